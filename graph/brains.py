"""What a trial's steps share across the graph's nodes: its brains and its repeat count.

Used by the search nodes (:mod:`graph.search`) and by validate and frontier
(:mod:`graph.supervisor`).
"""

from __future__ import annotations

from agents.analyst import Analyst, ClaudeAnalyst
from agents.deployer import ClaudeDeployer, Deployer
from domain.ledger import Ledger
from domain.trial import Trial
from domain.usage import spent
from graph.state import StudyContext


def repeats(ctx: StudyContext) -> int:
    """Saturation runs per launched search candidate.

    The study's ``acceptance.repeats``, else the run's setting (``SERVETUNE_REPEATS``, default 1).
    """
    return ctx.study.acceptance.repeats or ctx.repeats


def llm_capped(ctx: StudyContext) -> bool:
    """Whether the study's ``max_llm_tokens`` is spent (then no agent calls the API again)."""
    cap = ctx.study.budget.max_llm_tokens
    return cap is not None and spent(ctx.ledger)["llm_tokens"] >= cap


def trial_brains(ctx: StudyContext) -> tuple[Deployer, Analyst]:
    """The deployer and analyst of one trial.

    Claude agents when the run has a key and its LLM-token budget is not spent, else the
    deterministic brains.
    """
    if ctx.claude is None or llm_capped(ctx):
        return Deployer(ctx.cluster), Analyst(ctx.bench, ctx.study)
    return (ClaudeDeployer(ctx.cluster, ctx.lessons, ctx.claude, ctx.namespace),
            ClaudeAnalyst(ctx.bench, ctx.lessons, ctx.study, ctx.claude))


def trial_by_seq(ledger: Ledger, seq: int) -> Trial:
    """The ledger row numbered ``seq`` (StopIteration if there is none)."""
    return next(t for t in ledger.trials() if t.seq == seq)
