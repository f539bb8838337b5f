"""The twin target: a twin deployment simulated in virtual time, in a worker thread.

Twin runs are bounded by a compute budget (:mod:`domain.twin.budget`, ``compute_budget_s``,
default 60 wall seconds per tool call, one budget for a whole sweep): a run whose estimated cost
exceeds what is left is refused before it starts, with the limit and the estimate; the budget is
checked inside the simulation loops, so a run stops within a second of reaching it or of the
client's cancel (the simulation's worker thread is told to stop). Saturation runs take the
study's run-to-run noise (:mod:`domain.twin.noise`) and injected faults (:mod:`domain.faults`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio.from_thread
import anyio.to_thread
import numpy as np

from domain.bench import BenchResult, Quality, WorkloadInfo
from domain.config import ServingConfig
from domain.fit import FitReport
from domain.metrics import RequestRecord
from domain.twin.budget import ComputeBudget, SimCost
from domain.twin.cluster import (
    estimate_closed_loop,
    estimate_open_loop,
    simulate_closed_loop,
    simulate_open_loop,
)
from domain.twin.injected import inject_records
from domain.twin.noise import noise_factor, scale_records
from domain.workload import Trace
from mcp_servers.bench.http_runner import TickFn
from mcp_servers.bench.quality import GreedyOutputs
from mcp_servers.bench.targets.base import (
    ArrivalProcess,
    BenchTarget,
    ProgressFn,
    RunnerChoice,
    RunnerKind,
)
from mcp_servers.cluster.backend import BackendError

if TYPE_CHECKING:
    from mcp_servers.bench.ops import BenchService

# A twin saturation run issues at most this many requests (steady state is reached long before;
# the cap bounds the memory of per-request records: ~1 KB each with their inter-token gaps).
MAX_SATURATION_REQUESTS = 200_000
T = TypeVar("T")


def _from_thread(progress: ProgressFn | None, message: Callable[[int, int], str],
                 min_interval_s: float = 0.5, budget: ComputeBudget | None = None
                 ) -> Callable[[int, int], None] | None:
    """A progress callback for a simulation running in a worker thread (at most 2 per s).

    The MCP notification is sent on the event loop (``anyio.from_thread.run``) while the
    simulation waits; the final count is always sent. A cancelled or spent ``budget`` raises
    here instead (the caller is gone).
    """
    if progress is None:
        return None
    last = [0.0]

    def step(done: int, total: int) -> None:
        if budget is not None:
            budget.check()
        now = time.monotonic()
        if done < total and now - last[0] < min_interval_s:
            return
        last[0] = now
        anyio.from_thread.run(progress, done, total, message(done, total))
    return step


async def _simulate(fn: Callable[[], T], budget: ComputeBudget) -> T:
    """``fn()`` (a twin simulation that checks ``budget``) in a worker thread.

    A cancel of the calling task (the client cancelled the tool call) cancels ``budget``: the
    thread stops at its next check, within milliseconds, instead of running to the end.
    """
    try:
        return await anyio.to_thread.run_sync(fn, abandon_on_cancel=True)
    except anyio.get_cancelled_exc_class():
        budget.cancel()
        raise


def _recorded_cost(recs: Sequence[RequestRecord]) -> SimCost:
    """What summarising and storing ``recs`` costs, as a :class:`SimCost`."""
    return SimCost(0, len(recs), sum(len(r.itl_s) for r in recs))


class TwinTarget(BenchTarget):
    """A Ready twin deployment (no endpoints in its status): simulated in virtual time.

    Args:
        svc: the bench service.
        deployment: the deployment's name.
        config: its serving config.
        fit: its memory fit (what the twin's cluster backend computed when it became Ready).
    """

    kind = "twin"

    def __init__(self, svc: BenchService, deployment: str, config: ServingConfig,
                 fit: FitReport) -> None:
        super().__init__(svc, deployment, None, [], config, config.gpus)
        self.twin_config, self.fit = config, fit

    against = ""
    max_requests = MAX_SATURATION_REQUESTS
    tokenizer_name = None
    simulated = "twin"

    @property
    def noise_pct(self) -> float:
        """The service's twin noise, percent."""
        return self.svc.twin_noise_pct

    def pick_runner(self, runner: RunnerChoice, svc: BenchService) -> RunnerKind:
        """``builtin`` (the simulation) for ``auto`` and ``builtin``.

        Raises:
            BackendError: ``aiperf`` (it loads HTTP endpoints).
        """
        if runner == "aiperf":
            raise BackendError("runner aiperf loads HTTP endpoints; a twin deployment is "
                               "simulated in virtual time: use runner builtin or auto")
        return "builtin"

    def bench_id(self, kind: str, args: dict[str, Any]) -> str:
        """Deterministic: the same run of the same config has the same id."""
        return self.svc.make_id(self.label, kind, args, self.twin_config.config_id())

    def sat_cost(self, isl: int, osl: int, concurrency: int, duration_s: float) -> SimCost:
        """The estimated cost of one saturation run."""
        return estimate_closed_loop(self.twin_config, self.fit, concurrency, duration_s, isl,
                                    osl, MAX_SATURATION_REQUESTS)

    def sweep_budget(self, isl: int, osl: int, concurrencies: list[int],
                     duration_s: float) -> ComputeBudget:
        """One budget for the whole sweep, refused up front when its points exceed it.

        Raises:
            ComputeBudgetExceeded: the points together are estimated over the budget.
        """
        budget = self.svc.budget()
        total = SimCost(0, 0, 0)
        for c in concurrencies:
            total += self.sat_cost(isl, osl, c, duration_s)
        budget.refuse_over(total, f"the {len(concurrencies)} points of this twin sweep (one "
                                  "budget for the whole sweep)")
        return budget

    async def saturation(self, bid: str, what: str, isl: int, osl: int, concurrency: int,
                         duration_s: float, progress: ProgressFn | None, tick: TickFn | None,
                         quality: Quality | None, repeat: int,
                         budget: ComputeBudget | None) -> BenchResult:
        """Simulated closed loop; noise and injected faults applied to the records."""
        svc, config, fit, noise = self.svc, self.twin_config, self.fit, self.noise_pct
        b = budget or svc.budget()
        b.refuse_over(self.sat_cost(isl, osl, concurrency, duration_s),
                      f"this twin run ({what} for {duration_s:g} s)")
        if progress:
            await progress(0, config.replicas,
                           f"twin: simulating {what} for {duration_s:g} virtual s")
        step = _from_thread(progress, lambda d, n: f"twin: {d}/{n} replicas simulated",
                            budget=b)
        recs, stats = await _simulate(
            lambda: simulate_closed_loop(config, fit, concurrency, duration_s, isl, osl,
                                         max_requests=MAX_SATURATION_REQUESTS,
                                         progress=step, budget=b), b)
        b.refuse_over(_recorded_cost(recs), f"summarising this twin run's {len(recs):,} "
                                            "records")
        factor = noise_factor(config.config_id(), repeat, noise, svc.twin_noise_seed)
        recs = scale_records(recs, factor)
        n = svc.runs_of.get(bid, 0)
        svc.runs_of[bid] = n + 1
        fault = svc.faults.bench_fault(bid, n) if svc.faults is not None else None
        if fault is not None:
            recs = inject_records(recs, fault)
            svc.injected.append({"fault": fault, "bench_id": bid, "attempt": n,
                                 "deployment": self.deployment})
        capped = len(recs) >= MAX_SATURATION_REQUESTS
        info = WorkloadInfo(kind="saturation", requests=len(recs), isl=isl, osl=osl,
                            concurrency=concurrency,
                            description=f"{what} for {duration_s:g} s" + (
                                f" (clients stopped after {MAX_SATURATION_REQUESTS:,} "
                                "requests)" if capped else "") + (
                                f"; twin noise {noise:g}% (repeat {repeat}: step times "
                                f"x{factor:.4f})" if noise else ""))
        return self.finish(bid, info, recs, stats, None, quality=quality)

    async def rate(self, bid: str, what: str, info: WorkloadInfo, times: np.ndarray, isl: int,
                   osl: int, request_rate: float, duration_s: float, arrival: ArrivalProcess,
                   seed: int, slo_ttft_ms: float | None, progress: ProgressFn | None,
                   quality: Quality | None) -> BenchResult:
        """Simulated open loop at the scheduled arrival times."""
        config, fit, n = self.twin_config, self.fit, len(times)
        reqs = [(float(x), isl, osl, (), 0) for x in times]
        b = self.svc.budget()
        b.refuse_over(estimate_open_loop(config, fit, reqs), f"this twin run ({what})")
        if progress:
            await progress(0, n + config.replicas, f"twin: simulating {what}")
        step = _from_thread(progress, lambda d, total: f"twin: {min(d, n)}/{n} requests "
                                                       "routed", budget=b)
        recs, stats = await _simulate(
            lambda: simulate_open_loop(config, fit, reqs, progress=step, budget=b), b)
        b.refuse_over(_recorded_cost(recs), f"summarising this twin run's {n:,} records")
        return self.finish(bid, info, recs, stats, None, slo_ttft_ms, quality)

    async def replay(self, bid: str, path: Path, win: Trace, info: WorkloadInfo,
                     slo_ttft_ms: float | None, progress: ProgressFn | None,
                     quality: Quality | None) -> BenchResult:
        """Simulated replay of the window's requests (hash ids drive the prefix cache)."""
        config, fit, n = self.twin_config, self.fit, len(win.requests)
        reqs = [(r.arrival_s, r.input_tokens, r.output_tokens, r.hash_ids, r.block_size)
                for r in win.requests]
        b = self.svc.budget()
        b.refuse_over(estimate_open_loop(config, fit, reqs),
                      f"this twin replay ({n:,} requests of {path.name})")
        if progress:  # then (routed + replicas drained) of (n + replicas), from the thread
            await progress(0, n + config.replicas,
                           f"twin: simulating {n} requests of {path.name}")
        step = _from_thread(progress, lambda d, total: f"twin: {min(d, n)}/{n} requests "
                                                       "routed" + (", replicas drained"
                                                                   if d == total else ""),
                            budget=b)
        recs, stats = await _simulate(
            lambda: simulate_open_loop(config, fit, reqs, progress=step, budget=b), b)
        b.refuse_over(_recorded_cost(recs), f"summarising this twin replay's {n:,} records")
        return self.finish(bid, info, recs, stats, None, slo_ttft_ms, quality)

    async def greedy(self, max_tokens: int) -> GreedyOutputs:
        """Not applicable.

        Raises:
            BackendError: always: the twin produces no real outputs.
        """
        raise BackendError("a twin deployment produces no real outputs: the quality gate "
                           "is not applicable on the twin (run it on real endpoints)")
