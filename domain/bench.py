"""Benchmark results: what one run measured, and the thresholds that decide whether it counts.

The one benchmark result model: :class:`BenchResult` is what the bench server's
``run_saturation``, ``run_replay`` and ``run_rate`` return (and what is stored beside each run's
records), and what the analyst and the graph parse that tool output into; ``sweep`` returns
:class:`SweepPoint` s. :class:`Quality` holds the thresholds of ``valid`` and ``flags``: a run
whose failed share exceeds ``max_error_share`` (default 5 %) is ``valid: false``; an open-loop
HTTP run whose dispatch lag p99 exceeds ``max_dispatch_lag_p99_ms`` (default 10 ms), or a replay
whose achieved prefix-cache hit rate is more than ``hit_rate_tolerance`` (default 0.15) from the
trace's expected rate, is flagged.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from domain.metrics import MetricsSummary, Percentiles
from domain.twin.cluster import ReplicaStats

MAX_ERROR_SHARE = 0.05  # a run with a larger share of failed requests is invalid
MAX_DISPATCH_LAG_P99_MS = 10.0  # an open-loop HTTP run sending later than this at p99 is flagged
HIT_RATE_TOLERANCE = 0.15  # |achieved - expected| prefix-cache hit rate above this is flagged


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
    replicas: list[ReplicaStats] = Field(default_factory=list, description=(
        "what the twin saw, per replica (empty for http): requests routed to it, requests in "
        "flight (mean over busy time, max), retractions and the tokens they prefill again, "
        "eager decode steps above cuda_graph_max_bs_decode and their share, all-reduce share "
        "of decode time, cache hits"))
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
    replica_requests: list[int] | None = Field(None, description=(
        "http: requests each replica's server finished during the run (the difference of its "
        "sglang:num_requests_total around the run), in endpoint order: how the router or the "
        "client spread the load; None on the twin (see replicas) or when a server exposes no "
        "such counter"))
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
    retractions: int | None = Field(None, description="requests the engine retracted during "
                                    "the point's run (None: the server exposes no counter)")
