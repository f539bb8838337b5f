"""Deployment records of a cluster backend: in memory, or JSON files shared between processes.

Claude Code runs the cluster and bench MCP servers as two stdio processes; both build a backend
over the same state folder, so a deployment made by one is seen (and can be torn down) by the
other. Each record is one JSON file ``<root>/<name>.json``, replaced atomically (write a temporary
file in the same folder, then :func:`os.replace`), and every read-modify-write holds an exclusive
``fcntl.flock`` on ``<root>/.lock``, so two processes never lose each other's updates.

A file that is not a JSON object (truncated, hand-edited) raises :class:`UnreadableRecord`
naming the file; :meth:`RecordStore.set_aside` renames it to ``<name>.json.<time>.corrupt``, out of
the way of the name.

Records are written redacted (:func:`domain.redact.redact_any` over every string): they hold
engine log lines (an exit event's last line, a status message), which may print a secret.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from domain.redact import redact_any


class UnreadableRecord(ValueError):
    """A record file exists but is not a JSON object."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


class RecordStore:
    """Named JSON records, in memory (``root=None``) or under ``root`` (created if missing)."""

    def __init__(self, root: Path | None) -> None:
        self.root = root
        self._mem: dict[str, dict[str, Any]] = {}
        self._thread_lock = threading.RLock()
        self._depth = 0
        self._lock_fd: int | None = None
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the store's lock: a thread lock, plus an ``flock`` across processes.

        Re-entrant within one thread; the file lock is taken by the outermost level only.
        """
        with self._thread_lock:
            if self.root is not None and self._depth == 0:
                fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._lock_fd = fd
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0 and self._lock_fd is not None:
                    fd, self._lock_fd = self._lock_fd, None
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)

    def path(self, name: str) -> Path | None:
        """The file of record ``name`` (None for an in-memory store)."""
        return None if self.root is None else self.root / f"{name}.json"

    def read(self, name: str) -> dict[str, Any] | None:
        """The record ``name``, or None if there is none.

        Raises:
            UnreadableRecord: the file exists but is not a JSON object.
        """
        if self.root is None:
            rec = self._mem.get(name)
            return json.loads(json.dumps(rec)) if rec is not None else None
        path = self.root / f"{name}.json"
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise UnreadableRecord(path, f"cannot be read ({e.strerror or e})") from e
        try:
            rec = json.loads(raw.decode())
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise UnreadableRecord(path, f"is not valid JSON ({e})") from e
        if not isinstance(rec, dict):
            raise UnreadableRecord(path, f"holds a JSON {type(rec).__name__}, not an object")
        return rec

    def set_aside(self, name: str) -> Path | None:
        """Rename the file of record ``name`` to ``<name>.json.<time>.corrupt``; its new path.

        None if there was no such file (or the store is in memory: the record is dropped).
        """
        if self.root is None:
            self._mem.pop(name, None)
            return None
        path = self.root / f"{name}.json"
        dest = self.root / f"{name}.json.{time.strftime('%Y%m%dT%H%M%S')}.corrupt"
        n = 1
        while dest.exists():
            n += 1
            dest = self.root / f"{name}.json.{time.strftime('%Y%m%dT%H%M%S')}-{n}.corrupt"
        try:
            os.rename(path, dest)
        except FileNotFoundError:
            return None
        return dest

    def write(self, name: str, record: dict[str, Any]) -> None:
        """Store ``record`` as ``name`` (atomically replacing any previous version), redacted."""
        record = redact_any(record)
        if self.root is None:
            self._mem[name] = json.loads(json.dumps(record))
            return
        write_atomic(self.root / f"{name}.json", json.dumps(record, indent=1))

    def names(self) -> list[str]:
        """Names of every stored record (unordered)."""
        if self.root is None:
            return list(self._mem)
        return [p.stem for p in self.root.glob("*.json")]

    def folder(self, name: str) -> Path:
        """A folder for the files of record ``name`` (logs, configs); created if missing.

        Raises:
            ValueError: for an in-memory store.
        """
        if self.root is None:
            raise ValueError("an in-memory record store has no folders")
        path = self.root / name
        path.mkdir(exist_ok=True)
        return path


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new file, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
