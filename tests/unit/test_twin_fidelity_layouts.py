"""The fidelity benchmark's EP / PD rows: CSV row -> config, skip reasons, folds, layout fit.

Literal rows in the wheel's ``silicon_sample.csv`` columns (values copied from real rows); no
simulation runs: the fit is checked on hand-made log-linear surrogates.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from fixtures.benchmarks import load_benchmark

pp = load_benchmark("published_points")  # before twin_fidelity, which imports it by name
tf = load_benchmark("twin_fidelity")

COLUMNS = ("id silicon_data_source backend backend_version model_path system precision mode isl "
           "osl gemm_quant_mode moe_quant_mode batch_size tp_size pp_size attention_dp_size "
           "moe_tp_size moe_ep_size prefill_batch_size prefill_num_workers prefill_tp_size "
           "prefill_pp_size prefill_attention_dp_size prefill_moe_tp_size prefill_moe_ep_size "
           "decode_batch_size decode_num_workers decode_tp_size decode_pp_size "
           "decode_attention_dp_size decode_moe_tp_size decode_moe_ep_size silicon_ttft_ms "
           "silicon_tpot_ms").split()
LAYOUT = ("tp_size", "pp_size", "attention_dp_size", "moe_tp_size", "moe_ep_size")


def csv_row(**kw: str) -> dict[str, str]:
    """A CSV row: DeepSeek-R1 NVFP4 on B200, 1k/1k, every other column empty."""
    r = dict.fromkeys(COLUMNS, "")
    r.update(id="x_c8", backend="sglang", backend_version="0.5.9", mode="agg",
             model_path="deepseek-ai/DeepSeek-R1", system="b200_sxm", precision="fp4",
             gemm_quant_mode="nvfp4", moe_quant_mode="nvfp4", isl="1024", osl="1024",
             silicon_ttft_ms="204.0", silicon_tpot_ms="9.2",
             silicon_data_source="db-dump; silicon_concurrency=8; measured=2026-03-24")
    r.update(kw)
    return r


def layout(prefix: str, *vals: int) -> dict[str, str]:
    return {f"{prefix}{c}": str(v) for c, v in zip(LAYOUT, vals, strict=True)}


def test_aggregated_ep_row_is_one_server_of_tp_x_attention_dp_gpus() -> None:
    row = tf.map_layout_row(csv_row(batch_size="8", **layout("", 8, 1, 1, 1, 8)))
    assert (row.kind, row.tp, row.ep, row.attn_dp, row.conc, row.gpus) == ("ep", 8, 8, 1, 8, 8)
    cfg = row.config
    assert (cfg.tp_size, cfg.ep_size, cfg.moe_tp_size, cfg.gpus) == (8, 8, 1, 8)
    assert cfg.moe_a2a_backend is None  # TP attention: every rank holds every token
    assert (cfg.model, cfg.weights, cfg.gpu) == ("deepseek-r1", "nvfp4", "B200")


def test_tp_column_that_is_moe_tp_times_ep_above_a_node_reads_as_tp_ep() -> None:
    # tp 64 = moe_tp 8 x moe_ep 8: the id says tp8_ep8 and the values repeat the 8-GPU row
    row = tf.map_layout_row(csv_row(id="r_tp8_ep8_1", batch_size="8",
                                    **layout("", 64, 1, 1, 8, 8)))
    assert (row.tp, row.ep, row.gpus) == (8, 8, 8)
    assert "read as TP8 EP8" in row.layout
    # a genuine tp 4 with moe_tp 2 x ep 2 (within a node) stays as the columns say
    row = tf.map_layout_row(csv_row(batch_size="8", **layout("", 4, 1, 1, 2, 2)))
    assert (row.tp, row.ep, row.config.moe_tp_size) == (4, 2, 2)


def test_disaggregated_row_with_worker_counts() -> None:
    # dsr1_gb200_sglang_fp4_disagg_1024x1024_c8192_cfg483: 4 prefill DEP4, 1 decode DEP32
    r = csv_row(mode="disagg", system="gb200", prefill_batch_size="1", prefill_num_workers="4",
                decode_batch_size="256", decode_num_workers="1",
                silicon_data_source="db-dump; silicon_concurrency=8192",
                **layout("prefill_", 1, 1, 4, 1, 4), **layout("decode_", 1, 1, 32, 1, 32))
    row = tf.map_layout_row(r)
    assert (row.kind, row.conc, row.gpus) == ("pd", 8192, 4 * 4 + 32)
    pre, dec = row.pd.prefill, row.pd.decode
    assert (pre.workers, pre.tp_size, pre.attn_dp_size, pre.ep_size) == (4, 4, 4, 4)
    assert (dec.workers, dec.tp_size, dec.attn_dp_size, dec.ep_size) == (1, 32, 32, 32)
    assert pre.moe_a2a_backend == dec.moe_a2a_backend == "deepep"
    roles = [(role, n, c.tp_size, c.schedulers) for role, n, c in row.config.servers()]
    assert roles == [("prefill", 4, 4, 4), ("decode", 1, 32, 32)]
    assert row.config.gpus == 48


def test_disaggregated_row_without_concurrency_takes_decode_batch_x_workers_x_dp() -> None:
    r = csv_row(mode="disagg", model_path="Qwen/Qwen3-32B", system="h100_sxm", precision="fp8",
                gemm_quant_mode="fp8_block", moe_quant_mode="", silicon_data_source="",
                prefill_batch_size="1", prefill_num_workers="8", decode_batch_size="256",
                decode_num_workers="2", **layout("prefill_", 1, 1, 1, 1, 1),
                **layout("decode_", 4, 1, 1, 1, 1))  # a dense model's MoE columns are 1
    row = tf.map_layout_row(r)
    assert (row.conc, row.gpus, row.model, row.weights) == (512, 8 + 8, "qwen3-32b", "fp8")
    assert "decode_batch_size x workers x attn DP = 512" in row.layout


def test_disaggregated_row_without_worker_counts_is_inferred() -> None:
    # with EP: decode tp 48 / moe_tp 12 / ep 4 is twelve TEP4 servers
    r = csv_row(id="2026_03_25_x_c4096_tp4_0_ep4_0_769", mode="disagg", system="gb300",
                silicon_data_source="f.csv; silicon_concurrency=4096",
                **layout("prefill_", 4, 1, 1, 1, 4), **layout("decode_", 48, 1, 1, 12, 4))
    row = tf.map_layout_row(r)
    assert row.kind == "pd-inferred" and row.conc == 4096
    assert (row.pd.prefill.workers, row.pd.prefill.tp_size, row.pd.prefill.ep_size) == (1, 4, 4)
    assert (row.pd.decode.workers, row.pd.decode.tp_size, row.pd.decode.ep_size) == (12, 4, 4)
    assert row.gpus == 52
    # without EP the per-server TP is the one the id names
    r = csv_row(id="2026_03_25_x_c512_tp4_0_ep1_0_773", mode="disagg", system="gb300",
                silicon_data_source="f.csv; silicon_concurrency=512",
                **layout("prefill_", 4, 1, 1, 4, 1), **layout("decode_", 48, 1, 1, 48, 1))
    row = tf.map_layout_row(r)
    assert (row.pd.decode.workers, row.pd.decode.tp_size, row.pd.decode.ep_size) == (12, 4, 1)


@pytest.mark.parametrize(("kw", "reason"), [
    ({"model_path": "Qwen/Qwen3.5-397B-A17B", "precision": "fp8", "gemm_quant_mode": "fp8",
      "moe_quant_mode": "fp8_block"},
     "weights fp8 of qwen3.5-397b-a17b not in the catalog (checkpoints: bf16, nvfp4)"),
    ({"model_path": "org/Unknown-1B"}, "model 'org/Unknown-1B' not in the catalog"),
    ({"system": "mi300x"}, "gpu 'mi300x' not in the GPU catalog"),
    ({"moe_tp_size": "2"}, "moe_tp_size 2 x moe_ep_size 8 != tp_size 8 x attention_dp_size 1"),
])
def test_skip_reasons_are_exact(kw: dict[str, str], reason: str) -> None:
    r = csv_row(batch_size="8", **layout("", 8, 1, 1, 1, 8))
    r.update(kw)
    with pytest.raises(tf.LayoutSkip) as e:
        tf.map_layout_row(r)
    assert str(e.value) == reason


def test_inferred_rows_without_a_readable_layout_are_skipped() -> None:
    r = csv_row(id="2026_04_06_x_c5632_tp72_ep1_1091", mode="disagg", system="gb200",
                **layout("prefill_", 72, 1, 1, 72, 1), **layout("decode_", 72, 1, 1, 72, 1))
    with pytest.raises(tf.LayoutSkip, match="TP72 does not divide the model's 128 attention heads"):
        tf.map_layout_row(r)
    r = csv_row(id="no_layout_in_id", mode="disagg", system="gb200",
                **layout("prefill_", 8, 1, 1, 8, 1), **layout("decode_", 8, 1, 1, 8, 1))
    with pytest.raises(tf.LayoutSkip, match="not a multiple of a per-worker TP"):
        tf.map_layout_row(r)


def hand_row(rid: str, gpu: str, model: str) -> object:
    return tf.Row(id=rid, gpu=gpu, model=model, weights="fp8", tp=8, isl=1024, osl=1024,
                  conc=8, ttft_ms=100.0, tpot_ms=10.0, version="0.5.9", ep=8, kind="ep")


def test_folds_leave_one_gpu_and_one_family_out() -> None:
    rows = [hand_row("a", "B200", "deepseek-r1"), hand_row("b", "B200", "deepseek-v3"),
            hand_row("c", "GB200", "deepseek-r1"), hand_row("d", "H100", "qwen3-32b")]
    folds = {name: ([r.id for r in tr], [r.id for r in te])
             for name, tr, te in tf.layout_folds(rows)}
    assert folds == {"gpu B200": (["c", "d"], ["a", "b"]), "gpu GB200": (["a", "b", "d"], ["c"]),
                     "gpu H100": (["a", "b", "c"], ["d"]),
                     "model deepseek": (["d"], ["a", "b", "c"]),
                     "model qwen3-32b": (["a", "b", "c"], ["d"])}


def sens(row: object, tpot: float, slope: float) -> object:
    return tf.Sensitivity(row=row, pred=tf.Pred(ttft_ms=100.0, tpot_ms=tpot, thr_gpu=1.0),
                          theta={"a2a_latency_s": 1e-5}, d_tpot=np.array([slope]),
                          d_ttft=np.array([0.0]))


def test_layout_fit_recovers_a_hand_computable_constant() -> None:
    # TPOT proportional to the constant (slope 1) and measured at twice the prediction:
    # without a prior pull the fit doubles it; a TTFT that already matches stays out of it
    rows = [sens(hand_row(f"r{i}", "B200", "deepseek-r1"), 5.0, 1.0) for i in range(3)]
    theta, ident = tf.fit_layout(rows, ("a2a_latency_s",), {"a2a_latency_s": 1e-5},
                                 prior_weight=0.0)
    assert ident == ["a2a_latency_s"]
    assert theta["a2a_latency_s"] == pytest.approx(2e-5, rel=1e-3)
    # with the prior weight the value lies between the prior and the rows' value
    theta, _ = tf.fit_layout(rows, ("a2a_latency_s",), {"a2a_latency_s": 1e-5})
    assert 1e-5 < theta["a2a_latency_s"] < 2e-5
    # a constant no row moves is not identified and stays put
    flat = [sens(hand_row("f", "B200", "deepseek-r1"), 5.0, 0.0)]
    theta, ident = tf.fit_layout(flat, ("a2a_latency_s",), {"a2a_latency_s": 1e-5})
    assert ident == [] and theta == {"a2a_latency_s": 1e-5}
    # the surrogate itself: log-linear in the constant
    tpot, _ = rows[0].predict(np.array([math.log(2.0)]))
    assert tpot == pytest.approx(10.0)


def test_layout_fit_never_reads_published_points(tmp_path: Path) -> None:
    pub = tmp_path / "published-points.json"
    pub.write_text('{"points": []}')

    class Reading(tf.Sensitivity):  # a surrogate that tries to read the published points
        def predict(self, x: np.ndarray) -> tuple[float, float]:
            pp.read_points(pub)
            return super().predict(x)

    row = Reading(row=hand_row("r", "B200", "deepseek-r1"),
                  pred=tf.Pred(ttft_ms=100.0, tpot_ms=5.0, thr_gpu=1.0),
                  theta={"a2a_latency_s": 1e-5}, d_tpot=np.array([1.0]), d_ttft=np.array([0.0]))
    with pytest.raises(pp.PublishedReadDuringFit):
        tf.fit_layout([row], ("a2a_latency_s",), {"a2a_latency_s": 1e-5})


def test_layout_constants_are_only_stepped_where_the_layout_uses_them() -> None:
    tep = tf.map_layout_row(csv_row(batch_size="8", **layout("", 8, 1, 1, 1, 8)))
    assert [n for n in tf.LAYOUT_NAMES if tf.exercises(tep, n)] == ["expert_imbalance"]
    dep = tf.map_layout_row(csv_row(
        mode="disagg", system="gb200", prefill_batch_size="1", prefill_num_workers="4",
        decode_batch_size="256", decode_num_workers="1",
        **layout("prefill_", 1, 1, 4, 1, 4), **layout("decode_", 1, 1, 32, 1, 32)))
    # DeepEP on both groups (auto: normal kernels on the prefill, low-latency on the decode)
    assert [n for n in tf.LAYOUT_NAMES if tf.exercises(dep, n)] == [
        "a2a_eta", "a2a_latency_s", "a2a_ll_latency_s", "expert_imbalance", "pd_transfer_eta",
        "pd_transfer_latency_s"]
