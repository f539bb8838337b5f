"""The lessons SGLang's failures teach: each failure class's family of doomed configs and fix.

A failed launch's class (:mod:`domain.engines.sglang.failures`) and evidence line decide the
lesson's scope and condition (:func:`failure_condition`, following each class's ``condition``
rule in the taxonomy, :mod:`domain.failures`), its fix (:data:`FIXES`, the taxonomy's, or the
fix of the INVALID_COMBINATION refusal its message names) and its outcome (:data:`OUTCOME`, the
taxonomy's). :func:`diagnosis_lesson` is the lesson of a :class:`~domain.failures.Diagnosis`
(``servetune diagnose``), refused with :class:`~domain.failures.NoLesson` when the rule cannot
form a condition for the config.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from domain.config import ServingConfig
from domain.engines.sglang.failures import bad_flag_name, named_fields
from domain.failures import TAXONOMY, Diagnosis, NoLesson
from domain.fit import MEMORY_FIELDS
from domain.knob_domain import field_domain
from domain.lesson import Clause, Lesson, Scope, layout_clauses
from domain.models import get_model

# the fix and the lesson outcome of each class are the failure taxonomy's (domain/failures.py)
FIXES = {name: fc.fix for name, fc in TAXONOMY.items()}
OUTCOME = {name: fc.outcome for name, fc in TAXONOMY.items() if fc.outcome is not None}


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
    ("is greater than the derived context_length",  # configs/model_config.py:1314
     "give --context-length at most the model's own context length, or leave it unset",
     lambda c: [Clause(field="context_length", op="gt",
                       value=get_model(c.model).context_len)]),
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

    - UNSUPPORTED_BACKEND: the backend flag the message names (the vision encoder's
      ``mm_attention_backend``; else ``attention_backend``) at its value, on this GPU, any
      model or checkpoint.
    - OOM_WEIGHTS: these weights at this or any smaller TP and PP (weights per GPU only
      grow); with speculative decoding on, only configs that also load the draft layer.
    - HOST_OOM_HICACHE: HiCache with a host ratio above the largest that fits (from the
      engine's requested/free GB), at this TP and checkpoint.
    - NO_DRAFT_MODEL: speculative decoding with this algorithm on this model.
    - HICACHE_HOST_TOO_SMALL: HiCache with a host ratio <= 1, any model.
    - INVALID_COMBINATION: the family the engine's message names (e.g. HiCache with the radix
      cache disabled; a partial speculative triple), for this engine version on any GPU/model
      (for tree drafting: this model, whose backend forces the page size).
    - KV_NO_ROOM / GRAPH_CAPTURE_OOM / KV_THRASH: exactly this memory layout (weights, TP,
      memory fraction, admission cap, chunk size, decode graph size) and parallel layout.

    Parallel layouts (:func:`domain.lesson.layout_clauses`): a family of a config with
    attention DP, EP, PP, DP copies or a PD layout stays inside that layout (the fields off
    their default are pinned), so a DeepEP OOM at ``ep_size 8`` forbids no config without
    EP; a weights OOM family is widened along the monotone fields instead (``attn_dp_size >=``
    its value, ``pp_size <=`` its value: more PP stages hold fewer layers per GPU).
    - BAD_FLAG: the flag argparse named, at the config's value, this engine version.
    - TP_DIVISIBILITY: this TP on this model, any GPU; MULTI_NODE_REQUIRED: also this GPU.
    - MODEL_LOAD: these weights at this TP on this model, any GPU.
    - anything else: exactly this config's explicitly set knobs.
    """
    scope = Scope(gpu=config.gpu, engine=config.engine, engine_version=config.engine_version)
    engine_scope = Scope(engine=config.engine, engine_version=config.engine_version)
    if failure_class == "UNSUPPORTED_BACKEND":
        field = next((f for f in named_fields(failure_class, evidence)
                      if f in ServingConfig.model_fields), "attention_backend")
        return scope, [Clause(field=field, op="eq", value=getattr(config, field))]
    flag = _bad_flag_field(config, evidence) if failure_class == "BAD_FLAG" else None
    if flag is not None:  # the flag argparse named, at the value the config gave it
        return engine_scope, [Clause(field=flag, op="eq", value=getattr(config, flag))]
    mscope = scope.model_copy(update={"model": config.model, "quantization": config.weights})
    if failure_class == "OOM_WEIGHTS":
        clauses = [Clause(field="weights", op="eq", value=config.weights)]
        if config.tp_size < (field_domain("tp_size").hi or math.inf):  # "<= the largest TP"
            clauses.append(Clause(field="tp_size", op="le", value=config.tp_size))  # is no family
        if config.speculative_algorithm is not None:  # the draft layer may be what overflowed
            clauses.append(Clause(field="speculative_algorithm", op="eq",
                                  value=config.speculative_algorithm))
        return mscope, clauses + layout_clauses(config, weights=True)
    if failure_class == "HOST_OOM_HICACHE" and config.hicache_ratio is not None:
        # the host pool grows linearly with the ratio: the engine's "Requesting X GB but only
        # have Y GB free" puts the largest ratio that fits at ratio x Y / X
        limit = config.hicache_ratio
        m = re.search(r"Requesting ([\d.]+) GB but only have ([\d.]+) GB free", evidence)
        if m and float(m.group(1)) > 0:
            limit = round(config.hicache_ratio * float(m.group(2)) / float(m.group(1)), 2)
        # more free than requested (hugepages, another tenant): the failing ratio still failed
        limit = min(limit, config.hicache_ratio)
        op = "gt" if limit < config.hicache_ratio else "ge"
        clauses = [Clause(field="enable_hierarchical_cache", op="eq", value=True),
                   Clause(field="tp_size", op="eq", value=config.tp_size),
                   *layout_clauses(config)]  # DP ranks each hold a host pool
        if limit <= 0:  # no host memory free: every ratio fails ("> 0" would name no family)
            return mscope, clauses
        return mscope, [*clauses, Clause(field="hicache_ratio", op=op, value=limit)]
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
        # head/shard divisibility is the model's, on any GPU; a node's GPU count is the GPU's
        where = engine_scope if failure_class == "TP_DIVISIBILITY" else scope
        return where.model_copy(update={"model": config.model}), [
            Clause(field="tp_size", op="eq", value=config.tp_size)]
    if failure_class == "MODEL_LOAD":  # the checkpoint is at fault, whatever the flags or GPU
        return mscope.model_copy(update={"gpu": None}), [
            Clause(field="weights", op="eq", value=config.weights),
            Clause(field="tp_size", op="eq", value=config.tp_size)]
    if failure_class in ("KV_NO_ROOM", "GRAPH_CAPTURE_OOM", "KV_THRASH"):
        memory = [Clause(field=f, op="eq", value=getattr(config, f)) for f in MEMORY_FIELDS]
        fields = {c.field for c in memory}
        return mscope, memory + [c for c in layout_clauses(config) if c.field not in fields]
    clauses = [Clause(field="weights", op="eq", value=config.weights),
               Clause(field="tp_size", op="eq", value=config.tp_size)]
    layout = layout_clauses(config)
    pinned = {c.field for c in layout}
    clauses += [Clause(field=k, op="eq", value=v) for k, v in sorted(config.set_fields().items())
                if k not in pinned and k != "pd"]
    return mscope, clauses + layout


def failure_lesson(config: ServingConfig, failure_class: str | None, stage: str | None,
                   evidence: str, log_tail: Sequence[str], run_id: str,
                   trial_key: str) -> Lesson:
    """The lesson of a failed launch of ``config``, with SGLang's log line as evidence.

    Args:
        config: the config that failed to start.
        failure_class: the classifier's class (None: UNKNOWN).
        stage: the startup phase it died in.
        evidence: the log line the classifier matched.
        log_tail: the last lines of the log (the last 6 become the lesson's evidence).
        run_id: the run the trial belongs to.
        trial_key: the trial's ledger key.
    """
    cls = failure_class or "UNKNOWN"
    scope, clauses = failure_condition(config, cls, evidence)
    fix = FIXES.get(cls, FIXES["UNKNOWN"])
    combo = _combination(config, evidence) if cls == "INVALID_COMBINATION" else None
    if combo is not None:
        fix = combo[1]
    title = {
        "UNSUPPORTED_BACKEND": f"--{clauses[0].field.replace('_', '-')} {clauses[0].value} "
                               f"refused on {config.gpu} at startup",
        "OOM_WEIGHTS": f"{config.weights} weights: CUDA out of memory at weight load on "
                       f"TP{config.tp_size} {config.gpu}",
        "GRAPH_CAPTURE_OOM": f"CUDA out of memory while capturing CUDA graphs: "
                             f"{config.weights} TP{config.tp_size} on {config.gpu}",
    }.get(cls, f"{cls} at startup: {config.weights} TP{config.tp_size} on {config.gpu}")
    if combo is not None or cls in ("HOST_OOM_HICACHE", "HICACHE_HOST_TOO_SMALL",
                                    "NO_DRAFT_MODEL") or (
            cls == "BAD_FLAG" and len(clauses) == 1):
        title = (f"SGLang {config.engine_version} refuses "
                 + " and ".join(c.text() for c in clauses))
    return Lesson(
        title=title, scope=scope, condition=clauses, outcome=OUTCOME.get(cls, "crash"),
        failure_class=cls,
        root_cause=f"SGLang {config.engine_version} died in stage {stage}: "
                   f"{evidence}",
        fix=fix,
        evidence="\n".join(list(log_tail)[-6:]), source="trial", run_id=run_id,
        trial_id=trial_key).with_id()


def _bad_flag_field(config: ServingConfig, evidence: str) -> str | None:
    """The ServingConfig field of the flag an argparse refusal names, if the config sets it."""
    flag = bad_flag_name(evidence)
    field = flag.lstrip("-").replace("-", "_") if flag else None
    if field in ServingConfig.model_fields and getattr(config, field) is not None:
        return field
    return None


def lesson_problem(config: ServingConfig, d: Diagnosis) -> str | None:
    """Why the taxonomy's rule of ``d``'s class forms no lesson for ``config`` (None: it does)."""
    fc = TAXONOMY.get(d.failure_class)
    if fc is not None and fc.outcome is None:
        return (f"{d.failure_class} is transient ({fc.retry.why}); it is retried, not learned")
    if d.failure_class == "BAD_FLAG" and _bad_flag_field(config, d.evidence) is None:
        flag = bad_flag_name(d.evidence) or "the refused flag"
        return (f"{flag} is not a setting of the config servetune knows (no ServingConfig "
                "field, or the config leaves it unset), so no condition can name it")
    if d.failure_class == "UNSUPPORTED_BACKEND":
        fields = named_fields(d.failure_class, d.evidence)
        field = fields[0] if fields else "attention_backend"
        if field not in ServingConfig.model_fields:
            return (f"the message names --{field.replace('_', '-')}, which servetune's config "
                    "has no field for, so no condition can name it")
        if getattr(config, field) is None:
            return (f"the config leaves --{field.replace('_', '-')} unset (the log's "
                    "server_args did not show it), so the refused value is unknown")
    return None


def diagnosis_lesson(config: ServingConfig, d: Diagnosis, log_tail: Sequence[str]) -> Lesson:
    """The lesson a diagnosed log teaches for ``config`` (what ``servetune diagnose`` prints).

    ``verified`` and ``source_site`` are the diagnosis's (source-grounded or not); the lesson's
    source and provenance backend are ``user`` (a log a person handed in, no run or trial of
    servetune's), with the log's last lines as its evidence.

    Raises:
        NoLesson: the class is transient or its rule cannot name the failing setting for
            ``config`` (:func:`lesson_problem` says why), or the condition names no family.
    """
    problem = lesson_problem(config, d)
    if problem is not None:
        raise NoLesson(problem)
    try:
        lesson = failure_lesson(config, d.failure_class, d.phase, d.evidence, log_tail, "", "")
    except ValueError as e:  # the condition names no family (e.g. a default-only clause)
        raise NoLesson(f"the {d.failure_class} rule names no family for this config: {e}") \
            from e
    from domain.provenance import Provenance, evidence_lines, now_iso

    prov = Provenance(backend="user", engine=config.engine,
                      engine_version=config.engine_version,
                      evidence=evidence_lines(lesson.evidence), learned_at=now_iso())
    return lesson.model_copy(update={"verified": d.verified, "source_site": d.source,
                                     "source": "user", "run_id": None, "trial_id": None,
                                     "provenance": prov})
