"""The HTTP target: real OpenAI-compatible servers loaded by the built-in runner, in wall time.

A deployment whose status lists endpoints (local processes, Kubernetes) or an explicit endpoint
on the allow-list is loaded by :mod:`mcp_servers.bench.http`. An open-loop run (replay,
fixed rate) whose dispatch lag p99 exceeds ``max_dispatch_lag_p99_ms``, or a replay whose
achieved prefix-cache hit rate (``usage.prompt_tokens_details.cached_tokens``, else SGLang's
``/metrics`` counters) is more than ``hit_rate_tolerance`` from the trace's expected rate
(:func:`~mcp_servers.bench.prompts.expected_hit_rate`, an unbounded cache), is flagged.
:class:`~mcp_servers.bench.targets.aiperf.AiperfTarget` is this target with aiperf as the load
generator (it overrides the three ``_*_run`` hooks).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from domain.bench import BenchResult, PrefixCacheCheck, Quality, WorkloadInfo
from domain.twin.budget import ComputeBudget
from domain.workload import Request, Trace
from mcp_servers.bench.aiperf import AiperfError, AiperfRun, find_aiperf
from mcp_servers.bench.http import (
    MAX_CONCURRENCY,
    HttpRun,
    HttpRunner,
    Snapshot,
    TickFn,
    counter_delta,
    fetch_cache_counters,
    fetch_counter,
    fetch_counter_each,
    fetch_model_id,
)
from mcp_servers.bench.prompts import (
    SyntheticPrompts,
    expected_prefix_hits,
    rate_plan,
    replay_plan,
)
from mcp_servers.bench.quality import PROMPTS, GreedyOutputs, greedy_outputs
from mcp_servers.bench.targets.base import (
    ArrivalProcess,
    BenchTarget,
    ProgressFn,
    RunnerChoice,
    RunnerKind,
    sat_progress,
)
from mcp_servers.cluster.backend import BackendError

if TYPE_CHECKING:
    from mcp_servers.bench.ops import BenchService

# Prompt words an HTTP replay may pre-build (about 6 bytes each in memory).
MAX_REPLAY_PROMPT_TOKENS = 50_000_000
FALLBACK_MODEL = "default"
# backends whose deployments are benchmarked with aiperf by default (runner "auto"): a real
# cluster, where the engine is far from this process and aiperf's reports are the reference
CLUSTER_BACKENDS = frozenset({"kubernetes"})
log = logging.getLogger("servetune.bench")


def _tick(progress: ProgressFn | None, fmt: Callable[[Snapshot], tuple[float, float | None,
                                                                       str]]) -> TickFn | None:
    if progress is None:
        return None

    async def tick(s: Snapshot) -> None:
        await progress(*fmt(s))
    return tick


def _replay_progress(s: Snapshot) -> tuple[float, float | None, str]:
    return (s.done, s.total, f"{s.done}/{s.total} requests, {s.elapsed_s:.0f} s")


def _prefix_check(run: HttpRun | AiperfRun, expected: np.ndarray,
                  before: tuple[float, float] | None, after: tuple[float, float] | None,
                  tolerance: float) -> PrefixCacheCheck:
    """Achieved vs expected hit rate over the requests that reached the server.

    Per-request ``cached_tokens`` (usage) when the server reported them for the successful
    requests, else the ``/metrics`` counters' difference over the run, else no achieved rate.
    """
    ok = np.array([r.error is None for r in run.records], dtype=bool)
    n_in = np.array([r.input_tokens for r in run.records], dtype=float)
    cached = run.cached_tokens
    exp_all = float(expected.sum() / n_in.sum()) if n_in.sum() else 0.0
    if ok.any() and (cached[ok] >= 0).all():
        exp = float(expected[ok].sum() / n_in[ok].sum())
        return PrefixCacheCheck(expected_hit_rate=exp,
                                achieved_hit_rate=float(cached[ok].sum() / n_in[ok].sum()),
                                source="usage", tolerance=tolerance)
    if before is not None and after is not None and after[0] > before[0]:
        return PrefixCacheCheck(expected_hit_rate=exp_all,
                                achieved_hit_rate=(after[1] - before[1]) / (after[0] - before[0]),
                                source="metrics", tolerance=tolerance)
    return PrefixCacheCheck(expected_hit_rate=exp_all, achieved_hit_rate=None, source=None,
                            tolerance=tolerance)


def _deltas(before: list[float] | None, after: list[float] | None) -> list[int] | None:
    """Per-replica counter differences around a run (None: a reading is missing or went down)."""
    if before is None or after is None or len(before) != len(after):
        return None
    out = [counter_delta(b, a) for b, a in zip(before, after, strict=True)]
    return None if any(d is None for d in out) else [d for d in out if d is not None]


class HttpTarget(BenchTarget):
    """Real servers at ``urls`` (a deployment's replicas, or one allowed endpoint)."""

    kind = "http"
    noise_pct = 0.0

    @property
    def against(self) -> str:
        """`` against <first URL> (+n more replicas)``."""
        return f" against {self.where}"

    @property
    def max_requests(self) -> int:
        """The service's cap on the requests of one HTTP run."""
        return self.svc.max_requests

    @property
    def tokenizer_name(self) -> str:
        """The service's prompt tokenizer."""
        return self.svc.tokenizer.name

    @property
    def simulated(self) -> str | None:
        """What the endpoint said simulates it (``x-servetune-simulated``), else None."""
        known = self.svc.simulated_endpoints
        return next((known[u] for u in self.urls if u in known), None)

    def pick_runner(self, runner: RunnerChoice, svc: BenchService) -> RunnerKind:
        """``runner``; for ``auto`` aiperf on a cluster backend's deployment when installed.

        Raises:
            BackendError: ``aiperf`` asked for and not installed.
        """
        if runner == "auto":
            want = svc.default_runner or (
                "aiperf" if svc.backend.kind in CLUSTER_BACKENDS and self.deployment else
                "builtin")
            if want == "aiperf" and svc.default_runner is None:
                try:
                    find_aiperf(svc.aiperf_binary)
                except AiperfError as e:
                    log.warning("cluster benchmark with the built-in runner: %s", e)
                    return "builtin"
            return want
        if runner == "aiperf":
            find_aiperf(svc.aiperf_binary)
        return runner

    def with_runner(self, runner: RunnerKind) -> BenchTarget:
        """This target, or the same servers loaded by aiperf."""
        if runner == "aiperf":
            from mcp_servers.bench.targets.aiperf import AiperfTarget
            t = AiperfTarget(self.svc, self.deployment, self.endpoint, self.urls,
                             self.config, self.gpus)
            t.router = self.router
            return t
        return self

    def bench_id(self, kind: str, args: dict[str, Any]) -> str:
        """Salted with the URLs and the time: two runs of real servers are two measurements."""
        return self.svc.make_id(self.label, kind, {**args, "to": self.urls},
                                str(time.time_ns()))

    def sweep_budget(self, isl: int, osl: int, concurrencies: list[int],
                     duration_s: float) -> ComputeBudget | None:
        """None: HTTP runs are not bounded by the compute budget."""
        return None

    async def model(self) -> str:
        """The served model id (``/v1/models``), else ``default``."""
        return await fetch_model_id(self.urls[0], simulated=self.svc.simulated_endpoints) or \
            FALLBACK_MODEL

    async def retracted(self) -> float | None:
        """The servers' retraction counter now (None: not exposed or not readable).

        Read through the engine seam's ``retracted_requests`` metric name (SGLang:
        ``sglang:num_retracted_requests_total``).
        """
        return await fetch_counter(self.urls, "retracted_requests")

    async def finished_each(self) -> list[float] | None:
        """Each replica's finished-request counter now, in ``urls`` order (None: unreadable).

        SGLang's ``sglang:num_requests_total`` (the engine seam's ``finished_requests``).
        """
        return await fetch_counter_each(self.urls, "finished_requests")

    def http_runner(self) -> HttpRunner:
        """The built-in runner over this target's URLs."""
        svc = self.svc
        return HttpRunner(self.load_urls, request_timeout_s=svc.request_timeout_s,
                          client=svc.client)

    # -- the load generator (AiperfTarget overrides these) -------------------------------------

    async def _closed_loop_run(self, bid: str, what: str, model: str, isl: int, osl: int,
                               concurrency: int, duration_s: float, progress: ProgressFn | None,
                               tick: TickFn | None) -> HttpRun | AiperfRun:
        prompts = SyntheticPrompts(model, isl, osl, self.svc.tokenizer)
        return await self.http_runner().closed_loop(
            prompts.body, isl, concurrency, duration_s, self.svc.max_requests,
            tick or _tick(progress, sat_progress), osl=osl)

    async def _rate_run(self, bid: str, what: str, model: str, times: np.ndarray, isl: int,
                        osl: int, request_rate: float, duration_s: float,
                        arrival: ArrivalProcess, seed: int,
                        progress: ProgressFn | None) -> HttpRun | AiperfRun:
        n = len(times)
        plan = rate_plan(times, SyntheticPrompts(model, isl, osl, self.svc.tokenizer), isl, osl)
        if progress:
            await progress(0, n, f"0/{n} requests: prompts built, starting")
        return await self.http_runner().open_loop(plan, _tick(progress, _replay_progress))

    async def _replay_run(self, bid: str, requests: list[Request], plan: Any, model: str,
                          slo_ttft_ms: float | None,
                          progress: ProgressFn | None) -> HttpRun | AiperfRun:
        return await self.http_runner().open_loop(plan, _tick(progress, _replay_progress))

    # -- the operations ---------------------------------------------------------------------

    async def saturation(self, bid: str, what: str, isl: int, osl: int, concurrency: int,
                         duration_s: float, progress: ProgressFn | None, tick: TickFn | None,
                         quality: Quality | None, repeat: int,
                         budget: ComputeBudget | None) -> BenchResult:
        """Closed loop for ``duration_s`` wall seconds, then drain.

        Raises:
            BackendError: ``concurrency`` above the HTTP runner's limit (4096).
        """
        svc = self.svc
        if concurrency > MAX_CONCURRENCY:
            raise BackendError(f"concurrency {concurrency} is above the HTTP runner's limit of "
                               f"{MAX_CONCURRENCY}; use a lower concurrency")
        model = await self.model()
        retracted, served = await self.retracted(), await self.finished_each()
        run = await self._closed_loop_run(bid, what, model, isl, osl, concurrency, duration_s,
                                          progress, tick)
        retractions = counter_delta(retracted, await self.retracted())
        per_replica = _deltas(served, await self.finished_each())
        capped = len(run.records) >= svc.max_requests
        info = WorkloadInfo(kind="saturation", requests=len(run.records), isl=isl, osl=osl,
                            concurrency=concurrency, tokenizer=svc.tokenizer.name,
                            description=f"{what} for {duration_s:g} s of wall time against "
                                        f"{self.where}" + (f" (clients stopped after "
                                                           f"{svc.max_requests:,} requests)"
                                                           if capped else ""))
        res = self.finish(bid, info, run.records, [], run, quality=quality,
                          retractions=retractions, replica_requests=per_replica)
        if progress and tick is None:
            s = res.summary
            await progress(s.requests, s.requests, f"done: {s.requests} requests "
                                                   f"({s.errors} failed) in {run.wall_s:.0f} s")
        return res

    async def rate(self, bid: str, what: str, info: WorkloadInfo, times: np.ndarray, isl: int,
                   osl: int, request_rate: float, duration_s: float, arrival: ArrivalProcess,
                   seed: int, slo_ttft_ms: float | None, progress: ProgressFn | None,
                   quality: Quality | None) -> BenchResult:
        """Open loop at the scheduled send times, in wall time."""
        n = len(times)
        model = await self.model()
        retracted, served = await self.retracted(), await self.finished_each()
        run = await self._rate_run(bid, what, model, times, isl, osl, request_rate, duration_s,
                                   arrival, seed, progress)
        res = self.finish(bid, info, run.records, [], run, slo_ttft_ms, quality, open_loop=True,
                          retractions=counter_delta(retracted, await self.retracted()),
                          replica_requests=_deltas(served, await self.finished_each()))
        if progress:
            await progress(n, n, f"done: {n}/{n} requests ({res.summary.errors} failed) in "
                                 f"{run.wall_s:.0f} s")
        return res

    async def replay(self, bid: str, path: Path, win: Trace, info: WorkloadInfo,
                     slo_ttft_ms: float | None, progress: ProgressFn | None,
                     quality: Quality | None) -> BenchResult:
        """Replay in wall time, with the prefix-cache check when the trace has hash ids.

        Raises:
            BackendError: a window over the request or prompt-size caps.
        """
        svc, n = self.svc, len(win.requests)
        words = sum(r.input_tokens for r in win.requests)
        if n > svc.max_requests or words > MAX_REPLAY_PROMPT_TOKENS:
            raise BackendError(
                f"the window holds {n:,} requests with {words:,} prompt tokens; an HTTP replay "
                f"takes at most {svc.max_requests:,} requests and {MAX_REPLAY_PROMPT_TOKENS:,} "
                "prompt tokens: replay a shorter window (duration_s) in several runs")
        model = await self.model()
        plan = replay_plan(win.requests, model, tokenizer=svc.tokenizer)
        info.tokenizer = svc.tokenizer.name
        expected = expected_prefix_hits(win.requests)
        has_ids = any(r.hash_ids and r.block_size > 0 for r in win.requests)
        before = await fetch_cache_counters(self.urls) if has_ids else None
        retracted, served = await self.retracted(), await self.finished_each()
        if progress:
            await progress(0, n, f"0/{n} requests: prompts built, starting")
        run = await self._replay_run(bid, win.requests, plan, model, slo_ttft_ms, progress)
        after = await fetch_cache_counters(self.urls) if before is not None else None
        retractions = counter_delta(retracted, await self.retracted())
        per_replica = _deltas(served, await self.finished_each())
        prefix = None
        if has_ids:
            prefix = _prefix_check(run, expected, before, after,
                                   (quality or svc.quality).hit_rate_tolerance)
        res = self.finish(bid, info, run.records, [], run, slo_ttft_ms, quality,
                          open_loop=True, prefix=prefix, retractions=retractions,
                          replica_requests=per_replica)
        if progress:
            await progress(n, n, f"done: {n}/{n} requests ({res.summary.errors} failed) in "
                                 f"{run.wall_s:.0f} s")
        return res

    async def greedy(self, max_tokens: int) -> GreedyOutputs:
        """Greedy completions from the first replica.

        Raises:
            BackendError: a failed request.
        """
        try:
            return await greedy_outputs(self.urls[0], await self.model(), PROMPTS, max_tokens)
        except httpx.HTTPError as e:
            raise BackendError(f"greedy completion from {self.urls[0]} failed: {e!r}") from e
