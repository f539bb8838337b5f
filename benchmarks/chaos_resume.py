"""Chaos resume: SIGKILL ``servetune run`` at random points of a twin study and resume it.

A small twin study first runs once uninterrupted (the reference). Then the same study runs under
another run id and is killed with SIGKILL ``--points`` times, each time restarted with the same
``--run-id``, and finally left to finish. A kill point is ``(rows, offset)``: once the ledger
holds ``rows`` rows, wait ``offset`` seconds, then SIGKILL. ``rows`` is drawn (``--seed``)
uniformly over the reference run's steps (each step ends with a committed row; the last one is
the report), ``offset`` uniformly within how long that step took in the reference, so kills land
inside a trial's work, in research, between two writes, in validation, in the frontier sweep and
while the report is rendered. Each restart first makes progress of its own (a new checkpoint,
row or deploy event), so every kill interrupts resumed work.

What it found (issue 9): the research fan-out, a LangGraph subgraph run inside the supervisor's
search node, inherited the run's SQLite checkpointer; a run killed during research resumed the
fan-out from the killed process's partial writes and crashed (KeyError on a question id). Fixed
in ``graph/research.py`` (``checkpointer=False``).

An interruption is *survived* when the restart after it

- changed or lost no ledger row committed before the kill (no result lost),
- deployed nothing whose work was already committed (``events.jsonl``; a trial interrupted
  before its row was committed is deployed again, which is the point of resuming),
- ran without a crash of its own (killed by us, or exit 0 at the end).

Then the finished ledger is compared with the reference's: the same trials in the same order with
the same statuses, decisions, reasons and objectives (timings, paths and the run id aside).

    .venv/bin/python benchmarks/chaos_resume.py [--points 20] [--seed 0] [--out DIR] [STUDY]

Without a study file it writes a small one (the test suite's tiny GLM-5 study: 4 knobs, 8
launches, 2 finalists, 2 sweep points). Prints one line per kill and ``survived N/M``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "studies" / "default.yaml"
TRACE = ROOT / "data" / "traces" / "mooncake_fast25_conversation_trace.jsonl"
# Fields that differ between two uninterrupted runs of one study (timings, paths, the run id,
# when a lesson was learned).
VOLATILE = {"created_at", "wall_s", "records_path", "llm_usage", "started_s", "finished_s",
            "t", "elapsed_s", "seconds", "learned_at"}


def small_study(**over: Any) -> dict[str, Any]:
    """The tiny GLM-5 twin study of the CLI tests (``over`` replaces top-level keys)."""
    s = yaml.safe_load(DEFAULT.read_text())
    s.update(name="chaos", knobs={"attention_backend": ["unset", "fa3"], "tp_size": [4, 8],
                                  "weights": ["fp8", "nvfp4"],
                                  "kv_cache_dtype": ["bf16", "fp8_e4m3"]},
             saturation={"isl": 1024, "osl": 128, "concurrency": 256, "duration_s": 10},
             replay={"trace": str(TRACE), "format": "mooncake", "start_s": 600,
                     "duration_s": 120, "time_scale": 0.5},
             finalists=2, sweep_concurrency=[8, 64], budget={"max_trials": 8, "patience": 4})
    s.update(over)
    return s


# ------------------------------------------------------------------ reading a run folder
def _query(path: Path, sql: str) -> list[tuple[Any, ...]] | None:
    """Rows of ``sql`` on the SQLite file ``path``; None while it is missing or locked."""
    if not path.exists():
        return None
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1)
        try:
            return db.execute(sql).fetchall()
        finally:
            db.close()
    except sqlite3.Error:
        return None


def ledger_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The committed trials of a run, in seq order (bodies as dicts)."""
    rows = _query(run_dir / "ledger.sqlite", "SELECT body FROM trials ORDER BY seq") or []
    return [json.loads(b) for (b,) in rows]


def deploys(run_dir: Path) -> list[str]:
    """The keys of every ``deploy`` event of a run, in order."""
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the kill: not a deploy that happened
            continue
        if ev.get("kind") == "deploy":
            out.append(str(ev["key"]))
    return out


def marks(run_dir: Path, last: int = 0) -> int:
    """Progress marks so far: ledger rows + checkpoints + events lines (``last`` if unreadable)."""
    led = _query(run_dir / "ledger.sqlite", "SELECT COUNT(*) FROM trials")
    ckp = _query(run_dir / "checkpoint.sqlite", "SELECT COUNT(*) FROM checkpoints")
    if led is None and (run_dir / "ledger.sqlite").exists():
        return last
    ev = run_dir / "events.jsonl"
    n_ev = len(ev.read_bytes().splitlines()) if ev.exists() else 0
    return int(led[0][0] if led else 0) + int(ckp[0][0] if ckp else 0) + n_ev


def normalized(row: dict[str, Any], run_id: str) -> Any:
    """A ledger body without what legitimately differs between runs (timings, paths, run id)."""
    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in VOLATILE}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return "RUN" if x == run_id else x
    return strip(row)


def done_keys(rows: list[dict[str, Any]], sweep: list[int]) -> set[str]:
    """Deploy keys whose work is committed: a trial's row, or every sweep point of a config."""
    keys = {r["key"] for r in rows if r["status"] != "pruned"}
    front: dict[str, set[int]] = {}
    for k in keys:
        parts = k.split(":")
        if parts[0] == "frontier" and len(parts) == 3:  # frontier:<cid> alone: did not start
            front.setdefault(parts[1], set()).add(int(parts[2]))
    keys |= {f"frontier:{cid}" for cid, got in front.items() if got >= set(sweep)}
    return keys


# ------------------------------------------------------------------ running the CLI
def _cmd(study: Path, run_id: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "servetune.cli", "run", str(study), "--run-id", run_id,
            "--out", str(out), "--brains", "deterministic"]


def _env(lessons: Path, work: Path) -> dict[str, str]:
    env = dict(os.environ, SERVETUNE_LESSONS_DIR=str(lessons), SERVETUNE_EMBEDDING="hashing",
               SERVETUNE_SOURCE_CACHE=str(work / "no-source"), COLUMNS="200",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("SERVETUNE_SGLANG_SOURCE", None)  # a fetched source tree would change research
    env.pop("ANTHROPIC_API_KEY", None)
    return env


@dataclass
class Kill:
    """One interruption and what the restart after it did."""

    rows: int                   # the ledger rows it waited for
    offset_s: float             # then the seconds it waited
    ran_s: float = 0.0          # how long the process ran before the kill
    rows_before: int = 0        # ledger rows committed at the kill
    killed: bool = False        # False: the study finished before the signal
    lost: list[str] = field(default_factory=list)      # committed rows changed or gone
    double: list[str] = field(default_factory=list)    # deploys of committed work
    redone: list[str] = field(default_factory=list)    # deploys of interrupted work
    error: str = ""             # the restart failed on its own

    @property
    def survived(self) -> bool:
        """Nothing lost, nothing deployed twice, no crash of the restart."""
        return self.killed and not (self.lost or self.double or self.error)


@dataclass
class ChaosResult:
    """The whole chaos run."""

    kills: list[Kill]
    ref_rows: int
    final_rows: int
    equal: bool
    diffs: list[str]
    completed: bool
    ref_s: float
    chaos_s: float

    @property
    def tried(self) -> int:
        """Interruptions that landed (the study had not finished yet)."""
        return sum(k.killed for k in self.kills)

    @property
    def survived(self) -> int:
        """Interruptions survived (see the module doc)."""
        return sum(k.survived for k in self.kills)


def compare(ref: list[dict[str, Any]], got: list[dict[str, Any]], ref_id: str,
            got_id: str) -> list[str]:
    """Differences between two ledgers, one line each (empty: equal)."""
    out = []
    for i in range(max(len(ref), len(got))):
        a = normalized(ref[i], ref_id) if i < len(ref) else None
        b = normalized(got[i], got_id) if i < len(got) else None
        if a != b:
            what = ("missing" if b is None else "extra" if a is None else
                    ", ".join(k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)))
            key = (b or a or {}).get("key")
            out.append(f"row {i + 1} ({key}): {what}")
    return out


def _rows(run_dir: Path, last: int = 0) -> int:
    got = _query(run_dir / "ledger.sqlite", "SELECT COUNT(*) FROM trials")
    return int(got[0][0]) if got else last


def _wait_for(proc: subprocess.Popen[bytes], run_dir: Path, rows: int, after_marks: int,
              limit_s: float = 600) -> bool:
    """Poll until ``run_dir`` holds ``rows`` rows and more than ``after_marks`` marks.

    Returns:
        False if the process ended first.
    """
    seen_rows, seen_marks, deadline = 0, 0, time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        seen_rows, seen_marks = _rows(run_dir, seen_rows), marks(run_dir, seen_marks)
        if seen_rows >= rows and seen_marks > after_marks:
            return True
        time.sleep(0.02)
    return proc.poll() is None


def timeline(proc: subprocess.Popen[bytes], run_dir: Path) -> tuple[list[float], float]:
    """Watch a run to its end: when progress started and each row was committed; its end.

    Returns:
        ``anchors`` (``anchors[0]``: the first mark; ``anchors[r]``: the r-th row, s after the
        start) and the exit time (s after the start).
    """
    t0, anchors = time.monotonic(), []
    while proc.poll() is None:
        now = time.monotonic() - t0
        if not anchors and marks(run_dir) > 0:
            anchors.append(now)
        if anchors:
            anchors += [now] * (_rows(run_dir, len(anchors) - 1) + 1 - len(anchors))
        time.sleep(0.02)
    return anchors, time.monotonic() - t0


def kill_points(anchors: list[float], end_s: float, points: int,
                rng: random.Random) -> list[tuple[int, float]]:
    """``points`` random kill points ``(rows, offset_s)``, in order.

    ``rows`` is uniform over the reference's progress steps (0 .. its row count: each step is
    the work up to the next committed row, the last one the report after the last row), and
    ``offset_s`` uniform within that step's duration in the reference, so every trial, the
    validation, the frontier sweep and the report are about equally likely to be hit, at a
    random moment of their work.
    """
    bounds = [*anchors, end_s]
    out = []
    for _ in range(points):
        r = rng.randrange(len(anchors))
        out.append((r, rng.uniform(0, bounds[r + 1] - bounds[r])))
    return sorted(out)


def chaos(study: Path, work: Path, points: int, seed: int = 0,
          targets: list[tuple[int, float]] | None = None, log: Any = print,
          popen: Any = subprocess.Popen) -> ChaosResult:
    """Run the reference, then the interrupted run with ``points`` kills; compare them.

    Args:
        study: the study file (a twin study).
        work: an empty folder for runs, lesson stores and logs.
        points: how many kills.
        seed: seed of the kill moments.
        targets: the kill points as ``(rows, offset_s)`` (default: ``points`` drawn over the
            reference run, after it ran; given, the reference runs alongside the kills).
        log: where a line per kill goes.
        popen: what starts a ``servetune run`` (``subprocess.Popen``'s arguments; the test
            suite passes ``tests/fixtures/warm_cli.py:popen``, a process forked from an
            interpreter that has imported the CLI).
    """
    rng = random.Random(seed)
    out = work / "runs"
    sweep = [int(c) for c in yaml.safe_load(study.read_text())["sweep_concurrency"]]
    t0 = time.monotonic()
    with (work / "ref.stderr").open("wb") as err:  # alongside the kills when they are given
        ref = popen(_cmd(study, "ref", out), env=_env(work / "lessons-ref", work),
                    stdout=subprocess.DEVNULL, stderr=err, cwd=work)
    ref_end: list[float] = []
    waiter = threading.Thread(target=lambda: (ref.wait(), ref_end.append(time.monotonic())))
    waiter.start()

    def reference() -> list[dict[str, Any]]:
        waiter.join(timeout=600)
        if ref.returncode != 0:
            raise RuntimeError("the reference run failed:\n"
                               + (work / "ref.stderr").read_text(errors="replace")[-2000:])
        return ledger_rows(out / "ref")

    if targets is None:
        anchors, end_s = timeline(ref, out / "ref")
        reference()
        targets = kill_points(anchors, end_s, points, rng)
    run_dir, env, cmd = out / "chaos", _env(work / "lessons-chaos", work), _cmd(study, "chaos",
                                                                              out)
    kills: list[Kill] = []
    t1 = time.monotonic()
    prev: Kill | None = None
    committed: list[dict[str, Any]] = []
    seg_start = 0  # deploy events before this index belong to earlier processes

    errs: list[Path] = []  # stderr of each start

    def launch() -> subprocess.Popen[bytes]:
        errs.append(work / f"start-{len(errs) + 1}.stderr")
        with errs[-1].open("wb") as err:
            return popen(cmd, env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=err)

    def settle(proc: subprocess.Popen[bytes], killed_by_us: bool) -> None:
        """After a process ended: check what it did against the kill before it."""
        nonlocal committed, seg_start
        rows = ledger_rows(run_dir)
        evs = deploys(run_dir)
        if prev is not None:
            before = {r["key"]: normalized(r, "chaos") for r in committed}
            after = {r["key"]: normalized(r, "chaos") for r in rows}
            prev.lost = [k for k, v in before.items()
                         if after.get(k) != v and not _status_only(v, after.get(k))]
            done = done_keys(committed, sweep)
            seg = evs[seg_start:]
            prev.double = [k for k in seg if k in done]
            prev.double += [k for i, k in enumerate(seg) if k in seg[:i]]
            earlier = set(evs[:seg_start])
            prev.redone = [k for k in seg if k not in done and k in earlier]
            if not killed_by_us and proc.returncode != 0:
                err = errs[-1].read_text(errors="replace")
                prev.error = f"exit {proc.returncode}: {err.strip()[-600:]}"
        committed, seg_start = rows, len(evs)

    for i, (rows, offset_s) in enumerate(targets):
        start = marks(run_dir)
        proc = launch()
        k = Kill(rows=rows, offset_s=offset_s)
        t_start = time.monotonic()
        try:
            if _wait_for(proc, run_dir, rows, start):
                time.sleep(offset_s)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                k.killed = True
            k.ran_s = time.monotonic() - t_start
        finally:
            proc.wait(timeout=60)
        settle(proc, k.killed)
        k.rows_before = len(committed)
        kills.append(k)
        prev = k
        log(f"kill {i + 1:2d}/{len(targets)}: {offset_s:5.2f} s after row {rows:2d} "
            f"({k.ran_s:4.1f} s after the start), {k.rows_before:2d} rows committed"
            + ("" if k.killed else " - the study had finished"))
        if not k.killed:  # it finished on its own
            completed = proc.returncode == 0
            break
    else:
        proc = launch()
        proc.wait(timeout=600)
        settle(proc, False)
        completed = proc.returncode == 0
    final, chaos_s = ledger_rows(run_dir), time.monotonic() - t1
    ref_rows = reference()
    diffs = compare(ref_rows, final, "ref", "chaos")
    return ChaosResult(kills=kills, ref_rows=len(ref_rows), final_rows=len(final),
                       equal=not diffs, diffs=diffs, completed=completed, ref_s=ref_end[0] - t0,
                       chaos_s=chaos_s)


def _status_only(before: Any, after: Any) -> bool:
    """Whether ``after`` is ``before`` promoted to winner (the one update the ledger allows)."""
    if not isinstance(before, dict) or not isinstance(after, dict):
        return False
    rest = {"status", "reason"}
    return (after.get("status") == "winner" and before.get("status") == "finalist"
            and {k: v for k, v in before.items() if k not in rest}
            == {k: v for k, v in after.items() if k not in rest})


def report(r: ChaosResult) -> str:
    """The summary lines printed at the end."""
    lines = []
    for i, k in enumerate(r.kills, 1):
        for what, keys in (("lost or changed", k.lost), ("deployed twice", k.double)):
            if keys:
                lines.append(f"  kill {i}: {what}: {', '.join(keys)}")
        if k.error:
            lines.append(f"  kill {i}: the restart failed: {k.error}")
    redone = sum(len(k.redone) for k in r.kills)
    lines += [
        f"interruptions survived: {r.survived}/{r.tried}"
        + (f" ({len(r.kills) - r.tried} kill point(s) came after the study finished)"
           if len(r.kills) > r.tried else ""),
        f"study completed after the last kill: {'yes' if r.completed else 'NO'}",
        f"final ledger equals the uninterrupted run's: {'yes' if r.equal else 'NO'} "
        f"({r.final_rows} rows vs {r.ref_rows})",
        *(f"  {d}" for d in r.diffs[:20]),
        f"deploys of committed work (double deploys): "
        f"{sum(len(k.double) for k in r.kills)}; deploys redone after a kill: {redone}",
        f"wall time: reference {r.ref_s:.1f} s, interrupted run {r.chaos_s:.1f} s "
        f"({len(r.kills)} starts + the last)",
    ]
    return "\n".join(lines)


def main() -> None:
    """Run the chaos benchmark and print its summary; exit 1 if an interruption was not survived."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=Path, nargs="?", help="study file (default: a small one)")
    ap.add_argument("--points", type=int, default=20, help="kills (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="work folder (default: a temporary one)")
    args = ap.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="chaos-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    study = args.study
    if study is None:
        study = work / "study.yaml"
        study.write_text(yaml.safe_dump(small_study()))
    print(f"work folder: {work}")
    r = chaos(study.resolve(), work, args.points, args.seed)
    print(report(r))
    ok = r.survived == r.tried and r.completed and r.equal
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
