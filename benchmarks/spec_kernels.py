"""Fit the speculative-decoding kernel constants of the twin on the aiconfigurator wheel's tables.

Data: ``aiconfigurator-core`` 0.12.0 (Apache-2.0), read as a zip (``--wheel``), SGLang 0.5.14
kernel tables under ``aiconfigurator_core/systems/data/<system>/``:

- ``moe/sglang/0.5.14/moe_perf.parquet``: one fused MoE layer (``latency`` in ms) per
  ``num_tokens``, shape (hidden, inter, experts, topk), dtype and ``moe_tp_size``; rows with
  ``moe_ep_size == 1`` and ``distribution == balanced`` (uniform routing, as the twin assumes).
- ``sparse_attention/sglang/0.5.14/glm5_mqa_logits_module_perf.parquet`` and
  ``glm5_topk_module_perf.parquet`` (``score_mode == flat``): GLM-5's DSA lightning indexer
  (DeepGEMM fp8 MQA logits, then the fused top-k) per ``batch_size`` sequences, ``isl`` query
  tokens per sequence and ``step`` cached tokens.

Constants (the model each is a parameter of is in :mod:`domain.costmodel`):

- ``moe_gemm_half_tokens`` ``h``: the grouped GEMM of an MoE layer at ``n`` tokens runs
  ``max((n k + h E_t) f / (F eta), E_t w / (B eta_m))`` -- every touched expert (``E_t`` of them)
  pays the compute of at least ``h`` more token rows (the kernel's M tile), i.e. its compute
  efficiency is ``eta x m / (m + h)`` at ``m = n k / E_t`` tokens per touched expert. Fitted with
  ``eta``, ``eta_m`` and a fixed latency per table by least squares on ``log(pred / measured)``.
- ``spec_index_query_share`` ``r``: the share of the indexer's one-query-token time that is paid
  again per extra query token (scoring and top-k run per query row; the cached index keys are
  read once per sequence): ``T(q) = T(1) x (1 - r + r q)``, least squares on
  ``isl in {4, 8, 16}`` at ``batch >= 64``, ``step >= 1024`` (the verify regime; ``isl == 1``
  rows take another kernel path and are noisy). This is the share of a kernel that reads the
  index keys once per sequence; SGLang's verify expands every draft token into its own decode
  row (``nsa_backend.py``), so the twin's default is 1.0 and this number is the reference.

Needs pyarrow + numpy + scipy, kept out of the product's runtime::

    python3 -m venv /tmp/spec-venv && /tmp/spec-venv/bin/pip install pyarrow numpy scipy
    PYTHONPATH=. /tmp/spec-venv/bin/python benchmarks/spec_kernels.py --wheel WHEEL
"""

from __future__ import annotations

import argparse
import io
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from scipy.optimize import least_squares

DATA = "aiconfigurator_core/systems/data"
# system -> (HBM B/s, {dtype: dense tensor FLOP/s}) from the wheel's systems/<system>.yaml
SYSTEMS: dict[str, tuple[float, dict[str, float]]] = {
    "b200_sxm": (7.7e12, {"nvfp4": 9.0e15, "fp8_block": 4.5e15, "bfloat16": 2.25e15}),
    "h200_sxm": (4.8e12, {"fp8_block": 1.979e15, "bfloat16": 0.989e15}),
}
# bytes per weight incl. block scales: nvfp4 (e2m1 + e4m3 scale per 16), fp8 (128x128 blocks)
BYTES = {"nvfp4": 0.5625, "fp8_block": 1.0 + 4 / (128 * 128), "bfloat16": 2.0}
# (hidden, inter, experts, topk): GLM-5 and DeepSeek-V3 routed experts (data/models/catalog.json)
SHAPES = ((6144, 2048, 256, 8), (7168, 2048, 256, 8))


def _table(wheel: zipfile.ZipFile, rel: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = pq.read_table(io.BytesIO(wheel.read(f"{DATA}/{rel}"))).to_pylist()
    return rows


def fit_moe(wheel: zipfile.ZipFile, system: str, dtype: str, tp: int) -> dict[str, float]:
    """Fit ``(eta, eta_m, h, latency)`` of the MoE model above on one system/dtype/TP table."""
    bw, flops = SYSTEMS[system]
    rows = [r for r in _table(wheel, f"{system}/moe/sglang/0.5.14/moe_perf.parquet")
            if (r["hidden_size"], r["inter_size"], r["num_experts"], r["topk"]) in SHAPES
            and r["moe_dtype"] == dtype and r["moe_tp_size"] == tp and r["moe_ep_size"] == 1
            and r["distribution"] == "balanced" and r["num_tokens"] <= 4096]
    n = np.array([r["num_tokens"] for r in rows], float)
    hid = np.array([r["hidden_size"] for r in rows], float)
    inter = np.array([r["inter_size"] for r in rows], float) / tp
    e = np.array([r["num_experts"] for r in rows], float)
    k = np.array([r["topk"] for r in rows], float)
    meas = np.array([r["latency"] for r in rows]) * 1e-3
    touched = e * (1 - (1 - k / e) ** n)
    row_flops = 2 * 3 * hid * inter
    w = 3 * hid * inter * BYTES[dtype]

    def pred(x: np.ndarray) -> np.ndarray:
        eta, eta_m, h, lat = np.exp(x)
        comp = (n * k + h * touched) * row_flops / (flops[dtype] * eta)
        return np.asarray(np.maximum(comp, touched * w / (bw * eta_m)) + lat)

    def res(x: np.ndarray) -> np.ndarray:
        return np.asarray(np.log(pred(x) / meas))

    lo, hi = np.log([0.02, 0.3, 0.1, 1e-7]), np.log([1.0, 1.0, 1000.0, 1e-4])
    fit = least_squares(res, np.log([0.3, 0.7, 32.0, 1e-5]), bounds=(lo, hi), loss="soft_l1",
                        f_scale=0.1)
    eta, eta_m, h, lat = np.exp(fit.x)
    err = np.abs(pred(fit.x) / meas - 1)
    # the same rows without the tile term (h = 0): what the roofline predicted before
    x0 = least_squares(lambda x: res(np.array([x[0], x[1], -30.0, x[2]])),
                       np.log([0.3, 0.7, 1e-5]), bounds=(lo[[0, 1, 3]], hi[[0, 1, 3]]),
                       loss="soft_l1", f_scale=0.1).x
    err0 = np.abs(pred(np.array([x0[0], x0[1], -30.0, x0[2]])) / meas - 1)
    return {"rows": float(len(rows)), "eta": eta, "eta_m": eta_m, "half_tokens": h,
            "latency_us": lat * 1e6, "median_ape": float(np.median(err) * 100),
            "median_ape_h0": float(np.median(err0) * 100)}


def fit_index_share(wheel: zipfile.ZipFile, system: str) -> dict[str, float]:
    """Fit ``r`` of ``T(q) = T1 (1 - r + r q)`` per (batch, step) cell of logits + top-k."""
    base = f"{system}/sparse_attention/sglang/0.5.14/"
    tot: dict[tuple[int, int, int], float] = {}
    for name in ("glm5_mqa_logits_module_perf", "glm5_topk_module_perf"):
        for r in _table(wheel, base + name + ".parquet"):
            if r.get("score_mode", "flat") != "flat":
                continue
            key = (r["batch_size"], r["step"], r["isl"])
            tot[key] = tot.get(key, 0.0) + r["latency"]
    shares = []
    for b in (64, 128, 256):
        for step in (1024, 2048, 4096):
            q = np.array([4.0, 8.0, 16.0])
            t = np.array([tot.get((b, step, int(i)), np.nan) for i in q])
            if np.isnan(t).any():
                continue
            slope, icpt = np.polyfit(q, t, 1)
            shares.append(slope / (slope + icpt))  # per-query part of T(1) = icpt + slope
    return {"cells": float(len(shares)), "share_median": float(np.median(shares)),
            "share_min": float(np.min(shares)), "share_max": float(np.max(shares))}


def main() -> None:
    """Print the fitted constants per table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path, required=True)
    args = ap.parse_args()
    with zipfile.ZipFile(args.wheel) as wheel:
        for system, dtype, tp in (("b200_sxm", "nvfp4", 4), ("b200_sxm", "nvfp4", 8),
                                  ("b200_sxm", "fp8_block", 4), ("b200_sxm", "fp8_block", 8),
                                  ("h200_sxm", "fp8_block", 8)):
            f = fit_moe(wheel, system, dtype, tp)
            print(f"moe {system} {dtype} tp{tp}: " + ", ".join(
                f"{k} {v:.3g}" for k, v in f.items()))
        try:
            s = fit_index_share(wheel, "b200_sxm")
            print("indexer b200_sxm: " + ", ".join(f"{k} {v:.3g}" for k, v in s.items()))
        except KeyError as exc:
            print(f"indexer: no table ({exc})")


if __name__ == "__main__":
    main()
