"""The steady-state estimate (domain/estimate.py): the guided brain's prior of a config's
saturation throughput and replay TTFT, checked against hand arithmetic, the memory fit and the
twin."""

from __future__ import annotations

import dataclasses
import math

import pytest

from domain.config import ServingConfig
from domain.errors import DoesNotFit
from domain.estimate import Estimate, ReplayProfile, estimate, safe_estimate
from domain.fit import fit
from domain.metrics import summarize
from domain.study import SaturationSpec
from domain.twin.cluster import simulate_closed_loop
from domain.twin.startup import start
from domain.workload import Request, Trace

# GLM-5 FP8 on one TP8 replica of 8x B200, the default study's baseline and saturation run.
GLM = ServingConfig(model="glm-5", gpu="B200", tp_size=8, replicas=1, weights="fp8",
                    kv_cache_dtype="bf16")
GLM_SAT = SaturationSpec(isl=2048, osl=512, concurrency=1024, duration_s=60)


def trace(*reqs: Request) -> Trace:
    return Trace(name="hand", source_format="synthetic", requests=list(reqs))


def req(t: float, isl: int, osl: int, hashes: tuple[int, ...] = (), block: int = 0) -> Request:
    return Request(arrival_s=t, input_tokens=isl, output_tokens=osl, hash_ids=hashes,
                   block_size=block)


# -- the replay profile ---------------------------------------------------------------------

def test_replay_profile_by_hand():
    win = trace(
        req(0.0, 10, 5, (1, 2, 3), 4),   # all blocks new: 0 reused
        req(1.0, 10, 7, (1, 2, 9), 4),   # 1, 2 seen (4 + 4); 9 new stops the match: 8
        req(2.0, 10, 3, (1, 2, 3), 4),   # 1, 2 full (8) + last block holds 10 - 8 = 2: 10
        req(3.0, 6, 1, (5, 2), 4),       # 5 new: the match stops although 2 was seen: 0
        req(4.0, 14, 4),                 # no hashes: never a hit, counts in the denominator
    )
    p = ReplayProfile.of(win, duration_s=10.0)
    assert p.requests == 5
    assert p.rate_req_s == pytest.approx(5 / 10.0)
    assert p.isl_mean == pytest.approx(50 / 5)
    # numpy's linear percentile of [6, 10, 10, 10, 14]: index 0.99 * 4 = 3.96 -> 10 + 0.96 * 4
    assert p.isl_p99 == pytest.approx(13.84)
    assert p.osl_mean == pytest.approx((5 + 7 + 3 + 1 + 4) / 5)
    assert p.reuse_share == pytest.approx((0 + 8 + 10 + 0 + 0) / 50)
    # no duration: the span of the arrivals (4 s)
    assert ReplayProfile.of(win).rate_req_s == pytest.approx(5 / 4.0)
    # no block hashes anywhere: no reuse
    flat = trace(req(0.0, 100, 10), req(0.5, 100, 10))
    assert ReplayProfile.of(flat, 1.0).reuse_share == 0.0


# -- the saturation estimate ----------------------------------------------------------------

def test_estimate_of_a_config_that_fits_follows_the_memory_fit():
    rep = fit(GLM)
    e = estimate(GLM, GLM_SAT)
    assert e.fits and e.why == ""
    want = min(GLM_SAT.concurrency / GLM.replicas, rep.max_running_requests,
               rep.kv_tokens / (GLM_SAT.isl + GLM_SAT.osl))
    assert e.batch == pytest.approx(want)
    assert e.output_tok_s_per_gpu > 0
    # without a replay the replay fields stay "unknown"
    assert e.capacity_req_s == 0 and math.isinf(e.utilization) and math.isinf(e.ttft_p99_ms)
    # two TP1 replicas split the clients: the admission cap is per replica
    small = SaturationSpec(isl=128, osl=64, concurrency=6, duration_s=10)
    two = ServingConfig(model="llama-3.1-8b", gpu="H100", tp_size=1, replicas=2, weights="bf16")
    assert estimate(two, small).batch == pytest.approx(3.0)


def test_fp8_kv_raises_the_batch_of_a_kv_limited_config():
    fp8kv = GLM.model_copy(update={"kv_cache_dtype": "fp8_e4m3"})
    bf, f8 = fit(GLM), fit(fp8kv)
    per_req = GLM_SAT.isl + GLM_SAT.osl
    # precondition: the bf16 pool is what limits the batch (not the clients, not the slots)
    assert bf.kv_tokens / per_req < min(GLM_SAT.concurrency, bf.max_running_requests)
    assert f8.kv_tokens > bf.kv_tokens
    e_bf, e_f8 = estimate(GLM, GLM_SAT), estimate(fp8kv, GLM_SAT)
    assert e_bf.batch == pytest.approx(bf.kv_tokens / per_req)
    assert e_f8.batch > e_bf.batch
    assert e_f8.output_tok_s_per_gpu > e_bf.output_tok_s_per_gpu


def profile(rate: float) -> ReplayProfile:
    return ReplayProfile(rate_req_s=rate, isl_mean=4000, isl_p99=12000, osl_mean=300,
                         reuse_share=0.3, requests=1000)


def test_replay_load_raises_utilization_and_ttft_until_it_is_infinite():
    slow, fast = estimate(GLM, GLM_SAT, profile(0.2)), estimate(GLM, GLM_SAT, profile(0.6))
    assert slow.fits and fast.fits
    assert 0 < slow.utilization < fast.utilization < 1
    assert slow.ttft_p99_ms < fast.ttft_p99_ms < math.inf
    # capacity depends on the config, not the load; utilization is rate over capacity
    assert slow.capacity_req_s == pytest.approx(fast.capacity_req_s)
    assert fast.utilization == pytest.approx(0.6 / fast.capacity_req_s)
    # the saturation numbers do not depend on the replay
    assert slow.output_tok_s_per_gpu == estimate(GLM, GLM_SAT).output_tok_s_per_gpu
    # at or past capacity the queue never drains: TTFT p99 infinite, the SLO ratio too
    over = estimate(GLM, GLM_SAT, profile(2 * slow.capacity_req_s))
    assert over.utilization >= 1 and math.isinf(over.ttft_p99_ms)
    assert math.isinf(over.slo_ratio(8000))
    assert slow.slo_ratio(slow.ttft_p99_ms * 2) == pytest.approx(0.5)
    # more prefix reuse makes prefill cheaper: lower TTFT at the same load
    reused = dataclasses.replace(profile(0.6), reuse_share=0.9)
    assert estimate(GLM, GLM_SAT, reused).ttft_p99_ms < fast.ttft_p99_ms


def test_a_config_that_does_not_fit_is_an_estimate_not_an_exception():
    tp2 = GLM.model_copy(update={"tp_size": 2, "replicas": 4})
    with pytest.raises(DoesNotFit):
        fit(tp2)
    for e in (estimate(tp2, GLM_SAT), safe_estimate(tp2, GLM_SAT, profile(0.5))):
        assert not e.fits and e.output_tok_s_per_gpu == 0 and e.batch == 0
        assert "does not fit" in e.why and "GB" in e.why
        assert math.isinf(e.ttft_p99_ms)
    # safe_estimate also turns a config the registry does not know into "does not fit"
    unknown = GLM.model_copy(update={"model": "no-such-model"})
    e = safe_estimate(unknown, GLM_SAT, profile(0.5))
    assert isinstance(e, Estimate) and not e.fits and e.why


LLAMA_H100 = ServingConfig(model="llama-3.1-8b", gpu="H100", tp_size=1, replicas=1,
                           weights="bf16")


@pytest.mark.parametrize(("cfg", "sat"), [
    # the brief's case: one TP1 replica, the batch is the clients
    (LLAMA_H100, SaturationSpec(isl=1024, osl=128, concurrency=64, duration_s=5)),
    # the KV pool limits the batch (admission waves in the twin)
    (LLAMA_H100, SaturationSpec(isl=4096, osl=512, concurrency=512, duration_s=5)),
    # two replicas share the clients
    (LLAMA_H100.model_copy(update={"gpu": "B200", "replicas": 2}),
     SaturationSpec(isl=512, osl=64, concurrency=32, duration_s=5)),
], ids=["llama8b-h100-tp1", "kv-limited", "two-replicas"])
def test_estimate_agrees_with_the_twin_on_a_small_config(cfg, sat):
    st = start(cfg)  # as benchmarks/search_efficiency.py evaluate() does
    assert st.ready and st.fit is not None
    recs, _ = simulate_closed_loop(cfg, st.fit, sat.concurrency, sat.duration_s, sat.isl,
                                   sat.osl)
    twin = summarize(recs, cfg.gpus).output_tok_s_per_gpu
    est = estimate(cfg, sat)
    print(f"twin {twin:,.1f} tok/s/GPU, estimate {est.output_tok_s_per_gpu:,.1f} tok/s/GPU "
          f"({est.output_tok_s_per_gpu / twin:.3f}x) at batch {est.batch:.1f}")
    assert twin > 0 and abs(est.output_tok_s_per_gpu / twin - 1) <= 0.25
