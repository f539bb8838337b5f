"""Issue 21's layout study end to end on the twin: studies/dsv3-h200-layouts.yaml (DeepSeek-V3
FP8 on 16x H200 over tensor parallelism, attention DP, expert parallelism and a 1P1D split)
cut to a three-launch budget runs to a winner, every launched config obeys the coupled layout
rules, the winner carries a parallel layout, and its manifests (``servetune sandbox
render-config``) pass kubernetes-validate strict and the sandbox policy.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from fixtures.cli import ledger_rows, write
from fixtures.cli_runner import invoke
from fixtures.paths import REPO, TRACES

from domain.config import ServingConfig
from sandbox.policy import Policy, enforce, gpu_demand
from sandbox.validate import validate

NS = "tune-dsv3"


def _tiny() -> dict:
    """The shipped study, 5 s saturation runs and a 20 s replay window: three launches."""
    s = yaml.safe_load((REPO / "studies" / "dsv3-h200-layouts.yaml").read_text())
    s.update(saturation={"isl": 1024, "osl": 256, "concurrency": 1024, "duration_s": 5},
             replay={"trace": str(TRACES / "AzureLLMInferenceTrace_conv.csv"),
                     "format": "azure", "start_s": 1800, "duration_s": 20, "time_scale": 4.0},
             finalists=1, sweep_concurrency=[64], budget={"max_trials": 3, "patience": 3},
             validation={"tune_admission": False})
    return s


def _layout(c: ServingConfig) -> bool:
    """Whether ``c`` uses a parallel layout beyond plain TP replicas on one node each."""
    return (c.attn_dp_size > 1 or c.ep_size > 1 or c.pp_size > 1 or c.dp_size > 1
            or c.pd is not None or c.nnodes(8) > 1)


def test_layout_study_runs_to_a_layout_winner_whose_manifests_deploy(tmp_path: Path) -> None:
    study = write(tmp_path, "study.yaml", _tiny())
    r = invoke("run", str(study), "--run-id", "r1", tmp=tmp_path,
               env={"SERVETUNE_BRAINS": "deterministic", "ANTHROPIC_API_KEY": None})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [(status, ServingConfig.model_validate(json.loads(body)["config"]))
            for _, _, status, _, body in ledger_rows(tmp_path / "runs" / "r1" / "ledger.sqlite")]
    for _, c in rows:  # the coupling held for every config the brains built
        assert c.tp_size % c.attn_dp_size == 0 and c.gpus <= 16
        assert c.ep_size == 1 or (c.moe_a2a_backend == "deepep" and c.ep_size == c.tp_size)
    winners = [c for status, c in rows if status == "winner"]
    assert len(winners) == 1, [s for s, _ in rows]
    win = winners[0]
    assert _layout(win), win.set_fields()
    # the winner's manifests, as an operator renders them
    cfg = write(tmp_path, "winner.json", win.model_dump_json())
    rc = invoke("sandbox", "render-config", "--config", str(cfg), "--name", "winner",
                "--namespace", NS, "--router", "--study-name", "dsv3-h200-layouts",
                tmp=tmp_path)
    assert rc.returncode == 0, rc.stderr[-3000:]
    objs = list(yaml.safe_load_all(rc.stdout))
    assert validate(objs) == []
    policy = Policy(NS, win.gpus, lws=True)
    enforce(objs, policy)
    assert gpu_demand(objs, policy) == win.gpus
    engines = [o for o in objs if o["kind"] in ("Deployment", "LeaderWorkerSet")
               and not o["metadata"]["name"].endswith("-router")]
    args = [a for o in engines for a in json.dumps(o["spec"]).split('"')]
    if win.attn_dp_size > 1:
        assert "--attn-dp-size" in args
    if win.ep_size > 1:
        assert "--ep-size" in args and "--moe-a2a-backend" in args
