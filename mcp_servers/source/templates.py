"""Error-message templates of raise and assert sites, as regexes that match a log message.

A message expression becomes literal pieces and wildcards: string literals as they are, the
formatted parts of f-strings, ``"...".format(...)`` and ``"..." % (...)`` templates as
wildcards, implicit and ``+`` concatenation joined, and a message held in a local variable
followed one assignment (:func:`parts`). :func:`pattern` turns the pieces into a regex whose
whitespace runs match any whitespace.
"""

from __future__ import annotations

import ast
import re

import regex

_EXC_RE = re.compile(r"^(?:.*?[\s:(\[])?((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|"
                     r"Exit|Interrupt|Warning))\s*:\s*(.+)$", re.S)
_FORMAT_FIELD = re.compile(r"\{\{|\}\}|\{[^{}]*\}")
_PERCENT_FIELD = re.compile(r"%%|%(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?"
                            r"[diouxXeEfFgGcrsa]")


def split_exception(message: str) -> tuple[str | None, str]:
    """(exception type, message) of a log line such as ``ValueError: The 'fa3' backend ...``."""
    m = _EXC_RE.match(message.strip())
    if m and " " not in m.group(1):
        return m.group(1).rsplit(".", 1)[-1], m.group(2).strip()
    return None, message.strip()


def _locals_of(fn: ast.AST | None, name: str) -> list[ast.expr]:
    if fn is None:
        return []
    return [n.value for n in ast.walk(fn) if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)]


def parts(node: ast.expr | None, fn: ast.AST | None, depth: int = 0) -> list[str | None]:
    """The message ``node`` as literal pieces and wildcards (None).

    ``fn`` is the enclosing function, searched for the one assignment of a message variable.
    """
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
        return parts(node.left, fn, depth) + parts(node.right, fn, depth)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) \
            and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str):
        return _fields(node.left.value, _PERCENT_FIELD, {"%%": "%"})
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "format":
        inner = parts(node.func.value, fn, depth)
        out = []
        for p in inner:
            out += _fields(p, _FORMAT_FIELD, {"{{": "{", "}}": "}"}) if p else [None]
        return out
    if isinstance(node, ast.Name) and depth < 1:
        found = _locals_of(fn, node.id)
        if len(found) == 1:
            return parts(found[0], fn, depth + 1)
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


def pattern(pieces: list[str | None]) -> str:
    """The regex of a template.

    Literal pieces are escaped (a whitespace run matches any whitespace, a backtick may be
    left out: quotes of the message without its Markdown code marks still match); each run of
    wildcards is one lazy group.
    """
    out: list[str] = []
    for p in pieces:
        if p is None:
            if not out or out[-1] != "(.*?)":
                out.append("(.*?)")
        elif p:
            out.append(r"\s+".join(regex.escape(w).replace("`", "`?")
                                    for w in re.split(r"\s+", p)))
    return "".join(out)


def template_text(parts: list[str | None]) -> str:
    """The template with ``{}`` for each formatted part."""
    return "".join("{}" if p is None else p for p in parts)


def prefix_literal(pieces: list[str | None], text: str) -> int | None:
    """Literal characters of the template matched when ``text`` is the start of a message.

    None when ``text`` is not the start of any message of the template. Whitespace runs
    count as one space, backticks are left out; a wildcard takes the text up to the next
    literal piece's first occurrence, or up to where the rest of the fragment starts that
    piece.
    """
    def norm(x: str) -> str:
        return re.sub(r"\s+", " ", x.replace("`", ""))

    rest, matched = norm(text), 0
    items = [norm(p) if p is not None else None for p in pieces]
    for i, piece in enumerate(items):
        if not rest:
            break
        if piece is None:
            nxt = next((q for q in items[i + 1:] if q), None)
            at = rest.find(nxt) if nxt else -1
            if at < 0:  # the fragment ends in the wildcard or inside the next piece
                cut = next((j for j in range(len(rest)) if nxt and nxt.startswith(rest[j:])),
                           len(rest))
                return matched + len(rest) - cut
            rest = rest[at:]
        elif rest.startswith(piece):
            matched += len(piece)
            rest = rest[len(piece):]
        elif piece.startswith(rest):
            return matched + len(rest)
        else:
            return None
    return matched if not rest else None
