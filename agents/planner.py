"""Planner agent: the plan models and the deterministic one-knob-at-a-time brain.

Job: propose the next candidate, one knob changed from the current best,
after pruning what lessons forbid and what the memory-fit estimate clearly rules out (each such
estimate becomes a lesson whose evidence is the arithmetic: ``domain.lesson_builders``).
Neighbours are tried in the order of the estimate's predicted benefit
(``Planner.ordered``), and one the engine would run exactly like the incumbent or an earlier
launch is never launched (``resolved_settings``). When speculative decoding's default admission
cap (48) is what holds the incumbent down, raising ``max_running_requests`` is tried before any
move that drops speculation (:func:`spec_cap_target`).

:class:`Planner` (deterministic, ``search.brain: ovat``) launches the first viable neighbour in
that order; ``agents.claude_planner.ClaudePlanner`` screens every neighbour the same way and
lets Claude pick; the space brains (``agents.brains``) share :meth:`Planner.screen`. Output:
:class:`PlanStep` carrying ``TrialPlan | NoViableConfig | PlannerFailed`` plus the candidates
pruned on the way. After a research round, ``decide`` keeps, modifies or drops the candidate
(:class:`Decision`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Literal

from mcp import Client
from pydantic import BaseModel

from agents.mcp_tools import call
from domain.config import ServingConfig
from domain.engines import resolved_settings
from domain.errors import ConfigInvalid, DoesNotFit
from domain.fit import fit
from domain.knobs import apply_knob, normalize_value
from domain.lesson import Lesson
from domain.lesson_builders import estimate_lesson, research_lesson
from domain.research import research_verdict
from domain.speculative import SPEC_MAX_RUNNING_REQUESTS
from domain.study import Study


class TrialPlan(BaseModel):
    """Launch this config next."""

    kind: Literal["plan"] = "plan"
    config: ServingConfig
    changed: str
    rationale: str
    predicted: dict[str, Any] = {}


class NoViableConfig(BaseModel):
    """Nothing left to try from the current best."""

    kind: Literal["none"] = "none"
    reason: str


class Pruned(BaseModel):
    """A candidate dropped before launch."""

    config: ServingConfig
    changed: str
    reason: str
    lesson_ids: list[str]
    new_lesson: Lesson | None = None


class PlannerFailed(BaseModel):
    """The planner's agent gave no valid answer (invalid twice, or its budget ran out)."""

    kind: Literal["failed"] = "failed"
    reason: str


class PlanStep(BaseModel):
    """The planner's output for one step."""

    pruned: list[Pruned]
    decision: TrialPlan | NoViableConfig | PlannerFailed


class Decision(BaseModel):
    """What the planner does with a candidate after research.

    ``plan`` is the candidate launched instead (modify only); ``lesson`` is written when the
    evidence shows the engine refuses the value on this GPU (drop or modify).
    """

    decision: Literal["keep", "modify", "drop"]
    reason: str
    evidence: list[str] = []
    plan: TrialPlan | None = None
    lesson: Lesson | None = None


def _fmt(v: Any) -> str:
    return "unset" if v is None else str(v)


def decode_schedulers(config: ServingConfig) -> int:
    """Schedulers that decode in ``config``: every server's, or a PD layout's decode workers'.

    ``config.schedulers`` (dp x attn_dp) per server times the servers that decode.
    """
    return sum(n * c.schedulers for role, n, c in config.servers() if role != "prefill")


def spec_cap_target(best: ServingConfig, study: Study) -> int | None:
    """The admission cap to raise ``best`` to when speculation's default cap is what limits it.

    SGLang 0.5.23 resets an unset ``max_running_requests`` to
    :data:`domain.speculative.SPEC_MAX_RUNNING_REQUESTS` (48) once speculative decoding is on
    (``speculative_hook.py``, ``_handle_eagle_family``). When the memory fit resolves ``best``'s
    cap to exactly that default and the saturation run puts more clients on each replica than
    that, the cap -- not speculation -- is what holds the batch down.

    Returns:
        ``min(clients per replica, sequences the KV pool holds at ISL + OSL)`` (requests per
        replica) when that is above the default cap; None otherwise (speculation off, the cap
        set explicitly, the load within the cap, the KV pool no larger, or no fit).
    """
    if best.speculative_algorithm is None or best.max_running_requests is not None:
        return None
    try:
        rep = fit(best)
    except (DoesNotFit, ConfigInvalid):
        return None
    if rep.speculative is None or rep.max_running_requests != SPEC_MAX_RUNNING_REQUESTS:
        return None
    sat = study.saturation
    # ceil: the most clients on one scheduler (the cap and the KV pool are per scheduler)
    clients = -(-sat.concurrency // (best.replicas * best.schedulers))
    target = min(clients, int(rep.kv_tokens // (sat.isl + sat.osl)))
    return target if target > SPEC_MAX_RUNNING_REQUESTS else None


class Planner:
    """Deterministic planner brain: greedy one-knob-at-a-time search from the current best.

    A neighbour the engine would run exactly like the incumbent or like a config this planner
    already launched (:func:`resolved_settings`) is skipped without a launch: its measurement
    would only repeat one already made.
    """

    def __init__(self, study: Study, lessons: Client) -> None:
        self.study, self.lessons = study, lessons
        # 'knob=value' moves (or space points) skipped because the coupled layout is invalid
        # there, with the reason (domain.knobs.apply_knobs): never launched, never a crash
        self.skipped: dict[str, str] = {}
        # resolved_settings signature -> config id, for incumbents and launched candidates
        self.resolved: dict[tuple[Any, ...], str] = {}
        # estimate lessons of this step's pruned candidates: the caller stores them once their
        # rows are committed (ledger row first, then its lessons); until then they forbid here
        self.unstored: list[Lesson] = []
        # why :meth:`ordered` put a max_running_requests raise first ('' when it did not)
        self.spec_cap_note = ""

    def remember(self, config: ServingConfig) -> None:
        """Record ``config``'s resolved settings (launched or incumbent) for :meth:`screened`."""
        sig = resolved_settings(config)
        if sig is not None:
            self.resolved.setdefault(sig, config.config_id())

    def capacity(self, config: ServingConfig) -> float:
        """Sequences the pool can hold at once in the saturation run, by the memory-fit estimate.

        ``schedulers x min(request slots, KV tokens / (ISL + OSL))`` (the fit's slots and KV
        pool are per scheduler: one attention-DP rank or dp copy), over every decoding server
        (``replicas``, or a PD layout's decode workers), capped by the run's concurrency (more
        room than clients buys nothing); 0 when the estimate rules it out.
        """
        try:
            rep = fit(config)
        except (DoesNotFit, ConfigInvalid):
            return 0.0
        sat = self.study.saturation
        per_scheduler = min(rep.max_running_requests, rep.kv_tokens / (sat.isl + sat.osl))
        return min(decode_schedulers(config) * per_scheduler, float(sat.concurrency))

    def ordered(self, best: ServingConfig) -> list[tuple[ServingConfig, str]]:
        """:meth:`neighbours` by the memory-fit estimate's predicted benefit, best first.

        The benefit is the change in :meth:`capacity` over ``best`` (a larger KV pool or more
        replicas admit a larger batch, which is what a saturation run's throughput per GPU
        mostly follows), bucketed to 5 % so that estimate noise does not reorder; candidates
        in the same bucket, e.g. every change the estimate cannot see (a backend, a router
        policy), keep the study's knob order. A candidate the estimate rules out sorts last
        (screening prunes it without a launch anyway).
        """
        self.spec_cap_note = ""
        base = self.capacity(best) or 1.0
        cands = list(self.neighbours(best))
        target = spec_cap_target(best, self.study)
        if target is not None:
            return self._spec_capped_order(best, cands, target, base)

        def gain(c: tuple[ServingConfig, str]) -> int:
            return round(self.capacity(c[0]) / base / 0.05)

        return sorted(cands, key=lambda c: -gain(c))  # stable: ties keep the study's order

    def _spec_capped_order(self, best: ServingConfig, cands: list[tuple[ServingConfig, str]],
                           target: int, base: float) -> list[tuple[ServingConfig, str]]:
        """The order when speculation's default cap holds ``best`` down (:func:`spec_cap_target`).

        Raising ``max_running_requests`` comes first (the study's value that admits the most,
        the one nearest ``target`` among equals; ``target`` itself when the study lists no value
        above the default cap), then the other moves that keep speculation, and moves that drop
        it last: turning speculation off also lifts the cap, and a search that tries it first
        credits the gain to the wrong knob.
        """
        def raises(c: ServingConfig) -> bool:
            return (c.speculative_algorithm is not None and c.max_running_requests is not None
                    and c.max_running_requests > SPEC_MAX_RUNNING_REQUESTS
                    and {k for k, v in c.model_dump().items() if v != getattr(best, k)}
                    == {"max_running_requests"})

        if not any(raises(c) for c, _ in cands):
            cand = apply_knob(best, "max_running_requests", target, self.study.gpu_count)
            cands.insert(0, (cand, f"max_running_requests={target}"))

        def key(c: tuple[ServingConfig, str]) -> tuple[int, int, int]:
            cfg = c[0]
            gain = round(self.capacity(cfg) / base / 0.05)
            if raises(cfg):
                return (0, -gain, abs((cfg.max_running_requests or 0) - target))
            return (1 if cfg.speculative_algorithm is not None else 2, -gain, 0)

        self.spec_cap_note = (f"speculative decoding resolves max_running_requests to its "
                              f"default {SPEC_MAX_RUNNING_REQUESTS} while the run puts up to "
                              f"{target} requests on each replica (clients, bounded by the KV "
                              "pool): raising the cap comes before dropping speculation")
        return sorted(cands, key=key)

    def equivalent(self, config: ServingConfig) -> str | None:
        """Config id of a remembered config the engine would run exactly like ``config``."""
        sig = resolved_settings(config)
        return None if sig is None else self.resolved.get(sig)

    def neighbours(self, best: ServingConfig) -> Iterator[tuple[ServingConfig, str]]:
        """Configs one knob away from ``best``, in the study's knob and value order."""
        for name, values in self.study.knobs.items():
            for v in values:
                move = f"{name}={_fmt(normalize_value(v))}"
                try:
                    cand = apply_knob(best, name, v, self.study.gpu_count)
                except ConfigInvalid as e:
                    # each value is valid somewhere (study load); a coupled one may not be here
                    # (attn_dp_size 8 from tp_size 4): skipped with the reason
                    self.skipped[move] = "; ".join(e.violations)
                    continue
                if cand != best:
                    yield cand, move

    async def forbidding(self, config: ServingConfig) -> list[dict[str, Any]]:
        """Lessons (id, title) that forbid ``config``.

        The stored ones (asked through the lessons server, oldest first), then this step's
        :attr:`unstored` ones.
        """
        r = await call(self.lessons, "check_config", {"config": config.model_dump(mode="json")})
        found = list(r.get("forbidding", []))
        ids = {f["id"] for f in found}
        return found + [{"id": x.id, "title": x.title} for x in self.unstored
                        if x.id not in ids and x.forbids(config)]

    async def screen(self, cand: ServingConfig, changed: str,
                     run_id: str) -> Pruned | TrialPlan:
        """Prune ``cand`` if a lesson forbids it or the memory-fit estimate rules it out.

        Returns:
            Pruned (its new estimate lesson, with its id, in ``new_lesson`` and
            :attr:`unstored`: the caller stores it after committing the pruned row), or a
            TrialPlan carrying the estimate's predictions.
        """
        forb = await self.forbidding(cand)
        if forb:
            ids = [f["id"] for f in forb]
            return Pruned(config=cand, changed=changed, lesson_ids=ids,
                          reason=f"forbidden by lesson {ids[0]}: {forb[0]['title']}")
        try:
            rep = fit(cand)
        except DoesNotFit as e:
            lesson = estimate_lesson(cand, e, self.study).model_copy(update={"run_id": run_id})
            self.unstored.append(lesson)
            return Pruned(config=cand, changed=changed, lesson_ids=[lesson.id],
                          new_lesson=lesson,
                          reason=f"pruned by memory-fit estimate: {e.arithmetic}")
        except ConfigInvalid as e:  # the engine's argument checks refuse it (a layout rule)
            return Pruned(config=cand, changed=changed, lesson_ids=[],
                          reason=f"refused pre-flight: {'; '.join(e.violations)[:300]}")
        # the fit's KV pool and cap are per scheduler (attention-DP rank or dp copy); a
        # server holds schedulers of them (for a PD layout: a decode server)
        server = cand if cand.pd is None else cand.pd_worker("decode")
        kv_server = rep.kv_tokens * server.schedulers
        predicted: dict[str, Any] = {"kv_tokens_per_replica": kv_server,
                                     "max_running_requests": rep.max_running_requests,
                                     "mem_fraction_static": rep.mem_fraction_static,
                                     "kv_pool_gb_per_gpu": round(rep.kv_pool_gb, 2)}
        if server.schedulers > 1:
            predicted["schedulers_per_replica"] = server.schedulers
        return TrialPlan(config=cand, changed=changed, predicted=predicted,
                         rationale=f"{changed or 'baseline'}: the estimate fits with "
                                   f"{kv_server:,} KV tokens per replica")

    async def screened(self, best: ServingConfig, seen: set[str], run_id: str,
                       losers: dict[str, str]) -> AsyncIterator[Pruned | TrialPlan]:
        """Each unseen neighbour of ``best``, screened: Pruned or a viable TrialPlan.

        A pruned candidate (an earlier regression in ``losers``, a forbidding lesson, the
        memory-fit estimate) is added to ``seen``; a viable one is not (the caller adds what
        it launches). A neighbour whose resolved settings equal the incumbent's or a launched
        config's (:meth:`equivalent`) is added to ``seen`` and skipped silently: it is the same
        server under another spelling, not a candidate.
        """
        self.remember(best)
        for cand, changed in self.ordered(best):
            cid = cand.config_id()
            if cid in seen:
                continue
            if self.equivalent(cand) is not None:
                seen.add(cid)
                continue
            if changed in losers:
                seen.add(cid)
                yield Pruned(config=cand, changed=changed, lesson_ids=[], reason=losers[changed])
                continue
            verdict = await self.screen(cand, changed, run_id)
            if isinstance(verdict, Pruned):
                seen.add(cid)
            yield verdict

    async def step(self, best: ServingConfig, seen: set[str], run_id: str,
                   losers: dict[str, str] | None = None,
                   history: Sequence[Any] = ()) -> PlanStep:
        """Next candidate from ``best``, skipping config ids in ``seen``.

        Args:
            best: the incumbent config.
            seen: config ids already launched or pruned in this run (updated in place).
            run_id: recorded on new lessons.
            losers: ``knob=value`` changes that already cost more than the study's
                ``drop_regressions`` share from an earlier incumbent, with the reason; they
                are pruned instead of launched again.
            history: the run's search trials (ledger order); this brain only remembers the
                measured ones' resolved settings (:meth:`remember`), so a neighbour the
                engine would run like one of them is skipped even by a fresh planner (the
                space brains of ``agents.brains`` learn from the whole history).

        Pruned candidates are returned so the caller can ledger them before anything launches,
        then store their new lessons (:attr:`Pruned.new_lesson`).
        """
        pruned: list[Pruned] = []
        for t in history:
            if t.launched and t.objective is not None:
                self.remember(t.config)
        async for verdict in self.screened(best, seen, run_id, losers or {}):
            if isinstance(verdict, Pruned):
                pruned.append(verdict)
                continue
            seen.add(verdict.config.config_id())
            self.remember(verdict.config)
            if self.spec_cap_note and verdict.changed.startswith("max_running_requests="):
                verdict.rationale = f"{verdict.rationale}; {self.spec_cap_note}"
            return PlanStep(pruned=pruned, decision=verdict)
        return PlanStep(pruned=pruned, decision=NoViableConfig(
            reason="every one-knob change of the best config was tried or pruned"
                   + self.skipped_note()))

    def skipped_note(self) -> str:
        """'; N moves skipped: <move>: <reason>' for coupled moves invalid here ('' if none)."""
        if not self.skipped:
            return ""
        move, why = next(iter(self.skipped.items()))
        return (f"; {len(self.skipped)} coupled layout moves are invalid from it (e.g. "
                f"{move}: {why[:200]})")

    async def decide(self, plan: TrialPlan, outcomes: list[dict[str, Any]],
                     run_id: str) -> Decision:
        """Keep or drop ``plan`` given the research ``outcomes`` (ResearchOutcome dumps).

        Drops it when :func:`domain.research.research_verdict` finds a source claim whose SM
        range excludes the GPU (and writes :func:`domain.lesson_builders.research_lesson`);
        otherwise keeps it.
        """
        drop = research_verdict(outcomes, plan.config)
        if drop is not None:
            return Decision(decision="drop", reason=drop,
                            lesson=research_lesson(plan.config, plan.changed, drop, run_id))
        answered = sum(o.get("status") == "answered" for o in outcomes)
        return Decision(decision="keep", reason=(
            f"{answered}/{len(outcomes)} questions answered, no refusal of {plan.changed} on "
            f"{plan.config.gpu} found"))
