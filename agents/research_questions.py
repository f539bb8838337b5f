"""The research questions a candidate raises before its launch (``budget.max_research_questions``).

The supervisor asks :func:`research_questions` for each candidate the planner proposes; the
research subagents (``agents.research``, fanned out by ``graph.research``) answer them and the
planner's ``decide`` reads the outcomes (:func:`domain.research.research_verdict`).
"""

from __future__ import annotations

import re

from agents.outputs import ResearchQuestion
from domain.config import ServingConfig
from domain.research import RESEARCH_FLAGS, research_change


def research_questions(changed: str, config: ServingConfig, seen_changes: set[str],
                       tool_budget: int = 6) -> list[ResearchQuestion]:
    """The scoped questions to ask before launching a candidate that changes ``changed``.

    None when the knob is not research-worthy (:data:`domain.research.RESEARCH_FLAGS`) or
    this ``knob=value`` was already researched in the run (``seen_changes``). Otherwise one
    source question (what the flag changes, where it is refused) and one memory question (what
    lessons say about the family on this or similar hardware).

    Args:
        changed: 'knob=value' of the candidate relative to its parent.
        config: the candidate.
        seen_changes: 'knob=value' strings researched before in this run.
        tool_budget: tool calls allowed per question.

    A space brain's candidate changes several knobs (``'a=1, b=2'``, ``agents.brains``): the
    questions are about its first research-worthy change not researched yet
    (:func:`domain.research.research_change`).
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
