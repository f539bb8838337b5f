"""A user's GPU from a spec file or inline mapping (servetune/gpu_file.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from domain.errors import ConfigInvalid
from domain.hardware import GPUS, get_gpu, gpu_spec, unregister_gpu
from servetune.gpu_file import load_gpu_file, resolve_gpu

# As a user writes it: PyYAML reads 1.792e12 (no sign in the exponent) as a string; the spec
# still validates (pydantic parses the number).
YAML_SPEC = """\
name: lab-rtx6000
sm_major: 12
hbm_gb: 96
hbm_bytes_per_s: 1.792e12
flops: {bf16: 467.8e12, fp8: 935.6e12, fp4: 1871.2e12}
interconnect: {kind: pcie, pcie_gen: 5, numa_nodes: 2, cross_numa_bytes_per_s: 40e9}
host_mem_gb_per_node: 1536
tdp_w: 600
"""


@pytest.fixture
def cleanup() -> Iterator[None]:
    yield
    for name in ("lab-rtx6000", "inline-gpu"):
        unregister_gpu(name)


def test_a_yaml_spec_file_loads_and_registers(tmp_path: Path, cleanup: None) -> None:
    (tmp_path / "gpu.yaml").write_text(YAML_SPEC)
    gpu = resolve_gpu("gpu.yaml", base=tmp_path)
    assert (gpu.arch, gpu.hbm_bytes_per_s, gpu.interconnect.cross_numa_bytes_per_s) == (
        "sm120", 1.792e12, 40e9)
    assert get_gpu("LAB-RTX6000") is gpu
    assert gpu.source == f"user spec ({tmp_path / 'gpu.yaml'})"


def test_a_json_spec_file_round_trips_a_catalog_entry(tmp_path: Path) -> None:
    path = tmp_path / "l40s.json"
    path.write_text(json.dumps(gpu_spec(GPUS["L40S"])))
    assert load_gpu_file(path) == GPUS["L40S"]


def test_inline_mapping_and_catalog_names(cleanup: None) -> None:
    spec = {**gpu_spec(GPUS["L4"]), "name": "inline-gpu", "sources": [], "aliases": []}
    gpu = resolve_gpu(spec, where="study.yaml: gpu")
    assert get_gpu("inline-gpu") is gpu and gpu.hbm_gb == 24.0
    assert resolve_gpu("rtx_pro_6000") is GPUS["RTX-PRO-6000"]


@pytest.mark.parametrize(("text", "says"), [
    ("name: [unclosed", "not valid YAML or JSON"),
    ("- 1\n- 2\n", "is a mapping of fields"),
    (YAML_SPEC.replace("hbm_gb: 96", "hbm_gb: 10000"), "hbm_gb = 10000: must be <= 1024"),
    (YAML_SPEC + "hbm_gb: 48\n", "given twice"),
])
def test_a_bad_file_is_one_line_naming_the_file(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "gpu.yaml"
    path.write_text(text)
    with pytest.raises(ConfigInvalid) as e:
        load_gpu_file(path)
    (line,) = e.value.violations
    assert str(path) in line and says in line, line


def test_missing_file_folder_and_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigInvalid, match="not found"):
        resolve_gpu("nope.yaml", base=tmp_path)
    with pytest.raises(ConfigInvalid, match="is a folder"):
        load_gpu_file(tmp_path)
    with pytest.raises(ConfigInvalid, match="unknown GPU 'X900'"):
        resolve_gpu("X900")
