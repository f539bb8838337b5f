"""The append-only trial ledger of a run: SQLite in WAL mode, one committed row per trial.

Every trial is committed before the study takes its next step, so a killed run loses nothing
and a resumed one can skip finished work by its ``key``. Standard library only.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from domain.config import ServingConfig
from domain.redact import redact
from domain.trial import LintNote, Trial

LintHook = Callable[[ServingConfig], list[LintNote]]
"""The lints of a config (the run wires ``domain.preflight:lint_config`` with its study)."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS trials (
    seq INTEGER PRIMARY KEY,
    key TEXT NOT NULL UNIQUE,
    run_id TEXT NOT NULL,
    phase TEXT NOT NULL,
    status TEXT NOT NULL,
    config_id TEXT NOT NULL,
    changed TEXT NOT NULL,
    objective REAL,
    reason TEXT NOT NULL,
    created_at TEXT NOT NULL,
    body TEXT NOT NULL
);
"""


class Ledger:
    """A run's ledger at ``path`` (created on first use)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, timeout=30, isolation_level=None,
                                   check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)
        self._tx_lock = threading.RLock()  # the connection is shared across threads
        # fills the lints of a row appended without any (None: rows are stored as given)
        self.lint: LintHook | None = None

    def close(self) -> None:
        """Close the connection."""
        self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """Run a read-modify-write as one ``BEGIN IMMEDIATE`` transaction (all or nothing).

        The write lock is taken at BEGIN, so a second writer on the same file waits (up to the
        connection timeout) instead of reading a seq or status that is stale by its write.
        """
        with self._tx_lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # ---- meta ----
    def get_meta(self, key: str) -> str | None:
        """A run-level value (e.g. the study digest), or None."""
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        """Store a run-level value (committed at once)."""
        self._db.execute("INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) "
                         "DO UPDATE SET value=excluded.value", (key, value))

    # ---- trials ----
    def next_seq(self) -> int:
        """The seq the next appended trial gets."""
        row = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM trials").fetchone()
        return int(row[0])

    def append(self, trial: Trial) -> Trial:
        """Commit ``trial``; if its key is already there, return the stored one unchanged.

        A row without lints gets the :attr:`lint` hook's findings for its config (when set).

        Returns:
            The committed trial (its ``seq`` is the ledger's).
        """
        with self._transaction():
            existing = self.get(trial.key)
            if existing is not None:
                return existing
            lints = trial.lints or (self.lint(trial.config) if self.lint is not None else [])
            trial = trial.model_copy(update={
                "lints": lints,
                "seq": self.next_seq(),
                "created_at": trial.created_at or datetime.now(UTC).isoformat(timespec="seconds")})
            self._db.execute(
                "INSERT INTO trials(seq, key, run_id, phase, status, config_id, changed, objective,"
                " reason, created_at, body) VALUES(?,?,?,?,?,?,?,?,?,?,?)",
                (trial.seq, trial.key, trial.run_id, trial.phase, trial.status,
                 trial.config.config_id(), trial.changed, trial.objective, trial.reason,
                 trial.created_at, trial.model_dump_json()))
        return trial

    def update_status(self, key: str, status: str, reason: str | None = None) -> None:
        """Change the status (and optionally the reason) of a committed trial.

        The reason is redacted (``domain.redact``) before it is stored, in its column and in the
        row's body. Raises KeyError when no trial has ``key``.
        """
        with self._transaction():
            t = self.get(key)
            if t is None:
                raise KeyError(key)
            upd: dict[str, str] = {"status": status}
            if reason is not None:  # model_copy runs no validator: redact as Trial.reason does
                upd["reason"] = redact(reason)
            t = t.model_copy(update=upd)
            self._db.execute("UPDATE trials SET status=?, reason=?, body=? WHERE key=?",
                             (t.status, t.reason, t.model_dump_json(), key))

    def get(self, key: str) -> Trial | None:
        """The trial with ``key``, or None."""
        row = self._db.execute("SELECT body FROM trials WHERE key=?", (key,)).fetchone()
        return Trial.model_validate_json(row[0]) if row else None

    def trials(self, phase: str | None = None) -> list[Trial]:
        """All trials in seq order (optionally of one phase)."""
        q = "SELECT body FROM trials" + (" WHERE phase=?" if phase else "") + " ORDER BY seq"
        rows = self._db.execute(q, (phase,) if phase else ()).fetchall()
        return [Trial.model_validate_json(r[0]) for r in rows]
