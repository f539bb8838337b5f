"""Every tool of the four MCP servers under schema-violating and adversarial arguments, through the
in-memory MCP client: each call answers with a result or an error that says what is wrong, never a
hidden crash (the SDK's bare ``Error executing tool X``) nor a wrapped ``unexpected KeyError``.

Two layers: a deterministic sweep that puts every adversarial value into every argument of every
tool (one at a time, from a valid seed call), and hypothesis mutating nested fields, dropping
required arguments and adding unknown ones. Calls that once crashed are kept in tests/fuzz/mcp/.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio.from_thread
import pytest
from fixtures.fuzz_sources import build_tree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp import Client

from mcp_servers.bench.ops import BenchService
from mcp_servers.bench.server import build_server as bench_server
from mcp_servers.cluster.server import build_server as cluster_server
from mcp_servers.cluster.twin import TwinBackend
from mcp_servers.lessons.server import build_server as lessons_server
from mcp_servers.source.server import build_server as source_server
from mcp_servers.source.tree import SourceTree
from memory.store import LessonStore

TESTS = Path(__file__).resolve().parents[1]
CORPUS = TESTS / "fuzz" / "mcp"
CONFIG = {"model": "glm-5", "gpu": "B200", "tp_size": 8, "replicas": 1, "weights": "nvfp4",
          "kv_cache_dtype": "fp8_e4m3"}
LESSON = {"title": "fa3 refused on B200", "scope": {"gpu": "B200", "model": "glm-5"},
          "condition": [{"field": "attention_backend", "op": "eq", "value": "fa3"}],
          "outcome": "unsupported", "root_cause": "SM100 has no FA3 kernels",
          "fix": "use the default backend", "evidence": "FlashAttention v3 Backend requires SM>=80"}
FLAG = "--max-running-requests"
# A valid call of every tool: the sweep and hypothesis mutate these.
SEEDS: dict[str, dict[str, dict[str, Any]]] = {
    "cluster": {
        "deploy": {"name": "fz-1", "config": CONFIG, "wait_s": 0},
        "get_status": {"name": "d1"},
        "get_logs": {"name": "d1", "tail": 5},
        "get_events": {"name": "d1"},
        "tear_down": {"name": "fz-2"},
        "list_deployments": {},
    },
    "bench": {
        "run_saturation": {"isl": 64, "osl": 4, "concurrency": 2, "duration_s": 0.5,
                           "deployment": "d1"},
        "run_rate": {"isl": 64, "osl": 4, "request_rate": 4, "duration_s": 0.5,
                     "deployment": "d1"},
        "run_replay": {"trace": "ok_mooncake.jsonl", "start_s": 0, "duration_s": 5,
                       "deployment": "d1"},
        "run_sweep": {"isl": 64, "osl": 4, "concurrencies": [1, 2], "duration_s": 0.5,
                      "deployment": "d1"},
        "run_greedy": {"deployment": "d1", "max_tokens": 4},
        "get_records": {"bench_id": "nope", "max_items": 2},
        "list_runs": {"max_items": 2},
    },
    "lessons": {
        "query_lessons": {"text": "fa3 on B200", "k": 2, "gpu": "B200"},
        "list_lessons": {"gpu": "B200", "max_items": 2},
        "add_lesson": {"lesson": LESSON},
        "check_config": {"config": CONFIG},
        "export_skill": {"name": "fz-skill", "gpu": "B200"},
        "show_lesson": {"lesson_id": "L-0000000000"},
        "quarantine_lesson": {"lesson_id": "L-0000000000", "reason": "fuzzed"},
        "report_served": {"config": CONFIG, "on": "twin", "trial": "search:fz"},
        "check_command": {"command": ["sglang", "serve", "--model-path", "zai-org/GLM-5-FP8",
                                      "--tp-size", "8"], "gpu": "B200", "gpus": 8},
        "diagnose_log": {"log": "Capture cuda graph failed: CUDA out of memory.", "gpu": "B200",
                         "model": "glm-5"},
    },
    "source": {
        "source_info": {},
        "list_files": {"path": "sglang/srt", "glob": "*.py", "max_items": 5},
        "read_file": {"path": "sglang/srt/arg_groups/memory_hook.py", "max_lines": 5},
        "grep": {"pattern": "max_running", "path": "sglang", "max_hits": 5},
        "outline": {"path": "sglang/srt/arg_groups/memory_hook.py"},
        "list_flags": {"name_contains": "running", "max_items": 5},
        "get_flag": {"flag": FLAG},
        "where_used": {"flag": FLAG, "max_hits": 5},
        "constraints": {"flag": FLAG, "max_items": 5},
        "explain_default": {"flag": FLAG, "max_items": 5},
        "locate_message": {"message": "AssertionError: max_running_requests must be positive",
                           "max_sites": 2},
    },
}
ADVERSARIAL: list[Any] = [
    None, True, -1, 0, 2**63, -(2**63), 10**30, 1.5, 1e308, math.inf, math.nan, "", " ", "-rf",
    "--help", "../../../../etc/passwd", "/etc/passwd", "a\x00b", "x" * 5000, "\u202e", "**/*",
    "(a+)+$", "[", "{name}", "$(id)", [], [None], {}, {"a": {"b": []}}, "1e999",
    "sglang/srt/fifo.py", "sglang/srt/self_a.py", "sglang/srt/loop/loop/loop/crlf.py",
    "sglang/srt/escape_dir/passwd", "sglang/srt/binary.so", "sglang/srt/utf16.py",
]
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
UNEXPECTED = re.compile(r"\bunexpected [A-Z]\w*(Error|Exception)\b")


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """(portal, {server: client}) with the four servers running in memory for the module."""
    tmp = tmp_path_factory.mktemp("fuzz-mcp")
    backend = TwinBackend()
    store = LessonStore(tmp / "lessons", embedding="hashing")
    tree = SourceTree(build_tree(tmp / "src"))
    servers = {
        "cluster": cluster_server(backend),
        "bench": bench_server(BenchService(backend, tmp / "records",
                                           [TESTS / "fuzz" / "traces"], [])),
        "lessons": lessons_server(store, run_id="fuzz"),
        "source": source_server(tree),
    }
    try:
        with anyio.from_thread.start_blocking_portal() as portal, contextlib.ExitStack() as stack:
            opened = {k: stack.enter_context(portal.wrap_async_context_manager(Client(s)))
                      for k, s in servers.items()}
            r = portal.call(opened["cluster"].call_tool, "deploy",
                            {"name": "d1", "config": dict(CONFIG, tp_size=4, replicas=2)})
            assert not r.is_error, r.content
            yield portal, opened
    finally:
        store.close()


def call(clients: Any, server: str, tool: str, args: dict[str, Any]) -> str:
    """Call ``tool``; fail on a hidden crash; return the error text ("" on success)."""
    portal, opened = clients
    try:
        r = portal.call(opened[server].call_tool, tool, args)
    except Exception as e:  # a protocol-level failure: the call never got an answer
        pytest.fail(f"{server}.{tool}({_short(args)}) raised {type(e).__name__}: {e}")
    if not r.is_error:
        return ""
    text = " ".join(getattr(c, "text", "") for c in r.content)
    assert text.strip() != f"Error executing tool {tool}", (
        f"{server}.{tool} crashed (see the server log) on {_short(args)}")
    assert not UNEXPECTED.search(text), f"{server}.{tool}: {text[:300]} on {_short(args)}"
    return text


def _short(args: dict[str, Any]) -> str:
    return json.dumps(args, default=repr)[:300]


def test_seeds_cover_every_tool(clients: Any) -> None:
    portal, opened = clients
    for server, seeds in SEEDS.items():
        listed = portal.call(opened[server].list_tools).tools
        assert {t.name for t in listed} == set(seeds), server


@pytest.mark.parametrize("server", sorted(SEEDS))
def test_every_adversarial_value_in_every_argument(clients: Any, server: str) -> None:
    """The sweep: one argument replaced at a time; a refused value names its argument."""
    portal, opened = clients
    schemas = {t.name: t.input_schema for t in portal.call(opened[server].list_tools).tools}
    cases = 0
    for tool, seed in SEEDS[server].items():
        for arg in schemas[tool].get("properties", {}):
            for value in ADVERSARIAL:
                args = dict(seed, **{arg: copy.deepcopy(value)})
                if tool == "deploy":
                    args["name"] = f"fz-sweep-{cases}"
                text = call(clients, server, tool, args)
                if "validation error" in text:
                    assert arg in text, f"{tool}: the error does not name {arg!r}: {text[:300]}"
                cases += 1
        text = call(clients, server, tool, dict(seed, bogus_argument=1))
        assert "bogus_argument" in text and "its arguments are" in text, text
        for required in schemas[tool].get("required", []):
            args = {k: v for k, v in seed.items() if k != required}
            text = call(clients, server, tool, args)
            assert required in text and "Field required" in text, text
    assert cases > 50


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


values = st.recursive(
    st.one_of(st.sampled_from(ADVERSARIAL), st.none(), st.booleans(), st.integers(),
              st.floats(), st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=5).map(copy.deepcopy)  # ADVERSARIAL holds mutable values: never share them


@st.composite
def mutated_call(draw: st.DrawFn, server: str) -> tuple[str, dict[str, Any]]:
    tool = draw(st.sampled_from(sorted(SEEDS[server])))
    args = copy.deepcopy(SEEDS[server][tool])
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(args)
        op = draw(st.sampled_from(["replace", "replace", "drop", "add"]))
        if not paths or op == "add":
            args[draw(st.text(min_size=1, max_size=8))] = draw(values)
            continue
        path = draw(st.sampled_from(paths))
        parent: Any = args
        for k in path[:-1]:
            parent = parent[k]
        if op == "drop":
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(values)
    if tool == "deploy":
        args["name"] = draw(st.sampled_from(["fz-h", "d1", "fz-x"]))
    return tool, args


@pytest.mark.parametrize("server", sorted(SEEDS))
@FUZZ
@given(data=st.data())
def test_mutated_calls_answer_or_explain(clients: Any, server: str, data: st.DataObject) -> None:
    tool, args = data.draw(mutated_call(server))
    call(clients, server, tool, args)


@pytest.mark.parametrize("case", sorted(p.name for p in CORPUS.glob("*.json")), ids=str)
def test_mcp_corpus(clients: Any, case: str) -> None:
    c = json.loads((CORPUS / case).read_text())
    text = call(clients, c["server"], c["tool"], c["arguments"])
    assert c["error"] in text, text
