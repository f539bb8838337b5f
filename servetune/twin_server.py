"""``servetune twin serve``: the twin as an OpenAI-compatible HTTP server in (scaled) real time.

One process serves every replica of a ServingConfig behind one port (the config's router policy
spreads requests over them, as :mod:`domain.twin.cluster` does offline); the token timing is
the twin engine's, run against the wall clock by :class:`domain.twin.realtime.RealtimeTwin`:
virtual time = (wall - start) x ``speedup``, so with ``speedup`` 10 every TTFT and inter-token
gap is a tenth of the engine's.

Endpoints (what SGLang 0.5.23's HTTP server answers, ``entrypoints/http_server.py``):

- ``POST /v1/completions`` and ``POST /v1/chat/completions``: ``stream: true`` sends one SSE
  event ``data: {chunk}`` per token (``finish_reason: "length"`` on the last), then a usage chunk
  (``choices: []``) when ``stream_options.include_usage`` is set, then ``data: [DONE]``;
  ``stream: false`` answers one JSON body, always with ``usage``. Usage carries
  ``prompt_tokens_details.cached_tokens`` (SGLang's ``--enable-cache-report``).
- ``GET /v1/models`` (the checkpoint's model path, as SGLang names the served model),
  ``GET /health`` (200 once serving), ``GET /metrics`` (Prometheus text, SGLang's names; see
  :func:`metrics_text`).

Token counts: a prompt is whitespace-separated words, one token each (the project's convention,
shared with ``mcp_servers/bench/prompts.py`` and the test stub; at least 1, like a BOS token);
chat prompts are the words of every message's text. Output is exactly ``max_tokens`` tokens
(``ignore_eos`` semantics; defaults: 16 for completions, SGLang's ``CompletionRequest``, and 128
for chat, SGLang's ``SamplingParams.max_new_tokens``), each one common English word, so a
whitespace count of the text equals ``completion_tokens``. Requests SGLang refuses up front
(prompt over the context length, prompt + max_tokens over it, prompt over the KV pool's input
limit) get HTTP 400 with SGLang's ``ErrorResponse`` body and message; a request the engine drops
later (it never fits the KV pool) ends its stream with an error event, or a 400 body. A client
that disconnects aborts its request in the engine (its slot and KV are freed).

Every response carries the header ``x-servetune-simulated: twin``
(:data:`domain.quality.SIMULATED_HEADER`), which SGLang never sends: a client can tell the twin
from a real server, and the quality gate is not applicable to its outputs.

Startup: the twin's startup (:func:`domain.twin.startup.start`) prints the engine's log; a config
the engine refuses exits with the engine's code and error line (like a failed ``sglang serve``),
a servable one binds, prints ``The server is fired up and ready to roll!`` and (``--port-file``)
writes the bound port. Startup is immediate (the engine's load time is not waited out).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from domain.config import ServingConfig
from domain.fit import FitReport
from domain.models import get_model
from domain.quality import SIMULATED_HEADER
from domain.twin.realtime import RealtimeTwin, block_hashes
from domain.twin.startup import start

# Default max_tokens: SGLang's CompletionRequest.max_tokens (16, the OpenAI default) and, for
# chat requests without one, SamplingParams.max_new_tokens (128) (sglang 0.5.23
# entrypoints/openai/protocol.py, sampling/sampling_params.py).
DEFAULT_COMPLETION_TOKENS = 16
DEFAULT_CHAT_TOKENS = 128
# Output words: each a single BPE token with its leading space in the usual vocabularies.
WORDS = (" the", " of", " and", " to", " in", " is", " was", " for", " on", " that", " with",
         " as", " by", " at", " from", " his", " her", " are", " this", " be")
# Tokens are released this long (wall s) before their engine time: the event loop's timer
# wakes up late by about 1 ms (epoll waits in whole milliseconds, rounded up), so releasing
# half of that early centres the emission error on zero (measured in tests/test_twin_server.py).
EMIT_AHEAD_S = 0.0005
# how often a non-streamed request checks that its client is still connected (s)
DISCONNECT_POLL_S = 0.5
READY_LINE = "The server is fired up and ready to roll!"


SIMULATED_BY = "twin"  # the value of SIMULATED_HEADER on every response of this server


class SimulatedHeader:
    """ASGI middleware: ``x-servetune-simulated: twin`` on every HTTP response (404s included).

    Pure ASGI (it only edits the ``http.response.start`` message), so streamed responses and
    client-disconnect detection are untouched.
    """

    def __init__(self, app: ASGIApp) -> None:
        """Wrap ``app``."""
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve ``scope`` through the wrapped app, adding the header to its response start."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[SIMULATED_HEADER] = SIMULATED_BY
            await send(message)

        await self.app(scope, receive, send_marked)


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


@dataclass
class _Stream:
    rid: int
    output: int
    due: int = 0
    finished: bool = False
    error: str | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)
    # --record: server-side times, time.perf_counter() s (CLOCK_MONOTONIC on Linux)
    recv: float = math.nan  # the handler began (request line and headers read)
    first_due: float = math.nan  # the twin's time for the first token
    last_due: float = math.nan  # ... and for the last token released so far
    first_write: float = math.nan  # the first token's chunk handed to the server
    last_write: float = math.nan


class TwinService:
    """The running server: the real-time twin, its clock and the open streams.

    Args:
        config: the config served (all its replicas behind one port).
        report: its memory layout.
        speedup: virtual seconds per wall second (> 0).
        model_name: the served model's name (``/v1/models``; requests may name any model).
        record: keep each request's server-side timing for ``GET /twin/timing`` (the known
            TTFT/ITL a load generator's measurement is compared with).

    The clock is ``time.perf_counter`` (not the event loop's: uvloop's ``loop.time()`` has
    millisecond resolution).
    """

    def __init__(self, config: ServingConfig, report: FitReport, speedup: float = 1.0,
                 model_name: str | None = None, record: bool = False) -> None:
        if not speedup > 0 or math.isinf(speedup):
            raise ValueError(f"speedup must be a positive number, got {speedup}")
        self.config, self.speedup = config, speedup
        self.twin = RealtimeTwin(config, report)
        self.model = model_name or get_model(config.model).checkpoint(config.weights).model_path
        self._streams: dict[int, _Stream] = {}
        self._t0 = 0.0
        self._wake: asyncio.Event | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self.created = int(time.time())
        self.record = record
        self._timing: list[dict[str, float]] = []

    # ---------------------------------------------------------------- clock and driver
    def virtual_now(self) -> float:
        """Virtual seconds since the server started."""
        return (time.perf_counter() - self._t0) * self.speedup

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def start(self) -> None:
        """Start the clock and the driver task (in the serving event loop)."""
        import anyio

        # Starlette streams through an anyio task group; its backend module is imported on
        # first use (tens of ms), which would otherwise delay the first streamed response.
        async with anyio.create_task_group():
            pass
        self._t0 = time.perf_counter()
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._drive())

    async def stop(self) -> None:
        """Stop the driver task."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _drive(self) -> None:
        """Poll the twin at each wake-up and hand due tokens to their streams."""
        loop = asyncio.get_running_loop()
        wake = self._wake
        assert wake is not None
        ahead = EMIT_AHEAD_S * self.speedup
        while True:
            wake.clear()
            for u in self.twin.poll(self.virtual_now(), ahead):
                st = self._streams.get(u.rid)
                if st is None:
                    continue
                st.due, st.finished, st.error = u.due, u.finished, u.error
                if self.record and u.due:
                    if math.isnan(st.first_due):
                        st.first_due = self._t0 + u.first_s / self.speedup
                    st.last_due = self._t0 + u.last_s / self.speedup
                st.event.set()
            nxt = self.twin.next_wake(ahead)
            if math.isfinite(nxt):
                delay = self._t0 + nxt / self.speedup - time.perf_counter()
                if delay <= 0:
                    await asyncio.sleep(0)  # let handlers run between catch-up polls
                    continue
                self._timer = loop.call_later(delay, wake.set)
            await wake.wait()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def submit(self, req: ParsedRequest, arrival: float | None = None,
               recv: float = math.nan) -> _Stream:
        """Admit a parsed request, or raise BadRequest with SGLang's refusal.

        Args:
            req: the request.
            arrival: its virtual arrival time (when its HTTP request began), default now.
            recv: when its HTTP request began, ``time.perf_counter()`` s (for ``--record``).
        """
        n_in = max(1, len(req.tokens))
        refusal = self.twin.refusal(n_in, req.max_tokens)
        if refusal is not None:
            raise BadRequest(refusal)
        hashes = block_hashes(req.tokens, self.twin.block)
        v = self.virtual_now() if arrival is None else arrival
        rid = self.twin.submit(v, n_in, req.max_tokens, hashes)
        st = _Stream(rid, req.max_tokens, recv=recv)
        self._streams[rid] = st
        self._kick()
        return st

    def release(self, st: _Stream) -> None:
        """Forget a stream; abort its request in the engine if it is not finished."""
        self._streams.pop(st.rid, None)
        if self.record:
            self._timing.append({"recv": st.recv, "first_due": st.first_due,
                                 "last_due": st.last_due, "first": st.first_write,
                                 "last": st.last_write, "tokens": st.due,
                                 "finished": st.finished and st.error is None})
        if not st.finished:
            self.twin.abort(st.rid)
            self._kick()

    # ---------------------------------------------------------------- responses
    def usage(self, st: _Stream, n_in: int) -> dict[str, Any]:
        """The OpenAI usage block of a finished request."""
        return {"prompt_tokens": n_in, "completion_tokens": st.due,
                "total_tokens": n_in + st.due,
                "prompt_tokens_details": {"cached_tokens": self.twin.cached_tokens(st.rid)}}

    async def stream_events(self, st: _Stream, req: ParsedRequest, n_in: int
                            ) -> AsyncIterator[bytes]:
        """SSE events of one streamed request: a chunk per token, usage, ``[DONE]``."""
        cid = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = json.dumps({"id": cid, "object": "chat.completion.chunk" if req.chat
                           else "text_completion", "created": self.created,
                           "model": self.model}, separators=(",", ":"))[:-1]
        if req.chat:
            first = head + ',"choices":[{"index":0,"delta":{"role":"assistant","content":"'
            pre = head + ',"choices":[{"index":0,"delta":{"content":"'
            post = '"},"logprobs":null,"finish_reason":'
        else:
            first = pre = head + ',"choices":[{"index":0,"text":"'
            post = '","logprobs":null,"finish_reason":'
        tail = ',"matched_stop":null}]}\n\n'
        sent = 0
        try:
            while True:
                await st.event.wait()
                st.event.clear()
                parts = []
                while sent < st.due:
                    last = sent + 1 == st.output
                    parts.append("data: " + (first if sent == 0 else pre)
                                 + WORDS[sent % len(WORDS)] + post
                                 + ('"length"' if last else "null") + tail)
                    sent += 1
                if st.error is not None:
                    parts.append("data: " + json.dumps(
                        {"error": error_body(st.error)}) + "\n\n")
                if st.finished:
                    if req.include_usage and st.error is None:
                        parts.append("data: " + head + ',"choices":[],"usage":'
                                     + json.dumps(self.usage(st, n_in)) + "}\n\n")
                    parts.append("data: [DONE]\n\n")
                if parts:
                    if self.record and sent:
                        st.last_write = time.perf_counter()
                        if math.isnan(st.first_write):
                            st.first_write = st.last_write
                    yield "".join(parts).encode()
                if st.finished:
                    return
        finally:
            self.release(st)

    async def complete(self, st: _Stream, req: ParsedRequest, n_in: int,
                       request: Request | None = None) -> Response:
        """The non-streamed response of one request, once its last token is due.

        While it waits, the connection is checked every :data:`DISCONNECT_POLL_S` seconds: a
        client that went away aborts the request (``release`` frees its slot and KV), as a
        streamed one is aborted when its write fails.
        """
        loop = asyncio.get_running_loop()
        check_at = loop.time() + DISCONNECT_POLL_S
        try:
            while not st.finished:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(st.event.wait(), DISCONNECT_POLL_S)
                st.event.clear()
                if request is not None and loop.time() >= check_at:
                    if await request.is_disconnected():
                        return Response(status_code=499)  # nginx's "client closed request"
                    check_at = loop.time() + DISCONNECT_POLL_S
        finally:
            self.release(st)
        if st.error is not None:
            return JSONResponse(error_body(st.error), status_code=400)
        text = "".join(WORDS[i % len(WORDS)] for i in range(st.due))
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text},
             "logprobs": None, "finish_reason": "length", "matched_stop": None} if req.chat
            else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                  "matched_stop": None})
        return JSONResponse({
            "id": f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if req.chat else "text_completion",
            "created": self.created, "model": self.model, "choices": [choice],
            "usage": self.usage(st, n_in)})

    # ---------------------------------------------------------------- routes
    def generate_route(self, chat: bool) -> Callable[[Request], Any]:
        """The handler of ``/v1/chat/completions`` (``chat``) or ``/v1/completions``."""
        async def handle(request: Request) -> Response:
            recv = time.perf_counter()  # the request line and headers are in
            arrival = (recv - self._t0) * self.speedup
            try:
                try:
                    body = json.loads(await request.body())
                except ValueError as e:
                    raise BadRequest(f"the request body is not JSON: {e}") from e
                req = parse_request(body, chat)
                st = self.submit(req, arrival, recv)
            except BadRequest as e:
                return JSONResponse(error_body(str(e)), status_code=400)
            n_in = max(1, len(req.tokens))
            if req.stream:
                return StreamingResponse(self.stream_events(st, req, n_in),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            return await self.complete(st, req, n_in, request)
        return handle

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: the served model."""
        return JSONResponse({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": self.created, "owned_by": "sglang",
            "root": self.model, "max_model_len": self.twin.limits.context_len}]})

    async def health(self, request: Request) -> Response:
        """``GET /health``: 200 while serving (SGLang answers an empty 200)."""
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        """``GET /metrics``: Prometheus text (see :func:`metrics_text`)."""
        return Response(metrics_text(self.twin, self.model),
                         media_type="text/plain; version=0.0.4; charset=utf-8")

    async def timing(self, request: Request) -> Response:
        """``GET /twin/timing`` (``--record`` only): the requests finished since the last call.

        Each: ``recv`` (the handler began), ``first_due``/``last_due`` (the twin's times of the
        first and last token), ``first``/``last`` (their chunks handed to the server), all
        ``time.perf_counter()`` seconds (CLOCK_MONOTONIC, comparable across processes on
        Linux; null when it did not happen), ``tokens`` sent and ``finished`` (no error).
        The list is cleared by the call.
        """
        rows, self._timing = self._timing, []
        return JSONResponse({"requests": [
            {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
            for r in rows]})

    def app(self, on_ready: Callable[[], None] | None = None) -> Starlette:
        """The ASGI app; ``on_ready`` runs once the driver started (before serving)."""
        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            await self.start()
            if on_ready is not None:
                on_ready()
            try:
                yield
            finally:
                await self.stop()

        return Starlette(routes=[
            Route("/v1/completions", self.generate_route(False), methods=["POST"]),
            Route("/v1/chat/completions", self.generate_route(True), methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            *([Route("/twin/timing", self.timing, methods=["GET"])] if self.record else []),
        ], middleware=[Middleware(SimulatedHeader)], lifespan=lifespan)


# (name, type, help, value of a ReplicaLoad) in SGLang's names and help texts
# (sglang 0.5.23 observability/metrics_collector.py); counters get the ``_total`` suffix.
_METRICS: tuple[tuple[str, str, str, Callable[[Any], float]], ...] = (
    ("num_running_reqs", "gauge", "The number of running requests.",
     lambda x: x.engine.running),
    ("num_queue_reqs", "gauge", "The number of requests in the waiting queue.",
     lambda x: x.engine.queued),
    ("num_used_tokens", "gauge", "The number of used tokens.",
     lambda x: x.engine.used_kv_tokens),
    ("token_usage", "gauge", "The token usage.",
     lambda x: x.engine.used_kv_tokens / x.engine.kv_tokens),
    ("cache_hit_rate", "gauge", "The prefix cache hit rate.", lambda x: x.cache_hit_rate),
    ("max_total_num_tokens", "gauge", "Maximum total number of tokens in the KV cache pool.",
     lambda x: x.engine.kv_tokens),
    ("context_len", "gauge", "Maximum context length.", lambda x: x.context_len),
    ("prompt_tokens", "counter", "Number of prefill tokens processed.",
     lambda x: x.prompt_tokens),
    ("generation_tokens", "counter", "Number of generation tokens processed.",
     lambda x: x.generation_tokens),
    ("cached_tokens", "counter", "Number of cached prompt tokens.",
     lambda x: x.cached_tokens),
    ("num_requests", "counter", "The number of requests.", lambda x: x.requests),
)


def metrics_text(twin: RealtimeTwin, model: str) -> str:
    """Prometheus exposition of every replica's scheduler state, in SGLang's metric names.

    One series per replica, labelled as SGLang labels its scheduler metrics
    (``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``) plus ``dp_rank`` = the replica
    when there are several (sum them for the whole server). Differences from SGLang: the gauges
    are the engine's state at the end of its latest simulated iteration (SGLang refreshes them
    every 40 decode steps); ``num_running_reqs`` counts a request mid chunked prefill too; and
    ``cache_hit_rate`` is cached / admitted prompt tokens since start (SGLang's is the last
    prefill batch's) -- ``sglang:cached_tokens_total`` / ``sglang:prompt_tokens_total``.
    """
    loads = twin.loads()
    labels = [f'model_name="{model}",engine_type="unified",tp_rank="0",pp_rank="0"'
              + (f',dp_rank="{i}"' if len(loads) > 1 else "") for i in range(len(loads))]
    lines: list[str] = []
    for name, kind, doc, value in _METRICS:
        full = f"sglang:{name}"
        lines += [f"# HELP {full} {doc}", f"# TYPE {full} {kind}"]
        sample = full + ("_total" if kind == "counter" else "")
        lines += [f"{sample}{{{lab}}} {float(value(x))!r}"
                  for lab, x in zip(labels, loads, strict=True)]
    return "\n".join(lines) + "\n"


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _write_port(path: Path, port: int) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n", encoding="utf-8")
    tmp.replace(path)


def serve(config: ServingConfig, host: str = "127.0.0.1", port: int = 0,
          port_file: Path | None = None, speedup: float = 1.0, record: bool = False) -> int:
    """Start the twin of ``config`` and serve it until SIGINT/SIGTERM; returns the exit code.

    Prints the twin startup's log (the engine's lines) to stdout. A config the engine refuses
    returns the engine's exit code after its error line, without binding.

    Raises:
        OSError: the address cannot be bound.
        ValueError: a non-positive speedup.
    """
    import uvicorn

    boot = start(config)
    lines = [x for x in boot.log if x != READY_LINE]
    for line in lines:
        print(line, flush=True)
    if not boot.ready or boot.fit is None:
        return boot.exit_code or 1
    service = TwinService(config, boot.fit, speedup, record=record)
    sock = bind(host, port)
    bound = sock.getsockname()[1]

    def ready() -> None:
        if port_file is not None:
            _write_port(port_file, bound)
        shown = f"[{host}]" if ":" in host else host
        print(f"twin: {config.replicas} replica(s) of config {config.config_id()} at "
              f"http://{shown}:{bound}, speedup {speedup:g}x", flush=True)
        print(READY_LINE, flush=True)

    server = uvicorn.Server(uvicorn.Config(
        service.app(ready), log_level="warning", access_log=False,
        timeout_graceful_shutdown=1, lifespan="on"))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1
