"""Calling MCP tools from an agent: one helper that turns tool errors into exceptions."""

from __future__ import annotations

from typing import Any

from mcp import Client


class ToolCallFailed(Exception):
    """An MCP tool answered with ``is_error``; the message is the server's text."""

    def __init__(self, tool: str, message: str) -> None:
        self.tool, self.message = tool, message
        super().__init__(f"{tool}: {message}")


async def call(client: Client, tool: str, args: dict[str, Any] | None = None) -> Any:
    """Call ``tool`` with ``args`` and return its structured result.

    Tools that return a list or a primitive are wrapped by MCP as ``{"result": ...}``; that
    wrapper is removed here.

    Raises:
        ToolCallFailed: if the server reports an error.
    """
    r = await client.call_tool(tool, args or {})
    if r.is_error:
        text = " ".join(getattr(c, "text", "") for c in r.content)
        raise ToolCallFailed(tool, text)
    data = r.structured_content
    if isinstance(data, dict) and set(data) == {"result"}:
        return data["result"]
    return data
