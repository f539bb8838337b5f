"""Source-grounded lesson conditions on the real SGLang 0.5.23 tree (a property test).

For each engine check below, the error message is looked up in the pinned source
(``locate_message``), the lesson is built from the guard's facts (``grounded_condition``) for a
config that trips it, and then, over generated configs:

* the lesson forbids the failing config and every config that differs from it only in fields
  the guard does not test;
* it forbids no config on which the guard is false, the guard being evaluated from its AST with
  the config's values substituted (``evaluate_site``), not from the lesson.
"""

from __future__ import annotations

from typing import Any

import pytest
from fixtures.pinned_index import pinned_index_fixture  # noqa: F401
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from domain.config import LAYOUT_FIELDS, ServingConfig
from domain.grounding import (
    FlagAtom,
    GuardFacts,
    ModelAtom,
    NotGrounded,
    OpaqueAtom,
    SmAtom,
    grounded_condition,
)
from domain.hardware import GPUS, get_gpu
from domain.lesson import KNOB_FIELDS, Clause, Lesson, Scope
from domain.models import MODELS, get_model
from mcp_servers.source.ground import ground_message
from mcp_servers.source.raises import evaluate_site, locate_message

EXAMPLES = 60  # generated configs per site
# Representative values of each field a generated config varies (None = unset).
VALUES: dict[str, list[Any]] = {
    "tp_size": [1, 2, 4, 8],
    "kv_cache_dtype": ["auto", "bf16", "fp8_e4m3"],
    "mem_fraction_static": [None, 0.8, 0.9],
    "max_running_requests": [None, 64, 256],
    "chunked_prefill_size": [None, -1, 1000, 8192],
    "cuda_graph_max_bs_decode": [None, 64],
    "attention_backend": [None, "fa3", "flashinfer", "triton", "trtllm_mla", "cutedsl_mla",
                          "trtllm_mha"],
    "mm_attention_backend": [None, "fa3", "fa4", "sdpa", "triton_attn"],
    "schedule_policy": ["fcfs", "lpm"],
    "schedule_conservativeness": [None, -1.0, -0.01, 0.0, 0.3, 1.5],
    "disable_radix_cache": [False, True],
    "enable_hierarchical_cache": [False, True],
    "hicache_ratio": [None, 2.0],
}

# (log line, the config that trips it, the lesson's expected scope (SM, model) and clauses)
GROUNDED = [
    pytest.param("ValueError: The 'fa3' backend is not supported on Blackwell GPUs",
                 {"gpu": "B200", "model": "qwen3-32b", "weights": "bf16",
                  "mm_attention_backend": "fa3", "tp_size": 2},
                 (10, None), [("mm_attention_backend", "eq", "fa3")], id="vision-fa3-blackwell"),
    pytest.param("ValueError: The arguments enable-hierarchical-cache and disable-radix-cache "
                 "are mutually exclusive and cannot be used at the same time. Please use only "
                 "one of them.",
                 {"gpu": "H200", "model": "deepseek-v3", "weights": "fp8", "tp_size": 8,
                  "enable_hierarchical_cache": True, "disable_radix_cache": True},
                 (None, None), [("enable_hierarchical_cache", "eq", True),
                        ("disable_radix_cache", "eq", True)], id="hicache-radix"),
    pytest.param("AssertionError: schedule_conservativeness must be non-negative",
                 {"gpu": "H100", "model": "llama-3.1-8b", "weights": "fp8",
                  "schedule_conservativeness": -0.5},
                 (None, None), [("schedule_conservativeness", "lt", 0)], id="conservativeness"),
    pytest.param("ValueError: TRTLLM MLA backend is only supported on Blackwell GPUs "
                 "(SM100/SM12x). Please use a different backend.",
                 {"gpu": "H200", "model": "deepseek-r1", "weights": "fp8", "tp_size": 8,
                  "attention_backend": "trtllm_mla"},
                 (9, None), [("attention_backend", "eq", "trtllm_mla")], id="trtllm-mla-hopper"),
    pytest.param("ValueError: CuteDSL MLA backend is only supported on Blackwell GPUs (SM100). "
                 "Please use a different backend.",
                 {"gpu": "H100", "model": "glm-5", "weights": "fp8", "tp_size": 8,
                  "attention_backend": "cutedsl_mla"},
                 (9, None), [("attention_backend", "eq", "cutedsl_mla")], id="cutedsl-hopper"),
    pytest.param("AssertionError: FlashAttention v3 Backend requires SM>=80 and SM<=90. Please "
                 "use `--attention-backend flashinfer`.",
                 {"gpu": "B200", "model": "llama-3.1-70b", "weights": "fp8", "tp_size": 4,
                  "attention_backend": "fa3"},
                 (10, None), [("attention_backend", "eq", "fa3")], id="fa3-registry-blackwell"),
    pytest.param("ValueError: trtllm_mha backend can only be used with non-MLA models.",
                 {"gpu": "B200", "model": "deepseek-v3", "weights": "fp8", "tp_size": 8,
                  "attention_backend": "trtllm_mha"},
                 (None, "deepseek-v3"), [("attention_backend", "eq", "trtllm_mha")],
                 id="trtllm-mha-on-mla-model"),
]


def _config(**kw: Any) -> ServingConfig:
    return ServingConfig(**kw)


def _lesson(config: ServingConfig, facts: GuardFacts) -> Lesson:
    scope, clauses = grounded_condition(config, facts)
    return Lesson(title="engine check", scope=scope, condition=clauses, outcome="unsupported",
                  failure_class="UNSUPPORTED_BACKEND", root_cause=facts.guard, fix="-",
                  evidence=facts.site, verified=True, source_site=facts.site).with_id()


def _tested(facts: GuardFacts) -> tuple[set[str], bool, bool]:
    """(ServingConfig fields, hardware?, model?) the guard tests."""
    atoms = [a for d in facts.disjuncts for a in d]
    fields = {a.dest for a in atoms if isinstance(a, FlagAtom) and a.dest in KNOB_FIELDS}
    return fields, any(isinstance(a, SmAtom) for a in atoms), \
        any(isinstance(a, ModelAtom) for a in atoms)


@st.composite
def configs(draw: st.DrawFn) -> ServingConfig:
    model = draw(st.sampled_from(sorted(MODELS)))
    kw: dict[str, Any] = {"model": model, "gpu": draw(st.sampled_from(sorted(GPUS))),
                          "weights": draw(st.sampled_from(sorted(get_model(model).checkpoints)))}
    for name, values in VALUES.items():
        kw[name] = draw(st.sampled_from(values))
    return _config(**kw)


def _values(config: ServingConfig) -> dict[str, Any]:
    return {f: getattr(config, f) for f in KNOB_FIELDS}


@pytest.mark.parametrize(("line", "failing", "sm", "clauses"), GROUNDED)
def test_the_lesson_is_built_from_exactly_what_the_guard_tests(pinned_index, line, failing, sm,
                                                               clauses):
    tree, inv = pinned_index
    site = locate_message(tree, inv, line).sites[0]
    config = _config(**failing)
    assert evaluate_site(tree, inv, site.path, site.line, _values(config),
                         get_gpu(config.gpu).sm_major) is (None if sm[1] else True)
    # (None: the guard also tests a model property, which the config does not state)
    lesson = _lesson(config, site.facts)
    assert (lesson.scope.sm_major, lesson.scope.model, lesson.scope.gpu) == (*sm, None)
    assert [(c.field, c.op, c.value) for c in lesson.condition] == clauses
    assert lesson.verified and lesson.source_site == site.site
    assert lesson.forbids(config)


@pytest.mark.parametrize(("line", "failing", "sm", "clauses"), GROUNDED)
def test_property_forbids_its_family_and_nothing_the_guard_allows(pinned_index, line, failing,
                                                                  sm, clauses):
    tree, inv = pinned_index
    site = locate_message(tree, inv, line).sites[0]
    failing_config = _config(**failing)
    lesson = _lesson(failing_config, site.facts)
    fields, hardware, model = _tested(site.facts)
    sm_major = get_gpu(failing_config.gpu).sm_major
    seen = {"false": 0, "variant": 0}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(other=configs())
    def check(other: ServingConfig) -> None:
        # 1. the failing config with every field the guard does not test taken from `other`
        keep = set(fields) | ({"gpu"} if hardware and get_gpu(other.gpu).sm_major != sm_major
                              else set()) | ({"model", "weights"} if model else set())
        data = {k: (failing[k] if k in failing else getattr(_config(
            model=failing["model"], gpu=failing["gpu"], weights=failing["weights"]), k))
            if k in keep else v for k, v in other.model_dump().items()}
        variant = _config(**data)
        assert lesson.forbids(variant), (variant, lesson.condition_text())
        seen["variant"] += 1
        # 2. no config on which the guard (evaluated from its AST) is false
        truth = evaluate_site(tree, inv, site.path, site.line, _values(other),
                              get_gpu(other.gpu).sm_major)
        if truth is False:
            seen["false"] += 1
            assert not lesson.forbids(other), (other, lesson.condition_text())

    check()
    assert seen["variant"] == EXAMPLES and seen["false"] >= EXAMPLES // 5  # exercised


@pytest.mark.parametrize(("line", "failing", "why"), [
    pytest.param("AssertionError: 4 is not divisible by 8",
                 {"gpu": "H200", "model": "qwen3-235b-a22b", "weights": "fp8", "tp_size": 8},
                 "numerator % denominator", id="divisibility-of-function-arguments"),
    pytest.param("AssertionError: chunked_prefill_size must be divisible by page_size",
                 {"gpu": "B200", "model": "deepseek-v3", "weights": "fp8",
                  "chunked_prefill_size": 1000},
                 "cfg.chunked_prefill_size % cfg.page_size", id="resolved-page-size"),
])
def test_a_guard_the_config_cannot_state_is_not_grounded(pinned_index, line, failing, why):
    """ensure_divisibility tests its arguments; the chunk check a page size resolved at
    start-up (Arg(resolvable=True)): both leave the condition to the taxonomy's rule."""
    tree, inv = pinned_index
    facts = locate_message(tree, inv, line).sites[0].facts
    with pytest.raises(NotGrounded, match="gives no condition") as e:
        grounded_condition(_config(**failing), facts)
    assert why in str(e.value)


def test_grounded_condition_rules_on_hand_made_facts():
    b200 = _config(gpu="B200", model="qwen3-32b", weights="bf16", tp_size=4,
                   chunked_prefill_size=4096)
    flag = FlagAtom(dest="chunked_prefill_size", op="compared", text="cps > x")
    model = ModelAtom(text="hf_config.num_heads % tp")
    sm = SmAtom(op="ge", value=10, text="get_device_capability()[0] >= 10")
    # one conjunction: it held (the config failed here); the model and the failing value pin it
    facts = GuardFacts(site="f.py:1", exception="ValueError", guard="g",
                       disjuncts=[[flag, model, sm]])
    scope, clauses = grounded_condition(b200, facts)
    assert (scope.sm_major, scope.model, scope.quantization) == (10, "qwen3-32b", "bf16")
    assert clauses == [Clause(field="chunked_prefill_size", op="eq", value=4096)]
    # two open conjunctions, neither decided: which one held is unknown
    two = facts.model_copy(update={"disjuncts": [[flag, model], [OpaqueAtom(text="x")]]})
    with pytest.raises(NotGrounded, match="cps > x"):
        grounded_condition(b200, two)
    # a decided-false conjunction is skipped; a non-knob flag at a literal default adds nothing
    mode = FlagAtom(dest="skip_server_warmup", op="ne", value=True, default=False,
                    default_known=True, text="not cfg.skip_server_warmup")
    tp = FlagAtom(dest="tp_size", op="ge", value=2, text="tp_size >= 2")
    other = facts.model_copy(update={"disjuncts": [[sm.model_copy(update={"value": 11})],
                                                   [mode, tp]]})
    assert grounded_condition(b200, other) == (Scope(engine_version="0.5.23"),
                                               [Clause(field="tp_size", op="ge", value=2)])
    assert Scope(sm_major=10).matches(b200) and not Scope(sm_major=9).matches(b200)


def test_ground_message_in_one_call(pinned_index):
    tree, inv = pinned_index
    config = _config(gpu="B200", model="glm-5", weights="fp8", tp_size=8,
                     mm_attention_backend="fa3", max_running_requests=256)
    g = ground_message(tree, inv, "ValueError: The 'fa3' backend is not supported on "
                       "Blackwell GPUs", config)
    assert g.verified and g.source_site == "sglang/srt/layers/attention/vision.py:1331"
    assert [c.text() for c in g.condition] == ["mm_attention_backend == 'fa3'"]
    assert g.scope is not None and g.scope.sm_major == 10 and g.scope.gpu is None
    odd = ground_message(tree, inv, "AssertionError: 4 is not divisible by 8", config)
    assert not odd.verified and odd.site is not None and "numerator" in (odd.reason or "")
    none = ground_message(tree, inv, "RuntimeError: servetune test says no", config)
    assert (none.verified, none.site) == (False, None) and "no raise or assert" in none.reason


def test_new_fields_keep_old_ids():
    """Scope.sm_major and ServingConfig.mm_attention_backend, unset, change no stored id."""
    import hashlib
    import json

    config = _config(gpu="H200", model="qwen3-32b", weights="fp8", tp_size=2)
    data = config.model_dump(mode="json")
    for name in ("schedule_conservativeness", "speculative_algorithm", "speculative_num_steps",
                 "speculative_eagle_topk", "speculative_num_draft_tokens", "speculative_adaptive",
                 "disable_radix_cache", "enable_hierarchical_cache", "hicache_ratio",
                 "mm_attention_backend", "context_length", "page_size", "disable_cuda_graph",
                 "moe_runner_backend", "fp4_gemm_runner_backend", "num_continuous_decode_steps",
                 "enable_two_batch_overlap", "enable_single_batch_overlap",  # issue 19's
                 "router_cache_threshold", "router_balance_abs_threshold",
                 "router_balance_rel_threshold",  # issue 20's
                 *LAYOUT_FIELDS):  # issue 21's
        del data[name]
    old = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]
    assert config.config_id() == old
    lesson = Lesson(title="fa3 refused", scope=Scope(gpu="B200"), outcome="unsupported",
                    condition=[Clause(field="attention_backend", op="eq", value="fa3")],
                    root_cause="-", fix="-", evidence="-").with_id()
    key = json.dumps({"scope": {"gpu": "B200", "model": None, "quantization": None,
                                "engine": "sglang", "engine_version": None},
                      "outcome": "unsupported",
                      "condition": [{"field": "attention_backend", "op": "eq", "value": "fa3"}]},
                     sort_keys=True, default=str)
    assert lesson.id == "L-" + hashlib.sha256(key.encode()).hexdigest()[:10]
    with_sm = lesson.model_copy(update={"scope": Scope(sm_major=10)}).with_id()
    assert with_sm.id != lesson.id
