"""The brains that search the whole product of the knob values: a seeded grid and Optuna's TPE.

:class:`SpacePlanner` is their shared machinery (points of the space, their configs, the screened
step); :class:`GridPlanner` walks every combination in a seeded order
(:func:`domain.search.seeded_permutation`), :class:`TpePlanner` asks Optuna's Tree-structured
Parzen Estimator, taught by the run's ledger. The estimate-guided brain
(``agents.guided_brain.GuidedPlanner``) is a :class:`SpacePlanner` too;
``agents.brains.make_planner`` picks among them by ``search.brain``.

A point of the space is a tuple of value indices, one per knob in the study's knob order; its
config is the study's baseline with every knob set to its value at once
(:func:`domain.knobs.apply_knobs`, so ``tp_size`` also sets the replicas, ``speculative`` its
bundle, and the coupled layout knobs move together; a combination the layout rules refuse is no
config and is skipped with its reason). Several points can give the
same config (e.g. a knob set to the baseline's own value); the ``seen`` config ids deduplicate
them.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

import optuna
from mcp import Client
from optuna.distributions import BaseDistribution, CategoricalDistribution

from agents.planner import NoViableConfig, Planner, PlanStep, Pruned, _fmt
from domain.config import ServingConfig
from domain.errors import ConfigInvalid
from domain.knobs import apply_knob, apply_knobs, normalize_value
from domain.search import Point, point_at, seeded_permutation
from domain.study import Study

# Statuses whose config ran and measured an objective the sampler can learn from; every other
# search status (pruned by a lesson or the estimate, crash at startup, failed agent) is an
# infeasible point for TPE.
MEASURED = frozenset({"baseline", "keep", "discard", "finalist", "winner", "slo-miss"})

# Objective given to infeasible points (Optuna needs a value for a COMPLETE trial; the constraint
# already ranks them below every feasible one). tok/s/GPU is never negative.
INFEASIBLE_VALUE = 0.0


class SpacePlanner(Planner, ABC):
    """Shared machinery of the brains that search the whole product of the knob values.

    Subclasses implement :meth:`proposals`; :meth:`step` screens each proposal and returns the
    first viable one. ``losers`` (one-knob regressions from an earlier incumbent) do not apply:
    they are local statements about ``ovat`` steps, and TPE learns regressions from ``history``.
    """

    brain = "space"

    def __init__(self, study: Study, lessons: Client, *, seed: int | None = None) -> None:
        """Brain over ``study``'s knob space; ``seed`` defaults to the study's ``search.seed``."""
        super().__init__(study, lessons)
        self.seed = study.search.seed if seed is None else seed
        self.names: list[str] = list(study.knobs)
        self.values: list[list[Any]] = [list(v) for v in study.knobs.values()]
        self.size = math.prod(len(v) for v in self.values) if self.values else 0
        self.base = study.base_config()
        self._configs: dict[Point, ServingConfig | None] = {}  # config_of, memoised

    # -- the space ------------------------------------------------------------------------
    def config_of(self, point: Point) -> ServingConfig | None:
        """The config of ``point`` (baseline with every knob set), or None if it is invalid.

        The knobs are set at once (:func:`domain.knobs.apply_knobs`), so coupled layout knobs
        (``attn_dp_size`` under ``tp_size``, ``ep_size`` with ``moe_a2a_backend``, ``pd``)
        hold in any knob order; a combination the layout rules refuse is None, its reason in
        :attr:`skipped` (never launched, never a crash).
        """
        hit = self._configs.get(point, False)
        if hit is not False:
            return hit
        settings = {name: vals[i]
                    for name, vals, i in zip(self.names, self.values, point, strict=True)}
        try:
            cfg: ServingConfig | None = apply_knobs(self.base, settings, self.study.gpu_count)
        except ConfigInvalid as e:
            self.skipped[self.changed_text(point)] = "; ".join(e.violations)
            cfg = None
        self._configs[point] = cfg
        return cfg

    def point_of(self, config: ServingConfig) -> Point | None:
        """The point whose knob values ``config`` carries, or None if a knob matches no value.

        A knob has value ``v`` in ``config`` when setting it to ``v`` leaves ``config``
        unchanged, so bundles (speculative, tp_size with replicas) are read back exactly.
        Coupled layout knobs may match several values (``ep_size 4`` and ``8`` under an a2a
        backend that forces ``ep_size = tp_size``): the first combination whose
        :meth:`config_of` is ``config`` wins.
        """
        matches: list[list[int]] = []
        for name, vals in zip(self.names, self.values, strict=True):
            hits = []
            for i, v in enumerate(vals):
                try:
                    if apply_knob(config, name, v, self.study.gpu_count) == config:
                        hits.append(i)
                except ConfigInvalid:
                    continue
            if not hits:
                return None
            matches.append(hits)
        if all(len(h) == 1 for h in matches):
            return tuple(h[0] for h in matches)
        for point in itertools.islice(itertools.product(*matches), 256):
            if self.config_of(point) == config:
                return tuple(point)
        return tuple(h[0] for h in matches)

    def point_at(self, k: int) -> Point:
        """The ``k``-th point of the product (:func:`domain.search.point_at`)."""
        return point_at(k, [len(v) for v in self.values])

    def seeded_order(self) -> Iterator[Point]:
        """Every point of the space exactly once, in an order fixed by ``seed``.

        The points of :func:`domain.search.seeded_permutation` of the product's indices.
        """
        for k in seeded_permutation(self.size, self.seed):
            yield self.point_at(k)

    def changed_text(self, point: Point) -> str:
        """'knob=value' of every knob of ``point`` (', '-joined)."""
        return ", ".join(f"{n}={_fmt(normalize_value(self.values[j][i]))}"
                         for j, (n, i) in enumerate(zip(self.names, point, strict=True)))

    def changed(self, best: ServingConfig, point: Point) -> str:
        """'knob=value' for each knob where ``point`` differs from ``best`` (', '-joined)."""
        bp = self.point_of(best)
        parts = [f"{n}={_fmt(normalize_value(self.values[j][i]))}"
                 for j, (n, i) in enumerate(zip(self.names, point, strict=True))
                 if bp is None or bp[j] != i]
        return ", ".join(parts)

    # -- the step -------------------------------------------------------------------------
    @abstractmethod
    def proposals(self, history: Sequence[Any]) -> Iterator[Point]:
        """Points to try, best guess first (subclasses); :meth:`feedback` hears each outcome."""

    def feedback(self, point: Point, value: float | None) -> None:
        """Outcome of the last proposal: its objective, or None when it is infeasible."""

    def why(self, point: Point, rationale: str) -> str:
        """The launched proposal's rationale (subclasses add what made them pick it)."""
        return rationale

    async def step(self, best: ServingConfig, seen: set[str], run_id: str,
                   losers: dict[str, str] | None = None,
                   history: Sequence[Any] = ()) -> PlanStep:
        """Next candidate from the whole space, screened, skipping config ids in ``seen``.

        Args:
            best: the incumbent (``changed`` is written relative to it).
            seen: config ids already launched or pruned in this run (updated in place).
            run_id: recorded on new lessons.
            losers: ignored (see the class docstring).
            history: the run's search trials (ledger ``Trial`` rows, ledger order).

        Returns:
            PlanStep with the candidates pruned on the way and the first viable one, or
            NoViableConfig once every point of the space was tried or pruned.
        """
        pruned: list[Pruned] = []
        measured = {t.config.config_id(): t.objective for t in history
                    if t.status in MEASURED and t.objective is not None}
        self.remember(best)
        for t in history:
            if t.status in MEASURED:
                self.remember(t.config)
        for point in self.proposals(history):
            cand = self.config_of(point)
            if cand is None:
                self.feedback(point, None)
                continue
            cid = cand.config_id()
            if cid in seen:
                self.feedback(point, measured.get(cid))
                continue
            twin = self.equivalent(cand)
            if twin is not None:  # the engine would run it exactly like a measured config
                seen.add(cid)
                self.feedback(point, measured.get(twin))
                continue
            verdict = await self.screen(cand, self.changed(best, point), run_id)
            seen.add(cid)
            if isinstance(verdict, Pruned):
                pruned.append(verdict)
                self.feedback(point, None)
                continue
            self.remember(cand)
            return PlanStep(pruned=pruned, decision=verdict.model_copy(update={
                "rationale": f"{self.brain}: {self.why(point, verdict.rationale)}"}))
        return PlanStep(pruned=pruned, decision=NoViableConfig(
            reason=f"{self.brain}: every config of the knob space ({self.size} combinations) "
                   "was tried or pruned" + self.skipped_note()))


class GridPlanner(SpacePlanner):
    """Grid brain: every combination of the knob values, in a seeded order (:meth:`seeded_order`).

    Stateless between steps: each step walks the same order and launches the first unseen
    viable point, so a resumed run continues where it stopped.
    """

    brain = "grid"

    def proposals(self, history: Sequence[Any]) -> Iterator[Point]:
        """The seeded order of the whole space."""
        return self.seeded_order()


class TpePlanner(SpacePlanner):
    """TPE brain: Optuna's TPESampler, rebuilt each step from the run's ledger.

    Each search trial of ``history`` becomes a finished Optuna trial of the same point: a
    measured one with its objective (maximised), a pruned, crashed or failed one infeasible
    (Optuna 5 constraint ``viable = 1.0``; the deprecated ``constraints_func`` of the sampler
    is replaced by per-trial constraints, which TPE ranks below every feasible trial). The
    sampler (seed ``seed + len(history)``, so a resumed run proposes the same) then proposes up
    to ``max_asks`` points; a point already seen is told its known outcome, a pruned one is
    told infeasible, and the first viable unseen point launches. When TPE keeps proposing
    seen points (a small, mostly explored space) the seeded grid order finishes the step, so
    the brain only stops once the whole space was tried or pruned.

    Args (beyond :class:`SpacePlanner`'s):
        n_startup_trials: random proposals before TPE models the history (Optuna's default
            is 10; 5 suits the 12-20 launch budgets of a serving study).
        max_asks: TPE proposals per step before falling back to the grid order.
    """

    brain = "tpe"

    def __init__(self, study: Study, lessons: Client, *, seed: int | None = None,
                 n_startup_trials: int = 5, max_asks: int = 64) -> None:
        super().__init__(study, lessons, seed=seed)
        self.n_startup_trials, self.max_asks = n_startup_trials, max_asks
        self.dists: dict[str, BaseDistribution] = {
            n: CategoricalDistribution(tuple(range(len(v))))
            for n, v in zip(self.names, self.values, strict=True)}
        self.optuna: optuna.Study | None = None
        self._asked: optuna.Trial | None = None

    def build(self, history: Sequence[Any]) -> optuna.Study:
        """An in-memory Optuna study holding ``history`` as finished trials (see class doc)."""
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        sampler = optuna.samplers.TPESampler(seed=self.seed + len(history), multivariate=True,
                                             n_startup_trials=self.n_startup_trials)
        st = optuna.create_study(direction="maximize", sampler=sampler)
        done: set[str] = set()
        for t in history:
            cid = t.config.config_id()
            point = self.point_of(t.config)
            if point is None or cid in done:
                continue
            done.add(cid)
            ok = t.status in MEASURED and t.objective is not None
            st.add_trial(optuna.trial.create_trial(
                params=dict(zip(self.names, point, strict=True)), distributions=self.dists,
                value=float(t.objective) if ok else INFEASIBLE_VALUE,
                constraints={"viable": 0.0 if ok else 1.0}))
        return st

    def proposals(self, history: Sequence[Any]) -> Iterator[Point]:
        """``max_asks`` TPE proposals, then the seeded grid order."""
        self.optuna = self.build(history)
        for _ in range(self.max_asks):
            self._asked = self.optuna.ask(self.dists)
            point = tuple(int(self._asked.params[n]) for n in self.names)
            yield point
            if self._asked is not None:  # launched (the generator is closed) or fed back
                self.feedback(point, None)
        self._asked = None
        yield from self.seeded_order()

    def feedback(self, point: Point, value: float | None) -> None:
        """Tell the open Optuna trial its outcome (None: infeasible)."""
        if self.optuna is None or self._asked is None:
            return
        trial, self._asked = self._asked, None
        trial.set_constraint("viable", 0.0 if value is not None else 1.0)
        self.optuna.tell(trial, INFEASIBLE_VALUE if value is None else float(value))
