"""Schedulers inside one server (domain/twin/dp.py): the DP controller, per-rank caps, lockstep.

Tiny scenarios on :class:`StepCost` (prefill 0.1 s per new token, decode 1 s per step), each
event time computed by hand in the comment above its assertion.
"""

from __future__ import annotations

import pytest
from fixtures.step_cost import StepCost

from domain.config import ServingConfig
from domain.fit import fit
from domain.twin.cluster import _closed_loop_windows, scheduler_limits, simulate_closed_loop
from domain.twin.dp import DPController, DPServer, resolve_method
from domain.twin.engine import EngineLimits, EngineLoad, TwinEngine


def lim(**kw) -> EngineLimits:
    base = dict(kv_tokens=10_000, max_running_requests=64, chunked_prefill_size=8192,
                context_len=100_000, radix_cache=False)
    base.update(kw)
    return EngineLimits(**base)


def server(n: int = 2, method: str = "round_robin", lockstep: bool = True, tokenize=None,
           **kw) -> DPServer:
    limits = lim(**kw)
    ranks = [TwinEngine(StepCost(), limits, None, tokenize=False) for _ in range(n)]
    return DPServer(ranks, DPController(method, n), lockstep, tokenize,
                    fits=lambda i, o: i + o <= limits.context_len)


def load(running: int, queued: int = 0, used: float = 0.0, queued_tokens: int = 0) -> EngineLoad:
    return EngineLoad(running=running, queued=queued, used_kv_tokens=used, kv_tokens=1000,
                      queued_tokens=queued_tokens)


# ---------------------------------------------------------------- the DP controller
@pytest.mark.parametrize(("method", "mode", "resolved"), [
    (None, "null", "round_robin"), ("auto", "decode", "round_robin"),
    ("auto", "prefill", "follow_bootstrap_room"), ("total_tokens", "null", "total_tokens"),
], ids=["auto", "auto-pd-decode", "auto-pd-prefill", "explicit"])
def test_auto_resolves_as_sglang_does(method, mode, resolved):
    assert resolve_method(method, mode) == resolved


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="Invalid load balance method: SHORTEST_QUEUE"):
        resolve_method("shortest_queue")


def test_round_robin_cycles_over_the_ranks():
    ctl = DPController("round_robin", 3)
    assert [ctl.pick(0.0, 10) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_total_requests_counts_its_own_dispatches_between_refreshes():
    ctl = DPController("total_requests", 3)
    real = [load(2), load(0), load(1, queued=0)]
    reads = []

    def loads():
        reads.append(1)
        return real

    # refresh at 0: counts [2, 0, 1] -> rank 1 ([2, 1, 1]); within 20 ms no re-read: rank 1
    # (first of equals, [2, 2, 1]), rank 2 ([2, 2, 2]), rank 0 ([3, 2, 2])
    picks = [ctl.pick(t, 10, loads) for t in (0.0, 0.005, 0.01, 0.015)]
    assert picks == [1, 1, 2, 0]
    assert len(reads) == 1
    # at 30 ms the counts are re-read from the ranks: [2, 0, 1] again -> rank 1
    assert ctl.pick(0.03, 10, loads) == 1
    assert len(reads) == 2


def test_total_tokens_picks_fewest_tokens_then_fewest_requests():
    ctl = DPController("total_tokens", 3)
    real = [load(1, used=500), load(3, used=100, queued=1, queued_tokens=100),
            load(1, used=200)]
    # tokens [500, 200, 200]: a tie between ranks 1 and 2, rank 2 has fewer requests (1 < 4)
    assert ctl.pick(0.0, 300, lambda: real) == 2
    # rank 2 now holds 500 tokens: rank 1 (200) next
    assert ctl.pick(0.001, 300, lambda: real) == 1


# ---------------------------------------------------------------- per-rank limits
def test_attention_dp_splits_the_request_cap_over_the_ranks():
    # the example: max_running_requests 48 at attention DP 8 is 6 per rank
    # (pool_configurator.py:956); a dp_size copy keeps the whole cap
    kw = dict(model="deepseek-v3", gpu="H200", tp_size=8, weights="fp8",
              max_running_requests=48)
    adp = ServingConfig(**kw, attn_dp_size=8, ep_size=8, moe_a2a_backend="deepep")
    assert scheduler_limits(adp, fit(adp)).max_running_requests == 6
    tp = ServingConfig(**kw)
    assert scheduler_limits(tp, fit(tp)).max_running_requests == 48


def test_each_rank_enforces_its_own_cap():
    srv = server(2, max_running_requests=1)
    for _ in range(4):
        srv.submit(0.0, 10, 2)
    srv.advance(float("inf"))
    recs = srv.records()
    # round robin: requests 0, 2 on rank 0 and 1, 3 on rank 1, one at a time per rank.
    # Step 1 (both ranks prefill 10 tokens): 0..1 s, first tokens of 0 and 1 at 1; step 2
    # decode: both finish at 2; step 3 prefill 2 and 3: 2..3; decode: finish at 4
    assert [r.first_token_s for r in recs] == pytest.approx([1.0, 1.0, 3.0, 3.0])
    assert [r.finish_s for r in recs] == pytest.approx([2.0, 2.0, 4.0, 4.0])
    assert [st.max_running for _, st in srv.rank_stats()] == [1, 1]
    assert srv.sent == [2, 2]


# ---------------------------------------------------------------- lockstep
def test_attention_dp_ranks_prefill_together_at_the_gathered_tokens():
    srv = server(2, lockstep=True)
    srv.submit(0.0, 10, 3)   # rank 0: 10 prompt tokens
    srv.submit(0.0, 20, 2)   # rank 1: 20
    srv.advance(float("inf"))
    a, b = srv.records()
    # step 1, one extend forward of 30 gathered tokens = a rank's prefill of 15: 1.5 s, both
    # first tokens at 1.5; step 2 decode (1 s) -> 2.5 (b done); step 3 rank 0 alone -> 3.5
    assert (a.first_token_s, a.finish_s) == pytest.approx((1.5, 3.5))
    assert (b.first_token_s, b.finish_s) == pytest.approx((1.5, 2.5))


def test_attention_dp_decode_is_priced_at_the_largest_rank_batch():
    class Batch(StepCost):
        def decode_time(self, batch, context_sum):
            return 0.5 * batch  # 0.5 s per sequence of the (padded) batch

    limits = lim()
    ranks = [TwinEngine(Batch(), limits, None, tokenize=False) for _ in range(2)]
    srv = DPServer(ranks, DPController("round_robin", 2), True, None, fits=lambda i, o: True)
    for _ in range(3):
        srv.submit(0.0, 10, 2)  # ranks 0, 1, 0
    srv.advance(float("inf"))
    recs = srv.records()
    # extend of 30 gathered tokens = 15 per rank: 1.5 s; then one decode step with batches
    # 2 and 1, both ranks padded to 2: 1 s (not 0.5 s for rank 1) -> everyone ends at 2.5
    assert [r.finish_s for r in recs] == pytest.approx([2.5, 2.5, 2.5])


def test_dp_size_copies_step_independently():
    srv = server(2, lockstep=False)
    srv.submit(0.0, 10, 3)
    srv.submit(0.0, 20, 2)
    srv.advance(float("inf"))
    a, b = srv.records()
    # rank 0: prefill 0..1, decode 1..3; rank 1: prefill 0..2, decode 2..3
    assert (a.first_token_s, a.finish_s) == pytest.approx((1.0, 3.0))
    assert (b.first_token_s, b.finish_s) == pytest.approx((2.0, 3.0))


def test_a_rank_prefill_stalls_the_other_rank():
    srv = server(2, lockstep=True)
    srv.submit(0.0, 100, 2)  # rank 0: a 10 s prefill
    srv.submit(1.0, 10, 2)   # rank 1, arrives at 1 while rank 0's step runs
    srv.advance(float("inf"))
    a, b = srv.records()
    # step 1: 100 gathered tokens, 50 per rank: 5 s. The request reaches its rank at that
    # step's end (5); step 2: its 10 tokens + rank 0's decode row (11 gathered, 6 per rank,
    # 0.6 s) against rank 0's 1 s decode: 1 s -> first token 6 (TTFT 5 s), a done; then
    # one decode step -> 7
    assert a.finish_s == pytest.approx(6.0)
    assert b.arrival_s == 1.0
    assert (b.ttft_s, b.finish_s) == pytest.approx((5.0, 7.0))


def test_the_server_tokenizer_is_shared_by_its_ranks():
    srv = server(2, lockstep=False, tokenize=lambda n: 0.01 * n)
    srv.submit(0.0, 10, 1)
    srv.submit(0.0, 10, 1)
    srv.advance(float("inf"))
    a, b = srv.records()
    # one tokenizer: ready at 0.1 and 0.2 (FIFO), each then prefills 10 tokens (1 s) on its
    # own rank; the records keep the server arrival 0
    assert (a.arrival_s, b.arrival_s) == (0.0, 0.0)
    assert (a.first_token_s, b.first_token_s) == pytest.approx((1.1, 1.2))


@pytest.mark.parametrize("lockstep", [True, False], ids=["attn-dp", "dp-copies"])
def test_closed_loop_client_requests_go_round_robin_over_the_ranks(lockstep):
    srv = server(2, lockstep=lockstep)
    # one client, 10-token prompts, 1 output token (prefill only), for 4 s: alone on 2
    # attention-DP ranks a prefill of 10 gathered tokens is 5 per rank, 0.5 s; a dp copy
    # prefills its 10 tokens in 1 s
    sent = srv.run_closed_loop(1, 4.0, 10, 1)
    recs = srv.records()
    step = 0.5 if lockstep else 1.0
    # the request ending at 4.0 sends none; each is sent at the previous one's end
    n = round(4.0 / step)
    assert sent == n
    assert [r.finish_s for r in recs] == pytest.approx([step * (k + 1) for k in range(n)])
    assert [r.arrival_s for r in recs] == pytest.approx([step * k for k in range(n)])
    assert srv.sent == [n // 2, n // 2]


def test_windowed_closed_loop_over_servers():
    srv = server(2, lockstep=False)
    # the routed loop's windows (1 s, one decode step): the requests ending at 1, 2, 3 are
    # taken at the window's end, each then prefills 1 s on the next rank
    sent = _closed_loop_windows([srv], lambda loads: 0, StepCost(), 1, 4.0, 10, 1, 0, 1)
    assert sent == [4]
    assert [r.finish_s for r in srv.records()] == pytest.approx([1.0, 2.0, 3.0, 4.0])


def test_replica_stats_per_rank_of_a_real_attention_dp_server():
    cfg = ServingConfig(model="deepseek-v3", gpu="H200", tp_size=8, weights="fp8",
                        attn_dp_size=8, ep_size=8, moe_a2a_backend="deepep")
    recs, stats = simulate_closed_loop(cfg, fit(cfg), 16, 0.5, 256, 8)
    assert [(s.replica, s.rank) for s in stats] == [(0, k) for k in range(8)]
    # 16 clients round robin over 8 ranks: 2 each in the first wave
    assert all(s.max_running == 2 for s in stats)
    assert sum(s.requests for s in stats) == len(recs)


def test_a_request_dropped_before_its_rank_ends_at_the_server():
    srv = server(2, lockstep=True, tokenize=lambda n: 0.1 * n)
    a = srv.submit(0.0, 10, 2)   # tokenized until 1.0
    b = srv.submit(0.0, 10, 2)   # in the tokenizer queue until 2.0
    srv.advance(0.5)
    assert srv.abort(b)
    assert not srv.abort(b)
    assert srv.finished_by(0.5) == 1  # the router's in-flight count drops at once
    srv.advance(float("inf"))
    recs = srv.records()
    # a: reaches rank 0 at 1.0; alone, its 10 tokens are 5 per rank: 0.5 s -> first token
    # 1.5, decode 1 s -> 2.5
    assert (recs[a].first_token_s, recs[a].finish_s) == pytest.approx((1.5, 2.5))
    assert recs[b].error == "aborted by the client"
    assert srv.sent == [1, 0]


def test_the_report_names_schedulers_inside_a_replica():
    from domain.twin.cluster import ReplicaStats
    from servetune.report.seen import seen_line

    def row(replica, rank):
        return ReplicaStats(replica=replica, rank=rank, requests=3, prefill_steps=1,
                            decode_steps=2, retractions=0, max_running=1,
                            mean_decode_batch=1.0, busy_s=1.0)

    assert seen_line([row(0, k) for k in range(8)]).startswith(
        "1 replica x 8 schedulers (per scheduler): requests 3..3;")
    assert seen_line([row(0, 0), row(1, 0)]).startswith("2 replicas: requests 3 / 3;")
