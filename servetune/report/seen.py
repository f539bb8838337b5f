"""The report's "What the twin saw" section: per-replica engine counters of each trial's runs.

One line per run (a trial's saturation run, a finalist's replay) whose backend reported engine
counters (the twin; of real servers, only the requests each replica finished, from its
``sglang:num_requests_total``, which shows how the router spread the load): requests routed to
each replica, requests in flight (time-weighted mean over the busy steps, and the most at one
step), retractions and the tokens they prefill again, the share of decode steps run eagerly
above ``cuda_graph_max_bs_decode``, and the share of decode time in TP all-reduces. The counters
are :class:`~domain.twin.cluster.ReplicaStats` as the bench returned them; an uneven request
split or in-flight load shows the router at work, eager steps and retractions show where
large-batch costs enter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from domain.trial import Trial
from domain.twin.cluster import ReplicaStats
from servetune.report.format import _changed

MAX_LISTED = 4  # replicas listed one by one; beyond, the range min..max


def _per(stats: Sequence[ReplicaStats], value: Callable[[ReplicaStats], float],
         fmt: str) -> str:
    """``a / b`` over the replicas (``lo..hi`` over more than MAX_LISTED)."""
    vals = [value(s) for s in stats]
    if len(vals) > MAX_LISTED:
        return f"{format(min(vals), fmt)}..{format(max(vals), fmt)}"
    return " / ".join(format(v, fmt) for v in vals)


def seen_line(stats: Sequence[ReplicaStats]) -> str:
    """What the twin saw on one run, all replicas (see the module docstring)."""
    n = len({s.replica for s in stats})
    who = f"{n} replicas" if n > 1 else "1 replica"
    if len(stats) > n:  # servers of several schedulers: one row per DP rank (issue 21)
        who += f" x {len(stats) // n} schedulers (per scheduler)"
    return (f"{who}: requests {_per(stats, lambda s: s.requests, ',')}; in flight mean "
            f"{_per(stats, lambda s: s.mean_inflight, ',.1f')}, max "
            f"{_per(stats, lambda s: s.max_inflight, ',')}; retractions "
            f"{_per(stats, lambda s: s.retractions, ',')} "
            f"({sum(s.retracted_tokens for s in stats):,} tokens recomputed); eager decode "
            f"steps {_per(stats, lambda s: s.eager_step_share, '.0%')}; all-reduce "
            f"{_per(stats, lambda s: s.decode_allreduce_share, '.0%')} of decode time")


def seen_section(trials: list[Trial]) -> list[str]:
    """The section; a sentence instead when no run reported engine counters."""
    out = ["## What the twin saw", ""]
    rows = []
    for t in trials:
        for what, stats in (("saturation", t.saturation_replicas),
                            ("replay", t.replay_replicas)):
            if stats:
                rows.append(f"- #{t.seq} {t.phase} {_changed(t)}, {what}: {seen_line(stats)}")
            elif t.replica_requests.get(what):
                counts = t.replica_requests[what]
                rows.append(f"- #{t.seq} {t.phase} {_changed(t)}, {what}: {len(counts)} "
                            f"server(s) finished {' / '.join(f'{n:,}' for n in counts)} "
                            "requests (their own counters; no engine internals over HTTP)")
    if not rows:
        return out + ["No run reported engine counters (real servers expose none of these "
                      "per replica; the twin does).", ""]
    return out + [
        "Per replica, in replica order: requests routed to it; requests in flight (running, "
        "waiting and prefilling; mean over busy time, and the most at one step); retractions "
        "(and the prompt plus generated tokens they prefill again); the share of decode steps "
        "run eagerly above cuda_graph_max_bs_decode; the share of decode time in TP "
        "all-reduces.", "", *rows, ""]
