"""Twin engine mechanics on tiny scenarios whose results are computed by hand.

Every scenario uses :class:`StepCost`: prefill 0.1 s per new token, HiCache load-back 0.01 s per
token, decode 1 s per step, verify 1.5 s, draft 0.5 s. Round numbers make each event
time checkable in the comment above its assertion.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from fixtures.step_cost import StepCost

from domain.twin.cluster import Router
from domain.twin.engine import EngineLimits, TwinEngine
from domain.twin.prefix_cache import PathIndex, PrefixCache


def lim(**kw) -> EngineLimits:
    base = dict(kv_tokens=10_000, max_running_requests=64, chunked_prefill_size=8192,
                context_len=100_000)
    base.update(kw)
    return EngineLimits(**base)


def engine(**kw) -> tuple[TwinEngine, PathIndex]:
    limits = lim(**kw)
    index = PathIndex()
    cache = PrefixCache(index, limits.host_kv_tokens) if limits.radix_cache else None
    return TwinEngine(StepCost(), limits, cache), index


# ---------------------------------------------------------------- scheduler
def test_admission_cap_queues_fcfs():
    eng, _ = engine(max_running_requests=1)
    recs = eng.run([(0.0, 10, 3), (0.0, 10, 3)])
    # A: prefill 10 tok = 1 s (first token at 1), decode 2 steps -> 3. B waits for the slot:
    # prefill 3..4 (first token 4), decode -> 6.
    assert [r.first_token_s for r in recs] == pytest.approx([1.0, 4.0])
    assert [r.finish_s for r in recs] == pytest.approx([3.0, 6.0])
    assert eng.stats.max_running == 1


def test_chunked_prefill_budget_splits_a_long_prompt():
    eng, _ = engine(chunked_prefill_size=4)
    recs = eng.run([(0.0, 10, 2)])
    # chunks 4, 4, 2 tokens = 0.4 + 0.4 + 0.2 s -> first token at 1.0; one decode step -> 2.0
    assert recs[0].first_token_s == pytest.approx(1.0)
    assert recs[0].finish_s == pytest.approx(2.0)
    assert eng.stats.prefill_steps == 3


def test_decode_batches_running_requests_together():
    eng, _ = engine()
    recs = eng.run([(0.0, 10, 3), (0.0, 10, 3)])
    # one prefill batch of 20 tokens (2 s), then 2 decode steps shared by both -> 4 s
    assert [r.finish_s for r in recs] == pytest.approx([4.0, 4.0])
    assert eng.stats.mean_decode_batch == 2
    assert recs[0].itl_s == pytest.approx([1.0, 1.0])
    # 0.4 s of each 1 s decode step is all-reduce (fixtures/step_cost.py)
    assert eng.stats.decode_allreduce_share == pytest.approx(0.4)


def test_retraction_when_the_pool_runs_out():
    # pool 30 tokens: two requests of 10 in + 10 out need 40 at the end. A low
    # conservativeness (reservation 0.07 x 9 tokens each) admits both; when decode runs out of
    # KV, one is retracted and recomputed after the other one.
    eng, _ = engine(kv_tokens=30, radix_cache=False, schedule_conservativeness=0.1)
    recs = eng.run([(0.0, 10, 10), (0.0, 10, 10)])
    assert eng.stats.retractions >= 1
    assert all(r.error is None for r in recs)
    assert [r.output_tokens for r in recs] == [10, 10]
    assert all(len(r.itl_s) == 9 for r in recs)


def test_new_token_ratio_reservation_limits_admission():
    # pool 120; after its prefill (t = 4) A (40 in, 100 out) holds 40 tokens and reserves
    # 0.7 x 99 = 69.3, leaving 10.7 < 17 for B (10 in + 0.7 x 10). The free room only shrinks
    # as A decodes faster than the ratio decays, so B waits for A (done at 4 + 99 = 103).
    eng, _ = engine(kv_tokens=120)
    recs = eng.run([(0.0, 40, 100), (0.5, 10, 10)])
    assert recs[0].finish_s == pytest.approx(103.0)
    assert recs[1].first_token_s == pytest.approx(104.0)
    # conservativeness 0.1: reservation 0.07 x 99 = 6.9, B (10.7) joins right after A's
    # prefill: its own prefill 4 -> 5.
    eng2, _ = engine(kv_tokens=120, schedule_conservativeness=0.1)
    recs2 = eng2.run([(0.0, 40, 100), (0.5, 10, 10)])
    assert recs2[1].first_token_s == pytest.approx(5.0)


# ---------------------------------------------------------------- prefix cache
def test_prefix_hit_skips_cached_blocks():
    eng, idx = engine()
    p1 = idx.path([1, 2, 3])        # blocks of 4 tokens; 10-token prompt -> 2 full blocks
    p2 = idx.path([1, 2, 9])
    eng.submit(0.0, 10, 1, p1, 4)
    eng.submit(5.0, 10, 1, p2, 4)
    eng.advance(float("inf"))
    recs = eng.records()
    # first: 10 new tokens = 1 s; second at 5 s: 2 blocks (8 tokens) cached -> 2 new = 0.2 s
    assert recs[0].ttft_s == pytest.approx(1.0)
    assert recs[1].ttft_s == pytest.approx(0.2)
    assert eng.stats.cached_tokens == 8 and eng.stats.prompt_tokens == 20


def test_last_prompt_token_is_always_recomputed():
    eng, idx = engine()
    p = idx.path([1, 2])
    eng.submit(0.0, 8, 1, p, 4)
    eng.submit(5.0, 8, 1, p, 4)
    eng.advance(float("inf"))
    # 8 = 2 full blocks, but at most (8 - 1) // 4 = 1 block is reused: 4 new tokens = 0.4 s
    assert eng.records()[1].ttft_s == pytest.approx(0.4)


def test_lru_eviction_keeps_the_recent_prefix():
    c = PrefixCache(PathIndex())
    a, b = c.index.path([1, 2]), c.index.path([7, 8])
    c.insert(a, 0, 4, now=1.0)
    c.lock(a, 1.0)
    c.unlock(a, 1.0)
    c.insert(b, 0, 4, now=2.0)
    c.lock(b, 2.0)
    c.unlock(b, 2.0)
    assert (c.device_tokens, c.evictable_tokens) == (16, 16)
    assert c.evict(4) == 4            # the deepest block of the older path goes first
    assert c.match(a) == (1, 0) and c.match(b) == (2, 0)
    c.lock(b, 3.0)                    # a locked path is never evicted
    assert c.evict(100) == 4
    assert c.match(a) == (0, 0) and c.match(b) == (2, 0)


def test_hicache_keeps_evicted_blocks_on_the_host_and_loads_them_back():
    c = PrefixCache(PathIndex(), host_capacity_tokens=16)
    a = c.index.path([1, 2])
    c.insert(a, 0, 4, now=1.0)
    c.lock(a, 1.0)
    c.unlock(a, 1.0)
    assert c.host_tokens == 8
    assert c.evict(8) == 8
    assert c.match(a) == (0, 2)       # gone from the device, still on the host
    assert c.load_back(a, 0, 2, now=2.0) == 8
    assert c.match(a) == (2, 0)


def test_hicache_load_back_cost_replaces_recompute():
    # device pool 12 tokens: after A (8 in) and B (8 in, other prefix) A's blocks are evicted.
    kw = dict(kv_tokens=12, radix_cache=True)
    plain, idx = engine(**kw)
    hic, idx2 = engine(host_kv_tokens=24, **kw)
    for eng, ix in ((plain, idx), (hic, idx2)):
        pa, pb = ix.path([1, 2, 3]), ix.path([5, 6, 7])
        eng.submit(0.0, 9, 1, pa, 4)
        eng.submit(10.0, 9, 1, pb, 4)
        eng.submit(20.0, 9, 1, pa, 4)
        eng.advance(float("inf"))
    # plain: A's blocks were evicted for B -> 9 new tokens = 0.9 s.
    # HiCache: 2 blocks (8 tokens) come back at 0.01 s/token + 1 new token: 0.08 + 0.1 s.
    assert plain.records()[2].ttft_s == pytest.approx(0.9)
    assert hic.records()[2].ttft_s == pytest.approx(0.18)
    assert hic.stats.host_loaded_tokens == 8


def test_lpm_admits_the_longest_cached_prefix_first():
    for policy, first in (("fcfs", 1), ("lpm", 2)):
        eng, idx = engine(max_running_requests=1, schedule_policy=policy)
        shared = idx.path([1, 2, 3])
        eng.submit(0.0, 12, 1, shared, 4)                  # warms the cache, done at 1.2 s
        eng.submit(0.5, 12, 1, idx.path([4, 5, 6]), 4)     # no hit
        eng.submit(0.6, 12, 1, shared, 4)                  # 2 blocks hit
        eng.advance(float("inf"))
        recs = eng.records()
        served = sorted((1, 2), key=lambda i: recs[i].first_token_s)
        assert served[0] == first, policy


# ---------------------------------------------------------------- speculative decoding
@dataclass(frozen=True)
class Spec:
    algorithm: str = "EAGLE"
    num_steps: int = 3
    topk: int = 1
    draft_tokens: int = 4
    adaptive: bool = False
    accept_rate: float = 0.5


def test_speculative_steps_emit_several_tokens(monkeypatch):
    import domain.twin.engine as en
    monkeypatch.setattr(en, "accept_length", lambda params, batch: 2.0)
    monkeypatch.setattr(en, "steps_for_batch", lambda params, batch: 3)
    monkeypatch.setattr(en, "draft_tokens_for_batch", lambda params, batch: 4)
    eng, _ = engine(spec=Spec())
    recs = eng.run([(0.0, 10, 7)])
    # prefill 1 s -> token 1; each verify+draft step (2 s) emits 2 tokens: 3 steps -> 7 tokens
    assert recs[0].finish_s == pytest.approx(1.0 + 3 * 2.0)
    # bench_serving spreads a chunk's gap over its tokens: 6 gaps of 1 s
    assert recs[0].itl_s == pytest.approx(np.ones(6))
    assert eng.stats.mean_accept_length == pytest.approx(2.0)
    # roofline share: plain decode of the same tokens at 0.25 s/step = 2 x 0.25 per 2 s step
    assert eng.stats.decode_roofline_share == pytest.approx(0.25)


# ---------------------------------------------------------------- routers
def test_power_of_two_picks_the_less_loaded_of_two():
    r = Router("power_of_two", 2)
    assert r.pick([], 0, 10, [5, 1]) == 1
    assert r.pick([], 0, 10, [0, 3]) == 0


def test_cache_aware_follows_the_prefix_then_balances():
    idx = PathIndex()
    r = Router("cache_aware", 2)
    a, b = idx.path([1, 2, 3]), idx.path([9, 8, 7])
    first = r.pick(a, 512, 1536, [0, 0])
    other = r.pick(b, 512, 1536, [1, 0])       # no match anywhere: the smaller tree
    assert other != first
    assert r.pick(a, 512, 1536, [1, 1]) == first  # 100% match > 0.3
    # imbalance: 100 - 0 > 64 and 100 > 1.5 x 0 -> the least loaded wins over the match
    loads = [0, 0]
    loads[first] = 100
    assert r.pick(a, 512, 1536, loads) == other


def test_round_robin_cycles():
    r = Router("round_robin", 3)
    assert [r.pick([], 0, 1, [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]


def test_bailian_16_token_blocks_hit_the_radix_cache():
    from pathlib import Path

    from domain.traces import load_bailian
    trace = load_bailian(Path(__file__).parents[1] / "fixtures" / "qwen_bailian_tiny.jsonl")
    eng, idx = engine()
    for q in trace.requests:
        eng.submit(q.arrival_s, q.input_tokens, q.output_tokens, idx.path(q.hash_ids),
                   q.block_size)
    eng.advance(float("inf"))
    # t=0: turn 1 (40 tokens) prefills 4.0 s and caches its 2 full 16-token blocks [0, 1].
    # t=4.0: one batch of the 3 waiting requests: 16 + (70 - 32 cached) + 33 = 87 tokens, 8.7 s.
    # t=12.7: turn 3 (100 tokens, arrived 4.75) reuses the 4 full blocks turn 2 cached
    # [0, 1, 2, 4] = 64 tokens; 36 new tokens = 3.6 s -> TTFT 12.7 + 3.6 - 4.75.
    recs = eng.records()
    assert recs[2].first_token_s == pytest.approx(12.7)
    assert recs[4].ttft_s == pytest.approx(12.7 + 3.6 - 4.75)
    assert (eng.stats.cached_tokens, eng.stats.prompt_tokens) == (32 + 64, 259)


def test_closed_loop_request_cap_bounds_the_run():
    eng, _ = engine()
    recs = eng.run(closed_loop=(2, 1e6, 10, 2), max_requests=7)
    assert len(recs) == 7 and all(r.error is None for r in recs)


def test_virtual_time_cap_names_itself():
    eng, _ = engine()
    recs = eng.run([(0.0, 10, 50)], max_virtual_s=5.0)
    assert "virtual time cap (5 s)" in recs[0].error


# ---------------------------------------------------------------- over-admission (issue 20)
def test_retraction_reestimates_the_new_token_ratio_and_recomputes_the_victim():
    # pool 80, radix off, conservativeness 0.1 (reservation 0.07 x 59 each): A and B (10 in,
    # 60 out) are both admitted; prefill 20 tokens -> t = 2. KV 20 + 2 per step: after 30 steps
    # (t = 32, 31 tokens each) the pool is full and B (equal output and prompt: the last of the
    # batch) is retracted, freeing its 40 tokens. SGLang's estimate from the request kept:
    # (31 decoded + 20 x 1) / (60 + 1). A ends at 32 + 29 = 61; B waits (full batch), then
    # re-prefills its 10 + 31 tokens (4.1 s) and decodes 28 more steps: 61 + 4.1 + 28 = 93.1.
    eng, _ = engine(kv_tokens=80, radix_cache=False, schedule_conservativeness=0.1)
    eng.submit(0.0, 10, 60)
    eng.submit(0.0, 10, 60)
    eng.advance(32.5)
    assert eng.stats.retractions == 1
    assert eng.new_token_ratio == pytest.approx(51 / 61)
    eng.advance(float("inf"))
    recs = eng.records()
    assert [r.finish_s for r in recs] == pytest.approx([61.0, 93.1])
    assert eng.stats.retracted_tokens == 10 + 31
    assert len(recs[1].itl_s) == 59
    assert eng.new_token_ratio == pytest.approx(0.07)  # reset when the engine idles


def test_a_full_batch_does_not_retry_admission_until_a_request_leaves():
    # conservativeness 1.5: ratio 1.0, decaying 0.86 / 600 per step. After A's prefill (t = 1)
    # the pool of 525 has 525 - 10 - 1.0 x 499 = 16 < 20 for B (10 in + 1.0 x 10): the batch is
    # full. The room then grows as the ratio decays (16 + 0.00143 k (499 - k): B would fit
    # after ~6 steps), but SGLang does not look again until a request leaves: B is admitted
    # when A finishes (1 + 499 = 500) and has its first token at 501.
    eng, _ = engine(kv_tokens=525, schedule_conservativeness=1.5)
    recs = eng.run([(0.0, 10, 500), (0.5, 10, 10)])
    assert recs[0].finish_s == pytest.approx(500.0)
    assert recs[1].first_token_s == pytest.approx(501.0)


@pytest.mark.parametrize(("policy", "first"), [("lpm", [2.0, 5.5]), ("fcfs", [1.0, 4.0])])
def test_lpm_pays_a_scan_per_waiting_request_fcfs_almost_none(policy, first):
    # 4 requests (10 in, 3 out) at t = 0, one slot, 0.5 s of CPU per waiting request matched.
    # LPM matches all 4 (queue <= 128): the pass takes 2 s, longer than A's 1 s prefill, so A's
    # first token is at 2; the slot is full during A's 2 decode steps (no pass, 1 s each); after
    # A leaves at 4 the pass over the 3 left takes 1.5 s > B's prefill: B's first token at 5.5.
    # FCFS only refreshes 128 prefixes every 32nd pass (3/32 per pass here): hidden behind the
    # prefills, A at 1 and B at 3 + 1 = 4.
    cost = StepCost()
    cost.scan_s = 0.5
    limits = lim(max_running_requests=1, schedule_policy=policy)
    eng = TwinEngine(cost, limits, PrefixCache(PathIndex(), 0))
    recs = eng.run([(0.0, 10, 3)] * 4)
    assert [r.first_token_s for r in recs[:2]] == pytest.approx(first)
    # waiting after each step: prefill A 3, decodes 3 + 3, prefill B 2, 2 + 2, C 1, 1 + 1, D 0
    assert eng.stats.waiting_sum == 18


def test_decode_steps_above_the_graph_max_are_counted_eager():
    cost = StepCost()
    cost.graph_max_bs = 1
    eng = TwinEngine(cost, lim(), None)
    eng.run([(0.0, 10, 3), (0.0, 10, 3), (5.0, 10, 2)])
    # A and B decode together twice (eager, 2 > 1); C decodes alone once (in the graph)
    assert eng.stats.eager_decode_steps == 2
    assert eng.stats.decode_steps == 3
