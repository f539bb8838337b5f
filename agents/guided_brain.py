"""Estimate-guided brain (``search.brain: guided``): the knob space ranked by the estimate.

The whole space is ranked by the steady-state estimate (:mod:`domain.estimate`), corrected by
what the run measured. The maths (residual model, UCB, P(meets the SLO), the learnt boundary,
score ties, the stop bar) is :mod:`domain.search`; this module binds it to a study, the run's
ledger and the lessons server (:class:`GuidedPlanner`).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from mcp import Client

from agents.mcp_tools import ToolCallFailed, call
from agents.planner import NoViableConfig, PlanStep, TrialPlan
from agents.space_brains import MEASURED, SpacePlanner
from domain.config import ServingConfig
from domain.estimate import Estimate, ReplayProfile, safe_estimate
from domain.lesson import STORED, Lesson
from domain.search import (
    UCB_Z,
    Point,
    ResidualModel,
    best_threshold,
    log_residual,
    p_meets_slo,
    score,
    score_bucket,
    slo_ratio,
    stop_bar,
)
from domain.study import SaturationSpec, Study

# Points the guided brain ranks at most per step (about 0.3 ms each on this machine's CPU); a
# larger space is ranked on a seeded sample of this many points plus every one-knob neighbour
# of the incumbent.
GUIDED_MAX_POINTS = 1 << 14


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
      (:class:`domain.search.ResidualModel`) explains them by an intercept (an error shared by
      every config, which changes no ranking) plus one effect per knob value (prior sd
      ``SIGMA_PRIOR / sqrt(K)`` each for ``K`` knobs, so a config's prior error is
      ``SIGMA_PRIOR``; residual noise ``SIGMA_NOISE``; constants of :mod:`domain.search`). The
      point's corrected prediction is its prior times ``exp`` of the posterior mean, and its
      optimistic one ``UCB_Z`` posterior sds above (upper confidence bound, Srinivas et al.,
      ICML 2010): a knob value no measurement carries stays uncertain and is worth a launch;
      once measured to change nothing, its points keep only the per-config error
      ``SIGMA_NOISE`` of optimism (router policies, HiCache ratios the saturation run cannot
      see).
    - **The SLO** (at least ``FEASIBLE_FLOOR`` in the score, so throughput still orders
      configs that are all predicted far over the SLO). ``P(ratio x e <= theta)`` with
      ``ratio`` the predicted replay TTFT p99 over the SLO and ``log e ~ N(0, SIGMA_TTFT^2)``
      (:func:`domain.search.p_meets_slo`): a standard normal CDF at ``(log theta - log
      ratio) / SIGMA_TTFT`` (probability of feasibility, as in constrained Bayesian
      optimisation, Gardner et al., ICML 2014); 1 without a replay profile, 0 when the pool
      is predicted overloaded. ``theta`` starts at 1 and, when ``slo_gated`` (a launch that
      ran but scored no objective missed the SLO or was invalid), moves to the boundary that
      misclassifies the fewest launched configs (:func:`domain.search.best_threshold`).

    Scores within ``TIE`` tie (:func:`domain.search.score_bucket`); ties go to fewer knobs
    changed from the incumbent (no knob moves without a predicted reason), then to fewer set
    flags. Points a stored lesson forbids
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
        self.model = ResidualModel([len(v) for v in self.values])

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
        return slo_ratio(est, None if self.replay is None else self.study.slo.ttft_p99_ms)

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
            r = log_residual(t.objective, est.output_tok_s_per_gpu)
            if r is not None and point is not None:
                residuals.append((point, r))
            if self.slo_gated:
                labelled.append((self.ratio(est), t.objective is not None))
        self.theta = best_threshold(labelled)
        return residuals

    def proposals(self, history: Sequence[Any]) -> Iterator[Point]:
        """Untried candidate points, best score first (see the class docstring).

        Ends early, setting ``stop_reason``, where no remaining point's optimistic
        throughput beats the incumbent by ``min_improvement``.
        """
        self.model.fit(self.learn(history))
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
            mean, upper = self.model.corrected(point, est.output_tok_s_per_gpu)
            ratio = self.ratio(est)
            p_slo = p_meets_slo(ratio, self.theta)
            self._ranked[point] = (mean, ratio, upper, p_slo)
            moved = 0 if bp is None else sum(a != b for a, b in zip(bp, point, strict=True))
            forbidden = any(lesson.forbids(cfg) for lesson in self.known_lessons)
            key = (int(forbidden), -score_bucket(score(upper, p_slo)), moved,
                   len(cfg.set_fields()))
            keyed.append((key, point, upper))
        keyed.sort(key=lambda k: k[0])
        bar = stop_bar(incumbent, self.study.min_improvement)
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
