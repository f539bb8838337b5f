"""What every servetune MCP server shares: errors the model can read, strict tool arguments.

One way to report anticipated failures to the model, and a server class that refuses tool
arguments the tool does not declare.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult

from domain.errors import ServetuneError


@contextlib.contextmanager
def as_tool_errors(*extra: type[Exception]) -> Iterator[None]:
    """Re-raise servetune errors (and ``extra`` types) as ToolError.

    MCP hides the text of unexpected exceptions from the client; a ToolError's message reaches
    the model, which needs it to fix its arguments.
    """
    try:
        yield
    except (ServetuneError, *extra) as e:
        raise ToolError(str(e)) from e


class StrictMCPServer(MCPServer):
    """An :class:`MCPServer` whose tools refuse arguments they do not declare.

    The SDK's argument models ignore unknown keys, so an invented argument (``namespace``,
    ``force``, a misspelt ``max_line``) would be dropped silently and the call would do
    something other than what the model asked. Here it is an error naming the valid arguments.
    """

    async def call_tool(self, name: str, arguments: dict[str, Any],
                        context: Context[Any, Any] | None = None) -> Any:
        """Call ``name`` after checking ``arguments`` against its declared parameters.

        Raises:
            ToolError: an argument the tool does not declare (or an unknown tool, from the SDK).
        """
        schema = self._tool_input_schema(name)
        if schema is not None:
            known = set(schema.get("properties", {}))
            unknown = sorted(set(arguments) - known)
            if unknown:
                names = ", ".join(map(repr, unknown))
                raise ToolError(f"Error executing tool {name}: {name} has no argument {names}; "
                                f"its arguments are: {', '.join(sorted(known)) or 'none'}")
        result: CallToolResult | Any = await super().call_tool(name, arguments, context)
        return result
