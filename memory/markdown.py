"""Markdown rendering of lessons (``LessonStore.export_markdown``): one section per lesson."""

from __future__ import annotations

from collections.abc import Iterable

from domain.lesson import Lesson


def _fence(text: str) -> str:
    ticks = 3
    while "`" * ticks in text:
        ticks += 1
    return f"{'`' * ticks}text\n{text.rstrip()}\n{'`' * ticks}"


def lessons_markdown(lessons: Iterable[Lesson]) -> str:
    """Render lessons as Markdown: one ``##`` section per lesson.

    Each section gives the id, scope, condition, outcome, root cause, fix, source, provenance,
    status and trust, and the
    evidence in a fenced block.
    """
    parts = ["# Lessons learned", ""]
    for lesson in lessons:
        s = lesson.scope
        scope = ", ".join([f"GPU {s.gpu or 'any'}", f"model {s.model or 'any'}",
                           f"weights {s.quantization or 'any'}",
                           f"engine {s.engine or 'any'} {s.engine_version or '(any version)'}"])
        outcome = lesson.outcome + (f" ({lesson.failure_class})" if lesson.failure_class else "")
        trust = lesson.trust()
        origin = lesson.source + "".join(f", {k} {v}" for k, v in
                                         (("run", lesson.run_id), ("trial", lesson.trial_id)) if v)
        parts += [
            f"## {lesson.title}",
            "",
            f"- **Id:** `{lesson.id or '(unsaved)'}`",
            f"- **Scope:** {scope}",
            f"- **When:** `{lesson.condition_text()}`"
            + (f" (ignored: {defect})" if (defect := lesson.defect()) else ""),
            f"- **Outcome:** {outcome}",
            f"- **Root cause:** {lesson.root_cause}",
            f"- **Fix:** {lesson.fix}",
            f"- **Source:** {origin}",
            f"- **Provenance:** {lesson.provenance.text() if lesson.provenance else 'unknown'}",
            f"- **Status:** {lesson.status}; {'trusted' if trust[0] else 'untrusted'}: "
            f"{trust[1]}",
            "",
            "Evidence:",
            "",
            _fence(lesson.evidence),
            "",
        ]
    if len(parts) == 2:
        parts += ["(no lessons)", ""]
    return "\n".join(parts)
