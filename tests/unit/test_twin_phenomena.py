"""Phenomena the twin must reproduce on GLM-5-class MoE on B200 (issue 3), end to end.

Each test starts the config the way the cluster server does (``startup.start``: memory fit,
engine log, failures) and runs the twin's benchmarks on it: closed-loop saturation, or a replay
of a 20-minute window of the shipped Mooncake conversation trace at its own arrival times (the
window the default study replays). No special case in the engine produces these: they come from
the memory fit, the roofline step model and the scheduler.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from domain.config import ServingConfig
from domain.costmodel import build_cost_model
from domain.fit import FitReport
from domain.metrics import MetricsSummary, summarize
from domain.traces import load_trace
from domain.twin.cluster import ReplicaStats, simulate_closed_loop, simulate_open_loop
from domain.twin.startup import start

TRACE = Path(__file__).resolve().parents[2] / "data" / "traces" / \
    "mooncake_fast25_conversation_trace.jsonl"
# the practice's serving layout: GLM-5 NVFP4 on TP4 replicas, fp8 KV, mem fraction 0.9
PRACTICE = dict(model="glm-5", gpu="B200", tp_size=4, weights="nvfp4",
                kv_cache_dtype="fp8_e4m3", mem_fraction_static=0.9)


def ready(**kw: object) -> tuple[ServingConfig, FitReport]:
    config = ServingConfig(**kw)
    s = start(config)
    assert s.ready, s.reason
    assert s.fit is not None
    return config, s.fit


@cache
def window(strip_prefixes: bool = False, duration_s: float = 1200.0
           ) -> tuple[tuple[object, ...], ...]:
    w = load_trace(TRACE, "mooncake").window(600, duration_s)
    return tuple((q.arrival_s, q.input_tokens, q.output_tokens,
                  () if strip_prefixes else q.hash_ids, q.block_size) for q in w.requests)


def replay(strip_prefixes: bool = False, duration_s: float = 1200.0, **kw: object
           ) -> tuple[MetricsSummary, list[ReplicaStats]]:
    config, rep = ready(**kw)
    recs, stats = simulate_open_loop(config, rep, list(window(strip_prefixes, duration_s)))
    return summarize(recs, config.gpus), stats


def saturation(concurrency: int, isl: int = 2048, osl: int = 512, duration_s: float = 60.0,
               **kw: object) -> tuple[MetricsSummary, list[ReplicaStats]]:
    config, rep = ready(**kw)
    recs, stats = simulate_closed_loop(config, rep, concurrency, duration_s, isl, osl)
    return summarize(recs, config.gpus), stats


# ---------------------------------------------------------------- memory
@pytest.mark.parametrize(("weights", "fits", "fails"), [("fp8", 8, 4), ("nvfp4", 4, 2)])
def test_weights_fit_only_from_a_tp_width(weights: str, fits: int, fails: int) -> None:
    # FP8 (~745 GB) does not fit TP4 (186 GB/GPU > 180 GB) but fits TP8; NVFP4 (~440 GB incl.
    # scales and bf16 attention) fits TP4 (110 GB/GPU) but not TP2 (220 GB/GPU).
    ok = start(ServingConfig(model="glm-5", gpu="B200", tp_size=fits, weights=weights))
    bad = start(ServingConfig(model="glm-5", gpu="B200", tp_size=fails, weights=weights))
    assert ok.ready
    assert (bad.ready, bad.phase) == (False, "load_weights")
    assert "CUDA out of memory" in bad.reason


def test_fp8_kv_roughly_doubles_the_decode_batch_and_raises_throughput() -> None:
    base = dict(model="glm-5", gpu="B200", tp_size=8, weights="fp8")
    bf16, st_b = saturation(1024, **base, kv_cache_dtype="bf16")
    fp8, st_f = saturation(1024, **base, kv_cache_dtype="fp8_e4m3")
    ratio = st_f[0].mean_decode_batch / st_b[0].mean_decode_batch
    # KV-bound at 1,024 clients; DSA's fp8 indexer keys are not halved, so 1.8x not 2x
    assert 1.6 < ratio < 2.1
    assert fp8.output_tok_s_per_gpu > 1.2 * bf16.output_tok_s_per_gpu


# ---------------------------------------------------------------- prefix cache / HiCache
def test_hicache_lowers_replay_wall_time_when_prefixes_repeat() -> None:
    plain, st_p = replay(**PRACTICE)
    hic, st_h = replay(**PRACTICE, enable_hierarchical_cache=True)
    assert st_h[0].cache_hit_rate > st_p[0].cache_hit_rate
    assert st_h[0].host_loaded_tokens > 0
    assert hic.duration_s < plain.duration_s
    assert hic.ttft_ms.p50 < plain.ttft_ms.p50


def test_hicache_changes_nothing_without_shared_prefixes() -> None:
    plain, _ = replay(strip_prefixes=True, **PRACTICE)
    hic, st = replay(strip_prefixes=True, **PRACTICE, enable_hierarchical_cache=True)
    assert st[0].cache_hit_rate == 0.0
    assert hic.duration_s == pytest.approx(plain.duration_s)


def test_radix_cache_off_loses_the_prefix_hits() -> None:
    on, st_on = replay(**PRACTICE)
    off, st_off = replay(**PRACTICE, disable_radix_cache=True)
    assert st_off[0].cache_hit_rate == 0.0 < st_on[0].cache_hit_rate
    assert off.ttft_ms.p50 > on.ttft_ms.p50


def test_admission_cap_plus_hicache_on_the_bursty_replay() -> None:
    # The practice measured TTFT p50 246 s (engine default admission) -> 13.3 s (cap 256 +
    # HiCache 4, the cap dominant). On 5 minutes of the trace at its own rate the twin's faithful
    # scheduler (SGLang 0.5.23: batch_is_full, retraction, new_token_ratio, eager steps, queue
    # scan) predicts the overload (TTFT p50 ~250 s) but not the cure: the KV pool (~0.94 M
    # tokens at ~12 k tokens per request) binds at ~100 running, long before a cap of 256, so
    # the cap alone changes nothing, and HiCache's extra prefix hits (5 % -> 15 % of prompt
    # tokens) shave ~4 % off TTFT p50 and ~6 % off the wall time (docs/validation.md,
    # "Over-admission and the admission retune").
    default, st_d = replay(duration_s=300.0, **PRACTICE)
    capped, _ = replay(duration_s=300.0, **PRACTICE, max_running_requests=256)
    both, st_b = replay(duration_s=300.0, **PRACTICE, max_running_requests=256,
                        enable_hierarchical_cache=True, hicache_ratio=4.0)
    assert default.ttft_ms.p50 > 120_000  # overloaded: minutes of queueing, as measured
    assert max(s.max_running for s in st_d) < 256
    assert capped.ttft_ms.p50 == pytest.approx(default.ttft_ms.p50)
    assert st_b[0].cache_hit_rate > 2 * st_d[0].cache_hit_rate
    assert 1.0 < default.ttft_ms.p50 / both.ttft_ms.p50 < 1.5  # the practice: 18.5x
    assert 0.85 < both.duration_s / default.duration_s < 1.0


def bursts(n: int = 2, size: int = 600, gap_s: float = 200.0, isl: int = 500,
           osl: int = 3000) -> list[tuple[object, ...]]:
    """``n`` bursts of ``size`` requests ``gap_s`` apart: short unique prompts (own prefix
    blocks of 64 tokens, so a retracted prompt can come back from the cache), outputs spread
    over osl/2 .. 3 osl/2."""
    out: list[tuple[object, ...]] = []
    block = 0
    for k in range(n):
        for j in range(size):
            out.append((k * gap_s, isl, osl // 2 + (j * 7919) % osl,
                        tuple(range(block, block + isl // 64)), 64))
            block += isl // 64
    return out


def test_over_admission_retracts_and_runs_eager_yet_a_cap_raises_ttft() -> None:
    # Where the cap binds (short prompts, long outputs, 600 at once): the engine default admits
    # ~650 (the new-token ratio decayed to 0.098 reserves a tenth of the outputs), decodes
    # above the 512 CUDA-graph max (eager) and retracts hundreds of requests that recompute
    # later; a cap of 256 removes both, but prefill-first scheduling with a per-token cost that
    # falls as the batch grows makes the capped server slower and its TTFT p50 a few times
    # longer. The twin's faithful model predicts no cure from a cap (docs/validation.md).
    config, rep = ready(**PRACTICE)
    recs, st = simulate_open_loop(config, rep, bursts())
    default = summarize(recs, config.gpus)
    config_c, rep_c = ready(**PRACTICE, max_running_requests=256)
    recs_c, st_c = simulate_open_loop(config_c, rep_c, bursts())
    capped = summarize(recs_c, config_c.gpus)
    assert st[0].max_running > rep.cuda_graph_max_bs_decode  # eager decode steps
    assert st[0].retractions > 50
    assert st_c[0].max_running == 256 and st_c[0].retractions == 0
    # 2.7x with the 2026-12-02 refit (B200's 100 ms per-prefill-step overhead became the
    # TTFT path's per-request latency: the capped server's many small prefills cost less)
    assert capped.ttft_ms.p50 > 2 * default.ttft_ms.p50
    assert capped.output_tok_s_per_gpu < 0.8 * default.output_tok_s_per_gpu


# ---------------------------------------------------------------- speculative decoding
SPEC = dict(PRACTICE, max_running_requests=256)  # caps matched: EAGLE resets an unset cap to 48


def test_eagle_raises_tok_s_per_user_at_concurrency_4_and_its_gain_shrinks_with_batch() -> None:
    # The practice: fixed EAGLE raised tok/s/user at concurrency 4 and lowered peak tok/s/GPU
    # 436 -> 327 (-25 %). The twin prices verify per draft token (DSA gathers and indexer scan
    # per draft-token row, the MoE tile term, the draft extend, the draft layers' extend over
    # every prompt at prefill), so a verify + draft iteration costs 1.3x a decode step at batch
    # 4 and 1.8x at batch 256; with GLM-5's 3.48 accepted tokens per step that still leaves
    # EAGLE ahead at the peak (measured below: +35 %; before the per-token pricing +56 %). See
    # test_eagle_lowers_peak_throughput_at_matched_caps.
    off4, _ = saturation(4, **SPEC)
    on4, st = saturation(4, **SPEC, speculative_algorithm="EAGLE")
    assert on4.tok_s_per_user > 2.0 * off4.tok_s_per_user  # 147 vs 56 tok/s/user
    assert st[0].mean_accept_length == pytest.approx(3.48, rel=0.01)
    off256, _ = saturation(256, **SPEC)
    on256, _ = saturation(256, **SPEC, speculative_algorithm="EAGLE")
    gain4 = on4.output_tok_s_per_gpu / off4.output_tok_s_per_gpu - 1      # +150 %
    gain256 = on256.output_tok_s_per_gpu / off256.output_tok_s_per_gpu - 1  # +35 %
    assert gain256 < 0.35 * gain4
    config, rep = ready(**SPEC, speculative_algorithm="EAGLE")
    cost = build_cost_model(config, rep)

    def ratio(b: int) -> float:
        ctx = b * 2300
        return (cost.verify_time(b, 4, ctx) + cost.draft_time(b, 3, 1, ctx, 4)) \
            / cost.decode_time(b, ctx)

    assert ratio(4) < 1.4 < 1.7 < ratio(256)  # 1.32 and 1.83 (before: 1.30 and 1.14)
    # the docs' bound: verify costs at most one decode step per draft token (weights read once),
    # so at 3.48 tokens EAGLE keeps >= 3.48 / 4.06 of plain tok/s at batch 256
    ctx = 256 * 2300
    assert cost.verify_time(256, 4, ctx) < 4 * cost.decode_time(256, ctx)
    assert 3.48 * cost.decode_time(256, ctx) / (
        4 * cost.decode_time(256, ctx) + cost.draft_time(256, 3, 1, ctx, 4)) > 0.85


@pytest.mark.xfail(strict=True, reason="the faithful model keeps EAGLE ahead at the peak "
                   "(+35 %): a verify + draft iteration costs 1.83x a decode step at batch 256 "
                   "and yields 3.48 tokens; the practice's -25 % needs >= 4.6x, more than the "
                   "4.06x of a verify paying every decode cost once per draft token, i.e. "
                   "<= 3.0 accepted tokens at the peak even then (docs/twin.md)")
def test_eagle_lowers_peak_throughput_at_matched_caps() -> None:
    off, _ = saturation(256, **SPEC)
    on, _ = saturation(256, **SPEC, speculative_algorithm="EAGLE")
    assert 0.50 < on.output_tok_s_per_gpu / off.output_tok_s_per_gpu < 0.88  # practice 0.75


# ---------------------------------------------------------------- CUDA graphs, routers
def test_decode_batches_beyond_the_cuda_graph_limit_run_slower() -> None:
    base = dict(model="glm-5", gpu="B200", tp_size=8, weights="fp8")
    graphs, _ = saturation(256, **base)
    eager, _ = saturation(256, **base, cuda_graph_max_bs_decode=64)
    assert eager.tpot_ms.p50 > graphs.tpot_ms.p50
    assert eager.output_tok_s_per_gpu < graphs.output_tok_s_per_gpu


def test_cache_aware_router_raises_prefix_hits_over_round_robin() -> None:
    two = dict(PRACTICE, replicas=2, duration_s=300.0)
    rr, st_rr = replay(**two)
    ca, st_ca = replay(**two, router_policy="cache_aware")
    hits = [sum(s.cache_hit_rate for s in st) / 2 for st in (st_rr, st_ca)]
    assert hits[1] > hits[0]
    assert ca.ttft_ms.p50 <= rr.ttft_ms.p50
    p2, st_p2 = replay(**two, router_policy="power_of_two")
    counts = [s.requests for s in st_p2]
    assert abs(counts[0] - counts[1]) < 0.2 * sum(counts)


def test_cache_aware_router_spreads_prompts_without_prefixes_by_load() -> None:
    """Issue 20: without prefix hashes every request used to tie and go to replica 0 (4-7 %
    slower than round robin, TTFT p99 up to 40x). Now the router sends them to the least-loaded
    replica, as sglang-router 0.3.2 does: measured 118.8 vs 118.1 tok/s/GPU, p99 TTFT 28.7 s
    vs 25.4 s, 493/485 requests."""
    two = dict(PRACTICE, replicas=2, duration_s=300.0)
    rr, _ = replay(strip_prefixes=True, **two)
    ca, st = replay(strip_prefixes=True, **two, router_policy="cache_aware")
    assert ca.output_tok_s_per_gpu >= 0.98 * rr.output_tok_s_per_gpu
    assert ca.ttft_ms.p99 < 1.5 * rr.ttft_ms.p99
    counts = [s.requests for s in st]
    assert abs(counts[0] - counts[1]) < 0.05 * sum(counts)


def test_cache_aware_router_beats_the_kubernetes_service_by_balancing_load() -> None:
    """Synthetic saturation, 4 replicas, 128 clients of 1,024 + 1,024 tokens: the router sends
    each request to the least-loaded replica (synthetic prompts share no prefix), the
    Kubernetes Service pins each client's connection to a random pod. The practice measured
    +8.8 % tok/s from the router over the Service; the twin's mean over 6 Service seeds is
    in the test's band (python benchmarks/router_gain.py)."""
    four = dict(PRACTICE, replicas=4)
    config, rep = ready(**four, router_policy="cache_aware")
    kube = config.model_copy(update={"router_policy": "kube_service"})
    # 240 virtual s of load: a request takes ~30 s here, so a 60 s window counts only two
    # cohorts and a pod with more clients than the mean finishes its second one late (the
    # window alone then showed +17..+31 %)
    ca = summarize(simulate_closed_loop(config, rep, 128, 240.0, 1024, 1024)[0], config.gpus)
    gains = [ca.output_tok_s_per_gpu / summarize(simulate_closed_loop(
        kube, rep, 128, 240.0, 1024, 1024, router_seed=seed)[0], kube.gpus).output_tok_s_per_gpu
        - 1 for seed in range(6)]
    assert 0.03 <= sum(gains) / len(gains) <= 0.15
    assert min(gains) >= 0.0  # balancing never loses on identical replicas


@pytest.mark.anyio
async def test_a_twin_run_reports_its_retractions_in_the_summary(tmp_path):
    """Llama 3.1 8B on one H100 with 1,024 clients of 1,000 + 4,000 tokens: decode outgrows the
    KV pool, the scheduler retracts, and the bench result's summary carries the count (the
    replicas' counters summed), which the ledger row and the report show."""
    from mcp_servers.bench.ops import BenchService
    from mcp_servers.cluster.twin import TwinBackend

    backend = TwinBackend()
    config = ServingConfig(model="llama-3.1-8b", gpu="H100", tp_size=1, replicas=1,
                           weights="bf16", max_running_requests=1024)
    assert backend.deploy("r", config, {}).phase == "Ready"
    svc = BenchService(backend, tmp_path / "rec", [])
    res = await svc.saturation("r", 1000, 4000, 1024, 5)
    assert res.summary.retractions == sum(r.retractions for r in res.replicas) > 0
    calm = await svc.saturation("r", 1000, 100, 8, 5)
    assert calm.summary.retractions == 0  # a counter that reads 0, not an unknown
