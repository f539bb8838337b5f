"""Reading the guard of a raise or assert: which server arguments and hardware facts it tests.

A guard is a list of conditions that all hold when the site raises (the enclosing ``if`` tests,
negated in ``else`` branches, the negated tests of early exits passed before it, and for an
assert its negated test). :class:`GuardReader` turns them into
:class:`domain.grounding.GuardFacts` atoms, and :meth:`GuardReader.evaluate` evaluates them for
given flag values and a GPU's ``sm_major`` (three-valued: None when the guard reads something
else). Names are mapped as follows:

* server arguments: ``<args>.X`` where X is a flag dest of the inventory and ``<args>`` is
  ``server_args``, ``args``, ``cfg``, ``view``, ``self`` (in a class named ``*Args*`` or a file
  under ``arg_groups/``), ``*.server_args`` or a ``get_*()`` accessor (``get_mm()``,
  ``get_global_server_args()``); ``<...>_dict["X"]`` and ``getattr(<args>, "X")``;
* hardware: the SM probes of ``sglang/srt/utils/common.py`` (``is_sm100_supported``,
  ``is_blackwell`` ...: ``partial(_check_cuda_device_version, device_capability_majors=[...])``
  read from the tree), the ``get_platform().<fact>`` names of ``sglang/srt/runtime_context.py``
  ``_PLATFORM_PROBES`` (read from the tree), ``get_device_capability()`` (``[0]`` or a
  ``major, _ =`` unpacking), ``get_device_sm()``, and the platform probes ``is_cuda()``,
  ``is_hip()`` ...; module-level aliases (``_is_hip = is_hip()``) are followed;
* model properties: chains through ``model_config`` / ``hf_config`` / ``hf_text_config`` and
  ``use_mla_backend``-like attributes;
* a local variable is followed through its assignments in the function, two levels deep: the
  first one that reads a flag (``backend = override_backend``, ``override_backend =
  get_mm().mm_attention_backend``) stands for it (recorded in the atom's ``via``).
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from domain.grounding import (
    Atom,
    FlagAtom,
    ModelAtom,
    OpaqueAtom,
    PlatformAtom,
    SmAtom,
)
from mcp_servers.source.flags import FlagInventory
from mcp_servers.source.scan import short
from mcp_servers.source.tree import SourceTree

COMMON = "sglang/srt/utils/common.py"
RUNTIME_CONTEXT = "sglang/srt/runtime_context.py"
MAX_DISJUNCTS = 32
_ARGS_NAMES = {"server_args", "_server_args", "args", "cfg", "view", "sa", "srv_args"}
_MODEL_CHAIN = re.compile(r"\b(model_config|hf_config|hf_text_config|text_config)\b")
_MODEL_ATTRS = {"use_mla_backend", "is_multimodal", "attention_arch", "is_hybrid",
                "architectures", "is_generation", "is_encoder_decoder"}
_PLATFORMS = {"is_cuda": "cuda", "is_cuda_alike": "cuda_alike", "is_hip": "hip",
              "is_npu": "npu", "is_xpu": "xpu", "is_musa": "musa", "is_mps": "mps",
              "is_cpu": "cpu", "is_hpu": "hpu", "is_sail": "sail"}
_OPS: dict[type[ast.cmpop], str] = {ast.Eq: "eq", ast.NotEq: "ne", ast.Lt: "lt", ast.LtE: "le",
                                    ast.Gt: "gt", ast.GtE: "ge", ast.In: "in",
                                    ast.NotIn: "not_in", ast.Is: "eq", ast.IsNot: "ne"}
_NEG = {"eq": "ne", "ne": "eq", "lt": "ge", "ge": "lt", "gt": "le", "le": "gt", "in": "not_in",
        "not_in": "in"}
_FLIP = {"lt": "gt", "gt": "lt", "le": "ge", "ge": "le", "eq": "eq", "ne": "ne"}
_PY: dict[str, Callable[[Any, Any], Any]] = {
    "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
    "gt": operator.gt, "ge": operator.ge, "in": lambda a, b: a in b,
    "not_in": lambda a, b: a not in b}


@dataclass(frozen=True)
class Hardware:
    """The tree's hardware probes: SM predicates by name, platform facts by attribute."""

    sm_probes: dict[str, tuple[list[int], str]]  # probe name -> (capability majors, file:line)
    platform_facts: dict[str, str]  # get_platform().<fact> -> probe name


def hardware(tree: SourceTree) -> Hardware:
    """The SM probes and platform facts defined in ``tree`` (memoised per tree)."""
    def run() -> Hardware:
        probes: dict[str, tuple[list[int], str]] = {}
        mod = tree.parse(COMMON) if COMMON in tree.texts else None
        for st in mod.body if mod else []:
            if not isinstance(st, ast.Assign):
                continue
            for n in ast.walk(st.value):
                if isinstance(n, ast.keyword) and n.arg == "device_capability_majors":
                    try:
                        majors = [int(v) for v in ast.literal_eval(n.value)]
                    except (ValueError, TypeError):
                        continue
                    for t in st.targets:
                        if isinstance(t, ast.Name):
                            probes[t.id] = (majors, f"{COMMON}:{st.lineno}")
        facts: dict[str, str] = {}
        ctx = tree.parse(RUNTIME_CONTEXT) if RUNTIME_CONTEXT in tree.texts else None
        for st in ctx.body if ctx else []:
            target = st.target if isinstance(st, ast.AnnAssign) else \
                st.targets[0] if isinstance(st, ast.Assign) and len(st.targets) == 1 else None
            if isinstance(target, ast.Name) and target.id in ("_PLATFORM_PROBES",
                                                              "_PLATFORM_VALUES") \
                    and st.value is not None:
                try:
                    facts.update(ast.literal_eval(st.value))
                except ValueError:
                    pass
        return Hardware(probes, facts)

    return tree.memo(("guards.hardware",), run)


@dataclass(frozen=True)
class Ref:
    """What an expression reads: kind flag|sm_major|sm|capability|sm_bool|platform|model."""

    kind: str
    name: str = ""  # flag dest, platform name
    majors: tuple[int, ...] = ()
    source: str | None = None
    via: str | None = None


@dataclass
class GuardReader:
    """Reads guard conditions of one function of one file (see the module docstring)."""

    tree: SourceTree
    inv: FlagInventory
    rel: str
    module: ast.Module
    function: ast.FunctionDef | ast.AsyncFunctionDef | None
    class_name: str = ""
    _locals: dict[str, list[tuple[ast.expr, int]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.hw = hardware(self.tree)
        self.dests = {f.dest for f in self.inv.flags} | set(self.inv.fields)
        body = self.function.body if self.function else self.module.body
        for n in ast.walk(ast.Module(body=body, type_ignores=[])):
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    self._bind(t, n.value, n.lineno)
            elif isinstance(n, ast.AnnAssign) and n.value is not None:
                self._bind(n.target, n.value, n.lineno)
        self._module_locals: dict[str, list[tuple[ast.expr, int]]] = {}
        for st in self.module.body:
            if isinstance(st, ast.Assign):
                for t in st.targets:
                    if isinstance(t, ast.Name):
                        self._module_locals.setdefault(t.id, []).append((st.value, st.lineno))

    def _bind(self, target: ast.expr, value: ast.expr, line: int) -> None:
        if isinstance(target, ast.Name):
            self._locals.setdefault(target.id, []).append((value, line))
        elif isinstance(target, ast.Tuple) and target.elts:
            for i, e in enumerate(target.elts):  # major, minor = get_device_capability()
                if isinstance(e, ast.Name):
                    sub = ast.Subscript(value=value, slice=ast.Constant(i), ctx=ast.Load())
                    self._locals.setdefault(e.id, []).append((sub, line))

    # -- what an expression reads --------------------------------------------------------------

    def _args_like(self, recv: ast.expr) -> bool:
        if isinstance(recv, ast.Name):
            if recv.id == "self":
                return "Args" in self.class_name or "/arg_groups/" in self.rel \
                    or self.rel.endswith("server_args.py")
            return recv.id in _ARGS_NAMES
        if isinstance(recv, ast.Attribute):
            return recv.attr in ("server_args", "_server_args")
        if isinstance(recv, ast.Call) and not recv.args and not recv.keywords:
            return bool(re.match(r"^get_\w+$", _name(recv.func)))
        return False

    def ref(self, e: ast.expr, depth: int = 0) -> Ref | None:
        """What ``e`` reads, or None (opaque)."""
        if isinstance(e, ast.Attribute):
            if e.attr in self.dests and self._args_like(e.value):
                return Ref("flag", e.attr)
            if isinstance(e.value, ast.Call) and _name(e.value.func) == "get_platform":
                probe = self.hw.platform_facts.get(e.attr, e.attr)
                return self._probe(probe)
            text = ast.unparse(e)
            if _MODEL_CHAIN.search(text) or e.attr in _MODEL_ATTRS:
                return Ref("model", text)
            return None
        if isinstance(e, ast.Subscript):
            key = e.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str) \
                    and key.value in self.dests and ast.unparse(e.value).endswith("args_dict"):
                return Ref("flag", key.value)
            inner = self.ref(e.value, depth)
            if inner and inner.kind == "capability" and isinstance(key, ast.Constant):
                return Ref("sm_major") if key.value == 0 else None
            return Ref("model", ast.unparse(e)) if inner and inner.kind == "model" else None
        if isinstance(e, ast.Call):
            fn = _name(e.func)
            if fn == "getattr" and len(e.args) >= 2 and isinstance(e.args[1], ast.Constant) \
                    and e.args[1].value in self.dests and self._args_like(e.args[0]):
                return Ref("flag", str(e.args[1].value))
            if fn == "get_device_capability":
                return Ref("capability")
            if fn == "get_device_sm":
                return Ref("sm")
            if fn == "bool" and len(e.args) == 1:
                return self.ref(e.args[0], depth)
            if not e.args and not e.keywords:
                return self._probe(fn)
            return None
        if isinstance(e, ast.Name):
            return self._local(e.id, depth)
        return None

    def _probe(self, probe: str) -> Ref | None:
        if probe in self.hw.sm_probes:
            majors, src = self.hw.sm_probes[probe]
            return Ref("sm_bool", probe, tuple(majors), src)
        if probe in _PLATFORMS:
            return Ref("platform", _PLATFORMS[probe])
        if probe == "get_device_capability":
            return Ref("capability")
        if probe == "get_device_sm":
            return Ref("sm")
        return None

    def _local(self, name: str, depth: int) -> Ref | None:
        if depth >= 2:
            return None
        found: Ref | None = None
        for value, line in self._locals.get(name, []) or self._module_locals.get(name, []):
            r = self.ref(value, depth + 1)
            if r is None:
                continue
            via = f"{name} = {short(ast.unparse(value), 80)} (line {line})"
            r = Ref(r.kind, r.name, r.majors, r.source,
                    via if r.via is None else f"{via}; {r.via}")
            if r.kind == "flag":
                return r
            found = found or r
        return found

    # -- atoms ---------------------------------------------------------------------------------

    def facts(self, conds: list[ast.expr]) -> tuple[list[list[Atom]], bool]:
        """(disjuncts, truncated): the conjunction of ``conds`` in disjunctive normal form."""
        dnf: list[list[Atom]] = [[]]
        for c in conds:
            dnf = _product(dnf, self._dnf(c, True))
        return dnf[:MAX_DISJUNCTS], len(dnf) > MAX_DISJUNCTS

    def _dnf(self, e: ast.expr, positive: bool) -> list[list[Atom]]:
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            return self._dnf(e.operand, not positive)
        if isinstance(e, ast.BoolOp):
            parts = [self._dnf(v, positive) for v in e.values]
            conj = isinstance(e.op, ast.And) == positive
            if conj:
                out: list[list[Atom]] = [[]]
                for p in parts:
                    out = _product(out, p)
                return out
            return [d for p in parts for d in p][:MAX_DISJUNCTS * 4]
        if isinstance(e, ast.Compare):
            pairs = list(zip([e.left, *e.comparators[:-1]], e.ops, e.comparators, strict=True))
            groups = [self._pair(a, op, b, positive) for a, op, b in pairs]
            return [[a for g in groups for a in g]] if positive else groups
        return [[self._truth(e, positive)]]

    def _text(self, e: ast.AST, positive: bool) -> str:
        src = short(ast.unparse(e), 200)
        return src if positive else f"not ({src})"

    def _truth(self, e: ast.expr, positive: bool) -> Atom:
        text = self._text(e, positive)
        r = self.ref(e)
        if r is None:
            return OpaqueAtom(text=text)
        if r.kind == "flag":
            return self._flag(r, "truthy" if positive else "falsy", None, text)
        if r.kind == "sm_bool":
            return SmAtom(op="in" if positive else "not_in", value=list(r.majors), text=text,
                          source=r.source)
        if r.kind == "platform":
            return PlatformAtom(platform=r.name, value=positive, text=text)
        if r.kind == "model":
            return ModelAtom(text=text)
        return OpaqueAtom(text=text)

    def _flag(self, r: Ref, op: str, value: Any, text: str) -> FlagAtom:
        default, known = self.default(r.name)
        return FlagAtom(dest=r.name, op=op, value=value, default=default,  # type: ignore[arg-type]
                        default_known=known, text=text, via=r.via)

    def default(self, dest: str) -> tuple[Any, bool]:
        """(declared default, whether it is the value at the check) of flag ``dest``.

        Not known: a computed default, a resolvable flag (``Arg(resolvable=True)``: start-up
        resolution may change it, e.g. ``page_size`` by attention backend) and a None default
        (unset: some later rule decides).
        """
        decl = self.inv.fields.get(dest)
        entry = next((f for f in self.inv.flags if f.dest == dest), None)
        src = decl.default_source if decl else entry.default_source if entry else "?"
        value = decl.default if decl else entry.default if entry else None
        known = src is None and value is not None and not (entry and entry.resolvable)
        return value, known

    def _arith_flags(self, e: ast.expr) -> list[Ref] | None:
        """The flags of an arithmetic expression over flags and literals, else None."""
        if _literal(e) is not _NOLIT:
            return []
        if isinstance(e, ast.BinOp):
            left, right = self._arith_flags(e.left), self._arith_flags(e.right)
            return None if left is None or right is None else left + right
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, (ast.USub, ast.UAdd)):
            return self._arith_flags(e.operand)
        r = self.ref(e)
        return [r] if r is not None and r.kind in ("flag", "model") else None

    def _pair(self, a: ast.expr, op: ast.cmpop, b: ast.expr, positive: bool) -> list[Atom]:
        """The atoms of one comparison: one, or one per flag of an arithmetic comparison.

        ``(cfg.tp_size * cfg.pp_size) % cfg.nnodes != 0`` gives a ``compared`` atom for each
        flag (together they hold for the failing values), and a comparison with a model
        property (``num_heads % cfg.tp_size``) a model atom too.
        """
        single = self._one(a, op, b, positive)
        if not isinstance(single, OpaqueAtom):
            return [single]
        fa, fb = self._arith_flags(a), self._arith_flags(b)
        if fa is None or fb is None or not any(r.kind == "flag" for r in fa + fb):
            return [single]
        flags: dict[str, Ref] = {r.name: r for r in fa + fb if r.kind == "flag"}
        atoms: list[Atom] = [self._flag(r, "compared", None, single.text)
                             for r in flags.values()]
        if any(r.kind == "model" for r in fa + fb):
            atoms.append(ModelAtom(text=single.text))
        return atoms

    def _one(self, a: ast.expr, op: ast.cmpop, b: ast.expr, positive: bool) -> Atom:
        name = _OPS[type(op)]
        if not positive:
            name = _NEG[name]
        text = self._text(ast.Compare(left=a, ops=[op], comparators=[b]), positive)
        la, lb = _literal(a), _literal(b)
        ra, rb = self.ref(a), self.ref(b)
        if la is not _NOLIT and rb is not None and name not in ("in", "not_in"):
            la, lb, ra, rb, name = lb, la, rb, ra, _FLIP[name]
        if lb is not _NOLIT and ra is not None:
            if ra.kind == "flag":
                if lb is None and name in ("eq", "ne"):
                    return self._flag(ra, "is_null" if name == "eq" else "not_null", None, text)
                if name in ("in", "not_in") and not isinstance(lb, (list, tuple, set)):
                    return self._flag(ra, "compared", None, text)
                value = list(lb) if isinstance(lb, (tuple, set)) else lb
                return self._flag(ra, name, value, text)
            if ra.kind == "sm_major" and isinstance(lb, int):
                return SmAtom(op=name, value=lb, text=text)  # type: ignore[arg-type]
            if ra.kind == "sm" and isinstance(lb, int) and lb % 10 == 0 and name in (
                    "ge", "lt"):
                return SmAtom(op=name, value=lb // 10, text=text)  # type: ignore[arg-type]
            if ra.kind == "capability" and isinstance(lb, tuple) and len(lb) == 2 \
                    and lb[1] == 0 and name in ("ge", "lt"):
                return SmAtom(op=name, value=lb[0], text=text)  # type: ignore[arg-type]
            if ra.kind == "model":
                return ModelAtom(text=text)
            return OpaqueAtom(text=text)
        return OpaqueAtom(text=text)  # flags against non-literals: see _pair

    # -- evaluation ----------------------------------------------------------------------------

    def evaluate(self, conds: list[ast.expr], values: Mapping[str, Any],
                 sm_major: int, platform: str = "cuda") -> bool | None:
        """Whether every condition holds for these flag values on a GPU of ``sm_major``.

        Walks the conditions' AST (BoolOp, UnaryOp not, Compare, Constant, literals, and the
        references of :meth:`ref`). A flag missing from ``values`` takes its declared default
        when that is known (:meth:`default`); otherwise it, a model property or any other
        name makes the answer None where it matters (three-valued logic).
        """
        env = _Env(self, values, sm_major, platform)
        result: bool | None = True
        for c in conds:
            v = env.truth(c)
            if v is False:
                return False
            if v is None:
                result = None
        return result


_NOLIT: Any = object()


def _literal(e: ast.expr) -> Any:
    try:
        return ast.literal_eval(e)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOLIT


def _name(fn: ast.expr) -> str:
    if isinstance(fn, ast.Name):
        return fn.id
    if isinstance(fn, ast.Attribute):
        return fn.attr
    return ""


def _product(a: list[list[Atom]], b: list[list[Atom]]) -> list[list[Atom]]:
    return [x + y for x in a for y in b][:MAX_DISJUNCTS * 4]


class _Unknown(Exception):
    pass


@dataclass
class _Env:
    reader: GuardReader
    values: Mapping[str, Any]
    sm_major: int
    platform: str

    def truth(self, e: ast.expr) -> bool | None:
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            v = self.truth(e.operand)
            return None if v is None else not v
        if isinstance(e, ast.BoolOp):
            vals = [self.truth(v) for v in e.values]
            if isinstance(e.op, ast.And):
                return False if False in vals else None if None in vals else True
            return True if True in vals else None if None in vals else False
        try:
            return bool(self.value(e))
        except _Unknown:
            return None

    def value(self, e: ast.expr) -> Any:
        if isinstance(e, ast.Compare):
            left = self.value(e.left)
            for op, comp in zip(e.ops, e.comparators, strict=True):
                right = self.value(comp)
                if isinstance(op, (ast.Is, ast.IsNot)):
                    ok = (left is right) == isinstance(op, ast.Is)
                else:
                    try:
                        ok = bool(_PY[_OPS[type(op)]](left, right))
                    except TypeError as err:
                        raise _Unknown from err
                if not ok:
                    return False
                left = right
            return True
        if isinstance(e, (ast.BoolOp, ast.UnaryOp)) and isinstance(
                getattr(e, "op", None), (ast.And, ast.Or, ast.Not)):
            v = self.truth(e)
            if v is None:
                raise _Unknown
            return v
        lit = _literal(e)
        if lit is not _NOLIT:
            return lit
        r = self.reader.ref(e)
        if r is None or r.kind == "model":
            raise _Unknown
        if r.kind == "flag":
            if r.name in self.values:
                return self.values[r.name]
            default, known = self.reader.default(r.name)
            if not known:
                raise _Unknown
            return default
        if r.kind == "sm_major":
            return self.sm_major
        if r.kind == "sm":
            return self.sm_major * 10
        if r.kind == "capability":
            return (self.sm_major, 0)
        if r.kind == "sm_bool":
            return self.sm_major in r.majors
        if r.kind == "platform":
            return self.platform == r.name or (r.name == "cuda_alike"
                                               and self.platform == "cuda")
        raise _Unknown
