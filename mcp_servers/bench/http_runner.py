"""Real-time load over HTTP against OpenAI-compatible servers (SGLang, vLLM, the test stub).

A lean asyncio runner: one event loop, one client session per run (aiohttp by default, httpx on
request; connection limit at least the run's concurrency, no proxies from the environment),
request bodies built before the clock starts, each request a streaming
``POST {base}/v1/completions``. Dispatch modes:

- closed loop (:meth:`HttpRunner.closed_loop`): ``concurrency`` clients each send a request as
  soon as their previous one finished, until ``duration_s`` of wall time; in-flight requests are
  then drained (fixed concurrency).
- open loop (:meth:`HttpRunner.open_loop`): every request is sent at its scheduled time on the
  run's clock, whatever is still in flight: a trace's (scaled) arrival times, or a fixed request
  rate from :func:`arrival_schedule` (constant or Poisson, seeded).

Per request a :class:`~domain.metrics.RequestRecord` on the run's clock (seconds since start):
``arrival_s`` = scheduled send time, ``first_token_s`` = arrival of the first SSE chunk carrying
text, ``itl_s`` = every gap between text chunks, ``finish_s`` = last text chunk; output tokens
from the final usage chunk (counted text chunks when the server sends none); input tokens and
cached prompt tokens (``usage.prompt_tokens_details.cached_tokens``, SGLang with
``--enable-cache-report``) from usage when present. Alongside, per request: the actual send time
(so dispatch lag = send - scheduled) and, for a failed request, its :class:`ErrorClass`. A failure
never stops the run. Error classes: HTTP status other than 200; timeout (no complete response
within ``request_timeout_s`` of the send); connect (refused, unreachable); disconnect (the stream
ended or the connection dropped before ``data: [DONE]``); stream (malformed SSE data or an
``error`` object in the stream); truncated (fewer output tokens than asked, judged from the
server's usage, or no text chunk at all).

Client choice, measured by ``benchmarks/loadgen_fidelity.py`` (2 shared cores, the test stub
on the same machine with TTFT 50 ms / ITL 10 ms, ISL 256 / OSL 64, constant rate; one run, load
average ~1): at 50 req/s the client's own overhead (client TTFT - the stub's own TTFT) was
1.96 ms for aiohttp on uvloop, 2.67 ms for aiohttp on asyncio, 6.91 ms for httpx on asyncio (the
earlier runner) and 1.70 ms for a raw-socket floor; dispatch lag p99 3.56 / 3.89 / 7.87 ms. The
highest rate with at most 5 ms of overhead was 300 req/s for aiohttp (either loop; the stub
itself fell behind at 400), 25-50 req/s for httpx, 50 req/s for aiperf 0.13.0. httpx's cost is
its connection pool (httpcore scans every connection on each request: ~10x aiohttp's CPU per
request in a profile at 100 req/s). So aiohttp is the default; ``client="httpx"`` stays for
comparison. The event loop is the caller's; the bench MCP server's entry point runs on uvloop.

Fidelity limits: one process, so the client's CPU (about 1 ms per 64-token request, most of it
reading and parsing chunks) bounds the clean request rate; chunks that arrive in one socket read
share a timestamp (a gap of 0); the loop's timer resolution (1 ms under uvloop) bounds dispatch
precision; TTFT counts from the *scheduled* send, so dispatch lag is part of it.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import gc
import json
import math
import re
import resource
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

import aiohttp
import httpx
import numpy as np

from domain.engines import engine
from domain.metrics import RequestRecord
from domain.quality import SIMULATED_HEADER

try:  # orjson (a dependency of chromadb) parses SSE chunks ~3x faster than json
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - fallback
    _loads = json.loads

HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}
MAX_CONCURRENCY = 4096
ERROR_CHARS = 300
ClientKind = Literal["aiohttp", "httpx"]
CLIENTS: tuple[ClientKind, ...] = ("aiohttp", "httpx")
DEFAULT_CLIENT: ClientKind = "aiohttp"
DRAIN_S = 1.0  # after 'data: [DONE]', wait at most this long for the end of the body


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


@dataclass(slots=True)
class PlannedRequest:
    """One request of an open-loop run; ``body`` is the complete JSON request.

    ``output_tokens`` is what the body asks for: a server that reports fewer in its usage
    produced a truncated output (an error). 0 = unknown, not checked.
    """

    arrival_s: float
    body: bytes
    input_tokens: int
    output_tokens: int


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


def arrival_schedule(rate: float, *, duration_s: float | None = None, count: int | None = None,
                     process: Literal["constant", "poisson"] = "poisson",
                     seed: int = 0) -> np.ndarray:
    """Send times (s from the run start) of a fixed request rate, first request at 0.

    Args:
        rate: mean requests per second (> 0).
        duration_s: keep the requests scheduled before this many seconds.
        count: or: exactly this many requests (one of the two is required; both: the first
            limit reached).
        process: ``constant`` (one request every ``1/rate`` s) or ``poisson`` (exponential gaps
            with mean ``1/rate``, seeded: the same seed gives the same schedule).
        seed: seed of the Poisson gaps.

    Raises:
        ValueError: a non-positive rate, or neither ``duration_s`` nor ``count`` given.
    """
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a finite number > 0, got {rate}")
    if duration_s is None and count is None:
        raise ValueError("give duration_s or count")
    n = count if count is not None else 0
    if duration_s is not None:
        expect = rate * duration_s
        n_dur = int(expect + 6 * math.sqrt(expect) + 16) if process == "poisson" else \
            math.ceil(expect)
        n = n_dur if count is None else min(count, n_dur)
    if process == "constant":
        t = np.arange(n, dtype=float) / rate
    elif process == "poisson":
        gaps = np.random.default_rng([seed, 0x5E7]).exponential(1.0 / rate, n)
        t = np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if n else np.zeros(0)
    else:
        raise ValueError(f"unknown arrival process {process!r}; use 'constant' or 'poisson'")
    return t[t < duration_s] if duration_s is not None else t


def _brief(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS] + "..."


def _cause(e: BaseException) -> str:
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
    return _brief(texts[-1] if texts[-1] == texts[0] else f"{texts[0]} ({texts[-1]})")


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


async def fetch_model_id(base_url: str, timeout_s: float = 5.0,
                         simulated: dict[str, str] | None = None) -> str | None:
    """The first model id ``GET {base_url}/v1/models`` lists, or None if it cannot be read.

    Args:
        base_url: the server.
        timeout_s: timeout of the request, s.
        simulated: when given, ``base_url`` -> the value of the server's
            ``x-servetune-simulated`` header (:data:`domain.quality.SIMULATED_HEADER`) is
            recorded in it if the server sends one (the twin server does; SGLang never).
    """
    try:
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
            r = await client.get(base_url + "/v1/models")
            if simulated is not None and r.headers.get(SIMULATED_HEADER):
                simulated[base_url] = r.headers[SIMULATED_HEADER][:64]
            r.raise_for_status()
            data = r.json().get("data") or []
            return str(data[0]["id"]) if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


_PROMPT, _CACHED = (engine().metrics[k] for k in ("prompt_tokens", "cached_tokens"))
_SAMPLE = re.compile(rf"^({re.escape(_PROMPT)}|{re.escape(_CACHED)})(?:\{{[^}}]*\}})?\s+(\S+)",
                     re.M)


async def fetch_cache_counters(base_urls: Sequence[str],
                               timeout_s: float = 5.0) -> tuple[float, float] | None:
    """``(prompt tokens, cached prompt tokens)`` summed over the servers' ``/metrics``.

    Reads SGLang's counters ``sglang:prompt_tokens_total`` and ``sglang:cached_tokens_total``
    (every label set, e.g. ``cache_source`` device/host/storage, summed; SGLang
    ``srt/metrics/collector.py``). None when a server has no such counters or cannot be read; the
    difference of two readings around a run gives the run's prefix-cache hit rate.
    """
    prompt = cached = 0.0
    try:
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
            for url in dict.fromkeys(base_urls):
                r = await client.get(url + "/metrics")
                if r.status_code != 200:
                    return None
                seen = set()
                for name, value in _SAMPLE.findall(r.text):
                    seen.add(name)
                    if name == _PROMPT:
                        prompt += float(value)
                    else:
                        cached += float(value)
                if len(seen) < 2:
                    return None
    except (httpx.HTTPError, ValueError):
        return None
    return prompt, cached


def _positive_int(x: object) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) and x > 0 else None


class _Stream:
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
            self._error = f"malformed SSE data: {_brief(data.decode(errors='replace'))}"
            return True
        if not isinstance(chunk, dict):
            return False
        if chunk.get("error"):
            self._error = f"error in stream: {_brief(str(chunk['error']))}"
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


class _Client(abc.ABC):
    """One HTTP client library behind the runner: open a session, stream one POST.

    Implemented by :class:`_Aiohttp` and :class:`_Httpx`.
    """

    kind: ClientKind

    @abc.abstractmethod
    async def __aenter__(self) -> _Client:
        """Open the client's connection pool."""

    @abc.abstractmethod
    async def __aexit__(self, *exc: object) -> None:
        """Close the connection pool."""

    @abc.abstractmethod
    async def post(self, url: str, body: bytes,
                   acc: _Stream) -> tuple[str, ErrorClass] | None:
        """Stream one request into ``acc``; the transport error and its class, if any."""


class _Aiohttp(_Client):
    kind: ClientKind = "aiohttp"

    def __init__(self, connections: int, connect_timeout_s: float) -> None:
        self.connections = connections
        self.connect_timeout_s = connect_timeout_s
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> _Client:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.connections, limit_per_host=0,
                                           ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
            trust_env=False)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()

    async def post(self, url: str, body: bytes,
                   acc: _Stream) -> tuple[str, ErrorClass] | None:
        assert self.session is not None
        try:
            async with self.session.post(url, data=body, headers=HEADERS) as resp:
                if resp.status != 200:
                    text = (await resp.read()).decode(errors="replace")
                    return f"HTTP {resp.status} from {url}: {_brief(text)}", \
                        ErrorClass.HTTP_STATUS
                chunks = resp.content.iter_any()
                async for data in chunks:
                    if acc.feed_bytes(data):
                        break
                if acc.done:  # read the body's end, so the connection goes back to the pool
                    with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                        async with asyncio.timeout(DRAIN_S):
                            async for _ in chunks:
                                pass
        except aiohttp.ClientConnectorError as e:
            return f"cannot connect to {url}: {_cause(e)}", ErrorClass.CONNECT
        except (aiohttp.ClientError, OSError) as e:  # resets, payload/protocol errors
            return (f"{type(e).__name__} talking to {url} after {len(acc.times)} text chunks: "
                    f"{_cause(e)}", ErrorClass.DISCONNECT)
        return None


class _Httpx(_Client):
    kind: ClientKind = "httpx"

    def __init__(self, connections: int, connect_timeout_s: float,
                 request_timeout_s: float) -> None:
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=connections,
                                max_keepalive_connections=connections),
            timeout=httpx.Timeout(connect=connect_timeout_s, read=request_timeout_s,
                                  write=request_timeout_s, pool=None),
            trust_env=False)

    async def __aenter__(self) -> _Client:
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.__aexit__(None, None, None)

    async def post(self, url: str, body: bytes,
                   acc: _Stream) -> tuple[str, ErrorClass] | None:
        try:
            async with self.client.stream("POST", url, content=body, headers=HEADERS) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    return f"HTTP {resp.status_code} from {url}: {_brief(text)}", \
                        ErrorClass.HTTP_STATUS
                chunks = resp.aiter_bytes()
                async for data in chunks:
                    if acc.feed_bytes(data):
                        break
                if acc.done:  # read the body's end, so the connection goes back to the pool
                    with contextlib.suppress(TimeoutError, httpx.HTTPError):
                        async with asyncio.timeout(DRAIN_S):
                            async for _ in chunks:
                                pass
        except httpx.ConnectError as e:
            return f"cannot connect to {url}: {_cause(e)}", ErrorClass.CONNECT
        except httpx.TimeoutException as e:
            raise TimeoutError from e
        except httpx.HTTPError as e:  # resets, protocol errors
            return (f"{type(e).__name__} talking to {url} after {len(acc.times)} text chunks: "
                    f"{_cause(e)}", ErrorClass.DISCONNECT)
        return None


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

    def _client(self, connections: int) -> _Client:
        n = max(1, min(connections, MAX_CONCURRENCY))
        _raise_open_files_limit(n)
        if self.client == "httpx":
            return _Httpx(n, self.connect_timeout_s, self.request_timeout_s)
        return _Aiohttp(n, self.connect_timeout_s)

    async def _one(self, client: _Client, st: _State, index: int, sched_s: float,
                   body: bytes, n_in: int, n_out: int) -> None:
        url = self.urls[index % len(self.urls)]
        sent = time.perf_counter() - st.t0
        acc = _Stream(st.t0)
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
                       on_tick: TickFn | None) -> AsyncIterator[_Client]:
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

        async def client_loop(client: _Client) -> None:
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
