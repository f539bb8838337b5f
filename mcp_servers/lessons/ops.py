"""The lesson operations behind the MCP tools: plain functions over an injected LessonStore.

Each returns a pydantic model (the tool's structured output). Bad input raises ``ValueError`` and
a broken store raises ``memory.store.StoreUnavailable``; both messages say what to do next, and
the server passes them on to the model.
"""

from __future__ import annotations

import json
import re

from pydantic import BaseModel, Field

from domain.config import ServingConfig
from domain.lesson import FORBIDDING, STORED, Lesson, Outcome
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
    ignored: dict[str, str] = Field(
        default_factory=dict, description="id -> why: lessons of this page whose condition "
        "names no family of configs (true for every config, or a value outside its field's "
        "domain); they forbid nothing and are left out of export_skill")


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
    # STORED: a stored lesson whose condition names no family is shown, not refused
    return QueryResult.model_validate(
        {"query": text, "hits": [{"score": s, "lesson": x} for x, s in hits]}, context=STORED)


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
    items = matching[start:end]
    ignored = {x.id: defect for x in items if (defect := x.defect()) is not None}
    return LessonPage.model_validate(
        {"items": items, "total": len(matching), "ignored": ignored,
         "next_start": end if end < len(matching) else None}, context=STORED)


def add_lesson(store: LessonStore, lesson: Lesson, run_id: str | None = None) -> AddResult:
    """Store a lesson; repeating a finding merges into the stored one (idempotent).

    The id is always recomputed from scope + condition + outcome, so the same finding gets the
    same id whoever reports it.

    Args:
        store: the lesson store.
        lesson: the lesson.
        run_id: run to record when the lesson names none (injected by the server, not the model).

    Raises:
        ValueError: the condition names no family of configs (``Lesson.defect``).
        StoreUnavailable: the store cannot be written.
    """
    if (defect := lesson.defect()) is not None:
        raise ValueError(defect)
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


SKILL_NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,63}$"
# Claude Code skill frontmatter limits (docs.claude.com, "Agent Skills"): name <= 64 lowercase
# letters, digits and hyphens; description <= 1024 characters.
SKILL_DESCRIPTION_MAX = 1024


class SkillFile(BaseModel):
    """A Claude Code skill (``SKILL.md``) that carries the lessons into any chat session."""

    name: str = Field(description="skill name (frontmatter `name`)")
    path: str = Field(description="where Claude Code looks for it, relative to the project: "
                                  ".claude/skills/<name>/SKILL.md")
    lesson_count: int
    content: str = Field(description="the SKILL.md text (YAML frontmatter + markdown)")


def _one_line(text: str, limit: int = 600) -> str:
    """``text`` on one line (a newline in a lesson must not start new markdown), cut at limit."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


def _scope_text(lesson: Lesson) -> str:
    s = lesson.scope
    parts = [s.gpu or "any GPU", s.model or "any model", f"weights {s.quantization or 'any'}",
             f"{s.engine or 'any engine'} {s.engine_version or 'any version'}"]
    return ", ".join(parts)


def export_skill(store: LessonStore, name: str = "servetune-lessons", gpu: str | None = None,
                 model: str | None = None, quantization: str | None = None) -> SkillFile:
    """Render the stored lessons (optionally scoped) as a Claude Code skill file.

    Forbidding lessons (oom, does-not-fit, crash, invalid-flag, unsupported) come first as
    rules ("do not launch configs where ..."), then the informative ones (improvements,
    regressions, SLO misses). Each carries its id so a chat can cite it and look it up with
    the lessons server's ``query_lessons``. Lessons whose condition names no family of configs
    (``Lesson.defect``, possible only in a store written before that check) are left out.

    Args:
        store: the lesson store.
        name: skill name (lowercase letters, digits, '-'; at most 64 characters).
        gpu: only lessons that apply to this GPU (scoped to it or to any GPU).
        model: only lessons that apply to this model.
        quantization: only lessons that apply to this checkpoint key.

    Raises:
        ValueError: a name Claude Code would refuse.
        StoreUnavailable: the store cannot be read.
    """
    if not re.match(SKILL_NAME_PATTERN, name):
        raise ValueError(f"skill name {name!r}: use lowercase letters, digits and '-', starting "
                         "with a letter or digit, at most 64 characters")
    lessons = [x for x in store.list(gpu=gpu, model=model, quantization=quantization)
               if x.defect() is None]
    rules = [x for x in lessons if x.outcome in FORBIDDING]
    notes = [x for x in lessons if x.outcome not in FORBIDDING]
    scope = ", ".join(f"{k} {v}" for k, v in (("GPU", gpu), ("model", model),
                                                ("weights", quantization)) if v) or "all scopes"
    description = (f"Known SGLang serving failures and findings from servetune trials ({scope}; "
                   f"{len(rules)} rules, {len(notes)} notes). Use before proposing, launching "
                   "or debugging an SGLang serving config (tp size, quantization, KV cache "
                   "dtype, mem fraction, attention backend, speculative decoding, HiCache): "
                   "configs matching a rule's condition fail to start.")[:SKILL_DESCRIPTION_MAX]
    out = ["---", f"name: {name}", f"description: {json.dumps(description)}", "---", "",
           f"# SGLang serving lessons ({scope})", "",
           "Lessons servetune learned by launching and benchmarking SGLang configs (or by its "
           "memory-fit arithmetic). A condition is a conjunction over `ServingConfig` fields "
           "(`tp_size`, `weights`, `kv_cache_dtype`, `mem_fraction_static`, "
           "`attention_backend`, ...) inside the lesson's scope (GPU, model, weights, engine "
           "version). Before proposing a config, check it against the rules; with the servetune "
           "MCP servers connected, `check_config` on the lessons server does this exactly, and "
           "`query_lessons` finds more by meaning.", ""]
    if rules:
        out += ["## Rules: configs that fail", ""]
    for x in rules:
        out += [f"- **{_one_line(x.title)}** (`{x.id}`, {x.outcome}"
                f"{', ' + x.failure_class if x.failure_class else ''})",
                f"  - scope: {_scope_text(x)}", f"  - fails when: `{x.condition_text()}`",
                f"  - why: {_one_line(x.root_cause)}", f"  - fix: {_one_line(x.fix)}"]
    if notes:
        out += ["", "## Notes: what helped or hurt", ""]
    for x in notes:
        out += [f"- **{_one_line(x.title)}** (`{x.id}`, {x.outcome})",
                f"  - scope: {_scope_text(x)}", f"  - when: `{x.condition_text()}`",
                f"  - why: {_one_line(x.root_cause)}", f"  - so: {_one_line(x.fix)}"]
    if not lessons:
        out += ["No lessons are stored yet for this scope: run `servetune run` first."]
    return SkillFile(name=name, path=f".claude/skills/{name}/SKILL.md",
                     lesson_count=len(lessons), content="\n".join(out) + "\n")


# ---- check_command (issue 18, item 7): pre-flight of a raw launch command -------------------
class CommandCheck(BaseModel):
    """``servetune check`` of one launch command, plus the stored lessons that forbid it."""

    verdict: str = Field(description="ok | warn | refuse")
    findings: list[dict[str, str]] = Field(description="each: severity, code, message, fix")
    memory: dict[str, float | int | None] | None = Field(
        description="per GPU: weights_bytes_per_gpu, kv_bytes_per_token, kv_pool_tokens, "
                    "min_mem_fraction_static, graph_capture_bytes; null when not parsed")
    resolved: dict[str, str | int | float] = Field(
        description="settings the engine would resolve (attention backend, max running "
                    "requests, chunked prefill size, CUDA-graph max batch, ...)")
    forbidding: list[ForbiddingLesson] = Field(
        default_factory=list, description="stored lessons whose condition covers the command's "
                                          "config (each also a KNOWN_FAILURE warn finding)")


def check_command(store: LessonStore, command: list[str], gpu: str, gpus: int | None = None,
                  version: str | None = None) -> CommandCheck:
    """Pre-flight ``command`` (``sglang serve ...``) on ``gpu`` and look it up in the store.

    The check is :func:`domain.preflight.check_command`'s; every stored lesson forbidding the
    parsed config adds a ``KNOWN_FAILURE`` warn finding.

    Raises:
        ValueError: not a launch command, an unknown GPU or engine version.
        StoreUnavailable: the store cannot be read.
    """
    from domain.errors import ConfigInvalid
    from domain.preflight import Finding, verdict_of
    from domain.preflight import check_command as preflight

    try:
        report = preflight(command, gpu, gpus, version=version)
    except ConfigInvalid as e:
        raise ValueError(str(e)) from e
    findings = list(report.findings)
    forbidding: list[ForbiddingLesson] = []
    if report.config is not None:
        forbidding = check_config(store, report.config).forbidding
        findings += [Finding(severity="warn", code="KNOWN_FAILURE",
                             message=f"lesson {x.id} ({x.outcome}): {x.title}; when "
                                     f"{x.condition}", fix=x.fix) for x in forbidding]
    out = report.to_json()
    return CommandCheck(verdict=verdict_of(findings), findings=[f.model_dump() for f in findings],
                        memory=out["memory"], resolved=out["resolved"], forbidding=forbidding)
