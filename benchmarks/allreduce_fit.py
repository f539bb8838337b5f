"""Fit the twin's all-reduce model on the measured all-reduce tables of the aiconfigurator wheel.

Data: ``aiconfigurator-core`` 0.12.0 (Apache-2.0), unpacked at ``/tmp/acc/x`` (or ``--wheel-dir``):
``aiconfigurator_core/systems/data/<system>/comm/nccl/<v>/nccl_perf.parquet`` (NCCL all-reduce,
``nccl_dtype == half``) and ``.../comm/sglang/<v>/custom_allreduce_perf.parquet`` (SGLang's custom
all-reduce, ``backend == sglang_graph``: inside a CUDA graph, as decode runs). ``message_size``
counts elements (the wheel's models pass ``tokens x hidden``), 2 bytes each; ``latency`` is in
ms. The node of each system is taken as its system yaml states it (``intra_node_bw``; e.g.
``rtx_pro_6000_server.yaml``: PCIe Gen5 x16, 64e9 B/s per GPU and direction).

Model, per table and GPU count ``n``: ``t(s) = min_k (a_k + 2 (n-1)/n x s / (e_k x link))``
over two protocol lines ``k`` -- NCCL itself picks, per size, the protocol (LL / LL128 / Simple)
and algorithm whose ``latency + size / bandwidth`` is least (NCCL ``src/graph/tuning.cc``); the
custom all-reduce switches from one-shot to two-shot kernels the same way. ``a_k`` is a latency
(s), ``e_k`` the share of the node's link bandwidth the ring's bus traffic reaches. Fitted by
least squares on ``log(pred / measured)`` (scipy ``least_squares``, soft-L1). The topology
blocks (``nvlink``, ``pcie``) are the medians over that topology's systems; the runtime
(:mod:`domain.interconnect`) scales them by the target node's own slowest ring link.

Baseline (printed and stored): the ring formula the cost model used before,
``2 (n-1)/n x s / link + 6 us``.

Needs pyarrow + numpy + scipy, kept OUT of the product's runtime (which reads the JSON with the
standard library)::

    python3 -m venv /tmp/comm-venv && /tmp/comm-venv/bin/pip install pyarrow numpy scipy
    PYTHONPATH=. /tmp/comm-venv/bin/python benchmarks/allreduce_fit.py            # print
    PYTHONPATH=. /tmp/comm-venv/bin/python benchmarks/allreduce_fit.py --write    # + JSON
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from scipy.optimize import least_squares

OUT = Path(__file__).resolve().parents[1] / "domain" / "data" / "allreduce-fit.json"
ELEMENT_BYTES = 2  # half / bfloat16
OLD_LATENCY_S = 6e-6  # domain/calibration.py Efficiency.allreduce_latency_s before this fit

# system -> (topology kind, link bytes/s per GPU and direction from the system yaml, the
# servetune catalog GPU names it stands for, NCCL version dir, SGLang version dir)
SYSTEMS: dict[str, tuple[str, float, list[str], str, str]] = {
    "rtx_pro_6000_server": ("pcie", 64e9, ["RTX PRO 6000 Server", "RTX-PRO-6000-Server",
                                           "RTX PRO 6000"], "2.29.2", "0.5.14"),
    "b200_sxm": ("nvlink", 900e9, ["B200"], "2.29.2", "0.5.14"),
    "h200_sxm": ("nvlink", 450e9, ["H200"], "2.29.2", "0.5.14"),
    "h100_sxm": ("nvlink", 450e9, ["H100"], "2.29.2", "0.5.14"),
}


def _rows(path: Path, custom: bool) -> dict[int, list[tuple[float, float]]]:
    """GPU count -> [(bytes, seconds)] of the all-reduce rows of one table."""
    out: dict[int, list[tuple[float, float]]] = {}
    for r in pq.read_table(path).to_pylist():
        if r["op_name"] != "all_reduce":
            continue
        if custom and r.get("backend") != "sglang_graph":
            continue
        if not custom and r.get("nccl_dtype") != "half":
            continue
        out.setdefault(int(r["num_gpus"]), []).append(
            (float(r["message_size"]) * ELEMENT_BYTES, float(r["latency"]) * 1e-3))
    return {n: sorted(v) for n, v in sorted(out.items())}


def predict(params: dict[str, list[float]], s: np.ndarray, n: int, link: float) -> np.ndarray:
    """Seconds of the two-line model for bytes ``s`` over ``n`` GPUs on a ``link`` B/s ring."""
    bus = 2 * (n - 1) / n * s
    pairs = zip(params["latency_s"], params["bus_eff"], strict=True)
    lines = [a + bus / (e * link) for a, e in pairs]
    return np.asarray(np.minimum(*lines))


def fit_one(pts: list[tuple[float, float]], n: int, link: float) -> dict[str, Any]:
    """Fit latencies and bus efficiencies of two protocol lines to one (table, n) curve."""
    s = np.array([p[0] for p in pts])
    t = np.array([p[1] for p in pts])
    bus = 2 * (n - 1) / n * s
    small = t[: max(3, len(t) // 3)]
    big_eff = float(np.max(bus[-3:] / t[-3:]) / link)
    x0 = np.log([float(small.min()), 0.3 * big_eff, float(small.min()) * 3, big_eff])

    def resid(x: np.ndarray) -> np.ndarray:
        a1, e1, a2, e2 = np.exp(x)
        p = {"latency_s": [a1, a2], "bus_eff": [e1, e2]}
        return np.asarray(np.log(predict(p, s, n, link) / t))

    sol = least_squares(resid, x0, loss="soft_l1", f_scale=0.1)
    a1, e1, a2, e2 = (float(v) for v in np.exp(sol.x))
    lines = sorted([(a1, e1), (a2, e2)])  # low-latency line first
    params = {"latency_s": [lines[0][0], lines[1][0]], "bus_eff": [lines[0][1], lines[1][1]]}
    ape = np.abs(predict(params, s, n, link) / t - 1) * 100
    old = bus / link + OLD_LATENCY_S
    old_ratio = old / t
    decode = s <= 4 * 2**20
    return {
        **{k: [round(v, 9 if k == "latency_s" else 4) for v in vals]
           for k, vals in params.items()},
        "rows": len(pts),
        "bytes_range": [int(s.min()), int(s.max())],
        "median_ape_pct": round(float(np.median(ape)), 1),
        "max_ape_pct": round(float(np.max(ape)), 1),
        "decode_sizes_median_ape_pct": round(float(np.median(ape[decode])), 1),
        "baseline_median_ape_pct": round(float(np.median(np.abs(old_ratio - 1) * 100)), 1),
        "baseline_median_ratio": round(float(np.median(old_ratio)), 3),
        "baseline_decode_sizes_median_ratio": round(float(np.median(old_ratio[decode])), 3),
    }


def _topology(systems: dict[str, Any]) -> dict[str, Any]:
    """Median latencies and efficiencies per topology kind, backend and GPU count."""
    out: dict[str, Any] = {}
    for kind in ("nvlink", "pcie"):
        mine = [v for v in systems.values() if v["kind"] == kind]
        for backend in ("nccl", "custom"):
            ns = sorted({int(n) for v in mine for n in v.get(backend, {})})
            for n in ns:
                fits = [v[backend][str(n)] for v in mine if str(n) in v.get(backend, {})]
                out.setdefault(kind, {}).setdefault(backend, {})[str(n)] = {
                    "latency_s": [round(statistics.median(f["latency_s"][k] for f in fits), 9)
                                  for k in (0, 1)],
                    "bus_eff": [round(statistics.median(f["bus_eff"][k] for f in fits), 4)
                                for k in (0, 1)],
                    "systems": len(fits)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wheel-dir", default="/tmp/acc/x", help="the unpacked wheel")
    ap.add_argument("--write", action="store_true", help=f"write {OUT.name}")
    args = ap.parse_args()
    data = Path(args.wheel_dir) / "aiconfigurator_core" / "systems" / "data"
    systems: dict[str, Any] = {}
    files = []
    print(f"{'table':45} {'n':>2} {'rows':>4} {'fit med/max APE %':>18} "
          f"{'decode APE %':>12} {'ring baseline APE % (ratio)':>28}")
    for system, (kind, link, gpus, nccl_v, sgl_v) in SYSTEMS.items():
        entry: dict[str, Any] = {"kind": kind, "link_bytes_per_s": link, "gpus": gpus}
        for backend, rel in (("nccl", f"comm/nccl/{nccl_v}/nccl_perf.parquet"),
                             ("custom", f"comm/sglang/{sgl_v}/custom_allreduce_perf.parquet")):
            path = data / system / rel
            rows = _rows(path, custom=backend == "custom")
            files.append({"file": f"aiconfigurator_core/systems/data/{system}/{rel}",
                          "rows_used": sum(len(v) for v in rows.values())})
            for n, pts in rows.items():
                if backend == "custom" and kind == "pcie" and n > 2:
                    continue  # SGLang runs NCCL there (custom_all_reduce_utils.py:492-498)
                f = fit_one(pts, n, link)
                entry.setdefault(backend, {})[str(n)] = f
                print(f"{system + ' ' + backend:45} {n:>2} {f['rows']:>4} "
                      f"{f['median_ape_pct']:>8.1f} / {f['max_ape_pct']:<7.1f} "
                      f"{f['decode_sizes_median_ape_pct']:>12.1f} "
                      f"{f['baseline_median_ape_pct']:>18.1f} ({f['baseline_median_ratio']:.2f})")
        systems[system] = entry
    result = {
        "note": ("All-reduce model of domain/interconnect.py, fitted by "
                 "benchmarks/allreduce_fit.py (see its docstring for the model). Per system and "
                 "backend (nccl; custom = SGLang's custom all-reduce in a CUDA graph) and GPU "
                 "count: two protocol lines, latency_s (s) and bus_eff (share of the node's link "
                 "bandwidth, bytes/s per GPU and direction, that the ring's 2(n-1)/n bus traffic "
                 "reaches); 'topology' holds the medians per topology kind used for GPUs without a"
                 " table. Errors: absolute percentage error of the fitted model against every row,"
                 " and of the old ring formula 2(n-1)/n x bytes / link + 6 us (baseline; ratio = "
                 "predicted/measured)."),
        "data_source": {
            "wheel": "aiconfigurator-core==0.12.0", "license": "Apache-2.0",
            "wheel_file": "aiconfigurator_core-0.12.0-cp311-abi3-manylinux_2_28_x86_64.whl",
            "row_filter": "op_name == all_reduce; NCCL nccl_dtype == half; custom backend == "
                          "sglang_graph; message_size elements x 2 bytes; latency ms",
            "files": files},
        "date": dt.date.today().isoformat(),
        "command": "PYTHONPATH=. /tmp/comm-venv/bin/python benchmarks/allreduce_fit.py --write",
        "systems": systems,
        "topology": _topology(systems),
    }
    if args.write:
        OUT.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
