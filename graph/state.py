"""Graph state and the runtime context injected into every node.

The state is small and JSON-serialisable (it is checkpointed after every node); raw logs,
per-request records and trial bodies live in the ledger and artifacts and are referenced by seq.
Infrastructure (MCP clients, the ledger, progress output) travels in :class:`StudyContext`,
never in state and never as a tool argument a model fills.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from mcp import Client

from agents.claude import ClaudeSetup
from agents.mcp_tools import call
from domain.config import ServingConfig
from domain.estimate import ReplayProfile
from domain.ledger import Ledger
from domain.study import Study
from domain.trial import Trial


class StudyState(TypedDict, total=False):
    """What the supervisor carries between steps."""

    run_id: str
    phase: str                 # search | validate | frontier | done
    step: str                  # the search loop's next node (graph.search.NODES)
    best_seq: int | None       # ledger seq of the incumbent
    best_objective: float | None
    launched: int              # search trials launched (pruned ones are free)
    since_improvement: int
    stop_reason: str
    finalists: list[int]       # ledger seqs of the configs replayed
    cursor: int                # index into finalists for validate/frontier
    winner_seq: int | None


Progress = Callable[[dict[str, Any]], None]


@dataclass
class StudyContext:
    """Everything a node needs that is not state."""

    run_id: str
    study: Study
    ledger: Ledger
    cluster: Client
    bench: Client
    lessons: Client
    backend_kind: str = "twin"
    progress: Progress | None = None
    events_path: Path | None = None
    researchers: dict[str, Any] | None = None  # kind -> graph.research.Researcher; None: off
    research_parallel: int = 4
    claude: ClaudeSetup | None = None  # None: deterministic planner, deployer and analyst
    namespace: str = "servetune"  # the cluster server's namespace (fixed in deployer tools)
    repeats: int = 1  # saturation runs per candidate when the study's acceptance.repeats is unset
    replay: ReplayProfile | None = None  # the replay window's profile (guided brain's SLO prior)
    # the search step in progress in this process (graph.search.SearchStep: live brains and a
    # running deployment); never checkpointed, so None in a resumed process
    step: Any = None

    def deployment_name(self, config: ServingConfig) -> str:
        """The deployment name of ``config`` in this run: ``trial-<config id>-<run hash>``.

        The run hash (the first 8 hex digits of the run id's SHA-256) keeps two runs in one
        namespace from ever using one name (27 characters, within the 52 of a deployment name).
        """
        run = hashlib.sha256(self.run_id.encode()).hexdigest()[:8]
        return f"trial-{config.config_id()}-{run}"

    async def commit(self, trial: Trial) -> Trial:
        """Commit ``trial`` to the ledger, then store the lessons it carries; the committed row.

        The one order of a row and its lessons, on every path: the ledger row first (with the
        ids of the lessons it carries), then each of its ``lessons_written`` through the lessons
        server, idempotently (a lesson's id is its finding). A kill before the row leaves
        neither; a kill after it leaves a row whose lessons the resumed run stores again
        (:func:`graph.run.run_study`), so a resume has nothing to undo.
        """
        row = self.ledger.append(trial)
        for lesson in trial.lessons_written:
            await call(self.lessons, "add_lesson", {"lesson": lesson.model_dump(mode="json")})
        return row

    def event(self, kind: str, **data: Any) -> None:
        """Append one audit event (e.g. every deploy) to ``events.jsonl``, flushed at once."""
        if self.events_path is None:
            return
        line = json.dumps({"t": time.time(), "kind": kind, **data}, sort_keys=True)
        with self.events_path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def report(self, **event: Any) -> None:
        """Send a progress event (phase, trial n/N, current config) to the CLI, if any."""
        if self.progress is not None:
            self.progress(event)
