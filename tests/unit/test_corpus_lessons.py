"""The lesson each SGLang log of the corpus teaches, checked as a property (issue 18, Done when 1).

For every excerpt of ``tests/data/sglang_logs/`` the failing config is the entry's ``config``
completed with a catalog GPU, model and checkpoint consistent with the excerpt (:data:`FAILING`
says which and why). The excerpt is diagnosed exactly as ``servetune diagnose --gpu G`` would
(``servetune/cli_diagnose.py`` -> :func:`domain.diagnosis.diagnose_log` with the source hook
:func:`mcp_servers.lessons.ground.source_ground` over the pinned 0.5.23 tree), with the log's
own ``server_args=ServerArgs(...)`` launch line in front (the line every full SGLang log starts
with; the corpus excerpts are cut after it), so the config the diagnosis reads is the failing
config. Then, over generated configs:

1. the lesson forbids the failing config;
2. it forbids every config that differs from it only in fields the failing check does not test
   (the other ServingConfig knob fields drawn over their domains,
   :func:`domain.knob_domain.field_domain`; combinations the config refuses are left at the
   failing value);
3. it forbids no config on which the check's condition is false.

"The check" is what the lesson claims to encode:

* a **verified** lesson (the message's raise or assert site was found and its guard gave the
  condition): the guard itself, read from the pinned source's AST. Its tested fields are the
  flag dests it compares (plus the GPU's SM and the model's checkpoint when it tests those), and
  its truth on a config is :func:`mcp_servers.source.raises.evaluate_site`, as in
  ``tests/unit/test_grounding.py``;
* an **unverified** lesson (no site, or a guard that gives no condition): the failure
  taxonomy's rule of its class (``domain/failures.py``: ``FailureClass.condition`` and
  ``fields``), written here independently as one atom per tested field (:func:`_rule_atoms`);
  the rule is false on a config when any atom is. For the classes whose rule is "the flag the
  message names" (UNSUPPORTED_BACKEND) the field is the corpus label's flag.

A KV_THRASH lesson is informative (outcome ``slo-miss``: the config runs): it forbids nothing,
so the property is checked on the family it *matches*, and it must forbid nothing.
Entries that teach no lesson are listed in :data:`NO_LESSON` with the reason diagnose gives,
and the test asserts that reason.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
from fixtures.log_corpus import Entry, load_index
from fixtures.pinned_index import pinned_index_fixture  # noqa: F401
from fixtures.pinned_source import pinned_tree_path
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from domain.config import ServingConfig
from domain.diagnosis import DiagnosisReport, diagnose_log
from domain.failures import TAXONOMY, Diagnosis
from domain.fit import MEMORY_FIELDS
from domain.grounding import FlagAtom, GuardFacts, ModelAtom, SmAtom
from domain.hardware import GPUS, get_gpu
from domain.knob_domain import field_domain
from domain.lesson import FORBIDDING, KNOB_FIELDS, Lesson
from domain.models import MODELS, get_model

EXAMPLES = 25  # generated configs per entry and property half
VERSION = "0.5.23"

# file prefix -> (gpu, model, weights, other fields, how the completion was chosen). The
# entry's own ``config`` fields are always kept (the test asserts they agree).
FAILING: dict[str, tuple[str, str, str, dict[str, Any], str]] = {
    "01": ("H200", "deepseek-v3", "fp8", {"tp_size": 8},
           "thread: DeepSeek-V3 on 2x8 H20 (no H20 in the catalog: the Hopper H200, one node)"),
    "02": ("B200", "qwen3-32b", "bf16", {"mm_attention_backend": "fa3"},
           "Qwen3-VL is not in the catalog; any model on SM 100 with the vision backend fa3"),
    "03": ("B200", "qwen3-32b", "bf16", {"mm_attention_backend": "fa3"}, "as 02"),
    "04": ("B200", "qwen3-32b", "bf16", {},
           "GDN model (Qwen3-Next, not in the catalog) with flashinfer on Blackwell"),
    "05": ("H200", "llama-3.1-8b", "bf16", {}, "argparse refusal: any model"),
    "06": ("H200", "deepseek-v3", "fp8", {"tp_size": 8, "hicache_ratio": 4.0},
           "the issue's HiCache ratio 4 at TP8 (the message: 40 GB asked, 44.87 GB free)"),
    "07": ("H200", "deepseek-v3", "fp8", {"tp_size": 8, "hicache_ratio": 2.0},
           "HiCache at its default ratio 2 (7.05 GB asked, 2.04 GB free)"),
    "08": ("H200", "deepseek-v3", "fp8", {"tp_size": 8, "speculative_algorithm": "EAGLE"},
           "speculative decoding on at the logged memory fraction"),
    "09": ("H200", "qwen3-32b", "bf16", {}, "tp_size 6 does not split the (vision) heads"),
    "10": ("H200", "deepseek-v3", "fp8", {"tp_size": 8}, "an NCCL watchdog: transient"),
    "11": ("H200", "deepseek-r1", "fp8", {}, "TP16 on one 8-GPU node"),
    "12": ("H200", "deepseek-r1", "fp8", {"tp_size": 16}, "DeepSeek-R1 at TP16 (two nodes)"),
    "13": ("H200", "deepseek-v3", "fp8", {"tp_size": 8}, "NCCL init: transient"),
    "14": ("H200", "llama-3.1-8b", "bf16", {}, "a crash while serving: any model"),
    "15": ("H200", "llama-3.1-8b", "bf16", {}, "a stall at capture: transient"),
    "16": ("H200", "deepseek-v3", "fp8", {}, "the entry's config"),
    "17": ("H100", "deepseek-v3", "fp8", {"tp_size": 8}, "DeepSeek weights at TP8 on H100"),
    "18": ("B200", "llama-3.1-8b", "bf16", {"speculative_algorithm": "EAGLE3"},
           "an EAGLE3 (MHA) draft with trtllm_mla: a non-MLA model"),
    "19": ("H200", "deepseek-v3", "fp8", {"tp_size": 8}, "gloo at capture: transient"),
    "20": ("H200", "glm-5", "fp8", {"tp_size": 8}, "a GLM checkpoint whose architecture the "
           "engine does not know (GLM-4 is not in the catalog)"),
    "21": ("B200", "llama-3.1-8b", "bf16", {"attention_backend": "flashinfer"},
           "SM 120 is not in the catalog: the Blackwell B200, flashinfer (the kernel raising)"),
    "22": ("B200", "deepseek-r1", "fp8", {"tp_size": 8}, "as 21, trtllm_mla on an MLA model"),
    "23": ("H200", "llama-3.1-70b", "bf16", {}, "a silent stop: transient"),
    "24": ("H200", "deepseek-r1", "fp8", {}, "the entry's config (TP32)"),
    "25": ("H200", "qwen3-235b-a22b", "fp8", {},
           "Qwen3.5 is not in the catalog: the FP8 block-quantized Qwen3 MoE at TP8"),
    "26": ("H200", "llama-3.1-8b", "bf16", {}, "argparse refusal: any model"),
    "27": ("H200", "deepseek-r1", "fp8", {}, "TP16 over two nodes"),
    "28": ("H200", "deepseek-r1", "fp8", {}, "a multi-node hang: transient"),
    "29": ("H200", "llama-3.1-8b", "bf16", {}, "a device-side assert while serving"),
    "30": ("H200", "deepseek-v3", "fp8", {"tp_size": 8}, "graph capture of a large MoE"),
    "31": ("H200", "llama-3.1-8b", "bf16", {}, "retraction while serving"),
    "32": ("H200", "llama-3.1-8b", "bf16", {}, "DFLASH is not a ServingConfig algorithm"),
    "33": ("H200", "llama-3.1-8b", "bf16", {}, "DSPARK is not a ServingConfig algorithm"),
    "34": ("H200", "llama-3.1-8b", "bf16", {"hicache_ratio": 1.0},
           "a host pool no larger than the device pool: ratio 1"),
    "35": ("H200", "llama-3.1-8b", "bf16", {"hicache_ratio": 0.5}, "host capacity 0: ratio < 1"),
    "36": ("H200", "llama-3.1-8b", "bf16", {}, "flags servetune's config has no field for"),
    "37": ("H200", "llama-3.1-8b", "bf16", {}, "as 36"),
    "38": ("H200", "llama-3.1-8b", "bf16", {}, "as 36"),
    "39": ("H200", "llama-3.1-8b", "bf16", {}, "weights missing at --model-path"),
    "40": ("B200", "llama-3.1-70b", "fp8", {"tp_size": 4}, "fa3 on SM 100 (the SM check)"),
    "41": ("B200", "deepseek-v3", "fp8", {"tp_size": 8}, "trtllm_mha on an MLA model"),
    "42": ("H200", "llama-3.1-70b", "bf16", {"tp_size": 4}, "70B bf16 at TP4, fraction 0.7"),
    "43": ("H200", "llama-3.1-8b", "bf16", {"speculative_algorithm": "EAGLE",
                                             "speculative_num_steps": 3,
                                             "speculative_eagle_topk": 1,
                                             "speculative_num_draft_tokens": 4},
           "EAGLE verify kernel assert: an EAGLE triple"),
    "44": ("H200", "qwen3-235b-a22b", "fp8", {"tp_size": 30},
           "the FP8 gate/up block check at TP30 (block_n does not divide the shard)"),
}

# file prefix -> the reason diagnose gives for teaching no lesson (a fragment it must contain)
NO_LESSON: dict[str, str] = {
    "05": "--reasoning_parser is not a setting of the config servetune knows",
    "26": "--enable-reasoning is not a setting of the config servetune knows",
    **{k: "is transient" for k in ("10", "13", "19")},            # NCCL: retried on a new pod
    **{k: "is transient" for k in ("15", "23", "28")},            # READY_TIMEOUT: retried once
    # the guard tests a flag servetune's config cannot state: no condition can name it
    "32": "--speculative-draft-model-path, which servetune's config has no field for",
    "33": "--speculative-draft-model-path, which servetune's config has no field for",
    "36": "which servetune's config has no field for",
    "37": "which servetune's config has no field for",
    "38": "which servetune's config has no field for",
}


def _entries() -> list[Entry]:
    return load_index()


def _key(e: Entry) -> str:
    return e.file[:2]


def _failing(e: Entry) -> ServingConfig:
    gpu, model, weights, extra, _ = FAILING[_key(e)]
    given_ = {k: v for k, v in e.config.items() if v is not None}
    assert given_.get("gpu", gpu) == gpu and given_.get("model", model) == model, e.file
    kw = {"gpu": gpu, "model": model, "weights": weights, **extra, **given_}
    if kw.get("hicache_ratio") is not None:
        kw["enable_hierarchical_cache"] = True
    return ServingConfig(**kw)


def _launch_line(c: ServingConfig) -> str:
    """The ``server_args=ServerArgs(...)`` line SGLang logs at start for config ``c``."""
    kv = {"model_path": get_model(c.model).checkpoints[c.weights].model_path,
          "tp_size": c.tp_size, **c.set_fields()}
    return ("[2026-01-01 00:00:00] server_args=ServerArgs("
            + ", ".join(f"{k}={v!r}" for k, v in kv.items()) + ")")


@cache
def _hook() -> Any:
    from mcp_servers.lessons.ground import source_ground

    ground, note = source_ground(pinned_tree_path(VERSION), VERSION)
    assert ground is not None, note
    return ground


def _diagnose(e: Entry) -> tuple[DiagnosisReport, GuardFacts | None, ServingConfig]:
    """What ``servetune diagnose --gpu G`` reports for the entry's log (and the guard's facts)."""
    failing = _failing(e)
    seen: dict[str, GuardFacts | None] = {"facts": None}

    def ground(d: Diagnosis, lines: Any) -> tuple[Diagnosis, GuardFacts | None]:
        d2, facts = _hook()(d, lines)
        seen["facts"] = facts
        return d2, facts

    report = diagnose_log([_launch_line(failing), *e.lines()], "sglang", VERSION, failing.gpu,
                          None, None, ground=ground)
    return report, seen["facts"], failing


# ---- the checks' tested fields and truth ---------------------------------------------------

Atoms = dict[str, Callable[[Any], bool]]  # field -> "this atom of the check is FALSE at v"


def _ne(v0: Any) -> Callable[[Any], bool]:
    return lambda v: v != v0


def _field_of(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _rule_atoms(e: Entry, f: ServingConfig, evidence: str) -> Atoms:
    """The taxonomy rule of the entry's class as atoms (domain/failures.py ``condition``)."""
    cls = e.failure_class
    here = {"gpu": _ne(f.gpu), "model": _ne(f.model)}
    ckpt = {**here, "weights": _ne(f.weights)}
    if cls == "UNSUPPORTED_BACKEND":  # the backend flag the message names, on this GPU
        named = [_field_of(x) for x in e.flags if _field_of(x) in ServingConfig.model_fields]
        field = named[0] if named else "attention_backend"
        return {"gpu": _ne(f.gpu), field: _ne(getattr(f, field))}
    if cls == "BACKEND_MODEL_MISMATCH":
        return {"model": _ne(f.model), "attention_backend": _ne(f.attention_backend)}
    if cls == "OOM_WEIGHTS":  # these weights at this or any smaller tp_size and pp_size
        atoms = {**ckpt, "tp_size": lambda v: v > f.tp_size, "pp_size": lambda v: v > f.pp_size}
        if f.speculative_algorithm is not None:
            atoms["speculative_algorithm"] = _ne(f.speculative_algorithm)
        return atoms
    if cls in ("GRAPH_CAPTURE_OOM", "KV_NO_ROOM", "KV_THRASH"):  # exactly this memory layout
        return {**ckpt, **{k: _ne(getattr(f, k)) for k in MEMORY_FIELDS}}
    if cls == "HOST_OOM_HICACHE":  # a ratio above the largest that fits (never above failing)
        m = re.search(r"Requesting ([\d.]+) GB but only have ([\d.]+) GB free", evidence)
        assert m and f.hicache_ratio is not None
        fit = f.hicache_ratio * min(1.0, float(m.group(2)) / float(m.group(1)))
        return {**ckpt, "enable_hierarchical_cache": lambda v: not v,
                "tp_size": _ne(f.tp_size),
                "hicache_ratio": lambda v: v is None or v < fit or (
                    v == fit and fit < f.hicache_ratio)}
    if cls == "HICACHE_HOST_TOO_SMALL":  # HiCache on with a ratio <= 1, any model
        return {"enable_hierarchical_cache": lambda v: not v,
                "hicache_ratio": lambda v: v is None or v > 1.0}
    if cls == "TP_DIVISIBILITY":  # this tp_size for this model
        return {"model": _ne(f.model), "tp_size": _ne(f.tp_size)}
    if cls == "MULTI_NODE_REQUIRED":  # this tp_size for this model on this GPU
        return {**here, "tp_size": _ne(f.tp_size)}
    if cls == "MODEL_LOAD":  # these weights at this exact tp_size on this model
        return {"model": _ne(f.model), "weights": _ne(f.weights), "tp_size": _ne(f.tp_size)}
    # CRASH_LOOP, an INVALID_COMBINATION the builder does not know: the set knobs exactly
    return {**ckpt, "tp_size": _ne(f.tp_size),
            **{k: _ne(v) for k, v in f.set_fields().items()}}


def _guard_tested(facts: GuardFacts) -> tuple[set[str], bool, bool]:
    """(knob fields, the GPU's SM?, the model's checkpoint?) the guard tests."""
    atoms = [a for d in facts.disjuncts for a in d]
    fields = {a.dest for a in atoms if isinstance(a, FlagAtom) and a.dest in KNOB_FIELDS}
    return (fields, any(isinstance(a, SmAtom) for a in atoms),
            any(isinstance(a, ModelAtom) for a in atoms))


# ---- generated configs --------------------------------------------------------------------

def _reps(field: str, named: list[Any]) -> list[Any]:
    extra = [1, 2, 4, 8] if field == "tp_size" else []
    vals = field_domain(field).representatives([*named, *extra])
    return list(dict.fromkeys([*vals, *(v for v in named if v is not None)]))


def _repaired(base: dict[str, Any], changes: dict[str, Any]) -> ServingConfig:
    """``base`` with each change the config accepts applied in turn (others left as in base)."""
    data = dict(base)
    for k, v in changes.items():
        trial = {**data, k: v}
        try:
            ServingConfig(**trial)
        except ValidationError:
            continue
        data = trial
    return ServingConfig(**data)


def _named(lesson: Lesson, failing: ServingConfig) -> dict[str, list[Any]]:
    named: dict[str, list[Any]] = {f: [getattr(failing, f)] for f in KNOB_FIELDS}
    for c in lesson.condition:
        if c.field in named and not isinstance(c.value, list):
            named[c.field].append(c.value)
    return named


def _knobs(named: dict[str, list[Any]], fields: set[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({f: st.sampled_from(_reps(f, named[f])) for f in sorted(fields)
                                  if f != "weights"})


def _teaching() -> list[Any]:
    out = []
    for e in _entries():
        if TAXONOMY[e.failure_class].outcome is None or _key(e) in NO_LESSON:
            continue
        out.append(pytest.param(e, id=e.file[:-4]))
    return out


def _not_teaching() -> list[Any]:
    return [pytest.param(e, id=e.file[:-4]) for e in _entries()
            if TAXONOMY[e.failure_class].outcome is None or _key(e) in NO_LESSON]


# ---- the tests ----------------------------------------------------------------------------

def test_every_corpus_entry_has_a_failing_config_and_a_verdict():
    keys = [_key(e) for e in _entries()]
    assert len(keys) >= 40 and sorted(keys) == sorted(FAILING)
    for e in _entries():  # a transient class is always listed, never silently skipped
        if TAXONOMY[e.failure_class].outcome is None:
            assert _key(e) in NO_LESSON, e.file
        _failing(e)  # a valid config, agreeing with the entry's own fields


@pytest.mark.parametrize("entry", _not_teaching())
def test_an_entry_that_teaches_no_lesson_says_why(entry, pinned_index):
    report, _, failing = _diagnose(entry)
    assert report.diagnosis.failure_class == entry.failure_class
    assert report.config == failing
    assert report.lesson is None
    assert NO_LESSON[_key(entry)] in (report.no_lesson or ""), report.no_lesson


@pytest.mark.parametrize("entry", _teaching())
def test_property_the_lesson_forbids_its_family_and_nothing_the_check_allows(entry,
                                                                             pinned_index):
    tree, inv = pinned_index
    report, facts, failing = _diagnose(entry)
    d, lesson = report.diagnosis, report.lesson
    assert d.failure_class == entry.failure_class
    assert report.config == failing, (report.config, failing)  # the log's config is the table's
    assert lesson is not None, report.no_lesson
    informative = lesson.outcome not in FORBIDDING  # KV_THRASH: slo-miss, forbids nothing
    covers = lesson.matches if informative else lesson.forbids
    if informative:
        assert not lesson.forbids(failing)
    # 1. the failing config
    assert covers(failing), lesson.condition_text()

    named = _named(lesson, failing)
    if lesson.verified:
        from mcp_servers.source.raises import evaluate_site

        assert facts is not None and lesson.source_site == d.source
        path, line = str(d.source).rsplit(":", 1)
        tested, hardware, model_tested = _guard_tested(facts)
        if model_tested:
            tested |= {"weights"}
        sm = get_gpu(failing.gpu).sm_major
        same_gpu = sorted(g for g in GPUS if not hardware or get_gpu(g).sm_major == sm)
        vary_models = not model_tested

        def false_on(c: ServingConfig) -> bool:
            values = {f: getattr(c, f) for f in KNOB_FIELDS}
            return evaluate_site(tree, inv, path, int(line), values,
                                 get_gpu(c.gpu).sm_major) is False
    else:
        atoms = _rule_atoms(entry, failing, d.evidence)
        tested = {f for f in atoms if f in KNOB_FIELDS}
        same_gpu = [failing.gpu] if "gpu" in atoms else sorted(GPUS)
        vary_models = "model" not in atoms
        for f, _ in atoms.items():
            if f in named:
                named[f].append(getattr(failing, f))

        def false_on(c: ServingConfig) -> bool:
            return any(is_false(getattr(c, f)) for f, is_false in atoms.items())

    base = failing.model_dump()
    untested = set(KNOB_FIELDS) - tested
    models = sorted(MODELS) if vary_models else [failing.model]
    seen = {"variant": 0, "differs": 0, "false": 0}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(knobs=_knobs(named, untested), gpu=st.sampled_from(same_gpu),
           model=st.sampled_from(models), pick=st.integers(0, 2))
    def family(knobs: dict[str, Any], gpu: str, model: str, pick: int) -> None:
        # 2. differs from the failing config only in fields the check does not test
        changes: dict[str, Any] = {"gpu": gpu}
        if "weights" not in tested:
            ckpts = sorted(get_model(model).checkpoints)
            changes |= {"model": model, "weights": ckpts[pick % len(ckpts)]}
        variant = _repaired(base, {**changes, **knobs})
        assert covers(variant), (variant.model_dump(exclude_defaults=True),
                                 lesson.condition_text())
        seen["variant"] += 1
        seen["differs"] += variant != failing

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(knobs=_knobs(named, set(KNOB_FIELDS)), gpu=st.sampled_from(sorted(GPUS)),
           model=st.sampled_from(sorted(MODELS)), pick=st.integers(0, 2),
           keep=st.sets(st.sampled_from(sorted(tested | {"gpu", "model"}))))
    def outside(knobs: dict[str, Any], gpu: str, model: str, pick: int, keep: set[str]) -> None:
        # 3. no config on which the check's condition is false (some tested fields kept at
        # the failing value, so the flips land near the family's edge)
        ckpts = sorted(get_model(model).checkpoints)
        changes = {"gpu": gpu, "model": model, "weights": ckpts[pick % len(ckpts)], **knobs}
        other = _repaired(base, {k: v for k, v in changes.items() if k not in keep})
        if false_on(other):
            seen["false"] += 1
            assert not covers(other), (other.model_dump(exclude_defaults=True),
                                       lesson.condition_text())

    family()
    outside()
    assert seen["variant"] == EXAMPLES and seen["differs"] >= EXAMPLES // 2  # exercised
    assert seen["false"] >= EXAMPLES // 5
