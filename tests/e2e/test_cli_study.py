"""End to end through the CLI, as a user runs it: a tiny study, lessons queries in new processes,
run-id reuse, and one-line errors with exit code 2 for bad input. Resume after SIGKILL is
tests/e2e/test_chaos_resume.py (three kills of ``servetune run``, each restarted with its run
id, against an uninterrupted run)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fixtures.cli import ledger_rows, servetune, tiny_study, write
from fixtures.cli_runner import invoke
from fixtures.paths import REPO


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    study = write(tmp, "tiny.yaml", tiny_study())
    r = servetune("run", str(study), "--run-id", "t1", tmp=tmp)
    return tmp, study, r


@pytest.mark.slow
def test_tiny_study_end_to_end(tiny_run):
    tmp, _, r = tiny_run
    assert r.returncode == 0, r.stderr
    run = tmp / "runs" / "t1"
    report = (run / "report.md").read_text()
    assert "sglang serve --model-path" in report
    assert "mooncake_fast25_conversation_trace.jsonl" in report
    for png in ("search.png", "frontier.png", "replay_ttft.png"):
        assert (run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = ledger_rows(run / "ledger.sqlite")
    by_change = {}
    for _, _key, status, changed, body in rows:
        by_change.setdefault(changed, []).append((status, json.loads(body)))
    # fa3 launched once, crashed with the engine's message, and became a lesson ...
    fa3 = by_change["attention_backend=fa3"]
    assert fa3[0][0] == "crash" and fa3[0][1]["failure_class"] == "UNSUPPORTED_BACKEND"
    fa3_lesson = fa3[0][1]["lesson_ids"][0]
    # ... and every later fa3 candidate was pruned by that lesson, never launched.
    assert len(fa3) >= 2 and all(s == "pruned" for s, _ in fa3[1:])
    assert all(b["lesson_ids"] == [fa3_lesson] for _, b in fa3[1:])
    # FP8 on TP4 is pruned before launch by the memory-fit estimate, arithmetic in the reason.
    # (The planner tries the estimate's most promising change first, so the incumbent may
    # already be TP4 when fp8 is proposed: the row's change is tp_size=4 or weights=fp8.)
    fp8_tp4 = [b for rows_ in by_change.values() for _, b in rows_
               if b["config"]["weights"] == "fp8" and b["config"]["tp_size"] == 4]
    assert fp8_tp4 and fp8_tp4[0]["status"] == "pruned"
    assert "186.5 GB per GPU" in fp8_tp4[0]["reason"]
    assert "report: runs/t1/report.md" in r.stdout and "elapsed:" in r.stdout
    # the lessons the run used or wrote are exported into its report
    assert fa3_lesson in report


@pytest.mark.slow
def test_lessons_query_in_new_process(tiny_run):
    tmp, _, r = tiny_run
    assert r.returncode == 0
    q = servetune("lessons", "query", "fa3 on B200", "-k", "1", tmp=tmp, check=True)
    assert "--attention-backend fa3 refused on B200" in q.stdout
    q = servetune("lessons", "query", "fp8 out of memory", "-k", "1", tmp=tmp, check=True)
    assert "fp8 weights of glm-5 do not fit" in q.stdout
    listed = servetune("lessons", "list", tmp=tmp, check=True)
    assert "lessons" in listed.stdout and "UNSUPPORTED" not in listed.stderr


@pytest.mark.slow
def test_same_run_id_is_a_no_op_and_other_study_is_refused(tiny_run):
    tmp, study, r = tiny_run
    before = ledger_rows(tmp / "runs" / "t1" / "ledger.sqlite")
    again = servetune("run", str(study), "--run-id", "t1", tmp=tmp)
    assert again.returncode == 0, again.stderr
    assert ledger_rows(tmp / "runs" / "t1" / "ledger.sqlite") == before
    other = write(tmp, "other.yaml", tiny_study(min_improvement=0.05))
    refused = invoke("run", str(other), "--run-id", "t1", tmp=tmp)
    assert refused.returncode == 2
    assert "belongs to another study" in refused.stderr and "Traceback" not in refused.stderr


BAD_STUDIES = {
    "unknown-knob": tiny_study(knobs={"turbo_mode": [True]}),
    "impossible-value": tiny_study(knobs={"mem_fraction_static": [1.5]}),
    "tp-not-dividing": tiny_study(knobs={"tp_size": [3]}),
    "unknown-top-key": {**tiny_study(), "colour": "blue"},
    "missing-trace": tiny_study(replay={"trace": "no/such/trace.jsonl", "duration_s": 10}),
    "wrong-type": tiny_study(saturation={"isl": "long", "osl": 1, "concurrency": 1,
                                         "duration_s": 1}),
    "unknown-checkpoint": tiny_study(knobs={"weights": ["int2"]}),
}


@pytest.mark.parametrize("name", sorted(BAD_STUDIES))
def test_bad_study_one_line_exit_2(tmp_path, name):
    p = write(tmp_path, f"{name}.yaml", BAD_STUDIES[name])
    r = invoke("run", str(p), tmp=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stderr.strip().startswith("error:")
    assert len(r.stderr.strip().splitlines()) <= 3  # one line, soft-wrapped at most
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("content", [
    '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [0]}\n{"timest',
    "", "\xff\xfe garbage"], ids=["truncated", "empty", "not-utf8"])
def test_malformed_trace_one_line_exit_2(tmp_path, content):
    trace = tmp_path / "bad.jsonl"
    trace.write_bytes(content.encode("latin-1"))
    p = write(tmp_path, "s.yaml", tiny_study(replay={"trace": str(trace), "format": "mooncake",
                                                     "duration_s": 10}))
    r = invoke("run", str(p), tmp=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "bad.jsonl" in r.stderr


def test_missing_study_and_bad_yaml(tmp_path):
    r = invoke("run", str(tmp_path / "nope.yaml"), tmp=tmp_path)
    assert r.returncode == 2 and "study file not found" in r.stderr
    p = write(tmp_path, "broken.yaml", "name: [unclosed\n")
    r = invoke("run", str(p), tmp=tmp_path)
    assert r.returncode == 2 and "not valid YAML" in r.stderr and "Traceback" not in r.stderr
    p = write(tmp_path, "dup.yaml", "name: a\nname: b\n")
    r = invoke("run", str(p), tmp=tmp_path)
    assert r.returncode == 2 and "key 'name' is given twice at line 2" in r.stderr
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00")
    r = invoke("run", str(tmp_path / "bin.yaml"), tmp=tmp_path)
    assert r.returncode == 2 and "not UTF-8" in r.stderr


@pytest.mark.slow
def test_baseline_that_does_not_fit_is_pruned_and_search_goes_on(tmp_path):
    study = write(tmp_path, "h100.yaml", tiny_study(gpu="H100", finalists=1,
                                                    sweep_concurrency=[8]))
    r = servetune("run", str(study), "--run-id", "h1", tmp=tmp_path,
                  env={"SERVETUNE_EMBEDDING": "hashing"})
    assert r.returncode == 0, r.stderr
    rows = ledger_rows(tmp_path / "runs" / "h1" / "ledger.sqlite")
    first = json.loads(rows[0][4])
    assert (first["status"], first["changed"]) == ("pruned", "")
    assert "93.2 GB per GPU" in first["reason"]  # 746 GB / TP8 on an 80 GB H100
    keeps = [json.loads(b) for _, _, s, _, b in rows if s == "keep"]
    assert keeps and keeps[0]["reason"].startswith("first config that runs")
    assert keeps[0]["config"]["weights"] == "nvfp4"


def test_run_id_in_use_is_refused(tmp_path):
    import fcntl

    study = write(tmp_path, "tiny.yaml", tiny_study())
    run_dir = tmp_path / "runs" / "busy"
    run_dir.mkdir(parents=True)
    with (run_dir / ".lock").open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = servetune("run", str(study), "--run-id", "busy", tmp=tmp_path)
    assert r.returncode == 2 and "in use by another servetune process" in r.stderr


@pytest.mark.parametrize("args, needle", [
    (["lessons", "query", "  "], "give some words"),
    (["run", "--run-id", "-rf"], "--run-id"),
    # the run id becomes the servetune/run-id label of every deployment: a Kubernetes label
    # value has at most 63 characters and ends with a letter or digit
    (["run", "--run-id", "a" * 64], "--run-id"),
    (["run", "--run-id", "run-1-"], "--run-id"),
    (["run", "--out", "afile"], "cannot write afile"),
], ids=["empty-query", "dash-run-id", "run-id-64-chars", "run-id-ends-with-dash",
        "out-is-a-file"])
def test_cli_argument_errors(tmp_path, args, needle):
    (tmp_path / "afile").write_text("x")
    r = invoke(*args, tmp=tmp_path, env={"SERVETUNE_EMBEDDING": "hashing"})
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_bad_setting_is_one_line(tmp_path):
    r = invoke("lessons", "list", tmp=tmp_path, env={"SERVETUNE_EMBEDDING": "bogus"})
    assert r.returncode == 2 and r.stderr.startswith("error: SERVETUNE_EMBEDDING")


@pytest.mark.slow
def test_unrunnable_neighbourhood_widens_until_something_runs(tmp_path):
    study = write(tmp_path, "wide.yaml", tiny_study(
        baseline={"tp_size": 4, "weights": "fp8", "kv_cache_dtype": "bf16",
                  "mem_fraction_static": 0.95},
        knobs={"weights": ["fp8", "nvfp4"], "tp_size": [4, 8],
               "mem_fraction_static": ["unset", 0.75]},
        finalists=1, sweep_concurrency=[8]))
    r = servetune("run", str(study), "--run-id", "w1", tmp=tmp_path,
                  env={"SERVETUNE_EMBEDDING": "hashing"})
    assert r.returncode == 0, r.stderr
    rows = [json.loads(b) for *_, b in ledger_rows(tmp_path / "runs" / "w1" / "ledger.sqlite")]
    # every one-knob change of the baseline is pruned (fp8 at TP4 never fits) ...
    assert all(t["status"] == "pruned" for t in rows[:5])
    # ... so the search continues two knobs away and finds configs that run
    ran = [t for t in rows if t["phase"] == "search" and t["status"] in ("keep", "discard")]
    assert ran and ran[0]["reason"].startswith("first config that runs")
    assert ran[0]["config"]["tp_size"] == 8


def test_mcp_bench_tokenizer_and_client_options(tmp_path):
    vocab = REPO / "memory" / "vocab.txt"
    ok = subprocess.run([sys.executable, "-m", "servetune.cli", "mcp", "bench", "--tokenizer",
                         str(vocab), "--state-dir", str(tmp_path / "state")], cwd=tmp_path,
                        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr[-2000:]  # served until stdin closed
    for args, said in ((["--tokenizer", "nope.json"], "--tokenizer nope.json: no such file"),
                       (["--tokenizer", str(vocab.parent / "store.py")], "no tokenizer at"),
                       (["--client", "curl"], "choose aiohttp or httpx")):
        r = invoke("mcp", "bench", *args, tmp=tmp_path)
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
