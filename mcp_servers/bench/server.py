"""The bench MCP server: saturation runs, trace replays and concurrency sweeps."""

from __future__ import annotations

import logging
from typing import Annotated, Literal

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations
from pydantic import Field

from mcp_servers.bench.ops import BenchResult, BenchService, SweepPoint
from mcp_servers.cluster.backend import BackendError
from mcp_servers.tool_errors import StrictMCPServer, as_tool_errors

log = logging.getLogger("servetune.mcp.bench")

Deployment = Annotated[str, Field(description="name of a Ready deployment", min_length=1,
                                  max_length=52, pattern=r"^[a-z0-9][-a-z0-9]*$")]
Tokens = Annotated[int, Field(ge=1, le=1_000_000, description="tokens")]


def build_server(service: BenchService) -> MCPServer:
    """An MCP server whose tools benchmark deployments of ``service``'s backend."""
    server = StrictMCPServer("servetune-bench", instructions=(
        "Benchmark Ready deployments: run_saturation (synthetic closed loop), run_replay "
        "(a real trace at its arrival times), run_sweep (concurrency sweep). Results are "
        "metric summaries; per-request records are stored at records_path."))

    def _guard(fn, *args, **kwargs):  # noqa: ANN001, ANN202
        with as_tool_errors(BackendError):
            return fn(*args, **kwargs)

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True, idempotentHint=True))
    def run_saturation(
        deployment: Deployment, isl: Tokens, osl: Tokens,
        concurrency: Annotated[int, Field(ge=1, le=100_000, description="clients in flight")],
        duration_s: Annotated[float, Field(gt=0, le=3600, description="seconds of new load")],
    ) -> BenchResult:
        """Closed-loop synthetic load (fixed ISL/OSL) at a fixed concurrency, then drain."""
        return _guard(service.saturation, deployment, isl, osl, concurrency, duration_s)

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True, idempotentHint=True))
    def run_replay(
        deployment: Deployment,
        trace: Annotated[str, Field(description="trace file relative to an allowed folder",
                                    min_length=1, max_length=4096)],
        start_s: Annotated[float, Field(ge=0, description="window start in trace time, s")],
        duration_s: Annotated[float, Field(gt=0, le=86_400, description="window length, s")],
        time_scale: Annotated[float, Field(gt=0, le=1000, description="2.0 = twice as fast")]
        = 1.0,
        format: Literal["auto", "mooncake", "azure", "bailian"] = "auto",
        slo_ttft_ms: Annotated[float | None, Field(gt=0, description="TTFT SLO for goodput")]
        = None,
    ) -> BenchResult:
        """Replay a window of a real trace with its (scaled) arrival times."""
        return _guard(service.replay, deployment, trace, format, start_s, duration_s,
                      time_scale, slo_ttft_ms)

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True, idempotentHint=True))
    def run_sweep(
        deployment: Deployment, isl: Tokens, osl: Tokens,
        concurrencies: Annotated[list[Annotated[int, Field(ge=1, le=100_000)]],
                                 Field(min_length=1, max_length=32)],
        duration_s: Annotated[float, Field(gt=0, le=3600)],
    ) -> list[SweepPoint]:
        """Saturation runs at each concurrency: points of the tok/s/GPU vs tok/s/user frontier."""
        return _guard(service.sweep, deployment, isl, osl, concurrencies, duration_s)

    return server

