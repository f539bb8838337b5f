"""The cluster and bench MCP servers through mcp.Client (in memory) and one stdio round trip."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from mcp import Client, StdioServerParameters

from agents.deployer import classify
from mcp_servers.bench.ops import BenchService
from mcp_servers.bench.server import build_server as bench_server
from mcp_servers.cluster.backend import TwinBackend
from mcp_servers.cluster.server import build_server as cluster_server

pytestmark = pytest.mark.anyio
REPO = Path(__file__).resolve().parent.parent
TRACES = REPO / "data" / "traces"


@pytest.fixture
def anyio_backend():
    return "asyncio"


def config(**kw):
    c = dict(model="glm-5", gpu="B200", tp_size=8, replicas=1, weights="nvfp4",
             kv_cache_dtype="fp8_e4m3")
    c.update(kw)
    return c


async def test_cluster_tools_deploy_status_logs_teardown():
    backend = TwinBackend("team-a")
    async with Client(cluster_server(backend)) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
        assert set(tools) == {"deploy", "get_status", "get_logs", "tear_down", "list_deployments"}
        assert tools["get_logs"].annotations.read_only_hint is True
        assert tools["tear_down"].annotations.destructive_hint is True
        r = await c.call_tool("deploy", {"name": "ok-1", "config": config()})
        assert not r.is_error
        st = r.structured_content
        assert (st["phase"], st["namespace"], st["ready_replicas"]) == ("Ready", "team-a", 1)
        assert st["labels"]["app.kubernetes.io/managed-by"] == "servetune"
        page = (await c.call_tool("get_logs", {"name": "ok-1", "max_lines": 2})).structured_content
        assert page["lines"][0].startswith("server_args=--model-path nvidia/GLM-5-NVFP4")
        assert page["next_start"] == 2
        tail = (await c.call_tool("get_logs", {"name": "ok-1", "tail": 1})).structured_content
        assert tail["lines"] == ["The server is fired up and ready to roll!"]
        r = await c.call_tool("deploy", {"name": "fa3", "config": config(attention_backend="fa3")})
        assert r.structured_content["phase"] == "Failed"
        assert r.structured_content["failed_stage"] == "model_init"
        logs = (await c.call_tool("get_logs", {"name": "fa3"})).structured_content["lines"]
        assert classify(logs)[0] == "UNSUPPORTED_BACKEND"
        down = (await c.call_tool("tear_down", {"name": "ok-1"})).structured_content
        assert down["phase"] == "Terminated"
        listed = (await c.call_tool("list_deployments", {})).structured_content["result"]
        assert [d["name"] for d in listed] == ["ok-1", "fa3"]


@pytest.mark.parametrize("args, needle", [
    ({"name": "Bad_Name", "config": config()}, "name"),
    ({"name": "x", "config": config(tp_size=0)}, "tp_size"),
    ({"name": "x", "config": config(weights="int3")}, "int3"),
    ({"name": "x", "config": {**config(), "turbo": True}}, "turbo"),
], ids=["bad-name", "tp-zero", "unknown-checkpoint", "invented-field"])
async def test_cluster_rejects_invented_arguments(args, needle):
    async with Client(cluster_server(TwinBackend())) as c:
        r = await c.call_tool("deploy", args)
        assert r.is_error
        assert needle in r.content[0].text


async def test_cluster_unknown_deployment_error_says_what_to_do():
    async with Client(cluster_server(TwinBackend())) as c:
        r = await c.call_tool("get_status", {"name": "nope"})
        assert r.is_error and "list_deployments" in r.content[0].text


async def test_oom_failure_is_classified_from_log():
    backend = TwinBackend()
    backend.deploy("fp8-tp4", __import__("domain.config", fromlist=["ServingConfig"])
                   .ServingConfig(**config(weights="fp8", tp_size=4, replicas=2)), {})
    cls, line = classify(backend.logs("fp8-tp4"))
    assert cls == "OOM_WEIGHTS" and "CUDA out of memory" in line


async def test_bench_saturation_and_replay(tmp_path):
    backend = TwinBackend()
    svc = BenchService(backend, tmp_path / "records", [TRACES])
    async with Client(cluster_server(backend)) as c, Client(bench_server(svc)) as b:
        await c.call_tool("deploy", {"name": "d1", "config": config(tp_size=4, replicas=2)})
        r = await b.call_tool("run_saturation", {"deployment": "d1", "isl": 512, "osl": 64,
                                                 "concurrency": 16, "duration_s": 5})
        assert not r.is_error, r.content
        res = r.structured_content
        s = res["summary"]
        assert s["gpus"] == 8 and s["errors"] == 0 and s["completed"] == s["requests"] > 16
        assert s["output_tokens"] == 64 * s["completed"]
        assert len(res["replicas"]) == 2
        rec = np.load(res["records_path"])
        assert len(rec["arrival_s"]) == s["requests"]
        assert rec["itl_offsets"][-1] == len(rec["itl_s"]) == s["completed"] * 63
        r = await b.call_tool("run_replay", {
            "deployment": "d1", "trace": "mooncake_fast25_conversation_trace.jsonl",
            "start_s": 0, "duration_s": 60, "time_scale": 1.0, "slo_ttft_ms": 5000})
        assert not r.is_error, r.content
        res = r.structured_content
        # trace timestamps (ms) below 60,000 ms: counted from the file itself
        lines = (TRACES / "mooncake_fast25_conversation_trace.jsonl").read_text().splitlines()
        expect = sum(1 for ln in lines if int(ln.split('"timestamp": ')[1].split(",")[0]) < 60000)
        assert res["workload"]["requests"] == res["summary"]["requests"] == expect
        assert res["summary"]["goodput_req_s"] is not None
        r = await b.call_tool("run_sweep", {"deployment": "d1", "isl": 256, "osl": 32,
                                            "concurrencies": [2, 8], "duration_s": 2})
        pts = r.structured_content["result"]
        assert [p["concurrency"] for p in pts] == [2, 8]
        assert pts[1]["output_tok_s_per_gpu"] > pts[0]["output_tok_s_per_gpu"]


@pytest.mark.parametrize("trace", ["../../etc/passwd", "-rf", "nope.jsonl"],
                         ids=["escape", "dash", "missing"])
async def test_bench_confines_trace_paths(tmp_path, trace):
    backend = TwinBackend()
    svc = BenchService(backend, tmp_path, [TRACES])
    async with Client(cluster_server(backend)) as c, Client(bench_server(svc)) as b:
        await c.call_tool("deploy", {"name": "d1", "config": config()})
        r = await b.call_tool("run_replay", {"deployment": "d1", "trace": trace, "start_s": 0,
                                             "duration_s": 10})
        assert r.is_error and "trace" in r.content[0].text


async def test_bench_refuses_failed_deployment(tmp_path):
    backend = TwinBackend()
    svc = BenchService(backend, tmp_path, [TRACES])
    async with Client(cluster_server(backend)) as c, Client(bench_server(svc)) as b:
        await c.call_tool("deploy", {"name": "bad", "config": config(attention_backend="fa3")})
        r = await b.call_tool("run_saturation", {"deployment": "bad", "isl": 1, "osl": 1,
                                                 "concurrency": 1, "duration_s": 1})
        assert r.is_error and "not Ready" in r.content[0].text


async def test_cluster_server_over_stdio():
    params = StdioServerParameters(
        command=sys.executable,
        args=["-c", "from mcp_servers.cluster.server import main; main('stdio-ns')"],
        cwd=str(REPO))
    async with Client(params) as c:
        r = await c.call_tool("deploy", {"name": "s1", "config": config()})
        assert r.structured_content["namespace"] == "stdio-ns"
        assert r.structured_content["phase"] == "Ready"
