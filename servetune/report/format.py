"""Formatting helpers of the report: numbers, Markdown tables and fences, atomic writes."""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from domain.layout import has_layout, layout_label
from domain.metrics import MetricsSummary
from domain.trial import Trial

EVIDENCE_LINES = 12


REASON_CHARS = 240


def _num(v: float | None, digits: int = 1) -> str:
    """``v`` with thousands separators, '' for None, 'n/a' for NaN."""
    if v is None:
        return ""
    if isinstance(v, float) and math.isnan(v):
        return "n/a"
    return f"{v:,.{digits}f}"


def _cell(text: object) -> str:
    """One Markdown table cell: a single line with ``|`` escaped."""
    s = " ".join(str(text).split())
    if len(s) > REASON_CHARS:
        s = s[: REASON_CHARS - 1] + "…"
    return s.replace("|", "\\|")


def _table(header: list[str], rows: Iterable[list[object]]) -> list[str]:
    """Markdown table lines."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def _changed(t: Trial) -> str:
    """A trial's name: what it changed ('baseline'), then its layout when it has one.

    A config with a parallel layout (``domain.layout.has_layout``) is named with its layout
    label in brackets, e.g. ``"attn_dp_size=8 [TP8 DP-attn8 EP8]"``, ``"baseline [1P1D TP4]"``;
    other configs keep their plain name.
    """
    name = t.changed or "baseline"
    return f"{name} [{layout_label(t.config)}]" if has_layout(t.config) else name


def _fence(text: str, lang: str = "") -> list[str]:
    """``text`` in a code fence longer than any backtick run inside it."""
    longest, run = 0, 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    fence = "`" * max(3, longest + 1)
    return [fence + lang, text, fence]


def _concurrency(t: Trial) -> int | None:
    """Concurrency of a frontier trial, from its key ``frontier:<config_id>:<c>``."""
    parts = t.key.split(":")
    if len(parts) == 3 and parts[2].isdigit():
        return int(parts[2])
    words = t.reason.split()
    return int(words[-1]) if words and words[-1].isdigit() else None


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temp file next to ``path``, then rename it onto ``path``.

    The temp name is unique per process and call; the file is created by ``write`` itself, so
    it gets the usual umask permissions (``mkstemp`` would leave it owner-only).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def summary_rows(trials: list[Trial]) -> list[dict[str, Any]]:
    """Plain rows for the CLI's final table, in the order given.

    Returns:
        One dict per trial: ``seq``, ``status``, ``changed`` ('baseline' when empty),
        ``objective`` (output tok/s/GPU or None) and ``reason`` (one line).
    """
    return [{"seq": t.seq, "status": t.status, "changed": _changed(t),
             "objective": t.objective, "reason": " ".join(t.reason.split())} for t in trials]


def _pct(v: float | None) -> str:
    return "" if v is None else f"{v:.0%}"


def _retractions(s: MetricsSummary | None) -> str:
    """A run's retraction count ('' with no run, 'n/a' when the server exposes no counter)."""
    if s is None:
        return ""
    return "n/a" if s.retractions is None else f"{s.retractions:,}"


def _lint_codes(t: Trial) -> str:
    """The codes of the lints a row's config trips, comma-separated ('' for none)."""
    return ", ".join(n.code for n in t.lints)
