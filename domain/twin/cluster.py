"""Replicas behind a router: spread a workload over the replicas of a config and simulate them.

Router policies (sglang-router 0.3.2 / smg 1.13.0 semantics, servetune's sglang-knobs reference
section 6.2; ``sgl-router/src/policies/cache_aware.rs``):

- ``round_robin``: request i goes to replica i mod R (also the in-server DP controller's
  ``load_balance_method`` when it resolves from ``auto``). Replicas then do not interact, so each
  is simulated on its own share.
- ``power_of_two``: sample two distinct replicas (seeded), send to the one with fewer in-flight
  requests (the router's own count: routed minus finished).
- ``cache_aware``: the router keeps an approximate prefix tree per replica of everything it sent
  there. If the fleet is imbalanced -- ``max_load - min_load > balance_abs_threshold`` (64) and
  ``max_load > balance_rel_threshold x min_load`` (1.5) -- it sends to the least-loaded replica;
  otherwise to the replica with the longest prefix match when matched / request tokens exceeds
  ``cache_threshold`` (0.3), else to the replica with the smallest tree. The real router matches
  request characters; the twin matches prefix blocks (the traces carry block hashes, not text).
  Its trees are trimmed only to 2^26 nodes (``--max-tree-size``), which a twin run never reaches.

Replicas that interact through the router are simulated in lockstep: before each arrival every
replica advances to the arrival time, so the router sees their load as the real one would.
A closed-loop saturation run gives each replica ``concurrency / R`` clients (the remainder spread
one by one) whatever the policy: synthetic prompts share no prefix and clients are balanced.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel

from domain.config import ServingConfig
from domain.costmodel import build_cost_model
from domain.fit import FitReport
from domain.metrics import RequestRecord
from domain.models import get_model
from domain.speculative import accept_length
from domain.twin.budget import CHECK_EVERY, ComputeBudget, SimCost
from domain.twin.engine import (
    MAX_PREFILL_TOKENS,
    EngineLimits,
    EngineStats,
    TwinEngine,
    new_cache,
)
from domain.twin.prefix_cache import PathIndex

# sglang-router 0.3.2 defaults (router_args.py; sglang-knobs reference 6.3)
CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5
ROUTER_SEED = 0
# Progress callbacks of the simulations: (done, total), called from the simulating thread.
SimProgress = Callable[[int, int], None]
PROGRESS_EVERY = 1000  # requests routed between two open-loop progress calls


class ReplicaStats(BaseModel):
    """Scheduler counters of one replica for one run."""

    replica: int
    requests: int
    prefill_steps: int
    decode_steps: int
    retractions: int
    max_running: int
    mean_decode_batch: float
    busy_s: float
    cache_hit_rate: float = 0.0
    host_loaded_tokens: int = 0
    evicted_tokens: int = 0
    decode_roofline_share: float = 0.0
    decode_allreduce_share: float = 0.0
    mean_accept_length: float = 0.0
    eager_decode_steps: int = 0
    eager_step_share: float = 0.0  # eager decode steps / decode steps
    retracted_tokens: int = 0  # tokens the retracted requests prefill again
    waiting_sum: int = 0  # sum over steps of the waiting-queue length
    mean_inflight: float = 0.0  # requests in flight (running + waiting), time-weighted
    max_inflight: int = 0


def engine_limits(config: ServingConfig, report: FitReport) -> EngineLimits:
    """The scheduler limits and features of one replica of ``config`` with memory ``report``."""
    host_tokens = report.host_kv_tokens if config.enable_hierarchical_cache else 0
    return EngineLimits(
        kv_tokens=report.kv_tokens,
        max_running_requests=report.max_running_requests,
        chunked_prefill_size=report.chunked_prefill_size,
        context_len=report.context_len,
        schedule_conservativeness=(1.0 if config.schedule_conservativeness is None
                                   else config.schedule_conservativeness),
        index_topk=get_model(config.model).index_topk,
        schedule_policy=config.schedule_policy,
        radix_cache=not config.disable_radix_cache,
        host_kv_tokens=host_tokens,
        spec=report.speculative,
        page_size=report.page_size,
    )


def _stats(i: int, n: int, s: EngineStats) -> ReplicaStats:
    return ReplicaStats(replica=i, requests=n, prefill_steps=s.prefill_steps,
                        decode_steps=s.decode_steps, retractions=s.retractions,
                        max_running=s.max_running, mean_decode_batch=s.mean_decode_batch,
                        busy_s=s.busy_s, cache_hit_rate=s.cache_hit_rate,
                        host_loaded_tokens=s.host_loaded_tokens,
                        evicted_tokens=s.evicted_tokens,
                        decode_roofline_share=s.decode_roofline_share,
                        decode_allreduce_share=s.decode_allreduce_share,
                        mean_accept_length=s.mean_accept_length,
                        eager_decode_steps=s.eager_decode_steps,
                        eager_step_share=s.eager_step_share,
                        retracted_tokens=s.retracted_tokens, waiting_sum=s.waiting_sum,
                        mean_inflight=s.mean_inflight, max_inflight=s.max_inflight)


class Router:
    """Chooses a replica per request (see the module docstring for the policies)."""

    def __init__(self, policy: str, replicas: int) -> None:
        self.policy, self.R = policy, replicas
        self._rr = 0
        self._rng = random.Random(ROUTER_SEED)
        self._trees: list[set[int]] = [set() for _ in range(replicas)]
        self._tree_tokens = [0] * replicas

    @property
    def needs_load(self) -> bool:
        """Whether decisions depend on replica load (then replicas run in lockstep)."""
        return self.policy != "round_robin"

    def pick(self, path: Sequence[int], block: int, input_tokens: int,
             loads: Sequence[int]) -> int:
        """Replica index for a request with prefix ``path`` given in-flight ``loads``."""
        R = self.R
        if R == 1:
            choice = 0
        elif self.policy == "round_robin":
            choice = self._rr % R
            self._rr += 1
        elif self.policy == "power_of_two":
            a, b = self._rng.sample(range(R), 2)
            choice = a if loads[a] <= loads[b] else b
        elif self.policy == "cache_aware":
            choice = self._cache_aware(path, block, input_tokens, loads)
        else:
            raise ValueError(f"unknown router policy {self.policy!r}")
        if self.policy == "cache_aware" and path:
            tree = self._trees[choice]
            for nid in path:
                if nid not in tree:
                    tree.add(nid)
                    self._tree_tokens[choice] += block
        return choice

    def _cache_aware(self, path: Sequence[int], block: int, input_tokens: int,
                     loads: Sequence[int]) -> int:
        lo, hi = min(loads), max(loads)
        if hi - lo > BALANCE_ABS_THRESHOLD and hi > BALANCE_REL_THRESHOLD * lo:
            return loads.index(lo)
        best, best_match = 0, -1
        for i, tree in enumerate(self._trees):
            m = 0
            for nid in path:
                if nid not in tree:
                    break
                m += 1
            if m > best_match:
                best, best_match = i, m
        if best_match > 0 and min(best_match * block, input_tokens) / input_tokens \
                > CACHE_THRESHOLD:
            return best
        return min(range(self.R), key=lambda i: self._tree_tokens[i])


def simulate_open_loop(config: ServingConfig, report: FitReport,
                       requests: Sequence[Any], progress: SimProgress | None = None,
                       budget: ComputeBudget | None = None,
                       ) -> tuple[list[RequestRecord], list[ReplicaStats]]:
    """Replay requests at their arrival times on the replicas of ``config`` behind its router.

    Args:
        config: the serving configuration (replicas, router policy, features).
        report: its resolved memory layout (:func:`domain.fit.fit`).
        requests: sorted by arrival; each ``(arrival_s, input_tokens, output_tokens)`` or
            ``(arrival_s, input_tokens, output_tokens, hash_ids, block_tokens)`` (prefix blocks
            for the radix cache and the cache-aware router).
        progress: called as ``progress(done, total)`` every ``PROGRESS_EVERY`` requests routed
            and once per replica drained (``total`` = requests + replicas).
        budget: compute budget checked while simulating (None: unbounded).

    Returns:
        Records in the order of ``requests`` and one ReplicaStats per replica.

    Raises:
        ComputeBudgetExceeded: ``budget`` ran out or was cancelled.
    """
    cost = build_cost_model(config, report)
    lim = engine_limits(config, report)
    R = config.replicas
    index = PathIndex()
    engines = [TwinEngine(cost, lim, new_cache(lim, index), budget) for _ in range(R)]
    router = Router(config.router_policy, R)
    where: list[tuple[int, int]] = []
    sent = [0] * R
    total = len(requests) + R
    for n, req in enumerate(requests):
        if budget is not None and not n % CHECK_EVERY:
            budget.check()
        if progress is not None and n and n % PROGRESS_EVERY == 0:
            progress(n, total)
        arrival, inp, out = req[0], req[1], req[2]
        hashes, block = (req[3], req[4]) if len(req) > 3 else ((), 0)
        path = index.path(hashes) if block and (lim.radix_cache or router.needs_load) else []
        if router.needs_load and R > 1:
            for e in engines:
                e.advance(arrival)
            loads = [sent[i] - engines[i].finished_by(arrival) for i in range(R)]
        else:
            loads = sent
        i = router.pick(path, block, inp, loads)
        sent[i] += 1
        where.append((i, engines[i].submit(arrival, inp, out, path, block if path else 0)))
    per = []
    stats = []
    for i, e in enumerate(engines):
        e.advance(float("inf"))
        per.append(e.records())
        stats.append(_stats(i, sent[i], e.stats))
        if progress is not None:
            progress(len(requests) + i + 1, total)
    return [per[i][j] for i, j in where], stats


def simulate_closed_loop(config: ServingConfig, report: FitReport, concurrency: int,
                         duration_s: float, isl: int, osl: int, max_requests: int = 0,
                         progress: SimProgress | None = None,
                         budget: ComputeBudget | None = None,
                         ) -> tuple[list[RequestRecord], list[ReplicaStats]]:
    """Closed-loop saturation: ``concurrency`` clients spread over the replicas.

    Args:
        config: the serving configuration.
        report: its resolved memory layout.
        concurrency: clients in flight (>= 1).
        duration_s: virtual seconds during which clients send new requests; then drain.
        isl: input tokens per request.
        osl: output tokens per request.
        max_requests: stop sending after this many requests in all (0 = no cap); each replica
            gets its share.
        progress: called as ``progress(replicas done, replicas)`` after each replica.
        budget: compute budget checked while simulating (None: unbounded).

    Raises:
        ValueError: if concurrency < 1.
        ComputeBudgetExceeded: ``budget`` ran out or was cancelled.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    cost = build_cost_model(config, report)
    lim = engine_limits(config, report)
    R = config.replicas
    records: list[RequestRecord] = []
    stats = []
    for i in range(R):
        share = concurrency // R + (1 if i < concurrency % R else 0)
        if share == 0:
            continue
        eng = TwinEngine(cost, lim, budget=budget)
        cap = max(share, max_requests * share // concurrency) if max_requests else 0
        recs = eng.run(closed_loop=(share, duration_s, isl, osl), max_requests=cap)
        records += recs
        stats.append(_stats(i, len(recs), eng.stats))
        if progress is not None:
            progress(i + 1, R)
    return records, stats


def _batch(lim: EngineLimits, clients: float, context: float) -> int:
    """Requests one replica decodes at once: slots, clients and the KV pool allow (>= 1)."""
    return max(1, int(min(clients, lim.max_running_requests,
                          lim.kv_tokens // max(1.0, context))))


def _chunk(lim: EngineLimits) -> int:
    c = lim.chunked_prefill_size
    return min(c, MAX_PREFILL_TOKENS) if c > 0 else MAX_PREFILL_TOKENS


def _steps(lim: EngineLimits, batch: int, in_tokens: float, out_tokens: float) -> float:
    """Prefill steps (``in_tokens`` in chunks) plus decode steps (``out_tokens`` by batch)."""
    per_step = batch * (accept_length(lim.spec, batch) if lim.spec is not None else 1.0)
    return in_tokens / _chunk(lim) + out_tokens / per_step


def estimate_closed_loop(config: ServingConfig, report: FitReport, concurrency: int,
                         duration_s: float, isl: int, osl: int, max_requests: int = 0
                         ) -> SimCost:
    """The work of :func:`simulate_closed_loop` with these arguments, estimated in O(replicas).

    Each replica's clients keep a batch as large as its slots and KV pool allow (prompt plus
    half the output per request) busy for ``duration_s`` at the step time of the cost model,
    then drain; requests that cannot fit fail at once (one record, no steps). An estimate for
    the compute budget's up-front check (:class:`~domain.twin.budget.SimCost`), not a bound.
    """
    cost = build_cost_model(config, report)
    lim = engine_limits(config, report)
    R = config.replicas
    total = SimCost(0, 0, 0)
    for i in range(R):
        share = concurrency // R + (1 if i < concurrency % R else 0)
        if share == 0:
            continue
        if isl + osl > lim.context_len or isl + 1 > lim.kv_tokens:
            total += SimCost(0, share, 0)
            continue
        ctx = isl + osl / 2
        b = _batch(lim, share, ctx)
        round_s = max(osl * cost.decode_time(b, int(b * ctx)), 1e-9)
        n = share + b * duration_s / round_s
        if max_requests:
            n = min(n, max(share, max_requests * share // concurrency))
        total += SimCost(_steps(lim, b, n * isl, n * osl), n, n * osl)
    return total


def estimate_open_loop(config: ServingConfig, report: FitReport, requests: Sequence[Any]
                       ) -> SimCost:
    """The work of :func:`simulate_open_loop` on ``requests``, estimated in O(requests).

    Decode steps at the largest batch the fleet's slots and KV pools hold (a lower estimate:
    a lightly loaded replica decodes smaller batches); requests that cannot fit cost one record.
    """
    lim = engine_limits(config, report)
    n = len(requests)
    fit_in = fit_out = fits = 0
    for req in requests:
        inp, out = req[1], req[2]
        if inp + out <= lim.context_len and inp + 1 <= lim.kv_tokens:
            fit_in += inp
            fit_out += out
            fits += 1
    if not fits:
        return SimCost(0, n, 0)
    b = _batch(lim, fits, (fit_in + fit_out / 2) / fits)
    return SimCost(_steps(lim, b, fit_in, fit_out) / config.replicas, n, fit_out)
