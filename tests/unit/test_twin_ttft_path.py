"""The TTFT path outside the GPU steps: the one tokenizer process and the fixed latency.

:class:`PathCost` is :class:`StepCost` (prefill 0.1 s per new token, decode 1 s per step) plus a
tokenizer of 0.2 s per prompt token and a fixed per-request latency of 0.05 s, so each event time
is checkable by hand in the comment above its assertion.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from fixtures.step_cost import StepCost

from domain.calibration import UNCALIBRATED, Efficiency
from domain.twin.engine import EngineLimits, TwinEngine


class PathCost(StepCost):
    """StepCost with the TTFT path: tokenize 0.2 s per token, 0.05 s fixed per request."""

    request_fixed_s = 0.05

    def tokenize_time(self, tokens: int) -> float:
        return 0.2 * tokens


def engine() -> TwinEngine:
    return TwinEngine(PathCost(), EngineLimits(kv_tokens=10_000, max_running_requests=8,
                                               chunked_prefill_size=8192, context_len=100_000))


def test_one_request_on_an_idle_engine_adds_tokenize_and_fixed_latency_to_ttft() -> None:
    # 10-token prompt: tokenized 0 -> 2.0 s, prefill 1.0 s -> 3.0, out after 0.05 -> TTFT 3.05;
    # two decode steps end at 4.0 and 5.0 (+0.05): the inter-token gaps stay 1 s
    (rec,) = engine().run([(0.0, 10, 3)])
    assert rec.ttft_s == pytest.approx(2.0 + 0.05 + 1.0)
    assert rec.finish_s == pytest.approx(5.05)
    assert rec.itl_s == pytest.approx([1.0, 1.0])


def test_two_requests_arriving_together_queue_in_the_tokenizer() -> None:
    # one output token each: A tokenized 0 -> 2, prefill 2 -> 3 (TTFT 3.05); B waits for the
    # tokenizer (2 -> 4), prefill 4 -> 5: TTFT 5.05 (without the queue it would be 4.05)
    a, b = engine().run([(0.0, 10, 1), (0.0, 10, 1)])
    assert (a.ttft_s, b.ttft_s) == pytest.approx((3.05, 5.05))


def test_closed_loop_client_resends_after_it_sees_the_last_token() -> None:
    # one client, 1-token prompts of 1 output: tokenize 0.2, prefill 0.1, out +0.05: each
    # request takes 0.35 s from send to its (only) token, the next is sent then
    eng = engine()
    recs = eng.run(closed_loop=(1, 1.0, 1, 1))
    assert [r.arrival_s for r in recs] == pytest.approx([0.0, 0.35, 0.70])
    assert all(r.ttft_s == pytest.approx(0.35) for r in recs)


def test_incremental_advance_gives_the_offline_token_times() -> None:
    # the real-time driver's way (submit at arrival, advance in small steps) and one offline
    # run give the same token times with the tokenizer queue and the fixed latency in play
    arrivals = [(0.0, 10, 3), (0.1, 5, 2), (2.5, 3, 2)]
    offline = engine().run(arrivals)
    eng = engine()
    ids: list[int] = []
    v = 0.0
    while v < 20.0:
        for a in arrivals[len(ids):]:
            if a[0] <= v:
                ids.append(eng.submit(*a))
        eng.advance(v + 1e-6)
        nxt = eng.next_event_s
        assert nxt >= eng.now or math.isinf(nxt)
        v += 0.25
    for i, rec in zip(ids, offline, strict=True):
        times = eng.progress(i).token_times
        expect = np.concatenate([[rec.first_token_s], rec.first_token_s + np.cumsum(rec.itl_s)])
        assert times == pytest.approx(list(expect))


def test_efficiency_rejects_a_tokenizer_without_throughput() -> None:
    assert UNCALIBRATED.request_fixed_s > 0 and UNCALIBRATED.tokenizer_tokens_per_s > 0
    with pytest.raises(ValueError, match="not a positive throughput"):
        Efficiency().updated({"tokenizer_tokens_per_s": 0.0})
