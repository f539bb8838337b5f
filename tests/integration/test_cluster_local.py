"""The local-process cluster backend with the OpenAI-compatible stub server as the engine.

Through mcp.Client (in memory and over stdio): Ready, a failed startup, a crash while serving,
Pending then polled, logs by time and tail, events, teardown that stops the whole process group
by PID (and never a recycled PID), records shared with a second backend instance; a corrupt or
tampered record (reported, torn down from the pid files, moved aside), log paths confined to the
deployment's folder, GPUs allocated across deployments, settings refused at construction.
Every test tears down what it started (the ``local`` fixture's finalizer).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from mcp import Client, StdioServerParameters

from domain.config import ServingConfig
from domain.engines.sglang.failures import classify
from mcp_servers.cluster import ops
from mcp_servers.cluster.backend import BackendError, CorruptRecord
from mcp_servers.cluster.local import LocalProcessBackend
from mcp_servers.cluster.procs import group_members, proc_stat, running
from mcp_servers.cluster.server import build_server as cluster_server

pytestmark = pytest.mark.anyio
REPO = Path(__file__).resolve().parents[2]
STUB = str(REPO / "tests" / "fixtures" / "openai_stub.py")
NS = "local-test"



def config(**kw):
    c = dict(model="glm-5", gpu="B200", tp_size=8, replicas=1, weights="nvfp4")
    c.update(kw)
    return c


def stub(*extra: str, pre: str = "") -> list[str]:
    """argv of the stub server; ``pre`` is Python run first in the same process."""
    if not pre:
        return [sys.executable, STUB, "--host", "{host}", "--port", "{port}", *extra]
    code = (f"{pre}\nimport runpy, sys\nsys.argv = ['openai_stub'] + sys.argv[1:]\n"
            f"runpy.run_path({STUB!r}, run_name='__main__')")
    return [sys.executable, "-c", code, "--host", "{host}", "--port", "{port}", *extra]


@pytest.fixture
def local(tmp_path):
    """Factory of LocalProcessBackends over one state folder; tears every deployment down."""
    made: list[LocalProcessBackend] = []

    def make(command: list[str] | None = None, **kw) -> LocalProcessBackend:
        b = LocalProcessBackend(NS, tmp_path, command=command or stub(), **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        for d in b.list():
            if d.phase != "Terminated":
                b.teardown(d.name)


def gone(pid: int) -> bool:
    """No such process any more: not running, and not left as a zombie either."""
    return proc_stat(pid) is None


async def poll(c: Client, name: str, until: tuple[str, ...], timeout_s: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        st = (await c.call_tool("get_status", {"name": name})).structured_content
        if st["phase"] in until or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


async def test_deploy_ready_endpoints_events_and_teardown_by_pid(local):
    backend = local(stub("--startup-s", "0.3"))
    progress: list[tuple[float, float | None, str | None]] = []

    async def on_progress(p, total, message):
        progress.append((p, total, message))

    async with Client(cluster_server(backend)) as c:
        t0 = time.perf_counter()
        r = await c.call_tool("deploy", {"name": "two", "config": config(replicas=2),
                                         "wait_s": 20}, progress_callback=on_progress)
        ready_s = time.perf_counter() - t0
        assert not r.is_error, r.content
        st = r.structured_content
        assert (st["phase"], st["replicas"], st["ready_replicas"]) == ("Ready", 2, 2)
        assert 0.3 < st["startup_s"] < 15 and st["failed_stage"] is None
        assert st["message"] == "The server is fired up and ready to roll!"
        assert len(st["endpoints"]) == 2 and len(set(st["endpoints"])) == 2
        for url in st["endpoints"]:
            assert url.startswith("http://127.0.0.1:")
            h = httpx.get(url + "/v1/models", trust_env=False)
            assert h.json()["data"][0]["id"] == "stub-model"
        assert progress and progress[0][1] == 20 and "replicas ready" in progress[0][2]
        ev = (await c.call_tool("get_events", {"name": "two"})).structured_content["events"]
        assert [e["reason"] for e in ev] == ["Created", "Started", "Started", "Ready", "Ready"]
        assert all(e["type"] == "Normal" and e["object"] == "two" for e in ev)
        listed = (await c.call_tool("list_deployments", {})).structured_content["result"]
        assert [(d["name"], d["phase"]) for d in listed] == [("two", "Ready")]
        pids = backend.processes("two")
        assert all(running(p, proc_stat(p).start_ticks) for p in pids)
        t0 = time.perf_counter()
        down = (await c.call_tool("tear_down", {"name": "two"})).structured_content
        teardown_s = time.perf_counter() - t0
        assert (down["phase"], down["endpoints"], down["ready_replicas"]) == (
            "Terminated", [], 0)
        assert all(gone(p) for p in pids)  # killed and reaped: no zombie left
        ev = (await c.call_tool("get_events", {"name": "two", "start": 5})).structured_content
        assert [e["reason"] for e in ev["events"]] == ["Killing", "Killing", "Stopped"]
        again = (await c.call_tool("tear_down", {"name": "two"})).structured_content
        assert again["phase"] == "Terminated"
    print(f"\nlocal stub x2: deploy->Ready {ready_s:.2f} s (startup 0.3 s), teardown "
          f"{teardown_s:.3f} s")


async def test_failed_startup_is_classified_from_the_log(local):
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    backend = local(stub("--fail", oom))
    async with Client(cluster_server(backend)) as c:
        st = (await c.call_tool("deploy", {"name": "oom", "config": config(),
                                           "wait_s": 20})).structured_content
        assert (st["phase"], st["failed_stage"], st["exit_code"]) == ("Failed", "startup", 1)
        assert st["message"] == oom and st["endpoints"] == []
        lines = (await c.call_tool("get_logs", {"name": "oom", "tail": 40})).structured_content
        assert lines["lines"][0].startswith("server_args=stub")
        assert classify(lines["lines"]) == ("OOM_WEIGHTS", oom)
        ev = (await c.call_tool("get_events", {"name": "oom"})).structured_content["events"]
        assert ev[-1]["type"] == "Warning" and ev[-1]["reason"] == "Failed"
        assert "exited with code 1 during startup: " + oom in ev[-1]["message"]


async def test_crash_while_serving_is_failed_stage_serving(local):
    backend = local(stub("--die-after-s", "0.5"))
    async with Client(cluster_server(backend)) as c:
        st = (await c.call_tool("deploy", {"name": "crash", "config": config(),
                                           "wait_s": 20})).structured_content
        assert st["phase"] == "Ready"
        st = await poll(c, "crash", ("Failed",))
        assert (st["phase"], st["failed_stage"], st["exit_code"]) == ("Failed", "serving", 1)
        assert st["message"] == "RuntimeError: stub server died (--die-after-s)"
        assert st["endpoints"] == [] and st["ready_replicas"] == 0


async def test_pending_then_polled_until_ready(local):
    backend = local(stub("--startup-s", "1.0"))
    async with Client(cluster_server(backend)) as c:
        st = (await c.call_tool("deploy", {"name": "slow", "config": config(),
                                           "wait_s": 0})).structured_content
        assert (st["phase"], st["endpoints"], st["startup_s"]) == ("Pending", [], 0.0)
        st = await poll(c, "slow", ("Ready", "Failed"))
        assert st["phase"] == "Ready" and st["startup_s"] >= 1.0


async def test_ready_timeout_fails_the_deployment(local):
    backend = local(stub("--startup-s", "30"), ready_timeout_s=0.5)
    st = ops.deploy(backend, "never", ServingConfig(**config()), wait_s=10)
    assert (st.phase, st.failed_stage, st.exit_code) == ("Failed", "startup", None)
    assert st.message.startswith("replica 0 not ready after 0.5 s; last log line: "
                                 "server_args=stub")
    assert backend.events("never")[-1].reason == "Unhealthy"
    pid = backend.processes("never")[0]
    assert backend.teardown("never").phase == "Terminated" and gone(pid)


async def test_logs_since_and_tail(local):
    backend = local(stub("--startup-s", "0.6"))
    async with Client(cluster_server(backend)) as c:
        st = (await c.call_tool("deploy", {"name": "logs", "config": config(),
                                           "wait_s": 20})).structured_content
        assert st["phase"] == "Ready"
        args_line, ready_line = backend.logs("logs")
        assert args_line.text.startswith("server_args=") and ready_line.text.endswith("roll!")
        # stamped when the polling first saw each line on disk: 0.6 s apart, give or take
        assert 0.2 < ready_line.t - args_line.t < 2.0
        since = time.time() - (args_line.t + ready_line.t) / 2
        page = (await c.call_tool("get_logs", {"name": "logs", "since_s": since}))
        assert page.structured_content["lines"] == [ready_line.text]
        page = (await c.call_tool("get_logs", {"name": "logs", "since_s": 3600, "tail": 1}))
        assert page.structured_content["lines"] == [ready_line.text]
        page = (await c.call_tool("get_logs", {"name": "logs", "max_lines": 1}))
        assert (page.structured_content["lines"], page.structured_content["next_start"]) == (
            [args_line.text], 1)
        r = await c.call_tool("get_logs", {"name": "logs", "replica": 3})
        assert r.is_error and "replicas 0..0" in r.content[0].text
        # stamps are persisted: a second instance reads the same times
        assert backend.logs("logs") == LocalProcessBackend(NS, backend._store.root.parent.parent,
                                                           command=stub()).logs("logs")


async def test_argv_template_config_json_and_visible_devices(local):
    pre = ("import json, os, sys\n"
           "cfg = json.load(open(sys.argv[sys.argv.index('--cfg') + 1]))\n"
           "print('devices', os.environ['CUDA_VISIBLE_DEVICES'], cfg['model'], flush=True)")
    backend = local(stub("--cfg", "{config_json}", pre=pre),
                    visible_devices=["0", "1", "2", "3", "4"])
    st = ops.deploy(backend, "gpus", ServingConfig(**config(tp_size=2, replicas=2)), wait_s=20)
    assert st.phase == "Ready", st.message
    assert backend.logs("gpus", replica=0)[0].text == "devices 0,1 glm-5"
    assert backend.logs("gpus", replica=1)[0].text == "devices 2,3 glm-5"
    with pytest.raises(Exception, match="needs 6 GPUs"):
        ops.deploy(backend, "big", ServingConfig(**config(tp_size=3, replicas=2)))


async def test_missing_server_program_and_default_sglang_argv(tmp_path):
    b = LocalProcessBackend(NS, tmp_path, command=None)  # sglang is not installed here
    async with Client(cluster_server(b)) as c:
        r = await c.call_tool("deploy", {"name": "real", "config": config()})
        assert r.is_error and "could not start 'sglang'" in r.content[0].text
        assert (await c.call_tool("list_deployments", {})).structured_content["result"] == []


async def test_teardown_stops_the_whole_process_group(local):
    # the server forks a helper (like SGLang's scheduler processes) into its process group
    pre = ("import subprocess, sys\n"
           "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])")
    backend = local(stub(pre=pre))
    st = ops.deploy(backend, "group", ServingConfig(**config()), wait_s=20)
    assert st.phase == "Ready"
    (pid,) = backend.processes("group")
    helpers = [p for p in group_members(pid) if p != pid]
    assert len(helpers) == 1
    ticks = proc_stat(helpers[0]).start_ticks
    backend.teardown("group")
    assert gone(pid) and not running(helpers[0], ticks)


async def test_teardown_stops_the_group_after_its_leader_was_killed(local, tmp_path):
    """A shell that backgrounds a helper and execs the server; the server is kill -9'd: the
    teardown still stops the helper (the group has outlived its leader), so nothing of the
    deployment keeps the GPUs it is given back."""
    helper_pid = tmp_path / "helper.pid"
    script = (f"sleep 297 & echo $! > {helper_pid}; exec {sys.executable} {STUB} "
              "--host {host} --port {port}")
    backend = local(["/bin/sh", "-c", script], visible_devices=["0", "1"])
    async with Client(cluster_server(backend)) as c:
        r = await c.call_tool("deploy", {"name": "forks", "config": config(tp_size=2),
                                         "wait_s": 20})
        assert r.structured_content["phase"] == "Ready", r.content
        (main,) = backend.processes("forks")
        sleep = int(helper_pid.read_text())
        ticks = proc_stat(sleep).start_ticks
        os.kill(main, signal.SIGKILL)
        assert (await poll(c, "forks", ("Failed",)))["phase"] == "Failed"
        r = await c.call_tool("tear_down", {"name": "forks"})
        assert r.structured_content["phase"] == "Terminated", r.content
        try:
            assert not running(sleep, ticks), "the helper outlived the teardown"
        finally:
            if running(sleep, ticks):
                os.kill(sleep, signal.SIGKILL)
        events = [e.message for e in backend.events("forks") if e.reason == "Killing"]
        assert events and "process group" in events[0]


async def test_a_group_without_the_replicas_token_is_not_signalled(local, tmp_path):
    """Once the leader has exited, the group id alone proves nothing: a record without the
    replica's token (as written before tokens existed) leaves the surviving helper alone."""
    helper_pid = tmp_path / "helper.pid"
    script = (f"sleep 297 & echo $! > {helper_pid}; exec {sys.executable} {STUB} "
              "--host {host} --port {port}")
    backend = local(["/bin/sh", "-c", script])
    assert ops.deploy(backend, "old", ServingConfig(**config()), wait_s=20).phase == "Ready"
    sleep = int(helper_pid.read_text())
    ticks = proc_stat(sleep).start_ticks
    try:
        path = backend._store.root / "old.json"
        rec = json.loads(path.read_text())
        rec["replicas"][0]["token"] = ""
        path.write_text(json.dumps(rec))
        for pf in (backend._store.root / "old").glob("replica-*.pid"):
            pf.write_text(json.dumps({**json.loads(pf.read_text()), "token": ""}))
        os.kill(rec["replicas"][0]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 15
        while backend.status("old").phase != "Failed" and time.monotonic() < deadline:
            time.sleep(0.05)  # the leader is dead (and reaped) before the teardown
        assert backend.teardown("old").phase == "Terminated"
        assert running(sleep, ticks)
        warn = [e.message for e in backend.events("old") if e.reason == "ForeignProcess"]
        assert warn and "SERVETUNE_REPLICA_TOKEN" in warn[0]
    finally:
        if running(sleep, ticks):
            os.kill(sleep, signal.SIGKILL)


@pytest.mark.parametrize(("labels", "needle"), [
    ({"app.kubernetes.io/managed-by": "me"}, "set by servetune"),
    ({"servetune/config-id": "x"}, "set by servetune"),
    ({"servetune/run-id": "bad value!"}, "a value is at most 63"),
    ({"-bad-key": "v"}, "not a valid Kubernetes label key"),
], ids=["managed-by", "config-id", "bad-value", "bad-key"])
async def test_deploy_labels_are_checked_and_recorded(local, labels, needle):
    backend = local()
    async with Client(cluster_server(backend)) as c:
        r = await c.call_tool("deploy", {"name": "lab", "config": config(), "labels": labels})
        assert r.is_error and needle in r.content[0].text, r.content
        assert backend.list() == []
        r = await c.call_tool("deploy", {"name": "lab", "config": config(), "wait_s": 20,
                                         "labels": {"servetune/run-id": "r1"}})
        assert r.structured_content["labels"]["servetune/run-id"] == "r1"
        assert r.structured_content["labels"]["app.kubernetes.io/managed-by"] == "servetune"


async def test_sigterm_ignored_gets_sigkill_after_grace(local):
    pre = "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)"
    backend = local(stub(pre=pre), stop_grace_s=0.3)
    assert ops.deploy(backend, "stubborn", ServingConfig(**config()), wait_s=20).phase == "Ready"
    (pid,) = backend.processes("stubborn")
    t0 = time.perf_counter()
    backend.teardown("stubborn")
    assert 0.3 <= time.perf_counter() - t0 < 5 and gone(pid)
    kills = [e.message for e in backend.events("stubborn") if e.reason == "Killing"]
    assert "SIGTERM" in kills[0] and "SIGKILL" in kills[1]
    rec = json.loads((backend._store.root / "stubborn.json").read_text())
    assert rec["replicas"][0]["exit_code"] == -signal.SIGKILL


async def test_second_instance_sees_and_tears_down(local):
    a = local()
    b = local()
    assert ops.deploy(a, "shared", ServingConfig(**config()), wait_s=20).phase == "Ready"
    (pid,) = a.processes("shared")
    ticks = proc_stat(pid).start_ticks
    (seen,) = b.list()
    assert (seen.name, seen.phase) == ("shared", "Ready")
    assert seen.endpoints == a.status("shared").endpoints
    assert b.teardown("shared").phase == "Terminated"
    assert not running(pid, ticks)  # b killed it; a, its parent, has not reaped it yet
    st = a.status("shared")  # a reaps its child on every call
    assert st.phase == "Terminated" and gone(pid)


async def test_a_recycled_pid_is_never_signalled(local):
    backend = local()
    assert ops.deploy(backend, "victim", ServingConfig(**config()), wait_s=20).phase == "Ready"
    (real,) = backend.processes("victim")
    ticks = proc_stat(real).start_ticks
    foreign = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                               start_new_session=True)
    try:
        # the record now names a PID that belongs to another process (as after PID reuse):
        # same number, different start time
        path = backend._store.root / "victim.json"
        rec = json.loads(path.read_text())
        rec["replicas"][0]["pid"] = foreign.pid
        path.write_text(json.dumps(rec))
        assert backend.teardown("victim").phase == "Terminated"
        assert foreign.poll() is None  # still running
        warn = [e for e in backend.events("victim") if e.reason == "ForeignProcess"]
        assert warn and warn[0].type == "Warning" and str(foreign.pid) in warn[0].message
        # the replica's pid file still named the real server: it was stopped all the same
        assert not running(real, ticks)
    finally:
        foreign.kill()
        foreign.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(real, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while not gone(real) and time.monotonic() < deadline:
            backend.list()  # reaps the real server once the kill has landed
            time.sleep(0.02)
    assert gone(real)


async def test_local_server_over_stdio_and_a_second_process(tmp_path):
    cmd = stub("--startup-s", "0.2")
    params = StdioServerParameters(
        command=sys.executable,
        args=["-c", "from pathlib import Path; from mcp_servers.cluster.server import main; "
              f"main('local', {NS!r}, Path({str(tmp_path)!r}), {cmd!r})"],
        cwd=str(REPO))
    here = LocalProcessBackend(NS, tmp_path, command=cmd)
    try:
        async with Client(params) as c:
            st = (await c.call_tool("deploy", {"name": "s1", "config": config(),
                                               "wait_s": 20})).structured_content
            assert (st["phase"], st["namespace"]) == ("Ready", NS)
            st2 = (await c.call_tool("deploy", {"name": "s2", "config": config(),
                                                "wait_s": 20})).structured_content
            assert st2["phase"] == "Ready"
            seen = here.status("s1")  # this process sees what the stdio server started
            assert seen.phase == "Ready" and seen.endpoints == st["endpoints"]
            assert httpx.get(seen.endpoints[0] + "/health", trust_env=False).status_code == 200
            logs = (await c.call_tool("get_logs", {"name": "s1"})).structured_content["lines"]
            assert logs[-1] == "The server is fired up and ready to roll!"
            (pid1,) = here.processes("s1")
            down = (await c.call_tool("tear_down", {"name": "s1"})).structured_content
            assert down["phase"] == "Terminated" and gone(pid1)
        # the stdio server has exited; s2's server outlives it and is torn down from here
        (pid2,) = here.processes("s2")
        ticks = proc_stat(pid2).start_ticks
        assert here.status("s2").phase == "Ready"
        assert here.teardown("s2").phase == "Terminated"
        assert not running(pid2, ticks)
    finally:
        for d in here.list():
            if d.phase != "Terminated":
                here.teardown(d.name)


async def test_corrupt_record_is_reported_and_teardown_still_stops_it(local):
    backend = local()
    for n in ("ok", "bad"):
        assert ops.deploy(backend, n, ServingConfig(**config()), wait_s=20).phase == "Ready"
    (pid,) = backend.processes("bad")
    path = backend._store.root / "bad.json"
    path.write_text(path.read_text()[:100])  # truncated mid-write by hand
    async with Client(cluster_server(backend)) as c:
        listed = await c.call_tool("list_deployments", {})
        assert not listed.is_error, listed.content
        assert [d["name"] for d in listed.structured_content["result"]] == ["ok"]
        ev = (await c.call_tool("get_events", {})).structured_content["events"]
        warn = [e for e in ev if e["reason"] == "CorruptRecord"]
        assert len(warn) == 1 and warn[0]["type"] == "Warning" and warn[0]["object"] == "bad"
        assert str(path) in warn[0]["message"] and "tear_down('bad')" in warn[0]["message"]
        for tool, args in [("get_status", {"name": "bad"}), ("get_logs", {"name": "bad"}),
                           ("get_events", {"name": "bad"}),
                           ("deploy", {"name": "bad", "config": config()})]:
            r = await c.call_tool(tool, args)
            assert r.is_error and str(path) in r.content[0].text, (tool, r.content)
            assert "not valid JSON" in r.content[0].text and "tear_down" in r.content[0].text
        assert running(pid, proc_stat(pid).start_ticks)  # nothing was stopped by the errors
        down = await c.call_tool("tear_down", {"name": "bad"})
        assert not down.is_error, down.content
        st = down.structured_content
        assert st["phase"] == "Terminated" and st["message"].startswith("torn down at ")
        assert gone(pid)  # stopped from its pid file
        (aside,) = backend._store.root.glob("bad.json.*.corrupt")
        assert len(aside.read_text()) == 100  # kept as it was, for a post-mortem
        reasons = [e.reason for e in backend.events("bad")]
        assert reasons[0] == "CorruptRecord" and reasons[-1] == "Stopped"
        again = await c.call_tool("tear_down", {"name": "bad"})  # idempotent
        assert again.structured_content["phase"] == "Terminated"
        r = await c.call_tool("deploy", {"name": "bad", "config": config(), "wait_s": 20})
        assert r.structured_content["phase"] == "Ready", r.content
        reasons = [e.reason for e in backend.events("bad")]  # the earlier run's are kept
        assert reasons[0] == "CorruptRecord" and reasons[-2:] == ["Started", "Ready"]


@pytest.mark.parametrize("tamper, needle", [
    (lambda rec: rec["replicas"][0].update(pid=0), "replicas.0.pid"),
    (lambda rec: rec["replicas"][0].update(start_ticks="soon"), "start_ticks"),
    (lambda rec: rec.pop("config"), "config"),
    (lambda rec: rec.update(name="other"), "names deployment 'other'"),
    (lambda rec: rec["replicas"][0].update(url="http://example.com:80"), "loopback"),
    (lambda rec: rec.update(health_path="@evil.example/"), "health_path"),
    (lambda rec: [rec.clear(), rec.update({"x": [1] * 3})], "invalid fields"),
], ids=["pid-zero", "ticks-type", "no-config", "other-name", "remote-url", "health-path",
        "garbage"])
def test_wrong_fields_are_a_corrupt_record_and_the_pid_file_still_stops_it(local, tamper,
                                                                          needle):
    backend = local()
    assert ops.deploy(backend, "t", ServingConfig(**config()), wait_s=20).phase == "Ready"
    (pid,) = backend.processes("t")
    path = backend._store.root / "t.json"
    rec = json.loads(path.read_text())
    tamper(rec)
    path.write_text(json.dumps(rec))
    with pytest.raises(CorruptRecord, match=needle):
        backend.status("t")
    assert backend.list() == []
    assert [e.reason for e in backend.events()] == ["CorruptRecord"]
    assert backend.teardown("t").phase == "Terminated" and gone(pid)


def test_a_list_record_and_a_record_without_pid_files_or_config(local):
    backend = local()
    assert ops.deploy(backend, "t", ServingConfig(**config()), wait_s=20).phase == "Ready"
    (pid,) = backend.processes("t")
    folder = backend._store.root / "t"
    (folder / "config.json").write_text("{")
    (backend._store.root / "t.json").write_text("[1, 2]")
    with pytest.raises(CorruptRecord, match="JSON list, not an object"):
        backend.status("t")
    with pytest.raises(BackendError, match="moved aside to .*corrupt.*can be deployed again"):
        backend.teardown("t")
    assert gone(pid) and backend.list() == [] and not list(folder.glob("*.pid"))
    assert ops.deploy(backend, "t", ServingConfig(**config()), wait_s=20).phase == "Ready"


async def test_log_path_is_confined_to_the_deployment_folder(local):
    backend = local()
    assert ops.deploy(backend, "lp", ServingConfig(**config()), wait_s=20).phase == "Ready"
    path = backend._store.root / "lp.json"
    good = path.read_text()
    rec = json.loads(good)
    rec["replicas"][0]["log"] = "../../../../../../etc/passwd"
    path.write_text(json.dumps(rec))
    async with Client(cluster_server(backend)) as c:
        r = await c.call_tool("get_logs", {"name": "lp"})
        assert r.is_error and "plain file name" in r.content[0].text
        assert "root:" not in r.content[0].text
        # a symlink planted in the folder is refused as well
        path.write_text(good)
        log = backend._store.root / "lp" / "replica-0.log"
        log.unlink()
        log.symlink_to("/etc/passwd")
        r = await c.call_tool("get_logs", {"name": "lp"})
        assert r.is_error and "outside the deployment's folder" in r.content[0].text
        st = (await c.call_tool("get_status", {"name": "lp"})).structured_content
        assert st["message"].startswith("(log unreadable: ") and "root:" not in st["message"]


async def test_visible_devices_are_allocated_across_deployments(local):
    pre = ("import os\n"
           "print('devices', os.environ['CUDA_VISIBLE_DEVICES'], flush=True)")
    a = local(stub(pre=pre), visible_devices=["0", "1"])
    b = local(stub(pre=pre), visible_devices=["0", "1"])  # a second server, same state
    one = ServingConfig(**config(tp_size=1))
    assert ops.deploy(a, "g1", one, wait_s=20).phase == "Ready"
    assert ops.deploy(b, "g2", one, wait_s=20).phase == "Ready"
    assert a.logs("g1")[0].text == "devices 0" and a.logs("g2")[0].text == "devices 1"
    with pytest.raises(BackendError, match=r"only 0 of the 2 visible devices are free .*"
                       r"GPU 0 by 'g1'; GPU 1 by 'g2'.*Tear down"):
        ops.deploy(a, "g3", one)
    started = [e.message for e in a.events("g2") if e.reason == "Started"]
    assert "CUDA_VISIBLE_DEVICES=1" in started[0]
    a.teardown("g1")
    assert ops.deploy(b, "g3", one, wait_s=20).phase == "Ready"
    assert b.logs("g3")[0].text == "devices 0"
    # a Failed deployment holds its GPUs until it is torn down
    a.teardown("g2")
    bad = local(stub("--fail", "boom", pre=pre), visible_devices=["0", "1"])
    assert ops.deploy(bad, "f1", one, wait_s=20).phase == "Failed"
    with pytest.raises(BackendError, match="GPU 0 by 'g3'; GPU 1 by 'f1'"):
        ops.deploy(a, "g4", one)


@pytest.mark.parametrize("kw, needle", [
    ({"visible_devices": ["0", "0"]}, "listed twice"),
    ({"visible_devices": ["0", "00"]}, "listed twice"),
    ({"visible_devices": ["-1"]}, "neither a non-negative GPU index"),
    ({"visible_devices": ["cuda:0"]}, "neither a non-negative GPU index"),
    ({"visible_devices": []}, "empty"),
    ({"command": ["srv", "--port", "{nope}"]}, r"unknown placeholder \{nope\}.*\{host\}, "
                                               r"\{port\} and \{config_json\}"),
    ({"health_path": "@evil/"}, "health_path"),
], ids=["dup", "dup-int", "negative", "word", "empty", "placeholder", "health-path"])
def test_bad_settings_are_refused_at_construction(tmp_path, kw, needle):
    with pytest.raises(BackendError, match=needle):
        LocalProcessBackend(NS, tmp_path, **{"command": stub(), **kw})
    ok = LocalProcessBackend(NS, tmp_path, command=stub(),
                             visible_devices=["1", "GPU-5c0e4e1a-8a4f-11ee-b9d1-0242ac120002"])
    assert ok.visible_devices == ["1", "GPU-5c0e4e1a-8a4f-11ee-b9d1-0242ac120002"]


def test_teardown_message_and_redeploy_keeps_earlier_events(local):
    backend = local()
    assert ops.deploy(backend, "re", ServingConfig(**config()), wait_s=20).phase == "Ready"
    st = backend.teardown("re")
    assert st.message.startswith("torn down at ") and st.message.endswith(
        "; last log line: The server is fired up and ready to roll!")
    assert ops.deploy(backend, "re", ServingConfig(**config()), wait_s=20).phase == "Ready"
    assert [e.reason for e in backend.events("re")] == [
        "Created", "Started", "Ready", "Killing", "Stopped", "Created", "Started", "Ready"]
