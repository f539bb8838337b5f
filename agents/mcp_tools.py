"""Calling MCP tools from an agent: one helper that turns tool errors into exceptions."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import anyio
from mcp import Client

from domain.faults import MAX_ATTEMPTS, UNAVAILABLE

log = logging.getLogger("servetune.agents")
# tool errors retried because they said the service was temporarily unavailable, by tool
# (process-wide: a run reads the difference before and after, for its report)
TRANSIENT_RETRIES: Counter[str] = Counter()
RETRY_PAUSE_S = 0.02  # first pause before a retry; doubles each time


class ToolCallFailed(Exception):
    """An MCP tool answered with ``is_error``; the message is the server's text."""

    def __init__(self, tool: str, message: str) -> None:
        self.tool, self.message = tool, message
        super().__init__(f"{tool}: {message}")


async def call(client: Client, tool: str, args: dict[str, Any] | None = None) -> Any:
    """Call ``tool`` with ``args`` and return its structured result.

    Tools that return a list or a primitive are wrapped by MCP as ``{"result": ...}``; that
    wrapper is removed here.

    An error saying the service is temporarily unavailable (class LESSONS_UNAVAILABLE,
    :data:`domain.faults.RETRY`) is retried up to ``MAX_ATTEMPTS`` tries in all, after short
    pauses; nothing else is.

    Raises:
        ToolCallFailed: if the server reports an error.
    """
    for attempt in range(MAX_ATTEMPTS):
        r = await client.call_tool(tool, args or {})
        if not r.is_error:
            break
        text = " ".join(getattr(c, "text", "") for c in r.content)
        if UNAVAILABLE not in text or attempt + 1 == MAX_ATTEMPTS:
            raise ToolCallFailed(tool, text)
        TRANSIENT_RETRIES[tool] += 1
        log.warning("%s: %s; retrying", tool, text)
        await anyio.sleep(RETRY_PAUSE_S * 2**attempt)
    data = r.structured_content
    if isinstance(data, dict) and set(data) == {"result"}:
        return data["result"]
    return data
