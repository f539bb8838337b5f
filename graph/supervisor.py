"""The supervisor: a LangGraph loop over planner, deployer and analyst, checkpointed in SQLite.

Phases: ``search`` (one trial per step: plan -> deploy -> benchmark -> judge -> ledger),
``validate`` (replay the real trace on the finalists, pick the winner under the SLO) and
``frontier`` (concurrency sweep of the finalists). Every node first commits its trial to the
ledger and derives the search position from the ledger, so a run killed anywhere and resumed
with the same id reproduces an uninterrupted run without repeating a finished trial.
"""

from __future__ import annotations

import json
import time
from typing import Any

from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime

from agents.analyst import (
    Analyst,
    BenchOutcome,
    ClaudeAnalyst,
    acceptance,
    failure_lesson,
    replica_mean,
)
from agents.brains import GuidedPlanner, make_planner
from agents.claude import AgentFailure, AgentUsage, failure_reason
from agents.deployer import ClaudeDeployer, Deployer
from agents.planner import (
    ClaudePlanner,
    NoViableConfig,
    Planner,
    PlannerFailed,
    Pruned,
    TrialPlan,
    research_questions,
)
from domain.config import ServingConfig
from domain.faults import bench_failure_class, rule
from domain.ledger import Ledger
from domain.study import Study
from domain.trial import Trial, manifest_for
from graph.research import run_research
from graph.retry import deployment, launch, measure
from graph.state import StudyContext, StudyState
from graph.validation import (
    admission_of,
    candidate_outputs,
    frontier_targets,
    quality_gate,
    retune,
)

SUCCESS = ("baseline", "keep", "discard")
EXTRA_USAGE = "llm_usage_unattached"  # ledger meta: agent runs that produced no trial row


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


TOKEN_KEYS = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_creation_tokens")


def tokens(usage: dict[str, Any]) -> float:
    """Every token an AgentUsage dump was billed for: input, output, cache reads and writes."""
    return sum(float(usage.get(k, 0) or 0) for k in TOKEN_KEYS)


def extra_usage(ledger: Ledger) -> dict[str, dict[str, Any]]:
    """Role -> usage of agent runs that produced no trial row (e.g. a planner that stopped)."""
    raw = ledger.get_meta(EXTRA_USAGE)
    return json.loads(raw) if raw else {}


def _add_extra_usage(ledger: Ledger, role: str, usage: AgentUsage) -> None:
    if not usage.turns:
        return
    extra = extra_usage(ledger)
    extra[role] = AgentUsage.model_validate(extra.get(role, {})).plus(usage).model_dump()
    ledger.set_meta(EXTRA_USAGE, json.dumps(extra))


def spent(ledger: Ledger) -> dict[str, float]:
    """What the search used so far, from the ledger (so a resumed run counts the same).

    Returns:
        ``wall_s`` (trial wall time + research branch time, s), ``gpu_hours`` (GPUs x
        benchmark duration of the search trials that ran one, h; twin: virtual seconds),
        ``llm_tokens`` (input + output tokens of every Claude agent run: research, planner,
        deployer, analyst; cache reads and writes included) and ``questions`` (research
        asked).
    """
    out = {"wall_s": 0.0, "gpu_hours": 0.0, "llm_tokens": 0.0, "questions": 0.0}
    out["llm_tokens"] += sum(tokens(u) for u in extra_usage(ledger).values())
    for t in ledger.trials():
        out["llm_tokens"] += sum(tokens(u) for u in t.llm_usage.values())
    for t in ledger.trials("search"):
        branch_s = sum(float(o.get("finished_s", 0)) - float(o.get("started_s", 0))
                       for o in t.research)
        out["wall_s"] += t.wall_s + branch_s
        out["llm_tokens"] += sum(tokens(o.get("usage", {})) for o in t.research)
        out["questions"] += len(t.research)
        if t.saturation is not None:  # repeated runs last about as long as the first
            out["gpu_hours"] += (t.config.gpus * t.saturation.duration_s / 3600
                                 * max(1, len(t.objective_runs)))
    return out


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


def repeats(ctx: StudyContext) -> int:
    """Saturation runs per launched search candidate.

    The study's ``acceptance.repeats``, else the run's setting (``SERVETUNE_REPEATS``, default 1).
    """
    return ctx.study.acceptance.repeats or ctx.repeats


def llm_capped(ctx: StudyContext) -> bool:
    """Whether the study's ``max_llm_tokens`` is spent (then no agent calls the API again)."""
    cap = ctx.study.budget.max_llm_tokens
    return cap is not None and spent(ctx.ledger)["llm_tokens"] >= cap


def _brains(ctx: StudyContext) -> tuple[Deployer, Analyst]:
    """The deployer and analyst of one trial.

    Claude agents when the run has a key and its LLM-token budget is not spent, else the
    deterministic brains.
    """
    if ctx.claude is None or llm_capped(ctx):
        return Deployer(ctx.cluster), Analyst(ctx.bench, ctx.study)
    return (ClaudeDeployer(ctx.cluster, ctx.lessons, ctx.claude, ctx.namespace),
            ClaudeAnalyst(ctx.bench, ctx.lessons, ctx.study, ctx.claude))


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


def llm_usage(**brains: Any) -> dict[str, dict[str, Any]]:
    """Role -> AgentUsage dump of the Claude brains that ran (deterministic ones have none)."""
    out: dict[str, dict[str, Any]] = {}
    for role, brain in brains.items():
        u = getattr(brain, "usage", None)
        if isinstance(u, AgentUsage) and u.turns:
            out[role] = u.model_dump()
    return out


async def _launch_and_measure(ctx: StudyContext, key: str, phase: str, config: ServingConfig,
                              changed: str, parent: int | None, predicted: dict[str, Any],
                              is_baseline: bool = False,
                              extra: dict[str, Any] | None = None,
                              planner: Planner | None = None) -> Trial:
    """Deploy, benchmark (saturation), judge, tear down, and commit one search trial.

    With Claude brains, an agent that gives no valid output (invalid twice, or out of budget)
    makes the trial ``failed`` with the reason; the deployment is torn down and a saturation
    run already measured is kept on the row.
    """
    t0 = time.time()
    deployer, analyst = _brains(ctx)
    name = ctx.deployment_name(config)
    labels = {"servetune/run-id": ctx.run_id, "servetune/trial": key.replace(":", "-")[:63]}
    retries: list[dict[str, Any]] = []  # filled by launch/measure before the row is built
    base: dict[str, Any] = dict(run_id=ctx.run_id, seq=0, key=key, phase=phase, config=config,
                                changed=changed, parent_seq=parent, predicted=predicted,
                                manifest=manifest_for(config, ctx.backend_kind),
                                retries=retries, **(extra or {}))

    def usage() -> dict[str, dict[str, Any]]:
        return llm_usage(planner=planner, deployer=deployer, analyst=analyst)

    ctx.event("deploy", key=key, name=name)
    failed: AgentFailure | None = None
    async with deployment(deployer, name):  # down before the row is committed
        try:
            out = await launch(ctx, deployer, name, config, labels, key, retries)
        except AgentFailure as e:
            failed = e
        else:
            runs = await measure(ctx, deployer, name, config, labels, key,
                                 lambda: analyst.saturation_runs(name, repeats(ctx)),
                                 retries) if out.ready else []
    if failed is not None:
        return ctx.ledger.append(Trial(**base, status="failed", reason=failure_reason(
            "deployer", failed), llm_usage=usage(), wall_s=time.time() - t0))
    if not out.ready and rule(out.failure_class).retry:  # transient to the last try: no lesson
        return ctx.ledger.append(Trial(
            **base, status="failed", failure_class=out.failure_class,
            reason=f"{out.failure_class} at {out.stage} on every try: {out.evidence[:160]}",
            log_tail=out.log_tail, llm_usage=usage(), wall_s=time.time() - t0))
    if not out.ready:
        lesson = failure_lesson(config, out, ctx.run_id, key)
        return await ctx.commit(Trial(
            **base, status="crash", failure_class=out.failure_class,
            reason=f"{out.failure_class} at {out.stage}: {out.evidence[:160]}",
            lesson_ids=[lesson.id], lessons_written=[lesson], log_tail=out.log_tail,
            llm_usage=usage(), wall_s=time.time() - t0))
    bench = next((b for b in runs if not b.valid), runs[0])  # an invalid run is not scored
    objectives = [b.summary.output_tok_s_per_gpu for b in runs]
    measured: dict[str, Any] = dict(
        saturation=bench.summary, records_path=bench.records_path,
        decode_roofline_share=replica_mean(bench.replicas, "decode_roofline_share"),
        objective_runs=objectives, objective_blocks=bench.block_tok_s_per_gpu)
    pos = search_position(ctx.ledger, ctx.study)
    gate = None
    if bench.valid and bench.summary.completed and not is_baseline \
            and pos["best_seq"] is not None:
        inc = _by_seq(ctx.ledger, pos["best_seq"])
        gate = acceptance(objectives, bench.block_tok_s_per_gpu,
                          inc.objective_runs or [inc.objective or 0.0], inc.objective_blocks,
                          ctx.study)
    try:
        verdict = await analyst.verdict(bench, pos["best_objective"], is_baseline, config,
                                        changed, gate=gate, objective=(
                                            sum(objectives) / len(objectives)
                                            if len(objectives) > 1 else None))
    except AgentFailure as e:
        return ctx.ledger.append(Trial(**base, **measured, status="failed",
                                       reason=failure_reason("analyst", e), llm_usage=usage(),
                                       wall_s=time.time() - t0))
    trial = Trial(**base, **measured, status=verdict.status, reason=verdict.reason,
                  objective=verdict.objective, acceptance=gate, llm_usage=usage(),
                  wall_s=time.time() - t0)
    return ctx.ledger.append(trial)


async def search(state: StudyState, runtime: Runtime[StudyContext]) -> dict[str, Any]:
    """One search step: baseline first, then the planner's next one-knob candidate."""
    ctx = runtime.context
    study, ledger = ctx.study, ctx.ledger
    pos = search_position(ledger, study)
    budget = study.budget
    planner = _planner(ctx)
    trials = ledger.trials("search")
    if not trials:  # the baseline: screened like any candidate, then launched
        base = study.base_config()
        ctx.report(phase="search", trial=1, total=budget.max_trials, config="baseline")
        verdict = await planner.screen(base, "", ctx.run_id)
        if isinstance(verdict, Pruned):
            await ctx.commit(Trial(
                run_id=ctx.run_id, seq=0, key=f"search:{base.config_id()}", phase="search",
                status="pruned", config=base, changed="", reason=verdict.reason,
                lesson_ids=verdict.lesson_ids,
                lessons_written=[verdict.new_lesson] if verdict.new_lesson else []))
            ctx.report(phase="search", pruned="baseline", reason=verdict.reason)
        else:
            predicted = dict(verdict.predicted)
            if isinstance(planner, GuidedPlanner):  # its prior for the baseline too
                predicted.update(planner.prediction(base))
            await _launch_and_measure(ctx, f"search:{base.config_id()}", "search", base, "",
                                      None, predicted, is_baseline=True)
        return {**search_position(ledger, study), "phase": "search"}
    if pos["launched"] >= budget.max_trials:
        return {**pos, "phase": "validate",
                "stop_reason": f"trial budget reached ({budget.max_trials} launched)"}
    if pos["since_improvement"] >= budget.patience:
        return {**pos, "phase": "validate",
                "stop_reason": f"no improvement for {budget.patience} trials"}
    capped = budget_stop(ledger, study)
    if capped is not None:
        return {**pos, "phase": "validate", "stop_reason": capped}
    # From the incumbent. While nothing has run yet (the baseline was pruned or crashed), the
    # search widens breadth-first: one knob from the baseline, then one knob from each config
    # tried so far, so a baseline that cannot run does not end the study.
    seen = {t.config.config_id() for t in trials}
    losers = _losers(trials, study.drop_regressions)
    i = 0
    step = None
    while True:
        trials = ledger.trials("search")
        bases = [t for t in trials if t.seq == pos["best_seq"]] or trials
        if i >= len(bases):
            break  # every base said NoViableConfig: the last one's reason stands
        base_trial = bases[i]
        i += 1
        step = await planner.step(base_trial.config, seen, ctx.run_id, losers=losers,
                                  history=trials)
        for p in step.pruned:
            await ctx.commit(Trial(
                run_id=ctx.run_id, seq=0, key=f"search:{p.config.config_id()}",
                phase="search", status="pruned", config=p.config, changed=p.changed,
                parent_seq=base_trial.seq, reason=p.reason, lesson_ids=p.lesson_ids,
                lessons_written=[p.new_lesson] if p.new_lesson else []))
            ctx.report(phase="search", pruned=p.changed, reason=p.reason)
        if not isinstance(step.decision, NoViableConfig):
            break
    if step is not None and isinstance(step.decision, PlannerFailed):
        n = sum(t.key.startswith("search:planner-failed:") for t in ledger.trials("search"))
        ledger.append(Trial(run_id=ctx.run_id, seq=0, key=f"search:planner-failed:{n + 1}",
                            phase="search", status="failed", config=base_trial.config,
                            changed="", parent_seq=base_trial.seq, reason=step.decision.reason,
                            llm_usage=llm_usage(planner=planner)))
        ctx.report(phase="search", pruned="(planner)", reason=step.decision.reason)
        return {**search_position(ledger, study), "phase": "search"}
    if step is None or isinstance(step.decision, NoViableConfig):
        _add_extra_usage(ledger, "planner", getattr(planner, "usage", AgentUsage()))
        pos = search_position(ledger, study)
        said = step.decision.reason if step is not None and isinstance(
            step.decision, NoViableConfig) else None
        space_brain = ctx.study.search.brain != "ovat"
        reason = (said if said is not None and (pos["best_seq"] is not None or space_brain)
                  else "every one-knob change of the best config was tried or pruned"
                  if pos["best_seq"] is not None else
                  "no config ran: every config reachable from the baseline was pruned or "
                  "failed to start")
        return {**pos, "phase": "validate", "stop_reason": reason}
    plan = step.decision
    assert isinstance(plan, TrialPlan)
    extra: dict[str, Any] = {}
    asked = int(spent(ledger)["questions"])
    room = budget.max_research_questions
    if ctx.researchers and (room is None or asked < room):
        seen_changes = {t.changed for t in ledger.trials("search") if t.research}
        questions = research_questions(plan.changed, plan.config, seen_changes)
        if room is not None:
            questions = questions[:room - asked]
        if questions:
            ctx.report(phase="search", trial=pos["launched"] + 1, total=budget.max_trials,
                       config=f"research: {plan.changed}")
            outcomes = await run_research(questions, ctx.researchers, ctx.research_parallel)
            dumped = [o.model_dump(mode="json") for o in outcomes]
            key = f"search:{plan.config.config_id()}"
            row = dict(run_id=ctx.run_id, seq=0, key=key, phase="search", config=plan.config,
                       changed=plan.changed, parent_seq=base_trial.seq, research=dumped)
            try:
                decision = await planner.decide(plan, dumped, ctx.run_id)
            except AgentFailure as e:
                ledger.append(Trial(**row, status="failed",
                                    reason=failure_reason("planner", e),
                                    research_decision="none: the planner gave no valid decision",
                                    llm_usage=llm_usage(planner=planner)))
                return {**search_position(ledger, study), "phase": "search"}
            if decision.decision == "keep":
                extra = {"research": dumped, "research_decision": f"kept: {decision.reason}"}
            else:
                lesson = decision.lesson
                what = ("dropped" if decision.plan is None
                        else f"modified to {decision.plan.changed}")
                await ctx.commit(Trial(**row, status="pruned",
                                       reason=f"research: {decision.reason}",
                                       lesson_ids=[lesson.id] if lesson else [],
                                       lessons_written=[lesson] if lesson else [],
                                       research_decision=f"{what}: {decision.reason}",
                                       llm_usage=llm_usage(planner=planner)))
                ctx.report(phase="search", pruned=plan.changed,
                           reason=f"research: {decision.reason}")
                if decision.plan is None:
                    return {**search_position(ledger, study), "phase": "search"}
                if ledger.get(f"search:{decision.plan.config.config_id()}") is not None:
                    return {**search_position(ledger, study), "phase": "search"}
                if isinstance(planner, ClaudePlanner):
                    planner.usage = AgentUsage()  # counted on the pruned row
                plan = decision.plan
                extra = {"research": [], "research_decision": (
                    f"launched instead of {row['changed']} (research: {decision.reason})")}
    ctx.report(phase="search", trial=pos["launched"] + 1, total=budget.max_trials,
               config=plan.changed)
    ctx.event("plan", key=f"search:{plan.config.config_id()}", changed=plan.changed,
              brain=study.search.brain, rationale=plan.rationale)
    await _launch_and_measure(ctx, f"search:{plan.config.config_id()}", "search", plan.config,
                              plan.changed, base_trial.seq, plan.predicted, extra=extra,
                              planner=planner)
    return {**search_position(ledger, study), "phase": "search"}


def _finalists(ledger: Ledger, k: int) -> list[int]:
    """The best ``k`` layouts, one finalist per layout, topped up with the next best.

    A layout is (tp_size, weights, kv_cache_dtype, attention_backend); its best trial stands for
    it, so finalists differ in how the model is laid out, not only in memory or admission knobs.
    With fewer layouts than ``k``, the remaining slots go to the next best trials.
    """
    ok = [t for t in ledger.trials("search") if t.status in SUCCESS and t.objective is not None]
    ok.sort(key=Trial.rank_key)
    chosen: dict[tuple, int] = {}
    for t in ok:
        c = t.config
        chosen.setdefault((c.tp_size, c.weights, c.kv_cache_dtype, c.attention_backend), t.seq)
    picked = list(chosen.values())[:k]
    picked += [t.seq for t in ok if t.seq not in picked][:k - len(picked)]  # fewer layouts
    return sorted(picked, key=lambda s: [t.seq for t in ok].index(s))


def _by_seq(ledger: Ledger, seq: int) -> Trial:
    return next(t for t in ledger.trials() if t.seq == seq)


async def validate(state: StudyState, runtime: Runtime[StudyContext]) -> dict[str, Any]:
    """Replay the trace on the next finalist; after the last one, name the winner."""
    ctx = runtime.context
    finalists = state.get("finalists") or _finalists(ctx.ledger, ctx.study.finalists)
    cursor = state.get("cursor", 0)
    if cursor >= len(finalists):
        winner = _pick_winner(ctx.ledger)
        return {"finalists": finalists, "cursor": 0, "phase": "frontier", "winner_seq": winner}
    src = _by_seq(ctx.ledger, finalists[cursor])
    key = f"validate:{src.config.config_id()}"
    ctx.report(phase="validate", trial=cursor + 1, total=len(finalists), config=src.changed
               or "baseline")
    if ctx.ledger.get(key) is None:
        t0 = time.time()
        deployer, analyst = _brains(ctx)
        name = ctx.deployment_name(src.config)
        ctx.event("deploy", key=key, name=name)
        rep, failed, outputs = None, None, None
        retried: list[dict[str, Any]] = []
        async with deployment(deployer, name):
            try:
                out = await launch(ctx, deployer, name, src.config,
                                   {"servetune/run-id": ctx.run_id}, key, retried)
                rep = await analyst.replay(name) if out.ready else None
                if rep is not None:  # while it is up: greedy outputs for the quality gate
                    outputs = await candidate_outputs(ctx, src.config, name)
            except AgentFailure as e:
                failed = failure_reason("deployer", e)
        slo = ctx.study.slo
        gate = found = None
        if failed is not None:
            status, reason, summary = "failed", failed, None
        elif rep is None:
            status, reason, summary = "crash", f"did not start: {out.evidence}", None
        else:
            summary = rep.summary
            p99 = summary.ttft_ms.p99
            p99_ok = slo.met(p99, 0)  # the latency half, for the reason
            ok = slo.met(p99, summary.errors)
            status = "finalist" if ok else "slo-miss"
            p99_txt = f"{p99:,.0f} ms" if p99 is not None else "n/a"
            reason = (f"replay TTFT p99 {p99_txt} {'<=' if p99_ok else '>'} SLO "
                      f"{slo.ttft_p99_ms:,.0f} ms; {summary.completed}/{summary.requests} "
                      "completed")
            if summary.errors:
                reason += f"; {summary.errors} requests failed ({rep.first_error})"
            found = await admission_of(ctx, rep, src.config)
            gate = await quality_gate(ctx, src.config, outputs, deployer)
            if found is not None and found.detected:
                reason += "; over-admission detected"
            if ok and gate.blocks:
                status, reason = "discard", f"{reason}; quality gate failed: {gate.reason}"
        ctx.ledger.append(Trial(
            run_id=ctx.run_id, seq=0, key=key, phase="validate", status=status,
            config=src.config, changed=src.changed, parent_seq=src.seq, reason=reason,
            objective=src.objective, saturation=src.saturation, replay=summary,
            decode_roofline_share=src.decode_roofline_share,
            cache_hit_rate=replica_mean(rep.replicas, "cache_hit_rate") if rep else None,
            records_path=rep.records_path if rep else None, llm_usage=llm_usage(
                deployer=deployer), manifest=manifest_for(src.config, ctx.backend_kind),
            admission=found, quality=gate, retries=retried, wall_s=time.time() - t0))
    done = ctx.ledger.get(key)
    if ctx.study.validation.tune_admission and done is not None and done.admission is not None \
            and done.admission.detected:  # idempotent per variant: a resumed run skips done ones
        deployer, analyst = _brains(ctx)
        await retune(ctx, done, deployer, analyst, done.quality)
    return {"finalists": finalists, "cursor": cursor + 1, "phase": "validate"}


def _pick_winner(ledger: Ledger) -> int | None:
    """Best search objective among finalists that met the SLO; marks it ``winner``."""
    ok = [t for t in ledger.trials("validate") if t.status in ("finalist", "winner")]
    if not ok:
        return None
    ok.sort(key=Trial.rank_key)
    win = ok[0]
    if win.status != "winner":
        ledger.update_status(win.key, "winner", win.reason + "; best finalist meeting the SLO")
    return win.seq


async def frontier(state: StudyState, runtime: Runtime[StudyContext]) -> dict[str, Any]:
    """Concurrency sweep of the next frontier config (tok/s/GPU vs tok/s/user points).

    The configs are the finalists, then a speculative (NEXTN) variant of the winner where the
    model ships an MTP head (:func:`graph.validation.frontier_targets`, derived from the
    ledger, so a resumed run sweeps the same list).
    """
    ctx = runtime.context
    targets = frontier_targets(ctx.ledger, ctx.study, state.get("finalists", []))
    cursor = state.get("cursor", 0)
    if cursor >= len(targets):
        return {"phase": "done"}
    config, changed, parent = targets[cursor]
    conc = ctx.study.sweep_concurrency
    ctx.report(phase="frontier", trial=cursor + 1, total=len(targets),
               config=changed or "baseline")
    key = f"frontier:{config.config_id()}"
    # a config that did not start has a row of its own (below) and is not launched again
    todo = [] if ctx.ledger.get(key) is not None else [
        c for c in conc if ctx.ledger.get(f"{key}:{c}") is None]
    if todo:
        deployer, analyst = _brains(ctx)
        name = ctx.deployment_name(config)
        ctx.event("deploy", key=key, name=name)
        labels = {"servetune/run-id": ctx.run_id}
        t0 = time.time()
        launch_retries: list[dict[str, Any]] = []
        failed: str | None = None
        async with deployment(deployer, name):
            try:
                out = await launch(ctx, deployer, name, config, labels, key, launch_retries)
            except AgentFailure as e:  # the sweep of this config is skipped, with the reason
                failed = failure_reason("deployer", e)
            else:
                _add_extra_usage(ctx.ledger, "deployer",
                                 getattr(deployer, "usage", AgentUsage()))
                if not out.ready:
                    _frontier_no_start(ctx, key, config, changed, parent, out, launch_retries,
                                       t0)
                for c in todo if out.ready else []:
                    t0 = time.time()
                    # the launch's retried failures go on the first sweep point's row
                    retried: list[dict[str, Any]] = launch_retries
                    launch_retries = []

                    async def one(c: int = c) -> list[BenchOutcome]:
                        return [await analyst.saturation(name, concurrency=c)]

                    b = (await measure(ctx, deployer, name, config, labels,
                                       f"frontier:{config.config_id()}:{c}", one, retried))[0]
                    ctx.ledger.append(Trial(
                        run_id=ctx.run_id, seq=0, key=f"frontier:{config.config_id()}:{c}",
                        phase="frontier", status="sweep", config=config, changed=changed,
                        parent_seq=parent, reason=f"concurrency {c}", saturation=b.summary,
                        objective=b.summary.output_tok_s_per_gpu, records_path=b.records_path,
                        manifest=manifest_for(config, ctx.backend_kind), retries=retried,
                        wall_s=time.time() - t0))
                    if not b.valid and rule(bench_failure_class(
                            False, b.invalid_reason, b.errors_by_class)).redeploy:
                        break  # the server is gone and could not be brought back
        if failed is not None:
            _add_extra_usage(ctx.ledger, "deployer", getattr(deployer, "usage", AgentUsage()))
            ctx.report(phase="frontier", pruned=changed or "baseline", reason=failed)
            return {"cursor": cursor + 1, "phase": "frontier"}
    return {"cursor": cursor + 1, "phase": "frontier"}


def _frontier_no_start(ctx: StudyContext, key: str, config: ServingConfig, changed: str,
                       parent: int, out: Any, retries: list[dict[str, Any]], t0: float) -> None:
    """Commit the row of a frontier config that did not start (with its retried failures).

    A frontier launch writes no lesson: the config is a finalist or the winner's variant, not
    a search candidate.
    """
    ctx.report(phase="frontier", pruned=changed or "baseline",
               reason=f"did not start: {out.evidence[:160]}")
    transient = rule(out.failure_class).retry
    ctx.ledger.append(Trial(
        run_id=ctx.run_id, seq=0, key=key, phase="frontier",
        status="failed" if transient else "crash", config=config, changed=changed,
        parent_seq=parent, failure_class=out.failure_class,
        reason=f"did not start: {out.failure_class} at {out.stage}: {out.evidence[:160]}",
        log_tail=out.log_tail, manifest=manifest_for(config, ctx.backend_kind),
        retries=retries, wall_s=time.time() - t0))


def _route(state: StudyState) -> str:
    return {"search": "search", "validate": "validate", "frontier": "frontier"}.get(
        state.get("phase", "search"), END)


def build_graph() -> StateGraph:
    """The uncompiled supervisor graph (compile it with a checkpointer)."""
    g = StateGraph(StudyState, context_schema=StudyContext)
    g.add_node("search", search)
    g.add_node("validate", validate)
    g.add_node("frontier", frontier)
    g.add_conditional_edges(START, _route, ["search", "validate", "frontier", END])
    for node in ("search", "validate", "frontier"):
        g.add_conditional_edges(node, _route, ["search", "validate", "frontier", END])
    return g
