"""Noise-gated acceptance: keep a candidate only when its gain over the best exceeds the noise.

A search that keeps every candidate whose measured objective beats the incumbent by
``min_improvement`` keeps noise as often as gains once run-to-run variation is comparable to the
threshold. The gate instead asks for the whole confidence interval of the relative gain

    gain = mean(candidate) / mean(incumbent) - 1

to lie above ``min_improvement``. The interval is a two-sample bootstrap
(:func:`scipy.stats.bootstrap`, BCa, samples resampled independently) over:

- **runs** -- the objective (output tok/s/GPU) of each repeated saturation run, when both configs
  have at least two runs (``acceptance.repeats`` / ``SERVETUNE_REPEATS`` >= 2). This is the
  interval that sees run-to-run noise.
- **time blocks** -- with one run each, the output tok/s/GPU of :data:`BLOCKS` equal slices of each
  run's wall (or virtual) time (:func:`block_rates`). Their mean is exactly the run's objective, so
  the point gain is the same as the runs' ratio; the interval only sees variation within a run
  (ramp-up, drain, batch dynamics), not between runs, so it is too narrow when runs differ by a
  constant factor. Repeat runs for a gate that sees that noise.

Standard library, numpy, scipy and pydantic only.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field

from domain.metrics import RequestRecord

BLOCKS = 10  # time slices of a single run (a 120 s run: 12 s each, ~ tens of decode batches)
N_RESAMPLES = 2000  # bootstrap resamples: the interval's ends move by < 0.1 % of gain beyond this
SampleKind = Literal["runs", "time blocks"]


class AcceptDecision(BaseModel):
    """The gate's decision on one candidate against the incumbent, with its interval."""

    accepted: bool = Field(description="ci_low > min_improvement")
    gain: float = Field(description="mean(candidate) / mean(incumbent) - 1 (0.05 = +5 %)")
    ci_low: float = Field(description="lower end of the interval on the gain")
    ci_high: float = Field(description="upper end of the interval on the gain")
    confidence: float = Field(description="level of the interval, e.g. 0.95")
    min_improvement: float = Field(description="the study's threshold on the gain")
    samples: SampleKind = Field(description="what was resampled: repeated runs or time blocks "
                                            "of one run each")
    n_candidate: int = Field(description="samples of the candidate")
    n_incumbent: int = Field(description="samples of the incumbent")
    method: str = Field(description="BCa, percentile, or exact (no spread in either sample, or a "
                        "sample of one: the interval is the point)")

    @property
    def ci_width(self) -> float:
        """Width of the interval on the gain (0.04 = 4 percentage points)."""
        return self.ci_high - self.ci_low

    def text(self) -> str:
        """One line for ledger reasons and the report."""
        head = (f"gain {self.gain:+.1%} ({self.confidence:.0%} CI {self.ci_low:+.1%} .. "
                f"{self.ci_high:+.1%}, {self.n_candidate} vs {self.n_incumbent} {self.samples})")
        if self.samples == "time blocks":
            return head + ": one run each, the interval sees no run-to-run noise (not gated)"
        op, verb = (">", "accepted") if self.accepted else ("<=", "rejected")
        return f"{head}: CI low {op} {self.min_improvement:.0%}, {verb} by the noise gate"


def block_rates(records: Sequence[RequestRecord], gpus: int,
                blocks: int = BLOCKS) -> list[float]:
    """Output tok/s/GPU of ``blocks`` equal time slices of one run.

    The run spans the first send to the last finish (as :func:`domain.metrics.summarize`
    measures it). A token counts in the slice where it was emitted: the first at
    ``first_token_s``, the others at ``first_token_s`` plus the cumulative inter-token gaps;
    tokens a record counts beyond its gaps (e.g. several per streamed chunk) at ``finish_s``.
    The mean of the slices' rates is the run's output tok/s/GPU.

    Returns:
        ``blocks`` rates (empty when no request completed).

    Raises:
        ValueError: ``gpus`` or ``blocks`` < 1.
    """
    if gpus < 1 or blocks < 1:
        raise ValueError("gpus and blocks must be >= 1")
    ok = [r for r in records if r.error is None and r.output_tokens > 0]
    if not ok:
        return []
    start = min(r.arrival_s for r in records)
    end = max(r.finish_s for r in ok)
    width = max(end - start, 1e-9) / blocks
    first = np.array([r.first_token_s for r in ok])
    gaps = [np.asarray(r.itl_s, dtype=float) for r in ok]
    n_gaps = np.array([g.size for g in gaps])
    # time of every later token: its record's first token + the record's cumulative gaps
    cum = np.cumsum(np.concatenate(gaps)) if n_gaps.sum() else np.zeros(0)
    before = np.concatenate(([0.0], cum))[np.cumsum(n_gaps) - n_gaps]  # cum at record start
    later = np.repeat(first - before, n_gaps) + cum
    extra = np.maximum(np.array([r.output_tokens for r in ok]) - 1 - n_gaps, 0)
    times = np.concatenate((first, later, [r.finish_s for r in ok]))
    weights = np.concatenate((np.ones(first.size), np.ones(later.size), extra))
    idx = np.clip(((times - start) / width).astype(int), 0, blocks - 1)
    counts = np.bincount(idx, weights=weights, minlength=blocks)
    return [float(c) / width / gpus for c in counts]


def pick_samples(candidate_runs: Sequence[float], incumbent_runs: Sequence[float],
                 candidate_blocks: Sequence[float], incumbent_blocks: Sequence[float]
                 ) -> tuple[list[float], list[float], SampleKind]:
    """The samples the gate resamples: runs when both have >= 2, else the time blocks."""
    if len(candidate_runs) >= 2 and len(incumbent_runs) >= 2:
        return list(candidate_runs), list(incumbent_runs), "runs"
    return list(candidate_blocks), list(incumbent_blocks), "time blocks"


def _gain(c: Any, i: Any, axis: int = -1) -> Any:
    return np.mean(c, axis=axis) / np.mean(i, axis=axis) - 1


def decide(candidate: Sequence[float], incumbent: Sequence[float], min_improvement: float,
           confidence: float = 0.95, seed: int = 0,
           samples: SampleKind = "runs") -> AcceptDecision:
    """Accept ``candidate`` over ``incumbent`` iff the interval's low end exceeds the threshold.

    Args:
        candidate: the candidate's samples (run objectives or block rates, tok/s/GPU).
        incumbent: the incumbent's samples, same kind.
        min_improvement: the study's threshold on the relative gain (0.02 = 2 %).
        confidence: level of the two-sided bootstrap interval.
        seed: seed of the resampling (same inputs and seed, same interval).
        samples: what the samples are, recorded on the decision.

    Raises:
        ValueError: an empty sample, or an incumbent whose mean is not positive.
    """
    c = np.asarray(candidate, dtype=float)
    i = np.asarray(incumbent, dtype=float)
    if c.size == 0 or i.size == 0:
        raise ValueError("both samples need at least one value")
    if not i.mean() > 0:
        raise ValueError("the incumbent's mean objective must be positive")
    gain = float(_gain(c, i))
    lo = hi = gain
    method = "exact"
    if min(c.size, i.size) >= 2 and (np.ptp(c) > 0 or np.ptp(i) > 0):
        lo, hi, method = math.nan, math.nan, "BCa"
        from scipy import stats  # here: scipy.stats takes about 1 s to import

        for method in ("BCa", "percentile"):  # BCa is undefined on some tiny samples
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", stats.DegenerateDataWarning)
                res = stats.bootstrap((c, i), _gain, n_resamples=N_RESAMPLES,
                                      confidence_level=confidence, method=method.lower(),
                                      vectorized=True, paired=False, rng=seed)
            lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
            if math.isfinite(lo) and math.isfinite(hi):
                break
    return AcceptDecision(accepted=bool(lo > min_improvement), gain=gain, ci_low=lo,
                          ci_high=hi, confidence=confidence, min_improvement=min_improvement,
                          samples=samples, n_candidate=int(c.size), n_incumbent=int(i.size),
                          method=method)
