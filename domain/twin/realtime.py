"""The twin against a clock: the replicas of a config served in (scaled) real time.

``servetune twin serve`` (:mod:`twin_http`) answers HTTP requests with the token
timing of the twin engine. This module is its clock-free core: the caller passes the current
*virtual* time ``v`` (``(wall - t0) x speedup``, seconds) to every call, submits each request
when it arrives, calls :meth:`RealtimeTwin.poll` at (or just after) :meth:`RealtimeTwin.next_wake`
and sends each request the tokens ``poll`` reports due.

How the engine runs in real time. The engine (:class:`~domain.twin.engine.TwinEngine`) is a
discrete-event simulation whose scheduler decides each iteration (prefill or decode batch) from
the requests that arrived by the iteration's start. ``poll(v)`` advances every replica with
``advance(v)``: it simulates only iterations that *start* before ``v``, and every request that
arrived before ``v`` was already submitted with its arrival time, so each decision sees exactly
the arrivals the offline simulation of the same arrival times sees. The iteration in progress at
``v`` is simulated whole (its end time and tokens are known early) and its tokens are released
only when ``v`` passes their times. Hence, for the same arrival times, the online token times
equal the offline ones (:func:`~domain.twin.cluster.simulate_open_loop`) exactly; what differs
is the clock: an arrival is stamped when the server reads the request, and a token leaves when
the event loop wakes after its time (timer granularity, about 1 ms, and the loop's load).
``tests/integration/test_twin_server.py`` measures both against the offline simulation.

Prefix caching. Requests carry the block hashes of their prompt (:func:`block_hashes`: one
hash per ``BLOCK_TOKENS`` full tokens, chained, so equal blocks after different prefixes differ);
the replicas share one :class:`~domain.twin.prefix_cache.PathIndex` like a trace replay, so
prompts that share a prefix share its blocks in the radix cache, and the cache-aware router
sees them too.

Replicas sit behind the config's router policy (:class:`~domain.twin.cluster.Router`); the
router's load is, as in the offline replay, requests sent minus requests finished by ``v``.
A replica of several schedulers (``dp_size`` x ``attn_dp_size`` > 1) is served as the offline
simulation runs it (:class:`~domain.twin.dp.DPServer`: its tokenizer, the DP controller and
the ranks, attention-DP ranks in lockstep); its gauges are its ranks' summed.

Limits of the model: the engine keeps every request and decode step it simulated (about 50
bytes per decode step and 300 per request), so a server's memory grows with what it served.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from domain.config import ServingConfig
from domain.costmodel import build_cost_model
from domain.fit import FitReport
from domain.twin.cluster import Router, Server, new_server, scheduler_limits
from domain.twin.dp import DPServer
from domain.twin.engine import EngineLimits, EngineLoad, EngineStats
from domain.twin.prefix_cache import PathIndex

# Tokens per prefix-cache block of a served prompt. SGLang's radix cache matches single tokens
# (page size 1); the twin's cache is block-granular, and 16 is the block of the Qwen-Bailian
# traces (the finest the twin is calibrated on): a shared prefix is found to within 15 tokens.
BLOCK_TOKENS = 16
# Virtual seconds past ``v`` that ``poll`` simulates to, so an iteration due exactly at ``v``
# (the wake-up time) starts; far below any step time (tens of microseconds at the least).
ADVANCE_EPS_S = 1e-6
# Scheduler input limit: SGLang refuses inputs of at least min(context - 1, pool - 1) - 5 tokens
# (``managers/tp_worker.py``: max_req_input_len = max_req_len - 5).
RESERVED_INPUT_TOKENS = 5


def block_hashes(tokens: Sequence[str] | Sequence[int], block: int = BLOCK_TOKENS) -> list[int]:
    """Chained hashes of the full ``block``-token blocks of ``tokens``.

    The last, partial block is left out (it is never cached). Each hash covers the whole
    prefix up to the end of its block (blake2b, 8 bytes), so a block's hash names its prefix
    like a trace's hash ids do; stable across processes.
    """
    out: list[int] = []
    h = hashlib.blake2b(digest_size=8)
    for start in range(0, len(tokens) - block + 1, block):
        h.update("\x1f".join(map(str, tokens[start:start + block])).encode())
        h.update(b"\x1e")
        out.append(int.from_bytes(h.copy().digest(), "big") >> 1)  # a non-negative int64
    return out


@dataclass(frozen=True, slots=True)
class Update:
    """What changed for one request in a :meth:`RealtimeTwin.poll`.

    Attributes:
        rid: the request id :meth:`RealtimeTwin.submit` returned.
        due: output tokens whose time has come (cumulative; send those not yet sent).
        finished: no more tokens will come (all sent, or ``error``).
        error: why the engine refused or dropped the request, or None.
        first_s: virtual time of the first token newly due in this update, s (nan if none).
        last_s: virtual time of the last token newly due in this update, s (nan if none).
    """

    rid: int
    due: int
    finished: bool
    error: str | None = None
    first_s: float = math.nan
    last_s: float = math.nan


@dataclass(slots=True)
class _Live:
    replica: int
    idx: int
    output: int
    times: deque[float] = field(default_factory=deque)  # known token times not yet due
    known: int = 0  # token times read from the engine
    due: int = 0


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's gauges and counters for ``/metrics``.

    Attributes:
        engine: the scheduler's state (running, queued, KV use).
        prompt_tokens: prompt tokens admitted so far.
        cached_tokens: of those, served from the prefix cache (device or host).
        generation_tokens: output tokens released to clients so far.
        requests: requests finished or failed so far.
        context_len: the model context, tokens.
        retractions: running requests retracted to the queue so far (decode KV ran out).
    """

    engine: EngineLoad
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    requests: int
    context_len: int
    retractions: int = 0

    @property
    def cache_hit_rate(self) -> float:
        """Cached / admitted prompt tokens since start (0 before any admission)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class RealtimeTwin:
    """The replicas of one config behind its router, driven by the caller's virtual clock.

    Args:
        config: the serving configuration (replicas, router policy, features).
        report: its memory layout (:func:`domain.fit.fit`, or the twin startup's ``fit``).
        block_tokens: tokens per prefix block of the hashes passed to :meth:`submit`.
    """

    def __init__(self, config: ServingConfig, report: FitReport,
                 block_tokens: int = BLOCK_TOKENS) -> None:
        self.config, self.block = config, block_tokens
        self.limits: EngineLimits = scheduler_limits(config, report)
        cost = build_cost_model(config, report)
        self.index = PathIndex()
        self.engines: list[Server] = [new_server(config, cost, self.limits, index=self.index)
                                      for _ in range(config.replicas)]
        self.router = Router.for_config(config)
        self._sent = [0] * config.replicas
        self._generated = [0] * config.replicas
        self._live: dict[int, _Live] = {}
        self._where: list[tuple[int, int]] = []
        self._last_v = 0.0

    # ------------------------------------------------------------------ admission
    def refusal(self, input_tokens: int, output_tokens: int) -> str | None:
        """SGLang's message when it refuses such a request up front (HTTP 400), else None.

        Checks in SGLang's order: the tokenizer manager's input and input + max_new_tokens
        against the context length (``managers/tokenizer_manager.py``), then the scheduler's
        input limit from the KV pool (``managers/utils.py: validate_input_length``).
        """
        ctx, kv = self.limits.context_len, self.limits.kv_tokens
        if input_tokens >= ctx:
            return (f"The input ({input_tokens} tokens) is longer than the model's context "
                    f"length ({ctx} tokens).")
        if input_tokens + output_tokens > ctx:
            return ("Requested token count exceeds the model's maximum context length of "
                    f"{ctx} tokens. You requested a total of {input_tokens + output_tokens} "
                    f"tokens: {input_tokens} tokens from the input messages and "
                    f"{output_tokens} tokens for the completion. Please reduce the number of "
                    "tokens in the input messages or the completion to fit within the limit.")
        max_input = min(ctx - 1, kv - 1) - RESERVED_INPUT_TOKENS
        if input_tokens >= max_input:
            return (f"Input length ({input_tokens} tokens) exceeds the maximum allowed length "
                    f"({max_input} tokens). Use a shorter input or enable "
                    "--allow-auto-truncate.")
        return None

    def submit(self, v: float, input_tokens: int, output_tokens: int,
               hashes: Sequence[int] = ()) -> int:
        """A request arriving at virtual time ``v`` (non-decreasing); returns its id.

        Args:
            v: virtual now, s.
            input_tokens: prompt tokens (>= 1).
            output_tokens: tokens to generate (>= 1; ``ignore_eos``: exactly this many).
            hashes: :func:`block_hashes` of the prompt, in blocks of ``block_tokens``.
        """
        v = self._last_v = max(v, self._last_v)
        R, lim = len(self.engines), self.limits
        path = (self.index.path(hashes)
                if hashes and (lim.radix_cache or self.router.needs_load) else [])
        if self.router.needs_load and R > 1:
            for e in self.engines:  # causal: only iterations starting before v
                e.advance(v)
            loads = [self._sent[i] - self.engines[i].finished_by(v) for i in range(R)]
        else:
            loads = self._sent
        i = self.router.pick(path, self.block, input_tokens, loads)
        self._sent[i] += 1
        idx = self.engines[i].submit(v, input_tokens, output_tokens, path,
                                     self.block if path else 0)
        rid = len(self._where)
        self._where.append((i, idx))
        self._live[rid] = _Live(i, idx, output_tokens)
        return rid

    def abort(self, rid: int) -> None:
        """Drop request ``rid`` (its client went away): frees its slot and KV in the engine."""
        lv = self._live.pop(rid, None)
        if lv is not None:
            self.engines[lv.replica].abort(lv.idx)

    # ------------------------------------------------------------------ the clock
    def poll(self, v: float, ahead: float = 0.0) -> list[Update]:
        """Simulate up to virtual time ``v`` and report the requests with newly due tokens.

        Args:
            v: virtual now, s.
            ahead: release tokens whose time is up to this many virtual seconds after ``v``
                (they are known: their iteration started before ``v``); lets a caller whose
                timer wakes late centre its emission error on zero.

        A request is reported once more with ``finished`` when its last token is due (or when
        the engine failed it), and then forgotten.
        """
        self._last_v = max(self._last_v, v)
        until = v + ADVANCE_EPS_S
        release = until + ahead
        for e in self.engines:
            if e.busy:
                e.advance(until)
        out: list[Update] = []
        for rid, lv in list(self._live.items()):
            eng = self.engines[lv.replica]
            p = eng.progress(lv.idx, lv.known)
            if p.error is not None:
                out.append(Update(rid, lv.due, True, p.error))
                del self._live[rid]
                continue
            if p.token_times:
                lv.times.extend(p.token_times)
                lv.known += len(p.token_times)
            times, n = lv.times, 0
            first = last = math.nan
            while times and times[0] <= release:
                last = times.popleft()
                if not n:
                    first = last
                n += 1
            if not n:
                continue
            lv.due += n
            self._generated[lv.replica] += n
            done = lv.due >= lv.output
            out.append(Update(rid, lv.due, done, None, first, last))
            if done:
                del self._live[rid]
        return out

    def next_wake(self, ahead: float = 0.0) -> float:
        """Virtual time of the next :meth:`poll` that can change something (inf: idle).

        The earliest of: the next known token time less ``ahead`` (the ``poll`` argument),
        and each busy replica's next scheduler decision
        (:attr:`~domain.twin.engine.TwinEngine.next_event_s`: the end of the iteration it is in,
        or, idle, the next request leaving its tokenizer).
        """
        t = math.inf
        for lv in self._live.values():
            if lv.times and lv.times[0] - ahead < t:
                t = lv.times[0] - ahead
        for e in self.engines:
            if e.busy and e.next_event_s < t:
                t = e.next_event_s
        return t

    # ------------------------------------------------------------------ introspection
    def cached_tokens(self, rid: int) -> int:
        """Prompt tokens of ``rid`` served from the prefix cache at its admission (0 before)."""
        i, idx = self._where[rid]
        return self.engines[i].progress(idx, 1 << 62).cached_tokens

    def replica_of(self, rid: int) -> int:
        """The replica the router sent ``rid`` to."""
        return self._where[rid][0]

    def loads(self) -> list[ReplicaLoad]:
        """Gauges and counters of every replica at its current simulated time."""
        out = []
        for i, e in enumerate(self.engines):
            per = [e.stats] if not isinstance(e, DPServer) else [s for _, s in e.rank_stats()]
            out.append(ReplicaLoad(engine=e.load(), prompt_tokens=_sum(per, "prompt_tokens"),
                                   cached_tokens=_sum(per, "cached_tokens"),
                                   generation_tokens=self._generated[i],
                                   requests=e.finished_by(math.inf),
                                   context_len=self.limits.context_len,
                                   retractions=_sum(per, "retractions")))
        return out

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished (all tokens released) or failed."""
        return len(self._live)


def _sum(stats: Sequence[EngineStats], name: str) -> int:
    """A counter of a replica: summed over its schedulers."""
    return sum(int(getattr(s, name)) for s in stats)
