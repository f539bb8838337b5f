"""The end-of-run report: ``report.md`` plus PNG plots, written into a run's folder.

Everything shown comes from the ledger's trials, the study and the lessons handed in, plus the
run's ``events.jsonl`` (the backend and the endpoints that said they were simulated, written by
:func:`graph.run.run_study`, named in the report's first lines; injected faults); nothing is
measured here. Units: throughput in output tokens per second (per GPU, or per user = 1 / TPOT),
latencies in milliseconds, durations in seconds. Files are written atomically (temp file in the
same folder, then ``os.replace``) so a reader never sees half a report.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import matplotlib

from domain.lesson import Lesson
from domain.study import Study
from domain.trial import Trial
from domain.usage import LLM_CALLS, read_llm_calls
from servetune.faults_report import faults_section, read_events
from servetune.lessons_report import quarantine_section
from servetune.report.agents import _agents_section, _lessons_section, _research_section
from servetune.report.format import _write_atomic
from servetune.report.plots import (
    FRONTIER_PNG,
    REPLAY_PNG,
    SEARCH_PNG,
    frontier_points,
    plot_frontier,
    plot_replay_ttft,
    plot_search,
)
from servetune.report.sections import (
    _admission_section,
    _backend_line,
    _ceiling_section,
    _finalists_table,
    _frontier_section,
    _lints_section,
    _predicted_section,
    _quality_section,
    _result,
    _summary,
    _trials_table,
    _workloads,
)
from servetune.report.seen import seen_section


def render_report(run_dir: Path, study: Study, trials: list[Trial], lessons: list[Lesson], *,
                  run_id: str, stop_reason: str, elapsed_s: float, replay_requests: int,
                  trace_file: str, brains: str = "deterministic",
                  extra_usage: dict[str, dict[str, Any]] | None = None,
                  prices: dict[str, float] | None = None) -> Path:
    """Write ``run_dir/report.md`` and its plots (search, frontier, replay TTFT PNGs).

    The plots are ``search.png``, ``frontier.png`` and ``replay_ttft.png``. A plot with no data
    is not written (a stale one from an earlier render is removed) and the report says so.

    Args:
        run_dir: the run's folder (created if missing).
        study: the study that ran.
        trials: the run's ledger rows, any phase, any order.
        lessons: lessons used (pruning) or written (failures) in this run.
        run_id: the run's id.
        stop_reason: why the search stopped.
        elapsed_s: wall time of the run, s.
        replay_requests: requests in the replayed trace window.
        trace_file: the replayed trace's file name.
        brains: the brains the run used, comma-separated, in order ("deterministic" or
            "claude:<model>"; ledger meta ``brains``).
        extra_usage: role -> usage of agent runs that left no ledger row.
        prices: USD per million tokens (input, output, cache_read, cache_write) for the cost
            estimate; None leaves the cost column empty.

    Returns:
        The path of ``report.md``.
    """
    if "matplotlib.pyplot" not in sys.modules:  # switching under pyplot would close its figures
        matplotlib.use("Agg")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    trials = sorted(trials, key=lambda t: t.seq)
    validated = [t for t in trials if t.phase == "validate"]
    points = frontier_points(trials)

    plots = {
        SEARCH_PNG: plot_search(trials, run_dir / SEARCH_PNG),
        FRONTIER_PNG: plot_frontier(points, run_dir / FRONTIER_PNG),
        REPLAY_PNG: plot_replay_ttft(validated, study.slo.ttft_p99_ms, run_dir / REPLAY_PNG),
    }
    for name, written in plots.items():
        if not written:
            (run_dir / name).unlink(missing_ok=True)

    lines = _summary(study, trials, run_id, stop_reason, elapsed_s,
                     _backend_line(read_events(run_dir / "events.jsonl")))
    lines += _workloads(study, replay_requests, trace_file)
    lines += _result(study, trials)
    lines += _trials_table(trials)
    if plots[SEARCH_PNG]:
        lines += [f"![Objective per search trial]({SEARCH_PNG})", ""]
    else:
        lines += ["No search trial was launched, so there is no search plot.", ""]
    lines += _finalists_table(trials, plots[REPLAY_PNG])
    lines += seen_section(trials)
    lines += _admission_section(trials)
    lines += _quality_section(trials)
    lines += _frontier_section(points, plots[FRONTIER_PNG])
    lines += _ceiling_section(trials)
    lines += _predicted_section(trials)
    lines += _lints_section(trials)
    lines += _research_section(trials)
    lines += _agents_section(trials, brains, extra_usage or {}, prices,
                             read_llm_calls(run_dir / LLM_CALLS))
    lines += faults_section(study, run_dir / "events.jsonl")
    lines += quarantine_section(run_dir / "events.jsonl")
    lines += _lessons_section(lessons)

    path = run_dir / "report.md"
    text = "\n".join(lines).rstrip("\n") + "\n"
    _write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return path
