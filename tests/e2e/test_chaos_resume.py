"""Interruption: a study SIGKILLed at random points and resumed with its run id finishes with the
ledger of an uninterrupted run, loses no committed row and deploys nothing twice (a 3-point
version of ``benchmarks/chaos_resume.py``; it is the suite's test of resume after SIGKILL
through the CLI: a kill in research, one mid-search, one in validation); deployments a killed
run left on a backend with persistent state (the local backend) are found by their labels and
torn down on resume.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fixtures import warm_cli
from fixtures.benchmarks import load_benchmark
from mcp import Client

from graph.run import tear_down_leftovers
from mcp_servers.cluster.local import LocalProcessBackend
from mcp_servers.cluster.procs import proc_stat, running
from mcp_servers.cluster.server import build_server as cluster_server

REPO = Path(__file__).resolve().parents[2]
STUB = str(REPO / "tests" / "fixtures" / "openai_stub.py")
NS = "chaos-test"


cr = load_benchmark("chaos_resume")


@pytest.mark.slow
def test_three_kills_then_resume_equals_uninterrupted_run(tmp_path):
    study = tmp_path / "study.yaml"  # smaller than the benchmark's: 5 launches, 1 finalist
    study.write_text(yaml.safe_dump(cr.small_study(
        finalists=1, sweep_concurrency=[8, 64], budget={"max_trials": 5, "patience": 3})))
    lines: list[str] = []
    # (rows committed, then s): in the research before the 3rd trial (where the chaos run found
    # the fan-out resuming from half-written state), mid-search, in validation/frontier (the
    # reference commits about 12 rows)
    # each `servetune run` is forked from the warm CLI interpreter (a process of its own, killed
    # by its PID with SIGKILL as a plain one is): 5 starts, each without ~4 CPU s of imports
    before = warm_cli.USED["warm"]
    r = cr.chaos(study, tmp_path, points=3, targets=[(1, 0.3), (6, 0.1), (10, 0.0)],
                 log=lines.append, popen=warm_cli.popen)
    print("\n" + "\n".join(lines) + "\n" + cr.report(r))
    if os.environ.get("SERVETUNE_TEST_WARM_CLI", "1") != "0":
        assert warm_cli.USED["warm"] == before + 5, warm_cli.USED
    assert r.tried == 3, lines  # every kill landed before the study finished
    assert r.survived == r.tried, cr.report(r)
    assert r.completed and r.equal, r.diffs
    assert not any(k.lost or k.double for k in r.kills)
    assert r.final_rows == r.ref_rows > 5
    # the resumed run went through validation to its winner, as the uninterrupted one did
    assert "winner" in {row["status"] for row in cr.ledger_rows(tmp_path / "runs" / "chaos")}


def test_compare_names_the_rows_that_differ():
    a = [{"key": "search:a", "status": "keep", "objective": 1.0, "run_id": "x", "wall_s": 3.0},
         {"key": "search:b", "status": "discard", "objective": 0.5, "run_id": "x"}]
    b = [{"key": "search:a", "status": "keep", "objective": 1.0, "run_id": "y", "wall_s": 9.0},
         {"key": "search:b", "status": "keep", "objective": 0.5, "run_id": "y"},
         {"key": "search:c", "status": "keep", "objective": 0.7, "run_id": "y"}]
    assert cr.compare(a, b[:1], "x", "y") == ["row 2 (search:b): missing"]
    assert cr.compare(a, b, "x", "y") == ["row 2 (search:b): status",
                                          "row 3 (search:c): extra"]
    sweep = [{"key": f"frontier:c1:{c}", "status": "sweep"} for c in (8, 64)]
    assert cr.done_keys(sweep, [8, 64]) >= {"frontier:c1", "frontier:c1:8"}
    assert "frontier:c1" not in cr.done_keys(sweep[:1], [8, 64])  # a sweep cut half-way


KILLED_RUN = """
import sys, time
from pathlib import Path
from domain.config import ServingConfig
from mcp_servers.cluster import ops
from mcp_servers.cluster.local import LocalProcessBackend
b = LocalProcessBackend({ns!r}, Path({state!r}), command={cmd!r})
cfg = ServingConfig(model="glm-5", gpu="B200", tp_size=8, replicas=1, weights="nvfp4")
for name, rid in (("trial-mine", "r1"), ("trial-other", "r2")):
    ops.deploy(b, name, cfg, {{"servetune/run-id": rid}}, wait_s=20)
print(json.dumps({{n: b.processes(n) for n in ("trial-mine", "trial-other")}}), flush=True)
time.sleep(600)
"""


@pytest.mark.anyio
async def test_resume_tears_down_what_a_killed_run_left_on_the_local_backend(tmp_path):
    """A run killed with a Ready server up: its resume (run id r1) stops that server, by label,
    and leaves the deployment of another run (r2) in the same namespace running."""
    cmd = [sys.executable, STUB, "--host", "{host}", "--port", "{port}"]
    code = "import json\n" + KILLED_RUN.format(ns=NS, state=str(tmp_path), cmd=cmd)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    backend = LocalProcessBackend(NS, tmp_path, command=cmd)
    try:
        assert proc.stdout is not None
        pids = json.loads(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGKILL)  # the servers outlive it (own sessions)
        proc.wait(timeout=30)
        ticks = {p: proc_stat(p).start_ticks for ps in pids.values() for p in ps}
        assert all(running(p, t) for p, t in ticks.items())
        async with Client(cluster_server(backend)) as c:  # the resumed process's server
            assert await tear_down_leftovers(c, "r1") == ["trial-mine"]
            assert await tear_down_leftovers(c, "r1") == []  # idempotent
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
                running(p, ticks[p]) for p in pids["trial-mine"]):
            time.sleep(0.05)
        assert not any(running(p, ticks[p]) for p in pids["trial-mine"])
        assert all(running(p, ticks[p]) for p in pids["trial-other"])
        assert {d.name: d.phase for d in backend.list()} == {"trial-mine": "Terminated",
                                                             "trial-other": "Ready"}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        for d in backend.list():
            if d.phase != "Terminated":
                backend.teardown(d.name)


@pytest.mark.anyio
async def test_resume_tears_down_leftovers_on_kubernetes_by_label():
    """The same on the kubernetes backend (fake API at its seam): a resumed process's backend
    finds the killed run's Deployments by label, Ready or still Pending, and deletes only those."""
    from fixtures.fakes_k8s import Clock, FakeKubeApi, Fate

    from domain.config import ServingConfig
    from mcp_servers.cluster import ops
    from mcp_servers.cluster.kubernetes import KubernetesBackend
    from sandbox.policy import Policy

    clock = Clock()
    api = FakeKubeApi("team-a", clock)

    def k8s() -> KubernetesBackend:
        return KubernetesBackend("team-a", api, None, Policy("team-a", gpu_budget=32),
                                 clock=clock)

    cfg = ServingConfig(model="glm-5", gpu="B200", tp_size=8, replicas=1, weights="nvfp4",
                        kv_cache_dtype="fp8_e4m3")
    killed = k8s()
    api.fates["trial-slow"] = Fate("ready", after=50)  # still Pending at the kill
    for name, rid in (("trial-up", "r1"), ("trial-slow", "r1"), ("trial-theirs", "r2")):
        ops.deploy(killed, name, cfg, {"servetune/run-id": rid})
    resumed = k8s()
    async with Client(cluster_server(resumed)) as c:
        assert sorted(await tear_down_leftovers(c, "r1")) == ["trial-slow", "trial-up"]
    assert {d.name: d.phase for d in resumed.list()} == {
        "trial-up": "Terminated", "trial-slow": "Terminated", "trial-theirs": "Ready"}
    assert ("apps/v1", "Deployment", "trial-theirs") in api.objects
    assert ("apps/v1", "Deployment", "trial-up") not in api.objects


@pytest.mark.anyio
async def test_research_fan_out_leaves_nothing_in_the_run_checkpoint(tmp_path):
    """Found by the chaos run: the research fan-out, run inside a supervisor node, inherited the
    run's SQLite checkpointer, so a run killed during research resumed the fan-out from what the
    killed process had written of it and lost outcomes (KeyError on a question id). Now each
    fan-out keeps its state in memory: nothing of it reaches the run's checkpoint, and a resumed
    step asks its questions again."""
    import sqlite3
    from typing import TypedDict

    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
    from langgraph.graph import END, START, StateGraph

    from agents.outputs import ResearchFindings, ResearchQuestion
    from domain.usage import AgentUsage
    from graph.research import run_research

    class Answers:
        async def answer(self, q):
            return ResearchFindings(question=q.question, answer="n/a"), AgentUsage()

    class S(TypedDict, total=False):
        got: list[str]

    qs = [ResearchQuestion(id="s0", kind="source", question="what does --x do?", flag="x"),
          ResearchQuestion(id="m0", kind="memory", question="lessons on x?")]

    async def node(state: S) -> S:
        out = await run_research(qs, {"source": Answers(), "memory": Answers()})
        return {"got": [o.question.id for o in out]}

    g = StateGraph(S)
    g.add_node("search", node)
    g.add_edge(START, "search")
    g.add_edge("search", END)
    db = tmp_path / "checkpoint.sqlite"
    async with AsyncSqliteSaver.from_conn_string(str(db)) as saver:
        final = await g.compile(checkpointer=saver).ainvoke(
            {}, {"configurable": {"thread_id": "r1"}}, durability="sync")
    assert final["got"] == ["s0", "m0"]
    con = sqlite3.connect(db)
    try:
        nss = {ns for (ns,) in con.execute("SELECT DISTINCT checkpoint_ns FROM checkpoints")}
        nss |= {ns for (ns,) in con.execute("SELECT DISTINCT checkpoint_ns FROM writes")}
    finally:
        con.close()
    assert nss == {""}  # the supervisor's own checkpoints only


@pytest.mark.anyio
async def test_a_pruned_rows_lesson_reaches_the_store_only_after_the_row(tmp_path, store):
    """Found by the chaos run: the planner stored a memory-fit lesson before the pruned row that
    carried it was committed; a kill in between left the lesson without its row, and the resumed
    step was pruned "forbidden by lesson" instead of "by memory-fit estimate" (another reason,
    no lesson on the row). Now a row and its lessons are committed in one order on every path
    (``StudyContext.commit``: the row first, then its lessons): screening stores nothing (its
    lesson still forbids the rest of the step's family), so a kill before the row leaves nothing
    to undo, and the row's commit stores the lesson; other runs' lessons are left alone."""
    from fixtures.cli import tiny_study, write

    from agents.planner import Planner, Pruned
    from domain.ledger import Ledger
    from domain.trial import Trial
    from graph.state import StudyContext
    from mcp_servers.lessons.server import build_server as lessons_server
    from servetune.study_file import load_study

    study = load_study(write(tmp_path, "tiny.yaml", tiny_study()))
    big = study.base_config().model_copy(update={"tp_size": 4, "weights": "fp8",
                                                 "kv_cache_dtype": "bf16"})
    kin = big.model_copy(update={"kv_cache_dtype": "fp8_e4m3"})  # same family
    ledger = Ledger(tmp_path / "ledger.sqlite")
    try:
        async with Client(lessons_server(store, "r1")) as lessons:
            planner = Planner(study, lessons)
            p = await planner.screen(big, "tp_size=4", "r1")
            assert isinstance(p, Pruned) and p.reason.startswith("pruned by memory-fit")
            assert p.new_lesson is not None and p.lesson_ids == [p.new_lesson.id]
            assert store.list() == []  # a kill now leaves no lesson without its row
            q = await planner.screen(kin, "kv_cache_dtype=fp8_e4m3", "r1")
            assert isinstance(q, Pruned) and q.new_lesson is None
            assert q.reason.startswith(f"forbidden by lesson {p.new_lesson.id}")
            ctx = StudyContext(run_id="r1", study=study, ledger=ledger, cluster=None,
                               bench=None, lessons=lessons)
            row = await ctx.commit(Trial(run_id="r1", seq=0, key=f"search:{big.config_id()}",
                                         phase="search", status="pruned", config=big,
                                         reason=p.reason, lesson_ids=p.lesson_ids,
                                         lessons_written=[p.new_lesson]))
        assert [t.key for t in ledger.trials()] == [row.key]
    finally:
        ledger.close()
    assert [x.id for x in store.list()] == p.lesson_ids
