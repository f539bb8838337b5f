"""Replicas behind a router: spread a workload over the replicas of a config and simulate them.

Router policies (sglang-router 0.3.2, the smg code base of its wheel; servetune's sglang-knobs
reference section 6.2):

- ``round_robin``: request i goes to replica i mod R (an open-loop replay's replicas then do
  not interact, so each is simulated on its own share).
- ``power_of_two``: sample two distinct replicas (seeded), send to the one with fewer in-flight
  requests (the router's own count: routed minus finished).
- ``cache_aware`` (sglang repository ``sgl-model-gateway/src/policies/cache_aware.rs``
  ``select_worker`` / ``select_worker_min_load``, whose debug events the 0.3.2 wheel names at
  cache_aware.rs:297-336, and ``tree.rs`` ``insert`` / ``prefix_match``; the behaviour below is
  checked against the wheel by ``tests/integration/test_router_fidelity.py``): one radix tree of the
  request *text* (characters) per model, shared by the workers, each node tagged with the
  workers it was sent to. Load = the router's in-flight count per worker. If the fleet is
  imbalanced -- ``max - min > balance_abs_threshold`` (64) and ``max > balance_rel_threshold x
  min`` (1.5) -- the request goes to the least-loaded worker. Otherwise the tree walk finds the
  longest prefix of the text any worker was sent; if matched / text characters exceeds
  ``cache_threshold`` (0.3) the request goes to a worker on the deepest node reached, else to
  the least-loaded worker (not the smallest tree as in the older ``sgl-router``). Every pick
  inserts the text under the chosen worker. Ties among equally loaded workers go to the first
  in the router's worker list (``min_by_key`` keeps the first minimum); the twin's replica 0 is
  that first worker (``GET /workers`` lists the real router's order, which is its registration
  order, not the command line's). Ties on the deepest node go to the first tenant of a DashMap
  (an arbitrary order); the twin takes the lowest index.

  The text is what the bench sends (``mcp_servers/bench/prompts.py``): a replay's prompt is
  one word block per hash id, so the characters two prompts share are their common leading
  blocks (plus at most part of one word) and the twin matches on blocks, the ratio in tokens
  (words are drawn independently per block, so characters per token average out). A synthetic
  prompt starts with its own request tag (``tag_words`` words, 3 for the 300-word list) before
  the shared body, so the text it shares with any earlier prompt is at most those tag words:
  under 0.3 of the prompt above ~10 tokens, and the twin gives it no match: it goes to the
  least-loaded worker (join-shortest-queue). This is why the real router sent 32 synthetic
  prompts, each finished before the next was sent, all to one worker (every load 0).
  Trees are trimmed only to 2^26 nodes (``--max-tree-size``), which a twin run never reaches.
- ``kube_service``: no router; the Kubernetes Service's kube-proxy (iptables mode) sends each
  new *connection* to a random ready endpoint (kubernetes.io/docs/reference/networking/
  virtual-ips/ "iptables proxy mode": "chooses a backend at random"), and an HTTP keep-alive
  client keeps its connection, so each client sticks to one pod. A closed loop's client c goes
  to a seeded random replica for the whole run; an open-loop replay's requests (a pool of
  reused connections, each request on whichever is free) each go to a seeded random replica.

Replicas that interact through the router are simulated in lockstep: before each arrival every
replica advances to the arrival time, so the router sees their load as the real one would.

A closed-loop saturation (and sweep) run goes through the router. ``round_robin`` and
``power_of_two`` route every request as it is sent, the replicas advanced together
(:func:`_closed_loop_routed`). ``kube_service`` and ``cache_aware`` place the clients once
(:meth:`Router.client_shares`) and simulate each replica with its own, which is exact: a
Service connection is pinned, and cache_aware sends each synthetic request to the
least-loaded worker while a worker's in-flight count drops by one only when one of its
requests finishes, so the replacement returns to a worker at the fleet minimum and the counts
stay the balanced split of the first wave (which worker holds a remainder client may change
on exact ties; replicas are identical). ``tests/unit/test_router_policy.py`` checks both
against a reference that routes every request with live counts.

Longer than 500 lines on purpose: the router, the replicas' saturation and replay loops
and the compute-budget estimates of the same loops live together, so an estimate follows the
loop it estimates (schedulers and PD dispatch from here).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel

from domain.config import ServingConfig
from domain.costmodel import StepCostModel, build_cost_model
from domain.fit import FitReport
from domain.metrics import RequestRecord
from domain.models import get_model
from domain.speculative import accept_length
from domain.twin.budget import CHECK_EVERY, ComputeBudget, SimCost
from domain.twin.dp import DPController, DPServer, resolve_method
from domain.twin.engine import (
    MAX_PREFILL_TOKENS,
    EngineLimits,
    EngineStats,
    TwinEngine,
    new_cache,
)
from domain.twin.prefix_cache import PathIndex

# One worker behind the router: a one-scheduler engine or a server of several schedulers.
Server = TwinEngine | DPServer

# sglang-router 0.3.2 defaults (router_args.py; sglang-knobs reference 6.3)
CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5
ROUTER_SEED = 0
POLICIES = ("round_robin", "power_of_two", "cache_aware", "kube_service")
# Policies whose closed loop is simulated request by request (the others pin their clients)
ROUTED_CLOSED_LOOP = ("round_robin", "power_of_two")
# Progress callbacks of the simulations: (done, total), called from the simulating thread.
SimProgress = Callable[[int, int], None]
PROGRESS_EVERY = 1000  # requests routed between two open-loop progress calls
# Wall cost of one attention-DP rank's lockstep step over a lone engine's step (the compute
# budget's estimate, _step_weight). benchmarks/twin_speed.py prints estimate and wall per row:
# with 6 the DeepSeek-V3 attention-DP 8 saturation run is estimated at 0.6 s (wall 0.3-0.6 s on
# the 2-core machine), its Mooncake replay at 5.5 s (wall 11-13 s; the TP rows: 1.15 s, wall
# 1.0-1.4 s); docs/benchmarks.md
LOCKSTEP_STEP_WEIGHT = 6.0


class ReplicaStats(BaseModel):
    """Scheduler counters of one scheduler for one run.

    ``replica`` is the server's index behind the router, ``rank`` the scheduler's inside it
    (0 for a server of one scheduler; its DP rank for ``dp_size`` x ``attn_dp_size`` > 1).
    """

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
    rank: int = 0
    role: str = "server"  # PD layouts: "prefill" or "decode" (domain.twin.pd)


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


def scheduler_limits(config: ServingConfig, report: FitReport) -> EngineLimits:
    """The limits of ONE scheduler of ``config`` (one attention-DP rank or one dp copy).

    :func:`domain.fit.fit` counts ``kv_tokens``, ``max_running_requests`` and
    ``chunked_prefill_size`` per scheduler (``FitReport.schedulers`` of them per server: the
    cap split over attention-DP ranks as ``pool_configurator.py:956`` splits it, the KV pool
    of one rank's GPUs), so they are the engine's limits as they are.
    """
    return engine_limits(config, report)


def new_server(config: ServingConfig, cost: StepCostModel, lim: EngineLimits,
               budget: ComputeBudget | None = None, index: PathIndex | None = None,
               seed: int = ROUTER_SEED) -> Server:
    """One server of ``config``: a TwinEngine, or its schedulers behind the DP controller.

    Args:
        config: the server's config (``schedulers`` ranks, ``load_balance_method``).
        cost: the step model of one scheduler.
        lim: the limits of one scheduler (:func:`scheduler_limits`).
        budget: compute budget of the run.
        index: the run's shared prefix path index (None: the radix caches get their own).
        seed: seed of ``follow_bootstrap_room``'s draws.
    """
    n = config.schedulers
    if n == 1:
        return TwinEngine(cost, lim, new_cache(lim, index), budget)
    index = index or PathIndex()
    ranks = [TwinEngine(cost, lim, new_cache(lim, index), budget, tokenize=False)
             for _ in range(n)]
    method = resolve_method(config.load_balance_method, config.disaggregation_mode)
    return DPServer(ranks, DPController(method, n, seed), lockstep=config.attn_dp_size > 1,
                    tokenize_time=getattr(cost, "tokenize_time", None),
                    fits=lambda i, o: i + o <= lim.context_len and i + 1 <= lim.kv_tokens)


def server_stats(i: int, n: int, server: Server) -> list[ReplicaStats]:
    """ReplicaStats of server ``i`` (``n`` requests routed to it): one per scheduler."""
    if isinstance(server, TwinEngine):
        return [_stats(i, n, server.stats)]
    return [_stats(i, sent, st, rank) for rank, (sent, st) in enumerate(server.rank_stats())]


def _stats(i: int, n: int, s: EngineStats, rank: int = 0) -> ReplicaStats:
    return ReplicaStats(replica=i, rank=rank, requests=n, prefill_steps=s.prefill_steps,
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
    """Chooses a replica per request (see the module docstring for the policies).

    Args:
        policy: the config's ``router_policy``.
        replicas: workers behind the router (>= 1).
        cache_threshold: ``--cache-threshold`` (cache_aware).
        balance_abs_threshold: ``--balance-abs-threshold`` (cache_aware), requests.
        balance_rel_threshold: ``--balance-rel-threshold`` (cache_aware).
        seed: seed of power_of_two's samples and kube_service's endpoint choices.
    """

    def __init__(self, policy: str, replicas: int, cache_threshold: float = CACHE_THRESHOLD,
                 balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
                 seed: int = ROUTER_SEED) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r}")
        self.policy, self.R = policy, replicas
        self.cache_threshold = cache_threshold
        self.abs_threshold, self.rel_threshold = balance_abs_threshold, balance_rel_threshold
        self._rr = 0
        self._rng = random.Random(seed)
        # cache_aware: prefix node id -> workers it was sent to (insertion order)
        self._tenants: dict[int, list[int]] = {}

    @classmethod
    def for_config(cls, config: ServingConfig, seed: int = ROUTER_SEED) -> Router:
        """The router of ``config`` (policy, replicas and the three thresholds)."""
        return cls(config.router_policy, config.replicas, config.router_cache_threshold,
                   config.router_balance_abs_threshold, config.router_balance_rel_threshold,
                   seed)

    @property
    def needs_load(self) -> bool:
        """Whether decisions depend on replica load (then replicas run in lockstep)."""
        return self.policy in ("power_of_two", "cache_aware")

    def pick(self, path: Sequence[int], block: int, input_tokens: int,
             loads: Sequence[int]) -> int:
        """Replica index for one request.

        Args:
            path: prefix node ids of its blocks (:meth:`PathIndex.path`); empty for a prompt
                that shares no text above the threshold with others (synthetic prompts).
            block: tokens per block of ``path``.
            input_tokens: prompt tokens (the denominator of the match ratio).
            loads: in-flight requests per replica as the router counts them.
        """
        R = self.R
        if R == 1:
            return 0
        if self.policy == "round_robin":
            choice = self._rr % R
            self._rr += 1
        elif self.policy == "kube_service":
            choice = self._rng.randrange(R)
        elif self.policy == "power_of_two":
            a, b = self._rng.sample(range(R), 2)
            choice = a if loads[a] <= loads[b] else b
        else:
            choice = self._cache_aware(path, block, input_tokens, loads)
            for nid in path:
                ten = self._tenants.setdefault(nid, [])
                if choice not in ten:
                    ten.append(choice)
        return choice

    def _cache_aware(self, path: Sequence[int], block: int, input_tokens: int,
                     loads: Sequence[int]) -> int:
        lo, hi = min(loads), max(loads)
        least = loads.index(lo)  # the first minimum, as Rust's min_by_key
        if hi - lo > self.abs_threshold and hi > self.rel_threshold * lo:
            return least
        matched, owners = 0, None
        for nid in path:  # the walk down the shared tree: the deepest node sent before
            ten = self._tenants.get(nid)
            if not ten:
                break
            matched, owners = matched + 1, ten
        if owners and input_tokens > 0 and \
                min(matched * block, input_tokens) / input_tokens > self.cache_threshold:
            return min(owners)
        return least

    def client_shares(self, concurrency: int, input_tokens: int) -> list[int]:
        """Closed-loop clients per replica: the first wave of ``concurrency`` requests routed.

        Each client's first request is routed with the in-flight counts of those before it
        (synthetic prompts: no shared prefix); ``kube_service`` pins each client's connection
        to a random replica. See the module docstring for why the split holds for the run.
        """
        shares = [0] * self.R
        if self.policy == "round_robin":
            return [concurrency // self.R + (1 if i < concurrency % self.R else 0)
                    for i in range(self.R)]
        for _ in range(concurrency):
            shares[self.pick((), 0, input_tokens, shares)] += 1
        return shares


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
    if config.pd is not None:  # prefill/decode disaggregation
        from domain.twin import pd

        return pd.simulate_open_loop(config, report, requests, progress, budget)
    cost = build_cost_model(config, report)
    lim = scheduler_limits(config, report)
    R = config.replicas
    index = PathIndex()
    engines = [new_server(config, cost, lim, budget, index) for _ in range(R)]
    router = Router.for_config(config)
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
        stats += server_stats(i, sent[i], e)
        if progress is not None:
            progress(len(requests) + i + 1, total)
    return [per[i][j] for i, j in where], stats


def simulate_closed_loop(config: ServingConfig, report: FitReport, concurrency: int,
                         duration_s: float, isl: int, osl: int, max_requests: int = 0,
                         progress: SimProgress | None = None,
                         budget: ComputeBudget | None = None, router_seed: int = ROUTER_SEED,
                         ) -> tuple[list[RequestRecord], list[ReplicaStats]]:
    """Closed-loop saturation: ``concurrency`` clients placed by the router over the replicas.

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
        router_seed: seed of the router's random choices (kube_service's endpoints).

    Raises:
        ValueError: if concurrency < 1.
        ComputeBudgetExceeded: ``budget`` ran out or was cancelled.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if config.pd is not None:  # prefill/decode disaggregation
        from domain.twin import pd

        return pd.simulate_closed_loop(config, report, concurrency, duration_s, isl, osl,
                                       max_requests, progress, budget, router_seed)
    if config.router_policy in ROUTED_CLOSED_LOOP and config.replicas > 1:
        return _closed_loop_routed(config, report, concurrency, duration_s, isl, osl,
                                   max_requests, progress, budget, router_seed)
    if config.schedulers > 1:
        return _closed_loop_pinned(config, report, concurrency, duration_s, isl, osl,
                                   max_requests, progress, budget, router_seed)
    cost = build_cost_model(config, report)
    lim = engine_limits(config, report)
    R = config.replicas
    records: list[RequestRecord] = []
    stats = []
    shares = Router.for_config(config, router_seed).client_shares(concurrency, isl)
    for i in range(R):
        share = shares[i]
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


def _closed_loop_routed(config: ServingConfig, report: FitReport, concurrency: int,
                        duration_s: float, isl: int, osl: int, max_requests: int,
                        progress: SimProgress | None, budget: ComputeBudget | None,
                        router_seed: int) -> tuple[list[RequestRecord], list[ReplicaStats]]:
    """:func:`simulate_closed_loop` with every request routed as it is sent.

    The replicas advance together in windows of about one decode step; the requests that
    ended by a window's end are taken in order of their end, each lowers its replica's in-flight
    count, and its client's next request (until ``duration_s`` or ``max_requests``) is routed
    with the counts of that moment and arrives at that end time (or at the replica's latest
    arrival, if later: a replica takes arrivals in order). A request routed to a replica that
    is mid-iteration waits for the iteration's end, as on a real server.
    """
    cost = build_cost_model(config, report)
    lim = scheduler_limits(config, report)
    R = config.replicas
    servers = [new_server(config, cost, lim, budget) for _ in range(R)]
    router = Router.for_config(config, router_seed)
    sent = _closed_loop_windows(servers, lambda loads: router.pick((), 0, isl, loads), cost,
                                concurrency, duration_s, isl, osl, max_requests,
                                max(1, concurrency // R) // config.schedulers)
    records: list[RequestRecord] = []
    stats = []
    for i, e in enumerate(servers):
        records += e.records()
        stats += server_stats(i, sent[i], e)
        if progress is not None:
            progress(i + 1, R)
    return records, stats


def _closed_loop_pinned(config: ServingConfig, report: FitReport, concurrency: int,
                        duration_s: float, isl: int, osl: int, max_requests: int,
                        progress: SimProgress | None, budget: ComputeBudget | None,
                        router_seed: int) -> tuple[list[RequestRecord], list[ReplicaStats]]:
    """:func:`simulate_closed_loop` of servers of several schedulers, clients placed once.

    The router's first wave places the clients (:meth:`Router.client_shares`; with one
    replica all of them); each server then runs its own closed loop, every request sent
    through its tokenizer and DP controller as it is sent (:meth:`DPServer.run_closed_loop`).
    """
    cost = build_cost_model(config, report)
    lim = scheduler_limits(config, report)
    R = config.replicas
    records: list[RequestRecord] = []
    stats: list[ReplicaStats] = []
    shares = Router.for_config(config, router_seed).client_shares(concurrency, isl)
    for i in range(R):
        share = shares[i]
        if share == 0:
            continue
        server = new_server(config, cost, lim, budget)
        cap = max(share, max_requests * share // concurrency) if max_requests else 0
        if isinstance(server, DPServer):
            sent = server.run_closed_loop(share, duration_s, isl, osl, cap)
        else:  # not reached: a config of one scheduler takes the engine's own closed loop
            sent = len(server.run(closed_loop=(share, duration_s, isl, osl), max_requests=cap))
        records += server.records()
        stats += server_stats(i, sent, server)
        if progress is not None:
            progress(i + 1, R)
    return records, stats


def _closed_loop_windows(servers: Sequence[Server], pick: Callable[[list[int]], int],
                         cost: StepCostModel, concurrency: int, duration_s: float, isl: int,
                         osl: int, max_requests: int, per: int) -> list[int]:
    """Run a closed loop over ``servers`` in windows of one decode step; requests per server.

    ``pick(in-flight counts)`` chooses the server of each request; ``per`` is the batch of
    one scheduler the window's length is priced at. See :func:`_closed_loop_routed`.
    """
    R = len(servers)
    loads, sent, seen = [0] * R, [0] * R, [0] * R
    last_arrival = [0.0] * R
    for _ in range(concurrency):
        i = pick(loads)
        loads[i] += 1
        sent[i] += 1
        servers[i].submit(0.0, isl, osl)
    issued = concurrency
    per = max(1, per)
    dt = max(1e-4, cost.decode_time(per, int(per * (isl + osl / 2))))
    t = 0.0
    ended: list[tuple[float, int]] = []  # a heap of (end s, replica) not yet taken
    while ended or any(e.busy for e in servers):
        t += dt
        for i, e in enumerate(servers):
            e.advance(t)
            new = e.ended_since(seen[i])
            seen[i] += len(new)
            for _, at in new:
                heapq.heappush(ended, (at, i))
        while ended and ended[0][0] <= t:  # an iteration may end past t: taken next window
            at, i = heapq.heappop(ended)
            loads[i] -= 1
            if at < duration_s and (not max_requests or issued < max_requests):
                j = pick(loads)
                loads[j] += 1
                sent[j] += 1
                issued += 1
                last_arrival[j] = max(at, last_arrival[j])
                servers[j].submit(last_arrival[j], isl, osl)
    return sent


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
    A PD config: :func:`domain.twin.pd.estimate_closed_loop`.
    """
    if config.pd is not None:
        from domain.twin import pd

        return pd.estimate_closed_loop(config, concurrency, duration_s, isl, osl, max_requests)
    cost = build_cost_model(config, report)
    lim = scheduler_limits(config, report)
    R, S = config.replicas, config.schedulers
    total = SimCost(0, 0, 0)
    shares = Router.for_config(config).client_shares(concurrency, isl)
    for i in range(R):
        share = shares[i]
        if share == 0:
            continue
        if isl + osl > lim.context_len or isl + 1 > lim.kv_tokens:
            total += SimCost(0, share, 0)
            continue
        ctx = isl + osl / 2
        busy = min(S, share)  # schedulers with clients (the controller spreads them)
        b = _batch(lim, share / busy, ctx)
        round_s = max(osl * cost.decode_time(b, int(b * ctx)), 1e-9)
        n = share + busy * b * duration_s / round_s
        if max_requests:
            n = min(n, max(share, max_requests * share // concurrency))
        steps = busy * _steps(lim, b, n / busy * isl, n / busy * osl)
        total += SimCost(steps * _step_weight(config), n, n * osl)
    return total


def _step_weight(config: ServingConfig) -> float:
    """Cost of one scheduler step of ``config`` in units of a lone engine's step.

    Attention-DP ranks step in lockstep: each rank's iteration is formed and run separately
    (:meth:`TwinEngine.plan_step`, :meth:`TwinEngine.commit_step`) without the lone engine's
    run of decode steps in one call, and every rank takes part in every step (an idle rank
    too): :data:`LOCKSTEP_STEP_WEIGHT` per rank and step.
    """
    return LOCKSTEP_STEP_WEIGHT if config.attn_dp_size > 1 else 1.0


def estimate_open_loop(config: ServingConfig, report: FitReport, requests: Sequence[Any]
                       ) -> SimCost:
    """The work of :func:`simulate_open_loop` on ``requests``, estimated in O(requests).

    Decode steps at the largest batch the fleet's slots and KV pools hold (a lower estimate:
    a lightly loaded replica decodes smaller batches); requests that cannot fit cost one record.
    A PD config: :func:`domain.twin.pd.estimate_open_loop`.
    """
    if config.pd is not None:
        from domain.twin import pd

        return pd.estimate_open_loop(config, requests)
    lim = scheduler_limits(config, report)
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
    steps = _steps(lim, b, fit_in, fit_out) / config.replicas * _step_weight(config)
    return SimCost(steps, n, fit_out)
