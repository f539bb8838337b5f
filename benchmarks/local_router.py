"""The real sglang-router in front of two twin servers on the local backend, per router policy.

For each policy: deploy two ``servetune twin serve`` replicas with the pinned sglang-router 0.3.2
in front (the local backend's ``router="sglang"``), run one saturation through the router, print
how many requests each replica finished (its own ``sglang:num_requests_total``), tok/s/GPU and
TTFT, and tear the deployment down. Real time: about 10 s per policy on a 2-core machine. Needs
the ``router`` extra (``pip install -e ".[router]"``).

    .venv/bin/python benchmarks/local_router.py [--concurrency 16] [--duration-s 6]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from domain.config import ServingConfig
from mcp_servers.bench.ops import BenchService
from mcp_servers.cluster.backend import make_backend
from mcp_servers.cluster.local import TWIN_SERVE_COMMAND

POLICIES = ("round_robin", "power_of_two", "cache_aware")


def main() -> None:
    """Print one row per router policy."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--duration-s", type=float, default=6.0)
    ap.add_argument("--isl", type=int, default=256)
    ap.add_argument("--osl", type=int, default=32)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        backend = make_backend("local", "router-bench", state, list(TWIN_SERVE_COMMAND),
                               router="sglang")
        svc = BenchService(backend, state / "artifacts", [state])
        print(f"two twin replicas (Llama 3.1 70B FP8, H200, cap 8 each) behind sglang-router; "
              f"ISL {args.isl} / OSL {args.osl}, {args.concurrency} clients, "
              f"{args.duration_s:g} s")
        print(f"{'policy':<14} {'split':>10} {'tok/s/GPU':>10} {'TTFT p50 ms':>12} "
              f"{'TTFT p99 ms':>12}")
        for policy in POLICIES:
            config = ServingConfig(model="llama-3.1-70b", gpu="H200", tp_size=1, weights="fp8",
                                   replicas=2, router_policy=policy, max_running_requests=8)
            name = policy.replace("_", "-")
            st = backend.deploy(name, config, {}, wait_s=120)
            try:
                if st.phase != "Ready":
                    print(f"{policy:<14} {st.phase}: {st.message}")
                    continue
                res = asyncio.run(svc.saturation(name, isl=args.isl, osl=args.osl,
                                                 concurrency=args.concurrency,
                                                 duration_s=args.duration_s, runner="builtin"))
                s = res.summary
                split = "/".join(map(str, res.replica_requests or []))
                print(f"{policy:<14} {split:>10} {s.output_tok_s_per_gpu:>10.1f} "
                      f"{s.ttft_ms.p50 or 0:>12.0f} {s.ttft_ms.p99 or 0:>12.0f}")
            finally:
                backend.teardown(name)


if __name__ == "__main__":
    main()
