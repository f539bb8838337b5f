"""Each Claude brain the graph uses (planner, deployer, analyst), driven by recorded Messages API
responses through the real anthropic SDK (httpx2 MockTransport) and the real MCP servers, with
the graph's own checks on their outputs: a rejected output gets one corrective retry.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx2
import pytest
from fixtures.anthropic_script import Scripted, msg, tool_use
from fixtures.anthropic_stub import State, answer
from fixtures.cli import tiny_study, write
from fixtures.lesson_invariants import assert_no_contradicted
from mcp import Client

from agents.analyst import ClaudeAnalyst, Verdict, check_verdict
from agents.claude import AgentOutputInvalid, ClaudeSetup
from agents.claude_planner import ClaudePlanner
from agents.deployer import ClaudeDeployer
from agents.planner import NoViableConfig, PlannerFailed, TrialPlan
from domain.ledger import Ledger
from domain.study import Study
from graph.run import run_study
from mcp_servers.bench.ops import BenchService
from mcp_servers.bench.server import build_server as bench_server
from mcp_servers.cluster.server import build_server as cluster_server
from mcp_servers.cluster.twin import TwinBackend
from mcp_servers.lessons.server import build_server as lessons_server
from servetune.study_file import load_study

pytestmark = pytest.mark.anyio
SUBMIT = "submit_result"


@pytest.fixture
def study(tmp_path) -> Study:
    return load_study(write(tmp_path, "tiny.yaml", tiny_study()))


def stub_client(handler: Any) -> anthropic.AsyncAnthropic:
    """An SDK client whose requests go to ``handler`` (no socket)."""
    return anthropic.AsyncAnthropic(
        api_key="test", base_url="http://anthropic.invalid", max_retries=0,
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)))


def search_trials(run_dir: Path) -> list[Any]:
    """The search-phase ledger rows of a run folder."""
    led = Ledger(run_dir / "ledger.sqlite")
    try:
        return led.trials("search")
    finally:
        led.close()


def context(request: dict[str, Any]) -> dict[str, Any]:
    """The <context> block of a request's task (its first user message)."""
    first = request["messages"][0]["content"]
    m = re.search(r"<context>(.*)</context>", first, re.S)
    assert m, first
    data: dict[str, Any] = json.loads(m.group(1))
    return data


def rejection(script: Scripted, i: int) -> str:
    (res,) = script.tool_results(i)
    assert res["is_error"] is True
    content: str = res["content"]
    return content


# -- planner --------------------------------------------------------------------------------

async def test_planner_picks_among_screened_candidates_after_one_rejected_pick(study, store):
    script = Scripted([
        msg(tool_use("check_config", config={"model": "glm-5", "gpu": "B200"})),
        msg(tool_use(SUBMIT, action="launch", candidate="tp_size=2",
                     rationale="more replicas")),  # not offered: rejected once
        msg(tool_use(SUBMIT, action="launch", candidate="kv_cache_dtype=fp8_e4m3",
                     rationale="fp8 KV doubles the KV pool, so more requests run at once")),
    ])
    claude = ClaudeSetup(client=script.client(), model="claude-test")
    base = study.base_config()
    async with Client(lessons_server(store)) as lessons:
        planner = ClaudePlanner(study, lessons, claude, history=[])
        seen = {base.config_id()}
        step = await planner.step(base, seen, "run-1")

    plan = step.decision
    assert isinstance(plan, TrialPlan) and plan.changed == "kv_cache_dtype=fp8_e4m3"
    assert plan.rationale.startswith("fp8 KV doubles")
    assert plan.config.config_id() in seen
    ctx = context(script.requests[0])
    offered = [c["candidate"] for c in ctx["candidates"]]
    assert "kv_cache_dtype=fp8_e4m3" in offered and "tp_size=2" not in offered
    assert all("kv_tokens_per_replica" in c["predicted"] for c in ctx["candidates"])
    # tp_size=4 with fp8 weights does not fit a B200: screened out in code, never offered
    assert "tp_size=4" not in offered
    assert any(p.changed == "tp_size=4" and "memory-fit" in p.reason for p in step.pruned)
    assert "is not one of the offered candidates" in rejection(script, 2)
    assert planner.usage.retries == 1 and planner.usage.turns == 3
    # the planner's tools are the lessons server's, the model never sees a cluster tool
    assert [t["name"] for t in script.requests[0]["tools"]] == [
        "check_config", "query_lessons", "list_lessons", SUBMIT]


async def test_planner_stop_and_two_invalid_picks(study, store):
    base = study.base_config()
    stop = Scripted([msg(tool_use(SUBMIT, action="stop", rationale="nothing left worth it"))])
    bad = Scripted([msg(tool_use(SUBMIT, action="launch", candidate="nope=1", rationale="x")),
                    msg(tool_use(SUBMIT, action="launch", rationale=""))])
    async with Client(lessons_server(store)) as lessons:
        s1 = await ClaudePlanner(study, lessons, ClaudeSetup(client=stop.client()), []).step(
            base, {base.config_id()}, "r")
        p2 = ClaudePlanner(study, lessons, ClaudeSetup(client=bad.client()), [])
        s2 = await p2.step(base, {base.config_id()}, "r")
    assert isinstance(s1.decision, NoViableConfig)
    assert s1.decision.reason == "the planner stopped the search: nothing left worth it"
    assert isinstance(s2.decision, PlannerFailed)
    assert s2.decision.reason.startswith("planner: invalid agent output after one corrective")
    assert "rationale" in s2.decision.reason  # the second problem is the one recorded
    assert p2.usage.turns == 2 and p2.usage.retries == 1
    assert s2.pruned  # what was screened out is not lost with the failed pick


async def test_planner_modifies_a_candidate_after_research(study, store):
    script = Scripted([
        msg(tool_use(SUBMIT, action="launch", candidate="attention_backend=fa3",
                     rationale="try fa3")),
        msg(tool_use(SUBMIT, decision="modify", modify_to="kv_cache_dtype=fp8_e4m3",
                     reason="fa3 requires SM<=90; B200 is SM 100", evidence=[],
                     refused_on_this_gpu=True)),  # no evidence: rejected once
        msg(tool_use(SUBMIT, decision="modify", modify_to="kv_cache_dtype=fp8_e4m3",
                     reason="fa3 requires SM<=90; B200 is SM 100",
                     evidence=["sglang/srt/arg_groups/attention_hook.py:12"],
                     refused_on_this_gpu=True)),
    ])
    base = study.base_config()
    outcomes = [{"question": {"id": "src-fa3", "kind": "source", "value": "fa3"},
                 "status": "answered", "findings": {"claims": [{
                     "text": "FlashAttention v3 Backend requires SM>=80 and SM<=90",
                     "evidence": ["sglang/srt/arg_groups/attention_hook.py:12"]}]}}]
    async with Client(lessons_server(store)) as lessons:
        planner = ClaudePlanner(study, lessons, ClaudeSetup(client=script.client()), [])
        step = await planner.step(base, {base.config_id()}, "run-1")
        assert isinstance(step.decision, TrialPlan)
        decision = await planner.decide(step.decision, outcomes, "run-1")
    assert decision.decision == "modify" and decision.plan is not None
    assert decision.plan.changed == "kv_cache_dtype=fp8_e4m3"
    assert decision.lesson is not None and decision.lesson.source == "research"
    assert decision.lesson.condition[0].field == "attention_backend"
    ctx = context(script.requests[1])
    assert ctx["candidate"] == "attention_backend=fa3" and ctx["sm"] == 100
    assert "kv_cache_dtype=fp8_e4m3" in ctx["alternatives"]
    assert "attention_backend=fa3" not in ctx["alternatives"]
    assert "needs evidence" in rejection(script, 2)
    assert planner.usage.turns == 3


async def test_planner_decision_invalid_twice_raises(study, store):
    script = Scripted([
        msg(tool_use(SUBMIT, action="launch", candidate="attention_backend=fa3", rationale="x")),
        msg(tool_use(SUBMIT, decision="modify", modify_to="tp_size=1", reason="r",
                     evidence=["a.py:1"])),
        msg(tool_use(SUBMIT, decision="maybe", reason="r")),
    ])
    base = study.base_config()
    async with Client(lessons_server(store)) as lessons:
        planner = ClaudePlanner(study, lessons, ClaudeSetup(client=script.client()), [])
        step = await planner.step(base, {base.config_id()}, "r")
        assert isinstance(step.decision, TrialPlan)
        with pytest.raises(AgentOutputInvalid) as e:
            await planner.decide(step.decision, [], "r")
    assert "modify_to 'tp_size=1' is not one of the alternatives" in e.value.errors[0]
    assert "decision" in e.value.reason
    assert planner.usage.turns == 3  # the failed run's cost is counted too


# -- deployer -------------------------------------------------------------------------------

async def test_deployer_report_is_checked_against_the_cluster(study, store):
    fa3 = study.base_config().model_copy(update={"attention_backend": "fa3"})
    script = Scripted([
        msg(tool_use("list_deployments")),
        msg(tool_use("deploy", wait_s=30)),
        msg(tool_use(SUBMIT, name="trial-x", ready=True)),  # Failed in fact: rejected once
        msg(tool_use("get_logs", tail=40)),
        msg(tool_use(SUBMIT, name="trial-x", ready=False, failure_class="UNSUPPORTED_BACKEND",
                     evidence="FlashAttention v3 Backend requires SM>=80 and SM<=90",
                     stage="startup")),
    ])
    backend = TwinBackend("servetune")
    async with Client(cluster_server(backend)) as cluster, \
            Client(lessons_server(store)) as lessons:
        deployer = ClaudeDeployer(cluster, lessons, ClaudeSetup(client=script.client()),
                                  "servetune")
        out = await deployer.launch("trial-x", fa3, {})
    assert (out.name, out.ready, out.failure_class) == ("trial-x", False, "UNSUPPORTED_BACKEND")
    assert out.log_tail and any("SM>=80" in line for line in out.log_tail)
    assert "ready=True contradicts get_status phase Failed" in rejection(script, 3)
    # the model deployed exactly the config it was given, under the given name
    (dep,) = backend.list()
    assert dep.name == "trial-x" and dep.phase == "Failed"
    tools = {t["name"]: t["input_schema"] for t in script.requests[0]["tools"]}
    assert set(tools) == {"deploy", "get_status", "get_logs", "get_events", "tear_down",
                          "list_deployments", "check_config", SUBMIT}
    for name in ("deploy", "get_status", "get_logs", "tear_down"):
        props = tools[name].get("properties", {})
        assert not {"name", "config", "namespace"} & set(props), (name, props)
    assert "wait_s" in tools["deploy"]["properties"]
    assert deployer.usage.tool_calls == 3 and deployer.usage.retries == 1


async def test_deployer_that_never_deploys_fails_after_one_retry(study, store):
    script = Scripted([msg(tool_use(SUBMIT, name="trial-y", ready=False,
                                    failure_class="UNKNOWN")),
                       msg(tool_use(SUBMIT, name="trial-z", ready=False,
                                    failure_class="UNKNOWN"))])
    async with Client(cluster_server(TwinBackend("servetune"))) as cluster, \
            Client(lessons_server(store)) as lessons:
        deployer = ClaudeDeployer(cluster, lessons, ClaudeSetup(client=script.client()),
                                  "servetune")
        with pytest.raises(AgentOutputInvalid) as e:
            await deployer.launch("trial-y", study.base_config(), {})
    assert e.value.errors[0].endswith("trial-y was never deployed: call deploy first")
    assert "name must be 'trial-y'" in e.value.reason


# -- analyst --------------------------------------------------------------------------------

async def test_analyst_verdict_is_held_to_the_measurement(study, store, tmp_path: Path):
    backend = TwinBackend("servetune")
    service = BenchService(backend, tmp_path / "records", [tmp_path])
    async with Client(cluster_server(backend)) as cluster, \
            Client(bench_server(service)) as bench, Client(lessons_server(store)) as lessons:
        await cluster.call_tool("deploy", {"name": "trial-a",
                                           "config": study.base_config().model_dump(mode="json")})
        analyst = ClaudeAnalyst(bench, lessons, study, ClaudeSetup(client=Scripted([]).client()))
        run = await analyst.saturation("trial-a", duration_s=5)
        measured = run.summary.output_tok_s_per_gpu
        best = measured * 0.9
        script = Scripted([
            msg(tool_use("get_records", bench_id=run.bench_id, max_items=5)),
            msg(tool_use(SUBMIT, status="keep", objective=measured * 1.2, reason="faster")),
            msg(tool_use(SUBMIT, status="keep", objective=round(measured, 1),
                         reason=f"{measured:.0f} tok/s/GPU, +11% over the best")),
        ])
        analyst.claude = ClaudeSetup(client=script.client())
        verdict = await analyst.verdict(run, best, False, study.base_config(), "x=1")
    assert verdict.status == "keep" and verdict.objective == round(measured, 1)
    assert f"objective must be the measured output tok/s/GPU, {measured:.1f}" in rejection(
        script, 2)
    (records,) = script.tool_results(1)
    assert records["is_error"] is False and '"records"' in records["content"]
    ctx = context(script.requests[0])
    assert ctx["bench_id"] == run.bench_id and ctx["best_objective"] == best
    assert ctx["summary"]["output_tok_s_per_gpu"] == measured
    assert [t["name"] for t in script.requests[0]["tools"]] == [
        "get_records", "list_runs", "query_lessons", SUBMIT]
    assert analyst.usage.turns == 3 and analyst.usage.retries == 1


def test_check_verdict_rules(study):
    def summary(obj: float, completed: int = 10, errors: int = 0) -> Any:
        return SimpleNamespace(output_tok_s_per_gpu=obj, completed=completed, errors=errors)

    def v(status: str, obj: float | None) -> Verdict:
        return Verdict(status=status, objective=obj, reason="r")  # type: ignore[arg-type]

    assert check_verdict(v("keep", 100.0), summary(100.0), 90.0, False) is None
    assert check_verdict(v("discard", 100.0), summary(100.0), 90.0, False) is None
    assert "more than the best" in str(check_verdict(v("keep", 100.0), summary(100.0), 120.0,
                                                     False))
    assert "errors cannot be kept" in str(check_verdict(v("keep", 100.0),
                                                        summary(100.0, errors=3), 90.0, False))
    assert "status must be baseline" in str(check_verdict(v("keep", 100.0), summary(100.0),
                                                          None, True))
    assert "no crash" in str(check_verdict(v("crash", None), summary(100.0), None, False))
    assert check_verdict(v("crash", None), summary(0.0, completed=0), None, False) is None
    assert check_verdict(v("baseline", 100.3), summary(100.0), None, True) is None  # 0.3 %
    assert "measured" in str(check_verdict(v("baseline", 101.0), summary(100.0), None, True))


# -- the graph: an agent that fails twice marks its trial failed; the study goes on ---------

async def test_analyst_invalid_twice_marks_the_trial_failed_and_the_study_goes_on(
        study, store, tmp_path):
    state = State(malformed_once=False, fail_after=None, log=None)
    broken = "kv_cache_dtype=fp8_e4m3"

    def handler(request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content)
        reply, _ = answer(body, state)
        task = body["messages"][0]["content"]
        if task.startswith("JUDGE") and f'"changed":"{broken}"' in task:
            for block in reply["content"]:  # every verdict on this candidate is off by 2x
                if block["type"] == "tool_use" and block["name"] == SUBMIT:
                    block["input"] = {**block["input"],
                                      "objective": 2 * (block["input"]["objective"] or 1)}
        return httpx2.Response(200, json=reply)

    client = stub_client(handler)
    trace = Path(study.replay.trace)
    out = await run_study(study, "cb1", tmp_path / "run", store, [trace.parent], research=False,
                          claude=ClaudeSetup(client=client, model="claude-test"))
    assert_no_contradicted(tmp_path / "run", store)
    trials = search_trials(tmp_path / "run")
    failed = next(t for t in trials if t.changed == broken)
    assert failed.status == "failed" and failed.objective is None
    assert failed.reason.startswith("analyst: invalid agent output after one corrective retry:")
    assert "objective must be the measured output tok/s/GPU" in failed.reason
    assert failed.saturation is not None  # the measurement is kept
    assert failed.llm_usage["analyst"]["retries"] == 1
    assert failed.llm_usage["analyst"]["turns"] == 2
    assert {"planner", "deployer"} <= set(failed.llm_usage)
    launched = [t for t in trials if t.status != "pruned"]
    assert launched[0].status == "baseline" and len(launched) > 2  # the search went on
    assert all(t.llm_usage.get("deployer", {}).get("turns") for t in launched)
    assert out.winner_seq is not None


async def test_planner_modify_after_research_launches_the_alternative(study, store, tmp_path):
    from fixtures.research_tree import build_tree

    from mcp_servers.source.tree import SourceTree

    state = State(malformed_once=False, fail_after=None, log=None)
    decisions: list[dict[str, Any]] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content)
        reply, _ = answer(body, state)
        task = body["messages"][0]["content"]
        if task.startswith("RESEARCH DECISION"):
            ctx = json.loads(re.search(r"<context>(.*)</context>", task, re.S).group(1))
            if ctx["candidate"] == "attention_backend=fa3":
                decision = {"decision": "modify", "modify_to": ctx["alternatives"][0],
                            "reason": "fa3 is Hopper-only; try the next candidate instead",
                            "evidence": ["sglang/srt/arg_groups/attention_hook.py:1"],
                            "refused_on_this_gpu": True}
                decisions.append({"alternatives": ctx["alternatives"], **decision})
                reply["content"] = [{"type": "tool_use", "id": f"toolu_m{len(decisions)}",
                                     "name": SUBMIT, "input": decision}]
        return httpx2.Response(200, json=reply)

    client = stub_client(handler)
    tree = SourceTree(build_tree(tmp_path))
    trace = Path(study.replay.trace)
    await run_study(study, "cb2", tmp_path / "run", store, [trace.parent], source_tree=tree,
                    claude=ClaudeSetup(client=client, model="claude-test"))
    assert_no_contradicted(tmp_path / "run", store)
    trials = search_trials(tmp_path / "run")
    assert decisions, "the planner was never asked about fa3"
    fa3 = next(t for t in trials if t.changed == "attention_backend=fa3")
    assert fa3.status == "pruned" and fa3.reason.startswith("research: fa3 is Hopper-only")
    target = decisions[0]["modify_to"]
    assert fa3.research_decision.startswith(f"modified to {target}:")
    assert {o["question"]["kind"] for o in fa3.research} == {"source", "memory"}
    a, b = fa3.research  # the two Claude research branches ran at the same time
    assert a["started_s"] < b["finished_s"] and b["started_s"] < a["finished_s"]
    assert all(o["usage"]["turns"] >= 1 for o in fa3.research)
    assert fa3.lessons_written and fa3.lessons_written[0].source == "research"
    launched = next(t for t in trials if t.seq == fa3.seq + 1)
    assert launched.changed == target and launched.status != "pruned"
    assert launched.research_decision == (
        "launched instead of attention_backend=fa3 (research: fa3 is Hopper-only; try the "
        "next candidate instead)")
    # the lesson keeps fa3 out of the rest of the run: it is never launched
    assert all(t.status == "pruned" for t in trials if t.changed == "attention_backend=fa3")


async def test_an_invalid_run_is_never_scored_by_either_analyst(study, store, tmp_path):
    from agents.analyst import Analyst
    from domain.bench import BenchResult
    from domain.metrics import MetricsSummary

    backend = TwinBackend("servetune")
    service = BenchService(backend, tmp_path / "records", [tmp_path])
    async with Client(cluster_server(backend)) as cluster, \
            Client(bench_server(service)) as bench, Client(lessons_server(store)) as lessons:
        await cluster.call_tool("deploy", {"name": "trial-a",
                                           "config": study.base_config().model_dump(mode="json")})
        run = await Analyst(bench, study).saturation("trial-a", duration_s=5)
        assert run.valid and isinstance(run.summary, MetricsSummary)
        bad = BenchResult.model_validate({**run.model_dump(), "valid": False,
                                          "invalid_reason": "12% of requests failed (> 5%)"})
        script = Scripted([])  # a model must not even be asked
        claude = ClaudeAnalyst(bench, lessons, study, ClaudeSetup(client=script.client()))
        for analyst in (Analyst(bench, study), claude):
            v = await analyst.verdict(bad, None, True, study.base_config(), "")
            assert (v.status, v.objective) == ("discard", None)
            assert v.reason == "invalid run, not scored: 12% of requests failed (> 5%)"
    assert not script.requests
