"""Benchmark analyst agent.

Job: run the benchmarks of a Ready candidate through the bench
server, judge it against the incumbent (keep / discard / crash, with evidence), and turn every
failure into a lesson whose condition covers the whole family of configs it dooms.

The benchmarks themselves run in code, so the ledger's numbers are what the bench server measured.
The verdict has two brains: :meth:`Analyst.verdict` (deterministic: the study's
``min_improvement`` rule, gated by the noise) and :meth:`ClaudeAnalyst.verdict` (prompt
``agents/prompts/analyst.md``, may read the per-request records and lessons; its verdict is
checked against the measured summary and the gate). Outputs: :class:`Verdict` and
:class:`~domain.lesson.Lesson`.

Causes: :func:`graph_ceiling_cause` names the CUDA-graph ceiling when a run's decode batch
went past ``cuda_graph_max_bs_decode`` and its ITL roughly doubled against a comparable run that
stayed in graph (:func:`domain.metrics.graph_ceiling`); the search appends it to the verdict.

Acceptance gate (:func:`acceptance`, :mod:`domain.acceptance`): computed in code before any
brain judges. With repeated runs of both the candidate and the incumbent it decides: a candidate
is kept only when the bootstrap interval of its gain lies above ``min_improvement``. With one run
each its interval rests on time slices of the runs, which see no run-to-run noise (and on the
twin swing with its synchronised prefill/decode waves), so it is recorded but the point rule
decides, as without the gate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from mcp import Client
from pydantic import BaseModel

from agents.claude import AgentFailure, ClaudeAgent, ClaudeSetup, context_block
from agents.deployer import DeployOutcome
from agents.mcp_tools import call
from domain.acceptance import AcceptDecision, decide, pick_samples
from domain.bench import BenchResult
from domain.config import ServingConfig
from domain.engines import engine_for
from domain.errors import ConfigInvalid, DoesNotFit
from domain.fit import fit
from domain.lesson import Lesson
from domain.metrics import CeilingPoint, GraphCeiling, MetricsSummary, graph_ceiling
from domain.study import Study
from domain.trial import Trial
from domain.twin.cluster import ReplicaStats
from domain.usage import AgentUsage


class Verdict(BaseModel):
    """The analyst's decision on one trial."""

    status: Literal["baseline", "keep", "discard", "crash"]
    objective: float | None
    reason: str


def acceptance(candidate_runs: list[float], candidate_blocks: list[float],
               incumbent_runs: list[float], incumbent_blocks: list[float], study: Study,
               seed: int = 0) -> AcceptDecision | None:
    """The gate's decision on a candidate against the incumbent (None: nothing to compare).

    Runs are the samples when both have at least two, else the time blocks of one run each
    (:func:`domain.acceptance.pick_samples`); ``study.acceptance.confidence`` sets the level.
    """
    c, i, kind = pick_samples(candidate_runs, incumbent_runs, candidate_blocks,
                              incumbent_blocks)
    if not c or not i or not sum(i) > 0:
        return None
    return decide(c, i, study.min_improvement, study.acceptance.confidence, seed, kind)


def gates(gate: AcceptDecision | None) -> bool:
    """Whether ``gate`` decides keep/discard (repeated runs) or only informs (one run each)."""
    return gate is not None and gate.samples == "runs"


# ReplicaStats counters of a PD run that only prefill servers fill (their radix caches)
PREFILL_COUNTERS = frozenset({"cache_hit_rate", "host_loaded_tokens", "evicted_tokens",
                              "prefill_steps"})


def replica_mean(replicas: Sequence[ReplicaStats], key: str) -> float | None:
    """Mean of one per-replica engine counter (e.g. ``decode_roofline_share``) over replicas.

    Returns None when no replica reports it (backends without engine counters: no replicas).
    A PD run (servers with role prefill and decode, :mod:`domain.twin.pd`) averages each
    counter over the servers that do that work: the prefix cache's over the prefill servers
    (:data:`PREFILL_COUNTERS`), the rest over the decode servers.
    """
    if any(getattr(r, "role", "server") == "prefill" for r in replicas):
        want = "prefill" if key in PREFILL_COUNTERS else "decode"
        replicas = [r for r in replicas if r.role == want]
    values = [float(v) for r in replicas if (v := getattr(r, key, None)) is not None]
    return sum(values) / len(values) if values else None


# knobs that change how many requests decode at once or how they are captured, not the step's
# kernels: two configs that differ only in these are comparable for the graph-ceiling cause
ADMISSION_KNOBS = frozenset({"max_running_requests", "cuda_graph_max_bs_decode",
                             "mem_fraction_static", "chunked_prefill_size",
                             "schedule_conservativeness", "schedule_policy"})


def comparable(a: ServingConfig, b: ServingConfig) -> bool:
    """Whether ``a`` and ``b`` differ only in :data:`ADMISSION_KNOBS`."""
    da, db = a.model_dump(), b.model_dump()
    return all(da[k] == db[k] for k in da if k not in ADMISSION_KNOBS)


def ceiling_point(config: ServingConfig, summary: MetricsSummary, concurrency: int,
                  label: str = "") -> CeilingPoint | None:
    """``summary``'s run as a :class:`~domain.metrics.CeilingPoint` (None: no ITL or no fit).

    The batch is the run's measured mean decode batch per replica (the twin's scheduler);
    where the server does not report it, what admission allows: ``min(clients per replica,
    the resolved max_running_requests, KV tokens / the run's mean tokens per request)``. The
    ceiling is the config's resolved ``cuda_graph_max_bs_decode`` (:func:`domain.fit.fit`).
    """
    itl = summary.itl_ms.p50
    if itl is None or summary.completed == 0:
        return None
    try:
        rep = fit(config)
    except (DoesNotFit, ConfigInvalid):
        return None
    batch = summary.decode_batch
    if batch is None:
        per_request = (summary.input_tokens + summary.output_tokens) / summary.completed
        batch = min(concurrency / config.replicas, rep.max_running_requests,
                    rep.kv_tokens / max(per_request, 1.0))
    return CeilingPoint(batch=batch, itl_p50_ms=itl, ceiling=rep.cuda_graph_max_bs_decode,
                        label=label)


def graph_ceiling_cause(subject: CeilingPoint,
                        others: Sequence[CeilingPoint]) -> GraphCeiling | None:
    """The graph-ceiling cause between ``subject`` and one of ``others`` (comparable runs).

    Of the pairs that show it (:func:`domain.metrics.graph_ceiling`), the one whose batches are
    closest; None when none does.
    """
    found = [g for o in others if (g := graph_ceiling([subject, o])) is not None]
    if not found:
        return None
    return min(found, key=lambda g: max(g.batch_above / g.batch_below,
                                        g.batch_below / g.batch_above))


def search_graph_ceiling(config: ServingConfig, summary: MetricsSummary,
                         trials: Sequence[Trial], concurrency: int) -> GraphCeiling | None:
    """The graph-ceiling cause of a search candidate's saturation run ``summary``.

    Judged against the measured search ``trials`` of comparable configs (:func:`comparable`;
    labelled by their seq), all at the study's saturation ``concurrency``.
    """
    subject = ceiling_point(config, summary, concurrency, "this run")
    if subject is None:
        return None
    others = [p for t in trials
              if t.saturation is not None and t.objective is not None
              and comparable(t.config, config) and t.config != config
              and (p := ceiling_point(t.config, t.saturation, concurrency, f"#{t.seq}"))
              is not None]
    return graph_ceiling_cause(subject, others)


def failure_lesson(config: ServingConfig, outcome: DeployOutcome, run_id: str,
                   trial_key: str) -> Lesson:
    """The lesson of a failed launch, with the engine's log line as evidence.

    The engine decides the failure's family, fix and wording
    (:meth:`domain.engines.Engine.failure_lesson`).
    """
    return engine_for(config).failure_lesson(config, outcome.failure_class, outcome.stage,
                                             outcome.evidence, outcome.log_tail, run_id,
                                             trial_key)


class Analyst:
    """Deterministic analyst brain over the bench MCP server."""

    def __init__(self, bench: Client, study: Study) -> None:
        self.bench, self.study = bench, study

    async def saturation(self, deployment: str, concurrency: int | None = None,
                         duration_s: float | None = None, repeat: int = 0) -> BenchResult:
        """The study's synthetic saturation run on ``deployment``.

        ``repeat`` numbers it among repeated runs of the same candidate (0 = the first).
        """
        s = self.study.saturation
        r = await call(self.bench, "run_saturation", {
            "deployment": deployment, "isl": s.isl, "osl": s.osl,
            "concurrency": concurrency or s.concurrency,
            "duration_s": duration_s or s.duration_s, **({"repeat": repeat} if repeat else {})})
        return BenchResult.model_validate(r)

    async def replay(self, deployment: str) -> BenchResult:
        """The study's trace replay on ``deployment`` (goodput under the TTFT SLO)."""
        rp = self.study.replay
        r = await call(self.bench, "run_replay", {
            "deployment": deployment, "trace": rp.trace, "format": rp.format,
            "start_s": rp.start_s, "duration_s": rp.duration_s, "time_scale": rp.time_scale,
            "slo_ttft_ms": self.study.slo.ttft_p99_ms})
        return BenchResult.model_validate(r)

    async def saturation_runs(self, deployment: str, repeats: int) -> list[BenchResult]:
        """``repeats`` saturation runs of ``deployment`` (``repeat`` 0, 1, ...).

        Stops at the first invalid run: an invalid run is never scored, so more would not help.
        """
        out: list[BenchResult] = []
        for r in range(repeats):
            out.append(await self.saturation(deployment, repeat=r))
            if not out[-1].valid:
                break
        return out

    def judge(self, summary: MetricsSummary, best: float | None, is_baseline: bool,
              gate: AcceptDecision | None = None, objective: float | None = None) -> Verdict:
        """Keep if tok/s/GPU beats the incumbent by ``min_improvement``, else discard.

        With a deciding ``gate`` (repeated runs, :func:`gates`) the interval decides instead:
        keep iff its low end exceeds ``min_improvement``. ``objective`` is the measured
        tok/s/GPU when it is not the summary's (the mean of repeated runs). A run that
        completed no request is a crash (the server served nothing).
        """
        obj = summary.output_tok_s_per_gpu if objective is None else objective
        if summary.completed == 0:
            return Verdict(status="crash", objective=None,
                           reason=f"no request completed ({summary.errors} errors)")
        if is_baseline:
            return Verdict(status="baseline", objective=obj,
                           reason=f"baseline: {obj:,.0f} output tok/s/GPU")
        if best is None:
            return Verdict(status="keep", objective=obj,
                           reason=f"first config that runs: {obj:,.0f} output tok/s/GPU")
        gain = obj / best - 1
        if gate is not None and gates(gate):
            return Verdict(status="keep" if gate.accepted else "discard", objective=obj,
                           reason=f"{obj:,.0f} tok/s/GPU vs best {best:,.0f}: {gate.text()}")
        note = "" if gate is None else (
            f"; not noise-gated, one run each (time-block CI {gate.ci_low:+.1%} .. "
            f"{gate.ci_high:+.1%})")
        if gain > self.study.min_improvement:
            return Verdict(status="keep", objective=obj,
                           reason=f"{obj:,.0f} tok/s/GPU, {gain:+.1%} vs best {best:,.0f}{note}")
        return Verdict(status="discard", objective=obj,
                       reason=f"{obj:,.0f} tok/s/GPU, {gain:+.1%} vs best {best:,.0f} "
                              f"(needs > {self.study.min_improvement:.0%}){note}")

    async def verdict(self, bench: BenchResult, best: float | None, is_baseline: bool,
                      config: ServingConfig, changed: str, gate: AcceptDecision | None = None,
                      objective: float | None = None) -> Verdict:
        """The verdict on a saturation run: :meth:`judge` of its summary and the gate.

        A run the bench server marked invalid (too many failed requests) is not scored: it is
        a ``discard`` (``crash`` if nothing completed) with the server's reason.
        """
        if not bench.valid:
            return invalid_verdict(bench)
        return self.judge(bench.summary, best, is_baseline, gate, objective)


def invalid_verdict(bench: BenchResult) -> Verdict:
    """The verdict on a run the bench server marked invalid: never scored."""
    status = "crash" if bench.summary.completed == 0 else "discard"
    return Verdict(status=status, objective=None,
                   reason=f"invalid run, not scored: {bench.invalid_reason or 'too many errors'}")


OBJECTIVE_TOLERANCE = 0.005  # a reported objective may differ from the measured one by 0.5 %


def check_verdict(v: Verdict, summary: MetricsSummary, best: float | None,
                  is_baseline: bool, gate: AcceptDecision | None = None,
                  objective: float | None = None) -> str | None:
    """What is wrong with an agent's verdict against the measured ``summary`` (None: fine).

    Rules: ``crash`` only when no request completed (and then it is the only choice);
    ``baseline`` exactly for the baseline; the objective is the measured output tok/s/GPU
    (``objective`` when given: the mean of repeated runs; within :data:`OBJECTIVE_TOLERANCE`);
    ``keep`` needs a gain over ``best``, no failed request, and no rejection by a deciding
    acceptance ``gate``.
    """
    measured = summary.output_tok_s_per_gpu if objective is None else objective
    if summary.completed == 0:
        return None if v.status == "crash" else "no request completed: the status is crash"
    if v.status == "crash":
        return f"{summary.completed} requests completed: the server ran, so it is no crash"
    if (v.status == "baseline") != is_baseline:
        return ("this is the baseline: status must be baseline" if is_baseline else
                "only the first trial is the baseline: choose keep or discard")
    if v.objective is None or abs(v.objective - measured) > OBJECTIVE_TOLERANCE * max(measured,
                                                                                     1e-9):
        return f"objective must be the measured output tok/s/GPU, {measured:.1f}"
    if v.status == "keep":
        if summary.errors:
            return f"{summary.errors} requests failed: a run with errors cannot be kept"
        if best is not None and measured <= best:
            return f"keep needs more than the best's {best:.1f} tok/s/GPU (measured {measured:.1f})"
        if gate is not None and gates(gate) and not gate.accepted:
            return (f"the acceptance gate rejected this candidate ({gate.text()}): the gain "
                    "is within run-to-run noise, so it cannot be kept; discard it")
    return None


class ClaudeAnalyst(Analyst):
    """Claude brain for the verdict, held to the measured numbers by :func:`check_verdict`.

    Claude reads the run's summary (and, if it wants, its records and the lessons) and decides
    keep / discard with a reason. ``usage`` accumulates the cost of every run.
    """

    def __init__(self, bench: Client, lessons: Client, study: Study,
                 claude: ClaudeSetup) -> None:
        """Analyst over ``bench`` (and ``lessons`` for query_lessons) for ``study``."""
        super().__init__(bench, study)
        self.lessons, self.claude = lessons, claude
        self.usage = AgentUsage()

    async def verdict(self, bench: BenchResult, best: float | None, is_baseline: bool,
                      config: ServingConfig, changed: str, gate: AcceptDecision | None = None,
                      objective: float | None = None) -> Verdict:
        """Claude's verdict on ``bench`` (an invalid run is not scored and asks no model).

        The gate's decision is computed in code and given to the model; a keep it rejected is
        refused by :func:`check_verdict` (repeated runs only: one run each, it only informs).

        Raises:
            AgentOutputInvalid, AgentBudgetExceeded: no valid verdict (the caller records the
                trial as failed, keeping the measurement).
        """
        if not bench.valid:
            return invalid_verdict(bench)
        agent: ClaudeAgent[Verdict] = ClaudeAgent(
            "analyst", self.claude.client, {"bench": self.bench, "lessons": self.lessons},
            {"bench": ["get_records", "list_runs"], "lessons": ["query_lessons"]}, Verdict,
            model=self.claude.model, budget=self.claude.budget,
            meter=self.claude.meter)
        task = ("JUDGE the saturation run of this candidate: baseline, keep (it becomes the "
                "best) or discard, with the numbers the decision rests on. Keep it only if "
                f"the gain over the best exceeds run-to-run noise (the study asks for more "
                f"than {self.study.min_improvement:.0%}).\n" + context_block({
                    "config": config.model_dump(mode="json", exclude_none=True),
                    "changed": changed or "baseline", "is_baseline": is_baseline,
                    "best_objective": best, "min_improvement": self.study.min_improvement,
                    "summary": bench.summary.model_dump(mode="json"),
                    "bench_id": bench.bench_id,
                    **({} if objective is None else {"objective_mean_of_runs": objective}),
                    **({} if gate is None else {"acceptance_gate": {
                        **gate.model_dump(mode="json"), "decides": gates(gate),
                        "text": gate.text()}})}))

        async def check(v: Verdict) -> str | None:
            return check_verdict(v, bench.summary, best, is_baseline, gate, objective)

        try:
            v, usage = await agent.run(task, check)
        except AgentFailure as e:
            self.usage = self.usage.plus(e.usage)
            raise
        self.usage = self.usage.plus(usage)
        return v
