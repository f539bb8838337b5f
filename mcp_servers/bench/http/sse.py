"""Reading one streamed completion: the SSE parser of the HTTP runner.

Per response: the arrival of each SSE chunk carrying text (s on the run clock), output tokens
from the final usage chunk, input tokens and cached prompt tokens
(``usage.prompt_tokens_details.cached_tokens``, SGLang with ``--enable-cache-report``) from usage
when present, whether ``data: [DONE]`` arrived, and malformed data or an ``error`` object in the
stream. Chunks that arrive in one socket read share a timestamp (a gap of 0).
"""

from __future__ import annotations

import json
import time
from typing import Any

from mcp_servers.bench.http.errors import ErrorClass, brief

try:  # orjson (a dependency of chromadb) parses SSE chunks ~3x faster than json
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - fallback
    _loads = json.loads


def _positive_int(x: object) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) and x > 0 else None


class SseStream:
    """Reads one SSE response: text-chunk times, usage, [DONE], errors.

    Feed it raw bytes as they arrive (:meth:`feed_bytes`); a chunk's time is the arrival of the
    socket read that completed its line.
    """

    __slots__ = ("t0", "times", "usage_in", "usage_out", "cached", "done", "_error", "_buf")

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.times: list[float] = []  # arrival of each chunk carrying text, s on the run clock
        self.usage_in: int | None = None
        self.usage_out: int | None = None
        self.cached: int | None = None
        self.done = False
        self._error: str | None = None
        self._buf = b""

    def failure(self, asked: int) -> tuple[str, ErrorClass] | None:
        """Why the stream failed and its class, or None for a complete stream."""
        if self._error is not None:
            return self._error, ErrorClass.STREAM
        if not self.done:
            return (f"stream closed before 'data: [DONE]' after {len(self.times)} text chunks",
                    ErrorClass.DISCONNECT)
        if not self.times:
            return "stream ended without any text chunk", ErrorClass.TRUNCATED
        if asked and self.usage_out is not None and self.usage_out < asked:
            return (f"truncated output: {self.usage_out} of {asked} tokens asked "
                    "(usage.completion_tokens)", ErrorClass.TRUNCATED)
        return None

    def feed_bytes(self, data: bytes) -> bool:
        """Take the bytes of one socket read; True when the stream is over."""
        t = time.perf_counter() - self.t0
        buf = self._buf + data
        lines = buf.split(b"\n")
        self._buf = lines.pop()
        for line in lines:
            if self.feed(line, t):
                return True
        return False

    def feed(self, line: bytes, t: float) -> bool:
        """Take one line that arrived at ``t``; True when the stream is over."""
        if not line.startswith(b"data:"):
            return False  # blank separators, ': keepalive' comments, 'event:' lines
        data = line[5:].strip()
        if not data:
            return False
        if data == b"[DONE]":
            self.done = True
            return True
        try:
            chunk = _loads(data)
        except ValueError:
            self._error = f"malformed SSE data: {brief(data.decode(errors='replace'))}"
            return True
        if not isinstance(chunk, dict):
            return False
        if chunk.get("error"):
            self._error = f"error in stream: {brief(str(chunk['error']))}"
            return True
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            piece = choice.get("text") or (delta.get("content") if isinstance(delta, dict)
                                           else None)
            if piece:
                self.times.append(t)
                break
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._usage(usage)
        return False

    def _usage(self, usage: dict[str, Any]) -> None:
        self.usage_out = _positive_int(usage.get("completion_tokens")) or self.usage_out
        self.usage_in = _positive_int(usage.get("prompt_tokens")) or self.usage_in
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            c = details.get("cached_tokens")
            if isinstance(c, int) and not isinstance(c, bool) and c >= 0:
                self.cached = c
