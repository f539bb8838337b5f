"""The supervisor: a LangGraph loop over planner, deployer and analyst, checkpointed in SQLite.

The search is a loop of nodes, one pass per trial (:mod:`graph.search`): plan -> prune ->
research -> deploy -> benchmark -> decide -> record. Then ``validate`` (replay the real trace on
the finalists, pick the winner under the SLO) and ``frontier`` (concurrency sweep of the
finalists). Every node commits its rows to the ledger and derives the search position from the
ledger, so a run killed anywhere and resumed with the same id reproduces an uninterrupted run
without repeating a finished trial. :func:`build_graph` at the end is the whole picture.
"""

from __future__ import annotations

import time
from typing import Any

from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime

from agents.analyst import replica_mean
from agents.claude import AgentFailure, failure_reason
from domain.bench import BenchResult
from domain.config import ServingConfig
from domain.faults import bench_failure_class, rule
from domain.ledger import Ledger
from domain.trial import Trial, manifest_for, per_run
from domain.usage import AgentUsage, add_extra_usage, llm_usage
from graph import search
from graph.brains import trial_brains, trial_by_seq
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


def _finalists(ledger: Ledger, k: int) -> list[int]:
    """The best ``k`` layouts, one finalist per layout, topped up with the next best.

    A layout is (tp_size, weights, kv_cache_dtype, attention_backend) plus the parallel layout
    (pp_size, dp_size, attn_dp_size, ep_size, the PD split; constant for a study that does not
    tune them); its best trial stands for it, so finalists differ in how the model is laid out,
    not only in memory or admission knobs. With fewer layouts than ``k``, the remaining slots go
    to the next best trials.
    """
    ok = [t for t in ledger.trials("search") if t.status in SUCCESS and t.objective is not None]
    ok.sort(key=Trial.rank_key)
    chosen: dict[tuple, int] = {}
    for t in ok:
        c = t.config
        chosen.setdefault((c.tp_size, c.weights, c.kv_cache_dtype, c.attention_backend,
                           c.pp_size, c.dp_size, c.attn_dp_size, c.ep_size,
                           c.pd.label() if c.pd is not None else None), t.seq)
    picked = list(chosen.values())[:k]
    picked += [t.seq for t in ok if t.seq not in picked][:k - len(picked)]  # fewer layouts
    return sorted(picked, key=lambda s: [t.seq for t in ok].index(s))


async def validate(state: StudyState, runtime: Runtime[StudyContext]) -> dict[str, Any]:
    """Replay the trace on the next finalist; after the last one, name the winner."""
    ctx = runtime.context
    finalists = state.get("finalists") or _finalists(ctx.ledger, ctx.study.finalists)
    cursor = state.get("cursor", 0)
    if cursor >= len(finalists):
        winner = _pick_winner(ctx.ledger)
        return {"finalists": finalists, "cursor": 0, "phase": "frontier", "winner_seq": winner}
    src = trial_by_seq(ctx.ledger, finalists[cursor])
    key = f"validate:{src.config.config_id()}"
    ctx.report(phase="validate", trial=cursor + 1, total=len(finalists), config=src.changed
               or "baseline")
    if ctx.ledger.get(key) is None:
        t0 = time.time()
        deployer, analyst = trial_brains(ctx)
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
            decode_allreduce_share=src.decode_allreduce_share,
            saturation_replicas=src.saturation_replicas,
            replay_replicas=rep.replicas if rep else [],
            replica_requests={**src.replica_requests,
                              **per_run(replay=rep.replica_requests if rep else None)},
            cache_hit_rate=replica_mean(rep.replicas, "cache_hit_rate") if rep else None,
            records_path=rep.records_path if rep else None, llm_usage=llm_usage(
                deployer=deployer), manifest=manifest_for(src.config, ctx.backend_kind),
            admission=found, quality=gate, retries=retried, wall_s=time.time() - t0))
    done = ctx.ledger.get(key)
    if ctx.study.validation.tune_admission and done is not None and done.admission is not None \
            and done.admission.detected:  # idempotent per variant: a resumed run skips done ones
        deployer, analyst = trial_brains(ctx)
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
        deployer, analyst = trial_brains(ctx)
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
                add_extra_usage(ctx.ledger, "deployer",
                                 getattr(deployer, "usage", AgentUsage()))
                if not out.ready:
                    _frontier_no_start(ctx, key, config, changed, parent, out, launch_retries,
                                       t0)
                for c in todo if out.ready else []:
                    t0 = time.time()
                    # the launch's retried failures go on the first sweep point's row
                    retried: list[dict[str, Any]] = launch_retries
                    launch_retries = []

                    async def one(c: int = c) -> list[BenchResult]:
                        return [await analyst.saturation(name, concurrency=c)]

                    b = (await measure(ctx, deployer, name, config, labels,
                                       f"frontier:{config.config_id()}:{c}", one, retried))[0]
                    ctx.ledger.append(Trial(
                        run_id=ctx.run_id, seq=0, key=f"frontier:{config.config_id()}:{c}",
                        phase="frontier", status="sweep", config=config, changed=changed,
                        parent_seq=parent, reason=f"concurrency {c}", saturation=b.summary,
                        objective=b.summary.output_tok_s_per_gpu, records_path=b.records_path,
                        decode_allreduce_share=replica_mean(b.replicas, "decode_allreduce_share"),
                        saturation_replicas=b.replicas,
                        replica_requests=per_run(saturation=b.replica_requests),
                        manifest=manifest_for(config, ctx.backend_kind), retries=retried,
                        wall_s=time.time() - t0))
                    if not b.valid and rule(bench_failure_class(
                            False, b.invalid_reason, b.errors_by_class)).redeploy:
                        break  # the server is gone and could not be brought back
        if failed is not None:
            add_extra_usage(ctx.ledger, "deployer", getattr(deployer, "usage", AgentUsage()))
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


def _phase(state: StudyState) -> str:
    """Where a run is entered (a start, or a resume with no pending step): by its phase."""
    return {"search": "plan", "validate": "validate", "frontier": "frontier"}.get(
        state.get("phase", "search"), END)


def _next(state: StudyState) -> str:
    """The node after a node: in the search, the loop's ``step``; else by phase."""
    if state.get("phase", "search") == "search":
        return state.get("step") or "plan"
    return _phase(state)


def build_graph() -> StateGraph:
    """The uncompiled supervisor graph (compile it with a checkpointer).

    Its picture, ``build_graph().compile().get_graph().draw_mermaid()``, is
    docs/architecture-graph.mmd (tests/unit/test_resume_rules.py keeps the two equal). Every
    search node may go back to ``plan``: a step that ends early, or one this process does not
    hold (a resume).
    """
    g = StateGraph(StudyState, context_schema=StudyContext)
    for node in search.NODES:
        g.add_node(node, getattr(search, node))
    g.add_node("validate", validate)
    g.add_node("frontier", frontier)
    g.add_conditional_edges(START, _phase, ["plan", "validate", "frontier", END])
    g.add_conditional_edges("plan", _next, ["prune", "validate"])
    g.add_conditional_edges("prune", _next, ["research", "record", "plan"])
    g.add_conditional_edges("research", _next, ["deploy", "record", "plan"])
    g.add_conditional_edges("deploy", _next, ["benchmark", "record", "plan"])
    g.add_conditional_edges("benchmark", _next, ["decide", "plan"])
    g.add_conditional_edges("decide", _next, ["record", "plan"])
    g.add_edge("record", "plan")
    g.add_conditional_edges("validate", _next, ["validate", "frontier"])
    g.add_conditional_edges("frontier", _next, ["frontier", END])
    return g
