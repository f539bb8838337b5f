"""The server flags of an SGLang version, read from its source with ``ast`` (never imported).

Two declaration styles are read:

* 0.5.2x: ``ServerArgs`` fields are msgspec Structs in ``sglang/srt/arg_groups/fields/*.py``,
  declared ``name: A[T, "help"] = default`` or ``name: A[T, Arg(help=..., choices=...,
  aliases=..., cli_name=..., action=..., no_cli=...)] = default``. The CLI name is ``--`` + the
  field name with ``_`` -> ``-``; choices come from ``Literal[...]``, from ``Arg(choices=...)`` or
  from constants in ``arg_groups/choices.py``.
* every version: ``parser.add_argument(...)`` calls in ``sglang/srt/server_args.py`` (dynamic
  choices and deprecated flags in 0.5.2x; every flag in older releases, whose plain dataclass
  fields in ``class ServerArgs`` supply the ``default=ServerArgs.x`` values).

Values that only exist at run time (a list computed by a function, an environment read) are kept
as their source text in ``default_source`` / ``choices_source``.
"""

from __future__ import annotations

import ast
import difflib
import operator
import re
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

from mcp_servers.source.tree import SourceError, SourceTree

FIELDS_DIR = "sglang/srt/arg_groups/fields/"
CHOICES_FILE = "sglang/srt/arg_groups/choices.py"
SERVER_ARGS = "sglang/srt/server_args.py"
FLAG_ARG_RE = re.compile(r"^(--?)?[A-Za-z_][A-Za-z0-9_-]*$")


class FlagInfo(BaseModel):
    """One command-line flag of ``sglang.launch_server`` (one argparse action)."""

    dest: str = Field(description="ServerArgs field it sets, e.g. 'max_running_requests'")
    flags: list[str] = Field(description="option strings: the CLI name first, then aliases "
                                         "(and --no-... forms of BooleanOptionalAction)")
    action: str = Field(description="argparse action: store, store_true, BooleanOptionalAction, "
                                    "or a custom action class name")
    type: str | None = Field(description="the field's annotation as written, e.g. "
                                         "'Optional[int]' (null for manual flags)")
    value_type: str | None = Field(description="what argparse converts the value with: str, int, "
                                               "float or a parser function; null for switches")
    nargs: str | None = None
    default: Any = Field(description="declared default; null is often 'resolved at start-up' "
                                     "(see explain_default)")
    default_source: str | None = Field(description="the default's source text when it is not a "
                                                   "plain literal")
    choices: list[Any] | None = None
    choices_source: str | None = Field(default=None, description="source text of choices "
                                       "computed at run time")
    help: str = ""
    namespace: str | None = Field(description="declaring Struct, e.g. 'Schedule'; "
                                              "'add_argument' for manual flags")
    deprecated: bool = False
    resolvable: bool = Field(default=False, description="Arg(resolvable=True): start-up "
                             "resolution may change the value")
    fallback: Any = Field(default=None, description="Arg(fallback=...): value used when neither "
                          "the user nor resolution set one")
    source: str = Field(description="file:line of the declaration")
    new_flag: str | None = Field(default=None, description="the successor a deprecated "
                                 "add_argument names (its new_flag= keyword)")


class FieldDecl(BaseModel):
    """A declared ServerArgs field, with or without a command-line flag."""

    dest: str
    type: str | None
    default: Any
    default_source: str | None
    namespace: str | None
    no_cli: bool
    source: str


class FlagInventory(BaseModel):
    """Every flag and declared field of one source tree."""

    version: str | None
    flags: list[FlagInfo]
    fields: dict[str, FieldDecl]

    def lookup(self) -> dict[str, str]:
        """Map of every accepted spelling (dest, --flag, --alias) to its dest."""
        names: dict[str, str] = {d: d for d in self.fields}
        for f in self.flags:
            names.setdefault(f.dest, f.dest)
            for s in f.flags:
                names.setdefault(s, f.dest)
        return names

    def dest_of(self, flag: str) -> str:
        """The dest named by ``flag`` (a dest like 'max_running_requests' or a CLI form).

        Raises:
            SourceError: an option-like but malformed value, or an unknown name (the message
                lists the closest known names).
        """
        if not FLAG_ARG_RE.match(flag) or flag.startswith("-") and not flag.startswith("--"):
            raise SourceError(f"{flag!r} is not a flag name; give a dest such as "
                              "'max_running_requests' or a CLI flag such as "
                              "'--max-running-requests'")
        names = self.lookup()
        if flag in names:
            return names[flag]
        guess = flag.lstrip("-").replace("-", "_")
        if guess in names:
            return names[guess]
        if not names:
            return guess  # a tree without a recognisable flag declaration: search the name itself
        close = difflib.get_close_matches(guess, [n for n in names if not n.startswith("-")],
                                          n=6, cutoff=0.6)
        hint = f"; did you mean: {', '.join(close)}" if close else \
            "; call list_flags(name_contains=...) to find it"
        raise SourceError(f"SGLang {self.version or ''} has no flag or field {flag!r}{hint}")

    def get(self, flag: str) -> list[FlagInfo]:
        """Every flag entry with the dest of ``flag`` (usually one; a deprecated spelling adds one).

        Raises:
            SourceError: unknown flag (see :meth:`dest_of`).
        """
        dest = self.dest_of(flag)
        return [f for f in self.flags if f.dest == dest]


# -- literal evaluation -------------------------------------------------------------------------

_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow, ast.BitOr: operator.or_,
}
_NOT = object()


class _Evaluator:
    """Evaluates constant expressions: literals, known names, arithmetic, f-strings as text."""

    def __init__(self, consts: dict[str, Any], fields: dict[str, FieldDecl]) -> None:
        self.consts = consts
        self.fields = fields

    def __call__(self, node: ast.expr | None) -> Any:
        """The value of ``node``, or the sentinel ``_NOT`` when it is only known at run time."""
        if node is None:
            return _NOT
        try:
            return self._eval(node)
        except Exception:  # noqa: BLE001 - any failure means "not a static value"
            return _NOT

    def _field_default(self, name: str) -> Any:
        decl = self.fields.get(name)
        if decl is None or decl.default_source is not None:
            return _NOT
        return decl.default

    def _eval(self, node: ast.expr) -> Any:  # noqa: C901 - one case per node type
        if isinstance(node, ast.Constant):
            ok = node.value is None or isinstance(node.value, (str, int, float, bool))
            return node.value if ok else _NOT
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            vals = [self._eval(e) for e in node.elts]
            if any(v is _NOT for v in vals):
                return _NOT
            return vals
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):
                return _NOT
            keys = [self._eval(k) for k in node.keys if k is not None]
            vals = [self._eval(v) for v in node.values]
            if any(x is _NOT for x in keys + vals):
                return _NOT
            return dict(zip(keys, vals, strict=True))
        if isinstance(node, ast.Name):
            return self.consts.get(node.id, _NOT)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "ServerArgs":
            return self._field_default(node.attr)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            v = self._eval(node.operand)
            return _NOT if v is _NOT else -v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = self._eval(node.left), self._eval(node.right)
            if a is _NOT or b is _NOT:
                return _NOT
            return _BINOPS[type(node.op)](a, b)
        if isinstance(node, ast.JoinedStr):
            parts = []
            for v in node.values:
                if isinstance(v, ast.Constant):
                    parts.append(str(v.value))
                elif isinstance(v, ast.FormattedValue):
                    parts.append("{" + ast.unparse(v.value) + "}")
            return "".join(parts)
        if isinstance(node, ast.Call):
            return self._call(node)
        return _NOT

    def _call(self, node: ast.Call) -> Any:
        fn = ast.unparse(node.func)
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        last = fn.rsplit(".", 1)[-1]
        if last == "field":  # dataclasses.field / msgspec.field
            if "default" in kw:
                return self._eval(kw["default"])
            factory = ast.unparse(kw["default_factory"]) if "default_factory" in kw else ""
            return {"list": [], "dict": {}, "set": [], "tuple": []}.get(factory, _NOT)
        if fn == "_declared_default" and node.args and isinstance(node.args[0], ast.Constant):
            return self._field_default(str(node.args[0].value))
        if fn in ("list", "sorted", "tuple", "set", "frozenset") and len(node.args) == 1:
            v = self._eval(node.args[0])
            if v is _NOT:
                return _NOT
            return sorted(v) if fn == "sorted" else list(v)
        return _NOT


def _module_consts(tree: ast.Module, ev: _Evaluator) -> None:
    """Add the module-level ``NAME = <constant expr>`` assignments of ``tree`` to ``ev.consts``."""
    for st in tree.body:
        if isinstance(st, ast.Assign) and len(st.targets) == 1:
            target, value = st.targets[0], st.value
        elif isinstance(st, ast.AnnAssign) and st.value is not None:
            target, value = st.target, st.value
        else:
            continue
        if isinstance(target, ast.Name):
            v = ev(value)
            if v is not _NOT:
                ev.consts[target.id] = v


# -- annotations --------------------------------------------------------------------------------

def _split_annotated(ann: ast.expr) -> tuple[ast.expr, list[ast.expr]] | None:
    """(type, metadata) of ``A[T, ...]`` / ``Annotated[T, ...]``, else None."""
    if not isinstance(ann, ast.Subscript):
        return None
    if ast.unparse(ann.value).rsplit(".", 1)[-1] not in ("A", "Annotated"):
        return None
    sl = ann.slice
    if not isinstance(sl, ast.Tuple) or not sl.elts:
        return None
    return sl.elts[0], list(sl.elts[1:])


def _unwrap_optional(typ: ast.expr) -> ast.expr:
    """X of ``Optional[X]``, ``Union[X, None]`` and ``X | None``."""
    if isinstance(typ, ast.Subscript):
        head = ast.unparse(typ.value).rsplit(".", 1)[-1]
        if head == "Optional":
            return typ.slice
        if head == "Union" and isinstance(typ.slice, ast.Tuple):
            rest = [e for e in typ.slice.elts if ast.unparse(e) != "None"]
            if len(rest) == 1:
                return rest[0]
    if isinstance(typ, ast.BinOp) and isinstance(typ.op, ast.BitOr):
        sides = [s for s in (typ.left, typ.right) if ast.unparse(s) != "None"]
        if len(sides) == 1:
            return sides[0]
    return typ


def _literal_values(typ: ast.expr, ev: _Evaluator) -> list[Any] | None:
    if isinstance(typ, ast.Subscript) and ast.unparse(typ.value).rsplit(".", 1)[-1] == "Literal":
        elts = typ.slice.elts if isinstance(typ.slice, ast.Tuple) else [typ.slice]
        vals = [ev(e) for e in elts]
        return None if any(v is _NOT for v in vals) else vals
    return None


def _no_flag_forms(names: list[str]) -> list[str]:
    out = []
    for n in names:
        out.append(n)
        if n.startswith("--"):
            out.append("--no-" + n[2:])
    return out


def _field_flag(dest: str, typ: ast.expr, arg: dict[str, ast.expr], default: Any,
                default_src: str | None, ev: _Evaluator, namespace: str, source: str) -> FlagInfo:
    """The argparse action ``add_cli_args_from_dataclass`` builds for one field."""
    def val(key: str, fallback: Any = None) -> Any:
        v = ev(arg.get(key))
        return fallback if v is _NOT else v

    cli = val("cli_name") or "--" + dest.replace("_", "-")
    names = [cli, *(val("aliases") or [])]
    help_text = ev(arg.get("help"))
    if not isinstance(help_text, str):
        help_text = ast.unparse(arg["help"]) if "help" in arg else ""
    parser = ast.unparse(arg["type_parser"]) if "type_parser" in arg else None
    choices = val("choices")
    choices_src = ast.unparse(arg["choices"]) if "choices" in arg and choices is None else None
    inner = _unwrap_optional(typ)
    inner_src = ast.unparse(inner)
    nargs = val("nargs")
    if "action" in arg:
        action = ast.unparse(arg["action"]).rsplit(".", 1)[-1]
        if action == "BooleanOptionalAction":
            names = _no_flag_forms(names)
        extra = arg["action_kwargs"] if isinstance(arg.get("action_kwargs"), ast.Dict) else None
        extra_kw = {ev(k): v for k, v in zip(extra.keys, extra.values, strict=True)
                    if k is not None} if extra else {}
        value_type = parser or (ast.unparse(extra_kw["type"]) if "type" in extra_kw else None)
        nargs = nargs or (ev(extra_kw["nargs"]) if "nargs" in extra_kw else None)
    elif (lits := _literal_values(inner, ev)) is not None:
        action, choices = "store", choices or lits
        first = type(lits[0]).__name__ if lits else "str"
        value_type = parser or (first if first in ("str", "int", "float") else "str")
    elif re.match(r"^(List|list)\b", inner_src) and parser is None:
        action, nargs = "store", nargs or "+"
        elem = inner_src[inner_src.find("[") + 1:-1] if "[" in inner_src else "str"
        value_type = elem if elem in ("int", "float") else "str"
    elif inner_src == "bool":
        action, value_type = "store_true", None
    else:
        action = "store"
        value_type = parser or (inner_src if inner_src in ("str", "int", "float") else "str")
    fallback = val("fallback")
    return FlagInfo(dest=dest, flags=names, action=action, type=ast.unparse(typ),
                    value_type=value_type, nargs=nargs, default=default,
                    default_source=default_src, choices=choices, choices_source=choices_src,
                    help=help_text, namespace=namespace,
                    deprecated="Deprecated" in action or help_text.startswith("Deprecated"),
                    resolvable=bool(val("resolvable", False)), fallback=fallback, source=source)


def _class_fields(rel: str, mod: ast.Module, ev: _Evaluator, only_class: str | None,
                  fields: dict[str, FieldDecl], flags: list[FlagInfo]) -> None:
    """Collect the annotated fields of the classes of one module (of ``only_class`` if given)."""
    for cls in mod.body:
        if not isinstance(cls, ast.ClassDef) or only_class and cls.name != only_class:
            continue
        for st in cls.body:
            if not (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)):
                continue
            dest = st.target.id
            if dest.startswith("_") or ast.unparse(st.annotation).startswith("ClassVar"):
                continue
            default = ev(st.value) if st.value is not None else None
            default_src = None
            if default is _NOT:
                default, default_src = None, ast.unparse(st.value) if st.value else None
            split = _split_annotated(st.annotation)
            typ, meta = split if split else (st.annotation, [])
            arg: dict[str, ast.expr] | None = None
            for m in meta:
                if isinstance(m, ast.Call) and ast.unparse(m.func).rsplit(".", 1)[-1] == "Arg":
                    arg = {k.arg: k.value for k in m.keywords if k.arg}
                    break
                if isinstance(ev(m), str):
                    arg = {"help": m}
                    break
            no_cli = arg is None or ev(arg.get("no_cli")) is True
            source = f"{rel}:{st.lineno}"
            fields[dest] = FieldDecl(dest=dest, type=ast.unparse(typ), default=default,
                                     default_source=default_src, namespace=cls.name,
                                     no_cli=no_cli, source=source)
            if not no_cli and arg is not None:
                flags.append(_field_flag(dest, typ, arg, default, default_src, ev, cls.name,
                                         source))


def _manual_flags(rel: str, mod: ast.Module, ev: _Evaluator) -> list[FlagInfo]:
    """The ``*.add_argument(...)`` calls of a module, as flags."""
    out = []
    for node in ast.walk(mod):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        names = [a.value for a in node.args
                 if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if not names or not names[0].startswith("-"):
            continue
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        long = next((n for n in names if n.startswith("--")), names[0])
        dest = ev(kw.get("dest"))
        dest = dest if isinstance(dest, str) else long.lstrip("-").replace("-", "_")
        action_v = ev(kw.get("action"))
        action = action_v if isinstance(action_v, str) else (
            ast.unparse(kw["action"]).rsplit(".", 1)[-1] if "action" in kw else "store")
        if action == "BooleanOptionalAction":
            names = _no_flag_forms(names)
        default: Any = None
        default_src = None
        if "default" in kw:
            default = ev(kw["default"])
            if default is _NOT:
                default, default_src = None, ast.unparse(kw["default"])
        elif "StoreTrue" in action or action == "store_true":
            default = False
        elif "StoreFalse" in action or action == "store_false":
            default = True
        choices = ev(kw.get("choices"))
        choices_src = None
        if choices is _NOT:
            choices, choices_src = None, ast.unparse(kw["choices"]) if "choices" in kw else None
        help_text = ev(kw.get("help"))
        help_text = help_text if isinstance(help_text, str) else ""
        nargs = ev(kw.get("nargs"))
        typ = ast.unparse(kw["type"]) if "type" in kw else None
        if typ is None and action == "store":
            typ = "str"
        out.append(FlagInfo(
            dest=dest, flags=names, action=action, type=None, value_type=typ,
            nargs=None if nargs is _NOT or nargs is None else str(nargs), default=default,
            default_source=default_src, choices=choices, choices_source=choices_src,
            help=help_text, namespace="add_argument",
            deprecated="Deprecated" in action or help_text.startswith("(Deprecated")
            or help_text.startswith("Deprecated"),
            source=f"{rel}:{node.lineno}",
            new_flag=new_flag if isinstance(new_flag := ev(kw.get("new_flag")), str) else None))
    return out


def _imported_consts(tree: SourceTree, mod: ast.Module, ev: _Evaluator,
                     seen: dict[str, ast.Module | None]) -> None:
    """Add constants that ``mod`` imports from other sglang modules (one level) to ``ev``."""
    for st in mod.body:
        if not (isinstance(st, ast.ImportFrom) and st.module
                and st.module.split(".")[0] == "sglang"):
            continue
        wanted = [(a.name, a.asname or a.name) for a in st.names if
                  (a.asname or a.name) not in ev.consts]
        if not wanted:
            continue
        base = st.module.replace(".", "/")
        rel = base + ".py" if base + ".py" in tree.texts else base + "/__init__.py"
        if rel not in seen:
            seen[rel] = _parse(tree, rel)
        src = seen[rel]
        if src is None:
            continue
        theirs = _Evaluator({}, {})
        _module_consts(src, theirs)
        for name, alias in wanted:
            if name in theirs.consts:
                ev.consts[alias] = theirs.consts[name]


def _parse(tree: SourceTree, rel: str) -> ast.Module | None:
    return tree.parse(rel)


def extract_flags(tree: SourceTree) -> FlagInventory:
    """Read every server flag and ServerArgs field of ``tree`` by static parsing (~0.3 s).

    Returns:
        The inventory: flags in declaration order (fields files by name, then manual
        ``add_argument`` flags), and every declared field (CLI or not) by dest. Empty when the
        tree has neither a fields directory nor ``server_args.py``.
    """
    ev = _Evaluator({}, {})
    choices_mod = _parse(tree, CHOICES_FILE)
    if choices_mod is not None:
        _module_consts(choices_mod, ev)
    fields: dict[str, FieldDecl] = {}
    flags: list[FlagInfo] = []
    field_files = sorted(f for f in tree.texts
                         if f.startswith(FIELDS_DIR) and f.endswith(".py") and "/" not in
                         f[len(FIELDS_DIR):])
    seen: dict[str, ast.Module | None] = {}
    for rel in field_files:
        mod = _parse(tree, rel)
        if mod is not None:
            _imported_consts(tree, mod, ev, seen)
            _module_consts(mod, ev)
            _class_fields(rel, mod, ev, None, fields, flags)
    ev.fields = fields
    server_args = _parse(tree, SERVER_ARGS)
    if server_args is not None:
        _imported_consts(tree, server_args, ev, seen)
        _module_consts(server_args, ev)
        annotated: list[FlagInfo] = []  # 0.5.1x: ``A[T, Arg(...)]`` fields of ServerArgs itself
        _class_fields(SERVER_ARGS, server_args, ev, "ServerArgs", fields, annotated)
        if not field_files:
            flags.extend(annotated)
        manual = _manual_flags(SERVER_ARGS, server_args, ev)
        if not field_files:  # an older layout: the dataclass fields have no CLI metadata
            for f in manual:
                decl = fields.get(f.dest)
                if decl is not None:
                    f.type = decl.type
        flags.extend(manual)
    return FlagInventory(version=tree.version, flags=flags, fields=fields)
