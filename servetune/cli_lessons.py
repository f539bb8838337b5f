"""``servetune lessons``: query, list, show, export, and quarantine/retract/restore lessons."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

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

lessons_app = typer.Typer(no_args_is_help=True, help="Query and curate the lesson memory.")

LessonId = Annotated[str, typer.Argument(help="the lesson's id, e.g. L-3f2a9c01be")]
Reason = Annotated[str, typer.Option("--reason", help="why (kept in the lesson's history)")]


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
        ok, why = lesson.trust()
        console.print(escape(f"  when: {lesson.condition_text()}  outcome: {lesson.outcome}"
                             f" ({lesson.failure_class})\n  fix: {lesson.fix}\n  status: "
                             f"{lesson.status}, {'trusted' if ok else 'untrusted'}: {why}"),
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
    for col in ("id", "outcome", "status", "trust", "title", "when"):
        table.add_column(col, overflow="fold")
    for lesson in items:  # text as plain text: a lesson's words are never Rich markup
        defect = lesson.defect()
        when = lesson.condition_text() + (f"\nignored (forbids nothing): {defect}"
                                          if defect else "")
        table.add_row(lesson.id, lesson.outcome, lesson.status,
                      "trusted" if lesson.trusted else "untrusted", escape(lesson.title),
                      escape(when))
    console.print(table)


def _versions_lines(lesson: Any) -> list[str]:
    """Whether a lesson learned on one engine version applies to each other known one."""
    from domain.engines import engine

    learned = lesson.scope.engine_version
    if learned is None:
        return []
    others = [v for v in engine(lesson.scope.engine or "sglang").versions if v != learned]
    lines = [f"  versions:    learned on {learned}"]
    for v in others:
        ok, why = lesson.carries_to(v)
        lines.append(f"    {v}: {'applies' if ok else 'does not apply'}: {why}")
    return lines


def _show(lesson: Any) -> None:
    """Print one lesson: what it says, where it was learned, its status and trust."""
    ok, why = lesson.trust()
    p = lesson.provenance
    lines = [f"{lesson.id}  {lesson.title}",
             f"  when:        {lesson.condition_text()}",
             f"  outcome:     {lesson.outcome}"
             + (f" ({lesson.failure_class})" if lesson.failure_class else ""),
             f"  status:      {lesson.status}",
             f"  trust:       {'trusted' if ok else 'untrusted'}: {why}",
             f"  verified:    {'yes' if lesson.verified else 'no'}"
             + (f" (source {lesson.source_site})" if lesson.source_site else ""),
             f"  source:      {lesson.source}",
             f"  provenance:  {p.text() if p else 'unknown (stored before provenance)'}",
             f"  prunes real-backend studies: {'yes' if lesson.applies_on('local') else 'no'}",
             *_versions_lines(lesson),
             f"  fix:         {lesson.fix}"]
    if p and p.evidence:
        lines += ["  evidence:", *(f"    {x}" for x in p.evidence)]
    if lesson.contradictions:
        lines.append("  contradicted by:")
        lines += [f"    {c.at} {c.backend} run {c.run_id or '-'} trial {c.trial or '-'}: "
                  f"{c.evidence}" for c in lesson.contradictions]
    if lesson.history:
        lines.append("  history:")
        lines += [f"    {h.at} {h.status} by {h.by}: {h.reason}" for h in lesson.history]
    console.print("\n".join(lines), highlight=False, markup=False, soft_wrap=True)


@lessons_app.command("show")
def lessons_show(lesson_id: LessonId, lessons_dir: LessonsDir = None) -> None:
    """One lesson: its provenance, status, trust, evidence and history."""
    from mcp_servers.lessons.ops import show_lesson

    settings = load_settings()
    try:
        store = open_store(settings, lessons_dir)
        try:
            view = show_lesson(store, lesson_id)
        finally:
            store.close()
    except (ServetuneError, ValueError) as e:
        fail(str(e))
    _show(view.lesson)


def _set_status(lesson_id: str, status: Any, reason: str, lessons_dir: Path | None) -> None:
    from mcp_servers.lessons.ops import set_status

    settings = load_settings()
    try:
        store = open_store(settings, lessons_dir)
        try:
            result = set_status(store, lesson_id, status, reason, by="operator (cli)")
        finally:
            store.close()
    except (ServetuneError, ValueError) as e:
        fail(str(e))
    verb = {"active": "restored", "quarantined": "quarantined", "retracted": "retracted"}
    done = verb[status] if result.changed else f"unchanged, {result.lesson.status}"
    console.print(f"{lesson_id}: {done}", highlight=False, markup=False)


@lessons_app.command("quarantine")
def lessons_quarantine(lesson_id: LessonId, reason: Reason, lessons_dir: LessonsDir = None,
                       ) -> None:
    """Set a lesson aside: it forbids nothing and is not exported (restore undoes it)."""
    _set_status(lesson_id, "quarantined", reason, lessons_dir)


@lessons_app.command("retract")
def lessons_retract(lesson_id: LessonId, reason: Reason, lessons_dir: LessonsDir = None,
                    ) -> None:
    """Retract a wrong lesson: it forbids nothing and is not exported; its evidence stays."""
    _set_status(lesson_id, "retracted", reason, lessons_dir)


@lessons_app.command("restore")
def lessons_restore(
    lesson_id: LessonId,
    reason: Annotated[str, typer.Option("--reason", help="why (kept in the lesson's history)")
                      ] = "restored by the operator",
    lessons_dir: LessonsDir = None,
) -> None:
    """Make a quarantined or retracted lesson active again."""
    _set_status(lesson_id, "active", reason, lessons_dir)


@lessons_app.command("export-skill")
def lessons_export_skill(
    out: Annotated[Path | None, typer.Option(
        "--out", help="file to write (default .claude/skills/NAME/SKILL.md)")] = None,
    name: Annotated[str, typer.Option(help="skill name")] = "servetune-lessons",
    gpu: Annotated[str | None, typer.Option(help="only lessons that apply to this GPU")] = None,
    model: Annotated[str | None, typer.Option(help="only lessons for this model")] = None,
    lessons_dir: LessonsDir = None,
) -> None:
    """Write the trusted lessons, with provenance, as a Claude Code skill file."""
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
