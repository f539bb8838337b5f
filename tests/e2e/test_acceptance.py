"""Noise-gated acceptance: twin noise, the bootstrap gate, the analyst's use of it, and a study.

Units check the pieces by hand-computable numbers; the graph runs show on a tiny study that a
noise-free twin decides as the plain threshold rule does, and that with 5 % twin noise and 3
repeats a gain inside the noise is not kept while a large one is, with the decision and its
interval in the ledger and the report.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from fixtures.cli import tiny_study, write
from fixtures.lesson_invariants import assert_no_contradicted
from mcp import Client

from agents.analyst import Analyst, Verdict, acceptance, check_verdict, gates
from domain.acceptance import BLOCKS, AcceptDecision, block_rates, decide, pick_samples
from domain.config import ServingConfig
from domain.ledger import Ledger
from domain.metrics import RequestRecord, summarize
from domain.twin.noise import noise_factor, scale_records
from graph.run import run_study
from mcp_servers.bench.ops import BenchService
from mcp_servers.bench.server import build_server as bench_server
from mcp_servers.cluster.server import build_server as cluster_server
from mcp_servers.cluster.twin import TwinBackend
from servetune.report import render_report
from servetune.study_file import load_study

REPO = Path(__file__).resolve().parents[2]


def rec(arrival: float, first: float, gaps: list[float], out: int | None = None) -> RequestRecord:
    itl = np.asarray(gaps, dtype=float)
    n = out if out is not None else len(gaps) + 1
    return RequestRecord(arrival_s=arrival, input_tokens=10, output_tokens=n,
                         first_token_s=first, finish_s=first + float(itl.sum()), itl_s=itl)


# ------------------------------------------------------------------------------ twin noise

def test_noise_factor_is_one_without_noise_reproducible_and_has_the_asked_spread():
    assert noise_factor("cfg", 0, 0.0) == 1.0 and noise_factor("cfg", 7, 0.0, seed=3) == 1.0
    a = noise_factor("cfg", 1, 5.0)
    assert a == noise_factor("cfg", 1, 5.0) != noise_factor("cfg", 2, 5.0)
    assert a != noise_factor("cfg", 1, 5.0, seed=1) and a != noise_factor("other", 1, 5.0)
    draws = [noise_factor(f"c{i}", 0, 5.0) for i in range(4000)]
    assert 0.046 < statistics.stdev(draws) < 0.054  # sd ~ 5 % (lognormal, sigma 0.05)
    assert abs(statistics.fmean(draws) - math.exp(0.05 ** 2 / 2)) < 0.003
    with pytest.raises(ValueError):
        noise_factor("cfg", -1, 5.0)


def test_scaled_records_divide_throughput_by_the_factor():
    recs = [rec(0.0, 1.0, [0.5, 0.5]), rec(0.0, 2.0, [1.0])]
    base = summarize(recs, gpus=2)
    scaled = summarize(scale_records(recs, 1.25), gpus=2)
    assert base.output_tok_s_per_gpu == pytest.approx(5 / 3 / 2)  # 5 tokens over 3 s, 2 GPUs
    assert scaled.output_tok_s_per_gpu == pytest.approx(base.output_tok_s_per_gpu / 1.25)
    assert scaled.ttft_ms.p50 == pytest.approx(base.ttft_ms.p50 * 1.25)
    assert scale_records(recs, 1.0) == recs


# ------------------------------------------------------------------------------ block rates

def test_block_rates_count_tokens_where_they_were_emitted():
    # tokens at 1.0, 1.5, 2.0 (request 1) and 2.0, 3.0 (request 2) over [0, 3] s in 3 blocks
    recs = [rec(0.0, 1.0, [0.5, 0.5]), rec(0.0, 2.0, [1.0])]
    assert block_rates(recs, gpus=1, blocks=3) == [0.0, 2.0, 3.0]
    # a chunked stream: 4 tokens but one gap -> the 2 extra tokens count at the finish
    assert block_rates([rec(0.0, 0.5, [1.0], out=4)], gpus=2, blocks=2) == pytest.approx(
        [1 / 0.75 / 2, 3 / 0.75 / 2])  # run spans 1.5 s: slices of 0.75 s
    failed = RequestRecord(arrival_s=0.0, input_tokens=1, output_tokens=0, error="x")
    assert block_rates([failed], gpus=1) == []


def test_block_rates_average_to_the_runs_objective():
    from domain.fit import fit
    from domain.twin.cluster import simulate_closed_loop

    c = ServingConfig(model="glm-5", gpu="B200", tp_size=8, weights="nvfp4")
    recs, _ = simulate_closed_loop(c, fit(c), 64, 5.0, 512, 64)
    blocks = block_rates(recs, c.gpus)
    assert len(blocks) == BLOCKS
    assert statistics.fmean(blocks) == pytest.approx(summarize(recs, c.gpus).output_tok_s_per_gpu)


# ------------------------------------------------------------------------------ the gate

def runs(objective: float, config_id: str, repeats: int, noise_pct: float) -> list[float]:
    """Repeated runs of a config whose noise-free objective is ``objective``."""
    return [objective / noise_factor(config_id, r, noise_pct) for r in range(repeats)]


def test_decide_without_spread_is_the_threshold_rule():
    d = decide([103.0, 103.0], [100.0, 100.0], 0.02)
    assert d.method == "exact" and d.ci_low == d.ci_high == pytest.approx(0.03) and d.accepted
    d = decide([101.0] * 3, [100.0] * 3, 0.02)
    assert not d.accepted and d.gain == pytest.approx(0.01)
    with pytest.raises(ValueError):
        decide([], [1.0], 0.02)


def test_at_5pct_noise_and_3_repeats_a_1pct_gain_is_rejected_and_a_20pct_gain_accepted():
    inc = runs(1000.0, "incumbent", 3, 5.0)
    small = decide(runs(1010.0, "small", 3, 5.0), inc, 0.02, seed=0)
    large = decide(runs(1200.0, "large", 3, 5.0), inc, 0.02, seed=0)
    assert not small.accepted and small.ci_low <= 0.02 < small.ci_high
    assert large.accepted and large.ci_low > 0.02
    assert small.method == large.method == "BCa" and small.samples == "runs"
    assert decide(runs(1010.0, "small", 3, 5.0), inc, 0.02, seed=0) == small  # seeded
    # noise-free repeats: the interval collapses to the point and the rule is today's
    assert decide(runs(1010.0, "s", 3, 0.0), runs(1000.0, "i", 3, 0.0), 0.02).ci_width == 0


def test_more_repeats_narrow_the_interval_and_one_run_each_uses_time_blocks():
    widths = {n: decide(runs(1100.0, "c", n, 5.0), runs(1000.0, "i", n, 5.0), 0.02).ci_width
              for n in (3, 10)}
    assert widths[10] < widths[3]
    c, i, kind = pick_samples([1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0])
    assert (c, i, kind) == ([4.0, 5.0], [6.0, 7.0], "time blocks")
    assert pick_samples([1.0, 2.0], [3.0, 4.0], [], [])[2] == "runs"


# ------------------------------------------------------------------------------ the analyst

def gate(accepted: bool, samples: str = "runs") -> AcceptDecision:
    return AcceptDecision(accepted=accepted, gain=0.05, ci_low=0.03 if accepted else -0.01,
                          ci_high=0.08, confidence=0.95, min_improvement=0.02,
                          samples=samples, n_candidate=3, n_incumbent=3, method="BCa")


def test_analyst_keeps_only_what_a_deciding_gate_accepts(tmp_path):
    study = load_study(write(tmp_path, "s.yaml", tiny_study()))
    judge = Analyst(None, study).judge  # type: ignore[arg-type]
    s = SimpleNamespace(output_tok_s_per_gpu=105.0, completed=10, errors=0)
    assert judge(s, 100.0, False).status == "keep"  # no gate: +5 % > 2 %
    rejected = judge(s, 100.0, False, gate(False))
    assert rejected.status == "discard" and "rejected by the noise gate" in rejected.reason
    assert judge(s, 100.0, False, gate(True)).status == "keep"
    # one run each: the interval informs, the point gain decides
    assert judge(s, 100.0, False, gate(False, "time blocks")).status == "keep"
    assert judge(s, 100.0, False, gate(True), objective=101.0).objective == 101.0
    assert gates(gate(False)) and not gates(gate(False, "time blocks")) and not gates(None)


def test_claude_verdict_may_not_keep_what_the_gate_rejected():
    s = SimpleNamespace(output_tok_s_per_gpu=105.0, completed=10, errors=0)
    keep = Verdict(status="keep", objective=105.0, reason="r")
    msg = check_verdict(keep, s, 100.0, False, gate(False))  # type: ignore[arg-type]
    assert msg is not None and "acceptance gate rejected" in msg
    assert check_verdict(keep, s, 100.0, False, gate(True)) is None  # type: ignore[arg-type]
    assert check_verdict(keep, s, 100.0, False,  # type: ignore[arg-type]
                         gate(False, "time blocks")) is None
    discard = Verdict(status="discard", objective=105.0, reason="r")
    assert check_verdict(discard, s, 100.0, False, gate(True)) is None  # type: ignore[arg-type]
    mean = Verdict(status="discard", objective=101.0, reason="r")
    assert check_verdict(mean, s, 100.0, False, objective=101.0) is None  # type: ignore[arg-type]


def test_acceptance_of_runs_uses_the_studys_confidence(tmp_path):
    study = load_study(write(tmp_path, "s.yaml", tiny_study(acceptance={"confidence": 0.8})))
    d = acceptance([110.0, 112.0, 108.0], [], [100.0, 101.0, 99.0], [], study)
    assert d is not None and d.confidence == 0.8 and d.samples == "runs" and d.accepted
    assert acceptance([110.0], [], [100.0], [], study) is None  # no blocks to fall back to


# ------------------------------------------------------------------------------ bench server

@pytest.mark.anyio
async def test_bench_repeats_get_their_own_id_and_noise(tmp_path):
    backend = TwinBackend()
    cfg = dict(model="glm-5", gpu="B200", tp_size=8, weights="nvfp4")
    args = {"deployment": "d", "isl": 512, "osl": 64, "concurrency": 32, "duration_s": 3}
    out = {}
    for noise in (0.0, 5.0):
        svc = BenchService(backend, tmp_path / f"rec{noise}", [], twin_noise_pct=noise)
        async with Client(cluster_server(backend)) as c, Client(bench_server(svc)) as b:
            await c.call_tool("deploy", {"name": "d", "config": cfg})
            for rep in (0, 1):
                r = await b.call_tool("run_saturation", {**args, "repeat": rep})
                assert not r.is_error, r.content
                out[noise, rep] = r.structured_content
    plain = [out[0.0, r]["summary"]["output_tok_s_per_gpu"] for r in (0, 1)]
    noisy = [out[5.0, r]["summary"]["output_tok_s_per_gpu"] for r in (0, 1)]
    assert plain[0] == plain[1] and noisy[0] != noisy[1]  # the twin alone is deterministic
    cid = ServingConfig(**cfg).config_id()
    for rep in (0, 1):
        assert noisy[rep] == pytest.approx(plain[0] / noise_factor(cid, rep, 5.0))
        assert f"twin noise 5% (repeat {rep}" in out[5.0, rep]["workload"]["description"]
    ids = {out[k]["bench_id"] for k in out}
    assert len(ids) == 4  # repeat and noise are part of the bench id
    assert statistics.fmean(out[0.0, 0]["block_tok_s_per_gpu"]) == pytest.approx(plain[0])


# ------------------------------------------------------------------------------ a study

SMALL_GAIN_KNOBS = {"attention_backend": ["unset", "fa3"], "tp_size": [4, 8],
                    "weights": ["fp8", "nvfp4"], "kv_cache_dtype": ["bf16", "fp8_e4m3"],
                    "mem_fraction_static": [0.85, 0.9],
                    "max_running_requests": ["unset", 128, 256]}


def run_tiny(tmp: Path, store, *, noise: float, repeats: int | None, env_repeats: int = 1):
    study = load_study(write(tmp, "s.yaml", tiny_study(
        knobs=SMALL_GAIN_KNOBS, acceptance={"repeats": repeats, "twin_noise_pct": noise})))
    asyncio.run(run_study(study, "acc", tmp / "run", store, [Path(study.replay.trace).parent],
                          research=False, repeats=env_repeats))
    assert_no_contradicted(tmp / "run", store)
    led = Ledger(tmp / "run" / "ledger.sqlite")
    try:
        return study, led.trials()
    finally:
        led.close()


def launched(trials):
    return [t for t in trials if t.phase == "search" and t.status not in ("pruned", "crash")]


@pytest.fixture(scope="module")
def noise_free(tmp_path_factory):
    from memory.store import LessonStore

    tmp = tmp_path_factory.mktemp("noise-free")
    store = LessonStore(tmp / "lessons", embedding="hashing")
    try:
        return run_tiny(tmp, store, noise=0.0, repeats=None)
    finally:
        store.close()


def test_noise_free_twin_decides_as_the_threshold_rule(noise_free, tmp_path, store):
    study, trials = noise_free
    rows = launched(trials)
    for t in rows[1:]:
        assert t.acceptance is not None and t.acceptance.samples == "time blocks"
        assert t.objective_runs == [t.objective] and len(t.objective_blocks) == BLOCKS
        gain = t.acceptance.gain  # the point gain over the incumbent of the time
        assert (t.status == "keep") == (gain > study.min_improvement), t.reason
        assert "not noise-gated" in t.reason
    assert rows[0].status == "baseline" and rows[0].acceptance is None
    assert any(t.status == "keep" for t in rows)
    # SERVETUNE_REPEATS=3 on the noise-free twin: same decisions and numbers, 3 runs each
    _, again = run_tiny(tmp_path, store, noise=0.0, repeats=None, env_repeats=3)
    assert [(t.changed, t.status) for t in launched(again)] == \
        [(t.changed, t.status) for t in rows]
    assert [t.objective for t in launched(again)] == pytest.approx([t.objective for t in rows])
    assert all(len(t.objective_runs) == 3 for t in launched(again))
    assert all(t.acceptance.method == "exact" for t in launched(again)[1:])


def test_with_noise_and_repeats_small_gains_are_not_kept_and_large_ones_are(tmp_path, store):
    # 5 % noise: since issue 20's refit (TTFT path, synchronized client model) 3 % keeps both
    # kv_cache_dtype=fp8_e4m3 (+8.8 %) and weights=nvfp4 (+6.5 % [+2.7 %, +8.9 %]); at 5 %
    # fp8 KV is kept at +11.3 % [+8.4 %, +16.1 %] and nvfp4 rejected at +4.4 % [-1.8 %, +8.2 %]
    # (before the refit 3 % did it, at +6.3 % and +3.9 %; 5 % then put nvfp4 under 2 %)
    study, trials = run_tiny(tmp_path, store, noise=5.0, repeats=3)
    rows = launched(trials)
    assert all(len(t.objective_runs) == 3 and len(set(t.objective_runs)) == 3 for t in rows)
    assert all(t.objective == pytest.approx(statistics.fmean(t.objective_runs)) for t in rows)
    gated = [t for t in rows[1:] if t.acceptance is not None]
    assert gated and all(t.acceptance.samples == "runs" for t in gated)
    for t in gated:  # the interval decided every keep and discard
        assert (t.status == "keep") == (t.acceptance.ci_low > study.min_improvement)
        assert t.acceptance.text() in t.reason
    # a large gain is kept; a point gain above min_improvement but inside the noise is not
    assert any(t.status == "keep" for t in gated)
    small = [t for t in gated if t.status == "discard"
             and t.acceptance.gain > study.min_improvement]
    assert small, [(t.changed, t.acceptance.text()) for t in gated]
    # the decision and its interval are in the report's trials table
    path = render_report(tmp_path / "rep", study, trials, [], run_id="acc", stop_reason="x",
                         elapsed_s=1.0, replay_requests=1, trace_file="t.jsonl")
    text = path.read_text()
    a = small[0].acceptance
    assert f"{a.gain:+.1%} [{a.ci_low:+.1%}, {a.ci_high:+.1%}] rejected (3v3 runs)" in text
    assert "gain vs best [CI]" in text
