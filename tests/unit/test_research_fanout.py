"""The research fan-out (graph/research.py): concurrent branches, bounded parallelism, a failing
or slow branch that loses nobody else's findings.
"""

from __future__ import annotations

import anyio
import pytest

from agents.outputs import Claim, ResearchFindings, ResearchQuestion
from domain.usage import AgentUsage
from graph.research import run_research

pytestmark = pytest.mark.anyio


class Slow:
    """A researcher that takes ``delay`` seconds and records how many ran at once."""

    def __init__(self, delay: float, fail_on: str | None = None) -> None:
        self.delay, self.fail_on = delay, fail_on
        self.running = self.peak = 0

    async def answer(self, q: ResearchQuestion) -> tuple[ResearchFindings, AgentUsage]:
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await anyio.sleep(self.delay)
            if q.id == self.fail_on:
                raise RuntimeError("source tree vanished")
            return (ResearchFindings(question=q.question, answer=f"about {q.flag}",
                                     claims=[Claim(text=f"{q.flag} is checked",
                                                   evidence=["sglang/srt/x.py:1"])]),
                    AgentUsage(tool_calls=2, seconds=self.delay))
        finally:
            self.running -= 1


def questions(n: int, kind: str = "source") -> list[ResearchQuestion]:
    return [ResearchQuestion(id=f"q{i}", kind=kind, question=f"what does flag_{i} do?",
                             flag=f"flag_{i}") for i in range(n)]


async def test_branches_run_concurrently_and_keep_question_order():
    r = Slow(0.3)
    out = await run_research(questions(3), {"source": r}, max_parallel=3)
    assert [o.question.id for o in out] == ["q0", "q1", "q2"]
    assert all(o.status == "answered" and o.findings.claims for o in out)
    # every pair of branches overlapped in time
    for a in out:
        for b in out:
            assert a.started_s < b.finished_s and b.started_s < a.finished_s
    assert r.peak == 3
    assert sum(o.usage.tool_calls for o in out) == 6


async def test_parallelism_is_bounded():
    r = Slow(0.1)
    out = await run_research(questions(5), {"source": r}, max_parallel=2)
    assert len(out) == 5 and r.peak == 2


async def test_a_failing_branch_does_not_lose_the_others():
    r = Slow(0.2, fail_on="q1")
    out = await run_research(questions(3), {"source": r}, max_parallel=3)
    assert [o.status for o in out] == ["answered", "failed", "answered"]
    assert out[1].error == "RuntimeError: source tree vanished" and out[1].findings is None
    assert out[0].findings.answer == "about flag_0" and out[2].findings.answer == "about flag_2"


async def test_a_slow_branch_times_out_and_a_missing_researcher_fails_alone():
    qs = questions(1) + [ResearchQuestion(id="m0", kind="memory", question="lessons on fa3?")]
    out = await run_research(qs, {"source": Slow(5.0)}, max_parallel=2, timeout_s=0.2)
    assert [o.status for o in out] == ["failed", "failed"]
    assert out[0].error == "timed out after 0.2 s"
    assert "no researcher for questions of kind 'memory'" in out[1].error


async def test_bad_arguments():
    with pytest.raises(ValueError, match="unique"):
        await run_research(questions(1) * 2, {"source": Slow(0)})
    with pytest.raises(ValueError, match="max_parallel"):
        await run_research(questions(1), {"source": Slow(0)}, max_parallel=0)
    assert await run_research([], {}) == []
