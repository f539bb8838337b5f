"""``servetune diagnose LOGFILE``: the failure class, phase, evidence, fix and lesson of a log.

Reads an engine log (a file, or ``-`` for stdin), diagnoses it with the engine's classifier
(:func:`domain.diagnosis.diagnose_log`) and prints the class, the phase the failure happened
in, the evidence line, the engine's source site, the fix and the lesson it would write (or
why none can be formed). ``--json`` prints one object with exactly the keys of
:data:`domain.diagnosis.JSON_KEYS`; ``--learn`` stores the lesson in the lesson store.

Exit codes: 0 a diagnosis (UNKNOWN included), 2 bad input (a missing file, an empty log, an
engine, version, GPU or model servetune does not know -- the message names the catalog).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from domain.errors import ServetuneError
from servetune.cli_common import LessonsDir, console, err_console, fail, load_settings, open_store


def _read(logfile: str) -> list[str]:
    if logfile == "-":
        return sys.stdin.read().splitlines()
    path = Path(logfile)
    if not path.is_file():
        fail(f"diagnose: no log file {logfile!r} (give a file, or - to read stdin)")
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as e:
        fail(f"diagnose: cannot read {logfile}: {e.strerror}")
        raise  # unreachable: fail exits


def diagnose(
    logfile: Annotated[str, typer.Argument(help="the engine's log file, or - for stdin")],
    engine: Annotated[str, typer.Option(help="the engine that wrote the log")] = "sglang",
    version: Annotated[str | None, typer.Option(
        help="the engine version (default: 0.5.23, the pinned one)")] = None,
    gpu: Annotated[str | None, typer.Option(help="GPU catalog key, e.g. B200 (the lesson's "
                                                 "scope)")] = None,
    model: Annotated[str | None, typer.Option(help="model catalog key, e.g. glm-5 (default: "
                                                   "the one the log's model_path names)")] = None,
    weights: Annotated[str | None, typer.Option(help="checkpoint key of the model, e.g. fp8 "
                                                     "(default: from the log's model_path)")
                       ] = None,
    source: Annotated[Path | None, typer.Option(
        "--source", help="SGLang source tree or wheel to ground the diagnosis in (default: the "
                         "version's cached tree, if fetched)")] = None,
    no_source: Annotated[bool, typer.Option("--no-source", help="do not read any source "
                                                                "tree")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    learn: Annotated[bool, typer.Option("--learn", help="store the lesson in the lesson "
                                                        "store")] = False,
    lessons_dir: LessonsDir = None,
) -> None:
    """Diagnose a failed engine log: class, phase, evidence, source site, fix and lesson."""
    from domain.diagnosis import diagnose_log
    from domain.engines import engine as get_engine

    lines = _read(logfile)
    ground, note = None, "source: not read (--no-source)"
    try:
        eng = get_engine(engine, version)
        if not no_source and eng.name == "sglang":
            from mcp_servers.lessons.ground import source_ground

            ground, note = source_ground(source, eng.version)
        report = diagnose_log(lines, engine, version, gpu, model, weights, ground=ground)
    except ServetuneError as e:
        fail(f"diagnose: {e}")
    except ValueError as e:
        fail(f"diagnose: {e}")
    stored = None
    if learn and report.lesson is not None:
        settings = load_settings()
        try:
            store = open_store(settings, lessons_dir)
            stored = store.add(report.lesson)
            store.close()
        except (ServetuneError, ValueError) as e:
            fail(f"diagnose --learn: {e}")
    if as_json:
        print(json.dumps(report.as_json(), indent=2))
        if ground is None:
            err_console.print(f"note: {escape(note)}", highlight=False)
        if report.no_lesson:
            err_console.print(f"note: {escape(report.no_lesson)}", highlight=False)
        if learn and stored is None:
            err_console.print("note: nothing stored (no lesson)", highlight=False)
        return
    d = report.diagnosis
    rows = [("class", d.failure_class), ("phase", d.phase), ("evidence", d.evidence),
            ("source", d.source or ("(no raise site matched the message)" if ground else
                                    f"(unknown: {note})")),
            ("flags", ", ".join(d.flags) or "-"),
            ("retry", "yes (a retry can cure it)" if d.retry else "no"), ("fix", d.fix),
            ("verified", "yes" if d.verified else "no")]
    for key, value in rows:  # log text is plain text, never Rich markup
        console.print(f"[bold]{key:>9}[/]  {escape(value)}", highlight=False, soft_wrap=True)
    if report.lesson is None:
        console.print(f"[bold]{'lesson':>9}[/]  {escape(report.no_lesson or '-')}",
                      highlight=False, soft_wrap=True)
        return
    les = report.lesson
    how = "source-verified condition" if les.verified else "the taxonomy's rule, unverified"
    console.print(f"[bold]{'lesson':>9}[/]  {escape(les.id)} {escape(les.title)}\n"
                  f"{'':>11}when: {escape(les.condition_text())}\n"
                  f"{'':>11}outcome: {les.outcome}, scope: {escape(_scope(les))} ({how})",
                  highlight=False, soft_wrap=True)
    if stored is not None:
        console.print(f"stored lesson {escape(stored.id)} in the lesson store", highlight=False)


def _scope(lesson: object) -> str:
    s = getattr(lesson, "scope", None)
    if s is None:
        return "-"
    parts = [f"{k}={v}" for k, v in s.model_dump().items() if v is not None]
    return ", ".join(parts) or "any"
