"""Replicas behind a router: spread a workload over the replicas of a config and simulate each.

Router v0: ``round_robin`` (request i goes to replica i mod R), the policy of SGLang's in-server
DP controller when ``load_balance_method`` resolves from ``auto`` (sglang-knobs reference 1.1)
and of sglang-router's ``--policy round_robin``. Replicas do not interact under round robin, so
each is simulated on its own share of the arrivals. A closed-loop saturation run gives each
replica ``concurrency / R`` clients (the remainder spread one by one).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from domain.config import ServingConfig
from domain.costmodel import build_cost_model
from domain.fit import FitReport
from domain.metrics import RequestRecord
from domain.models import get_model
from domain.twin.engine import EngineLimits, EngineStats, TwinEngine


class ReplicaStats(BaseModel):
    """Scheduler counters of one replica for one run."""

    replica: int
    requests: int
    prefill_steps: int
    decode_steps: int
    retractions: int
    max_running: int
    mean_decode_batch: float
    busy_s: float


def _limits(config: ServingConfig, report: FitReport) -> EngineLimits:
    return EngineLimits(kv_tokens=report.kv_tokens,
                        max_running_requests=report.max_running_requests,
                        chunked_prefill_size=report.chunked_prefill_size,
                        context_len=report.context_len,
                        index_topk=get_model(config.model).index_topk)


def _stats(i: int, n: int, s: EngineStats) -> ReplicaStats:
    return ReplicaStats(replica=i, requests=n, prefill_steps=s.prefill_steps,
                        decode_steps=s.decode_steps, retractions=s.retractions,
                        max_running=s.max_running, mean_decode_batch=s.mean_decode_batch,
                        busy_s=s.busy_s)


def simulate_open_loop(config: ServingConfig, report: FitReport,
                       requests: Sequence[tuple[float, int, int]]
                       ) -> tuple[list[RequestRecord], list[ReplicaStats]]:
    """Replay (arrival_s, input_tokens, output_tokens) requests on every replica of ``config``.

    Returns:
        Records in the order of ``requests`` and one ReplicaStats per replica.
    """
    cost = build_cost_model(config, report)
    lim = _limits(config, report)
    R = config.replicas
    records: list[RequestRecord | None] = [None] * len(requests)
    stats = []
    for i in range(R):
        share = list(requests[i::R])
        eng = TwinEngine(cost, lim)
        for j, rec in zip(range(i, len(requests), R), eng.run(share), strict=True):
            records[j] = rec
        stats.append(_stats(i, len(share), eng.stats))
    return [r for r in records if r is not None], stats


def simulate_closed_loop(config: ServingConfig, report: FitReport, concurrency: int,
                         duration_s: float, isl: int, osl: int
                         ) -> tuple[list[RequestRecord], list[ReplicaStats]]:
    """Closed-loop saturation: ``concurrency`` clients spread over the replicas.

    Raises:
        ValueError: if concurrency < 1.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    cost = build_cost_model(config, report)
    lim = _limits(config, report)
    R = config.replicas
    records: list[RequestRecord] = []
    stats = []
    for i in range(R):
        share = concurrency // R + (1 if i < concurrency % R else 0)
        if share == 0:
            continue
        eng = TwinEngine(cost, lim)
        recs = eng.run(closed_loop=(share, duration_s, isl, osl))
        records += recs
        stats.append(_stats(i, len(recs), eng.stats))
    return records, stats
