"""All-reduce over the node's topology (domain/interconnect.py) and its hook in the cost model.

The rules are SGLang 0.5.23's (checked against the pinned source's lines the module cites);
the constants are the fit in domain/data/allreduce-fit.json (benchmarks/allreduce_fit.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures.pinned_source import pinned_tree  # noqa: F401  (the session fixture)

import domain.hardware as hw
from domain.calibration import calibration_line, error_band, is_calibrated
from domain.config import ServingConfig
from domain.costmodel import build_cost_model
from domain.fit import fit
from domain.interconnect import (
    FIT_PATH,
    V1_MAX_BYTES,
    V2_MAX_BYTES,
    allreduce_seconds,
    backend_for,
    ring_link_bytes_per_s,
)

MiB = 2**20
RTX_PRO_6000 = "RTX-PRO-6000"  # the catalog's Server Edition on issue 19's node (data/gpus)
GLM5_HIDDEN_BYTES = 6144 * 2  # one token's bf16 activations of GLM-5


def pcie(**kw: object) -> hw.Interconnect:
    return hw.Interconnect(kind="pcie", **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------- which implementation
def test_nvlink_groups_run_the_custom_all_reduce_up_to_16_mib() -> None:
    nv = hw.get_gpu("B200").interconnect
    assert backend_for(128 * GLM5_HIDDEN_BYTES, 8, nv) == "custom"
    assert backend_for(V2_MAX_BYTES, 8, nv) == "custom"
    assert backend_for(V2_MAX_BYTES + 16, 8, nv) == "nccl"
    assert backend_for(4096, 8, nv, custom_allowed=False) == "nccl"  # --disable-custom-all-reduce
    assert backend_for(4096 + 8, 8, nv) == "nccl"  # not a multiple of 16 bytes
    assert backend_for(4096, 16, nv) == "nccl"  # leaves the 8-GPU NVLink domain


def test_pcie_runs_the_custom_all_reduce_only_for_two_gpus_with_p2p() -> None:
    assert backend_for(4096, 2, pcie()) == "custom"
    assert backend_for(V1_MAX_BYTES, 2, pcie()) == "custom"
    assert backend_for(V1_MAX_BYTES + 16, 2, pcie()) == "nccl"
    assert backend_for(4096, 2, pcie(p2p=False)) == "nccl"
    assert backend_for(4096, 4, pcie()) == "nccl"
    assert backend_for(4096, 8, pcie()) == "nccl"


def test_the_cited_rules_are_in_the_pinned_source(
        pinned_tree: Path,  # noqa: F811  (the fixture imported above)
) -> None:
    srt = pinned_tree / "sglang" / "srt"

    def line(rel: str, n: int) -> str:
        return (srt / rel).read_text().splitlines()[n - 1]

    dc = "distributed/device_communicators/"
    assert "_MAX_CAR_SIZE = 8192 * 1024" in line(dc + "custom_all_reduce.py", 42)
    assert "_SUPPORTED_WORLD_SIZES = [2, 4, 6, 8]" in line(dc + "custom_all_reduce.py", 41)
    assert "world_size == 2 or self.full_nvlink" in line(dc + "custom_all_reduce.py", 272)
    assert "world_size > 2 and not full_nvlink" in line(dc + "custom_all_reduce_utils.py", 492)
    assert "can_p2p" in line(dc + "custom_all_reduce_utils.py", 504)
    assert "return full_nvlink is True" in line(dc + "custom_all_reduce_v2.py", 597)
    assert "SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2 = EnvBool(True)" in line("environ.py", 1532)
    assert "SGLANG_CUSTOM_ALL_REDUCE_V2_MAX_SIZE_KB = EnvInt(16 * 1024)" in line("environ.py",
                                                                              1535)
    assert "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE = EnvBool(False)" in line("environ.py", 1539)


# ---------------------------------------------------------------- the ring's slowest link
def test_the_numa_hop_is_the_slowest_link_only_when_the_group_spans_numa_nodes() -> None:
    ic = pcie(numa_nodes=2, cross_numa_bytes_per_s=40e9)
    gen5 = ic.pcie_bytes_per_s
    assert gen5 == pytest.approx(63.0e9, rel=1e-3)  # PCIe Gen5 x16 per direction
    assert ring_link_bytes_per_s(4, ic) == gen5  # GPUs 0-3: one NUMA node
    assert ring_link_bytes_per_s(8, ic) == 40e9
    assert ring_link_bytes_per_s(8, pcie(numa_nodes=1)) == gen5
    assert ring_link_bytes_per_s(2, pcie(p2p=False)) == gen5 / 2  # staged through host memory
    assert ring_link_bytes_per_s(16, ic) == 40e9  # the NUMA hop is slower than the 50 GB/s NIC
    assert ring_link_bytes_per_s(16, pcie(nic_bytes_per_s=25e9)) == 25e9  # leaves the host
    nvl72 = hw.Interconnect(kind="nvlink", nvlink_bytes_per_s=900e9, gpus_per_node=4,
                            nvlink_domain=72)
    assert ring_link_bytes_per_s(16, nvl72) == 900e9  # across hosts inside the NVLink domain


def test_tp8_across_numa_nodes_costs_more_than_on_one_node() -> None:
    two = hw.get_gpu(RTX_PRO_6000)
    assert two.interconnect.numa_nodes == 2 and two.interconnect.cross_numa_bytes_per_s == 40e9
    one = two.model_copy(update={"interconnect": two.interconnect.model_copy(
        update={"numa_nodes": 1, "cross_numa_bytes_per_s": None})})
    nbytes = 128 * GLM5_HIDDEN_BYTES
    assert allreduce_seconds(nbytes, 8, two) > 1.3 * allreduce_seconds(nbytes, 8, one)
    assert allreduce_seconds(nbytes, 4, two) == allreduce_seconds(nbytes, 4, one)


# ---------------------------------------------------------------- the fit
def test_fit_beats_the_old_ring_formula_on_every_table() -> None:
    data = json.loads(FIT_PATH.read_text())
    assert data["data_source"]["license"] == "Apache-2.0"
    assert data["data_source"]["wheel"] == "aiconfigurator-core==0.12.0"
    tables = [(s, b, n, f) for s, v in data["systems"].items() for b in ("nccl", "custom")
              for n, f in v.get(b, {}).items()]
    assert len(tables) == 22
    for system, backend, n, f in tables:
        where = f"{system} {backend} {n}"
        assert f["median_ape_pct"] <= 10, where
        assert f["median_ape_pct"] < f["baseline_median_ape_pct"], where
    # SGLang runs NCCL on more than two PCIe GPUs: no custom-AR constants there
    assert set(data["systems"]["rtx_pro_6000_server"]["custom"]) == {"2"}


def test_allreduce_seconds_by_hand_from_the_fitted_constants() -> None:
    p = json.loads(FIT_PATH.read_text())["systems"]["b200_sxm"]["nccl"]["8"]
    b200 = hw.get_gpu("B200")
    nbytes = 64 * MiB  # above the custom all-reduce's 16 MiB: NCCL
    bus = 2 * 7 / 8 * nbytes
    want = min(a + bus / (e * 900e9) for a, e in zip(p["latency_s"], p["bus_eff"], strict=True))
    assert allreduce_seconds(nbytes, 8, b200) == pytest.approx(want)
    # the wheel measured 67,108,864 bf16 elements (128 MiB) at 398.4 us (b200_sxm nccl 2.29.2)
    assert allreduce_seconds(128 * MiB, 8, b200) == pytest.approx(398.4e-6, rel=0.05)
    assert allreduce_seconds(nbytes, 8, b200, ideal=True) == pytest.approx(bus / 900e9)
    assert allreduce_seconds(nbytes, 1, b200) == 0.0


def test_a_gpu_without_a_table_uses_its_topology_kind() -> None:
    b200 = hw.get_gpu("B200")
    other = b200.model_copy(update={"name": "my-nvlink-gpu"})
    nbytes = 128 * GLM5_HIDDEN_BYTES
    # the NVLink medians (over B200, H200, H100) differ from B200's own constants ...
    assert allreduce_seconds(nbytes, 8, other) != allreduce_seconds(nbytes, 8, b200)
    # ... and stay within a factor 2 of them
    assert 0.5 < allreduce_seconds(nbytes, 8, other) / allreduce_seconds(nbytes, 8, b200) < 2
    # GPU counts between the fitted 2, 4, 8 interpolate; past 8 the latency grows
    assert (allreduce_seconds(nbytes, 4, other) < allreduce_seconds(nbytes, 6, other)
            < allreduce_seconds(nbytes, 8, other))
    nvl72 = other.model_copy(update={"interconnect": hw.Interconnect(
        kind="nvlink", nvlink_bytes_per_s=900e9, gpus_per_node=4, nvlink_domain=72)})
    assert allreduce_seconds(4096, 16, nvl72) > allreduce_seconds(4096, 8, nvl72)


# ---------------------------------------------------------------- the cost model
@pytest.mark.parametrize(("gpu", "low", "high"), [(RTX_PRO_6000, 0.40, 1.0), ("B200", 0.0, 0.15)])
def test_glm5_nvfp4_tp8_decode_all_reduce_share(gpu: str, low: float, high: float) -> None:
    config = ServingConfig(model="glm-5", gpu=gpu, weights="nvfp4", tp_size=8)
    cost = build_cost_model(config, fit(config))
    batch = 256  # a saturated decode batch at ISL 2048 / OSL 512
    share = cost.decode_allreduce_time(batch) / cost.decode_time(batch, batch * 2300)
    assert low <= share <= high
    # 78 layers x 2 all-reduces of batch x 6144 x 2 bytes, NCCL over the NUMA hop on PCIe
    one = allreduce_seconds(batch * GLM5_HIDDEN_BYTES, 8, hw.get_gpu(gpu))
    assert cost.decode_allreduce_time(batch) == pytest.approx(2 * 78 * one)


# ---------------------------------------------------------------- calibration
def test_uncalibrated_gpus_quote_the_error_band_measured_on_calibrated_ones() -> None:
    assert is_calibrated("B200") and is_calibrated("H100") and is_calibrated("H200")
    assert not is_calibrated(RTX_PRO_6000)
    band = error_band()
    assert band is not None and band.gpus == ("B200", "H100", "H200")
    assert band.fitted_tpot_pct == pytest.approx(7.259, abs=0.01)  # twin-calibration.json fit
    line = calibration_line(RTX_PRO_6000)
    assert line.startswith("uncalibrated (default twin constants; twin error on calibrated GPUs")
    assert "TPOT median 7 %, throughput median 10 % over 234 measured rows" in line
    assert calibration_line("B200").startswith("calibrated")


def test_a_user_spec_named_like_a_calibrated_gpu_is_uncalibrated() -> None:
    """B200's fitted constants hold for the shipped B200: a user's SM 12 PCIe card registered
    under the name "B200" runs with the default constants and is reported uncalibrated."""
    from domain.calibration import efficiency
    from domain.hardware import GPUS, register_gpu, unregister_gpu

    fitted = efficiency("B200")
    register_gpu(GPUS[RTX_PRO_6000].model_copy(update={"name": "B200"}))
    try:
        assert not is_calibrated("B200") and calibration_line("B200").startswith("uncalibrated")
        assert efficiency("B200") == efficiency(RTX_PRO_6000) != fitted
    finally:
        unregister_gpu("B200")
    assert is_calibrated("B200") and efficiency("B200") == fitted
