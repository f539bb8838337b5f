"""The HTTP runner: real-time load over HTTP against OpenAI-compatible servers (SGLang, vLLM, stub).

A lean asyncio runner: one event loop, one client session per run
(:mod:`~mcp_servers.bench.http.clients`: aiohttp by default, httpx on request), request bodies
built before the clock starts. Dispatch modes:

- closed loop (:meth:`HttpRunner.closed_loop`): ``concurrency`` clients each send a request as
  soon as their previous one finished, until ``duration_s`` of wall time; in-flight requests are
  then drained (fixed concurrency).
- open loop (:meth:`HttpRunner.open_loop`): every request is sent at its scheduled time on the
  run's clock, whatever is still in flight: a trace's (scaled) arrival times, or a fixed request
  rate from :func:`~mcp_servers.bench.http.schedule.arrival_schedule` (constant or Poisson,
  seeded).

Per request a :class:`~domain.metrics.RequestRecord` on the run's clock (seconds since start):
``arrival_s`` = scheduled send time, ``first_token_s`` = arrival of the first SSE chunk carrying
text, ``itl_s`` = every gap between text chunks, ``finish_s`` = last text chunk; output tokens
from the final usage chunk (counted text chunks when the server sends none); input tokens and
cached prompt tokens from usage when present (:mod:`~mcp_servers.bench.http.sse`). Alongside,
per request: the actual send time (so dispatch lag = send - scheduled) and, for a failed request,
its :class:`~mcp_servers.bench.http.errors.ErrorClass`. A failure never stops the run. The event
loop is the caller's; the bench MCP server's entry point runs on uvloop.

Fidelity limits: one process, so the client's CPU (about 1 ms per 64-token request, most of it
reading and parsing chunks) bounds the clean request rate; chunks that arrive in one socket read
share a timestamp (a gap of 0); the loop's timer resolution (1 ms under uvloop) bounds dispatch
precision; TTFT counts from the *scheduled* send, so dispatch lag is part of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import resource
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from domain.metrics import RequestRecord
from mcp_servers.bench.http.clients import (
    CLIENTS,
    DEFAULT_CLIENT,
    AiohttpClient,
    Client,
    ClientKind,
    HttpxClient,
)
from mcp_servers.bench.http.errors import ErrorClass, count_error_classes
from mcp_servers.bench.http.schedule import PlannedRequest
from mcp_servers.bench.http.sse import SseStream

MAX_CONCURRENCY = 4096


@dataclass(slots=True)
class Snapshot:
    """Where a run stands, for progress reports."""

    elapsed_s: float
    done: int
    errors: int
    in_flight: int
    total: int | None  # open loop: requests planned; closed loop: None
    duration_s: float | None  # closed loop: seconds of new load; open loop: None


TickFn = Callable[[Snapshot], Awaitable[None]]


@dataclass
class HttpRun:
    """The records of a run (in send order) and how the client kept its schedule.

    Attributes:
        records: one per request, in send order (times in s on the run clock).
        sent_s: actual send time of each record, s on the run clock.
        wall_s: wall seconds of the whole run including the drain.
        stopped_early: why a closed loop stopped sending before its duration, if it did.
        error_class: the :class:`ErrorClass` value of each failed record, None when it succeeded.
        cached_tokens: prompt tokens the server reported as served from its prefix cache, per
            record; -1 where the server reported none.
        t0_mono: ``time.perf_counter()`` at the run's start (CLOCK_MONOTONIC on Linux, so
            comparable with another local process's timestamps).
        client: the HTTP client library that ran it.
    """

    records: list[RequestRecord]
    sent_s: np.ndarray
    wall_s: float
    stopped_early: str | None = None
    error_class: list[str | None] = field(default_factory=list)
    cached_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    t0_mono: float = 0.0
    client: str = DEFAULT_CLIENT

    def __repr__(self) -> str:  # not every record: asyncio.run reprs its main task's result
        return (f"HttpRun({len(self.records)} records, {self.wall_s:.1f} s, client "
                f"{self.client}, errors {self.error_counts()})")

    def error_counts(self) -> dict[str, int]:
        """Failed requests per error class (only classes that occurred)."""
        return count_error_classes(self.error_class)


@dataclass(slots=True)
class _Done:
    record: RequestRecord
    sent: float
    error_class: str | None
    cached: int


@dataclass
class _State:
    total: int | None
    duration_s: float | None
    t0: float = 0.0
    issued: int = 0
    done: int = 0
    errors: int = 0
    ok: int = 0
    stop: str | None = None
    records: dict[int, _Done] = field(default_factory=dict)

    def snapshot(self) -> Snapshot:
        return Snapshot(elapsed_s=time.perf_counter() - self.t0, done=self.done,
                        errors=self.errors, in_flight=self.issued - self.done,
                        total=self.total, duration_s=self.duration_s)


def _raise_open_files_limit(needed: int) -> None:
    """Raise the soft limit on open files towards ``needed`` (one socket per connection)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """Keep the objects alive before a run out of garbage collection during it.

    A full collection over a large heap stalls the event loop. Measured against the stub at
    100 req/s with 2 M objects alive before the run: dispatch lag p99 310-340 ms and requests
    lost without this, p99 2-6 ms with it (no difference in a small process).
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class HttpRunner:
    """Streams completions to ``base_urls`` (round-robin by request index).

    Args:
        base_urls: server roots such as ``http://127.0.0.1:30000`` (no trailing ``/v1``).
        request_timeout_s: a request not finished this long after it was sent fails.
        connect_timeout_s: TCP connect limit per request.
        tick_s: interval of progress callbacks (at most one per ``tick_s``).
        abort_after_failures: a closed loop stops sending new requests when this many requests
            failed before any succeeded (a dead endpoint is not hammered for the whole run).
        client: HTTP client library, ``aiohttp`` (default, lower overhead) or ``httpx``.
    """

    def __init__(self, base_urls: Sequence[str], *, request_timeout_s: float = 600.0,
                 connect_timeout_s: float = 10.0, tick_s: float = 0.5,
                 abort_after_failures: int = 32, client: ClientKind = DEFAULT_CLIENT) -> None:
        if not base_urls:
            raise ValueError("HttpRunner needs at least one base URL")
        if client not in CLIENTS:
            raise ValueError(f"unknown HTTP client {client!r}; use one of {CLIENTS}")
        self.urls = [u.rstrip("/") + "/v1/completions" for u in base_urls]
        self.base_urls = [u.rstrip("/") for u in base_urls]
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.tick_s = tick_s
        self.abort_after_failures = abort_after_failures
        self.client = client

    def _client(self, connections: int) -> Client:
        n = max(1, min(connections, MAX_CONCURRENCY))
        _raise_open_files_limit(n)
        if self.client == "httpx":
            return HttpxClient(n, self.connect_timeout_s, self.request_timeout_s)
        return AiohttpClient(n, self.connect_timeout_s)

    async def _one(self, client: Client, st: _State, index: int, sched_s: float,
                   body: bytes, n_in: int, n_out: int) -> None:
        url = self.urls[index % len(self.urls)]
        sent = time.perf_counter() - st.t0
        acc = SseStream(st.t0)
        failed: tuple[str, ErrorClass] | None
        try:
            async with asyncio.timeout(self.request_timeout_s):
                failed = await client.post(url, body, acc)
        except TimeoutError:
            failed = (f"no complete response from {url} within {self.request_timeout_s:g} s "
                      f"(after {len(acc.times)} text chunks)", ErrorClass.TIMEOUT)
        if failed is None:
            failed = acc.failure(n_out)
            if failed is not None:
                failed = (f"{failed[0]} (from {url})", failed[1])
        times = acc.times
        if acc.usage_in is not None:
            n_in = acc.usage_in
        if failed is None:
            rec = RequestRecord(arrival_s=sched_s, input_tokens=n_in,
                                output_tokens=acc.usage_out or len(times),
                                first_token_s=times[0], finish_s=times[-1],
                                itl_s=np.diff(np.asarray(times)))
            st.ok += 1
        else:
            rec = RequestRecord(arrival_s=sched_s, input_tokens=n_in,
                                output_tokens=acc.usage_out or len(times),
                                first_token_s=times[0] if times else math.nan, error=failed[0])
            st.errors += 1
        st.done += 1
        st.records[index] = _Done(rec, sent, None if failed is None else failed[1].value,
                                  -1 if acc.cached is None else acc.cached)

    async def _ticker(self, st: _State, on_tick: TickFn | None) -> None:
        if on_tick is None:
            return
        while True:
            await asyncio.sleep(self.tick_s)
            await on_tick(st.snapshot())

    def _result(self, st: _State) -> HttpRun:
        done = [st.records[i] for i in sorted(st.records)]
        return HttpRun(records=[d.record for d in done],
                       sent_s=np.array([d.sent for d in done], dtype=float),
                       wall_s=time.perf_counter() - st.t0, stopped_early=st.stop,
                       error_class=[d.error_class for d in done],
                       cached_tokens=np.array([d.cached for d in done], dtype=np.int64),
                       t0_mono=st.t0, client=self.client)

    @contextlib.asynccontextmanager
    async def _running(self, st: _State, connections: int,
                       on_tick: TickFn | None) -> AsyncIterator[Client]:
        with _frozen_heap():
            async with self._client(connections) as client:
                st.t0 = time.perf_counter()
                ticker = asyncio.create_task(self._ticker(st, on_tick))
                try:
                    yield client
                finally:
                    ticker.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await ticker

    async def closed_loop(self, body_of: Callable[[int], bytes], isl: int,
                          concurrency: int, duration_s: float, max_requests: int,
                          on_tick: TickFn | None = None, osl: int = 0) -> HttpRun:
        """``concurrency`` clients in a loop for ``duration_s`` wall seconds, then drain.

        Args:
            body_of: request index -> JSON body (cheap: prompts are pre-built templates).
            isl: input tokens per request (for the record when the server reports no usage).
            concurrency: clients in flight, 1..4096.
            duration_s: wall seconds during which new requests are sent.
            max_requests: stop sending after this many requests in all.
            on_tick: called every ``tick_s`` with a :class:`Snapshot`.
            osl: output tokens each body asks for (fewer in the usage = truncated); 0 = unknown.
        """
        st = _State(total=None, duration_s=duration_s)

        async def client_loop(client: Client) -> None:
            while st.stop is None:
                now = time.perf_counter() - st.t0
                if now >= duration_s or st.issued >= max_requests:
                    return
                i = st.issued
                st.issued += 1
                await self._one(client, st, i, now, body_of(i), isl, osl)
                if st.ok == 0 and st.errors >= self.abort_after_failures and st.stop is None:
                    st.stop = (f"stopped sending after the first {st.errors} requests all "
                               "failed")

        async with self._running(st, concurrency, on_tick) as client:
            async with asyncio.TaskGroup() as tg:
                for _ in range(concurrency):
                    tg.create_task(client_loop(client))
        return self._result(st)

    async def open_loop(self, plan: Sequence[PlannedRequest],
                        on_tick: TickFn | None = None) -> HttpRun:
        """Send every request of ``plan`` (sorted by ``arrival_s``) at its scheduled time.

        The schedule is absolute (``arrival_s`` seconds after the run starts), so a late send
        does not delay the following ones.
        """
        st = _State(total=len(plan), duration_s=None)
        async with self._running(st, len(plan), on_tick) as client:
            async with asyncio.TaskGroup() as tg:
                for i, p in enumerate(plan):
                    delay = p.arrival_s - (time.perf_counter() - st.t0)
                    if delay > 0:
                        await asyncio.sleep(delay)
                    st.issued += 1
                    tg.create_task(self._one(client, st, i, p.arrival_s, p.body,
                                             p.input_tokens, p.output_tokens))
        return self._result(st)
