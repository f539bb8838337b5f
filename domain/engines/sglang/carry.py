"""Whether a source-verified lesson learned on one SGLang version holds on another.

A verified lesson's condition was read from the guard of one raise/assert site
(``Lesson.source_site``, e.g. ``sglang/srt/managers/tp_worker.py:420``) in the tree of the
version it was learned on. It carries to version B when B's copy of that file still has a
raise/assert with the same guard: the same enclosing ``if`` tests (``not (...)`` for an ``else``
branch) and the same exception, or the same ``assert`` test, compared as ``ast.unparse`` text
(formatting and line numbers do not matter; any change of the test does). Both trees must be
fetched (``servetune source fetch --version X``); without B's tree the lesson does not carry and
:func:`carries` says why.

The trees are found where ``servetune source fetch`` unpacks them
(:func:`domain.engines.source_cache_dir`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from domain.engines import source_cache_dir
from domain.engines.sglang.versions import FETCH_COMMAND


def tree_of(version: str) -> Path | None:
    """The fetched tree of ``version`` (the directory holding ``sglang/``), or None."""
    root = source_cache_dir() / f"sglang-{version}"
    try:
        return root if (root / "sglang").is_dir() else None
    except OSError:
        return None


def _guards(body: list[ast.stmt], tests: tuple[str, ...]) -> Iterator[tuple[ast.stmt, str]]:
    """``(raise or assert statement, its guard text)`` of every one under ``body``."""
    for st in body:
        if isinstance(st, ast.Assert):
            yield st, " and ".join((*tests, f"assert {ast.unparse(st.test)}"))
        elif isinstance(st, ast.Raise):
            exc = st.exc.func if isinstance(st.exc, ast.Call) else st.exc
            yield st, " and ".join((*tests, f"raise {ast.unparse(exc) if exc else ''}"))
        if isinstance(st, ast.If):
            test = ast.unparse(st.test)
            yield from _guards(st.body, (*tests, test))
            yield from _guards(st.orelse, (*tests, f"not ({test})"))
            continue
        # a def starts afresh; loops, with and try blocks keep the tests around them
        keep = () if isinstance(st, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) \
            else tests
        blocks = [getattr(st, n, []) for n in ("body", "orelse", "finalbody")]
        blocks += [h.body for h in getattr(st, "handlers", [])]
        for block in blocks:
            if block and isinstance(block[0], ast.stmt):
                yield from _guards(block, keep)


def _file_guards(path: Path) -> tuple[tuple[int, int, str], ...]:
    """``(first line, last line, guard text)`` of each raise/assert of a file; () if unreadable.

    Parsed once per file version (path, size and modification time); a missing file is
    looked at again next time.
    """
    try:
        st = path.stat()
    except OSError:
        return ()
    return _parsed_guards(path, st.st_size, st.st_mtime_ns)


@cache
def _parsed_guards(path: Path, size: int, mtime_ns: int) -> tuple[tuple[int, int, str], ...]:
    try:
        mod = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return ()
    return tuple((st.lineno, st.end_lineno or st.lineno, text)
                 for st, text in _guards(mod.body, ()))


def guard_at(root: Path, site: str) -> str | None:
    """The guard text of the raise/assert at ``site`` (``rel/path.py:LINE``) in ``root``."""
    rel, _, line = site.rpartition(":")
    if not rel or not line.isdigit():
        return None
    n = int(line)
    hits = [g for g in _file_guards(root / rel) if g[0] <= n <= g[1]]
    return min(hits, key=lambda g: g[1] - g[0])[2] if hits else None


def carries(site: str, learned_on: str, version: str) -> tuple[bool, str]:
    """Whether a lesson verified at ``site`` on ``learned_on`` applies to ``version``, and why.

    Returns:
        ``(True, "guard unchanged at FILE:LINE in VERSION")`` when ``version``'s file holds a
        raise/assert with the same guard text; ``(False, reason)`` otherwise: a tree not
        fetched (the reason names the fetch command), the site not readable, or the guard
        changed or gone.
    """
    if learned_on == version:
        return True, "the version it was learned on"
    roots = {v: tree_of(v) for v in (learned_on, version)}
    missing = [v for v, r in roots.items() if r is None]
    if missing:
        return False, ("the guard cannot be compared without the source of SGLang "
                       + " and ".join(missing) + ": run "
                       + "; ".join(f"`{FETCH_COMMAND.format(version=v)}`" for v in missing))
    old_root, new_root = roots[learned_on], roots[version]
    assert old_root is not None and new_root is not None
    guard = guard_at(old_root, site)
    if guard is None:
        return False, f"no raise/assert at {site} in SGLang {learned_on}'s source"
    rel = site.rpartition(":")[0]
    same = [g for g in _file_guards(new_root / rel) if g[2] == guard]
    if not same:
        return False, f"the guard at {site} ({guard}) changed or is gone in SGLang {version}"
    return True, f"guard unchanged at {rel}:{same[0][0]} in SGLang {version}"
