"""Per-request records -> a metrics summary (the Pareto frontier lives in :mod:`domain.pareto`).

Definitions follow SGLang's ``bench_serving`` (``sglang/benchmark/serving.py: calculate_metrics``;
sglang-knobs reference section 5.4):

- TTFT: first token time - send (arrival) time; E2E: last token - arrival.
- ITL: every gap between consecutive output tokens of a request (pooled over requests).
- TPOT: (E2E - TTFT) / (output_tokens - 1) per request with more than one output token.
- Output throughput: total output tokens / duration, where duration runs from the first arrival
  to the last finish; tok/s/GPU divides it by the GPUs of the config.
- tok/s/user: mean over requests of 1 / TPOT (the decode speed one user sees).
- Goodput: completed requests per second that met every SLO given.
Percentiles use linear interpolation (numpy's default). Times are seconds in records; the summary
carries milliseconds (``*_ms``) for latencies and seconds for durations.

The CUDA-graph ceiling (:func:`graph_ceiling`): SGLang captures decode CUDA graphs up to
``cuda_graph_max_bs_decode`` and runs a larger decode batch eagerly, one kernel launch at a time
(sglang-knobs reference, ``cuda_graph_max_bs_decode``); where launch overhead is a large part of
a decode step, ITL jumps as the running batch crosses the ceiling. Two runs whose running batches
straddle their ceiling, the eager one's median ITL at least :data:`GRAPH_CEILING_ITL_RATIO` times
the in-graph one's ("roughly doubles"), name that cause.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, Field

from domain.pareto import pareto_front as pareto_front  # re-exported; defined there


@dataclass(slots=True)
class RequestRecord:
    """One request as a load generator saw it. Times in seconds; ``itl_s`` holds the gaps."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    first_token_s: float = math.nan
    finish_s: float = math.nan
    itl_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    error: str | None = None
    # PD disaggregation: seconds of the prompt's KV transfer (prefill end to KV on the decode
    # server) inside this request's TTFT; 0 on an aggregated server
    transfer_s: float = 0.0

    @property
    def ttft_s(self) -> float:
        """Time to first token, s (NaN on error)."""
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        """End-to-end latency, s (NaN on error)."""
        return self.finish_s - self.arrival_s


class Percentiles(BaseModel):
    """p50/p90/p99 and mean of one latency, in ms (None when there are no samples)."""

    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None

    @classmethod
    def of(cls, seconds: Sequence[float] | np.ndarray) -> Percentiles:
        """Percentiles of ``seconds`` reported in milliseconds."""
        a = np.asarray(seconds, dtype=float) * 1e3
        if a.size == 0:
            return cls(p50=None, p90=None, p99=None, mean=None)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(p50=float(p50), p90=float(p90), p99=float(p99), mean=float(a.mean()))


class MetricsSummary(BaseModel):
    """Summary of one benchmark run (one workload on one config)."""

    requests: int
    completed: int
    errors: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    output_tok_s: float
    input_tok_s: float
    output_tok_s_per_gpu: float
    tok_s_per_user: float
    request_rate: float
    ttft_ms: Percentiles
    itl_ms: Percentiles
    tpot_ms: Percentiles
    e2e_ms: Percentiles
    goodput_req_s: float | None = None
    gpus: int
    decode_batch: float | None = Field(
        None, description="mean running decode batch per replica over the run's decode steps "
        "(the twin's scheduler; None where the server does not say)")
    retractions: int | None = Field(
        None, description="running requests the engine retracted to its queue during the run "
        "(decode ran out of KV; each is recomputed later): the twin's scheduler counter, or "
        "the difference of the server's retraction counter around the run "
        "(``Engine.metrics['retracted_requests']``); None when the server exposes none")


def summarize(records: Sequence[RequestRecord], gpus: int,
              slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> MetricsSummary:
    """Summarize ``records`` of a run on ``gpus`` GPUs.

    Args:
        records: one per request; failed ones carry ``error``.
        gpus: GPUs of the config (tp x replicas), for tok/s/GPU.
        slo_ttft_ms: optional TTFT target (ms) for goodput.
        slo_tpot_ms: optional TPOT target (ms) for goodput.

    Raises:
        ValueError: if ``gpus`` < 1.
    """
    if gpus < 1:
        raise ValueError("gpus must be >= 1")
    ok = [r for r in records if r.error is None]
    if ok:
        start = min(r.arrival_s for r in records)
        end = max(r.finish_s for r in ok)
        duration = max(end - start, 1e-9)
    else:
        duration = 0.0
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.input_tokens for r in ok)
    ttft = [r.ttft_s for r in ok]
    e2e = [r.e2e_s for r in ok]
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = np.concatenate([r.itl_s for r in ok]) if ok else np.zeros(0)
    per_user = [1.0 / t for t in tpot if t > 0]
    good = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        n_good = 0
        for r in ok:
            t_ok = slo_ttft_ms is None or r.ttft_s * 1e3 <= slo_ttft_ms
            p = (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
            p_ok = slo_tpot_ms is None or p * 1e3 <= slo_tpot_ms
            n_good += t_ok and p_ok
        good = n_good / duration if duration else 0.0
    out_rate = out_tok / duration if duration else 0.0
    return MetricsSummary(
        requests=len(records), completed=len(ok), errors=len(records) - len(ok),
        duration_s=duration, input_tokens=in_tok, output_tokens=out_tok,
        output_tok_s=out_rate, input_tok_s=in_tok / duration if duration else 0.0,
        output_tok_s_per_gpu=out_rate / gpus,
        tok_s_per_user=float(np.mean(per_user)) if per_user else 0.0,
        request_rate=len(ok) / duration if duration else 0.0,
        ttft_ms=Percentiles.of(ttft), itl_ms=Percentiles.of(itl), tpot_ms=Percentiles.of(tpot),
        e2e_ms=Percentiles.of(e2e), goodput_req_s=good, gpus=gpus,
    )


def ttft_transfer_share(records: Sequence[RequestRecord]) -> float | None:
    """The KV transfer's share of TTFT over the completed requests (PD disaggregation).

    ``sum(transfer_s) / sum(ttft_s)`` over records without error: the fraction of all the time
    to first token spent moving prompts' KV from prefill to decode servers. None when no
    completed request has a transfer (an aggregated run) or none completed.
    """
    ok = [r for r in records if r.error is None]
    moved = sum(r.transfer_s for r in ok)
    if not ok or moved <= 0:
        return None
    return moved / max(sum(r.ttft_s for r in ok), 1e-12)


# "ITL roughly doubles" past the ceiling: an eager run's median ITL at least 1.8 x an in-graph
# run's names the graph ceiling as the cause (below 2 to allow for measurement noise).
GRAPH_CEILING_ITL_RATIO = 1.8


@dataclass(frozen=True)
class CeilingPoint:
    """One run for :func:`graph_ceiling`.

    Its running decode batch per replica, median ITL (ms), the CUDA-graph ceiling its config
    resolves to, and a label (e.g. ``"#3"``, ``"c=64"``).
    """

    batch: float
    itl_p50_ms: float
    ceiling: int
    label: str = ""


class GraphCeiling(BaseModel):
    """Decode ran eagerly past the CUDA-graph ceiling: the two runs that show it."""

    ceiling: int = Field(description="cuda_graph_max_bs_decode of the eager run's config")
    batch_below: float = Field(description="running decode batch per replica, in-graph run")
    itl_below_ms: float = Field(description="median ITL of the in-graph run, ms")
    batch_above: float = Field(description="running decode batch per replica, eager run")
    itl_above_ms: float = Field(description="median ITL of the eager run, ms")
    below: str = ""
    above: str = ""

    @property
    def ratio(self) -> float:
        """ITL above / below."""
        return self.itl_above_ms / self.itl_below_ms

    def text(self) -> str:
        """One line naming the cause, with the numbers and the fix."""
        def at(label: str) -> str:
            return f" ({label})" if label else ""
        return (f"graph ceiling: decode ran eager past cuda_graph_max_bs_decode {self.ceiling}: "
                f"ITL p50 {self.itl_above_ms:.1f} ms at a running batch of "
                f"{self.batch_above:.0f}{at(self.above)} vs {self.itl_below_ms:.1f} ms at "
                f"{self.batch_below:.0f}{at(self.below)}, {self.ratio:.1f}x; raise "
                f"--cuda-graph-max-bs-decode to the batch or cap --max-running-requests at "
                f"{self.ceiling}")


def graph_ceiling(points: Sequence[CeilingPoint],
                  ratio: float = GRAPH_CEILING_ITL_RATIO) -> GraphCeiling | None:
    """The CUDA-graph-ceiling cause shown by ``points`` (runs of comparable configs), or None.

    A point is eager when its batch exceeds its own ceiling, in-graph otherwise. Of every
    (eager, in-graph) pair, the one with the closest batches is judged (the least of the ITL
    change is then the batch's own); the cause is named when its eager ITL is at least
    ``ratio`` x the in-graph one's. Points without a positive ITL are skipped.
    """
    ok = [p for p in points if p.itl_p50_ms > 0 and p.batch > 0]
    pairs = [(e, g) for e in ok if e.batch > e.ceiling for g in ok if g.batch <= g.ceiling]
    if not pairs:
        return None
    e, g = min(pairs, key=lambda eg: abs(math.log(eg[0].batch / eg[1].batch)))
    if e.itl_p50_ms < ratio * g.itl_p50_ms:
        return None
    return GraphCeiling(ceiling=e.ceiling, batch_below=g.batch, itl_below_ms=g.itl_p50_ms,
                        batch_above=e.batch, itl_above_ms=e.itl_p50_ms, below=g.label,
                        above=e.label)
