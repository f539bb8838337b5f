"""Twin engine: a discrete-event simulation of one SGLang server (one replica) in virtual time.

Mechanics (SGLang 0.5.23 scheduler, ``managers/scheduler.py`` and ``schedule_policy.py``):

- Arrivals enter a waiting queue, admitted FCFS, or longest-prefix-match first with
  ``--schedule-policy lpm`` (which SGLang silently turns into FCFS above 128 waiting requests).
- Each iteration runs either a prefill (extend) batch or a decode batch; prefill has priority
  whenever a waiting request can be admitted, as in ``get_next_batch_to_run``.
- Admission (``PrefillAdder``) needs a free request slot (running < max_running_requests) and
  enough KV: free plus evictable (unreferenced radix-cache) tokens minus the decode tokens
  reserved for running requests (remaining output x ``new_token_ratio``) must cover the new,
  uncached prompt tokens plus the request's own reservation. ``new_token_ratio`` starts at
  0.7 x schedule_conservativeness, decays linearly to 0.14 x that over 600 decode steps without
  retraction, is re-estimated from the batch kept after a retraction and reset when the engine
  idles (SGLang's ``SGLANG_INIT_NEW_TOKEN_RATIO``, ``SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR``,
  ``SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS``, ``SGLANG_RETRACT_DECODE_STEPS`` defaults,
  ``managers/scheduler_components/new_token_ratio_tracker.py``). An admission pass is skipped
  while the running batch is full (SGLang's ``batch_is_full``: no slot, or the head did not
  fit) until a request leaves; a pass that runs costs CPU per waiting request it matches
  (:meth:`TwinEngine._admit`).
- Radix prefix cache (:mod:`domain.twin.prefix_cache`): a request reuses its longest cached
  prefix (at least its last prompt token is recomputed); HiCache host hits are loaded back over
  the host link before the prefill, charged per token. Finished prompts stay cached until
  evicted (LRU) to make room.
- A prefill batch holds at most ``chunked_prefill_size`` new tokens (and ``max_prefill_tokens``);
  a longer prompt is split into chunks over several iterations (one chunked request at a time).
- Decode batches every running request (continuous batching); if the KV pool cannot hold the
  next step's tokens even after evicting the cache, the requests with the fewest generated tokens
  are retracted to the back of the queue and recomputed later (``retract_decode``,
  :meth:`TwinEngine._make_room`). A decode batch above the CUDA-graph max runs eagerly
  (:meth:`~domain.costmodel.StepCostModel.eager_time`).
- Speculative decoding (EAGLE/NEXTN): each decode iteration is a draft + verify step that emits
  ``accept_length`` tokens per request on average (:mod:`domain.speculative`), at the cost of
  :meth:`~domain.costmodel.StepCostModel.verify_time` + ``draft_time``; every prefill step also
  pays the draft layers' extend over its prompt tokens (``draft_prefill_time``).
- The first token is produced by the last prefill chunk.
- The TTFT path outside the GPU (SGLang 0.5.23, ``python/sglang/srt/managers/``): a request is
  tokenized by the ONE tokenizer-manager process (``tokenizer_manager.py``: ``TokenizerManager``
  "is a process that tokenizes the text"; ``generate_request`` awaits ``_tokenize_one_request``
  before ``_send_one_request`` hands it to the scheduler over ZMQ), so requests queue there:
  request k becomes schedulable at ``ready_k = max(arrival_k, ready_{k-1}) +
  cost.tokenize_time(input_k)`` (FIFO in arrival order). Every token then leaves
  ``cost.request_fixed_s`` after the iteration that produced it (HTTP receive, ZMQ hops, the
  detokenizer process and the streaming response: a constant pipeline delay), so
  TTFT = tokenizer wait + tokenize + scheduler wait + prefill + ``request_fixed_s`` and the
  inter-token gaps are unchanged. A closed-loop client sends its next request when it has seen
  the last token (finish + ``request_fixed_s``). A step-cost model without these two members
  (the tests' hand-checkable fakes) has neither delay.

Implementation note: decode iterations are O(1) in the batch size. Every decode step appends its
end time to ``T`` and the tokens it emits per request to the cumulative array ``C``; a request
that decoded over steps [a, b) produced ``floor(C[k+1] - C[a])`` tokens by step k, so its token
times are read back from those arrays at the end. Inter-token gaps are reported the way
``sglang.bench_serving`` measures a streamed chunk of several tokens: the gap divided evenly over
the chunk's tokens.

The engine is incremental (:meth:`TwinEngine.submit`, :meth:`TwinEngine.advance`) so a router can
run several replicas in lockstep and see their load at each arrival. :meth:`TwinEngine.progress`
reads back the token times a request has so far (the same times :meth:`TwinEngine.records` ends
with), :meth:`TwinEngine.load` the scheduler's queues and KV use, and :meth:`TwinEngine.abort`
drops a request (a client that disconnected): what the real-time driver
(:mod:`domain.twin.realtime`) needs to serve the twin over HTTP.

Longer than 500 lines on purpose: one scheduler iteration (admission, prefill, decode, retraction,
radix cache, speculation) is one simulation loop whose parts share its state; split, they would
trade that state through arguments on every step of the hot loop.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from domain.costmodel import StepCostModel
from domain.metrics import RequestRecord
from domain.speculative import SpecParams, accept_length, draft_tokens_for_batch, steps_for_batch
from domain.twin.budget import CHECK_EVERY, ComputeBudget
from domain.twin.prefix_cache import PathIndex, PrefixCache

# SGLang 0.5.23 ``srt/environ.py:646-649`` defaults: SGLANG_INIT_NEW_TOKEN_RATIO,
# SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR, SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS, SGLANG_RETRACT_DECODE_STEPS
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20
MAX_PREFILL_TOKENS = 16384  # --max-prefill-tokens default (sglang-knobs reference 1.3)
LPM_MAX_WAITING = 128       # schedule_policy.py: lpm falls back to fcfs above this queue length
# schedule_policy.py:137-139 (0.5.23): a pass under FCFS refreshes the LRU recency of at most
# WAITING_QUEUE_PREFIX_MATCH_MAX (= LPM_MAX_WAITING) waiting prefixes, every 32nd pass
WAITING_PREFIX_REFRESH_INTERVAL = 32
_EPS = 1e-9


@dataclass(slots=True)
class _Req:
    idx: int
    arrival: float
    input: int
    output: int
    path: list[int]
    block: int
    target: int = 0           # tokens to prefill (input, or input + generated after retraction)
    prefilled: int = 0        # includes the cached prefix
    generated: int = 0
    first_token: float = math.nan
    finish: float = math.nan
    locked: int = 0           # leading path nodes referenced in the prefix cache
    private: float = 0.0      # KV tokens of this request outside the cache
    seg_start: int = -1       # decode index where the current decode segment started
    seg_gen: int = 0          # generated count at seg_start
    epoch: int = 0            # bumps on retraction (lazy heap deletion)
    # decode segments (a, b, tokens) over steps [a, b); (-1, -1, 1) marks a re-prefill token
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    reprefill_times: list[float] = field(default_factory=list)
    cached: int = 0           # prompt tokens served from the cache on the last admission
    error: str | None = None
    ready: float = 0.0        # when the tokenizer manager hands it to the scheduler


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Resolved per-replica limits and features the scheduler enforces.

    Attributes:
        kv_tokens: KV pool, tokens.
        max_running_requests: request slots.
        chunked_prefill_size: tokens per prefill batch (-1 = no chunking).
        context_len: model context, tokens.
        schedule_conservativeness: scales the initial new-token ratio.
        index_topk: DSA attended-token cap (0 = dense).
        schedule_policy: ``fcfs`` or ``lpm``.
        radix_cache: prefix caching on (``--disable-radix-cache`` off).
        host_kv_tokens: HiCache host pool, tokens (0 = off).
        spec: resolved speculative parameters (``domain.speculative.SpecParams``) or None.
        page_size: KV page, tokens: a cached prefix is reused in whole pages only
            (``mem_cache/radix_cache.py:178-220``: a match is rounded down to ``page_size``).
    """

    kv_tokens: int
    max_running_requests: int
    chunked_prefill_size: int
    context_len: int
    schedule_conservativeness: float = 1.0
    index_topk: int = 0
    schedule_policy: str = "fcfs"
    radix_cache: bool = True
    host_kv_tokens: int = 0
    spec: SpecParams | None = None
    page_size: int = 1


@dataclass(frozen=True, slots=True)
class StepShape:
    """The work of one rank's next iteration, for a caller that prices ranks together.

    Attributes:
        extend: a prefill (extend) step; else a plain decode step.
        tokens: new tokens (extend) or sequences in the batch (decode).
        attn: extend: query-key pairs (``sum c x attended context``); decode: KV tokens held.
        index: extend, DSA: indexer pairs; else 0.
        chunks: extend: requests in the batch.
        loaded: extend: HiCache tokens loaded back before the forward.
    """

    extend: bool
    tokens: int
    attn: float
    index: float = 0.0
    chunks: int = 0
    loaded: int = 0


@dataclass(frozen=True, slots=True)
class RequestProgress:
    """What one request has produced so far in the simulation.

    Attributes:
        token_times: virtual times (s) of its output tokens number ``since`` onward that the
            simulated iterations produced (a token's time is the end of the iteration that
            produced it; with speculative decoding several tokens share one time).
        finished: every output token is in the simulation (or it failed).
        error: why the engine refused or dropped it, or None.
        cached_tokens: prompt tokens served from the prefix cache at its (last) admission.
    """

    token_times: list[float]
    finished: bool
    error: str | None
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The scheduler's state at the engine's current virtual time (SGLang's gauges).

    Attributes:
        running: requests holding a request slot (in the decode batch, or mid chunked prefill).
        queued: requests that arrived and are not admitted (SGLang's waiting queue).
        used_kv_tokens: KV tokens held by live requests (pool - free - evictable cache).
        kv_tokens: the KV pool, tokens.
        queued_tokens: tokens the queued requests will prefill (prompt, plus generated for a
            retracted one: SGLang's ``seqlen`` of a waiting request, ``load_inquirer.py:145``).
    """

    running: int
    queued: int
    used_kv_tokens: float
    kv_tokens: int
    queued_tokens: int = 0


@dataclass
class EngineStats:
    """Counters of one simulated run (for reports and over-admission detection)."""

    prefill_steps: int = 0
    decode_steps: int = 0
    retractions: int = 0
    max_running: int = 0
    busy_s: float = 0.0
    decode_batch_sum: int = 0
    decode_busy_s: float = 0.0
    decode_roofline_s: float = 0.0
    decode_allreduce_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_loaded_tokens: int = 0
    evicted_tokens: int = 0
    spec_tokens: float = 0.0
    # decode steps whose batch ran eagerly (above cuda_graph_max_bs_decode)
    eager_decode_steps: int = 0
    # KV tokens (prompt + generated) of the requests retracted, to be recomputed (less cache hits)
    retracted_tokens: int = 0
    # sum over scheduler iterations (prefill and decode steps) of the waiting-queue length
    waiting_sum: int = 0
    # request-seconds in flight (running + waiting + prefilling) over the busy steps
    inflight_s: float = 0.0
    # most requests in flight at one step
    max_inflight: int = 0

    @property
    def eager_step_share(self) -> float:
        """Eager decode steps / decode steps (0 when nothing decoded)."""
        return self.eager_decode_steps / self.decode_steps if self.decode_steps else 0.0

    @property
    def mean_inflight(self) -> float:
        """Requests in flight, time-weighted over the busy steps (0 when it never ran a step)."""
        return self.inflight_s / self.busy_s if self.busy_s else 0.0

    @property
    def mean_waiting(self) -> float:
        """Waiting-queue length per scheduler step (0 when it never ran a step)."""
        steps = self.prefill_steps + self.decode_steps
        return self.waiting_sum / steps if steps else 0.0

    def count_load(self, inflight: int, dt: float) -> None:
        """Count one scheduler step of ``dt`` s with ``inflight`` requests in flight."""
        self.inflight_s += inflight * dt
        if inflight > self.max_inflight:
            self.max_inflight = inflight

    @property
    def mean_decode_batch(self) -> float:
        """Mean number of sequences per decode step."""
        return self.decode_batch_sum / self.decode_steps if self.decode_steps else 0.0

    @property
    def cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache (device or host) / prompt tokens admitted."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def decode_roofline_share(self) -> float:
        """Decode time at 100% of the roofline / simulated decode time (0 when nothing decoded).

        With speculative decoding the roofline is that of plain decoding of the same tokens, so
        the share can exceed 1.
        """
        return self.decode_roofline_s / self.decode_busy_s if self.decode_busy_s else 0.0

    @property
    def decode_allreduce_share(self) -> float:
        """Decode time spent in TP all-reduces / simulated decode time (0 when nothing decoded).

        The all-reduce seconds are those of the cost model's decode steps
        (:meth:`~domain.costmodel.StepCostModel.decode_allreduce_time`); a CPU-bound step (the
        scheduler's overlap hides the GPU time) counts them against the whole step.
        """
        return self.decode_allreduce_s / self.decode_busy_s if self.decode_busy_s else 0.0

    @property
    def mean_accept_length(self) -> float:
        """Tokens emitted per request per decode step (1.0 without speculative decoding)."""
        return self.spec_tokens / self.decode_batch_sum if self.decode_batch_sum else 0.0


class TwinEngine:
    """One simulated SGLang replica.

    Feed requests with :meth:`submit` (in arrival order), move virtual time with
    :meth:`advance`, read :meth:`records`. :meth:`run` does all three for a whole workload.

    Args:
        cost: step-time model of this replica.
        limits: resolved limits and features.
        cache: the replica's prefix cache (built from ``limits`` when None).
        budget: compute budget checked every ``CHECK_EVERY`` scheduler iterations and records
            (None: unbounded); :meth:`advance` and :meth:`records` then raise
            :class:`~domain.errors.ComputeBudgetExceeded` when it runs out or is cancelled.
        tokenize: whether this engine runs the server's tokenizer queue (False for one rank of
            a server with several schedulers, whose tokenizer sits before the DP controller:
            :mod:`domain.twin.dp`).
    """

    def __init__(self, cost: StepCostModel, limits: EngineLimits,
                 cache: PrefixCache | None = None, budget: ComputeBudget | None = None,
                 tokenize: bool = True) -> None:
        self.cost, self.lim = cost, limits
        self.compute_budget = budget
        self.stats = EngineStats()
        self.cache = cache if cache is not None else new_cache(limits)
        self.now = 0.0
        self._reqs: list[_Req] = []
        self._pending: deque[_Req] = deque()
        self._tokenizing: deque[_Req] = deque()          # in the tokenizer (ready ascending)
        self._waiting: deque[_Req] = deque()
        self._running: dict[int, _Req] = {}
        self._heap: list[tuple[float, int, int]] = []   # (cumulative-token target, epoch, idx)
        self._T: list[float] = []                        # decode step end times
        self._C: list[float] = [0.0]                     # cumulative tokens per request
        self._priv_running = 0.0                         # private KV of running requests
        self._ctx_running = 0.0                          # context tokens of running requests
        self._rem_out = 0.0                              # remaining output of running requests
        self._out_running = 0                            # output lengths of running requests
        self._full = False                               # SGLang's running_batch.batch_is_full
        self._scan_s = 0.0                               # CPU of the last admission pass's scan
        self._chunked: _Req | None = None
        init = min(1.0, INIT_NEW_TOKEN_RATIO * limits.schedule_conservativeness)
        self._init_ratio = init
        self._min_ratio = init * MIN_NEW_TOKEN_RATIO_FACTOR
        self._decay = (init - self._min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self._ratio = init
        self._budget = min(limits.chunked_prefill_size, MAX_PREFILL_TOKENS) \
            if limits.chunked_prefill_size > 0 else MAX_PREFILL_TOKENS
        self._closed: tuple[float, int, int] | None = None
        self._max_requests = 0  # closed loop: stop issuing after this many (0 = no cap)
        self._finish_times: list[float] = []
        self._finish_order: list[int] = []  # request indices in the order they ended
        self._lpm_dirty = True
        self._uses_spec = False
        # the TTFT path outside the GPU steps (module docstring); 0 for costs without it
        self._fixed = float(getattr(cost, "request_fixed_s", 0.0))
        self._tokenize = getattr(cost, "tokenize_time", None) if tokenize else None
        self._tokenizer_free = 0.0                       # when the tokenizer is next idle
        # PD disaggregation roles (:meth:`set_role`, driven by domain.twin.pd)
        self._role = "null"
        self._held: dict[int, _Req] = {}   # KV and a slot held outside the batch (PD)
        self._held_kv = 0.0                # their KV tokens
        self._transferred: deque[_Req] = deque()  # decode role: KV arrived, not yet running
        self._stalled = False              # the head waits on held KV (prefill role)
        self._pd_extra_slots = 0
        self._pd_reserved = 0
        self._pd_joins = 0                 # decode role: requests joined (prealloc_fits' cache)
        self._pd_max_key: tuple[int, ...] = ()
        self._pd_max_total = 0
        # lockstep (domain.twin.dp): the iteration plan_step formed, for commit_step
        self._plan: tuple[list[tuple[_Req, int]], int, float, int] | None = None
        # lockstep with shared pricing: the step plan_step formed (see StepShape), or None
        self.step_shape: StepShape | None = None

    # ------------------------------------------------------------------ public API
    def submit(self, arrival_s: float, input_tokens: int, output_tokens: int,
               path: Sequence[int] = (), block_tokens: int = 0) -> int:
        """Queue one request arriving at ``arrival_s`` (non-decreasing across calls).

        Args:
            arrival_s: virtual arrival time, s.
            input_tokens: prompt length, tokens.
            output_tokens: generated length, tokens.
            path: prefix-cache node ids of its blocks (:meth:`PathIndex.path`), or empty.
            block_tokens: tokens per block of ``path``.

        Returns:
            The request's index in :meth:`records`.
        """
        r = _Req(idx=len(self._reqs), arrival=arrival_s, input=input_tokens,
                 output=output_tokens, path=list(path) if block_tokens else [],
                 block=block_tokens, target=input_tokens)
        self._reqs.append(r)
        self._pending.append(r)
        return r.idx

    @property
    def busy(self) -> bool:
        """Whether a submitted request is not finished (there is work to simulate)."""
        return bool(self._pending or self._tokenizing or self._waiting or self._running
                    or self._chunked or self._transferred)

    @property
    def next_event_s(self) -> float:
        """Virtual time of the next scheduler decision (inf when idle).

        :attr:`now` while a request is running, waiting or mid-prefill; else the next arrival
        or the next request leaving the tokenizer.
        """
        if (self._running or self._waiting or self._chunked is not None
                or self._transferred) and not self._stalled:
            return self.now
        t = math.inf
        if self._pending:
            t = self._pending[0].arrival
        if self._tokenizing:
            t = min(t, self._tokenizing[0].ready)
        return max(t, self.now) if t < math.inf else t

    @property
    def next_arrival_s(self) -> float:
        """When the next request arrives or leaves the tokenizer (inf when none will)."""
        t = self._pending[0].arrival if self._pending else math.inf
        if self._tokenizing:
            t = min(t, self._tokenizing[0].ready)
        return t

    @property
    def new_token_ratio(self) -> float:
        """The scheduler's current new-token ratio (SGLang's ``sglang:new_token_ratio`` gauge).

        The share of their remaining output the running requests reserve in admission: starts
        at ``INIT_NEW_TOKEN_RATIO x schedule_conservativeness``, decays per decode step to the
        minimum, is re-estimated on retraction and reset when the engine idles.
        """
        return self._ratio

    def progress(self, idx: int, since: int = 0) -> RequestProgress:
        """Token times request ``idx`` has so far, from output token number ``since`` on.

        Times are those of :meth:`records`: the first token at the end of the prefill that
        completed the prompt, then one time per decoded token (the decode step's end; a
        recomputation after a retraction yields its token at the end of that prefill). Without
        speculative decoding ``numpy.diff`` of all of them is the record's ``itl_s``.

        Cost: O(segments + new tokens) (a log factor with speculative decoding).
        """
        r = self._reqs[idx]
        done = not math.isnan(r.finish)
        if r.error is not None or math.isnan(r.first_token):
            return RequestProgress([], done, r.error, r.cached)
        T, C, fixed = self._T, self._C, self._fixed
        out: list[float] = [r.first_token + fixed] if since <= 0 else []
        n = 1  # tokens accounted for so far
        re = iter(r.reprefill_times)
        segs = r.segments
        if self._running.get(idx) is r:  # the open decode segment
            open_tokens = min(int(C[len(T)] - C[r.seg_start] + _EPS), r.output - r.seg_gen)
            segs = [*segs, (r.seg_start, len(T), open_tokens)]
        for a, b, tokens in segs:
            if a < 0:  # a recomputation's token
                t = next(re)
                if n >= since:
                    out.append(t + fixed)
                n += 1
                continue
            if b <= a or tokens <= 0:
                continue
            if n + tokens > since:
                for j in range(max(0, since - n), tokens):
                    # token j of the segment ends the first step whose cumulative count > j
                    m = bisect.bisect_left(C, C[a] + j + 1 - _EPS, a + 1, b + 1)
                    out.append(T[m - 1] + fixed)
            n += tokens
        return RequestProgress(out, done, None, r.cached)

    def load(self) -> EngineLoad:
        """Running and queued requests and the KV in use, at :attr:`now` (see EngineLoad)."""
        chunked = 1 if self._chunked is not None else 0
        used = self.lim.kv_tokens - self._free() - self._evictable()
        queued = (self._waiting, self._pending, self._tokenizing)
        return EngineLoad(running=len(self._running) + chunked,
                          queued=sum(len(q) for q in queued),
                          used_kv_tokens=max(0.0, used), kv_tokens=self.lim.kv_tokens,
                          queued_tokens=sum(r.target for q in queued for r in q))

    def abort(self, idx: int, message: str = "aborted by the client") -> bool:
        """Drop request ``idx`` now (a client disconnect): free its slot, KV and cache locks.

        Returns:
            False when it had already finished or failed (nothing to do).
        """
        r = self._reqs[idx]
        if not math.isnan(r.finish):
            return False
        if self._running.get(idx) is r:
            k_now = len(self._T)
            decoded = self._leave_running(r)
            r.segments.append((r.seg_start, k_now, int(decoded + _EPS)))
            r.epoch += 1  # its heap entry is stale now
        elif r is self._chunked:
            self._chunked = None
            self._release(r)
        elif r in self._waiting:
            self._waiting.remove(r)
            self._lpm_dirty = True
        elif r in self._tokenizing:
            self._tokenizing.remove(r)
        elif r in self._pending:
            self._pending.remove(r)
        self._fail(r, self.now, message)
        return True

    def finished_by(self, t: float) -> int:
        """Requests (of those submitted) that finished or failed at or before ``t``."""
        return bisect.bisect_right(self._finish_times, t)  # the list is kept sorted

    def ended_since(self, n: int) -> list[tuple[int, float]]:
        """The requests that ended (finished or failed) after the first ``n`` to end.

        Returns:
            (request index, end time s) pairs in the order they ended.
        """
        return list(zip(self._finish_order[n:], self._finish_times[n:], strict=True))

    @property
    def ended(self) -> int:
        """Requests that ended (finished or failed) so far."""
        return len(self._finish_times)

    # ------------------------------------------------------------------ lockstep (DP ranks)
    def plan_step(self, max_virtual_s: float = 1e7, shared: bool = False) -> float | None:
        """Form this engine's next iteration at :attr:`now`; return its own duration, s.

        For attention-DP ranks that step together (:mod:`domain.twin.dp`): the caller takes
        the slowest rank's duration and passes it to every rank's :meth:`commit_step`. The
        iteration is formed as :meth:`advance` forms it (arrivals taken, admission, retraction
        to make room), so its state changes are made here. None: nothing to run (the rank
        joins the others' forward with an idle batch, or all are idle).

        ``shared``: a prefill step and a plain (not speculative) decode step are priced by the
        caller for all ranks at once; the engine then sets :attr:`step_shape` to the step's
        work, returns only its CPU floor (the queue scan of the admission pass that formed it,
        else 0) and takes a shared decode step's statistics from :meth:`count_shared_decode`.
        """
        now = self.now
        self.step_shape = None
        if self._pending or self._tokenizing:
            self._intake(now)
        if now > max_virtual_s:
            self._give_up(now, max_virtual_s)
            return None
        while True:
            if self._running and self._chunked is None and (self._full or not self._waiting):
                chunks: list[tuple[_Req, int]] = []  # what _admit returns at once
                loaded = 0
                self._scan_s = 0.0
            else:
                chunks, loaded = self._admit()
            if chunks:
                self._plan = (chunks, 0, 0.0, 0)
                if shared:
                    new_tok, attn, index = self._prefill_shape(chunks, self.lim.index_topk)
                    self.step_shape = StepShape(True, new_tok, attn, index, len(chunks), loaded)
                    return self._scan_s
                return self._prefill_time(chunks, loaded, self.lim.index_topk)
            if self._running:
                retracted = self.stats.retractions
                n = self._make_room(len(self._running))
                if shared and self.lim.spec is None:
                    self._plan = ([], n, 1.0, retracted)
                    self.step_shape = StepShape(False, n, float(int(self._ctx_running)))
                    self.stats.waiting_sum += len(self._waiting)
                    floor = 0.0
                    if self._scan_s:
                        floor = self.cost.cpu_time(n) + self._scan_s
                        self._scan_s = 0.0
                    return floor
                dt, acc = self._decode_time(n)
                self._plan = ([], n, acc, retracted)
                return dt
            self._ratio = self._init_ratio  # on_idle (scheduler.py:5318)
            if self._waiting and not self._pending and not self._tokenizing:
                self._fail(self._waiting.popleft(), now,
                           "request exceeds the KV pool after reservations")
                continue
            return None

    def count_shared_decode(self, allreduce_s: float, roofline_s: float, eager: bool) -> None:
        """Count the statistics of a decode step priced for all ranks (:meth:`plan_step`)."""
        st = self.stats
        st.decode_allreduce_s += allreduce_s
        st.decode_roofline_s += roofline_s
        if eager:
            st.eager_decode_steps += 1

    def commit_step(self, dt: float) -> None:
        """Run the iteration :meth:`plan_step` formed, lasting ``dt`` s (>= its own duration).

        Without a planned iteration the engine's clock moves on by ``dt`` (an idle batch).
        """
        plan, self._plan = self._plan, None
        if plan is None:
            self.now += dt
            return
        chunks, n, acc, retracted = plan
        if chunks:
            self._prefill_commit(chunks, dt)
        else:
            self._decode_commit(n, dt, acc, retracted)
        if self.cache is not None:
            self.stats.evicted_tokens = self.cache.evicted_tokens

    def run(self, arrivals: Sequence[tuple[float, int, int]] = (), *,
            closed_loop: tuple[int, float, int, int] | None = None,
            max_virtual_s: float = 1e7, max_requests: int = 0) -> list[RequestRecord]:
        """Simulate a whole workload until every request finished; return one record each.

        Args:
            arrivals: open-loop requests as (arrival_s, input_tokens, output_tokens), sorted.
            closed_loop: (concurrency, duration_s, isl, osl): that many clients each send a new
                request when their previous one finishes, until duration_s; then drain.
            max_virtual_s: safety cap on virtual time (s); unfinished requests get an error.
            max_requests: closed loop only: clients stop sending once this many requests were
                issued (bounds memory for long, fast runs; 0 = no cap).

        Returns:
            RequestRecords in request order (times in virtual seconds).
        """
        self._max_requests = max_requests
        for a, i, o in arrivals:
            self.submit(a, i, o)
        if closed_loop:
            conc, duration, isl, osl = closed_loop
            self._closed = (duration, isl, osl)
            for _ in range(conc):
                self.submit(0.0, isl, osl)
        self.advance(math.inf, max_virtual_s=max_virtual_s)
        return self.records()

    # ------------------------------------------------------------------ simulation
    def advance(self, until: float, *, max_virtual_s: float = 1e7) -> None:
        """Run scheduler iterations while virtual time is before ``until`` and work remains.

        An iteration that starts before ``until`` completes (it may end after it).

        Raises:
            ComputeBudgetExceeded: the engine's budget ran out or was cancelled.
        """
        cache = self.cache
        pending, waiting, running = self._pending, self._waiting, self._running
        tokenizing = self._tokenizing
        topk = self.lim.index_topk
        budget, mask, it = self.compute_budget, CHECK_EVERY - 1, 0
        while self.now < until:
            it += 1
            if budget is not None and not it & mask:
                budget.check()
            self._stalled = False
            if self._transferred:
                self._join_transferred()
            now = self.now
            self._intake(now)
            if now > max_virtual_s:
                self._give_up(now, max_virtual_s)
                break
            # ---- try to form a prefill batch ----
            chunks, loaded = self._admit()
            if chunks:
                self._prefill(chunks, loaded, topk)
                continue
            # ---- decode ----
            if running:
                self._decode(min(until, max_virtual_s))
                continue
            # ---- idle: jump to the next arrival or tokenized request ----
            self._ratio = self._init_ratio  # on_idle resets the ratio (scheduler.py:5318)
            self._stalled = bool(waiting) and bool(self._held)  # PD: waits for held KV
            if pending or tokenizing:
                nxt = min(pending[0].arrival if pending else math.inf,
                          tokenizing[0].ready if tokenizing else math.inf)
                self.now = max(now, min(nxt, until))
                if self.now < nxt:
                    break
                continue
            if self._stalled:  # PD: the head waits for held KV to be released
                break
            if waiting:  # nothing runs and the head cannot be admitted: it never fits
                r = waiting.popleft()
                self._fail(r, now, "request exceeds the KV pool after reservations")
                continue
            break
        self.stats.evicted_tokens = cache.evicted_tokens if cache else 0

    def _intake(self, now: float) -> None:
        """Move the requests that arrived by ``now`` into the tokenizer, and tokenized ones on.

        A request the KV pool or the context cannot hold fails at its arrival.
        """
        lim, pending, tokenizing, tokenize = self.lim, self._pending, self._tokenizing, \
            self._tokenize
        while pending and pending[0].arrival <= now:
            r = pending.popleft()
            if r.input + r.output > lim.context_len or r.input + 1 > lim.kv_tokens:
                self._fail(r, r.arrival,
                           f"The input ({r.input} tokens) plus max_new_tokens ({r.output}) "
                           f"exceeds the KV pool ({lim.kv_tokens}) or context length "
                           f"({lim.context_len})")
                continue
            # the one tokenizer process, FIFO in arrival order (module docstring)
            ready = max(r.arrival, self._tokenizer_free)
            if tokenize is not None:
                ready += tokenize(r.input)
            r.ready = self._tokenizer_free = ready
            tokenizing.append(r)
        while tokenizing and tokenizing[0].ready <= now:
            self._waiting.append(tokenizing.popleft())
            self._lpm_dirty = True

    def _give_up(self, now: float, max_virtual_s: float) -> None:
        """Fail every unfinished request: the virtual-time cap ``max_virtual_s`` was passed."""
        for r in self._reqs:
            if math.isnan(r.finish):
                self._fail(r, now, f"not finished within the twin's virtual time cap "
                                   f"({max_virtual_s:g} s): the workload is far beyond "
                                   "what this config serves (check time_scale)")
        self._pending.clear()
        self._tokenizing.clear()
        self._waiting.clear()
        self._running.clear()
        self._chunked = None

    def _decode(self, until: float) -> None:
        """Run decode steps: one, or a run of them while nothing else could be scheduled.

        The fast path (no chunked request, no arrival due, nothing finished, and no waiting
        request or a full batch) skips the admission attempt between steps; the schedule is the
        same as one step per iteration. A step's CPU side includes the waiting-queue scan of the
        admission pass before it (``self._scan_s``); a batch above the graph max runs eagerly.
        """
        running, pending = self._running, self._pending
        tokenizing, waiting, st = self._tokenizing, self._waiting, self.stats
        budget, mask = self.compute_budget, CHECK_EVERY - 1
        while True:
            if budget is not None and not st.decode_steps & mask:
                budget.check()
            retracted = st.retractions
            n = self._make_room(len(running))
            dt, acc = self._decode_time(n)
            finished = self._decode_commit(n, dt, acc, retracted)
            if (finished or not running or (waiting and not self._full)
                    or self._chunked is not None or self.now >= until
                    or (pending and pending[0].arrival <= self.now)
                    or (tokenizing and tokenizing[0].ready <= self.now)):
                return

    def _decode_time(self, n: int) -> tuple[float, float]:
        """``(seconds, tokens per request)`` of the next decode step of batch ``n``.

        Counts the step's all-reduce, roofline and eager statistics (the step will run).
        """
        cost, spec, st = self.cost, self.lim.spec, self.stats
        ctx = int(self._ctx_running)
        steps = steps_for_batch(spec, n) if spec is not None else 0
        if spec is not None and steps > 0:
            acc = accept_length(spec, n)
            draft = draft_tokens_for_batch(spec, n)
            dt = (cost.verify_time(n, draft, ctx)
                  + cost.draft_time(n, steps, spec.topk, ctx, draft))
            st.decode_allreduce_s += cost.decode_allreduce_time(n, draft, steps, spec.topk)
            self._uses_spec = True
        else:
            acc = 1.0
            dt = cost.decode_time(n, ctx)
            st.decode_allreduce_s += cost.decode_allreduce_time(n)
        if self._scan_s:  # the admission pass's queue scan, on the CPU side of the step
            dt = max(dt, cost.cpu_time(n) + self._scan_s)
            self._scan_s = 0.0
        if cost.eager(n):
            st.eager_decode_steps += 1
        st.waiting_sum += len(self._waiting)
        st.decode_roofline_s += acc * cost.decode_roofline_time(n, ctx)
        return dt, acc

    def _decode_commit(self, n: int, dt: float, acc: float, retracted: int) -> bool:
        """Run the decode step of batch ``n`` lasting ``dt`` s; True if a request finished.

        ``retracted``: the retraction count before the step's room was made (the new-token
        ratio decays only on a step without retraction).
        """
        running, heap, st = self._running, self._heap, self.stats
        T, C = self._T, self._C
        self.now += dt
        T.append(self.now)
        C.append(C[-1] + acc)
        st.decode_steps += 1
        st.decode_batch_sum += n
        st.count_load(n + len(self._waiting), dt)
        st.spec_tokens += n * acc
        if n > st.max_running:
            st.max_running = n
        st.busy_s += dt
        st.decode_busy_s += dt
        grown = n * acc
        self._priv_running += grown
        self._ctx_running += grown
        self._rem_out -= grown
        if st.retractions == retracted:  # decays on a step without retraction (4542)
            self._ratio = max(self._min_ratio, self._ratio - self._decay)
        k = len(T)  # C[k] is the cumulative count after this step
        finished = False
        while heap and heap[0][0] <= C[k] + _EPS:
            _, ep, idx = heapq.heappop(heap)
            done = running.get(idx)
            if done is None or done.epoch != ep:
                continue
            self._leave_running(done)
            done.segments.append((done.seg_start, k, done.output - done.seg_gen))
            done.generated = done.output
            self._finish(done, self.now)
            finished = True
        return finished

    # ------------------------------------------------------------------ helpers
    def _free(self) -> float:
        dev = self.cache.device_tokens if self.cache else 0
        chunk_priv = self._chunked.private if self._chunked is not None else 0.0
        return self.lim.kv_tokens - dev - self._priv_running - chunk_priv - self._held_kv

    def _evictable(self) -> int:
        return self.cache.evictable_tokens if self.cache else 0

    def _ensure_free(self, tokens: float) -> None:
        short = tokens - self._free()
        if short > 0 and self.cache is not None:
            self.cache.evict(math.ceil(short))

    def _usable_blocks(self, r: _Req) -> tuple[int, int]:
        """(device, host) leading blocks of ``r`` the cache can serve now."""
        if self.cache is None or not r.path:
            return 0, 0
        nd, nh = self.cache.match(r.path)
        cap = (r.input - 1) // r.block  # at least the last prompt token is recomputed
        nd = min(nd, cap)
        nh = min(nh, cap - nd)
        page = self.lim.page_size
        if page > r.block:  # whole pages only: the matched tokens rounded down to the page
            keep = (nd + nh) * r.block // page * page // r.block
            nd, nh = min(nd, keep), keep - min(nd, keep)
        return nd, nh

    def _scanned(self, waiting: int) -> float:
        """Waiting requests one admission pass matches against the radix tree (on average).

        SGLang 0.5.23 ``managers/schedule_policy.py:213-302`` ``calc_priority``: LPM matches
        every waiting request (``_compute_prefix_matches``) while the queue holds at most 128,
        and falls back to FCFS above (``_determine_active_policy``, 304-314). FCFS matches none
        with the default radix cache (``supports_fast_match_prefix`` is False,
        ``mem_cache/base_prefix_cache.py:449``) and only refreshes the recency of the first 128
        waiting prefixes every 32nd pass (``_touch_waiting_prefixes``, 282-302): 128 / 32 = 4
        per pass on average. No radix cache: no match at all.
        """
        if self.cache is None:
            return 0.0
        if self.lim.schedule_policy == "lpm" and waiting <= LPM_MAX_WAITING:
            return float(waiting)
        return min(waiting, LPM_MAX_WAITING) / WAITING_PREFIX_REFRESH_INTERVAL

    def _lpm_order(self) -> None:
        w = self._waiting
        if not self._lpm_dirty or len(w) > LPM_MAX_WAITING or len(w) < 2:
            return
        keyed = sorted(w, key=lambda r: -sum(self._usable_blocks(r)) * r.block)
        w.clear()
        w.extend(keyed)
        self._lpm_dirty = False

    def _admit(self) -> tuple[list[tuple[_Req, int]], int]:
        """Form the next prefill batch: [(request, new tokens this step)], host tokens loaded.

        A pass follows SGLang 0.5.23's ``get_new_batch_prefill`` (``managers/scheduler.py``):
        it is skipped while the running batch is full (``batch_is_full``, 4098-4101: set when
        no request slot is left, 4118-4126 and 4230-4234, or when the queue's head did not fit
        the KV, 4276-4284; cleared when a request leaves the batch or the batch is empty,
        3951-3968, 4094-4096, 4544-4545) -- so a KV-bound or slot-bound server does not retry
        admission on every decode step. A pass that runs computes the queue's priority
        (``calc_priority``, 4129: radix matches of waiting requests, :meth:`_scanned`); its CPU
        time ``waiting_request_overhead_s x`` requests matched is kept in ``self._scan_s`` for
        the step it forms (or the decode step that follows).
        """
        lim, waiting, cache = self.lim, self._waiting, self.cache
        chunks: list[tuple[_Req, int]] = []
        left = self._budget
        chunked = self._chunked
        self._scan_s = 0.0
        if not self._running:
            self._full = False
        if chunked is None and (self._full or not waiting):
            return chunks, 0
        n_slots = len(self._running) + (1 if chunked is not None else 0) + len(self._held)
        if chunked is None and n_slots >= lim.max_running_requests:
            self._full = True
            return chunks, 0
        self._scan_s = self.cost.scan_time(self._scanned(len(waiting)))
        if chunked is not None:
            c = min(chunked.target - chunked.prefilled, left)
            chunks.append((chunked, c))
            left -= c
        if lim.schedule_policy == "lpm" and cache is not None:
            self._lpm_order()
        ratio = self._ratio
        # KV the chunked request still needs for its prompt, plus its decode reservation
        held = (chunked.target - chunked.prefilled + ratio * (chunked.output - chunked.generated)) \
            if chunked is not None else 0.0
        loaded = 0
        while waiting and left > 0 and n_slots < lim.max_running_requests:
            r = waiting[0]
            nd, nh = self._usable_blocks(r)
            cached = (nd + nh) * r.block
            avail = self._free() + self._evictable() - held - ratio * self._rem_out
            need = (r.target - cached) + nh * r.block + ratio * (r.output - r.generated)
            if need > avail:  # NO_TOKEN: full if anything runs or was just admitted
                self._full = bool(chunks) or bool(self._running)
                break
            waiting.popleft()
            self._lpm_dirty = True
            if cache is not None and nd + nh:
                cache.lock(r.path[:nd], self.now)
                if nh:
                    self._ensure_free(nh * r.block)
                    loaded += cache.load_back(r.path, nd, nh, self.now)
                    cache.lock(r.path[nd:nd + nh], self.now)
            r.locked = nd + nh
            r.cached = cached
            r.prefilled = cached
            r.private = 0.0
            self.stats.prompt_tokens += r.input
            self.stats.cached_tokens += min(cached, r.input)
            self.stats.host_loaded_tokens += nh * r.block
            c = min(r.target - cached, left)
            chunks.append((r, c))
            left -= c
            n_slots += 1
            held += need
            if c < r.target - cached:
                self._chunked = r  # this one continues in the next prefill batch
        if waiting and left > 0 and n_slots >= lim.max_running_requests:
            self._full = True  # every slot taken (scheduler.py:4230-4234)
        return chunks, loaded

    def _prefill(self, chunks: list[tuple[_Req, int]], loaded: int, topk: int) -> None:
        self._prefill_commit(chunks, self._prefill_time(chunks, loaded, topk))

    def _prefill_shape(self, chunks: list[tuple[_Req, int]], topk: int
                       ) -> tuple[int, float, float]:
        """(new tokens, attention pairs, indexer pairs) of a prefill step; evicts room for it."""
        new_tok = sum(c for _, c in chunks)
        attn = index = 0.0
        for r, c in chunks:
            ctx = r.prefilled + c / 2
            attn += c * (min(ctx, topk) if topk else ctx)
            index += c * ctx if topk else 0.0
        self._ensure_free(new_tok)
        return new_tok, attn, index

    def _prefill_time(self, chunks: list[tuple[_Req, int]], loaded: int, topk: int) -> float:
        """Seconds the prefill step of ``chunks`` takes (evicting the cache for its tokens)."""
        new_tok, attn, index = self._prefill_shape(chunks, topk)
        dt = self.cost.prefill_time(new_tok, attn, index)
        if self.lim.spec is not None:  # the draft layers extend over the same prompt tokens
            dt += self.cost.draft_prefill_time(new_tok, attn, index, len(chunks))
        if loaded:  # HiCache load-back before the forward (not overlapped: conservative)
            dt += self.cost.host_load_time(loaded)
        return max(dt, self._scan_s)  # the pass that formed the batch overlaps the GPU work

    def _prefill_commit(self, chunks: list[tuple[_Req, int]], dt: float) -> None:
        """Run the prefill step of ``chunks`` lasting ``dt`` s: first tokens, joins, finishes."""
        self.now += dt
        now = self.now
        self.stats.prefill_steps += 1
        self.stats.waiting_sum += len(self._waiting)
        self.stats.busy_s += dt
        self.stats.count_load(len(self._running) + len(self._waiting) + len(chunks), dt)
        for r, c in chunks:
            r.prefilled += c
            r.private += c
            if r.prefilled < r.target:
                continue  # still chunked (it is self._chunked)
            if r is self._chunked:
                self._chunked = None
            self._insert_prompt(r, now)
            r.generated += 1  # prefill complete: it yields one token
            if math.isnan(r.first_token):
                r.first_token = now
            else:  # recomputation after a retraction also yields the next token
                r.segments.append((-1, -1, 1))
                r.reprefill_times.append(now)
            if self._role == "prefill":  # PD: its KV waits for the transfer (set_role)
                self._hold(r, now)
                continue
            if r.generated >= r.output:
                r.segments.append((0, 0, 0))
                self._release(r)
                self._finish(r, now)
                self._full = False  # it left the batch (scheduler.py:3951)
                continue
            self._join_running(r)

    def _insert_prompt(self, r: _Req, now: float) -> None:
        """Put the prompt's full blocks in the cache; their private copy becomes shared."""
        if self.cache is None or not r.path:
            return
        n_full = r.input // r.block
        if n_full > r.locked:
            self.cache.insert(r.path[:n_full], r.locked, r.block, now)
            self.cache.lock(r.path[r.locked:n_full], now)
            r.private -= (n_full - r.locked) * r.block
            r.locked = n_full

    def _join_running(self, r: _Req) -> None:
        k = len(self._T)
        r.seg_start, r.seg_gen = k, r.generated
        self._running[r.idx] = r
        self._priv_running += r.private
        self._ctx_running += r.input + r.generated
        self._rem_out += r.output - r.generated
        self._out_running += r.output
        heapq.heappush(self._heap, (self._C[k] + r.output - r.generated, r.epoch, r.idx))

    def _leave_running(self, r: _Req) -> float:
        """Remove ``r`` from the running batch; returns the tokens it decoded in this segment."""
        del self._running[r.idx]
        decoded = self._C[len(self._T)] - self._C[r.seg_start]
        self._priv_running -= r.private + decoded
        self._ctx_running -= r.input + r.seg_gen + decoded
        self._rem_out -= r.output - r.seg_gen - decoded
        self._out_running -= r.output
        self._full = False  # a request left the batch: admission may try again
        self._release(r)
        return decoded

    def _release(self, r: _Req) -> None:
        """Unlock ``r``'s cached prefix; its private KV is freed by the caller's accounting."""
        if self.cache is not None and r.locked:
            self.cache.unlock(r.path[:r.locked], self.now)
        r.locked = 0
        r.private = 0.0

    def _make_room(self, n: int) -> int:
        """Evict cache, then retract, until the next decode step's KV fits; returns batch size.

        SGLang 0.5.23 ``managers/schedule_batch.py:3451-3539`` ``retract_decode``: at least one
        request, then until the rest fit (``check_decode_mem``), fewest output tokens first and
        the longest prompt among equals (``_get_decode_retraction_order``, 3542-3556). A victim
        frees its KV without inserting it into the radix cache (its prompt, cached at prefill,
        stays there unlocked, so it may be evicted before it comes back) and the cache is evicted
        until ``RETRACT_DECODE_STEPS`` tokens per remaining request are free (``release_req``,
        2360-2395). The victim goes to the back of the waiting queue (``scheduler.py:3493``) and
        is recomputed later: prompt + generated tokens, less what the cache still holds. The
        new-token ratio becomes (tokens decoded + 20 x batch) / (max new tokens + 1) of the
        requests kept (``new_token_ratio_tracker.py:41-49``, ``scheduler.py:4513``).
        """
        spec = self.lim.spec
        per_req = (spec.draft_tokens if spec is not None else 1)
        self._ensure_free(n * per_req)
        running = self._running
        while self._free() < n * per_req and len(running) > 1:
            k_now = len(self._T)
            C = self._C
            # the last of equals in batch order: SGLang sorts stably, descending, and pops the end
            victim = min(reversed(running.values()),
                         key=lambda x: (x.seg_gen + C[k_now] - C[x.seg_start], -x.input))
            decoded = self._leave_running(victim)
            gained = int(decoded + _EPS)
            victim.segments.append((victim.seg_start, k_now, gained))
            victim.generated = victim.seg_gen + gained
            victim.epoch += 1
            victim.target, victim.prefilled = victim.input + victim.generated, 0
            self._waiting.append(victim)
            self._lpm_dirty = True
            self.stats.retractions += 1
            self.stats.retracted_tokens += victim.input + victim.generated
            n = len(running)
            self._ensure_free(max(n * per_req, n * RETRACT_DECODE_STEPS))
            decoded_sum = self._out_running - self._rem_out
            self._ratio = min(1.0, (decoded_sum + RETRACT_DECODE_STEPS * n)
                              / (self._out_running + 1))
        return n

    def _finish(self, r: _Req, t: float) -> None:
        r.finish = t
        seen = t + self._fixed  # the client has the last token
        self._finish_times.append(seen)
        self._finish_order.append(r.idx)
        closed = self._closed
        if closed is not None and seen < closed[0] and (
                not self._max_requests or len(self._reqs) < self._max_requests):
            nr = _Req(idx=len(self._reqs), arrival=seen, input=closed[1], output=closed[2],
                      path=[], block=0, target=closed[1])
            self._reqs.append(nr)
            pending, i = self._pending, 0
            while i < len(pending) and pending[i].arrival < seen:  # keep arrival order
                i += 1
            pending.insert(i, nr)

    def _fail(self, r: _Req, t: float, message: str) -> None:
        r.error, r.finish = message, t
        last = self._finish_times[-1] if self._finish_times else t
        self._finish_times.append(max(t, last))  # kept sorted for finished_by()
        self._finish_order.append(r.idx)

    # ------------------------------------------------------------------ PD roles
    def set_role(self, role: str, extra_slots: int = 0, reserved_decode_tokens: int = 0) -> None:
        """Make this engine one server of a prefill/decode layout (:mod:`domain.twin.pd`).

        ``"prefill"``: a request leaves the batch once its prefill yields the first token but
        keeps its KV (and its cache locks) and its request slot until :meth:`release_held` (its
        KV transfer ended); :meth:`ended_since` reports it at the prefill's end. SGLang 0.5.23
        ``disaggregation/prefill.py``: ``process_batch_result_disagg_prefill`` (901) moves it
        to the inflight queue, ``process_disagg_prefill_inflight_queue`` (1151-1250) frees its
        KV on ``KVPoll.Success``; the rows it holds count against admission
        (``managers/scheduler.py:4027-4050`` ``get_num_allocatable_reqs``).

        ``"decode"``: requests arrive prefilled: :meth:`prealloc_fits` and :meth:`preallocate`
        reserve a request slot and the prompt's KV before the transfer, :meth:`join_prefilled`
        hands the request over when its KV has arrived (SGLang ``disaggregation/decode.py``).

        Args:
            role: ``"prefill"`` or ``"decode"``.
            extra_slots: decode: request slots beyond ``max_running_requests`` for requests
                preallocated or in transfer (``--disaggregation-decode-extra-slots``).
            reserved_decode_tokens: decode: KV tokens reserved per active request by the
                preallocation budget (``--num-reserved-decode-tokens``).

        Raises:
            ValueError: for another role.
        """
        if role not in ("prefill", "decode"):
            raise ValueError(f"unknown PD role {role!r}: prefill or decode")
        self._role = role
        self._pd_extra_slots = extra_slots
        self._pd_reserved = reserved_decode_tokens

    @property
    def pd_reserved_tokens(self) -> int:
        """Decode role: KV tokens the preallocation budget reserves per active request."""
        return self._pd_reserved

    def release_held(self, idx: int, t: float) -> None:
        """Prefill role: request ``idx``'s KV transfer ended at ``t``: free its KV and slot.

        The KV is freed at the engine's next iteration boundary at or after ``t`` (the
        inflight queue is polled once per scheduler loop, ``prefill.py:684-722``); an idle
        engine moves to ``t``. Its cached prefix stays in the radix cache, unlocked.
        """
        r = self._held.pop(idx)
        self._held_kv -= r.private
        self._release(r)
        self._full = False
        self._stalled = False
        if not (self._running or self._chunked is not None) and self.now < t:
            self.now = t

    def prealloc_fits(self, input_tokens: int, output_tokens: int) -> bool:
        """Decode role: whether preallocation admits one more request now.

        SGLang 0.5.23 ``disaggregation/decode.py`` ``pop_preallocated`` (1333-1620, FIFO, the
        queue stops at the first request that does not fit): a free request row
        (``max_running_requests + extra_slots`` rows, ``DecodeReqToTokenPool`` 171-216) and
        ``required <= allocatable`` with (radix cache off on decode servers)

        - ``required = max(input + reserved, input + output - retractable)``
          (``_required_admission_tokens``, 508-517),
        - ``allocatable = free KV - max(reserved x active, max over the running batch of
          (input + output) - retractable)`` (``_allocatable_token_budgets`` and
          ``_need_space_for_single_req``, 2027-2137),

        where ``retractable`` = prompt + generated tokens of the running batch and ``active``
        = requests running, preallocated, in transfer or waiting.
        """
        running = self._running
        active = (len(running) + len(self._held) + len(self._transferred) + len(self._waiting)
                  + (1 if self._chunked is not None else 0))
        if active >= self.lim.max_running_requests + self._pd_extra_slots:
            return False
        retractable = self._ctx_running
        # the running batch changes only on a join, a finish, a retraction or a re-prefill
        key = (self._pd_joins, len(self._finish_order), self.stats.retractions,
               self.stats.prefill_steps)
        if key != self._pd_max_key:
            self._pd_max_key = key
            self._pd_max_total = max((x.input + x.output for x in running.values()), default=0)
        single = self._pd_max_total - retractable if running else 0.0
        allocatable = self._free() + self._evictable() - max(self._pd_reserved * active,
                                                             single)
        required = max(input_tokens + self._pd_reserved,
                       input_tokens + output_tokens - retractable)
        return required <= allocatable

    def preallocate(self, t: float, input_tokens: int, output_tokens: int) -> int:
        """Decode role: reserve a slot and ``input_tokens`` of KV for a request at ``t``.

        Returns:
            The request's index in :meth:`records` (its arrival there is ``t``).
        """
        r = _Req(idx=len(self._reqs), arrival=t, input=input_tokens, output=output_tokens,
                 path=[], block=0, target=input_tokens)
        self._reqs.append(r)
        r.private = float(input_tokens)
        self._held[r.idx] = r
        self._held_kv += r.private
        return r.idx

    def join_prefilled(self, idx: int, t: float) -> None:
        """Decode role: request ``idx``'s KV arrived at ``t``; it joins the running batch.

        It joins at the engine's next iteration boundary at or after ``t`` while the batch has
        room (``_get_new_prebuilt_batch``, ``decode.py:3375-3456``: up to
        ``max_running_requests`` running), with the first token (computed by the prefill
        server) streamed then (``process_batch_result_prebuilt``,
        ``managers/scheduler_components/batch_result_processor.py:117-134``): that is its
        first-token time; no forward runs for it.
        """
        r = self._held.pop(idx)
        if not self.busy:
            self.now = max(self.now, t)
        self._transferred.append(r)
        self._stalled = False

    def _join_transferred(self) -> None:
        cap, now = self.lim.max_running_requests, self.now
        while self._transferred and len(self._running) < cap:
            r = self._transferred.popleft()
            self._pd_joins += 1
            self._held_kv -= r.private
            r.prefilled = r.target = r.input
            r.generated = 1
            r.first_token = now
            self.stats.prompt_tokens += r.input
            if r.generated >= r.output:
                r.segments.append((0, 0, 0))
                r.private = 0.0
                self._finish(r, now)
                continue
            self._join_running(r)

    def _hold(self, r: _Req, now: float) -> None:
        """Prefill role: ``r`` produced its first token; it keeps its KV until released."""
        r.segments.append((0, 0, 0))
        r.finish = now
        last = self._finish_times[-1] if self._finish_times else now
        self._finish_times.append(max(now, last))
        self._finish_order.append(r.idx)
        self._held[r.idx] = r
        self._held_kv += r.private

    # ------------------------------------------------------------------ results
    def records(self) -> list[RequestRecord]:
        """One record per submitted request, in submission order (virtual seconds).

        Raises:
            ComputeBudgetExceeded: the engine's budget ran out or was cancelled.
        """
        T = np.asarray(self._T)
        C = np.asarray(self._C)
        out = []
        budget, mask = self.compute_budget, CHECK_EVERY - 1
        for k, r in enumerate(self._reqs):
            if budget is not None and not k & mask:
                budget.check()
            if r.error is not None or math.isnan(r.finish):
                out.append(RequestRecord(arrival_s=r.arrival, input_tokens=r.input,
                                         output_tokens=0,
                                         error=r.error or "request did not finish"))
                continue
            out.append(RequestRecord(
                arrival_s=r.arrival, first_token_s=r.first_token + self._fixed,
                finish_s=r.finish + self._fixed,
                input_tokens=r.input, output_tokens=r.output,
                itl_s=self._itl(r, T, C)))
        return out

    def _itl(self, r: _Req, T: np.ndarray, C: np.ndarray) -> np.ndarray:
        if not self._uses_spec:
            parts = [np.array([r.first_token])]
            re = iter(r.reprefill_times)
            for a, b, _ in r.segments:
                if a < 0:
                    parts.append(np.array([next(re)]))
                elif b > a:
                    parts.append(T[a:b])
            return np.diff(np.concatenate(parts))
        # chunks of several tokens per step: spread each chunk's gap over its tokens
        t_prev = r.first_token
        gaps: list[np.ndarray] = []
        re = iter(r.reprefill_times)
        for a, b, tokens in r.segments:
            if a < 0:
                t = next(re)
                gaps.append(np.array([t - t_prev]))
                t_prev = t
                continue
            if b <= a or tokens <= 0:
                continue
            cum = np.minimum(np.floor(C[a + 1:b + 1] - C[a] + _EPS), tokens)
            emitted = np.diff(cum, prepend=0.0).astype(np.int64)
            steps = np.nonzero(emitted)[0]
            times = T[a:b][steps]
            counts = emitted[steps]
            deltas = np.diff(times, prepend=t_prev) / counts
            gaps.append(np.repeat(deltas, counts))
            t_prev = float(times[-1]) if times.size else t_prev
        return np.concatenate(gaps) if gaps else np.zeros(0)


def new_cache(limits: EngineLimits, index: PathIndex | None = None) -> PrefixCache | None:
    """The prefix cache of one replica with ``limits`` (None when the radix cache is off).

    Args:
        limits: the replica's limits (radix cache on/off, HiCache host tokens).
        index: the run's shared path index (a fresh one when None).
    """
    if not limits.radix_cache:
        return None
    return PrefixCache(index or PathIndex(), host_capacity_tokens=limits.host_kv_tokens)
