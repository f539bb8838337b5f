"""The OpenAI-compatible request side of the twin server: parsing, token counts, SGLang's errors.

A prompt is whitespace-separated words, one token each (see :mod:`twin_http`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Default max_tokens: SGLang's CompletionRequest.max_tokens (16, the OpenAI default) and, for
# chat requests without one, SamplingParams.max_new_tokens (128) (sglang 0.5.23
# entrypoints/openai/protocol.py, sampling/sampling_params.py).
DEFAULT_COMPLETION_TOKENS = 16
DEFAULT_CHAT_TOKENS = 128
# Output words: each a single BPE token with its leading space in the usual vocabularies.
WORDS = (" the", " of", " and", " to", " in", " is", " was", " for", " on", " that", " with",
         " as", " by", " at", " from", " his", " her", " are", " this", " be")


class BadRequest(ValueError):
    """A request SGLang would answer with HTTP 400; the message is SGLang's where it has one."""


def error_body(message: str, code: int = 400, err_type: str = "BadRequestError") -> dict[str, Any]:
    """SGLang's ``ErrorResponse`` (``entrypoints/openai/serving_base.py``)."""
    return {"object": "error", "message": message, "type": err_type, "param": None,
            "code": code}


def count_tokens(text: str) -> list[str]:
    """The prompt's tokens under the project's convention: its whitespace-separated words."""
    return text.split()


@dataclass
class ParsedRequest:
    """What the twin needs from a completion or chat request."""

    chat: bool
    tokens: list[str] | list[int]
    max_tokens: int
    stream: bool
    include_usage: bool


def _int_field(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequest(f"{name} must be an integer, got {value!r}")
        return value
    return None


def _chat_text(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    parts: list[str] = []
    for m in messages:
        if not isinstance(m, dict):
            raise BadRequest("each message must be an object with role and content")
        content = m.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [str(c.get("text", "")) for c in content
                      if isinstance(c, dict) and c.get("type") == "text"]
        elif content is not None:
            raise BadRequest("message content must be a string or a list of text parts")
    return " ".join(parts)


def parse_request(body: Any, chat: bool) -> ParsedRequest:
    """Validate an OpenAI completion (``chat`` False) or chat request body.

    Raises:
        BadRequest: malformed body, several prompts or choices, max_tokens < 1.
    """
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    tokens: list[str] | list[int]
    if chat:
        tokens = count_tokens(_chat_text(body.get("messages")))
        max_tokens = _int_field(body, "max_completion_tokens", "max_tokens")
        default = DEFAULT_CHAT_TOKENS
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            tokens = count_tokens(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            tokens = [int(t) for t in prompt]
        else:
            raise BadRequest("prompt must be a string or a list of token ids (the twin serves "
                             "one prompt per request)")
        max_tokens = _int_field(body, "max_tokens")
        default = DEFAULT_COMPLETION_TOKENS
    n = _int_field(body, "n")
    if n is not None and n != 1:
        raise BadRequest(f"n={n}: the twin generates one choice per request")
    if max_tokens is None:
        max_tokens = default
    if max_tokens < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}")
    opts = body.get("stream_options") or {}
    return ParsedRequest(chat=chat, tokens=tokens, max_tokens=max_tokens,
                         stream=bool(body.get("stream")),
                         include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")))


