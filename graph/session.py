"""One run's bookkeeping around :func:`graph.run.run_study`, with the ledger opened once.

What a ``servetune run`` does besides driving the graph: check the run files before anything
is written, claim the run folder for its study (the study digest in the ledger meta), record
which brains ran (ledger meta ``brains``, one entry per resumed segment), and save the run's
wall time (ledger meta ``elapsed_s``, summed over every segment, s) when the run ends, is
interrupted or stops on an API error. The command line keeps the argument parsing, the
printing and the exit codes; the report is rendered from :meth:`RunSession.finish`'s record.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from domain.errors import ServetuneError
from domain.ledger import Ledger
from domain.study import Study
from domain.trial import Trial
from domain.usage import extra_usage
from graph.run import StudyOutcome, run_study
from graph.runfiles import LEDGER_FILE, check_run_files


class StudyMismatch(ServetuneError):
    """The run id was used before for another study (its ledger holds another digest)."""


@dataclass
class RunRecord:
    """What the report and the summary of a finished run are made from.

    Attributes:
        trials: every ledger row, any phase.
        brains: the brains each segment used, comma-separated ("deterministic" or
            "claude:<model>").
        extra_usage: role -> usage of agent runs that left no ledger row.
        lesson_ids: the lessons the trials used or wrote, first use first.
        elapsed_s: wall time of the run over all its segments, s.
    """

    trials: list[Trial]
    brains: str
    extra_usage: dict[str, dict[str, Any]]
    lesson_ids: list[str]
    elapsed_s: float


class RunSession:
    """The bookkeeping of one run segment of ``run_id`` in ``run_dir`` (a context manager).

    Opening one checks the run files read-only, then opens the ledger (the only time in the
    segment) and claims it for ``study``; leaving the ``with`` block closes it.
    """

    def __init__(self, run_dir: Path, run_id: str, study: Study, study_path: Path,
                 started: float) -> None:
        """Open the run's ledger and claim it for ``study``.

        Args:
            run_dir: ``runs/<run-id>/``.
            run_id: the run's id.
            study: the validated study (its digest claims the run).
            study_path: the study file (ledger meta ``study_path``).
            started: epoch s this segment started (its elapsed time counts from there).

        Raises:
            RunFileDamaged: a run file a resume reads is damaged (nothing was written).
            StudyMismatch: the run id belongs to another study.
        """
        check_run_files(run_dir, run_id)  # read-only, before anything below writes to it
        self.run_dir, self.run_id, self.started = run_dir, run_id, started
        self.ledger = Ledger(run_dir / LEDGER_FILE)
        try:
            digest = study.digest()
            old = self.ledger.get_meta("study_digest")
            if old is not None and old != digest:
                raise StudyMismatch(f"run id {run_id} belongs to another study ({old} != "
                                    f"{digest}); choose a new --run-id or rerun the original "
                                    "study")
            self.ledger.set_meta("study_digest", digest)
            self.ledger.set_meta("study_path", str(study_path))
            self.prior_s = float(self.ledger.get_meta("elapsed_s") or 0.0)
        except BaseException:
            self.ledger.close()
            raise
        self._brains_before: str | None = None

    def __enter__(self) -> RunSession:
        """The session; the ledger closes when the block is left."""
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Close the ledger."""
        self.ledger.close()

    def record_brains(self, now: str) -> None:
        """Add the brains of this segment (``deterministic`` or ``claude:<model>``) to the meta."""
        self._brains_before = self.ledger.get_meta("brains")
        used = [b for b in (self._brains_before or "").split(",") if b]
        self.ledger.set_meta("brains", ",".join([*used, now] if now not in used else used))

    def run(self, study: Study, store: Any, trace_roots: list[Path],
            **options: Any) -> Awaitable[StudyOutcome]:
        """:func:`graph.run.run_study` of this run on this session's ledger.

        ``options`` are run_study's keyword arguments (progress, source_tree, claude, backend,
        repeats, ...).
        """
        return run_study(study, self.run_id, self.run_dir, store, trace_roots,
                         ledger=self.ledger, **options)

    def elapsed_s(self) -> float:
        """Wall time of the run so far: earlier segments plus this one, s."""
        return self.prior_s + time.time() - self.started

    def save_elapsed(self, elapsed_s: float | None = None) -> float:
        """Save the run's wall time (default :meth:`elapsed_s`) in the ledger meta; it, s."""
        elapsed = self.elapsed_s() if elapsed_s is None else elapsed_s
        self.ledger.set_meta("elapsed_s", f"{elapsed:.3f}")
        return elapsed

    def finish(self, outcome: StudyOutcome) -> RunRecord:
        """Close the bookkeeping of a segment that ran to its end; what the report shows.

        A segment that found the run already complete ran no brain, so its brains entry is
        taken back and its time is not added.
        """
        if outcome.already_done and self._brains_before is not None:
            self.ledger.set_meta("brains", self._brains_before)
        elapsed = self.save_elapsed(self.prior_s if outcome.already_done else None)
        trials = self.ledger.trials()
        return RunRecord(trials=trials,
                         brains=self.ledger.get_meta("brains") or "deterministic",
                         extra_usage=extra_usage(self.ledger),
                         lesson_ids=list(dict.fromkeys(i for t in trials for i in t.lesson_ids)),
                         elapsed_s=elapsed)
