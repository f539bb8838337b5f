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
from domain.provenance import Contradiction, Provenance, Status, evidence_lines, now_iso
from memory.store import LessonStore


class LessonHit(BaseModel):
    """One search result."""

    score: float = Field(description="cosine similarity, 0..1 (1 = same meaning)")
    lesson: Lesson
    trusted: bool = Field(description="active and (source-verified, or learned on a real "
                          "backend and never contradicted)")
    trust: str = Field(description="why it is trusted or not")


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
    trust: dict[str, str] = Field(
        default_factory=dict, description="id -> 'trusted: why' or 'untrusted: why' for each "
        "lesson of this page (each item's status says active, quarantined or retracted)")


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
    trusted: bool
    learned_on: str | None = Field(description="the backend it was learned on (null: unknown)")


class LessonView(BaseModel):
    """One lesson with its status, provenance and trust, as ``show_lesson`` returns it."""

    lesson: Lesson
    trusted: bool
    trust: str = Field(description="why it is trusted or not")
    prunes_real_backend: bool = Field(description="whether it may prune a study on a real "
                                      "backend (local, kubernetes) while active")


class StatusResult(BaseModel):
    """A lesson after a status change."""

    changed: bool = Field(description="false if the lesson already had this status")
    lesson: Lesson


class ServedResult(BaseModel):
    """The lessons a served config contradicted and that were quarantined now."""

    config_id: str
    quarantined: list[LessonView]


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
        {"query": text, "hits": [{"score": s, "lesson": x, "trusted": x.trust()[0],
                                  "trust": x.trust()[1]} for x, s in hits]}, context=STORED)


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
    trust = {x.id: f"{'trusted' if ok else 'untrusted'}: {why}"
             for x in items for ok, why in [x.trust()]}
    return LessonPage.model_validate(
        {"items": items, "total": len(matching), "ignored": ignored, "trust": trust,
         "next_start": end if end < len(matching) else None}, context=STORED)


def add_lesson(store: LessonStore, lesson: Lesson, run_id: str | None = None,
               backend: str | None = None) -> AddResult:
    """Store a lesson; repeating a finding merges into the stored one (idempotent).

    The id is always recomputed from scope + condition + outcome, so the same finding gets the
    same id whoever reports it. A new lesson is stored active with no history and no
    contradictions, whatever the caller sent (status changes go through :func:`set_status`
    and :func:`report_served`); a repeat keeps the stored status.

    Args:
        store: the lesson store.
        lesson: the lesson.
        run_id: run to record when the lesson names none (injected by the server, not the model).
        backend: the backend of the run the server serves (injected by the server): the
            provenance of a lesson that names none.

    Raises:
        ValueError: the condition names no family of configs (``Lesson.defect``).
        StoreUnavailable: the store cannot be written.
    """
    if (defect := lesson.defect()) is not None:
        raise ValueError(defect)
    lesson = lesson.model_copy(update={"id": ""}).with_id()
    if lesson.run_id is None and run_id is not None:
        lesson = lesson.model_copy(update={"run_id": run_id})
    if lesson.provenance is None and backend is not None:
        lesson = lesson.model_copy(update={"provenance": default_provenance(lesson, backend)})
    lesson = lesson.model_copy(update={"status": "active", "history": [], "contradictions": []})
    created = store.get(lesson.id) is None
    return AddResult(created=created, lesson=store.add(lesson))


def default_provenance(lesson: Lesson, backend: str) -> Provenance:
    """The provenance of a lesson that names none, added on ``backend``'s run.

    A lesson of the memory-fit estimate or of research is learned by that, whatever backend
    the run uses; a trial's lesson on ``backend`` (twin, local, kubernetes).
    """
    kind = lesson.source if lesson.source in ("estimate", "research", "user") else backend
    return Provenance.model_validate({
        "backend": kind, "engine": lesson.scope.engine,
        "engine_version": lesson.scope.engine_version, "run_id": lesson.run_id,
        "trial": lesson.trial_id, "evidence": evidence_lines(lesson.evidence),
        "learned_at": now_iso()})


def check_config(store: LessonStore, config: ServingConfig,
                 backend: str | None = None) -> CheckResult:
    """Which stored lessons keep a study on ``backend`` from launching ``config``.

    Active lessons only; on a real backend (local, kubernetes) a twin-learned lesson counts
    only when source-verified (``Lesson.applies_on``). None: every active lesson.

    Raises:
        StoreUnavailable: the store cannot be read.
    """
    found = [ForbiddingLesson(id=x.id, title=x.title, condition=x.condition_text(),
                              outcome=x.outcome, fix=x.fix, trusted=x.trusted,
                              learned_on=x.provenance.backend if x.provenance else None)
             for x in store.forbidding(config, backend)]
    return CheckResult(allowed=not found, config_id=config.config_id(), forbidding=found)


def _view(lesson: Lesson) -> LessonView:
    ok, why = lesson.trust()
    return LessonView.model_validate(
        {"lesson": lesson, "trusted": ok, "trust": why,
         "prunes_real_backend": lesson.applies_on("local")}, context=STORED)


def show_lesson(store: LessonStore, lesson_id: str) -> LessonView:
    """One lesson with its provenance, status history, contradictions and trust.

    Raises:
        UnknownLesson: no lesson has this id (a ``ValueError``).
        StoreUnavailable: the store cannot be read.
    """
    from memory.store import UnknownLesson

    lesson = store.get(lesson_id)
    if lesson is None:
        raise UnknownLesson(lesson_id, store.path)
    return _view(lesson)


def set_status(store: LessonStore, lesson_id: str, status: Status, reason: str,
               by: str) -> StatusResult:
    """Quarantine, retract or restore (``active``) a lesson, with the reason in its history.

    Raises:
        UnknownLesson: no lesson has this id (a ``ValueError``).
        ValueError: an empty reason.
        StoreUnavailable: the store cannot be written.
    """
    if not reason.strip():
        raise ValueError(f"give a reason to mark lesson {lesson_id} {status}: it is kept in "
                         "the lesson's history")
    before = show_lesson(store, lesson_id).lesson
    lesson = store.set_status(lesson_id, status, reason, by)
    return StatusResult.model_validate({"changed": lesson != before, "lesson": lesson},
                                       context=STORED)


def report_served(store: LessonStore, config: ServingConfig, backend: str,
                  run_id: str | None = None, trial: str | None = None,
                  evidence: str = "") -> ServedResult:
    """``config`` ran and served on ``backend``: quarantine the lessons that forbid it.

    See ``LessonStore.contradict`` (a twin measurement does not overrule a lesson learned on
    a real backend).

    Raises:
        ValueError: ``backend`` is not twin, local, kubernetes (or estimate, research, user).
        StoreUnavailable: the store cannot be read or written.
    """
    done = store.contradict(config, Contradiction.model_validate(
        {"backend": backend, "run_id": run_id, "trial": trial, "config_id": config.config_id(),
         "evidence": evidence[:2_000]}))
    return ServedResult(config_id=config.config_id(), quarantined=[_view(x) for x in done])


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
    gpu = s.gpu or (f"any SM {s.sm_major}.x GPU" if s.sm_major is not None else "any GPU")
    parts = [gpu, s.model or "any model", f"weights {s.quantization or 'any'}",
             f"{s.engine or 'any engine'} {s.engine_version or 'any version'}"]
    return ", ".join(parts)


def _provenance_lines(lesson: Lesson) -> list[str]:
    p = lesson.provenance
    lines = [f"  - learned: {_one_line(p.text()) if p else 'unknown provenance'}",
             f"  - trusted: {_one_line(lesson.trust()[1])}"]
    if p and p.evidence:
        lines.append(f"  - evidence: `{_one_line(p.evidence[-1], 300).replace('`', chr(39))}`")
    return lines


def export_skill(store: LessonStore, name: str = "servetune-lessons", gpu: str | None = None,
                 model: str | None = None, quantization: str | None = None) -> SkillFile:
    """Render the stored lessons (optionally scoped) as a Claude Code skill file.

    Forbidding lessons (oom, does-not-fit, crash, invalid-flag, unsupported) come first as
    rules ("do not launch configs where ..."), then the informative ones (improvements,
    regressions, SLO misses). Each carries its id so a chat can cite it and look it up with
    the lessons server's ``query_lessons``, and its provenance (where it was learned) and why
    it is trusted. Only trusted lessons are written (``Lesson.trust``: active and
    source-verified, or learned on a real backend and never contradicted); lessons whose
    condition names no family of configs (``Lesson.defect``, possible only in a store written
    before that check) are left out too.

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
    found = [x for x in store.list(gpu=gpu, model=model, quantization=quantization)
             if x.defect() is None]
    lessons = [x for x in found if x.trusted]
    untrusted = len(found) - len(lessons)
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
                f"  - why: {_one_line(x.root_cause)}", f"  - fix: {_one_line(x.fix)}",
                *_provenance_lines(x)]
    if notes:
        out += ["", "## Notes: what helped or hurt", ""]
    for x in notes:
        out += [f"- **{_one_line(x.title)}** (`{x.id}`, {x.outcome})",
                f"  - scope: {_scope_text(x)}", f"  - when: `{x.condition_text()}`",
                f"  - why: {_one_line(x.root_cause)}", f"  - so: {_one_line(x.fix)}",
                *_provenance_lines(x)]
    if not lessons:
        out += ["No lessons are stored yet for this scope: run `servetune run` first."
                if not untrusted else
                f"No trusted lessons for this scope ({untrusted} untrusted left out: learned "
                "on the twin without a source-verified condition, contradicted, quarantined "
                "or retracted; see `servetune lessons show ID`)."]
    elif untrusted:
        out += ["", f"({untrusted} untrusted lessons of this scope are left out; see "
                "`servetune lessons list`.)"]
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


# ------------------------------------------------------------------ diagnose_log (a pasted log)
class LogDiagnosis(BaseModel):
    """What a pasted engine log shows (:func:`domain.diagnosis.diagnose_log`)."""

    failure_class: str = Field(description="e.g. GRAPH_CAPTURE_OOM, UNSUPPORTED_BACKEND, UNKNOWN")
    phase: str = Field(description="where it failed: args, init, weights_load, kv_pool, "
                                   "cuda_graph or serving")
    evidence: str = Field(description="the log line that decided the class")
    source: str | None = Field(description="file:line of the engine check, if known")
    flags: list[str] = Field(description="the server flags the lesson's condition tests")
    retry: bool = Field(description="a retry can cure it (transient), so no lesson is learned")
    fix: str
    verified: bool = Field(description="source and flags read from the engine's source tree")
    lesson: Lesson | None = Field(description="the lesson it would write (not stored)")
    no_lesson: str | None = Field(description="why no lesson can be formed, when none is")


MAX_LOG_CHARS = 200_000  # a pasted log: the lines around the failure, not a day of serving


def diagnose_log(log: str, engine: str = "sglang", version: str | None = None,
                 gpu: str | None = None, model: str | None = None,
                 ground: bool = True) -> LogDiagnosis:
    """Diagnose a pasted engine log: class, phase, evidence, fix and the lesson (not stored).

    With ``ground``, the version's cached source tree (when fetched) grounds the evidence line
    in its raise site (:func:`mcp_servers.lessons.ground.cached_ground`).

    Raises:
        ValueError: an empty or oversized log, or an engine, version, GPU or model servetune
            does not know (the message names the supported ones).
    """
    from domain.diagnosis import diagnose_log as run
    from domain.errors import ConfigInvalid

    if len(log) > MAX_LOG_CHARS:
        raise ValueError(f"the log has {len(log)} characters; paste at most {MAX_LOG_CHARS} "
                         "(the lines around the failure)")
    from domain.engines import engine as get_engine
    from mcp_servers.lessons.ground import cached_ground

    try:
        eng = get_engine(engine, version)
        hook = cached_ground(eng.version)[0] if ground and eng.name == "sglang" else None
        r = run(log.splitlines(), engine, version, gpu, model, ground=hook)
    except ConfigInvalid as e:
        raise ValueError(str(e)) from e
    d = r.diagnosis
    return LogDiagnosis(failure_class=d.failure_class, phase=d.phase, evidence=d.evidence,
                        source=d.source, flags=d.flags, retry=d.retry, fix=d.fix,
                        verified=d.verified, lesson=r.lesson, no_lesson=r.no_lesson)
