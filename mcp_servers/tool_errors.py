"""One way for every servetune MCP server to report an anticipated failure to the model."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mcp.server.mcpserver.exceptions import ToolError

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
