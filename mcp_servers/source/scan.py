"""Finding a flag in the source: whole-word occurrences, and the statements that concern it.

Text first, syntax second: a file is considered only if its text names the flag, and only the
functions that name it are parsed. Each such function is cut out of the file by indentation
(from its ``def`` line to the next line at the same or a lower indentation), dedented and parsed
on its own; when a cut does not parse, or the flag is named outside any function, the whole file
is parsed instead (cached by the tree). Statements then come with their enclosing function and
the ``if`` conditions around them.
"""

from __future__ import annotations

import ast
import bisect
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from mcp_servers.source.flags import FlagInventory
from mcp_servers.source.tree import SourceTree

MAX_SRC = 300
_DEF_RE = re.compile(r"(?:async[ \t]+)?def[ \t]+(\w+)")
_CLASS_RE = re.compile(r"class[ \t]+(\w+)")


def short(src: str, limit: int = MAX_SRC) -> str:
    """``src`` on one line, cut at ``limit`` characters."""
    src = " ".join(src.split())
    return src if len(src) <= limit else src[:limit] + " ..."


def phase(rel: str) -> Literal["startup", "runtime"]:
    """'startup' for argument parsing and resolution code, 'runtime' for the rest."""
    return "startup" if "/arg_groups/" in rel or rel.endswith("server_args.py") else "runtime"


def spellings(inv: FlagInventory, flag: str) -> tuple[str, list[str]]:
    """(dest, CLI spellings without --no- forms) of ``flag``.

    Raises:
        SourceError: unknown flag (see ``FlagInventory.dest_of``).
    """
    dest = inv.dest_of(flag)
    cli = {"--" + dest.replace("_", "-")}
    for f in inv.flags:
        if f.dest == dest:
            cli.update(s for s in f.flags if not s.startswith("--no-"))
    return dest, sorted(cli)


def candidates(tree: SourceTree, needles: list[str]) -> list[str]:
    """Python files whose text holds any of ``needles``, sorted."""
    return sorted(rel for rel, text in tree.texts.items()
                  if rel.endswith(".py") and any(n in text for n in needles))


def _whole(text: str, start: int, end: int, extra: str) -> bool:
    before = text[start - 1] if start else " "
    after = text[end] if end < len(text) else " "
    return not (before.isalnum() or before in "_" + extra or after.isalnum()
                or after in "_" + extra)


def occurrences(text: str, dest: str, cli: list[str]) -> list[tuple[int, int, bool]]:
    """(start, end, is_cli) of every whole-word occurrence of ``dest`` or a CLI spelling."""
    out = []
    for needle, is_cli in [(dest, False), *((c, True) for c in cli)]:
        i = text.find(needle)
        while i >= 0:
            j = i + len(needle)
            if _whole(text, i, j, "-" if is_cli else ""):
                out.append((i, j, is_cli))
            i = text.find(needle, j)
    out.sort()
    return out


def lines_of(text: str, positions: list[int]) -> list[int]:
    """1-based line numbers of sorted character ``positions``."""
    lines, line_no, scan = [], 1, 0
    for pos in positions:
        line_no += text.count("\n", scan, pos)
        scan = pos
        lines.append(line_no)
    return lines


# -- statements with context --------------------------------------------------------------------

@dataclass(frozen=True)
class Ctx:
    """Where a statement sits."""

    func: str  # qualified name of the enclosing function, '<module>' at top level
    conds: tuple[str, ...]  # enclosing if conditions in this function, outermost first
    mentions: bool  # an enclosing condition names the flag
    unset: bool  # an enclosing condition tests the flag for None / falsiness


class Mentions:
    """Whether an AST node names the flag (attribute, name, keyword or inside a string)."""

    def __init__(self, dest: str, cli: list[str]) -> None:
        self.dest = dest
        self.rx = re.compile("|".join([rf"(?<!\w){re.escape(dest)}(?!\w)"]
                                      + [rf"(?<![\w-]){re.escape(c)}(?![\w-])" for c in cli]))

    def __call__(self, node: ast.AST | None) -> bool:
        """True if ``node`` or a node below it names the flag."""
        if node is None:
            return False
        for n in ast.walk(node):
            if isinstance(n, ast.Attribute) and n.attr == self.dest \
                    or isinstance(n, ast.Name) and n.id == self.dest \
                    or isinstance(n, ast.keyword) and n.arg == self.dest \
                    or isinstance(n, ast.Constant) and isinstance(n.value, str) \
                    and self.rx.search(n.value):
                return True
        return False


class _Lines:
    """Sorted line numbers where the flag is named; answers 'is any inside this node?'."""

    def __init__(self, lines: list[int]) -> None:
        self.lines = lines

    def __call__(self, node: ast.AST) -> bool:
        lo = getattr(node, "lineno", 0)
        hi = getattr(node, "end_lineno", None) or lo
        i = bisect.bisect_left(self.lines, lo)
        return i < len(self.lines) and self.lines[i] <= hi


def _statements(body: list[ast.stmt], ctx: Ctx, mentions: Mentions, named: _Lines,
                scope: str = "") -> Iterator[tuple[ast.stmt, Ctx]]:
    """Statements under ``body`` that may concern the flag, with function and ``if`` context.

    A statement is skipped, with its whole subtree, when neither it nor an enclosing condition
    names the flag.
    """
    for st in body:
        if not ctx.mentions and not named(st):
            continue
        yield st, ctx
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{scope}{st.name}"
            yield from _statements(st.body, Ctx(name, (), False, False), mentions, named,
                                   name + ".")
        elif isinstance(st, ast.ClassDef):
            yield from _statements(st.body, ctx, mentions, named, f"{scope}{st.name}.")
        elif isinstance(st, ast.If):
            test = short(ast.unparse(st.test), 200)
            hit = named(st.test) and mentions(st.test)
            unset = hit and ("None" in test or test.startswith("not ") or " not " in test)
            inner = Ctx(ctx.func, (*ctx.conds, test), ctx.mentions or hit, ctx.unset or unset)
            yield from _statements(st.body, inner, mentions, named, scope)
            if st.orelse:
                other = Ctx(ctx.func, (*ctx.conds, f"not ({test})"), ctx.mentions or hit,
                            ctx.unset)
                yield from _statements(st.orelse, other, mentions, named, scope)
        else:
            for field in ("body", "orelse", "finalbody"):
                sub = getattr(st, field, None)
                if isinstance(sub, list) and sub and isinstance(sub[0], ast.stmt):
                    yield from _statements(sub, ctx, mentions, named, scope)
            for h in getattr(st, "handlers", []):
                yield from _statements(h.body, ctx, mentions, named, scope)
            for c in getattr(st, "cases", []):
                yield from _statements(c.body, ctx, mentions, named, scope)


# -- cutting functions out of a file ------------------------------------------------------------

def _indent(line: str) -> int | None:
    """Indentation of a code line; None for blank and comment-only lines."""
    body = line.lstrip(" \t")
    if not body.strip() or body.startswith("#"):
        return None
    return len(line) - len(body)


def _function_of(lines: list[str], n: int) -> tuple[int, str] | None:
    """(def line, class prefix) of the outermost function around 1-based line ``n``."""
    own = lines[n - 1]
    cur = _indent(own)
    if cur is None:
        return None
    outer: int | None = n if _DEF_RE.match(own.lstrip()) else None
    classes: list[str] = []
    j = n - 1
    while j >= 1 and cur > 0:
        line = lines[j - 1]
        ind = _indent(line)
        if ind is not None and ind < cur and line.lstrip(" \t")[0] not in ")]}":
            cur = ind
            head = line.lstrip()
            if _DEF_RE.match(head):
                outer, classes = j, []
            elif (m := _CLASS_RE.match(head)) is not None and outer is not None:
                classes.append(m.group(1))
        j -= 1
    if outer is None:
        return None
    return outer, "".join(c + "." for c in reversed(classes))


def _end_of(lines: list[str], start: int) -> int:
    """Last line of the block whose header is at 1-based line ``start``."""
    k = _indent(lines[start - 1]) or 0
    last = start
    for n in range(start + 1, len(lines) + 1):
        line = lines[n - 1]
        ind = _indent(line)
        if ind is None:
            continue
        if ind <= k and line.lstrip(" \t")[0] not in ")]}":
            break
        last = n
    return last


def _parse_function(lines: list[str], start: int, end: int) -> ast.stmt | None:
    """The function at lines ``start``..``end``, parsed on its own with true line numbers."""
    k = _indent(lines[start - 1]) or 0
    body = []
    for line in lines[start - 1:end]:
        if line[:k].strip(" \t"):
            return None  # less indented than the def: a string or a continuation; give up
        body.append(line[k:])
    try:
        mod = ast.parse("\n".join(body))
    except (SyntaxError, ValueError):
        return None
    if len(mod.body) != 1 or not isinstance(mod.body[0], (ast.FunctionDef,
                                                          ast.AsyncFunctionDef)):
        return None
    ast.increment_lineno(mod, start - 1)
    return mod.body[0]


def _units(tree: SourceTree, rel: str, lines_named: list[int]) -> list[tuple[ast.stmt, str]]:
    """(statement, class prefix) units to walk: the functions naming the flag, else the module."""
    text = tree.texts[rel]
    lines = text.split("\n")
    units: list[tuple[ast.stmt, str]] = []
    covered_to = 0
    for n in lines_named:
        if n <= covered_to:
            continue
        found = _function_of(lines, n)
        if found is None:
            units = []
            break
        start, prefix = found
        end = _end_of(lines, start)
        fn = _parse_function(lines, start, end) if start <= n <= end else None
        if fn is None:
            units = []
            break
        units.append((fn, prefix))
        covered_to = end
    if units:
        return units
    mod = tree.parse(rel)
    return [(st, "") for st in mod.body] if mod is not None else []


def scan(tree: SourceTree, dest: str, cli: list[str]) -> Iterator[tuple[str, ast.stmt, Ctx,
                                                                      Mentions]]:
    """Statements that may concern the flag, start-up files first, then path and line order."""
    mentions = Mentions(dest, cli)
    files = candidates(tree, [dest, *cli])
    for rel in [r for r in files if phase(r) == "startup"] + \
            [r for r in files if phase(r) == "runtime"]:
        text = tree.texts[rel]
        occ = occurrences(text, dest, cli)
        if not occ:
            continue
        named = _Lines(lines_of(text, [o[0] for o in occ]))
        top = Ctx("<module>", (), False, False)
        for unit, prefix in _units(tree, rel, sorted(set(named.lines))):
            for st, ctx in _statements([unit], top, mentions, named, prefix):
                yield rel, st, ctx, mentions
