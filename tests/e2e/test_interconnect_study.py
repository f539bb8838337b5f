"""Issue 19's interconnect done-when, end to end on the twin: GLM-5-NVFP4 at TP8 on 8x RTX PRO
6000 (PCIe, two NUMA nodes) spends >= 40 % of its decode step time in all-reduce at saturation;
the same study on 8x B200 (NVLink) <= 15 %. The RTX PRO 6000 report says "uncalibrated" with
the twin's error band.

The studies are the shipped ones (studies/glm5-rtxpro6000.yaml, studies/glm5-b200-nvfp4.yaml)
cut to a baseline-only budget, run in this process (tests/fixtures/cli_runner.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from fixtures.cli import TRACE, write
from fixtures.cli_runner import invoke
from fixtures.paths import REPO

RTX_PRO_6000 = "RTX-PRO-6000"  # the catalog's Server Edition on issue 19's node (data/gpus)


def _tiny(study_file: str) -> dict:
    s = yaml.safe_load((REPO / "studies" / study_file).read_text())
    s.update(knobs={"max_running_requests": ["unset", 64]},
             saturation={"isl": 2048, "osl": 256, "concurrency": 256, "duration_s": 5},
             replay={"trace": str(TRACE), "format": "mooncake", "start_s": 600,
                     "duration_s": 10, "time_scale": 0.25},
             finalists=1, sweep_concurrency=[8], budget={"max_trials": 1, "patience": 1},
             validation={"tune_admission": False})
    return s


def _baseline_share(report: str) -> float:
    """The baseline row's "decode all-reduce" cell of the Trials table, as a fraction."""
    block = report[report.index("## Trials\n"):]
    rows = [ln for ln in block.splitlines() if ln.startswith("| ")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    base = next(r for r in rows[1:] if "| baseline |" in r)  # the separator is "|---|"
    cell = [c.strip() for c in base.strip("|").split("|")][header.index("decode all-reduce")]
    return float(cell.rstrip("%")) / 100


@pytest.mark.parametrize(("study_file", "gpu"), [("glm5-rtxpro6000.yaml", RTX_PRO_6000),
                                                 ("glm5-b200-nvfp4.yaml", "B200")])
def test_glm5_tp8_all_reduce_share_by_interconnect(tmp_path: Path, study_file: str,
                                                   gpu: str) -> None:
    study = write(tmp_path, "study.yaml", _tiny(study_file))
    r = invoke("run", str(study), "--run-id", "r1", tmp=tmp_path,
               env={"SERVETUNE_BRAINS": "deterministic", "ANTHROPIC_API_KEY": None})
    assert r.returncode == 0, r.stderr[-3000:]
    report = (tmp_path / "runs" / "r1" / "report.md").read_text()
    share = _baseline_share(report)
    assert "- All-reduce " in report and "of decode step time at saturation (TP 8)" in report
    if gpu == RTX_PRO_6000:
        assert share >= 0.40
        assert (f"GPU `{RTX_PRO_6000}`: uncalibrated (default twin constants; twin error on "
                "calibrated GPUs (B200, H100, H200): TPOT median 7 %") in report
    else:
        assert share <= 0.15
        assert "GPU `B200`: calibrated" in report
