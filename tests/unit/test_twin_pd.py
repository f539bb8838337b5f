"""Prefill/decode disaggregation in the twin (domain/twin/pd.py) on hand-computable scenarios.

Every scenario uses :class:`StepCost` on both servers (prefill 0.1 s per new token, decode 1 s
per step, no tokenizer or pipeline delay) and a link that moves one prompt token in 0.2 s
(100 bytes per token and GPU over a 1,000 B/s NIC at eta 0.5) plus 0.25 s per request, so each
event time can be checked in the comment above its assertion.
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.benchmarks import load_benchmark
from fixtures.step_cost import StepCost

from domain.config import ServingConfig
from domain.metrics import ttft_transfer_share
from domain.models import get_model
from domain.twin.cluster import Router, simulate_open_loop
from domain.twin.engine import EngineLimits, TwinEngine
from domain.twin.pd import (
    MOONCAKE_TCP_SLOWDOWN,
    PDSimulation,
    TransferLink,
    decode_extra_slots,
    fit_servers,
    transfer_link,
)
from domain.twin.prefix_cache import PathIndex, PrefixCache

LINK = TransferLink(sender_bytes_per_token=100, receiver_bytes_per_token=100, gpus=4,
                    nic_bytes_per_s=1000, eta=0.5, latency_s=0.25)


def lim(**kw) -> EngineLimits:
    base = dict(kv_tokens=10_000, max_running_requests=64, chunked_prefill_size=8192,
                context_len=100_000)
    base.update(kw)
    return EngineLimits(**base)


def pd_sim(prefill_kv: int = 10_000, decode_kv: int = 10_000, reserved: int = 5,
           link: TransferLink = LINK) -> PDSimulation:
    pl = lim(kv_tokens=prefill_kv)
    p = TwinEngine(StepCost(), pl, PrefixCache(PathIndex()))
    p.set_role("prefill")
    d = TwinEngine(StepCost(), lim(kv_tokens=decode_kv, radix_cache=False), None)
    d.set_role("decode", extra_slots=0, reserved_decode_tokens=reserved)
    return PDSimulation([p], [d], link, Router("round_robin", 1), Router("round_robin", 1))


# ---------------------------------------------------------------- the transfer
def test_transfer_seconds_of_a_prompt():
    # 10 tokens x 100 B per GPU over 1,000 B/s x 0.5 = 2 s on the wire, + 0.25 s
    assert LINK.wire_seconds(10) == pytest.approx(2.0)
    assert LINK.seconds(10) == pytest.approx(2.25)
    assert LINK.bytes(10) == pytest.approx(10 * 100 * 4)  # all four GPUs' shares
    tcp = TransferLink(100, 100, 4, 1000, 0.5, 0.25, slowdown=MOONCAKE_TCP_SLOWDOWN)
    assert tcp.wire_seconds(10) == pytest.approx(2.0 * 4.6)
    fake = TransferLink(100, 100, 4, 1000, 0.5, 0.25, moves_kv=False)
    assert fake.seconds(10) == 0.0 and fake.bytes(10) == 0.0
    # the receiving side bounds the rate when its GPUs each hold more of the request
    assert TransferLink(100, 200, 4, 1000, 0.5, 0.0).wire_seconds(10) == pytest.approx(4.0)


def test_transfer_link_of_a_real_layout_moves_the_prompts_whole_kv():
    cfg = ServingConfig(model="llama-3.1-8b", gpu="H200", tp_size=4, weights="bf16", pd="1P1D")
    (_, _, pw, pr), (_, _, dw, dr) = fit_servers(cfg)
    link = transfer_link(cfg, pw, pr, dw, dr)
    whole = get_model("llama-3.1-8b").kv_bytes_per_token(2, 1)  # bf16 KV, all layers, TP 1
    assert link.bytes(1000) == pytest.approx(1000 * whole)
    # each of the 4 GPUs sends its quarter over its own 50 GB/s NIC at the prior 0.475
    assert link.seconds(1000) == pytest.approx(1000 * whole / 4 / (50e9 * 0.475) + 1e-3)
    tcp = cfg.model_copy(update={"disaggregation_transfer_backend": "mooncake_tcp"})
    assert transfer_link(tcp, pw, pr, dw, dr).wire_seconds(1000) == pytest.approx(
        4.6 * link.wire_seconds(1000))


# ---------------------------------------------------------------- TTFT
def test_ttft_is_prefill_plus_transfer_plus_the_decode_servers_next_iteration():
    sim = pd_sim()
    sim.add(0.0, 10, 5)
    sim.add(0.0, 12, 3)
    sim.run()
    a, b = sim.records()
    # one prefill batch of 22 tokens: 0 -> 2.2 s. A's KV: 2.2 + 2.0 wire + 0.25 = 4.45; it
    # joins the idle decode server then (first token 4.45) and decodes 5.45, 6.45, 7.45, 8.45.
    assert a.first_token_s == pytest.approx(4.45) and a.transfer_s == pytest.approx(2.25)
    assert a.finish_s == pytest.approx(8.45)
    assert a.itl_s == pytest.approx([1.0, 1.0, 1.0, 1.0])
    # B waits for the link (busy with A until 4.2): 4.2 + 2.4 + 0.25 = 6.85, mid decode step
    # (6.45 -> 7.45): it joins at the boundary 7.45, then 8.45, 9.45.
    # TTFT 7.45 = prefill 2.2 + transfer 4.65 (2.0 s of it queued on the link) + 0.6 wait
    assert b.transfer_s == pytest.approx(4.65)
    assert b.ttft_s == pytest.approx(2.2 + 4.65 + 0.6)
    assert b.finish_s == pytest.approx(9.45)
    assert ttft_transfer_share([a, b]) == pytest.approx((2.25 + 4.65) / (4.45 + 7.45))
    pa, pb = sim.ttft_parts([a, b])
    assert (pa.prealloc_wait_s, pa.prefill_s, pa.transfer_s, pa.decode_wait_s) == \
        pytest.approx((0.0, 2.2, 2.25, 0.0))
    assert (pb.prealloc_wait_s, pb.prefill_s, pb.transfer_s, pb.decode_wait_s) == \
        pytest.approx((0.0, 2.2, 4.65, 0.6))
    prefill, decode = sim.stats()
    assert (prefill.role, prefill.prefill_steps, prefill.decode_steps) == ("prefill", 1, 0)
    assert (decode.role, decode.prefill_steps) == ("decode", 0)


def test_decode_admission_waits_on_the_prealloc_queue():
    # decode pool 28 tokens, 5 reserved per active request: A (10 in, 3 out) preallocates at 0
    # (needs max(10 + 5, 10 + 3) = 15 of 28); B then has 28 - 10 - 5 x 1 = 13 < 15: it waits in
    # the prealloc queue, and so does its prefill (the bootstrap waits for the handshake).
    sim = pd_sim(decode_kv=28)
    sim.add(0.0, 10, 3)
    sim.add(0.0, 10, 3)
    sim.run()
    a, b = sim.records()
    # A: prefill 0 -> 1, KV on decode 1 + 2 + 0.25 = 3.25 (first token), decode 4.25, 5.25
    assert a.first_token_s == pytest.approx(3.25) and a.finish_s == pytest.approx(5.25)
    # while A runs, its KV grows and nothing fits; when A finishes (5.25) B preallocates,
    # prefills 5.25 -> 6.25, KV 6.25 + 2.25 = 8.5 (first token), decode 9.5, 10.5
    assert b.first_token_s == pytest.approx(8.5) and b.finish_s == pytest.approx(10.5)
    assert b.transfer_s == pytest.approx(2.25)
    # B's TTFT 8.5 = 5.25 in the prealloc queue + 1 prefill + 2.25 transfer + 0 decode wait
    parts = sim.ttft_parts([a, b])[1]
    assert parts is not None
    assert (parts.prealloc_wait_s, parts.prefill_s, parts.transfer_s, parts.decode_wait_s) == \
        pytest.approx((5.25, 1.0, 2.25, 0.0))


def test_the_prefill_server_holds_the_kv_until_its_transfer_ends():
    # prefill pool 15 tokens: A's 10 stay held after its prefill (0 -> 1) until its KV reached
    # the decode server at 3.25; B (10 tokens) cannot be admitted before: prefill 3.25 -> 4.25,
    # transfer 4.25 -> 6.5 (first token), decode 7.5
    sim = pd_sim(prefill_kv=15)
    sim.add(0.0, 10, 2)
    sim.add(0.0, 10, 2)
    sim.run()
    a, b = sim.records()
    assert a.first_token_s == pytest.approx(3.25)
    assert b.first_token_s == pytest.approx(6.5) and b.finish_s == pytest.approx(7.5)


def test_fake_backend_charges_no_transfer():
    sim = pd_sim(link=TransferLink(100, 100, 4, 1000, 0.5, 0.25, moves_kv=False))
    sim.add(0.0, 10, 2)
    sim.run()
    (a,) = sim.records()
    # prefill 0 -> 1 = first token, decode 2
    assert (a.first_token_s, a.finish_s, a.transfer_s) == pytest.approx((1.0, 2.0, 0.0))


def test_decode_extra_slots_default():
    # pd_disaggregation_hook.py:127-143: 2x the per-rank batch when set and <= 32, else 0
    base = ServingConfig(model="llama-3.1-8b", gpu="H200", tp_size=4, weights="bf16")
    assert decode_extra_slots(base) == 0
    assert decode_extra_slots(base.model_copy(update={"max_running_requests": 16})) == 32
    assert decode_extra_slots(base.model_copy(update={"max_running_requests": 64})) == 0


def test_cluster_dispatches_a_pd_config():
    cfg = ServingConfig(model="llama-3.1-8b", gpu="H200", tp_size=4, weights="bf16", pd="1P1D")
    reqs = [(0.5 * i, 2000, 50) for i in range(6)]
    recs, stats = simulate_open_loop(cfg, fit_servers(cfg)[1][3], reqs)
    assert all(r.error is None for r in recs) and len(recs) == 6
    assert all(r.transfer_s > 0 and r.ttft_s > r.transfer_s for r in recs)
    assert [s.role for s in stats] == ["prefill", "decode"]
    assert [s.requests for s in stats] == [6, 6]


# ---------------------------------------------------------------- issue 21 "done when"
def test_pd_split_keeps_the_decode_itl_flat_where_the_aggregated_pair_stalls():
    # benchmarks/pd_split.py on a small window: the first 120 s of the Mooncake conversation
    # trace at 2x (339 requests), Llama-3.1-8B FP8 TP4 on 8 H200: 2 aggregated vs 1P1D
    bench = load_benchmark("pd_split")
    reqs = bench.workload(0.0, 120.0, 2.0)
    agg, split = bench.configs()
    a, p = bench.run(agg, reqs), bench.run(split, reqs)
    assert a["errors"] == p["errors"] == 0
    assert p["itl_p99"] / p["itl_p50"] <= 1.5
    assert a["itl_p99"] / a["itl_p50"] >= 2.0
    # the split's TTFT holds its transfers; the aggregated pair's none
    assert 0 < p["share"] < 1 and a["share"] == 0
    assert p["transfer_p50"] > 0


def test_closed_loop_client_sends_its_next_request_after_the_last_token():
    sim = pd_sim()
    sim.closed_loop(1, 6.0, 10, 2)
    sim.run()
    first, second = sim.records()
    # prefill 0 -> 1, KV on decode 3.25 (first token), one decode step -> 4.25; the client
    # sends again at 4.25 (< 6 s): prefill 4.25 -> 5.25, KV 7.5, last token 8.5; it stops
    assert (first.first_token_s, first.finish_s) == pytest.approx((3.25, 4.25))
    assert (second.arrival_s, second.first_token_s, second.finish_s) == pytest.approx(
        (4.25, 7.5, 8.5))


def test_round_robin_over_two_prefill_and_two_decode_servers():
    prefill, decode = [], []
    for _ in range(2):
        p = TwinEngine(StepCost(), lim(), PrefixCache(PathIndex()))
        p.set_role("prefill")
        d = TwinEngine(StepCost(), lim(radix_cache=False), None)
        d.set_role("decode", reserved_decode_tokens=5)
        prefill.append(p)
        decode.append(d)
    sim = PDSimulation(prefill, decode, LINK, Router("round_robin", 2), Router("round_robin", 2))
    for _ in range(4):
        sim.add(0.0, 10, 2)
    sim.run()
    recs = sim.records()
    # requests 0, 2 -> prefill 0 and decode 0; 1, 3 -> prefill 1 and decode 1. Each prefill
    # server prefills its two in one 2 s batch; its link sends them 2 -> 4 and 4 -> 6 (+0.25)
    assert [r.first_token_s for r in recs] == pytest.approx([4.25, 4.25, 6.25, 6.25])
    assert [r.finish_s for r in recs] == pytest.approx([5.25, 5.25, 7.25, 7.25])
    assert [(s.role, s.replica, s.requests) for s in sim.stats()] == [
        ("prefill", 0, 2), ("prefill", 1, 2), ("decode", 0, 2), ("decode", 1, 2)]


@pytest.mark.parametrize("seed", [3, 22, 40, 41])
def test_every_request_completes_under_tight_pools(seed):
    # random layouts (1-2 prefill and decode servers, each router policy) on small pools and
    # caps: prefill servers bound by held KV, decode prealloc waits, decode retractions while
    # transfers are in flight (seeds 3 and 22 once left requests stranded). Every request ends
    # with all its tokens, its transfer inside its TTFT.
    rng = np.random.default_rng(seed)
    n_p, n_d = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    index = PathIndex()
    prefill, decode = [], []
    for _ in range(n_p):
        e = TwinEngine(StepCost(), lim(kv_tokens=int(rng.integers(250, 800)),
                                       chunked_prefill_size=int(rng.integers(30, 300)),
                                       max_running_requests=int(rng.integers(2, 8))),
                       PrefixCache(index))
        e.set_role("prefill")
        prefill.append(e)
    for _ in range(n_d):
        e = TwinEngine(StepCost(), lim(kv_tokens=int(rng.integers(300, 900)), radix_cache=False,
                                       max_running_requests=int(rng.integers(2, 10))), None)
        e.set_role("decode", extra_slots=int(rng.integers(0, 4)),
                   reserved_decode_tokens=int(rng.integers(0, 20)))
        decode.append(e)
    policy = ("round_robin", "power_of_two", "cache_aware")[seed % 3]
    sim = PDSimulation(prefill, decode, LINK, Router(policy, n_p), Router(policy, n_d))
    t = 0.0
    for _ in range(150):
        t += float(rng.exponential(0.3))
        n = int(rng.integers(1, 200))
        path = index.path([int(rng.integers(0, 3))] * (n // 16))  # shared leading blocks
        sim.add(t, n, int(rng.integers(1, 60)), path, 16 if path else 0)
    sim.run()
    recs = sim.records()
    assert all(r.error is None for r in recs)
    assert all(len(r.itl_s) == r.output_tokens - 1 for r in recs)
    assert all(r.ttft_s >= r.transfer_s >= 0.25 for r in recs)


def test_a_pd_runs_counters_average_over_the_servers_doing_that_work():
    from agents.analyst import replica_mean

    sim = pd_sim()
    for _ in range(2):
        sim.add(0.0, 10, 3)
    sim.run()
    stats = sim.stats()
    prefill, decode = stats
    # the decode server's decode steps alone (the prefill server has none), and the prefill
    # server's cache alone (the decode server has none)
    assert replica_mean(stats, "decode_allreduce_share") == decode.decode_allreduce_share == 0.4
    assert replica_mean(stats, "cache_hit_rate") == prefill.cache_hit_rate
