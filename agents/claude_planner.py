"""Claude planner brain: code screens every unseen neighbour, Claude picks which one to launch.

The ``search.brain: ovat`` search with a Claude agent (prompt ``agents/prompts/planner.md``)
choosing among the candidates :class:`agents.planner.Planner` screens (lessons, memory fit,
earlier regressions), and keeping, modifying or dropping a candidate after research.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mcp import Client

from agents.claude import (
    AgentFailure,
    ClaudeAgent,
    ClaudeSetup,
    context_block,
    failure_reason,
)
from agents.outputs import PlanChoice, ResearchDecision
from agents.planner import (
    Decision,
    NoViableConfig,
    Planner,
    PlannerFailed,
    PlanStep,
    Pruned,
    TrialPlan,
)
from domain.config import ServingConfig
from domain.hardware import get_gpu
from domain.lesson_builders import research_lesson
from domain.study import Study
from domain.usage import AgentUsage


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
