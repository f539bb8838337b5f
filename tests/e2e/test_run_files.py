"""Damaged run files on resume, through the CLI: a ledger, checkpoint or events.jsonl that is
truncated, random bytes or a directory, and an empty or deleted ledger beside a live checkpoint,
are refused with one line naming the file and the ways on (exit 2), and nothing is written; a
deleted checkpoint is still recovered from the ledger."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from fixtures.cli import servetune, tiny_study, write
from fixtures.cli_runner import invoke

ENV = {"SERVETUNE_EMBEDDING": "hashing"}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished tiny run ``f1`` (its folder, the study file and the folder of runs)."""
    tmp = tmp_path_factory.mktemp("runfiles")
    study = write(tmp, "tiny.yaml", tiny_study(finalists=1, sweep_concurrency=[8]))
    r = servetune("run", str(study), "--run-id", "f1", tmp=tmp, env=ENV)
    assert r.returncode == 0, r.stderr
    return tmp / "runs" / "f1", study


def _truncate(p: Path) -> None:
    with p.open("r+b") as f:
        f.truncate(8192)


def _random(p: Path) -> None:
    p.write_bytes(os.urandom(p.stat().st_size))


def _directory(p: Path) -> None:
    p.unlink()
    p.mkdir()
    (p / "x").write_text("x")


def _empty(p: Path) -> None:
    p.write_bytes(b"")


def _delete(p: Path) -> None:
    p.unlink()


def _mkdir(p: Path) -> None:
    p.mkdir()


def _append(data: bytes):
    def damage(p: Path) -> None:
        with p.open("ab") as f:
            f.write(data)
    return damage


# damaged contents of events.jsonl: bytes that are no UTF-8, a Latin-1 line, a line nested
# deeper than the JSON parser's stack
RANDOM_BYTES = bytes(range(128, 256)) * 20 + b"\n"
LATIN1_LINE = '{"x": "caf\xe9"}\n'.encode("latin-1")
DEEP_LINE = b"[" * 100_000 + b"\n"


DAMAGE = {  # id -> (the run file, how it is damaged)
    "ledger-truncated": ("ledger.sqlite", _truncate),
    "ledger-random": ("ledger.sqlite", _random),
    "ledger-directory": ("ledger.sqlite", _directory),
    "ledger-empty-beside-checkpoint": ("ledger.sqlite", _empty),
    "ledger-deleted-beside-checkpoint": ("ledger.sqlite", _delete),
    "checkpoint-truncated": ("checkpoint.sqlite", _truncate),
    "checkpoint-random": ("checkpoint.sqlite", _random),
    "checkpoint-directory": ("checkpoint.sqlite", _directory),
    "events-directory": ("events.jsonl", _directory),
    "events-random-bytes": ("events.jsonl", _append(RANDOM_BYTES)),
    "events-latin1-line": ("events.jsonl", _append(LATIN1_LINE)),
    "events-deep-line": ("events.jsonl", _append(DEEP_LINE)),
    "ledger-shm-directory": ("ledger.sqlite-shm", _mkdir),
    "checkpoint-shm-directory": ("checkpoint.sqlite-shm", _mkdir),
    "ledger-wal-fifo": ("ledger.sqlite-wal", os.mkfifo),
}


def _snapshot(run_dir: Path) -> dict[str, str]:
    """sha256 of every file of the run folder (the lock file aside), and every folder."""
    out = {}
    for p in sorted(run_dir.rglob("*")):
        rel = str(p.relative_to(run_dir))
        if p.name == ".lock":
            continue
        out[rel] = ("dir" if p.is_dir() else "other" if not p.is_file()  # a FIFO: not read
                    else hashlib.sha256(p.read_bytes()).hexdigest())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_run_file_is_refused_and_nothing_written(finished, tmp_path, case):
    src, study = finished
    name, damage = DAMAGE[case]
    run_dir = tmp_path / "runs" / "f1"
    shutil.copytree(src, run_dir)
    damage(run_dir / name)
    before = _snapshot(run_dir)
    r = invoke("run", str(study), "--run-id", "f1", tmp=tmp_path, env=ENV)
    assert r.returncode == 2, (r.returncode, r.stdout[-1500:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr and r.stderr.startswith("error:"), r.stderr[-3000:]
    assert len(r.stderr.strip().splitlines()) <= 4, r.stderr  # one line, soft-wrapped at most
    line = " ".join(r.stderr.split())
    assert name in line and "move" in line and "--run-id" in line, line
    assert _snapshot(run_dir) == before  # nothing overwritten, nothing added


@pytest.mark.slow
def test_deleted_checkpoint_is_recovered_from_the_ledger(finished, tmp_path):
    src, study = finished
    run_dir = tmp_path / "runs" / "f1"
    shutil.copytree(src, run_dir)
    (run_dir / "checkpoint.sqlite").unlink()
    r = servetune("run", str(study), "--run-id", "f1", tmp=tmp_path, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "winner" in r.stdout


@pytest.mark.slow
def test_a_half_written_event_line_is_tolerated(finished, tmp_path):
    """A run killed mid-write leaves part of a JSON line: resuming skips it, as before."""
    src, study = finished
    run_dir = tmp_path / "runs" / "f1"
    shutil.copytree(src, run_dir)
    _append(b'{"kind": "deploy", "t": 17')(run_dir / "events.jsonl")
    r = servetune("run", str(study), "--run-id", "f1", tmp=tmp_path, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["report.md", ".lock"])
def test_an_unwritable_run_file_is_named(finished, tmp_path, name):
    src, study = finished
    run_dir = tmp_path / "runs" / "f1"
    shutil.copytree(src, run_dir)
    p = run_dir / name
    p.unlink(missing_ok=True)
    p.mkdir()
    # .lock is refused before any work (in this process); report.md only after the resumed
    # run rendered it, so that one runs the whole resume in a servetune subprocess
    cli = invoke if name == ".lock" else servetune
    r = cli("run", str(study), "--run-id", "f1", tmp=tmp_path, env=ENV)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert r.stderr.startswith("error:") and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"runs/f1/{name}" in " ".join(r.stderr.split()), r.stderr  # the file, not the folder


def test_read_events_skips_lines_it_cannot_decode(tmp_path):
    from servetune.faults_report import read_events

    p = tmp_path / "events.jsonl"
    p.write_bytes(b'{"kind": "a"}\n' + RANDOM_BYTES + LATIN1_LINE + DEEP_LINE
                  + b"[1]\nnot json\n" + b'{"kind": "b"}\n')
    assert [e["kind"] for e in read_events(p)] == ["a", "b"]


def _old_graph_checkpoint(path: Path, run_id: str, state: dict, pending: str) -> None:
    """Write ``path`` as the three-node graph before issue 17 (``search``, ``validate``,
    ``frontier``, routed by phase) checkpointed a run killed in ``pending`` with ``state``."""
    from langgraph.checkpoint.sqlite import SqliteSaver
    from langgraph.graph import END, START, StateGraph

    from graph.state import StudyState

    def killed(state):  # no hints: LangGraph resolves them, and StudyState is local here
        raise KeyboardInterrupt  # the kill, inside the pending node

    def route(state) -> str:
        return {n: n for n in ("search", "validate", "frontier")}.get(
            state.get("phase", "search"), END)

    g = StateGraph(StudyState)
    for node in ("search", "validate", "frontier"):
        g.add_node(node, killed)
        g.add_conditional_edges(node, route, ["search", "validate", "frontier", END])
    g.add_conditional_edges(START, route, ["search", "validate", "frontier", END])
    with SqliteSaver.from_conn_string(str(path)) as saver:
        cfg = {"configurable": {"thread_id": run_id}}
        with pytest.raises(KeyboardInterrupt):
            g.compile(checkpointer=saver).invoke({**state, "phase": pending}, cfg,
                                                 durability="sync")
        assert g.compile(checkpointer=saver).get_state(cfg).next == (pending,)


def _keep_rows(ledger: Path, upto: int) -> None:
    import sqlite3
    db = sqlite3.connect(ledger)
    try:
        db.execute("DELETE FROM trials WHERE seq > ?", (upto,))
        db.commit()
    finally:
        db.close()


def test_a_run_checkpointed_by_the_old_graph_resumes_to_the_same_ledger(finished, tmp_path):
    """A run the old three-node graph checkpointed mid-search (pending node ``search``, which
    the graph no longer has) resumes: it enters at its phase and, since every node derives its
    position from the ledger, finishes with the ledger of the uninterrupted run."""
    from fixtures.cli import ledger_rows

    run_dir, study = finished
    ref = [(seq, key, status) for seq, key, status, *_ in ledger_rows(run_dir / "ledger.sqlite")]
    search = [seq for seq, key, _ in ref if key.startswith("search:")]
    assert len(search) >= 3
    runs = tmp_path / "runs" / "f1"
    runs.mkdir(parents=True)
    shutil.copy(run_dir / "ledger.sqlite", runs / "ledger.sqlite")
    _keep_rows(runs / "ledger.sqlite", search[1])
    _old_graph_checkpoint(runs / "checkpoint.sqlite", "f1",
                          {"run_id": "f1", "best_seq": search[0], "launched": 1,
                           "since_improvement": 0}, "search")
    r = servetune("run", str(study), "--run-id", "f1", tmp=tmp_path, env=ENV)
    assert r.returncode == 0, r.stderr
    got = [(seq, key, status) for seq, key, status, *_ in ledger_rows(runs / "ledger.sqlite")]
    assert got == ref


def test_a_checkpoint_in_a_phase_the_graph_lacks_is_refused_in_one_line(finished, tmp_path):
    """A checkpoint whose state names a phase this graph has no node for is refused with one
    line naming the file and the ways on (exit 2), before anything is written."""
    run_dir, study = finished
    runs = tmp_path / "runs" / "f1"
    runs.mkdir(parents=True)
    shutil.copy(run_dir / "ledger.sqlite", runs / "ledger.sqlite")
    from langgraph.checkpoint.sqlite import SqliteSaver
    from langgraph.graph import END, START, StateGraph

    from graph.state import StudyState

    g = StateGraph(StudyState)
    g.add_node("explore", lambda s: {"phase": "explore"})
    g.add_edge(START, "explore")
    g.add_edge("explore", END)
    with SqliteSaver.from_conn_string(str(runs / "checkpoint.sqlite")) as saver:
        g.compile(checkpointer=saver).invoke({"run_id": "f1"},
                                             {"configurable": {"thread_id": "f1"}})
    before = _snapshot(runs)
    r = invoke("run", str(study), "--run-id", "f1", tmp=tmp_path, env=ENV)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.startswith("error:"), r.stderr[-3000:]
    assert len(r.stderr.strip().splitlines()) <= 4, r.stderr  # one line, soft-wrapped at most
    line = " ".join(r.stderr.split())
    assert "checkpoint.sqlite" in line and "phase 'explore'" in line, line
    assert line.endswith("start a new run with another --run-id"), line
    assert _snapshot(runs) == before
