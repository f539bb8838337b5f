"""Issue 19's bad-input matrix through the CLI: each bad model config, GPU spec or SGLang version
gives ``servetune run`` and ``servetune check`` ONE ``error:`` line naming the field, exit 2.

In this process (fixtures/cli_runner.py:invoke): each refusal comes before any study work.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from fixtures.cli import tiny_study
from fixtures.cli_runner import invoke
from fixtures.user_model import (
    H20_SPEC,
    clean_registry,  # noqa: F401 (a fixture)
    write_model_dir,
)

pytestmark = pytest.mark.usefixtures("clean_registry")
SERVE = ["--", "sglang", "serve", "--model-path", "lab/x", "--tp-size", "1"]


def one_line(r: subprocess.CompletedProcess[str], *words: str) -> str:
    """The one ``error:`` line of a refused command, holding every word of ``words``."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert "Traceback" not in r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def run_study(tmp: Path, **over) -> subprocess.CompletedProcess[str]:
    s = tiny_study(gpu="H200", gpu_count=1, baseline={"tp_size": 1, "weights": "bf16"},
                   knobs={"tp_size": [1]})
    s.update(over)
    (tmp / "s.yaml").write_text(yaml.safe_dump(s))
    return invoke("run", "s.yaml", "--brains", "deterministic", tmp=tmp)


BAD_CONFIGS = {  # name -> (config.json changes, words the line holds)
    "missing-field": ({"num_hidden_layers": None}, ("num_hidden_layers",)),
    "unknown-model-type": ({"model_type": "rwkv7", "architectures": ["Rwkv7ForCausalLM"]},
                           ("rwkv7",)),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_a_bad_model_config(tmp_path: Path, case: str) -> None:
    over, words = BAD_CONFIGS[case]
    d = write_model_dir(tmp_path, case, **over)
    line = one_line(run_study(tmp_path, model=f"./{case}"), *words)
    assert "s.yaml: model" in line
    one_line(invoke("check", "--model-config", str(d), "--gpu", "H200", *SERVE, tmp=tmp_path),
             "--model-config", *words)


BAD_GPUS = {  # name -> (spec changes, the field the line names)
    "negative-bandwidth": ({"hbm_bytes_per_s": -3.35e12}, "hbm_bytes_per_s"),
    "10-TB-of-HBM": ({"hbm_gb": 10_000.0}, "hbm_gb"),
    "negative-nvlink": ({"interconnect": {"kind": "nvlink", "nvlink_bytes_per_s": -1.0}},
                        "interconnect.nvlink_bytes_per_s"),
}


@pytest.mark.parametrize("case", BAD_GPUS)
def test_an_impossible_gpu_spec(tmp_path: Path, case: str) -> None:
    over, field = BAD_GPUS[case]
    spec = {**H20_SPEC, "name": f"bad-{case}", **over}
    one_line(run_study(tmp_path, gpu=spec), "s.yaml: gpu", field)
    (tmp_path / "gpu.json").write_text(json.dumps(spec))
    one_line(run_study(tmp_path, gpu="gpu.json"), "gpu.json", field)
    one_line(invoke("check", "--gpu", "gpu.json", "--gpus", "1", *SERVE, tmp=tmp_path),
             "gpu.json", field)


def test_a_missing_gpu_file_and_a_gpu_file_that_is_no_mapping(tmp_path: Path) -> None:
    one_line(run_study(tmp_path, gpu="gpus/none.yaml"), "gpu: GPU file", "not found")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    one_line(invoke("check", "--gpu", "list.yaml", *SERVE, tmp=tmp_path),
             "--gpu: GPU file", "expected a mapping")


def test_an_unknown_sglang_version(tmp_path: Path) -> None:
    one_line(run_study(tmp_path, model="llama-3.1-8b", engine_version="0.4.0"),
             "engine_version", "0.4.0")
    one_line(invoke("check", "--gpu", "H200", "--version", "0.4.0", "--", "sglang", "serve",
                    "--model-path", "meta-llama/Llama-3.1-8B-Instruct", tmp=tmp_path), "0.4.0")
