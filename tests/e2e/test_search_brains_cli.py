"""A whole `servetune run` with each search brain (search.brain grid, tpe, guided): the ledger,
the plan events and the report of a deterministic run on a 16-point knob space."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml
from fixtures.brain_studies import study_dict
from fixtures.cli import ledger_rows
from fixtures.cli import run_deterministic as servetune
from mcp import Client

from agents.guided_brain import GuidedPlanner
from agents.planner import TrialPlan
from domain.config import ServingConfig
from domain.estimate import ReplayProfile
from domain.lesson_builders import research_lesson
from domain.study import parse_study
from domain.traces import load_trace
from domain.trial import Trial
from mcp_servers.lessons.server import build_server
from memory.store import LessonStore
from servetune.study_file import load_study

# the 16-point knob space of the tiny GLM-5 study
KNOBS = {"attention_backend": ["unset", "fa3"], "tp_size": [4, 8],
         "weights": ["fp8", "nvfp4"], "kv_cache_dtype": ["bf16", "fp8_e4m3"]}


def search_rows(ledger: Path) -> list[tuple[str, dict]]:
    """(status, body) of the search rows of a run's ledger, in order."""
    return [(status, json.loads(body)) for _, key, status, _, body in ledger_rows(ledger)
            if key.startswith("search:")]


@pytest.mark.slow
@pytest.mark.parametrize("brain", ["tpe", "grid"])
def test_servetune_run_with_a_space_brain(tmp_path, brain):
    p = tmp_path / "s.yaml"
    sd = study_dict("brains", knobs=KNOBS, search={"brain": brain, "seed": 3})
    p.write_text(yaml.safe_dump(sd))
    r = servetune(tmp_path, p, "b1")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = search_rows(tmp_path / "runs" / "b1" / "ledger.sqlite")
    launched = [b for s, b in rows if s != "pruned"]
    assert rows[0][0] == "baseline" and 2 <= len(launched) <= 5
    assert any("," in b["changed"] for b in launched[1:])  # several knobs at once
    # FP8 on TP4 never launches: the estimate prunes it (arithmetic in the reason)
    assert not any(b["config"]["weights"] == "fp8" and b["config"]["tp_size"] == 4
                   for b in launched)
    assert all("memory-fit estimate" in b["reason"] for s, b in rows if s == "pruned"
               and b["config"]["weights"] == "fp8" and b["config"]["tp_size"] == 4)
    # fa3 crashes at most once; later fa3 candidates are pruned by its lesson
    fa3 = [(s, b) for s, b in rows if b["config"].get("attention_backend") == "fa3"]
    assert sum(s == "crash" for s, _ in fa3) <= 1
    assert all(s == "pruned" for s, _ in fa3[1:])
    assert (tmp_path / "runs" / "b1" / "report.md").exists()


@pytest.mark.slow
def test_servetune_run_with_the_guided_brain(tmp_path):
    # a 5 s TTFT p99 SLO (the default study's 8 s left TP4 and TP8 within one 2 % score
    # bucket once the all-reduce priced the node's topology): the prior decides, not a tie
    sd = study_dict("guided", knobs=KNOBS, search={"brain": "guided"},
                    budget={"max_trials": 3, "patience": 3}, slo={"ttft_p99_ms": 5000})
    st = parse_study(sd)
    # a lesson store that already knows fa3 is refused on B200 (the CLI reuses its embedding)
    store = LessonStore(tmp_path / "lessons", embedding="hashing")
    try:
        cfg = st.base_config().model_copy(update={"attention_backend": "fa3"})
        fa3_id = store.add(research_lesson(cfg, "attention_backend=fa3",
                                           "FA3 requires SM>=80 and SM<=90", "r0")).id
    finally:
        store.close()
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(sd))
    r = servetune(tmp_path, p, "g1")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = search_rows(tmp_path / "runs" / "g1" / "ledger.sqlite")
    launched = [b for s, b in rows if s != "pruned"]
    assert rows[0][0] == "baseline" and 2 <= len(launched) <= 3
    # the baseline carries the guided brain's prediction too (report: predicted vs measured)
    assert rows[0][1]["predicted"]["output_tok_s_per_gpu"] > 0
    assert "replay_ttft_p99_ms" in rows[0][1]["predicted"]
    ids = [ServingConfig.model_validate(b["config"]).config_id() for b in launched]
    assert len(set(ids)) == len(ids)
    assert not any(b["config"].get("attention_backend") == "fa3" for b in launched)
    # fa3 points are ranked last: never launched, and pruned by the stored lesson if reached
    fa3 = [b for s, b in rows if s == "pruned" and b["config"].get("attention_backend") == "fa3"]
    assert all(fa3_id in b["lesson_ids"] for b in fa3)
    # the second launch is the brain's step after the baseline, with the replay's SLO prior
    # (graph.run gives the brain the window's profile) and the baseline's residual, on the
    # study as the CLI read it (safe_dump sorted the knobs: their order breaks exact ties)
    st = load_study(p)
    rp = st.replay
    prof = ReplayProfile.of(load_trace(rp.trace, rp.format).window(rp.start_s, rp.duration_s)
                            .scaled(rp.time_scale), rp.duration_s / rp.time_scale)
    baseline = Trial.model_validate(rows[0][1])

    async def second_step(replay: ReplayProfile | None):
        store = LessonStore(tmp_path / "lessons", embedding="hashing")
        try:
            async with Client(build_server(store)) as client:
                g = GuidedPlanner(st, client, replay=replay)
                return await g.step(baseline.config, {baseline.config.config_id()}, "g1",
                                    history=[baseline])
        finally:
            store.close()

    with_slo, blind = asyncio.run(second_step(prof)), asyncio.run(second_step(None))
    assert isinstance(with_slo.decision, TrialPlan) and isinstance(blind.decision, TrialPlan)
    pick = with_slo.decision.config
    # the SLO prior matters: blind, TP4 nvfp4 fp8 KV (the best throughput) would come first;
    # with it, the TP8 twin predicted further under the SLO does
    assert blind.decision.config != pick and blind.decision.config.tp_size == 4
    assert pick.tp_size == 8
    second = launched[1]
    assert ServingConfig.model_validate(second["config"]) == pick, second
    assert second["changed"] == with_slo.decision.changed
    assert "," in second["changed"] and "weights=nvfp4" in second["changed"], second
    # a plan event (key, changed, brain, rationale) before each search launch after the baseline
    events = [json.loads(line) for line in
              (tmp_path / "runs" / "g1" / "events.jsonl").read_text().splitlines()]
    plans = [e for e in events if e["kind"] == "plan"]
    assert [e["key"] for e in plans] == [f"search:{i}" for i in ids[1:]]
    for e, b in zip(plans, launched[1:], strict=True):
        assert e["brain"] == "guided" and e["changed"] == b["changed"]
        assert e["rationale"].startswith("guided: predicted ")
        assert "the SLO (boundary 1.00x)" in e["rationale"]
    assert plans[0]["rationale"] == with_slo.decision.rationale
    assert (tmp_path / "runs" / "g1" / "report.md").exists()
