"""Benchmark operations: saturation, trace replay and concurrency sweep.

Against a twin deployment (virtual time) or real OpenAI-compatible servers (wall time, over
HTTP). A run's target is a deployment of the injected cluster backend XOR an explicit endpoint
URL on the allow-list. A twin deployment (no endpoints in its status) is simulated in a worker
thread; a deployment whose status lists endpoints (local processes, Kubernetes) and an explicit
endpoint are loaded over HTTP by :mod:`mcp_servers.bench.http_runner`. Per-request records
are stored under the injected artifacts directory (:mod:`mcp_servers.bench.records`); results
carry their path and id, never the records themselves.

Every result says whether it can be used (:class:`BenchResult`): failed requests are counted per
error class (:class:`~mcp_servers.bench.http_runner.ErrorClass`; ``engine`` for the twin) and a
run whose failed share exceeds ``max_error_share`` (default 5 %) is ``valid: false`` with the
reason -- its numbers are reported but must not be scored. An open-loop HTTP run (replay, fixed
rate) whose dispatch lag p99 exceeds ``max_dispatch_lag_p99_ms`` (default 10 ms), or a replay
whose achieved prefix-cache hit rate (``usage.prompt_tokens_details.cached_tokens``, else
SGLang's ``/metrics`` counters) is more than ``hit_rate_tolerance`` (default 0.15) from the
trace's expected rate (:func:`~mcp_servers.bench.prompts.expected_hit_rate`, an unbounded cache),
is flagged in ``flags`` with the numbers.

Twin runs are bounded by a compute budget (:mod:`domain.twin.budget`, ``compute_budget_s``,
default 60 wall seconds per tool call, one budget for a whole sweep): a run whose estimated cost
exceeds what is left is refused before it starts, with the limit and the estimate; the budget is
checked inside the simulation loops, so a run stops within a second of reaching it or of the
client's cancel (the simulation's worker thread is told to stop).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio.from_thread
import anyio.to_thread
import httpx
import numpy as np
from pydantic import BaseModel, Field

from domain.acceptance import block_rates
from domain.config import ServingConfig
from domain.errors import TraceInvalid
from domain.faults import FaultSpec
from domain.fit import FitReport
from domain.metrics import MetricsSummary, Percentiles, RequestRecord, summarize
from domain.twin.budget import DEFAULT_COMPUTE_BUDGET_S, ComputeBudget, SimCost
from domain.twin.cluster import (
    ReplicaStats,
    estimate_closed_loop,
    estimate_open_loop,
    simulate_closed_loop,
    simulate_open_loop,
)
from domain.twin.injected import inject_records
from domain.twin.noise import noise_factor, scale_records
from domain.workload import Trace, check_trace_path, load_trace
from mcp_servers.bench import records as store
from mcp_servers.bench.aiperf import AiperfError, AiperfRun, AiperfRunner, find_aiperf
from mcp_servers.bench.endpoints import check_endpoint
from mcp_servers.bench.http_runner import (
    DEFAULT_CLIENT,
    MAX_CONCURRENCY,
    ClientKind,
    HttpRun,
    HttpRunner,
    Snapshot,
    TickFn,
    arrival_schedule,
    fetch_cache_counters,
    fetch_model_id,
)
from mcp_servers.bench.prompts import (
    PromptTokenizer,
    SyntheticPrompts,
    WordTokenizer,
    expected_prefix_hits,
    rate_plan,
    replay_plan,
)
from mcp_servers.bench.quality import (
    DEFAULT_MAX_TOKENS,
    PROMPTS,
    GreedyOutputs,
    greedy_outputs,
)
from mcp_servers.cluster.backend import BackendError, ClusterBackend

# A twin saturation run issues at most this many requests (steady state is reached long before;
# the cap bounds the memory of per-request records: ~1 KB each with their inter-token gaps).
MAX_SATURATION_REQUESTS = 200_000
# An HTTP run sends at most this many requests; a replay window must not hold more.
MAX_HTTP_REQUESTS = 100_000
# Prompt words an HTTP replay may pre-build (about 6 bytes each in memory).
MAX_REPLAY_PROMPT_TOKENS = 50_000_000
FALLBACK_MODEL = "default"
MAX_ERROR_SHARE = 0.05  # a run with a larger share of failed requests is invalid
MAX_DISPATCH_LAG_P99_MS = 10.0  # an open-loop HTTP run sending later than this at p99 is flagged
HIT_RATE_TOLERANCE = 0.15  # |achieved - expected| prefix-cache hit rate above this is flagged
ENGINE_ERROR = "engine"  # error class of a twin request the engine did not serve

TraceFormat = Literal["auto", "mooncake", "azure", "bailian"]
ArrivalProcess = Literal["poisson", "constant"]
log = logging.getLogger("servetune.bench")
RunnerKind = Literal["builtin", "aiperf"]
RunnerChoice = Literal["auto", "builtin", "aiperf"]
# backends whose deployments are benchmarked with aiperf by default (runner "auto"): a real
# cluster, where the engine is far from this process and aiperf's reports are the reference
CLUSTER_BACKENDS = frozenset({"kubernetes"})
T = TypeVar("T")
ProgressFn = Callable[[float, float | None, str], Awaitable[None]]
"""``(progress, total or None, message)``, as MCP's ``Context.report_progress`` takes them."""


class WorkloadInfo(BaseModel):
    """What was run: enough to reproduce it and to report it."""

    kind: str  # saturation | replay | rate
    description: str
    requests: int
    trace_file: str | None = None
    window_start_s: float | None = None
    window_s: float | None = None
    time_scale: float | None = None
    isl: int | None = None
    osl: int | None = None
    concurrency: int | None = None
    request_rate: float | None = Field(None, description="rate runs: requests per second")
    arrival: str | None = Field(None, description="rate runs: poisson or constant")
    seed: int | None = None
    tokenizer: str | None = Field(None, description="http: tokenizer the prompts were built "
                                                    "with (words = whitespace words)")


class Quality(BaseModel):
    """Thresholds that decide whether a run is valid or flagged (see the module docstring)."""

    max_error_share: float = Field(MAX_ERROR_SHARE, ge=0, le=1)
    max_dispatch_lag_p99_ms: float = Field(MAX_DISPATCH_LAG_P99_MS, gt=0)
    hit_rate_tolerance: float = Field(HIT_RATE_TOLERANCE, ge=0, le=1)


class PrefixCacheCheck(BaseModel):
    """Achieved vs expected prefix-cache hit rate of a replay (shares of prompt tokens)."""

    expected_hit_rate: float = Field(description="what an unbounded prefix cache would serve "
                                                 "of the prompts sent (from the hash ids)")
    achieved_hit_rate: float | None = Field(description="what the server reported; None when "
                                                        "it reports no cached tokens")
    source: str | None = Field(description="usage (prompt_tokens_details.cached_tokens) or "
                                           "metrics (sglang:cached_tokens_total / "
                                           "sglang:prompt_tokens_total over the run)")
    tolerance: float


class BenchResult(BaseModel):
    """Summary of one benchmark run plus where its per-request records are."""

    bench_id: str
    target: Literal["twin", "http"] = Field(
        "twin", description="twin: virtual time; http: real requests, wall time")
    deployment: str | None = None
    endpoint: str | None = Field(None, description="base URL when run against an endpoint")
    config_id: str | None = None
    workload: WorkloadInfo
    summary: MetricsSummary
    replicas: list[ReplicaStats] = Field(default_factory=list,
                                         description="twin engine counters (empty for http)")
    records_path: str
    first_error: str | None = Field(None, description="message of the first failed request")
    wall_s: float | None = Field(None, description="http: wall seconds of the run incl. drain")
    dispatch_lag_ms: Percentiles | None = Field(
        None, description="http: actual minus scheduled send time per request, ms")
    note: str | None = Field(None, description="e.g. why a run stopped sending early")
    errors_by_class: dict[str, int] = Field(
        default_factory=dict, description="failed requests per class: http_status, timeout, "
                                          "connect, disconnect, stream, truncated (http); "
                                          "engine (twin)")
    error_share: float = Field(0.0, description="failed / sent requests")
    valid: bool = Field(True, description="false: too many failed requests; the numbers are "
                                          "reported but must not be scored")
    invalid_reason: str | None = None
    flags: list[str] = Field(default_factory=list, description=(
        "measurement problems that do not void the run but must be looked at: dispatch lag, "
        "prefix-cache hit rate far from the trace's"))
    prefix_cache: PrefixCacheCheck | None = None
    client: str | None = Field(None, description="http: the load generator's HTTP client")
    simulated: str | None = Field(None, description=(
        "what simulates the target: 'twin' for a twin deployment (virtual time) and for an "
        "endpoint that identified itself as the twin server (x-servetune-simulated header); "
        "None for a real engine. A simulated run's numbers are the twin's, not a GPU's"))
    block_tok_s_per_gpu: list[float] = Field(default_factory=list, description=(
        "saturation runs: output tok/s/GPU of equal time slices of the run (their mean is the "
        "summary's): the acceptance gate's samples when a candidate ran once"))


class SweepPoint(BaseModel):
    """One concurrency of a sweep."""

    concurrency: int
    output_tok_s_per_gpu: float
    tok_s_per_user: float
    ttft_p99_ms: float | None
    itl_p99_ms: float | None
    errors: int = 0
    valid: bool = True
    bench_id: str


@dataclass
class _Target:
    deployment: str | None
    endpoint: str | None
    urls: list[str]  # empty: twin simulation
    config: ServingConfig | None
    fit: FitReport | None
    gpus: int

    @property
    def label(self) -> str:
        return self.deployment or "endpoint"

    @property
    def where(self) -> str:
        n = len(self.urls)
        return f"{self.urls[0]}" + (f" (+{n - 1} more replicas)" if n > 1 else "")


TWIN_FAULT_CLASSES = ("timeout", "connect", "disconnect")
SANITY_SLACK_S = 1e-3  # clock slack of the time-order checks


def _insane(records: Sequence[RequestRecord]) -> str:
    """What is impossible about completed ``records`` ('' if nothing).

    A first token before the send or a finish before the first token cannot be measured; a
    run holding such records is garbage, whatever its throughput says.
    """
    ok = [r for r in records if r.error is None]
    early = sum(r.first_token_s < r.arrival_s - SANITY_SLACK_S for r in ok)
    back = sum(r.finish_s < r.first_token_s - SANITY_SLACK_S for r in ok)
    parts = [f"{early} with the first token before the send"] if early else []
    parts += [f"{back} finished before their first token"] if back else []
    return ", ".join(parts)


def _first_error(records: Sequence[RequestRecord]) -> str | None:
    return next((r.error for r in records if r.error is not None), None)


def _tick(progress: ProgressFn | None, fmt: Callable[[Snapshot], tuple[float, float | None,
                                                                       str]]) -> TickFn | None:
    if progress is None:
        return None

    async def tick(s: Snapshot) -> None:
        await progress(*fmt(s))
    return tick


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


def _sat_progress(s: Snapshot) -> tuple[float, float | None, str]:
    clock = (f"{s.elapsed_s:.0f}/{s.duration_s:g} s" if s.elapsed_s <= s.duration_s else
             f"draining {s.in_flight} after {s.duration_s:g} s ({s.elapsed_s:.0f} s)")
    return (s.done, None, f"{s.done} requests ({s.errors} failed), {clock}, "
                          f"{s.in_flight} in flight")


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


class BenchService:
    """Benchmarks over a cluster backend or allowed endpoints; stores records in ``artifacts``.

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
            on a cluster backend (:data:`CLUSTER_BACKENDS`) when it is installed, else the
            built-in runner.
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
        self._runs_of: dict[str, int] = {}  # bench id -> twin runs so far (fault draws)
        self._traces: dict[tuple[str, str], Trace] = {}

    # -- targets, traces, storage --------------------------------------------------------------

    def _target(self, deployment: str | None, endpoint: str | None,
                gpus: int | None) -> _Target:
        if (deployment is None) == (endpoint is None):
            raise BackendError("give exactly one of deployment (a Ready deployment of this "
                               "server's cluster) or endpoint (an allowed base URL)")
        if endpoint is not None:
            base = check_endpoint(endpoint, self.allowed)
            return _Target(None, base, [base], None, None, gpus or 1)
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
            return _Target(deployment, None, urls, st.config, None, st.config.gpus)
        if not hasattr(self.backend, "ready_fit"):
            raise BackendError(f"deployment {deployment!r} is Ready but its status lists no "
                               "endpoints yet; poll get_status and retry")
        config, fit = self.backend.ready_fit(deployment)
        return _Target(deployment, None, [], config, fit, config.gpus)

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
    def _id(label: str, kind: str, args: dict[str, Any], salt: str) -> str:
        blob = json.dumps({**args, "salt": salt}, sort_keys=True).encode()
        return f"{label}-{kind}-{hashlib.sha256(blob).hexdigest()[:8]}"

    def _bench_id(self, t: _Target, kind: str, args: dict[str, Any]) -> str:
        if not t.urls:  # the twin is deterministic: same run, same id
            assert t.config is not None
            return self._id(t.label, kind, args, t.config.config_id())
        return self._id(t.label, kind, {**args, "to": t.urls}, str(time.time_ns()))

    def _finish(self, t: _Target, bench_id: str, info: WorkloadInfo,
                recs: list[RequestRecord], stats: list[ReplicaStats],
                run: HttpRun | AiperfRun | None,
                slo_ttft_ms: float | None = None, quality: Quality | None = None,
                open_loop: bool = False,
                prefix: PrefixCacheCheck | None = None) -> BenchResult:
        q = quality or self.quality
        lag = None if run is None else Percentiles.of(
            run.sent_s - np.array([r.arrival_s for r in recs], dtype=float))
        if run is not None:
            by_class = run.error_counts()
        else:  # an injected fault names the load generator's class ("timeout: ...")
            by_class = {}
            for r in recs:
                if r.error is not None:
                    head = r.error.split(":", 1)[0]
                    k = head if head in TWIN_FAULT_CLASSES else ENGINE_ERROR
                    by_class[k] = by_class.get(k, 0) + 1
        n_err = sum(by_class.values())
        share = n_err / len(recs) if recs else 0.0
        invalid = None
        insane = _insane(recs)
        if not recs:
            invalid = "no request was sent"
        elif insane:
            invalid = f"records fail the sanity checks ({insane}); not scored"
        elif share > q.max_error_share:
            classes = ", ".join(f"{k} {v}" for k, v in sorted(by_class.items()))
            invalid = (f"{n_err} of {len(recs)} requests failed ({share:.1%} > the "
                       f"{q.max_error_share:.1%} allowed: {classes}); not scored")
        flags = []
        if open_loop and lag is not None and lag.p99 is not None \
                and lag.p99 > q.max_dispatch_lag_p99_ms:
            flags.append(f"dispatch lag p99 {lag.p99:.1f} ms > {q.max_dispatch_lag_p99_ms:g} ms: "
                         f"the load generator fell behind its schedule (p50 {lag.p50:.1f} ms, "
                         f"mean {lag.mean:.1f} ms); the offered load was not the trace's")
        if prefix is not None and prefix.achieved_hit_rate is not None and \
                abs(prefix.achieved_hit_rate - prefix.expected_hit_rate) > prefix.tolerance:
            flags.append(f"prefix-cache hit rate {prefix.achieved_hit_rate:.1%} (from "
                         f"{prefix.source}) vs {prefix.expected_hit_rate:.1%} expected from the "
                         f"trace's hash ids (off by more than {prefix.tolerance:.0%}): the "
                         "prompts do not share prefixes as the trace does, or the server's "
                         "cache evicts or is off")
        res = BenchResult(
            bench_id=bench_id, target="http" if t.urls else "twin", deployment=t.deployment,
            endpoint=t.endpoint, config_id=t.config.config_id() if t.config else None,
            workload=info, summary=summarize(recs, t.gpus, slo_ttft_ms=slo_ttft_ms),
            replicas=stats, records_path=str(self.artifacts / f"{bench_id}.npz"),
            first_error=_first_error(recs), wall_s=None if run is None else run.wall_s,
            dispatch_lag_ms=lag, note=None if run is None else run.stopped_early,
            errors_by_class=by_class, error_share=share, valid=invalid is None,
            invalid_reason=invalid, flags=flags, prefix_cache=prefix,
            client=None if run is None else run.client,
            simulated="twin" if not t.urls else next(
                (self.simulated_endpoints[u] for u in t.urls if u in self.simulated_endpoints),
                None),
            block_tok_s_per_gpu=block_rates(recs, t.gpus) if info.kind == "saturation" else [])
        store.store(self.artifacts, bench_id, recs, None if run is None else run.sent_s,
                    res.model_dump_json(),
                    error_class=None if run is None else run.error_class,
                    cached_tokens=None if run is None else run.cached_tokens)
        return res

    async def _model(self, t: _Target) -> str:
        return await fetch_model_id(t.urls[0], simulated=self.simulated_endpoints) or \
            FALLBACK_MODEL

    def _runner(self, t: _Target) -> HttpRunner:
        return HttpRunner(t.urls, request_timeout_s=self.request_timeout_s, client=self.client)

    def _aiperf(self) -> AiperfRunner:
        return AiperfRunner(self.artifacts / "aiperf-cache", binary=self.aiperf_binary,
                            request_timeout_s=self.request_timeout_s)

    def budget(self) -> ComputeBudget:
        """A fresh compute budget for one tool call (see ``compute_budget_s``)."""
        return ComputeBudget(self.compute_budget_s)

    def pick_runner(self, t: _Target, runner: RunnerChoice) -> RunnerKind:
        """The load generator of a run: ``runner``, or for ``auto`` the server's default.

        ``auto`` is aiperf for HTTP targets of a cluster backend (when aiperf is installed;
        otherwise the built-in runner, with a warning in the log) and the built-in runner
        elsewhere; the twin (virtual time) always runs in the simulation.

        Raises:
            BackendError: ``aiperf`` asked for a twin deployment, or aiperf is not installed.
        """
        if runner == "auto":
            if not t.urls:
                return "builtin"
            want = self.default_runner or (
                "aiperf" if self.backend.kind in CLUSTER_BACKENDS and t.deployment else
                "builtin")
            if want == "aiperf" and self.default_runner is None:
                try:
                    find_aiperf(self.aiperf_binary)
                except AiperfError as e:
                    log.warning("cluster benchmark with the built-in runner: %s", e)
                    return "builtin"
            return want
        if runner == "aiperf":
            if not t.urls:
                raise BackendError("runner aiperf loads HTTP endpoints; a twin deployment is "
                                   "simulated in virtual time: use runner builtin or auto")
            find_aiperf(self.aiperf_binary)
        return runner

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
        t = self._target(deployment, endpoint, gpus)
        return await self._saturation(t, isl, osl, concurrency, duration_s, progress, None,
                                      quality, self.pick_runner(t, runner), repeat)

    def _sat_cost(self, t: _Target, isl: int, osl: int, concurrency: int,
                  duration_s: float) -> SimCost:
        assert t.config is not None and t.fit is not None
        return estimate_closed_loop(t.config, t.fit, concurrency, duration_s, isl, osl,
                                    MAX_SATURATION_REQUESTS)

    async def _saturation(self, t: _Target, isl: int, osl: int, concurrency: int,
                          duration_s: float, progress: ProgressFn | None,
                          tick: TickFn | None, quality: Quality | None = None,
                          runner: RunnerKind = "builtin", repeat: int = 0,
                          budget: ComputeBudget | None = None) -> BenchResult:
        noise = self.twin_noise_pct if not t.urls else 0.0
        args = {"isl": isl, "osl": osl, "c": concurrency, "d": duration_s,
                **({"r": runner} if runner != "builtin" else {}),
                **({"rep": repeat} if repeat else {}), **({"noise": noise} if noise else {})}
        bid = self._bench_id(t, "sat", args)
        what = f"synthetic ISL {isl} / OSL {osl} at concurrency {concurrency}"
        if not t.urls:
            assert t.config is not None and t.fit is not None
            config, fit = t.config, t.fit
            b = budget or self.budget()
            b.refuse_over(self._sat_cost(t, isl, osl, concurrency, duration_s),
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
            factor = noise_factor(config.config_id(), repeat, noise, self.twin_noise_seed)
            recs = scale_records(recs, factor)
            n = self._runs_of.get(bid, 0)
            self._runs_of[bid] = n + 1
            fault = self.faults.bench_fault(bid, n) if self.faults is not None else None
            if fault is not None:
                recs = inject_records(recs, fault)
                self.injected.append({"fault": fault, "bench_id": bid, "attempt": n,
                                      "deployment": t.deployment})
            capped = len(recs) >= MAX_SATURATION_REQUESTS
            info = WorkloadInfo(kind="saturation", requests=len(recs), isl=isl, osl=osl,
                                concurrency=concurrency,
                                description=f"{what} for {duration_s:g} s" + (
                                    f" (clients stopped after {MAX_SATURATION_REQUESTS:,} "
                                    "requests)" if capped else "") + (
                                    f"; twin noise {noise:g}% (repeat {repeat}: step times "
                                    f"x{factor:.4f})" if noise else ""))
            return self._finish(t, bid, info, recs, stats, None, quality=quality)
        if concurrency > MAX_CONCURRENCY:
            raise BackendError(f"concurrency {concurrency} is above the HTTP runner's limit of "
                               f"{MAX_CONCURRENCY}; use a lower concurrency")
        model = await self._model(t)
        run: HttpRun | AiperfRun
        if runner == "aiperf":
            if progress:
                await progress(0, None, f"aiperf: {what} for {duration_s:g} s")
            run = await self._aiperf().synthetic(
                "concurrency", t.urls, model, self.artifacts / f"{bid}.aiperf", isl=isl,
                osl=osl, duration_s=duration_s, concurrency=concurrency)
        else:
            prompts = SyntheticPrompts(model, isl, osl, self.tokenizer)
            run = await self._runner(t).closed_loop(
                prompts.body, isl, concurrency, duration_s, self.max_requests,
                tick or _tick(progress, _sat_progress), osl=osl)
        capped = len(run.records) >= self.max_requests
        info = WorkloadInfo(kind="saturation", requests=len(run.records), isl=isl, osl=osl,
                            concurrency=concurrency, tokenizer=self.tokenizer.name,
                            description=f"{what} for {duration_s:g} s of wall time against "
                                        f"{t.where}" + (f" (clients stopped after "
                                                        f"{self.max_requests:,} requests)"
                                                        if capped else ""))
        res = self._finish(t, bid, info, run.records, [], run, quality=quality)
        if progress and tick is None:
            s = res.summary
            await progress(s.requests, s.requests, f"done: {s.requests} requests "
                                                   f"({s.errors} failed) in {run.wall_s:.0f} s")
        return res

    async def rate(self, deployment: str | None, isl: int, osl: int, request_rate: float,
                   duration_s: float, arrival: ArrivalProcess = "poisson", seed: int = 0,
                   slo_ttft_ms: float | None = None, *, endpoint: str | None = None,
                   gpus: int | None = None, progress: ProgressFn | None = None,
                   quality: Quality | None = None,
                   runner: RunnerChoice = "auto") -> BenchResult:
        """Open loop at a fixed request rate for ``duration_s`` seconds of arrivals, then drain.

        Arrivals from :func:`~mcp_servers.bench.http_runner.arrival_schedule` (Poisson or
        constant, seeded: the same seed sends at the same times; aiperf draws its own
        schedule of the same process and rate). Twin: virtual seconds; HTTP: wall seconds,
        with the load generator :meth:`pick_runner` picks for ``runner``.

        Raises:
            BackendError: target missing/not Ready/not allowed, or more requests than the cap.
            ComputeBudgetExceeded: a twin run estimated over the compute budget (refused), or
                one that reached it or was cancelled (stopped).
        """
        t = self._target(deployment, endpoint, gpus)
        kind = self.pick_runner(t, runner)
        cap = MAX_SATURATION_REQUESTS if not t.urls else self.max_requests
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
                "s": seed, **({"g": kind} if kind != "builtin" else {})}
        bid = self._bench_id(t, "rate", args)
        what = (f"synthetic ISL {isl} / OSL {osl} at {request_rate:g} req/s ({arrival}, seed "
                f"{seed}) for {duration_s:g} s")
        info = WorkloadInfo(kind="rate", requests=n, isl=isl, osl=osl, request_rate=request_rate,
                            arrival=arrival, seed=seed,
                            tokenizer=self.tokenizer.name if t.urls else None,
                            description=what + (f" against {t.where}" if t.urls else ""))
        if not t.urls:
            assert t.config is not None and t.fit is not None
            config, fit = t.config, t.fit
            reqs = [(float(x), isl, osl, (), 0) for x in times]
            b = self.budget()
            b.refuse_over(estimate_open_loop(config, fit, reqs), f"this twin run ({what})")
            if progress:
                await progress(0, n + config.replicas, f"twin: simulating {what}")
            step = _from_thread(progress, lambda d, total: f"twin: {min(d, n)}/{n} requests "
                                                           "routed", budget=b)
            recs, stats = await _simulate(
                lambda: simulate_open_loop(config, fit, reqs, progress=step, budget=b), b)
            b.refuse_over(_recorded_cost(recs), f"summarising this twin run's {n:,} records")
            return self._finish(t, bid, info, recs, stats, None, slo_ttft_ms, quality)
        model = await self._model(t)
        run: HttpRun | AiperfRun
        if kind == "aiperf":
            if progress:
                await progress(0, n, f"aiperf: {what}")
            run = await self._aiperf().synthetic(
                "rate", t.urls, model, self.artifacts / f"{bid}.aiperf", isl=isl, osl=osl,
                duration_s=duration_s, request_rate=request_rate, arrival=arrival, seed=seed)
        else:
            plan = rate_plan(times, SyntheticPrompts(model, isl, osl, self.tokenizer), isl, osl)
            if progress:
                await progress(0, n, f"0/{n} requests: prompts built, starting")
            run = await self._runner(t).open_loop(plan, _tick(progress, _replay_progress))
        res = self._finish(t, bid, info, run.records, [], run, slo_ttft_ms, quality,
                           open_loop=True)
        if progress:
            await progress(n, n, f"done: {n}/{n} requests ({res.summary.errors} failed) in "
                                 f"{run.wall_s:.0f} s")
        return res

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
        t = self._target(deployment, endpoint, gpus)
        runner = self.pick_runner(t, runner)
        path, win = self.load_window(trace, fmt, start_s, duration_s, time_scale)
        args = {"t": str(path), "s": start_s, "d": duration_s, "x": time_scale,
                **({"r": runner} if runner != "builtin" else {})}
        bid = self._bench_id(t, "replay", args)
        n = len(win.requests)
        info = WorkloadInfo(kind="replay", requests=n, trace_file=path.name,
                            window_start_s=start_s, window_s=duration_s, time_scale=time_scale,
                            description=f"{path.name} window [{start_s:g}, "
                                        f"{start_s + duration_s:g}) s at {time_scale:g}x"
                                        + (f" against {t.where}" if t.urls else ""))
        if not t.urls:
            assert t.config is not None and t.fit is not None
            config, fit = t.config, t.fit
            reqs = [(r.arrival_s, r.input_tokens, r.output_tokens, r.hash_ids, r.block_size)
                    for r in win.requests]
            b = self.budget()
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
            return self._finish(t, bid, info, recs, stats, None, slo_ttft_ms, quality)
        words = sum(r.input_tokens for r in win.requests)
        if n > self.max_requests or words > MAX_REPLAY_PROMPT_TOKENS:
            raise BackendError(
                f"the window holds {n:,} requests with {words:,} prompt tokens; an HTTP replay "
                f"takes at most {self.max_requests:,} requests and {MAX_REPLAY_PROMPT_TOKENS:,} "
                "prompt tokens: replay a shorter window (duration_s) in several runs")
        model = await self._model(t)
        plan = replay_plan(win.requests, model, tokenizer=self.tokenizer)
        info.tokenizer = self.tokenizer.name
        expected = expected_prefix_hits(win.requests)
        has_ids = any(r.hash_ids and r.block_size > 0 for r in win.requests)
        before = await fetch_cache_counters(t.urls) if has_ids else None
        if progress:
            await progress(0, n, f"0/{n} requests: prompts built, starting")
        run: HttpRun | AiperfRun
        if runner == "aiperf":
            run = await self._aiperf().replay(
                win.requests, t.urls, model, self.artifacts / f"{bid}.aiperf",
                slo_ttft_ms=slo_ttft_ms)
        else:
            run = await self._runner(t).open_loop(plan, _tick(progress, _replay_progress))
        after = await fetch_cache_counters(t.urls) if before is not None else None
        prefix = None
        if has_ids:
            prefix = _prefix_check(run, expected, before, after,
                                   (quality or self.quality).hit_rate_tolerance)
        res = self._finish(t, bid, info, run.records, [], run, slo_ttft_ms, quality,
                           open_loop=True, prefix=prefix)
        if progress:
            await progress(n, n, f"done: {n}/{n} requests ({res.summary.errors} failed) in "
                                 f"{run.wall_s:.0f} s")
        return res

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
        t = self._target(deployment, endpoint, gpus)
        kind = self.pick_runner(t, runner)
        k_total = len(concurrencies)
        budget = None
        if not t.urls:
            budget = self.budget()
            total = SimCost(0, 0, 0)
            for c in concurrencies:
                total += self._sat_cost(t, isl, osl, c, duration_s)
            budget.refuse_over(total, f"the {k_total} points of this twin sweep (one budget "
                                      "for the whole sweep)")
        points = []
        for k, c in enumerate(concurrencies):
            head = f"point {k + 1}/{k_total} (concurrency {c})"
            tick = None
            if progress is not None:
                await progress(k, k_total, f"{head}: starting")

                async def tick(s: Snapshot, k: int = k, head: str = head) -> None:
                    frac = min(s.elapsed_s / duration_s, 0.99) if duration_s else 0.0
                    await progress(k + frac, k_total, f"{head}: {_sat_progress(s)[2]}")
            r = await self._saturation(t, isl, osl, c, duration_s, None, tick, runner=kind,
                                       budget=budget)
            s = r.summary
            points.append(SweepPoint(concurrency=c, output_tok_s_per_gpu=s.output_tok_s_per_gpu,
                                     tok_s_per_user=s.tok_s_per_user,
                                     ttft_p99_ms=s.ttft_ms.p99, itl_p99_ms=s.itl_ms.p99,
                                     errors=s.errors, valid=r.valid, bench_id=r.bench_id))
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
        t = self._target(deployment, endpoint, None)
        if not t.urls:
            raise BackendError("a twin deployment produces no real outputs: the quality gate "
                               "is not applicable on the twin (run it on real endpoints)")
        try:
            return await greedy_outputs(t.urls[0], await self._model(t), PROMPTS, max_tokens)
        except httpx.HTTPError as e:
            raise BackendError(f"greedy completion from {t.urls[0]} failed: {e!r}") from e
