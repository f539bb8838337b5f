"""Planner agent.

Job: propose the next candidate, one knob changed from the current best,
after pruning what lessons forbid and what the memory-fit estimate clearly rules out (each such
estimate becomes a lesson whose evidence is the arithmetic).

The Claude brain (its prompt in ``agents/prompts/``) comes with the Claude-agents issue. Output:
:class:`PlanStep` carrying ``TrialPlan | NoViableConfig`` plus the candidates pruned on the way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from mcp import Client
from pydantic import BaseModel

from agents.mcp_tools import call
from domain.config import ServingConfig
from domain.errors import ConfigInvalid, DoesNotFit
from domain.fit import MEMORY_FIELDS, fit
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
