"""Lesson provenance and trust over the real store, the lessons MCP server and the CLI.

The store's merge and status rules (ChromaDB on a temporary folder), the lessons server's
show/quarantine/report_served tools (in memory and over stdio, retract only with the operator
flag), a run's record step quarantining a contradicted lesson (graph/state.py:StudyContext
.commit on a real ledger), and ``servetune lessons show|quarantine|retract|restore``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from fixtures import warm_cli
from fixtures.lessons import temp_store
from mcp import Client, StdioServerParameters

from domain.config import ServingConfig
from domain.ledger import Ledger
from domain.lesson import Clause, Lesson, Scope
from domain.metrics import MetricsSummary, Percentiles
from domain.provenance import Contradiction, Provenance
from domain.trial import Trial
from graph.state import StudyContext
from mcp_servers.lessons import ops
from mcp_servers.lessons.server import build_server
from memory.store import LessonStore, UnknownLesson

pytestmark = pytest.mark.anyio
REPO_ROOT = Path(__file__).resolve().parents[2]
TP8 = ServingConfig(model="glm-5", gpu="B200", weights="fp8", tp_size=8)


def lesson(backend: str | None, field: str = "tp_size", value: object = 8,
           run: str = "r1", **extra: object) -> Lesson:
    prov = None if backend is None else Provenance(backend=backend, engine="sglang",
                                                   engine_version="0.5.23", run_id=run,
                                                   image="lmsysorg/sglang:v0.5.23")
    return Lesson(title=f"{field} {value} crashes ({backend})",
                  scope=Scope(gpu="B200", model="glm-5"),
                  condition=[Clause(field=field, op="eq", value=value)], outcome="crash",
                  root_cause="x", fix="y", evidence=f"RuntimeError: {field} {value}",
                  provenance=prov, run_id=run, **extra)


@pytest.fixture
def store(tmp_path):
    yield from temp_store(tmp_path)


# -- store rules --------------------------------------------------------------------------------

def test_a_repeat_keeps_the_first_provenance_and_status_and_notes_the_run(store):
    first = store.add(lesson("twin", run="r1"))
    store.set_status(first.id, "quarantined", "served in r0", by="operator (cli)")
    again = store.add(lesson("kubernetes", run="r2", verified=True,
                             source_site="sglang/srt/server_args.py:10"))
    assert again.id == first.id and store.count() == 1
    assert again.provenance.backend == "twin" and again.provenance.run_id == "r1"
    assert again.provenance.runs == ["r2"]
    assert again.status == "quarantined" and [h.reason for h in again.history] == ["served in r0"]
    assert again.verified and again.source_site == "sglang/srt/server_args.py:10"
    assert store.get(first.id) == again


def test_forbidding_heeds_status_and_the_study_backend(store):
    twin = store.add(lesson("twin"))
    real = store.add(lesson("local", field="attention_backend", value="fa3"))
    fa3 = TP8.model_copy(update={"attention_backend": "fa3"})
    assert [x.id for x in store.forbidding(TP8)] == [twin.id]
    assert store.forbidding(TP8, "kubernetes") == []  # twin-learned, not source-verified
    assert [x.id for x in store.forbidding(fa3)] == [twin.id, real.id]
    assert [x.id for x in store.forbidding(fa3, "local")] == [real.id]
    assert [x.id for x in store.forbidding(fa3.model_copy(update={"tp_size": 4}), "local")] \
        == [real.id]
    store.set_status(real.id, "retracted", "fa3 works since 0.5.23", by="operator (cli)")
    assert store.forbidding(fa3.model_copy(update={"tp_size": 4})) == []
    assert [x.id for _, x in store.covering(fa3.model_copy(update={"tp_size": 4}))] == [real.id]
    with pytest.raises(UnknownLesson, match="no lesson 'L-0000000000'"):
        store.set_status("L-0000000000", "quarantined", "x", by="operator (cli)")


def test_contradict_quarantines_by_the_weight_of_the_measurement(store):
    twin = store.add(lesson("twin"))
    real = store.add(lesson("local", field="weights", value="fp8"))
    m = Contradiction(backend="twin", run_id="r9", trial="search:1", config_id=TP8.config_id(),
                      evidence="baseline; 512 completed")
    assert [x.id for x in store.contradict(TP8, m)] == [twin.id]  # the twin cannot overrule
    assert store.get(real.id).status == "active"                   # a real-backend lesson
    assert store.contradict(TP8, m) == []                          # idempotent
    assert len(store.get(twin.id).contradictions) == 1
    real_m = m.model_copy(update={"backend": "kubernetes", "trial": "search:2"})
    assert [x.id for x in store.contradict(TP8, real_m)] == [real.id]
    got = store.get(real.id)
    assert got.status == "quarantined" and got.history[-1].by == "measurement (kubernetes)"
    assert "contradicted: config" in got.history[-1].reason and not got.trusted


# -- ops and tools ------------------------------------------------------------------------------

def test_export_skill_writes_only_trusted_lessons_with_provenance(store):
    store.add(lesson("twin"))
    real = store.add(lesson("kubernetes", field="attention_backend", value="fa3"))
    verified = store.add(lesson("twin", field="weights", value="nvfp4", verified=True,
                                source_site="sglang/srt/layers/quantization/x.py:7"))
    text = ops.export_skill(store).content
    assert real.id in text and verified.id in text
    assert lesson("twin").with_id().id not in text  # twin-learned, not source-verified
    assert "learned: kubernetes, sglang 0.5.23, image lmsysorg/sglang:v0.5.23, run r1" in text
    assert "trusted: source-verified (sglang/srt/layers/quantization/x.py:7)" in text
    assert "1 untrusted lessons of this scope are left out" in text
    assert ops.export_skill(store).lesson_count == 2
    store.set_status(real.id, "quarantined", "served on r3", by="operator (cli)")
    assert real.id not in ops.export_skill(store).content


async def test_show_quarantine_and_report_served_tools(store):
    twin = store.add(lesson("twin"))
    async with Client(build_server(store, run_id="r5", backend="kubernetes")) as client:
        shown = (await client.call_tool("show_lesson", {"lesson_id": twin.id})).structured_content
        real_check = (await client.call_tool("check_config", {"config": TP8.model_dump(
            mode="json")})).structured_content
        twin_check = (await client.call_tool("check_config", {
            "config": TP8.model_dump(mode="json"), "on": "twin"})).structured_content
        unknown = await client.call_tool("show_lesson", {"lesson_id": "L-0000000000"})
        no_reason = await client.call_tool("quarantine_lesson", {"lesson_id": twin.id})
        served = (await client.call_tool("report_served", {
            "config": TP8.model_dump(mode="json"), "trial": "search:9",
            "evidence": "ready; 512 completed"})).structured_content
        names = {t.name for t in (await client.list_tools()).tools}
    assert shown["trusted"] is False and shown["trust"] == "learned on twin, not source-verified"
    assert shown["prunes_real_backend"] is False
    assert real_check["allowed"] is True  # a kubernetes study: the twin lesson does not prune
    assert [f["id"] for f in twin_check["forbidding"]] == [twin.id]
    assert twin_check["forbidding"][0]["learned_on"] == "twin"
    assert unknown.is_error and "no lesson 'L-0000000000'" in unknown.content[0].text
    assert no_reason.is_error and "reason" in no_reason.content[0].text
    assert [q["lesson"]["id"] for q in served["quarantined"]] == [twin.id]
    got = store.get(twin.id)
    assert got.contradictions[0].run_id == "r5" and got.contradictions[0].backend == "kubernetes"
    assert "retract_lesson" not in names and "restore_lesson" not in names


async def test_quarantine_by_an_agent_and_retract_only_with_the_operator_flag(store):
    x = store.add(lesson("local"))
    async with Client(build_server(store)) as agent:
        q = (await agent.call_tool("quarantine_lesson", {
            "lesson_id": x.id, "reason": "tp 8 served in run r7"})).structured_content
        again = (await agent.call_tool("quarantine_lesson", {
            "lesson_id": x.id, "reason": "tp 8 served in run r7"})).structured_content
        page = (await agent.call_tool("list_lessons", {})).structured_content
    assert q["changed"] is True and q["lesson"]["status"] == "quarantined"
    assert q["lesson"]["history"][0]["by"] == "agent (mcp)" and again["changed"] is False
    assert page["items"][0]["status"] == "quarantined"
    assert page["trust"][x.id].startswith("untrusted: quarantined: tp 8 served in run r7")
    async with Client(build_server(store, allow_retract=True)) as operator:
        names = {t.name for t in (await operator.list_tools()).tools}
        back = (await operator.call_tool("restore_lesson", {
            "lesson_id": x.id, "reason": "r7 ran another image"})).structured_content
        gone = (await operator.call_tool("retract_lesson", {
            "lesson_id": x.id, "reason": "wrong condition"})).structured_content
    assert {"retract_lesson", "restore_lesson"} <= names
    assert back["lesson"]["status"] == "active" and gone["lesson"]["status"] == "retracted"
    async with Client(build_server(store)) as agent:  # an agent cannot undo a retraction
        kept = (await agent.call_tool("quarantine_lesson", {
            "lesson_id": x.id, "reason": "make it restorable"})).structured_content
    assert kept["changed"] is False and kept["lesson"]["status"] == "retracted"
    assert [h.status for h in store.get(x.id).history] == ["quarantined", "active",
                                                              "retracted"]


async def test_add_lesson_fills_provenance_and_refuses_a_forged_status(store):
    forged = lesson(None).model_copy(update={"status": "retracted", "contradictions": [
        Contradiction(backend="local", config_id="x")]})
    async with Client(build_server(store, run_id="r3", backend="local")) as client:
        r = (await client.call_tool("add_lesson", {"lesson": forged.model_dump(mode="json")}
                                    )).structured_content
    stored = store.get(r["lesson"]["id"])
    assert stored.status == "active" and stored.contradictions == [] and stored.history == []
    assert stored.provenance.backend == "local" and stored.provenance.run_id == "r1"
    assert stored.provenance.evidence == ["RuntimeError: tp_size 8"]


# -- the record step ----------------------------------------------------------------------------

def pct(p50: float, p99: float) -> Percentiles:
    return Percentiles(p50=p50, p90=p99, p95=p99, p99=p99, mean=p50)


def summary(completed: int = 100) -> MetricsSummary:
    return MetricsSummary(
        requests=100, completed=completed, errors=100 - completed, duration_s=60.0,
        input_tokens=100_000, output_tokens=20_000, output_tok_s=8000.0, input_tok_s=1000.0,
        output_tok_s_per_gpu=1000.0, tok_s_per_user=30.0, request_rate=1.5,
        ttft_ms=pct(100.0, 400.0), itl_ms=pct(10.0, 30.0), tpot_ms=pct(12.0, 20.0),
        e2e_ms=pct(2000.0, 5000.0), gpus=8)


async def test_commit_quarantines_a_new_lesson_that_forbids_a_served_config(store, tmp_path):
    """The issue's HiCache case, as the record step sees it: ratio 2 served, then the ratio-8
    host OOM writes a lesson whose condition covers ratio 2."""
    hc = TP8.model_copy(update={"enable_hierarchical_cache": True, "hicache_ratio": 2.0})
    wide = Lesson(title="HiCache host OOM at TP8", scope=Scope(gpu="B200", model="glm-5"),
                  condition=[Clause(field="enable_hierarchical_cache", op="eq", value=True),
                             Clause(field="tp_size", op="eq", value=8),
                             Clause(field="hicache_ratio", op="gt", value=1.29)],
                  outcome="oom", failure_class="HOST_OOM_HICACHE", root_cause="x", fix="y",
                  evidence="ValueError: Not enough host memory available. Requesting 478.01 "
                           "GB but only have 77.24 GB free.", run_id="r1").with_id()
    events: list[dict] = []
    ledger = Ledger(tmp_path / "ledger.sqlite")
    try:
        async with Client(build_server(store, "r1", "twin")) as lessons:
            ctx = StudyContext(run_id="r1", study=None, ledger=ledger, cluster=None, bench=None,
                               lessons=lessons, backend_kind="twin", progress=events.append,
                               events_path=tmp_path / "events.jsonl")
            base = await ctx.commit(Trial(run_id="r1", seq=0, key="search:base", phase="search",
                                          status="baseline", config=hc, reason="baseline",
                                          saturation=summary()))
            crash = await ctx.commit(Trial(
                run_id="r1", seq=0, key="search:r8", phase="search", status="crash",
                config=hc.model_copy(update={"hicache_ratio": 8.0}), reason="host OOM",
                failure_class="HOST_OOM_HICACHE", lessons_written=[wide]))
            # a later served row of a config an active lesson forbids: quarantined at once too
            later = Lesson(title="tp 4 crashes", scope=Scope(gpu="B200", model="glm-5"),
                           condition=[Clause(field="tp_size", op="eq", value=4)],
                           outcome="crash", root_cause="x", fix="y", evidence="boom").with_id()
            store.add(later.model_copy(update={"provenance": Provenance(backend="twin")}))
            await ctx.commit(Trial(run_id="r1", seq=0, key="search:tp4", phase="search",
                                   status="discard", config=TP8.model_copy(
                                       update={"tp_size": 4}), reason="slower",
                                   saturation=summary()))
    finally:
        ledger.close()
    stored = store.get(wide.id)
    assert base.seq == 1 and crash.lessons_written[0].provenance.backend == "twin"
    assert crash.lessons_written[0].provenance.image == "lmsysorg/sglang:v0.5.23"
    assert crash.lessons_written[0].provenance.trial == "search:r8"
    assert stored.status == "quarantined" and stored.contradictions[0].trial == "search:base"
    assert store.get(later.id).status == "quarantined"
    assert [e["quarantined"] for e in events if "quarantined" in e] == [wide.id, later.id]
    assert (tmp_path / "events.jsonl").read_text().count('"lesson-quarantined"') == 2


# -- CLI and stdio ------------------------------------------------------------------------------

def cli(tmp: Path, *args: str, plain: bool = False) -> subprocess.CompletedProcess:
    """``servetune lessons ARGS``, a process of its own forked from the warm CLI interpreter
    (fixtures/warm_cli.py: the same exit code and output as ``python -m servetune.cli``), or
    with ``plain`` that ``python -m servetune.cli`` subprocess (the real entry point)."""
    env = dict(os.environ, SERVETUNE_LESSONS_DIR=str(tmp / "lessons"), COLUMNS="200")
    if plain:
        return subprocess.run([sys.executable, "-m", "servetune.cli", "lessons", *args],
                              cwd=tmp, env=env, capture_output=True, text=True, timeout=120)
    return warm_cli.run(["lessons", *args], cwd=tmp, env=env, timeout=120)


def test_cli_show_quarantine_retract_restore(tmp_path):
    with LessonStore(tmp_path / "lessons", embedding="hashing") as s:
        x = s.add(lesson("twin"))
    shown = cli(tmp_path, "show", x.id, plain=True)
    assert shown.returncode == 0, shown.stderr
    for needle in ("status:      active", "trust:       untrusted: learned on twin, not "
                   "source-verified", "verified:    no", "provenance:  twin, sglang 0.5.23, "
                   "image lmsysorg/sglang:v0.5.23, run r1", "prunes real-backend studies: no"):
        assert needle in shown.stdout, shown.stdout
    q = cli(tmp_path, "quarantine", x.id, "--reason", "tp 8 served in r2")
    assert (q.returncode, q.stdout.strip()) == (0, f"{x.id}: quarantined")
    assert "untrusted" in cli(tmp_path, "list").stdout
    r = cli(tmp_path, "retract", x.id, "--reason", "wrong condition")
    assert (r.returncode, r.stdout.strip()) == (0, f"{x.id}: retracted")
    back = cli(tmp_path, "restore", x.id)
    assert (back.returncode, back.stdout.strip()) == (0, f"{x.id}: restored")
    history = cli(tmp_path, "show", x.id).stdout
    assert "quarantined by operator (cli): tp 8 served in r2" in history
    assert "active by operator (cli): restored by the operator" in history
    missing = cli(tmp_path, "show", "L-0000000000")
    assert missing.returncode == 2 and "no lesson 'L-0000000000'" in missing.stderr
    assert cli(tmp_path, "retract", "L-0000000000", "--reason", "x").returncode == 2
    no_reason = cli(tmp_path, "quarantine", x.id)
    assert no_reason.returncode == 2 and "--reason" in no_reason.stderr


async def test_stdio_server_retracts_only_with_allow_retract(tmp_path):
    with LessonStore(tmp_path / "lessons", embedding="hashing") as s:
        x = s.add(lesson("local"))
    env = dict(os.environ, SERVETUNE_LESSONS_DIR=str(tmp_path / "lessons"))

    async def tools(*flags: str) -> tuple[set[str], object]:
        params = StdioServerParameters(command=sys.executable, cwd=str(REPO_ROOT), env=env,
                                       args=["-m", "servetune.cli", "mcp", "lessons", *flags])
        with anyio.fail_after(90):
            async with Client(params) as client:
                names = {t.name for t in (await client.list_tools()).tools}
                r = await client.call_tool("retract_lesson", {
                    "lesson_id": x.id, "reason": "operator says so"}) if flags else None
        return names, r

    plain, _ = await tools()
    assert {"show_lesson", "quarantine_lesson"} <= plain and "retract_lesson" not in plain
    operator, r = await tools("--allow-retract")
    assert "retract_lesson" in operator and not r.is_error
    with LessonStore(tmp_path / "lessons") as s:
        assert s.get(x.id).status == "retracted"
