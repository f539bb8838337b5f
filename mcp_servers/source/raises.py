"""From an engine error message to the raise or assert site that produced it, with its guard.

Every ``raise XError(msg)`` and ``assert test, msg`` of the tree's Python files is a *site*; its
message expression becomes a template: string literals as they are, the formatted parts of
f-strings, ``"...".format(...)`` and ``"..." % (...)`` templates as wildcards, implicit and
``+`` concatenation joined, and a message held in a local variable followed one assignment. A
log message matches a site when the template's regex matches it (whole, or inside a longer log
line); ties are ranked by the exception type named in the log line, then by the number of
literal characters matched (the longest literal match wins), then stage (argument resolution
before runtime) and path.

Files are read lazily: a message's word trigrams pick the files whose text can hold it, and the
sites of each file are parsed once per tree and kept (the index grows with the files asked
about; parsing the whole 0.5.23 wheel at once would take ~13 s).
"""

from __future__ import annotations

import ast
import re
import threading
import time
import weakref
from dataclasses import dataclass

import regex
from pydantic import BaseModel, Field

from domain.grounding import GuardFacts
from mcp_servers.source.flags import FlagInventory
from mcp_servers.source.guards import GuardReader
from mcp_servers.source.scan import STAGE_RANK, is_test, negate, short, stage
from mcp_servers.source.tree import SourceError, SourceTree

MAX_MESSAGE_CHARS = 4_000
MIN_LITERAL_CHARS = 8  # a template with fewer literal characters matches too much
MIN_LITERAL_SHARE = 0.4  # its literals must cover this share of the message
MATCH_BUDGET_S = 2.0
SERVING_PREFIX = "sglang/srt/"  # the serving runtime; its sites rank before other packages'
_EXC_RE = re.compile(r"^(?:.*?[\s:(\[])?((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|"
                     r"Exit|Interrupt|Warning))\s*:\s*(.+)$", re.S)
_WORD_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
_FORMAT_FIELD = re.compile(r"\{\{|\}\}|\{[^{}]*\}")
_PERCENT_FIELD = re.compile(r"%%|%(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?"
                            r"[diouxXeEfFgGcrsa]")
_QUIET = (ast.Return, ast.Continue, ast.Break)


class RaiseSite(BaseModel):
    """One raise or assert site whose message matches, with what its guard tests."""

    path: str = Field(description="file relative to the tree root")
    line: int = Field(description="line of the raise / assert statement")
    site: str = Field(description="path:line")
    kind: str = Field(description="raise or assert")
    exception: str = Field(description="exception type, e.g. ValueError (AssertionError for "
                                       "an assert)")
    function: str = Field(description="enclosing function, Class.method, or <module>")
    stage: str = Field(description="arg-resolution, engine-startup, runtime or test")
    template: str = Field(description="the message as a template: {} marks a formatted part")
    literal_chars: int = Field(description="literal characters of the template that matched")
    guard: str = Field(description="the condition under which it raises, as source text: "
                                   "enclosing if tests, early exits passed, the negated assert "
                                   "test ('True' when unconditional)")
    flags: list[str] = Field(description="flag dests the guard tests")
    hardware: list[str] = Field(description="hardware facts the guard tests, as source text")
    tests_model: bool = Field(description="the guard tests a property of the model")
    facts: GuardFacts = Field(description="the guard as atoms (domain/grounding.py)")


class MessageMatch(BaseModel):
    """The sites a message can come from, best first."""

    message: str = Field(description="the message searched (exception prefix removed)")
    exception: str | None = Field(description="exception type named in the log line, if any")
    total: int = Field(description="matching sites")
    sites: list[RaiseSite]
    files_searched: int = Field(description="files whose text could hold the message")
    elapsed_s: float


@dataclass
class _Site:
    rel: str
    line: int
    kind: str
    exception: str
    func: str
    cls: str
    fn: ast.FunctionDef | ast.AsyncFunctionDef | None
    conds: list[ast.expr]
    parts: list[str | None]  # literal text, or None for a formatted part

    @property
    def literal(self) -> int:
        return sum(len(p) for p in self.parts if p)


_CACHE: weakref.WeakKeyDictionary[SourceTree, dict[str, list[_Site]]] = \
    weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def split_exception(message: str) -> tuple[str | None, str]:
    """(exception type, message) of a log line such as ``ValueError: The 'fa3' backend ...``."""
    m = _EXC_RE.match(message.strip())
    if m and " " not in m.group(1):
        return m.group(1).rsplit(".", 1)[-1], m.group(2).strip()
    return None, message.strip()


# -- templates -----------------------------------------------------------------------------------

def _locals_of(fn: ast.AST | None, name: str) -> list[ast.expr]:
    if fn is None:
        return []
    return [n.value for n in ast.walk(fn) if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)]


def _parts(node: ast.expr | None, fn: ast.AST | None, depth: int = 0) -> list[str | None]:
    """The message ``node`` as literal pieces and wildcards (None)."""
    if node is None:
        return []
    if isinstance(node, ast.Constant):
        return [str(node.value)] if isinstance(node.value, str) else [None]
    if isinstance(node, ast.JoinedStr):
        out: list[str | None] = []
        for v in node.values:
            out += [str(v.value)] if isinstance(v, ast.Constant) else [None]
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _parts(node.left, fn, depth) + _parts(node.right, fn, depth)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) \
            and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str):
        return _fields(node.left.value, _PERCENT_FIELD, {"%%": "%"})
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "format":
        inner = _parts(node.func.value, fn, depth)
        out = []
        for p in inner:
            out += _fields(p, _FORMAT_FIELD, {"{{": "{", "}}": "}"}) if p else [None]
        return out
    if isinstance(node, ast.Name) and depth < 1:
        found = _locals_of(fn, node.id)
        if len(found) == 1:
            return _parts(found[0], fn, depth + 1)
    return [None]


def _fields(text: str, rx: re.Pattern[str], escapes: dict[str, str]) -> list[str | None]:
    out: list[str | None] = []
    pos = 0
    buf = ""
    for m in rx.finditer(text):
        buf += text[pos:m.start()]
        if m.group(0) in escapes:
            buf += escapes[m.group(0)]
        else:
            out += [buf, None]
            buf = ""
        pos = m.end()
    out.append(buf + text[pos:])
    return out


def _regex(parts: list[str | None]) -> str:
    out: list[str] = []
    for p in parts:
        if p is None:
            if not out or out[-1] != "(.*?)":
                out.append("(.*?)")
        elif p:
            out.append(r"\s+".join(regex.escape(w) for w in re.split(r"\s+", p)))
    return "".join(out)


def template_text(parts: list[str | None]) -> str:
    """The template with ``{}`` for each formatted part."""
    return "".join("{}" if p is None else p for p in parts)


# -- sites of a file -------------------------------------------------------------------------

def _exception(exc: ast.expr | None) -> tuple[str, ast.expr | None]:
    if isinstance(exc, ast.Call):
        name = ast.unparse(exc.func).rsplit(".", 1)[-1]
        msg = exc.args[0] if exc.args else next((k.value for k in exc.keywords
                                                 if k.arg in ("msg", "message")), None)
        return name, msg
    return (ast.unparse(exc).rsplit(".", 1)[-1] if exc is not None else "(re-raise)"), None


def _walk(body: list[ast.stmt], conds: list[ast.expr], func: str, cls: str,
          fn: ast.FunctionDef | ast.AsyncFunctionDef | None, rel: str,
          out: list[_Site]) -> None:
    conds = list(conds)
    for st in body:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{cls}.{st.name}" if cls else st.name
            _walk(st.body, [], name, cls, st, rel, out)
        elif isinstance(st, ast.ClassDef):
            _walk(st.body, [], func, st.name, fn, rel, out)
        elif isinstance(st, ast.If):
            _walk(st.body, [*conds, st.test], func, cls, fn, rel, out)
            _walk(st.orelse, [*conds, negate(st.test)], func, cls, fn, rel, out)
        elif isinstance(st, ast.Raise):
            exc, msg = _exception(st.exc)
            if msg is not None:
                out.append(_Site(rel, st.lineno, "raise", exc, func, cls, fn, conds,
                                 _parts(msg, fn)))
        elif isinstance(st, ast.Assert):
            if st.msg is not None:
                out.append(_Site(rel, st.lineno, "assert", "AssertionError", func, cls, fn,
                                 [*conds, negate(st.test)], _parts(st.msg, fn)))
        elif isinstance(st, ast.Try) or type(st).__name__ == "TryStar":
            _walk(st.body, conds, func, cls, fn, rel, out)  # type: ignore[attr-defined]
            for h in st.handlers:  # type: ignore[attr-defined]
                caught = ast.Name(id=f"<caught {ast.unparse(h.type) if h.type else 'any'}>")
                _walk(h.body, [*conds, caught], func, cls, fn, rel, out)
            _walk(st.orelse + st.finalbody, conds, func, cls, fn, rel,  # type: ignore
                  out)
        elif isinstance(st, (ast.For, ast.AsyncFor, ast.While)):
            _walk(st.body + st.orelse, conds, func, cls, fn, rel, out)
        elif isinstance(st, (ast.With, ast.AsyncWith)):
            _walk(st.body, conds, func, cls, fn, rel, out)
        elif isinstance(st, ast.Match):
            for c in st.cases:
                _walk(c.body, [*conds, ast.Name(id=f"<case {ast.unparse(c.pattern)}>")],
                      func, cls, fn, rel, out)
        if isinstance(st, ast.If) and st.body and isinstance(st.body[-1], _QUIET) \
                and not st.orelse:
            conds.append(negate(st.test))  # `if c: return` before: not c holds below


def _file_sites(tree: SourceTree, rel: str) -> list[_Site]:
    with _LOCK:
        per_tree = _CACHE.setdefault(tree, {})
        if rel in per_tree:
            return per_tree[rel]
    mod = tree.parse(rel)
    sites: list[_Site] = []
    if mod is not None:
        _walk(mod.body, [], "<module>", "", None, rel, sites)
    with _LOCK:
        per_tree[rel] = sites
    return sites


def _needles(message: str) -> list[str]:
    words = _WORD_RE.findall(message)
    grams = [" ".join(words[i:i + 3]) for i in range(max(0, len(words) - 2))]
    if not grams:
        grams = sorted((w for w in words if len(w) >= 5), key=len, reverse=True)[:2]
    return list(dict.fromkeys(grams))[:40]


def _candidate_files(tree: SourceTree, text: str, include_tests: bool) -> list[str]:
    """Python files holding the most of the message's word trigrams.

    A file is kept when it holds at least half as many as the best file: the file of the
    template holds the trigrams of its literal parts.
    """
    needles = _needles(text)
    counts: dict[str, int] = {}
    for rel, body in tree.texts.items():
        if rel.endswith(".py") and (include_tests or not is_test(rel)):
            n = sum(1 for x in needles if x in body)
            if n:
                counts[rel] = n
    best = max(counts.values(), default=0)
    return sorted(rel for rel, n in counts.items() if 2 * n >= best)


def _module_and_reader(tree: SourceTree, inv: FlagInventory, s: _Site) -> GuardReader:
    mod = tree.parse(s.rel)
    assert mod is not None  # its sites came from this parse
    return GuardReader(tree, inv, s.rel, mod, s.fn, s.cls)


def _public(tree: SourceTree, inv: FlagInventory, s: _Site, matched: int) -> RaiseSite:
    reader = _module_and_reader(tree, inv, s)
    disjuncts, truncated = reader.facts(s.conds)
    guard = " and ".join(f"({short(ast.unparse(c), 300)})" if len(s.conds) > 1
                         else short(ast.unparse(c), 300) for c in s.conds) or "True"
    facts = GuardFacts(site=f"{s.rel}:{s.line}", exception=s.exception, guard=guard,
                       disjuncts=disjuncts, truncated=truncated)
    return RaiseSite(path=s.rel, line=s.line, site=f"{s.rel}:{s.line}", kind=s.kind,
                     exception=s.exception, function=s.func, stage=stage(s.rel, s.func),
                     template=short(template_text(s.parts), 600), literal_chars=matched,
                     guard=guard, flags=facts.flags, hardware=facts.hardware,
                     tests_model=facts.tests_model, facts=facts)


def locate_message(tree: SourceTree, inv: FlagInventory, message: str,
                   exception: str | None = None, max_sites: int = 5,
                   include_tests: bool = False) -> MessageMatch:
    """The raise / assert sites whose message template matches ``message``, best first.

    Args:
        tree: the source tree.
        inv: its flag inventory (to map the guard's names to flag dests).
        message: the error message, alone or as the log line
            (``ValueError: The 'fa3' backend is not supported on Blackwell GPUs``).
        exception: the exception type, when the message does not name it.
        max_sites: how many sites to return.
        include_tests: also match sites in test code.

    Raises:
        SourceError: an empty or overlong message, or matching ran past 2 s.
    """
    t0 = time.perf_counter()
    if not message.strip() or len(message) > MAX_MESSAGE_CHARS:
        raise SourceError(f"give the error message (1 to {MAX_MESSAGE_CHARS} characters), e.g. "
                          "\"ValueError: The 'fa3' backend is not supported on Blackwell GPUs\"")
    named, text = split_exception(message.strip().splitlines()[-1] if "\n" in message.strip()
                                  else message)
    want = exception or named
    files = _candidate_files(tree, text, include_tests)
    deadline = t0 + MATCH_BUDGET_S
    found: list[tuple[_Site, int]] = []
    for rel in sorted(files):
        for s in _file_sites(tree, rel):
            lit = s.literal
            if lit < MIN_LITERAL_CHARS or lit < MIN_LITERAL_SHARE * len(text) \
                    or lit > len(text):
                continue
            try:
                rx = regex.compile(_regex(s.parts), regex.S)
                hit = rx.fullmatch(text, timeout=max(deadline - time.perf_counter(), 1e-3)) \
                    or rx.search(text, timeout=max(deadline - time.perf_counter(), 1e-3))
            except TimeoutError as e:
                raise SourceError("matching the message took longer than "
                                  f"{MATCH_BUDGET_S:g} s; give a shorter excerpt") from e
            if hit is not None:
                found.append((s, lit))
    found.sort(key=lambda p: (want is not None and p[0].exception != want, -p[1],
                              not p[0].rel.startswith(SERVING_PREFIX),
                              STAGE_RANK[stage(p[0].rel, p[0].func)], p[0].rel, p[0].line))
    sites = [_public(tree, inv, s, lit) for s, lit in found[:max(1, max_sites)]]
    return MessageMatch(message=text, exception=want, total=len(found), sites=sites,
                        files_searched=len(files), elapsed_s=round(time.perf_counter() - t0, 4))


def site_at(tree: SourceTree, inv: FlagInventory, path: str, line: int) -> RaiseSite:
    """The raise / assert site at ``path:line`` with its guard (for audits by file:line).

    Raises:
        SourceError: no raise or assert with a message starts at that line.
    """
    rel = tree.relpath(path)
    for s in _file_sites(tree, rel):
        if s.line == line:
            return _public(tree, inv, s, s.literal)
    raise SourceError(f"no raise or assert with a message at {rel}:{line}")


def evaluate_site(tree: SourceTree, inv: FlagInventory, path: str, line: int,
                  values: dict[str, object], sm_major: int) -> bool | None:
    """Whether the site at ``path:line`` raises for these flag values on SM ``sm_major``.

    Evaluates the guard's AST (see :meth:`GuardReader.evaluate`); None when it depends on
    something else (a model property, a function argument, a flag not in ``values``).

    Raises:
        SourceError: no such site.
    """
    rel = tree.relpath(path)
    for s in _file_sites(tree, rel):
        if s.line == line:
            return _module_and_reader(tree, inv, s).evaluate(s.conds, values, sm_major)
    raise SourceError(f"no raise or assert with a message at {rel}:{line}")
