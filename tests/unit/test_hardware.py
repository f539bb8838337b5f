"""The GPU catalog as data, the spec validator a user's GPU goes through, and the registry."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fixtures.gpu_grid import GRID_GPUS, GRID_MODELS

from domain.config import ServingConfig
from domain.errors import ConfigInvalid
from domain.hardware import (
    CATALOG_FILE,
    GPU,
    GPUS,
    canonical_gpu_name,
    get_gpu,
    gpu_from_spec,
    gpu_spec,
    load_catalog,
    register_gpu,
    unregister_gpu,
)

# The issue's list (plus the three main had) -- every one must ship.
REQUIRED = ("B200", "H200", "H100", "A100-40GB", "A100-80GB", "H100-PCIe", "L4", "L40", "L40S",
            "A10G", "RTX-4090", "RTX-5090", "RTX-PRO-6000", "RTX-PRO-6000-WS", "B300", "GB200",
            "GB300")


def _spec(**over: Any) -> dict[str, Any]:
    """A valid L40S-like user spec, with ``over`` replacing keys."""
    spec: dict[str, Any] = {
        "name": "my-gpu", "sm_major": 8, "sm_minor": 9, "hbm_gb": 48, "hbm_bytes_per_s": 864e9,
        "flops": {"bf16": 362e12, "fp8": 733e12}, "interconnect": {"kind": "pcie", "pcie_gen": 4},
        "host_mem_gb_per_node": 512,
    }
    spec.update(over)
    return spec


@pytest.fixture
def registered() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for n in names:
        unregister_gpu(n)


def test_catalog_ships_every_gpu_the_issue_names_in_order() -> None:
    assert list(GPUS) == list(REQUIRED)
    assert next(iter(GPUS)) == "B200"  # the knob domain's base config takes the first


@pytest.mark.parametrize("name", REQUIRED)
def test_every_entry_names_its_sources_and_round_trips(name: str) -> None:
    gpu = GPUS[name]
    assert gpu.source and gpu.sources, f"{name}: no source"
    assert all(s.url.startswith("https://") and s.name for s in gpu.sources)
    assert gpu.arch == f"sm{gpu.sm_major * 10 + gpu.sm_minor}"
    assert gpu.tdp_w is not None or "board power not published" in gpu.source
    assert "bf16" in gpu.flops and "fp8" in gpu.flops
    assert gpu_from_spec(gpu_spec(gpu), "round trip") == gpu
    assert gpu_from_spec(json.loads(json.dumps(gpu_spec(gpu))), "json") == gpu


def test_the_catalog_page_lists_every_gpu() -> None:
    page = (CATALOG_FILE.parents[2] / "docs" / "catalog.md").read_text()
    gpus = page[page.index("## GPUs"):page.index("## Interconnect")]
    for name in GPUS:
        g = GPUS[name]
        assert f"| `{name}` | {g.sm_major}.{g.sm_minor} | {g.hbm_gb:g} GB |" in gpus, name


def test_the_test_grid_covers_every_sm_of_the_catalog() -> None:
    sms = {(GPUS[n].sm_major, GPUS[n].sm_minor) for n in GPUS}
    assert {(GPUS[n].sm_major, GPUS[n].sm_minor) for n in GRID_GPUS} == sms
    assert set(GRID_GPUS) <= set(GPUS) and GRID_GPUS[:3] == ("B200", "H200", "H100")


def test_main_numbers_are_unchanged() -> None:
    b200, h200, h100 = GPUS["B200"], GPUS["H200"], GPUS["H100"]
    assert (b200.arch, b200.sm_major, b200.sm_minor, b200.hbm_gb, b200.hbm_bytes_per_s) == (
        "sm100", 10, 0, 180.0, 7.7e12)
    assert b200.flops == {"bf16": 2250e12, "fp8": 4500e12, "fp4": 9000e12}
    assert b200.link_bytes_per_s == 900e9 and b200.interconnect.nic_bytes_per_s == 50e9
    for g, hbm, bw in ((h200, 141.0, 4.8e12), (h100, 80.0, 3.35e12)):
        assert (g.arch, g.sm_major, g.hbm_gb, g.hbm_bytes_per_s) == ("sm90", 9, hbm, bw)
        assert g.flops == {"bf16": 989e12, "fp8": 1979e12}
        assert g.link_bytes_per_s == 450e9
    for g in (b200, h200, h100):
        assert g.host_link_bytes_per_s == 64e9 and g.host_mem_gb_per_node == 2000.0
        assert g.interconnect.kind == "nvlink" and g.gpus_per_node == 8
        assert g.interconnect.domain_size == 8


def test_rtx_pro_6000_is_the_issues_machine() -> None:
    g = get_gpu("RTX-PRO-6000")
    assert (g.sm_major, g.sm_minor, g.arch, g.hbm_gb, g.hbm_bytes_per_s, g.tdp_w) == (
        12, 0, "sm120", 96.0, 1.792e12, 600.0)
    ic = g.interconnect
    assert (ic.kind, ic.pcie_gen, ic.pcie_lanes, ic.p2p, ic.nvlink_bytes_per_s) == (
        "pcie", 5, 16, True, 0.0)
    assert (ic.gpus_per_node, ic.numa_nodes, ic.cross_numa_bytes_per_s) == (8, 2, 40e9)
    # dense FLOP/s of aiconfigurator-core 0.12.0 systems/rtx_pro_6000_server.yaml
    assert g.flops == {"bf16": 467.8e12, "fp8": 935.6e12, "fp4": 1871.2e12}
    assert ic.pcie_bytes_per_s == pytest.approx(3.938e9 * 16)  # PCIe 5.0: 3.938 GB/s a lane


def test_nvl72_domains_span_hosts_of_four() -> None:
    for name in ("GB200", "GB300"):
        ic = GPUS[name].interconnect
        assert (ic.gpus_per_node, ic.nvlink_domain, ic.domain_size) == (4, 72, 72)
    assert GPUS["GB300"].sm_minor == 3 and GPUS["B300"].arch == "sm103"


def test_fp8_on_ampere_is_the_bf16_rate_and_required_from_ada() -> None:
    a100 = GPUS["A100-80GB"]
    assert not a100.fp8_native and a100.flops["fp8"] == a100.flops["bf16"] == 312e12
    assert GPUS["L40S"].fp8_native and GPUS["L40S"].flops["fp8"] == 733e12
    gpu = gpu_from_spec(_spec(sm_minor=6, flops={"bf16": 70e12}), "t")
    assert gpu.flops["fp8"] == 70e12 and gpu.arch == "sm86"


@pytest.mark.parametrize(("name", "want"), [
    ("h200", "H200"), ("H200", "H200"), ("b200_sxm", "B200"), ("rtx pro 6000", "RTX-PRO-6000"),
    ("rtx_pro_6000_server", "RTX-PRO-6000"), ("l40s", "L40S"), ("gb200 nvl72", "GB200"),
    ("a100-80gb", "A100-80GB"), ("RTX-PRO-6000-ws", "RTX-PRO-6000-WS"),
])
def test_lookups_are_case_insensitive_and_take_aliases(name: str, want: str) -> None:
    assert canonical_gpu_name(name) == want
    assert get_gpu(name) is GPUS[want] and name in GPUS


def test_a_config_stores_the_catalog_spelling() -> None:
    cfg = ServingConfig(model="llama-3.1-8b", gpu="h100", weights="bf16")
    assert cfg.gpu == "H100"
    assert cfg == ServingConfig(model="llama-3.1-8b", gpu="H100", weights="bf16")


@pytest.mark.parametrize("name", ["-B200", "", "B 200", "b200x", "rtxpro6000"])
def test_near_names_are_not_lookups(name: str) -> None:
    assert GPUS.resolve(name) is None and name not in GPUS


def test_unknown_gpu_is_one_line_listing_the_catalog() -> None:
    with pytest.raises(ConfigInvalid) as e:
        get_gpu("X900")
    (line,) = e.value.violations
    assert "'X900'" in line and "RTX-PRO-6000" in line and "docs/catalog.md#gpus" in line


def test_a_registered_gpu_is_found_but_joins_no_catalog_grid(registered: list[str]) -> None:
    gpu = register_gpu(gpu_from_spec(_spec(name="Lab-GPU"), "study.yaml: gpu"))
    registered.append(gpu.name)
    assert get_gpu("lab_gpu") is gpu and "LAB-GPU" in GPUS
    assert gpu.name not in list(GPUS) and len(GPUS) == len(REQUIRED)
    assert gpu.source == "user spec (study.yaml: gpu)"
    assert gpu.host_link_bytes_per_s == pytest.approx(1.969e9 * 16)  # Gen4 x16 by default
    assert ServingConfig(model="llama-3.1-8b", gpu="lab-gpu", weights="bf16").gpu == "Lab-GPU"
    unregister_gpu(gpu.name)
    assert "Lab-GPU" not in GPUS


def test_a_registered_gpu_shadows_the_shipped_one(registered: list[str]) -> None:
    mine = register_gpu(GPUS["H100"].model_copy(update={"hbm_gb": 40.0}))
    registered.append(mine.name)
    assert get_gpu("h100").hbm_gb == 40.0 and GPUS["H100"] is mine


@pytest.mark.parametrize(("over", "field", "says"), [
    ({"hbm_bytes_per_s": -1.0}, "hbm_bytes_per_s", "must be > 0"),
    ({"hbm_gb": 10_000}, "hbm_gb", "must be <= 1024"),
    ({"flops": {"bf16": 1e19, "fp8": 1e15}}, "flops.bf16", "must be <= 1e+17"),
    ({"sm_major": 13}, "sm_major", "must be <= 12"),
    ({"sm_major": 6}, "sm_major", "must be >= 7"),
    ({"hbm": 48}, "hbm", "unknown key"),
    ({"arch": "sm90"}, "arch", "'sm89'"),
    ({"flops": {"bf16": 362e12}}, "flops.fp8", "FP8 tensor cores"),
    ({"flops": {"fp8": 1e12}}, "flops", "'bf16' rate"),
    ({"flops": {"bf16": 1e12, "fp8": 1e12, "fp6": 1e12}}, "flops.fp6", "unknown dtype"),
    ({"interconnect": {"kind": "nvlink"}}, "interconnect", "nvlink_bytes_per_s > 0"),
    ({"interconnect": {"kind": "pcie", "nic_bytes_per_s": -5}}, "interconnect.nic_bytes_per_s",
     "must be > 0"),
    ({"interconnect": {"kind": "infiniband"}}, "interconnect.kind", "'nvlink' or 'pcie'"),
    ({"interconnect": {"kind": "pcie", "gpus_per_node": 6, "numa_nodes": 4}}, "interconnect",
     "split evenly"),
    ({"tdp_w": 0}, "tdp_w", "must be > 0"),
    ({"hbm_gb": "lots"}, "hbm_gb", "valid number"),
])
def test_a_bad_spec_is_one_line_naming_the_field(over: dict[str, Any], field: str,
                                                 says: str) -> None:
    with pytest.raises(ConfigInvalid) as e:
        gpu_from_spec(_spec(**over), "gpu.yaml")
    (line,) = e.value.violations
    assert line.startswith(f"gpu (gpu.yaml): {field}") and says in line, line
    assert "\n" not in line


@pytest.mark.parametrize("field", ["name", "sm_major", "hbm_gb", "hbm_bytes_per_s", "flops",
                                   "interconnect", "host_mem_gb_per_node"])
def test_a_missing_required_field_is_named(field: str) -> None:
    spec = _spec()
    del spec[field]
    with pytest.raises(ConfigInvalid) as e:
        gpu_from_spec(spec, "gpu.yaml")
    assert any(line.startswith(f"gpu (gpu.yaml): {field}") and "missing" in line
               for line in e.value.violations), e.value.violations


def test_every_problem_gets_its_line_and_a_non_mapping_one() -> None:
    with pytest.raises(ConfigInvalid) as e:
        gpu_from_spec(_spec(hbm_gb=-1, hbm_bytes_per_s=-1, wat=1), "s")
    assert len(e.value.violations) == 3
    with pytest.raises(ConfigInvalid, match="is a mapping of fields"):
        gpu_from_spec([1, 2], "s")  # type: ignore[arg-type]


def test_a_broken_catalog_file_is_refused(tmp_path: Path) -> None:
    doc = json.loads(CATALOG_FILE.read_text())
    doc["gpus"][1]["hbm_gb"] = -1
    bad = tmp_path / "catalog.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ConfigInvalid, match=r"catalog.json entry 1\): hbm_gb"):
        load_catalog(bad)
    doc["gpus"][1] = doc["gpus"][0]
    bad.write_text(json.dumps(doc))
    with pytest.raises(ConfigInvalid, match="listed twice"):
        load_catalog(bad)


def test_numbers_yaml_reads_as_strings_still_validate() -> None:
    # PyYAML reads 1.792e12 (no sign in the exponent) as the string "1.792e12"
    gpu = gpu_from_spec(_spec(hbm_bytes_per_s="1.792e12", flops={"bf16": "362e12",
                                                                  "fp8": "733e12"}), "gpu.yaml")
    assert gpu.hbm_bytes_per_s == 1.792e12 and gpu.flops["fp8"] == 733e12


def test_constructing_a_gpu_directly_checks_the_same_bounds() -> None:
    with pytest.raises(ValueError, match="hbm_gb"):
        GPU.model_validate({**gpu_spec(GPUS["L4"]), "hbm_gb": 10_000})


def test_the_model_grid_covers_every_architecture_and_weight_format():
    """GRID_MODELS (tests/fixtures/gpu_grid.py) holds one catalog model per architecture and
    every checkpoint key the catalog ships, so grids over it miss no family."""
    from domain.models import CATALOG, get_model

    assert set(GRID_MODELS) <= set(CATALOG)
    archs = {get_model(m).architecture for m in CATALOG}
    assert {get_model(m).architecture for m in GRID_MODELS} == archs
    keys = {k for m in CATALOG for k in get_model(m).checkpoints}
    assert {k for m in GRID_MODELS for k in get_model(m).checkpoints} == keys
