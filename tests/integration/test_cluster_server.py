"""The cluster MCP server on the twin backend: every tool through mcp.Client (in memory),
namespace confinement, flag injection, records shared over a state folder, a stdio round trip.

The local-process backend has its own tests in test_cluster_local.py.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from fixtures.configs import config
from mcp import Client, StdioServerParameters

from domain.config import ServingConfig
from domain.engines.sglang.failures import classify
from mcp_servers.cluster import ops
from mcp_servers.cluster.backend import (
    BackendError,
    make_backend,
    refuse_flag_values,
)
from mcp_servers.cluster.server import build_server as cluster_server
from mcp_servers.cluster.twin import TwinBackend

pytestmark = pytest.mark.anyio
REPO = Path(__file__).resolve().parents[2]
TOOLS = {"deploy", "get_status", "get_logs", "get_events", "tear_down", "list_deployments"}





async def test_cluster_tools_deploy_status_logs_events_teardown():
    backend = TwinBackend("team-a")
    async with Client(cluster_server(backend)) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
        assert set(tools) == TOOLS
        for name in ("get_status", "get_logs", "get_events", "list_deployments"):
            assert tools[name].annotations.read_only_hint is True, name
        assert tools["tear_down"].annotations.destructive_hint is True
        assert tools["tear_down"].annotations.idempotent_hint is True
        assert tools["deploy"].annotations.read_only_hint is False
        assert "namespace" in tools["deploy"].input_schema["properties"]
        t0 = time.time()
        r = await c.call_tool("deploy", {"name": "ok-1", "config": config()})
        assert not r.is_error, r.content
        st = r.structured_content
        assert (st["phase"], st["namespace"], st["ready_replicas"]) == ("Ready", "team-a", 1)
        assert st["labels"]["app.kubernetes.io/managed-by"] == "servetune"
        assert st["endpoints"] == [] and t0 <= st["created_at"] <= time.time()
        st = (await c.call_tool("get_status", {"name": "ok-1"})).structured_content
        assert st["phase"] == "Ready" and st["startup_s"] > 0
        page = (await c.call_tool("get_logs", {"name": "ok-1", "max_lines": 2})).structured_content
        assert page["lines"][0].startswith("server_args=--model-path nvidia/GLM-5-NVFP4")
        assert page["next_start"] == 2
        tail = (await c.call_tool("get_logs", {"name": "ok-1", "tail": 1})).structured_content
        assert tail["lines"] == ["The server is fired up and ready to roll!"]
        # twin lines are stamped with the creation time: all within the last hour
        hour = (await c.call_tool("get_logs", {"name": "ok-1", "since_s": 3600}))
        assert hour.structured_content["total_lines"] == len(backend.logs("ok-1")) > 2
        r = await c.call_tool("deploy", {"name": "fa3", "config": config(attention_backend="fa3")})
        assert r.structured_content["phase"] == "Failed"
        assert r.structured_content["failed_stage"] == "model_init"
        logs = (await c.call_tool("get_logs", {"name": "fa3"})).structured_content["lines"]
        assert classify(logs)[0] == "UNSUPPORTED_BACKEND"
        down = (await c.call_tool("tear_down", {"name": "ok-1"})).structured_content
        assert down["phase"] == "Terminated"
        again = (await c.call_tool("tear_down", {"name": "ok-1"})).structured_content
        assert again["phase"] == "Terminated"
        listed = (await c.call_tool("list_deployments", {})).structured_content["result"]
        assert [(d["name"], d["phase"]) for d in listed] == [("ok-1", "Terminated"),
                                                            ("fa3", "Failed")]
        ev = (await c.call_tool("get_events", {})).structured_content
        assert [(e["object"], e["reason"]) for e in ev["events"]] == [
            ("ok-1", "Created"), ("ok-1", "Ready"), ("fa3", "Created"), ("fa3", "Failed"),
            ("ok-1", "Killing")]
        assert ev["events"][3]["type"] == "Warning" and "FlashAttention" in \
            ev["events"][3]["message"]
        one = (await c.call_tool("get_events", {"name": "fa3", "max_items": 1})).structured_content
        assert ([e["reason"] for e in one["events"]], one["total_events"], one["next_start"]) \
            == (["Created"], 2, 1)


@pytest.mark.parametrize("args, needle", [
    ({"name": "Bad_Name", "config": config()}, "name"),
    ({"name": "x", "config": config(tp_size=0)}, "tp_size"),
    ({"name": "x", "config": config(weights="int3")}, "int3"),
    ({"name": "x", "config": {**config(), "turbo": True}}, "turbo"),
    ({"name": "x", "config": config(), "force": True}, "force"),
], ids=["bad-name", "tp-zero", "unknown-checkpoint", "invented-field", "invented-argument"])
async def test_cluster_rejects_invented_arguments(args, needle):
    async with Client(cluster_server(TwinBackend())) as c:
        r = await c.call_tool("deploy", args)
        assert r.is_error
        assert needle in r.content[0].text


async def test_cluster_unknown_deployment_error_says_what_to_do():
    async with Client(cluster_server(TwinBackend())) as c:
        r = await c.call_tool("get_status", {"name": "nope"})
        assert r.is_error and "list_deployments" in r.content[0].text


async def test_cluster_refuses_a_second_live_deployment_of_a_name():
    async with Client(cluster_server(TwinBackend())) as c:
        await c.call_tool("deploy", {"name": "d1", "config": config()})
        r = await c.call_tool("deploy", {"name": "d1", "config": config()})
        assert r.is_error and "tear it down first" in r.content[0].text
        await c.call_tool("tear_down", {"name": "d1"})
        r = await c.call_tool("deploy", {"name": "d1", "config": config()})
        assert r.structured_content["phase"] == "Ready"


def test_oom_failure_is_classified_from_log():
    backend = TwinBackend()
    backend.deploy("fp8-tp4", ServingConfig(**config(weights="fp8", tp_size=4, replicas=2)), {})
    cls, line = classify([ln.text for ln in backend.logs("fp8-tp4")])
    assert cls == "OOM_WEIGHTS" and "CUDA out of memory" in line


NS_CALLS = [
    ("deploy", {"name": "d2", "config": config()}),
    ("get_status", {"name": "d1"}),
    ("get_logs", {"name": "d1"}),
    ("get_events", {}),
    ("tear_down", {"name": "d1"}),
    ("list_deployments", {}),
]


@pytest.mark.parametrize("tool, args", NS_CALLS, ids=[t for t, _ in NS_CALLS])
async def test_every_tool_is_confined_to_the_configured_namespace(tool, args):
    backend = TwinBackend("team-a")
    async with Client(cluster_server(backend)) as c:
        await c.call_tool("deploy", {"name": "d1", "config": config()})
        r = await c.call_tool(tool, {**args, "namespace": "kube-system"})
        assert r.is_error
        assert "confined to namespace 'team-a'" in r.content[0].text
        assert backend.status("d1").phase == "Ready"  # the refused call changed nothing
        assert [d.name for d in backend.list()] == ["d1"]
        ok = await c.call_tool(tool, {**args, "namespace": "team-a"})
        assert not ok.is_error, ok.content


@pytest.mark.parametrize("tool, args, needle", [
    ("deploy", {"name": "--all", "config": config()}, "name"),
    ("get_status", {"name": "--all"}, "name"),
    ("get_logs", {"name": "-f"}, "name"),
    ("get_events", {"name": "--field-selector=x"}, "name"),
    ("tear_down", {"name": "--all"}, "name"),
    ("deploy", {"name": "d1", "config": config(model="-rf")}, "-rf"),
    ("deploy", {"name": "d1", "config": config(attention_backend="--trust-remote-code")},
     "--trust-remote-code"),
    ("list_deployments", {"namespace": "--all-namespaces"}, "confined"),
], ids=["deploy-name", "status-name", "logs-name", "events-name", "teardown-name",
        "config-model", "config-backend", "namespace"])
async def test_flag_injection_is_refused(tool, args, needle):
    backend = TwinBackend()
    async with Client(cluster_server(backend)) as c:
        r = await c.call_tool(tool, args)
        assert r.is_error
        assert needle in r.content[0].text
    assert backend.list() == []


def test_config_values_starting_with_dash_never_reach_a_backend():
    # A config built without validation (model_construct) is still refused before any argv.
    bad = ServingConfig.model_construct(**{**ServingConfig(**config()).__dict__,
                                           "attention_backend": "--trust-remote-code"})
    with pytest.raises(BackendError, match="attention_backend"):
        refuse_flag_values(bad)
    with pytest.raises(BackendError, match="read as a command-line flag"):
        ops.deploy(TwinBackend(), "d1", bad)


def test_twin_records_are_shared_over_a_state_dir(tmp_path):
    a = TwinBackend("team-a", state_dir=tmp_path)
    b = TwinBackend("team-a", state_dir=tmp_path)
    other_ns = TwinBackend("team-b", state_dir=tmp_path)
    ops.deploy(a, "d1", ServingConfig(**config(tp_size=4, replicas=2)))
    ops.deploy(a, "bad", ServingConfig(**config(attention_backend="fa3")))
    assert (tmp_path / "twin" / "team-a" / "d1.json").is_file()
    assert [(d.name, d.phase) for d in b.list()] == [("d1", "Ready"), ("bad", "Failed")]
    assert other_ns.list() == []
    cfg, fit = b.ready_fit("d1")
    assert cfg.replicas == 2 and fit == a.ready_fit("d1")[1]
    assert [ln.text for ln in b.logs("bad")] == [ln.text for ln in a.logs("bad")]
    assert b.status("d1").created_at == a.status("d1").created_at
    with pytest.raises(BackendError, match="already exists"):
        ops.deploy(b, "d1", ServingConfig(**config()))
    assert b.teardown("d1").phase == "Terminated"
    assert a.status("d1").phase == "Terminated"
    assert [e.reason for e in a.events("d1")] == ["Created", "Ready", "Killing"]
    with pytest.raises(BackendError, match="not Ready"):
        a.ready_fit("d1")


def test_make_backend_kinds(tmp_path):
    assert make_backend("twin").kind == "twin"
    assert make_backend("local", "ns", tmp_path).kind == "local"
    with pytest.raises(BackendError, match="state_dir"):
        make_backend("local", "ns")
    with pytest.raises(BackendError, match="twin, local, kubernetes"):
        make_backend("k8s")


async def test_cluster_server_over_stdio(tmp_path):
    params = StdioServerParameters(
        command=sys.executable,
        args=["-c", "from pathlib import Path; from mcp_servers.cluster.server import main; "
              f"main('twin', 'stdio-ns', Path({str(tmp_path)!r}))"],
        cwd=str(REPO))
    async with Client(params) as c:
        assert {t.name for t in (await c.list_tools()).tools} == TOOLS
        r = await c.call_tool("deploy", {"name": "s1", "config": config()})
        assert r.structured_content["namespace"] == "stdio-ns"
        assert r.structured_content["phase"] == "Ready"
        # a second process over the same state folder (the bench server) sees it
        assert TwinBackend("stdio-ns", tmp_path).status("s1").phase == "Ready"
        r = await c.call_tool("get_status", {"name": "s1", "namespace": "default"})
        assert r.is_error and "confined" in r.content[0].text
        r = await c.call_tool("tear_down", {"name": "s1"})
        assert r.structured_content["phase"] == "Terminated"
    assert TwinBackend("stdio-ns", tmp_path).status("s1").phase == "Terminated"


@pytest.mark.parametrize("text, needle", [
    ("{not json", "not valid JSON"),
    ('{"name": "b", "config": 5, "labels": {}}', "invalid fields: config"),
    ('"b"', "JSON str, not an object"),
    ("\xff garbage", "not valid JSON"),
], ids=["truncated", "wrong-type", "not-object", "not-utf8"])
async def test_a_corrupt_twin_record_is_reported_not_fatal(tmp_path, text, needle):
    backend = TwinBackend("team-a", state_dir=tmp_path)
    ops.deploy(backend, "a", ServingConfig(**config()))
    ops.deploy(backend, "b", ServingConfig(**config()))
    path = tmp_path / "twin" / "team-a" / "b.json"
    path.write_bytes(text.encode("latin-1"))
    async with Client(cluster_server(backend)) as c:
        listed = await c.call_tool("list_deployments", {})
        assert not listed.is_error, listed.content
        assert [d["name"] for d in listed.structured_content["result"]] == ["a"]
        ev = await c.call_tool("get_events", {})
        assert not ev.is_error, ev.content
        warn = [e for e in ev.structured_content["events"] if e["reason"] == "CorruptRecord"]
        assert len(warn) == 1 and warn[0]["object"] == "b" and str(path) in warn[0]["message"]
        assert needle in warn[0]["message"]
        for tool, args in [("get_status", {"name": "b"}), ("get_logs", {"name": "b"}),
                           ("get_events", {"name": "b"}),
                           ("deploy", {"name": "b", "config": config()})]:
            r = await c.call_tool(tool, args)
            assert r.is_error and str(path) in r.content[0].text, (tool, r.content)
            assert needle in r.content[0].text and "tear_down('b')" in r.content[0].text
        assert (await c.call_tool("get_status", {"name": "a"})).structured_content[
            "phase"] == "Ready"
        r = await c.call_tool("tear_down", {"name": "b"})
        assert r.is_error and "moved aside" in r.content[0].text
        assert "can be deployed again" in r.content[0].text
        assert not path.exists() and len(list(path.parent.glob("b.json.*.corrupt"))) == 1
        r = await c.call_tool("deploy", {"name": "b", "config": config()})
        assert r.structured_content["phase"] == "Ready"
        ev = (await c.call_tool("get_events", {})).structured_content["events"]
        assert not [e for e in ev if e["reason"] == "CorruptRecord"]


def test_twin_teardown_message_and_redeploy_keeps_earlier_events(tmp_path):
    backend = TwinBackend("team-a", state_dir=tmp_path)
    ops.deploy(backend, "d", ServingConfig(**config()))
    st = backend.teardown("d")
    assert st.message.startswith("torn down at ") and st.message.endswith(
        "; last log line: The server is fired up and ready to roll!")
    ops.deploy(backend, "d", ServingConfig(**config(attention_backend="fa3")))
    assert [e.reason for e in backend.events("d")] == [
        "Created", "Ready", "Killing", "Created", "Failed"]
    assert [e.reason for e in TwinBackend("team-a", state_dir=tmp_path).events()] == [
        "Created", "Ready", "Killing", "Created", "Failed"]
