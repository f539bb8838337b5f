"""Over-admission detection from a trace replay's own time series, and admission-cap candidates.

Over-admission (the practice this product grows out of: GLM-5 on B200 at the engine's default
``max_running_requests``) shows in a replay as *throughput flat while TTFT and the queue keep
rising*: the server has reached what it can deliver, yet keeps taking requests whose first token
comes ever later. The signal is read only from the run's per-request records -- no engine
counter is needed, so it works the same on the twin and on real endpoints:

- **queue** at time t: requests sent (arrival <= t) with no first token yet (t < first token);
- **running** at t: requests between their first and last token (decoding);
- **throughput** per bin: output tokens emitted in the bin, a request's first token at its
  first-token time and the others spread evenly up to its finish (the records carry TTFT and
  E2E; the exact token times are not needed at bin resolution);
- **TTFT** per bin: median TTFT of the requests that arrived in the bin.

The offered period (first to last arrival) is cut into :data:`BINS` equal bins and the verdict
is taken on the later half (:data:`STEADY_FROM`, past the warm-up): the queue and the TTFT must
rise monotonically (Kendall's tau >= :data:`MIN_TAU`, and the last bin at least
:data:`MIN_RISE` x the first of that half), while throughput stays within
:data:`FLAT_TOLERANCE` of its mean over that half (least-squares change across it).

The cap candidates follow the practice (engine default -> a cap near the measured capacity):
the median number of decoding requests per replica while the plateau held, rounded to a
multiple of :data:`CAP_STEP`, and 3/4 of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, Field

BINS = 12  # bins over the offered period
STEADY_FROM = 0.5  # the verdict reads the bins from this share of the period on
MIN_TAU = 0.6  # Kendall's tau of a series that "keeps rising"
MIN_RISE = 1.5  # last / first value of that half for the queue and the TTFT
MIN_QUEUE = 4.0  # a queue that never exceeds this many requests is no backlog
FLAT_TOLERANCE = 0.2  # |fitted change across the half| / mean throughput of a flat series
CAP_STEP = 8  # caps are rounded to this (SGLang's CUDA-graph batch sizes step by 8-16)


class AdmissionSeries(BaseModel):
    """A replay's time series, one value per bin (bin ``i`` covers ``[t0 + i*w, t0 + (i+1)*w)``)."""

    t0_s: float = Field(description="first arrival, s on the run's clock")
    bin_s: float = Field(description="bin width, s")
    throughput_tok_s: list[float] = Field(description="output tokens emitted per second")
    offered_tok_s: list[float] = Field(description="output tokens of the requests arriving, /s")
    queue: list[float] = Field(description="requests sent, no first token yet, at bin end")
    running: list[float] = Field(description="requests decoding (first token out, not finished) "
                                             "at bin end")
    ttft_p50_s: list[float | None] = Field(description="median TTFT of the bin's arrivals, s")


class OverAdmission(BaseModel):
    """The verdict on one replay, with the numbers it rests on and the caps to try."""

    detected: bool
    reason: str = Field(description="one line: the evidence, or why there is none")
    queue_tau: float | None = None
    ttft_tau: float | None = None
    throughput_change: float | None = Field(
        None, description="fitted change of throughput across the steady half / its mean")
    plateau_tok_s: float | None = Field(None, description="mean throughput over the steady "
                                                          "half, output tok/s (all replicas)")
    running_per_replica: float | None = Field(
        None, description="median decoding requests per replica over the steady half: the "
                          "concurrency the server really sustained")
    cap_candidates: list[int] = Field(default_factory=list, description=(
        "max_running_requests values to replay (per replica), largest first"))
    series: AdmissionSeries | None = None


def time_series(arrival_s: Sequence[float] | np.ndarray, ttft_s: Sequence[float] | np.ndarray,
                e2e_s: Sequence[float] | np.ndarray, output_tokens: Sequence[int] | np.ndarray,
                bins: int = BINS) -> AdmissionSeries:
    """Bin a replay's records into queue, running, throughput and TTFT series.

    Args:
        arrival_s: send time of every request, s (any origin).
        ttft_s: time to first token, s; NaN for a failed request (never counted as queued).
        e2e_s: end-to-end latency, s; NaN for a failed request.
        output_tokens: tokens each request produced.
        bins: how many bins the offered period (first to last arrival) is cut into.

    Raises:
        ValueError: no request, or ``bins`` < 2.
    """
    arr = np.asarray(arrival_s, dtype=float)
    if arr.size == 0 or bins < 2:
        raise ValueError("need at least one request and two bins")
    first = arr + np.asarray(ttft_s, dtype=float)
    finish = arr + np.asarray(e2e_s, dtype=float)
    out = np.asarray(output_tokens, dtype=float)
    ok = np.isfinite(first) & np.isfinite(finish)
    t0, t1 = float(arr.min()), float(arr.max())
    w = max((t1 - t0) / bins, 1e-9)
    edges = t0 + w * np.arange(bins + 1)
    f, e, n = first[ok], finish[ok], out[ok]
    span = np.maximum(e - f, 1e-12)
    thr, offered, queue, running, ttft = [], [], [], [], []
    for i in range(bins):
        lo, hi = edges[i], edges[i + 1]
        rest = np.clip(np.minimum(e, hi) - np.maximum(f, lo), 0.0, None) / span * (n - 1)
        firsts = ((f >= lo) & (f < hi)).sum()
        thr.append(float((rest.sum() + firsts) / w))
        in_bin = (arr >= lo) & ((arr < hi) if i < bins - 1 else (arr <= hi))
        offered.append(float(out[in_bin].sum() / w))
        queue.append(float(((arr <= hi) & ok & (first > hi)).sum()))
        running.append(float(((first <= hi) & (finish > hi) & ok).sum()))
        tt = (first - arr)[in_bin & ok]
        ttft.append(float(np.median(tt)) if tt.size else None)
    return AdmissionSeries(t0_s=t0, bin_s=w, throughput_tok_s=thr, offered_tok_s=offered,
                           queue=queue, running=running, ttft_p50_s=ttft)


def _tau(values: Sequence[float]) -> float:
    if len(values) < 3 or len(set(values)) < 2:
        return 0.0
    from scipy import stats  # here: scipy.stats takes about 1 s to import

    tau = stats.kendalltau(np.arange(len(values)), np.asarray(values)).statistic
    return 0.0 if math.isnan(tau) else float(tau)


def cap_candidates(running_per_replica: float, current_cap: int | None = None) -> list[int]:
    """Admission caps near the measured capacity: that concurrency and 3/4 of it.

    Rounded to a multiple of :data:`CAP_STEP` (at least one step); the current cap is left
    out. Largest first.
    """
    def r(x: float) -> int:
        return max(CAP_STEP, int(round(x / CAP_STEP)) * CAP_STEP)
    caps = sorted({r(running_per_replica), r(0.75 * running_per_replica)}, reverse=True)
    return [c for c in caps if c != current_cap]


def detect(series: AdmissionSeries, replicas: int = 1,
           current_cap: int | None = None) -> OverAdmission:
    """Over-admission verdict on a replay's series (see the module docstring for the rule).

    Args:
        series: from :func:`time_series`.
        replicas: replicas that served the replay (caps are per replica).
        current_cap: the config's explicit ``max_running_requests`` (left out of the
            candidates); None: the engine's default.
    """
    k = int(len(series.queue) * STEADY_FROM)
    queue = series.queue[k:]
    ttft = [x for x in series.ttft_p50_s[k:] if x is not None]
    thr = np.asarray(series.throughput_tok_s[k:], dtype=float)
    q_tau, t_tau = _tau(queue), _tau(ttft)
    mean = float(thr.mean()) if thr.size else 0.0
    change = 0.0
    if thr.size >= 2 and mean > 0:
        slope = float(np.polyfit(np.arange(thr.size), thr, 1)[0])
        change = slope * (thr.size - 1) / mean
    running = float(np.median(series.running[k:])) / max(replicas, 1)
    q_rise = queue[-1] >= MIN_QUEUE and queue[-1] >= MIN_RISE * max(queue[0], 1.0)
    t_rise = len(ttft) >= 3 and ttft[-1] >= MIN_RISE * max(ttft[0], 1e-6)
    rising_q, rising_t = q_tau >= MIN_TAU and q_rise, t_tau >= MIN_TAU and t_rise
    flat = abs(change) <= FLAT_TOLERANCE
    facts = (f"queue {queue[0]:.0f} -> {queue[-1]:.0f} requests (tau {q_tau:+.2f}), TTFT p50 "
             + (f"{ttft[0]:.1f} -> {ttft[-1]:.1f} s" if ttft else "n/a")
             + f" (tau {t_tau:+.2f}), throughput {mean:,.0f} tok/s ({change:+.0%} across the "
             f"second half), {running:.0f} decoding per replica")
    base = dict(queue_tau=q_tau, ttft_tau=t_tau, throughput_change=change, plateau_tok_s=mean,
                running_per_replica=running, series=series)
    if rising_q and rising_t and flat:
        return OverAdmission(detected=True, cap_candidates=cap_candidates(running, current_cap),
                             reason=f"over-admission: throughput flat while the queue and TTFT "
                                    f"keep rising: {facts}", **base)
    why = [w for w, bad in (("queue not rising", not rising_q), ("TTFT not rising", not rising_t),
                            ("throughput not flat", not flat)) if bad]
    return OverAdmission(detected=False, reason=f"no over-admission ({', '.join(why)}): {facts}",
                         **base)


def adopt(parent_p99_ms: float | None, parent_tok_s: float, tuned_p99_ms: float | None,
          tuned_tok_s: float, tuned_errors: int, slo_ms: float,
          min_improvement: float) -> tuple[bool, str]:
    """Whether a retuned config (cap, HiCache) replaces its finalist on the trace.

    It must serve every request, keep the replay's output throughput within
    ``min_improvement`` of the finalist's, and either meet the TTFT p99 SLO the finalist
    missed or lower TTFT p99 by more than ``min_improvement`` (the study's noise margin).

    Returns:
        (adopted, one-line reason with the numbers).
    """
    if tuned_p99_ms is None or tuned_errors:
        return False, f"{tuned_errors} requests failed" if tuned_errors else "no TTFT measured"
    before = f"{parent_p99_ms:,.0f}" if parent_p99_ms is not None else "n/a"
    facts = (f"replay TTFT p99 {before} -> {tuned_p99_ms:,.0f} ms, output "
             f"{parent_tok_s:,.0f} -> {tuned_tok_s:,.0f} tok/s")
    if tuned_tok_s < (1 - min_improvement) * parent_tok_s:
        return False, f"not adopted, throughput fell: {facts}"
    rescued = tuned_p99_ms <= slo_ms and (parent_p99_ms is None or parent_p99_ms > slo_ms)
    better = parent_p99_ms is not None and tuned_p99_ms < (1 - min_improvement) * parent_p99_ms
    if rescued or better:
        why = ("meets the SLO the finalist missed" if rescued or parent_p99_ms is None
               else f"TTFT p99 {tuned_p99_ms / parent_p99_ms - 1:+.0%}")
        return True, f"adopted ({why}): {facts}"
    return False, (f"not adopted (TTFT p99 not lower by more than {min_improvement:.0%}): "
                   f"{facts}")
