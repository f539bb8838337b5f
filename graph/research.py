"""Parallel research before a costly experiment: a LangGraph fan-out of scoped questions.

Each :class:`~agents.outputs.ResearchQuestion` goes to its own branch (LangGraph ``Send``), which
asks the researcher of its kind (source or memory; Claude-driven or deterministic, see
:mod:`agents.research`) and returns one :class:`ResearchOutcome`. Branches run concurrently up to
``max_parallel`` (LangGraph's ``max_concurrency``); a branch that fails or overruns its time
limit yields a ``failed`` outcome with the reason and never loses the other branches' findings.
A Messages API error (after the SDK's retries) is not a branch failure: it propagates, the run
stops, and its resume asks the questions again.
"""

from __future__ import annotations

import operator
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Protocol, TypedDict

import anyio
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send
from pydantic import BaseModel, Field

from agents.claude import api_errors
from agents.outputs import ResearchFindings, ResearchQuestion
from domain.usage import AgentUsage


class Researcher(Protocol):
    """Answers one question (see :mod:`agents.research`)."""

    async def answer(self, q: ResearchQuestion) -> tuple[ResearchFindings, AgentUsage]:
        """Findings and what they cost."""
        ...


class ResearchOutcome(BaseModel):
    """What one branch returned: findings, or the reason it has none."""

    question: ResearchQuestion
    status: Literal["answered", "failed"]
    findings: ResearchFindings | None = None
    error: str | None = Field(None, description="why the branch failed (type: message)")
    started_s: float = Field(description="branch start, epoch seconds")
    finished_s: float = Field(description="branch end, epoch seconds")
    usage: AgentUsage = Field(default_factory=AgentUsage)


class _FanIn(TypedDict):
    questions: list[dict[str, Any]]
    outcomes: Annotated[list[dict[str, Any]], operator.add]


class _Branch(TypedDict):
    question: dict[str, Any]


def build_research_graph(researchers: Mapping[str, Researcher],
                         timeout_s: float) -> StateGraph[Any]:
    """The fan-out graph: START -> one ``branch`` per question (``Send``) -> END.

    Args:
        researchers: the researcher of each question kind ("source", "memory").
        timeout_s: wall-clock limit of one branch, seconds.
    """

    def fan_out(state: _FanIn) -> list[Send]:
        return [Send("branch", {"question": q}) for q in state["questions"]]

    async def branch(state: _Branch) -> dict[str, Any]:
        q = ResearchQuestion.model_validate(state["question"])
        t0 = time.time()
        try:
            researcher = researchers.get(q.kind)
            if researcher is None:
                raise LookupError(f"no researcher for questions of kind {q.kind!r}")
            with anyio.fail_after(timeout_s):
                findings, usage = await researcher.answer(q)
            out = ResearchOutcome(question=q, status="answered", findings=findings,
                                  started_s=t0, finished_s=time.time(), usage=usage)
        except api_errors():
            raise  # the API itself failed: the run stops and its resume asks again
        except Exception as e:  # noqa: BLE001 - a failed branch is an outcome, not a crash
            reason = f"timed out after {timeout_s:g} s" if isinstance(e, TimeoutError) else \
                f"{type(e).__name__}: {e}"
            spent = getattr(e, "usage", None)  # an agent failure says what it cost
            out = ResearchOutcome(question=q, status="failed", error=reason[:500],
                                  started_s=t0, finished_s=time.time(),
                                  usage=spent if isinstance(spent, AgentUsage) else AgentUsage())
        return {"outcomes": [out.model_dump(mode="json")]}

    g: StateGraph[Any] = StateGraph(_FanIn)
    g.add_node("branch", branch)  # type: ignore[type-var]
    g.add_conditional_edges(START, fan_out, ["branch"])
    g.add_edge("branch", END)
    return g


async def run_research(questions: Sequence[ResearchQuestion],
                       researchers: Mapping[str, Researcher], max_parallel: int = 4,
                       timeout_s: float = 120.0) -> list[ResearchOutcome]:
    """Answer ``questions`` in parallel branches; outcomes in the order of ``questions``.

    Args:
        questions: the scoped questions (ids unique).
        researchers: researcher per kind.
        max_parallel: at most this many branches run at once (>= 1).
        timeout_s: wall-clock limit of one branch, seconds.

    Raises:
        ValueError: duplicate question ids or max_parallel < 1.
    """
    if max_parallel < 1:
        raise ValueError("max_parallel must be >= 1")
    ids = [q.id for q in questions]
    if len(set(ids)) != len(ids):
        raise ValueError(f"research question ids must be unique: {ids}")
    if not questions:
        return []
    # checkpointer=False: inside the supervisor's node this graph would otherwise write into
    # the run's SQLite checkpoint, and a run killed during research resumed the fan-out from
    # what the killed process had written of it, losing outcomes (a KeyError below). Each call
    # starts afresh; a resumed step asks every question again. The explicit durability
    # replaces the run's "sync", which LangGraph 1.2 cannot honour without a checkpointer.
    graph = build_research_graph(researchers, timeout_s).compile(checkpointer=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`durability` has no effect")
        final = await graph.ainvoke(
            {"questions": [q.model_dump(mode="json") for q in questions], "outcomes": []},
            {"max_concurrency": max_parallel}, durability="exit")
    by_id = {o["question"]["id"]: ResearchOutcome.model_validate(o) for o in final["outcomes"]}
    return [by_id[i] for i in ids]
