"""The steady-state estimate (domain/estimate.py): the guided brain's prior of a config's
saturation throughput and replay TTFT, checked against hand arithmetic, the memory fit and the
twin."""

from __future__ import annotations

import dataclasses
import math

import pytest

from domain.calibration import efficiency
from domain.config import ServingConfig
from domain.costmodel import build_cost_model
from domain.errors import DoesNotFit
from domain.estimate import (
    Estimate,
    ReplayProfile,
    _p99_slot_wait,
    _pairs,
    _prefill_per_request,
    estimate,
    safe_estimate,
)
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
    # uncached tokens [10, 2, 0, 6, 14]: p99 of [0, 2, 6, 10, 14] is 10 + 0.96 * 4; only the
    # hashless 14-token request is at or above it, with nothing cached
    assert p.new_p99 == pytest.approx(13.84)
    assert p.cached_at_p99 == 0.0
    # no duration: the span of the arrivals (4 s)
    assert ReplayProfile.of(win).rate_req_s == pytest.approx(5 / 4.0)
    # no block hashes anywhere: no reuse
    flat = trace(req(0.0, 100, 10), req(0.5, 100, 10))
    assert ReplayProfile.of(flat, 1.0).reuse_share == 0.0


def test_new_p99_is_the_uncached_tail_and_cached_at_p99_its_history():
    win = trace(
        req(0.0, 8, 1, (1, 2), 4),              # new 8, cached 0
        req(1.0, 20, 1, (1, 2, 3, 4, 5), 4),    # 1, 2 seen: cached 8, new 12
        req(2.0, 12, 1),                        # no hashes: cached 0, new 12
        req(3.0, 24, 1, (1, 2, 3, 4, 5, 6), 4),  # 1..5 seen: cached 20, new 4
    )
    p = ReplayProfile.of(win, duration_s=4.0)
    assert p.reuse_share == pytest.approx((8 + 20) / 64)
    # p99 of the uncached [4, 8, 12, 12]: index 0.99 * 3 = 2.97 between the two 12s
    assert p.new_p99 == pytest.approx(12.0)
    # the two 12-token requests are at the p99; their cached tokens average (8 + 0) / 2
    assert p.cached_at_p99 == pytest.approx(4.0)
    # the longest prompt (24) carries the most history: the uncached tail is below
    # isl_p99 x (1 - reuse_share) (numpy's p99 of [8, 12, 20, 24]: 20 + 0.97 * 4)
    assert p.isl_p99 == pytest.approx(23.88)
    assert p.new_p99 < p.isl_p99 * (1 - p.reuse_share)


def test_ttft_grows_with_the_uncached_p99_prompt():
    base = dataclasses.replace(profile(0.3), new_p99=2000.0, cached_at_p99=6000.0)
    more = dataclasses.replace(base, new_p99=8000.0)
    lo, hi = estimate(GLM, GLM_SAT, base), estimate(GLM, GLM_SAT, more)
    assert lo.ttft_p99_ms < hi.ttft_p99_ms < math.inf
    # the queueing terms do not depend on it: same capacity and utilization
    assert lo.utilization == pytest.approx(hi.utilization)


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


# -- the queueing and prefill terms ---------------------------------------------------------

def _hw_p99_slot_wait(rho: float, c: float, e2e: float) -> float:
    """The Halfin-Whitt slot wait, by hand (Phi via erf)."""
    beta = (1 - rho) * math.sqrt(c)
    phi = math.exp(-beta * beta / 2) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1 + math.erf(beta / math.sqrt(2)))
    p_wait = 1 / (1 + beta * cdf / phi)
    return math.log(100 * p_wait) * e2e / (c * (1 - rho))


def test_slot_wait_is_zero_at_low_load_and_grows_towards_saturation():
    # many slots, light load: a free slot is (almost) always there
    assert _p99_slot_wait(0.3, 256, 10.0) == 0.0
    assert _p99_slot_wait(0.5, 64, 10.0) == 0.0  # beta = 4: P(wait) ~ 3e-5
    rhos = [0.5, 0.8, 0.9, 0.95, 0.99, 0.999]
    waits = [_p99_slot_wait(r, 64, 10.0) for r in rhos]
    assert all(a <= b for a, b in zip(waits, waits[1:], strict=False))
    assert all(a < b for a, b in zip(waits[1:], waits[2:], strict=False))
    assert waits[1] > 0 and waits[-1] > 100 * waits[1]
    # by hand at rho 0.9, 64 slots: beta 0.8, P(wait) ~ 0.315, p99 ~ 5.4 s for a 10 s E2E
    assert waits[2] == pytest.approx(_hw_p99_slot_wait(0.9, 64, 10.0), rel=1e-9)
    assert waits[2] == pytest.approx(5.39, abs=0.02)
    # at the same load more slots wait less; the wait scales with the E2E
    assert _p99_slot_wait(0.9, 256, 10.0) < waits[2]
    assert _p99_slot_wait(0.9, 64, 20.0) == pytest.approx(2 * waits[2])


def test_dsa_prefill_attends_at_most_index_topk_keys():
    cost = build_cost_model(GLM, fit(GLM))
    assert cost.topk > 0  # GLM-5 is a DSA model
    k = cost.topk
    # within index_topk: attention and indexer both count the whole context
    assert _pairs(cost, 1000, k / 2) == (1000 * k / 2, 1000 * k / 2)
    # a long context: attention capped at index_topk keys per query, the indexer scores all
    ctx = 16 * k
    attn, index = _pairs(cost, 1000, ctx)
    assert attn == 1000 * k and index == 1000 * ctx
    capped = cost.prefill_time(1000, attn, index)
    uncapped = cost.prefill_time(1000, 1000 * ctx, 1000 * ctx)
    assert capped < uncapped
    assert cost.prefill_time(1000, *_pairs(cost, 1000, k / 2)) == \
        cost.prefill_time(1000, 1000 * k / 2, 1000 * k / 2)
    # a request's chunked prefill on a long cached history counts its pairs through the cap
    chunk = fit(GLM).chunked_prefill_size
    new_tokens, cached = 2 * chunk + 1000, 40 * k

    def by_hand(cap: bool) -> float:
        total, done, left = 0.0, float(cached), float(new_tokens)
        while left > 0:
            c = min(chunk, left)
            mid = done + c / 2
            total += cost.prefill_time(int(c), c * (min(mid, k) if cap else mid), c * mid)
            done += c
            left -= c
        return total

    got = _prefill_per_request(cost, cached + new_tokens, 0.0, chunk, cached=cached)
    assert got == pytest.approx(by_hand(cap=True), rel=1e-12)
    assert got < by_hand(cap=False)
    # a dense model attends everything and has no indexer
    dense = build_cost_model(LLAMA_H100, fit(LLAMA_H100))
    assert dense.topk == 0 and _pairs(dense, 1000, ctx) == (1000 * ctx, 0.0)


# -- layouts: per scheduler x schedulers x servers; PD as min(prefill, decode) -------------

@dataclasses.dataclass
class _Rep:
    """A hand-made memory fit: per scheduler 1,000 KV tokens and 4 request slots."""

    kv_tokens: int = 1000
    max_running_requests: int = 4
    chunked_prefill_size: int = 8192
    speculative: None = None
    kv_bytes_per_token: float = 1e6
    draft_kv_bytes_per_token: float = 0.0


class _Cost:
    """A hand-made step model: 1 ms per prefill token, 10 ms per decode step, nothing else."""

    topk = 0
    request_fixed_s = 0.0

    def prefill_time(self, tokens: int, attn: float, index: float) -> float:
        return 1e-3 * tokens

    def decode_time(self, batch: int, context: int) -> float:
        return 0.01

    def tokenize_time(self, tokens: float) -> float:
        return 0.0


@pytest.fixture
def hand_model(monkeypatch):
    monkeypatch.setattr("domain.estimate.fit", lambda c: _Rep())
    monkeypatch.setattr("domain.estimate.build_cost_model", lambda c, r: _Cost())


DSV3 = ServingConfig(model="deepseek-v3", gpu="H200", tp_size=8, weights="fp8")
HAND_SAT = SaturationSpec(isl=100, osl=11, concurrency=64, duration_s=60)


def test_attention_dp_counts_every_scheduler(hand_model):
    # one scheduler: batch min(64 clients, 4 slots, 1000 / 111) = 4; 4 requests finish every
    # 4 x 0.1 s prefill + 10 x 0.01 s decode = 0.5 s: 4 x 11 / 0.5 = 88 tok/s over 8 GPUs
    tp8 = estimate(DSV3, HAND_SAT)
    assert (tp8.batch, tp8.output_tok_s_per_gpu) == (4, pytest.approx(88 / 8))
    # 8 attention-DP ranks, each its own scheduler with the same fit and step: 8x the output
    dp8 = estimate(DSV3.model_copy(update={"attn_dp_size": 8}), HAND_SAT)
    assert (dp8.batch, dp8.output_tok_s_per_gpu) == (4, pytest.approx(88))


def test_pd_is_the_slower_pool_and_its_ttft_carries_the_transfer(hand_model):
    pd = ServingConfig.model_validate({**DSV3.model_dump(), "tp_size": 4, "pd": "1P1D"})
    est = estimate(pd, HAND_SAT)
    # prefill: 1 scheduler / 0.1 s = 10 req/s; decode: 4 slots / (10 x 0.01 s) = 40 req/s;
    # the closed loop 64 / (0.1 + transfer + 0.01 + 0.1) s is far above: 10 req/s x 11 tokens
    # over the 8 GPUs of the two TP4 servers
    assert est.output_tok_s_per_gpu == pytest.approx(10 * 11 / 8)
    # the p99 prompt's KV: 100 tokens x 1 MB per GPU over each GPU's 50 GB/s NIC at the
    # transfer's share of it, plus its fixed latency (the twin's link, domain/twin/pd.py)
    eff = efficiency("H200")
    move = 100 * 1e6 / (50e9 * eff.pd_transfer_eta) + eff.pd_transfer_latency_s
    r = ReplayProfile(rate_req_s=1.0, isl_mean=100, isl_p99=100, osl_mean=11,
                      reuse_share=0.0, requests=60)
    est = estimate(pd, HAND_SAT, r)
    assert est.transfer_ms == pytest.approx(move * 1000)
    assert est.capacity_req_s == pytest.approx(10.0) and est.utilization == pytest.approx(0.1)
    # TTFT: prefill 0.1 s + its M/M/1 wait at rho 0.1 (0.1 ln 10 / 0.9) + the move + one 10 ms
    # decode step + the wait for one of the 4 decode slots at rho 1/40 (each held 0.11 s)
    wait = 0.1 * math.log(10) / 0.9
    slot = _p99_slot_wait(1 / 40, 4, 0.11)
    assert 0 < slot < 0.05
    assert est.ttft_p99_ms == pytest.approx((0.1 + wait + move + 0.01 + slot) * 1000)


def test_attention_dp_ranks_stall_for_each_others_prefills(hand_model):
    # 2 schedulers at 1 req/s each; each: 4 slots, 4 x 0.1 s prefill + 10 x 0.01 s decode per
    # 4 requests = 8 req/s, and a 0.1 s prefill per request: its own prefill share u = 0.1
    r = ReplayProfile(rate_req_s=2.0, isl_mean=100, isl_p99=100, osl_mean=11,
                      reuse_share=0.0, requests=120)
    copies = estimate(DSV3.model_copy(update={"dp_size": 2}), HAND_SAT, r)
    assert copies.utilization == pytest.approx(1 / 8)  # independent TP groups: no stall
    # attention-DP ranks step together: alone the peer would prefill 1 - 0.9^2 - 0.1 = 0.09 of
    # the time; the shared step is priced as the mean tokens per rank (100 / 2 = 50 tokens:
    # 0.05 s, half its own 0.1 s), and this rank still runs one 0.01 s decode step in it:
    # it loses 0.09 x 0.05 / 0.1 x (1 - 0.01 / 0.05) = 0.036
    lock = estimate(DSV3.model_copy(update={"attn_dp_size": 2}), HAND_SAT, r)
    assert lock.utilization == pytest.approx(1 / 8 + 0.036)
    assert lock.capacity_req_s == pytest.approx(2.0 / (1 / 8 + 0.036))
    assert lock.ttft_p99_ms > copies.ttft_p99_ms
