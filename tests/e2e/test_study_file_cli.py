"""Loading a study file through the CLI: a YAML alias bomb is refused before it expands, and
numbers and booleans are taken as written (``true`` is not 1, ``"8"`` is not 8, ``8.0`` is not
an integer)."""

from __future__ import annotations

import resource
import subprocess
import sys
import time

import pytest
import yaml
from fixtures.cli import tiny_study, write
from fixtures.cli_runner import invoke
from typer.testing import CliRunner

from domain.errors import ConfigInvalid
from servetune.cli import app
from servetune.study_file import load_study


def _bomb(levels: int = 9, width: int = 10) -> str:
    """A study whose one knob's values are ``width ** levels`` strings through nested anchors."""
    study = tiny_study()
    del study["knobs"]
    items = [f"&l0 [{', '.join(['fa3'] * width)}]"]
    items += [f"&l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return yaml.safe_dump(study) + f"knobs:\n  attention_backend: [{', '.join(items)}]\n"


def _limit_memory() -> None:  # the bomb must not take the shared machine down before the fix
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def test_alias_bomb_is_refused_at_once_naming_the_anchor(tmp_path):
    text = _bomb()
    assert len(text) < 2500  # a small file ...
    p = write(tmp_path, "bomb.yaml", text)
    # the CLI's own start (imports) takes seconds on a loaded machine: the timeout bounds the
    # bomb (53 s into a MemoryError before the fix), the CPU time below the refusal itself
    r = subprocess.run([sys.executable, "-m", "servetune.cli", "run", str(p)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60, preexec_fn=_limit_memory)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and r.stderr.startswith("error:")
    assert len(r.stderr.strip().splitlines()) <= 3  # one line, soft-wrapped at most
    assert "bomb.yaml" in r.stderr and "&l8" in r.stderr and "10,000" in r.stderr
    assert not (tmp_path / "runs").exists()
    t0 = time.process_time()
    with pytest.raises(ConfigInvalid, match="&l8"):
        load_study(p)
    assert time.process_time() - t0 < 1.0  # the bound, in CPU seconds


def test_a_few_aliases_still_load(tmp_path):
    """Anchors that expand to little are ordinary YAML: the study loads (and fails only later,
    at a check that has nothing to do with aliases)."""
    study = yaml.safe_dump(tiny_study(replay={"trace": "no/such/trace.jsonl",
                                              "duration_s": 10}))
    study = study.replace("attention_backend:\n  - unset\n  - fa3\n",
                          "attention_backend: &ab [unset, fa3]\n  schedule_policy: [fcfs, lpm]\n")
    assert "&ab" in study
    p = write(tmp_path, "ok.yaml", study + "# uses *ab nowhere else\n")
    r = invoke("run", str(p), tmp=tmp_path)
    assert r.returncode == 2 and "trace file not found" in r.stderr, r.stderr


# ---------------------------------------------------------------- strict numbers and booleans
def _replace(d: dict, dotted: str, value) -> dict:
    *path, last = dotted.split(".")
    node = d
    for k in path:
        node = node[k]
    node[last] = value
    return d


LAX = {  # study field -> a value pydantic's lax mode would coerce, and the field's path
    "knob-bool-as-int": ("knobs.max_running_requests", [True], "knobs.max_running_requests"),
    "knob-str-as-int": ("knobs.max_running_requests", ["64"], "knobs.max_running_requests"),
    "knob-float-as-int": ("knobs.chunked_prefill_size", [4096.0], "knobs.chunked_prefill_size"),
    "knob-int-as-bool": ("knobs.disable_radix_cache", [1], "knobs.disable_radix_cache"),
    "knob-bool-as-float": ("knobs.hicache_ratio", [True], "knobs.hicache_ratio"),
    "knob-tp-size-true": ("knobs.tp_size", [True], "knobs.tp_size"),
    "baseline-tp-size-true": ("baseline.tp_size", True, "tp_size"),
    "baseline-bool-as-int": ("baseline.max_running_requests", True, "max_running_requests"),
    "gpu-count-true": ("gpu_count", True, "gpu_count"),
    "concurrency-str": ("saturation.concurrency", "256", "saturation.concurrency"),
    "max-trials-true": ("budget.max_trials", True, "budget.max_trials"),
    "duration-bool": ("saturation.duration_s", True, "saturation.duration_s"),
    "tune-admission-str": ("validation.tune_admission", "yes", "validation.tune_admission"),
    "seed-float": ("search.seed", 3.0, "search.seed"),
}


@pytest.mark.parametrize("case", sorted(LAX))
def test_study_numbers_and_booleans_are_strict(tmp_path, monkeypatch, case):
    dotted, value, field = LAX[case]
    study = tiny_study(validation={"tune_admission": True}, search={"brain": "ovat", "seed": 0})
    p = write(tmp_path, "lax.yaml", _replace(study, dotted, value))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SERVETUNE_LESSONS_DIR", str(tmp_path / "lessons"))
    r = CliRunner().invoke(app, ["run", str(p)])
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert r.stderr.startswith("error:") and field in r.stderr, r.stderr
    assert "Traceback" not in r.output
    assert not (tmp_path / "runs").exists()


def test_slo_is_met_only_within_the_target_with_every_request_served():
    from domain.study import SLO
    slo = SLO(ttft_p99_ms=500.0)
    assert slo.met(500.0, 0) and slo.met(12.0, 0)
    assert not slo.met(500.1, 0)
    assert not slo.met(100.0, 1)  # a failed request misses it whatever the latency
    assert not slo.met(None, 0)  # no first token at all
