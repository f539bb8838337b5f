"""Hardening of the bench MCP server (issue 16): through mcp.Client and the CLI.

- D1: the endpoint allow-list scopes paths after RFC 3986 normalisation (a loopback HTTP server
  records the paths it receives).
- D9: twin runs are bounded by a compute budget (refused up front, stopped in the loop, shared by
  a sweep) and stop within a second of the client's cancel.
- D10: a trace line of deeply nested JSON is a one-line trace error (MCP and CLI).
- D11: a trace path component over 255 characters is a one-line error (MCP and CLI).
- Strict types: numbers and booleans of bench tool arguments are not coerced.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import yaml
from fixtures.cli_runner import invoke
from mcp import Client

from domain.config import ServingConfig
from mcp_servers.bench.ops import BenchService
from mcp_servers.bench.server import build_server as bench_server
from mcp_servers.bench.targets import twin as ops  # the twin target runs the estimates
from mcp_servers.cluster.backend import BackendError
from mcp_servers.cluster.twin import TwinBackend

pytestmark = pytest.mark.anyio
REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "studies" / "default.yaml"
SMALL = {"isl": 8, "osl": 4, "concurrency": 1, "duration_s": 0.2}
CONFIG = dict(model="glm-5", gpu="B200", tp_size=8, replicas=1, weights="fp8",
              kv_cache_dtype="bf16", mem_fraction_static=0.85)


def twin(name: str = "d1") -> TwinBackend:
    backend = TwinBackend()
    backend.deploy(name, ServingConfig(**CONFIG), {})
    return backend


def servetune(*args: str, cwd: Path, stdin: int | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI in a subprocess; ``stdin=subprocess.DEVNULL`` lets a server it starts see EOF."""
    env = dict(os.environ, SERVETUNE_LESSONS_DIR=str(cwd / "lessons"), COLUMNS="200",
               SERVETUNE_SOURCE_CACHE=str(cwd / "no-source"))
    env.pop("SERVETUNE_SGLANG_SOURCE", None)
    return subprocess.run([sys.executable, "-m", "servetune.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, stdin=stdin)


def study_with_trace(tmp: Path, trace: str) -> Path:
    s = yaml.safe_load(DEFAULT.read_text())
    s["replay"].update(trace=trace, format="mooncake", start_s=0, duration_s=60)
    p = tmp / "study.yaml"
    p.write_text(yaml.safe_dump(s))
    return p


def one_line_error(text: str) -> bool:
    return "\n" not in text.strip() and "Traceback" not in text


# --------------------------------------------------------------------------- D1

@contextlib.asynccontextmanager
async def recording_server(seen: list[str]) -> AsyncIterator[str]:
    """A loopback HTTP server that records each request's path and answers 404."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            seen.append(lines[0].split(" ")[1])
            length = next((int(ln.split(":", 1)[1]) for ln in lines
                           if ln.lower().startswith("content-length:")), 0)
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n"
                         b"Connection: close\r\n\r\n")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("tail", [
    "/team-a/../team-b", "/team-a/%2e%2e/team-b", "/team-a/%2E%2E/team-b",
    "/team-a/.%2e/team-b", "/team-a/./../team-b", "/team-a/%2e%2e%2fteam-b",
    "/team-a/x/%2E%2E/%2e%2e/team-b", "/team-a/..", "/team-a\\..\\team-b",
    "/team-a/%74eam-b",
    # f3: what a proxy or servlet container may still read as '..' (fresh-user item 7)
    "/team-a/%252e%252e/team-b", "/team-a/%252E%252E/team-b", "/team-a/%2/team-b",
    "/team-a/..;/team-b", "/team-a/..;jsessionid=x/team-b", "/team-a/..%3b/team-b",
    "/team-a/..%00/team-b", "/team-a/..%1f/team-b", "/team-a/..%7F/team-b",
    "/team-a/..\x00/team-b", "/team-a/.\t./team-b", "/team-a/team-\tb",
    "/team-a/.. /team-b", "/team-a/..%20/team-b", "/team-a/..%09/team-b",
    "/team-a/\uff0e\uff0e/team-b", "/team-a/%EF%BC%8E%EF%BC%8E/team-b",
    "/team-a/%c0%ae%c0%ae/team-b",
], ids=["dotdot", "pct-dotdot", "pct-DOTDOT", "mixed", "dot-dotdot", "pct-slash",
        "nested", "trailing-dotdot", "backslash", "pct-unreserved",
        "double-encoded", "double-encoded-upper", "pct-malformed",
        "semicolon", "semicolon-param", "pct-semicolon",
        "pct-nul", "pct-ctrl", "pct-del", "raw-nul", "raw-tab", "raw-tab-in-name",
        "space", "pct-space", "pct-tab",
        "fullwidth-dots", "pct-fullwidth-dots", "overlong-utf8-dots"])
async def test_d1_allow_list_path_scope_survives_normalisation(tmp_path, tail):
    seen: list[str] = []
    async with recording_server(seen) as base:
        svc = BenchService(TwinBackend(), tmp_path / "rec", [], [base + "/team-a"])
        async with Client(bench_server(svc)) as b:
            r = await b.call_tool("run_saturation", {"endpoint": base + tail, **SMALL})
            text = r.content[0].text
            assert r.is_error, f"{tail!r} ran; the server saw {sorted(set(seen))}"
            assert not any("team-b" in p for p in seen), seen
            assert one_line_error(text), text
            assert "run_saturation: endpoint " in text, text  # names the problem: no crash
            # the scope itself still works: requests go under /team-a/
            r = await b.call_tool("run_saturation", {"endpoint": base + "/team-a", **SMALL})
            assert not r.is_error, r.content[0].text
    assert seen and all(p.startswith("/team-a/") for p in seen), seen


def test_d1_allow_list_entry_must_be_normal(tmp_path):
    for entry in ("http://127.0.0.1/team-a/../team-b", "http://127.0.0.1/team-a/%2e%2e/x"):
        with pytest.raises(BackendError, match="allowed endpoint"):
            BenchService(TwinBackend(), tmp_path / "rec", [], [entry])


@pytest.mark.parametrize("path", [
    "/team-a/%252e%252e/x", "/team-a/..;/x", "/team-a;v=1", "/team-a/..%00/x", "/team-a\x00",
    "/team-a/.. /x", "/team-a/..%20/x", "/team-a/\uff0e\uff0e/x", "/team-a/%EF%BC%8E/x",
    "/team-a/%zz",
], ids=["double-encoded", "semicolon", "path-param", "pct-nul", "raw-nul", "space", "pct-space",
        "fullwidth-dots", "pct-non-ascii", "pct-malformed"])
def test_d1_allow_list_entry_refuses_ambiguous_paths(tmp_path, path):
    with pytest.raises(BackendError, match="allowed endpoint") as e:
        BenchService(TwinBackend(), tmp_path / "rec", [], ["http://127.0.0.1:8000" + path])
    assert one_line_error(str(e.value)), str(e.value)


def test_d1_cli_refuses_an_ambiguous_allow_list_entry(tmp_path):
    out = invoke("mcp", "bench", "--state-dir", str(tmp_path / "state"),
                 "--allow-endpoint", "http://127.0.0.1:8000/team-a/..;/team-b", tmp=tmp_path)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stderr.startswith("error: ") and "';'" in out.stderr, out.stderr
    assert one_line_error(out.stderr), out.stderr


@pytest.mark.parametrize("entry, tail", [
    ("", ""), ("", "/"), ("", "/v1"), ("/team-a", "/team-a"), ("/team-a", "/team-a/"),
    ("/team-a", "/team-a/v1"), ("/team-a", "/team-a/v1/"), ("/team-a/", "/team-a/x-1_~y/v1"),
    ("/team-a", "/team-a/m:1@b!$&'()*+,=/v1"), ("/team-a", "/team-a/%3A%40"),
], ids=["bare", "bare-slash", "bare-v1", "scope", "scope-slash", "scope-v1", "scope-v1-slash",
        "sub-unreserved", "sub-delims", "pct-reserved"])
async def test_d1_legitimate_endpoints_still_run(tmp_path, entry, tail):
    seen: list[str] = []
    async with recording_server(seen) as base:
        svc = BenchService(TwinBackend(), tmp_path / "rec", [], [base + entry])
        async with Client(bench_server(svc)) as b:
            r = await b.call_tool("run_saturation", {"endpoint": base + tail, **SMALL})
            assert not r.is_error, r.content[0].text
    assert seen, seen


# --------------------------------------------------------------------------- D9

HUGE = {"isl": 4096, "osl": 4096, "concurrency": 100_000, "duration_s": 3600}
# simulation-heavy: ~10 s of simulation on a loaded 2-core machine, then far more to summarise
HEAVY = {"isl": 4096, "osl": 4096, "concurrency": 30_000, "duration_s": 1}


def no_estimate(monkeypatch):
    """Let every run past the up-front estimate, to reach the checks inside the loop."""
    monkeypatch.setattr(ops, "estimate_closed_loop",
                        lambda *a, **k: ops.SimCost(steps=0, requests=0, tokens=0))


def simulating() -> bool:
    """Whether some thread is inside the twin's simulation loops now."""
    return any(f.f_code.co_filename.endswith(("twin/engine.py", "twin/cluster.py"))
               for frame in sys._current_frames().values()
               for f in _walk(frame))


def _walk(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back


async def test_d9_huge_twin_run_is_refused_naming_limit_and_cost(tmp_path):
    svc = BenchService(twin(), tmp_path / "rec", [], [], compute_budget_s=1.0)
    async with Client(bench_server(svc)) as b:
        t0 = time.monotonic()
        r = await b.call_tool("run_saturation", {"deployment": "d1", **HUGE})
        took = time.monotonic() - t0
        sweep = await b.call_tool("run_sweep", {
            "deployment": "d1", "isl": 4096, "osl": 4096, "duration_s": 3600,
            "concurrencies": [100_000] * 32})
    text = r.content[0].text
    assert r.is_error and took < 2.0, (took, text)
    assert "compute budget" in text and "1 s" in text and "estimated" in text, text
    assert one_line_error(text), text
    assert sweep.is_error and "compute budget" in sweep.content[0].text


async def test_d9_sweep_shares_one_budget(tmp_path):
    """Each point fits the budget alone; all 32 together do not: refused before any runs."""
    svc = BenchService(twin(), tmp_path / "rec", [], [], compute_budget_s=1.0)
    point = {"isl": 512, "osl": 512, "concurrencies": [512], "duration_s": 60}
    async with Client(bench_server(svc)) as b:
        one = await b.call_tool("run_sweep", {"deployment": "d1", **point})
        assert not one.is_error, one.content[0].text
        t0 = time.monotonic()
        r = await b.call_tool("run_sweep", {"deployment": "d1", **point,
                                            "concurrencies": [512] * 32})
    assert r.is_error and time.monotonic() - t0 < 2.0
    assert "compute budget" in r.content[0].text and "32" in r.content[0].text


async def test_d9_budget_stops_the_simulation_loop(tmp_path, monkeypatch):
    """A run the up-front estimate lets through still stops at the budget while simulating."""
    no_estimate(monkeypatch)
    svc = BenchService(twin(), tmp_path / "rec", [], [], compute_budget_s=0.5)
    async with Client(bench_server(svc)) as b:
        t0 = time.monotonic()
        r = await b.call_tool("run_saturation", {"deployment": "d1", **HEAVY})
        took = time.monotonic() - t0
    text = r.content[0].text
    # the budget (0.5 s) stops it, not the run's end; the bound leaves room for a loaded machine
    assert r.is_error and took < 0.5 + 4.5, (took, text)
    assert "compute budget" in text and "0.5 s" in text, text
    assert one_line_error(text), text
    assert not simulating()


async def test_d9_client_cancel_stops_the_simulation(tmp_path, monkeypatch):
    no_estimate(monkeypatch)
    svc = BenchService(twin(), tmp_path / "rec", [], [])  # the default budget
    async with Client(bench_server(svc)) as b:
        with anyio.move_on_after(1.0) as scope:
            await b.call_tool("run_saturation", {"deployment": "d1", **HEAVY})
        assert scope.cancelled_caught, "the run finished before the cancel"
        cancelled = time.monotonic()
        while simulating() and time.monotonic() - cancelled < 3.0:
            await anyio.sleep(0.05)
        stopped_after = time.monotonic() - cancelled
        assert stopped_after < 1.0, f"still simulating {stopped_after:.1f} s after the cancel"
        r = await b.call_tool("list_runs", {})  # the server still answers
        assert not r.is_error


@pytest.mark.parametrize("value", ["inf", "-inf", "1e999", "nan", "0", "-1"])
def test_d9_cli_refuses_an_unbounded_or_empty_budget(tmp_path, value):
    out = invoke("mcp", "bench", "--state-dir", str(tmp_path / "state"),
                 f"--compute-budget-s={value}", tmp=tmp_path)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "compute-budget-s" in out.stderr or "compute budget" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0.0, -1.0])
def test_d9_service_refuses_an_unbounded_or_empty_budget(tmp_path, value):
    with pytest.raises(BackendError, match="compute budget") as e:
        BenchService(TwinBackend(), tmp_path / "rec", [], [], compute_budget_s=value)
    assert one_line_error(str(e.value)), str(e.value)


def test_d9_cli_states_the_default_budget(tmp_path):
    out = servetune("mcp", "bench", "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    flat = " ".join(out.stdout.split())
    assert "--compute-budget-s" in flat and "60" in flat, out.stdout


# --------------------------------------------------------------------------- D10, D11

def deep_trace(folder: Path) -> Path:
    good = json.dumps({"timestamp": 0, "input_length": 100, "output_length": 10,
                       "hash_ids": [1]})
    p = folder / "deep.jsonl"
    p.write_text(good + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    return p


@pytest.mark.parametrize("fmt", ["auto", "mooncake", "bailian"])
async def test_d10_deeply_nested_trace_line_is_a_trace_error(tmp_path, fmt):
    deep_trace(tmp_path)
    svc = BenchService(twin(), tmp_path / "rec", [tmp_path], [])
    async with Client(bench_server(svc)) as b:
        r = await b.call_tool("run_replay", {"deployment": "d1", "trace": "deep.jsonl",
                                             "format": fmt, "start_s": 0, "duration_s": 60})
    text = r.content[0].text
    assert r.is_error and "deep.jsonl:2:" in text and "nest" in text, text
    assert one_line_error(text), text


def test_d10_deeply_nested_trace_in_a_study_is_one_line(tmp_path):
    study = study_with_trace(tmp_path, str(deep_trace(tmp_path)))
    out = invoke("run", str(study), "--out", str(tmp_path / "runs"), tmp=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    err = out.stderr.strip()
    assert err.startswith("error:") and "deep.jsonl:2:" in err and one_line_error(err), err


LONG = "x" * 300


@pytest.mark.parametrize("trace", [LONG + ".jsonl", f"{LONG}/t.jsonl", f"sub/{LONG}.jsonl"],
                         ids=["file", "folder", "nested"])
async def test_d11_over_long_trace_path_component(tmp_path, trace):
    svc = BenchService(twin(), tmp_path / "rec", [tmp_path], [])
    async with Client(bench_server(svc)) as b:
        r = await b.call_tool("run_replay", {"deployment": "d1", "trace": trace,
                                             "start_s": 0, "duration_s": 60})
    text = r.content[0].text
    assert r.is_error and "255" in text and one_line_error(text), text


@pytest.mark.parametrize("relative", [True, False], ids=["relative", "absolute"])
def test_d11_over_long_trace_path_in_a_study(tmp_path, relative):
    trace = f"{LONG}/t.jsonl" if relative else str(tmp_path / LONG / "t.jsonl")
    out = invoke("run", str(study_with_trace(tmp_path, trace)), "--out",
                 str(tmp_path / "runs"), tmp=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    err = out.stderr.strip()
    assert err.startswith("error:") and "255" in err and one_line_error(err), err


# --------------------------------------------------------------------------- strict types

SAT = {"deployment": "d1", "isl": 64, "osl": 8, "concurrency": 2, "duration_s": 1}


@pytest.mark.parametrize("tool, args", [
    ("run_saturation", {**SAT, "concurrency": True}),
    ("run_saturation", {**SAT, "concurrency": "8"}),
    ("run_saturation", {**SAT, "concurrency": 8.5}),
    ("run_saturation", {**SAT, "isl": "64"}),
    ("run_saturation", {**SAT, "duration_s": True}),
    ("run_saturation", {**SAT, "duration_s": "1"}),
    ("run_saturation", {**SAT, "repeat": False}),
    ("run_saturation", {**SAT, "max_error_share": True}),
    ("run_rate", {"deployment": "d1", "isl": 64, "osl": 8, "request_rate": True,
                  "duration_s": 1}),
    ("run_rate", {"deployment": "d1", "isl": 64, "osl": 8, "request_rate": 2,
                  "duration_s": 1, "seed": "3"}),
    ("run_replay", {"deployment": "d1", "trace": "mooncake_fast25_conversation_trace.jsonl",
                    "start_s": "0", "duration_s": 10}),
    ("run_replay", {"deployment": "d1", "trace": "mooncake_fast25_conversation_trace.jsonl",
                    "start_s": 0, "duration_s": 10, "time_scale": True}),
    ("run_sweep", {"deployment": "d1", "isl": 64, "osl": 8, "concurrencies": [True, "4"],
                   "duration_s": 1}),
    ("run_greedy", {"deployment": "d1", "max_tokens": True}),
    ("get_records", {"bench_id": "RUN", "include_itl": 1}),
    ("get_records", {"bench_id": "RUN", "start": True}),
    ("list_runs", {"max_items": "5"}),
], ids=["conc-true", "conc-str", "conc-frac", "isl-str", "dur-true", "dur-str", "repeat-false",
        "share-true", "rate-true", "seed-str", "start-str", "scale-true", "sweep-mixed",
        "greedy-true", "itl-int", "start-true", "max-str"])
async def test_bench_tool_numbers_and_booleans_are_strict(tmp_path, tool, args):
    svc = BenchService(twin(), tmp_path / "rec", [REPO / "data" / "traces"], [])
    async with Client(bench_server(svc)) as b:
        if args.get("bench_id") == "RUN":
            ok = await b.call_tool("run_saturation", SAT)
            args = {**args, "bench_id": ok.structured_content["bench_id"]}
        r = await b.call_tool(tool, args)
    assert r.is_error, f"{tool} {args} was coerced and ran"
    assert "valid" in r.content[0].text, r.content[0].text
