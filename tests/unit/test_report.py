"""Tests of servetune.report: report.md content and the PNG plots, from hand-built trials."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from domain.config import ServingConfig
from domain.lesson import Clause, Lesson, Scope
from domain.metrics import GraphCeiling, MetricsSummary, Percentiles
from domain.quality import QualityGate
from domain.study import Study, parse_study
from domain.trial import LintNote, Trial
from servetune.report import render_report
from servetune.report.format import summary_rows

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_ID = "run-test-1"


def pct(p50: float, p99: float) -> Percentiles:
    return Percentiles(p50=p50, p90=(p50 + p99) / 2, p99=p99, mean=p50)


def summary(tok_gpu: float, per_user: float, ttft: tuple[float, float] = (100.0, 400.0),
            itl_p99: float = 30.0, requests: int = 100, completed: int = 100,
            retractions: int | None = 0) -> MetricsSummary:
    return MetricsSummary(
        requests=requests, completed=completed, errors=requests - completed, duration_s=60.0,
        input_tokens=100_000, output_tokens=20_000, output_tok_s=tok_gpu * 8,
        input_tok_s=1000.0, output_tok_s_per_gpu=tok_gpu, tok_s_per_user=per_user,
        request_rate=1.5, ttft_ms=pct(*ttft), itl_ms=pct(10.0, itl_p99), tpot_ms=pct(12.0, 20.0),
        e2e_ms=pct(2000.0, 5000.0), gpus=8, retractions=retractions)


def cfg(**kw: object) -> ServingConfig:
    return ServingConfig(model="glm-5", gpu="B200", tp_size=8, replicas=1, weights="fp8", **kw)


BASE = cfg()
MRR = cfg(max_running_requests=256)
CPS = cfg(chunked_prefill_size=4096)
MFS = cfg(mem_fraction_static=0.95)
CUDA = cfg(cuda_graph_max_bs_decode=512)


@pytest.fixture(scope="module")
def study() -> Study:
    return parse_study({
        "name": "glm5-b200", "model": "glm-5", "gpu": "B200", "gpu_count": 8,
        "baseline": {"weights": "fp8", "tp_size": 8},
        "knobs": {"max_running_requests": [128, 256], "chunked_prefill_size": [4096]},
        "saturation": {"isl": 2048, "osl": 512, "concurrency": 64, "duration_s": 120},
        "replay": {"trace": "data/traces/mooncake_fast25_conversation_trace.jsonl",
                   "start_s": 30, "duration_s": 300, "time_scale": 2.5},
        "slo": {"ttft_p99_ms": 2000},
        "budget": {"max_trials": 10, "patience": 3},
    })


def trial(seq: int, phase: str, status: str, config: ServingConfig, changed: str = "",
          reason: str = "ok", key: str | None = None, **kw: object) -> Trial:
    return Trial(run_id=RUN_ID, seq=seq, key=key or f"{phase}:{config.config_id()}", phase=phase,
                 status=status, config=config, changed=changed, reason=reason, **kw)


LINT = LintNote(severity="warn", code="GRAPH_CEILING",
                message="max_running_requests 256 far above cuda_graph_max_bs_decode 160",
                fix="raise --cuda-graph-max-bs-decode")


def search_trials() -> list[Trial]:
    return [
        trial(1, "search", "baseline", BASE, reason="baseline", objective=1000.0,
              saturation=summary(1000.0, 40.0)),
        trial(2, "search", "keep", MRR, "max_running_requests=256", "+20.0% over best",
              objective=1200.0, saturation=summary(1200.0, 35.0, retractions=1_234),
              decode_allreduce_share=0.47,
              graph_ceiling=GraphCeiling(ceiling=160, batch_below=128, itl_below_ms=11.0,
                                         batch_above=256, itl_above_ms=24.5, below="#1",
                                         above="this run"),
              predicted={"kv_tokens": 812_345, "max_running_requests": 256,
                         "mem_fraction_static": 0.88, "kv_pool_gb": 61.5}),
        trial(3, "search", "discard", CPS, "chunked_prefill_size=4096",
              "no gain | -2.0% vs best", objective=1176.0,
              saturation=summary(1176.0, 36.0, ttft=(120.0, 777.5), retractions=None),
              lints=[LINT]),
        trial(4, "search", "crash", MFS, "mem_fraction_static=0.95",
              "OOM_KV at startup: CUDA out of memory", failure_class="OOM_KV",
              predicted={"kv_tokens": 999_999}),
        trial(5, "search", "pruned", CUDA, "cuda_graph_max_bs_decode=512",
              "forbidden by lesson L-abc: too big"),
    ]


def validate_trials(winner: bool) -> list[Trial]:
    return [
        trial(6, "validate", "winner" if winner else "slo-miss", MRR, "max_running_requests=256",
              "replay", parent_seq=2, objective=1200.0, saturation=summary(1200.0, 35.0),
              decode_allreduce_share=0.47,
              replay=summary(300.0, 30.0, ttft=(210.0, 1850.0) if winner else (900.0, 4321.0),
                             itl_p99=45.5, requests=1234, completed=1234, retractions=7)),
        trial(7, "validate", "slo-miss", BASE, "", "replay", parent_seq=1, objective=1000.0,
              saturation=summary(1000.0, 40.0),
              replay=summary(250.0, 31.0, ttft=(950.0, 5000.0), requests=1234, completed=1234,
                             retractions=None)),
    ]


def frontier_trials() -> list[Trial]:
    out, seq = [], 8
    for config, changed, parent, scale in ((MRR, "max_running_requests=256", 2, 1.0),
                                           (BASE, "", 1, 0.8)):
        for c, user, gpu in ((8, 90.0, 300.0), (32, 60.0, 800.0), (128, 30.0, 1300.0)):
            out.append(trial(seq, "frontier", "sweep", config, changed, f"concurrency {c}",
                             key=f"frontier:{config.config_id()}:{c}", parent_seq=parent,
                             objective=gpu * scale,
                             saturation=summary(gpu * scale, user * scale)))
            seq += 1
    return out


def lesson() -> Lesson:
    evidence = "\n".join(f"log line {i}" for i in range(1, 31))
    return Lesson(title="mem_fraction_static 0.95 OOMs on B200", scope=Scope(gpu="B200"),
                  condition=[Clause(field="mem_fraction_static", op="ge", value=0.95)],
                  outcome="oom", failure_class="OOM_KV", root_cause="KV pool too large",
                  fix="keep mem_fraction_static <= 0.9", evidence=evidence).with_id()


def render(tmp_path: Path, study: Study, trials: list[Trial],
           lessons: list[Lesson] | None = None) -> str:
    path = render_report(tmp_path, study, trials, lessons or [], run_id=RUN_ID,
                         stop_reason="no improvement for 3 trials", elapsed_s=1234.5,
                         replay_requests=1234,
                         trace_file="mooncake_fast25_conversation_trace.jsonl")
    assert path == tmp_path / "report.md"
    return path.read_text()


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory, study: Study) -> tuple[Path, str]:
    """One complete run rendered once (winner, frontier, lesson) for the read-only tests."""
    run_dir = tmp_path_factory.mktemp("full")
    trials = search_trials() + validate_trials(winner=True) + frontier_trials()
    return run_dir, render(run_dir, study, trials, [lesson()])


def section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def table_rows(block: str) -> list[str]:
    rows = [ln for ln in block.splitlines() if ln.startswith("| ")]
    return rows[1:]  # drop the header


def test_full_report_names_winner_with_its_launch_command(full: tuple[Path, str]) -> None:
    text = full[1]
    assert text.startswith(f"# glm5-b200: run `{RUN_ID}`")
    assert "8 x B200 with sglang 0.5.23" in text
    assert "Elapsed: 1,234.5 s" in text
    assert "4 launched, 1 pruned before launch, 1 crashed" in text
    result = section(text, "Result")
    cmd = ("sglang serve --model-path zai-org/GLM-5-FP8 --tp-size 8 --quantization fp8 "
           "--max-running-requests 256")
    assert MRR.launch_command() == cmd
    assert f"```bash\n{cmd}\n```" in result
    assert "replicas: 1 (tp_size 8 each, 8 GPUs)" in result
    assert "1,200.0 output tok/s/GPU, 35.0 tok/s/user" in result
    assert "All-reduce 47% of decode step time at saturation (TP 8)" in result
    # B200 has fitted twin constants
    assert "GPU `B200`: calibrated (twin constants fitted by benchmarks/twin_fidelity.py" in text
    assert ("TTFT p50 210.0 ms, p99 1,850.0 ms (meets the SLO of p99 <= 2,000 ms with every "
            "request served)") in result
    assert "Changes from the baseline" in result and "max_running_requests unset -> 256" in result
    assert "No finalist met the SLO" not in text


SIMULATED_GATE = QualityGate(status="not-applicable", reason="not applicable (simulated endpoint)",
                             changes=["kv_cache_dtype bf16 -> fp8_e4m3"])


@pytest.mark.parametrize(("events", "first"), [
    pytest.param([{"kind": "backend", "backend": "local"},
                  {"kind": "endpoints", "simulated": {"http://127.0.0.1:4001": "twin"}}],
                 "Backend: `local`; endpoints: simulated (1 of them identified itself as the "
                 "twin server", id="local-simulated"),
    pytest.param([{"kind": "backend", "backend": "kubernetes"}],
                 "Backend: `kubernetes`; endpoints: real", id="kubernetes-real"),
    pytest.param([{"kind": "backend", "backend": "twin"}],
                 "Backend: `twin`; endpoints: simulated (the digital twin in virtual time",
                 id="twin"),
    pytest.param([], "Backend: not recorded", id="older-run"),
])
def test_first_lines_name_the_backend_and_whether_endpoints_were_simulated(
        tmp_path: Path, study: Study, events: list[dict], first: str) -> None:
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    fp8kv = cfg(max_running_requests=256, kv_cache_dtype="fp8_e4m3")
    trials = search_trials() + [trial(6, "validate", "winner", fp8kv, "kv_cache_dtype=fp8_e4m3",
                                      "replay", parent_seq=2, objective=1200.0,
                                      saturation=summary(1200.0, 35.0),
                                      replay=summary(300.0, 30.0), quality=SIMULATED_GATE)]
    lines = render(tmp_path, study, trials).splitlines()
    assert lines[0].startswith("# glm5-b200: run")
    assert lines[2].startswith(first), lines[2]
    assert "- Quality gate: not applicable (simulated endpoint)" in lines
    assert "pass" not in section("\n".join(lines), "Quality gate").split("| reason |")[1]


def test_workloads_show_request_count_time_scale_and_window(full: tuple[Path, str]) -> None:
    wl = section(full[1], "Workloads")
    assert "ISL 2,048 tokens, OSL 512 tokens, concurrency 64, duration 120.0 s" in wl
    assert "`mooncake_fast25_conversation_trace.jsonl`" in wl
    assert "window start 30.0 s, length 300.0 s, 1,234 requests, time scale 2.5x" in wl


def test_no_winner_says_so_and_shows_best_finalist(tmp_path: Path, study: Study) -> None:
    text = render(tmp_path, study, search_trials() + validate_trials(winner=False))
    result = section(text, "Result")
    assert "No finalist met the SLO (TTFT p99 <= 2,000 ms on the replay)." in result
    assert "trial #6 (max_running_requests=256)" in result
    assert MRR.launch_command() in result
    assert "p99 4,321.0 ms (misses the SLO" in result


def test_pngs_are_written_and_valid(full: tuple[Path, str]) -> None:
    tmp_path, text = full
    for name in ("search.png", "frontier.png", "replay_ttft.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == PNG_MAGIC, name
        assert len(data) > 5_000, name
    for link in ("(search.png)", "(frontier.png)", "(replay_ttft.png)"):
        assert f"]{link}" in text
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_trials_table_has_one_row_per_search_trial_and_escapes_pipes(
        full: tuple[Path, str]) -> None:
    rows = table_rows(section(full[1], "Trials"))
    assert len(rows) == 5
    assert [r.split(" | ")[0] for r in rows] == ["| 1", "| 2", "| 3", "| 4", "| 5"]
    assert rows[0].startswith("| 1 | baseline | baseline | 1,000.0 | 400.0 |  |  | 0 |")
    # the decode all-reduce share, then the retractions of the saturation run
    assert rows[1].startswith("| 2 | keep | max_running_requests=256 | 1,200.0 | 400.0 |  "
                              "| 47% | 1,234 |")
    # no roofline or all-reduce share, a server without a retraction counter, no gate, a lint
    assert rows[2] == ("| 3 | discard | chunked_prefill_size=4096 | 1,176.0 | 777.5 "
                       "|  |  | n/a |  | GRAPH_CEILING | no gain \\| -2.0% vs best |")
    assert rows[3].startswith("| 4 | crash | mem_fraction_static=0.95 |  |  |  |  |  |  |  "
                              "| OOM_KV")


def test_lints_section_lists_each_lint_with_its_fix(full: tuple[Path, str]) -> None:
    rows = table_rows(section(full[1], "Lints"))
    assert rows == ["| 3 | search | chunked_prefill_size=4096 | warn | GRAPH_CEILING | "
                    "max_running_requests 256 far above cuda_graph_max_bs_decode 160 | "
                    "raise --cuda-graph-max-bs-decode |"]


def test_finalists_table(full: tuple[Path, str]) -> None:
    rows = table_rows(section(full[1], "Finalists on the real trace"))
    assert rows == [
        "| 6 | max_running_requests=256 | 1,200.0 | 210.0 | 1,850.0 | 45.5 |  | 7 | 1234/1234 "
        "| winner |",
        "| 7 | baseline | 1,000.0 | 950.0 | 5,000.0 | 30.0 |  | n/a | 1234/1234 | slo-miss |",
    ]


def test_no_frontier_skips_plot_with_a_sentence(tmp_path: Path, study: Study) -> None:
    (tmp_path / "frontier.png").write_bytes(b"stale")
    text = render(tmp_path, study, search_trials() + validate_trials(winner=True))
    assert not (tmp_path / "frontier.png").exists()
    assert "No frontier sweep was measured in this run" in section(text, "Frontier")
    assert "frontier.png" not in text


def test_frontier_table_marks_pareto_points(full: tuple[Path, str]) -> None:
    rows = table_rows(section(full[1], "Frontier"))
    assert len(rows) == 6
    assert rows[0] == "| #2 max_running_requests=256 | 8 | 90.0 | 300.0 | 400.0 | 0 | yes |"
    # the baseline's sweep is dominated everywhere (0.8x on both axes)
    assert all(not r.endswith("| yes |") for r in rows[3:])


def test_predicted_vs_measured(full: tuple[Path, str]) -> None:
    rows = table_rows(section(full[1], "Predicted vs measured"))
    assert rows == [
        "| 2 | max_running_requests=256 | 812,345 | 256 | 0.88 | 61.50 | 9,600.0 | 1,200.0 "
        "| 35.0 |",
        "| 4 | mem_fraction_static=0.95 | 999,999 |  |  |  | crash |  |  |",
    ]


def test_lessons_section_truncates_evidence(full: tuple[Path, str]) -> None:
    les = lesson()
    block = section(full[1], "Lessons used or written in this run")
    assert f"### {les.id}: mem_fraction_static 0.95 OOMs on B200" in block
    assert "- Outcome: oom (OOM_KV)" in block
    assert "- Condition: `mem_fraction_static >= 0.95`" in block
    assert "- Fix: keep mem_fraction_static <= 0.9" in block
    assert "log line 12\n" in block and "log line 13" not in block
    assert "(18 more lines)" in block


def test_empty_run_still_writes_a_report(tmp_path: Path, study: Study) -> None:
    text = render(tmp_path, study, [])
    assert "No finalist met the SLO" in text
    assert "No finalist was replayed" in text
    assert not any(tmp_path.glob("*.png"))


def test_summary_rows() -> None:
    rows = summary_rows(search_trials()[:3])
    assert rows[0] == {"seq": 1, "status": "baseline", "changed": "baseline",
                       "objective": 1000.0, "reason": "baseline"}
    assert rows[2]["changed"] == "chunked_prefill_size=4096"
    assert rows[2]["reason"] == "no gain | -2.0% vs best"


def test_graph_ceiling_section_names_the_cause_with_numbers(full: tuple[Path, str]) -> None:
    block = section(full[1], "CUDA-graph ceiling")
    assert table_rows(block) == ["| #2 max_running_requests=256 | 160 | 11.0 at 128 (#1) | "
                                 "24.5 at 256 (this run) | 2.2x |"]
    assert "raise `--cuda-graph-max-bs-decode`" in block


def test_no_graph_ceiling_says_so(tmp_path: Path, study: Study) -> None:
    text = render(tmp_path, study, search_trials()[2:])
    assert "No run decoded past its CUDA-graph ceiling" in section(text, "CUDA-graph ceiling")


def test_a_frontier_sweep_past_the_graph_ceiling_is_named(tmp_path: Path, study: Study) -> None:
    """A sweep whose ITL roughly doubles where the decode batch passes the config's ceiling
    (the measured batch where the server gives one, else what admission allows)."""
    llama = ServingConfig(model="llama-3.1-8b", gpu="H100", tp_size=1, replicas=1,
                          weights="bf16", cuda_graph_max_bs_decode=32)
    sweep = []
    for seq, (c, itl, batch) in enumerate(((16, 6.5, 16.0), (32, 7.0, None), (40, 13.2, 39.5)),
                                          start=8):
        s = summary(900.0, 100.0).model_copy(update={"itl_ms": pct(itl, itl * 2),
                                                     "decode_batch": batch})
        sweep.append(trial(seq, "frontier", "sweep", llama, "", f"concurrency {c}",
                           key=f"frontier:{llama.config_id()}:{c}", saturation=s))
    block = section(render(tmp_path, study, search_trials()[2:] + sweep), "CUDA-graph ceiling")
    assert table_rows(block) == ["| frontier baseline | 32 | 7.0 at 32 (c=32) | "
                                 "13.2 at 40 (c=40) | 1.9x |"]


def test_what_the_twin_saw_lists_each_runs_replicas(tmp_path: Path, study: Study) -> None:
    from domain.twin.cluster import ReplicaStats

    def rs(i: int, requests: int, inflight: float, peak: int, retr: int, eager: float,
           ar: float) -> ReplicaStats:
        return ReplicaStats(replica=i, requests=requests, prefill_steps=10, decode_steps=100,
                            retractions=retr, max_running=peak, mean_decode_batch=8.0,
                            busy_s=1.0, retracted_tokens=retr * 1000, mean_inflight=inflight,
                            max_inflight=peak, eager_step_share=eager,
                            decode_allreduce_share=ar)

    two = [rs(0, 975, 60.4, 256, 3, 0.25, 0.081), rs(1, 214, 12.0, 40, 0, 0.0, 0.079)]
    trials = [trial(1, "search", "baseline", BASE, objective=1000.0,
                    saturation=summary(1000.0, 40.0), saturation_replicas=two),
              trial(2, "search", "keep", MRR, "max_running_requests=256", objective=1100.0,
                    saturation=summary(1100.0, 40.0))]
    seen = section(render(tmp_path, study, trials, []), "What the twin saw")
    assert ("- #1 search baseline, saturation: 2 replicas: requests 975 / 214; in flight mean "
            "60.4 / 12.0, max 256 / 40; retractions 3 / 0 (3,000 tokens recomputed); eager "
            "decode steps 25% / 0%; all-reduce 8% / 8% of decode time") in seen
    assert "#2" not in seen  # no engine counters: no line
    http = trial(3, "search", "discard", CPS, "chunked_prefill_size=4096", objective=900.0,
                 saturation=summary(900.0, 40.0), replica_requests={"saturation": [1200, 34]})
    seen = section(render(tmp_path / "h", study, [*trials, http], []), "What the twin saw")
    assert ("- #3 search chunked_prefill_size=4096, saturation: 2 server(s) finished 1,200 / 34 "
            "requests") in seen
    empty = section(render(tmp_path / "e", study, trials[1:], []), "What the twin saw")
    assert "No run reported engine counters" in empty
