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
from dataclasses import dataclass, replace
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


Stage = Literal["arg-resolution", "engine-startup", "runtime", "test"]
STAGE_RANK: dict[str, int] = {"arg-resolution": 0, "engine-startup": 1, "runtime": 2, "test": 3}
# Functions (or their classes) that compute a setting while the engine starts, e.g.
# KVCacheConfigurator._resolve_memory_pool_config / resolve_max_num_reqs (the KV-pool size and
# the request cap from free GPU memory), ModelRunner.alloc_memory_pool, *_hook resolvers.
_ENGINE_FUNC_RE = re.compile(r"^_*resolve|_hook$|configurator|(alloc|init|resize)\w*pool", re.I)
_ENGINE_VALUE_RE = re.compile(r"(?<![\w])_*(resolve|compute)_\w*\(")


def phase(rel: str) -> Literal["startup", "runtime"]:
    """'startup' for argument parsing and resolution code, 'runtime' for the rest."""
    return "startup" if "/arg_groups/" in rel or rel.endswith("server_args.py") else "runtime"


def is_test(rel: str) -> bool:
    """True for test code: under sglang/test/ (mock runners, kits) or a tests/ directory."""
    parts = rel.split("/")
    return "test" in parts[:-1] or "tests" in parts[:-1] or parts[-1].startswith("test_")


def stage(rel: str, func: str, value: str = "") -> Stage:
    """Where a site runs: argument resolution, engine start-up resolution, runtime or tests.

    ``arg-resolution``: arg_groups/ and server_args.py. ``engine-startup``: a function whose name
    (or class, or file) says it resolves or configures the value as the engine starts
    (``resolve_*``, ``*_hook``, ``*Configurator``, ``alloc_*pool``, ``*configurator.py``), or an
    assignment whose value calls a ``resolve_*`` / ``compute_*`` function. ``test``: see
    :func:`is_test`. ``runtime``: the rest.
    """
    if is_test(rel):
        return "test"
    if phase(rel) == "startup":
        return "arg-resolution"
    if "configurator" in rel.rsplit("/", 1)[-1] or _ENGINE_VALUE_RE.search(value) \
            or any(_ENGINE_FUNC_RE.search(part) for part in func.split(".")):
        return "engine-startup"
    return "runtime"


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
    unset: bool  # an enclosing condition (or guard) tests the flag for None / falsiness
    guards: tuple[str, ...] = ()  # conditions that hold past earlier early exits (see _guards)
    guard_mentions: bool = False  # one of those guards names the flag
    shim: bool = False  # the function is an accessor / deprecation shim (see _is_shim)
    handler: bool = False  # inside an except handler

    @property
    def involved(self) -> bool:
        """An enclosing condition or a guard names the flag."""
        return self.mentions or self.guard_mentions


# -- early exits --------------------------------------------------------------------------------

_QUIET_EXITS = (ast.Return, ast.Continue, ast.Break)
_INVERSE: dict[type, type] = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.GtE,
                              ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt,
                              ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn,
                              ast.NotIn: ast.In}


def negate(node: ast.expr) -> ast.expr:
    """``not node``, simplified: ``not not x`` -> ``x``, inverted comparisons, De Morgan."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return node.operand
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _INVERSE:
        return ast.Compare(left=node.left, ops=[_INVERSE[type(node.ops[0])]()],
                           comparators=node.comparators)
    if isinstance(node, ast.BoolOp):
        op = ast.And() if isinstance(node.op, ast.Or) else ast.Or()
        return ast.BoolOp(op=op, values=[negate(v) for v in node.values])
    return ast.UnaryOp(op=ast.Not(), operand=node)


def _exits_quietly(body: list[ast.stmt]) -> bool:
    """The block ends in return / continue / break (an early exit that raises nothing)."""
    return bool(body) and isinstance(body[-1], _QUIET_EXITS)


def _guards(st: ast.stmt) -> list[tuple[ast.expr, ast.expr]]:
    """(test, condition) pairs that hold for the statements after ``st``, an early exit.

    ``if c: return`` (or continue / break) gives ``not c``; ``if c: ... else: return`` gives
    ``c``; an ``elif`` chain of early exits gives one condition per branch.
    """
    if not isinstance(st, ast.If):
        return []
    if _exits_quietly(st.body):
        if not st.orelse:
            return [(st.test, negate(st.test))]
        if len(st.orelse) == 1 and isinstance(st.orelse[0], ast.If):
            return [(st.test, negate(st.test)), *_guards(st.orelse[0])]
        return [] if _exits_quietly(st.orelse) else [(st.test, negate(st.test))]
    if st.orelse and _exits_quietly(st.orelse):
        return [(st.test, st.test)]
    return []


def _tests_unset(test: str) -> bool:
    return "None" in test or test.startswith("not ") or " not " in test


_SHIM_NAME_RE = re.compile(r"^__(getattr|getattribute|setattr|delattr|dir|get|set)__$|"
                           r"deprecat|retired|legacy|shim", re.I)
_SHIM_DOC_RE = re.compile(r"\b(retired|deprecated|legacy|shim|removed)\b", re.I)


def _is_shim(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """True for an accessor or deprecation shim rather than checking code.

    That is a ``__getattr__``-like function, or one whose name or docstring summary says it is
    retired, deprecated, legacy or a shim (``get_global_server_args``: "Retired accessor").
    """
    doc = ast.get_docstring(fn, clean=False) or ""
    return bool(_SHIM_NAME_RE.search(fn.name) or _SHIM_DOC_RE.search(doc.split("\n\n")[0]))


class Mentions:
    """Whether an AST node names the flag (attribute, name, keyword or inside a string).

    In a string, a CLI spelling counts anywhere, and so does the dest when it has an underscore
    (``max_running_requests``); a one-word dest such as ``port`` or ``config`` counts only as the
    whole string (a key or getattr name), not as an English word in a message.
    """

    def __init__(self, dest: str, cli: list[str]) -> None:
        self.dest = dest
        self.one_word = "_" not in dest.strip("_")
        words = [] if self.one_word else [rf"(?<!\w){re.escape(dest)}(?!\w)"]
        self.rx = re.compile("|".join(words + [rf"(?<![\w-]){re.escape(c)}(?![\w-])"
                                               for c in cli]))

    def __call__(self, node: ast.AST | None, tested: bool = False, message: bool = False) -> bool:
        """True if ``node`` or a node below it names the flag.

        With ``tested``, a flag that is only handed to a call as a keyword argument
        (``negotiate(max_bs=self.flag)``) does not count: the test is about something else.
        With ``message``, a local variable named like a one-word dest (``{device}`` in an
        f-string) does not count: the message must spell the flag or read it from a config
        (``cfg.device``).
        """
        if node is None:
            return False
        todo = [node]
        while todo:
            n = todo.pop()
            if tested and isinstance(n, ast.keyword):
                continue
            if isinstance(n, ast.Attribute) and n.attr == self.dest \
                    or isinstance(n, ast.Name) and n.id == self.dest \
                    and not (message and self.one_word) \
                    or isinstance(n, ast.keyword) and n.arg == self.dest \
                    or isinstance(n, ast.Constant) and isinstance(n.value, str) \
                    and (n.value == self.dest or self.rx.search(n.value) is not None):
                return True
            todo.extend(ast.iter_child_nodes(n))
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
    """Statements under ``body`` that may concern the flag, with their context.

    A statement is skipped, with its whole subtree, when neither it nor an enclosing condition
    or guard names the flag. Early exits (``if c: return``) earlier in the same block, or in an
    enclosing block of the same function, become guards of the statements after them.
    """
    for st in body:
        if ctx.involved or named(st):
            yield st, ctx
            yield from _nested(st, ctx, mentions, named, scope)
        exits = _guards(st)
        if exits:
            texts = tuple(short(ast.unparse(g), 200) for _, g in exits)
            hit = any(named(t) and mentions(t, tested=True) for t, _ in exits)
            ctx = replace(ctx, guards=(*ctx.guards, *texts),
                          guard_mentions=ctx.guard_mentions or hit,
                          unset=ctx.unset or hit and any(_tests_unset(t) for t in texts))


def _nested(st: ast.stmt, ctx: Ctx, mentions: Mentions, named: _Lines,
            scope: str) -> Iterator[tuple[ast.stmt, Ctx]]:
    if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
        name = f"{scope}{st.name}"
        yield from _statements(st.body, Ctx(name, (), False, False, shim=_is_shim(st)),
                               mentions, named, name + ".")
    elif isinstance(st, ast.ClassDef):
        yield from _statements(st.body, ctx, mentions, named, f"{scope}{st.name}.")
    elif isinstance(st, ast.If):
        test = short(ast.unparse(st.test), 200)
        hit = named(st.test) and mentions(st.test)
        unset = hit and _tests_unset(test)
        inner = replace(ctx, conds=(*ctx.conds, test), mentions=ctx.mentions or hit,
                        unset=ctx.unset or unset)
        yield from _statements(st.body, inner, mentions, named, scope)
        if st.orelse:
            other = replace(ctx, conds=(*ctx.conds, short(ast.unparse(negate(st.test)), 200)),
                            mentions=ctx.mentions or hit)
            yield from _statements(st.orelse, other, mentions, named, scope)
    else:
        for field in ("body", "orelse", "finalbody"):
            sub = getattr(st, field, None)
            if isinstance(sub, list) and sub and isinstance(sub[0], ast.stmt):
                yield from _statements(sub, ctx, mentions, named, scope)
        for h in getattr(st, "handlers", []):
            yield from _statements(h.body, replace(ctx, handler=True), mentions, named, scope)
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


def units(tree: SourceTree, rel: str, lines_named: list[int]) -> list[tuple[ast.stmt, str]]:
    """(statement, class prefix) units to walk: the functions holding the lines, else the module.

    ``lines_named`` are sorted 1-based line numbers; each is covered by the outermost function
    around it, cut out and parsed alone; when one lies outside any function or a cut does not
    parse, the whole module's statements are returned instead.
    """
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
        for unit, prefix in units(tree, rel, sorted(set(named.lines))):
            for st, ctx in _statements([unit], top, mentions, named, prefix):
                yield rel, st, ctx, mentions
