"""Why a failed request of the HTTP runner failed: the error classes and their messages.

Error classes: HTTP status other than 200; timeout (no complete response within
``request_timeout_s`` of the send); connect (refused, unreachable); disconnect (the stream ended
or the connection dropped before ``data: [DONE]``); stream (malformed SSE data or an ``error``
object in the stream); truncated (fewer output tokens than asked, judged from the server's usage,
or no text chunk at all). A failure never stops the run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from enum import StrEnum

ERROR_CHARS = 300


class ErrorClass(StrEnum):
    """Why a request failed (see the module docstring)."""

    HTTP_STATUS = "http_status"
    TIMEOUT = "timeout"
    CONNECT = "connect"
    DISCONNECT = "disconnect"
    STREAM = "stream"
    TRUNCATED = "truncated"


def count_error_classes(classes: Sequence[str | None]) -> dict[str, int]:
    """Failed requests per error class (only classes that occurred).

    ``classes`` holds one entry per request: its error class, or None when it succeeded.
    """
    return dict(Counter(c for c in classes if c is not None))


def brief(text: str) -> str:
    """``text`` on one line, cut to :data:`ERROR_CHARS` characters."""
    text = " ".join(text.split())
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS] + "..."


def cause(e: BaseException) -> str:
    """The most specific text of an exception chain (e.g. '[Errno 111] Connect call failed')."""
    texts = []
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if str(cur):
            texts.append(str(cur))
        cur = cur.__cause__ or cur.__context__
    if not texts:
        return type(e).__name__
    return brief(texts[-1] if texts[-1] == texts[0] else f"{texts[0]} ({texts[-1]})")
