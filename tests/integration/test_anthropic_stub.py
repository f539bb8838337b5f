"""The Messages API stand-in (``tests/fixtures/anthropic_stub.py``) through the real anthropic SDK
over real HTTP on 127.0.0.1: role detection, offered tools only, ``--malformed-once``, 401s, and
one servetune agent (the deployer over the twin) run against it end to end.

``running_stub`` starts the stub as a subprocess (bound port read from its ``--port-file``) and
stops it by its PID (``tests/fixtures/anthropic_process.py``, shared with the Claude-study tests).
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest
from fixtures.anthropic_process import log_lines, running_stub
from mcp import Client

from agents.analyst import Verdict
from agents.claude import RULES, SUBMIT_TOOL, ClaudeAgent, load_prompt
from agents.deployer import DeployOutcome
from agents.outputs import PlanChoice, ResearchDecision, ResearchFindings
from mcp_servers.cluster.server import build_server as cluster_server
from mcp_servers.cluster.twin import TwinBackend

pytestmark = pytest.mark.anyio
MODEL = "claude-stub-test"


@pytest.fixture
def stub_log(tmp_path):
    return tmp_path / "stub.jsonl"


@pytest.fixture
def stub(tmp_path, stub_log):
    with running_stub(tmp_path, log=stub_log) as url:
        yield url


def client(url: str, key: str = "test") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(api_key=key, base_url=url, max_retries=0)


def system(role: str) -> list[dict[str, Any]]:
    text = load_prompt(role) + "\n\n" + RULES.format(submit=SUBMIT_TOOL, tool_calls=20)
    return [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]


def spec(name: str, **props: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "description": name,
            "input_schema": {"type": "object", "properties": props}}


def submit(model: type) -> dict[str, Any]:
    return {"name": SUBMIT_TOOL, "description": "submit",
            "input_schema": model.model_json_schema()}


def ctx(data: dict[str, Any]) -> str:
    return f"<context>{json.dumps(data, separators=(',', ':'))}</context>"


async def create(url: str, role: str, messages: list[dict[str, Any]],
                 tools: list[dict[str, Any]], key: str = "test") -> Any:
    async with client(url, key) as c:
        return await c.messages.create(model=MODEL, max_tokens=1024, system=system(role),
                                       messages=messages, tools=tools)


def uses(resp: Any) -> list[Any]:
    return [b for b in resp.content if b.type == "tool_use"]


def after(messages: list[dict[str, Any]], resp: Any, result: str, *,
          is_error: bool = False) -> list[dict[str, Any]]:
    """``messages`` + the assistant turn ``resp`` + a tool_result for its tool_use."""
    (use,) = uses(resp)
    return [*messages,
            {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                              for b in resp.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "is_error": is_error, "content": result}]}]


def wrapped(tool: str, data: Any) -> str:
    return f'<tool_output tool="{tool}">\n{json.dumps(data, separators=(",", ":"))}\n</tool_output>'


PLAN = {"best": {"model": "glm-5", "gpu": "B200", "tp_size": 8, "weights": "nvfp4"},
        "candidates": [{"candidate": "kv_cache_dtype=fp8_e4m3", "predicted": {}},
                       {"candidate": "tp_size=4", "predicted": {}}],
        "history": [], "objective": "output_tok_s_per_gpu"}
PLANNER_TOOLS = [spec("check_config", config={"type": "object"}),
                 spec("query_lessons", text={"type": "string"}), submit(PlanChoice)]


# -- role detection and the policies -------------------------------------------------------------

async def test_planner_plan_step_launches_the_first_candidate_as_a_messages_api_reply(
        stub, stub_log):
    task = "PLAN STEP: pick the next trial.\n" + ctx(PLAN)
    resp = await create(stub, "planner", [{"role": "user", "content": task}], PLANNER_TOOLS)
    assert resp.type == "message" and resp.role == "assistant" and resp.model == MODEL
    assert resp.stop_reason == "tool_use" and resp.id.startswith("msg_")
    (use,) = uses(resp)
    assert use.name == SUBMIT_TOOL
    choice = PlanChoice.model_validate(use.input)
    assert (choice.action, choice.candidate) == ("launch", "kv_cache_dtype=fp8_e4m3")
    assert resp.usage.input_tokens > 100 and resp.usage.output_tokens > 0
    (entry,) = log_lines(stub_log)
    assert entry == {"status": 200, "role": "planner", "kind": "PLAN STEP", "turn": 1,
                     "tools": [SUBMIT_TOOL], "malformed": False,
                     "input_tokens": resp.usage.input_tokens,
                     "output_tokens": resp.usage.output_tokens}
    stop = await create(stub, "planner", [{"role": "user", "content": "PLAN STEP\n" + ctx(
        {**PLAN, "candidates": []})}], PLANNER_TOOLS)
    assert PlanChoice.model_validate(uses(stop)[0].input).action == "stop"


@pytest.mark.parametrize("sm, decision", [(100, "drop"), (90, "keep")])
async def test_planner_research_decision_drops_on_an_sm_bound_that_excludes_the_gpu(
        stub, sm, decision):
    claim = {"text": "raise in init: FlashAttention v3 Backend requires SM>=80 and SM<=90",
             "evidence": ["sglang/srt/arg_groups/attention_hook.py:12"]}
    research = [{"question": {"id": "q", "kind": "source", "question": "fa3?"},
                 "status": "answered", "started_s": 0, "finished_s": 1,
                 "findings": {"question": "fa3?", "answer": "a",
                              "claims": [{"text": "declared", "evidence": ["a.py:1"]}, claim]}}]
    task = "RESEARCH DECISION\n" + ctx({"candidate": "attention_backend=fa3", "config": {},
                                        "gpu": "B200", "sm": sm, "research": research,
                                        "alternatives": []})
    resp = await create(stub, "planner", [{"role": "user", "content": task}],
                        [submit(ResearchDecision)])
    d = ResearchDecision.model_validate(uses(resp)[0].input)
    assert d.decision == decision
    if decision == "drop":
        assert d.evidence == ["sglang/srt/arg_groups/attention_hook.py:12"]
        assert d.refused_on_this_gpu and "SM 100" in d.reason
    else:
        assert d.evidence == [] and not d.refused_on_this_gpu


SUMMARY = {"requests": 10, "completed": 10, "errors": 0, "output_tok_s_per_gpu": 1100.0}


@pytest.mark.parametrize("over, status, objective", [
    ({"is_baseline": True}, "baseline", 1100.0),
    ({"best_objective": 1000.0}, "keep", 1100.0),
    ({"best_objective": 1050.0}, "discard", 1100.0),
    ({"best_objective": 1000.0, "summary": {**SUMMARY, "errors": 2}}, "discard", 1100.0),
    ({"summary": {**SUMMARY, "completed": 0, "errors": 10}}, "crash", None),
])
async def test_analyst_judges_like_the_deterministic_analyst(stub, over, status, objective):
    c = {"config": {}, "changed": "tp_size=4", "is_baseline": False, "best_objective": None,
         "min_improvement": 0.05, "summary": SUMMARY, "bench_id": "b1", **over}
    tools = [spec("get_records", bench_id={"type": "string"}), submit(Verdict)]
    resp = await create(stub, "analyst", [{"role": "user", "content": "JUDGE\n" + ctx(c)}],
                        tools)
    v = Verdict.model_validate(uses(resp)[0].input)
    assert (v.status, v.objective) == (status, objective)


async def test_deployer_polls_then_classifies_the_failed_startup_log(stub):
    tools = [spec("deploy", wait_s={"type": "number"}), spec("get_status"),
             spec("get_logs", tail={"type": "integer"}, since_s={"type": "number"}),
             submit(DeployOutcome)]
    msgs = [{"role": "user", "content": "DEPLOY\n" + ctx({"name": "trial-007", "config": {}})}]
    r = await create(stub, "deployer", msgs, tools)
    assert [(u.name, u.input) for u in uses(r)] == [("deploy", {})]
    msgs = after(msgs, r, wrapped("deploy", {"phase": "Pending", "startup_s": 0}))
    r = await create(stub, "deployer", msgs, tools)
    assert [(u.name, u.input) for u in uses(r)] == [("get_status", {})]
    msgs = after(msgs, r, wrapped("get_status", {"phase": "Failed", "failed_stage": "init",
                                                 "startup_s": 3.0}))
    r = await create(stub, "deployer", msgs, tools)
    assert [(u.name, u.input) for u in uses(r)] == [("get_logs", {"tail": 40})]
    line = "ValueError: FlashAttention v3 Backend requires SM>=80 and SM<=90"
    msgs = after(msgs, r, wrapped("get_logs", {"lines": ["loading", line, "exit 1"]}))
    r = await create(stub, "deployer", msgs, tools)
    out = DeployOutcome.model_validate(uses(r)[0].input)
    assert (out.name, out.ready, out.failure_class, out.evidence, out.stage) == (
        "trial-007", False, "UNSUPPORTED_BACKEND", line, "init")


async def test_researchers_cite_path_line_or_lesson_ids(stub):
    task = ("Question: What does --attention-backend fa3 change?\n"
            "Flag: --attention-backend (dest attention_backend)\nValue the candidate sets: fa3\n"
            "Tool budget: 8 calls. Answer this one question; cite file:line or lesson ids.")
    tools = [spec("get_flag", flag={"type": "string"}),
             spec("constraints", flag={"type": "string"}, max_items={"type": "integer"}),
             submit(ResearchFindings)]
    msgs = [{"role": "user", "content": task}]
    r = await create(stub, "source_researcher", msgs, tools)
    assert [(u.name, u.input) for u in uses(r)] == [("get_flag", {"flag": "attention_backend"})]
    msgs = after(msgs, r, wrapped("get_flag", {"dest": "attention_backend", "entries": [
        {"type": "str", "default": None, "source": "sglang/srt/fields/kernel.py:7"}]}))
    r = await create(stub, "source_researcher", msgs, tools)
    assert uses(r)[0].name == "constraints"
    check = {"path": "sglang/srt/hook.py", "line": 12, "kind": "raise", "function": "init",
             "condition": "not is_sm90_or_lower()",
             "message": "FlashAttention v3 Backend requires SM>=80 and SM<=90"}
    msgs = after(msgs, r, wrapped("constraints", {"items": [check]}))
    r = await create(stub, "source_researcher", msgs, tools)
    found = ResearchFindings.model_validate(uses(r)[0].input)
    assert found.question == "What does --attention-backend fa3 change?"
    assert [c.evidence for c in found.claims] == [["sglang/srt/fields/kernel.py:7"],
                                                  ["sglang/srt/hook.py:12"]]
    assert "SM>=80 and SM<=90" in found.claims[1].text

    # without a source tree the tool fails: the error is unresolved, the tool name cited
    msgs = [{"role": "user", "content": task}]
    r = await create(stub, "source_researcher", msgs, tools)
    msgs = after(msgs, r, "no SGLang source: run `servetune source fetch`", is_error=True)
    r = await create(stub, "source_researcher", msgs, tools)
    found = ResearchFindings.model_validate(uses(r)[0].input)
    assert found.claims[0].evidence == ["get_flag"]
    assert "servetune source fetch" in found.unresolved[0]

    mem_tools = [spec("query_lessons", text={"type": "string"}, k={"type": "integer"}),
                 submit(ResearchFindings)]
    msgs = [{"role": "user", "content": "Question: what do lessons say about fa3 on B200?"}]
    query = await create(stub, "memory_researcher", msgs, mem_tools)
    assert [(u.name, u.input) for u in uses(query)] == [
        ("query_lessons", {"text": "what do lessons say about fa3 on B200?"})]
    hit = {"score": 0.8, "lesson": {"id": "L-abc123", "title": "fa3 refused on B200",
                                    "outcome": "unsupported", "fix": "leave it unset"}}
    r = await create(stub, "memory_researcher", after(msgs, query, wrapped(
        "query_lessons", {"query": "q", "hits": [hit]})), mem_tools)
    found = ResearchFindings.model_validate(uses(r)[0].input)
    assert [c.evidence for c in found.claims] == [["L-abc123"]]
    r = await create(stub, "memory_researcher", after(msgs, query, wrapped(
        "query_lessons", {"query": "q", "hits": []})), mem_tools)
    assert ResearchFindings.model_validate(uses(r)[0].input).claims == []


async def test_unknown_role_is_a_400(stub):
    async with client(stub) as c:
        with pytest.raises(anthropic.BadRequestError, match="no servetune role"):
            await c.messages.create(model=MODEL, max_tokens=10, system="You are a poet.",
                                    messages=[{"role": "user", "content": "hi"}],
                                    tools=[submit(Verdict)])


# -- only what the request offers ---------------------------------------------------------------

async def test_only_offered_tools_and_argument_names_are_used(stub):
    # a deployer offered no get_logs, and tools without the optional arguments
    tools = [spec("cluster__deploy"), spec("get_status"), submit(DeployOutcome)]
    msgs = [{"role": "user", "content": "DEPLOY\n" + ctx({"name": "t1", "config": {}})}]
    r = await create(stub, "deployer", msgs, tools)
    assert [(u.name, u.input) for u in uses(r)] == [("cluster__deploy", {})]
    msgs = after(msgs, r, wrapped("cluster__deploy", {"phase": "Failed"}))
    r = await create(stub, "deployer", msgs, tools)
    (use,) = uses(r)
    assert use.name == SUBMIT_TOOL and use.input["failure_class"] == "UNKNOWN"
    # a get_logs without a tail argument is called with no arguments
    tools = [spec("deploy"), spec("get_logs", since_s={"type": "number"}),
             submit(DeployOutcome)]
    msgs = [{"role": "user", "content": "DEPLOY\n" + ctx({"name": "t1", "config": {}})}]
    r = await create(stub, "deployer", msgs, tools)
    r = await create(stub, "deployer", after(msgs, r, wrapped("deploy", {"phase": "Failed"})),
                     tools)
    assert [(u.name, u.input) for u in uses(r)] == [("get_logs", {})]
    # a researcher offered no tool submits at once; submit carries only schema properties
    task = "Question: q\nFlag: --tp-size (dest tp_size)\nTool budget: 8 calls."
    r = await create(stub, "source_researcher", [{"role": "user", "content": task}],
                     [submit(ResearchFindings)])
    (use,) = uses(r)
    assert use.name == SUBMIT_TOOL
    assert set(use.input) <= set(ResearchFindings.model_json_schema()["properties"])


# -- --malformed-once and 401 -------------------------------------------------------------------

async def test_malformed_once_per_role_then_valid_after_the_error(tmp_path, stub_log):
    with running_stub(tmp_path, "--malformed-once", log=stub_log) as url:
        msgs = [{"role": "user", "content": "PLAN STEP\n" + ctx(PLAN)}]
        r = await create(url, "planner", msgs, PLANNER_TOOLS)
        (use,) = uses(r)
        assert use.name == SUBMIT_TOOL and "action" not in use.input  # a required field
        msgs = after(msgs, r, "submit_result was rejected: action: Field required",
                     is_error=True)
        r = await create(url, "planner", msgs, PLANNER_TOOLS)
        assert PlanChoice.model_validate(uses(r)[0].input).action == "launch"
        # once per role and task kind: the next plan step is valid at once
        r = await create(url, "planner", msgs[:1], PLANNER_TOOLS)
        assert PlanChoice.model_validate(uses(r)[0].input).action == "launch"
        # the analyst's first submit is malformed in its turn
        c = {"is_baseline": True, "best_objective": None, "min_improvement": 0.05,
             "summary": SUMMARY}
        r = await create(url, "analyst", [{"role": "user", "content": "JUDGE\n" + ctx(c)}],
                         [submit(Verdict)])
        assert "status" not in uses(r)[0].input
    assert [e["malformed"] for e in log_lines(stub_log)] == [True, False, False, True]


async def test_401_without_a_key_and_with_always_401(tmp_path, stub, stub_log):
    body = {"model": MODEL, "max_tokens": 10, "system": system("planner"),
            "messages": [{"role": "user", "content": "PLAN STEP\n" + ctx(PLAN)}],
            "tools": PLANNER_TOOLS}
    # the API's header is x-api-key; anthropic 2.x sends the key as a Bearer token instead
    for headers in ({}, {"Authorization": "Basic k"}, {"x-api-key": ""}):
        r = httpx.post(stub + "/v1/messages", json=body, headers=headers, trust_env=False)
        assert r.status_code == 401, headers
        assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "invalid x-api-key"}}
    for headers in ({"x-api-key": "k"}, {"Authorization": "Bearer k"}):
        r = httpx.post(stub + "/v1/messages", json=body, headers=headers, trust_env=False)
        assert r.status_code == 200, headers
    with running_stub(tmp_path, "--always-401", log=stub_log) as url:
        with pytest.raises(anthropic.AuthenticationError) as e:
            await create(url, "planner", body["messages"], PLANNER_TOOLS,
                         key="sk-ant-real-looking-key")
    assert e.value.status_code == 401
    assert [x["status"] for x in log_lines(stub_log)] == [401, 401, 401, 200, 200, 401]
    assert "sk-ant" not in stub_log.read_text()  # no header value is logged


# -- a servetune agent end to end against the stub ----------------------------------------------

@pytest.mark.parametrize("flags, retries", [((), 0), (("--malformed-once",), 1)])
async def test_claude_deployer_on_the_twin_against_the_stub(tmp_path, flags, retries):
    backend = TwinBackend("servetune")
    allowed = {"cluster": ["deploy", "get_status", "get_logs", "list_deployments", "tear_down"]}
    config = {"model": "glm-5", "gpu": "B200", "tp_size": 8, "weights": "nvfp4",
              "attention_backend": "fa3"}
    hidden = {"cluster": {t: {"namespace": "servetune"} for t in allowed["cluster"]}}
    hidden["cluster"]["deploy"] = {"namespace": "servetune", "name": "trial-003",
                                   "config": config}
    for t in ("get_status", "get_logs", "tear_down"):
        hidden["cluster"][t] = {"namespace": "servetune", "name": "trial-003"}
    with running_stub(tmp_path, *flags) as url:
        async with Client(cluster_server(backend)) as cluster, client(url) as api:
            agent = ClaudeAgent("deployer", api, {"cluster": cluster}, allowed,
                                DeployOutcome, model=MODEL, fixed_args=hidden)
            out, usage = await agent.run("DEPLOY trial-003\n" + ctx({"name": "trial-003",
                                                                    "config": config}))
    assert (out.name, out.ready, out.failure_class) == ("trial-003", False,
                                                        "UNSUPPORTED_BACKEND")
    assert "SM>=80 and SM<=90" in out.evidence
    assert usage.retries == retries and usage.tool_calls == 2
    assert usage.turns == 3 + retries and usage.input_tokens > 0 and usage.output_tokens > 0
