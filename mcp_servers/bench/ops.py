"""Benchmark operations against twin deployments (virtual time): saturation, replay, sweep.

Per-request records are stored as compressed ``.npz`` files under the injected artifacts
directory; results carry their path, never the records themselves.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from pydantic import BaseModel, Field

from domain.errors import TraceInvalid
from domain.metrics import MetricsSummary, RequestRecord, summarize
from domain.twin.cluster import ReplicaStats, simulate_closed_loop, simulate_open_loop
from domain.workload import Trace, load_trace
from mcp_servers.cluster.backend import BackendError, TwinBackend

# A saturation run issues at most this many requests (steady state is reached long before; the
# cap bounds the memory of per-request records: ~1 KB each with their inter-token gaps).
MAX_SATURATION_REQUESTS = 200_000


class WorkloadInfo(BaseModel):
    """What was run: enough to reproduce it and to report it."""

    kind: str  # saturation | replay
    description: str
    requests: int
    trace_file: str | None = None
    window_start_s: float | None = None
    window_s: float | None = None
    time_scale: float | None = None
    isl: int | None = None
    osl: int | None = None
    concurrency: int | None = None


class BenchResult(BaseModel):
    """Summary of one benchmark run plus where its per-request records are."""

    bench_id: str
    deployment: str
    config_id: str
    workload: WorkloadInfo
    summary: MetricsSummary
    replicas: list[ReplicaStats]
    records_path: str
    first_error: str | None = Field(None, description="message of the first failed request")


class SweepPoint(BaseModel):
    """One concurrency of a sweep."""

    concurrency: int
    output_tok_s_per_gpu: float
    tok_s_per_user: float
    ttft_p99_ms: float | None
    itl_p99_ms: float | None
    bench_id: str


def _first_error(records: list[RequestRecord]) -> str | None:
    return next((r.error for r in records if r.error is not None), None)


class BenchService:
    """Benchmarks over a twin backend; stores records under ``artifacts_dir``."""

    def __init__(self, backend: TwinBackend, artifacts_dir: Path,
                 trace_roots: list[Path]) -> None:
        self.backend = backend
        self.artifacts = Path(artifacts_dir)
        self.roots = [Path(r).resolve() for r in trace_roots]
        self._traces: dict[tuple[str, str], Trace] = {}

    def _resolve_trace(self, trace: str) -> Path:
        if trace.startswith("-"):
            raise BackendError(f"trace path {trace!r} must not start with '-'")
        for root in self.roots:
            p = (root / trace).resolve()
            if p.is_relative_to(root) and p.is_file():
                return p
        roots = ", ".join(str(r) for r in self.roots)
        raise BackendError(f"trace {trace!r} not found inside the allowed trace folders "
                           f"({roots}); give a path relative to one of them")

    def _store(self, bench_id: str, records: list[RequestRecord]) -> str:
        self.artifacts.mkdir(parents=True, exist_ok=True)
        ok = [r.error is None for r in records]
        itl = [r.itl_s for r in records]
        path = self.artifacts / f"{bench_id}.npz"
        tmp = path.with_suffix(".tmp.npz")
        np.savez_compressed(
            tmp, arrival_s=np.array([r.arrival_s for r in records]),
            first_token_s=np.array([r.first_token_s for r in records]),
            finish_s=np.array([r.finish_s for r in records]),
            input_tokens=np.array([r.input_tokens for r in records]),
            output_tokens=np.array([r.output_tokens for r in records]),
            ok=np.array(ok), itl_offsets=np.cumsum([0] + [len(x) for x in itl]),
            itl_s=np.concatenate(itl) if itl else np.zeros(0))
        tmp.replace(path)
        return str(path)

    @staticmethod
    def _id(deployment: str, kind: str, args: dict, config_id: str) -> str:
        blob = json.dumps({**args, "config": config_id}, sort_keys=True).encode()
        return f"{deployment}-{kind}-{hashlib.sha256(blob).hexdigest()[:8]}"

    def saturation(self, deployment: str, isl: int, osl: int, concurrency: int,
                   duration_s: float) -> BenchResult:
        """Closed-loop run at ``concurrency`` until ``duration_s`` virtual seconds, then drain.

        Raises:
            BackendError: deployment not Ready.
        """
        config, fit = self.backend.ready_fit(deployment)
        recs, stats = simulate_closed_loop(config, fit, concurrency, duration_s, isl, osl,
                                           max_requests=MAX_SATURATION_REQUESTS)
        capped = len(recs) >= MAX_SATURATION_REQUESTS
        args = {"isl": isl, "osl": osl, "c": concurrency, "d": duration_s}
        bid = self._id(deployment, "sat", args, config.config_id())
        info = WorkloadInfo(kind="saturation", requests=len(recs), isl=isl, osl=osl,
                            concurrency=concurrency,
                            description=f"synthetic ISL {isl} / OSL {osl} at concurrency "
                                        f"{concurrency} for {duration_s:g} s"
                                        + (f" (clients stopped after {MAX_SATURATION_REQUESTS:,} "
                                           "requests)" if capped else ""))
        return BenchResult(bench_id=bid, deployment=deployment, config_id=config.config_id(),
                           workload=info, summary=summarize(recs, config.gpus),
                           replicas=stats, records_path=self._store(bid, recs),
                           first_error=_first_error(recs))

    def load_window(self, trace: str, fmt: str, start_s: float, duration_s: float,
                    time_scale: float) -> tuple[Path, Trace]:
        """The scaled window of a trace (cached per file).

        Raises:
            BackendError: path outside the allowed folders; TraceInvalid: malformed trace.
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

    def replay(self, deployment: str, trace: str, fmt: str, start_s: float, duration_s: float,
               time_scale: float, slo_ttft_ms: float | None = None) -> BenchResult:
        """Open-loop replay of a trace window at its (scaled) arrival times.

        Raises:
            BackendError: deployment not Ready or trace outside the allowed folders;
            TraceInvalid: malformed trace or empty window.
        """
        config, fit = self.backend.ready_fit(deployment)
        path, win = self.load_window(trace, fmt, start_s, duration_s, time_scale)
        reqs = [(r.arrival_s, r.input_tokens, r.output_tokens, r.hash_ids, r.block_size)
                for r in win.requests]
        recs, stats = simulate_open_loop(config, fit, reqs)
        args = {"t": str(path), "s": start_s, "d": duration_s, "x": time_scale}
        bid = self._id(deployment, "replay", args, config.config_id())
        info = WorkloadInfo(kind="replay", requests=len(reqs), trace_file=path.name,
                            window_start_s=start_s, window_s=duration_s, time_scale=time_scale,
                            description=f"{path.name} window [{start_s:g}, "
                                        f"{start_s + duration_s:g}) s at {time_scale:g}x")
        return BenchResult(bench_id=bid, deployment=deployment, config_id=config.config_id(),
                           workload=info,
                           summary=summarize(recs, config.gpus, slo_ttft_ms=slo_ttft_ms),
                           replicas=stats, records_path=self._store(bid, recs),
                           first_error=_first_error(recs))

    def sweep(self, deployment: str, isl: int, osl: int, concurrencies: list[int],
              duration_s: float) -> list[SweepPoint]:
        """Saturation runs over ``concurrencies`` (the frontier's points)."""
        points = []
        for c in concurrencies:
            r = self.saturation(deployment, isl, osl, c, duration_s)
            s = r.summary
            points.append(SweepPoint(concurrency=c, output_tok_s_per_gpu=s.output_tok_s_per_gpu,
                                     tok_s_per_user=s.tok_s_per_user,
                                     ttft_p99_ms=s.ttft_ms.p99, itl_p99_ms=s.itl_ms.p99,
                                     bench_id=r.bench_id))
        return points
