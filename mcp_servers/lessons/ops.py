"""The lesson operations behind the MCP tools: plain functions over an injected LessonStore.

Each returns a pydantic model (the tool's structured output). Bad input raises ``ValueError`` and
a broken store raises ``memory.store.StoreUnavailable``; both messages say what to do next, and
the server passes them on to the model.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from domain.config import ServingConfig
from domain.lesson import Lesson, Outcome
from memory.store import LessonStore


class LessonHit(BaseModel):
    """One search result."""

    score: float = Field(description="cosine similarity, 0..1 (1 = same meaning)")
    lesson: Lesson


class QueryResult(BaseModel):
    """Lessons ranked by similarity to the query text, best first."""

    query: str
    hits: list[LessonHit]


class LessonPage(BaseModel):
    """One page of lessons, oldest first."""

    items: list[Lesson]
    total: int = Field(description="lessons matching the filters, over all pages")
    next_start: int | None = Field(description="pass as start for the next page; null at the end")


class AddResult(BaseModel):
    """The lesson as stored."""

    created: bool = Field(description="false if the same finding (same id) was already stored "
                                      "and this call merged into it")
    lesson: Lesson


class ForbiddingLesson(BaseModel):
    """A lesson that forbids the checked config."""

    id: str
    title: str
    condition: str = Field(description="the lesson's condition, e.g. 'tp_size <= 4'")
    outcome: Outcome
    fix: str


class CheckResult(BaseModel):
    """Whether known lessons allow a config."""

    allowed: bool = Field(description="true if no stored lesson forbids the config")
    config_id: str
    forbidding: list[ForbiddingLesson] = Field(description="the lessons that forbid it, "
                                               "oldest first")


def query_lessons(store: LessonStore, text: str, k: int = 5, gpu: str | None = None,
                  model: str | None = None, quantization: str | None = None) -> QueryResult:
    """Semantic search over lessons.

    Args:
        store: the lesson store.
        text: what to look for, in words.
        k: at most this many hits (>= 1).
        gpu: only lessons that apply to this GPU (scoped to it or to any GPU).
        model: only lessons that apply to this model.
        quantization: only lessons that apply to this checkpoint (weights) key.

    Raises:
        ValueError: empty text or k < 1.
        StoreUnavailable: the store cannot be read.
    """
    if not text.strip():
        raise ValueError("text is empty: describe the failure or question in words, "
                         "e.g. 'fp8 out of memory at weight load'")
    hits = store.query(text, k=k, gpu=gpu, model=model, quantization=quantization)
    return QueryResult(query=text, hits=[LessonHit(score=s, lesson=x) for x, s in hits])


def list_lessons(store: LessonStore, gpu: str | None = None, model: str | None = None,
                 outcome: str | None = None, start: int = 0, max_items: int = 50) -> LessonPage:
    """One page of lessons, oldest first.

    Args:
        store: the lesson store.
        gpu: only lessons that apply to this GPU.
        model: only lessons that apply to this model.
        outcome: only lessons with this outcome.
        start: index of the first lesson of the page (0-based).
        max_items: page size (>= 1).

    Raises:
        ValueError: start < 0 or max_items < 1.
        StoreUnavailable: the store cannot be read.
    """
    if start < 0 or max_items < 1:
        raise ValueError(f"start must be >= 0 and max_items >= 1 (got start={start}, "
                         f"max_items={max_items})")
    matching = store.list(gpu=gpu, model=model, outcome=outcome)
    end = start + max_items
    return LessonPage(items=matching[start:end], total=len(matching),
                      next_start=end if end < len(matching) else None)


def add_lesson(store: LessonStore, lesson: Lesson, run_id: str | None = None) -> AddResult:
    """Store a lesson; repeating a finding merges into the stored one (idempotent).

    The id is always recomputed from scope + condition + outcome, so the same finding gets the
    same id whoever reports it.

    Args:
        store: the lesson store.
        lesson: the lesson.
        run_id: run to record when the lesson names none (injected by the server, not the model).

    Raises:
        StoreUnavailable: the store cannot be written.
    """
    lesson = lesson.model_copy(update={"id": ""}).with_id()
    if lesson.run_id is None and run_id is not None:
        lesson = lesson.model_copy(update={"run_id": run_id})
    created = store.get(lesson.id) is None
    return AddResult(created=created, lesson=store.add(lesson))


def check_config(store: LessonStore, config: ServingConfig) -> CheckResult:
    """Which stored lessons forbid ``config``.

    Raises:
        StoreUnavailable: the store cannot be read.
    """
    found = [ForbiddingLesson(id=x.id, title=x.title, condition=x.condition_text(),
                              outcome=x.outcome, fix=x.fix) for x in store.forbidding(config)]
    return CheckResult(allowed=not found, config_id=config.config_id(), forbidding=found)
