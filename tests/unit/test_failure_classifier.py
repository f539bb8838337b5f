"""A startup log gets its failure class: the twin's startup logs per phase and their class.

Covers ``domain.engines.sglang.failures.classify`` over the log lines of
``domain.twin.startup.start`` (the engine's resolve, model-init, weight-loading, KV-pool,
CUDA-graph and HiCache host-pool failures) and over the injected faults of
``domain.twin.injected``; each checked against arithmetic done by hand in the comments.
Backends' logs classified through the cluster MCP server are tested with their backend.
"""

from __future__ import annotations

import pytest
from fixtures.configs import GLM5_FP8_KV, fraction_for_tokens
from fixtures.configs import serving_config as cfg
from fixtures.configs import speculative_config as spec

import domain.hardware as hw
from domain.config import ServingConfig
from domain.engines.sglang.failures import classify
from domain.errors import DoesNotFit, InvalidCombination
from domain.faults import DEPLOY_FAULTS, EXPECTED_CLASS
from domain.fit import fit, host_pool_shortfall
from domain.knobs import apply_knob
from domain.models import glm5
from domain.speculative import resolve_speculative
from domain.twin.injected import inject_startup
from domain.twin.startup import start

BASE = cfg()


# ---------------------------------------------------------------- resolve: refused before weights
@pytest.mark.parametrize("kw, exc, message", [
    (dict(speculative_eagle_topk=1), "AssertionError", ""),
    (dict(speculative_num_draft_tokens=4), "AssertionError", ""),
    (dict(speculative_num_steps=3), "TypeError",
     "'>' not supported between instances of 'NoneType' and 'int'"),
    (dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=4),
     "ValueError", "speculative_eagle_topk > 1 with page_size > 1 is only supported on "
     "('flashinfer', 'fa3', 'triton'); got attention_backend='dsa'. Use page_size == 1 or one "
     "of those backends."),
    (dict(speculative_adaptive=True, speculative_num_steps=2), "ValueError",
     "--speculative-num-steps=2 is not in the adaptive config candidate_steps [0, 1, 3, 5, 7]. "
     "Pass one of those values."),
    # adaptive is switched off for topk 2, and then the partial triple trips the assert
    (dict(speculative_adaptive=True, speculative_eagle_topk=2), "AssertionError", ""),
], ids=["topk-only", "draft-only", "steps-only", "dsa-tree", "adaptive-steps", "adaptive-topk2"])
def test_partial_or_refused_speculative_combinations(kw, exc, message):
    with pytest.raises(InvalidCombination) as e:
        resolve_speculative(spec(**kw))
    assert (e.value.exception, e.value.message) == (exc, message)
    s = start(spec(**kw))
    assert (s.ready, s.phase, s.exit_code) == (False, "resolve", 1)
    assert s.log[-1] == e.value.line
    assert not any(line.startswith("Load weight begin") for line in s.log)
    assert classify(s.log)[0] == "INVALID_COMBINATION"


def test_resolve_failures_before_weights_with_engine_messages():
    s = start(cfg(enable_hierarchical_cache=True, disable_radix_cache=True))
    assert (s.phase, s.exit_code) == ("resolve", 1)
    assert s.reason == ("ValueError: The arguments enable-hierarchical-cache and "
                        "disable-radix-cache are mutually exclusive and cannot be used at the "
                        "same time. Please use only one of them.")
    s = start(cfg(schedule_conservativeness=-0.1))
    assert (s.phase, s.reason) == ("resolve", "AssertionError: schedule_conservativeness must "
                                              "be non-negative")
    assert classify(s.log)[0] == "INVALID_COMBINATION"
    assert start(cfg(schedule_conservativeness=0.0)).ready


# ---------------------------------------------------------------- model init
def test_tp_divisibility_and_single_node_refused_like_the_engine():
    # GLM-5's 64 query heads do not split over 3 ranks: DeepseekV2AttentionMLA's bare assert
    s = start(cfg(weights="nvfp4", tp_size=3, replicas=2))
    assert (s.phase, classify(s.log)[0]) == ("model_init", "TP_DIVISIBILITY")
    assert s.log[-3:] == [
        '  File "/sgl-workspace/sglang/python/sglang/srt/models/deepseek_v2.py", line 2057, in '
        "__init__", "    assert num_heads % attn_tp_size == 0", "AssertionError"]
    # a pasted launch of TP16 without --nnodes: rank 8 has no device on an 8-GPU node
    from domain.engines import engine
    s = engine("sglang").start(cfg(weights="nvfp4", tp_size=16, replicas=1), nnodes=1)
    assert classify(s.log)[0] == "MULTI_NODE_REQUIRED"
    # the config's own argv spans two nodes with --nnodes 2 (issue 21) and starts
    s = start(cfg(weights="nvfp4", tp_size=16, replicas=1))
    assert s.ready and "--nnodes 2" in s.log[0]
    # and a study may build it (the knobs let a server span nodes)
    two_nodes = apply_knob(cfg(), "tp_size", 16, 16)
    assert (two_nodes.replicas, two_nodes.nnodes(8)) == (1, 2)


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    # Qwen3-235B-A22B: 64 query heads, 4 KV heads. TP8: 64 % 8 == 0 and 8 % 4 == 0, so each KV
    # head is replicated on 2 ranks (qwen3_moe.py:509-517) and the server starts; before, the
    # twin refused it with "4 is not divisible by 8".
    for gpu in ("H200", "B200"):
        s = start(ServingConfig(model="qwen3-235b-a22b", gpu=gpu, tp_size=8, weights="fp8"))
        assert s.ready, s.log[-3:]
        # every GPU holds max(1, 4 // 8) = 1 KV head: 94 layers x K and V x 128 dims x 2 B
        assert s.fit.kv_bytes_per_token == 94 * 2 * 1 * 128 * 2
    # TP3 splits neither the 64 query heads nor the 4 KV heads: the query assert comes first
    s = start(ServingConfig(model="qwen3-235b-a22b", gpu="H200", tp_size=3, weights="fp8"))
    assert (s.phase, classify(s.log)[0]) == ("model_init", "TP_DIVISIBILITY")
    assert "line 506, in __init__" in s.log[-3]


def test_speculation_without_a_draft_head_fails_at_model_init():
    s = start(ServingConfig(model="qwen3-32b", gpu="H200", tp_size=8, weights="bf16",
                            speculative_algorithm="NEXTN"))
    assert (s.phase, classify(s.log)[0]) == ("model_init", "NO_DRAFT_MODEL")
    assert any(x.startswith("Load weight end") for x in s.log)


# ---------------------------------------------------------------- weights, KV pool, CUDA graphs
def test_draft_layers_can_tip_weight_loading_into_oom(monkeypatch):
    # a 113 GB GPU: NVFP4 TP4 target 110.2 GB + 1.5 GB context fits; its bf16 NextN layer
    # (19.9 GB / 4 = 5.0 GB) does not
    monkeypatch.setitem(hw.GPUS, "B200", hw.GPUS["B200"].model_copy(update={"hbm_gb": 113.0}))
    m = glm5()
    w, draft_w = m.weight_bytes("nvfp4") / 4, m.draft_weight_bytes("nvfp4") / 4
    assert w + 1.5e9 <= 113e9 < w + draft_w + 1.5e9
    c = cfg(weights="nvfp4", tp_size=4, replicas=2)
    assert start(c).phase == "kv_pool"  # without speculation the target loads (no KV room)
    with pytest.raises(DoesNotFit) as e:
        fit(c.model_copy(update={"speculative_algorithm": "NEXTN"}))
    assert e.value.phase == "weights_load"
    assert e.value.required_gb == pytest.approx((w + draft_w + 1.5e9) / 1e9)
    s = start(c.model_copy(update={"speculative_algorithm": "NEXTN"}))
    assert (s.phase, classify(s.log)[0]) == ("load_weights", "OOM_WEIGHTS")
    assert sum(x.startswith("Load weight end") for x in s.log) == 1  # the target loaded


def test_kv_pool_too_small_for_one_request():
    # 1.5 tokens of pool: max_running_requests = 1 // 2 = 0 -> the server dies
    c = cfg(kv_cache_dtype="bf16", mem_fraction_static=fraction_for_tokens(1.5))
    with pytest.raises(DoesNotFit) as e:
        fit(c)
    assert (e.value.phase, e.value.cause) == ("kv_pool", "zero_requests")
    s = start(c)
    assert (s.phase, s.reason) == ("kv_pool", "AssertionError: max_running_request is zero")
    assert classify(s.log)[0] == "KV_NO_ROOM"
    # 4.5 tokens: 2 requests allowed and max_req_len = min(202,751, 4 - 1) = 3 > 0
    # (tp_worker.py:421-425): 0.5.23 starts it (the twin used to refuse it with "- 5")
    s = start(cfg(kv_cache_dtype="bf16", mem_fraction_static=fraction_for_tokens(4.5)))
    assert s.ready and s.fit.kv_tokens == 4 and s.fit.max_running_requests == 2
    # 0.5 tokens: no whole token fits, MemoryPoolConfig refuses (pool_configurator.py:99)
    s = start(cfg(kv_cache_dtype="bf16", mem_fraction_static=fraction_for_tokens(0.5)))
    assert s.phase == "kv_pool" and s.reason.startswith("RuntimeError: Not enough memory. ")
    # 100,000 tokens < the 202,752-token context: a warning, and the server starts
    c = cfg(kv_cache_dtype="bf16", mem_fraction_static=fraction_for_tokens(100_000.5))
    s = start(c)
    assert s.ready and s.fit.kv_tokens == 100_000 and s.fit.kv_smaller_than_context
    assert "KV pool holds 100000 tokens, fewer than --context-length 202752" in s.log
    # max_running_requests: int(100,000 / 202,752 x 512) = 252 -> floor 2,048 (<= 50,000)
    assert s.fit.max_running_requests == 2048


def test_existing_failure_modes_keep_their_phase_and_class():
    assert (start(cfg(tp_size=4, replicas=2)).phase, "OOM_WEIGHTS") == \
        ("load_weights", classify(start(cfg(tp_size=4, replicas=2)).log)[0])
    s = start(cfg(mem_fraction_static=0.5))
    assert (s.phase, classify(s.log)[0]) == ("kv_pool", "KV_NO_ROOM")
    s = start(cfg(mem_fraction_static=0.99))
    assert (s.phase, classify(s.log)[0]) == ("cuda_graph", "GRAPH_CAPTURE_OOM")
    s = start(cfg(attention_backend="fa3"))
    assert (s.phase, classify(s.log)[0]) == ("model_init", "UNSUPPORTED_BACKEND")


# ---------------------------------------------------------------- HiCache host pool
def test_hicache_host_pool_default_ratio_and_shortfall():
    r = fit(cfg(enable_hierarchical_cache=True, mem_fraction_static=0.85))
    # auto KV dtype on B200 for DSA: fp8, 55,224 B/token; host = 2 x device tokens
    assert (r.hicache_ratio, r.host_kv_tokens) == (2.0, 2 * r.kv_tokens)
    assert r.host_kv_bytes_per_gpu == 2 * r.kv_tokens * GLM5_FP8_KV
    assert host_pool_shortfall(cfg(enable_hierarchical_cache=True), r) is None
    # ratio 5: x = 5 x kv x 55,224 B per process; the 8 processes split 2 TB - 10 GiB evenly
    # (pool_host/base.py:104-108) and each fails when x exceeds its share
    c5 = cfg(enable_hierarchical_cache=True, hicache_ratio=5.0, mem_fraction_static=0.85)
    r5 = fit(c5)
    x = int(r5.kv_tokens * 5.0) * GLM5_FP8_KV
    share = (2e12 - 10 * 2**30) // 8
    assert x > share
    assert host_pool_shortfall(c5, r5) == pytest.approx((x / 1e9, share / 1e9))
    s = start(c5)
    assert (s.phase, s.exit_code, classify(s.log)[0]) == ("host_pool", 1, "HOST_OOM_HICACHE")
    assert s.reason == (f"ValueError: Not enough host memory available. Requesting {x / 1e9:.2f} "
                        f"GB but only have {share / 1e9:.2f} GB free. "
                        "Please reduce the size of the hierarchical cache.")


def test_hicache_ready_log_and_a_ratio_of_one_only_warns():
    ok = start(cfg(enable_hierarchical_cache=True))
    assert ok.ready
    line = (f"Allocating {ok.fit.host_kv_bytes_per_gpu / 1e9:.2f} GB host memory for "
            "hierarchical KV cache.")
    assert line in ok.log
    # a host pool no larger than the device pool is a warning in 0.5.23 (pool_host/base.py:239)
    s = start(cfg(enable_hierarchical_cache=True, hicache_ratio=1.0))
    assert s.ready
    assert any(x.startswith("HiCache KV host pool (") and "is smaller than the device pool" in x
               for x in s.log)


# ---------------------------------------------------------------- injected faults
@pytest.mark.parametrize("fault", DEPLOY_FAULTS)
def test_each_injected_startup_is_classified_into_its_class(fault):
    ok = start(BASE)
    assert ok.ready
    s = inject_startup(ok, fault, BASE)
    assert not s.ready
    cls, evidence = classify(s.log)
    assert cls == EXPECTED_CLASS[fault], (cls, evidence)
    assert not any("inject" in line.lower() for line in s.log)  # only what a cluster shows
