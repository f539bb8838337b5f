"""The aiperf target: the HTTP target's servers loaded by aiperf 0.13.0, not the built-in runner.

aiperf (:mod:`mcp_servers.bench.aiperf`: the ``[aiperf]`` extra or ``SERVETUNE_AIPERF``) runs as
its own process and writes its artifacts under ``<artifacts>/<bench id>.aiperf``; they are parsed
back into the same records, so everything after the load generator (validity, flags, the
prefix-cache check, storage) is the HTTP target's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from domain.workload import Request
from mcp_servers.bench.aiperf import AiperfRun, AiperfRunner
from mcp_servers.bench.http import HttpRun, TickFn
from mcp_servers.bench.targets.base import ArrivalProcess, ProgressFn, RunnerKind
from mcp_servers.bench.targets.http import HttpTarget


class AiperfTarget(HttpTarget):
    """Real servers at ``urls``, loaded by aiperf."""

    runner: RunnerKind = "aiperf"

    def aiperf_runner(self) -> AiperfRunner:
        """An aiperf runner with the service's binary, cache and request timeout."""
        svc = self.svc
        return AiperfRunner(svc.artifacts / "aiperf-cache", binary=svc.aiperf_binary,
                            request_timeout_s=svc.request_timeout_s)

    async def _closed_loop_run(self, bid: str, what: str, model: str, isl: int, osl: int,
                               concurrency: int, duration_s: float, progress: ProgressFn | None,
                               tick: TickFn | None) -> HttpRun | AiperfRun:
        if progress:
            await progress(0, None, f"aiperf: {what} for {duration_s:g} s")
        return await self.aiperf_runner().synthetic(
            "concurrency", self.load_urls, model, self.svc.artifacts / f"{bid}.aiperf", isl=isl,
            osl=osl, duration_s=duration_s, concurrency=concurrency)

    async def _rate_run(self, bid: str, what: str, model: str, times: np.ndarray, isl: int,
                        osl: int, request_rate: float, duration_s: float,
                        arrival: ArrivalProcess, seed: int,
                        progress: ProgressFn | None) -> HttpRun | AiperfRun:
        if progress:
            await progress(0, len(times), f"aiperf: {what}")
        return await self.aiperf_runner().synthetic(
            "rate", self.load_urls, model, self.svc.artifacts / f"{bid}.aiperf", isl=isl, osl=osl,
            duration_s=duration_s, request_rate=request_rate, arrival=arrival, seed=seed)

    async def _replay_run(self, bid: str, requests: list[Request], plan: Any, model: str,
                          slo_ttft_ms: float | None,
                          progress: ProgressFn | None) -> HttpRun | AiperfRun:
        return await self.aiperf_runner().replay(
            requests, self.load_urls, model, self.svc.artifacts / f"{bid}.aiperf",
            slo_ttft_ms=slo_ttft_ms)
