"""The bench MCP server: saturation, fixed rate, trace replay, concurrency sweep, records.

Runs target a deployment of the cluster backend (the twin simulates it; real deployments are
loaded over HTTP) or an allowed OpenAI-compatible endpoint. Runs are async tools that report
progress (``notifications/progress``) at most twice a second and once at the end. Every result
says whether it is ``valid`` (failed share within ``max_error_share``) and lists ``flags``
(dispatch lag, prefix-cache hit rate) that need a look before the numbers are used.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Annotated, TypeVar

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations
from pydantic import Field, Strict

from domain.bench import (
    MAX_DISPATCH_LAG_P99_MS,
    MAX_ERROR_SHARE,
    BenchResult,
    Quality,
    SweepPoint,
)
from domain.twin.budget import DEFAULT_COMPUTE_BUDGET_S
from mcp_servers.bench import records as store
from mcp_servers.bench.http_runner import DEFAULT_CLIENT, MAX_CONCURRENCY, ClientKind
from mcp_servers.bench.ops import BenchService, TraceFormat
from mcp_servers.bench.prompts import HFTokenizer
from mcp_servers.bench.quality import DEFAULT_MAX_TOKENS, GreedyOutputs
from mcp_servers.bench.targets.base import ArrivalProcess, ProgressFn, RunnerChoice
from mcp_servers.cluster.backend import BackendError, ClusterBackend, make_backend
from mcp_servers.tool_errors import StrictMCPServer, as_tool_errors

log = logging.getLogger("servetune.mcp.bench")
T = TypeVar("T")
# Number and boolean arguments are never coerced: true is not 1, "8" is not 8, 8.0 is not an int.
STRICT = Strict()

Deployment = Annotated[str | None, Field(
    description="name of a Ready deployment of the cluster server (give this OR endpoint)",
    min_length=1, max_length=52, pattern=r"^[a-z0-9][-a-z0-9]*$")]
Endpoint = Annotated[str | None, Field(
    description="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:30000; must be "
                "on the server's allow-list (give this OR deployment)",
    min_length=1, max_length=2048)]
Gpus = Annotated[int | None, STRICT, Field(
    ge=1, le=100_000, description="endpoint runs only: GPUs behind the endpoint, for tok/s/GPU "
                                  "(default 1)")]
Tokens = Annotated[int, STRICT, Field(ge=1, le=1_000_000, description="tokens")]
Concurrency = Annotated[int, STRICT, Field(
    ge=1, le=100_000, description=f"clients in flight (HTTP: at most {MAX_CONCURRENCY})")]
Duration = Annotated[float, STRICT, Field(
    gt=0, le=3600, description="seconds of new load: virtual on the twin, wall time over HTTP "
                               "(the run then drains in-flight requests; an HTTP request not "
                               "finished 600 s after its send counts as failed)")]

MaxErrorShare = Annotated[float | None, STRICT, Field(
    ge=0, le=1, description="a run with a larger share of failed requests is marked "
                            f"valid=false, not scored (default {MAX_ERROR_SHARE:g})")]
MaxLagP99 = Annotated[float | None, STRICT, Field(
    gt=0, le=60_000, description="HTTP open loop: flag the run when the dispatch lag p99 "
                                 f"exceeds this, ms (default {MAX_DISPATCH_LAG_P99_MS:g})")]
SloTtft = Annotated[float | None, STRICT, Field(gt=0, description="TTFT SLO for goodput, ms")]
Runner = Annotated[RunnerChoice, Field(
    description="HTTP load generator: auto (aiperf for a cluster deployment when installed, "
                "else the built-in runner), builtin, or aiperf 0.13.0 (the [aiperf] extra or "
                "SERVETUNE_AIPERF); the twin is simulated whatever this says")]

RUN = ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=False,
                      openWorldHint=True)
READ = ToolAnnotations(readOnlyHint=True, idempotentHint=True, openWorldHint=False)


def _progress(ctx: Context) -> ProgressFn:
    async def report(done: float, total: float | None, message: str) -> None:
        await ctx.report_progress(done, total, message)
    return report


def _quality(service: BenchService, max_error_share: float | None,
             max_dispatch_lag_p99_ms: float | None = None) -> Quality:
    q = service.quality
    return q.model_copy(update={
        k: v for k, v in (("max_error_share", max_error_share),
                          ("max_dispatch_lag_p99_ms", max_dispatch_lag_p99_ms)) if v is not None})


def build_server(service: BenchService) -> MCPServer:
    """An MCP server whose tools benchmark deployments of ``service``'s backend or endpoints."""
    allowed = ", ".join(service.allowed) or "none"
    limit = service.compute_budget_s
    budget = ("" if limit is None else
              f"Twin runs have a compute budget of {limit:g} wall seconds per call (a sweep "
              "shares one): a run estimated over it is refused with the estimate, one that "
              "reaches it is stopped; make runs smaller rather than retrying them. ")
    server = StrictMCPServer("servetune-bench", instructions=(
        "Benchmark Ready deployments (by name) or allowed OpenAI-compatible endpoints "
        f"(allowed: {allowed}): run_saturation (synthetic closed loop), run_rate (synthetic "
        "open loop at a fixed request rate), run_replay (a real trace at its arrival times), "
        "run_sweep (concurrency sweep). On the twin, durations are virtual seconds; over HTTP "
        "they are wall time and runs report progress. Results are metric summaries; a result "
        "with valid=false (too many failed requests) must not be scored, and its flags "
        "(dispatch lag, prefix-cache hit rate) must be read before its numbers are used. Page "
        "through the per-request records with get_records and see stored runs with "
        "list_runs. " + budget).strip())

    async def _guard(coro: Awaitable[T]) -> T:
        with as_tool_errors(BackendError):
            result = await coro
        if isinstance(result, BenchResult):
            s = result.summary
            log.info("%s: %d requests, %d failed, %.0f output tok/s%s%s", result.bench_id,
                     s.requests, s.errors, s.output_tok_s,
                     "" if result.valid else f", INVALID: {result.invalid_reason}",
                     "".join(f"; flag: {f}" for f in result.flags))
        return result

    @server.tool(annotations=RUN)
    async def run_saturation(isl: Tokens, osl: Tokens, concurrency: Concurrency,
                             duration_s: Duration, ctx: Context,
                             deployment: Deployment = None, endpoint: Endpoint = None,
                             gpus: Gpus = None,
                             max_error_share: MaxErrorShare = None,
                             runner: Runner = "auto",
                             repeat: Annotated[int, STRICT, Field(ge=0, le=100, description=(
                                 "0-based number of this run among repeated runs of the same "
                                 "target (part of the bench id, so each keeps its records)"
                             ))] = 0) -> BenchResult:
        """Closed-loop synthetic load (fixed ISL/OSL) at a fixed concurrency, then drain.

        Target: `deployment` XOR `endpoint`. On the twin, `duration_s` is virtual time and the
        run is a fast simulation; over HTTP it is wall time and real requests load the server.
        Repeat a run (`repeat` 1, 2, ...) to measure its run-to-run noise.
        """
        return await _guard(service.saturation(deployment, isl, osl, concurrency, duration_s,
                                               endpoint=endpoint, gpus=gpus,
                                               progress=_progress(ctx),
                                               quality=_quality(service, max_error_share),
                                               runner=runner, repeat=repeat))

    @server.tool(annotations=RUN)
    async def run_rate(
        isl: Tokens, osl: Tokens,
        request_rate: Annotated[float, STRICT, Field(gt=0, le=100_000,
                                                     description="requests per s")],
        duration_s: Annotated[float, STRICT, Field(gt=0, le=3600, description=(
            "seconds of arrivals: virtual on the twin, wall time over HTTP (then drained)"))],
        ctx: Context,
        arrival: Annotated[ArrivalProcess, Field(description=(
            "poisson (exponential gaps) or constant (evenly spaced)"))] = "poisson",
        seed: Annotated[int, STRICT, Field(ge=0, le=2**31,
                                           description="seed of the Poisson gaps")] = 0,
        slo_ttft_ms: SloTtft = None,
        deployment: Deployment = None, endpoint: Endpoint = None, gpus: Gpus = None,
        max_error_share: MaxErrorShare = None, max_dispatch_lag_p99_ms: MaxLagP99 = None,
        runner: Runner = "auto",
    ) -> BenchResult:
        """Open-loop synthetic load (fixed ISL/OSL) at a fixed request rate, then drain.

        Target: `deployment` XOR `endpoint`. Requests arrive whether or not earlier ones
        finished, so queueing shows in TTFT; a run whose sends fell behind schedule is flagged.
        """
        return await _guard(service.rate(
            deployment, isl, osl, request_rate, duration_s, arrival, seed, slo_ttft_ms,
            endpoint=endpoint, gpus=gpus, progress=_progress(ctx),
            quality=_quality(service, max_error_share, max_dispatch_lag_p99_ms), runner=runner))

    @server.tool(annotations=RUN)
    async def run_replay(
        trace: Annotated[str, Field(description="trace file relative to an allowed folder",
                                    min_length=1, max_length=4096)],
        start_s: Annotated[float, STRICT, Field(ge=0, description="window start in trace time, s")],
        duration_s: Annotated[float, STRICT, Field(gt=0, le=86_400,
                                           description="window length in trace time, s")],
        ctx: Context,
        time_scale: Annotated[float, STRICT, Field(gt=0, le=1000,
                                                   description="2.0 = twice as fast")]
        = 1.0,
        format: TraceFormat = "auto",
        slo_ttft_ms: SloTtft = None,
        deployment: Deployment = None, endpoint: Endpoint = None, gpus: Gpus = None,
        max_error_share: MaxErrorShare = None, max_dispatch_lag_p99_ms: MaxLagP99 = None,
        runner: Runner = "auto",
    ) -> BenchResult:
        """Replay a window of a real trace with its (scaled) arrival times (open loop).

        Target: `deployment` XOR `endpoint`. Over HTTP the run takes the window's length divided
        by `time_scale` in wall time; prompts reproduce the trace's shared prefixes (hash ids),
        and the result compares the server's prefix-cache hit rate with the trace's.
        """
        return await _guard(service.replay(
            deployment, trace, format, start_s, duration_s, time_scale, slo_ttft_ms,
            endpoint=endpoint, gpus=gpus, progress=_progress(ctx),
            quality=_quality(service, max_error_share, max_dispatch_lag_p99_ms),
            runner=runner))

    @server.tool(annotations=RUN)
    async def run_sweep(
        isl: Tokens, osl: Tokens,
        concurrencies: Annotated[list[Annotated[int, STRICT, Field(ge=1, le=100_000)]],
                                 Field(min_length=1, max_length=32)],
        duration_s: Duration, ctx: Context,
        deployment: Deployment = None, endpoint: Endpoint = None, gpus: Gpus = None,
        runner: Runner = "auto",
    ) -> list[SweepPoint]:
        """Saturation runs at each concurrency: points of the tok/s/GPU vs tok/s/user frontier.

        Over HTTP each point takes `duration_s` of wall time plus its drain.
        """
        return await _guard(service.sweep(deployment, isl, osl, concurrencies, duration_s,
                                          endpoint=endpoint, gpus=gpus,
                                          progress=_progress(ctx), runner=runner))

    @server.tool(annotations=RUN)
    async def run_greedy(
        deployment: Deployment = None, endpoint: Endpoint = None,
        max_tokens: Annotated[int, STRICT, Field(ge=1, le=1024, description=(
            "tokens per greedy completion"))] = DEFAULT_MAX_TOKENS,
    ) -> GreedyOutputs:
        """Greedy (temperature 0) completions of a fixed prompt set, for the quality gate.

        Compare a numerics-changing config's outputs with a reference config's (same
        prompts_sha). Real endpoints only: a twin deployment has no real outputs, and an
        endpoint that identifies itself as simulated (the twin server) answers with simulated
        set and no outputs.
        """
        return await _guard(service.greedy(deployment, max_tokens, endpoint=endpoint))

    @server.tool(annotations=READ)
    def get_records(
        bench_id: Annotated[str, Field(description="id from a run result or list_runs",
                                       min_length=1, max_length=128)],
        start: Annotated[int, STRICT, Field(ge=0, description="index of the first record")] = 0,
        max_items: Annotated[int, STRICT, Field(ge=1, le=store.MAX_PAGE, description="page size")]
        = 100,
        include_itl: Annotated[bool, STRICT, Field(
            description="add every inter-token gap")] = False,
    ) -> store.RecordPage:
        """Per-request records of a stored run, paged; continue with `start=next_start`."""
        with as_tool_errors(BackendError):
            return service.records(bench_id, start, max_items, include_itl)

    @server.tool(annotations=READ)
    def list_runs(
        start: Annotated[int, STRICT, Field(ge=0, description="index of the first run")] = 0,
        max_items: Annotated[int, STRICT, Field(ge=1, le=store.MAX_PAGE, description="page size")]
        = 100,
    ) -> store.RunList:
        """Stored benchmark runs, newest first (id, target, workload, requests, errors)."""
        return service.runs(start, max_items)

    return server


def _backend(kind: str, namespace: str, state_dir: Path | None,
             kubeconfig: Path | None = None, context: str | None = None) -> ClusterBackend:
    """The cluster server's backend, read-only here: the bench server never deploys."""
    if kind == "local" and state_dir is None:
        raise BackendError("the local backend needs a state_dir (the one the cluster server "
                           "uses)")
    return make_backend(kind, namespace, state_dir, kubeconfig=kubeconfig, context=context)


def main(backend_kind: str = "twin", namespace: str = "servetune",
         state_dir: Path | str | None = None, artifacts_dir: Path | str | None = None,
         trace_roots: Sequence[Path | str] = (),
         allowed_endpoints: Sequence[str] = (), tokenizer: Path | str | None = None,
         client: ClientKind = DEFAULT_CLIENT, runner: RunnerChoice = "auto",
         kubeconfig: Path | None = None, context: str | None = None,
         compute_budget_s: float | None = DEFAULT_COMPUTE_BUDGET_S) -> None:
    """Run the bench server over stdio (logs go to stderr; stdout is the protocol).

    Args:
        backend_kind: ``twin``, ``local`` or ``kubernetes``; built over ``state_dir`` like the
            cluster server's, so deployments made there can be benchmarked here by name.
        namespace: the namespace of the deployments (must match the cluster server's).
        state_dir: shared state folder of the cluster backend (required for ``local``).
        artifacts_dir: where records are stored (default ``<state_dir>/bench``, else
            ``.servetune/bench``).
        trace_roots: folders trace files may be read from.
        allowed_endpoints: base URLs that may be benchmarked directly (e.g.
            ``http://127.0.0.1``); none by default.
        tokenizer: a local ``tokenizer.json`` / ``vocab.txt`` (or a folder with one) of the served
            model, for prompts of exact token lengths (default: whitespace words, exact for the
            twin and the test stub; see :mod:`mcp_servers.bench.prompts`).
        client: HTTP client of the load generator (``aiohttp`` or ``httpx``).
        runner: the load generator of runs that ask for ``auto`` (``auto``: aiperf for a
            cluster backend's deployments when it is installed, else the built-in runner).
        kubeconfig: ``kubernetes`` backend: kubeconfig file (None: the default, or the pod's
            service account).
        context: ``kubernetes`` backend: kubeconfig context (None: the current one).
        compute_budget_s: wall seconds of twin simulation one tool call may use, a whole
            ``run_sweep`` sharing one (finite and above 0, default 60; None: unbounded; ``inf``
            is refused with :class:`~mcp_servers.cluster.backend.BackendError`); see
            :mod:`domain.twin.budget`.

    The event loop is uvloop's when it is installed (it comes with ``uvicorn[standard]``): the
    HTTP runner's own TTFT overhead at 50 req/s was 1.96 ms on uvloop vs 2.67 ms on asyncio's
    default loop (``benchmarks/loadgen_fidelity.py``).
    """
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per benchmark request
    sdir = Path(state_dir) if state_dir is not None else None
    if artifacts_dir is None:
        artifacts_dir = sdir / "bench" if sdir is not None else Path(".servetune") / "bench"
    tok = HFTokenizer(tokenizer) if tokenizer is not None else None
    service = BenchService(_backend(backend_kind, namespace, sdir, kubeconfig, context),
                           Path(artifacts_dir),
                           [Path(r) for r in trace_roots], list(allowed_endpoints),
                           client=client, tokenizer=tok,
                           default_runner=None if runner == "auto" else runner,
                           compute_budget_s=compute_budget_s)
    server = build_server(service)
    anyio.run(server.run_stdio_async, backend_options={"use_uvloop": _have_uvloop()})


def _have_uvloop() -> bool:
    return importlib.util.find_spec("uvloop") is not None
