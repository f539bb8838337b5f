"""A 1P:1D prefill/decode split against two aggregated replicas on the same GPUs, on the twin.

Workload: a window of the Mooncake FAST'25 conversation trace (shipped in ``data/traces``; long
prompts, short answers, arrivals in bursts) replayed at its own arrival times sped up by
``--time-scale``. Configs (8 GPUs each): Llama-3.1-8B FP8 on H200, one TP4 server per
replica -- two aggregated replicas behind the router (round_robin) against one prefill and
one decode server (``pd: 1P1D``, mooncake transfer). Both are simulated in the same run; the
ratios printed are the PD split's over the aggregated pair.

What it shows: an aggregated server interleaves every prefill batch with its decode batches, so
a running request's inter-token gap now and then holds a whole prefill chunk (ITL p99 / p50
grows with the load); the decode servers of a split never prefill, so their ITL stays flat,
while the split's one prefill server serves the prefill load of both aggregated ones (its TTFT
queues first). Issue 21 "done when": the decode pool's ITL p99/p50 <= 1.5 where the
aggregated pair's is >= 2, both TTFT p50 reported with the transfer's share.

    .venv/bin/python benchmarks/pd_split.py [--start-s 0] [--duration-s 300] [--time-scale 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from domain.config import ServingConfig
from domain.fit import fit
from domain.metrics import RequestRecord, summarize, ttft_transfer_share
from domain.traces import load_trace
from domain.twin.cluster import simulate_open_loop
from domain.twin.pd import TTFTParts, replay

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "data" / "traces" / "mooncake_fast25_conversation_trace.jsonl"
BASE = {"model": "llama-3.1-8b", "gpu": "H200", "tp_size": 4, "weights": "fp8"}


def configs() -> tuple[ServingConfig, ServingConfig]:
    """The aggregated pair and the 1P:1D split (same model, GPUs and server layout)."""
    return (ServingConfig(**BASE, replicas=2, router_policy="round_robin"),
            ServingConfig(**BASE, pd="1P1D", router_policy="round_robin"))


def workload(start_s: float, duration_s: float, time_scale: float,
             path: Path = TRACE) -> list[tuple[float, int, int, tuple[int, ...], int]]:
    """The trace window ``[start_s, start_s + duration_s)`` replayed ``time_scale`` x faster."""
    trace = load_trace(path, "mooncake").window(start_s, duration_s).scaled(time_scale)
    return [(q.arrival_s, q.input_tokens, q.output_tokens, q.hash_ids, q.block_size)
            for q in trace.requests]


def itl_tail(records: list[RequestRecord]) -> tuple[float, float]:
    """Pooled inter-token gaps of the completed requests: (p50, p99), seconds."""
    gaps = np.concatenate([r.itl_s for r in records if r.error is None])
    p50, p99 = np.percentile(gaps, [50, 99])
    return float(p50), float(p99)


def run(config: ServingConfig, requests: list[tuple[float, int, int, tuple[int, ...], int]]
        ) -> dict[str, float]:
    """Simulate ``requests`` on ``config``: ITL p50/p99 (s), TTFT p50 (s), shares, wall s."""
    t0 = time.perf_counter()
    parts: list[TTFTParts] = []
    if config.pd is not None:  # the split: keep where each TTFT went
        sim = replay(config, requests)
        recs = sim.records()
        parts = [p for p in sim.ttft_parts(recs) if p is not None]
    else:
        recs, _ = simulate_open_loop(config, fit(config), requests)
    wall = time.perf_counter() - t0
    s = summarize(recs, config.gpus)
    p50, p99 = itl_tail(recs)
    ok = [r for r in recs if r.error is None]
    share = ttft_transfer_share(recs) or 0.0
    medians = {f"ttft_{k}": float(np.median([getattr(p, f"{k}_s") for p in parts]))
               for k in ("prealloc_wait", "prefill", "transfer", "decode_wait")} if parts else {}
    return {**medians, "itl_p50": p50, "itl_p99": p99,
            "ttft_p50": (s.ttft_ms.p50 or 0.0) / 1e3,
            "transfer_p50": float(np.median([r.transfer_s for r in ok])) if ok else 0.0,
            "share": share, "errors": float(s.errors), "out_tok_s": s.output_tok_s,
            "wall": wall}


def main() -> None:
    """Print both configs' ITL tail, TTFT and the split's ratios over the aggregated pair."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start-s", type=float, default=0.0)
    ap.add_argument("--duration-s", type=float, default=300.0)
    ap.add_argument("--time-scale", type=float, default=2.0)
    ap.add_argument("--trace", type=Path, default=TRACE)
    args = ap.parse_args()
    reqs = workload(args.start_s, args.duration_s, args.time_scale, args.trace)
    agg, split = configs()
    print(f"workload: {args.trace.name} [{args.start_s:g} s, +{args.duration_s:g} s) x"
          f"{args.time_scale:g}: {len(reqs)} requests over {reqs[-1][0]:.0f} s")
    print(f"configs: {BASE['model']} {BASE['weights']} TP{BASE['tp_size']} on {BASE['gpu']}, "
          f"{agg.gpus} GPUs: 2 aggregated replicas vs {split.pd.label() if split.pd else ''}")
    rows = {"aggregated x2": run(agg, reqs), "PD 1P1D": run(split, reqs)}
    print(f"{'config':<14} {'ITL p50 ms':>10} {'ITL p99 ms':>10} {'p99/p50':>8} "
          f"{'TTFT p50 s':>10} {'xfer p50 ms':>11} {'xfer/TTFT':>9} {'out tok/s':>9} "
          f"{'errors':>6} {'wall s':>6}")
    for name, m in rows.items():
        print(f"{name:<14} {m['itl_p50'] * 1e3:>10.2f} {m['itl_p99'] * 1e3:>10.2f} "
              f"{m['itl_p99'] / m['itl_p50']:>8.2f} {m['ttft_p50']:>10.2f} "
              f"{m['transfer_p50'] * 1e3:>11.1f} {m['share']:>9.2%} {m['out_tok_s']:>9.0f} "
              f"{m['errors']:>6.0f} {m['wall']:>6.2f}")
    a, p = rows["aggregated x2"], rows["PD 1P1D"]
    print(f"PD TTFT, median of each part: prealloc queue {p['ttft_prealloc_wait']:.2f} s, "
          f"prefill (queue + compute) {p['ttft_prefill']:.2f} s, transfer "
          f"{p['ttft_transfer'] * 1e3:.1f} ms, decode join + pipeline "
          f"{p['ttft_decode_wait'] * 1e3:.1f} ms")
    ra, rp = a["itl_p99"] / a["itl_p50"], p["itl_p99"] / p["itl_p50"]
    print(f"ITL p99/p50: decode pool {rp:.2f} (target <= 1.5), aggregated pair {ra:.2f} "
          f"(target >= 2): {'met' if rp <= 1.5 <= 2 <= ra else 'NOT met'}")
    print(f"split / aggregated: ITL p99 {p['itl_p99'] / a['itl_p99']:.2f}x, ITL p50 "
          f"{p['itl_p50'] / a['itl_p50']:.2f}x, TTFT p50 {p['ttft_p50'] / a['ttft_p50']:.2f}x, "
          f"output tok/s {p['out_tok_s'] / a['out_tok_s']:.2f}x")


if __name__ == "__main__":
    main()
