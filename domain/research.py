"""What research decides before a launch: which changes to research, and whether to drop one.

:func:`research_change` picks the ``knob=value`` of a candidate to research (the knobs of
:data:`RESEARCH_FLAGS`, each once per run); ``agents.research_questions`` turns it into the
scoped questions, the research subagents (``agents.research``) answer them, and
:func:`research_verdict` reads their outcomes: a source claim stating an SM (compute capability)
range that excludes the GPU drops the candidate, and :func:`domain.lesson_builders.
research_lesson` records why.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from domain.config import ServingConfig
from domain.hardware import get_gpu

# Knobs whose first use in a run is worth a research round before launching, and the SGLang
# flag (ServerArgs dest) each one sets: a backend choice, a speculative setting, a parallelism
# layout, a KV cache format or a HiCache size can fail at startup on some architectures.
RESEARCH_FLAGS = {"attention_backend": "attention_backend", "speculative": "speculative_algorithm",
                  "speculative_algorithm": "speculative_algorithm", "tp_size": "tp_size",
                  "kv_cache_dtype": "kv_cache_dtype", "hicache_ratio": "hicache_ratio",
                  "moe_runner_backend": "moe_runner_backend"}
_SM_BOUND = re.compile(r"SM\s*(>=|<=|>|<|==)\s*(\d+)", re.IGNORECASE)


def research_change(changed: str, seen_changes: Iterable[str] = frozenset()) -> str | None:
    """The 'knob=value' part of ``changed`` to research, or None.

    ``changed`` is one 'knob=value' (one-knob brains) or several joined by ', ' (space brains);
    the first part whose knob is in :data:`RESEARCH_FLAGS` and that no entry of
    ``seen_changes`` (split the same way) contains is the one.
    """
    done = {p for c in seen_changes for p in c.split(", ")}
    for part in changed.split(", ") if changed else []:
        if "=" in part and part not in done and part.split("=", 1)[0] in RESEARCH_FLAGS:
            return part
    return None


def research_verdict(outcomes: list[dict[str, Any]], config: ServingConfig) -> str | None:
    """Why research says not to launch ``config``, or None to launch it.

    Drops the candidate when an answered source claim about the value it sets states an SM
    (compute capability) range that excludes this GPU, e.g. "FlashAttention v3 Backend requires
    SM>=80 and SM<=90" for fa3 on a B200 (SM 100). Lessons that forbid the family already
    pruned it before research (``Planner.screen``); memory findings inform the report. The
    reason quotes the claim and its evidence.

    Args:
        outcomes: ``ResearchOutcome`` dumps (mode="json").
        config: the candidate.

    Raises:
        ConfigInvalid: ``config.gpu`` is not in the hardware catalog
            (:func:`domain.hardware.get_gpu`).
    """
    sm = get_gpu(config.gpu).sm_major * 10
    for o in outcomes:
        if o.get("status") != "answered":
            continue
        q = o.get("question") or {}
        value = str(q.get("value") or "")
        for c in (o.get("findings") or {}).get("claims") or []:
            text = str(c.get("text", ""))
            ev = "; ".join(str(e) for e in c.get("evidence", [])[:2])
            if q.get("kind") == "source" and (not value or value in text):
                bounds = _SM_BOUND.findall(text)
                if bounds and not all(_holds(sm, op, int(n)) for op, n in bounds):
                    return (f"{config.gpu} is SM {sm}, outside what the source requires: "
                            f"{' '.join(text.split())[:200]} [{ev}]")
    return None


def _holds(sm: int, op: str, n: int) -> bool:
    return {">=": sm >= n, "<=": sm <= n, ">": sm > n, "<": sm < n, "==": sm == n}[op]
