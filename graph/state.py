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
from domain.lesson import Lesson
from domain.provenance import Provenance, evidence_lines, now_iso
from domain.study import Study
from domain.trial import Trial

# Ledger statuses of a trial whose server was ready and benchmarked (a "crash", "pruned" or
# "failed" row measured nothing); with a saturation or replay summary that completed requests,
# the config served. (domain/trial.py: TrialStatus)
SERVED = frozenset({"baseline", "keep", "discard", "finalist", "winner", "slo-miss", "sweep"})


def served(trial: Trial) -> bool:
    """Whether ``trial``'s config ran and served.

    Served = ready and benchmarked with a valid result: a row of a :data:`SERVED` status with a
    saturation or replay summary (the bench server refuses garbage and invalid runs, which
    leave none) that completed requests.
    """
    runs = [m for m in (trial.saturation, trial.replay) if m is not None]
    return trial.status in SERVED and any(m.completed > 0 for m in runs)


def with_provenance(lesson: Lesson, trial: Trial, backend: str) -> Lesson:
    """``lesson`` with its provenance: where ``trial`` (of a run on ``backend``) learned it.

    A lesson that already names its provenance keeps it, with the run, trial and time added
    where it names none. The memory-fit estimate's
    and research's lessons are learned by arithmetic and source reading (backend
    ``estimate``/``research``) whatever the run's backend; a launched trial's on ``backend``
    with the engine image the trial ran (``Engine.image``).
    """
    if lesson.provenance is not None:  # a builder's (estimate, research): add run and trial
        p = lesson.provenance
        return lesson.model_copy(update={"provenance": p.model_copy(update={
            "run_id": p.run_id or lesson.run_id or trial.run_id,
            "trial": p.trial or lesson.trial_id or trial.key,
            "learned_at": p.learned_at or now_iso()})})
    from domain.engines import engine_for

    kind = lesson.source if lesson.source in ("estimate", "research", "user") else backend
    image = trial.manifest.image if trial.manifest is not None else engine_for(trial.config).image
    return lesson.model_copy(update={"provenance": Provenance.model_validate({
        "backend": kind, "engine": trial.config.engine,
        "engine_version": trial.config.engine_version,
        "image": image if kind not in ("estimate", "research", "user") else None,
        "run_id": lesson.run_id or trial.run_id, "trial": lesson.trial_id or trial.key,
        "evidence": evidence_lines(lesson.evidence), "learned_at": now_iso()})})


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

        Each lesson gets its provenance (:func:`with_provenance`) before the row is written.
        Then the contradictions (:meth:`contradictions`): a lesson that forbids a config this
        run measured serving is quarantined at once.
        """
        if trial.lessons_written:
            trial = trial.model_copy(update={"lessons_written": [
                with_provenance(x, trial, self.backend_kind) for x in trial.lessons_written]})
        row = self.ledger.append(trial)
        for lesson in row.lessons_written:
            await call(self.lessons, "add_lesson", {"lesson": lesson.model_dump(mode="json")})
        await self.contradictions(row)
        return row

    async def contradictions(self, row: Trial) -> list[dict[str, Any]]:
        """Quarantine the lessons ``row`` contradicts; the quarantined ones (id, reason).

        - ``row`` served (:func:`served`): every active lesson that forbids its config.
        - ``row`` wrote lessons: every one of them that forbids a config an earlier row of this
          run served (e.g. a HiCache host OOM at ratio 4 whose lesson covers ratio 2, which
          served before).

        Through the lessons server's ``report_served`` (a twin measurement does not overrule a
        lesson learned on a real backend). Each quarantine is reported at once: a progress event
        (``quarantined``) and a ``lesson-quarantined`` event in events.jsonl.
        """
        healthy = [row] if served(row) else []
        if row.lessons_written:
            healthy += [t for t in self.ledger.trials() if t.seq != row.seq and served(t)
                        and any(x.covers(t.config) for x in row.lessons_written)]
        out: list[dict[str, Any]] = []
        for t in healthy:
            out += await self._report_served(t)
        return out

    async def _report_served(self, t: Trial) -> list[dict[str, Any]]:
        r = await call(self.lessons, "report_served", {
            "config": t.config.model_dump(mode="json"), "trial": t.key,
            "evidence": _measured(t)})
        out = []
        for view in r.get("quarantined", []):
            lesson = view["lesson"]
            reason = lesson["history"][-1]["reason"] if lesson.get("history") else ""
            found = {"id": lesson["id"], "title": lesson["title"], "reason": reason,
                     "trial": t.key, "seq": t.seq}
            out.append(found)
            self.event("lesson-quarantined", **found)
            self.report(quarantined=lesson["id"], title=lesson["title"], reason=reason)
        return out

    async def recheck_served(self) -> list[dict[str, Any]]:
        """Report every served row of the ledger again; the lessons quarantined now.

        For a resumed run: a kill may have come between a row's lessons and their
        contradiction check. ``report_served`` is idempotent (one contradiction per run and
        trial).
        """
        out: list[dict[str, Any]] = []
        for t in self.ledger.trials():
            if served(t):
                out += await self._report_served(t)
        return out

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


def _measured(t: Trial) -> str:
    """What ``t`` measured, in one line: ``ready; saturation 1234 tok/s/GPU, 0 errors``."""
    parts = [f"{t.status} (seq {t.seq})"]
    for name, m in (("saturation", t.saturation), ("replay", t.replay)):
        if m is not None:
            parts.append(f"{name} {m.output_tok_s_per_gpu:.0f} tok/s/GPU, {m.completed} "
                         f"completed, {m.errors} errors")
    return "; ".join(parts)
