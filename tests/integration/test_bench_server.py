"""The bench MCP server through mcp.Client (in memory) and one stdio round trip.

Twin runs (virtual time) and HTTP runs against the OpenAI-compatible stub
(``tests/fixtures/openai_stub.py``, started here on 127.0.0.1 and stopped by its PID), plus the
HTTP runner's SSE handling against canned responses from a tiny server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from fixtures.configs import config
from fixtures.stub_process import free_port, running_stub
from mcp import Client, StdioServerParameters

from domain.config import ServingConfig
from domain.traces import load_mooncake
from mcp_servers.bench.http import HttpRunner, PlannedRequest
from mcp_servers.bench.ops import BenchService
from mcp_servers.bench.prompts import replay_plan
from mcp_servers.bench.server import build_server as bench_server
from mcp_servers.cluster.backend import DeploymentStatus
from mcp_servers.cluster.server import build_server as cluster_server
from mcp_servers.cluster.twin import TwinBackend

pytestmark = pytest.mark.anyio
REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "data" / "traces"
TTFT_MS, ITL_MS = 20.0, 5.0
LOCAL = ["http://127.0.0.1"]
# Timing bounds catch scheduling errors (requests sent late, serially or all at once), not
# fidelity: they hold on a loaded 2-core machine. Measured bias and lag belong in benchmarks/.
SLACK_MS = 40.0






@pytest.fixture(scope="module")
def stub():
    """Base URL of a running stub (TTFT 20 ms, ITL 5 ms); stopped by PID afterwards."""
    with running_stub(ttft_ms=TTFT_MS, itl_ms=ITL_MS) as url:
        yield url


def service(tmp_path, backend=None, roots=(TRACES,), allowed=LOCAL) -> BenchService:
    return BenchService(backend or TwinBackend(), tmp_path / "records", list(roots), allowed)


def mooncake_file(path: Path) -> Path:
    """40 requests, one every 25 ms; groups share their first 1 or 2 hash blocks."""
    rows = []
    for i in range(40):
        n_in = 300 + 37 * i
        k = -(-n_in // 512)
        shared = [7, 8][:1 + i % 2]  # every request starts with block 7; odd ones also with 8
        ids = (shared + [1000 + 10 * i + j for j in range(k)])[:k]
        rows.append({"timestamp": 25 * i, "input_length": n_in, "output_length": 4 + i % 3,
                     "hash_ids": ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class Progress:
    def __init__(self):
        self.events: list[tuple[float, float, float | None, str]] = []

    async def __call__(self, progress, total, message):
        self.events.append((time.monotonic(), progress, total, message))


# --------------------------------------------------------------------------- twin (virtual time)

async def test_twin_saturation_replay_sweep(tmp_path):
    backend = TwinBackend()
    svc = service(tmp_path, backend)
    async with Client(cluster_server(backend)) as c, Client(bench_server(svc)) as b:
        await c.call_tool("deploy", {"name": "d1", "config": config(tp_size=4, replicas=2)})
        prog = Progress()
        r = await b.call_tool("run_saturation", {"deployment": "d1", "isl": 512, "osl": 64,
                                                 "concurrency": 16, "duration_s": 5},
                              progress_callback=prog)
        assert not r.is_error, r.content
        res = r.structured_content
        assert res["target"] == "twin" and res["deployment"] == "d1"
        s = res["summary"]
        assert s["gpus"] == 8 and s["errors"] == 0 and s["completed"] == s["requests"] > 16
        assert s["output_tokens"] == 64 * s["completed"]
        assert len(res["replicas"]) == 2
        rec = np.load(res["records_path"])
        assert len(rec["arrival_s"]) == s["requests"]
        assert rec["itl_offsets"][-1] == len(rec["itl_s"]) == s["completed"] * 63
        # start, then each replica simulated (sent from the simulating thread)
        assert [(p, t) for _, p, t, _ in prog.events] == [(0, 2), (1, 2), (2, 2)]
        assert prog.events[0][3].startswith("twin: simulating")
        assert prog.events[-1][3] == "twin: 2/2 replicas simulated"
        prog = Progress()
        r = await b.call_tool("run_replay", {
            "deployment": "d1", "trace": "mooncake_fast25_conversation_trace.jsonl",
            "start_s": 0, "duration_s": 60, "time_scale": 1.0, "slo_ttft_ms": 5000},
            progress_callback=prog)
        assert not r.is_error, r.content
        res = r.structured_content
        # trace timestamps (ms) below 60,000 ms: counted from the file itself
        lines = (TRACES / "mooncake_fast25_conversation_trace.jsonl").read_text().splitlines()
        expect = sum(1 for ln in lines if int(ln.split('"timestamp": ')[1].split(",")[0]) < 60000)
        assert res["workload"]["requests"] == res["summary"]["requests"] == expect
        assert res["summary"]["goodput_req_s"] is not None
        done = [p for _, p, _, _ in prog.events]
        assert done[0] == 0 and done == sorted(set(done)) and done[-1] == expect + 2
        assert prog.events[-1][3] == f"twin: {expect}/{expect} requests routed, replicas drained"
        prog = Progress()
        r = await b.call_tool("run_sweep", {"deployment": "d1", "isl": 256, "osl": 32,
                                            "concurrencies": [2, 8], "duration_s": 2},
                              progress_callback=prog)
        pts = r.structured_content["result"]
        assert [p["concurrency"] for p in pts] == [2, 8]
        assert pts[1]["output_tok_s_per_gpu"] > pts[0]["output_tok_s_per_gpu"]
        assert [(p, t) for _, p, t, _ in prog.events] == [(0, 2), (1, 2), (2, 2)]


@pytest.mark.parametrize("trace", ["../../etc/passwd", "-rf", "nope.jsonl"],
                         ids=["escape", "dash", "missing"])
async def test_bench_confines_trace_paths(tmp_path, trace):
    backend = TwinBackend()
    svc = service(tmp_path, backend)
    async with Client(cluster_server(backend)) as c, Client(bench_server(svc)) as b:
        await c.call_tool("deploy", {"name": "d1", "config": config()})
        r = await b.call_tool("run_replay", {"deployment": "d1", "trace": trace, "start_s": 0,
                                             "duration_s": 10})
        assert r.is_error and "trace" in r.content[0].text


async def test_bench_confines_trace_symlink_escape(tmp_path):
    root = tmp_path / "traces"
    root.mkdir()
    outside = mooncake_file(tmp_path / "outside.jsonl")
    (root / "link.jsonl").symlink_to(outside)
    backend = TwinBackend()
    backend.deploy("d1", ServingConfig(**config()), {})
    async with Client(bench_server(service(tmp_path, backend, roots=[root]))) as b:
        r = await b.call_tool("run_replay", {"deployment": "d1", "trace": "link.jsonl",
                                             "start_s": 0, "duration_s": 10})
        assert r.is_error and "not found inside the allowed trace folders" in r.content[0].text


async def test_bench_refuses_failed_deployment(tmp_path):
    backend = TwinBackend()
    async with Client(cluster_server(backend)) as c, \
            Client(bench_server(service(tmp_path, backend))) as b:
        await c.call_tool("deploy", {"name": "bad", "config": config(attention_backend="fa3")})
        r = await b.call_tool("run_saturation", {"deployment": "bad", "isl": 1, "osl": 1,
                                                 "concurrency": 1, "duration_s": 1})
        assert r.is_error and "not Ready" in r.content[0].text


async def test_tools_and_annotations(tmp_path):
    async with Client(bench_server(service(tmp_path))) as b:
        tools = {t.name: t for t in (await b.list_tools()).tools}
        assert set(tools) == {"run_saturation", "run_rate", "run_replay", "run_sweep",
                              "run_greedy", "get_records", "list_runs"}
        for name in ("run_saturation", "run_rate", "run_replay", "run_sweep", "run_greedy"):
            a = tools[name].annotations
            assert (a.read_only_hint, a.destructive_hint, a.open_world_hint) == \
                (False, False, True), name
            assert "ctx" not in tools[name].input_schema["properties"]
            assert {"deployment", "endpoint"} <= set(tools[name].input_schema["properties"])
        for name in ("get_records", "list_runs"):
            assert tools[name].annotations.read_only_hint is True
        assert "wall time" in tools["run_saturation"].description


async def test_get_records_paging_and_list_runs(tmp_path):
    backend = TwinBackend()
    backend.deploy("d1", ServingConfig(**config()), {})
    async with Client(bench_server(service(tmp_path, backend))) as b:
        res = (await b.call_tool("run_saturation", {"deployment": "d1", "isl": 128, "osl": 8,
                                                    "concurrency": 4, "duration_s": 1})
               ).structured_content
        n = res["summary"]["requests"]
        assert n > 7
        page = (await b.call_tool("get_records", {"bench_id": res["bench_id"], "max_items": 5})
                ).structured_content
        assert (page["total"], page["start"], page["next_start"]) == (n, 0, 5)
        assert [r["index"] for r in page["records"]] == [0, 1, 2, 3, 4]
        first = page["records"][0]
        assert first["error"] is None and first["output_tokens"] == 8
        assert first["ttft_ms"] > 0 and first["e2e_ms"] > first["ttft_ms"]
        assert first["dispatch_lag_ms"] == 0 and first["itl_ms"] is None
        last = (await b.call_tool("get_records", {"bench_id": res["bench_id"], "start": n - 2,
                                                  "include_itl": True})).structured_content
        assert last["next_start"] is None and len(last["records"]) == 2
        assert len(last["records"][0]["itl_ms"]) == 7
        runs = (await b.call_tool("list_runs", {})).structured_content
        assert runs["total"] == 1 and runs["runs"][0]["bench_id"] == res["bench_id"]
        assert runs["runs"][0]["requests"] == n and runs["runs"][0]["target"] == "d1"
        for bad, needle in [("../records/x", "not a run id"), ("nope-sat-1", "list_runs")]:
            r = await b.call_tool("get_records", {"bench_id": bad})
            assert r.is_error and needle in r.content[0].text
        # a damaged records file and a foreign result file: clear errors, nothing hidden
        (tmp_path / "records" / "junk-sat-1.npz").write_bytes(b"not a zip")
        (tmp_path / "records" / "junk-sat-1.json").write_text("{")
        r = await b.call_tool("get_records", {"bench_id": "junk-sat-1"})
        assert r.is_error and "damaged or incomplete" in r.content[0].text
        runs = (await b.call_tool("list_runs", {})).structured_content
        assert (runs["total"], runs["skipped_files"]) == (1, ["junk-sat-1.json"])


# --------------------------------------------------------------------------- HTTP against the stub

async def test_http_saturation_measures_stub_timing(tmp_path, stub):
    prog = Progress()
    async with Client(bench_server(service(tmp_path))) as b:
        r = await b.call_tool("run_saturation", {"endpoint": stub + "/v1", "isl": 32, "osl": 16,
                                                 "concurrency": 4, "duration_s": 1.5, "gpus": 2},
                              progress_callback=prog)
        assert not r.is_error, r.content
        res = r.structured_content
    s = res["summary"]
    assert res["target"] == "http" and res["endpoint"] == stub and res["deployment"] is None
    assert s["errors"] == 0 and s["completed"] == s["requests"] >= 20
    assert s["output_tokens"] == 16 * s["completed"]  # from the usage chunk
    assert s["input_tokens"] == 32 * s["completed"]  # the stub counts prompt words
    # client-side TTFT = stub's sleep + connect/parse overhead on both sides
    assert TTFT_MS <= s["ttft_ms"]["p50"] <= TTFT_MS + SLACK_MS, s["ttft_ms"]
    assert abs(s["itl_ms"]["mean"] - ITL_MS) < 4, s["itl_ms"]
    assert s["output_tok_s_per_gpu"] == pytest.approx(s["output_tok_s"] / 2)
    assert 1.5 <= res["wall_s"] < 6
    rec = np.load(res["records_path"])
    assert rec["ok"].all() and len(rec["sent_s"]) == s["requests"]
    assert rec["itl_offsets"][-1] == 15 * s["completed"]
    # progress: at most ~2 per second plus the final one, which reports the whole run
    assert 2 <= len(prog.events) <= 2 * res["wall_s"] + 2
    assert all(e[2] is None for e in prog.events[:-1])
    assert prog.events[-1][1] == s["requests"] and prog.events[-1][3].startswith("done: ")
    assert " requests (0 failed), " in prog.events[0][3]
    gaps = np.diff([e[0] for e in prog.events[:-1]])
    assert (gaps > 0.4).all()


async def test_http_replay_keeps_schedule_and_prefixes(tmp_path, stub):
    trace = mooncake_file(tmp_path / "mc.jsonl")
    prog = Progress()
    async with Client(bench_server(service(tmp_path, roots=[tmp_path]))) as b:
        r = await b.call_tool("run_replay", {"endpoint": stub, "trace": "mc.jsonl",
                                             "format": "mooncake", "start_s": 0,
                                             "duration_s": 10, "time_scale": 2.0,
                                             "slo_ttft_ms": 200}, progress_callback=prog)
        assert not r.is_error, r.content
        res = r.structured_content
        page = (await b.call_tool("get_records", {"bench_id": res["bench_id"],
                                                  "max_items": 100})).structured_content
    rows = [json.loads(x) for x in trace.read_text().splitlines()]
    s = res["summary"]
    assert s["requests"] == s["completed"] == 40 and s["errors"] == 0
    recs = page["records"]
    # arrival = scheduled time on the run clock: trace ms / 1000 / time_scale
    assert [x["arrival_s"] for x in recs] == pytest.approx([r["timestamp"] / 2000 for r in rows])
    # exact ISL: the stub's usage counts the words it received
    assert [x["input_tokens"] for x in recs] == [r["input_length"] for r in rows]
    assert [x["output_tokens"] for x in recs] == [r["output_length"] for r in rows]
    # dispatch lag = actual - scheduled send (measured ~1 ms p50 on 2 idle cores; the bounds
    # leave room for a loaded test machine)
    lags = [x["dispatch_lag_ms"] for x in recs]
    assert min(lags) >= 0 and max(lags) < 500
    assert res["dispatch_lag_ms"]["p50"] < SLACK_MS, res["dispatch_lag_ms"]
    # TTFT counts from the scheduled time, so a late send or a late arrival shows here too
    assert TTFT_MS <= s["ttft_ms"]["p50"] <= TTFT_MS + SLACK_MS, s["ttft_ms"]
    assert s["goodput_req_s"] > 0
    assert prog.events[-1][1:3] == (40, 40) and prog.events[-1][3].startswith("done: 40/40")
    assert all(e[2] == 40 for e in prog.events)


def test_replay_prompts_share_hash_prefixes(tmp_path):
    reqs = load_mooncake(mooncake_file(tmp_path / "mc.jsonl")).requests
    prompts = [json.loads(p.body)["prompt"].split(" ") for p in replay_plan(reqs, "m")]
    assert [len(p) for p in prompts] == [r.input_tokens for r in reqs]
    for i in range(len(reqs)):
        for j in range(i):
            a, b = reqs[i], reqs[j]
            shared = 0
            while shared < min(len(a.hash_ids), len(b.hash_ids)) and \
                    a.hash_ids[shared] == b.hash_ids[shared]:
                shared += 1
            n = min(shared * 512, a.input_tokens, b.input_tokens)
            assert prompts[i][:n] == prompts[j][:n]
            if shared < min(len(a.hash_ids), len(b.hash_ids)):  # next block differs
                k = shared * 512
                m = min(a.input_tokens, b.input_tokens, k + 512)
                assert prompts[i][k:m] != prompts[j][k:m]
    assert replay_plan(reqs, "m")[3].body == replay_plan(reqs, "m")[3].body  # deterministic


async def test_http_sweep(tmp_path, stub):
    prog = Progress()
    async with Client(bench_server(service(tmp_path))) as b:
        r = await b.call_tool("run_sweep", {"endpoint": stub, "isl": 16, "osl": 8,
                                            "concurrencies": [1, 4], "duration_s": 0.6},
                              progress_callback=prog)
        assert not r.is_error, r.content
        pts = r.structured_content["result"]
        runs = (await b.call_tool("list_runs", {})).structured_content
    assert [p["concurrency"] for p in pts] == [1, 4] and [p["errors"] for p in pts] == [0, 0]
    assert pts[1]["output_tok_s_per_gpu"] > 2 * pts[0]["output_tok_s_per_gpu"]
    assert {x["bench_id"] for x in runs["runs"]} == {p["bench_id"] for p in pts}
    values = [e[1] for e in prog.events]
    assert values == sorted(values) and values[-1] == 2
    assert all(e[2] == 2 for e in prog.events)
    assert any(e[3].startswith("point 2/2 (concurrency 4): ") for e in prog.events)


async def test_http_against_a_deployment_with_endpoints(tmp_path, stub):
    class Backend:  # a backend whose Ready deployment serves over HTTP (like local processes)
        namespace, kind = "servetune", "fake"

        def status(self, name):
            return DeploymentStatus(name=name, namespace="servetune", phase="Ready", replicas=2,
                                    ready_replicas=2, config=ServingConfig(**config(replicas=2)),
                                    endpoints=[stub, stub + "/"], created_at=time.time())

    async with Client(bench_server(service(tmp_path, Backend(), allowed=[]))) as b:
        r = await b.call_tool("run_saturation", {"deployment": "real", "isl": 8, "osl": 4,
                                                 "concurrency": 2, "duration_s": 0.3})
        assert not r.is_error, r.content
        res = r.structured_content
        assert res["target"] == "http" and res["deployment"] == "real"
        assert res["summary"]["gpus"] == 16 and res["summary"]["errors"] == 0
        assert res["config_id"] and "+1 more replicas" in res["workload"]["description"]
        r = await b.call_tool("run_saturation", {"deployment": "real", "isl": 8, "osl": 4,
                                                 "concurrency": 2, "duration_s": 0.3, "gpus": 4})
        assert r.is_error and "only for endpoint runs" in r.content[0].text


@pytest.mark.parametrize("args, needle", [
    ({"endpoint": "http://example.com:8000"}, "not on this bench server's allow-list"),
    ({"endpoint": "http://127.0.0.1.evil.example:80"}, "not on this bench server's allow-list"),
    ({"endpoint": "https://127.0.0.1:8000"}, "not on this bench server's allow-list"),
    ({"endpoint": "ftp://127.0.0.1/"}, "http:// or https://"),
    ({"endpoint": "http://user:pw@127.0.0.1:9000"}, "credentials"),
    ({"endpoint": "http://127.0.0.1:9000/?x=1"}, "query"),
    ({"endpoint": "http://127.0.0.1:99999"}, "not a URL"),
    ({"endpoint": "http://127.0.0.1:9000", "deployment": "d1"}, "exactly one of"),
    ({}, "exactly one of"),
    ({"endpoint": "http://127.0.0.1:9000", "concurrency": 5000}, "limit of 4096"),
], ids=["other-host", "prefix-trick", "scheme-mismatch", "ftp", "credentials", "query",
        "bad-port", "both", "neither", "concurrency-cap"])
async def test_endpoint_guard_rails(tmp_path, args, needle):
    base = {"isl": 8, "osl": 4, "concurrency": 1, "duration_s": 1}
    async with Client(bench_server(service(tmp_path))) as b:
        r = await b.call_tool("run_saturation", {**base, **args})
        assert r.is_error and needle in r.content[0].text, r.content[0].text


async def test_no_endpoint_is_allowed_by_default(tmp_path, stub):
    async with Client(bench_server(service(tmp_path, allowed=[]))) as b:
        r = await b.call_tool("run_saturation", {"endpoint": stub, "isl": 8, "osl": 4,
                                                 "concurrency": 1, "duration_s": 1})
        assert r.is_error and "(allowed: none)" in r.content[0].text


async def test_connection_refused_is_recorded_per_request(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    async with Client(bench_server(service(tmp_path))) as b:
        r = await b.call_tool("run_saturation", {"endpoint": dead, "isl": 8, "osl": 4,
                                                 "concurrency": 2, "duration_s": 5})
        assert not r.is_error, r.content
        res = r.structured_content
    s = res["summary"]
    assert s["completed"] == 0 and s["errors"] == s["requests"] >= 32
    assert "cannot connect to" in res["first_error"] and "111" in res["first_error"]
    assert res["note"].startswith("stopped sending after the first")
    assert res["wall_s"] < 4  # the dead endpoint was not hammered for 5 s
    rec = np.load(res["records_path"])
    assert not rec["ok"].any() and str(rec["error"][0]) == res["first_error"]


# --------------------------------------------------------------------------- SSE handling

SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"


def sse(*events: str) -> bytes:
    return SSE_HEAD + b"".join(f"{e}\n\n".encode() for e in events)


def text(t: str) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "text": t}]})


USAGE7 = "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 5,
                                                         "completion_tokens": 7}})


@pytest.mark.parametrize("raw, delay, out, error, cls", [
    (sse(": keepalive", text(""), text("a"), "event: ping", text("b"), text("c"),
         "data: [DONE]"), 0, 3, None, None),
    (sse(text("ab"), text("cd"), text("efg"), USAGE7, "data: [DONE]"), 0, 7, None, None),
    (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 23\r\nConnection: close\r\n\r\n"
     b'{"error": "overloaded"}', 0, 0, "HTTP 503 from", "http_status"),
    (sse(text("a"), text("b")), 0, 2, "closed before 'data: [DONE]' after 2 text chunks",
     "disconnect"),
    (sse("data: {not json", "data: [DONE]"), 0, 0, "malformed SSE data", "stream"),
    (sse('data: {"error": {"message": "boom"}}'), 0, 0, "error in stream", "stream"),
    (sse(text("a"), "data: [DONE]"), 1.0, 0, "no complete response", "timeout"),
    (sse(text("a"), USAGE7.replace('"completion_tokens": 7', '"completion_tokens": 5'),
         "data: [DONE]"), 0, 5, "truncated output: 5 of 7 tokens", "truncated"),
    (sse("data: [DONE]"), 0, 0, "without any text chunk", "truncated"),
], ids=["keepalive-no-usage", "usage-wins", "http-503", "cut-stream", "bad-json",
        "error-chunk", "timeout", "truncated", "no-text"])
@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
async def test_sse_parsing(raw, delay, out, error, cls, client):
    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                          if ln.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        await asyncio.sleep(delay)
        writer.write(raw)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        runner = HttpRunner([f"http://127.0.0.1:{port}"], request_timeout_s=0.3, client=client)
        run = await runner.open_loop([PlannedRequest(0.0, b"{}", 3, 7)])
    finally:
        server.close()
    rec = run.records[0]
    assert run.error_class == [cls] and run.client == client
    if error is None:
        assert rec.error is None and rec.output_tokens == out
        assert rec.input_tokens == (5 if out == 7 else 3)
        assert len(rec.itl_s) == 2 and rec.first_token_s >= 0
    else:
        assert error in rec.error and rec.output_tokens == out
        assert run.error_counts() == {cls: 1}


# --------------------------------------------------------------------------- stdio

async def test_bench_server_over_stdio(tmp_path, stub):
    state = tmp_path / "state"
    TwinBackend("stdio-ns", state_dir=state).deploy("s1", ServingConfig(**config()), {})
    code = ("from mcp_servers.bench.server import main; "
            f"main('twin', 'stdio-ns', {str(state)!r}, {str(tmp_path / 'art')!r}, [], "
            "['http://127.0.0.1'])")
    params = StdioServerParameters(command=sys.executable, args=["-c", code], cwd=str(REPO))
    prog = Progress()
    async with Client(params) as c:
        r = await c.call_tool("run_saturation", {"deployment": "s1", "isl": 64, "osl": 8,
                                                 "concurrency": 2, "duration_s": 1})
        assert not r.is_error, r.content
        assert r.structured_content["target"] == "twin"  # the deployment made in this process
        r = await c.call_tool("run_saturation", {"endpoint": stub, "isl": 16, "osl": 8,
                                                 "concurrency": 2, "duration_s": 0.8},
                              progress_callback=prog)
        assert not r.is_error, r.content
        res = r.structured_content
        assert res["summary"]["errors"] == 0 and res["summary"]["completed"] > 5
        runs = (await c.call_tool("list_runs", {})).structured_content
        assert runs["total"] == 2
    assert prog.events and prog.events[-1][3].startswith("done: ")
    assert Path(res["records_path"]).parent == tmp_path / "art"


async def test_http_request_caps(tmp_path, stub):
    mooncake_file(tmp_path / "mc.jsonl")
    svc = BenchService(TwinBackend(), tmp_path / "records", [tmp_path], LOCAL, max_requests=10)
    async with Client(bench_server(svc)) as b:
        r = await b.call_tool("run_replay", {"endpoint": stub, "trace": "mc.jsonl",
                                             "start_s": 0, "duration_s": 10})
        assert r.is_error and "at most 10 requests" in r.content[0].text
        r = await b.call_tool("run_saturation", {"endpoint": stub, "isl": 8, "osl": 2,
                                                 "concurrency": 3, "duration_s": 30})
        res = r.structured_content
        assert res["summary"]["requests"] == 10 and res["wall_s"] < 5
        assert "clients stopped after 10 requests" in res["workload"]["description"]


async def test_replay_runner_aiperf_is_for_http_targets_and_names_its_install(tmp_path, stub,
                                                                              monkeypatch):
    trace = mooncake_file(tmp_path / "mc.jsonl")
    backend = TwinBackend()
    backend.deploy("d1", ServingConfig(**config()), {})
    monkeypatch.setenv("SERVETUNE_AIPERF", str(tmp_path / "no-aiperf"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no aiperf on PATH either
    async with Client(bench_server(service(tmp_path, backend, roots=[tmp_path]))) as b:
        twin = await b.call_tool("run_replay", {"deployment": "d1", "trace": trace.name,
                                                "start_s": 0, "duration_s": 10,
                                                "runner": "aiperf"})
        http = await b.call_tool("run_replay", {"endpoint": stub, "trace": trace.name,
                                                "format": "mooncake", "start_s": 0,
                                                "duration_s": 10, "runner": "aiperf"})
        bad = await b.call_tool("run_replay", {"endpoint": stub, "trace": trace.name,
                                               "start_s": 0, "duration_s": 10,
                                               "runner": "guidellm"})
    assert twin.is_error and "runner aiperf loads HTTP endpoints" in twin.content[0].text
    assert http.is_error and "SERVETUNE_AIPERF" in http.content[0].text
    assert bad.is_error


@pytest.mark.skipif(not (os.environ.get("SERVETUNE_AIPERF") or shutil.which("aiperf")),
                    reason="needs aiperf 0.13.0 (SERVETUNE_AIPERF or PATH)")
async def test_http_replay_with_real_aiperf(tmp_path, stub):
    mooncake_file(tmp_path / "mc.jsonl")
    async with Client(bench_server(service(tmp_path, roots=[tmp_path]))) as b:
        r = await b.call_tool("run_replay", {"endpoint": stub, "trace": "mc.jsonl",
                                             "format": "mooncake", "start_s": 0,
                                             "duration_s": 10, "time_scale": 2.0,
                                             "runner": "aiperf"})
    assert not r.is_error, r.content
    res = r.structured_content
    assert res["summary"]["errors"] == 0 and res["summary"]["completed"] > 0
    assert res["valid"] and res["dispatch_lag_ms"]["p50"] is not None


class ClusterLike:
    """A backend of kind ``kubernetes`` whose one Ready deployment serves at ``url``."""

    kind, namespace = "kubernetes", "sandbox"

    def __init__(self, url: str) -> None:
        self.url = url

    def status(self, name: str) -> DeploymentStatus:
        return DeploymentStatus(name=name, namespace=self.namespace, phase="Ready", replicas=1,
                                ready_replicas=1, config=ServingConfig(**config()),
                                endpoints=[self.url], created_at=time.time())


def test_auto_runner_is_aiperf_for_cluster_deployments_when_installed(tmp_path, stub,
                                                                      monkeypatch):
    fake = tmp_path / "bin" / "aiperf"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("SERVETUNE_AIPERF", str(fake))
    twin = TwinBackend()
    twin.deploy("d1", ServingConfig(**config()), {})
    on_twin = service(tmp_path, twin)
    assert on_twin.pick_runner(on_twin._target("d1", None, None), "auto") == "builtin"
    cluster = service(tmp_path, ClusterLike(stub))
    dep = cluster._target("d1", None, None)
    assert cluster.pick_runner(dep, "auto") == "aiperf"
    assert cluster.pick_runner(dep, "builtin") == "builtin"
    # an endpoint given by URL is not a cluster deployment: the built-in runner
    assert cluster.pick_runner(cluster._target(None, stub, None), "auto") == "builtin"
    forced = BenchService(ClusterLike(stub), tmp_path / "r2", [TRACES], LOCAL,
                          default_runner="builtin")
    assert forced.pick_runner(dep, "auto") == "builtin"
    # not installed: auto falls back to the built-in runner, an explicit aiperf is refused
    monkeypatch.setenv("SERVETUNE_AIPERF", str(tmp_path / "missing"))
    assert cluster.pick_runner(dep, "auto") == "builtin"
    with pytest.raises(Exception, match="SERVETUNE_AIPERF"):
        cluster.pick_runner(dep, "aiperf")


@pytest.mark.skipif(not (os.environ.get("SERVETUNE_AIPERF") or shutil.which("aiperf")),
                    reason="needs aiperf 0.13.0 (SERVETUNE_AIPERF or PATH)")
async def test_cluster_saturation_and_rate_run_with_aiperf_by_default(tmp_path, stub):
    async with Client(bench_server(service(tmp_path, ClusterLike(stub)))) as b:
        sat = await b.call_tool("run_saturation", {"deployment": "d1", "isl": 32, "osl": 4,
                                                   "concurrency": 2, "duration_s": 2})
        rate = await b.call_tool("run_rate", {"deployment": "d1", "isl": 32, "osl": 4,
                                              "request_rate": 10, "duration_s": 2,
                                              "arrival": "constant"})
    for r in (sat, rate):
        assert not r.is_error, r.content
        res = r.structured_content
        assert res["client"].startswith("aiperf") and res["valid"]
        assert res["summary"]["completed"] > 0 and res["summary"]["errors"] == 0
