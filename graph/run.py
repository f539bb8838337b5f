"""Run (or resume) one study: wire the MCP servers, the checkpointer and the supervisor graph.

The agents reach the cluster, bench and lessons servers through the MCP protocol (in-memory
``mcp.Client`` sessions), never by importing their functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from mcp import Client

from agents.claude import ClaudeSetup
from agents.mcp_tools import TRANSIENT_RETRIES, call
from agents.research import (
    ClaudeResearcher,
    DeterministicMemoryResearcher,
    DeterministicSourceResearcher,
)
from domain.errors import ServetuneError
from domain.estimate import ReplayProfile
from domain.ledger import Ledger
from domain.study import Study
from graph.search import candidate_lints
from graph.state import Progress, StudyContext
from graph.supervisor import build_graph
from mcp_servers.bench.ops import BenchService
from mcp_servers.bench.server import build_server as bench_server
from mcp_servers.cluster.backend import BackendError, ClusterBackend
from mcp_servers.cluster.ops import MANAGED_BY
from mcp_servers.cluster.server import build_server as cluster_server
from mcp_servers.cluster.twin import TwinBackend
from mcp_servers.lessons.outage import FlakyStore
from mcp_servers.lessons.server import build_server as lessons_server
from mcp_servers.source.server import build_server as source_server
from mcp_servers.source.tree import SourceTree
from memory.store import LessonStore


def resume_input(run_id: str, values: dict[str, Any],
                 next_nodes: tuple[str, ...]) -> dict[str, Any] | None:
    """What to invoke the graph with, given the checkpointed state of ``run_id``.

    - no state yet: a fresh start in the search phase;
    - a pending step (``next_nodes``): None, so LangGraph continues the interrupted step (a
      search node this process holds no step for sends it back to ``plan``, see
      :mod:`graph.search`);
    - state but no pending step (a kill landed between a node's writes and its routing):
      enter again at the phase the state names; nodes derive their position from the ledger.
      A checkpoint of the three-node graph before issue 17 is one: its pending ``search`` is
      no node of this graph, so LangGraph reports none, and the run enters at its phase.
    """
    if not values:
        return {"run_id": run_id, "phase": "search"}
    if next_nodes:
        return None
    return {"run_id": run_id, "phase": values.get("phase", "search")}


def record_injected(ctx: StudyContext, backend: Any, bench: BenchService, store: Any,
                    lesson_retries: int) -> None:
    """Append an ``injected`` event per fault injected in this process.

    The lesson-store wrapper adds one event with its outages, the calls it refused and the
    retries that classified them LESSONS_UNAVAILABLE.
    """
    for row in getattr(backend, "injected", []):
        ctx.event("injected", what="deploy", **row)
    for row in bench.injected:
        ctx.event("injected", what="bench", **row)
    if isinstance(store, FlakyStore):
        ctx.event("injected", what="lessons", fault="lessons_outage", outages=store.outages,
                  refused=store.refused, retried=lesson_retries)


async def tear_down_leftovers(cluster: Client, run_id: str) -> list[str]:
    """Tear down the deployments a killed process of ``run_id`` left running; their names.

    Found by their labels (servetune's managed-by label and ``servetune/run-id``), never by
    name alone: another run's deployments in the namespace are left alone. None is adopted:
    a server of unknown state (a benchmark cut off half-way has warmed its cache) would make
    the redone step measure something else than an uninterrupted run; the step deploys its
    config again. Without this, a deployment the kill caught after its last result was
    committed (a frontier sweep's last point, the quality reference) would never be stopped,
    and on the local backend it would keep its GPUs from the next launch.
    """
    left = []
    for d in await call(cluster, "list_deployments"):
        if _of_run(d["phase"], d.get("labels") or {}, run_id):
            await call(cluster, "tear_down", {"name": d["name"]})
            left.append(d["name"])
    return left


def _of_run(phase: str, labels: dict[str, str], run_id: str) -> bool:
    """Whether a deployment is a live one of ``run_id`` (by servetune's labels)."""
    (label, owner), = MANAGED_BY.items()
    return phase != "Terminated" and labels.get(label) == owner \
        and labels.get("servetune/run-id") == run_id


def stop_run(backend: ClusterBackend, run_id: str) -> tuple[list[str], list[str]]:
    """Tear down every live deployment of ``run_id`` on ``backend``, outside any event loop.

    What an interrupted run does after its tasks have unwound (SIGTERM, Ctrl-C): found by
    label as in :func:`tear_down_leftovers`, so another run's deployments are left alone.

    Returns:
        (names torn down, ``"name: reason"`` of each teardown the backend refused).

    Raises:
        BackendError: the backend cannot list its deployments.
    """
    stopped, failed = [], []
    for d in backend.list():
        if _of_run(d.phase, d.labels, run_id):
            try:
                backend.teardown(d.name)
                stopped.append(d.name)
            except BackendError as e:
                failed.append(f"{d.name}: {e}")
    return stopped, failed


@dataclass
class StudyOutcome:
    """How a run ended."""

    run_id: str
    resumed: bool
    already_done: bool
    stop_reason: str
    winner_seq: int | None


def replay_profile(bench: BenchService, study: Study) -> ReplayProfile | None:
    """Profile of the study's replay window for the guided brain's SLO prior.

    None when the study uses another brain, or when the trace cannot be read (the replay phase
    reports that failure itself; the search then ranks by throughput alone).
    """
    if study.search.brain != "guided":
        return None
    rp = study.replay
    try:
        _, window = bench.load_window(rp.trace, rp.format, rp.start_s, rp.duration_s,
                                      rp.time_scale)
    except (ServetuneError, BackendError):
        return None
    return ReplayProfile.of(window, rp.duration_s / rp.time_scale)


async def run_study(study: Study, run_id: str, run_dir: Path, store: LessonStore,
                    trace_roots: list[Path], progress: Progress | None = None,
                    source_tree: SourceTree | None = None, research: bool = True,
                    research_parallel: int = 4,
                    claude: ClaudeSetup | None = None,
                    backend: ClusterBackend | None = None, repeats: int = 1,
                    ledger: Ledger | None = None) -> StudyOutcome:
    """Run ``study`` as ``run_id`` in ``run_dir`` (resuming from its checkpoint if present).

    Args:
        study: the validated study (its replay trace must lie under one of ``trace_roots``).
        run_id: thread id of the checkpoint and id of every ledger row.
        run_dir: ``runs/<run-id>/``: ledger.sqlite, checkpoint.sqlite, records/.
        store: the shared lesson store.
        trace_roots: folders the bench server may read traces from.
        progress: callback for progress events (phase, trial, config).
        source_tree: the SGLang source the source researcher reads (None: its server runs
            without a tree and its answers name the fetch command).
        research: ask the research subagents before launching a research-worthy candidate.
        research_parallel: research branches that run at once.
        claude: run the planner, deployer, analyst and researchers as Claude agents (None:
            the deterministic brains, no API key needed).
        backend: the cluster backend trials are deployed on; the cluster and bench servers
            share it (None: the twin, records in memory, namespace ``servetune``).
        repeats: saturation runs per search candidate when the study's
            ``acceptance.repeats`` is unset (``SERVETUNE_REPEATS``).
        ledger: the run's open ledger (:class:`graph.session.RunSession`'s; left open), or
            None to open ``run_dir/ledger.sqlite`` here and close it at the end.

    Raises:
        anthropic.APIError: the Messages API refused a call for good (bad key, no credit);
            every trial finished before it is in the ledger and the run resumes with its id.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    own_ledger = ledger is None
    ledger = Ledger(run_dir / "ledger.sqlite") if ledger is None else ledger
    ledger.lint = candidate_lints(study)  # every row carries the lints its config trips
    backend = backend if backend is not None else TwinBackend(namespace="servetune")
    faults = study.faults if study.faults.active else None
    if faults is not None and isinstance(backend, TwinBackend):
        backend.faults = faults  # the study's faults strike the twin only
    bench = BenchService(backend, run_dir / "records", trace_roots,
                         twin_noise_pct=study.acceptance.twin_noise_pct,
                         faults=faults if backend.kind == "twin" else None)
    lesson_store: Any = store if faults is None or not faults.lessons_outage \
        else FlakyStore(store, faults)
    retried_before = sum(TRANSIENT_RETRIES.values())
    try:
        async with Client(cluster_server(backend)) as c_cluster, \
                Client(bench_server(bench)) as c_bench, \
                Client(lessons_server(lesson_store, run_id, backend.kind)) as c_lessons, \
                Client(source_server(source_tree, study.engine_version)) as c_source, \
                AsyncSqliteSaver.from_conn_string(str(run_dir / "checkpoint.sqlite")) as saver:
            graph = build_graph().compile(checkpointer=saver)
            cfg = {"configurable": {"thread_id": run_id}, "recursion_limit": 100_000}
            snap = await graph.aget_state(cfg)
            resumed = bool(snap.values)
            if resumed:  # rows commit before their lessons (StudyContext.commit): store the
                # lessons of committed rows again, in case a kill came in between
                for t in ledger.trials():
                    for lesson in t.lessons_written:
                        await call(c_lessons, "add_lesson",
                                   {"lesson": lesson.model_dump(mode="json")})
            researchers: dict[str, Any] | None = None
            if research and claude is not None:
                brain = ClaudeResearcher(claude.client, {"source": c_source,
                                                         "lessons": c_lessons},
                                         model=claude.model, budget=claude.research_budget,
                                         meter=claude.meter)
                researchers = {"source": brain, "memory": brain}
            elif research:
                researchers = {"source": DeterministicSourceResearcher(c_source),
                               "memory": DeterministicMemoryResearcher(c_lessons)}
            ctx = StudyContext(run_id=run_id, study=study, ledger=ledger, cluster=c_cluster,
                               bench=c_bench, lessons=c_lessons, backend_kind=backend.kind,
                               progress=progress, events_path=run_dir / "events.jsonl",
                               researchers=researchers, research_parallel=research_parallel,
                               claude=claude, namespace=backend.namespace, repeats=repeats,
                               replay=replay_profile(bench, study))
            ctx.event("backend", backend=backend.kind)  # the report's first lines
            if resumed:  # a kill may have come between a row's lessons and its contradictions
                await ctx.recheck_served()
            for name in await tear_down_leftovers(c_cluster, run_id):
                ctx.event("teardown-leftover", name=name)
            already_done = resumed and snap.values.get("phase") == "done"
            if already_done:
                final = snap.values  # finished before: nothing to do
            else:
                inp = resume_input(run_id, snap.values, tuple(snap.next))
                # durability="sync": each step's checkpoint is on disk before the next starts.
                final = await graph.ainvoke(inp, cfg, context=ctx, durability="sync")
        if bench.simulated_endpoints:  # endpoints that said they are simulated, for the report
            ctx.event("endpoints", simulated=dict(bench.simulated_endpoints))
        if faults is not None:  # what was injected, for the report (events.jsonl)
            record_injected(ctx, backend, bench, lesson_store,
                            sum(TRANSIENT_RETRIES.values()) - retried_before)
        return StudyOutcome(run_id=run_id, resumed=resumed, already_done=already_done,
                            stop_reason=final.get("stop_reason", ""),
                            winner_seq=final.get("winner_seq"))
    finally:
        if own_ledger:
            ledger.close()
