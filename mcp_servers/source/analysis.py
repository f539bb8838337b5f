"""What the source says about one flag: where it is used, what constrains it, its default.

``where_used`` classifies each line that names the flag with a textual scan over the texts kept
in memory (about 0.05 s over a whole wheel). ``constraints`` and ``explain_default`` parse only
the functions that name the flag (see :mod:`mcp_servers.source.scan`); their results are
memoised per flag, so paging is free.

A flag is accepted as its dest (``max_running_requests``) or a CLI spelling
(``--max-running-requests``); see :meth:`FlagInventory.dest_of`. Test code (``sglang/test/``,
``tests/``, ``test_*.py``) is left out unless ``include_tests`` is set; each result says how much
was left out.

Longer than 500 lines on purpose: where_used, constraints and explain_default read the same
memoised per-flag scan of the source texts; apart, each would rebuild it.
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
    STAGE_RANK,
    Ctx,
    Mentions,
    Stage,
    candidates,
    is_test,
    lines_of,
    occurrences,
    scan,
    short,
    spellings,
    stage,
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
    """Lines naming a flag, in path then line order.

    Every line that names the flag is in exactly one of: ``counts`` (returned, over all pages),
    ``excluded_counts`` (kinds not asked for) or ``tests_excluded`` (test code, when
    include_tests is false).
    """

    dest: str
    flags: list[str]
    counts: dict[str, int] = Field(description="returned hits per kind, over all pages; they "
                                               "sum to total")
    excluded_counts: dict[str, int] = Field(description="lines of the kinds not asked for "
                                                        "(default: name, comment), per kind")
    tests_excluded: int = Field(description="lines in test code (sglang/test/, tests/, "
                                            "test_*.py) left out; include_tests=true lists them")
    total: int = Field(description="hits of the selected kinds, over all pages (= sum of counts)")
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
               max_hits: int = 200, include_tests: bool = False) -> WhereUsed:
    """Every line of every Python file that names ``flag``, classified by how it uses it.

    Args:
        tree: the source tree.
        inv: its flag inventory (for spellings and the declaration line).
        flag: dest or CLI spelling.
        kinds: kinds to return (default: all but 'name' and 'comment'); the others are counted
            in ``excluded_counts``.
        start: first hit of the page.
        max_hits: page size.
        include_tests: also return lines in test code (else only counted in ``tests_excluded``).

    Raises:
        SourceError: unknown flag (the message lists close names).
    """
    t0 = time.perf_counter()
    dest, cli = spellings(inv, flag)
    wanted = set(kinds or DEFAULT_KINDS)
    classified = tree.memo(("where_used", dest), lambda: _uses(tree, inv, dest, cli))
    scope = classified if include_tests else [u for u in classified if not is_test(u.path)]
    selected = [u for u in scope if u.kind in wanted]
    counts = Counter(u.kind for u in selected)
    excluded = Counter(u.kind for u in scope if u.kind not in wanted)
    files = {u.path for u in selected}
    page = selected[start:start + max(1, max_hits)]
    nxt = start + len(page) if start + len(page) < len(selected) else None
    return WhereUsed(dest=dest, flags=cli, counts=_by_rank(counts),
                     excluded_counts=_by_rank(excluded),
                     tests_excluded=len(classified) - len(scope), total=len(selected),
                     files=len(files), hits=page, next_start=nxt,
                     elapsed_s=round(time.perf_counter() - t0, 4))


def _by_rank(counts: Counter[UseKind]) -> dict[str, int]:
    return {k: counts[k] for k in sorted(counts, key=_RANK.__getitem__)}


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

_STARTUP_STAGES = ("arg-resolution", "engine-startup")
_STAGE_DOC = ("arg-resolution (arg_groups/, server_args.py), engine-startup (resolve_* / *_hook "
              "/ *Configurator / alloc_*pool functions that compute it as the engine starts, "
              "e.g. the KV pool and request cap from free GPU memory), runtime, or test")


class Constraint(BaseModel):
    """An assert, raise or warning that involves the flag."""

    path: str
    line: int
    kind: Literal["assert", "raise", "warning"]
    phase: Literal["startup", "runtime"] = Field(description="startup = stage arg-resolution "
                                                 "or engine-startup")
    stage: Stage = Field(description=_STAGE_DOC)
    function: str
    condition: str = Field(description="the assert's test (what must hold), or for a raise or "
                                       "warning the enclosing if conditions joined by ' and ' "
                                       "(outermost first): when it fires, once reached")
    reached_only_if: list[str] = Field(description=(
        "conditions that must hold to reach it and that condition does not state: for an "
        "assert its enclosing if conditions, then the early exits passed earlier in the same "
        "or an enclosing block of the function (`if c: return` / continue / break gives "
        "`not c`, simplified)"))
    involves: Literal["test", "condition", "guard", "message"] = Field(description=(
        "why it is listed: the flag is in the assert's test, an enclosing if condition, an "
        "early-exit guard, or only in the message (never from an accessor, deprecation shim or "
        "migration note that merely names it)"))
    message: str = Field(description="source of the message or exception (cut at 300 chars)")


# Other spellings of a flag value that messages and function names use (case-insensitive).
VALUE_ALIASES: dict[str, tuple[str, ...]] = {
    "fa3": ("flashattention v3", "flashattention3", "flash_attn_3", "flashattention 3",
            "flashattention_v3"),
    "fa4": ("flashattention v4", "flashattention4", "flash_attn_4", "flashattention 4",
            "flashattention_v4"),
    "trtllm_mla": ("tensorrt-llm mla", "trtllm mla"),
    "trtllm_mha": ("tensorrt-llm mha", "trtllm mha"),
    "cutedsl_mla": ("cutedsl mla",),
}


def mentions_value(value: str | None, *texts: str) -> bool:
    """Whether any of ``texts`` names ``value`` (as a word, or by a known alias)."""
    if not value:
        return False
    word = re.compile(rf"(?<![\w]){re.escape(value)}(?![\w])", re.IGNORECASE)
    aliases = VALUE_ALIASES.get(value.lower(), ())
    return any(word.search(t or "") or any(a in (t or "").lower() for a in aliases)
               for t in texts)


class Constraints(BaseModel):
    """Checks that involve a flag: start-up resolution code first, then runtime, then tests."""

    dest: str
    total: int
    tests_excluded: int = Field(description="checks in test code left out (include_tests=true "
                                            "lists them)")
    not_mentioning: int = Field(0, description="checks left out because they do not mention "
                                               "the `mentions` text")
    items: list[Constraint]
    next_start: int | None
    elapsed_s: float


def constraints(tree: SourceTree, inv: FlagInventory, flag: str, start: int = 0,
                max_items: int = 50, include_tests: bool = False,
                mentions: str | None = None) -> Constraints:
    """Asserts, raises and warnings that involve ``flag``, with file:line.

    A check counts when the flag is in an assert's test, in an enclosing ``if`` condition or an
    early-exit guard (``if c: return`` earlier in the same function, not as a mere keyword
    argument), or in its message, except that a message-only mention does not count

    - in an accessor or deprecation shim (a ``__getattr__``, a function whose name or docstring
      says retired / deprecated / legacy), or in a migration note ("x() is retired, read
      get_schedule().flag"): the flag is named, not constrained;
    - for a warning, in runtime code outside any condition, guard or except handler (a log line
      that prints the value).

    In messages, a one-word dest (``port``, ``device``) counts only when spelled as a CLI flag or
    read from an object (``cfg.device``), not as an English word or a local of that name.

    Args:
        tree: the source tree.
        inv: its flag inventory.
        flag: dest or CLI spelling.
        start: first item of the page.
        max_items: page size.
        include_tests: also list checks in test code.
        mentions: keep only checks whose condition, guards, message or function name this
            text as a word or by a known alias (:data:`VALUE_ALIASES`), case-insensitive, e.g.
            the value a candidate sets ("fa3" also finds "FlashAttention v3").

    Raises:
        SourceError: unknown flag.
    """
    t0 = time.perf_counter()
    dest, cli = spellings(inv, flag)
    everything = _analyse(tree, dest, cli)[0]
    found = everything if include_tests else [c for c in everything if c.stage != "test"]
    before = len(found)
    if mentions:
        found = [c for c in found if mentions_value(mentions, c.condition, *c.reached_only_if,
                                                    c.message, c.function)]
    page = found[start:start + max(1, max_items)]
    nxt = start + len(page) if start + len(page) < len(found) else None
    return Constraints(dest=dest, total=len(found), tests_excluded=len(everything) - before,
                       not_mentioning=before - len(found), items=page, next_start=nxt,
                       elapsed_s=round(time.perf_counter() - t0, 4))


_MIGRATION_RE = re.compile(r"\b(is|was|been) (retired|removed|deprecated)\b|"
                           r"\bno longer (supported|available|exists)\b", re.I)


def _involvement(ctx: Ctx, message: ast.AST | None, mentions: Mentions, where: Stage,
                 warning: bool) -> str | None:
    """Why a raise or warning concerns the flag (see :func:`constraints`), or None."""
    if ctx.mentions:
        return "condition"
    if ctx.guard_mentions:
        return "guard"
    if message is None or ctx.shim or not mentions(message, message=True):
        return None
    if _MIGRATION_RE.search(ast.unparse(message)):
        return None  # a migration note ("x() is retired, read get_schedule().flag")
    if warning and not (ctx.conds or ctx.guards or ctx.handler or where in _STARTUP_STAGES):
        return None  # an unconditional runtime log line that prints the value
    return "message"


def _constraints_of(rel: str, st: ast.stmt, ctx: Ctx, mentions: Mentions) -> Iterator[Constraint]:
    cond = short(" and ".join(ctx.conds), 600)
    where = stage(rel, ctx.func)
    when = "startup" if where in _STARTUP_STAGES else "runtime"

    def make(kind: str, line: int, why: str, condition: str, reached: list[str],
             message: str) -> Constraint:
        return Constraint(path=rel, line=line, kind=kind, phase=when, stage=where,
                          function=ctx.func, condition=condition, reached_only_if=reached,
                          involves=why, message=message)

    if isinstance(st, ast.Assert):
        why = "test" if mentions(st.test) else "condition" if ctx.mentions else \
            "guard" if ctx.guard_mentions else "message" if mentions(st.msg, message=True) else None
        if why:
            yield make("assert", st.lineno, why, short(ast.unparse(st.test)),
                       [*ctx.conds, *ctx.guards],
                       short(ast.unparse(st.msg)) if st.msg else "")
    elif isinstance(st, ast.Raise):
        why = _involvement(ctx, st.exc, mentions, where, warning=False)
        if why:
            yield make("raise", st.lineno, why, cond, list(ctx.guards),
                       short(ast.unparse(st.exc)) if st.exc else "(re-raise)")
    else:
        for call in _simple_calls(st):
            if _WARN_RE.match(_callee(call)):
                why = _involvement(ctx, call, mentions, where, warning=True)
                if why:
                    yield make("warning", call.lineno, why, cond, list(ctx.guards),
                               short(ast.unparse(call)))


# -- explain_default ----------------------------------------------------------------------------

class Assignment(BaseModel):
    """A place that sets the flag's value."""

    path: str
    line: int
    kind: Literal["declare", "attribute", "key", "dict-entry", "setattr", "local"] = Field(
        description="declare (a resolution call such as declare_resolution(..., flag=v)), "
                    "attribute (x.flag = v), key (d['flag'] = v), dict-entry ({'flag': v} in "
                    "resolution code), setattr, local (flag = v under a check that it is unset)")
    phase: Literal["startup", "runtime"] = Field(description="startup = stage arg-resolution "
                                                 "or engine-startup")
    stage: Stage = Field(description=_STAGE_DOC)
    function: str
    conditions: list[str] = Field(description="enclosing if conditions, outermost first")
    guards: list[str] = Field(description="early exits passed before it in the same or an "
                                          "enclosing block (`if c: return` gives `not c`): "
                                          "they hold too when it runs")
    value: str = Field(description="source of the assigned value (cut at 300 chars)")
    computed_by: str | None = Field(default=None, description=(
        "the resolve_* / compute_* function the value comes from, with file:line when it is "
        "defined in the same file"))


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
    summary: str = Field(description="one line: the default and the main resolution sites "
                                     "(file:line under sglang/srt/)")
    total: int
    tests_excluded: int = Field(description="assignments in test code left out "
                                            "(include_tests=true lists them)")
    assignments: list[Assignment] = Field(description="arg-resolution sites first, then "
                                                      "engine-startup, runtime and test")
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


_COMPUTE_RE = re.compile(r"^_*(resolve|compute)_?\w*$")


def _computed_by(tree: SourceTree, rel: str, value: ast.expr) -> str | None:
    """The resolve_* / compute_* function called in ``value``, located in ``rel`` if there."""
    for n in ast.walk(value):
        if isinstance(n, ast.Call) and _COMPUTE_RE.match(name := _callee(n)):
            m = re.search(rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{name}\b", tree.texts.get(rel, ""),
                          re.M)
            if m is None:
                return name
            return f"{name} ({rel}:{tree.texts[rel].count(chr(10), 0, m.start()) + 1})"
    return None


def _assignments(tree: SourceTree, rel: str, st: ast.stmt, ctx: Ctx,
                 dest: str) -> Iterator[Assignment]:
    def make(kind: str, line: int, value: ast.expr | None) -> Assignment:
        src = short(ast.unparse(value)) if value is not None else ""
        where = stage(rel, ctx.func, src)
        return Assignment(path=rel, line=line, kind=kind,
                          phase="startup" if where in _STARTUP_STAGES else "runtime",
                          stage=where, function=ctx.func, conditions=list(ctx.conds),
                          guards=list(ctx.guards), value=src,
                          computed_by=_computed_by(tree, rel, value) if value is not None
                          else None)

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
    if stage(rel, ctx.func) == "arg-resolution" and not isinstance(st, _COMPOUND):
        for n in ast.walk(st):
            if isinstance(n, ast.Dict):
                for key, v in zip(n.keys, n.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value == dest:
                        yield make("dict-entry", key.lineno, v)


def _analyse(tree: SourceTree, dest: str, cli: list[str]) -> tuple[list[Constraint],
                                                                   list[Assignment]]:
    """Constraints and assignments of the flag, from one pass over its files (memoised).

    Both come ordered by stage (arg-resolution, engine-startup, runtime, test), then path and
    line.
    """
    def run() -> tuple[list[Constraint], list[Assignment]]:
        checks: list[Constraint] = []
        sets: list[Assignment] = []
        seen: set[tuple[str, int, str]] = set()
        for rel, st, ctx, mentions in scan(tree, dest, cli):
            checks.extend(_constraints_of(rel, st, ctx, mentions))
            for a in _assignments(tree, rel, st, ctx, dest):
                if (a.path, a.line, a.kind) not in seen:
                    seen.add((a.path, a.line, a.kind))
                    sets.append(a)
        checks.sort(key=lambda c: STAGE_RANK[c.stage])
        sets.sort(key=_assignment_rank)
        return checks, sets

    return tree.memo(("analysis", dest), run)


def _assignment_rank(a: Assignment) -> tuple[int, bool, bool]:
    """Sort key: stage order, and engine start-up sites that compute the value first.

    Those are the ones with a resolve_* / compute_* call, then configurator files; the sites that
    only pass a resolved value on come after.
    """
    engine = a.stage == "engine-startup"
    return (STAGE_RANK[a.stage], engine and a.computed_by is None,
            engine and "configurator" not in a.path.rsplit("/", 1)[-1])


def _site(a: Assignment, with_value: bool) -> str:
    where = a.path.removeprefix("sglang/srt/") + f":{a.line}"
    if a.computed_by:
        return f"{where} ({a.computed_by.split(' ')[0]})"
    return f"{where} (= {short(a.value, 30)})" if with_value else where


def _sites(found: list[Assignment], with_value: bool, most: int = 4) -> str:
    shown = ", ".join(_site(a, with_value) for a in found[:most])
    return shown + (f", +{len(found) - most} more" if len(found) > most else "")


def explain_default(tree: SourceTree, inv: FlagInventory, flag: str, start: int = 0,
                    max_items: int = 50, include_tests: bool = False) -> DefaultExplanation:
    """The declared default of ``flag`` and every place that sets it when it is left unset.

    Lists resolution calls (``declare_resolution(..., flag=v)``), attribute writes
    (``server_args.flag = v``, ``self.flag = v``), ``d['flag'] = v``, ``setattr``, dict entries in
    resolution code, and locals of that name assigned under an ``is None`` check; each with its
    function, enclosing ``if`` conditions and early-exit guards. Argument resolution comes
    first, then engine start-up resolution (e.g. the request cap computed from the KV pool),
    then runtime assignments; test code only with ``include_tests``.

    Args:
        tree: the source tree.
        inv: its flag inventory.
        flag: dest or CLI spelling.
        start: first assignment of the page.
        max_items: page size.
        include_tests: also list assignments in test code.

    Raises:
        SourceError: unknown flag.
    """
    t0 = time.perf_counter()
    dest, cli = spellings(inv, flag)
    everything = _analyse(tree, dest, cli)[1]
    found = everything if include_tests else [a for a in everything if a.stage != "test"]
    decl = inv.fields.get(dest)
    entry = next((f for f in inv.flags if f.dest == dest), None)
    default = decl.default if decl else entry.default if entry else None
    default_src = decl.default_source if decl else entry.default_source if entry else None
    where = decl.source if decl else entry.source if entry else None
    by_stage: dict[str, list[Assignment]] = {s: [] for s in STAGE_RANK}
    for a in everything:
        by_stage[a.stage].append(a)
    args, engine, run = by_stage["arg-resolution"], by_stage["engine-startup"], by_stage["runtime"]
    shown = default_src or repr(default)
    summary = (f"{cli[0] if cli else dest} defaults to {shown}"
               + (f" (declared at {where})" if where else "")
               + f"; {len(args)} start-up resolution site(s) in arg_groups/ or server_args.py"
               + (f" ({_sites(args, True)})" if args else "")
               + f"; {len(engine)} engine start-up site(s) compute it"
               + (f" ({_sites(engine, False)})" if engine else "")
               + f"; {len(run)} runtime assignment(s) set it")
    if by_stage["test"]:
        summary += (f"; {len(by_stage['test'])} in test code"
                    + ("" if include_tests else " left out (include_tests=true lists them)"))
    if entry and entry.fallback is not None:
        summary += f"; if still unset after resolution the fallback {entry.fallback!r} applies"
    page = found[start:start + max(1, max_items)]
    nxt = start + len(page) if start + len(page) < len(found) else None
    return DefaultExplanation(
        dest=dest, flags=cli, type=decl.type if decl else entry.type if entry else None,
        declared_default=default, default_source=default_src, declared_at=where,
        fallback=entry.fallback if entry else None,
        resolvable=entry.resolvable if entry else False, summary=summary, total=len(found),
        tests_excluded=len(everything) - len(found), assignments=page, next_start=nxt,
        elapsed_s=round(time.perf_counter() - t0, 4))
