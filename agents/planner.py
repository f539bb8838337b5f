"""Planner agent.

Job: propose the next candidate, one knob changed from the current best,
after pruning what lessons forbid and what the memory-fit estimate clearly rules out (each such
estimate becomes a lesson whose evidence is the arithmetic). Neighbours are tried in the order of
the estimate's predicted benefit (``Planner.ordered``), and one the engine would run exactly like
the incumbent or an earlier launch is never launched (``resolved_settings``).

Two brains. :class:`Planner` (deterministic) launches the first viable neighbour in that
order. :class:`ClaudePlanner` screens every neighbour the same way (lessons, memory fit) and
lets Claude (prompt ``agents/prompts/planner.md``) pick among the viable ones. Output:
:class:`PlanStep` carrying ``TrialPlan | NoViableConfig | PlannerFailed`` plus the candidates
pruned on the way. After a research round, ``decide`` keeps, modifies or drops the candidate
(:class:`Decision`).
"""

from __future__ import annotations

import math
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Literal

from mcp import Client
from pydantic import BaseModel

from agents.claude import (
    AgentFailure,
    AgentUsage,
    ClaudeAgent,
    ClaudeSetup,
    context_block,
    failure_reason,
)
from agents.mcp_tools import call
from agents.outputs import PlanChoice, ResearchDecision, ResearchQuestion
from domain.config import ServingConfig
from domain.errors import ConfigInvalid, DoesNotFit, InvalidCombination
from domain.fit import MEMORY_FIELDS, fit
from domain.hardware import get_gpu
from domain.knob_domain import field_domain
from domain.knobs import apply_knob, normalize_value
from domain.lesson import Clause, Lesson, Scope
from domain.speculative import resolve_speculative
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


class PlannerFailed(BaseModel):
    """The planner's agent gave no valid answer (invalid twice, or its budget ran out)."""

    kind: Literal["failed"] = "failed"
    reason: str


class PlanStep(BaseModel):
    """The planner's output for one step."""

    pruned: list[Pruned]
    decision: TrialPlan | NoViableConfig | PlannerFailed


class Decision(BaseModel):
    """What the planner does with a candidate after research.

    ``plan`` is the candidate launched instead (modify only); ``lesson`` is written when the
    evidence shows the engine refuses the value on this GPU (drop or modify).
    """

    decision: Literal["keep", "modify", "drop"]
    reason: str
    evidence: list[str] = []
    plan: TrialPlan | None = None
    lesson: Lesson | None = None


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
        cond = [Clause(field="weights", op="eq", value=config.weights)]
        if t_max < (field_domain("tp_size").hi or math.inf):  # "<= the largest TP" is no
            cond.append(Clause(field="tp_size", op="le", value=t_max))  # family (D2)
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


# ServingConfig fields whose effect the engine resolves (a default, ``auto`` or a value clamped
# by the KV pool); :func:`resolved_settings` compares their resolved values, not the flags.
RESOLVED_FIELDS = ("attention_backend", "kv_cache_dtype", "mem_fraction_static",
                   "max_running_requests", "chunked_prefill_size", "cuda_graph_max_bs_decode",
                   "hicache_ratio", "schedule_conservativeness", "speculative_algorithm",
                   "speculative_num_steps", "speculative_eagle_topk",
                   "speculative_num_draft_tokens", "speculative_adaptive")


def resolved_settings(config: ServingConfig) -> tuple[Any, ...] | None:
    """What the engine actually runs ``config`` with, as a hashable signature; None if unknown.

    Two configs with equal signatures differ only in flags the engine resolves to the same
    value, e.g. ``--attention-backend fa3`` on a Hopper GPU where ``auto`` already picks fa3,
    ``--max-running-requests`` or ``--chunked-prefill-size`` equal to the defaults the engine
    derives, or ``--kv-cache-dtype`` equal to what ``auto`` resolves to. The resolved values are
    the memory-fit estimate's (:func:`domain.fit.fit`: backend and page size, KV dtype, static
    fraction, pool tokens, request slots, prefill chunk, decode graph batch, speculative
    parameters, HiCache host pool); every other field is compared as given. None (never equal to
    anything) when the estimate rules the config out or the engine would refuse its speculative
    flags: such a config fails at startup however it is spelled, and the failure is the lesson.
    """
    try:
        rep = fit(config)
        spec = resolve_speculative(config)
    except (DoesNotFit, InvalidCombination, ConfigInvalid):
        return None
    raw = config.model_dump(mode="json", exclude=set(RESOLVED_FIELDS))
    return (tuple(sorted(raw.items())),
            rep.attention_backend, rep.page_size, rep.kv_dtype, rep.mem_fraction_static,
            rep.kv_tokens, rep.max_running_requests, rep.chunked_prefill_size,
            config.chunked_prefill_size == -1,  # no chunking is a mode, not a chunk size
            rep.cuda_graph_max_bs_decode, rep.host_kv_tokens, round(rep.hicache_ratio, 6),
            1.0 if config.schedule_conservativeness is None
            else config.schedule_conservativeness, repr(spec))


class Planner:
    """Deterministic planner brain: greedy one-knob-at-a-time search from the current best.

    A neighbour the engine would run exactly like the incumbent or like a config this planner
    already launched (:func:`resolved_settings`) is skipped without a launch: its measurement
    would only repeat one already made.
    """

    def __init__(self, study: Study, lessons: Client) -> None:
        self.study, self.lessons = study, lessons
        # resolved_settings signature -> config id, for incumbents and launched candidates
        self.resolved: dict[tuple[Any, ...], str] = {}
        # estimate lessons of this step's pruned candidates: the caller stores them once their
        # rows are committed (ledger row first, then its lessons); until then they forbid here
        self.unstored: list[Lesson] = []

    def remember(self, config: ServingConfig) -> None:
        """Record ``config``'s resolved settings (launched or incumbent) for :meth:`screened`."""
        sig = resolved_settings(config)
        if sig is not None:
            self.resolved.setdefault(sig, config.config_id())

    def capacity(self, config: ServingConfig) -> float:
        """Sequences the pool can hold at once in the saturation run, by the memory-fit estimate.

        ``replicas x min(request slots, KV tokens / (ISL + OSL))``, capped by the run's
        concurrency (more room than clients buys nothing); 0 when the estimate rules it out.
        """
        try:
            rep = fit(config)
        except (DoesNotFit, ConfigInvalid):
            return 0.0
        sat = self.study.saturation
        per_replica = min(rep.max_running_requests, rep.kv_tokens / (sat.isl + sat.osl))
        return min(config.replicas * per_replica, float(sat.concurrency))

    def ordered(self, best: ServingConfig) -> list[tuple[ServingConfig, str]]:
        """:meth:`neighbours` by the memory-fit estimate's predicted benefit, best first.

        The benefit is the change in :meth:`capacity` over ``best`` (a larger KV pool or more
        replicas admit a larger batch, which is what a saturation run's throughput per GPU
        mostly follows), bucketed to 5 % so that estimate noise does not reorder; candidates
        in the same bucket, e.g. every change the estimate cannot see (a backend, a router
        policy), keep the study's knob order. A candidate the estimate rules out sorts last
        (screening prunes it without a launch anyway).
        """
        base = self.capacity(best) or 1.0
        cands = list(self.neighbours(best))

        def gain(c: tuple[ServingConfig, str]) -> int:
            return round(self.capacity(c[0]) / base / 0.05)

        return sorted(cands, key=lambda c: -gain(c))  # stable: ties keep the study's order

    def equivalent(self, config: ServingConfig) -> str | None:
        """Config id of a remembered config the engine would run exactly like ``config``."""
        sig = resolved_settings(config)
        return None if sig is None else self.resolved.get(sig)

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
        """Lessons (id, title) that forbid ``config``.

        The stored ones (asked through the lessons server, oldest first), then this step's
        :attr:`unstored` ones.
        """
        r = await call(self.lessons, "check_config", {"config": config.model_dump(mode="json")})
        found = list(r.get("forbidding", []))
        ids = {f["id"] for f in found}
        return found + [{"id": x.id, "title": x.title} for x in self.unstored
                        if x.id not in ids and x.forbids(config)]

    async def screen(self, cand: ServingConfig, changed: str,
                     run_id: str) -> Pruned | TrialPlan:
        """Prune ``cand`` if a lesson forbids it or the memory-fit estimate rules it out.

        Returns:
            Pruned (its new estimate lesson, with its id, in ``new_lesson`` and
            :attr:`unstored`: the caller stores it after committing the pruned row), or a
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
            self.unstored.append(lesson)
            return Pruned(config=cand, changed=changed, lesson_ids=[lesson.id],
                          new_lesson=lesson,
                          reason=f"pruned by memory-fit estimate: {e.arithmetic}")
        predicted = {"kv_tokens_per_replica": rep.kv_tokens,
                     "max_running_requests": rep.max_running_requests,
                     "mem_fraction_static": rep.mem_fraction_static,
                     "kv_pool_gb_per_gpu": round(rep.kv_pool_gb, 2)}
        return TrialPlan(config=cand, changed=changed, predicted=predicted,
                         rationale=f"{changed or 'baseline'}: the estimate fits with "
                                   f"{rep.kv_tokens:,} KV tokens per replica")

    async def screened(self, best: ServingConfig, seen: set[str], run_id: str,
                       losers: dict[str, str]) -> AsyncIterator[Pruned | TrialPlan]:
        """Each unseen neighbour of ``best``, screened: Pruned or a viable TrialPlan.

        A pruned candidate (an earlier regression in ``losers``, a forbidding lesson, the
        memory-fit estimate) is added to ``seen``; a viable one is not (the caller adds what
        it launches). A neighbour whose resolved settings equal the incumbent's or a launched
        config's (:meth:`equivalent`) is added to ``seen`` and skipped silently: it is the same
        server under another spelling, not a candidate.
        """
        self.remember(best)
        for cand, changed in self.ordered(best):
            cid = cand.config_id()
            if cid in seen:
                continue
            if self.equivalent(cand) is not None:
                seen.add(cid)
                continue
            if changed in losers:
                seen.add(cid)
                yield Pruned(config=cand, changed=changed, lesson_ids=[], reason=losers[changed])
                continue
            verdict = await self.screen(cand, changed, run_id)
            if isinstance(verdict, Pruned):
                seen.add(cid)
            yield verdict

    async def step(self, best: ServingConfig, seen: set[str], run_id: str,
                   losers: dict[str, str] | None = None,
                   history: Sequence[Any] = ()) -> PlanStep:
        """Next candidate from ``best``, skipping config ids in ``seen``.

        Args:
            best: the incumbent config.
            seen: config ids already launched or pruned in this run (updated in place).
            run_id: recorded on new lessons.
            losers: ``knob=value`` changes that already cost more than the study's
                ``drop_regressions`` share from an earlier incumbent, with the reason; they
                are pruned instead of launched again.
            history: the run's search trials (ledger order); this brain only remembers the
                measured ones' resolved settings (:meth:`remember`), so a neighbour the
                engine would run like one of them is skipped even by a fresh planner (the
                space brains of ``agents.brains`` learn from the whole history).

        Pruned candidates are returned so the caller can ledger them before anything launches,
        then store their new lessons (:attr:`Pruned.new_lesson`).
        """
        pruned: list[Pruned] = []
        for t in history:
            if t.launched and t.objective is not None:
                self.remember(t.config)
        async for verdict in self.screened(best, seen, run_id, losers or {}):
            if isinstance(verdict, Pruned):
                pruned.append(verdict)
                continue
            seen.add(verdict.config.config_id())
            self.remember(verdict.config)
            return PlanStep(pruned=pruned, decision=verdict)
        return PlanStep(pruned=pruned, decision=NoViableConfig(
            reason="every one-knob change of the best config was tried or pruned"))

    async def decide(self, plan: TrialPlan, outcomes: list[dict[str, Any]],
                     run_id: str) -> Decision:
        """Keep or drop ``plan`` given the research ``outcomes`` (ResearchOutcome dumps).

        Drops it when :func:`research_verdict` finds a source claim whose SM range excludes the
        GPU (and writes :func:`research_lesson`); otherwise keeps it.
        """
        drop = research_verdict(outcomes, plan.config)
        if drop is not None:
            return Decision(decision="drop", reason=drop,
                            lesson=research_lesson(plan.config, plan.changed, drop, run_id))
        answered = sum(o.get("status") == "answered" for o in outcomes)
        return Decision(decision="keep", reason=(
            f"{answered}/{len(outcomes)} questions answered, no refusal of {plan.changed} on "
            f"{plan.config.gpu} found"))


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

    A space brain's candidate changes several knobs (``'a=1, b=2'``, ``agents.brains``): the
    questions are about its first research-worthy change not researched yet
    (:func:`research_change`).
    """
    part = research_change(changed, seen_changes)
    if part is None:
        return []
    knob, value = part.split("=", 1)
    flag = RESEARCH_FLAGS[knob]
    cli = "--" + flag.replace("_", "-")
    scope = dict(gpu=config.gpu, model=config.model, quantization=config.weights,
                 engine_version=config.engine_version)
    slug = re.sub(r"[^a-z0-9]+", "-", part.lower()).strip("-")[:40]
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


def research_change(changed: str, seen_changes: set[str] = frozenset()) -> str | None:
    """The 'knob=value' part of ``changed`` to research, or None.

    ``changed`` is one 'knob=value' (one-knob brains) or several joined by ', ' (space brains);
    the first part whose knob is in :data:`RESEARCH_FLAGS` and that no entry of
    ``seen_changes`` (split the same way) contains is the one.
    """
    done = {p for c in seen_changes for p in c.split(", ")}
    for part in changed.split(", ") if changed else []:
        if "=" in part and part not in done and part.split("=", 1)[0] in RESEARCH_FLAGS:
            return part
    return None


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
    knob = (research_change(changed) or changed).split("=", 1)[0]
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


def _history(trials: list[Any]) -> list[dict[str, Any]]:
    """Compact search history for a planner task (seq, status, changed, objective, reason)."""
    return [{"seq": t.seq, "status": t.status, "changed": t.changed or "baseline",
             "objective": round(t.objective, 1) if t.objective is not None else None,
             "reason": t.reason[:160]} for t in trials]


class ClaudePlanner(Planner):
    """Claude brain: code screens every unseen neighbour, Claude picks which one to launch.

    Screening (lessons through ``check_config``, the memory-fit estimate, earlier regressions)
    stays in code, so a model never launches what a lesson or the arithmetic rules out; the
    model picks among the viable candidates with the search history in view, may stop the
    search, and decides keep / modify / drop after research. ``usage`` accumulates the cost of
    every agent run of this planner.
    """

    def __init__(self, study: Study, lessons: Client, claude: ClaudeSetup,
                 history: list[Any]) -> None:
        """Planner over ``lessons`` with ``history`` (the run's search trials, ledger order)."""
        super().__init__(study, lessons)
        self.claude, self.history = claude, history
        self.usage = AgentUsage()
        self.viable: list[TrialPlan] = []

    def _agent(self, output: type[Any]) -> ClaudeAgent[Any]:
        return ClaudeAgent("planner", self.claude.client, {"lessons": self.lessons},
                           {"lessons": ["check_config", "query_lessons", "list_lessons"]},
                           output, model=self.claude.model, budget=self.claude.budget,
                           meter=self.claude.meter)

    async def _run(self, output: type[Any], task: str, check: Any) -> Any:
        try:
            out, usage = await self._agent(output).run(task, check)
        except AgentFailure as e:
            self.usage = self.usage.plus(e.usage)
            raise
        self.usage = self.usage.plus(usage)
        return out

    async def step(self, best: ServingConfig, seen: set[str], run_id: str,
                   losers: dict[str, str] | None = None,
                   history: Sequence[Any] = ()) -> PlanStep:
        """Screen every unseen neighbour of ``best``, then ask Claude which one to launch.

        Same arguments as :meth:`Planner.step`. Viable candidates that are not chosen stay
        unseen (they are offered again next step). A failed agent run gives
        :class:`PlannerFailed` (the pruned candidates are still returned).
        """
        pruned: list[Pruned] = []
        viable: list[TrialPlan] = []
        async for verdict in self.screened(best, seen, run_id, losers or {}):
            if isinstance(verdict, Pruned):
                pruned.append(verdict)
            else:
                viable.append(verdict)
        self.viable = viable
        if not viable:
            return PlanStep(pruned=pruned, decision=NoViableConfig(
                reason="every one-knob change of the best config was tried or pruned"))
        offered = {p.changed: p for p in viable}
        task = ("PLAN STEP. Pick the next config to launch: one of the candidates below (each "
                "changes one knob of the current best and passed the lesson check and the "
                "memory-fit estimate), or stop if none is worth a launch. Objective: "
                f"{self.study.objective} under TTFT p99 <= {self.study.slo.ttft_p99_ms:g} ms "
                f"on the replay; {self.study.gpu_count}x {self.study.gpu}, SGLang "
                f"{self.study.engine_version}.\n" + context_block({
                    "best": best.model_dump(mode="json", exclude_none=True),
                    "candidates": [{"candidate": p.changed, "predicted": p.predicted}
                                   for p in viable],
                    "history": _history(self.history), "objective": self.study.objective}))

        async def check(out: PlanChoice) -> str | None:
            if out.action == "launch" and out.candidate not in offered:
                return (f"candidate {out.candidate!r} is not one of the offered candidates: "
                        f"{', '.join(offered)}")
            return None

        try:
            choice: PlanChoice = await self._run(PlanChoice, task, check)
        except AgentFailure as e:
            return PlanStep(pruned=pruned, decision=PlannerFailed(
                reason=failure_reason("planner", e)))
        if choice.action == "stop" or choice.candidate is None:
            return PlanStep(pruned=pruned, decision=NoViableConfig(
                reason=f"the planner stopped the search: {choice.rationale}"))
        plan = offered[choice.candidate]
        seen.add(plan.config.config_id())
        return PlanStep(pruned=pruned, decision=plan.model_copy(
            update={"rationale": choice.rationale}))

    async def decide(self, plan: TrialPlan, outcomes: list[dict[str, Any]],
                     run_id: str) -> Decision:
        """Claude keeps, modifies (to another screened candidate) or drops ``plan``.

        Raises:
            AgentOutputInvalid, AgentBudgetExceeded: the agent gave no valid decision (the
                caller records the trial as failed).
        """
        alternatives = {p.changed: p for p in self.viable if p.changed != plan.changed}
        task = ("RESEARCH DECISION. Research subagents answered questions about the candidate "
                "below before its launch. Decide: keep (launch it), modify (launch one of the "
                "alternatives instead) or drop (launch nothing). Cite the claims' evidence.\n"
                + context_block({
                    "candidate": plan.changed,
                    "config": plan.config.model_dump(mode="json", exclude_none=True),
                    "gpu": plan.config.gpu, "sm": get_gpu(plan.config.gpu).sm_major * 10,
                    "research": outcomes, "alternatives": list(alternatives)}))

        async def check(out: ResearchDecision) -> str | None:
            if out.decision == "modify" and out.modify_to not in alternatives:
                return (f"modify_to {out.modify_to!r} is not one of the alternatives: "
                        f"{', '.join(alternatives) or '(none: keep or drop)'}")
            if out.decision != "keep" and not out.evidence:
                return f"a {out.decision} decision needs evidence (file:line or lesson id)"
            return None

        d: ResearchDecision = await self._run(ResearchDecision, task, check)
        lesson = None
        if d.decision != "keep" and d.refused_on_this_gpu:
            why = f"{d.reason} [{'; '.join(d.evidence[:3])}]"
            lesson = research_lesson(plan.config, plan.changed, why, run_id)
        return Decision(decision=d.decision, reason=d.reason, evidence=d.evidence,
                        plan=alternatives.get(d.modify_to or "") if d.decision == "modify"
                        else None, lesson=lesson)
