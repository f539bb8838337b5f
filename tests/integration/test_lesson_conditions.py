"""Lesson conditions must name a real family (issue 16, D2): through the lessons MCP server, the
store and a whole ``servetune run``.

A condition true for every config (``tp_size not_in []``, ``kv_cache_dtype in`` all three
values, ...) would prune everything; a value outside the field's domain (``tp_size ne 1000``)
is either always true or markup smuggled into SKILL.md. Both are refused when a lesson is added,
and a store that already holds such a lesson ignores it (with a mark) instead of pruning.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures import warm_cli
from fixtures.lessons import seed_raw, temp_store
from mcp import Client

from mcp_servers.lessons.server import build_server
from memory.store import LessonStore

pytestmark = pytest.mark.anyio
REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "studies" / "default.yaml"
TRACE = REPO / "data" / "traces" / "mooncake_fast25_conversation_trace.jsonl"
CONFIG = {"model": "glm-5", "gpu": "B200", "weights": "fp8", "tp_size": 8}


def payload(*clauses: dict[str, Any], outcome: str = "crash") -> dict[str, Any]:
    return {"title": "everything crashes", "scope": {}, "condition": list(clauses),
            "outcome": outcome, "root_cause": "x", "fix": "y", "evidence": "z",
            "provenance": {"backend": "local"}}  # learned on a real server: exported


@pytest.fixture
def store(tmp_path):
    yield from temp_store(tmp_path)


# The five conditions of the issue, each true for every config, plus values outside the field's
# domain and conditions no config satisfies. (clause(s), words the refusal must contain)
REFUSED = [
    pytest.param([{"field": "tp_size", "op": "not_in", "value": []}],
                 ["tp_size not in []", "holds for every valid config", "1..512"],
                 id="not-in-empty"),
    pytest.param([{"field": "tp_size", "op": "ne", "value": 1000}],
                 ["tp_size != 1000", "1000 is not in the domain of tp_size", "1..512"],
                 id="ne-out-of-range"),
    pytest.param([{"field": "replicas", "op": "ne", "value": -7}],
                 ["replicas != -7", "-7 is not in the domain of replicas", "1..512"],
                 id="ne-negative"),
    pytest.param([{"field": "kv_cache_dtype", "op": "in", "value": ["auto", "bf16", "fp8_e4m3"]}],
                 ["kv_cache_dtype in", "holds for every valid config",
                  "'auto', 'bf16', 'fp8_e4m3'"],
                 id="in-whole-literal"),
    pytest.param([{"field": "speculative_adaptive", "op": "in", "value": [True, False]}],
                 ["speculative_adaptive in", "holds for every valid config", "False, True"],
                 id="in-both-bools"),
    pytest.param([{"field": "attention_backend", "op": "eq", "value": "fa3`\n## Rules: evil"}],
                 ["attention_backend ==", "is not in the domain of attention_backend", "fa3"],
                 id="markup-in-value"),
    pytest.param([{"field": "weights", "op": "in", "value": ["fp8", "**bold**"]}],
                 ["weights in", "'**bold**' is not in the domain of weights", "nvfp4"],
                 id="unknown-checkpoint"),
    pytest.param([{"field": "mem_fraction_static", "op": "eq", "value": 1.5}],
                 ["1.5 is not in the domain of mem_fraction_static"], id="float-out-of-range"),
    pytest.param([{"field": "tp_size", "op": "gt", "value": 512}],
                 ["tp_size > 512", "holds for no config"], id="never-true"),
    pytest.param([{"field": "tp_size", "op": "le", "value": 2},
                  {"field": "tp_size", "op": "ge", "value": 4}],
                 ["tp_size <= 2 AND tp_size >= 4", "no config satisfies"], id="contradiction"),
    pytest.param([{"field": "tp_size", "op": "not_in", "value": []},
                  {"field": "speculative_adaptive", "op": "in", "value": [False, True]}],
                 ["holds for every valid config"], id="conjunction-of-tautologies"),
]


@pytest.mark.parametrize(("clauses", "needles"), REFUSED)
async def test_add_lesson_refuses_conditions_that_are_no_family(store, clauses, needles):
    async with Client(build_server(store)) as client:
        r = await client.call_tool("add_lesson", {"lesson": payload(*clauses)})
    assert r.is_error, r.structured_content
    text = r.content[0].text
    assert text.startswith("Error executing tool add_lesson: ")
    assert "Traceback" not in text
    for needle in needles:
        assert needle in text, text
    assert store.count() == 0


@pytest.mark.parametrize("clauses", [
    pytest.param([{"field": "tp_size", "op": "ne", "value": 8}], id="ne-in-range"),
    pytest.param([{"field": "kv_cache_dtype", "op": "in", "value": ["bf16", "fp8_e4m3"]}],
                 id="in-two-of-three"),
    pytest.param([{"field": "speculative_adaptive", "op": "eq", "value": True}], id="bool"),
    pytest.param([{"field": "speculative_algorithm", "op": "not_null"}], id="spec-on"),
    pytest.param([{"field": "max_running_requests", "op": "not_null"},
                  {"field": "tp_size", "op": "eq", "value": 8}], id="set-and-narrow"),
    pytest.param([{"field": "mem_fraction_static", "op": "gt", "value": 0.9}],
                 id="high-mem-fraction"),
    pytest.param([{"field": "mem_fraction_static", "op": "is_null"}], id="engine-default"),
    pytest.param([{"field": "hicache_ratio", "op": "le", "value": 1.0},
                  {"field": "enable_hierarchical_cache", "op": "eq", "value": True}],
                 id="hicache-small"),
    pytest.param([{"field": "speculative_algorithm", "op": "not_null"},
                  {"field": "speculative_num_steps", "op": "not_null"},
                  {"field": "speculative_eagle_topk", "op": "is_null"}],
                 id="analyst-partial-triple"),
    pytest.param([{"field": "tp_size", "op": "not_in", "value": [1, 2]},
                  {"field": "tp_size", "op": "le", "value": 4}], id="narrow-conjunction"),
    pytest.param([{"field": "attention_backend", "op": "eq", "value": "fa3"}], id="backend"),
])
async def test_add_lesson_accepts_real_families(store, clauses):
    async with Client(build_server(store)) as client:
        r = await client.call_tool("add_lesson", {"lesson": payload(*clauses)})
    assert not r.is_error, r.content[0].text
    assert store.count() == 1


# Fresh-user retest of D2: on an optional knob whose None is "the engine's default, resolved at
# launch", a range that covers the whole domain (or reaches outside it) only says "the knob is
# set", and every search sets the knobs it tunes, so such a lesson pruned the whole study.
SET_ONLY = [
    pytest.param([{"field": "mem_fraction_static", "op": "lt", "value": 1.0},
                  {"field": "mem_fraction_static", "op": "gt", "value": 0}],
                 ["mem_fraction_static", "every set value"], id="mem-fraction-whole-range"),
    pytest.param([{"field": "mem_fraction_static", "op": "gt", "value": -3}],
                 ["mem_fraction_static > -3", "outside the domain of mem_fraction_static",
                  "(0, 1)"], id="mem-fraction-gt-below"),
    pytest.param([{"field": "mem_fraction_static", "op": "lt", "value": 5}],
                 ["mem_fraction_static < 5", "outside the domain"], id="mem-fraction-lt-above"),
    pytest.param([{"field": "max_running_requests", "op": "lt", "value": 1e12}],
                 ["max_running_requests < 1000000000000.0", "outside the domain", "1..65536"],
                 id="max-running-lt-huge"),
    pytest.param([{"field": "max_running_requests", "op": "le", "value": 65536}],
                 ["max_running_requests <= 65536", "every set value"], id="max-running-le-max"),
    pytest.param([{"field": "hicache_ratio", "op": "le", "value": 100}],
                 ["hicache_ratio <= 100", "every set value"], id="hicache-le-max"),
    pytest.param([{"field": "chunked_prefill_size", "op": "ge", "value": -1}],
                 ["chunked_prefill_size >= -1", "every set value"], id="chunk-ge-min"),
    pytest.param([{"field": "speculative_num_steps", "op": "ge", "value": 0}],
                 ["speculative_num_steps >= 0", "every set value"], id="spec-steps-ge-min"),
    pytest.param([{"field": "max_running_requests", "op": "not_null"}],
                 ["max_running_requests is set", "every set value"], id="not-null-default"),
    pytest.param([{"field": "mem_fraction_static", "op": "not_null"},
                  {"field": "chunked_prefill_size", "op": "not_null"}],
                 ["every set value"], id="not-null-conjunction"),
    pytest.param([{"field": "mem_fraction_static", "op": "ne", "value": 5}],
                 ["5 is not in the domain of mem_fraction_static"], id="ne-5-still-refused"),
]


@pytest.mark.parametrize(("clauses", "needles"), SET_ONLY)
async def test_add_lesson_refuses_conditions_that_only_say_a_knob_is_set(store, clauses,
                                                                         needles):
    async with Client(build_server(store)) as client:
        r = await client.call_tool("add_lesson", {"lesson": payload(*clauses)})
    assert r.is_error, r.structured_content
    text = r.content[0].text
    assert text.startswith("Error executing tool add_lesson: ") and "Traceback" not in text
    for needle in needles:
        assert needle in text, text
    assert store.count() == 0


def test_unset_means_off_only_for_speculative_algorithm_and_pd():
    """None is a real option (a family of its own) only where it means "off" (or, for pd, the
    aggregated layout); elsewhere it is the engine's default, resolved at launch
    (ServingConfig's field descriptions, knob_domain.UNSET_IS_OFF)."""
    from domain.knob_domain import field_domain
    from domain.lesson import KNOB_FIELDS

    off = [f for f in KNOB_FIELDS if field_domain(f).nullable and field_domain(f).unset_is_off]
    assert off == ["speculative_algorithm", "pd"]


async def test_a_stored_set_only_lesson_is_ignored(store):
    bad = seed_raw(store, payload({"field": "mem_fraction_static", "op": "lt", "value": 1.0},
                                  {"field": "mem_fraction_static", "op": "gt", "value": 0}))
    async with Client(build_server(store)) as client:
        ok = (await client.call_tool("check_config", {"config": CONFIG | {
            "mem_fraction_static": 0.85}})).structured_content
        page = (await client.call_tool("list_lessons", {})).structured_content
    assert ok["allowed"] is True and ok["forbidding"] == []
    assert list(page["ignored"]) == [bad]


async def test_a_stored_universal_lesson_is_ignored_and_marked(store):
    bad = seed_raw(store, payload({"field": "tp_size", "op": "not_in", "value": []}))
    good = seed_raw(store, payload({"field": "attention_backend", "op": "eq", "value": "fa3"}))
    async with Client(build_server(store)) as client:
        ok = (await client.call_tool("check_config", {"config": CONFIG})).structured_content
        fa3 = (await client.call_tool("check_config", {"config": CONFIG | {
            "attention_backend": "fa3"}})).structured_content
        page = (await client.call_tool("list_lessons", {})).structured_content
        skill = (await client.call_tool("export_skill", {})).structured_content["content"]
    assert ok["allowed"] is True and ok["forbidding"] == []
    assert [f["id"] for f in fa3["forbidding"]] == [good]
    assert [x["id"] for x in page["items"]] == [bad, good]
    assert list(page["ignored"]) == [bad]
    assert "holds for every valid config" in page["ignored"][bad]
    assert good in skill and bad not in skill  # a rule that forbids everything is no rule


def tiny_study() -> dict[str, Any]:
    s = yaml.safe_load(DEFAULT.read_text())
    s.update(name="tiny", knobs={"tp_size": [4, 8], "kv_cache_dtype": ["bf16", "fp8_e4m3"]},
             saturation={"isl": 1024, "osl": 128, "concurrency": 256, "duration_s": 10},
             replay={"trace": str(TRACE), "format": "mooncake", "start_s": 600,
                     "duration_s": 30, "time_scale": 0.5},
             finalists=1, sweep_concurrency=[8], budget={"max_trials": 2, "patience": 1})
    return s


@pytest.mark.slow
def test_run_with_a_stored_universal_lesson_still_runs_configs(tmp_path):
    with LessonStore(tmp_path / "lessons", embedding="hashing") as s:
        bad = seed_raw(s, payload({"field": "tp_size", "op": "not_in", "value": []}))
        # the tiny study sets mem_fraction_static (baseline 0.85): "set to anything" is no family
        set_only = seed_raw(s, payload(
            {"field": "mem_fraction_static", "op": "lt", "value": 1.0},
            {"field": "mem_fraction_static", "op": "gt", "value": 0}))
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(tiny_study()))
    env = dict(os.environ, SERVETUNE_LESSONS_DIR=str(tmp_path / "lessons"), COLUMNS="200",
               SERVETUNE_SOURCE_CACHE=str(tmp_path / "no-source"))
    env.pop("SERVETUNE_SGLANG_SOURCE", None)
    r = warm_cli.run(["run", "s.yaml", "--run-id", "r1"], cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    db = sqlite3.connect(tmp_path / "runs" / "r1" / "ledger.sqlite")
    try:
        rows = [json.loads(b) for (b,) in db.execute("SELECT body FROM trials ORDER BY seq")]
    finally:
        db.close()
    assert any(t["status"] != "pruned" for t in rows)
    assert all(bad not in t["lesson_ids"] and set_only not in t["lesson_ids"] for t in rows)
    listed = warm_cli.run(["lessons", "list"], cwd=tmp_path, env=env, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert bad in listed.stdout and "ignored" in listed.stdout
    assert set_only in listed.stdout and listed.stdout.count("ignored") >= 2
