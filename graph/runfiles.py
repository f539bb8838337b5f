"""The files a resume reads, checked read-only before anything is written to the run folder.

A run folder holds ``ledger.sqlite`` (the record: every finished trial), ``checkpoint.sqlite``
(LangGraph's position in the study graph, thread = run id) and ``events.jsonl`` (the audit log,
appended to). A resume that met a damaged one ended in a traceback after opening the others for
writing, and an empty or deleted ledger beside a live checkpoint restarted the study and
redeployed finished trials. :func:`check_run_files` refuses every such case with one line
naming the file and the ways on; a missing checkpoint is fine (the ledger alone resumes).
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from langgraph.checkpoint.sqlite import SqliteSaver
from pydantic import ValidationError

from domain.errors import RunFileDamaged
from domain.trial import Trial

LEDGER_FILE = "ledger.sqlite"
CHECKPOINT_FILE = "checkpoint.sqlite"
EVENTS_FILE = "events.jsonl"
# tables each SQLite file must hold (domain/ledger.py SCHEMA; SqliteSaver.setup)
TABLES = {LEDGER_FILE: ("meta", "trials"), CHECKPOINT_FILE: ("checkpoints", "writes")}
# the phases the study graph enters a run at (graph.state.StudyState.phase); a checkpoint of
# the three-node graph before issue 17 names these too and resumes (graph.run.resume_input)
PHASES = ("search", "validate", "frontier", "done")


@dataclass
class _Ledger:
    exists: bool = False  # a non-empty SQLite file
    digest: str | None = None  # the study digest the run recorded first
    seqs: set[int] = field(default_factory=set)


@dataclass
class _Checkpoint:
    steps: int = 0  # checkpoints of the run's thread
    state: dict[str, Any] = field(default_factory=dict)  # channel values of the latest


def _kind(path: Path) -> str | None:
    """Why ``path`` cannot be a run file (it is there but not a regular file), or None."""
    if path.is_dir():
        return "it is a directory"
    if path.exists() and not path.is_file():
        return "it is not a regular file"
    return None


def _connect(path: Path) -> sqlite3.Connection:
    """A read-only connection that leaves the folder as it is.

    Without a ``-wal`` file beside it the database is opened ``immutable`` (no ``-shm`` or
    ``-wal`` file is created); with one (a killed run), read-only through its WAL.
    """
    wal = path.with_name(path.name + "-wal").exists()
    uri = path.resolve().as_uri() + ("?mode=ro" if wal else "?mode=ro&immutable=1")
    return sqlite3.connect(uri, uri=True, timeout=5)


def _open(path: Path, damaged: Any) -> sqlite3.Connection | None:
    """The checked database at ``path``; None if it is missing or empty.

    Its ``-wal`` and ``-shm`` files, where they exist, must be regular files (SQLite fails
    on, or writes beside, a folder or FIFO there).
    """
    why = _kind(path)
    if why:
        raise damaged(why)
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        why = _kind(side)
        if why:
            raise RunFileDamaged(str(side), why, f"move it aside to resume (SQLite starts a "
                                 f"new {suffix[1:]} file beside {path.name})")
    if not path.exists() or path.stat().st_size == 0:
        return None
    db = _connect(path)
    try:
        rows = db.execute("PRAGMA quick_check").fetchall()
        if rows != [("ok",)]:
            raise damaged(f"SQLite integrity check: {rows[0][0]}")
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        missing = [t for t in TABLES[path.name] if t not in tables]
        if missing:
            raise damaged(f"no {' or '.join(missing)} table")
    except sqlite3.Error as e:
        db.close()
        raise damaged(str(e)) from e
    except RunFileDamaged:
        db.close()
        raise
    return db


def _read_ledger(path: Path, damaged: Any) -> _Ledger:
    db = _open(path, damaged)
    if db is None:
        return _Ledger()
    try:
        out = _Ledger(exists=True)
        row = db.execute("SELECT value FROM meta WHERE key='study_digest'").fetchone()
        out.digest = row[0] if row else None
        for seq, body in db.execute("SELECT seq, body FROM trials ORDER BY seq"):
            try:
                Trial.model_validate_json(body)
            except ValidationError as e:
                raise damaged(f"trial {seq} is not a trial record: "
                              f"{e.errors()[0]['msg']}") from e
            out.seqs.add(int(seq))
        return out
    except sqlite3.Error as e:
        raise damaged(str(e)) from e
    finally:
        db.close()


def _read_checkpoint(path: Path, run_id: str, damaged: Any) -> _Checkpoint:
    db = _open(path, damaged)
    if db is None:
        return _Checkpoint()
    try:
        (steps,), = db.execute("SELECT COUNT(*) FROM checkpoints WHERE thread_id=?", (run_id,))
        row = db.execute("SELECT type, checkpoint FROM checkpoints WHERE thread_id=? AND "
                         "checkpoint_ns='' ORDER BY checkpoint_id DESC LIMIT 1",
                         (run_id,)).fetchone()
        if row is None:
            return _Checkpoint(steps=int(steps))
        try:
            checkpoint = SqliteSaver(db).serde.loads_typed((row[0], row[1]))
            state = dict(checkpoint["channel_values"])
        except Exception as e:  # any decoding failure of the blob: the file is not usable
            raise damaged(f"its latest state cannot be read: {type(e).__name__}") from e
        return _Checkpoint(steps=int(steps), state=state)
    except sqlite3.Error as e:
        raise damaged(str(e)) from e
    finally:
        db.close()


def _check_phase(state: dict[str, Any], damaged: Any) -> None:
    """The checkpoint's state names a phase the study graph can enter a run at, or none."""
    phase = state.get("phase")
    if phase is not None and phase not in PHASES:
        raise damaged(f"its state names phase {phase!r}, which this version's study graph "
                      f"has no node for (it knows {', '.join(PHASES)})")


def _check_events(path: Path, damaged: Any) -> None:
    """Every line of ``events.jsonl`` is UTF-8 text that the JSON parser can read.

    The run writes ASCII JSON lines (``json.dumps``), so bytes that are not UTF-8, or a line
    nested too deep for the parser (RecursionError), were put there by something else. A line
    that is merely not JSON (the half-written last line of a killed run) is skipped by
    :func:`servetune.faults_report.read_events` and allowed here.
    """
    why = _kind(path)
    if why:
        raise damaged(why)
    if not path.exists():
        return
    try:
        with path.open("rb") as f:
            for n, raw in enumerate(f, start=1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise damaged(f"line {n} is not UTF-8 text (byte {e.start})") from e
                try:
                    json.loads(text)
                except RecursionError as e:
                    raise damaged(f"line {n} is nested too deeply to parse") from e
                except ValueError:  # not JSON (a half-written line): skipped when read
                    continue
    except OSError as e:
        raise damaged(f"cannot read it ({e.strerror or e})") from e


def _referenced(state: dict[str, Any]) -> list[int]:
    """Ledger seqs the graph state refers to (incumbent, finalists, winner)."""
    seqs = [state.get("best_seq"), state.get("winner_seq"), *(state.get("finalists") or [])]
    return [s for s in seqs if isinstance(s, int)]


def check_run_files(run_dir: Path, run_id: str) -> None:
    """Check the run files of ``run_id`` in ``run_dir`` without writing anything.

    Each SQLite file must open read-only, pass ``PRAGMA quick_check`` and hold its tables
    (every ledger row must be a trial), and their ``-wal``/``-shm`` files must be regular files
    where they exist; ``events.jsonl`` must be a regular file of UTF-8 lines, none nested too
    deep to parse. The checkpoint's state must name a phase the study graph knows
    (:data:`PHASES`; one of the graph before issue 17 does). A checkpoint of the run beside
    a ledger that is missing, empty or lacks the trials the checkpoint refers to contradicts
    it (resuming would redo and redeploy finished trials). Missing files are fine otherwise:
    a new run has none, and the ledger alone resumes a run whose checkpoint is gone.

    Raises:
        RunFileDamaged: naming the file, what is wrong and how to go on.
    """
    ledger, checkpoint, events = (run_dir / n for n in (LEDGER_FILE, CHECKPOINT_FILE,
                                                          EVENTS_FILE))

    def ck_damaged(why: str) -> RunFileDamaged:
        return RunFileDamaged(str(checkpoint), why, f"move it aside to resume from {ledger} "
                              "(it holds every finished trial)")

    def ev_damaged(why: str) -> RunFileDamaged:
        return RunFileDamaged(str(events), why, "move it aside to resume from the ledger and "
                              "checkpoint (a new events.jsonl is started)")

    ck = _read_checkpoint(checkpoint, run_id, ck_damaged)
    _check_phase(ck.state, ck_damaged)
    stand_alone = (f"move it and {checkpoint} aside to start run {run_id} over (the checkpoint "
                   "cannot restore finished trials without the ledger)" if ck.steps else
                   f"move it aside to start run {run_id} over")

    def led_damaged(why: str) -> RunFileDamaged:
        return RunFileDamaged(str(ledger), why, stand_alone)

    led = _read_ledger(ledger, led_damaged)
    _check_events(events, ev_damaged)
    if not ck.steps:
        return
    lost = sorted(set(_referenced(ck.state)) - led.seqs)
    launched = ck.state.get("launched")
    if not ledger.exists():
        what = "missing"
    elif not led.exists:
        what = "empty"
    elif led.digest is None:
        what = "it records no study"
    elif lost:
        what = f"it lacks trials {', '.join(map(str, lost))}"
    elif isinstance(launched, int) and launched > len(led.seqs):
        what = f"it holds {len(led.seqs)} trials, the run launched {launched}"
    else:
        return
    raise RunFileDamaged(
        str(ledger), f"{what}, but {checkpoint} holds {ck.steps} steps of run {run_id}; "
        "resuming would redeploy finished trials",
        f"put the ledger back, or move {checkpoint} aside to start run {run_id} over")
