"""The one interface every benchmark target implements, and how a run becomes a result.

A target is where a run's load goes, picked once per tool call by
:class:`~mcp_servers.bench.ops.BenchService`: a twin deployment simulated in virtual time
(:class:`~mcp_servers.bench.targets.twin.TwinTarget`), real OpenAI-compatible servers loaded
over HTTP by the built-in runner (:class:`~mcp_servers.bench.targets.http.HttpTarget`), or the
same servers loaded by aiperf (:class:`~mcp_servers.bench.targets.aiperf.AiperfTarget`). Each
implements the saturation, rate, replay, sweep-budget and greedy operations of
:class:`BenchTarget`; :meth:`BenchTarget.finish` turns any run's records into a
:class:`~domain.bench.BenchResult` (error classes, validity, flags) and stores them
(:mod:`mcp_servers.bench.records`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from domain.acceptance import block_rates
from domain.bench import BenchResult, PrefixCacheCheck, Quality, WorkloadInfo
from domain.config import ServingConfig
from domain.metrics import Percentiles, RequestRecord, summarize
from domain.twin.budget import ComputeBudget
from domain.twin.cluster import ReplicaStats
from domain.workload import Trace
from mcp_servers.bench import records as store
from mcp_servers.bench.aiperf import AiperfRun
from mcp_servers.bench.http import HttpRun, Snapshot, TickFn
from mcp_servers.bench.quality import GreedyOutputs

if TYPE_CHECKING:
    from mcp_servers.bench.ops import BenchService

RunnerKind = Literal["builtin", "aiperf"]
RunnerChoice = Literal["auto", "builtin", "aiperf"]
ArrivalProcess = Literal["poisson", "constant"]
ProgressFn = Callable[[float, float | None, str], Awaitable[None]]
"""``(progress, total or None, message)``, as MCP's ``Context.report_progress`` takes them."""

ENGINE_ERROR = "engine"  # error class of a twin request the engine did not serve
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


def sat_progress(s: Snapshot) -> tuple[float, float | None, str]:
    """A closed-loop HTTP run's progress notification from a runner snapshot."""
    clock = (f"{s.elapsed_s:.0f}/{s.duration_s:g} s" if s.elapsed_s <= s.duration_s else
             f"draining {s.in_flight} after {s.duration_s:g} s ({s.elapsed_s:.0f} s)")
    return (s.done, None, f"{s.done} requests ({s.errors} failed), {clock}, "
                          f"{s.in_flight} in flight")


class BenchTarget(ABC):
    """Where one tool call's load goes; the operations each kind of target implements.

    Args:
        svc: the bench service (artifacts folder, tokenizer, caps, thresholds, budgets).
        deployment: the deployment benchmarked by name, or None for an endpoint.
        endpoint: the allowed base URL benchmarked directly, or None for a deployment.
        urls: the replicas' base URLs (empty for the twin).
        config: the deployment's serving config (None for an endpoint).
        gpus: GPUs the per-GPU numbers divide by.
    """

    kind: Literal["twin", "http"]
    """``twin``: virtual time; ``http``: real requests, wall time (:attr:`BenchResult.target`)."""
    runner: RunnerKind = "builtin"
    """The load generator (``builtin`` for the twin's simulation)."""

    def __init__(self, svc: BenchService, deployment: str | None, endpoint: str | None,
                 urls: list[str], config: ServingConfig | None, gpus: int) -> None:
        self.svc = svc
        self.deployment, self.endpoint, self.urls = deployment, endpoint, urls
        self.config, self.gpus = config, gpus
        # the router in front of the replicas (DeploymentStatus.router): load goes there, the
        # engines' metrics and model id are still read from ``urls``
        self.router: str | None = None

    @property
    def load_urls(self) -> list[str]:
        """Where the requests go: the router when the deployment has one, else the replicas."""
        return [self.router] if self.router else self.urls

    @property
    def label(self) -> str:
        """The deployment's name, or ``endpoint``: the head of the bench ids."""
        return self.deployment or "endpoint"

    @property
    def where(self) -> str:
        """The first replica's URL and how many more there are (and the router in front)."""
        n = len(self.urls)
        replicas = f"{self.urls[0]}" + (f" (+{n - 1} more replicas)" if n > 1 else "")
        return f"router {self.router} in front of {replicas}" if self.router else replicas

    # -- what differs per target -------------------------------------------------------------

    @property
    @abstractmethod
    def against(self) -> str:
        """The end of a workload description: `` against <where>`` over HTTP, '' on the twin."""

    @property
    @abstractmethod
    def max_requests(self) -> int:
        """Most requests one run may send."""

    @property
    @abstractmethod
    def noise_pct(self) -> float:
        """Run-to-run noise of saturation runs, percent (the twin's; 0 over HTTP)."""

    @property
    @abstractmethod
    def tokenizer_name(self) -> str | None:
        """The tokenizer the prompts are built with (None: the twin builds no prompts)."""

    @property
    @abstractmethod
    def simulated(self) -> str | None:
        """What simulates the target (``twin``), or None for a real engine."""

    @abstractmethod
    def pick_runner(self, runner: RunnerChoice, svc: BenchService) -> RunnerKind:
        """The load generator for ``runner`` under ``svc``'s defaults (its ``pick_runner``)."""

    def with_runner(self, runner: RunnerKind) -> BenchTarget:
        """This target loaded by ``runner`` (the twin and the built-in runner: itself)."""
        return self

    @abstractmethod
    def bench_id(self, kind: str, args: dict[str, Any]) -> str:
        """The id of a run of ``kind`` with ``args`` (the twin's is deterministic)."""

    @abstractmethod
    async def saturation(self, bid: str, what: str, isl: int, osl: int, concurrency: int,
                         duration_s: float, progress: ProgressFn | None, tick: TickFn | None,
                         quality: Quality | None, repeat: int,
                         budget: ComputeBudget | None) -> BenchResult:
        """A closed loop at ``concurrency`` (see :meth:`BenchService.saturation`)."""

    @abstractmethod
    async def rate(self, bid: str, what: str, info: WorkloadInfo, times: np.ndarray, isl: int,
                   osl: int, request_rate: float, duration_s: float, arrival: ArrivalProcess,
                   seed: int, slo_ttft_ms: float | None, progress: ProgressFn | None,
                   quality: Quality | None) -> BenchResult:
        """An open loop sending at ``times`` (see :meth:`BenchService.rate`)."""

    @abstractmethod
    async def replay(self, bid: str, path: Path, win: Trace, info: WorkloadInfo,
                     slo_ttft_ms: float | None, progress: ProgressFn | None,
                     quality: Quality | None) -> BenchResult:
        """An open-loop replay of the scaled window ``win`` (see :meth:`BenchService.replay`)."""

    @abstractmethod
    def sweep_budget(self, isl: int, osl: int, concurrencies: list[int],
                     duration_s: float) -> ComputeBudget | None:
        """The one compute budget a whole sweep shares (None: not bounded, HTTP)."""

    @abstractmethod
    async def greedy(self, max_tokens: int) -> GreedyOutputs:
        """Greedy completions of the fixed prompt set (see :meth:`BenchService.greedy`)."""

    # -- records -> result --------------------------------------------------------------------

    def finish(self, bench_id: str, info: WorkloadInfo, recs: list[RequestRecord],
               stats: list[ReplicaStats], run: HttpRun | AiperfRun | None,
               slo_ttft_ms: float | None = None, quality: Quality | None = None,
               open_loop: bool = False, prefix: PrefixCacheCheck | None = None,
               retractions: int | None = None,
               replica_requests: list[int] | None = None) -> BenchResult:
        """The result of a run's records (``run``: the HTTP run, None on the twin); stored.

        ``retractions``: requests the server retracted during the run (HTTP: read from its
        counter around the run); on the twin the replicas' scheduler counters give it.
        ``replica_requests``: HTTP: requests each replica finished during the run (its
        counter's difference), in endpoint order; the twin's are in its replica stats.
        """
        svc = self.svc
        q = quality or svc.quality
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
        summary = summarize(recs, self.gpus, slo_ttft_ms=slo_ttft_ms)
        summary.retractions = sum(s.retractions for s in stats) if stats else retractions
        decoding = [s for s in stats if s.role != "prefill"]  # PD: the decode servers
        summary.decode_batch = (sum(s.mean_decode_batch for s in decoding) / len(decoding)
                                if decoding else None)
        res = BenchResult(
            bench_id=bench_id, target=self.kind, deployment=self.deployment,
            endpoint=self.endpoint, config_id=self.config.config_id() if self.config else None,
            workload=info, summary=summary,
            replicas=stats, records_path=str(svc.artifacts / f"{bench_id}.npz"),
            first_error=_first_error(recs), wall_s=None if run is None else run.wall_s,
            dispatch_lag_ms=lag, note=None if run is None else run.stopped_early,
            errors_by_class=by_class, error_share=share, valid=invalid is None,
            invalid_reason=invalid, flags=flags, prefix_cache=prefix,
            client=None if run is None else run.client, simulated=self.simulated,
            block_tok_s_per_gpu=block_rates(recs, self.gpus) if info.kind == "saturation"
            else [], replica_requests=replica_requests)
        store.store(svc.artifacts, bench_id, recs, None if run is None else run.sent_s,
                    res.model_dump_json(),
                    error_class=None if run is None else run.error_class,
                    cached_tokens=None if run is None else run.cached_tokens)
        return res
