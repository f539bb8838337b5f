"""``servetune lessons``: query, list and export the lesson memory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from domain.errors import ServetuneError
from servetune.cli_common import (
    LessonsDir,
    console,
    fail,
    load_settings,
    open_store,
)

lessons_app = typer.Typer(no_args_is_help=True, help="Query the lesson memory.")


@lessons_app.command("query")
def lessons_query(
    text: Annotated[str, typer.Argument(help="what you want to know, in words")],
    k: Annotated[int, typer.Option("-k", min=1, max=50, help="how many lessons")] = 5,
    gpu: Annotated[str | None, typer.Option(help="only lessons that apply to this GPU")] = None,
    lessons_dir: LessonsDir = None,
) -> None:
    """Lessons most similar to TEXT, best first."""
    if not text.strip():
        fail("lessons query: give some words to search for, e.g. \"fp8 out of memory\"")
    settings = load_settings()
    try:
        store = open_store(settings, lessons_dir)
        total = store.count()
        hits = store.query(text, k=k, **({"gpu": gpu} if gpu else {}))
        store.close()
    except ServetuneError as e:
        fail(str(e))
    if not hits:
        console.print("no lessons yet (run a study first)" if total == 0 else
                      f"no lesson applies to GPU {gpu!r} ({total} lessons in the store)")
        return
    for lesson, score in hits:  # a lesson's words are plain text, never Rich markup
        console.print(f"[bold]{escape(lesson.id)}[/] ({score:.2f}) {escape(lesson.title)}",
                      highlight=False)
        console.print(escape(f"  when: {lesson.condition_text()}  outcome: {lesson.outcome}"
                             f" ({lesson.failure_class})\n  fix: {lesson.fix}"),
                      highlight=False)


@lessons_app.command("list")
def lessons_list(
    gpu: Annotated[str | None, typer.Option(help="only lessons that apply to this GPU")] = None,
    lessons_dir: LessonsDir = None,
) -> None:
    """Every lesson in the store, oldest first."""
    settings = load_settings()
    try:
        store = open_store(settings, lessons_dir)
        items = store.list(**({"gpu": gpu} if gpu else {}))
        store.close()
    except ServetuneError as e:
        fail(str(e))
    table = Table(title=f"{len(items)} lessons")
    for col in ("id", "outcome", "title", "when"):
        table.add_column(col, overflow="fold")
    for lesson in items:  # text as plain text: a lesson's words are never Rich markup
        defect = lesson.defect()
        when = lesson.condition_text() + (f"\nignored (forbids nothing): {defect}"
                                          if defect else "")
        table.add_row(lesson.id, lesson.outcome, escape(lesson.title), escape(when))
    console.print(table)


@lessons_app.command("export-skill")
def lessons_export_skill(
    out: Annotated[Path | None, typer.Option(
        "--out", help="file to write (default .claude/skills/NAME/SKILL.md)")] = None,
    name: Annotated[str, typer.Option(help="skill name")] = "servetune-lessons",
    gpu: Annotated[str | None, typer.Option(help="only lessons that apply to this GPU")] = None,
    model: Annotated[str | None, typer.Option(help="only lessons for this model")] = None,
    lessons_dir: LessonsDir = None,
) -> None:
    """Write the lessons as a Claude Code skill file, so chat sessions know them."""
    from mcp_servers.lessons.ops import export_skill

    settings = load_settings()
    try:
        store = open_store(settings, lessons_dir)
        try:
            skill = export_skill(store, name=name, gpu=gpu, model=model)
        finally:
            store.close()
    except (ServetuneError, ValueError) as e:
        fail(str(e))
    path = out or Path(skill.path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(skill.content, encoding="utf-8")
        tmp.replace(path)
    except OSError as e:
        fail(f"cannot write {path}: {e.strerror or e}")
    console.print(f"wrote {skill.lesson_count} lessons to {path}", highlight=False,
                  markup=False)
