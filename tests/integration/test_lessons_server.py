"""The servetune-lessons MCP server: ops, tools in memory through mcp.Client, one stdio trip."""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import pytest
import yaml
from mcp import Client, StdioServerParameters

from domain.lesson import Clause, Lesson, Scope
from domain.provenance import Provenance
from mcp_servers.lessons import ops
from mcp_servers.lessons.server import build_server
from memory.store import LessonStore

pytestmark = pytest.mark.anyio
REPO_ROOT = Path(__file__).resolve().parents[2]



def lesson(title: str, gpu: str | None, field: str, op: str, value: object, outcome: str,
           **extra: object) -> Lesson:
    return Lesson(title=title, scope=Scope(gpu=gpu, model="glm-5"),
                  condition=[Clause(field=field, op=op, value=value)], outcome=outcome,
                  root_cause=f"cause of {title}", fix=f"fix for {title}",
                  evidence=f"log of {title}",
                  **({"provenance": Provenance(backend="local")} | extra))


OOM = lesson("FP8 weights do not fit on 4 B200 GPUs: CUDA out of memory at weight load", "B200",
             "tp_size", "le", 4, "oom", failure_class="OOM_WEIGHTS")
FA3 = lesson("fa3 attention backend refused on B200 (Blackwell, SM100)", "B200",
             "attention_backend", "eq", "fa3", "unsupported")
KV = lesson("kv cache fp8 doubles batch", None, "kv_cache_dtype", "eq", "fp8_e4m3", "improvement")

CONFIG = {"model": "glm-5", "gpu": "B200", "weights": "fp8", "tp_size": 4}


@pytest.fixture
def store(tmp_path):
    s = LessonStore(tmp_path / "lessons", embedding="hashing")
    s.add_many([OOM, FA3, KV])
    try:
        yield s
    finally:
        s.close()


# -- ops (no protocol) --------------------------------------------------------------------------

def test_ops_paging_and_errors(store):
    page = ops.list_lessons(store, max_items=2)
    assert ([x.title for x in page.items], page.total, page.next_start) == (
        [OOM.title, FA3.title], 3, 2)
    last = ops.list_lessons(store, start=2, max_items=2)
    assert ([x.title for x in last.items], last.next_start) == ([KV.title], None)
    assert ops.list_lessons(store, start=9).items == []
    with pytest.raises(ValueError, match="max_items >= 1"):
        ops.list_lessons(store, max_items=0)
    with pytest.raises(ValueError, match="text is empty"):
        ops.query_lessons(store, "  ")


def test_ops_add_recomputes_id_and_stamps_run(store):
    bogus = lesson("tp 3 crashes", None, "tp_size", "eq", 3, "crash").model_copy(
        update={"id": "my-own-id"})
    first = ops.add_lesson(store, bogus, run_id="run-7")
    assert first.created and first.lesson.id == bogus.model_copy(update={"id": ""}).with_id().id
    assert first.lesson.run_id == "run-7"
    second = ops.add_lesson(store, bogus, run_id="run-8")
    assert not second.created and second.lesson.run_id == "run-7"
    assert store.count() == 4 and store.get("my-own-id") is None


# -- tools in memory ----------------------------------------------------------------------------

async def test_tools_are_listed_with_descriptions_and_annotations(store):
    async with Client(build_server(store)) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
    hints = {"query_lessons": True, "list_lessons": True, "add_lesson": False,
             "check_config": True, "export_skill": True, "check_command": True,
             "show_lesson": True, "quarantine_lesson": False, "report_served": False,
             "diagnose_log": True}
    assert set(tools) == set(hints)  # retract/restore: only with the operator flag
    assert {n: t.annotations.read_only_hint for n, t in tools.items()} == hints
    assert tools["add_lesson"].annotations.idempotent_hint is True
    assert tools["add_lesson"].annotations.destructive_hint is False
    assert tools["query_lessons"].description.startswith("Search lessons by meaning")
    props = tools["query_lessons"].input_schema["properties"]
    assert props["k"]["description"] == "at most this many hits"
    assert (props["k"]["minimum"], props["k"]["maximum"]) == (1, 50)
    assert "store" not in tools["query_lessons"].input_schema["properties"]
    assert list(tools["check_config"].input_schema["properties"]) == ["config", "on"]
    assert tools["quarantine_lesson"].input_schema["required"] == ["lesson_id", "reason"]


async def test_query_lessons_tool(store):
    async with Client(build_server(store)) as client:
        r = await client.call_tool("query_lessons", {"text": "fa3 on B200", "k": 2})
        assert not r.is_error
        hits = r.structured_content["hits"]
        assert [h["lesson"]["title"] for h in hits][0] == FA3.title and len(hits) == 2
        assert 0.0 < hits[1]["score"] < hits[0]["score"] <= 1.0
        r = await client.call_tool("query_lessons", {"text": "fp8 out of memory", "gpu": "H200"})
        assert [h["lesson"]["title"] for h in r.structured_content["hits"]] == [KV.title]


async def test_list_lessons_tool_pages(store):
    async with Client(build_server(store)) as client:
        first = await client.call_tool("list_lessons", {"max_items": 2})
        page = first.structured_content
        assert [x["title"] for x in page["items"]] == [OOM.title, FA3.title]
        assert (page["total"], page["next_start"]) == (3, 2)
        nxt = {"max_items": 2, "start": page["next_start"]}
        rest = (await client.call_tool("list_lessons", nxt)).structured_content
        assert [x["title"] for x in rest["items"]] == [KV.title]
        assert rest["next_start"] is None
        only_oom = (await client.call_tool("list_lessons", {"outcome": "oom"})).structured_content
        assert [x["id"] for x in only_oom["items"]] == [OOM.with_id().id]


async def test_add_lesson_tool_is_idempotent(store):
    new = lesson("tp 3 crashes", None, "tp_size", "eq", 3, "crash")
    payload = {"lesson": new.model_dump(mode="json")}
    async with Client(build_server(store, run_id="run-42")) as client:
        first = await client.call_tool("add_lesson", payload)
        second = await client.call_tool("add_lesson", payload)
    assert not first.is_error and not second.is_error
    assert first.structured_content["created"] is True
    assert second.structured_content["created"] is False
    assert first.structured_content["lesson"] == second.structured_content["lesson"]
    assert first.structured_content["lesson"]["id"] == new.with_id().id
    assert first.structured_content["lesson"]["run_id"] == "run-42"
    assert store.count() == 4


async def test_check_config_tool(store):
    async with Client(build_server(store)) as client:
        bad = (await client.call_tool("check_config", {"config": CONFIG | {
            "attention_backend": "fa3"}})).structured_content
        good = (await client.call_tool("check_config", {"config": CONFIG | {
            "gpu": "H200"}})).structured_content
    assert bad["allowed"] is False
    assert [(f["id"], f["condition"], f["outcome"]) for f in bad["forbidding"]] == [
        (OOM.with_id().id, "tp_size <= 4", "oom"),
        (FA3.with_id().id, "attention_backend == 'fa3'", "unsupported")]
    assert bad["forbidding"][0]["title"] == OOM.title
    assert bad["forbidding"][0]["fix"] == OOM.fix
    assert good == {"allowed": True, "config_id": good["config_id"], "forbidding": []}
    assert len(good["config_id"]) == 12


@pytest.mark.parametrize(("tool", "args", "message"), [
    pytest.param("query_lessons", {"text": "oom", "k": "many"}, "k\n  Input should be a valid "
                 "integer", id="k-not-int"),
    pytest.param("query_lessons", {"text": "oom", "k": 0}, "greater than or equal to 1",
                 id="k-zero"),
    pytest.param("query_lessons", {"text": "   "}, "text is empty: describe the failure",
                 id="blank-text"),
    pytest.param("list_lessons", {"gpu": "--all"}, "gpu\n  String should match pattern",
                 id="gpu-option-like"),
    pytest.param("list_lessons", {"outcome": "boom"}, "outcome\n  Input should be 'oom'",
                 id="unknown-outcome"),
    pytest.param("check_config", {"config": CONFIG | {"tp_size": 0}},
                 "config.tp_size\n  Input should be greater than or equal to 1", id="tp-zero"),
    pytest.param("check_config", {"config": CONFIG | {"attention_backend": "fa9"}},
                 "attention_backend 'fa9' is not a choice", id="unknown-backend"),
    pytest.param("add_lesson", {"lesson": {"title": "no scope"}}, "lesson.scope\n  Field required",
                 id="lesson-missing-fields"),
    pytest.param("add_lesson", {"lesson": {**OOM.model_dump(mode="json"),
                                           "root_cause": "x" * 6000}},
                 "lesson.root_cause\n  String should have at most 5000 characters",
                 id="lesson-huge-root-cause"),
    pytest.param("export_skill", {"name": "../../etc"}, "name\n  String should match pattern",
                 id="skill-name-path"),
    pytest.param("list_lessons", {"gpu": "B200", "namespace": "prod"},
                 "list_lessons has no argument 'namespace'", id="invented-argument"),
])
async def test_invalid_arguments_are_readable_tool_errors(store, tool, args, message):
    async with Client(build_server(store)) as client:
        r = await client.call_tool(tool, args)
    assert r.is_error
    assert r.structured_content is None
    text = r.content[0].text
    assert text.startswith(f"Error executing tool {tool}: ")
    assert message in text
    assert store.count() == 3


async def test_export_skill_tool_renders_rules_then_notes(store):
    async with Client(build_server(store)) as client:
        r = await client.call_tool("export_skill", {"gpu": "B200"})
        empty = await client.call_tool("export_skill", {"name": "h200-only", "gpu": "H100",
                                                        "model": "llama-3.1-8b"})
    assert not r.is_error
    skill = r.structured_content
    assert skill["path"] == ".claude/skills/servetune-lessons/SKILL.md"
    assert skill["lesson_count"] == 3
    text = skill["content"]
    head, body = text.split("---\n")[1], text.split("---\n", 2)[2]
    front = yaml.safe_load(head)
    assert front["name"] == "servetune-lessons"
    assert "GPU B200" in front["description"] and len(front["description"]) <= 1024
    rules, notes = body.split("## Notes")
    assert OOM.with_id().id in rules and "fails when: `tp_size <= 4`" in rules
    assert "attention_backend == 'fa3'" in rules
    assert KV.title in notes and KV.title not in rules
    assert store.count() == 3  # nothing written
    assert empty.structured_content["lesson_count"] == 0
    # a lesson text with newlines cannot start new markdown (or frontmatter) in the skill
    store.add(lesson("two\nlines\n---\nname: evil", "B200", "tp_size", "eq", 2, "crash"))
    async with Client(build_server(store)) as client:
        text = (await client.call_tool("export_skill", {})).structured_content["content"]
    assert "**two lines --- name: evil**" in text and "\nname: evil" not in text
    assert "No lessons are stored yet" in empty.structured_content["content"]


# -- stdio --------------------------------------------------------------------------------------

async def test_stdio_round_trip(tmp_path):
    path = tmp_path / "stdio-store"
    with LessonStore(path, embedding="hashing") as s:
        s.add_many([OOM, KV])
    params = StdioServerParameters(
        command=sys.executable, cwd=str(REPO_ROOT),
        args=["-c", f"from mcp_servers.lessons.server import main; main({str(path)!r})"])
    with anyio.fail_after(60):
        async with Client(params) as client:
            names = sorted(t.name for t in (await client.list_tools()).tools)
            r = await client.call_tool("list_lessons", {"gpu": "H200"})
    assert names == ["add_lesson", "check_command", "check_config", "diagnose_log",
                     "export_skill", "list_lessons", "quarantine_lesson", "query_lessons",
                     "report_served", "show_lesson"]
    assert not r.is_error
    assert [x["title"] for x in r.structured_content["items"]] == [KV.title]
    assert r.structured_content["next_start"] is None
