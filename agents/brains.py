"""Planner brains over the whole knob space: estimate-guided, a seeded grid, Optuna's TPE.

The study key ``search.brain`` picks the brain (:func:`make_planner`): ``ovat`` is
:class:`agents.planner.Planner` (one knob at a time from the current best), ``guided`` ranks
every combination by the steady-state estimate (:mod:`domain.estimate`) corrected by what the
run measured (:class:`GuidedPlanner`), ``grid`` walks every
combination of the study's knob values in a seeded order (:class:`GridPlanner`), ``tpe`` asks
Optuna's Tree-structured Parzen Estimator sampler, taught by the run's ledger, for the next
combination (:class:`TpePlanner`). All of them share :meth:`Planner.screen`: a candidate a lesson
forbids, or that the memory-fit estimate rules out, is pruned (and ledgered by the supervisor)
before anything launches, whichever brain proposed it. All keep :class:`Planner`'s
``step(best, seen, run_id, losers=None, history=()) -> PlanStep`` contract, so the supervisor and
the search benchmark drive them alike.

A point of the space is a tuple of value indices, one per knob in the study's knob order; its
config is the study's baseline with every knob set to its value (:func:`domain.knobs.apply_knob`,
so ``tp_size`` also sets the replicas and ``speculative`` its bundle). Several points can give the
same config (e.g. a knob set to the baseline's own value); the ``seen`` config ids deduplicate
them.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import optuna
from mcp import Client
from optuna.distributions import BaseDistribution, CategoricalDistribution

from agents.mcp_tools import ToolCallFailed, call
from agents.planner import NoViableConfig, Planner, PlanStep, Pruned, TrialPlan, _fmt
from domain.config import ServingConfig
from domain.errors import ConfigInvalid
from domain.estimate import Estimate, ReplayProfile, safe_estimate
from domain.knobs import apply_knob, normalize_value
from domain.lesson import STORED, Lesson
from domain.study import SaturationSpec, Study

Point = tuple[int, ...]

# Statuses whose config ran and measured an objective the sampler can learn from; every other
# search status (pruned by a lesson or the estimate, crash at startup, failed agent) is an
# infeasible point for TPE.
MEASURED = frozenset({"baseline", "keep", "discard", "finalist", "winner", "slo-miss"})

# Objective given to infeasible points (Optuna needs a value for a COMPLETE trial; the constraint
# already ranks them below every feasible one). tok/s/GPU is never negative.
INFEASIBLE_VALUE = 0.0

# Largest space the grid shuffles as a list (2**20 indices, ~40 MB of ints; a study's knob
# space is usually a few hundred points).
SHUFFLE_MAX = 2**20


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

    # -- the space ------------------------------------------------------------------------
    def config_of(self, point: Point) -> ServingConfig | None:
        """The config of ``point`` (baseline with every knob set), or None if it is invalid."""
        cfg = self.base
        try:
            for name, vals, i in zip(self.names, self.values, point, strict=True):
                cfg = apply_knob(cfg, name, vals[i], self.study.gpu_count)
        except ConfigInvalid:
            return None
        return cfg

    def point_of(self, config: ServingConfig) -> Point | None:
        """The point whose knob values ``config`` carries, or None if a knob matches no value.

        A knob has value ``v`` in ``config`` when setting it to ``v`` leaves ``config``
        unchanged, so bundles (speculative, tp_size with replicas) are read back exactly.
        """
        out: list[int] = []
        for name, vals in zip(self.names, self.values, strict=True):
            for i, v in enumerate(vals):
                try:
                    if apply_knob(config, name, v, self.study.gpu_count) == config:
                        out.append(i)
                        break
                except ConfigInvalid:
                    continue
            else:
                return None
        return tuple(out)

    def point_at(self, k: int) -> Point:
        """The ``k``-th point of the product in mixed radix (last knob fastest)."""
        out: list[int] = []
        for vals in reversed(self.values):
            k, r = divmod(k, len(vals))
            out.append(r)
        return tuple(reversed(out))

    def seeded_order(self) -> Iterator[Point]:
        """Every point of the space exactly once, in an order fixed by ``seed``.

        Up to :data:`SHUFFLE_MAX` points: a seeded shuffle of the product's indices. Larger
        spaces: a seeded affine permutation ``k -> (a*k + b) mod N`` with ``gcd(a, N) = 1``,
        O(1) per point and nothing materialised (more regular, still a permutation).
        """
        n = self.size
        if n == 0:
            return
        rng = random.Random(self.seed)
        if n <= SHUFFLE_MAX:
            order = list(range(n))
            rng.shuffle(order)
            for k in order:
                yield self.point_at(k)
            return
        a = rng.randrange(1, n + 1) if n > 1 else 1
        while math.gcd(a, n) != 1:
            a = rng.randrange(1, n + 1)
        b = rng.randrange(n)
        for k in range(n):
            yield self.point_at((a * k + b) % n)

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
                   "was tried or pruned"))


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


# Points the guided brain ranks at most per step (about 0.3 ms each on this machine's CPU); a
# larger space is ranked on a seeded sample of this many points plus every one-knob neighbour
# of the incumbent.
GUIDED_MAX_POINTS = 1 << 14
# Prior sd of the estimate's log error for one config: the estimators reference measures
# aiconfigurator's TPOT at 32 % mean absolute error against measured rows (sigma ~ 0.3).
SIGMA_PRIOR = 0.3
# Sd of what the per-knob-value model cannot explain (an error of one config alone, run noise),
# in log tok/s/GPU.
SIGMA_NOISE = 0.15
# Sd of the TTFT prediction's log error: the estimators reference has aiconfigurator's TTFT
# about 2x off (ln 2 ~ 0.7); servetune's queueing estimate is 3-4x pessimistic on the default
# study's long-prompt trace, which a learnt boundary (slo_gated) absorbs.
SIGMA_TTFT = 0.7
# Optimism of the ranking and of the stop rule: a point's throughput is taken this many
# posterior sds above its mean (2: a one-sided 97.7 % bound; 1 stopped 13 % of the benchmark's
# perturbed-prior searches short of 95 % of the optimum, 2 stops 3 %).
UCB_Z = 2.0
# Floor of the SLO probability in the score: the TTFT prior can be off by more than its sd, so
# where every config is predicted far over the SLO, throughput still orders them.
FEASIBLE_FLOOR = 0.05
# Predicted scores within this log-distance of each other (2 %) are ties (GuidedPlanner.proposals).
TIE = math.log(1.02)


@functools.lru_cache(maxsize=1 << 17)
def _estimate_cached(config: ServingConfig, sat: tuple[int, int, int, float],
                     replay: ReplayProfile | None) -> Estimate:
    """:func:`domain.estimate.safe_estimate`, memoised across steps (planners are per step).

    ``sat`` is the saturation spec as ``(isl, osl, concurrency, duration_s)`` (hashable).
    """
    isl, osl, conc, dur = sat
    spec = SaturationSpec(isl=isl, osl=osl, concurrency=conc, duration_s=dur)
    return safe_estimate(config, spec, replay)


class GuidedPlanner(SpacePlanner):
    """Estimate-guided brain: the whole space ranked by the steady-state prior, corrected online.

    Each step scores every point of the knob space and launches the best-scored unseen viable
    one (lessons and the memory fit screen it first, as for every brain). A point's score is
    its optimistic throughput times its probability of meeting the SLO:

    - **Throughput.** The prior is :mod:`domain.estimate`'s saturation tok/s/GPU. Each
      measured config gives a residual ``log(measured / predicted)``; a Bayesian linear model
      (:meth:`fit_residuals`) explains them by an intercept (an error shared by every config,
      which changes no ranking) plus one effect per knob value (prior sd ``SIGMA_PRIOR /
      sqrt(K)`` each for ``K`` knobs, so a config's prior error is :data:`SIGMA_PRIOR`;
      residual noise :data:`SIGMA_NOISE`). The point's corrected prediction is its prior times
      ``exp`` of the posterior mean, and its optimistic one :data:`UCB_Z` posterior sds above
      (upper confidence bound, Srinivas et al., ICML 2010): a knob value no measurement
      carries stays uncertain and is worth a launch; once measured to change nothing, its
      points keep only the per-config error :data:`SIGMA_NOISE` of optimism (router
      policies, HiCache ratios the saturation run cannot see).
    - **The SLO** (at least :data:`FEASIBLE_FLOOR` in the score, so throughput still orders
      configs that are all predicted far over the SLO). ``P(ratio x e <= theta)`` with
      ``ratio`` the predicted replay TTFT p99 over
      the SLO and ``log e ~ N(0, SIGMA_TTFT^2)``: a standard normal CDF at ``(log theta - log
      ratio) / SIGMA_TTFT`` (probability of feasibility, as in constrained Bayesian
      optimisation, Gardner et al., ICML 2014); 1 without a replay profile, 0 when the pool
      is predicted overloaded. ``theta`` starts at 1 and, when ``slo_gated`` (a launch that
      ran but scored no objective missed the SLO or was invalid), moves to the boundary that
      misclassifies the fewest launched configs (:func:`best_threshold`).

    Scores within :data:`TIE` tie; ties go to fewer knobs changed from the incumbent (no knob
    moves without a predicted reason), then to fewer set flags. Points a stored lesson forbids
    rank last (:meth:`lessons_for_gpu`); points the memory fit rules out are never proposed.
    The brain stops (``NoViableConfig``) once no untried point's optimistic throughput beats
    the incumbent's measured one by the study's ``min_improvement``: the search has converged
    as far as the estimate and the measurements can tell. The bar ignores the SLO (a fast
    config predicted to miss it keeps the search going) and, with the per-config error in
    every untried bound, needs every untried point predicted about 25 % below the incumbent,
    so a study's ``patience`` often ends the search first. The SLO boundary is soft: a config
    predicted exactly at a missed config's ratio keeps half its score.

    Args (beyond :class:`SpacePlanner`'s):
        replay: profile of the study's replay window (None: no SLO prior).
        estimator: ``config -> Estimate`` replacing :func:`domain.estimate.safe_estimate` (the
            search benchmark passes a deliberately wrong one to measure robustness).
        slo_gated: objectives in the history are SLO-gated (see above). The product's search
            scores the saturation run alone, so its history says nothing of the SLO: False.
    """

    brain = "guided"

    def __init__(self, study: Study, lessons: Client, *, seed: int | None = None,
                 replay: ReplayProfile | None = None,
                 estimator: Callable[[ServingConfig], Estimate] | None = None,
                 slo_gated: bool = False) -> None:
        super().__init__(study, lessons, seed=seed)
        self.replay, self.slo_gated = replay, slo_gated
        sat = study.saturation
        key = (sat.isl, sat.osl, sat.concurrency, sat.duration_s)
        self.estimator = estimator or (lambda c: _estimate_cached(c, key, replay))
        self._est: dict[ServingConfig, Estimate] = {}
        self.theta = 1.0
        self._ranked: dict[Point, tuple[float, float, float, float]] = {}
        self._best: ServingConfig | None = None
        self.stop_reason: str | None = None
        self.known_lessons: list[Lesson] = []
        self._offsets = [0]
        for vals in self.values:
            self._offsets.append(self._offsets[-1] + len(vals))
        self._mean = np.zeros(self._offsets[-1])
        self._cov = np.eye(self._offsets[-1]) * self.tau ** 2
        self._c = 0.0

    @property
    def tau(self) -> float:
        """Prior sd of one knob value's effect (log tok/s/GPU)."""
        return SIGMA_PRIOR / math.sqrt(max(1, len(self.values)))

    async def step(self, best: ServingConfig, seen: set[str], run_id: str,
                   losers: dict[str, str] | None = None,
                   history: Sequence[Any] = ()) -> PlanStep:
        """:meth:`SpacePlanner.step`; the plan's ``predicted`` gains the brain's prior.

        ``predicted`` adds ``output_tok_s_per_gpu`` (the corrected prediction the ranking
        used) and, with a replay profile, ``replay_utilization`` and ``replay_ttft_p99_ms``
        (None when predicted unbounded), for the report's predicted-vs-measured table.
        ``best`` also seeds the candidates of a space too large to rank whole.
        """
        self._best = best
        self.stop_reason = None
        self.known_lessons = await self.lessons_for_gpu()
        step = await super().step(best, seen, run_id, losers, history)
        plan = step.decision
        if isinstance(plan, TrialPlan):
            point = self.point_of(plan.config)
            ranked = self._ranked.get(point) if point is not None else None
            extra = self.prediction(plan.config, ranked[0] if ranked else None)
            step = step.model_copy(update={"decision": plan.model_copy(
                update={"predicted": {**plan.predicted, **extra}})})
        elif self.stop_reason is not None:
            step = step.model_copy(update={"decision": NoViableConfig(reason=self.stop_reason)})
        return step

    async def lessons_for_gpu(self) -> list[Lesson]:
        """Every stored lesson for the study's GPU (or any GPU), through the lessons server.

        Points a lesson forbids rank after every other point (screening would prune them
        anyway; ranked first they would only fill the ledger with pruned rows). An unreachable
        store gives none: screening still asks it before any launch.
        """
        out: list[Lesson] = []
        start: int | None = 0
        try:
            while start is not None and len(out) < 10_000:
                page = await call(self.lessons, "list_lessons",
                                  {"gpu": self.study.gpu, "start": start, "max_items": 200})
                # as stored: a lesson whose condition names no family is kept, forbids nothing
                out += [Lesson.model_validate(x, context=STORED)
                        for x in page.get("items", [])]
                start = page.get("next_start")
        except ToolCallFailed:
            return out
        return out

    def estimate(self, config: ServingConfig) -> Estimate:
        """The prior of ``config`` (cached)."""
        est = self._est.get(config)
        if est is None:
            est = self._est[config] = self.estimator(config)
        return est

    def ratio(self, est: Estimate) -> float:
        """Predicted TTFT p99 over the SLO (0 without a replay profile; inf if it cannot fit)."""
        if not est.fits:
            return math.inf
        if self.replay is None:
            return 0.0
        return est.slo_ratio(self.study.slo.ttft_p99_ms)

    def feasible(self, ratio: float) -> float:
        """Probability that a config of predicted TTFT ratio ``ratio`` meets the SLO."""
        if ratio <= 0:
            return 1.0
        if not math.isfinite(ratio):
            return 0.0
        from scipy.stats import norm  # here: scipy.stats takes about 1 s to import

        return float(norm.cdf((math.log(self.theta) - math.log(ratio)) / SIGMA_TTFT))

    def candidates(self, best: ServingConfig | None = None) -> list[Point]:
        """Points to rank: the whole space, or a seeded sample plus ``best``'s neighbours."""
        if self.size <= GUIDED_MAX_POINTS:
            return [self.point_at(k) for k in range(self.size)]
        pts = list(itertools.islice(self.seeded_order(), GUIDED_MAX_POINTS))
        bp = self.point_of(best) if best is not None else None
        if bp is not None:
            for j, vals in enumerate(self.values):
                pts += [bp[:j] + (i,) + bp[j + 1:] for i in range(len(vals))]
        return list(dict.fromkeys(pts))

    def learn(self, history: Sequence[Any]) -> list[tuple[Point, float]]:
        """Residuals ``(point, log(measured / predicted))`` of the measured configs; sets theta."""
        residuals: list[tuple[Point, float]] = []
        labelled: list[tuple[float, bool]] = []
        for t in history:
            if t.status not in MEASURED:
                continue
            point = self.point_of(t.config)
            est = self.estimate(t.config)
            if t.objective is not None and est.output_tok_s_per_gpu > 0 and t.objective > 0 \
                    and point is not None:
                residuals.append((point, math.log(t.objective / est.output_tok_s_per_gpu)))
            if self.slo_gated:
                labelled.append((self.ratio(est), t.objective is not None))
        self.theta = best_threshold(labelled)
        return residuals

    def fit_residuals(self, residuals: list[tuple[Point, float]]) -> None:
        """Posterior of the log-residual model (Bayesian linear regression, conjugate normal).

        ``r = c + X b + noise``: ``X`` one-hot knob values, ``b ~ N(0, tau^2 I)``, noise
        ``N(0, SIGMA_NOISE^2)``, ``c`` the residuals' mean. Posterior covariance ``(X'X /
        s^2 + I / tau^2)^-1``, mean ``cov X' (r - c) / s^2`` (Bishop, "Pattern Recognition and
        Machine Learning", 2006, section 3.3).
        """
        n = self._offsets[-1]
        self._c = 0.0
        self._mean = np.zeros(n)
        self._cov = np.eye(n) * self.tau ** 2
        if not residuals:
            return
        r = np.array([x for _, x in residuals])
        self._c = float(r.mean())
        x = np.zeros((len(residuals), n))
        for row, (p, _) in enumerate(residuals):
            x[row, [self._offsets[j] + i for j, i in enumerate(p)]] = 1.0
        s2 = SIGMA_NOISE ** 2
        self._cov = np.linalg.inv(x.T @ x / s2 + np.eye(n) / self.tau ** 2)
        self._mean = self._cov @ x.T @ (r - self._c) / s2

    def corrected(self, point: Point, est: Estimate) -> tuple[float, float]:
        """(mean, optimistic) predicted tok/s/GPU of ``point`` under the residual posterior."""
        idx = [self._offsets[j] + i for j, i in enumerate(point)]
        mean = self._c + float(self._mean[idx].sum())
        # an untried config: the effects' posterior plus its own error the effects miss
        sd = math.sqrt(max(0.0, float(self._cov[np.ix_(idx, idx)].sum())) + SIGMA_NOISE ** 2)
        base = est.output_tok_s_per_gpu
        return base * math.exp(mean), base * math.exp(mean + UCB_Z * sd)

    def proposals(self, history: Sequence[Any]) -> Iterator[Point]:
        """Untried candidate points, best score first (see the class docstring).

        Ends early, setting ``stop_reason``, where no remaining point's optimistic
        throughput beats the incumbent by ``min_improvement``.
        """
        self.fit_residuals(self.learn(history))
        tried = {t.config for t in history}
        incumbent = max((t.objective for t in history
                         if t.status in MEASURED and t.objective is not None), default=None)
        bp = self.point_of(self._best) if self._best is not None else None
        keyed = []
        for point in self.candidates(self._best):
            cfg = self.config_of(point)
            if cfg is None or cfg in tried:
                continue
            est = self.estimate(cfg)
            if not est.fits:
                continue  # the memory fit or the engine rules it out: never a candidate
            mean, upper = self.corrected(point, est)
            ratio = self.ratio(est)
            p_slo = self.feasible(ratio)
            self._ranked[point] = (mean, ratio, upper, p_slo)
            score = upper * max(FEASIBLE_FLOOR, p_slo)
            moved = 0 if bp is None else sum(a != b for a, b in zip(bp, point, strict=True))
            forbidden = any(lesson.forbids(cfg) for lesson in self.known_lessons)
            key = (int(forbidden), -round(math.log(max(score, 1e-300)) / TIE), moved,
                   len(cfg.set_fields()))
            keyed.append((key, point, upper))
        keyed.sort(key=lambda k: k[0])
        bar = None if incumbent is None else incumbent * (1 + self.study.min_improvement)
        below = 0
        for _, point, upper in keyed:
            if bar is not None and upper <= bar:
                below += 1
                continue
            yield point
        if below:
            self.stop_reason = (
                f"{self.brain}: converged: no untried config of the knob space is predicted to "
                f"beat the incumbent's {incumbent:,.1f} tok/s/GPU by min_improvement "
                f"{self.study.min_improvement:.0%}, even {UCB_Z:g} sd above the corrected "
                "estimate")

    def prediction(self, config: ServingConfig, corrected: float | None = None) -> dict[str, Any]:
        """The brain's prediction for ``config`` as ``TrialPlan.predicted`` entries.

        ``output_tok_s_per_gpu`` (``corrected``, the posterior mean the ranking used, else the
        raw estimate) and, with a replay profile, ``replay_utilization`` and
        ``replay_ttft_p99_ms`` (None when predicted unbounded). Empty when the estimate rules
        the config out.
        """
        est = self.estimate(config)
        if not est.fits:
            return {}
        out: dict[str, Any] = {"output_tok_s_per_gpu": round(
            est.output_tok_s_per_gpu if corrected is None else corrected, 1)}
        if self.replay is not None:
            out["replay_utilization"] = round(est.utilization, 3) \
                if math.isfinite(est.utilization) else None
            out["replay_ttft_p99_ms"] = round(est.ttft_p99_ms) \
                if math.isfinite(est.ttft_p99_ms) else None
        return out

    def why(self, point: Point, rationale: str) -> str:
        """The rationale: corrected prediction, its optimistic bound, the SLO odds."""
        mean, ratio, upper, p_slo = self._ranked.get(point, (0.0, math.inf, 0.0, 0.0))
        slo = ("" if self.replay is None else
               f"; predicted replay TTFT p99 {ratio:.2f}x the SLO (boundary {self.theta:.2f}x), "
               f"P(meets the SLO) {p_slo:.2f}")
        return (f"predicted {mean:,.0f} tok/s/GPU (optimistic bound {upper:,.0f}){slo}; "
                f"{rationale}")


def best_threshold(labelled: Sequence[tuple[float, bool]]) -> float:
    """The boundary on the predicted TTFT ratio that best separates feasible from not.

    Args:
        labelled: ``(predicted ratio, met the SLO)`` of every launched config.

    Returns:
        1.0 without labels; else the threshold (1.0 or one of the ratios, or just below an
        infeasible one) with the fewest feasible configs above it plus infeasible ones at or
        below it, the one nearest 1.0 (in log) among ties.
    """
    if not labelled:
        return 1.0
    cands = {1.0}
    for r, _ in labelled:
        if math.isfinite(r) and r > 0:
            cands.update((r, r * (1 - 1e-9)))
        elif r == math.inf:
            cands.add(math.inf)

    def errors(th: float) -> int:
        return sum((r <= th) != ok for r, ok in labelled)

    return min(cands, key=lambda th: (errors(th), abs(math.log(th)) if math.isfinite(th) and
                                      th > 0 else math.inf))


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
