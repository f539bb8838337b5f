"""Hand-computable checks of the domain core: catalog, memory fit, twin engine, metrics, knobs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fixtures.configs import serving_config as cfg

from domain.engines import engine
from domain.engines.sglang.flags import flag_inventory
from domain.errors import ConfigInvalid, DoesNotFit, UnknownFlag
from domain.fit import default_max_running_requests, fit
from domain.knobs import apply_knob
from domain.lesson import Clause, Lesson, Scope
from domain.metrics import RequestRecord, pareto_front, summarize
from domain.models import glm5
from domain.twin.engine import EngineLimits, TwinEngine
from domain.twin.startup import start

DEFAULT_STUDY = Path(__file__).resolve().parents[2] / "studies" / "default.yaml"


# ---------------------------------------------------------------- catalog
def test_glm5_parameter_counts_match_published_totals():
    m = glm5()
    # GLM-5 is published as 744B total / ~40B active.
    assert m.total_params / 1e9 == pytest.approx(744, abs=1)
    assert m.active_params / 1e9 == pytest.approx(40.7, abs=0.5)
    assert (m.layers, m.n_routed_experts, m.experts_per_tok, m.attention) == (78, 256, 8, "dsa")


def test_kv_bytes_per_token_dsa():
    m = glm5()
    # latent (512 + 64) x bytes + indexer (128 fp8 + 4 B scale), x 78 layers
    assert m.kv_bytes_per_token(2, 8) == 78 * (576 * 2 + 132) == 100_152
    assert m.kv_bytes_per_token(1, 8) == 78 * (576 + 132) == 55_224


# ---------------------------------------------------------------- memory fit
def test_fit_fp8_tp8_bf16_kv_hand_arithmetic():
    r = fit(cfg(kv_cache_dtype="bf16", mem_fraction_static=0.85))
    weights = glm5().weight_bytes("fp8") / 8
    assert weights / 1e9 == pytest.approx(93.249, abs=0.01)
    pool = 0.85 * 180e9 - weights  # 59.751 GB
    assert r.kv_pool_bytes_per_gpu == pytest.approx(pool)
    assert r.kv_tokens == int(pool // 100_152) == 596_600
    # int(596600 / 202752 * 512) = 1506 -> clamped up to 2048; kv_tokens // 2 does not bind
    assert r.max_running_requests == 2048
    assert r.chunked_prefill_size == 16384  # >= 160 GiB tier


def test_fit_nvfp4_tp4_fp8_kv_hand_arithmetic():
    r = fit(cfg(weights="nvfp4", tp_size=4, replicas=2, kv_cache_dtype="fp8_e4m3",
                mem_fraction_static=0.90))
    weights = glm5().weight_bytes("nvfp4") / 4
    assert weights / 1e9 == pytest.approx(110.185, abs=0.01)
    assert r.kv_tokens == int((0.90 * 180e9 - weights) // 55_224) == 938_274
    assert r.max_running_requests == int(938_274 / 202_752 * 512) == 2369


def test_fp8_does_not_fit_tp4_but_nvfp4_does_and_not_tp2():
    with pytest.raises(DoesNotFit) as e:
        fit(cfg(tp_size=4, replicas=2))
    assert e.value.phase == "weights_load"
    assert e.value.required_gb == pytest.approx(746.0 / 4 + 1.5, abs=0.1)
    assert "186.5 GB per GPU" in e.value.arithmetic
    fit(cfg(weights="nvfp4", tp_size=4, replicas=2))
    with pytest.raises(DoesNotFit):
        fit(cfg(weights="nvfp4", tp_size=2, replicas=4))


def test_default_mem_fraction_and_max_running_rules():
    r = fit(cfg(kv_cache_dtype="bf16"))
    # reserved = 512 + 1.5*16384 + 8/8*1024 + 2*512 + 1536 = 28,672 MiB of 171,661 MiB
    gpu_mib = 180e9 / 2**20
    assert r.mem_fraction_static == round((gpu_mib - 28_672) / gpu_mib, 3) == 0.833
    assert r.mem_fraction_was_default
    assert default_max_running_requests(3000, 131_072) == 1500  # kv_tokens // 2 binds
    assert default_max_running_requests(400_000, 32_768) == 4096


def test_fp8_kv_roughly_doubles_capacity():
    bf16 = fit(cfg(kv_cache_dtype="bf16")).kv_tokens
    fp8 = fit(cfg(kv_cache_dtype="fp8_e4m3")).kv_tokens
    assert 1.7 < fp8 / bf16 < 2.0


# ---------------------------------------------------------------- config -> argv
def test_to_sglang_args_exact_flags():
    c = cfg(weights="nvfp4", kv_cache_dtype="fp8_e4m3", mem_fraction_static=0.9,
            max_running_requests=256)
    assert engine("sglang").argv(c) == [
        "sglang", "serve", "--model-path", "nvidia/GLM-5-NVFP4", "--tp-size", "8",
        "--quantization", "modelopt_fp4", "--kv-cache-dtype", "fp8_e4m3",
        "--mem-fraction-static", "0.9", "--max-running-requests", "256"]
    inv = flag_inventory("0.5.23")
    assert "nvfp4" not in inv["quantization"]["choices"]  # there is no --quantization nvfp4


def test_unknown_attention_backend_and_version_are_refused():
    with pytest.raises(ValueError, match="not a choice"):
        cfg(attention_backend="fa9")
    with pytest.raises(ValueError, match="no flag inventory"):
        cfg(engine_version="0.4.0")
    with pytest.raises(UnknownFlag):
        from domain.engines.sglang.flags import flag_for
        flag_for("no_such_flag", "0.5.23")


def test_apply_knob_sets_replicas_and_rejects_bad_values():
    c = apply_knob(cfg(), "tp_size", 4, 8)
    assert (c.tp_size, c.replicas) == (4, 2)
    assert apply_knob(cfg(max_running_requests=128), "max_running_requests", "unset", 8) \
        .max_running_requests is None
    with pytest.raises(ConfigInvalid, match="knobs.tp_size"):
        apply_knob(cfg(), "tp_size", 3, 8)
    with pytest.raises(ConfigInvalid, match="unknown knob"):
        apply_knob(cfg(), "turbo", True, 8)
    with pytest.raises(ConfigInvalid, match="knobs.mem_fraction_static"):
        apply_knob(cfg(), "mem_fraction_static", 1.5, 8)


# ---------------------------------------------------------------- startup failures
def test_fa3_refused_on_b200_with_engine_message():
    s = start(cfg(attention_backend="fa3"))
    assert not s.ready and s.phase == "model_init"
    assert "FlashAttention v3 Backend requires SM>=80 and SM<=90" in s.reason
    assert any(line.startswith("Load weight end") for line in s.log)
    assert start(cfg(gpu="H200", weights="nvfp4", attention_backend="fa3")).phase != "model_init"


def test_weights_oom_log_and_ready_log():
    s = start(cfg(tp_size=4, replicas=2))
    assert (s.ready, s.phase) == (False, "load_weights")
    assert "CUDA out of memory" in s.reason
    ok = start(cfg())
    assert ok.ready and ok.log[-1] == "The server is fired up and ready to roll!"
    assert f"#tokens: {ok.fit.kv_tokens}" in " ".join(ok.log)


# ---------------------------------------------------------------- twin engine
class LinearCost:
    """prefill: 10 ms + 10 us/token; decode: 20 ms per step, 5 ms of it all-reduce."""

    def prefill_time(self, new_tokens, attn_pairs, index_pairs):
        return 0.010 + 1e-5 * new_tokens

    def decode_time(self, batch, context_sum):
        return 0.020

    def decode_roofline_time(self, batch, context_sum):
        return 0.010

    def decode_allreduce_time(self, batch, draft_tokens=0, draft_steps=0, draft_topk=1):
        return 0.005

    def scan_time(self, waiting):  # no scheduler CPU, no eager steps
        return 0.0

    def cpu_time(self, batch):
        return 0.0

    def eager(self, batch):
        return False


def test_three_request_scenario_ttft_by_hand():
    lim = EngineLimits(kv_tokens=100_000, max_running_requests=16, chunked_prefill_size=1000,
                       context_len=10_000)
    eng = TwinEngine(LinearCost(), lim)
    recs = eng.run([(0.0, 1500, 3), (0.0, 400, 2), (0.05, 100, 1)])
    # step 1: A chunk 1000 -> t=0.020; step 2: A 500 + B 400 -> t=0.039 (first tokens of A, B);
    # step 3: decode A,B -> t=0.059 (B done); step 4: C arrived at 0.05, prefill 100 -> 0.070;
    # step 5: decode A -> 0.090 (A done).
    ttft = [r.ttft_s for r in recs]
    assert ttft == pytest.approx([0.039, 0.039, 0.020])
    assert [r.finish_s for r in recs] == pytest.approx([0.090, 0.059, 0.070])
    assert recs[0].itl_s == pytest.approx([0.020, 0.031])
    assert (eng.stats.prefill_steps, eng.stats.decode_steps) == (3, 2)


def test_what_the_engine_saw_in_the_three_request_scenario_by_hand():
    # as above, with CUDA graphs up to batch 1: step 3 decodes A and B (2 > 1) eagerly.
    # In flight per step (running + waiting + prefilling): A+B waiting 2 (B waits), 2, 2, 2
    # (A running, C prefilling), 1; durations 20, 19, 20, 11, 20 ms.
    cost = LinearCost()
    cost.eager = lambda batch: batch > 1  # CUDA graphs up to batch 1 (no eager cost here)
    lim = EngineLimits(kv_tokens=100_000, max_running_requests=16, chunked_prefill_size=1000,
                       context_len=10_000)
    eng = TwinEngine(cost, lim)
    eng.run([(0.0, 1500, 3), (0.0, 400, 2), (0.05, 100, 1)])
    st = eng.stats
    assert (st.eager_decode_steps, st.eager_step_share) == (1, 0.5)
    assert (st.waiting_sum, st.max_inflight, st.retracted_tokens) == (1, 2, 0)
    assert st.inflight_s == pytest.approx(2 * (0.020 + 0.019 + 0.020 + 0.011) + 0.020)
    assert st.mean_inflight == pytest.approx(0.160 / 0.090)
    assert st.mean_waiting == pytest.approx(1 / 5)


def test_admission_cap_limits_the_decode_batch():
    lim = EngineLimits(kv_tokens=1_000_000, max_running_requests=4, chunked_prefill_size=8192,
                       context_len=100_000)
    eng = TwinEngine(LinearCost(), lim)
    eng.run(closed_loop=(10, 1.0, 100, 20))
    assert eng.stats.max_running == 4


def test_kv_pool_limits_and_retracts():
    # 10 requests of 100 + 100 tokens need 2,000 KV tokens; the pool holds 1,000.
    lim = EngineLimits(kv_tokens=1000, max_running_requests=64, chunked_prefill_size=8192,
                       context_len=100_000)
    eng = TwinEngine(LinearCost(), lim)
    recs = eng.run([(0.0, 100, 100)] * 10)
    assert all(r.error is None for r in recs)
    assert eng.stats.max_running * 200 <= 1000 + 64 * 100  # never more than the pool admits
    assert sum(r.output_tokens for r in recs) == 1000


# ---------------------------------------------------------------- metrics
def test_summarize_known_samples():
    recs = [RequestRecord(arrival_s=0.0, input_tokens=10, output_tokens=3, first_token_s=0.1,
                          finish_s=0.3, itl_s=np.array([0.1, 0.1])),
            RequestRecord(arrival_s=1.0, input_tokens=10, output_tokens=5, first_token_s=1.3,
                          finish_s=1.7, itl_s=np.array([0.1] * 4)),
            RequestRecord(arrival_s=1.0, input_tokens=10, output_tokens=0, error="boom")]
    s = summarize(recs, gpus=2, slo_ttft_ms=200)
    assert (s.completed, s.errors, s.output_tokens) == (2, 1, 8)
    assert s.duration_s == pytest.approx(1.7)
    assert s.output_tok_s == pytest.approx(8 / 1.7)
    assert s.output_tok_s_per_gpu == pytest.approx(8 / 1.7 / 2)
    assert s.ttft_ms.p50 == pytest.approx(200.0)  # median of 100 and 300 ms
    assert s.tpot_ms.mean == pytest.approx(100.0)
    assert s.tok_s_per_user == pytest.approx(10.0)
    assert s.goodput_req_s == pytest.approx(1 / 1.7)
    assert summarize([], gpus=1).ttft_ms.p99 is None


def test_pareto_front():
    pts = [(10, 100), (20, 90), (15, 80), (30, 50), (5, 120)]
    assert pareto_front(pts) == [4, 0, 1, 3]


# ---------------------------------------------------------------- lessons
def test_lesson_family_matching():
    lesson = Lesson(title="fp8 oom", scope=Scope(gpu="B200", model="glm-5", quantization="fp8"),
                    condition=[Clause(field="weights", op="eq", value="fp8"),
                               Clause(field="tp_size", op="le", value=4)],
                    outcome="does-not-fit", root_cause="x", fix="y", evidence="z").with_id()
    assert lesson.forbids(cfg(tp_size=4, replicas=2))
    assert lesson.forbids(cfg(tp_size=2, replicas=4, kv_cache_dtype="fp8_e4m3"))
    assert not lesson.forbids(cfg())  # TP8
    assert not lesson.forbids(cfg(gpu="H200", tp_size=4, replicas=2))
    assert lesson.id == lesson.with_id().id and lesson.id.startswith("L-")


@pytest.mark.parametrize("clause, needle", [
    (dict(field="bogus", op="eq", value=1), "not a knob of ServingConfig"),
    (dict(field="gpu", op="eq", value="B200"), "belong in the lesson's scope"),
    (dict(field="tp_size", op="le", value="two"), "must be a finite number"),
    (dict(field="tp_size", op="lt", value=float("inf")), "must be a finite number"),
    (dict(field="tp_size", op="in", value=4), "must be a list"),
    (dict(field="tp_size", op="eq", value="two"), "not a valid tp_size value"),
    (dict(field="tp_size", op="ge", value=1), "holds for every valid config"),
    (dict(field="tp_size", op="not_null"), "holds for every valid config"),
], ids=["unknown-field", "scope-field", "non-numeric-bound", "infinite-bound", "in-needs-list",
        "wrong-type", "always-true-bound", "always-set"])
def test_clause_validation(clause, needle):
    with pytest.raises(ValueError, match=needle):
        Clause(**clause)


@pytest.mark.parametrize("scope", [dict(gpu="-B200"), dict(gpu=""), dict(model="x"),
                                   dict(quantization="int2"), dict(engine_version="9.9")],
                         ids=["dash-gpu", "empty-gpu", "unknown-model", "unknown-ckpt",
                              "unknown-version"])
def test_scope_must_name_catalog_entries(scope):
    with pytest.raises(ValueError, match="scope"):
        Scope(**scope)


def test_forbidding_lesson_needs_a_condition():
    with pytest.raises(ValueError, match="at least one condition"):
        Lesson(title="everything crashes", scope=Scope(), condition=[], outcome="crash",
               root_cause="x", fix="y", evidence="z")
    # an informative lesson may be unconditional
    Lesson(title="fp8 KV helps", scope=Scope(), condition=[], outcome="improvement",
           root_cause="x", fix="y", evidence="z")


def test_estimate_lesson_for_kv_pool_covers_exactly_the_memory_layout():
    import yaml

    from domain.fit import MEMORY_FIELDS
    from domain.lesson_builders import estimate_lesson
    from domain.study import parse_study

    study = parse_study(yaml.safe_load(DEFAULT_STUDY.read_text()))
    bad = cfg(mem_fraction_static=0.5)  # 0.5 x 180 GB = 90 GB < 93.2 GB of weights per GPU
    with pytest.raises(DoesNotFit) as e:
        fit(bad)
    assert e.value.phase == "kv_pool"
    lesson = estimate_lesson(bad, e.value, study)
    assert [c.field for c in lesson.condition] == list(MEMORY_FIELDS)
    assert lesson.failure_class == "KV_NO_ROOM" and "mem-fraction-static" in lesson.fix
    assert lesson.forbids(bad)
    assert not lesson.forbids(cfg(mem_fraction_static=0.9))
    assert not lesson.forbids(cfg(mem_fraction_static=0.5, chunked_prefill_size=8192))


def test_weights_estimate_lesson_names_the_largest_failing_tp():
    import yaml

    from domain.lesson_builders import estimate_lesson
    from domain.study import parse_study

    study = parse_study(yaml.safe_load(DEFAULT_STUDY.read_text()))
    tp2 = cfg(tp_size=2, replicas=4)
    with pytest.raises(DoesNotFit) as e:
        fit(tp2)
    lesson = estimate_lesson(tp2, e.value, study)
    # pp_size <= 1: two or more PP stages hold fewer layers per GPU (issue 21)
    assert lesson.condition_text() == "weights == 'fp8' AND tp_size <= 4 AND pp_size <= 1"
    assert "more than 4 GPUs" in lesson.fix
    assert "TP2 = 373.0 GB" in lesson.evidence and "TP4 = 186.5 GB" in lesson.evidence


def test_weights_estimate_lesson_at_the_largest_tp_names_the_weights_alone(monkeypatch):
    """Weights that fail at every TP up to the domain's largest (512 since issue 21's PD
    groups): ``tp_size <= 512`` would
    be true for every config and is refused (issue 16, D2), so the family is the checkpoint
    (at this PP width or less: issue 21)."""
    import yaml

    import domain.lesson_builders as planner
    from domain.study import parse_study

    study = parse_study(yaml.safe_load(DEFAULT_STUDY.read_text()))
    tps = [8, 16, 32, 64, 128, 256, 512]
    study = study.model_copy(update={"knobs": {**study.knobs, "tp_size": tps}})
    err = DoesNotFit("weights_load", 2000.0, 180.0, "weights 2000 GB per GPU > 180 GB")

    def never_fits(config):
        raise DoesNotFit("weights_load", 2000.0, 180.0, f"TP{config.tp_size} does not fit")

    monkeypatch.setattr(planner, "fit", never_fits)
    lesson = planner.estimate_lesson(cfg(tp_size=8), err, study)
    assert lesson.condition_text() == "weights == 'fp8' AND pp_size <= 1"  # issue 21: PP
    assert lesson.forbids(cfg(tp_size=8)) and not lesson.forbids(cfg(weights="nvfp4"))


def test_graph_ceiling_needs_a_straddling_pair_whose_itl_roughly_doubles():
    """Twin numbers of Llama 3.1 8B on H100 with graphs up to 32: ITL p50 7.0 ms at batch 32,
    13.2 ms at 40 (eager), 16 ms at 128; 6.5 ms at 16."""
    from domain.metrics import CeilingPoint, graph_ceiling

    at16, at32 = CeilingPoint(16, 6.5, 32, "c=16"), CeilingPoint(32, 7.0, 32, "c=32")
    at40, at128 = CeilingPoint(40, 13.2, 32, "c=40"), CeilingPoint(128, 16.0, 32, "c=128")
    g = graph_ceiling([at16, at128, at32, at40])
    assert g is not None and (g.below, g.above, g.ceiling) == ("c=32", "c=40", 32)
    assert g.ratio == pytest.approx(13.2 / 7.0)
    assert "ITL p50 13.2 ms at a running batch of 40 (c=40) vs 7.0 ms at 32 (c=32), 1.9x" \
        in g.text()
    assert graph_ceiling([at16, at32]) is None  # nothing past the ceiling
    assert graph_ceiling([at40, at128]) is None  # nothing in graph
    assert graph_ceiling([at32, CeilingPoint(40, 9.0, 32)]) is None  # +29 %: not doubled
    # a raised ceiling puts the same batch back in graph: the eager run is the other config's
    g2 = graph_ceiling([CeilingPoint(40, 13.2, 32, "a"), CeilingPoint(40, 7.2, 64, "b")])
    assert g2 is not None and (g2.above, g2.ceiling) == ("a", 32)
