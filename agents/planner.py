"""Planner agent.

Job: propose the next candidate, one knob changed from the current best,
after pruning what lessons forbid and what the memory-fit estimate clearly rules out (each such
estimate becomes a lesson whose evidence is the arithmetic).

The Claude brain (its prompt in ``agents/prompts/``) comes with the Claude-agents issue. Output:
:class:`PlanStep` carrying ``TrialPlan | NoViableConfig`` plus the candidates pruned on the way.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Literal

from mcp import Client
from pydantic import BaseModel

from agents.mcp_tools import call
from agents.outputs import ResearchQuestion
from domain.config import ServingConfig
from domain.errors import ConfigInvalid, DoesNotFit
from domain.fit import MEMORY_FIELDS, fit
from domain.hardware import get_gpu
from domain.knobs import apply_knob, normalize_value
from domain.lesson import Clause, Lesson, Scope
from domain.study import Study


class TrialPlan(BaseModel):
    """Launch this config next."""

    kind: Literal["plan"] = "plan"
    config: ServingConfig
    changed: str
    rationale: str
    predicted: dict[str, Any] = {}


class NoViableConfig(BaseModel):
    """Nothing left to try from the current best."""

    kind: Literal["none"] = "none"
    reason: str


class Pruned(BaseModel):
    """A candidate dropped before launch."""

    config: ServingConfig
    changed: str
    reason: str
    lesson_ids: list[str]
    new_lesson: Lesson | None = None


class PlanStep(BaseModel):
    """The planner's output for one step."""

    pruned: list[Pruned]
    decision: TrialPlan | NoViableConfig


def _fmt(v: Any) -> str:
    return "unset" if v is None else str(v)


def estimate_lesson(config: ServingConfig, err: DoesNotFit, study: Study) -> Lesson:
    """Lesson for a config the memory-fit estimate rules out, covering its whole family.

    Weights that exceed the GPU at TP ``t`` exceed it at every smaller TP, so the condition is
    ``weights == w AND tp_size <= t_max`` where ``t_max`` is the largest TP of the study's space
    that also fails; a KV-pool or graph-capture shortfall also depends on mem_fraction_static.
    """
    scope = Scope(gpu=config.gpu, model=config.model, quantization=config.weights,
                  engine=config.engine, engine_version=config.engine_version)
    evidence = [err.arithmetic]
    t_max = config.tp_size
    if err.phase == "weights_load":
        for t in sorted(int(v) for v in study.knobs.get("tp_size", [])):
            if t > t_max:
                try:
                    fit(config.model_copy(update={"tp_size": t}))
                except DoesNotFit as e2:
                    if e2.phase == "weights_load":
                        t_max = t
                        evidence.append(e2.arithmetic)
                        continue
                break
        cond = [Clause(field="weights", op="eq", value=config.weights),
                Clause(field="tp_size", op="le", value=t_max)]
        title = (f"{config.weights} weights of {config.model} do not fit TP<={t_max} "
                 f"{config.gpu}: the weight shard exceeds GPU memory (out of memory at weight "
                 "load, by the memory-fit estimate)")
        fix = (f"use more than {t_max} GPUs per replica (--tp-size) or a checkpoint with fewer "
               "bytes per parameter")
        failure_class = "OOM_WEIGHTS"
    else:
        # KV-pool and graph-capture shortfalls depend on every knob that sizes memory, so the
        # family is exactly this memory layout (never a broader one that a later run would
        # wrongly prune).
        cond = [Clause(field=f, op="eq", value=getattr(config, f)) for f in MEMORY_FIELDS]
        if err.phase == "kv_pool":
            title = (f"{config.weights} TP{config.tp_size} leaves no KV cache at "
                     f"mem_fraction_static {config.mem_fraction_static or 'default'} "
                     "(memory-fit estimate)")
            fix = "raise --mem-fraction-static, raise --tp-size or use a smaller checkpoint"
            failure_class = "KV_NO_ROOM"
        else:
            title = (f"{config.weights} TP{config.tp_size}: too little memory outside the static "
                     "pool for CUDA-graph capture and prefill activations (memory-fit estimate)")
            fix = ("lower --mem-fraction-static, --cuda-graph-max-bs-decode or "
                   "--chunked-prefill-size")
            failure_class = "GRAPH_CAPTURE_OOM"
    return Lesson(title=title, scope=scope, condition=cond, outcome="does-not-fit",
                  failure_class=failure_class,
                  root_cause=f"memory-fit estimate: {err.arithmetic}", fix=fix,
                  evidence="\n".join(evidence), source="estimate").with_id()


class Planner:
    """Deterministic planner brain: greedy one-knob-at-a-time search from the current best."""

    def __init__(self, study: Study, lessons: Client) -> None:
        self.study, self.lessons = study, lessons

    def neighbours(self, best: ServingConfig) -> Iterator[tuple[ServingConfig, str]]:
        """Configs one knob away from ``best``, in the study's knob and value order."""
        for name, values in self.study.knobs.items():
            for v in values:
                try:
                    cand = apply_knob(best, name, v, self.study.gpu_count)
                except ConfigInvalid:
                    continue  # validated at study load; unreachable for a parsed study
                if cand != best:
                    yield cand, f"{name}={_fmt(normalize_value(v))}"

    async def forbidding(self, config: ServingConfig) -> list[dict[str, Any]]:
        """Lessons (id, title) that forbid ``config``, asked through the lessons server."""
        r = await call(self.lessons, "check_config", {"config": config.model_dump(mode="json")})
        return list(r.get("forbidding", []))

    async def screen(self, cand: ServingConfig, changed: str,
                     run_id: str) -> Pruned | TrialPlan:
        """Prune ``cand`` if a lesson forbids it or the memory-fit estimate rules it out.

        Returns:
            Pruned (its new estimate lesson already stored through the lessons server), or a
            TrialPlan carrying the estimate's predictions.
        """
        forb = await self.forbidding(cand)
        if forb:
            ids = [f["id"] for f in forb]
            return Pruned(config=cand, changed=changed, lesson_ids=ids,
                          reason=f"forbidden by lesson {ids[0]}: {forb[0]['title']}")
        try:
            rep = fit(cand)
        except DoesNotFit as e:
            lesson = estimate_lesson(cand, e, self.study).model_copy(update={"run_id": run_id})
            stored = await call(self.lessons, "add_lesson",
                                {"lesson": lesson.model_dump(mode="json")})
            return Pruned(config=cand, changed=changed, lesson_ids=[stored["lesson"]["id"]],
                          new_lesson=lesson,
                          reason=f"pruned by memory-fit estimate: {e.arithmetic}")
        predicted = {"kv_tokens_per_replica": rep.kv_tokens,
                     "max_running_requests": rep.max_running_requests,
                     "mem_fraction_static": rep.mem_fraction_static,
                     "kv_pool_gb_per_gpu": round(rep.kv_pool_gb, 2)}
        return TrialPlan(config=cand, changed=changed, predicted=predicted,
                         rationale=f"{changed or 'baseline'}: the estimate fits with "
                                   f"{rep.kv_tokens:,} KV tokens per replica")

    async def step(self, best: ServingConfig, seen: set[str], run_id: str,
                   losers: dict[str, str] | None = None) -> PlanStep:
        """Next candidate from ``best``, skipping config ids in ``seen``.

        Args:
            best: the incumbent config.
            seen: config ids already launched or pruned in this run (updated in place).
            run_id: recorded on new lessons.
            losers: ``knob=value`` changes that already cost more than the study's
                ``drop_regressions`` share from an earlier incumbent, with the reason; they
                are pruned instead of launched again.

        Pruned candidates are returned (and their new lessons stored through the lessons
        server) so the caller can ledger them before anything launches.
        """
        pruned: list[Pruned] = []
        losers = losers or {}
        for cand, changed in self.neighbours(best):
            cid = cand.config_id()
            if cid in seen:
                continue
            seen.add(cid)
            if changed in losers:
                pruned.append(Pruned(config=cand, changed=changed, lesson_ids=[],
                                     reason=losers[changed]))
                continue
            verdict = await self.screen(cand, changed, run_id)
            if isinstance(verdict, Pruned):
                pruned.append(verdict)
                continue
            return PlanStep(pruned=pruned, decision=verdict)
        return PlanStep(pruned=pruned, decision=NoViableConfig(
            reason="every one-knob change of the best config was tried or pruned"))


# Knobs whose first use in a run is worth a research round before launching, and the SGLang
# flag (ServerArgs dest) each one sets: a backend choice, a speculative setting, a parallelism
# layout, a KV cache format or a HiCache size can fail at startup on some architectures.
RESEARCH_FLAGS = {"attention_backend": "attention_backend", "speculative": "speculative_algorithm",
                  "speculative_algorithm": "speculative_algorithm", "tp_size": "tp_size",
                  "kv_cache_dtype": "kv_cache_dtype", "hicache_ratio": "hicache_ratio"}
_SM_BOUND = re.compile(r"SM\s*(>=|<=|>|<|==)\s*(\d+)", re.IGNORECASE)


def research_questions(changed: str, config: ServingConfig, seen_changes: set[str],
                       tool_budget: int = 6) -> list[ResearchQuestion]:
    """The scoped questions to ask before launching a candidate that changes ``changed``.

    None when the knob is not research-worthy (:data:`RESEARCH_FLAGS`) or this ``knob=value``
    was already researched in the run (``seen_changes``). Otherwise one source question (what
    the flag changes, where it is refused) and one memory question (what lessons say about the
    family on this or similar hardware).

    Args:
        changed: 'knob=value' of the candidate relative to its parent.
        config: the candidate.
        seen_changes: 'knob=value' strings researched before in this run.
        tool_budget: tool calls allowed per question.
    """
    if not changed or "=" not in changed or changed in seen_changes:
        return []
    knob, value = changed.split("=", 1)
    flag = RESEARCH_FLAGS.get(knob)
    if flag is None:
        return []
    cli = "--" + flag.replace("_", "-")
    scope = dict(gpu=config.gpu, model=config.model, quantization=config.weights,
                 engine_version=config.engine_version)
    slug = re.sub(r"[^a-z0-9]+", "-", changed.lower()).strip("-")[:40]
    return [
        ResearchQuestion(id=f"src-{slug}", kind="source", flag=flag, value=value,
                         tool_budget=tool_budget, **scope,
                         question=f"What does `{cli} {value}` change in SGLang "
                                  f"{config.engine_version}, and on which GPU architectures is "
                                  f"it selected or refused ({config.gpu})?"),
        ResearchQuestion(id=f"mem-{slug}", kind="memory", flag=flag, value=value,
                         tool_budget=tool_budget, **scope,
                         question=f"What do past lessons say about {knob}={value} for "
                                  f"{config.model} ({config.weights}) on {config.gpu} or "
                                  "similar hardware?"),
    ]


def research_verdict(outcomes: list[dict[str, Any]], config: ServingConfig) -> str | None:
    """Why research says not to launch ``config``, or None to launch it.

    Drops the candidate when an answered source claim about the value it sets states an SM
    (compute capability) range that excludes this GPU, e.g. "FlashAttention v3 Backend requires
    SM>=80 and SM<=90" for fa3 on a B200 (SM 100). Lessons that forbid the family already
    pruned it before research (``Planner.screen``); memory findings inform the report. The
    reason quotes the claim and its evidence.

    Args:
        outcomes: ``ResearchOutcome`` dumps (mode="json").
        config: the candidate.
    """
    sm = get_gpu(config.gpu).sm_major * 10
    for o in outcomes:
        if o.get("status") != "answered":
            continue
        q = o.get("question") or {}
        value = str(q.get("value") or "")
        for c in (o.get("findings") or {}).get("claims") or []:
            text = str(c.get("text", ""))
            ev = "; ".join(str(e) for e in c.get("evidence", [])[:2])
            if q.get("kind") == "source" and (not value or value in text):
                bounds = _SM_BOUND.findall(text)
                if bounds and not all(_holds(sm, op, int(n)) for op, n in bounds):
                    return (f"{config.gpu} is SM {sm}, outside what the source requires: "
                            f"{' '.join(text.split())[:200]} [{ev}]")
    return None


def _holds(sm: int, op: str, n: int) -> bool:
    return {">=": sm >= n, "<=": sm <= n, ">": sm > n, "<": sm < n, "==": sm == n}[op]


def research_lesson(config: ServingConfig, changed: str, reason: str, run_id: str) -> Lesson:
    """The lesson a research drop writes: this knob value is refused on this GPU's architecture.

    Scope: the GPU and engine version (an architecture check holds for every model); condition:
    the knob's field equals the candidate's value. Source ``research``: it was read in the
    engine's code, not seen in a crash.

    Args:
        config: the dropped candidate.
        changed: its 'knob=value'.
        reason: :func:`research_verdict`'s reason (the claim and its file:line evidence).
        run_id: the run that asked.
    """
    knob = changed.split("=", 1)[0]
    field = knob if knob in ServingConfig.model_fields else RESEARCH_FLAGS.get(knob, knob)
    value = getattr(config, field)
    flag = "--" + field.replace("_", "-")
    return Lesson(title=f"{flag} {value} refused on {config.gpu} "
                        f"(SM {get_gpu(config.gpu).sm_major * 10}), per the SGLang source",
                  scope=Scope(gpu=config.gpu, engine_version=config.engine_version),
                  condition=[Clause(field=field, op="eq", value=value)],
                  outcome="unsupported", failure_class="UNSUPPORTED_BACKEND"
                  if field == "attention_backend" else "INVALID_COMBINATION",
                  root_cause=reason[:4000],
                  fix=f"leave {flag} unset or choose a value the {config.gpu} architecture "
                      "supports",
                  evidence=reason[:20000], source="research", run_id=run_id).with_id()
