"""Lessons the planner writes without a crash: the memory-fit estimate's and research's.

:func:`estimate_lesson` turns a :class:`~domain.errors.DoesNotFit` of the memory-fit estimate
into a lesson covering the whole family that fails the same way (source ``estimate``: its
evidence is the arithmetic); :func:`research_lesson` records a research drop
(:func:`domain.research.research_verdict`): a knob value refused on the GPU's architecture, as
read in the engine's source (source ``research``). The lessons a failed launch teaches are the
analyst's (``agents.analyst.failure_lesson``).
"""

from __future__ import annotations

import math

from domain.config import ServingConfig
from domain.errors import DoesNotFit
from domain.fit import MEMORY_FIELDS, fit
from domain.hardware import get_gpu
from domain.knob_domain import field_domain
from domain.lesson import Clause, Lesson, Scope, layout_clauses
from domain.provenance import Provenance, evidence_lines
from domain.research import RESEARCH_FLAGS, research_change
from domain.study import Study


def estimate_lesson(config: ServingConfig, err: DoesNotFit, study: Study) -> Lesson:
    """Lesson for a config the memory-fit estimate rules out, covering its whole family.

    Weights that exceed the GPU at TP ``t`` exceed it at every smaller TP, so the condition is
    ``weights == w AND tp_size <= t_max AND pp_size <= p`` where ``t_max`` is the largest TP of
    the study's space that also fails and ``p`` the config's PP stages (more stages hold fewer
    layers per GPU); a config with attention DP, EP or a PD layout keeps its family inside
    that layout (:func:`domain.lesson.layout_clauses`); a KV-pool or graph-capture shortfall
    also depends on mem_fraction_static.

    Args:
        config: the config the estimate ruled out.
        err: the estimate's verdict (:func:`domain.fit.fit`), with its phase and arithmetic.
        study: the study whose ``tp_size`` values bound the weights family.

    Returns:
        The lesson, with its id (``outcome="does-not-fit"``, ``source="estimate"``, provenance
        ``estimate``: the arithmetic is its evidence; the run and trial are filled when it is
        committed, graph/state.py:with_provenance).
    """
    scope = Scope(gpu=config.gpu, model=config.model, quantization=config.weights,
                  engine=config.engine, engine_version=config.engine_version)
    evidence = [err.arithmetic]
    t_max = config.tp_size
    if err.phase == "weights_load":
        for t in sorted(int(v) for v in study.knobs.get("tp_size", [])):
            if t > t_max:
                try:
                    fit(config.model_copy(update={"tp_size": t}))
                except DoesNotFit as e2:
                    if e2.phase == "weights_load":
                        t_max = t
                        evidence.append(e2.arithmetic)
                        continue
                break
        cond = [Clause(field="weights", op="eq", value=config.weights)]
        if t_max < (field_domain("tp_size").hi or math.inf):  # "<= the largest TP" is no
            cond.append(Clause(field="tp_size", op="le", value=t_max))  # family (D2)
        # the parallel layout: at most this many PP stages (each holds 1 / pp_size of the
        # layers), at least this attention DP (attention replicated per rank), the rest pinned
        cond += layout_clauses(config, weights=True)
        title = (f"{config.weights} weights of {config.model} do not fit TP<={t_max} "
                 f"{config.gpu}: the weight shard exceeds GPU memory (out of memory at weight "
                 "load, by the memory-fit estimate)")
        fix = (f"use more than {t_max} GPUs per replica (--tp-size) or a checkpoint with fewer "
               "bytes per parameter")
        failure_class = "OOM_WEIGHTS"
    else:
        # KV-pool and graph-capture shortfalls depend on every knob that sizes memory, so the
        # family is exactly this memory layout (never a broader one that a later run would
        # wrongly prune).
        cond = [Clause(field=f, op="eq", value=getattr(config, f)) for f in MEMORY_FIELDS]
        cond += [c for c in layout_clauses(config) if c.field not in MEMORY_FIELDS]
        if err.phase == "kv_pool":
            title = (f"{config.weights} TP{config.tp_size} leaves no KV cache at "
                     f"mem_fraction_static {config.mem_fraction_static or 'default'} "
                     "(memory-fit estimate)")
            fix = "raise --mem-fraction-static, raise --tp-size or use a smaller checkpoint"
            failure_class = "KV_NO_ROOM"
        else:
            title = (f"{config.weights} TP{config.tp_size}: too little memory outside the static "
                     "pool for CUDA-graph capture and prefill activations (memory-fit estimate)")
            fix = ("lower --mem-fraction-static, --cuda-graph-max-bs-decode or "
                   "--chunked-prefill-size")
            failure_class = "GRAPH_CAPTURE_OOM"
    return Lesson(title=title, scope=scope, condition=cond, outcome="does-not-fit",
                  failure_class=failure_class,
                  root_cause=f"memory-fit estimate: {err.arithmetic}", fix=fix,
                  evidence="\n".join(evidence), source="estimate",
                  provenance=Provenance(backend="estimate", engine=config.engine,
                                        engine_version=config.engine_version,
                                        evidence=evidence_lines("\n".join(evidence)))
                  ).with_id()


def research_lesson(config: ServingConfig, changed: str, reason: str, run_id: str) -> Lesson:
    """The lesson a research drop writes: this knob value is refused on this GPU's architecture.

    Scope: the GPU and engine version (an architecture check holds for every model); condition:
    the knob's field equals the candidate's value. Source ``research``: it was read in the
    engine's code, not seen in a crash.

    Args:
        config: the dropped candidate.
        changed: its 'knob=value'.
        reason: :func:`domain.research.research_verdict`'s reason (the claim and its file:line
            evidence), or the Claude planner's reason with its evidence.
        run_id: the run that asked.

    Returns:
        The lesson, with its id (``outcome="unsupported"``, ``source="research"``, provenance
        ``research``).

    Raises:
        ConfigInvalid: ``config.gpu`` is not in the hardware catalog.
    """
    knob = (research_change(changed) or changed).split("=", 1)[0]
    field = knob if knob in ServingConfig.model_fields else RESEARCH_FLAGS.get(knob, knob)
    value = getattr(config, field)
    flag = "--" + field.replace("_", "-")
    return Lesson(title=f"{flag} {value} refused on {config.gpu} "
                        f"(SM {get_gpu(config.gpu).sm_major * 10}), per the SGLang source",
                  scope=Scope(gpu=config.gpu, engine_version=config.engine_version),
                  condition=[Clause(field=field, op="eq", value=value)],
                  outcome="unsupported", failure_class="UNSUPPORTED_BACKEND"
                  if field == "attention_backend" else "INVALID_COMBINATION",
                  root_cause=reason[:4000],
                  fix=f"leave {flag} unset or choose a value the {config.gpu} architecture "
                      "supports",
                  evidence=reason[:20000], source="research", run_id=run_id,
                  provenance=Provenance(backend="research", engine=config.engine,
                                        engine_version=config.engine_version, run_id=run_id,
                                        evidence=evidence_lines(reason[:20000]))).with_id()
