"""Fit the twin's expert-parallel constants on the aiconfigurator wheel's DeepEP and MoE tables.

Data: ``aiconfigurator-core`` 0.12.0 (Apache-2.0), read as a zip (``--wheel``), under
``aiconfigurator_core/systems/data/<system>/``:

- ``comm/sglang/0.5.12/wideep_deepep_normal_perf.parquet``: DeepEP normal-mode dispatch and
  combine (``dispatch_transmit_us``, ``combine_transmit_us``) per ``num_token`` tokens per rank,
  hidden size, top-k, experts and SM count, one node (``node_num`` 1: EP = the node's GPUs,
  ``num_gpus_per_node`` of ``systems/<system>.yaml``). Rows at 20 SMs, the DeepEP ``Buffer``
  default SGLang keeps without ``--deepep-config`` (``layers/moe/token_dispatcher/deepep.py:
  356-359``).
- ``comm/sglang/0.5.12/wideep_deepep_ll_perf.parquet``: the low-latency kernels
  (``dispatch_avg_t_us``, ``combine_avg_t_us``), ``num_token`` <= 1024.
- ``moe/sglang/0.5.10/wideep_generation_moe_perf.parquet`` and ``wideep_context_moe_perf``
  (H200, DeepSeek-V3 shape, DeepEP MoE kernels, ``moe_ep_size`` 4-256): the expert GEMMs of one
  rank under ``uniform`` routing and under skewed ``power_law_<a>`` routing.

Constants (the model each is a parameter of is :func:`domain.layout_cost.a2a_seconds`):

- ``a2a_eta`` / ``a2a_latency_s`` (normal) and ``a2a_ll_latency_s`` (low-latency): dispatch +
  combine of ``T`` tokens per rank takes ``lat + T x copies x hidden x (d + 2) / (eta x link)``,
  ``copies`` the off-rank copies per token (:func:`domain.layout_cost.remote_copies`: one per
  destination rank in normal mode, one per routed expert in low-latency mode), ``d`` the fp8
  dispatch bytes per value with its 1/128 scale (1.03125; SGLang's default wire format), combine
  bf16, ``link`` the NVLink bandwidth per GPU and direction of the system file
  (``intra_node_bw``). Least squares on ``log(pred / measured)`` per system and mode; the
  median and 90th-percentile absolute errors are printed. ``--copies-per-expert`` fits normal
  mode with the low-latency copy count instead (the check that normal kernels deduplicate).
- ``expert_imbalance`` (no EPLB) and ``expert_imbalance_eplb``: the median over token counts
  >= 1,024 of ``latency(power_law_a) / latency(uniform)`` at EP 8 -- how much longer the
  busiest rank's expert GEMMs run under skewed routing. The prior takes ``power_law_1.01``
  (aiconfigurator's default skew: the wheel's ``sdk/config.py:37`` and
  ``sdk/models/deepseek.py:170``) without EPLB and the mildest table skew ``power_law_0.6``
  for EPLB (a static rebalancing leaves a residual spread step to step).

Needs pyarrow + numpy + scipy, kept out of the product's runtime::

    python3 -m venv /tmp/spec-venv && /tmp/spec-venv/bin/pip install pyarrow numpy scipy
    PYTHONPATH=. /tmp/spec-venv/bin/python benchmarks/a2a_kernels.py --wheel WHEEL
"""

from __future__ import annotations

import argparse
import io
import math
import re
import statistics
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from scipy.optimize import least_squares

DATA = "aiconfigurator_core/systems/data"
SYSTEMS_DIR = "aiconfigurator_core/systems"
DEEPEP = "comm/sglang/0.5.12"
FP8_DISPATCH = 1.0 + 4.0 / 128  # domain/layout_cost.py FP8_DISPATCH_BYTES
COMBINE = 2.0
DEFAULT_SMS = 20


def _table(wheel: zipfile.ZipFile, rel: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = pq.read_table(io.BytesIO(wheel.read(f"{DATA}/{rel}"))).to_pylist()
    return rows


def _system(wheel: zipfile.ZipFile, system: str) -> tuple[int, float]:
    """(GPUs per node, NVLink bytes/s per GPU and direction) from ``systems/<system>.yaml``."""
    text = wheel.read(f"{SYSTEMS_DIR}/{system}.yaml").decode()

    def field(name: str) -> float:
        hit = re.search(rf"^\s*{name}:\s*([0-9.eE+]+)", text, re.M)
        if hit is None:
            raise KeyError(f"{system}.yaml: {name}")
        return float(hit.group(1))

    return int(field("num_gpus_per_node")), field("intra_node_bw")


def copies(mode: str, ep: int, experts: int, topk: int) -> float:
    """Off-rank copies per token (domain/layout_cost.py:remote_copies, restated for numpy)."""
    if mode == "low_latency" or experts < ep:
        return topk * (ep - 1) / ep
    per = experts // ep
    if topk > experts - per:
        return float(ep - 1)
    return (ep - 1) * (1.0 - math.comb(experts - per, topk) / math.comb(experts, topk))


def fit_a2a(wheel: zipfile.ZipFile, system: str, mode: str,
            per_expert: bool = False) -> dict[str, float]:
    """Fit ``(eta, latency)`` of dispatch + combine on one system's DeepEP table of ``mode``."""
    ep, link = _system(wheel, system)
    name = "wideep_deepep_ll_perf" if mode == "low_latency" else "wideep_deepep_normal_perf"
    rows = _table(wheel, f"{system}/{DEEPEP}/{name}.parquet")
    if mode == "normal":
        rows = [r for r in rows if r["dispatch_sms"] == DEFAULT_SMS]
        meas = np.array([r["dispatch_transmit_us"] + r["combine_transmit_us"] for r in rows])
    else:
        meas = np.array([r["dispatch_avg_t_us"] + r["combine_avg_t_us"] for r in rows])
    kind = "low_latency" if per_expert else mode
    wire = np.array([r["num_token"] * copies(kind, ep, r["num_experts"], r["num_topk"])
                     * r["hidden_size"] * (FP8_DISPATCH + COMBINE) for r in rows])
    meas = meas * 1e-6

    def pred(x: np.ndarray) -> np.ndarray:
        eta, lat = np.exp(x)
        return np.asarray(lat + wire / (eta * link))

    fit = least_squares(lambda x: np.log(pred(x) / meas), np.log([0.5, 3e-5]),
                        bounds=(np.log([0.01, 1e-7]), np.log([1.5, 1e-2])), loss="soft_l1",
                        f_scale=0.1)
    eta, lat = np.exp(fit.x)
    err = np.abs(pred(fit.x) / meas - 1) * 100
    return {"rows": float(len(rows)), "ep": float(ep), "eta": float(eta),
            "latency_us": float(lat * 1e6), "median_ape": float(np.median(err)),
            "p90_ape": float(np.percentile(err, 90))}


def imbalance(wheel: zipfile.ZipFile, system: str = "h200_sxm", ep: int = 8
              ) -> dict[str, dict[str, float]]:
    """Median latency ratio skewed / uniform routing at ``ep`` and >= 1,024 tokens per table."""
    out: dict[str, dict[str, float]] = {}
    for name in ("wideep_generation_moe_perf", "wideep_context_moe_perf"):
        rows = [r for r in _table(wheel, f"{system}/moe/sglang/0.5.10/{name}.parquet")
                if r["moe_ep_size"] == ep and r["num_tokens"] >= 1024]
        uniform = {r["num_tokens"]: r["latency"] for r in rows if r["distribution"] == "uniform"}
        ratios: dict[str, list[float]] = {}
        for r in rows:
            if r["distribution"] != "uniform" and r["num_tokens"] in uniform:
                ratios.setdefault(r["distribution"], []).append(
                    r["latency"] / uniform[r["num_tokens"]])
        out[name] = {d: statistics.median(v) for d, v in sorted(ratios.items())}
    return out


def main() -> None:
    """Print the fitted constants per table and their errors against it."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path, required=True)
    ap.add_argument("--copies-per-expert", action="store_true",
                    help="fit normal mode with one copy per routed expert (no deduplication)")
    args = ap.parse_args()
    with zipfile.ZipFile(args.wheel) as wheel:
        for system in ("h100_sxm", "h200_sxm", "b200_sxm", "b300_sxm", "gb200", "gb300"):
            for mode in ("normal", "low_latency"):
                try:
                    f = fit_a2a(wheel, system, mode, per_expert=args.copies_per_expert)
                except KeyError as exc:
                    print(f"a2a {system} {mode}: no table ({exc})")
                    continue
                print(f"a2a {system} {mode}: " + ", ".join(
                    f"{k} {v:.3g}" for k, v in f.items()))
        for table, ratios in imbalance(wheel).items():
            print(f"imbalance h200_sxm ep8 {table}: " + ", ".join(
                f"{d} {v:.3f}" for d, v in ratios.items()))


if __name__ == "__main__":
    main()
