"""The local backend with the pinned sglang-router in front of its replicas (``router="sglang"``).

Two stub servers (tests/fixtures/openai_stub.py, fast to start) behind the real router 0.3.2:
the deployment is Ready once the router answers ``/readiness``, its status names the router, a
bench saturation run goes through it (the replicas' own request counters show the router's
round-robin split), a router killed while serving fails the deployment, teardown stops the
router by its PID, and its log stays in the deployment's folder (one replica gets no router:
``fronted``). Without the package, the backend refuses ``router="sglang"`` with the install command.
Skipped when sglang-router 0.3.2 is not installed (the ``router`` extra).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from domain.config import ServingConfig
from mcp_servers.bench.ops import BenchService
from mcp_servers.cluster import router as router_mod
from mcp_servers.cluster.backend import BackendError, make_backend
from mcp_servers.cluster.local import LocalProcessBackend
from mcp_servers.cluster.procs import proc_stat

REPO = Path(__file__).resolve().parents[2]
STUB = [sys.executable, str(REPO / "tests" / "fixtures" / "openai_stub.py"),
        "--host", "{host}", "--port", "{port}", "--itl-ms", "1", "--ttft-ms", "2"]
NEEDS_ROUTER = pytest.mark.skipif(
    router_mod.installed_version() != router_mod.ROUTER_VERSION,
    reason="sglang-router 0.3.2 is not installed (pip install -e '.[router]')")


def config(**kw) -> ServingConfig:
    c = dict(model="glm-5", gpu="B200", tp_size=8, replicas=2, weights="nvfp4")
    c.update(kw)
    return ServingConfig(**c)


def served(url: str) -> int:
    """The stub's ``sglang:num_requests_total``: requests that replica answered."""
    text = httpx.get(url + "/metrics", trust_env=False).text
    return int(float(re.search(r"^sglang:num_requests_total (\S+)$", text, re.M).group(1)))


@NEEDS_ROUTER
@pytest.mark.anyio
async def test_the_real_router_fronts_the_replicas_and_goes_with_the_deployment(tmp_path):
    backend = LocalProcessBackend("router-test", tmp_path, command=STUB, router="sglang",
                                  stop_grace_s=5.0)
    try:
        st = backend.deploy("two", config(router_policy="round_robin"), {}, wait_s=30)
        assert st.phase == "Ready", st.message
        assert st.message.startswith(f"sglang-router (round_robin) at {st.router} in front of 2 "
                                     "replicas; replica 0's last log line: ")
        assert st.router is not None and st.router.startswith("http://127.0.0.1:")
        assert len(st.endpoints) == 2 and st.router not in st.endpoints
        rt = backend._get("two").router
        assert rt is not None and "--policy" in rt.argv
        assert rt.argv[rt.argv.index("--policy") + 1] == "round_robin"
        assert rt.argv[rt.argv.index("--worker-urls") + 1:][:2] == st.endpoints
        reasons = [(e.reason, e.message.split(":")[0]) for e in backend.events("two")]
        assert ("Started", "router") in reasons and \
            any(r == "Ready" and m.startswith("router answered 200") for r, m in reasons)
        # a bench run goes through the router; the router splits it over both replicas
        svc = BenchService(backend, tmp_path / "artifacts", [tmp_path])
        target = svc.target("two", None, None, "builtin")
        assert target.load_urls == [st.router] and "router" in target.where
        res = await svc.saturation("two", isl=8, osl=4, concurrency=2, duration_s=0.5,
                                   runner="builtin")
        n = [served(u) for u in st.endpoints]
        assert res.summary.completed == sum(n) > 4  # every request reached a replica once
        assert abs(n[0] - n[1]) <= 2, n  # round_robin (two clients): an even split
        assert res.replica_requests == n  # the bench read the same counters around the run
        pid = rt.pid
        # a router that dies while serving fails its deployment, saying so
        crash = backend.deploy("crash", config(), {}, wait_s=30)
        assert crash.phase == "Ready"
        crashed = backend._get("crash").router
        assert crashed is not None
        os.kill(crashed.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (st2 := backend.status("crash")).phase == "Ready" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (st2.phase, st2.failed_stage, st2.exit_code) == ("Failed", "serving",
                                                                -signal.SIGKILL)
        assert st2.message.startswith("router: ") and "\x1b" not in st2.message
        assert any(e.reason == "Failed" and e.message.startswith(f"router (pid {crashed.pid})")
                   for e in backend.events("crash"))
    finally:
        for d in backend.list():
            if d.phase != "Terminated":
                backend.teardown(d.name)
    down = backend.status("two")
    assert down.phase == "Terminated" and down.router is None
    assert proc_stat(pid) is None  # stopped by its PID, and reaped
    assert (tmp_path / "local" / "router-test" / "two" / "router.log").is_file()
    assert any(e.message == "router: SIGTERM to process group " + str(pid)
               for e in backend.events("two"))


def test_router_without_the_package_is_refused_with_the_install_command(tmp_path,
                                                                        monkeypatch):
    monkeypatch.setattr(router_mod, "installed_version", lambda: None)
    with pytest.raises(BackendError, match=r"servetune\[router\]'.*leave out --router"):
        LocalProcessBackend("router-test", tmp_path, command=STUB, router="sglang")
    with pytest.raises(BackendError, match="option of the local backend"):
        make_backend("twin", router="sglang")
    monkeypatch.setattr(router_mod, "installed_version", lambda: "0.2.1")
    with pytest.raises(BackendError, match="0.2.1 is installed; servetune pins 0.3.2"):
        LocalProcessBackend("router-test", tmp_path, command=STUB, router="sglang")


def test_router_argv_maps_policy_and_thresholds():
    argv = router_mod.router_argv(config(router_policy="cache_aware"), ["http://127.0.0.1:1",
                                  "http://127.0.0.1:2"], "127.0.0.1", 5, 6)
    assert argv[1:3] == ["-m", "sglang_router.launch_router"]
    assert argv[argv.index("--policy") + 1] == "cache_aware"
    assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"
    assert argv[argv.index("--worker-urls") + 1:argv.index("--policy")] == [
        "http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert not router_mod.fronted(config(replicas=1))
    assert router_mod.fronted(config(replicas=2))


def test_cli_router_flags_are_checked(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from servetune.cli import _cluster_backend, app
    from servetune.settings import Settings

    for argv, message in [(["mcp", "cluster", "--router"], "--router is an option of "
                           "--backend local and --backend kubernetes"),
                          (["run", "--router"], "give it with --backend local or kubernetes")]:
        r = CliRunner().invoke(app, argv)
        assert r.exit_code == 2 and message in " ".join(r.output.split()), r.output
    monkeypatch.setattr(router_mod, "installed_version", lambda: None)
    import typer

    with pytest.raises(typer.Exit):  # fail(): exit 2 with the install command
        _cluster_backend("local", "servetune", None, None, 8, Settings(state_dir=tmp_path),
                         router=True)


def test_the_run_header_says_who_routes(tmp_path, monkeypatch):
    from rich.console import Console

    from servetune import cli_run_print

    out = Console(record=True, width=200)
    monkeypatch.setattr(cli_run_print, "console", out)
    cli_run_print.routing_notice(LocalProcessBackend("router-test", tmp_path, command=STUB))
    cli_run_print.routing_notice(make_backend("twin"))  # says nothing: the twin routes itself
    text = " ".join(out.export_text().split())
    assert text == ("routing: no router on the local backend: the bench spreads a trial's "
                    "requests over its replicas round-robin (--router puts the pinned "
                    "sglang-router in front)")
