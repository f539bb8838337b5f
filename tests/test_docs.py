"""The docs stay true to the code: study keys, links (and anchors), README length, benchmarks."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import BaseModel

from domain.study import Study

REPO = Path(__file__).resolve().parent.parent
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
