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
from agents.mcp_tools import call
from agents.research import (
    ClaudeResearcher,
    DeterministicMemoryResearcher,
    DeterministicSourceResearcher,
)
from domain.ledger import Ledger
from domain.study import Study
from graph.state import Progress, StudyContext
from graph.supervisor import build_graph
from mcp_servers.bench.ops import BenchService
from mcp_servers.bench.server import build_server as bench_server
from mcp_servers.cluster.backend import ClusterBackend, TwinBackend
from mcp_servers.cluster.server import build_server as cluster_server
from mcp_servers.lessons.server import build_server as lessons_server
from mcp_servers.source.server import build_server as source_server
from mcp_servers.source.tree import SourceTree
from memory.store import LessonStore


def resume_input(run_id: str, values: dict[str, Any],
                 next_nodes: tuple[str, ...]) -> dict[str, Any] | None:
    """What to invoke the graph with, given the checkpointed state of ``run_id``.

    - no state yet: a fresh start in the search phase;
    - a pending step (``next_nodes``): None, so LangGraph continues the interrupted step;
    - state but no pending step (a kill landed between a node's writes and its routing):
      enter again at the phase the state names; nodes derive their position from the ledger.
    """
    if not values:
        return {"run_id": run_id, "phase": "search"}
    if next_nodes:
        return None
    return {"run_id": run_id, "phase": values.get("phase", "search")}


@dataclass
class StudyOutcome:
    """How a run ended."""

    run_id: str
    resumed: bool
    already_done: bool
    stop_reason: str
    winner_seq: int | None


async def run_study(study: Study, run_id: str, run_dir: Path, store: LessonStore,
                    trace_roots: list[Path], progress: Progress | None = None,
                    source_tree: SourceTree | None = None, research: bool = True,
                    research_parallel: int = 4,
                    claude: ClaudeSetup | None = None,
                    backend: ClusterBackend | None = None, repeats: int = 1) -> StudyOutcome:
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

    Raises:
        anthropic.APIError: the Messages API refused a call for good (bad key, no credit);
            every trial finished before it is in the ledger and the run resumes with its id.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(run_dir / "ledger.sqlite")
    backend = backend if backend is not None else TwinBackend(namespace="servetune")
    bench = BenchService(backend, run_dir / "records", trace_roots,
                         twin_noise_pct=study.acceptance.twin_noise_pct)
    try:
        async with Client(cluster_server(backend)) as c_cluster, \
                Client(bench_server(bench)) as c_bench, \
                Client(lessons_server(store, run_id)) as c_lessons, \
                Client(source_server(source_tree, study.engine_version)) as c_source, \
                AsyncSqliteSaver.from_conn_string(str(run_dir / "checkpoint.sqlite")) as saver:
            graph = build_graph().compile(checkpointer=saver)
            cfg = {"configurable": {"thread_id": run_id}, "recursion_limit": 100_000}
            snap = await graph.aget_state(cfg)
            resumed = bool(snap.values)
            if resumed:  # lessons of committed trials, in case a kill came before storing them
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
                               claude=claude, namespace=backend.namespace, repeats=repeats)
            already_done = resumed and snap.values.get("phase") == "done"
            if already_done:
                final = snap.values  # finished before: nothing to do
            else:
                inp = resume_input(run_id, snap.values, tuple(snap.next))
                # durability="sync": each step's checkpoint is on disk before the next starts.
                final = await graph.ainvoke(inp, cfg, context=ctx, durability="sync")
        return StudyOutcome(run_id=run_id, resumed=resumed, already_done=already_done,
                            stop_reason=final.get("stop_reason", ""),
                            winner_seq=final.get("winner_seq"))
    finally:
        ledger.close()
