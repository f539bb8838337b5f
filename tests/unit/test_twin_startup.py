"""Twin v1: ServingConfig flags, SGLang's default rules, speculative decoding, HiCache and the
startup logs of a server that starts -- each checked against arithmetic done by hand in the
comments. The failed starts and their classes are in test_failure_classifier.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from fixtures.configs import GLM5_BF16_KV, GLM5_FP8_KV, fraction_for_tokens
from fixtures.configs import serving_config as cfg
from fixtures.configs import speculative_config as spec

from domain.config import ServingConfig
from domain.engines import engine
from domain.engines.sglang.flags import flag_inventory
from domain.errors import ConfigInvalid, DoesNotFit, InvalidCombination
from domain.fit import (
    default_chunked_prefill,
    default_decode_graph_bs,
    default_mem_fraction,
    fit,
    hicache_host_pool,
    resolve_attention_backend,
    resolve_max_running_requests,
)
from domain.hardware import get_gpu
from domain.knobs import apply_knob
from domain.models import get_model, glm5
from domain.speculative import (
    MTP_ACCEPT_RATE,
    SpecParams,
    accept_length,
    accept_rate,
    adaptive_steps,
    chain_rate,
    draft_tokens_for_batch,
    resolve_speculative,
    resolve_speculative_logged,
    spec_capture_sizes,
    steps_for_batch,
)
from domain.study import parse_study
from domain.twin.startup import start

DEFAULT_STUDY = Path(__file__).resolve().parents[2] / "studies" / "default.yaml"
MRR_LINE = ("Max running requests is reset to 48 for speculative decoding. You can override "
            "this by explicitly setting --max-running-requests.")


# GLM-5's MTP acceptance, solved from the cookbook's 3.48 tokens per (3, 1, 4) verify step
# (domain/data/spec-acceptance.json): 1 + a + a^2 + a^3 = 3.48
GLM5_ALPHA = accept_rate(glm5())


def chain(steps: int, alpha: float = MTP_ACCEPT_RATE, adaptive: bool = False) -> SpecParams:
    return SpecParams(algorithm="EAGLE", num_steps=steps, topk=1, draft_tokens=steps + 1,
                      adaptive=adaptive, accept_rate=alpha)


# ---------------------------------------------------------------- ServingConfig -> argv
def test_new_fields_emit_exact_flags_and_store_true_flags_bare():
    c = cfg(schedule_policy="lpm", schedule_conservativeness=0.8, speculative_num_steps=3,
            speculative_algorithm="NEXTN", speculative_eagle_topk=1,
            speculative_num_draft_tokens=4, speculative_adaptive=True,
            enable_hierarchical_cache=True, hicache_ratio=2.5, router_policy="cache_aware")
    assert engine("sglang").argv(c) == [
        "sglang", "serve", "--model-path", "zai-org/GLM-5-FP8", "--tp-size", "8",
        "--quantization", "fp8", "--schedule-policy", "lpm", "--schedule-conservativeness",
        "0.8", "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
        "--hicache-ratio", "2.5", "--speculative-adaptive", "--enable-hierarchical-cache"]
    assert engine("sglang").argv(cfg(disable_radix_cache=True))[-1] == "--disable-radix-cache"
    # unset / off fields pass nothing; the router policy is a router flag, never a server flag
    assert engine("sglang").argv(cfg(router_policy="power_of_two")) == [
        "sglang", "serve", "--model-path", "zai-org/GLM-5-FP8", "--tp-size", "8",
        "--quantization", "fp8"]
    flags = {f for e in flag_inventory("0.5.23").values() for f in e["flags"]}
    assert {a for a in engine("sglang").argv(c) if a.startswith("--")} <= flags


def test_config_id_of_configs_without_v1_fields_is_unchanged():
    # ids computed with the pre-v1 ServingConfig (git HEAD before this change)
    assert cfg(kv_cache_dtype="bf16", mem_fraction_static=0.85).config_id() == "9167785bc116"
    assert cfg(tp_size=4, replicas=2, weights="nvfp4").config_id() == "5c60110620b5"
    assert spec().config_id() != cfg().config_id()
    assert spec().set_fields() == {"speculative_algorithm": "NEXTN"}


# ---------------------------------------------------------------- SGLang's default rules
@pytest.mark.parametrize("hbm_gb, chunked, graph_tp1, graph_tp8", [
    (16, 2048, 8, 8),      # 14.9 GiB  < 20
    (24, 4096, 48, 160),   # 22.4 GiB  < 35
    (40, 4096, 32, 160),   # 37.3 GiB  < 60
    (80, 8192, 256, 512),  # 74.5 GiB  < 90
    (141, 8192, 256, 512),  # 131.3 GiB < 160
    (180, 16384, 512, 512),  # 167.6 GiB >= 160
])
def test_chunked_prefill_and_decode_graph_by_memory_tier(hbm_gb, chunked, graph_tp1, graph_tp8):
    gpu = get_gpu("H100").model_copy(update={"hbm_gb": float(hbm_gb)})
    assert default_chunked_prefill(gpu) == chunked
    assert (default_decode_graph_bs(gpu, 1), default_decode_graph_bs(gpu, 8)) == \
        (graph_tp1, graph_tp8)


def test_mem_fraction_heuristic_tiny_scenarios():
    llama = get_model("llama-3.1-8b")  # GQA: prefill graphs reserve 8 MiB per captured size
    h100 = get_gpu("H100")  # 80e9 B = 76,293.9 MiB
    # 512 + 1.5 x 8192 + 1/8 x 1024 + 2 x 256 + 8 x 58 = 13,904 MiB (sglang-knobs table row)
    assert default_mem_fraction(llama, h100, 1, 8192, 256) == \
        round((76_293.9453125 - 13_904) / 76_293.9453125, 3) == 0.818
    # 40 GB card (38,147 MiB < 60 GiB: no 10,240 floor), 4096 tokens -> 50 prefill sizes:
    # 512 + 6144 + 128 + 64 + 400 = 7,248 MiB
    a100 = h100.model_copy(update={"hbm_gb": 40.0})
    assert default_mem_fraction(llama, a100, 1, 4096, 32) == \
        round((38_146.97265625 - 7_248) / 38_146.97265625, 3) == 0.81
    # B200-class, TP8, 16384 tokens -> 74 sizes: 512 + 24,576 + 1,024 + 1,024 + 592 = 27,728
    b200 = get_gpu("B200")  # 171,661.4 MiB
    assert default_mem_fraction(llama, b200, 8, 16384, 512) == \
        round((171_661.376953125 - 27_728) / 171_661.376953125, 3) == 0.838
    # 20 GB card, 2048 tokens -> 8 + 14 + 8 + 8 + 4 = 42 prefill sizes:
    # 512 + 1.5 x 2048 + 128 + 2 x 8 + 8 x 42 = 4,064 MiB of 19,073.5
    small = h100.model_copy(update={"hbm_gb": 20.0})
    assert default_mem_fraction(llama, small, 1, 2048, 8) == \
        round((19_073.486328125 - 4_064) / 19_073.486328125, 3) == 0.787


def test_max_running_requests_rules_incl_speculative_48():
    # unset, no speculation: int(596,600 / 202,752 x 512) = 1,506 -> floor 2,048
    assert resolve_max_running_requests(None, 596_600, 202_752, False) == 2048
    assert resolve_max_running_requests(None, 400_000, 32_768, False) == 4096  # 6,250 -> cap
    assert resolve_max_running_requests(None, 3_000, 131_072, False) == 1500  # kv // 2 binds
    # any speculative algorithm: 48, still capped by kv // 2; an explicit value wins
    assert resolve_max_running_requests(None, 596_600, 202_752, True) == 48
    assert resolve_max_running_requests(None, 60, 202_752, True) == 30
    assert resolve_max_running_requests(256, 596_600, 202_752, True) == 256
    assert resolve_max_running_requests(None, 1, 202_752, False) == 0  # 1 // 2


def test_speculative_fit_glm5_hand_arithmetic():
    m = glm5()
    w, draft_w = m.weight_bytes("fp8") / 8, m.draft_weight_bytes("fp8") / 8
    r = fit(spec(kv_cache_dtype="bf16", mem_fraction_static=0.85))
    # the NextN layer's KV: one layer of the 78 -> 100,152 / 78 = 1,284 B/token
    assert r.draft_kv_bytes_per_token == GLM5_BF16_KV / 78 == 1284
    pool = 0.85 * 180e9 - w - draft_w
    assert r.kv_pool_bytes_per_gpu == pytest.approx(pool)
    assert r.kv_tokens == int(pool // (GLM5_BF16_KV + 1284))
    assert r.draft_weight_bytes_per_gpu == pytest.approx(draft_w)
    assert (r.max_running_requests, r.cuda_graph_max_bs_decode) == (48, 48)
    assert r.speculative == SpecParams("EAGLE", 3, 1, 4, False, GLM5_ALPHA)
    # an explicit max_running_requests wins, and the graph limit follows it
    r2 = fit(spec(kv_cache_dtype="bf16", mem_fraction_static=0.85, max_running_requests=256))
    assert (r2.max_running_requests, r2.cuda_graph_max_bs_decode) == (256, 256)
    # speculation off: no draft layers, the tier's graph size 512
    off = fit(cfg(kv_cache_dtype="bf16", mem_fraction_static=0.85))
    assert (off.draft_weight_bytes_per_gpu, off.cuda_graph_max_bs_decode) == (0.0, 512)
    assert off.kv_tokens > r.kv_tokens


# ---------------------------------------------------------------- the phenomena
def test_glm5_b200_fp8_needs_tp8_nvfp4_fits_tp4_not_tp2():
    with pytest.raises(DoesNotFit) as e:
        fit(cfg(tp_size=4, replicas=2))
    assert e.value.phase == "weights_load"
    assert fit(cfg()).kv_tokens > 0  # FP8 on TP8 fits
    assert fit(cfg(weights="nvfp4", tp_size=4, replicas=2)).kv_tokens > 0
    with pytest.raises(DoesNotFit) as e:
        fit(cfg(weights="nvfp4", tp_size=2, replicas=4))
    assert e.value.phase == "weights_load"
    assert start(cfg(tp_size=4, replicas=2)).phase == "load_weights"
    assert start(cfg(weights="nvfp4", tp_size=4, replicas=2)).ready


def test_fp8_kv_roughly_doubles_kv_tokens():
    bf16 = fit(cfg(kv_cache_dtype="bf16", mem_fraction_static=0.85))
    fp8 = fit(cfg(kv_cache_dtype="fp8_e4m3", mem_fraction_static=0.85))
    # same pool, 100,152 vs 55,224 B/token: x 1.81 (the indexer's 132 B/token stay fp8)
    assert fp8.kv_tokens == int(bf16.kv_pool_bytes_per_gpu // GLM5_FP8_KV)
    assert fp8.kv_tokens / bf16.kv_tokens == pytest.approx(GLM5_BF16_KV / GLM5_FP8_KV, rel=1e-5)
    assert 1.7 < fp8.kv_tokens / bf16.kv_tokens < 2.0


# ---------------------------------------------------------------- speculative resolution
def test_speculative_defaults_and_aliases():
    assert resolve_speculative(cfg()) is None
    r = resolve_speculative_logged(spec())
    assert r.params == SpecParams("EAGLE", 3, 1, 4, False, GLM5_ALPHA)  # NEXTN = EAGLE
    assert r.log == (MRR_LINE,)
    assert resolve_speculative_logged(spec(max_running_requests=64)).log == ()
    # topk 1 forces draft tokens = steps + 1, with the engine's warning
    r = resolve_speculative_logged(spec(speculative_num_steps=2, speculative_eagle_topk=1,
                                        speculative_num_draft_tokens=8))
    assert (r.params.num_steps, r.params.draft_tokens) == (2, 3)
    assert r.log[-1] == ("speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 "
                         "when speculative_eagle_topk == 1")
    # Llama defaults to (5, 4, 8) (no MTP head: acceptance 0, refused later at model init)
    llama = ServingConfig(model="llama-3.1-8b", gpu="H100", weights="bf16",
                          speculative_algorithm="EAGLE")
    p = resolve_speculative(llama)
    assert (p.num_steps, p.topk, p.draft_tokens, p.accept_rate) == (5, 4, 8, 0.0)


def test_trtllm_mha_refuses_trees_and_picks_flashinfer_for_spec_without_topk1():
    llama = dict(model="llama-3.1-8b", gpu="B200", weights="bf16", tp_size=1)
    c = ServingConfig(**llama, attention_backend="trtllm_mha", speculative_algorithm="EAGLE",
                      speculative_num_steps=5, speculative_eagle_topk=4,
                      speculative_num_draft_tokens=8)
    with pytest.raises(InvalidCombination, match="trtllm_mha backend only supports topk = 1"):
        resolve_speculative(c)
    m, gpu = get_model("llama-3.1-8b"), get_gpu("B200")
    assert resolve_attention_backend(ServingConfig(**llama), m, gpu) == ("trtllm_mha", 64)
    assert resolve_attention_backend(ServingConfig(**llama, speculative_algorithm="EAGLE"),
                                     m, gpu) == ("flashinfer", 1)
    assert resolve_attention_backend(ServingConfig(
        **llama, speculative_algorithm="EAGLE", speculative_num_steps=3,
        speculative_eagle_topk=1, speculative_num_draft_tokens=4), m, gpu) == ("trtllm_mha", 64)


def test_adaptive_disabled_with_warning_for_topk2_when_triple_given():
    r = resolve_speculative_logged(spec(speculative_adaptive=True, speculative_num_steps=3,
                                        speculative_eagle_topk=2, speculative_num_draft_tokens=6,
                                        attention_backend="flashinfer"))
    assert r.log[0] == ("speculative_adaptive disabled: speculative_eagle_topk=2 (only topk=1 "
                        "is supported). Falling back to static speculative params.")
    assert r.params == SpecParams("EAGLE", 3, 2, 6, False, GLM5_ALPHA)
    a = resolve_speculative(spec(speculative_adaptive=True))
    assert a == SpecParams("EAGLE", 3, 1, 4, True, GLM5_ALPHA)  # middle of [0,1,3,5,7]


# ---------------------------------------------------------------- acceptance model
def test_acceptance_per_family_from_the_data_file():
    # GLM-5: 1 + a + a^2 + a^3 = 3.48 (SGLang cookbook, EAGLE (3, 1, 4), concurrency 1)
    assert GLM5_ALPHA == pytest.approx(0.9078, abs=1e-4)
    assert accept_length(chain(3, GLM5_ALPHA), 1) == pytest.approx(3.48)
    assert accept_length(chain(3, GLM5_ALPHA), 256) == accept_length(chain(3, GLM5_ALPHA), 1)
    # DeepSeek-V3: the report's 85 % (low end of 85-90 %), also the fallback
    assert accept_rate(get_model("deepseek-v3")) == MTP_ACCEPT_RATE == 0.85
    assert chain_rate(1.75, 2) == pytest.approx(0.5) and chain_rate(4.0, 3) == 1.0
    with pytest.raises(ValueError, match="outside"):
        chain_rate(5.0, 3)


def test_chain_accept_length_by_hand():
    # (1 - 0.85^4) / 0.15 = 1 + 0.85 + 0.7225 + 0.614125
    assert accept_length(chain(3), 1) == pytest.approx(3.186625)
    assert accept_length(chain(2, 0.5), 1) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert accept_length(chain(0), 1) == 1.0
    assert accept_length(chain(4, 1.0), 1) == 5.0


def test_tree_accept_length_approximation_by_hand():
    # topk 2, 2 steps, 5 tokens, a = 0.5: b = 1 - 0.5^2 = 0.75; 4 drafted nodes pay for 2 full
    # levels -> 1 + 0.75 + 0.75^2 = 2.3125
    p = SpecParams("EAGLE", 2, 2, 5, False, 0.5)
    assert accept_length(p, 1) == pytest.approx(2.3125)
    # Llama's (5, 4, 8), a = 0.85: b = 1 - 0.15^4; 7 nodes: 1 full level (4 nodes), then a chain
    # of 3 -> depth 4: 1 + b (1 + 0.85 + 0.85^2 + 0.85^3)
    b = 1 - 0.15 ** 4
    p = SpecParams("EAGLE", 5, 4, 8, False, 0.85)
    assert accept_length(p, 1) == pytest.approx(1 + b * (1 + 0.85 + 0.7225 + 0.614125))


@pytest.mark.parametrize("batch, steps", [
    # bucket 1, candidates [1,3,5,7]: at 3 the EMA -> 0.85 + 0.7225 + 0.614 = 2.187:
    # drop to 1 needs <= 1 - 0.5 - 0.25; rise needs > 3 - 0.5 -> stays at 3
    (1, 3), (7, 3),
    # bucket 8, [0,1,3]: 2.187 > 1 - 0.5 (no drop) -> 3; batch 30 is captured, stays in it
    (8, 3), (30, 3),
    # batch 31 pads to the captured 32 -> bucket 32, [0,1]: starts at the middle (1),
    # EMA 0.85 > 0.5 (no drop to 0) -> 1
    (31, 1), (48, 1),
    # batch 61 pads to 64 -> bucket 64, [0]: drafting off
    (61, 0), (64, 0), (256, 0),
])
def test_adaptive_steps_per_batch_bucket_mtp_head(batch, steps):
    p = chain(3, adaptive=True)
    assert steps_for_batch(p, batch) == steps
    assert draft_tokens_for_batch(p, batch) == steps + 1
    assert accept_length(p, batch) == pytest.approx(sum(0.85 ** i for i in range(steps + 1)))


def test_adaptive_steps_other_acceptance_rates():
    # a = 0.95, bucket 1: at 3 EMA 2.710 > 2.5 -> 5; at 5 EMA 4.298 <= 4.5 and > 2.25 -> 5
    assert adaptive_steps(1, 0.95) == 5
    # a = 0.2, bucket 1: at 3 EMA 0.248 <= 0.25 -> 1; at 1 EMA 0.2 <= 0.5 (no rise) -> 1
    assert adaptive_steps(1, 0.2) == 1
    # a = 0.3, bucket 8: at 3 EMA 0.417 <= 0.5 -> 1 -> 0 (<= 0.5); 0 probes 1, whose EMA 0.3
    # drops it back: the slot alternates 0 <-> 1, reported as 0
    assert adaptive_steps(8, 0.3) == 0
    assert spec_capture_sizes(40) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                      26, 28, 30, 32, 36, 40]
    assert steps_for_batch(chain(2), 200) == 2  # static speculation: always num_steps


# ---------------------------------------------------------------- HiCache
def test_hicache_unset_ratio_shrinks_to_fit_a_small_host():
    gpu = get_gpu("B200").model_copy(update={"host_mem_gb_per_node": 500.0})
    kv, per_tok = 1_000_000, 55_224.0  # device pool 55.224 GB per process
    # budget per process = 0.8 x (500e9 - 10 GiB) / 8; 2 x 55.224 GB exceeds it
    budget = 0.8 * (500e9 - 10 * 2**30) / 8
    ratio, tokens = hicache_host_pool(cfg(enable_hierarchical_cache=True), gpu, kv, per_tok)
    assert ratio == pytest.approx(budget / 55.224e9)
    assert tokens == int(kv * ratio)
    # an explicit ratio is taken as given
    assert hicache_host_pool(cfg(enable_hierarchical_cache=True, hicache_ratio=3.0), gpu, kv,
                             per_tok) == (3.0, 3_000_000)
    assert hicache_host_pool(cfg(), gpu, kv, per_tok) == (0.0, 0)


# ---------------------------------------------------------------- startup failures and logs
def test_speculative_ready_log_has_the_engine_lines():
    s = start(spec())
    assert s.ready
    assert s.log[1] == MRR_LINE
    assert s.log.index(MRR_LINE) < s.log.index(next(x for x in s.log
                                                    if x.startswith("Load weight begin")))
    loads = [x for x in s.log if x.startswith("Load weight end")]
    assert len(loads) == 2 and "type=glm-5-nextn" in loads[1]  # target, then the NextN layer
    assert "Capture target verify CUDA graph end. bs=[1, 2, 3, 4, ..., 48]" in s.log
    assert any(x.startswith("Capture draft CUDA graph begin") for x in s.log)
    assert f"max_running_requests=48, context_len={s.fit.context_len}" in s.log[-2]
    assert s.startup_s == pytest.approx((s.fit.weight_bytes_per_gpu
                                         + s.fit.draft_weight_bytes_per_gpu) / 2.5e9 + 60)


def test_reduced_max_running_requests_warning():
    c = cfg(kv_cache_dtype="bf16", mem_fraction_static=fraction_for_tokens(100.5),
            max_running_requests=64)
    s = start(c)
    assert s.ready and s.fit.max_running_requests == 50  # 100 // 2
    assert ("max_running_requests was reduced from the requested 64 to 50 (per dp worker) due "
            "to the available KV cache capacity.") in s.log


# ---------------------------------------------------------------- knobs and studies
def test_speculative_knob_sets_a_coherent_bundle():
    partial = cfg(speculative_algorithm="NEXTN", speculative_num_steps=5,
                  speculative_eagle_topk=1, speculative_num_draft_tokens=6)
    on = apply_knob(partial, "speculative", "nextn", 8)
    assert (on.speculative_algorithm, on.speculative_num_steps, on.speculative_eagle_topk,
            on.speculative_num_draft_tokens, on.speculative_adaptive) == \
        ("NEXTN", None, None, None, False)
    assert apply_knob(on, "speculative", "nextn_adaptive", 8).speculative_adaptive
    off = apply_knob(on, "speculative", "off", 8)
    assert off.speculative_algorithm is None
    assert engine("sglang").argv(off) == engine("sglang").argv(cfg())
    tri = apply_knob(cfg(), "speculative", "nextn:1,1,2", 8)
    assert (tri.speculative_num_steps, tri.speculative_eagle_topk,
            tri.speculative_num_draft_tokens) == (1, 1, 2)
    with pytest.raises(ConfigInvalid, match="knobs.speculative"):
        apply_knob(cfg(), "speculative", "medusa", 8)
    with pytest.raises(ConfigInvalid, match="cannot be 'unset'"):
        apply_knob(cfg(), "enable_hierarchical_cache", "unset", 8)
    assert apply_knob(cfg(), "router_policy", "cache_aware", 8).router_policy == "cache_aware"
    with pytest.raises(ConfigInvalid, match="knobs.router_policy"):
        apply_knob(cfg(), "router_policy", "random", 8)


def test_study_with_the_new_knobs_validates():
    data = yaml.safe_load(DEFAULT_STUDY.read_text())
    parse_study(data)  # the shipped default still validates
    data["knobs"].update({"speculative": ["off", "nextn", "nextn_adaptive"],
                          "enable_hierarchical_cache": [False, True],
                          "disable_radix_cache": [False, True],
                          "hicache_ratio": ["unset", 3.0],
                          "schedule_policy": ["fcfs", "lpm"],
                          "schedule_conservativeness": ["unset", 0.5],
                          "router_policy": ["round_robin", "cache_aware"]})
    study = parse_study(data)
    assert "speculative" in study.knobs
    data["knobs"]["speculative"] = ["eagle9"]
    with pytest.raises(ConfigInvalid, match="knobs.speculative"):
        parse_study(data)
