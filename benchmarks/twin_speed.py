"""How much faster than real time the twin simulates one replica replaying a whole real trace.

Baseline: real time (a real cluster needs the virtual duration in wall-clock seconds), so the
ratio printed is simulated seconds per wall second. The workload is the full Mooncake FAST'25
conversation trace (12,031 requests over one hour, shipped in ``data/traces``) at its own arrival
times on ONE replica of GLM-5 on B200 (TP8, FP8 weights). Rows: with the radix prefix cache (the
engine default), with HiCache, and with the cache disabled, on a 1P:1D prefill/decode split of
that server (two of them: ``pd_row``, issue 21), plus the default study's saturation run for
reference. Target (issue 3): >= 1,000x real time for the trace replay. The attention-DP
rows (issue 21) replay the same trace on, and saturate, ONE server of DeepSeek-V3 FP8 on 8x H200
with attention DP 8 + EP 8 (eight schedulers in lockstep behind the DP controller); target
>= 1,000x. The last column is the compute budget's up-front estimate of the run
(:mod:`domain.twin.budget`), wall seconds on a machine twice as fast as the one it was measured on.

    .venv/bin/python benchmarks/twin_speed.py [--trace PATH]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from domain.config import ServingConfig
from domain.fit import fit
from domain.metrics import summarize
from domain.traces import load_trace
from domain.twin.cluster import (
    estimate_closed_loop,
    estimate_open_loop,
    simulate_closed_loop,
    simulate_open_loop,
)

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "data" / "traces" / "mooncake_fast25_conversation_trace.jsonl"


def main() -> None:
    """Print one row per workload with virtual s, wall s and the speed-up over real time."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    args = ap.parse_args()
    trace = load_trace(args.trace, "mooncake")
    reqs = [(q.arrival_s, q.input_tokens, q.output_tokens, q.hash_ids, q.block_size)
            for q in trace.requests]
    base = ServingConfig(model="glm-5", gpu="B200", tp_size=8, weights="fp8")
    dp8 = ServingConfig(model="deepseek-v3", gpu="H200", tp_size=8, weights="fp8",
                        attn_dp_size=8, ep_size=8, moe_a2a_backend="deepep")
    rows = {
        "replay, radix cache (default)": base,
        "replay, HiCache ratio 2": base.model_copy(update={"enable_hierarchical_cache": True}),
        "replay, radix cache off": base.model_copy(update={"disable_radix_cache": True}),
        "replay, attn DP 8 + EP 8": dp8,
    }
    print(f"workload: {args.trace.name}, {len(reqs)} requests, one replica of "
          f"{base.model} {base.weights} TP{base.tp_size} on {base.gpu} (attn DP rows: "
          f"{dp8.model} {dp8.weights} on 8x {dp8.gpu}, attn DP 8 + EP 8)")
    print(f"{'run':<32} {'virtual s':>10} {'wall s':>8} {'x real time':>12} {'hit rate':>9} "
          f"{'TTFT p50 s':>11} {'estimate s':>11}")
    for name, cfg in rows.items():
        cfg = ServingConfig.model_validate(cfg.model_dump())
        rep = fit(cfg)
        t0 = time.perf_counter()
        recs, stats = simulate_open_loop(cfg, rep, reqs)
        wall = time.perf_counter() - t0
        ok = [r for r in recs if r.error is None]
        virtual = max(r.finish_s for r in ok) - min(r.arrival_s for r in recs)
        s = summarize(recs, cfg.gpus)
        p50 = (s.ttft_ms.p50 or 0.0) / 1e3
        hit = sum(x.cache_hit_rate for x in stats) / len(stats)  # mean over the schedulers
        est = estimate_open_loop(cfg, rep, reqs).seconds
        print(f"{name:<32} {virtual:>10.0f} {wall:>8.2f} {virtual / wall:>12,.0f} "
              f"{hit:>9.1%} {p50:>11.1f} {est:>11.2f}")
    pd_row(base, reqs)
    for name, cfg in (("saturation c1024 ISL2048/OSL512", base),
                      ("saturation attn DP 8, c1024", dp8)):
        rep = fit(cfg)
        t0 = time.perf_counter()
        recs, _ = simulate_closed_loop(cfg, rep, 1024, 120.0, 2048, 512)
        wall = time.perf_counter() - t0
        virtual = max(r.finish_s for r in recs if r.error is None)
        est = estimate_closed_loop(cfg, rep, 1024, 120.0, 2048, 512).seconds
        print(f"{name:<32} {virtual:>10.0f} {wall:>8.2f} {virtual / wall:>12,.0f} {'-':>9} "
              f"{'-':>11} {est:>11.2f}")


def pd_row(base: ServingConfig, reqs: list[tuple[float, int, int, tuple[int, ...], int]]) -> None:
    """Print the row of the trace replayed on a 1P:1D split of ``base`` (issue 21).

    One prefill and one decode server with ``base``'s layout (:mod:`domain.twin.pd`); the
    virtual duration over the wall seconds of the simulation, as the other replay rows.
    """
    cfg = ServingConfig.model_validate({**base.model_dump(), "pd": "1P1D"})
    rep = fit(cfg)
    t0 = time.perf_counter()
    recs, stats = simulate_open_loop(cfg, rep, reqs)
    wall = time.perf_counter() - t0
    ok = [r for r in recs if r.error is None]
    virtual = max(r.finish_s for r in ok) - min(r.arrival_s for r in recs)
    p50 = (summarize(recs, cfg.gpus).ttft_ms.p50 or 0.0) / 1e3
    hit = next(s.cache_hit_rate for s in stats if s.role == "prefill")
    print(f"{'replay, PD 1P1D':<32} {virtual:>10.0f} {wall:>8.2f} {virtual / wall:>12,.0f} "
          f"{hit:>9.1%} {p50:>11.1f}")


if __name__ == "__main__":
    main()
