"""The report's "Quarantined lessons" section, from the run's ``lesson-quarantined`` events.

``graph/state.py:StudyContext.contradictions`` appends one event per lesson a measurement of the
run contradicted (a config it forbids served) and quarantined.
"""

from __future__ import annotations

from pathlib import Path

from servetune.faults_report import read_events


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def quarantine_section(events_path: Path) -> list[str]:
    """The report lines (none when the run quarantined no lesson)."""
    found = [e for e in read_events(events_path) if e.get("kind") == "lesson-quarantined"]
    if not found:
        return []
    lines = ["## Quarantined lessons", "",
             f"{len(found)} lesson(s) forbade a config this run measured serving; each was "
             "quarantined at once and forbids nothing until `servetune lessons restore ID` "
             "(`servetune lessons show ID` gives its provenance and the measurement).", "",
             "| lesson | title | served by | reason |", "|---|---|---|---|"]
    lines += [f"| `{_cell(e.get('id'))}` | {_cell(e.get('title'))} | {_cell(e.get('trial'))} "
              f"(#{e.get('seq')}) | {_cell(e.get('reason'))} |" for e in found]
    return [*lines, ""]
