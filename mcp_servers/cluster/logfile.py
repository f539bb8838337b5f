"""A server's log file as timestamped lines, for the local backend.

The server writes plain lines (SGLang's own format) to a file; a line's time is taken from
*marks*: ``(bytes on disk, file mtime)`` pairs recorded whenever a reader saw the file grow. A
line gets the time of the first mark that covers its end, i.e. the mtime when it was first seen
on disk: exact while someone polls (``status`` does during startup), later otherwise.
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path

from mcp_servers.cluster.backend import LogLine

MAX_LOG_BYTES = 8 << 20  # lines() reads at most the last 8 MiB of a log
Mark = tuple[int, float]  # (bytes on disk, epoch s of the file's mtime then)


def text(raw: bytes) -> str:
    """One raw line as text; of a line rewritten with carriage returns (tqdm), the last part."""
    return raw.decode(errors="replace").rstrip("\r").split("\r")[-1].rstrip()


def growth(path: Path, marks: list[Mark]) -> Mark | None:
    """A new mark if the file grew past the last one, else None (also if it does not exist)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_size, st.st_mtime) if st.st_size > (marks[-1][0] if marks else 0) else None


def last_line(path: Path) -> str:
    """The last non-empty line of the file (read from its last 64 KiB); '' if none."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))
            tail = f.read()
    except FileNotFoundError:
        return ""
    for raw in reversed(tail.split(b"\n")):
        if line := text(raw).strip():
            return line
    return ""


def lines(path: Path, marks: list[Mark]) -> tuple[list[LogLine], Mark | None]:
    """Non-empty lines of the file's last 8 MiB, stamped by ``marks``.

    Returns:
        (lines, the new mark to record if the file grew past the last mark, else None).
    """
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            base = max(0, st.st_size - MAX_LOG_BYTES)
            f.seek(base)
            data = f.read(st.st_size - base)
    except FileNotFoundError:
        return [], None
    size = base + len(data)
    new: Mark | None = None
    if size > (marks[-1][0] if marks else 0):
        new = (size, st.st_mtime)
        marks = [*marks, new]
    offsets = [m[0] for m in marks]
    out, pos = [], base
    for i, raw in enumerate(data.split(b"\n")):
        end = min(pos + len(raw) + 1, size)
        if raw.strip() and not (i == 0 and base > 0):  # skip a line cut by the 8 MiB window
            k = min(bisect.bisect_left(offsets, end), len(marks) - 1)
            out.append(LogLine(t=marks[k][1], text=text(raw)))
        pos += len(raw) + 1
    return out, new
