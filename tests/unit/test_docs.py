"""The docs stay true to the code: study keys, links (and anchors), README length, benchmarks."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import BaseModel

from domain.study import Study

# the repository root: the first folder up holding pyproject.toml (wherever the tiers put this file)
REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page (lowercase, punctuation dropped, - for space)."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (directly or in an Optional), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def study_keys(model: type[BaseModel] = Study, prefix: str = "") -> list[str]:
    """Every key of the study file, nested blocks as ``block.key``."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        sub = _model_of(field.annotation)
        if sub is not None:
            keys += study_keys(sub, f"{prefix}{name}.")
    return keys


def test_every_study_key_is_documented() -> None:
    text = (DOCS / "study-file.md").read_text(encoding="utf-8")
    missing = [k for k in study_keys() if f"`{k}`" not in text]
    assert not missing, f"docs/study-file.md does not name these study keys: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path, _, anchor = target.partition("#")
        dest = page.parent / path
        if not dest.exists() or (anchor and dest.is_file() and anchor not in anchors(dest)):
            broken.append(target)
    assert not broken, f"{page.name}: links to missing files or headings {broken}"


def test_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines (at most 150)"


def test_every_benchmark_script_is_documented() -> None:
    text = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    missing = [p.name for p in sorted((REPO / "benchmarks").glob("*.py"))
               if f"benchmarks/{p.name}" not in text]
    assert not missing, f"docs/benchmarks.md does not name {missing}"


TOP = "|".join(("domain", "memory", "mcp_servers", "agents", "graph", "sandbox", "twin_http",
                "servetune", "tests", "benchmarks", "studies", "data"))
POINTER = re.compile(rf"`((?:{TOP})/[\w./<>-]*)(?::([\w.]+))?")


def pointers() -> list[tuple[str, str, str | None]]:
    """(page, path, name) for every `path` or `path:name` a page points at in backticks."""
    out = []
    for page in PAGES:
        for path, name in POINTER.findall(page.read_text(encoding="utf-8")):
            if "<" not in path:  # a pattern such as domain/data/sglang-<version>-flags.json
                out.append((page.name, path.rstrip("."), name or None))
    return out


def test_file_and_function_pointers_exist() -> None:
    """Every `dir/file.py:func` the docs name exists (a class, def or constant of that name)."""
    bad = []
    for page, path, name in pointers():
        target = REPO / path
        if not target.exists():
            bad.append(f"{page}: {path}")
        elif name and target.is_file():
            text = target.read_text(encoding="utf-8")
            for part in name.split("."):
                if not re.search(rf"^\s*(?:async def|def|class) {part}\b|^\s*{part}\b\s*[:=]",
                                 text, flags=re.M):
                    bad.append(f"{page}: {path}:{name}")
                    break
    assert not bad, "the docs point at missing files or names:\n" + "\n".join(bad)


def test_the_architecture_page_shows_the_graphs_own_drawing() -> None:
    """docs/architecture.md's Mermaid block is docs/architecture-graph.mmd (the graph's drawing)."""
    drawing = DOCS / "architecture-graph.mmd"
    if not drawing.is_file():
        pytest.skip("no docs/architecture-graph.mmd in this tree")
    page = (DOCS / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"```mermaid\n(.*?)```", page, flags=re.S)
    assert block is not None, "docs/architecture.md has no Mermaid block"
    assert block.group(1).strip() == drawing.read_text(encoding="utf-8").strip(), (
        "docs/architecture.md's Mermaid block differs from docs/architecture-graph.mmd: copy it")


def test_every_knob_is_documented() -> None:
    from domain.knobs import KNOBS

    text = (DOCS / "study-file.md").read_text(encoding="utf-8")
    missing = [k for k in KNOBS if f"| `{k}` |" not in text]
    assert not missing, f"docs/study-file.md's knob table has no row for {missing}"
