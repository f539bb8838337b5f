"""How much faster than real time the twin simulates the default study's workloads.

Baseline: real time (a real cluster needs the virtual duration in wall-clock seconds). For each
config the script runs the default study's saturation run and its trace replay on the twin and
prints virtual seconds, wall seconds and the speed-up ratio virtual / wall.

    .venv/bin/python benchmarks/twin_speed.py
"""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from domain.fit import fit
from domain.knobs import apply_knob
from domain.study import parse_study
from domain.twin.cluster import simulate_closed_loop, simulate_open_loop
from domain.workload import load_trace

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    """Print one row per (config, workload)."""
    study = parse_study(yaml.safe_load((ROOT / "studies" / "default.yaml").read_text()))
    base = study.base_config()
    configs = {"baseline fp8 TP8": base,
               "nvfp4 TP4x2 fp8-KV": apply_knob(apply_knob(apply_knob(
                   base, "weights", "nvfp4", 8), "tp_size", 4, 8), "kv_cache_dtype",
                   "fp8_e4m3", 8)}
    r = study.replay
    window = load_trace(ROOT / r.trace, r.format).window(r.start_s, r.duration_s) \
        .scaled(r.time_scale)
    reqs = [(q.arrival_s, q.input_tokens, q.output_tokens) for q in window.requests]
    s = study.saturation
    print(f"{'config':<22} {'workload':<11} {'requests':>8} {'virtual s':>10} {'wall s':>8} "
          f"{'x real time':>12}")
    for name, cfg in configs.items():
        rep = fit(cfg)
        for label, run in (
            ("saturation", lambda c=cfg, f=rep: simulate_closed_loop(
                c, f, s.concurrency, s.duration_s, s.isl, s.osl)),
            ("replay", lambda c=cfg, f=rep: simulate_open_loop(c, f, reqs)),
        ):
            t0 = time.perf_counter()
            recs, _ = run()
            wall = time.perf_counter() - t0
            ok = [x for x in recs if x.error is None]
            virtual = max(x.finish_s for x in ok) - min(x.arrival_s for x in recs)
            print(f"{name:<22} {label:<11} {len(recs):>8} {virtual:>10.1f} {wall:>8.3f} "
                  f"{virtual / wall:>12,.0f}")


if __name__ == "__main__":
    main()
