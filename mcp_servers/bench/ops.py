"""Benchmark operations: saturation, trace replay, fixed rate and concurrency sweep.

Against a twin deployment (virtual time) or real OpenAI-compatible servers (wall time, over
HTTP). A run's target is a deployment of the injected cluster backend XOR an explicit endpoint
URL on the allow-list; :meth:`BenchService.target` picks it once per call, as one
:class:`~mcp_servers.bench.targets.base.BenchTarget`: a twin deployment (no endpoints in its
status) is simulated in a worker
thread (:mod:`~mcp_servers.bench.targets.twin`, a deployment of a
:class:`~mcp_servers.cluster.backend.SimulatedBackend`); a deployment whose status lists endpoints
(local processes, Kubernetes) and an explicit endpoint are loaded over HTTP by the built-in
runner (:mod:`~mcp_servers.bench.targets.http`) or aiperf
(:mod:`~mcp_servers.bench.targets.aiperf`). Per-request records are stored under the injected
artifacts directory (:mod:`mcp_servers.bench.records`); results carry their path and id, never
the records themselves.

Every result says whether it can be used (:class:`~domain.bench.BenchResult`):
failed requests are counted per error class (:class:`~mcp_servers.bench.http.ErrorClass`;
``engine`` for the twin) and a run whose failed share exceeds ``max_error_share`` (default 5 %)
is ``valid: false`` with the reason -- its numbers are reported but must not be scored. Open-loop
HTTP runs with a late dispatch or a prefix-cache hit rate far from the trace's are flagged
(:mod:`~mcp_servers.bench.targets.http`). Twin runs are bounded by a compute budget
(:mod:`~mcp_servers.bench.targets.twin`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from domain.bench import BenchResult, Quality, SweepPoint, WorkloadInfo
from domain.errors import TraceInvalid
from domain.faults import FaultSpec
from domain.trace_paths import check_trace_path
from domain.traces import load_trace
from domain.twin.budget import DEFAULT_COMPUTE_BUDGET_S, ComputeBudget
from domain.workload import Trace
from mcp_servers.bench import records as store
from mcp_servers.bench.endpoints import check_endpoint
from mcp_servers.bench.http import (
    DEFAULT_CLIENT,
    ClientKind,
    Snapshot,
    TickFn,
    arrival_schedule,
)
from mcp_servers.bench.prompts import PromptTokenizer, WordTokenizer
from mcp_servers.bench.quality import DEFAULT_MAX_TOKENS, GreedyOutputs
from mcp_servers.bench.targets.base import (
    ArrivalProcess,
    BenchTarget,
    ProgressFn,
    RunnerChoice,
    RunnerKind,
    sat_progress,
)
from mcp_servers.bench.targets.http import HttpTarget
from mcp_servers.bench.targets.twin import TwinTarget
from mcp_servers.cluster.backend import BackendError, ClusterBackend, SimulatedBackend

# An HTTP run sends at most this many requests; a replay window must not hold more.
MAX_HTTP_REQUESTS = 100_000
TraceFormat = Literal["auto", "mooncake", "azure", "bailian"]


class BenchService:
    """Benchmarks over a cluster backend or allowed endpoints; stores records in ``artifacts``.

    Each call picks its target once (:meth:`target`) and hands the run to it.

    Args:
        backend: the cluster backend whose deployments may be benchmarked by name.
        artifacts_dir: where records (``.npz``) and results (``.json``) are written.
        trace_roots: folders trace files may be read from (paths are confined to them).
        allowed_endpoints: base URLs that may be loaded directly (default: none).
        max_requests: cap on the requests of one HTTP run.
        request_timeout_s: an HTTP request not finished this long after its send fails.
        client: HTTP client library of the runner (``aiohttp`` or ``httpx``).
        tokenizer: builds HTTP prompts (default :class:`~mcp_servers.bench.prompts.WordTokenizer`;
            give the served model's, e.g. ``HFTokenizer(path)``, for exact ISL on a real server).
        quality: default thresholds for valid/flagged results (a run may override them).
        default_runner: the HTTP load generator of runs that ask for ``auto``; None: aiperf
            on a cluster backend (:data:`~mcp_servers.bench.targets.http.CLUSTER_BACKENDS`)
            when it is installed, else the built-in runner.
        aiperf_binary: the aiperf executable (default: :func:`~mcp_servers.bench.aiperf.
            find_aiperf`).
        twin_noise_pct: run-to-run noise of twin saturation runs, percent: each run's times
            scale by a factor drawn from (config, repeat, ``twin_noise_seed``)
            (:mod:`domain.twin.noise`); 0 = the twin's exact numbers.
        twin_noise_seed: seed of that noise.
        faults: a study's ``faults`` (:mod:`domain.faults`): a share of twin saturation runs
            lose their server, stall or return garbage (:func:`~domain.twin.injected.
            inject_records`); run ``n`` of a bench id draws from ``(seed, bench id, n)``.
            ``injected`` lists what was injected.
        compute_budget_s: wall seconds of twin simulation one call may use (a sweep shares
            one budget; default :data:`~domain.twin.budget.DEFAULT_COMPUTE_BUDGET_S`, 60; None:
            unbounded). Runs estimated over it are refused, runs reaching it stopped
            (:class:`~domain.errors.ComputeBudgetExceeded`). HTTP runs are not bounded by it.

    Raises:
        BackendError: ``compute_budget_s`` is not finite or not above 0 (``inf`` would turn the
            guard off; only None is unbounded), or an ``allowed_endpoints`` entry is malformed
            (:func:`~mcp_servers.bench.endpoints.check_endpoint`).
    """

    def __init__(self, backend: ClusterBackend, artifacts_dir: Path, trace_roots: list[Path],
                 allowed_endpoints: Sequence[str] = (), *,
                 max_requests: int = MAX_HTTP_REQUESTS,
                 request_timeout_s: float = 600.0, client: ClientKind = DEFAULT_CLIENT,
                 tokenizer: PromptTokenizer | None = None,
                 quality: Quality | None = None, default_runner: RunnerKind | None = None,
                 aiperf_binary: str | None = None, twin_noise_pct: float = 0.0,
                 twin_noise_seed: int = 0, faults: FaultSpec | None = None,
                 compute_budget_s: float | None = DEFAULT_COMPUTE_BUDGET_S) -> None:
        if compute_budget_s is not None and not (math.isfinite(compute_budget_s)
                                                 and compute_budget_s > 0):
            # inf would switch the guard off (nan compares false everywhere): a finite > 0 only
            raise BackendError(f"compute budget {compute_budget_s!r} s (--compute-budget-s): "
                               "give a finite number of seconds above 0, e.g. 60")
        self.compute_budget_s = compute_budget_s
        self.backend = backend
        self.artifacts = Path(artifacts_dir)
        self.roots = [Path(r).resolve() for r in trace_roots]
        self.allowed = list(allowed_endpoints)
        for a in self.allowed:  # fail at startup on a malformed allow-list entry
            check_endpoint(a, [a])
        self.max_requests = max_requests
        self.request_timeout_s = request_timeout_s
        self.client = client
        self.tokenizer: PromptTokenizer = tokenizer or WordTokenizer()
        self.quality = quality or Quality()
        self.default_runner = default_runner
        self.aiperf_binary = aiperf_binary
        self.twin_noise_pct, self.twin_noise_seed = twin_noise_pct, twin_noise_seed
        self.faults = faults
        self.injected: list[dict[str, Any]] = []
        # base URL -> what simulates it, for every endpoint that said so (x-servetune-simulated)
        self.simulated_endpoints: dict[str, str] = {}
        self.runs_of: dict[str, int] = {}  # bench id -> twin runs so far (fault draws)
        self._traces: dict[tuple[str, str], Trace] = {}

    # -- targets, traces, storage --------------------------------------------------------------

    def target(self, deployment: str | None, endpoint: str | None, gpus: int | None,
               runner: RunnerChoice = "auto") -> BenchTarget:
        """The one target of a call: where its load goes, with the load generator it picks.

        Raises:
            BackendError: as :meth:`_target` and :meth:`pick_runner`.
        """
        t = self._target(deployment, endpoint, gpus)
        return t.with_runner(self.pick_runner(t, runner))

    def _target(self, deployment: str | None, endpoint: str | None,
                gpus: int | None) -> BenchTarget:
        if (deployment is None) == (endpoint is None):
            raise BackendError("give exactly one of deployment (a Ready deployment of this "
                               "server's cluster) or endpoint (an allowed base URL)")
        if endpoint is not None:
            base = check_endpoint(endpoint, self.allowed)
            return HttpTarget(self, None, base, [base], None, gpus or 1)
        assert deployment is not None
        if gpus is not None:
            raise BackendError("gpus is only for endpoint runs; a deployment's GPUs come from "
                               "its config")
        try:
            st = self.backend.status(deployment)
        except BackendError as e:
            b = self.backend
            raise BackendError(f"{e} (this bench server reads the {b.kind} backend's "
                               f"deployments in namespace {b.namespace}: start it with the same "
                               "--backend, --namespace and --state-dir as the cluster server)"
                               ) from e
        urls = [u.rstrip("/") for u in getattr(st, "endpoints", None) or []]
        if st.phase != "Ready":
            raise BackendError(f"deployment {deployment!r} is not Ready (phase {st.phase}); "
                               "benchmark only Ready deployments (poll get_status first)")
        if urls:
            target = HttpTarget(self, deployment, None, urls, st.config, st.config.gpus)
            target.router = getattr(st, "router", None)
            return target
        if not isinstance(self.backend, SimulatedBackend):
            raise BackendError(f"deployment {deployment!r} is Ready but its status lists no "
                               "endpoints yet; poll get_status and retry")
        config, fit = self.backend.ready_fit(deployment)
        return TwinTarget(self, deployment, config, fit)

    def _resolve_trace(self, trace: str) -> Path:
        if trace.startswith("-"):
            raise BackendError(f"trace path {trace!r} must not start with '-'")
        if "\0" in trace:
            raise BackendError(f"trace path {trace!r} holds a NUL byte; give a file name")
        check_trace_path(trace)
        for root in self.roots:
            try:
                p = (root / trace).resolve()
                if any(p.is_relative_to(r) for r in self.roots) and p.is_file():
                    return p
            except (OSError, RuntimeError):  # a symlink cycle (3.11 raises RuntimeError),
                continue  # a name too long under this root, a folder we may not read
        roots = ", ".join(str(r) for r in self.roots) or "none configured"
        raise BackendError(f"trace {trace!r} not found inside the allowed trace folders "
                           f"({roots}); give a path relative to one of them")

    def load_window(self, trace: str, fmt: TraceFormat, start_s: float, duration_s: float,
                    time_scale: float) -> tuple[Path, Trace]:
        """The scaled window of a trace (cached per file).

        Raises:
            BackendError: path outside the allowed folders; TraceInvalid: malformed trace, or a
                file or folder name in the path over 255 bytes.
        """
        path = self._resolve_trace(trace)
        key = (str(path), fmt)
        if key not in self._traces:
            self._traces[key] = load_trace(path, fmt)
        win = self._traces[key].window(start_s, duration_s)
        if not win.requests:
            raise TraceInvalid(str(path), f"window [{start_s}, {start_s + duration_s}) s "
                                          "holds no request; pick another start_s")
        return path, win.scaled(time_scale)

    @staticmethod
    def make_id(label: str, kind: str, args: dict[str, Any], salt: str) -> str:
        """``<label>-<kind>-<8 hex of sha256(args, salt)>``."""
        blob = json.dumps({**args, "salt": salt}, sort_keys=True).encode()
        return f"{label}-{kind}-{hashlib.sha256(blob).hexdigest()[:8]}"

    def budget(self) -> ComputeBudget:
        """A fresh compute budget for one tool call (see ``compute_budget_s``)."""
        return ComputeBudget(self.compute_budget_s)

    def pick_runner(self, t: BenchTarget, runner: RunnerChoice) -> RunnerKind:
        """The load generator of a run: ``runner``, or for ``auto`` the server's default.

        ``auto`` is aiperf for HTTP targets of a cluster backend (when aiperf is installed;
        otherwise the built-in runner, with a warning in the log) and the built-in runner
        elsewhere; the twin (virtual time) always runs in the simulation.

        Raises:
            BackendError: ``aiperf`` asked for a twin deployment, or aiperf is not installed.
        """
        return t.pick_runner(runner, self)

    # -- runs ---------------------------------------------------------------------------------

    async def saturation(self, deployment: str | None, isl: int, osl: int, concurrency: int,
                         duration_s: float, *, endpoint: str | None = None,
                         gpus: int | None = None, progress: ProgressFn | None = None,
                         quality: Quality | None = None,
                         runner: RunnerChoice = "auto", repeat: int = 0) -> BenchResult:
        """Closed loop at ``concurrency`` for ``duration_s`` seconds of new load, then drain.

        Twin: virtual seconds; HTTP: wall seconds (the run lasts ``duration_s`` plus the drain),
        with the load generator :meth:`pick_runner` picks for ``runner``. ``repeat`` numbers
        the repeated runs of one candidate: it is part of the bench id (each repeat keeps its
        records) and draws the twin's run-to-run noise.

        Raises:
            BackendError: target missing, not Ready, not allowed, or concurrency over 4096
                on HTTP.
            ComputeBudgetExceeded: a twin run estimated over the compute budget (refused), or
                one that reached it or was cancelled (stopped).
        """
        t = self.target(deployment, endpoint, gpus, runner)
        return await self._saturation(t, isl, osl, concurrency, duration_s, progress, None,
                                      quality, repeat)

    async def _saturation(self, t: BenchTarget, isl: int, osl: int, concurrency: int,
                          duration_s: float, progress: ProgressFn | None,
                          tick: TickFn | None, quality: Quality | None = None,
                          repeat: int = 0,
                          budget: ComputeBudget | None = None) -> BenchResult:
        noise = t.noise_pct
        args = {"isl": isl, "osl": osl, "c": concurrency, "d": duration_s,
                **({"r": t.runner} if t.runner != "builtin" else {}),
                **({"rep": repeat} if repeat else {}), **({"noise": noise} if noise else {})}
        bid = t.bench_id("sat", args)
        what = f"synthetic ISL {isl} / OSL {osl} at concurrency {concurrency}"
        return await t.saturation(bid, what, isl, osl, concurrency, duration_s, progress, tick,
                                  quality, repeat, budget)

    async def rate(self, deployment: str | None, isl: int, osl: int, request_rate: float,
                   duration_s: float, arrival: ArrivalProcess = "poisson", seed: int = 0,
                   slo_ttft_ms: float | None = None, *, endpoint: str | None = None,
                   gpus: int | None = None, progress: ProgressFn | None = None,
                   quality: Quality | None = None,
                   runner: RunnerChoice = "auto") -> BenchResult:
        """Open loop at a fixed request rate for ``duration_s`` seconds of arrivals, then drain.

        Arrivals from :func:`~mcp_servers.bench.http.arrival_schedule` (Poisson or
        constant, seeded: the same seed sends at the same times; aiperf draws its own
        schedule of the same process and rate). Twin: virtual seconds; HTTP: wall seconds,
        with the load generator :meth:`pick_runner` picks for ``runner``.

        Raises:
            BackendError: target missing/not Ready/not allowed, or more requests than the cap.
            ComputeBudgetExceeded: a twin run estimated over the compute budget (refused), or
                one that reached it or was cancelled (stopped).
        """
        t = self.target(deployment, endpoint, gpus, runner)
        cap = t.max_requests
        if request_rate * duration_s > 2 * cap:  # refuse before drawing a huge schedule
            raise BackendError(f"{request_rate:g} req/s for {duration_s:g} s is about "
                               f"{request_rate * duration_s:,.0f} requests; a run takes at most "
                               f"{cap:,}: shorten it")
        times = arrival_schedule(request_rate, duration_s=duration_s, process=arrival, seed=seed)
        n = len(times)
        if n == 0:
            raise BackendError(f"{request_rate:g} req/s for {duration_s:g} s sends no request; "
                               "raise the rate or the duration")
        if n > cap:
            raise BackendError(f"{request_rate:g} req/s for {duration_s:g} s is {n:,} requests; "
                               f"a run takes at most {cap:,}: shorten it")
        args = {"isl": isl, "osl": osl, "r": request_rate, "d": duration_s, "a": arrival,
                "s": seed, **({"g": t.runner} if t.runner != "builtin" else {})}
        bid = t.bench_id("rate", args)
        what = (f"synthetic ISL {isl} / OSL {osl} at {request_rate:g} req/s ({arrival}, seed "
                f"{seed}) for {duration_s:g} s")
        info = WorkloadInfo(kind="rate", requests=n, isl=isl, osl=osl, request_rate=request_rate,
                            arrival=arrival, seed=seed, tokenizer=t.tokenizer_name,
                            description=what + t.against)
        return await t.rate(bid, what, info, times, isl, osl, request_rate, duration_s, arrival,
                            seed, slo_ttft_ms, progress, quality)

    async def replay(self, deployment: str | None, trace: str, fmt: TraceFormat, start_s: float,
                     duration_s: float, time_scale: float, slo_ttft_ms: float | None = None,
                     *, endpoint: str | None = None, gpus: int | None = None,
                     progress: ProgressFn | None = None,
                     quality: Quality | None = None,
                     runner: RunnerChoice = "auto") -> BenchResult:
        """Open-loop replay of a trace window at its (scaled) arrival times.

        ``runner="aiperf"`` replays an HTTP target with aiperf 0.13.0
        (:class:`~mcp_servers.bench.aiperf.AiperfRunner`: the ``[aiperf]`` extra or
        ``SERVETUNE_AIPERF``) instead of the built-in runner; ``auto`` (default) picks as
        :meth:`pick_runner` says; the twin runs in virtual time.

        Raises:
            BackendError: target missing/not Ready/not allowed, trace outside the allowed
                folders, or (HTTP) a window over the request or prompt-size caps;
            TraceInvalid: malformed trace; ConfigInvalid: empty window or bad time scale.
            ComputeBudgetExceeded: a twin run estimated over the compute budget (refused), or
                one that reached it or was cancelled (stopped).
        """
        t = self.target(deployment, endpoint, gpus, runner)
        path, win = self.load_window(trace, fmt, start_s, duration_s, time_scale)
        args = {"t": str(path), "s": start_s, "d": duration_s, "x": time_scale,
                **({"r": t.runner} if t.runner != "builtin" else {})}
        bid = t.bench_id("replay", args)
        info = WorkloadInfo(kind="replay", requests=len(win.requests), trace_file=path.name,
                            window_start_s=start_s, window_s=duration_s, time_scale=time_scale,
                            description=f"{path.name} window [{start_s:g}, "
                                        f"{start_s + duration_s:g}) s at {time_scale:g}x"
                                        + t.against)
        return await t.replay(bid, path, win, info, slo_ttft_ms, progress, quality)

    async def sweep(self, deployment: str | None, isl: int, osl: int,
                    concurrencies: list[int], duration_s: float, *,
                    endpoint: str | None = None, gpus: int | None = None,
                    progress: ProgressFn | None = None,
                    runner: RunnerChoice = "auto") -> list[SweepPoint]:
        """Saturation runs over ``concurrencies`` (the frontier's points), one after another.

        Over HTTP with the load generator :meth:`pick_runner` picks for ``runner``.

        Progress counts points (``k`` of ``len(concurrencies)``, fractional within an HTTP
        point by elapsed wall time). On the twin all points share one compute budget: a sweep
        whose points together are estimated over it is refused before the first.

        Raises:
            BackendError: as :meth:`saturation`.
            ComputeBudgetExceeded: a twin run estimated over the compute budget (refused), or
                one that reached it or was cancelled (stopped).
        """
        t = self.target(deployment, endpoint, gpus, runner)
        k_total = len(concurrencies)
        budget = t.sweep_budget(isl, osl, concurrencies, duration_s)
        points = []
        for k, c in enumerate(concurrencies):
            head = f"point {k + 1}/{k_total} (concurrency {c})"
            tick = None
            if progress is not None:
                await progress(k, k_total, f"{head}: starting")

                async def tick(s: Snapshot, k: int = k, head: str = head) -> None:
                    frac = min(s.elapsed_s / duration_s, 0.99) if duration_s else 0.0
                    await progress(k + frac, k_total, f"{head}: {sat_progress(s)[2]}")
            r = await self._saturation(t, isl, osl, c, duration_s, None, tick, budget=budget)
            s = r.summary
            points.append(SweepPoint(concurrency=c, output_tok_s_per_gpu=s.output_tok_s_per_gpu,
                                     tok_s_per_user=s.tok_s_per_user,
                                     ttft_p99_ms=s.ttft_ms.p99, itl_p99_ms=s.itl_ms.p99,
                                     errors=s.errors, valid=r.valid, bench_id=r.bench_id,
                                     retractions=s.retractions))
        if progress is not None:
            await progress(k_total, k_total, f"done: {k_total} points")
        return points

    # -- stored runs --------------------------------------------------------------------------

    def records(self, bench_id: str, start: int = 0, max_items: int = 100,
                include_itl: bool = False) -> store.RecordPage:
        """A page of the per-request records of a stored run (see :func:`records.page`)."""
        return store.page(self.artifacts, bench_id, start, max_items, include_itl)

    def runs(self, start: int = 0, max_items: int = 100) -> store.RunList:
        """Stored runs, newest first."""
        return store.runs(self.artifacts, start, max_items)

    # -- quality gate -------------------------------------------------------------------------

    async def greedy(self, deployment: str | None, max_tokens: int = DEFAULT_MAX_TOKENS, *,
                     endpoint: str | None = None) -> GreedyOutputs:
        """Greedy completions of the fixed prompt set (:mod:`mcp_servers.bench.quality`).

        A simulated endpoint (the twin server) gives a result marked ``simulated``, without
        outputs.

        Raises:
            BackendError: target missing/not Ready/not allowed, a twin deployment (no real
                outputs: the quality gate is not applicable there), or a failed request.
        """
        return await self._target(deployment, endpoint, None).greedy(max_tokens)
