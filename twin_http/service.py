"""The running twin server: the real-time twin, its clock, the open streams and the Starlette app.

Token timing is :class:`domain.twin.realtime.RealtimeTwin`'s; every response carries
``x-servetune-simulated: twin`` (:class:`SimulatedHeader`); ``/metrics`` uses SGLang's names.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
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
from twin_http.protocol import WORDS, BadRequest, ParsedRequest, error_body, parse_request

# Tokens are released this long (wall s) before their engine time: the event loop's timer
# wakes up late by about 1 ms (epoll waits in whole milliseconds, rounded up), so releasing
# half of that early centres the emission error on zero (measured in
# tests/integration/test_twin_server.py).
EMIT_AHEAD_S = 0.0005
# how often a non-streamed request checks that its client is still connected (s)
DISCONNECT_POLL_S = 0.5

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
    prompt_tokens: int = 0  # the request's prompt, tokens (--record rows)


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
        st = _Stream(rid, req.max_tokens, recv=recv, prompt_tokens=n_in)
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
                                 "prompt_tokens": st.prompt_tokens,
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
        Linux; null when it did not happen), ``tokens`` sent, ``prompt_tokens`` (the prompt's
        length, tokens) and ``finished`` (no error).
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
    # the twin's gauge is the count since start (SGLang's: the last logging interval's)
    ("num_retracted_reqs", "gauge", "The number of retracted requests.",
     lambda x: x.retractions),
    ("num_retracted_requests", "counter", "Total number of retracted requests.",
     lambda x: x.retractions),
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


