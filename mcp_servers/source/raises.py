"""From an engine error message to the raise or assert site that produced it, with its guard.

Every ``raise XError(msg)`` and ``assert test, msg`` of the tree's Python files is a *site*; its
message expression becomes a template (:mod:`mcp_servers.source.templates`: string literals as
they are, formatted parts of f-strings, ``.format`` and ``%`` templates as wildcards). A
log message matches a site when the template's regex matches it (whole, or inside a longer log
line), or when it is the start of the template (a cut line); ties are ranked by the exception
type named in the log line, whole matches before starts, then by the number of literal
characters matched (the longest literal match wins), the serving runtime (``sglang/srt/``)
before other packages, then stage (argument resolution before runtime) and path.

Files are read lazily: a message's word trigrams (weighted by rarity) pick the files whose text
can hold it, and the functions holding them are parsed once per tree and kept (the index grows
with the messages asked about; parsing the whole 0.5.23 wheel at once would take ~13 s).
"""

from __future__ import annotations

import ast
import math
import re
import threading
import time
import weakref
from dataclasses import dataclass, replace

import regex
from pydantic import BaseModel, Field

from domain.grounding import GuardFacts
from mcp_servers.source.flags import FlagInventory
from mcp_servers.source.guards import GuardReader
from mcp_servers.source.scan import STAGE_RANK, is_test, lines_of, negate, short, stage, units
from mcp_servers.source.templates import (
    parts,
    pattern,
    prefix_literal,
    split_exception,
    template_text,
)
from mcp_servers.source.tree import SourceError, SourceTree

MAX_MESSAGE_CHARS = 4_000
MIN_LITERAL_CHARS = 8  # a template with fewer literal characters matches too much
MIN_LITERAL_SHARE = 0.4  # its literals must cover this share of the message
MATCH_BUDGET_S = 0.5  # one template's regex against the message
MIN_PARTIAL_CHARS = 24  # a shorter message is not matched against the start of a template
WIDEN_FILES = 100  # files searched at most when the named exception is not found at first
RARE_FILES = 20  # a needle held by at most this many files makes a file's case
MAX_NEEDLES = 12  # word n-grams of a message searched for in the file texts
SERVING_PREFIX = "sglang/srt/"  # the serving runtime; its sites rank before other packages'
_WORD_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")
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
    partial: bool = Field(False, description="the message is only the start of the template "
                                             "(a cut log line or a quoted fragment)")
    guard: str = Field(description="the condition under which it raises, as source text: "
                                   "enclosing if tests, early exits passed, the negated assert "
                                   "test ('True' when unconditional)")
    reached_only_if: list[str] = Field(description="earlier checks that raise (`if c: raise` "
                                       "gives `not c`): a config failing them fails there "
                                       "first, so they are not part of the guard")
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
    at: _Where
    conds: list[ast.expr]  # all hold when it raises
    parts: list[str | None]  # literal text, or None for a formatted part

    @property
    def func(self) -> str:
        return self.at.func

    @property
    def literal(self) -> int:
        return sum(len(p.replace("`", "")) for p in self.parts if p)  # backticks optional


_CACHE: weakref.WeakKeyDictionary[SourceTree, dict[str, list[_Site]]] = \
    weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


# -- sites of a file -------------------------------------------------------------------------

def _exception(exc: ast.expr | None) -> tuple[str, ast.expr | None]:
    if isinstance(exc, ast.Call):
        name = ast.unparse(exc.func).rsplit(".", 1)[-1]
        msg = exc.args[0] if exc.args else next((k.value for k in exc.keywords
                                                 if k.arg in ("msg", "message")), None)
        return name, msg
    return (ast.unparse(exc).rsplit(".", 1)[-1] if exc is not None else "(re-raise)"), None


@dataclass(frozen=True)
class _Where:
    func: str
    cls: str
    fn: ast.FunctionDef | ast.AsyncFunctionDef | None
    conds: tuple[ast.expr, ...] = ()  # the guard: enclosing if tests, quiet early exits
    passed: tuple[ast.expr, ...] = ()  # earlier `if c: raise` checks: `not c` holds here

    def under(self, *c: ast.expr) -> _Where:
        return replace(self, conds=(*self.conds, *c))


def _registered(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[ast.expr, ...]:
    """The condition under which a registered factory runs.

    ``@register_attention_backend("fa3")`` (``layers/attention/attention_registry.py``) files
    the function under that name; the model runner calls it for the resolved prefill or
    decode backend, which is ``--attention-backend`` unless those are set apart. Its sites
    get ``server_args.attention_backend == "fa3"``.
    """
    for d in fn.decorator_list:
        if isinstance(d, ast.Call) and ast.unparse(d.func).endswith(
                "register_attention_backend") and d.args \
                and isinstance(d.args[0], ast.Constant) and isinstance(d.args[0].value, str):
            dest = ast.Attribute(value=ast.Name(id="server_args", ctx=ast.Load()),
                                 attr="attention_backend", ctx=ast.Load())
            return (ast.Compare(left=dest, ops=[ast.Eq()],
                                comparators=[ast.Constant(d.args[0].value)]),)
    return ()


def _walk(body: list[ast.stmt], at: _Where, rel: str, out: list[_Site]) -> None:
    """Collect the raise / assert sites under ``body`` with their guards.

    An early exit ``if c: return`` (or continue / break) passed before a site adds ``not c``
    to its guard: had ``c`` held, it would not be reached. An earlier ``if c: raise`` adds
    ``not c`` to ``reached_only_if`` only: a config with ``c`` fails there anyway.
    """
    for st in body:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{at.cls}.{st.name}" if at.cls else st.name
            _walk(st.body, _Where(name, at.cls, st, _registered(st)), rel, out)
        elif isinstance(st, ast.ClassDef):
            _walk(st.body, _Where(at.func, st.name, at.fn), rel, out)
        elif isinstance(st, ast.If):
            _walk(st.body, at.under(st.test), rel, out)
            _walk(st.orelse, at.under(negate(st.test)), rel, out)
        elif isinstance(st, ast.Raise):
            exc, msg = _exception(st.exc)
            if msg is not None:
                out.append(_Site(rel, st.lineno, "raise", exc, at, list(at.conds),
                                 parts(msg, at.fn)))
        elif isinstance(st, ast.Assert):
            if st.msg is not None:
                out.append(_Site(rel, st.lineno, "assert", "AssertionError", at,
                                 [*at.conds, negate(st.test)], parts(st.msg, at.fn)))
        elif isinstance(st, ast.Try) or type(st).__name__ == "TryStar":
            _walk(st.body, at, rel, out)  # type: ignore[attr-defined]
            for h in st.handlers:  # type: ignore[attr-defined]
                caught = ast.Name(id=f"<caught {ast.unparse(h.type) if h.type else 'any'}>")
                _walk(h.body, at.under(caught), rel, out)
            _walk(st.orelse + st.finalbody, at, rel, out)  # type: ignore[attr-defined]
        elif isinstance(st, (ast.For, ast.AsyncFor, ast.While)):
            _walk(st.body + st.orelse, at, rel, out)
        elif isinstance(st, (ast.With, ast.AsyncWith)):
            _walk(st.body, at, rel, out)
        elif isinstance(st, ast.Match):
            for c in st.cases:
                _walk(c.body, at.under(ast.Name(id=f"<case {ast.unparse(c.pattern)}>")), rel,
                      out)
        if isinstance(st, ast.If) and st.body and not st.orelse:
            if isinstance(st.body[-1], _QUIET):
                at = at.under(negate(st.test))
            elif isinstance(st.body[-1], ast.Raise):
                at = replace(at, passed=(*at.passed, negate(st.test)))


def _file_sites(tree: SourceTree, rel: str) -> list[_Site]:
    """Every site of file ``rel`` (parsed once per tree, then kept)."""
    with _LOCK:
        per_tree = _CACHE.setdefault(tree, {})
        if rel in per_tree:
            return per_tree[rel]
    mod = tree.parse(rel)
    sites: list[_Site] = []
    if mod is not None:
        _walk(mod.body, _Where("<module>", "", None), rel, sites)
    with _LOCK:
        per_tree[rel] = sites
    return sites


def _sites_near(tree: SourceTree, rel: str, needles: list[str]) -> list[_Site]:
    """The sites of the functions of ``rel`` whose text holds a needle.

    Each such function is cut out and parsed alone (:func:`mcp_servers.source.scan.units`)
    and kept per tree; the whole file is parsed when a needle lies outside any function.
    """
    with _LOCK:
        per_tree = _CACHE.setdefault(tree, {})
        if rel in per_tree:
            return per_tree[rel]
    text = tree.texts[rel]
    positions = sorted({i for n in needles for i in _finds(text, n)})
    lines = sorted(set(lines_of(text, positions)))
    out: list[_Site] = []
    for unit, prefix in units(tree, rel, lines):
        if not isinstance(unit, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return _file_sites(tree, rel)  # the whole module was parsed anyway
        key = f"{rel}#{unit.lineno}"
        with _LOCK:
            cached = per_tree.get(key)
        if cached is None:
            cached = []
            if not unit.decorator_list:  # a cut starts at the def line: read decorators above
                unit.decorator_list = _decorators_above(text, unit.lineno)
            cls = prefix.rstrip(".").rsplit(".", 1)[-1] if prefix else ""
            _walk([unit], _Where("<module>", cls, None), rel, cached)
            with _LOCK:
                per_tree[key] = cached
        out += cached
    return out


def _decorators_above(text: str, line: int) -> list[ast.expr]:
    """The one-line decorators right above 1-based ``line`` (a def), parsed."""
    lines = text.split("\n")
    out: list[ast.expr] = []
    j = line - 2
    while j >= 0 and lines[j].lstrip().startswith("@"):
        try:
            out.insert(0, ast.parse(lines[j].strip()[1:], mode="eval").body)
        except SyntaxError:
            break
        j -= 1
    return out


def _finds(text: str, needle: str) -> list[int]:
    out, i = [], text.find(needle)
    while i >= 0 and len(out) < 50:
        out.append(i)
        i = text.find(needle, i + 1)
    return out


def _needles(message: str, n: int) -> list[str]:
    """Pieces of the message to look for in the file texts, spread over it.

    For n = 0, the stretches between numbers (formatted values are mostly numbers) of at
    least 12 characters; for n >= 2, runs of n whitespace-separated tokens as the message
    spells them (a literal piece of the template holds them verbatim); for n = 1, its words of
    at least 4 characters.
    """
    if n == 0:
        grams = list(dict.fromkeys(seg.strip() for seg in _NUMBER_RE.split(message)
                                   if len(seg.strip()) >= 12))
    elif n == 1:
        grams = list(dict.fromkeys(w for w in _WORD_RE.findall(message) if len(w) >= 4))
    else:
        tokens = message.split()
        grams = list(dict.fromkeys(" ".join(tokens[i:i + n])
                                   for i in range(len(tokens) - n + 1)))
    step = -(-len(grams) // MAX_NEEDLES)  # spread over the message
    return grams[::max(1, step)]


def _candidate_files(tree: SourceTree, text: str, include_tests: bool,
                     share: float = 0.5) -> tuple[list[str], list[str]]:
    """(files, needles): the Python files most likely to hold the message's template.

    Needles are the message's word trigrams, each weighted by its rarity over the files
    (log(1 + N / files holding it)); a file is kept when its weight is at least ``share`` of
    the best file's: the file of the template holds the trigrams of its literal parts, and
    common phrases ("is not divisible") weigh little. The stretches between numbers come first;
    when no file holds a rare needle (formatted values between every few words), trigrams,
    bigrams, then single words are added. ``share=0`` widens: the ``WIDEN_FILES`` heaviest
    files holding a stretch, trigram or bigram.
    """
    scope = [(rel, body) for rel, body in tree.texts.items()
             if rel.endswith(".py") and (include_tests or not is_test(rel))]
    rare = math.log(1 + len(scope) / RARE_FILES)
    needles: list[str] = []
    held: dict[str, list[str]] = {}
    for n in (0, 3, 2, 1):
        more = [x for x in _needles(text, n) if x not in needles]
        needles += more
        for rel, body in scope:
            got = [x for x in more if x in body]
            if got:
                held.setdefault(rel, []).extend(got)
        if not held:
            continue
        df = {x: sum(1 for h in held.values() if x in h) for x in needles}
        weight = {rel: sum(math.log(1 + len(scope) / df[x]) for x in h)
                  for rel, h in held.items()}
        best = max(weight.values())
        # trigrams always join (a stretch may be found only in the wrong files); share 0
        # (widening): every file holding a stretch, trigram or bigram, the heaviest first
        if share == 0 and n == 2:
            top = sorted(weight, key=lambda rel: -weight[rel])[:WIDEN_FILES]
            return sorted(top), needles
        if n in (3, 2) and best >= rare and share > 0 or n == 1:
            return sorted(rel for rel, w in weight.items() if w >= share * best), needles
    return [], []


_READERS: weakref.WeakKeyDictionary[SourceTree, dict[tuple[int, str, int], GuardReader]] = \
    weakref.WeakKeyDictionary()


def _module_and_reader(tree: SourceTree, inv: FlagInventory, s: _Site) -> GuardReader:
    """The guard reader of site ``s``, kept per tree and inventory.

    Audits evaluate one site over many configs.
    """
    key = (id(inv), s.rel, s.line)
    with _LOCK:
        found = _READERS.setdefault(tree, {}).get(key)
    if found is not None and found.inv is inv:
        return found
    mod = tree.parse(s.rel)
    assert mod is not None  # its sites came from this parse
    reader = GuardReader(tree, inv, s.rel, mod, s.at.fn, s.at.cls)
    with _LOCK:
        _READERS[tree][key] = reader
    return reader


def _public(tree: SourceTree, inv: FlagInventory, s: _Site, matched: int,
            partial: bool = False) -> RaiseSite:
    reader = _module_and_reader(tree, inv, s)
    disjuncts, truncated = reader.facts(s.conds)
    guard = " and ".join(f"({short(ast.unparse(c), 300)})" if len(s.conds) > 1
                         else short(ast.unparse(c), 300) for c in s.conds) or "True"
    facts = GuardFacts(site=f"{s.rel}:{s.line}", exception=s.exception, guard=guard,
                       disjuncts=disjuncts, truncated=truncated)
    return RaiseSite(path=s.rel, line=s.line, site=f"{s.rel}:{s.line}", kind=s.kind,
                     exception=s.exception, function=s.func, stage=stage(s.rel, s.func),
                     template=short(template_text(s.parts), 600), literal_chars=matched,
                     partial=partial,
                     guard=guard, reached_only_if=[short(ast.unparse(c), 200)
                                                   for c in s.at.passed],
                     flags=facts.flags, hardware=facts.hardware,
                     tests_model=facts.tests_model, facts=facts)


def _last_exception(message: str) -> str:
    """From a traceback or several log lines, the last exception line and what follows it.

    A message of one line, or of lines none of which names an exception, is returned whole
    (a multi-line message of its own).
    """
    lines = message.strip().splitlines()
    for k in range(len(lines) - 1, -1, -1):
        if split_exception(lines[k])[0] is not None:
            return "\n".join(lines[k:])
    return message.strip()


def _matches(tree: SourceTree, text: str, files: list[str],
             needles: list[str]) -> list[tuple[_Site, int, bool]]:
    """(site, literal characters matched, partial) of the sites in ``files`` matching ``text``.

    A template matches when its regex matches the whole message or a part of a longer log
    line; or, for a message of at least ``MIN_PARTIAL_CHARS``, when the message is a start of
    the template (``partial``: a cut log line, or a quoted fragment).

    Raises:
        SourceError: one template's match ran past ``MATCH_BUDGET_S``.
    """
    found: list[tuple[_Site, int, bool]] = []
    for rel in files:
        for s in _sites_near(tree, rel, needles):
            lit = s.literal
            if lit < MIN_LITERAL_CHARS or lit < MIN_LITERAL_SHARE * len(text):
                continue
            try:
                rx = regex.compile(pattern(s.parts), regex.S)
                hit = None
                if lit <= len(text):
                    hit = rx.fullmatch(text, timeout=MATCH_BUDGET_S) \
                        or rx.search(text, timeout=MATCH_BUDGET_S)
            except TimeoutError as e:
                raise SourceError("matching the message took longer than "
                                  f"{MATCH_BUDGET_S:g} s; give a shorter excerpt") from e
            if hit is not None:
                found.append((s, lit, False))
            elif len(text) >= MIN_PARTIAL_CHARS:
                start = prefix_literal(s.parts, text)
                if start is not None and start >= max(MIN_LITERAL_CHARS,
                                                      MIN_LITERAL_SHARE * len(text)):
                    found.append((s, start, True))
    return found


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
        SourceError: an empty or overlong message, or one template's match ran past 0.5 s.
    """
    t0 = time.perf_counter()
    if not message.strip() or len(message) > MAX_MESSAGE_CHARS:
        raise SourceError(f"give the error message (1 to {MAX_MESSAGE_CHARS} characters), e.g. "
                          "\"ValueError: The 'fa3' backend is not supported on Blackwell GPUs\"")
    named, text = split_exception(_last_exception(message))
    want = exception or named
    if text.endswith(("...", "\u2026")):  # a quoted fragment: match it as a start
        text = text.rstrip(" .\u2026")
    if len(re.findall(r"[A-Za-z0-9]", text)) < 8:  # "{name}", "--help": under 8 letters or digits
        # too little text to tell raise sites apart (every wildcard template would match)
        return MessageMatch(message=text, exception=want, total=0, sites=[], files_searched=0,
                            elapsed_s=round(time.perf_counter() - t0, 4))
    files, needles = _candidate_files(tree, text, include_tests)
    found = _matches(tree, text, files, needles)
    if want is not None and not any(s.exception == want for s, _, _ in found):
        # the log line names an exception none of the likeliest files raises with it: widen
        files, needles = _candidate_files(tree, text, include_tests, share=0.0)
        found = _matches(tree, text, files, needles)
    found.sort(key=lambda p: (want is not None and p[0].exception != want, p[2], -p[1],
                              not p[0].rel.startswith(SERVING_PREFIX),
                              STAGE_RANK[stage(p[0].rel, p[0].func)], p[0].rel, p[0].line))
    sites = [_public(tree, inv, s, lit, partial) for s, lit, partial in found[:max(1, max_sites)]]
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

    Evaluates the guard's AST (see :meth:`GuardReader.evaluate`): ``values`` maps flag dests
    to values (e.g. a ServingConfig's fields); other flags take their declared default when
    it is known. None when it depends on something else (a model property, a function
    argument, a flag whose value is resolved at start-up).

    Raises:
        SourceError: no such site.
    """
    rel = tree.relpath(path)
    for s in _file_sites(tree, rel):
        if s.line == line:
            return _module_and_reader(tree, inv, s).evaluate(s.conds, values, sm_major)
    raise SourceError(f"no raise or assert with a message at {rel}:{line}")
