"""A scripted Messages API for tests: recorded responses over httpx2.MockTransport (no socket)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import anthropic
import httpx2


class Scripted:
    """A Messages API that answers with recorded responses and keeps every request body."""

    def __init__(self, responses: list[dict[str, Any]]) -> None:
        self.responses = list(responses)
        self.requests: list[dict[str, Any]] = []

    def handler(self, request: httpx2.Request) -> httpx2.Response:
        assert request.url.path == "/v1/messages", request.url
        self.requests.append(json.loads(request.content))
        if not self.responses:
            return httpx2.Response(500, json={"type": "error", "error": {
                "type": "api_error", "message": "script exhausted"}})
        return httpx2.Response(200, json=self.responses.pop(0))

    def client(self) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(
            api_key="test", base_url="http://anthropic.invalid", max_retries=0,
            http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(self.handler)))

    def tool_results(self, i: int) -> list[dict[str, Any]]:
        """The tool_result blocks of request ``i``'s last (user) message."""
        last = self.requests[i]["messages"][-1]
        assert last["role"] == "user"
        return [b for b in last["content"] if b["type"] == "tool_result"]


_ids = itertools.count(1)


def tool_use(name: str, /, **args: Any) -> dict[str, Any]:
    """A tool_use block with a fresh id."""
    return {"type": "tool_use", "id": f"toolu_{next(_ids):03d}", "name": name, "input": args}


def text(t: str) -> dict[str, Any]:
    """A text block."""
    return {"type": "text", "text": t}


def msg(*blocks: dict[str, Any], stop: str = "tool_use", tokens: tuple[int, int] = (100, 10)
        ) -> dict[str, Any]:
    """An assistant message as the Messages API returns it."""
    return {"id": "msg_x", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
            "content": list(blocks), "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": tokens[0], "output_tokens": tokens[1]}}
