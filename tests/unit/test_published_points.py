"""benchmarks/published_points.py: published rows mapped from their own fields, scored, skipped.

The fixture ``tests/fixtures/published-points.json`` is a copy of the shared reference file
(``shared/reference/published-points.json``, collected 2026-11-29).
"""

from __future__ import annotations

import copy
import inspect
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fixtures.benchmarks import load_benchmark
from fixtures.paths import FIXTURES

pp = load_benchmark("published_points")  # before twin_fidelity, which imports it by name
tf = load_benchmark("twin_fidelity")

SHARED = FIXTURES / "published-points.json"


def _rows() -> list[dict[str, Any]]:
    return list(json.loads(SHARED.read_text())["points"])


def _row(**overrides: Any) -> dict[str, Any]:
    """A P08-like row (Qwen3-235B bf16 TP8 on B200, c100, random 1000/1000) with overrides."""
    base = {"id": "T1", "engine": "SGLang", "model": "Qwen/Qwen3-235B-A22B-Instruct-2507",
            "gpu": "B200", "quantization": "BF16", "kv_cache_dtype": "auto (bf16)",
            "gpu_count": 8, "parallelism": {"tp": 8, "ep": 1, "dp": 1, "replicas": 1},
            "workload": {"isl": 1000, "osl": 1000, "dataset": "bench_serving random",
                         "measured_mean_input": 500, "measured_mean_output": 504},
            "load": {"concurrency": 100, "request_rate": "inf"},
            "flags": {"launch": "python -m sglang.launch_server --model "
                                "Qwen/Qwen3-235B-A22B-Instruct-2507 --tp 8 (all else default)"},
            "metrics": {"output_tok_s": {"value": 2738.78, "unit": "tok/s"},
                        "tpot_ms_mean": {"value": 32.94, "unit": "ms"}}}
    base.update(overrides)
    return base


def _fake(sc: Any) -> dict[str, float]:
    """A prediction from the scenario's content only: 1.1x / 0.9x / 2x of its measurements."""
    return {"tok/s/GPU": 1.1 * sc.measured.get("tok/s/GPU", 1.0),
            "TPOT ms": 0.9 * sc.measured.get("TPOT ms", 1.0), "TTFT ms": 2.0}


def test_shared_rows_map_from_their_fields() -> None:
    """P08, P11, P15, P17 and S12 become scenarios; every other row has its exact reason."""
    mapped = {m.id: m for m in (pp.map_row(r) for r in _rows())}
    scen = {k: m for k, m in mapped.items() if isinstance(m, pp.Scenario)}
    assert {"P08", "P11", "P15", "P17", "S12"} <= set(scen)
    p08, s12 = scen["P08"], scen["S12"]
    assert (p08.config.model, p08.config.weights, p08.config.gpu, p08.config.tp_size,
            p08.conc, p08.isl, p08.osl) == ("qwen3-235b-a22b", "bf16", "B200", 8, 100, 500, 504)
    assert p08.measured == {"tok/s/GPU": pytest.approx(2738.78 / 8), "TPOT ms": 32.94,
                            "TTFT ms": 260.55}
    assert (scen["P11"].config.model, scen["P11"].config.weights) == ("deepseek-r1", "fp8")
    assert (scen["P17"].config.model, scen["P17"].isl, scen["P17"].osl) == \
        ("gpt-oss-120b", 297, 192)  # ShareGPT: the measured means
    assert (s12.config.model, s12.config.weights, s12.config.gpu, s12.config.disable_cuda_graph,
            s12.conc) == ("glm-5", "nvfp4", "RTX-PRO-6000", True, 1024)
    assert any("ISL/OSL not stated: stand-in" in n for n in s12.notes)
    p12 = scen["P12"]  # MiniMax-M2.5 TP8 EP8, aggregated
    assert (p12.config.model, p12.config.tp_size, p12.config.ep_size, p12.conc) == \
        ("minimax-m2.5", 8, 8, 100)
    p04 = scen["P04"]  # PD, decode measured alone: one DEP48 decode server, 1408 per rank
    assert (p04.phase, p04.batch, p04.ctx, p04.config.model, p04.config.weights,
            p04.config.kv_cache_dtype, p04.config.gpu) == \
        ("decode", 1408, 2000, "deepseek-r1", "nvfp4", "fp8_e4m3", "GB200")
    assert (p04.config.tp_size, p04.config.attn_dp_size, p04.config.ep_size,
            p04.config.moe_a2a_backend, p04.config.disaggregation_mode) == \
        (48, 48, 48, "deepep", "decode")
    assert p04.measured == {"tok/s/GPU": 13386}
    p06 = scen["P06"]  # prefill measured alone: a DEP2 prefill instance
    assert (p06.phase, p06.config.tp_size, p06.config.attn_dp_size, p06.isl) == \
        ("prefill", 2, 2, 2000)
    assert p06.measured == {"prefill tok/s/GPU": 26156}
    assert mapped["P28"].reason == "model 'Llama-2-70B-chat (MLPerf reference)' not in the catalog"
    assert mapped["S11"].reason.startswith("no throughput or TPOT metric")
    p22 = scen["P22"]  # TensorRT-LLM, offline: 1,500 requests at 8k/1k queued at t=0
    assert (p22.engine, p22.config.model, p22.conc, p22.requests, p22.isl, p22.osl) == \
        ("TensorRT-LLM", "llama-3.1-70b", None, 1500, 8192, 1024)


def test_layouts_map_to_config_fields() -> None:
    """EP, DP attention (a DEP row without tp), PP and a PD phase with legacy flags."""
    ep = pp.map_row(_row(parallelism={"tp": 8, "ep": 8},
                         flags={"launch": "sglang serve --tp 8 --ep 8"}))
    assert (ep.config.tp_size, ep.config.ep_size, ep.config.attn_dp_size) == (8, 8, 1)
    dep = pp.map_row(_row(parallelism={"dp_attention": 8, "ep": 8}))
    assert (dep.config.tp_size, dep.config.attn_dp_size, dep.config.ep_size,
            dep.config.moe_a2a_backend) == (8, 8, 8, "deepep")
    pipe = pp.map_row(_row(parallelism={"tp": 4, "pp": 2}, flags={}))
    assert (pipe.config.tp_size, pipe.config.pp_size, pipe.config.gpus) == (4, 2, 8)
    decode = pp.map_row(_row(
        model="deepseek-ai/DeepSeek-V3-0324", quantization="FP8", gpu_count=16,
        parallelism={"pd_disaggregation": True, "phase_measured": "decode", "decode_nodes": 2,
                     "dp_attention": "all decode ranks", "ep": 16},
        workload={"isl": 2000, "osl": "short", "kv_length_per_seq": 2000},
        load={"decode_batch_per_gpu": 64, "mode": "saturated decode"},
        flags={"--enable-deepep-moe": True, "--deepep-mode": "low_latency (decode)",
               "--max-running-requests": "512 x num_decode_nodes"},
        metrics={"decode_output_tok_s_per_gpu": {"value": 2000}}))
    c = decode.config
    assert (c.model, c.tp_size, c.attn_dp_size, c.ep_size, c.disaggregation_mode) == \
        ("deepseek-v3", 16, 16, 16, "decode")
    assert (c.moe_a2a_backend, c.max_running_requests) == ("deepep", 1024)
    row = {"parallelism": {"decode_nodes": 2},
           "flags": {"--enable-deepep-moe": True, "--deepep-mode": "low_latency (decode)",
                     "--cuda-graph-bs": 256, "--max-running-requests": "512 x num_decode_nodes"}}
    assert pp._flag_tokens(row) == ["--moe-a2a-backend", "deepep", "--deepep-mode",
                                    "low_latency", "--cuda-graph-bs-decode", "256",
                                    "--max-running-requests", "1024"]
    assert (decode.phase, decode.batch, decode.ctx, decode.measured) == \
        ("decode", 64, 2000, {"tok/s/GPU": 2000})


def test_renamed_ids_give_the_same_scenarios_and_scores(tmp_path: Path) -> None:
    """No id is in the code: every id renamed, the same scenarios and the same printed scores."""
    doc = json.loads(SHARED.read_text())
    # rows whose closed loop runs thousands of clients (a TensorRT-LLM DEP8 row, 7,168) take
    # seconds each in the twin; the renaming check holds on the rest (still all engines/kinds)
    doc["points"] = [p for p in doc["points"]
                     if not (isinstance((p.get("load") or {}).get("concurrency"), int)
                             and p["load"]["concurrency"] > 2048)]
    shared = tmp_path / "published-points.json"
    shared.write_text(json.dumps(doc))
    renamed = copy.deepcopy(doc)
    names = {p["id"]: f"X{i}" for i, p in enumerate(doc["points"], 1)}
    for p in renamed["points"]:
        p["id"] = names[p["id"]]
    path = tmp_path / "renamed.json"
    path.write_text(json.dumps(renamed))
    a, b = pp.load(shared), pp.load(path)
    assert [replace(m, id=names[m.id]) for m in a] == b
    committed = {g: tf.efficiency(g) for g in tf.SYSTEMS.values()}
    lines_a = tf.published_report(shared, committed)  # the twin's real predictions
    lines_b = tf.published_report(path, committed)
    words = [[names.get(w, w) for w in line.split()] for line in lines_a]
    assert words == [line.split() for line in lines_b]
    assert any(line.startswith("  SGLang tok/s/GPU: median abs error") for line in lines_b)
    assert sum(" SGLang " in line and "%" in line for line in lines_b) >= 12


def test_no_row_id_in_the_benchmark_code() -> None:
    """Neither the mapping module nor twin_fidelity names any id of the shared file."""
    ids = {p["id"] for p in _rows()}
    for mod in (pp, tf):
        words = set(re.findall(r"[A-Za-z0-9]+", Path(mod.__file__).read_text()))
        assert not ids & words, (mod.__name__, ids & words)


@pytest.mark.parametrize(("change", "reason"), [
    ({"model": "meta-llama/Llama-2-70b-chat-hf"},
     "model 'meta-llama/Llama-2-70b-chat-hf' not in the catalog"),
    ({"parallelism": {"tp": 8, "ep": "wide"}}, "parallelism ep 'wide' is not one number"),
    ({"parallelism": {"tp": 8, "pd_disaggregation": True}},
     "pd_disaggregation without a measured phase (phase_measured decode or prefill): the "
     "whole PD deployment is not stated"),
    ({"parallelism": {"pd_disaggregation": True, "phase_measured": "decode"}},
     "pd_disaggregation: the decode servers' GPUs are not stated"),
    ({"parallelism": {"tp": 8, "dp_attention": "some"}},
     "dp_attention 'some' is not one number"),
    ({"parallelism": {"tp": 8, "pp": 2}}, "gpu_count 8 but tp x pp x replicas = 16"),
    ({"gpu": "MI300X"}, "gpu 'MI300X' not in the GPU catalog"),
    ({"metrics": {"tok_s_per_user": {"value": 20}}},
     "no throughput or TPOT metric (metrics: tok_s_per_user)"),
    ({"workload": {"dataset": "synthetic"}, "metrics": {"tpot_ms_mean": {"value": 30}}},
     "ISL/OSL not stated"),
    ({"load": {"request_rate": "fixed, not stated"}},
     "load: neither a concurrency nor an offline mode is stated"),
])
def test_unexpressible_rows_get_their_exact_reason(change: dict[str, Any], reason: str) -> None:
    """A row the twin cannot express is skipped with the reason, not run wrongly."""
    assert pp.map_row(_row(**change)) == pp.Skip("T1", "SGLang", reason)


def test_a_malformed_row_is_skipped_with_its_error_not_a_crash(tmp_path: Path) -> None:
    """A wrong-shaped field skips its row (the others still run); a wrong top level exits."""
    assert pp.map_row(_row(load="x")) == pp.Skip(
        "T1", "SGLang", "malformed row: AttributeError: 'str' object has no attribute 'get'")
    assert pp.map_row("P99") == pp.Skip("?", "?", "malformed row: not an object (str)")
    bad = tmp_path / "rows.json"
    bad.write_text(json.dumps([_row()]))
    with pytest.raises(SystemExit, match=r'expected \{"points": \[\.\.\.\]\}: TypeError'):
        pp.read_points(bad)


def test_lengths_are_the_measured_means_of_drawn_datasets() -> None:
    """Random/ShareGPT lengths run at their measured means; fixed ones at ISL/OSL; marked."""
    drawn = pp.map_row(_row())
    fixed = pp.map_row(_row(workload={"isl": 1024, "osl": 2048, "dataset": "synthetic, fixed",
                                      "measured_mean_input": 1, "measured_mean_output": 1}))
    no_means = pp.map_row(_row(workload={"isl": 1000, "osl": 800, "dataset": "random"}))
    assert (drawn.isl, drawn.osl, fixed.isl, fixed.osl, no_means.isl, no_means.osl) == \
        (500, 504, 1024, 2048, 1000, 800)
    assert no_means.notes == ("lengths drawn, their means not stated: the stated ISL/OSL run "
                              "fixed",)


def test_speculative_row_maps_to_eagle_314_at_mem_085() -> None:
    """A GLM-5-FP8 EAGLE launch command: algorithm, (steps, topk, draft tokens), memory."""
    sc = pp.map_row(_row(
        model="zai-org/GLM-5-FP8", gpu="H200 SXM 141GB", quantization="FP8", kv_cache_dtype="auto",
        parallelism={"tp": 8, "replicas": 1}, load={"concurrency": 1, "request_rate": "inf"},
        flags={"launch": "python -m sglang.launch_server --model zai-org/GLM-5-FP8 --tp 8 "
                         "--speculative-algorithm EAGLE --speculative-num-steps 3 "
                         "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4 "
                         "--mem-fraction-static 0.85 (+ parsers); image x:glm5-hopper"}))
    assert isinstance(sc, pp.Scenario)
    c = sc.config
    assert (c.model, c.weights, c.gpu, c.speculative_algorithm, c.speculative_num_steps,
            c.speculative_eagle_topk, c.speculative_num_draft_tokens, c.mem_fraction_static,
            sc.conc) == ("glm-5", "fp8", "H200", "EAGLE", 3, 1, 4, 0.85, 1)


def test_other_engines_are_reported_beside_not_in_the_median() -> None:
    """A TensorRT-LLM row is scored and printed, but the SGLang median is over SGLang rows."""
    rows = [_row(), _row(id="T2", engine="TensorRT-LLM (PyTorch backend)",
                         workload={"isl": 1024, "osl": 1024, "dataset": "fixed lengths"},
                         load={"mode": "offline max load (all requests queued at once)"})]
    mapped = [pp.map_row(r) for r in rows]
    assert [type(m).__name__ for m in mapped] == ["Scenario", "Scenario"]
    assert mapped[1].requests == pp.OFFLINE_STAND_IN and mapped[1].conc is None

    def predict(sc: Any) -> dict[str, float]:
        return {"tok/s/GPU": sc.measured["tok/s/GPU"] * (1.1 if sc.engine == "SGLang" else 3)}

    ev = pp.evaluate(mapped, predict)
    assert pp.summary(ev.scores) == {"tok/s/GPU": (1, pytest.approx(10.0), pytest.approx(10.0))}
    lines = pp.report(ev)
    assert "  SGLang tok/s/GPU: median abs error 10.0 %, mean 10.0 % over 1 rows" in lines
    assert "  beside, not in the median: TensorRT-LLM tok/s/GPU: median 200.0 % over 1 rows" \
        in lines
    assert sum(" T2 " in line and "TensorRT-LLM" in line for line in lines) == 1


def test_a_twin_failure_is_reported_not_scored() -> None:
    """A scenario the twin cannot run (its error) is listed with it, outside the scores."""
    ev = pp.evaluate([pp.map_row(_row())], lambda sc: "DoesNotFit: no KV pool")
    assert ev.scores == [] and ev.failed == [
        pp.Skip("T1", "SGLang", "twin cannot run it: DoesNotFit: no KV pool")]


def test_fits_never_read_published_points() -> None:
    """The fit's entry points take measured schedules/rows only, and reading is refused inside."""
    for fn in (tf.fit_gpu, tf.record_schedule, tf.fit_layout, tf.sensitivities):
        params = inspect.signature(fn).parameters
        assert not any("publish" in p or "path" in p for p in params), params
    with pp.fitting(), pytest.raises(pp.PublishedReadDuringFit):
        pp.read_points(SHARED)

    class Sneaky:  # a schedule that would read the published file while the fit runs
        row = None

        def predict(self, eff: Any) -> tuple[float, float]:
            pp.read_points(SHARED)
            return 1.0, 1.0

    with pytest.raises(pp.PublishedReadDuringFit):
        tf.fit_gpu([Sneaky()], tf.UNCALIBRATED, tf.UNCALIBRATED, ("eta_mem",), iterations=1)
    assert pp.read_points(SHARED)  # outside a fit it reads


def test_opening_a_published_file_inside_a_fit_raises(tmp_path: Path) -> None:
    """Inside a fit, open() and Path.read_text() of a published file raise; other files open."""
    renamed = tmp_path / "other-name.json"
    renamed.write_text(SHARED.read_text())
    pp.read_points(renamed)  # a file read as published points is one, whatever its name
    other = tmp_path / "rows.csv"
    other.write_text("a,b\n")
    with pp.fitting():
        for path in (SHARED, renamed):
            with pytest.raises(pp.PublishedReadDuringFit):
                path.read_text()
            with pytest.raises(pp.PublishedReadDuringFit):
                open(path)  # noqa: SIM115
        assert other.read_text() == "a,b\n"
    assert json.loads(SHARED.read_text())["points"]  # restored after the fit


def test_published_only_needs_no_wheel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """--published-only never looks for the measured rows' wheel; --published FILE is honoured."""
    def no_wheel(_: Any) -> Path:
        raise AssertionError("the wheel was looked for")

    monkeypatch.setattr(tf, "find_wheel", no_wheel)
    monkeypatch.setattr(pp, "evaluate", lambda mapped, predict: pp.Evaluation(
        skipped=[m for m in mapped if isinstance(m, pp.Skip)]))
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"points": [_row(id="ONLY", gpu="MI300X")]}))
    tf.main(["--published-only", "--published", str(path)])
    assert "skipped ONLY (SGLang): gpu 'MI300X' not in the GPU catalog" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no such file"):
        tf.main(["--published-only", "--published", str(tmp_path / "missing.json")])
