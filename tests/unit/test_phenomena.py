"""The practice's phenomena that no other test pins with a band (the index: docs/twin.md).

FP8 weights OOM at TP4 (tests/unit/test_twin_phenomena.py::test_weights_fit_only_from_a_tp_width)
and FP8 KV (::test_fp8_kv_roughly_doubles_the_decode_batch_and_raises_throughput) are tested
there; this file adds the memory fraction.

The practice (published-points.json S01 -> S02, GLM-5 on B200) raised
``--mem-fraction-static`` 0.85 -> 0.90 together with NVFP4 TP4, FP8 KV and the cache-aware
router (153 -> 320 tok/s/GPU in all); it states the direction of the memory-fraction step, not
its own size. The band here is physical: the fraction moves 5 % of the GPU's memory (B200:
180 GB -> 9.0 GB per GPU) into the KV pool, and throughput at a KV-bound concurrency rises by
less than the pool does.
"""

from __future__ import annotations

import pytest

from domain.config import ServingConfig
from domain.hardware import get_gpu
from domain.metrics import summarize
from domain.twin.cluster import simulate_closed_loop
from domain.twin.startup import start

# the practice's layout (S02): GLM-5 NVFP4 on TP4 replicas with fp8 KV
LAYOUT = dict(model="glm-5", gpu="B200", tp_size=4, weights="nvfp4", kv_cache_dtype="fp8_e4m3")


def test_mem_fraction_085_to_090_grows_the_kv_pool_and_raises_tok_s_per_gpu() -> None:
    runs = {}
    for frac in (0.85, 0.90):
        config = ServingConfig(**LAYOUT, mem_fraction_static=frac)
        s = start(config)
        assert s.ready and s.fit is not None, s.reason
        # 1,024 clients of 2,048 + 512 tokens: KV-bound at both fractions (retractions show it)
        recs, stats = simulate_closed_loop(config, s.fit, 1024, 30.0, 2048, 512)
        runs[frac] = (s.fit, summarize(recs, config.gpus), stats[0])
    (lo_fit, lo, lo_st), (hi_fit, hi, hi_st) = runs[0.85], runs[0.90]
    # the pool gains exactly 5 % of the GPU's memory (weights and activations are unchanged)
    gpu_gb = get_gpu("B200").hbm_gb
    assert hi_fit.kv_pool_gb - lo_fit.kv_pool_gb == pytest.approx(0.05 * gpu_gb, rel=0.02)
    pool_gain = hi_fit.kv_tokens / lo_fit.kv_tokens - 1  # about +21 %
    assert hi_st.mean_decode_batch > lo_st.mean_decode_batch
    gain = hi.output_tok_s_per_gpu / lo.output_tok_s_per_gpu - 1
    # raises tok/s/GPU, by more than noise and by less than the pool grew
    assert 0.02 < gain < pool_gain, (gain, pool_gain)
