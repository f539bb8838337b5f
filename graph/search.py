"""The search loop's nodes: plan -> prune -> research -> deploy -> benchmark -> decide -> record.

One pass of the loop is one search step: ``plan`` asks the planner for the next candidate (the
baseline first) or ends the search; ``prune`` commits the candidates it dropped before launch;
``research`` asks the research fan-out about a research-worthy candidate (it may keep, modify or
drop it); ``deploy`` launches it; ``benchmark`` runs the saturation benchmark and tears the
deployment down; ``decide`` judges the result against the incumbent; ``record`` commits the
trial. A step that ends early (a pruned baseline, a dropped candidate) goes back to ``plan``; an
agent that gives no valid output, or a launch that fails, goes to ``record`` with its row.

What the nodes of one step hand each other lives in :class:`SearchStep`, held in the process's
:class:`~graph.state.StudyContext` and never checkpointed: it holds live brains and a running
deployment. A node that finds no step of its own (the process was killed and the run resumed
there) goes back to ``plan``, which derives the position from the ledger, so the step is redone
exactly as the killed process began it; rows are committed at the same points as before the
loop was split into nodes (pruned candidates, then the trial), each with its lessons after it
(:meth:`StudyContext.commit`).
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from langgraph.runtime import Runtime

from agents.analyst import (
    Analyst,
    acceptance,
    failure_lesson,
    replica_mean,
    search_graph_ceiling,
)
from agents.brains import make_planner
from agents.claude import AgentFailure, failure_reason
from agents.claude_planner import ClaudePlanner
from agents.deployer import Deployer, DeployOutcome
from agents.guided_brain import GuidedPlanner
from agents.planner import NoViableConfig, Planner, PlannerFailed, Pruned, TrialPlan
from agents.research_questions import research_questions
from domain.config import ServingConfig
from domain.errors import ConfigInvalid, DoesNotFit
from domain.faults import rule
from domain.ledger import Ledger, LintHook
from domain.preflight import arch_lints, lint_config
from domain.study import Study
from domain.trial import LintNote, Trial, manifest_for, per_run
from domain.usage import AgentUsage, add_extra_usage, llm_usage, spent
from graph.brains import llm_capped, repeats, trial_brains, trial_by_seq
from graph.research import run_research
from graph.retry import deployment, launch, measure
from graph.state import StudyContext, StudyState


def candidate_lints(study: Study) -> LintHook:
    """The ledger's lint hook for ``study``: each row's config through the pre-flight lints.

    Calls :func:`domain.preflight.lint_config` (the lints of ``servetune check``: e.g.
    ``GRAPH_CEILING``, ``SPEC_DEFAULT_CAP``) and :func:`domain.preflight.arch_lints`
    (``ARCH_REFUSED``, ``NOT_MODELLED``) and keeps each finding's severity, code, message
    and fix on the row (:class:`~domain.trial.LintNote`).
    """
    def lints(config: ServingConfig) -> list[LintNote]:
        try:
            found = lint_config(config, study) + arch_lints(config)
        except (ConfigInvalid, DoesNotFit):  # a config the estimate refuses: pruned, not linted
            return []
        return [LintNote.model_validate(f, from_attributes=True) for f in found]
    return lints


def search_position(ledger: Ledger, study: Study) -> dict[str, Any]:
    """Incumbent, launches and trials-since-improvement, recomputed from the ledger."""
    best_seq, best_obj, launched, since = None, None, 0, 0
    for t in ledger.trials("search"):
        if t.status == "pruned":
            continue
        launched += 1  # a failed trial (an agent's invalid output) uses a slot too
        if t.status in ("baseline", "keep"):
            best_seq, best_obj, since = t.seq, t.objective, 0
        else:
            since += 1
    return {"best_seq": best_seq, "best_objective": best_obj, "launched": launched,
            "since_improvement": since}


def budget_stop(ledger: Ledger, study: Study) -> str | None:
    """Which per-study cap (wall time, GPU-hours, LLM tokens) the search has reached, if any."""
    b, used = study.budget, spent(ledger)
    for cap, key, unit in ((b.max_wall_s, "wall_s", "s of wall time"),
                           (b.max_gpu_hours, "gpu_hours", "GPU-hours")):
        if cap is not None and used[key] >= cap:
            return f"{unit} budget reached ({used[key]:,.2f} of {cap:,.2f} {unit.split()[0]})"
    if b.max_llm_tokens is not None and used["llm_tokens"] >= b.max_llm_tokens:
        return (f"LLM tokens budget reached ({used['llm_tokens']:,.0f} of "
                f"{b.max_llm_tokens:,} tokens); validation and the frontier run with the "
                "deterministic brains")
    return None


def _losers(trials: list[Trial], share: float) -> dict[str, str]:
    """``knob=value`` changes that cost more than ``share`` of their parent's tok/s/GPU."""
    by_seq = {t.seq: t for t in trials}
    out: dict[str, str] = {}
    for t in trials:
        parent = by_seq.get(t.parent_seq or -1)
        if (t.status == "discard" and t.changed and parent is not None and parent.objective
                and t.objective is not None and t.objective < (1 - share) * parent.objective):
            loss = 1 - t.objective / parent.objective
            out.setdefault(t.changed, f"{t.changed} cost {loss:.0%} of the tok/s/GPU of trial "
                                      f"#{parent.seq} in trial #{t.seq}; not retried")
    return out


def _planner(ctx: StudyContext) -> Planner:
    """The planner brain of one search step.

    ``search.brain`` guided, tpe or grid: that space brain
    (:func:`agents.brains.make_planner`; guided gets the replay profile), with or without
    Claude. ovat: Claude picks among the one-knob neighbours when the run has
    a key and its LLM-token budget is not spent, else the deterministic :class:`Planner`.
    """
    if ctx.study.search.brain != "ovat":
        return make_planner(ctx.study, ctx.lessons, replay=ctx.replay)
    if ctx.claude is None or llm_capped(ctx):
        return Planner(ctx.study, ctx.lessons)
    return ClaudePlanner(ctx.study, ctx.lessons, ctx.claude, ctx.ledger.trials("search"))


NODES = ("plan", "prune", "research", "deploy", "benchmark", "decide", "record")


@dataclass
class SearchStep:
    """One search step in progress in this process (what its nodes hand each other)."""

    planner: Planner
    pos: dict[str, Any]  # search_position at the step's start
    seen: set[str] = field(default_factory=set)  # config ids tried or pruned (planner.step)
    losers: dict[str, str] = field(default_factory=dict)
    bases_tried: int = 0  # bases the planner stepped from (more only while nothing ran)
    base_seq: int | None = None  # the trial the candidate changes one knob of
    base_trial: Trial | None = None
    decision: Any = None  # the planner's TrialPlan | NoViableConfig | PlannerFailed
    pruned: list[tuple[Pruned, int | None]] = field(default_factory=list)  # to commit
    plan: TrialPlan | None = None  # the candidate to launch
    is_baseline: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # research fields of the trial row
    # deploy -> benchmark -> decide
    deployer: Deployer | None = None
    analyst: Analyst | None = None
    name: str = ""  # the deployment
    labels: dict[str, str] = field(default_factory=dict)
    base: dict[str, Any] = field(default_factory=dict)  # the trial row's common fields
    t0: float = 0.0
    held: AsyncExitStack | None = None  # the running deployment (benchmark tears it down)
    runs: list[Any] = field(default_factory=list)
    row: Trial | None = None  # the trial ``record`` commits

    def usage(self) -> dict[str, dict[str, Any]]:
        """Role -> usage of the Claude brains of this trial."""
        return llm_usage(planner=None if self.is_baseline else self.planner,
                         deployer=self.deployer, analyst=self.analyst)


def _go(node: str, **update: Any) -> dict[str, Any]:
    return {**update, "phase": "search", "step": node}


def _done(ctx: StudyContext) -> dict[str, Any]:
    """The step is over: the position as the ledger has it, and the next step."""
    ctx.step = None
    return _go("plan", **search_position(ctx.ledger, ctx.study))


def _lost(ctx: StudyContext) -> bool:
    """Whether this process holds no step (resumed mid-step): the step is redone from plan."""
    return ctx.step is None


async def plan(state: StudyState, runtime: Runtime[StudyContext]) -> dict[str, Any]:
    """The next candidate: the baseline first, then the planner's step from the incumbent.

    Ends the search (phase ``validate``) at the trial budget, the patience, a budget cap, or
    when every base offers nothing. While nothing has run yet (the baseline was pruned or
    crashed) the search widens breadth-first: one knob from the baseline, then one knob from
    each config tried so far (``prune`` sends the step back here for the next base).
    """
    ctx = runtime.context
    study, ledger, budget = ctx.study, ctx.ledger, ctx.study.budget
    s = ctx.step
    if s is None or s.decision is None or not isinstance(s.decision, NoViableConfig):
        s = ctx.step = SearchStep(planner=_planner(ctx), pos=search_position(ledger, study))
        trials = ledger.trials("search")
        if not trials:  # the baseline: screened like any candidate, then launched
            base = study.base_config()
            ctx.report(phase="search", trial=1, total=budget.max_trials, config="baseline")
            verdict = await s.planner.screen(base, "", ctx.run_id)
            if isinstance(verdict, Pruned):
                s.pruned = [(verdict, None)]
            else:
                predicted = dict(verdict.predicted)
                if isinstance(s.planner, GuidedPlanner):  # its prior for the baseline too
                    predicted.update(s.planner.prediction(base))
                s.plan = verdict.model_copy(update={"predicted": predicted})
                s.is_baseline = True
            return _go("prune")
        pos = s.pos
        stop = (f"trial budget reached ({budget.max_trials} launched)"
                if pos["launched"] >= budget.max_trials else
                f"no improvement for {budget.patience} trials"
                if pos["since_improvement"] >= budget.patience else budget_stop(ledger, study))
        if stop is not None:
            ctx.step = None
            return {**pos, "phase": "validate", "stop_reason": stop}
        s.seen = {t.config.config_id() for t in trials}
        s.losers = _losers(trials, study.drop_regressions)
    trials = ledger.trials("search")
    bases = [t for t in trials if t.seq == s.pos["best_seq"]] or trials
    if s.bases_tried >= len(bases):  # every base said NoViableConfig: the last reason stands
        return _no_viable(ctx, s)
    s.base_trial = bases[s.bases_tried]
    s.bases_tried += 1
    step = await s.planner.step(s.base_trial.config, s.seen, ctx.run_id, losers=s.losers,
                                history=trials)
    s.decision = step.decision
    s.pruned = [(p, s.base_trial.seq) for p in step.pruned]
    return _go("prune")


def _no_viable(ctx: StudyContext, s: SearchStep) -> dict[str, Any]:
    """End the search: nothing is left to launch from any base."""
    add_extra_usage(ctx.ledger, "planner", getattr(s.planner, "usage", AgentUsage()))
    ctx.step = None
    pos = search_position(ctx.ledger, ctx.study)
    said = s.decision.reason if isinstance(s.decision, NoViableConfig) else None
    space_brain = ctx.study.search.brain != "ovat"
    reason = (said if said is not None and (pos["best_seq"] is not None or space_brain)
              else "every one-knob change of the best config was tried or pruned"
              if pos["best_seq"] is not None else
              "no config ran: every config reachable from the baseline was pruned or "
              "failed to start")
    return {**pos, "phase": "validate", "stop_reason": reason}


async def prune(state: StudyState, runtime: Runtime[StudyContext]) -> dict[str, Any]:
    """Commit the candidates the planner dropped before launch (each row, then its lesson)."""
    ctx = runtime.context
    s = ctx.step
    if s is None:
        return _go("plan")
    for p, parent in s.pruned:
        await ctx.commit(Trial(
            run_id=ctx.run_id, seq=0, key=f"search:{p.config.config_id()}", phase="search",
            status="pruned", config=p.config, changed=p.changed, parent_seq=parent,
            reason=p.reason, lesson_ids=p.lesson_ids,
            lessons_written=[p.new_lesson] if p.new_lesson else []))
        ctx.report(phase="search", pruned=p.changed or "baseline", reason=p.reason)
    s.pruned = []
    if s.is_baseline:
        return _go("research")
    if s.decision is None:  # the baseline was pruned
        return _done(ctx)
    if isinstance(s.decision, NoViableConfig):
        return _go("plan")  # the next base, if any
    assert s.base_trial is not None
    if isinstance(s.decision, PlannerFailed):
        n = sum(t.key.startswith("search:planner-failed:") for t in ctx.ledger.trials("search"))
        s.row = Trial(run_id=ctx.run_id, seq=0, key=f"search:planner-failed:{n + 1}",
                      phase="search", status="failed", config=s.base_trial.config, changed="",
                      parent_seq=s.base_trial.seq, reason=s.decision.reason,
                      llm_usage=llm_usage(planner=s.planner))
        ctx.report(phase="search", pruned="(planner)", reason=s.decision.reason)
        return _go("record")
    assert isinstance(s.decision, TrialPlan)
    s.plan, s.base_seq = s.decision, s.base_trial.seq
    return _go("research")


async def research(state: StudyState, runtime: Runtime[StudyContext]) -> dict[str, Any]:
    """Ask the research fan-out before a research-worthy candidate; keep, modify or drop it.

    Not for the baseline, nor once the study's research questions are spent.
    """
    ctx = runtime.context
    s = ctx.step
    if s is None or s.plan is None:
        return _go("plan")
    if s.is_baseline:
        return _go("deploy")
    ledger, budget, plan = ctx.ledger, ctx.study.budget, s.plan
    asked = int(spent(ledger)["questions"])
    room = budget.max_research_questions
    if not ctx.researchers or (room is not None and asked >= room):
        return _go("deploy")
    seen_changes = {t.changed for t in ledger.trials("search") if t.research}
    questions = research_questions(plan.changed, plan.config, seen_changes)
    if room is not None:
        questions = questions[:room - asked]
    if not questions:
        return _go("deploy")
    ctx.report(phase="search", trial=s.pos["launched"] + 1, total=budget.max_trials,
               config=f"research: {plan.changed}")
    outcomes = await run_research(questions, ctx.researchers, ctx.research_parallel)
    dumped = [o.model_dump(mode="json") for o in outcomes]
    row: dict[str, Any] = dict(
        run_id=ctx.run_id, seq=0, key=f"search:{plan.config.config_id()}", phase="search",
        config=plan.config, changed=plan.changed, parent_seq=s.base_seq, research=dumped)
    try:
        decision = await s.planner.decide(plan, dumped, ctx.run_id)
    except AgentFailure as e:
        s.row = Trial(**row, status="failed", reason=failure_reason("planner", e),
                      research_decision="none: the planner gave no valid decision",
                      llm_usage=llm_usage(planner=s.planner))
        return _go("record")
    if decision.decision == "keep":
        s.extra = {"research": dumped, "research_decision": f"kept: {decision.reason}"}
        return _go("deploy")
    lesson = decision.lesson
    what = "dropped" if decision.plan is None else f"modified to {decision.plan.changed}"
    await ctx.commit(Trial(**row, status="pruned", reason=f"research: {decision.reason}",
                           lesson_ids=[lesson.id] if lesson else [],
                           lessons_written=[lesson] if lesson else [],
                           research_decision=f"{what}: {decision.reason}",
                           llm_usage=llm_usage(planner=s.planner)))
    ctx.report(phase="search", pruned=plan.changed, reason=f"research: {decision.reason}")
    if decision.plan is None or ledger.get(f"search:{decision.plan.config.config_id()}"):
        return _done(ctx)
    if isinstance(s.planner, ClaudePlanner):
        s.planner.usage = AgentUsage()  # counted on the pruned row
    s.plan = decision.plan
    s.extra = {"research": [], "research_decision": (
        f"launched instead of {row['changed']} (research: {decision.reason})")}
    return _go("deploy")


async def deploy(state: StudyState, runtime: Runtime[StudyContext]) -> dict[str, Any]:
    """Launch the candidate (retrying transient failures); a launch that fails is recorded.

    A failure that is not transient becomes a lesson on the ``crash`` row
    (:func:`agents.analyst.failure_lesson`); one transient to the last try writes none.
    """
    ctx = runtime.context
    s = ctx.step
    if s is None or s.plan is None:
        return _go("plan")
    plan, key = s.plan, f"search:{s.plan.config.config_id()}"
    if not s.is_baseline:
        ctx.report(phase="search", trial=s.pos["launched"] + 1,
                   total=ctx.study.budget.max_trials, config=plan.changed)
        ctx.event("plan", key=key, changed=plan.changed, brain=ctx.study.search.brain,
                  rationale=plan.rationale)
    s.t0 = time.time()
    s.deployer, s.analyst = trial_brains(ctx)
    s.name = name = ctx.deployment_name(plan.config)
    s.labels = labels = {"servetune/run-id": ctx.run_id,
                         "servetune/trial": key.replace(":", "-")[:63]}
    s.base = dict(run_id=ctx.run_id, seq=0, key=key, phase="search", config=plan.config,
                  changed=plan.changed, parent_seq=s.base_seq, predicted=plan.predicted,
                  manifest=manifest_for(plan.config, ctx.backend_kind), retries=[], **s.extra)
    ctx.event("deploy", key=key, name=name)
    failed: AgentFailure | None = None
    async with AsyncExitStack() as stack:  # down on every way out but a Ready launch
        await stack.enter_async_context(deployment(s.deployer, name))
        try:
            out = await launch(ctx, s.deployer, name, plan.config, labels, key,
                               s.base["retries"])
        except AgentFailure as e:
            failed = e
        else:
            if out.ready:
                s.held = stack.pop_all()  # benchmark tears it down
                return _go("benchmark")
    if failed is not None:
        s.row = Trial(**s.base, status="failed", reason=failure_reason("deployer", failed),
                      llm_usage=s.usage(), wall_s=time.time() - s.t0)
    else:
        s.row = _not_started(ctx, s, out, key)
    return _go("record")


def _not_started(ctx: StudyContext, s: SearchStep, out: DeployOutcome, key: str) -> Trial:
    """The row of a candidate that did not start: ``failed`` if transient, else ``crash``."""
    if rule(out.failure_class).retry:  # transient to the last try: no lesson
        return Trial(**s.base, status="failed", failure_class=out.failure_class,
                     reason=f"{out.failure_class} at {out.stage} on every try: "
                            f"{out.evidence[:160]}",
                     log_tail=out.log_tail, llm_usage=s.usage(), wall_s=time.time() - s.t0)
    assert s.plan is not None
    lesson = failure_lesson(s.plan.config, out, ctx.run_id, key)
    return Trial(**s.base, status="crash", failure_class=out.failure_class,
                 reason=f"{out.failure_class} at {out.stage}: {out.evidence[:160]}",
                 lesson_ids=[lesson.id], lessons_written=[lesson], log_tail=out.log_tail,
                 llm_usage=s.usage(), wall_s=time.time() - s.t0)


async def benchmark(state: StudyState, runtime: Runtime[StudyContext]) -> dict[str, Any]:
    """Saturation runs of the Ready candidate (retried by failure class); then tear it down."""
    ctx = runtime.context
    s = ctx.step
    if s is None or s.held is None or s.plan is None or s.analyst is None \
            or s.deployer is None:
        return _go("plan")
    name, analyst = s.name, s.analyst
    try:
        s.runs = await measure(ctx, s.deployer, name, s.plan.config, s.labels, s.base["key"],
                               lambda: analyst.saturation_runs(name, repeats(ctx)),
                               s.base["retries"])
    finally:
        held, s.held = s.held, None
        await held.aclose()
    return _go("decide")


async def decide(state: StudyState, runtime: Runtime[StudyContext]) -> dict[str, Any]:
    """Judge the measured candidate: baseline, keep, discard, or ``failed``.

    The acceptance gate compares its runs with the incumbent's; ``failed`` when the analyst
    gives no valid verdict.
    """
    ctx = runtime.context
    s = ctx.step
    if s is None or not s.runs or s.plan is None or s.analyst is None:
        return _go("plan")
    runs, config, changed = s.runs, s.plan.config, s.plan.changed
    bench = next((b for b in runs if not b.valid), runs[0])  # an invalid run is not scored
    objectives = [b.summary.output_tok_s_per_gpu for b in runs]
    measured: dict[str, Any] = dict(
        saturation=bench.summary, records_path=bench.records_path,
        decode_roofline_share=replica_mean(bench.replicas, "decode_roofline_share"),
        decode_allreduce_share=replica_mean(bench.replicas, "decode_allreduce_share"),
        saturation_replicas=bench.replicas, objective_runs=objectives,
        replica_requests=per_run(saturation=bench.replica_requests),
        objective_blocks=bench.block_tok_s_per_gpu)
    pos = search_position(ctx.ledger, ctx.study)
    gate = None
    if bench.valid and bench.summary.completed and not s.is_baseline \
            and pos["best_seq"] is not None:
        inc = trial_by_seq(ctx.ledger, pos["best_seq"])
        gate = acceptance(objectives, bench.block_tok_s_per_gpu,
                          inc.objective_runs or [inc.objective or 0.0], inc.objective_blocks,
                          ctx.study)
    try:
        verdict = await s.analyst.verdict(bench, pos["best_objective"], s.is_baseline, config,
                                          changed, gate=gate, objective=(
                                              sum(objectives) / len(objectives)
                                              if len(objectives) > 1 else None))
    except AgentFailure as e:
        s.row = Trial(**s.base, **measured, status="failed",
                      reason=failure_reason("analyst", e), llm_usage=s.usage(),
                      wall_s=time.time() - s.t0)
        return _go("record")
    cause = search_graph_ceiling(config, bench.summary, ctx.ledger.trials("search"),
                                 ctx.study.saturation.concurrency) if bench.valid else None
    reason = verdict.reason if cause is None else f"{verdict.reason}; {cause.text()}"
    s.row = Trial(**s.base, **measured, status=verdict.status, reason=reason,
                  objective=verdict.objective, acceptance=gate, llm_usage=s.usage(),
                  graph_ceiling=cause, wall_s=time.time() - s.t0)
    return _go("record")


async def record(state: StudyState, runtime: Runtime[StudyContext]) -> dict[str, Any]:
    """Commit the step's trial (the row, then its lessons); the next step plans from it."""
    ctx = runtime.context
    s = ctx.step
    if s is None or s.row is None:
        return _go("plan")
    await ctx.commit(s.row)
    return _done(ctx)
