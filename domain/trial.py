"""Trial: one row of a study's ledger -- a config that was launched, pruned or replayed."""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field

from domain.acceptance import AcceptDecision
from domain.admission import OverAdmission
from domain.config import ServingConfig
from domain.engines import engine_for
from domain.lesson import Lesson
from domain.metrics import GraphCeiling, MetricsSummary
from domain.quality import QualityGate
from domain.redact import RedactedStr, redact_any
from domain.twin.cluster import ReplicaStats

# "failed": an agent (Claude brain) gave an invalid output twice or ran out of budget; the trial
# used a slot of the trial budget but measured nothing that can win.
TrialStatus = Literal["baseline", "keep", "discard", "crash", "pruned", "finalist", "winner",
                      "slo-miss", "sweep", "failed"]
Phase = Literal["search", "validate", "frontier"]


class VersionManifest(BaseModel):
    """What a measurement was made with, so results from different engines never mix."""

    engine: str
    engine_version: str
    image: str
    flag_inventory_sha: str = Field(description="sha256 (12 hex) of the flag inventory used")
    backend: str = Field(description="cluster backend: twin, local, kubernetes")


def manifest_for(config: ServingConfig, backend: str) -> VersionManifest:
    """The manifest of ``config`` run on ``backend`` (the engine's image and flag inventory)."""
    eng = engine_for(config)
    inv = eng.flag_inventory()
    sha = hashlib.sha256(repr(sorted(inv)).encode()).hexdigest()[:12]
    return VersionManifest(engine=config.engine, engine_version=config.engine_version,
                           image=eng.image,
                           flag_inventory_sha=sha, backend=backend)


class LintNote(BaseModel):
    """A pre-flight lint a ledgered config trips (from ``domain.preflight:lint_config``).

    The same fields as a pre-flight finding: ``severity`` (``warn`` or ``refuse``), ``code``
    (a stable name, e.g. a graph ceiling below the admission cap), ``message`` (why, with the
    numbers) and ``fix`` (what to change).
    """

    severity: str
    code: str
    message: RedactedStr
    fix: RedactedStr = ""


class Trial(BaseModel):
    """One ledger row. ``key`` identifies the work (phase + config + workload) for idempotence."""

    run_id: str
    seq: int = Field(description="1-based order in the run")
    key: str = Field(description="phase:config_id[:suffix], unique within a run")
    phase: Phase
    status: TrialStatus
    config: ServingConfig
    changed: str = Field("", description="'knob=value' relative to the parent, '' for baseline")
    parent_seq: int | None = None
    # reason, log_tail and retries carry engine log lines: stored redacted (domain/redact.py)
    reason: RedactedStr = Field(description="one line: why kept, discarded, pruned or crashed")
    failure_class: str | None = None
    lesson_ids: list[str] = Field(default_factory=list)
    lessons_written: list[Lesson] = Field(
        default_factory=list, description="lessons this trial taught (stored again on resume)")
    saturation: MetricsSummary | None = None
    replay: MetricsSummary | None = None
    objective: float | None = Field(None, description="output tok/s/GPU on the saturation run "
                                    "(the mean over its repeats when it ran several times)")
    objective_runs: list[float] = Field(
        default_factory=list, description="output tok/s/GPU of each repeated saturation run "
        "(acceptance.repeats / SERVETUNE_REPEATS); ``saturation`` is the first run's summary")
    objective_blocks: list[float] = Field(
        default_factory=list, description="output tok/s/GPU of equal time slices of the first "
        "saturation run: the gate's samples when a candidate or the incumbent ran once")
    acceptance: AcceptDecision | None = Field(
        None, description="the acceptance gate's decision against the incumbent: relative "
        "gain, its bootstrap interval and the samples it rests on (None: baseline, first "
        "config that ran, or no valid run)")
    decode_roofline_share: float | None = Field(
        None, description="decode time at 100% of the roofline / measured decode time on the "
        "saturation run (twin: from the engine's step model; mean over replicas)")
    decode_allreduce_share: float | None = Field(
        None, description="share of the saturation run's decode step time spent in TP "
        "all-reduces (twin: the cost model's all-reduce seconds over simulated decode seconds, "
        "domain/interconnect.py; mean over replicas; None: a backend without engine counters)")
    cache_hit_rate: float | None = Field(
        None, description="prompt tokens served from the prefix cache on the trace replay")
    saturation_replicas: list[ReplicaStats] = Field(
        default_factory=list, description="what the twin saw on the saturation run, per "
        "replica: requests routed to it, requests in flight (mean, max), retractions and the "
        "tokens they recompute, eager decode steps, all-reduce share (empty: a backend without "
        "engine counters)")
    replay_replicas: list[ReplicaStats] = Field(
        default_factory=list, description="the same counters of the trace replay (validate)")
    replica_requests: dict[str, list[int]] = Field(
        default_factory=dict, description="real servers: requests each replica finished, by "
        "run (saturation, replay), from the servers' own counters (BenchResult."
        "replica_requests): how the router spread the load")
    admission: OverAdmission | None = Field(
        None, description="validate: the over-admission verdict read from the replay's own "
        "time series (queue, TTFT, throughput per bin) and the admission caps it suggests")
    quality: QualityGate | None = Field(
        None, description="validate: the quality gate on outputs (not-needed, not-applicable "
        "on the twin, pass or fail on real endpoints)")
    predicted: dict[str, Any] = Field(default_factory=dict,
                                      description="the estimator's numbers before launch")
    log_tail: list[RedactedStr] = Field(default_factory=list)
    retries: Annotated[list[dict[str, Any]], BeforeValidator(redact_any)] = Field(
        default_factory=list, description="failed tries of this trial's launch or benchmark "
        "that were tried again because their failure class is transient (domain/faults.py): "
        "what (deploy/bench), attempt, failure_class, stage, evidence")
    research: list[dict[str, Any]] = Field(
        default_factory=list, description="research outcomes gathered before the launch "
        "decision: question, status, answer, claims with evidence, error, usage, start/end")
    research_decision: str = Field("", description="what the research changed: 'kept: ...' "
                                   "or 'dropped: ...' with the deciding evidence")
    llm_usage: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="role (planner, deployer, analyst) -> what its Claude "
        "agent runs for this trial cost (AgentUsage: tokens, tool calls, turns, retries, s); "
        "empty with deterministic brains. Research cost is in ``research``")
    graph_ceiling: GraphCeiling | None = Field(
        None, description="search: the analyst's CUDA-graph-ceiling cause -- this run or a "
        "comparable one decoded eagerly past cuda_graph_max_bs_decode and its ITL roughly "
        "doubled (agents/analyst.py:graph_ceiling_cause)")
    lints: list[LintNote] = Field(
        default_factory=list, description="the pre-flight lints this config trips (filled when "
        "the row is appended, :attr:`domain.ledger.Ledger.lint`)")
    records_path: str | None = None
    manifest: VersionManifest | None = None
    wall_s: float = 0.0
    created_at: str = ""

    def rank_key(self) -> tuple[float, int, int]:
        """Sort key for "best first": higher tok/s/GPU, then fewer tuned flags, then earlier."""
        return (-(self.objective or 0.0), len(self.config.set_fields()), self.seq)

    @property
    def launched(self) -> bool:
        """True if the trial deployed something (pruned trials never launch)."""
        return self.status != "pruned"


def per_run(**runs: list[int] | None) -> dict[str, list[int]]:
    """``Trial.replica_requests`` of the runs that read their servers' counters (None: not)."""
    return {k: v for k, v in runs.items() if v is not None}
