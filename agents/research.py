"""Research subagents: answer one scoped :class:`ResearchQuestion` before a costly launch.

Two kinds of question: ``source`` (what the SGLang source says about a flag: its declaration,
where an unset value is resolved, the asserts/raises/warnings around it and the architecture
checks among them) over the sglang-source MCP server, and ``memory`` (what past lessons say
about this family on this or similar hardware) over the lessons MCP server.

Each kind has a deterministic researcher that answers by static means within the question's
tool budget, so a research fan-out runs and is tested with no API key, and a Claude researcher
(:class:`ClaudeResearcher`) that runs the ``source_researcher`` / ``memory_researcher`` prompt
as a tool-use loop. All return ``(ResearchFindings, AgentUsage)``; every claim cites
``path:line`` (with a short quote) or a lesson id. An anticipated failure (no source tree, an
unknown flag, a tool error, a spent budget) is reported in ``unresolved``, never raised, by the
deterministic researchers.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from mcp import Client

from agents.claude import AgentBudget, ClaudeAgent
from agents.mcp_tools import ToolCallFailed, call
from agents.outputs import Claim, ResearchFindings, ResearchQuestion
from domain.lesson import STORED, Lesson
from domain.usage import AgentUsage, Meter
from mcp_servers.source.analysis import mentions_value

if TYPE_CHECKING:  # the SDK loads only when a client is made (agents.claude)
    from anthropic import AsyncAnthropic

MAX_CONSTRAINT_CLAIMS = 6
MAX_DEFAULT_CLAIMS = 3
CONSTRAINT_PAGE = 200  # items per constraints call (the tool allows 500)
QUOTE_CHARS = 160

# Conditions or messages that test the GPU architecture or platform.
ARCH_RE = re.compile(
    r"\bis_sm\d+\w*|\bsm_?\d{2,3}\b|\bSM\s*[<>=]=?\s*\d+|\bSM\s*\d{2,3}\b|is_hopper|is_blackwell"
    r"|is_ampere|get_device_capability|compute_capability|\bmajor\s*[<>=!]=?|\bminor\s*[<>=!]=?"
    r"|is_cuda|is_hip|is_rocm|is_musa|is_npu|is_xpu|is_gfx\d+|torch\.version\.(?:cuda|hip)",
    re.IGNORECASE)

class Researcher(Protocol):
    """Answers one scoped research question."""

    async def answer(self, q: ResearchQuestion) -> tuple[ResearchFindings, AgentUsage]:
        """The findings for ``q`` and what answering cost."""
        ...


def _quote(text: str, limit: int = QUOTE_CHARS) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _cli(flag: str) -> str:
    return flag if flag.startswith("--") else "--" + flag.replace("_", "-")


def is_architecture_check(*texts: str) -> bool:
    """Whether any of ``texts`` tests the GPU architecture or platform (SM version, CUDA/HIP)."""
    return any(ARCH_RE.search(t or "") for t in texts)


class _Session:
    """Tool calls of one answer, within the question's budget."""

    def __init__(self, client: Client, budget: int) -> None:
        self.client, self.budget = client, budget
        self.usage = AgentUsage()
        self.start = time.monotonic()
        self.skipped: list[str] = []

    def can_call(self) -> bool:
        return self.usage.tool_calls < self.budget

    async def call(self, tool: str, args: dict[str, Any]) -> Any:
        """The tool's result; None when the budget is spent (the tool is noted as skipped).

        Raises:
            ToolCallFailed: the tool answered with an error.
        """
        if not self.can_call():
            self.skipped.append(tool)
            return None
        self.usage.tool_calls += 1
        return await call(self.client, tool, args)

    def finish(self) -> AgentUsage:
        self.usage.seconds = round(time.monotonic() - self.start, 3)
        return self.usage

    def budget_note(self) -> str | None:
        if not self.skipped:
            return None
        return (f"tool budget of {self.budget} call(s) spent before "
                f"{', '.join(dict.fromkeys(self.skipped))}: not checked")


class DeterministicSourceResearcher:
    """Answers ``kind="source"`` questions from the sglang-source server, by static means.

    Calls, within ``q.tool_budget``: ``get_flag`` (declaration), ``constraints`` (the asserts,
    raises and warnings; architecture checks first, then those naming ``q.value``),
    ``explain_default`` (where an unset value is resolved), then further ``constraints`` pages.
    """

    def __init__(self, source: Client) -> None:
        self.source = source

    async def answer(self, q: ResearchQuestion) -> tuple[ResearchFindings, AgentUsage]:
        """Findings about ``q.flag`` (and ``q.value``); never raises for a tool error."""
        s = _Session(self.source, q.tool_budget)
        claims: list[Claim] = []
        unresolved: list[str] = []
        parts: list[str] = []
        if not q.flag:
            unresolved.append("the question names no flag; the deterministic source researcher "
                              "answers questions about one flag only")
            return self._findings(q, "No flag to look up.", claims, unresolved, s)
        subject = _cli(q.flag) + (f" {q.value}" if q.value else "")
        try:
            decl = await s.call("get_flag", {"flag": q.flag})
        except ToolCallFailed as e:
            unresolved.append(f"get_flag {q.flag}: {e.message}")
            return self._findings(q, f"{subject}: not answered from the source "
                                     f"({_quote(e.message, 200)}).", claims, unresolved, s)
        dest = decl["dest"]
        parts.append(self._declaration(decl, q, claims, unresolved))

        cons = await self._constraints(s, dest, q, unresolved)
        default = None
        if s.can_call():
            try:
                default = await s.call("explain_default", {"flag": dest, "max_items": 50})
            except ToolCallFailed as e:
                unresolved.append(f"explain_default {dest}: {e.message}")
        else:
            s.skipped.append("explain_default")
        if default is not None:
            parts.append(self._default(default, q, claims))
        if cons is not None:
            parts.append(self._constraint_claims(cons, q, claims))
        note = s.budget_note()
        if note:
            unresolved.append(note)
        unresolved.append("performance is not settled by the source; only a benchmark measures it")
        return self._findings(q, f"{subject}: " + " ".join(p for p in parts if p), claims,
                              unresolved, s)

    @staticmethod
    def _findings(q: ResearchQuestion, answer: str, claims: list[Claim], unresolved: list[str],
                  s: _Session) -> tuple[ResearchFindings, AgentUsage]:
        return (ResearchFindings(question=q.question, answer=answer, claims=claims,
                                 unresolved=unresolved), s.finish())

    @staticmethod
    def _declaration(decl: dict[str, Any], q: ResearchQuestion, claims: list[Claim],
                     unresolved: list[str]) -> str:
        entries = decl.get("entries") or []
        field = decl.get("field") or {}
        e = entries[0] if entries else {}
        where = e.get("source") or field.get("source")
        typ = e.get("type") or field.get("type")
        default = e.get("default", field.get("default"))
        choices = e.get("choices")
        text = (f"{_cli(decl['dest'])} is declared with type {typ}, default {default!r}"
                + (f", {len(choices)} choices" if choices else "")
                + (f"; help: {_quote(e.get('help', ''), 120)}" if e.get("help") else "")
                + ("; resolvable at start-up" if e.get("resolvable") else "") + ".")
        if where:
            claims.append(Claim(text=text, evidence=[f"{where} (declaration of {decl['dest']})"]))
        out = f"declared at {where}, default {default!r}." if where else ""
        if q.value and choices is not None:
            if q.value in [str(c) for c in choices]:
                out += f" {q.value!r} is one of its {len(choices)} choices."
            else:
                out += f" {q.value!r} is NOT among its choices."
                if where:
                    claims.append(Claim(text=f"{q.value!r} is not an accepted value of "
                                             f"{_cli(decl['dest'])} (argparse refuses it).",
                                        evidence=[f"{where} (choices)"]))
        elif q.value and choices is None and e.get("choices_source"):
            unresolved.append(f"choices are computed at run time ({e['choices_source']}); "
                              f"whether {q.value!r} is accepted is not read statically")
        return out

    async def _constraints(self, s: _Session, dest: str, q: ResearchQuestion,
                           unresolved: list[str]) -> dict[str, Any] | None:
        """Every constraints page the budget allows (the first page before explain_default)."""
        items: list[dict[str, Any]] = []
        first: dict[str, Any] | None = None
        start: int | None = 0
        while start is not None:
            # keep one call for explain_default after the first page
            if first is not None and s.usage.tool_calls + 1 >= s.budget:
                s.skipped.append("constraints (later pages)")
                break
            try:
                page = await s.call("constraints", {"flag": dest, "start": start,
                                                    "max_items": CONSTRAINT_PAGE})
            except ToolCallFailed as e:
                unresolved.append(f"constraints {dest}: {e.message}")
                break
            if page is None:
                break
            first = first or page
            items.extend(page["items"])
            start = page.get("next_start")
        if first is None:
            return None
        if start is not None:
            unresolved.append(f"constraints: {len(items)} of {first['total']} checks read")
        return {**first, "items": items}

    @staticmethod
    def rank_constraints(items: Sequence[dict[str, Any]], value: str | None
                         ) -> list[dict[str, Any]]:
        """Architecture checks first, then checks naming ``value``, then sglang/srt, then order.

        Architecture checks that name the value come first of all: those whose condition (or
        ``reached_only_if``) names it, then those whose message does.
        """
        def key(ic: tuple[int, dict[str, Any]]) -> tuple[int, ...]:
            i, c = ic
            cond = (c.get("condition", ""), *c.get("reached_only_if", []))
            arch = is_architecture_check(*cond, c.get("message", ""))
            val_cond = mentions_value(value, *cond)
            val = val_cond or mentions_value(value, c.get("message", ""))
            return (0 if arch and val_cond else 1, 0 if arch and val else 1, 0 if arch else 1,
                    0 if val else 1, 0 if c.get("path", "").startswith("sglang/srt/") else 1, i)
        return [c for _, c in sorted(enumerate(items), key=key)]

    def _constraint_claims(self, cons: dict[str, Any], q: ResearchQuestion,
                           claims: list[Claim]) -> str:
        items = cons["items"]
        if not items:
            return "No assert, raise or warning involves it."
        ranked = self.rank_constraints(items, q.value)
        startup = sum(c.get("phase") == "startup" for c in items)
        arch = [c for c in items if is_architecture_check(
            c.get("condition", ""), c.get("message", ""), *c.get("reached_only_if", []))]
        val = [c for c in items if mentions_value(
            q.value, c.get("condition", ""), c.get("message", ""), *c.get("reached_only_if", []))]
        # the best-ranked (architecture first), then room for checks that name the value
        head = ranked[:MAX_CONSTRAINT_CLAIMS - 2]
        tail = sorted(ranked[len(head):], key=lambda c: not any(c is v for v in val))
        for c in head + tail[:MAX_CONSTRAINT_CLAIMS - len(head)]:
            claims.append(self._constraint_claim(c, q.value))
        summary = (f"{cons['total']} check(s) involve it ({startup} of the {len(items)} read at "
                   f"start-up), {len(arch)} test the architecture"
                   + (f", {len(val)} name {q.value!r}" if q.value else "") + ".")
        top = ranked[0]
        lead = ("refused" if top["kind"] in ("assert", "raise") else "warned")
        cond = top.get("condition") or "(always, once reached)"
        how = (f"unless `{_quote(cond, 100)}`" if top["kind"] == "assert"
               else f"when `{_quote(cond, 100)}`")
        return (f"{summary} Top: {lead} {how} ({top['path']}:{top['line']}: "
                f"{_quote(top.get('message', ''), 100)}).")

    @staticmethod
    def _constraint_claim(c: dict[str, Any], value: str | None) -> Claim:
        cond = c.get("condition") or "(always, once reached)"
        reach = c.get("reached_only_if") or []
        if c["kind"] == "assert":
            what = f"Start-up fails unless `{_quote(cond)}`" if c.get("phase") == "startup" \
                else f"Fails at run time ({c.get('function')}) unless `{_quote(cond)}`"
        elif c["kind"] == "raise":
            what = (f"{'Start-up' if c.get('phase') == 'startup' else 'Run time'} raises "
                    f"when `{_quote(cond)}`")
        else:
            what = f"Warns when `{_quote(cond)}`"
        if reach:
            what += f", reached only if {'; '.join(f'`{_quote(r, 100)}`' for r in reach[:3])}"
        tags = [t for t, ok in (("architecture check", is_architecture_check(
            cond, c.get("message", ""), *reach)), (f"names {value!r}", mentions_value(
                value, cond, c.get("message", ""), *reach))) if ok]
        if tags:
            what += f" [{', '.join(tags)}]"
        msg = _quote(c.get("message", ""), 120)
        return Claim(text=what + (f": {msg}" if msg else "") + ".",
                     evidence=[f"{c['path']}:{c['line']} ({c['kind']} in {c.get('function')})"])

    @staticmethod
    def _default(d: dict[str, Any], q: ResearchQuestion, claims: list[Claim]) -> str:
        sites = d.get("assignments") or []

        def key(ia: tuple[int, dict[str, Any]]) -> tuple[int, int, int, int, int]:
            i, a = ia
            texts = (*a.get("conditions", []), *a.get("guards", []), a.get("value", ""))
            return (0 if a.get("phase") == "startup" else 1,
                    0 if is_architecture_check(*texts) else 1,
                    0 if mentions_value(q.value, *texts) else 1,
                    0 if a.get("path", "").startswith("sglang/srt/") else 1, i)

        top = [a for _, a in sorted(enumerate(sites), key=key)][:MAX_DEFAULT_CLAIMS]
        for a in top:
            when = " and ".join(f"`{_quote(c, 100)}`" for c in
                                [*a.get("conditions", []), *a.get("guards", [])][:3])
            claims.append(Claim(
                text=(f"{'At start-up' if a.get('phase') == 'startup' else 'At run time'} "
                      f"{a.get('function')} sets it to `{_quote(a.get('value', ''), 80)}`"
                      + (f" when {when}" if when else "") + "."),
                evidence=[f"{a['path']}:{a['line']} ({a.get('kind')} assignment)"]))
        if not sites:
            return f"Default {d.get('declared_default')!r}; nothing resolves it."
        return (f"{d.get('total', len(sites))} site(s) set it (e.g. "
                + ", ".join(f"{a['path']}:{a['line']}" for a in top) + ").")


class DeterministicMemoryResearcher:
    """Answers ``kind="memory"`` questions from the lessons server.

    ``query_lessons`` scoped to the question's gpu/model/quantization, then (budget allowing,
    when a GPU is named) the same query without the GPU filter for lessons from other hardware.
    A hit is kept when its condition names ``q.flag`` or its score is at least ``min_score``.
    """

    def __init__(self, lessons: Client, *, k: int = 5, min_score: float = 0.25) -> None:
        self.lessons, self.k, self.min_score = lessons, k, min_score

    async def answer(self, q: ResearchQuestion) -> tuple[ResearchFindings, AgentUsage]:
        """Findings that cite lesson ids; never raises for a tool error."""
        s = _Session(self.lessons, q.tool_budget)
        unresolved: list[str] = []
        scope = {k: v for k, v in (("gpu", q.gpu), ("model", q.model),
                                   ("quantization", q.quantization)) if v}
        found: dict[str, tuple[Lesson, float, bool]] = {}  # id -> (lesson, score, same GPU)
        queries = [scope]
        if q.gpu:
            queries.append({k: v for k, v in scope.items() if k != "gpu"})
        for i, filters in enumerate(queries):
            try:
                res = await s.call("query_lessons", {"text": q.question, "k": self.k, **filters})
            except ToolCallFailed as e:
                unresolved.append(f"query_lessons: {e.message}")
                break
            if res is None:
                break
            for h in res["hits"]:
                lesson = Lesson.model_validate(h["lesson"], context=STORED)
                if lesson.id not in found:
                    found[lesson.id] = (lesson, float(h["score"]), i == 0)
        kept = [(les, score, same) for les, score, same in found.values()
                if self._about_flag(les, q) or score >= self.min_score]
        kept.sort(key=lambda t: (not self._about_flag(t[0], q), not t[2], -t[1]))
        claims = [self._claim(les, score, same, q) for les, score, same in kept]
        where = ", ".join(f"{k}={v}" for k, v in scope.items()) or "any scope"
        note = s.budget_note()
        if note and q.gpu:
            unresolved.append(note.replace("query_lessons", "query_lessons without the GPU "
                                                            "filter (similar hardware)"))
        if not claims:
            unresolved.append(f"no stored lesson bears on this ({where}); only a trial can tell")
            answer = f"No past lesson bears on this question ({where})."
        else:
            about = sum(self._about_flag(les, q) for les, _, _ in kept)
            forbidding = [les for les, _, _ in kept if les.outcome in ("oom", "crash",
                                                                       "invalid", "unsupported")]
            answer = (f"{len(claims)} lesson(s) bear on this ({where})"
                      + (f", {about} about {_cli(q.flag)}" if q.flag else "") + ". "
                      + " ".join(f"{les.id}: {_quote(les.title, 100)} ({les.outcome}"
                                 f"{'' if same else ', other hardware'})."
                                 for les, _, same in kept[:3])
                      + (f" {len(forbidding)} record a failure." if forbidding else ""))
        return (ResearchFindings(question=q.question, answer=answer, claims=claims,
                                 unresolved=unresolved), s.finish())

    @staticmethod
    def _about_flag(lesson: Lesson, q: ResearchQuestion) -> bool:
        return bool(q.flag) and any(c.field == q.flag for c in lesson.condition)

    @staticmethod
    def _claim(lesson: Lesson, score: float, same_gpu: bool, q: ResearchQuestion) -> Claim:
        sc = lesson.scope
        scope = ", ".join(x for x in (sc.gpu, sc.model, sc.quantization) if x) or "any scope"
        text = (f"{lesson.title} (scope {scope}): when {lesson.condition_text()}, outcome "
                f"{lesson.outcome}; fix: {_quote(lesson.fix, 160)}")
        if not same_gpu:
            text += f" [from other hardware than {q.gpu}]"
        return Claim(text=text + f" (similarity {score:.2f}).", evidence=[lesson.id],
                     inferred=not same_gpu)


SOURCE_TOOLS = ("source_info", "get_flag", "explain_default", "constraints", "where_used",
                "grep", "read_file", "outline", "list_files", "list_flags")
LESSON_TOOLS = ("query_lessons", "list_lessons")
ROLES = {"source": "source_researcher", "memory": "memory_researcher"}


def research_task(q: ResearchQuestion) -> str:
    """The task text a Claude researcher gets for ``q``."""
    lines = [f"Question: {q.question}"]
    if q.flag:
        lines.append(f"Flag: {_cli(q.flag)} (dest {q.flag.lstrip('-').replace('-', '_')})")
    if q.value:
        lines.append(f"Value the candidate sets: {q.value}")
    scope = [f"{k} {v}" for k, v in (("GPU", q.gpu), ("model", q.model),
                                     ("weights", q.quantization),
                                     ("SGLang", q.engine_version)) if v]
    if scope:
        lines.append("Scope: " + ", ".join(scope))
    lines.append(f"Tool budget: {q.tool_budget} calls. Answer this one question; cite "
                 "file:line or lesson ids.")
    return "\n".join(lines)


class ClaudeResearcher:
    """A research question answered by a Claude tool-use loop (:class:`ClaudeAgent`).

    ``source`` questions run the ``source_researcher`` prompt over the ``source`` server (plus
    ``query_lessons`` when a ``lessons`` server is connected); ``memory`` questions run
    ``memory_researcher`` over ``lessons``. The question's ``tool_budget`` caps tool calls.
    """

    def __init__(self, client: AsyncAnthropic, servers: Mapping[str, Client], *,
                 model: str | None = None, budget: AgentBudget | None = None,
                 agent_factory: Callable[..., ClaudeAgent[ResearchFindings]] = ClaudeAgent,
                 meter: Meter | None = None) -> None:
        self.client, self.servers, self.model, self.meter = client, servers, model, meter
        self.budget = budget or AgentBudget(max_turns=12)
        self.agent_factory = agent_factory

    def allowed(self, kind: str) -> dict[str, list[str]]:
        """Server -> tool names a researcher of ``kind`` may call."""
        if kind == "source":
            out = {"source": list(SOURCE_TOOLS)}
            if "lessons" in self.servers:
                out["lessons"] = ["query_lessons"]
            return out
        return {"lessons": list(LESSON_TOOLS)}

    async def answer(self, q: ResearchQuestion) -> tuple[ResearchFindings, AgentUsage]:
        """Run the agent on ``q``.

        Raises:
            AgentOutputInvalid, AgentBudgetExceeded: from :meth:`ClaudeAgent.run` (each carries
                ``usage``); the caller records the failed branch.
            ValueError: the needed server is not connected or lacks a tool.
        """
        budget = dataclasses.replace(self.budget, max_tool_calls=q.tool_budget)
        agent = self.agent_factory(ROLES[q.kind], self.client, self.servers,
                                   self.allowed(q.kind), ResearchFindings, model=self.model,
                                   budget=budget, meter=self.meter)
        findings, usage = await agent.run(research_task(q))
        if findings.question != q.question:
            findings = findings.model_copy(update={"question": q.question})
        return findings, usage
