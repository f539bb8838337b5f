"""The report's sections about who decided: research, the agents and their cost, the lessons.

The LLM cost comes from :mod:`domain.usage` (the ledger's usage per role and the run's
``llm_calls.jsonl``).
"""

from __future__ import annotations

from typing import Any

from domain.lesson import Lesson
from domain.trial import Trial
from domain.usage import LLM_CALLS, USAGE_KEYS, llm_cost_usd, tokens, usage_by_role
from servetune.report.format import EVIDENCE_LINES, REASON_CHARS, _changed, _fence

ROLES = ("planner", "deployer", "analyst", "researchers")


def _research_section(trials: list[Trial]) -> list[str]:
    """Questions asked before launches, their cited answers, the decisions and their cost."""
    asked = [t for t in trials if t.research]
    if not asked:
        return []
    avoided = sum(1 for t in asked if t.status == "pruned")  # dropped, or modified to another
    outcomes = [o for t in asked for o in t.research]
    calls = sum(int(o.get("usage", {}).get("tool_calls", 0)) for o in outcomes)
    n_tokens = int(sum(tokens(o.get("usage", {})) for o in outcomes))
    seconds = sum(float(o.get("finished_s", 0)) - float(o.get("started_s", 0))
                  for o in outcomes)
    out = ["## Research before launches", "",
           f"{len(outcomes)} questions before {len(asked)} candidate(s), in parallel branches; "
           f"launches avoided: {avoided}. Cost: {calls} tool calls, {n_tokens:,} LLM tokens, "
           f"{seconds:.1f} s of branch time.", ""]
    for t in asked:
        out += [f"### {_changed(t)} (trial #{t.seq}, {t.status})", "",
                f"Decision: {t.research_decision or 'kept'}", ""]
        for o in t.research:
            q = o.get("question", {})
            span = float(o.get("finished_s", 0)) - float(o.get("started_s", 0))
            out.append(f"- **{q.get('kind', '?')}**: {q.get('question', '')} "
                       f"({o.get('status')}, {span:.2f} s)")
            f = o.get("findings") or {}
            if o.get("status") != "answered":
                out.append(f"  - failed: {o.get('error')}")
                continue
            out.append(f"  - answer: {' '.join(str(f.get('answer', '')).split())}")
            for c in (f.get("claims") or [])[:6]:
                ev = "; ".join(str(e) for e in c.get("evidence", [])[:3])
                out.append(f"  - {' '.join(str(c.get('text', '')).split())} [{ev}]")
            for u in f.get("unresolved") or []:
                out.append(f"  - unresolved: {' '.join(str(u).split())}")
        out.append("")
    return out


def _agents_section(trials: list[Trial], brains: str, extra: dict[str, dict[str, Any]],
                    prices: dict[str, float] | None,
                    billed: dict[str, float] | None) -> list[str]:
    """Who made the decisions and, for Claude agents, what they cost."""
    out = ["## Agents and LLM cost", ""]
    rows = usage_by_role(trials, extra)
    failed = [t for t in trials if t.status == "failed"]
    used = [b for b in brains.split(",") if b]
    models = [b.split(":", 1)[1] for b in used if b.startswith("claude:")]
    if not models and not rows:
        return out + ["Deterministic brains (no `ANTHROPIC_API_KEY`): no LLM call, no cost. "
                      "With a key, `servetune run` runs the planner, deployer, analyst and "
                      "researchers as Claude agents.", ""]
    who = ", ".join(f"`{m}`" for m in models) or "(not recorded)"
    mixed = (" The run was resumed with other brains; each segment's usage is counted."
             if len(used) > 1 else "")
    out += [f"Claude agents, model{'s' if len(models) > 1 else ''} {who}.{mixed} Token counts "
            "are the Messages API's `usage`; "
            "cost is estimated at the configured prices"
            + (f" (USD/MTok: input {prices['input']:g}, output {prices['output']:g}, cache "
               f"read {prices['cache_read']:g}, cache write {prices['cache_write']:g})."
               if prices else "."), "",
            "| role | turns | tool calls | retries | input tok | output tok | cache read tok "
            "| cache write tok | agent s | est. USD |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    total = dict.fromkeys(USAGE_KEYS, 0.0)
    for role in [*ROLES, *sorted(set(rows) - set(ROLES))]:
        u = rows.get(role)
        if u is None:
            continue
        for k in USAGE_KEYS:
            total[k] += u[k]
        usd = f"{llm_cost_usd(u, prices):.4f}" if prices else ""
        out.append(f"| {role} | " + " | ".join(f"{u[k]:,.0f}" for k in USAGE_KEYS[:-1])
                   + f" | {u['seconds']:,.1f} | {usd} |")
    usd = f"{llm_cost_usd(total, prices):.4f}" if prices else ""
    out.append("| **total** | " + " | ".join(f"{total[k]:,.0f}" for k in USAGE_KEYS[:-1])
               + f" | {total['seconds']:,.1f} | {usd} |")
    out.append("")
    out.append("Turns are Messages API calls; agent s is the agents' wall time.")
    if billed is not None:
        tok = sum(billed[k] for k in billed if k.endswith("_tokens"))
        out.append(f"Every API call of the run, including work an interruption cut short "
                   f"(`{LLM_CALLS}`): {billed['calls']:,.0f} calls, {tok:,.0f} tokens"
                   + (f", est. USD {llm_cost_usd(billed, prices):.4f}." if prices else "."))
    out.append("")
    if failed:
        out += [f"{len(failed)} trial(s) failed because an agent gave no valid output:", ""]
        out += [f"- #{t.seq} {_changed(t)}: {' '.join(t.reason.split())[:REASON_CHARS]}"
                for t in failed]
        out.append("")
    return out


def _lessons_section(lessons: list[Lesson]) -> list[str]:
    out = ["## Lessons used or written in this run", ""]
    if not lessons:
        return out + ["None.", ""]
    for les in lessons:
        lines = les.evidence.splitlines()
        evidence = "\n".join(lines[:EVIDENCE_LINES])
        if len(lines) > EVIDENCE_LINES:
            evidence += f"\n... ({len(lines) - EVIDENCE_LINES} more lines)"
        fc = f" ({les.failure_class})" if les.failure_class else ""
        out += [f"### {les.id or '(no id)'}: {' '.join(les.title.split())}", "",
                f"- Outcome: {les.outcome}{fc}",
                f"- Condition: `{les.condition_text()}`",
                f"- Fix: {' '.join(les.fix.split())}", "", "Evidence:", "", *_fence(evidence), ""]
    return out
