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

Acceptance gate (:func:`acceptance`, :mod:`domain.acceptance`): computed in code before any
brain judges. With repeated runs of both the candidate and the incumbent it decides: a candidate
is kept only when the bootstrap interval of its gain lies above ``min_improvement``. With one run
each its interval rests on time slices of the runs, which see no run-to-run noise (and on the
twin swing with its synchronised prefill/decode waves), so it is recorded but the point rule
decides, as without the gate.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from mcp import Client
from pydantic import BaseModel

from agents.claude import AgentFailure, ClaudeAgent, ClaudeSetup, context_block
from agents.deployer import DeployOutcome
from agents.mcp_tools import call
from domain.acceptance import AcceptDecision, decide, pick_samples
from domain.config import ServingConfig
from domain.fit import MEMORY_FIELDS
from domain.knob_domain import field_domain
from domain.lesson import Clause, Lesson, Scope
from domain.metrics import MetricsSummary
from domain.study import Study
from domain.usage import AgentUsage

FIXES = {
    "UNSUPPORTED_BACKEND": "leave --attention-backend unset (the engine picks the backend for the "
                           "GPU architecture) or choose one the architecture supports",
    "OOM_WEIGHTS": "use more GPUs per replica (higher --tp-size) or a smaller checkpoint",
    "KV_NO_ROOM": "raise --mem-fraction-static, raise --tp-size or use a smaller checkpoint",
    "GRAPH_CAPTURE_OOM": "lower --mem-fraction-static or --cuda-graph-max-bs-decode",
    "BAD_FLAG": "use only flags and values of the pinned SGLang version's inventory",
    "BACKEND_MODEL_MISMATCH": "choose an attention backend made for this model's attention "
                              "type (MLA/DSA or MHA/GQA), or leave it unset",
    "TP_DIVISIBILITY": "choose a tp_size that divides the attention heads (e.g. 2, 4, 8)",
    "MULTI_NODE_REQUIRED": "keep tp_size within one node's GPUs or serve across nodes with "
                           "--nnodes",
    "INVALID_COMBINATION": "drop or adjust the conflicting flags the engine's message names",
    "HOST_OOM_HICACHE": "lower --hicache-ratio (or leave it unset) so the host KV pool fits the "
                        "node's memory",
    "HICACHE_HOST_TOO_SMALL": "use --hicache-ratio above 1 (the host pool must exceed the device "
                              "pool)",
    "NO_DRAFT_MODEL": "speculative decoding needs a model with MTP/NextN layers or a draft model",
}
OUTCOME = {"UNSUPPORTED_BACKEND": "unsupported", "OOM_WEIGHTS": "oom", "KV_NO_ROOM": "oom",
           "GRAPH_CAPTURE_OOM": "oom", "BAD_FLAG": "invalid-flag",
           "TP_DIVISIBILITY": "crash", "MULTI_NODE_REQUIRED": "crash",
           "BACKEND_MODEL_MISMATCH": "unsupported", "HOST_OOM_HICACHE": "oom",
           "HICACHE_HOST_TOO_SMALL": "crash", "INVALID_COMBINATION": "crash",
           "NO_DRAFT_MODEL": "unsupported"}


class Verdict(BaseModel):
    """The analyst's decision on one trial."""

    status: Literal["baseline", "keep", "discard", "crash"]
    objective: float | None
    reason: str


class BenchOutcome(BaseModel):
    """One benchmark's summary and where its records are."""

    bench_id: str
    summary: MetricsSummary
    records_path: str
    workload: dict[str, Any]
    replicas: list[dict[str, Any]]
    first_error: str | None = None
    valid: bool = True
    invalid_reason: str | None = None
    errors_by_class: dict[str, int] = {}
    flags: list[str] = []
    block_tok_s_per_gpu: list[float] = []


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


def replica_mean(replicas: list[dict[str, Any]], key: str) -> float | None:
    """Mean of one per-replica engine counter (e.g. ``decode_roofline_share``) over replicas.

    Returns None when no replica reports it (backends without engine counters).
    """
    values = [float(r[key]) for r in replicas if r.get(key) is not None]
    return sum(values) / len(values) if values else None


# INVALID_COMBINATION refusals of SGLang 0.5.23 (sglang-knobs reference 3.1): the evidence line
# names the family; (fragment, fix, clause builder over the config).
def _spec_partial(c: ServingConfig) -> list[Clause]:
    if c.speculative_num_steps is None:  # bare assert: steps unset but topk or draft set
        other = "speculative_eagle_topk" if c.speculative_eagle_topk is not None \
            else "speculative_num_draft_tokens"
        return [Clause(field="speculative_algorithm", op="not_null"),
                Clause(field="speculative_num_steps", op="is_null"),
                Clause(field=other, op="not_null")]
    return [Clause(field="speculative_algorithm", op="not_null"),   # TypeError: topk unset
            Clause(field="speculative_num_steps", op="not_null"),
            Clause(field="speculative_eagle_topk", op="is_null")]


_COMBINATIONS: tuple[tuple[str, str, Any], ...] = (
    ("enable-hierarchical-cache and disable-radix-cache are mutually exclusive",
     "HiCache needs the radix cache: drop --disable-radix-cache or --enable-hierarchical-cache",
     lambda c: [Clause(field="enable_hierarchical_cache", op="eq", value=True),
                Clause(field="disable_radix_cache", op="eq", value=True)]),
    ("schedule_conservativeness must be non-negative",
     "give --schedule-conservativeness a value >= 0 (1.0 is the default)",
     lambda c: [Clause(field="schedule_conservativeness", op="lt", value=0.0)]),
    ("trtllm_mha backend only supports topk = 1",
     "use --speculative-eagle-topk 1 with trtllm_mha, or another attention backend",
     lambda c: [Clause(field="attention_backend", op="eq", value="trtllm_mha"),
                Clause(field="speculative_eagle_topk", op="gt", value=1)]),
    ("speculative_eagle_topk > 1 with page_size > 1",
     "use --speculative-eagle-topk 1 (tree drafting needs page size 1 or flashinfer/fa3/"
     "triton attention, which this model's backend is not)",
     lambda c: [Clause(field="attention_backend", op="eq", value=c.attention_backend)
                if c.attention_backend is not None
                else Clause(field="attention_backend", op="is_null"),
                Clause(field="speculative_eagle_topk", op="gt", value=1)]),
    ("is not in the adaptive config candidate_steps",
     "with --speculative-adaptive give --speculative-num-steps one of the candidate steps "
     "(0, 1, 3, 5, 7) or leave it unset",
     lambda c: [Clause(field="speculative_adaptive", op="eq", value=True),
                Clause(field="speculative_num_steps", op="eq", value=c.speculative_num_steps)]),
)
_SPEC_PARTIAL_FIX = ("set all of --speculative-num-steps, --speculative-eagle-topk and "
                     "--speculative-num-draft-tokens, or none of them")


def _combination(config: ServingConfig, evidence: str) -> tuple[list[Clause], str] | None:
    """Family and fix of an INVALID_COMBINATION refusal, read from its evidence line."""
    for fragment, fix, build in _COMBINATIONS:
        if fragment in evidence:
            return build(config), fix
    spec_fields = (config.speculative_num_steps, config.speculative_eagle_topk,
                   config.speculative_num_draft_tokens)
    bare = evidence.strip() in ("AssertionError", "AssertionError:") or "TypeError" in evidence
    if bare and config.speculative_algorithm is not None and any(
            v is not None for v in spec_fields):
        return _spec_partial(config), _SPEC_PARTIAL_FIX
    return None


def failure_condition(config: ServingConfig, failure_class: str,
                      evidence: str = "") -> tuple[Scope, list[Clause]]:
    """Scope and condition of the family a failure of ``config`` dooms.

    - UNSUPPORTED_BACKEND: that backend on this GPU, any model or checkpoint.
    - OOM_WEIGHTS: these weights at this or any smaller TP (weights per GPU only grow); with
      speculative decoding on, only configs that also load the draft layer.
    - HOST_OOM_HICACHE: HiCache with a host ratio above the largest that fits (from the
      engine's requested/free GB), at this TP and checkpoint.
    - NO_DRAFT_MODEL: speculative decoding with this algorithm on this model.
    - HICACHE_HOST_TOO_SMALL: HiCache with a host ratio <= 1, any model.
    - INVALID_COMBINATION: the family the engine's message names (e.g. HiCache with the radix
      cache disabled; a partial speculative triple), for this engine version on any GPU/model
      (for tree drafting: this model, whose backend forces the page size).
    - KV_NO_ROOM / GRAPH_CAPTURE_OOM: exactly this memory layout (weights, TP, memory
      fraction, admission cap, chunk size, decode graph size).
    - anything else: exactly this config's explicitly set knobs.
    """
    scope = Scope(gpu=config.gpu, engine=config.engine, engine_version=config.engine_version)
    if failure_class == "UNSUPPORTED_BACKEND":
        return scope, [Clause(field="attention_backend", op="eq",
                              value=config.attention_backend)]
    mscope = scope.model_copy(update={"model": config.model, "quantization": config.weights})
    if failure_class == "OOM_WEIGHTS":
        clauses = [Clause(field="weights", op="eq", value=config.weights)]
        if config.tp_size < (field_domain("tp_size").hi or math.inf):  # "<= the largest TP"
            clauses.append(Clause(field="tp_size", op="le", value=config.tp_size))  # is no family
        if config.speculative_algorithm is not None:  # the draft layer may be what overflowed
            clauses.append(Clause(field="speculative_algorithm", op="eq",
                                  value=config.speculative_algorithm))
        return mscope, clauses
    if failure_class == "HOST_OOM_HICACHE" and config.hicache_ratio is not None:
        # the host pool grows linearly with the ratio: the engine's "Requesting X GB but only
        # have Y GB free" puts the largest ratio that fits at ratio x Y / X
        limit = config.hicache_ratio
        m = re.search(r"Requesting ([\d.]+) GB but only have ([\d.]+) GB free", evidence)
        if m and float(m.group(1)) > 0:
            limit = round(config.hicache_ratio * float(m.group(2)) / float(m.group(1)), 2)
        op = "gt" if limit < config.hicache_ratio else "ge"
        clauses = [Clause(field="enable_hierarchical_cache", op="eq", value=True),
                   Clause(field="tp_size", op="eq", value=config.tp_size)]
        if limit <= 0:  # no host memory free: every ratio fails ("> 0" would name no family)
            return mscope, clauses
        return mscope, [*clauses, Clause(field="hicache_ratio", op=op, value=limit)]
    engine_scope = Scope(engine=config.engine, engine_version=config.engine_version)
    if failure_class == "HICACHE_HOST_TOO_SMALL":
        return engine_scope, [Clause(field="enable_hierarchical_cache", op="eq", value=True),
                              Clause(field="hicache_ratio", op="le", value=1.0)]
    if failure_class == "INVALID_COMBINATION":
        found = _combination(config, evidence)
        if found is not None:
            clauses = found[0]
            if any(c.field == "attention_backend" and c.op == "is_null" for c in clauses):
                return engine_scope.model_copy(update={"model": config.model}), clauses
            return engine_scope, clauses
    if failure_class == "NO_DRAFT_MODEL" and config.speculative_algorithm is not None:
        return Scope(model=config.model, engine=config.engine,
                     engine_version=config.engine_version), [
            Clause(field="speculative_algorithm", op="eq", value=config.speculative_algorithm)]
    if failure_class == "BACKEND_MODEL_MISMATCH":  # a property of the model, not the GPU
        return Scope(model=config.model, engine=config.engine,
                     engine_version=config.engine_version), [
            Clause(field="attention_backend", op="eq", value=config.attention_backend)]
    if failure_class in ("TP_DIVISIBILITY", "MULTI_NODE_REQUIRED"):
        return scope.model_copy(update={"model": config.model}), [
            Clause(field="tp_size", op="eq", value=config.tp_size)]
    if failure_class in ("KV_NO_ROOM", "GRAPH_CAPTURE_OOM"):
        return mscope, [Clause(field=f, op="eq", value=getattr(config, f))
                        for f in MEMORY_FIELDS]
    clauses = [Clause(field="weights", op="eq", value=config.weights),
               Clause(field="tp_size", op="eq", value=config.tp_size)]
    clauses += [Clause(field=k, op="eq", value=v) for k, v in sorted(config.set_fields().items())]
    return mscope, clauses


def failure_lesson(config: ServingConfig, outcome: DeployOutcome, run_id: str,
                   trial_key: str) -> Lesson:
    """The lesson of a failed launch, with the engine's log line as evidence."""
    cls = outcome.failure_class or "UNKNOWN"
    scope, clauses = failure_condition(config, cls, outcome.evidence)
    fix = FIXES.get(cls, "inspect the log; avoid this exact combination")
    combo = _combination(config, outcome.evidence) if cls == "INVALID_COMBINATION" else None
    if combo is not None:
        fix = combo[1]
    title = {
        "UNSUPPORTED_BACKEND": f"--attention-backend {config.attention_backend} refused on "
                               f"{config.gpu} at startup",
        "OOM_WEIGHTS": f"{config.weights} weights: CUDA out of memory at weight load on "
                       f"TP{config.tp_size} {config.gpu}",
    }.get(cls, f"{cls} at startup: {config.weights} TP{config.tp_size} on {config.gpu}")
    if combo is not None or cls in ("HOST_OOM_HICACHE", "HICACHE_HOST_TOO_SMALL",
                                    "NO_DRAFT_MODEL"):
        title = (f"SGLang {config.engine_version} refuses "
                 + " and ".join(c.text() for c in clauses))
    return Lesson(
        title=title, scope=scope, condition=clauses, outcome=OUTCOME.get(cls, "crash"),
        failure_class=cls,
        root_cause=f"SGLang {config.engine_version} died in stage {outcome.stage}: "
                   f"{outcome.evidence}",
        fix=fix,
        evidence="\n".join(outcome.log_tail[-6:]), source="trial", run_id=run_id,
        trial_id=trial_key).with_id()


class Analyst:
    """Deterministic analyst brain over the bench MCP server."""

    def __init__(self, bench: Client, study: Study) -> None:
        self.bench, self.study = bench, study

    async def saturation(self, deployment: str, concurrency: int | None = None,
                         duration_s: float | None = None, repeat: int = 0) -> BenchOutcome:
        """The study's synthetic saturation run on ``deployment``.

        ``repeat`` numbers it among repeated runs of the same candidate (0 = the first).
        """
        s = self.study.saturation
        r = await call(self.bench, "run_saturation", {
            "deployment": deployment, "isl": s.isl, "osl": s.osl,
            "concurrency": concurrency or s.concurrency,
            "duration_s": duration_s or s.duration_s, **({"repeat": repeat} if repeat else {})})
        return BenchOutcome.model_validate(r)

    async def replay(self, deployment: str) -> BenchOutcome:
        """The study's trace replay on ``deployment`` (goodput under the TTFT SLO)."""
        rp = self.study.replay
        r = await call(self.bench, "run_replay", {
            "deployment": deployment, "trace": rp.trace, "format": rp.format,
            "start_s": rp.start_s, "duration_s": rp.duration_s, "time_scale": rp.time_scale,
            "slo_ttft_ms": self.study.slo.ttft_p99_ms})
        return BenchOutcome.model_validate(r)

    async def saturation_runs(self, deployment: str, repeats: int) -> list[BenchOutcome]:
        """``repeats`` saturation runs of ``deployment`` (``repeat`` 0, 1, ...).

        Stops at the first invalid run: an invalid run is never scored, so more would not help.
        """
        out: list[BenchOutcome] = []
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

    async def verdict(self, bench: BenchOutcome, best: float | None, is_baseline: bool,
                      config: ServingConfig, changed: str, gate: AcceptDecision | None = None,
                      objective: float | None = None) -> Verdict:
        """The verdict on a saturation run: :meth:`judge` of its summary and the gate.

        A run the bench server marked invalid (too many failed requests) is not scored: it is
        a ``discard`` (``crash`` if nothing completed) with the server's reason.
        """
        if not bench.valid:
            return invalid_verdict(bench)
        return self.judge(bench.summary, best, is_baseline, gate, objective)


def invalid_verdict(bench: BenchOutcome) -> Verdict:
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

    async def verdict(self, bench: BenchOutcome, best: float | None, is_baseline: bool,
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
