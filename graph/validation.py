"""The validate and frontier phases' helpers: over-admission, admission retuning, quality gate.

Called by :func:`graph.supervisor.validate` and :func:`graph.supervisor.frontier`; every
measurement goes through the bench and cluster MCP servers and is committed to the ledger
before the next one, keyed by config, so a resumed run repeats none of them.

- :func:`admission_of`: the over-admission verdict of a replay, read from its per-request
  records (``get_records``) by :mod:`domain.admission`.
- :func:`retune`: on an over-admitted finalist, replay the cap candidates near the measured
  capacity and, where the trace's prefixes repeat (prefix-cache hits >= :data:`REPEAT_HITS`),
  HiCache; each is a ``validate`` trial, adopted only by :func:`domain.admission.adopt`.
- :func:`quality_gate`: the gate of :mod:`domain.quality` for a finalist -- not needed when its
  numerics equal the reference's (the study's baseline), not applicable on the twin or when an
  endpoint identifies itself as simulated (``run_greedy`` marks its result ``simulated``: the
  twin server that ``--backend local`` runs without a GPU), else the greedy outputs of the fixed
  prompt set (bench ``run_greedy``) against the reference's.
- :func:`frontier_targets`: the finalists plus a speculative (NEXTN) variant of the winner when
  the model ships an MTP/NextN head.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from agents.analyst import Analyst, replica_mean
from agents.deployer import Deployer
from agents.mcp_tools import ToolCallFailed, call
from agents.planner import spec_cap_target
from domain.admission import OverAdmission, adopt, detect, time_series
from domain.bench import BenchResult
from domain.config import ServingConfig
from domain.errors import ConfigInvalid
from domain.knobs import apply_knob
from domain.ledger import Ledger
from domain.models import get_model
from domain.quality import (
    SIMULATED_NOT_APPLICABLE,
    TWIN_NOT_APPLICABLE,
    QualityGate,
    compare_outputs,
    numerics_changes,
)
from domain.study import Study
from domain.trial import Trial, manifest_for, per_run
from graph.retry import deployment, launch, measure
from graph.state import StudyContext

REPEAT_HITS = 0.05  # prefix-cache hit rate from which a trace's prefixes "repeat" (HiCache pays)
HICACHE_RATIO = 2.0  # SGLang's default --hicache-ratio (server_args.py), host = 2x device pool
PAGE = 1000  # records per get_records page (the tool's maximum)
REFERENCE_META = "quality_reference_outputs"  # ledger meta: the reference's greedy outputs


async def admission_of(ctx: StudyContext, rep: BenchResult, config: ServingConfig
                       ) -> OverAdmission | None:
    """The over-admission verdict of replay ``rep`` from its records (None: no records)."""
    rows: list[dict[str, Any]] = []
    start: int | None = 0
    while start is not None:
        page = await call(ctx.bench, "get_records", {"bench_id": rep.bench_id, "start": start,
                                                     "max_items": PAGE})
        rows += page["records"]
        start = page["next_start"]
    if not rows:
        return None
    nan = float("nan")
    arr = np.array([r["sent_s"] for r in rows], dtype=float)
    ttft = np.array([nan if r["ttft_ms"] is None else r["ttft_ms"] / 1e3 for r in rows])
    e2e = np.array([nan if r["e2e_ms"] is None else r["e2e_ms"] / 1e3 for r in rows])
    out = np.array([r["output_tokens"] for r in rows], dtype=float)
    return detect(time_series(arr, ttft, e2e, out), config.replicas,
                  config.max_running_requests)


def _variants(config: ServingConfig, found: OverAdmission, hit_rate: float | None,
              gpu_count: int) -> list[tuple[str, ServingConfig]]:
    out: list[tuple[str, ServingConfig]] = []
    for cap in found.cap_candidates:
        out.append((f"max_running_requests={cap}",
                    apply_knob(config, "max_running_requests", cap, gpu_count)))
    if hit_rate is not None and hit_rate >= REPEAT_HITS and not config.enable_hierarchical_cache:
        out.append((f"hicache_ratio={HICACHE_RATIO:g}",
                    apply_knob(config, "hicache_ratio", HICACHE_RATIO, gpu_count)))
    return out


async def retune(ctx: StudyContext, parent: Trial, deployer: Deployer, analyst: Analyst,
                 gate: QualityGate | None) -> list[Trial]:
    """Replay the admission variants of over-admitted finalist ``parent`` (a validate trial).

    Each variant is deployed, replayed and judged by :func:`domain.admission.adopt` against
    ``parent``; an adopted one also runs the saturation benchmark (its objective ranks it
    among the finalists) and becomes a ``finalist`` (``slo-miss`` if it still misses the SLO);
    the others are ``discard``. A HiCache variant starts from the best adopted cap, if any.
    """
    study, found = ctx.study, parent.admission
    if found is None or not found.detected or parent.replay is None:
        return []
    slo, margin = study.slo.ttft_p99_ms, study.min_improvement
    done: list[Trial] = []
    base_cfg = parent.config
    for label, cfg in _variants(base_cfg, found, parent.cache_hit_rate, study.gpu_count):
        if label.startswith("hicache"):
            best = min((t for t in done if t.status in ("finalist", "slo-miss")),
                       key=lambda t: (t.replay.ttft_ms.p99 or float("inf")) if t.replay
                       else float("inf"), default=None)
            if best is not None:
                cfg = apply_knob(best.config, "hicache_ratio", HICACHE_RATIO, study.gpu_count)
                label = f"{best.changed}, {label}"
        key = f"validate:{cfg.config_id()}"
        have = ctx.ledger.get(key)
        if have is not None:
            done.append(have)
            continue
        ctx.report(phase="validate", trial=len(done) + 1, total=len(found.cap_candidates) + 1,
                   config=f"retune: {label}")
        done.append(await _measure_variant(ctx, parent, cfg, label, key, deployer, analyst,
                                           gate, slo, margin))
    return done


async def _measure_variant(ctx: StudyContext, parent: Trial, cfg: ServingConfig, label: str,
                           key: str, deployer: Deployer, analyst: Analyst,
                           gate: QualityGate | None, slo: float, margin: float) -> Trial:
    t0 = time.time()
    name = ctx.deployment_name(cfg)
    ctx.event("deploy", key=key, name=name)
    rep = sat = None
    labels = {"servetune/run-id": ctx.run_id}
    retried: list[dict[str, Any]] = []
    async with deployment(deployer, name):
        out = await launch(ctx, deployer, name, cfg, labels, key, retried)
        if out.ready:
            rep = await analyst.replay(name)
            assert parent.replay is not None
            ok, why = adopt(parent.replay.ttft_ms.p99, parent.replay.output_tok_s,
                            rep.summary.ttft_ms.p99, rep.summary.output_tok_s,
                            rep.summary.errors, slo, margin)
            if ok:
                async def one() -> list[BenchResult]:
                    return [await analyst.saturation(name)]

                sat = (await measure(ctx, deployer, name, cfg, labels, key, one, retried))[0]
    row: dict[str, Any] = dict(
        run_id=ctx.run_id, seq=0, key=key, phase="validate", config=cfg, changed=label,
        parent_seq=parent.seq, manifest=manifest_for(cfg, ctx.backend_kind), quality=gate,
        retries=retried, wall_s=0.0)
    if rep is None:
        return ctx.ledger.append(Trial(**row, status="crash",
                                       reason=f"retune {label}: did not start: {out.evidence}"))
    met = ctx.study.slo.met(rep.summary.ttft_ms.p99, rep.summary.errors)
    status = ("finalist" if met else "slo-miss") if ok else "discard"
    found = await admission_of(ctx, rep, cfg)
    return ctx.ledger.append(Trial(
        **{**row, "wall_s": time.time() - t0}, status=status,
        reason=f"retune {label} of #{parent.seq} under the trace: {why}",
        objective=sat.summary.output_tok_s_per_gpu if sat is not None else None,
        saturation=sat.summary if sat is not None else None, replay=rep.summary,
        cache_hit_rate=replica_mean(rep.replicas, "cache_hit_rate"),
        saturation_replicas=sat.replicas if sat is not None else [],
        replay_replicas=rep.replicas, records_path=rep.records_path, admission=found,
        replica_requests=per_run(saturation=sat.replica_requests if sat is not None else None,
                                 replay=rep.replica_requests)))


# ---------------------------------------------------------------- quality gate
def gate_needed(study: Study, config: ServingConfig) -> list[str]:
    """What in ``config`` changes numerics vs the study's baseline (the reference config)."""
    return numerics_changes(config, study.base_config())


@dataclass(frozen=True)
class Simulated:
    """``run_greedy`` met a simulated endpoint: there are no model outputs to compare."""

    by: str  # what simulates it (the endpoint's x-servetune-simulated header, e.g. "twin")


async def candidate_outputs(ctx: StudyContext, config: ServingConfig, name: str
                            ) -> list[str] | Simulated | None:
    """Greedy outputs of deployed ``name`` if the gate needs them, else None.

    Needed on real endpoints when ``config`` changes numerics vs the reference; a
    :class:`Simulated` when the endpoint says it is simulated.
    """
    if ctx.backend_kind == "twin" or not gate_needed(ctx.study, config):
        return None
    r = await call(ctx.bench, "run_greedy", {"deployment": name})
    if r.get("simulated"):
        return Simulated(str(r["simulated"]))
    return [str(x) for x in r["outputs"]]


async def _reference_outputs(ctx: StudyContext, deployer: Deployer
                             ) -> list[str] | Simulated | str:
    """The reference's greedy outputs (cached in ledger meta), or why they could not be had.

    A :class:`Simulated` when the reference's endpoint says it is simulated (nothing cached).
    """
    ref = ctx.study.base_config()
    raw = ctx.ledger.get_meta(REFERENCE_META)
    if raw:
        cached = json.loads(raw)
        if cached.get("config_id") == ref.config_id():
            return [str(x) for x in cached["outputs"]]
    name = ctx.deployment_name(ref)
    ctx.event("deploy", key=f"quality:{ref.config_id()}", name=name)
    async with deployment(deployer, name):
        try:
            out = await launch(ctx, deployer, name, ref, {"servetune/run-id": ctx.run_id},
                               f"quality:{ref.config_id()}")
            if not out.ready:
                return f"the reference (baseline) did not start: {out.evidence[:160]}"
            r = await call(ctx.bench, "run_greedy", {"deployment": name})
        except ToolCallFailed as e:
            return f"the reference's outputs could not be read: {e}"
    if r.get("simulated"):
        return Simulated(str(r["simulated"]))
    outputs = [str(x) for x in r["outputs"]]
    ctx.ledger.set_meta(REFERENCE_META, json.dumps({"config_id": ref.config_id(),
                                                    "prompts_sha": r["prompts_sha"],
                                                    "outputs": outputs}))
    return outputs


async def quality_gate(ctx: StudyContext, config: ServingConfig,
                       outputs: list[str] | Simulated | None, deployer: Deployer) -> QualityGate:
    """The quality gate's decision on ``config`` (``outputs``: from :func:`candidate_outputs`).

    Simulated outputs (the candidate's or the reference's endpoint says it is simulated) make
    it ``not-applicable`` (:data:`~domain.quality.SIMULATED_NOT_APPLICABLE`): it neither blocks
    nor passes.
    """
    ref = ctx.study.base_config()
    changes = gate_needed(ctx.study, config)
    need = ctx.study.validation.quality_min_token_match
    base = dict(changes=changes, reference_config_id=ref.config_id(), min_token_match=need)
    if not changes:
        return QualityGate(status="not-needed", reason="same weights and KV cache dtype as the "
                           "reference (baseline): numerics unchanged", **base)
    if ctx.backend_kind == "twin":
        return QualityGate(status="not-applicable", reason=TWIN_NOT_APPLICABLE, **base)
    if isinstance(outputs, Simulated):
        return QualityGate(status="not-applicable", reason=SIMULATED_NOT_APPLICABLE, **base)
    if outputs is None:
        return QualityGate(status="fail", reason="no greedy outputs of the candidate", **base)
    reference = await _reference_outputs(ctx, deployer)
    if isinstance(reference, Simulated):
        return QualityGate(status="not-applicable", reason=SIMULATED_NOT_APPLICABLE, **base)
    if isinstance(reference, str):
        return QualityGate(status="fail", reason=reference, **base)
    rate, ok = compare_outputs(outputs, reference, need)
    return QualityGate(status="pass" if ok else "fail", token_match_rate=rate,
                       prompts=len(reference),
                       reason=f"greedy token match {rate:.1%} {'>=' if ok else '<'} "
                              f"{need:.0%} vs the reference on {len(reference)} prompts", **base)


# ---------------------------------------------------------------- frontier
def speculative_variant(study: Study, config: ServingConfig) -> ServingConfig | None:
    """``config`` with NEXTN speculative decoding, or None.

    None when the model ships no MTP/NextN head or ``config`` is speculative already. When
    speculation's default admission cap (48 in SGLang 0.5.23) would hold the batch down at the
    study's load, the variant also sets ``max_running_requests``
    (:func:`agents.planner.spec_cap_target`), so the frontier compares speculation against the
    winner rather than against the default cap.
    """
    if config.speculative_algorithm is not None or get_model(config.model).mtp_layers < 1:
        return None
    try:
        spec = apply_knob(config, "speculative", "nextn", study.gpu_count)
        cap = spec_cap_target(spec, study)
        if cap is not None:
            spec = apply_knob(spec, "max_running_requests", cap, study.gpu_count)
        return spec
    except ConfigInvalid:
        return None


def frontier_targets(ledger: Ledger, study: Study, finalists: list[int]
                     ) -> list[tuple[ServingConfig, str, int]]:
    """(config, changed label, parent seq) of every config the frontier sweeps, in order.

    The finalists (search trials), then the speculative variant of the winner (or, with no
    winner, of the best finalist) when :func:`speculative_variant` gives one.
    """
    by_seq = {t.seq: t for t in ledger.trials()}
    out = [(by_seq[s].config, by_seq[s].changed, s) for s in finalists if s in by_seq]
    validated = [t for t in ledger.trials("validate") if t.status in ("winner", "finalist")]
    top = next((t for t in validated if t.status == "winner"), None) or (
        by_seq[finalists[0]] if finalists and finalists[0] in by_seq else None)
    if top is not None:
        spec = speculative_variant(study, top.config)
        seen = {c.config_id() for c, _, _ in out}
        if spec is not None and spec.config_id() not in seen:
            label = "speculative=nextn"
            if spec.max_running_requests != top.config.max_running_requests:
                label += f", max_running_requests={spec.max_running_requests}"
            out.append((spec, label, top.seq))
    return out
