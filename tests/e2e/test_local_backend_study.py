"""``servetune run --backend local`` as a user runs it (a subprocess), interrupted.

Trial servers here are ``servetune twin serve`` processes (the local backend's default without a
GPU). Each test waits, by polling the backend's records under the state folder, until a trial
server is up, then interrupts the run: SIGKILL and resume (the leftover is torn down by its
run-id label), SIGTERM (a clean stop, exit 143), or a second run in the same namespace (it never
touches the first run's deployment). Every server a test saw is stopped by its PID in
``finally`` (only while its start time matches), never by name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures import warm_cli
from fixtures.benchmarks import load_benchmark

from mcp_servers.cluster.local import gpu_present
from mcp_servers.cluster.procs import proc_stat, running

REPO = Path(__file__).resolve().parents[2]
cr = load_benchmark("chaos_resume")
twin_servers = pytest.mark.skipif(gpu_present(), reason="trial servers are twin servers only "
                                  "without a GPU")


class Runs:
    """Runs of one tiny study over one state folder (``tmp``), and what they started."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.study = tmp / "study.yaml"
        self.study.write_text(yaml.safe_dump(cr.small_study(
            finalists=1, sweep_concurrency=[8], budget={"max_trials": 2, "patience": 2},
            saturation={"isl": 256, "osl": 32, "concurrency": 16, "duration_s": 20})))
        self.state = tmp / "state"
        self.procs: list[Any] = []  # subprocess.Popen or warm_cli.WarmProcess
        self.seen: dict[int, int] = {}  # server PID -> start ticks

    def start(self, run_id: str, namespace: str = "servetune", plain: bool = False) -> Any:
        """``servetune run`` of the study as ``run_id``; stdout/stderr to ``<run_id>.out/.err``.

        Forked from the warm CLI interpreter (``fixtures.warm_cli.popen``: a process of its
        own, signalled by its PID), or with ``plain`` a ``python -m servetune.cli`` subprocess
        on an 80-column terminal: the real entry point, its signal handling included.
        """
        env = dict(os.environ, PYTHONPATH=str(REPO), SERVETUNE_STATE_DIR=str(self.state),
                   SERVETUNE_LESSONS_DIR=str(self.tmp / "lessons"),
                   SERVETUNE_BRAINS="deterministic", SERVETUNE_EMBEDDING="hashing",
                   COLUMNS="80" if plain else warm_cli.COLUMNS)
        env.pop("ANTHROPIC_API_KEY", None)
        n = sum(1 for p in self.tmp.glob(f"{run_id}.*.out"))
        cmd = [sys.executable, "-m", "servetune.cli", "run", str(self.study), "--run-id", run_id,
               "--out", str(self.tmp / "runs"), "--backend", "local", "--namespace", namespace]
        with open(self.tmp / f"{run_id}.{n}.out", "wb") as out, \
                open(self.tmp / f"{run_id}.{n}.err", "wb") as err:
            start = subprocess.Popen if plain else warm_cli.popen
            p = start(cmd, cwd=self.tmp, stdout=out, stderr=err, env=env)
        self.procs.append(p)
        return p

    def output(self, run_id: str, n: int = 0) -> tuple[str, str]:
        """(stdout, stderr) of the ``n``-th start of ``run_id``."""
        return ((self.tmp / f"{run_id}.{n}.out").read_text(errors="replace"),
                (self.tmp / f"{run_id}.{n}.err").read_text(errors="replace"))

    def records(self, namespace: str = "servetune") -> list[dict[str, Any]]:
        """The local backend's deployment records in ``namespace`` (their servers noted)."""
        out = []
        for path in sorted((self.state / "local" / namespace).glob("*.json")):
            try:
                rec = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # being replaced right now
            for r in rec["replicas"]:
                self.seen.setdefault(r["pid"], r["start_ticks"])
            out.append(rec)
        return out

    def up(self, namespace: str = "servetune", after: float = 0.0) -> dict[str, Any] | None:
        """A record created after ``after`` whose replica answered health and still runs."""
        for rec in self.records(namespace):
            r = rec["replicas"][0]
            if rec["created_at"] > after and rec["terminated_at"] is None and \
                    r["ready_at"] is not None and running(r["pid"], r["start_ticks"]):
                return rec
        return None

    def events(self, run_id: str) -> list[dict[str, Any]]:
        path = self.tmp / "runs" / run_id / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        for ns in (self.state / "local").glob("*"):  # note every server any run started
            self.records(ns.name)
        for pid, ticks in self.seen.items():  # the trial servers, by PID and start time
            st = proc_stat(pid)
            if st is not None and st.start_ticks == ticks and running(pid, ticks):
                os.killpg(pid, signal.SIGKILL)


def wait_for(what: Callable[[], Any], timeout_s: float = 90.0, procs: tuple = ()) -> Any:
    """Poll ``what()`` until it is truthy; fail on timeout or if one of ``procs`` exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = what()
        if got:
            return got
        for p in procs:
            assert p.poll() is None, f"run exited with {p.returncode} while waiting"
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.1)


@pytest.fixture
def runs(tmp_path):
    r = Runs(tmp_path)
    try:
        yield r
    finally:
        r.close()


@twin_servers
def test_sigterm_stops_a_local_run_cleanly_with_exit_143(runs):
    """A plain ``python -m servetune.cli run`` (the real entry point): it first says that the
    study runs in real time, and SIGTERM stops it cleanly."""
    p = runs.start("term", plain=True)
    rec = wait_for(runs.up, procs=(p,))
    os.kill(p.pid, signal.SIGTERM)
    rc = p.wait(timeout=60)
    out, err = runs.output("term")
    line = [ln for ln in out.splitlines() if "without a GPU" in ln]
    assert len(line) == 1, out
    assert "real time" in line[0] and "expected about" in line[0], line
    assert any(c.isdigit() for c in line[0].split("expected about", 1)[1]), line
    both = out + err
    assert "Traceback" not in both, err[-3000:]
    resume = [ln for ln in both.splitlines() if "Resume with:" in ln]
    assert len(resume) == 1 and "--run-id term" in resume[0] and "--backend local" in resume[0], \
        both[-2000:]
    assert rc == 143, both[-2000:]
    r = rec["replicas"][0]
    assert not running(r["pid"], r["start_ticks"]), "the trial server was left running"
    assert all(not running(x["pid"], x["start_ticks"]) for x in
               (rr for rec in runs.records() for rr in rec["replicas"]))


@twin_servers
def test_resume_after_sigkill_tears_down_the_leftover_local_server(runs):
    p = runs.start("kill")
    rec = wait_for(runs.up, procs=(p,))
    r = rec["replicas"][0]
    os.kill(p.pid, signal.SIGKILL)  # the server outlives the run (its own session)
    p.wait(timeout=30)
    assert running(r["pid"], r["start_ticks"])
    before = len(runs.events("kill"))
    t_resume = time.time()
    again = runs.start("kill")

    def resumed_past_leftovers() -> list[dict[str, Any]]:
        new = runs.events("kill")[before:]
        return [e for e in new if e["kind"] in ("teardown-leftover", "deploy")]

    first = wait_for(resumed_past_leftovers, procs=(again,))[0]
    assert first["kind"] == "teardown-leftover" and first["name"] == rec["name"], first
    assert first["t"] >= t_resume
    wait_for(lambda: not running(r["pid"], r["start_ticks"]), timeout_s=30)


@twin_servers
def test_two_runs_in_one_namespace_never_touch_each_others_deployments(runs):
    a = runs.start("run-a", namespace="shared-ns")
    rec_a = wait_for(lambda: runs.up("shared-ns"), procs=(a,))
    ra = rec_a["replicas"][0]
    t_b = time.time()
    b = runs.start("run-b", namespace="shared-ns")
    # run B deploys its first trial (the same baseline config as run A's)
    rec_b = wait_for(lambda: runs.up("shared-ns", after=t_b), procs=(a, b))
    assert rec_b["name"] != rec_a["name"]
    assert running(ra["pid"], ra["start_ticks"]), "run B stopped run A's trial server"
    assert a.poll() is None, runs.output("run-a")[1][-2000:]
    mine = {r["name"]: r for r in runs.records("shared-ns")}
    assert mine[rec_a["name"]]["terminated_at"] is None
    assert mine[rec_a["name"]]["labels"]["servetune/run-id"] == "run-a"
    assert mine[rec_b["name"]]["labels"]["servetune/run-id"] == "run-b"


def test_stop_run_tears_down_only_this_runs_deployments_on_kubernetes():
    """What the CLI does after SIGTERM, on the kubernetes backend (fake API at its seam)."""
    from fixtures.fakes_k8s import Clock, FakeKubeApi

    from domain.config import ServingConfig
    from graph.run import stop_run
    from mcp_servers.cluster import ops
    from mcp_servers.cluster.kubernetes import KubernetesBackend
    from sandbox.policy import Policy

    api = FakeKubeApi("team-a", Clock())
    k8s = KubernetesBackend("team-a", api, None, Policy("team-a", gpu_budget=32))
    cfg = ServingConfig(model="glm-5", gpu="B200", tp_size=8, replicas=1, weights="nvfp4",
                        kv_cache_dtype="fp8_e4m3")
    for name, rid in (("trial-a-1", "r1"), ("trial-b-1", "r1"), ("trial-a-2", "r2")):
        ops.deploy(k8s, name, cfg, {"servetune/run-id": rid})
    assert stop_run(k8s, "r1") == (["trial-a-1", "trial-b-1"], [])
    phases = {d.name: d.phase for d in k8s.list()}
    assert phases["trial-a-1"] == phases["trial-b-1"] == "Terminated" != phases["trial-a-2"]
    assert ("apps/v1", "Deployment", "trial-a-2") in api.objects
    assert stop_run(k8s, "r1") == ([], [])


def test_realtime_estimate_adds_up_the_studys_budget(tmp_path):
    from domain.study import parse_study

    study = parse_study(cr.small_study(finalists=2, sweep_concurrency=[8, 64],
                                       budget={"max_trials": 8, "patience": 4}))
    sat, replay = study.saturation.duration_s, study.replay.duration_s / study.replay.time_scale
    # 8 launches, 2 replays, the reference, 3 frontier configs x 2 points; startup 5 s each
    want = 8 * (5 + 2 * sat) + 2 * (5 + replay) + 5 + 3 * (5 + 2 * sat)
    assert study.realtime_s(5.0, repeats=2) == pytest.approx(want)
