"""Issue 19's new user: a study on a config.json no catalog holds, on a GPU given inline, runs
end to end on the twin (``servetune run`` in a subprocess), and its resume reads the study again
(in this process, the registries emptied as a fresh process has them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from fixtures.cli import ledger_rows, run_deterministic
from fixtures.cli_runner import invoke
from fixtures.paths import FIXTURES
from fixtures.user_model import (
    H20_SPEC,
    LAB_MOE_PARAMS,
    clean_registry,  # noqa: F401 (a fixture)
    write_model_dir,
)

from domain import hardware, models
from domain.hardware import get_gpu
from domain.models import get_model
from servetune.study_file import load_study

BAILIAN = FIXTURES / "qwen_bailian_tiny.jsonl"


@pytest.mark.usefixtures("clean_registry")
def test_a_config_json_on_an_inline_gpu_runs_and_resumes(tmp_path: Path) -> None:
    write_model_dir(tmp_path / "models", "lab-moe")
    study = {
        "name": "lab-moe-h20", "gpu_count": 1,
        "model": {"hf_config": "models/lab-moe/config.json", "name": "lab-moe",
                  "checkpoints": {"bf16": "lab/Lab-MoE", "fp8": "lab/Lab-MoE-FP8"}},
        "gpu": H20_SPEC,
        "baseline": {"tp_size": 1, "weights": "bf16"},
        "knobs": {"weights": ["bf16", "fp8"]},
        "saturation": {"isl": 1024, "osl": 128, "concurrency": 32, "duration_s": 5},
        "replay": {"trace": str(BAILIAN), "format": "bailian", "start_s": 0, "duration_s": 100},
        "slo": {"ttft_p99_ms": 8000}, "finalists": 1, "sweep_concurrency": [8],
        "budget": {"max_trials": 2, "patience": 2},
        "validation": {"tune_admission": False},
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    load_study(path)  # this process reads the run's ledger below: it knows the model too
    r = run_deterministic(tmp_path, path, "lab")
    assert r.returncode == 0, r.stdout + r.stderr
    report = (tmp_path / "runs" / "lab" / "report.md").read_text()
    assert "lab-moe" in report and "H20" in report
    assert "uncalibrated (default twin constants" in report  # no fitted efficiencies for H20
    rows = ledger_rows(tmp_path / "runs" / "lab" / "ledger.sqlite")
    assert rows and all('"model":"lab-moe"' in body.replace(" ", "") for *_, body in rows)
    assert any('"weights":"fp8"' in body.replace(" ", "") for *_, body in rows)
    # the resume, in this process with the model and GPU forgotten as in a fresh one: reading
    # the study registers them again, and the digest it checks the run folder against matches
    models._REGISTERED.pop("lab-moe")
    models.MODELS.pop("lab-moe")
    hardware._REGISTERED.pop("H20")
    again = invoke("run", str(path), "--run-id", "lab", tmp=tmp_path,
                   env={"SERVETUNE_BRAINS": "deterministic", "ANTHROPIC_API_KEY": None})
    assert again.returncode == 0 and "already complete" in again.stdout, again.stderr
    assert get_model("lab-moe").total_params == LAB_MOE_PARAMS and get_gpu("H20").hbm_gb == 96
