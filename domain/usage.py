"""LLM usage and cost: the one owner of token counting, prices, USD and the llm-calls file.

An agent run's cost is an :class:`AgentUsage` (tokens, tool calls, turns, retries, seconds).
The ledger keeps it per role on each trial row (``Trial.llm_usage``), per research branch
(``Trial.research[i]["usage"]``) and, for agent runs that left no row (a planner that stopped),
in the ledger meta key :data:`EXTRA_USAGE`. Every Messages API call is also appended to the
run's :data:`LLM_CALLS` file as it happens (:func:`call_record`, :func:`llm_calls_meter`), so
spend an interruption cut short is still counted.

Units: tokens are the Messages API's ``usage`` counts (input, output, cache reads and cache
writes counted apart); prices are USD per million tokens (USD/MTok); costs are USD.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from domain.ledger import Ledger
from domain.trial import Trial

TOKEN_KEYS = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_creation_tokens")
USAGE_KEYS = ("turns", "tool_calls", "retries", "input_tokens", "output_tokens",
              "cache_read_tokens", "cache_creation_tokens", "seconds")
LLM_CALLS = "llm_calls.jsonl"  # a run folder's file: one JSON line per Messages API call
EXTRA_USAGE = "llm_usage_unattached"  # ledger meta: agent runs that produced no trial row

# USD per million tokens: Claude Sonnet 5.5 list prices
# (platform.claude.com/docs/en/about-claude/pricing, 2026-11); cache_write is the 5-minute
# cache write. The defaults of the SERVETUNE_PRICE_*_PER_MTOK settings.
DEFAULT_PRICES: dict[str, float] = {"input": 2.0, "output": 10.0, "cache_read": 0.2,
                                    "cache_write": 2.5}

Meter = Callable[[dict[str, Any]], None]


class AgentUsage(BaseModel):
    """What one agent run cost.

    Attributes: tool_calls (MCP calls), turns (Messages API calls), input_tokens,
    output_tokens, cache_read_tokens, cache_creation_tokens (tokens), retries (corrective
    retries after an invalid output), seconds (wall time of the run, s).
    """

    tool_calls: int = 0
    turns: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_creation_tokens: int = 0
    retries: int = 0
    seconds: float = 0.0

    def plus(self, other: AgentUsage) -> AgentUsage:
        """The sum of two usages (e.g. a study's research cost)."""
        return AgentUsage(**{k: getattr(self, k) + getattr(other, k)
                             for k in AgentUsage.model_fields})


def tokens(usage: dict[str, Any]) -> float:
    """Every token an AgentUsage dump was billed for: input, output, cache reads and writes."""
    return sum(float(usage.get(k, 0) or 0) for k in TOKEN_KEYS)


def llm_cost_usd(u: dict[str, float], prices: dict[str, float]) -> float:
    """USD of one usage row at ``prices``.

    ``prices`` are USD per million tokens under the keys input, output, cache_read and
    cache_write (see :data:`DEFAULT_PRICES`); the Messages API counts cache reads and writes
    apart from ``input_tokens``.
    """
    return (u.get("input_tokens", 0) * prices["input"] + u.get("output_tokens", 0)
            * prices["output"] + u.get("cache_read_tokens", 0) * prices["cache_read"]
            + u.get("cache_creation_tokens", 0) * prices["cache_write"]) / 1e6


def llm_usage(**brains: Any) -> dict[str, dict[str, Any]]:
    """Role -> AgentUsage dump of the Claude brains that ran (deterministic ones have none)."""
    out: dict[str, dict[str, Any]] = {}
    for role, brain in brains.items():
        u = getattr(brain, "usage", None)
        if isinstance(u, AgentUsage) and u.turns:
            out[role] = u.model_dump()
    return out


def usage_by_role(trials: list[Trial],
                  extra: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, float]]:
    """Summed AgentUsage per role (planner, deployer, analyst, researchers) over a run.

    Args:
        trials: the ledger rows (``llm_usage`` per role; research usage per outcome).
        extra: role -> usage of agent runs that left no row (ledger meta).
    """
    out: dict[str, dict[str, float]] = {}

    def add(role: str, u: dict[str, Any]) -> None:
        row = out.setdefault(role, dict.fromkeys(USAGE_KEYS, 0.0))
        for k in USAGE_KEYS:
            row[k] += float(u.get(k, 0) or 0)

    for t in trials:
        for role, u in t.llm_usage.items():
            add(role, u)
        for o in t.research:
            if o.get("usage", {}).get("turns"):
                add("researchers", o["usage"])
    for role, u in (extra or {}).items():
        add(role, u)
    return out


# ---------------------------------------------------------------- the ledger's usage
def extra_usage(ledger: Ledger) -> dict[str, dict[str, Any]]:
    """Role -> usage of agent runs that produced no trial row (e.g. a planner that stopped)."""
    raw = ledger.get_meta(EXTRA_USAGE)
    return json.loads(raw) if raw else {}


def add_extra_usage(ledger: Ledger, role: str, usage: AgentUsage) -> None:
    """Add ``usage`` of an agent run that left no trial row to the ledger meta (none: no-op)."""
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


# ---------------------------------------------------------------- llm_calls.jsonl
def call_record(role: str, model: str, u: Any) -> dict[str, Any]:
    """One Messages API call's cost: t (epoch s), role, model and its ``usage`` token counts.

    ``u`` is the response's ``usage`` (input_tokens, output_tokens, cache_read_input_tokens,
    cache_creation_input_tokens; the last two may be None).
    """
    return {"t": round(time.time(), 3), "role": role, "model": model,
            "input_tokens": u.input_tokens, "output_tokens": u.output_tokens,
            "cache_read_tokens": u.cache_read_input_tokens or 0,
            "cache_creation_tokens": u.cache_creation_input_tokens or 0}


def llm_calls_meter(path: Path) -> Meter:
    """A meter that appends every Messages API call's cost to ``path`` (one JSON line each)."""
    def record(call: dict[str, Any]) -> None:
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(call, sort_keys=True) + "\n")
    return record


def read_llm_calls(path: Path) -> dict[str, float] | None:
    """Totals of a run's ``llm_calls.jsonl`` (one line per Messages API call), or None if absent.

    Returns:
        ``calls`` and the summed ``input_tokens``, ``output_tokens``, ``cache_read_tokens`` and
        ``cache_creation_tokens``; a line that cannot be read (a write cut by a kill) is skipped.
    """
    if not path.is_file():
        return None
    out = {"calls": 0.0, **dict.fromkeys(TOKEN_KEYS, 0.0)}
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
                row = {k: float(rec.get(k, 0) or 0) for k in TOKEN_KEYS}
            except (ValueError, TypeError, AttributeError):
                continue
            out["calls"] += 1
            for k in TOKEN_KEYS:
                out[k] += row[k]
    return out


def spend_line(run_dir: Path, prices: dict[str, float]) -> str | None:
    """One line: the run's Messages API calls, tokens and estimated USD so far (None: no call).

    Read from ``run_dir/llm_calls.jsonl``; ``prices`` in USD per million tokens.
    """
    billed = read_llm_calls(run_dir / LLM_CALLS)
    if not billed or not billed["calls"]:
        return None
    tok = sum(v for k, v in billed.items() if k.endswith("_tokens"))
    return (f"LLM: {billed['calls']:,.0f} Messages API calls, {tok:,.0f} tokens, est. USD "
            f"{llm_cost_usd(billed, prices):.2f}")
