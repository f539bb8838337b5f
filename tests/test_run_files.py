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

from tests.test_cli import servetune, tiny_study, write

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
}


def _snapshot(run_dir: Path) -> dict[str, str]:
    """sha256 of every file of the run folder (the lock file aside), and every folder."""
    out = {}
    for p in sorted(run_dir.rglob("*")):
        rel = str(p.relative_to(run_dir))
        if p.name == ".lock":
            continue
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
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
    r = servetune("run", str(study), "--run-id", "f1", tmp=tmp_path, env=ENV)
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
