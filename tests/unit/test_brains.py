"""Planner brains over the whole knob space (agents/space_brains.py, agents/brains.py): grid and
TPE, screened by lessons and the memory-fit estimate like the one-knob planner, selected by the
study key search.brain."""

from __future__ import annotations

import pytest
from fixtures.brain_studies import KNOBS, study_dict
from fixtures.planning import drive as drive_with
from fixtures.planning import forbid_fa3, row
from mcp import Client

from agents.brains import make_planner
from agents.planner import NoViableConfig, Planner
from agents.research_questions import research_questions
from agents.space_brains import GridPlanner, TpePlanner
from domain.errors import DoesNotFit
from domain.fit import fit
from domain.lesson_builders import research_lesson
from domain.research import research_change
from domain.study import parse_study
from domain.trial import Trial
from mcp_servers.lessons.server import build_server


def study(**over):
    return parse_study(study_dict("brains", **over))


def objective(c) -> float:
    """A synthetic tok/s/GPU: nvfp4 doubles it, smaller TP helps, fp8 KV a little."""
    return 100.0 * (2 if c.weights == "nvfp4" else 1) * (8 / c.tp_size) ** 0.3 \
        * (1.1 if c.kv_cache_dtype == "fp8_e4m3" else 1.0)


async def drive(planner, st, steps: int, history: list[Trial] | None = None):
    """Run ``steps`` planner steps against :func:`objective`, ledgering like the supervisor."""
    return await drive_with(planner, st, steps, objective, history)


@pytest.fixture
async def lessons(store):
    async with Client(build_server(store)) as client:
        yield client


@pytest.mark.anyio
async def test_make_planner_picks_by_study_key_and_overrides(lessons):
    assert type(make_planner(study(), lessons)) is Planner
    assert isinstance(make_planner(study(search={"brain": "grid"}), lessons), GridPlanner)
    tpe = make_planner(study(search={"brain": "tpe", "seed": 7}), lessons)
    assert isinstance(tpe, TpePlanner) and tpe.seed == 7
    assert make_planner(study(), lessons, brain="tpe", seed=3).seed == 3
    assert type(make_planner(study(search={"brain": "tpe"}), lessons, brain="ovat")) is Planner
    with pytest.raises(ValueError, match="unknown planner brain"):
        make_planner(study(), lessons, brain="anneal")


@pytest.mark.anyio
async def test_grid_covers_the_space_in_a_seeded_order(lessons):
    st = study(knobs=KNOBS)
    g1, g2, g3 = (GridPlanner(st, lessons, seed=s) for s in (1, 1, 2))
    o1 = list(g1.seeded_order())
    assert len(o1) == g1.size == 192 and len(set(o1)) == 192  # every point exactly once
    assert o1 == list(g2.seeded_order()) and o1 != list(g3.seeded_order())
    # Stepping to the end launches or prunes every distinct config of the space, in that order.
    launched, pruned, stop, _ = await drive(g1, st, 500)
    assert isinstance(stop, NoViableConfig) and "192 combinations" in stop.reason
    distinct = {c.config_id() for c in map(g1.config_of, o1) if c is not None}
    tried = [p.config.config_id() for p in launched] + [p.config.config_id() for p in pruned]
    assert len(tried) == len(set(tried)) and set(tried) | {st.base_config().config_id()} \
        == distinct
    order = {}
    for p in o1:
        order.setdefault(g1.config_of(p).config_id(), len(order))
    idx = [order[p.config.config_id()] for p in launched]
    assert idx == sorted(idx)
    # The memory-fit estimate pruned every FP8 TP2/TP4 point before launch (186.5 GB/GPU).
    assert all(not (p.config.weights == "fp8" and p.config.tp_size < 8) for p in launched)
    assert any("memory-fit estimate" in p.reason for p in pruned)
    # The grid also decodes points back from configs (what TPE's history needs).
    assert all(g1.point_of(g1.config_of(p)) == p for p in o1[:20])


@pytest.mark.anyio
async def test_tpe_launches_only_screened_candidates_never_a_forbidden_family(lessons):
    st = study(knobs=KNOBS, search={"brain": "tpe", "seed": 0})
    lesson_id = await forbid_fa3(lessons, st)
    for seed in (0, 1, 2):
        tpe = make_planner(st, lessons, seed=seed)
        launched, pruned, _, _ = await drive(tpe, st, 12)
        assert len(launched) == 12
        for plan in launched:  # passed the lesson check and the estimate
            assert plan.config.attention_backend != "fa3"
            assert await tpe.forbidding(plan.config) == []
            fit(plan.config)
            assert plan.rationale.startswith("tpe: ")
        ids = [p.config.config_id() for p in launched]
        assert len(set(ids)) == len(ids)  # never the same config twice
        fa3 = [p for p in pruned if p.config.attention_backend == "fa3"]
        assert fa3 and all(lesson_id in p.lesson_ids for p in fa3)
        for p in pruned:
            if p.config.attention_backend != "fa3":
                with pytest.raises(DoesNotFit):
                    fit(p.config)
    # and the grid the same way
    launched, pruned, _, _ = await drive(GridPlanner(st, lessons, seed=0), st, 12)
    assert all(p.config.attention_backend != "fa3" for p in launched)


@pytest.mark.anyio
async def test_history_feeds_tpe(lessons):
    st = study(knobs=KNOBS)
    tpe = TpePlanner(st, lessons, seed=0)
    base = st.base_config()
    nv = base.model_copy(update={"weights": "nvfp4"})
    hist = [row(1, "baseline", base, 100.0), row(2, "keep", nv, 200.0),
            row(3, "crash", base.model_copy(update={"attention_backend": "fa3"})),
            row(4, "pruned", base.model_copy(update={"tp_size": 4, "replicas": 2}))]
    ost = tpe.build(hist)
    got = [(t.params, t.value, t.constraints) for t in ost.trials]
    assert got[0] == (dict(zip(tpe.names, tpe.point_of(base), strict=True)), 100.0,
                      {"viable": 0.0})
    assert got[1][0]["weights"] == 1 and got[1][1] == 200.0
    assert got[2][0]["attention_backend"] == 1 and got[2][2] == {"viable": 1.0}
    assert got[3][0]["tp_size"] == 1 and got[3][2] == {"viable": 1.0}
    # Past the startup trials TPE models the history: after 10 launches where nvfp4 doubled
    # tok/s/GPU, its proposals favour nvfp4 far more than the 1/2 of a uniform draw.
    picks = []
    for seed in range(6):
        p = TpePlanner(st, lessons, seed=seed)
        launched, _, _, hist2 = await drive(p, st, 10)
        more, _, _, _ = await drive(p, st, 4, history=hist2)
        picks += [m.config.weights == "nvfp4" for m in more]
    assert sum(picks) / len(picks) >= 0.75, picks
    # Same history, same seed: the same proposal (a resumed run proposes what it would have).
    a, _, _, _ = await drive(TpePlanner(st, lessons, seed=5), st, 6)
    b, _, _, _ = await drive(TpePlanner(st, lessons, seed=5), st, 6)
    assert [x.config for x in a] == [x.config for x in b]


def test_research_asks_about_one_research_worthy_change_of_a_multi_knob_candidate():
    st = study()
    cfg = st.base_config().model_copy(update={"attention_backend": "fa3",
                                              "mem_fraction_static": 0.9})
    changed = "mem_fraction_static=0.9, attention_backend=fa3, weights=nvfp4"
    assert research_change(changed) == "attention_backend=fa3"
    qs = research_questions(changed, cfg, {"attention_backend=fa3, tp_size=4"})
    assert qs == []  # fa3 was researched before as part of another candidate
    qs = research_questions(changed, cfg, set())
    assert [q.value for q in qs] == ["fa3", "fa3"] and qs[0].flag == "attention_backend"
    lesson = research_lesson(cfg, changed, "FA3 requires SM>=80 and SM<=90", "r")
    assert [(c.field, c.value) for c in lesson.condition] == [("attention_backend", "fa3")]
    assert research_change("tp_size=4") == "tp_size=4" and research_change("") is None


def test_speculation_default_cap_makes_ovat_raise_max_running_requests_first():
    """DeepSeek-V3 NEXTN at 256 clients: the baseline resolves to the speculative default cap
    of 48, so the first neighbour raises max_running_requests (the study's 256: the client
    count) and moves that drop speculation come last."""
    from fixtures.brain_studies import spec_cap_study

    from agents.planner import spec_cap_target
    st = parse_study(spec_cap_study("cap"))
    base = st.base_config()
    assert fit(base).max_running_requests == 48 and spec_cap_target(base, st) == 256
    order = [changed for _, changed in Planner(st, None).ordered(base)]
    assert order[0] == "max_running_requests=256" and order[-1] == "speculative=off"
    # no max_running_requests in the knob space: the move is made at the target itself
    no_mrr = parse_study(spec_cap_study("cap2", knobs={"speculative": ["nextn", "off"]}))
    p = Planner(no_mrr, None)
    assert [c for _, c in p.ordered(base)] == ["max_running_requests=256", "speculative=off"]
    assert "default 48" in p.spec_cap_note
    # the rule does not fire: load within the cap, the cap set, or speculation off
    assert spec_cap_target(base, parse_study(spec_cap_study(
        "cap3", saturation={"isl": 1000, "osl": 250, "concurrency": 32, "duration_s": 10}))) \
        is None
    assert spec_cap_target(base.model_copy(update={"max_running_requests": 48}), st) is None
    off = base.model_copy(update={"speculative_algorithm": None})
    assert spec_cap_target(off, st) is None


LAYOUTS = {"tp_size": [4, 8], "attn_dp_size": [1, 8], "ep_size": [1, 8]}  # 8 points


def layout_study(brain: str):
    """DeepSeek-V3 FP8 on 8x H200 over TP, attention DP and EP: (tp 4, attn_dp 8) is invalid."""
    return study(model="deepseek-v3", gpu="H200", knobs=LAYOUTS,
                 baseline={"tp_size": 8, "weights": "fp8"}, search={"brain": brain})


def layout_objective(c) -> float:
    """Attention DP with EP best, then EP alone, then plain TP; TP4 x 2 in between."""
    return 100.0 * (1.5 if c.attn_dp_size > 1 else 1) * (1.2 if c.ep_size > 1 else 1) \
        * (1.1 if c.tp_size == 4 else 1)


@pytest.mark.anyio
@pytest.mark.parametrize("brain", ["ovat", "grid", "tpe", "guided"])
async def test_every_brain_skips_an_invalid_coupled_layout_with_its_reason(lessons, brain):
    st = layout_study(brain)
    planner = make_planner(st, lessons)
    launched, pruned, stop, _ = await drive_with(planner, st, 12, layout_objective)
    tried = [p.config for p in launched] + [p.config for p in pruned]
    assert all(c.tp_size % c.attn_dp_size == 0 for c in tried)
    # ep 8 brought deepep, and deepep makes ep = tp (SGLang 0.5.23 overrides.py:1611)
    assert all(c.moe_a2a_backend == "deepep" and c.ep_size == c.tp_size
               for c in tried if c.ep_size > 1)
    if brain != "ovat":  # the whole space: every valid point, the invalid ones skipped
        assert isinstance(stop, NoViableConfig)
        # grid and TPE walk the space to its end; guided may converge before it
        assert "coupled layout moves are invalid" in stop.reason or "converged" in stop.reason
        assert any("attn_dp_size 8 does not divide tp_size 4" in why
                   for why in planner.skipped.values())
        assert any(c.attn_dp_size == 8 and c.ep_size == 8 for c in tried)
