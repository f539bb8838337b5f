"""The planner brains and :func:`make_planner`, which picks one by ``search.brain``.

The study key ``search.brain`` picks the brain (:func:`make_planner`): ``ovat`` is
:class:`agents.planner.Planner` (one knob at a time from the current best), ``guided`` ranks
every combination by the steady-state estimate (:mod:`domain.estimate`) corrected by what the
run measured (:class:`agents.guided_brain.GuidedPlanner`), ``grid`` walks every combination of
the study's knob values in a seeded order (:class:`agents.space_brains.GridPlanner`), ``tpe``
asks Optuna's Tree-structured Parzen Estimator sampler, taught by the run's ledger, for the
next combination (:class:`agents.space_brains.TpePlanner`). The Claude planner
(``agents.claude_planner.ClaudePlanner``) replaces ``ovat`` when the run has Claude agents
(``graph.supervisor``). All of them share :meth:`Planner.screen`: a candidate a lesson
forbids, or that the memory-fit estimate rules out, is pruned (and ledgered by the supervisor)
before anything launches, whichever brain proposed it. All keep :class:`Planner`'s
``step(best, seen, run_id, losers=None, history=()) -> PlanStep`` contract, so the supervisor and
the search benchmark drive them alike.
"""

from __future__ import annotations

from typing import Any

from mcp import Client

from agents.guided_brain import GuidedPlanner
from agents.planner import Planner
from agents.space_brains import GridPlanner, TpePlanner
from domain.estimate import ReplayProfile
from domain.study import Study


def make_planner(study: Study, lessons: Client, *, brain: str | None = None,
                 seed: int | None = None, replay: ReplayProfile | None = None,
                 **guided: Any) -> Planner:
    """The deterministic planner brain for ``study``.

    Args:
        study: the study (its ``search.brain`` and ``search.seed`` are the defaults).
        lessons: a client of the lessons MCP server (screening asks it).
        brain: ``ovat``, ``guided``, ``grid`` or ``tpe``; overrides ``study.search.brain``.
        seed: overrides ``study.search.seed`` (grid order, TPE sampler).
        replay: the replay window's profile, for the guided brain's SLO prior.
        guided: further keyword arguments of :class:`GuidedPlanner` (``estimator``,
            ``slo_gated``); ignored by the other brains.

    Raises:
        ValueError: an unknown brain.
    """
    which = brain or study.search.brain
    if which == "ovat":
        return Planner(study, lessons)
    if which == "guided":
        return GuidedPlanner(study, lessons, seed=seed, replay=replay, **guided)
    if which == "grid":
        return GridPlanner(study, lessons, seed=seed)
    if which == "tpe":
        return TpePlanner(study, lessons, seed=seed)
    raise ValueError(f"unknown planner brain {which!r}; known: ovat, guided, grid, tpe")
