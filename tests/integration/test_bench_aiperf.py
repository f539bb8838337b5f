"""The aiperf adapter (mcp_servers/bench/aiperf/): traces, tokenizer, argv, artifacts, runs.

Artifact parsing is tested on what aiperf 0.13.0 really wrote (``tests/fixtures/aiperf/``,
recorded by ``record_fixtures.py`` there against ``tests/fixtures/openai_stub.py`` with injected
HTTP 503s and mid-stream disconnects). The runner's plumbing is tested with a fake ``aiperf``
executable; one integration test runs the real aiperf against the stub and is skipped unless an
aiperf 0.13.0 executable is found (``SERVETUNE_AIPERF`` or ``PATH``).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import sys
import textwrap
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from fixtures.stub_process import running_stub

from domain.metrics import summarize
from domain.traces import load_trace
from domain.workload import Request
from mcp_servers.bench import aiperf as ap
from mcp_servers.bench.aiperf import (
    AIPERF_VERSION,
    INSTALL_HINT,
    AiperfError,
    AiperfRunner,
    build_tokenizer,
    convert_trace,
    default_workers,
    failure_reason,
    find_aiperf,
    parse_artifacts,
    prepare_tokenizer,
    profile_argv,
    read_summary,
    read_trace,
    run_process,
    session_id,
    trace_rows,
    write_trace,
)
from mcp_servers.bench.aiperf.artifacts import _error_class
from mcp_servers.bench.aiperf.tokenizer import _WORDS

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "data" / "traces"
MOONCAKE = TRACES / "mooncake_fast25_conversation_trace.jsonl"
AZURE = TRACES / "AzureLLMInferenceTrace_conv.csv"
BAILIAN = REPO / "tests" / "fixtures" / "qwen_bailian_tiny.jsonl"
SHARED = REPO.parent / "shared" / "traces"
FIX = REPO / "tests" / "fixtures" / "aiperf"


def head_lines(src: Path, dst: Path, n: int) -> Path:
    """The first ``n`` lines of ``src`` (a small slice of a real trace) as ``dst``."""
    with open(src, "rb") as f:
        dst.write_bytes(b"".join(f.readline() for _ in range(n)))
    return dst


def rows_of(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def req(t: float, n_in: int = 600, n_out: int = 10, ids: tuple[int, ...] = (),
        block: int = 0) -> Request:
    return Request(arrival_s=t, input_tokens=n_in, output_tokens=n_out, hash_ids=ids,
                   block_size=block)


# ------------------------------------------------------------------------------- trace formats

def test_mooncake_slice_window_scale_and_hash_ids(tmp_path):
    src = head_lines(MOONCAKE, tmp_path / "mc.jsonl", 60)
    orig = rows_of(src)
    t = convert_trace(src, tmp_path / "out.jsonl", start_s=2.0, duration_s=10.0, time_scale=4.0)
    rows = rows_of(t.path)
    picked = [r for r in orig if 2000 <= r["timestamp"] < 12000]
    assert len(rows) == len(picked) == len(t) > 0
    assert t.block_size == 512
    for i, (row, o) in enumerate(zip(rows, picked, strict=True)):
        assert row["session_id"] == session_id(i) == f"r{i:06d}"
        # (arrival - window start) / time_scale, in ms: the idle lead before the first row stays
        assert row["timestamp"] == pytest.approx((o["timestamp"] - 2000) / 4.0, abs=1e-3)
        assert t.arrival_s[i] == pytest.approx(row["timestamp"] / 1000.0)
        assert (row["input_length"], row["output_length"]) == (o["input_length"],
                                                               o["output_length"])
        assert row["hash_ids"] == o["hash_ids"]  # Mooncake has exactly ceil(len/512) ids
        assert len(row["hash_ids"]) == math.ceil(row["input_length"] / 512)
    assert rows[0]["timestamp"] == pytest.approx(1000 / 4.0)  # first tick at 3000 ms


def test_azure_slice_has_no_hash_ids(tmp_path):
    src = head_lines(AZURE, tmp_path / "az.csv", 41)  # header + 40 rows
    t = convert_trace(src, tmp_path / "out.jsonl", time_scale=2.0)
    rows = rows_of(t.path)
    trace = load_trace(src)
    assert len(rows) == 40 and t.block_size == 0
    assert all("hash_ids" not in r for r in rows)
    for row, r in zip(rows, trace.requests, strict=True):
        assert row["timestamp"] == pytest.approx(r.arrival_s * 1000 / 2.0, abs=1e-3)
        assert row["input_length"] == r.input_tokens and row["output_length"] == r.output_tokens
    assert rows[0]["timestamp"] == 0.0 and rows[1]["timestamp"] > 0


def test_bailian_uses_16_token_blocks(tmp_path):
    t = convert_trace(BAILIAN, tmp_path / "out.jsonl")
    rows = rows_of(t.path)
    orig = rows_of(BAILIAN)
    assert t.block_size == 16 and len(rows) == len(orig)
    for row, o in zip(rows, orig, strict=True):
        assert row["timestamp"] == pytest.approx(o["timestamp"] * 1000.0)  # seconds -> ms
        assert set(row) == {"session_id", "timestamp", "input_length", "output_length",
                            "hash_ids"}  # Bailian's chat_id/turn/type are not aiperf fields
    # ids 2 and 5 end turns 1 and 2 as partial blocks (8 and 6 tokens) and come back full in
    # the next turn: aiperf would refuse them at two sizes, so those tails go unhashed
    assert [r["hash_ids"] for r in rows] == [[0, 1], [3], [0, 1, 2, 4], [6, 7, 8],
                                             [0, 1, 2, 4, 5, 9, 10]]


@pytest.mark.skipif(not (SHARED / "mooncake_fast25_synthetic_trace.jsonl").is_file(),
                    reason="needs ../shared/traces (the Mooncake synthetic trace)")
def test_shared_mooncake_synthetic_slice(tmp_path):
    src = head_lines(SHARED / "mooncake_fast25_synthetic_trace.jsonl", tmp_path / "s.jsonl", 80)
    t = convert_trace(src, tmp_path / "out.jsonl", format="mooncake", time_scale=10.0)
    rows = rows_of(t.path)
    assert len(rows) == 80 and t.block_size == 512
    assert all(len(r["hash_ids"]) == math.ceil(r["input_length"] / 512) for r in rows)
    assert np.all(np.diff(t.arrival_s) >= 0)


def test_hash_ids_cut_to_what_aiperf_accepts():
    # aiperf refuses a final block outside (0, block]: 5 ids for 40 tokens at 16 is too many
    rows, block = trace_rows([req(0.0, 40, 5, ids=(1, 2, 3, 4, 5), block=16),
                              req(0.5, 100, 5, ids=(1, 2), block=16)])
    assert block == 16
    assert rows[0]["hash_ids"] == [1, 2, 3]
    assert rows[1]["hash_ids"] == [1, 2]  # fewer ids than blocks: aiperf pads the tail
    assert rows[1]["timestamp"] == 500.0
    # the same partial tail twice at one size is kept (identical prompts share it)
    rows, _ = trace_rows([req(0.0, 20, 1, ids=(7, 8), block=16),
                          req(0.1, 20, 1, ids=(7, 8), block=16),
                          req(0.2, 36, 1, ids=(7, 9, 8), block=16)])
    assert [r["hash_ids"] for r in rows] == [[7, 8], [7, 8], [7, 9, 8]]
    rows, _ = trace_rows([req(0.0, 20, 1, ids=(7, 8), block=16),
                          req(0.1, 48, 1, ids=(7, 8, 9), block=16)])
    assert [r["hash_ids"] for r in rows] == [[7], [7, 8, 9]]


@pytest.mark.parametrize(("requests", "match"), [
    ([], "no request"),
    ([req(1.0), req(0.5)], "sort the requests"),
    ([req(0.0, ids=(1,), block=512), req(0.1, ids=(1,), block=16)], "one block size"),
])
def test_trace_rows_refusals(requests, match):
    with pytest.raises(AiperfError, match=match):
        trace_rows(requests)


def test_read_trace_round_trip_and_refusals(tmp_path):
    t = write_trace([req(0.0, 600, 7), req(0.25, 30, 2)], tmp_path / "t.jsonl")
    back = read_trace(t.path)
    assert np.array_equal(back.arrival_s, t.arrival_s)
    assert list(back.input_tokens) == [600, 30] and list(back.output_tokens) == [7, 2]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session_id": "x", "timestamp": 0}\n')
    with pytest.raises(AiperfError, match="write_trace"):
        read_trace(bad)
    with pytest.raises(AiperfError, match="cannot read"):
        read_trace(tmp_path / "missing.jsonl")


# ------------------------------------------------------------------------------------ tokenizer

def test_built_tokenizer_is_deterministic_one_word_one_token(tmp_path):
    from tokenizers import Tokenizer

    a, b = build_tokenizer(tmp_path / "a"), build_tokenizer(tmp_path / "b")
    names = sorted(p.name for p in a.iterdir())
    assert names == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes()
    tok = Tokenizer.from_file(str(a / "tokenizer.json"))
    vocab = tok.get_vocab()
    assert len(_WORDS) > 400 and all(w in vocab for w in _WORDS)
    # any text: whitespace words = tokens (what the stub and word-counting servers count)
    for text in ("the love of zebra-42 ünïcode!\n\n  the\tend", "x", "a  b   c"):
        assert len(tok.encode(text).ids) == len(text.split())
    # what aiperf does with --prompt-corpus random: draw ids, decode, count again
    rng = np.random.default_rng(0)
    ids = [vocab[w] for w in rng.choice(_WORDS, 300)]
    text = tok.decode(ids)
    assert len(text.split()) == 300 and tok.encode(text).ids == ids
    cfg = json.loads((a / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "chat_template" in cfg


def test_prepare_tokenizer_hf_cache_layout(tmp_path):
    ref = prepare_tokenizer(tmp_path / "hf")
    repo = tmp_path / "hf" / "models--servetune--words-v1"
    assert ref.repo_id == "servetune/words-v1" and len(ref.revision) == 40
    assert (repo / "refs" / "main").read_text() == ref.revision
    assert (ref.snapshot_dir / "tokenizer.json").is_file()
    assert ref.snapshot_dir == repo / "snapshots" / ref.revision
    assert prepare_tokenizer(tmp_path / "hf") == ref  # idempotent: same files, same snapshot
    assert not [p for p in (tmp_path / "hf").iterdir() if p.name.startswith(".staging")]
    env = ref.env()
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HUB_CACHE"] == str(tmp_path / "hf")
    # what aiperf does under HF_HUB_OFFLINE=1 (common/tokenizer.py: _resolve_local_snapshot)
    hub = pytest.importorskip("huggingface_hub")
    found = hub.snapshot_download(ref.repo_id, revision="main", local_files_only=True,
                                  cache_dir=str(tmp_path / "hf"))
    assert Path(found) == ref.snapshot_dir


def test_prepare_tokenizer_copies_only_tokenizer_files(tmp_path):
    src = tmp_path / "My Model"
    build_tokenizer(src)
    (src / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 1024)
    (src / "config.json").write_text("{}")
    ref = prepare_tokenizer(tmp_path / "hf", source=src)
    assert ref.repo_id == "local/My-Model"
    assert sorted(p.name for p in ref.snapshot_dir.iterdir()) == [
        "config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    with pytest.raises(AiperfError, match="holds no tokenizer"):
        prepare_tokenizer(tmp_path / "hf", source=tmp_path / "hf")
    with pytest.raises(AiperfError, match="org/name"):
        prepare_tokenizer(tmp_path / "hf", repo_id="no slash")


# ------------------------------------------------------------------------------------- argv

BASE = dict(urls=["http://10.0.0.5:30000/"], model="glm-5", tokenizer="servetune/words-v1",
            artifact_dir="/results/run1", client_cpus=8)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_replay_argv():
    argv = profile_argv(mode="replay", input_file="/data/t.jsonl", block_size=512, **BASE)
    assert argv[:2] == ["aiperf", "profile"]
    assert flag(argv, "--url") == "http://10.0.0.5:30000"
    assert flag(argv, "--custom-dataset-type") == "mooncake_trace"
    assert flag(argv, "--input-file") == "/data/t.jsonl"
    assert "--fixed-schedule" in argv and flag(argv, "--fixed-schedule-start-offset") == "0"
    assert flag(argv, "--isl-block-size") == "512"
    assert flag(argv, "--workers-max") == str(default_workers(8)) == "5"
    assert json.loads(flag(argv, "--extra-inputs")) == {"ignore_eos": True}
    for f in ("--streaming", "--use-server-token-count", "--no-server-metrics",
              "--no-gpu-telemetry", "--no-auto-plot"):
        assert f in argv
    assert flag(argv, "--ui") == "none" and flag(argv, "--export-level") == "records"
    assert flag(argv, "--endpoint-type") == "completions"
    assert "--concurrency" not in argv and "--synthesis-speedup-ratio" not in argv
    no_ids = profile_argv(mode="replay", input_file="/t.jsonl", **BASE)
    assert "--isl-block-size" not in no_ids


def test_synthetic_argv():
    c = profile_argv(mode="concurrency", concurrency=64, isl=2048, osl=512, duration_s=120,
                     request_timeout_s=300, **BASE)
    assert flag(c, "--concurrency") == "64" and flag(c, "--isl") == "2048"
    assert flag(c, "--isl-stddev") == "0" and flag(c, "--osl-stddev") == "0"
    assert flag(c, "--benchmark-duration") == "120"
    assert flag(c, "--benchmark-grace-period") == "300"  # drain like the HTTP runner
    assert flag(c, "--num-dataset-entries") == "1000"
    r = profile_argv(mode="rate", request_rate=20.5, arrival="constant", isl=256, osl=64,
                     request_count=400, slo_ttft_ms=200, workers=2, **BASE)
    assert flag(r, "--request-rate") == "20.5" and flag(r, "--arrival-pattern") == "constant"
    assert flag(r, "--request-count") == "400" and flag(r, "--num-dataset-entries") == "400"
    assert flag(r, "--goodput") == "time_to_first_token:200"
    assert flag(r, "--workers-max") == "2" and "--benchmark-duration" not in r


@pytest.mark.parametrize(("kw", "match"), [
    (dict(mode="replay"), "input_file"),
    (dict(mode="replay", input_file="t", concurrency=4), "no concurrency"),
    (dict(mode="concurrency", isl=1, osl=1, duration_s=1), "concurrency >= 1"),
    (dict(mode="rate", isl=1, osl=1, duration_s=1, request_rate=math.inf), "request_rate"),
    (dict(mode="concurrency", concurrency=2, isl=1, osl=1), "duration_s or request_count"),
    (dict(mode="sweep"), "mode replay"),
])
def test_argv_refusals(kw, match):
    with pytest.raises(AiperfError, match=match):
        profile_argv(**{**BASE, **kw})


def test_default_workers():
    assert [default_workers(c) for c in (1, 2, 4, 8, 16)] == [1, 1, 2, 5, 11]


# ------------------------------------------------------------------ artifacts (recorded fixtures)

def raw_records(adir: Path) -> list[dict]:
    return rows_of(adir / "profile_export.jsonl")


def phase_start(adir: Path) -> int:
    text = (adir / "logs" / "aiperf.log").read_text()
    return int(text.split(", start_ns=")[1].split(",")[0])


def test_parse_recorded_replay():
    trace = read_trace(FIX / "replay" / "trace.jsonl")
    adir = FIX / "replay" / "aiperf"
    run = parse_artifacts(adir, trace)
    raw = {r["metadata"]["conversation_id"]: r for r in raw_records(adir)}
    zero = phase_start(adir)
    assert run.clock == "phase start" and run.stopped_early is None
    assert len(run.records) == len(trace) == len(raw) == 12
    for i, (rec, sent) in enumerate(zip(run.records, run.sent_s, strict=True)):
        r = raw[session_id(i)]
        assert rec.arrival_s == trace.arrival_s[i]  # the schedule, in trace row order
        assert sent == pytest.approx((r["metadata"]["request_start_ns"] - zero) / 1e9)
        m = r["metrics"]
        if rec.error is None:
            ttft = m["time_to_first_token"]["value"] / 1e3
            assert rec.first_token_s == pytest.approx(sent + ttft)
            assert rec.ttft_s == pytest.approx(sent - rec.arrival_s + ttft)  # incl. dispatch lag
            gaps = np.array(m["inter_chunk_latency"]["value"]) / 1e3
            assert np.allclose(rec.itl_s, gaps)
            assert rec.finish_s == pytest.approx(rec.first_token_s + gaps.sum())
            assert rec.output_tokens == m["output_sequence_length"]["value"] == 8
            assert rec.input_tokens == m["input_sequence_length"]["value"]
    errors = [r.error for r in run.records if r.error]
    assert sum(e.startswith("HTTP 503 Service Unavailable:") for e in errors) == 2
    cut = [e for e in errors if "final usage chunk" in e]
    assert len(cut) == 1 and "after 4 text chunks" in cut[0]  # stub: half of 8 tokens
    assert run.error_counts() == {"http_status": 2, "disconnect": 1}
    assert [c is None for c in run.error_class] == [r.error is None for r in run.records]
    assert list(run.cached_tokens) == [-1] * 12  # the stub ran without a cache report
    assert run.dispatch_lag_ms.p50 is not None and run.dispatch_lag_ms.p50 >= 0
    s = run.summary(gpus=2, slo_ttft_ms=1000)
    assert s == summarize(run.records, 2, slo_ttft_ms=1000)
    assert (s.requests, s.completed, s.errors, s.output_tokens) == (12, 9, 3, 72)
    assert run.aiperf_metrics["run"]["aiperf_version"] == AIPERF_VERSION
    assert run.aiperf_metrics["request_count"]["avg"] == 10  # aiperf counts the cut stream ok
    assert run.client_overhead_ms.mean == run.aiperf_metrics["credit_to_start_latency"]["avg"]


def test_parse_without_log_anchors_on_least_late_credit(tmp_path):
    adir = tmp_path / "a"
    shutil.copytree(FIX / "replay" / "aiperf", adir)
    (adir / "logs" / "aiperf.log").unlink()
    trace = read_trace(FIX / "replay" / "trace.jsonl")
    run = parse_artifacts(adir, trace)
    ref = parse_artifacts(FIX / "replay" / "aiperf", trace)
    assert run.clock == "least-late credit"
    shift = ref.sent_s - run.sent_s
    assert np.allclose(shift, shift[0]) and abs(shift[0]) < 0.05  # a constant, < 50 ms


def test_parse_recorded_concurrency_run():
    adir = FIX / "concurrency" / "aiperf"
    run = parse_artifacts(adir, None, isl=32, osl=4)
    raw = sorted(raw_records(adir), key=lambda r: r["metadata"]["credit_issued_ns"])
    zero = phase_start(adir)
    assert len(run.records) == 8
    for rec, sent, r in zip(run.records, run.sent_s, raw, strict=True):
        assert rec.arrival_s == pytest.approx((r["metadata"]["credit_issued_ns"] - zero) / 1e9)
        assert sent == pytest.approx((r["metadata"]["request_start_ns"] - zero) / 1e9)
        assert sent >= rec.arrival_s
    assert [r.arrival_s for r in run.records] == sorted(r.arrival_s for r in run.records)
    errors = [r for r in run.records if r.error]
    assert len(errors) == 3 and all(e.input_tokens == 32 for e in errors
                                    if e.error.startswith("HTTP"))
    assert all(r.output_tokens == 4 for r in run.records if r.error is None)
    assert run.error_counts() == {"http_status": 2, "disconnect": 1}
    # asking for more tokens than the server produced makes every success a truncation
    more = parse_artifacts(adir, None, isl=32, osl=5)
    assert more.error_counts() == {"http_status": 2, "disconnect": 1, "truncated": 5}
    assert "truncated output: 4 of the 5 tokens asked" in more.records[0].error


@pytest.mark.parametrize(("err", "cls"), [
    ({"code": 503, "type": "Service Unavailable", "message": "busy"}, "http_status"),
    ({"code": 499, "type": "RequestCancellationError", "message": "cancelled"}, "timeout"),
    ({"type": "TimeoutError", "message": ""}, "timeout"),
    ({"type": "ClientConnectorError", "message": "refused"}, "connect"),
    ({"type": "ServerDisconnectedError", "message": ""}, "disconnect"),
    ({"type": "ClientPayloadError", "message": "cut"}, "disconnect"),
    ({"type": "SSEResponseError", "message": "bad"}, "stream"),
    ("not an object", "stream"),
])
def test_error_classes(err, cls):
    assert _error_class(err) == cls


def test_error_classes_match_the_http_runner():
    runner = pytest.importorskip("mcp_servers.bench.http")
    if not hasattr(runner, "ErrorClass"):
        pytest.skip("the HTTP runner has no ErrorClass")
    assert {ap.HTTP_STATUS, ap.TIMEOUT, ap.CONNECT, ap.DISCONNECT, ap.STREAM,
            ap.TRUNCATED} == {c.value for c in runner.ErrorClass}


def test_parse_fills_missing_rows_and_refuses_foreign_records(tmp_path):
    trace = read_trace(FIX / "replay" / "trace.jsonl")
    adir = tmp_path / "a"
    shutil.copytree(FIX / "replay" / "aiperf", adir)
    lines = (adir / "profile_export.jsonl").read_text().splitlines()
    keep = [ln for ln in lines if '"conversation_id":"r000011"' not in ln]
    assert len(keep) == 11
    (adir / "profile_export.jsonl").write_text("\n".join(keep) + "\n")
    run = parse_artifacts(adir, trace)
    assert "no record" in run.records[11].error and run.sent_s[11] == trace.arrival_s[11]
    assert run.error_class[11] == "stream"

    (adir / "profile_export.jsonl").write_text("\n".join(lines + lines[:1]) + "\n")
    with pytest.raises(AiperfError, match="two records for one trace row"):
        parse_artifacts(adir, trace)
    short = write_trace([req(0.0)], tmp_path / "short.jsonl")
    (adir / "profile_export.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(AiperfError, match="not a row of short.jsonl"):
        parse_artifacts(adir, short)
    (adir / "profile_export.jsonl").write_text(lines[0] + "\n{not json\n")
    with pytest.raises(AiperfError, match=r"profile_export.jsonl:2 is not an aiperf record"):
        parse_artifacts(adir, trace)
    r = json.loads(lines[0])
    del r["metadata"]["request_start_ns"]
    (adir / "profile_export.jsonl").write_text(json.dumps(r) + "\n")
    with pytest.raises(AiperfError, match="metadata.request_start_ns"):
        parse_artifacts(adir, trace)


def test_parse_missing_or_damaged_artifacts(tmp_path):
    with pytest.raises(AiperfError, match="wrote no per-request records"):
        parse_artifacts(tmp_path / "nowhere")
    adir = tmp_path / "a"
    shutil.copytree(FIX / "concurrency" / "aiperf", adir)
    (adir / "profile_export_aiperf.json").write_text("[1, 2]")
    with pytest.raises(AiperfError, match="summary .* is unreadable"):
        read_summary(adir)
    (adir / "profile_export_aiperf.json").unlink()
    assert parse_artifacts(adir, isl=32).aiperf_metrics == {}
    (adir / ".aiperf_results_ready.json").write_text('{"ready": true, "was_cancelled": true}')
    assert "cancelled" in parse_artifacts(adir).stopped_early


def test_failure_reason_from_real_console_output():
    # aiperf 0.13.0's console when the tokenizer is not in the offline cache (recorded)
    out = textwrap.dedent("""\
        ╭──────────────────────────── AIPerf System Error ────────────────────────────╮
        │ • Service: dataset_manager                                                   │
        │    Operation: Configure Profiling                                            │
        │    Error: TokenizerError                                                     │
        │    Reason: Failed to load tokenizer 'servetune/nope': OSError: Tokenizer     │
        │            'servetune/nope' (revision 'main') is not present in              │
        │            the HuggingFace cache. Run online once to populate the            │
        │            cache, or unset HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE.              │
        │                                                                              │
        │ • Service: system_controller                                                 │
        ╰──────────────────────────────────────────────────────────────────────────────╯
        Log File: /tmp/ap/out5/logs/aiperf.log
        """)
    reason = failure_reason(out)
    assert reason.startswith("Reason: Failed to load tokenizer 'servetune/nope'")
    assert reason.endswith("unset HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE.")
    assert "\n" not in reason and "│" not in reason
    assert failure_reason("boom\n\n") == "boom" and failure_reason("") == "no output"


# ------------------------------------------------------------------------- finding and running

def test_find_aiperf_errors_name_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("SERVETUNE_AIPERF", str(tmp_path / "missing-aiperf"))
    with pytest.raises(AiperfError, match="SERVETUNE_AIPERF") as e:
        find_aiperf()
    assert INSTALL_HINT in str(e.value)
    monkeypatch.delenv("SERVETUNE_AIPERF")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(AiperfError, match=r"aiperf is not installed.*pip install -e"):
        find_aiperf()


FAKE = '''#!{python}
"""A fake aiperf: --version, and profile copying recorded artifacts (or failing)."""
import os, shutil, sys
args = sys.argv[1:]
if args == ["--version"]:
    print(os.environ.get("FAKE_VERSION", "{version}"))
    sys.exit(0)
with open(os.environ["FAKE_LOG"], "w") as f:
    f.write(repr(args) + "\\n" + repr({{k: v for k, v in os.environ.items()
                                     if k.startswith("HF_")}}))
if os.environ.get("FAKE_FAIL"):
    print("│    Reason: cannot connect to the endpoint      │")
    sys.exit(1)
out = args[args.index("--artifact-dir") + 1]
shutil.copytree(os.environ["FAKE_SRC"], out, dirs_exist_ok=True)
'''


@pytest.fixture
def fake_aiperf(tmp_path, monkeypatch):
    exe = tmp_path / "bin" / "aiperf"
    exe.parent.mkdir()
    exe.write_text(FAKE.format(python=sys.executable, version=AIPERF_VERSION))
    exe.chmod(0o755)
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "fake.log"))
    monkeypatch.setenv("SERVETUNE_AIPERF", str(exe))
    return exe


def test_runner_replay_with_fake_aiperf(fake_aiperf, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SRC", str(FIX / "replay" / "aiperf"))
    trace = read_trace(FIX / "replay" / "trace.jsonl")
    reqs = [req(float(t), int(i), int(o)) for t, i, o in
            zip(trace.arrival_s, trace.input_tokens, trace.output_tokens, strict=True)]
    runner = AiperfRunner(tmp_path / "cache", client_cpus=4)
    assert runner.binary == str(fake_aiperf)
    run = asyncio.run(runner.replay(reqs, ["http://127.0.0.1:9"], "m", tmp_path / "r"))
    assert len(run.records) == 12 and run.returncode == 0 and run.notes == []
    assert run.argv[0] == str(fake_aiperf) and flag(run.argv, "--workers-max") == "2"
    assert flag(run.argv, "--input-file") == str(tmp_path / "r" / "trace.jsonl")
    logged = (tmp_path / "fake.log").read_text()
    assert "'HF_HUB_OFFLINE': '1'" in logged and str(tmp_path / "cache" / "hf") in logged
    assert len(rows_of(tmp_path / "r" / "trace.jsonl")) == 12


def test_runner_failures_with_fake_aiperf(fake_aiperf, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "1")
    runner = AiperfRunner(tmp_path / "cache")
    with pytest.raises(AiperfError, match=r"aiperf failed \(exit 1\): Reason: cannot connect"):
        asyncio.run(runner.synthetic("concurrency", ["http://127.0.0.1:9"], "m", tmp_path / "s",
                                     isl=8, osl=2, concurrency=1, request_count=2))
    monkeypatch.setenv("FAKE_VERSION", "0.14.1")
    (tmp_path / "fake.log").unlink()
    runner = AiperfRunner(tmp_path / "cache")
    with pytest.raises(AiperfError, match=r"aiperf 0\.14\.1; servetune is pinned to 0\.13\.0"):
        asyncio.run(runner.replay([req(0.0)], ["http://127.0.0.1:9"], "m", tmp_path / "v"))
    assert not (tmp_path / "fake.log").exists()  # refused before `aiperf profile` ran


CHILDREN = '''
import os, subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
open(sys.argv[1], "w").write(" ".join(str(p) for p in [os.getpid()] + [k.pid for k in kids]))
time.sleep(60)
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); its state in /proc says Z
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def _wait_for(path: Path) -> list[int]:
    for _ in range(200):
        if path.exists() and path.read_text().strip():
            return [int(x) for x in path.read_text().split()]
        time.sleep(0.05)
    raise AssertionError("the child did not start")


def test_timeout_kills_the_whole_process_group(tmp_path):
    pids = tmp_path / "pids"
    argv = [sys.executable, "-c", CHILDREN, str(pids)]
    with pytest.raises(AiperfError, match="did not finish within 2 s"):
        asyncio.run(run_process(argv, env=dict(os.environ), timeout_s=2))
    procs = [int(x) for x in pids.read_text().split()]
    assert len(procs) == 3
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in procs)


def test_cancellation_kills_the_process_group(tmp_path):
    pids = tmp_path / "pids"

    async def main() -> None:
        task = asyncio.create_task(run_process(
            [sys.executable, "-c", CHILDREN, str(pids)], env=dict(os.environ), timeout_s=60,
            log_path=tmp_path / "out.log"))
        await asyncio.to_thread(_wait_for, pids)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    procs = _wait_for(pids)
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in procs)


def test_normal_exit_reaps_leftover_group_members(tmp_path):
    pids = tmp_path / "pids"
    script = ("import subprocess, sys\n"
              "k = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "open(sys.argv[1], 'w').write(str(k.pid))\n")
    rc, _ = asyncio.run(run_process([sys.executable, "-c", script, str(pids)],
                                    env=dict(os.environ), timeout_s=30))
    assert rc == 0
    (orphan,) = _wait_for(pids)
    deadline = time.monotonic() + 5
    while _alive(orphan) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(orphan)


def test_run_process_pins_cpus_and_returns_output():
    cpu = sorted(os.sched_getaffinity(0))[-1]
    rc, out = asyncio.run(run_process(
        [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        env=dict(os.environ), timeout_s=30, cpu_affinity=[cpu]))
    assert rc == 0 and out.strip() == f"[{cpu}]"


def test_run_process_cannot_start(tmp_path):
    with pytest.raises(AiperfError, match="cannot start"):
        asyncio.run(run_process([str(tmp_path / "nope")], env={}, timeout_s=5))


# ----------------------------------------------------------------------- real aiperf (optional)

def _real_aiperf() -> str | None:
    try:
        exe = find_aiperf()
        return exe if ap.aiperf_version(exe) == AIPERF_VERSION else None
    except AiperfError:
        return None



TTFT_MS, ITL_MS = 20.0, 5.0


@pytest.fixture
def stub_url():
    """The stub (TTFT 20 ms, ITL 5 ms, keep-alive, server timing, prefix cache); stopped by PID.

    The last three options are newer than the stub's first version, which ignores unknown
    flags; the checks that need them are skipped when the stub does not report them.
    """
    with running_stub("--keep-alive", "--record", "--cached-tokens", "prefix",
                      ttft_ms=TTFT_MS, itl_ms=ITL_MS) as url:
        yield url


def _cached_tokens(url: str) -> float | None:
    """``sglang:cached_tokens_total`` from the stub's /metrics, if it reports it."""
    text = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
    for line in text.splitlines():
        if line.startswith("sglang:cached_tokens_total"):
            return float(line.split()[-1])
    return None


def _server_ttft_ms(url: str) -> float | None:
    """Mean server-side TTFT (first chunk - body read) if the stub records timing."""
    try:
        r = httpx.get(url + "/stub/timing", timeout=5, trust_env=False)
        reqs = r.json()["requests"] if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    vals = [(q["first"] - q["recv"]) * 1e3 for q in reqs if q.get("first") is not None]
    return float(np.mean(vals)) if vals else None


@pytest.mark.skipif(_real_aiperf() is None,
                    reason=f"needs aiperf {AIPERF_VERSION} (SERVETUNE_AIPERF or PATH)")
def test_real_aiperf_against_the_stub(stub_url, tmp_path):
    # 40 requests, one every 100 ms (10 req/s), 256 prompt tokens in 512-token blocks that
    # share their first id in pairs, 16 output tokens
    reqs = [req(0.1 * i, 256, 16, ids=(i // 2,), block=512) for i in range(40)]
    runner = AiperfRunner(tmp_path / "cache", request_timeout_s=60, client_cpus=2)
    t0 = time.monotonic()
    run = asyncio.run(runner.replay(reqs, [stub_url], "stub-model", tmp_path / "replay"))
    replay_wall = time.monotonic() - t0
    server_ttft = _server_ttft_ms(stub_url)
    cached = _cached_tokens(stub_url)
    assert run.returncode == 0 and run.clock == "phase start"
    assert [r.error for r in run.records] == [None] * 40
    assert all(r.output_tokens == 16 for r in run.records)
    # the built-in tokenizer makes 256 tokens 256 words: the stub's usage counts words
    assert all(r.input_tokens == 256 for r in run.records)
    if cached is not None:  # pairs share their one (256-token) block: 20 x 255 words cached
        assert 20 * 255 <= cached < 20 * 255 + 200
        assert run.cached_tokens.sum() == cached  # per request, from the usage aiperf kept
    s = run.summary(gpus=1)
    lag = run.dispatch_lag_ms
    client_ttft = np.array([r.first_token_s - sent for r, sent in
                            zip(run.records, run.sent_s, strict=True)]) * 1e3
    # scheduling errors, not fidelity: bounds that hold on a loaded 2-core machine
    assert lag.p50 is not None and 0 <= lag.p50 < 100 and lag.p99 < 500
    assert TTFT_MS <= float(np.median(client_ttft)) < TTFT_MS + 100
    assert s.itl_ms.p50 == pytest.approx(ITL_MS, abs=3)
    span = run.sent_s.max() - run.sent_s.min()
    assert 3.5 < span < 4.5  # 39 gaps of 100 ms: the schedule was kept, not compressed

    conc = asyncio.run(runner.synthetic("concurrency", [stub_url], "stub-model",
                                        tmp_path / "conc", isl=64, osl=8, concurrency=4,
                                        request_count=40))
    cs = conc.summary(gpus=1)
    assert cs.requests == 40 and cs.errors == 0
    assert all(r.output_tokens == 8 for r in conc.records)
    print(f"\naiperf {AIPERF_VERSION} vs stub (TTFT {TTFT_MS:g} ms, ITL {ITL_MS:g} ms), replay of "
          f"40 req at 10 req/s, {replay_wall:.1f} s wall incl. aiperf start-up:\n"
          f"  client TTFT (aiperf, from send) mean {client_ttft.mean():.2f} / p50 "
          f"{np.median(client_ttft):.2f} ms -> bias vs configured "
          f"{client_ttft.mean() - TTFT_MS:+.2f} ms"
          + (f", vs server-side {server_ttft:.2f} ms: {client_ttft.mean() - server_ttft:+.2f} ms"
             if server_ttft is not None else "") + "\n"
          f"  record TTFT (from schedule) p50 {s.ttft_ms.p50:.2f} / p99 {s.ttft_ms.p99:.2f} ms\n"
          f"  dispatch lag (send - schedule) p50 {lag.p50:.2f} / p90 {lag.p90:.2f} / p99 "
          f"{lag.p99:.2f} ms; credit->start p50 {run.client_overhead_ms.p50:.2f} ms\n"
          f"  ITL p50 {s.itl_ms.p50:.3f} ms; prefix-cached words at the stub {cached} "
          f"(trace: {20 * 255}); concurrency 4: TTFT p50 {cs.ttft_ms.p50:.2f} ms, "
          f"{cs.request_rate:.1f} req/s")
