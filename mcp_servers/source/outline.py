"""The outline of a Python module of the tree: classes, functions and methods with lines."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Literal

from pydantic import BaseModel, Field

from mcp_servers.source.scan import short
from mcp_servers.source.tree import SourceError, SourceTree, split_lines


class OutlineItem(BaseModel):
    """A class or function of a module."""

    kind: Literal["class", "function", "method"]
    name: str = Field(description="qualified name, e.g. 'Scheduler.get_next_batch_to_run'")
    line: int
    end_line: int
    signature: str = Field(description="'(bases)' for classes, '(args) -> ret' for functions")
    decorators: list[str] = Field(default_factory=list)
    doc: str = Field(description="first line of the docstring")
    is_async: bool = False


class Outline(BaseModel):
    """Classes, functions and methods of a Python module, in source order."""

    path: str
    doc: str = Field(description="first line of the module docstring")
    total_lines: int
    total: int
    items: list[OutlineItem]
    next_start: int | None


def _first_line(node: ast.AST) -> str:
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node)
        if doc:
            return short(doc.strip().splitlines()[0], 200)
    return ""


def _outline_items(body: list[ast.stmt], scope: str, in_class: bool) -> Iterator[OutlineItem]:
    for st in body:
        decorators = [short(ast.unparse(d), 120) for d in getattr(st, "decorator_list", [])]
        if isinstance(st, ast.ClassDef):
            bases = ", ".join(ast.unparse(b) for b in [*st.bases, *st.keywords])
            yield OutlineItem(kind="class", name=scope + st.name, line=st.lineno,
                              end_line=st.end_lineno or st.lineno, signature=f"({bases})",
                              decorators=decorators, doc=_first_line(st))
            yield from _outline_items(st.body, f"{scope}{st.name}.", True)
        elif isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
            sig = f"({ast.unparse(st.args)})"
            if st.returns is not None:
                sig += f" -> {ast.unparse(st.returns)}"
            yield OutlineItem(kind="method" if in_class else "function", name=scope + st.name,
                              line=st.lineno, end_line=st.end_lineno or st.lineno,
                              signature=short(sig, 400), decorators=decorators,
                              doc=_first_line(st),
                              is_async=isinstance(st, ast.AsyncFunctionDef))


def outline(tree: SourceTree, path: str, start: int = 0, max_items: int = 300) -> Outline:
    """The classes, functions and methods of Python module ``path`` with line numbers.

    Args:
        tree: the source tree.
        path: a .py file relative to the tree root.
        start: first item of the page.
        max_items: page size.

    Raises:
        SourceError: refused path, not a .py file, or a file that does not parse.
    """
    rel = tree.relpath(path)
    if not rel.endswith(".py"):
        raise SourceError(f"{rel!r} is not a Python module; outline reads .py files (use "
                          "read_file for others)")
    mod = tree.parse(rel)
    if mod is None:
        raise SourceError(f"{rel!r} does not parse as Python 3.11 (or is too large to index); "
                          "use read_file or grep on it")
    items = list(_outline_items(mod.body, "", False))
    page = items[start:start + max(1, max_items)]
    nxt = start + len(page) if start + len(page) < len(items) else None
    return Outline(path=rel, doc=_first_line(mod), total_lines=len(split_lines(tree.texts[rel])),
                   total=len(items), items=page, next_start=nxt)
