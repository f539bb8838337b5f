"""Schedulers inside one server: data-parallel ranks behind SGLang's DP controller.

A server with ``dp_size`` full copies or ``attn_dp_size`` attention-DP ranks runs
``config.schedulers`` schedulers (SGLang 0.5.23 ``runtime_context.py:202-207``
``num_dp_ranks_of``: ``dp_size x attn_dp_size``, one of the two being 1), each with its own
waiting queue, request cap and KV pool (:func:`domain.twin.cluster.scheduler_limits`). One
tokenizer-manager process tokenizes every request of the server and hands it to the one
``DataParallelController`` process (``managers/data_parallel_controller.py``), which sends it
to one rank by ``--load-balance-method``:

- ``auto`` resolves to ``round_robin`` for a colocated server and a PD decode server, and to
  ``follow_bootstrap_room`` for a PD prefill server (``arg_groups/serving_hook.py:217-236``
  ``handle_load_balance_method``), for attention DP and ``dp_size`` alike.
- ``round_robin``: the next rank in turn (``round_robin_scheduler``, 880-899).
- ``total_requests``: the rank with the fewest running + waiting requests, the first of equals
  (``DPBudget.dispatch``, 140-155, ``update_budget``, 129-138); ``total_tokens``: the fewest
  KV tokens in use plus tokens of queued requests, ties to fewer requests. Each dispatch adds
  one request (and its prompt tokens) to the chosen rank's count; the counts are re-read from
  the ranks at most every 20 ms (``refresh_load_budget``, 346-361), so a burst inside 20 ms is
  spread by those increments. The twin re-reads the ranks' load at that moment; SGLang's ranks
  publish it after each prefill, when idle and every 15th decode step
  (``--load-snapshot-publish-interval`` 15, ``scheduler.py:871-889``), a staleness the twin
  leaves out.
- ``follow_bootstrap_room``: the rank ``bootstrap_room mod ranks``; the router draws the room
  at random per request, so the twin draws the rank uniformly (seeded).

Attention-DP ranks step together: every rank joins each forward for the MoE's collectives
(``managers/scheduler_components/dp_attn.py:519-700`` ``prepare_mlp_sync_batch_raw``: the
ranks all-gather their token counts and a rank without work runs an idle batch while any rank
has one). :class:`DPServer` therefore advances its attention-DP ranks in lockstep: each forms
its iteration (:meth:`TwinEngine.plan_step`), the server prices the forward they share
(:meth:`DPServer._price`) and every rank's clock moves by it (:meth:`TwinEngine.commit_step`).
The cost model prices one rank whose peers run the same batch (its MoE sees ``ranks x`` the
rank's tokens), so a shared step is priced at an equivalent uniform batch: a decode-only step
at the largest rank's batch and KV read (the decode CUDA graph pads every rank to the largest
batch, ``layers/dp_attention.py:185-201``, MAX_LEN); a step with a prefill on any rank, whose
MoE gathers the sum of the ranks' tokens (SUM_LEN for extend), as a rank's prefill of the mean
tokens per rank with the slowest rank's attention pairs, and no shorter than the decode ranks'
step. ``dp_size`` copies are independent TP groups (``launch_dp_schedulers``, 420-467) and are
simulated independently.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from collections.abc import Callable

from domain.costmodel import StepCostModel
from domain.metrics import RequestRecord
from domain.twin.budget import CHECK_EVERY
from domain.twin.engine import EngineLoad, EngineStats, RequestProgress, StepShape, TwinEngine

# data_parallel_controller.py:358 refresh_load_budget: at most one re-read per 20 ms
LOAD_REFRESH_S = 0.02
METHODS = ("auto", "round_robin", "total_requests", "total_tokens", "follow_bootstrap_room")
LOAD_AWARE = ("total_requests", "total_tokens")


def resolve_method(method: str | None, disaggregation_mode: str = "null") -> str:
    """The dispatch ``--load-balance-method`` (None = ``auto``) resolves to.

    Raises:
        ValueError: an unknown method.
    """
    m = method or "auto"
    if m not in METHODS:
        raise ValueError(f"Invalid load balance method: {m.upper()}")
    if m == "auto":
        return "follow_bootstrap_room" if disaggregation_mode == "prefill" else "round_robin"
    return m


class DPController:
    """Chooses the scheduler (rank) of each request, as SGLang's DP controller does.

    Args:
        method: a resolved method (:func:`resolve_method`).
        ranks: schedulers behind it (>= 1).
        seed: seed of ``follow_bootstrap_room``'s draws.
    """

    def __init__(self, method: str, ranks: int, seed: int = 0) -> None:
        if method not in METHODS or method == "auto":
            raise ValueError(f"unresolved or unknown load balance method {method!r}")
        self.method, self.ranks = method, ranks
        self._rr = 0
        self._rng = random.Random(seed)
        self.requests = [0] * ranks  # DPBudget.total_requests
        self.tokens = [0.0] * ranks  # DPBudget.total_tokens
        self._refreshed = -math.inf

    @property
    def load_aware(self) -> bool:
        """Whether a pick reads the ranks' load."""
        return self.method in LOAD_AWARE

    def pick(self, now: float, input_tokens: int,
             loads: Callable[[], list[EngineLoad]] | None = None) -> int:
        """Rank index for one request dispatched at virtual time ``now`` (s).

        Args:
            now: dispatch time, s (the 20 ms refresh throttle runs on it).
            input_tokens: prompt tokens (``total_tokens``' estimate for the request).
            loads: every rank's current load, read when the counts are refreshed (required for
                the load-aware methods).
        """
        if self.ranks == 1:
            return 0
        if self.method == "round_robin":
            k = self._rr
            self._rr = (k + 1) % self.ranks
            return k
        if self.method == "follow_bootstrap_room":
            return self._rng.randrange(self.ranks)
        if now - self._refreshed >= LOAD_REFRESH_S:
            assert loads is not None, "a load-aware method needs the ranks' loads"
            self._refreshed = now
            for i, ld in enumerate(loads()):
                self.requests[i] = ld.running + ld.queued
                self.tokens[i] = ld.used_kv_tokens + ld.queued_tokens
        if self.method == "total_requests":
            k = self.requests.index(min(self.requests))
        else:
            k = min(range(self.ranks), key=lambda i: (self.tokens[i], self.requests[i]))
        self.requests[k] += 1
        self.tokens[k] += input_tokens
        return k


class DPServer:
    """One server of several schedulers: its tokenizer, the DP controller and the ranks.

    Offers what :mod:`domain.twin.cluster` uses of a :class:`TwinEngine` (``submit``,
    ``advance``, ``busy``, ``finished_by``, ``ended_since``, ``records``) so the router in front
    treats it as one worker.

    Args:
        ranks: the rank engines, each built with ``tokenize=False`` (the server tokenizes).
        controller: the DP controller over them.
        lockstep: attention-DP ranks (step together) rather than independent ``dp_size`` copies.
        tokenize_time: seconds the server's one tokenizer takes for a prompt of n tokens
            (None: no tokenizer cost, as an engine whose cost model has none).
        fits: whether a request of (input, output) tokens fits a rank (else it fails at its
            arrival without taking the tokenizer, as in the engine).
    """

    def __init__(self, ranks: list[TwinEngine], controller: DPController, lockstep: bool,
                 tokenize_time: Callable[[float], float] | None,
                 fits: Callable[[int, int], bool]) -> None:
        self.ranks, self.controller, self.lockstep = ranks, controller, lockstep
        self._tokenize, self._fits = tokenize_time, fits
        self.now = 0.0
        self._tok_free = 0.0
        self._queue: deque[tuple[float, int]] = deque()  # (ready s, request) not dispatched
        self._arrival: list[float] = []
        self._req: list[tuple[int, int, tuple[int, ...], int]] = []
        self._where: list[tuple[int, int]] = []  # (rank, index in the rank) per request
        self.sent = [0] * len(ranks)
        self._seen = [0] * len(ranks)
        self._ended: list[tuple[int, float]] = []  # (request, end s) in the order collected
        self._rank_req: list[list[int]] = [[] for _ in ranks]  # rank index -> request
        self._aborted: dict[int, str] = {}  # dropped before reaching a rank -> message
        self._aborted_at: list[float] = []  # their drop times (non-decreasing)
        self._by_batch: dict[int, tuple[float, bool]] = {}  # decode batch -> (all-reduce, eager)

    # ------------------------------------------------------------------ worker API
    def submit(self, arrival_s: float, input_tokens: int, output_tokens: int,
               path: tuple[int, ...] | list[int] = (), block_tokens: int = 0) -> int:
        """Queue one request at the server (arrivals non-decreasing); returns its index."""
        k = len(self._arrival)
        self._arrival.append(arrival_s)
        self._req.append((input_tokens, output_tokens, tuple(path), block_tokens))
        self._where.append((-1, -1))
        ready = arrival_s
        if self._fits(input_tokens, output_tokens):  # the one tokenizer, FIFO (engine.py)
            ready = max(arrival_s, self._tok_free)
            if self._tokenize is not None:
                ready += self._tokenize(input_tokens)
            self._tok_free = ready
        self._queue.append((ready, k))
        return k

    @property
    def busy(self) -> bool:
        """Whether a submitted request is not finished."""
        return bool(self._queue) or any(e.busy for e in self.ranks)

    def finished_by(self, t: float) -> int:
        """Requests that ended at or before ``t`` (over every rank)."""
        return (sum(e.finished_by(t) for e in self.ranks)
                + bisect.bisect_right(self._aborted_at, t))

    @property
    def next_event_s(self) -> float:
        """Virtual time of the server's next decision: a rank's, or a request's dispatch.

        Lockstep ranks take a dispatched request at a step's boundary, not before the server's
        clock (the end of the step simulated last).
        """
        t = self._queue[0][0] if self._queue else math.inf
        if self.lockstep and t < self.now:
            t = self.now
        for e in self.ranks:
            if e.busy:
                t = min(t, e.next_event_s)
        return t

    def progress(self, idx: int, since: int = 0) -> RequestProgress:
        """Token times request ``idx`` has so far (:meth:`TwinEngine.progress`)."""
        if idx in self._aborted:
            return RequestProgress([], True, self._aborted[idx], 0)
        rank, j = self._where[idx]
        if rank < 0:  # in the tokenizer or the controller
            return RequestProgress([], False, None, 0)
        return self.ranks[rank].progress(j, since)

    def abort(self, idx: int, message: str = "aborted by the client") -> bool:
        """Drop request ``idx`` now (:meth:`TwinEngine.abort`); False if it had ended."""
        rank, j = self._where[idx]
        if rank >= 0:
            return self.ranks[rank].abort(j, message)
        if idx in self._aborted:
            return False
        self._queue = deque(x for x in self._queue if x[1] != idx)
        self._aborted[idx] = message
        self._aborted_at.append(max([self.now, *self._aborted_at[-1:]]))
        return True

    def load(self) -> EngineLoad:
        """The server's gauges: its ranks' summed, requests not yet at a rank as queued."""
        per = self.loads()
        queued = self._queue
        return EngineLoad(running=sum(x.running for x in per),
                          queued=sum(x.queued for x in per) + len(queued),
                          used_kv_tokens=sum(x.used_kv_tokens for x in per),
                          kv_tokens=sum(x.kv_tokens for x in per),
                          queued_tokens=sum(x.queued_tokens for x in per)
                          + sum(self._req[k][0] for _, k in queued))

    def ended_since(self, n: int) -> list[tuple[int, float]]:
        """(request index, end time s) of the requests that ended after the first ``n``."""
        self._collect()
        return self._ended[n:]

    def loads(self) -> list[EngineLoad]:
        """Every rank's scheduler state now."""
        return [e.load() for e in self.ranks]

    def rank_stats(self) -> list[tuple[int, EngineStats]]:
        """(requests sent, counters) per rank."""
        return [(self.sent[i], e.stats) for i, e in enumerate(self.ranks)]

    def records(self) -> list[RequestRecord]:
        """One record per submitted request, in submission order, with its server arrival."""
        per = [e.records() for e in self.ranks]
        out = []
        for k, (rank, j) in enumerate(self._where):
            if rank < 0:  # dropped, or still in the tokenizer or the controller
                inp = self._req[k][0]
                out.append(RequestRecord(arrival_s=self._arrival[k], input_tokens=inp,
                                         output_tokens=0,
                                         error=self._aborted.get(k, "request did not finish")))
                continue
            rec = per[rank][j]  # a fresh record: its arrival becomes the server's
            rec.arrival_s = self._arrival[k]
            out.append(rec)
        return out

    # ------------------------------------------------------------------ simulation
    def _dispatch(self, now: float) -> None:
        """Send every tokenized request whose time has come (by ``now``) to its rank."""
        q, ctl = self._queue, self.controller
        while q and q[0][0] <= now:
            ready, k = q.popleft()
            inp, out, path, block = self._req[k]
            if ctl.load_aware and not self.lockstep:
                for e in self.ranks:  # independent copies: their load at the dispatch time
                    e.advance(ready)
            i = ctl.pick(ready, inp, self.loads)
            self.sent[i] += 1
            self._where[k] = (i, self.ranks[i].submit(ready, inp, out, path, block))
            self._rank_req[i].append(k)

    def _collect(self) -> None:
        for i, e in enumerate(self.ranks):
            if e.ended > self._seen[i]:
                new = e.ended_since(self._seen[i])
                self._seen[i] += len(new)
                rr = self._rank_req[i]
                self._ended += [(rr[j], at) for j, at in new]

    def run_closed_loop(self, clients: int, duration_s: float, isl: int, osl: int,
                        max_requests: int = 0) -> int:
        """``clients`` closed-loop clients of this server alone; returns requests sent.

        Each client sends its next request when it has its previous one's last token (the
        request's end, ``request_fixed_s`` after its last iteration), until ``duration_s`` or
        ``max_requests`` (0: no cap), through the tokenizer and the DP controller; then the
        server drains. Exact in event order: attention-DP ranks stop after every step that
        ended a request; ``dp_size`` copies run one iteration at a time, the copy with the
        earliest clock first, so a request sent at ``t`` reaches a copy busy at ``t`` when its
        iteration ends, as on a real server.

        Raises:
            ComputeBudgetExceeded: a rank's budget ran out or was cancelled.
        """
        for _ in range(clients):
            self.submit(0.0, isl, osl)
        issued, seen, last = clients, 0, 0.0
        ranks, q = self.ranks, self._queue
        while self.busy:
            if self.lockstep:
                self.advance(math.inf, stop_on_end=True)
            else:
                t, i = min((e.next_event_s if e.busy else math.inf, k)
                           for k, e in enumerate(ranks))
                if q and q[0][0] <= t:
                    self._dispatch(q[0][0])
                    continue
                ranks[i].advance(math.nextafter(t, math.inf))  # one iteration
            new = self.ended_since(seen)
            seen += len(new)
            for _, at in sorted(new, key=lambda x: x[1]):
                if at < duration_s and (not max_requests or issued < max_requests):
                    last = max(last, at)  # the server takes arrivals in order
                    self.submit(last, isl, osl)
                    issued += 1
        return issued

    def advance(self, until: float, *, max_virtual_s: float = 1e7,
                stop_on_end: bool = False) -> None:
        """Run the server's iterations while virtual time is before ``until``.

        ``stop_on_end`` (attention DP only): return after the first step that ended a request.

        Raises:
            ComputeBudgetExceeded: a rank's budget ran out or was cancelled.
        """
        if not self.lockstep:
            q = self._queue
            while q and q[0][0] < until:
                self._dispatch(q[0][0])
            for e in self.ranks:
                e.advance(until, max_virtual_s=max_virtual_s)
            self.now = max(self.now, until) if math.isfinite(until) else \
                max([self.now, *(e.now for e in self.ranks)])
            return
        ranks, q, cost = self.ranks, self._queue, self.ranks[0].cost
        budget, mask, it = ranks[0].compute_budget, CHECK_EVERY - 1, 0
        while self.now < until:
            it += 1
            if budget is not None and not it & mask:
                budget.check()
            now = self.now
            self._dispatch(now)
            dt = None
            shapes: list[StepShape] = []
            for e in ranks:
                d = e.plan_step(max_virtual_s, shared=True)
                if d is not None and (dt is None or d > dt):
                    dt = d
                if e.step_shape is not None:
                    shapes.append(e.step_shape)
            if shapes:
                gpu = self._price(cost, shapes)
                dt = gpu if dt is None or gpu > dt else dt
            if dt is not None:
                ended = 0
                for e in ranks:
                    if stop_on_end:
                        ended -= e.ended
                    e.commit_step(dt)
                    if stop_on_end:
                        ended += e.ended
                self.now = ranks[0].now
                if ended:
                    return
                continue
            # every rank idle: jump to the next arrival at a rank or dispatch
            nxt = min(q[0][0] if q else math.inf, min(e.next_arrival_s for e in ranks))
            if nxt == math.inf:
                break
            t = max(now, min(nxt, until))
            for e in ranks:
                e.now = t
            self.now = t
            if t < nxt:
                break

    def _price(self, cost: StepCostModel, shapes: list[StepShape]) -> float:
        """GPU seconds of one lockstep forward of the ranks' ``shapes`` (module docstring).

        Decode only: every rank padded to the largest batch (MAX_LEN), so the step is one
        rank's step at the largest batch and the largest KV read. With a prefill on any rank:
        an extend step whose gathered MoE batch is the sum of every rank's tokens (SUM_LEN;
        a decode row is one token), priced as a rank's prefill of the mean tokens per rank
        with the slowest rank's attention pairs (the cost model prices a rank whose peers run
        the same batch), and at least the decode ranks' own step. The decode ranks count the
        decode step's statistics (all-reduce, roofline, eager) at the largest batch.
        """
        dec = [x for x in shapes if not x.extend]
        ext = [x for x in shapes if x.extend]
        gpu = 0.0
        if dec:
            n = max(x.tokens for x in dec)
            ctx = int(max(x.attn for x in dec))
            gpu = cost.decode_time(n, ctx)
            by_n = self._by_batch.get(n)
            if by_n is None:  # functions of the batch alone: computed once per batch size
                by_n = self._by_batch[n] = (cost.decode_allreduce_time(n), cost.eager(n))
            ar, eager = by_n
            roof = cost.decode_roofline_time(n, ctx)
            for e in self.ranks:
                if e.step_shape is not None and not e.step_shape.extend:
                    e.count_shared_decode(ar, roof, eager)
        if ext:
            total = sum(x.tokens for x in shapes)
            mean = max(1, math.ceil(total / len(self.ranks)))
            attn = max(x.attn for x in ext)
            index = max(x.index for x in ext)
            t = cost.prefill_time(mean, attn, index)
            if self.ranks[0].lim.spec is not None:  # the draft layers' extend (engine.py)
                t += cost.draft_prefill_time(mean, attn, index, max(x.chunks for x in ext))
            loaded = max(x.loaded for x in ext)
            if loaded:
                t += cost.host_load_time(loaded)
            gpu = max(gpu, t)
        return gpu
