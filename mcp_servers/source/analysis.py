"""What the source says about one flag: where it is used, what constrains it, its default.

``where_used`` classifies each line that names the flag with a textual scan over the texts kept
in memory (about 0.05 s over a whole wheel). ``constraints`` and ``explain_default`` parse only
the functions that name the flag (see :mod:`mcp_servers.source.scan`); their results are
memoised per flag, so paging is free.

A flag is accepted as its dest (``max_running_requests``) or a CLI spelling
(``--max-running-requests``); see :meth:`FlagInventory.dest_of`.
"""

from __future__ import annotations

import ast
import re
import time
from collections import Counter
from collections.abc import Iterator
from typing import Literal

from pydantic import BaseModel, Field

from mcp_servers.source.flags import FlagInventory
from mcp_servers.source.scan import (
    Ctx,
    Mentions,
    candidates,
    lines_of,
    occurrences,
    phase,
    scan,
    short,
    spellings,
)
from mcp_servers.source.tree import SourceTree

UseKind = Literal["declaration", "write", "read", "cli-string", "string", "keyword", "name",
                  "comment"]
DEFAULT_KINDS: tuple[UseKind, ...] = ("declaration", "write", "read", "cli-string", "string",
                                      "keyword")
_RANK = {k: i for i, k in enumerate(("declaration", "write", "read", "cli-string", "string",
                                     "keyword", "name", "comment"))}
_WRITE_AFTER = re.compile(r"\s*(?:[-+*/%@&|^]|//|\*\*|<<|>>)?=(?!=)")
_KW_AFTER = re.compile(r"\s*=(?!=)")
_WARN_RE = re.compile(r"^_?(print_|log_)?(deprecated_)?warn(ing)?(_once)?$|^raise_error_or_warn$")
_SETTER_RE = re.compile(r"declare|resolv|override|replace|set_?default", re.I)


# -- where_used ---------------------------------------------------------------------------------

class Use(BaseModel):
    """One line that names the flag."""

    path: str
    line: int
    kind: UseKind = Field(description="declaration (the field), write (x.flag = ...), read "
                                      "(x.flag), cli-string ('--flag' in a string), string "
                                      "('flag' as a key or getattr name), keyword (flag=... as "
                                      "an argument or local), name (a local of that name), "
                                      "comment")
    text: str


class WhereUsed(BaseModel):
    """Lines naming a flag, in path then line order."""

    dest: str
    flags: list[str]
    counts: dict[str, int] = Field(description="hits per kind over the whole tree, all kinds")
    total: int = Field(description="hits of the selected kinds, over all pages")
    files: int = Field(description="files with hits of the selected kinds")
    hits: list[Use]
    next_start: int | None
    elapsed_s: float


def _in_comment(line: str, col: int) -> bool:
    hash_at = line.find("#")
    if hash_at < 0 or hash_at > col:
        return False
    before = line[:hash_at]
    return before.count('"') % 2 == 0 and before.count("'") % 2 == 0


def _classify(text: str, start: int, end: int, line: str, col: int, cli_hit: bool) -> UseKind:
    if _in_comment(line, col):
        return "comment"
    if cli_hit:
        return "cli-string"
    if start and text[start - 1] == ".":
        return "write" if _WRITE_AFTER.match(text, end) else "read"
    head = line[:col]
    if (head.count('"') - head.count('\\"')) % 2 or (head.count("'") - head.count("\\'")) % 2:
        return "string"  # inside a quoted string on this line: a key, a getattr name, a message
    if _KW_AFTER.match(text, end):
        return "keyword"
    return "name"


def where_used(tree: SourceTree, inv: FlagInventory, flag: str,
               kinds: list[UseKind] | None = None, start: int = 0,
               max_hits: int = 200) -> WhereUsed:
    """Every line of every Python file that names ``flag``, classified by how it uses it.

    Args:
        tree: the source tree.
        inv: its flag inventory (for spellings and the declaration line).
        flag: dest or CLI spelling.
        kinds: kinds to return (default: all but 'name' and 'comment'); ``counts`` always covers
            every kind.
        start: first hit of the page.
        max_hits: page size.

    Raises:
        SourceError: unknown flag (the message lists close names).
    """
    t0 = time.perf_counter()
    dest, cli = spellings(inv, flag)
    wanted = set(kinds or DEFAULT_KINDS)
    classified = tree.memo(("where_used", dest), lambda: _uses(tree, inv, dest, cli))
    counts = Counter(u.kind for u in classified)
    selected = [u for u in classified if u.kind in wanted]
    files = {u.path for u in selected}
    page = selected[start:start + max(1, max_hits)]
    nxt = start + len(page) if start + len(page) < len(selected) else None
    return WhereUsed(dest=dest, flags=cli, counts=dict(counts), total=len(selected),
                     files=len(files), hits=page, next_start=nxt,
                     elapsed_s=round(time.perf_counter() - t0, 4))


def _uses(tree: SourceTree, inv: FlagInventory, dest: str, cli: list[str]) -> list[Use]:
    decl = inv.fields.get(dest)
    decl_at = decl.source if decl else None
    uses: list[Use] = []
    for rel in candidates(tree, [dest, *cli]):
        text = tree.texts[rel]
        occ = occurrences(text, dest, cli)
        per_line: dict[int, tuple[UseKind, str]] = {}
        for (pos, end, is_cli), line_no in zip(occ, lines_of(text, [o[0] for o in occ]),
                                               strict=True):
            lo = text.rfind("\n", 0, pos) + 1
            hi = text.find("\n", pos)
            line = text[lo:None if hi < 0 else hi]
            if decl_at == f"{rel}:{line_no}":
                kind: UseKind = "declaration"
            else:
                kind = _classify(text, pos, end, line, pos - lo, is_cli)
            old = per_line.get(line_no)
            if old is None or _RANK[kind] < _RANK[old[0]]:
                per_line[line_no] = (kind, line)
        uses.extend(Use(path=rel, line=n, kind=kind, text=short(line.strip(), 240))
                    for n, (kind, line) in sorted(per_line.items()))
    return uses


# -- statements that concern the flag -------------------------------------------------------

_COMPOUND = tuple(getattr(ast, n) for n in (
    "FunctionDef", "AsyncFunctionDef", "ClassDef", "If", "For", "AsyncFor", "While", "With",
    "AsyncWith", "Try", "TryStar", "Match") if hasattr(ast, n))


def _simple_calls(st: ast.stmt) -> Iterator[ast.Call]:
    """Calls inside a simple statement (compound statements are visited through their bodies)."""
    if isinstance(st, _COMPOUND):
        return
    for n in ast.walk(st):
        if isinstance(n, ast.Call):
            yield n


def _callee(call: ast.Call) -> str:
    f = call.func
    if isinstance(f, ast.Attribute):
        return f.attr
    return f.id if isinstance(f, ast.Name) else ""


# -- constraints --------------------------------------------------------------------------------

class Constraint(BaseModel):
    """An assert, raise or warning that mentions the flag (or sits under a condition that does)."""

    path: str
    line: int
    kind: Literal["assert", "raise", "warning"]
    phase: Literal["startup", "runtime"] = Field(description="startup = argument resolution "
                                                 "(arg_groups/, server_args.py)")
    function: str
    condition: str = Field(description="the assert's test, or the enclosing if conditions "
                                       "joined by ' and ' (outermost first)")
    message: str = Field(description="source of the message or exception (cut at 300 chars)")


class Constraints(BaseModel):
    """Checks that involve a flag, startup code first, then path and line order."""

    dest: str
    total: int
    items: list[Constraint]
    next_start: int | None
    elapsed_s: float


def constraints(tree: SourceTree, inv: FlagInventory, flag: str, start: int = 0,
                max_items: int = 50) -> Constraints:
    """Asserts, raises and warnings that involve ``flag``, with file:line.

    An assert counts when its test or message names the flag; a raise or warning when its
    message or an enclosing ``if`` condition (in the same function) does.

    Args:
        tree: the source tree.
        inv: its flag inventory.
        flag: dest or CLI spelling.
        start: first item of the page.
        max_items: page size.

    Raises:
        SourceError: unknown flag.
    """
    t0 = time.perf_counter()
    dest, cli = spellings(inv, flag)
    found = _analyse(tree, dest, cli)[0]
    page = found[start:start + max(1, max_items)]
    nxt = start + len(page) if start + len(page) < len(found) else None
    return Constraints(dest=dest, total=len(found), items=page, next_start=nxt,
                       elapsed_s=round(time.perf_counter() - t0, 4))


def _constraints_of(rel: str, st: ast.stmt, ctx: Ctx, mentions: Mentions) -> Iterator[Constraint]:
    cond = short(" and ".join(ctx.conds), 600)
    if isinstance(st, ast.Assert):
        if mentions(st.test) or mentions(st.msg):
            yield Constraint(path=rel, line=st.lineno, kind="assert", phase=phase(rel),
                             function=ctx.func, condition=short(ast.unparse(st.test)),
                             message=short(ast.unparse(st.msg)) if st.msg else "")
    elif isinstance(st, ast.Raise):
        if ctx.mentions or mentions(st.exc):
            yield Constraint(path=rel, line=st.lineno, kind="raise", phase=phase(rel),
                             function=ctx.func, condition=cond,
                             message=short(ast.unparse(st.exc)) if st.exc else "(re-raise)")
    else:
        for call in _simple_calls(st):
            if _WARN_RE.match(_callee(call)) and (ctx.mentions or mentions(call)):
                yield Constraint(path=rel, line=call.lineno, kind="warning", phase=phase(rel),
                                 function=ctx.func, condition=cond,
                                 message=short(ast.unparse(call)))


# -- explain_default ----------------------------------------------------------------------------

class Assignment(BaseModel):
    """A place that sets the flag's value."""

    path: str
    line: int
    kind: Literal["declare", "attribute", "key", "dict-entry", "setattr", "local"] = Field(
        description="declare (a resolution call such as declare_resolution(..., flag=v)), "
                    "attribute (x.flag = v), key (d['flag'] = v), dict-entry ({'flag': v} in "
                    "resolution code), setattr, local (flag = v under a check that it is unset)")
    phase: Literal["startup", "runtime"]
    function: str
    conditions: list[str] = Field(description="enclosing if conditions, outermost first")
    value: str = Field(description="source of the assigned value (cut at 300 chars)")


class DefaultExplanation(BaseModel):
    """The declared default of a flag and every place that resolves or overrides it."""

    dest: str
    flags: list[str]
    type: str | None
    declared_default: object = Field(description="default as declared (null often means "
                                                  "'computed at start-up')")
    default_source: str | None
    declared_at: str | None = Field(description="file:line of the field declaration")
    fallback: object = None
    resolvable: bool = False
    summary: str
    total: int
    assignments: list[Assignment]
    next_start: int | None
    elapsed_s: float


def _targets(node: ast.expr) -> Iterator[ast.expr]:
    if isinstance(node, (ast.Tuple, ast.List)):
        for e in node.elts:
            yield from _targets(e)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)
    else:
        yield node


def _assignments(rel: str, st: ast.stmt, ctx: Ctx, dest: str) -> Iterator[Assignment]:
    where = phase(rel)

    def make(kind: str, line: int, value: ast.expr | None) -> Assignment:
        return Assignment(path=rel, line=line, kind=kind, phase=where, function=ctx.func,
                          conditions=list(ctx.conds),
                          value=short(ast.unparse(value)) if value is not None else "")

    if isinstance(st, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = st.targets if isinstance(st, ast.Assign) else [st.target]
        for t in (x for tt in targets for x in _targets(tt)):
            if isinstance(t, ast.Attribute) and t.attr == dest:
                yield make("attribute", st.lineno, st.value)
            elif isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant) \
                    and t.slice.value == dest:
                yield make("key", st.lineno, st.value)
            elif isinstance(t, ast.Name) and t.id == dest and ctx.unset:
                yield make("local", st.lineno, st.value)
    for call in _simple_calls(st):
        name = _callee(call)
        if name == "setattr" and len(call.args) == 3 and isinstance(call.args[1], ast.Constant) \
                and call.args[1].value == dest:
            yield make("setattr", call.lineno, call.args[2])
        elif _SETTER_RE.search(name):
            for k in call.keywords:
                if k.arg == dest:
                    yield make("declare", k.value.lineno, k.value)
    if where == "startup" and not isinstance(st, _COMPOUND):
        for n in ast.walk(st):
            if isinstance(n, ast.Dict):
                for k, v in zip(n.keys, n.values, strict=True):
                    if isinstance(k, ast.Constant) and k.value == dest:
                        yield make("dict-entry", k.lineno, v)


def _analyse(tree: SourceTree, dest: str, cli: list[str]) -> tuple[list[Constraint],
                                                                   list[Assignment]]:
    """Constraints and assignments of the flag, from one pass over its files (memoised)."""
    def run() -> tuple[list[Constraint], list[Assignment]]:
        checks: list[Constraint] = []
        sets: list[Assignment] = []
        seen: set[tuple[str, int, str]] = set()
        for rel, st, ctx, mentions in scan(tree, dest, cli):
            checks.extend(_constraints_of(rel, st, ctx, mentions))
            for a in _assignments(rel, st, ctx, dest):
                if (a.path, a.line, a.kind) not in seen:
                    seen.add((a.path, a.line, a.kind))
                    sets.append(a)
        return checks, sets

    return tree.memo(("analysis", dest), run)


def explain_default(tree: SourceTree, inv: FlagInventory, flag: str, start: int = 0,
                    max_items: int = 50) -> DefaultExplanation:
    """The declared default of ``flag`` and every place that sets it when it is left unset.

    Lists resolution calls (``declare_resolution(..., flag=v)``), attribute writes
    (``server_args.flag = v``, ``self.flag = v``), ``d['flag'] = v``, ``setattr``, dict entries in
    resolution code, and locals of that name assigned under an ``is None`` check; each with its
    function and enclosing ``if`` conditions. Start-up resolution code comes first.

    Args:
        tree: the source tree.
        inv: its flag inventory.
        flag: dest or CLI spelling.
        start: first assignment of the page.
        max_items: page size.

    Raises:
        SourceError: unknown flag.
    """
    t0 = time.perf_counter()
    dest, cli = spellings(inv, flag)
    found = _analyse(tree, dest, cli)[1]
    decl = inv.fields.get(dest)
    entry = next((f for f in inv.flags if f.dest == dest), None)
    default = decl.default if decl else entry.default if entry else None
    default_src = decl.default_source if decl else entry.default_source if entry else None
    where = decl.source if decl else entry.source if entry else None
    n_start = sum(a.phase == "startup" for a in found)
    n_run = len(found) - n_start
    shown = default_src or repr(default)
    summary = (f"{cli[0] if cli else dest} defaults to {shown}"
               + (f" (declared at {where})" if where else "")
               + f"; {n_start} start-up resolution site(s) in arg_groups/ or server_args.py and "
               f"{n_run} runtime assignment(s) set it")
    if entry and entry.fallback is not None:
        summary += f"; if still unset after resolution the fallback {entry.fallback!r} applies"
    page = found[start:start + max(1, max_items)]
    nxt = start + len(page) if start + len(page) < len(found) else None
    return DefaultExplanation(
        dest=dest, flags=cli, type=decl.type if decl else entry.type if entry else None,
        declared_default=default, default_source=default_src, declared_at=where,
        fallback=entry.fallback if entry else None,
        resolvable=entry.resolvable if entry else False, summary=summary, total=len(found),
        assignments=page, next_start=nxt, elapsed_s=round(time.perf_counter() - t0, 4))
