"""The fidelity benchmark's fit bookkeeping: at-bound reasons and leave-one-model-out folds.

No test runs the fit: the folds are split on hand-made rows and the at-bound check reads the
committed calibration file.
"""

from __future__ import annotations

import json
import math

from fixtures.benchmarks import load_benchmark

from domain.calibration import CALIBRATION_PATH, UNCALIBRATED

tf = load_benchmark("twin_fidelity")


def row(model: str, rid: str, version: str = "0.5.9") -> object:
    return tf.Row(id=rid, gpu="H200", model=model, weights="fp8", tp=8, isl=1024, osl=1024,
                  conc=8, ttft_ms=100.0, tpot_ms=10.0, version=version)


def test_every_committed_value_at_a_bound_has_a_reason() -> None:
    data = json.loads(CALIBRATION_PATH.read_text())
    reasons = data["fit"]["at_bounds"]
    at = 0
    for gpu, block in data["gpus"].items():
        for name in tf.FIT_NAMES:
            lo, hi = tf.BOUNDS[name]
            if any(abs(math.log(block[name] / b)) <= 5e-3 for b in (lo, hi)):
                at += 1
                assert name in reasons.get(gpu, {}), f"{gpu} {name} = {block[name]}: no reason"
                assert len(reasons[gpu][name]) > 40
    # and no reason for a value that is not at a bound
    listed = sum(len(v) for v in reasons.values())
    assert listed == at


def test_at_bounds_names_the_bound_and_the_inherited_constants() -> None:
    lo = tf.BOUNDS["eta_compute"][0]
    hi = tf.BOUNDS["request_fixed_s"][1]
    eff = UNCALIBRATED.updated({"eta_compute": lo, "request_fixed_s": hi})
    out = tf.at_bounds({"H100": eff}, {"H100": ["eta_compute"]})
    assert set(out["H100"]) == {"eta_compute", "request_fixed_s"}
    assert out["H100"]["eta_compute"].startswith(f"at its lower bound {lo:g}")
    assert "inherited" in out["H100"]["request_fixed_s"]
    assert tf.at_bounds({"H200": UNCALIBRATED}) == {}  # the priors sit inside every bound


def test_lomo_folds_hold_out_one_family_each() -> None:
    rows = [row("deepseek-v3", "a"), row("deepseek-r1", "b"), row("qwen3-32b", "c"),
            row("llama-3.1-8b", "d"), row("llama-3.1-8b", "e", version="")]
    folds = tf.lomo_folds(rows)
    assert [f for f, _, _ in folds] == ["deepseek", "llama-3.1-8b", "qwen3-32b"]
    for fam, train, test in folds:
        assert {tf.family(r.model) for r in test} == {fam}
        assert fam not in {tf.family(r.model) for r in train}
        assert sorted(r.id for r in train + test) == ["a", "b", "c", "d", "e"]
    deepseek = folds[0]
    assert [r.id for r in deepseek[2]] == ["a", "b"]  # V3 and R1: one architecture, one fold
