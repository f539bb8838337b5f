"""The estimate-guided planner brain (agents/guided_brain.py GuidedPlanner, search.brain "guided"):
ranking by the steady-state prior, the residual correction and its optimism (UCB), the SLO
probability and boundary, the stop rule, lessons ranked last and screening, the memory fit,
the equivalence skip (a whole `servetune run` with it: tests/e2e/test_search_brains_cli.py)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from fixtures.brain_studies import KNOBS, study_dict
from fixtures.planning import drive, forbid_fa3, row
from mcp import Client

from agents.brains import make_planner
from agents.guided_brain import GuidedPlanner
from agents.planner import NoViableConfig, TrialPlan
from agents.space_brains import GridPlanner
from domain.config import ServingConfig
from domain.engines import resolved_settings
from domain.errors import ConfigInvalid
from domain.estimate import Estimate, ReplayProfile
from domain.fit import fit
from domain.search import p_meets_slo
from domain.study import Study, parse_study
from mcp_servers.lessons.server import build_server

SLO_MS = 8000.0  # the default study's TTFT p99 SLO

# A replay profile for the scripted estimators: only its presence matters (the ratio is then
# the scripted TTFT over the SLO).
REPLAY = ReplayProfile(rate_req_s=1.0, isl_mean=4000, isl_p99=12000, osl_mean=300,
                       reuse_share=0.0, requests=60)


def study(**over) -> Study:
    return parse_study(study_dict("guided", **over))


# weights x kv_cache_dtype x mem_fraction_static on GLM-5 TP8: all 8 configs fit
SMALL = {"weights": ["fp8", "nvfp4"], "kv_cache_dtype": ["bf16", "fp8_e4m3"],
         "mem_fraction_static": [0.85, 0.90]}


def scripted(tput: Callable[[ServingConfig], float],
             ttft: Callable[[ServingConfig], float] = lambda c: 1000.0):
    """An estimator that predicts ``tput`` tok/s/GPU and ``ttft`` ms for every config."""
    calls: list[str] = []

    def est(c: ServingConfig) -> Estimate:
        calls.append(c.config_id())
        return Estimate(fits=True, batch=64.0, output_tok_s_per_gpu=tput(c),
                        capacity_req_s=2.0, utilization=0.5, ttft_p99_ms=ttft(c))
    est.calls = calls  # type: ignore[attr-defined]
    return est


@pytest.fixture
async def lessons(store):
    async with Client(build_server(store)) as client:
        yield client


# -- selection ------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_the_study_key_selects_the_guided_brain(lessons):
    st = study(search={"brain": "guided", "seed": 4})
    assert st.search.brain == "guided"
    g = make_planner(st, lessons, replay=REPLAY, slo_gated=True)
    assert isinstance(g, GuidedPlanner) and g.brain == "guided"
    assert g.seed == 4 and g.replay is REPLAY and g.slo_gated and g.theta == 1.0
    # the keyword arguments of the guided brain are accepted (and ignored) by the others
    assert isinstance(make_planner(st, lessons, brain="grid", slo_gated=True), GridPlanner)
    assert isinstance(make_planner(study(), lessons, brain="guided"), GuidedPlanner)
    with pytest.raises(ConfigInvalid, match=r"search\.brain: .*'guided'"):
        study(search={"brain": "anneal"})


# -- ranking by the prior -------------------------------------------------------------------

def tput_small(c: ServingConfig) -> float:
    return (100.0 * (3 if c.weights == "nvfp4" else 1)
            * (1.5 if c.kv_cache_dtype == "fp8_e4m3" else 1)
            * (1.1 if c.mem_fraction_static == 0.9 else 1))


def ttft_small(c: ServingConfig) -> float:
    """nvfp4 predicted at half the SLO, fp8 at 1/8; nvfp4 + fp8 KV + 0.90 over it (2.5x)."""
    if c.weights == "nvfp4" and c.kv_cache_dtype == "fp8_e4m3" and c.mem_fraction_static == 0.9:
        return 2.5 * SLO_MS
    return (0.5 if c.weights == "nvfp4" else 0.125) * SLO_MS


@pytest.mark.anyio
async def test_first_launch_is_the_best_predicted_feasible_point(lessons):
    st = study(knobs=SMALL, search={"brain": "guided"})
    est = scripted(tput_small, ttft_small)
    g = make_planner(st, lessons, replay=REPLAY, estimator=est)
    launched, pruned, _, _ = await drive(g, st, 1, tput_small)
    assert pruned == []
    cfg = launched[0].config
    # the highest prediction (495, nvfp4 + fp8 KV + 0.90) is predicted to miss the SLO
    assert (cfg.weights, cfg.kv_cache_dtype, cfg.mem_fraction_static) == \
        ("nvfp4", "fp8_e4m3", 0.85)
    assert launched[0].rationale.startswith("guided: predicted 450 tok/s/GPU")
    assert "0.50x the SLO (boundary 1.00x)" in launched[0].rationale
    assert launched[0].changed == "weights=nvfp4, kv_cache_dtype=fp8_e4m3"
    # every point of the space was estimated once (cached by config id)
    assert len(est.calls) == len(set(est.calls)) == 8
    # without a replay profile every ratio is 0: throughput alone ranks
    g0 = make_planner(st, lessons, estimator=scripted(tput_small, ttft_small))
    launched, _, _, _ = await drive(g0, st, 1, tput_small)
    assert launched[0].config.mem_fraction_static == 0.9 and launched[0].config.weights == "nvfp4"
    assert "SLO" not in launched[0].rationale


def tput_slo(c: ServingConfig) -> float:
    """:func:`tput_small` with nvfp4 only 2x fp8, so feasibility decides between them."""
    return tput_small(c) / (1.5 if c.weights == "nvfp4" else 1)


@pytest.mark.anyio
async def test_an_slo_miss_moves_the_boundary_below_the_missed_prediction(lessons):
    st = study(knobs=SMALL, search={"brain": "guided"})

    def truth(c: ServingConfig) -> float | None:  # every nvfp4 config misses the SLO
        return None if c.weights == "nvfp4" else tput_slo(c)

    g = make_planner(st, lessons, replay=REPLAY, estimator=scripted(tput_slo, ttft_small),
                     slo_gated=True)
    launched, _, _, hist = await drive(g, st, 2, truth)
    first, second = (p.config for p in launched)
    # 300 at 0.5x (P(meet) ~ 0.84) beats 330 at 2.5x (~0.01) and fp8 + fp8 KV + 0.90 (165)
    assert (first.weights, first.kv_cache_dtype, first.mem_fraction_static) == \
        ("nvfp4", "fp8_e4m3", 0.85)
    assert hist[1].objective is None  # predicted 0.5x, missed
    # labels (0.125, met) and (0.5, missed): the boundary sits just below 0.5
    assert 0.125 <= g.theta < 0.5 and g.theta == pytest.approx(0.5)
    # P(meet) of a config predicted at the missed ratio drops from ~0.84 to ~0.5; one at
    # 0.125x stays near 1 (log(0.5 / 0.125) / SIGMA_TTFT ~ 2 sd under the boundary)
    assert p_meets_slo(0.5, g.theta) == pytest.approx(0.5, abs=1e-6)
    assert p_meets_slo(0.125, g.theta) > 0.97
    # so the next launch is the best config predicted well under it: fp8, fp8 KV, 0.90
    # (165 x 0.98 ~ 161) over nvfp4 + bf16 + 0.90 (220 x 0.5 = 110)
    assert (second.weights, second.kv_cache_dtype, second.mem_fraction_static) == \
        ("fp8", "fp8_e4m3", 0.9)
    assert f"(boundary {g.theta:.2f}x)" in launched[1].rationale
    # ungated (the product's search: saturation only) the same history teaches nothing:
    # nvfp4 + bf16 + 0.90 (220 x 0.84 ~ 185) comes next
    u = make_planner(st, lessons, replay=REPLAY, estimator=scripted(tput_slo, ttft_small))
    launched, _, _, _ = await drive(u, st, 2, truth)
    assert u.theta == 1.0 and p_meets_slo(0.5, u.theta) > 0.8
    assert (launched[1].config.weights, launched[1].config.kv_cache_dtype,
            launched[1].config.mem_fraction_static) == ("nvfp4", "bf16", 0.9)
    # the boundary is soft: with nvfp4 3x fp8 (tput_small) even half the chance of meeting
    # the SLO keeps nvfp4 + bf16 + 0.90 (330 x 0.5) ahead of fp8 + fp8 KV + 0.90 (161)
    s = make_planner(st, lessons, replay=REPLAY, estimator=scripted(tput_small, ttft_small),
                     slo_gated=True)
    launched, _, _, _ = await drive(
        s, st, 2, lambda c: None if c.weights == "nvfp4" else tput_small(c))
    assert s.theta < 0.5 and (launched[1].config.weights, launched[1].config.kv_cache_dtype,
                              launched[1].config.mem_fraction_static) == ("nvfp4", "bf16", 0.9)


# -- the residual correction ----------------------------------------------------------------

# Truth on weights x kv_cache_dtype (GLM-5 TP8): fp8 KV triples fp8; nvfp4 is no better.
TRUTH = {("fp8", "bf16"): 100.0, ("fp8", "fp8_e4m3"): 300.0,
         ("nvfp4", "bf16"): 120.0, ("nvfp4", "fp8_e4m3"): 110.0}


def truth2(c: ServingConfig) -> float:
    return TRUTH[(c.weights, c.kv_cache_dtype or "auto")]


def over_nvfp4(c: ServingConfig) -> float:
    """The truth, but every nvfp4 config overestimated 3x."""
    return truth2(c) * (3 if c.weights == "nvfp4" else 1)


@pytest.mark.anyio
async def test_measured_residuals_correct_a_systematic_overestimate(lessons):
    st = study(knobs={"weights": ["fp8", "nvfp4"], "kv_cache_dtype": ["bf16", "fp8_e4m3"]},
               search={"brain": "guided"})
    g = make_planner(st, lessons, estimator=scripted(over_nvfp4))
    launched, _, _, hist = await drive(g, st, 2, truth2)
    first, second = (p.config for p in launched)
    # the prior ranks nvfp4 + bf16 (360) over nvfp4 + fp8 KV (330) over fp8 + fp8 KV (300)
    assert (first.weights, first.kv_cache_dtype) == ("nvfp4", "bf16")
    # it measured 120, not 360: the nvfp4 neighbour drops to ~241, under fp8 + fp8 KV (~256),
    # which the truth ranks first (300 vs 110)
    assert (second.weights, second.kv_cache_dtype) == ("fp8", "fp8_e4m3")
    res = dict(g.learn(hist[:2]))
    assert res[g.point_of(first)] == pytest.approx(math.log(1 / 3))
    assert res[g.point_of(st.base_config())] == pytest.approx(0.0)
    # control: had the nvfp4 launch measured what the prior said, nvfp4 would come next
    ctl = make_planner(st, lessons, estimator=scripted(over_nvfp4))
    launched, _, _, _ = await drive(ctl, st, 2, over_nvfp4)
    assert launched[1].config.weights == "nvfp4"


# -- the SLO probability ---------------------------------------------------------------------

def test_the_brain_feeds_its_ratio_and_boundary_to_the_slo_probability():
    """The normal CDF itself: tests/unit/test_search.py (domain.search.p_meets_slo)."""
    st = study(knobs=SMALL, search={"brain": "guided"})
    g = GuidedPlanner(st, None, replay=REPLAY)
    assert g.theta == 1.0
    # the ratio fed to it: 0 without a replay profile, inf for a config that does not fit
    fits = Estimate(fits=True, batch=8.0, output_tok_s_per_gpu=1.0, ttft_p99_ms=4000.0)
    unfit = Estimate(fits=False, batch=0.0, output_tok_s_per_gpu=0.0)
    assert g.ratio(fits) == pytest.approx(4000.0 / SLO_MS) and g.ratio(unfit) == math.inf
    blind = GuidedPlanner(st, None)
    assert blind.ratio(fits) == 0.0 and p_meets_slo(blind.ratio(fits), blind.theta) == 1.0


# -- optimism and the stop rule -------------------------------------------------------------

@pytest.mark.anyio
async def test_an_unmeasured_knob_value_is_more_optimistic_than_a_measured_one(lessons):
    # router_policy changes nothing the estimate sees: both values are predicted alike
    st = study(knobs={"router_policy": ["round_robin", "cache_aware"],
                      "weights": ["fp8", "nvfp4"]}, search={"brain": "guided"})
    g = make_planner(st, lessons, estimator=scripted(
        lambda c: 100.0 * (2 if c.weights == "nvfp4" else 1)))
    pts = [(r, w) for r in range(2) for w in range(2)]
    est = {q: g.estimate(g.config_of(q)) for q in pts}
    assert est[(0, 0)].output_tok_s_per_gpu == est[(1, 0)].output_tok_s_per_gpu
    # the residual model on these points alone: tests/unit/test_search.py (ResidualModel).
    # through the brain: after the baseline (round_robin, fp8), the unmeasured policy's bonus
    # outranks the tie-break on fewer knobs changed; measured to change nothing, the search
    # stops without trying (cache_aware, fp8)
    b = make_planner(st, lessons, estimator=scripted(
        lambda c: 100.0 * (2 if c.weights == "nvfp4" else 1)))
    launched, _, stop, _ = await drive(b, st, 4, lambda c: b.estimate(c).output_tok_s_per_gpu)
    assert [(p.config.router_policy, p.config.weights) for p in launched] == \
        [("cache_aware", "nvfp4"), ("round_robin", "nvfp4")]
    assert isinstance(stop, NoViableConfig) and "converged" in stop.reason


def tput_peak(c: ServingConfig) -> float:
    """One clear peak: nvfp4 and fp8 KV 4x each (1,680 at 0.90), everything else <= 440."""
    return (100.0 * (4 if c.weights == "nvfp4" else 1)
            * (4 if c.kv_cache_dtype == "fp8_e4m3" else 1)
            * (1.05 if c.mem_fraction_static == 0.9 else 1))


@pytest.mark.anyio
async def test_guided_stops_once_nothing_untried_can_beat_the_incumbent(lessons):
    st = study(knobs=SMALL, search={"brain": "guided"})
    g = make_planner(st, lessons, estimator=scripted(tput_peak))  # an exact estimator
    launched, pruned, stop, hist = await drive(g, st, g.size, tput_peak)
    assert pruned == []
    # the predicted best first, measured exactly as predicted
    top = launched[0].config
    assert (top.weights, top.kv_cache_dtype, top.mem_fraction_static) == \
        ("nvfp4", "fp8_e4m3", 0.9)
    assert hist[1].objective == pytest.approx(1680.0)
    # then it stops, well before the space (8 points, baseline included) is exhausted
    assert isinstance(stop, NoViableConfig), stop
    assert stop.reason.startswith("guided: converged:") and "1,680.0" in stop.reason
    assert 1 + len(launched) < g.size
    # because no untried point's optimistic throughput beats 1,680 by min_improvement
    bar = 1680.0 * (1 + st.min_improvement)
    tried = {t.config for t in hist}
    untried = [q for q in g.candidates() if g.config_of(q) not in tried]
    assert untried and all(
        g.model.corrected(q, g.estimate(g.config_of(q)).output_tok_s_per_gpu)[1] <= bar
        for q in untried)
    # a stopped step launches nothing more
    again = await g.step(st.base_config(), {t.config.config_id() for t in hist}, "r",
                         history=list(hist))
    assert isinstance(again.decision, NoViableConfig) and "converged" in again.decision.reason
    # control: had the peak measured a third of its prediction, the search would go on
    ctl = make_planner(st, lessons, estimator=scripted(tput_peak))
    launched, _, stop, _ = await drive(
        ctl, st, 2, lambda c: tput_peak(c) / (3 if c.weights == "nvfp4" else 1))
    assert stop is None and len(launched) == 2


# -- screening ------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_guided_never_launches_a_forbidden_or_unfit_config(lessons):
    st = study(knobs=KNOBS, search={"brain": "guided"})
    lesson_id = await forbid_fa3(lessons, st)
    g = make_planner(st, lessons, replay=REPLAY)  # the real estimate

    def truth(c: ServingConfig) -> float:
        return g.estimate(c).output_tok_s_per_gpu

    # the top of the ranking: TP4 nvfp4 variants the estimate cannot tell apart (the batch is
    # the clients), each still uncertain enough to launch; fa3 points a stored lesson forbids
    # rank after every other point, so ten launches never reach them
    launched, pruned, stop, hist = await drive(g, st, 10, truth)
    assert stop is None and len(launched) == 10
    assert lesson_id in {lesson.id for lesson in g.known_lessons}
    ids = [p.config.config_id() for p in launched]
    assert len(set(ids)) == len(ids)
    for plan in launched:
        assert plan.config.attention_backend != "fa3"
        assert await g.forbidding(plan.config) == []
        fit(plan.config)
        assert plan.rationale.startswith("guided: predicted ")
    # fa3 points are never launched: not reached, or pruned by the stored lesson
    fa3 = [p for p in pruned if p.config.attention_backend == "fa3"]
    assert all(lesson_id in p.lesson_ids and p.reason.startswith("forbidden by lesson")
               for p in fa3)
    # points the memory fit rules out are never proposed, so never screened either
    assert not any("memory-fit estimate" in p.reason for p in pruned)
    unfit = {c.config_id() for c in map(g.config_of, (g.point_at(k) for k in range(g.size)))
             if c is not None and not g.estimate(c).fits}
    assert unfit  # precondition: TP2 GLM-5 does not fit
    assert not unfit & {g.config_of(q).config_id() for q in g.proposals(hist)}
    # the first launch is the best prediction of the whole space among non-fa3 points
    preds = [g.estimate(c).output_tok_s_per_gpu
             for c in map(g.config_of, (g.point_at(k) for k in range(g.size)))
             if c is not None and c.attention_backend != "fa3"]
    assert truth(launched[0].config) == pytest.approx(max(preds))


@pytest.mark.anyio
async def test_points_a_stored_lesson_forbids_rank_last(lessons):
    st = study(knobs=KNOBS, search={"brain": "guided"})
    base = st.base_config()

    async def first_step(g):
        hist = [row(1, "baseline", base, g.estimate(base).output_tok_s_per_gpu)]
        s = await g.step(base, {base.config_id()}, "r", history=hist)
        order = [g.config_of(q) for q in g.proposals(hist)]
        return s, order

    # control, before the lesson exists: fa3 twins interleave with the rest of the ranking
    free = make_planner(st, lessons, replay=REPLAY)
    s0, order0 = await first_step(free)
    assert free.known_lessons == []
    fa3_0 = [k for k, c in enumerate(order0) if c.attention_backend == "fa3"]
    rest_0 = [k for k, c in enumerate(order0) if c.attention_backend != "fa3"]
    assert fa3_0 and rest_0 and min(fa3_0) < max(rest_0)
    # with the lesson stored, the step fetches it and every fa3 point ranks after the rest
    lesson_id = await forbid_fa3(lessons, st)
    g = make_planner(st, lessons, replay=REPLAY)
    s, order = await first_step(g)
    assert [lesson.id for lesson in g.known_lessons] == [lesson_id]
    assert isinstance(s.decision, TrialPlan) and s.pruned == []
    assert s.decision.config.attention_backend != "fa3"
    # the top of the ranking is unchanged but for the demoted fa3 points
    assert s.decision.config == next(c for c in order0 if c.attention_backend != "fa3")
    fa3 = [k for k, c in enumerate(order) if c.attention_backend == "fa3"]
    rest = [k for k, c in enumerate(order) if c.attention_backend != "fa3"]
    assert len(fa3) == len(fa3_0) and len(rest) == len(rest_0)
    assert max(rest) < min(fa3)
    assert all(c.attention_backend != "fa3" for c in order[:10])


# -- the equivalence skip -------------------------------------------------------------------

@pytest.mark.anyio
@pytest.mark.parametrize("brain", ["guided", "grid"])
async def test_a_point_the_engine_runs_like_a_measured_config_is_not_launched(lessons, brain):
    base = study().base_config()
    derived = fit(base).max_running_requests
    knobs = {"max_running_requests": ["unset", derived], "kv_cache_dtype": ["bf16", "fp8_e4m3"]}
    st = study(knobs=knobs, search={"brain": brain})
    same = base.model_copy(update={"max_running_requests": derived})
    # precondition: a distinct config id, the same resolved engine settings as the baseline
    assert same.config_id() != base.config_id()
    assert resolved_settings(same) == resolved_settings(base) is not None
    # ... while with fp8 KV the derived slot count differs, so that pair is no twin
    f8 = base.model_copy(update={"kv_cache_dtype": "fp8_e4m3"})
    assert resolved_settings(f8.model_copy(update={"max_running_requests": derived})) \
        != resolved_settings(f8)
    p = make_planner(st, lessons)
    seen = {base.config_id()}
    hist = [row(1, "baseline", base, 100.0)]
    launched: list[ServingConfig] = []
    for _ in range(5):
        s = await p.step(base, seen, "r", history=list(hist))
        assert s.pruned == []
        if isinstance(s.decision, NoViableConfig):
            break
        launched.append(s.decision.config)
        hist.append(row(len(hist) + 1, "discard", s.decision.config, 90.0))
    assert isinstance(s.decision, NoViableConfig)
    ids = {c.config_id() for c in launched}
    assert same.config_id() not in ids and len(launched) == 2  # 4 points, baseline + its twin
    assert same.config_id() in seen  # skipped for good, without a ledger row


@pytest.mark.anyio
async def test_throughput_orders_configs_that_are_all_predicted_far_over_the_slo(lessons):
    """Every config ~50x over the SLO: its probability is floored (FEASIBLE_FLOOR), so the
    fastest is launched first, not the one predicted least far over."""
    st = study(knobs=SMALL, search={"brain": "guided"})

    def ttft_far(c: ServingConfig) -> float:  # the fastest is predicted the furthest over
        return SLO_MS * (80.0 if c.weights == "nvfp4" else 50.0)

    g = make_planner(st, lessons, replay=REPLAY, estimator=scripted(tput_small, ttft_far))
    launched, _, _, _ = await drive(g, st, 1, tput_small)
    cfg = launched[0].config
    assert (cfg.weights, cfg.kv_cache_dtype, cfg.mem_fraction_static) == \
        ("nvfp4", "fp8_e4m3", 0.9)
    assert "P(meets the SLO) 0.00" in launched[0].rationale
    # a config predicted to meet it still outranks a faster one predicted far over it
    g2 = make_planner(st, lessons, replay=REPLAY, estimator=scripted(
        tput_small, lambda c: SLO_MS * (80.0 if c.weights == "nvfp4" else 0.2)))
    launched, _, _, _ = await drive(g2, st, 1, tput_small)
    assert launched[0].config.weights == "fp8"
    assert g2.prediction(launched[0].config)["output_tok_s_per_gpu"] == pytest.approx(
        tput_small(launched[0].config), rel=1e-3)
