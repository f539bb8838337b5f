"""Search maths of the space brains: knob-space order, estimate correction, UCB, P(meets the SLO).

The seeded order of a knob space, the Bayesian correction of the steady-state estimate by what
a run measured, its optimism (UCB), the probability of meeting the SLO and the learnt SLO
boundary. Pure functions and one small model; the brains (``agents.brains``) bind them to a
study and a ledger. A *point* of a knob space is a tuple of value indices, one per knob in the
study's knob order; ``sizes`` is the number of values of each knob.

- **Order** (grid brain, and the guided brain's sample of a large space): :func:`point_at`
  decodes an index of the product in mixed radix, :func:`seeded_permutation` visits every index
  once in a seeded order.
- **Throughput** (guided brain): the prior is the estimate's saturation tok/s/GPU; measured
  configs give log residuals (:func:`log_residual`) that :class:`ResidualModel`, a Bayesian
  linear regression on one-hot knob values, explains by a shared intercept plus one effect per
  knob value. :meth:`ResidualModel.corrected` gives a point's corrected prediction and its
  optimistic one :data:`UCB_Z` posterior sds above (upper confidence bound, Srinivas et al.,
  "Gaussian Process Optimization in the Bandit Setting", ICML 2010).
- **The SLO**: :func:`slo_ratio` (predicted TTFT p99 over the SLO), :func:`p_meets_slo` (a
  normal CDF around the boundary ``theta``, the probability of feasibility of constrained
  Bayesian optimisation, Gardner et al., ICML 2014) and :func:`best_threshold` (the boundary
  that misclassifies the fewest launched configs).
- **Ranking**: :func:`score` (optimistic throughput times the floored SLO probability) and
  :func:`score_bucket` (scores within :data:`TIE` tie); :func:`stop_bar` (what an untried
  point's optimistic throughput must beat for the search to go on).

Standard library and numpy; scipy.stats is imported inside :func:`p_meets_slo` only, so
importing this module is cheap.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:  # domain.estimate imports scipy.stats (~1 s); only its type is needed here
    from domain.estimate import Estimate

Point = tuple[int, ...]

# Largest space the seeded order shuffles as a list (2**20 indices, ~40 MB of ints; a study's
# knob space is usually a few hundred points).
SHUFFLE_MAX = 2**20
# Prior sd of the estimate's log error for one config: the estimators reference measures
# aiconfigurator's TPOT at 32 % mean absolute error against measured rows (sigma ~ 0.3).
SIGMA_PRIOR = 0.3
# Sd of what the per-knob-value model cannot explain (an error of one config alone, run noise),
# in log tok/s/GPU.
SIGMA_NOISE = 0.15
# Sd of the TTFT prediction's log error: the estimators reference has aiconfigurator's TTFT
# about 2x off (ln 2 ~ 0.7); servetune's queueing estimate is 3-4x pessimistic on the default
# study's long-prompt trace, which a learnt boundary (slo_gated) absorbs.
SIGMA_TTFT = 0.7
# Optimism of the ranking and of the stop rule: a point's throughput is taken this many
# posterior sds above its mean (2: a one-sided 97.7 % bound; 1 stopped 13 % of the benchmark's
# perturbed-prior searches short of 95 % of the optimum, 2 stops 3 %).
UCB_Z = 2.0
# Floor of the SLO probability in the score: the TTFT prior can be off by more than its sd, so
# where every config is predicted far over the SLO, throughput still orders them.
FEASIBLE_FLOOR = 0.05
# Predicted scores within this log-distance of each other (2 %) are ties (:func:`score_bucket`).
TIE = math.log(1.02)


# -- the order of a knob space ---------------------------------------------------------------

def point_at(k: int, sizes: Sequence[int]) -> Point:
    """The ``k``-th point of the product of ``sizes`` in mixed radix (last knob fastest).

    Args:
        k: index in ``[0, prod(sizes))``.
        sizes: number of values of each knob, in knob order (each >= 1).

    Returns:
        One value index per knob.
    """
    out: list[int] = []
    for n in reversed(sizes):
        k, r = divmod(k, n)
        out.append(r)
    return tuple(reversed(out))


def seeded_permutation(n: int, seed: int, shuffle_max: int = SHUFFLE_MAX) -> Iterator[int]:
    """Every index of ``range(n)`` exactly once, in an order fixed by ``seed``.

    Up to ``shuffle_max`` indices: a seeded shuffle (``random.Random(seed).shuffle``). More: a
    seeded affine permutation ``k -> (a*k + b) mod n`` with ``gcd(a, n) = 1``, O(1) per index
    and nothing materialised (more regular, still a permutation).

    Args:
        n: size of the space (0 yields nothing).
        seed: the search seed (``search.seed``).
        shuffle_max: largest ``n`` shuffled as a list (:data:`SHUFFLE_MAX`).
    """
    if n == 0:
        return
    rng = random.Random(seed)
    if n <= shuffle_max:
        order = list(range(n))
        rng.shuffle(order)
        yield from order
        return
    a = rng.randrange(1, n + 1) if n > 1 else 1
    while math.gcd(a, n) != 1:
        a = rng.randrange(1, n + 1)
    b = rng.randrange(n)
    for k in range(n):
        yield (a * k + b) % n


# -- throughput: the residual correction -----------------------------------------------------

def log_residual(measured: float | None, predicted: float) -> float | None:
    """``log(measured / predicted)`` of one measured config, or None when it says nothing.

    Args:
        measured: the measured objective (tok/s/GPU), None when the run scored none.
        predicted: the estimate's tok/s/GPU.

    Returns:
        The log residual; None unless both are positive.
    """
    if measured is None or predicted <= 0 or measured <= 0:
        return None
    return math.log(measured / predicted)


class ResidualModel:
    """Posterior of the log-residual model (Bayesian linear regression, conjugate normal).

    ``r = c + X b + noise``: ``X`` one-hot knob values, ``b ~ N(0, tau^2 I)`` with ``tau =
    sigma_prior / sqrt(K)`` for ``K`` knobs (so one config's prior error is ``sigma_prior``),
    noise ``N(0, sigma_noise^2)``, ``c`` the residuals' mean (an error shared by every config,
    which changes no ranking). Posterior covariance ``(X'X / s^2 + I / tau^2)^-1``, mean ``cov
    X' (r - c) / s^2`` (Bishop, "Pattern Recognition and Machine Learning", 2006, section 3.3).
    Before :meth:`fit` (or fitted on nothing) the posterior is the prior.

    Args:
        sizes: number of values of each knob, in knob order.
        sigma_prior: prior sd of one config's log error (:data:`SIGMA_PRIOR`).
        sigma_noise: sd of what the per-value effects cannot explain (:data:`SIGMA_NOISE`).
    """

    def __init__(self, sizes: Sequence[int], sigma_prior: float = SIGMA_PRIOR,
                 sigma_noise: float = SIGMA_NOISE) -> None:
        self.sizes = list(sizes)
        self.sigma_prior, self.sigma_noise = sigma_prior, sigma_noise
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.c = 0.0
        self.mean: npt.NDArray[np.floating[Any]] = np.zeros(self.offsets[-1])
        self.cov: npt.NDArray[np.floating[Any]] = np.eye(self.offsets[-1]) * self.tau ** 2

    @property
    def tau(self) -> float:
        """Prior sd of one knob value's effect (log tok/s/GPU)."""
        return self.sigma_prior / math.sqrt(max(1, len(self.sizes)))

    def columns(self, point: Point) -> list[int]:
        """The one-hot columns of ``point`` (one per knob)."""
        return [self.offsets[j] + i for j, i in enumerate(point)]

    def fit(self, residuals: Sequence[tuple[Point, float]]) -> None:
        """Set the posterior from ``(point, log residual)`` pairs (replaces any earlier fit)."""
        n = self.offsets[-1]
        self.c = 0.0
        self.mean = np.zeros(n)
        self.cov = np.eye(n) * self.tau ** 2
        if not residuals:
            return
        r = np.array([x for _, x in residuals])
        self.c = float(r.mean())
        x = np.zeros((len(residuals), n))
        for row, (p, _) in enumerate(residuals):
            x[row, self.columns(p)] = 1.0
        s2 = self.sigma_noise ** 2
        self.cov = np.linalg.inv(x.T @ x / s2 + np.eye(n) / self.tau ** 2)
        self.mean = self.cov @ x.T @ (r - self.c) / s2

    def corrected(self, point: Point, prior: float, z: float = UCB_Z) -> tuple[float, float]:
        """(mean, optimistic) corrected tok/s/GPU of ``point`` whose estimate is ``prior``.

        The mean is ``prior * exp(c + sum of the point's effects)``; the optimistic value is
        ``z`` sds above in log, the sd being the effects' posterior plus the point's own error
        ``sigma_noise`` (an untried config's error the per-value effects miss).

        Args:
            point: one value index per knob.
            prior: the estimate's tok/s/GPU for the point.
            z: optimism in posterior sds (:data:`UCB_Z`).
        """
        idx = self.columns(point)
        mean = self.c + float(self.mean[idx].sum())
        sd = math.sqrt(max(0.0, float(self.cov[np.ix_(idx, idx)].sum())) + self.sigma_noise ** 2)
        return prior * math.exp(mean), prior * math.exp(mean + z * sd)


# -- the SLO ---------------------------------------------------------------------------------

def slo_ratio(est: Estimate, ttft_slo_ms: float | None) -> float:
    """Predicted replay TTFT p99 over the SLO.

    Args:
        est: the config's estimate.
        ttft_slo_ms: the study's TTFT p99 SLO (ms); None when there is no replay profile to
            predict TTFT from.

    Returns:
        inf when the estimate rules the config out; 0 without a replay profile; else the ratio
        (<= 1: predicted to meet the SLO).
    """
    if not est.fits:
        return math.inf
    if ttft_slo_ms is None:
        return 0.0
    return est.slo_ratio(ttft_slo_ms)


def p_meets_slo(ratio: float, theta: float = 1.0, sigma: float = SIGMA_TTFT) -> float:
    """Probability that a config predicted at TTFT ratio ``ratio`` meets the SLO.

    ``P(ratio x e <= theta)`` with ``log e ~ N(0, sigma^2)``: the standard normal CDF at ``(log
    theta - log ratio) / sigma``.

    Args:
        ratio: :func:`slo_ratio` (0: certain to meet it; inf: certain to miss it).
        theta: the boundary on the ratio (1 until :func:`best_threshold` learns another).
        sigma: sd of the TTFT prediction's log error (:data:`SIGMA_TTFT`).
    """
    if ratio <= 0:
        return 1.0
    if not math.isfinite(ratio):
        return 0.0
    from scipy.stats import norm  # lazy: ~1 s to import, only the guided brain needs it

    return float(norm.cdf((math.log(theta) - math.log(ratio)) / sigma))


def best_threshold(labelled: Sequence[tuple[float, bool]]) -> float:
    """The boundary on the predicted TTFT ratio that best separates feasible from not.

    Args:
        labelled: ``(predicted ratio, met the SLO)`` of every launched config.

    Returns:
        1.0 without labels; else the threshold (1.0 or one of the ratios, or just below an
        infeasible one) with the fewest feasible configs above it plus infeasible ones at or
        below it, the one nearest 1.0 (in log) among ties.
    """
    if not labelled:
        return 1.0
    cands = {1.0}
    for r, _ in labelled:
        if math.isfinite(r) and r > 0:
            cands.update((r, r * (1 - 1e-9)))
        elif r == math.inf:
            cands.add(math.inf)

    def errors(th: float) -> int:
        return sum((r <= th) != ok for r, ok in labelled)

    return min(cands, key=lambda th: (errors(th), abs(math.log(th)) if math.isfinite(th) and
                                      th > 0 else math.inf))


# -- ranking and stopping --------------------------------------------------------------------

def score(upper: float, p_slo: float, floor: float = FEASIBLE_FLOOR) -> float:
    """A point's score: optimistic tok/s/GPU times its SLO probability, at least ``floor``."""
    return upper * max(floor, p_slo)


def score_bucket(value: float, tie: float = TIE) -> int:
    """``value``'s bucket: scores within ``tie`` in log (:data:`TIE`, 2 %) share one."""
    return round(math.log(max(value, 1e-300)) / tie)


def stop_bar(incumbent: float | None, min_improvement: float) -> float | None:
    """What an untried point's optimistic tok/s/GPU must exceed to be worth a launch.

    Args:
        incumbent: the best measured objective (tok/s/GPU), None before any.
        min_improvement: the study's ``min_improvement`` (a share, e.g. 0.02).

    Returns:
        ``incumbent * (1 + min_improvement)``; None (no bar) without an incumbent.
    """
    return None if incumbent is None else incumbent * (1 + min_improvement)
