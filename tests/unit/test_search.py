"""The search maths of the space brains (domain/search.py): the seeded order of a knob space,
the residual model (Bayesian correction and its UCB optimism), P(meets the SLO), the learnt
SLO boundary, the score, its ties and the stop bar. No planner, no lessons server."""

from __future__ import annotations

import math
import random

import pytest

from domain.estimate import Estimate
from domain.search import (
    FEASIBLE_FLOOR,
    SIGMA_NOISE,
    SIGMA_PRIOR,
    SIGMA_TTFT,
    TIE,
    UCB_Z,
    ResidualModel,
    best_threshold,
    log_residual,
    p_meets_slo,
    point_at,
    score,
    score_bucket,
    seeded_permutation,
    slo_ratio,
    stop_bar,
)

SLO_MS = 8000.0


# -- the order of a knob space ---------------------------------------------------------------

def test_point_at_decodes_the_product_in_mixed_radix_last_knob_fastest():
    sizes = [2, 3, 2]
    pts = [point_at(k, sizes) for k in range(12)]
    assert pts[:3] == [(0, 0, 0), (0, 0, 1), (0, 1, 0)] and pts[-1] == (1, 2, 1)
    assert len(set(pts)) == 12
    assert point_at(0, []) == ()


@pytest.mark.parametrize("n,shuffle_max", [(0, 10), (1, 10), (7, 10), (96, 100), (97, 10),
                                           (1000, 10)])
def test_seeded_permutation_visits_every_index_once_in_a_seeded_order(n, shuffle_max):
    order = list(seeded_permutation(n, 3, shuffle_max))
    assert sorted(order) == list(range(n))
    assert order == list(seeded_permutation(n, 3, shuffle_max))
    if n > 10:
        assert order != list(seeded_permutation(n, 4, shuffle_max))


def test_seeded_permutation_of_a_small_space_is_the_seeded_shuffle():
    expected = list(range(50))
    random.Random(9).shuffle(expected)
    assert list(seeded_permutation(50, 9)) == expected


# -- the residual correction -----------------------------------------------------------------

def test_log_residual_needs_a_positive_measurement_and_prediction():
    assert log_residual(120.0, 360.0) == pytest.approx(math.log(1 / 3))
    assert log_residual(None, 360.0) is None
    assert log_residual(0.0, 360.0) is None and log_residual(120.0, 0.0) is None


def test_the_residual_model_prior_gives_one_config_sigma_prior():
    m = ResidualModel([2, 2])
    assert m.tau == pytest.approx(SIGMA_PRIOR / math.sqrt(2))
    mean, upper = m.corrected((0, 1), 100.0)
    # the prior: no correction; the bound is UCB_Z sds of the prior error plus the noise
    assert mean == pytest.approx(100.0)
    assert upper == pytest.approx(100.0 * math.exp(UCB_Z * math.sqrt(
        SIGMA_PRIOR ** 2 + SIGMA_NOISE ** 2)))
    assert ResidualModel([]).tau == SIGMA_PRIOR


def test_a_shared_residual_moves_every_prediction_alike():
    m = ResidualModel([2, 2])
    m.fit([((0, 0), math.log(0.5)), ((1, 1), math.log(0.5))])
    assert m.c == pytest.approx(math.log(0.5))
    assert m.corrected((0, 1), 100.0)[0] == pytest.approx(50.0)
    assert m.corrected((1, 0), 200.0)[0] == pytest.approx(100.0)


def test_an_unmeasured_knob_value_is_more_optimistic_than_a_measured_one():
    """(router_policy, weights): router_policy changes nothing the estimate sees, nvfp4 2x."""
    base = {(r, w): 100.0 * (2 if w else 1) for r in range(2) for w in range(2)}
    m = ResidualModel([2, 2])
    # no measurement yet: both policies equally uncertain
    m.fit([])
    assert m.corrected((0, 0), base[(0, 0)]) == pytest.approx(m.corrected((1, 0), base[(1, 0)]))
    # round_robin measured (both weights) exactly as predicted
    m.fit([((0, 0), 0.0), ((0, 1), 0.0)])
    for w in range(2):
        rr_mean, rr_up = m.corrected((0, w), base[(0, w)])
        ca_mean, ca_up = m.corrected((1, w), base[(1, w)])
        # same corrected mean (the prior), a higher upper bound for the unmeasured value
        assert rr_mean == pytest.approx(ca_mean) == pytest.approx(base[(0, w)])
        assert ca_up > rr_up > rr_mean
    # once cache_aware is measured to change nothing too, the bonus is gone
    m.fit([((0, 0), 0.0), ((0, 1), 0.0), ((1, 0), 0.0), ((1, 1), 0.0)])
    assert m.corrected((1, 0), base[(1, 0)])[1] == pytest.approx(
        m.corrected((0, 0), base[(0, 0)])[1])
    # a measured value that lost shifts the mean down, not just the bound
    m.fit([((0, 0), 0.0), ((1, 0), math.log(0.5))])
    assert m.corrected((1, 1), base[(1, 1)])[0] < m.corrected((0, 1), base[(0, 1)])[0]


# -- the SLO ---------------------------------------------------------------------------------

def test_slo_ratio_is_zero_without_a_replay_profile_and_inf_when_the_config_cannot_fit():
    fits = Estimate(fits=True, batch=8.0, output_tok_s_per_gpu=1.0, ttft_p99_ms=4000.0)
    unfit = Estimate(fits=False, batch=0.0, output_tok_s_per_gpu=0.0)
    assert slo_ratio(fits, SLO_MS) == pytest.approx(4000.0 / SLO_MS)
    assert slo_ratio(unfit, SLO_MS) == math.inf and slo_ratio(unfit, None) == math.inf
    assert slo_ratio(fits, None) == 0.0


def test_p_meets_slo_is_a_normal_cdf_around_the_boundary():
    assert p_meets_slo(0.0) == 1.0 and p_meets_slo(math.inf) == 0.0
    assert p_meets_slo(1.0) == pytest.approx(0.5)
    # one SIGMA_TTFT (0.7 in log) under the boundary: Phi(1) ~ 0.841
    assert SIGMA_TTFT == 0.7
    assert p_meets_slo(math.exp(-0.7)) == pytest.approx(0.8413, abs=1e-4)
    ratios = [0.0, 0.01, 0.1, 0.3, 0.5, 0.9, 1.0, 1.1, 2.0, 5.0, 50.0, math.inf]
    ps = [p_meets_slo(r) for r in ratios]
    assert all(a > b for a, b in zip(ps, ps[1:], strict=False))
    assert all(0.0 <= x <= 1.0 for x in ps)
    # a moved boundary moves the midpoint
    assert p_meets_slo(0.4, 0.4) == pytest.approx(0.5) and p_meets_slo(1.0, 0.4) < 0.5
    # 0.125x is ~2 sd under a boundary just below 0.5 (log(0.5 / 0.125) / SIGMA_TTFT)
    assert p_meets_slo(0.125, 0.5 * (1 - 1e-9)) > 0.97


def test_best_threshold():
    assert best_threshold([]) == 1.0
    # one infeasible config predicted at half the SLO: the boundary drops just below it
    th = best_threshold([(0.5, False)])
    assert th < 0.5 and th == pytest.approx(0.5)
    # feasible at 2x, infeasible at 3x: anything in [2, 3) separates; the one nearest 1
    th = best_threshold([(2.0, True), (3.0, False)])
    assert 2.0 <= th < 3.0 and th == 2.0
    # labels that agree with the estimate keep the boundary at 1
    assert best_threshold([(0.3, True), (0.9, True), (1.5, False), (math.inf, False)]) == 1.0
    # conflicting labels at one ratio: the majority (infeasible) wins, the boundary is below
    assert best_threshold([(1.2, True), (1.2, False), (1.2, False)]) < 1.2
    # no threshold is perfect here; the result has the fewest errors of any threshold
    labelled = [(0.5, True), (0.8, False), (1.5, True), (3.0, False), (0.6, True)]

    def errors(t: float) -> int:
        return sum((r <= t) != ok for r, ok in labelled)

    grid = [k / 1000 for k in range(1, 5000)] + [math.inf]
    th = best_threshold(labelled)
    assert errors(th) == min(errors(t) for t in grid) == 1
    assert th == pytest.approx(0.8) and th < 0.8  # nearest 1 among the best ones


# -- ranking and stopping --------------------------------------------------------------------

def test_score_floors_the_slo_probability():
    assert score(1000.0, 0.5) == 500.0
    assert score(1000.0, 0.0) == pytest.approx(1000.0 * FEASIBLE_FLOOR)
    # a config predicted to meet the SLO outranks a 10x faster one predicted far over it
    assert score(100.0, 1.0) > score(1000.0, 0.0)


def test_scores_within_two_percent_tie():
    assert TIE == pytest.approx(math.log(1.02))
    assert score_bucket(1000.0) == score_bucket(1000.0 * 1.005)
    assert score_bucket(1000.0) < score_bucket(1000.0 * 1.03)
    assert score_bucket(0.0) == score_bucket(1e-300)  # a zero score still has a bucket


def test_stop_bar():
    assert stop_bar(None, 0.02) is None
    assert stop_bar(1680.0, 0.02) == pytest.approx(1680.0 * 1.02)
