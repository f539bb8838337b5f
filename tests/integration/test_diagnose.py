"""``servetune diagnose`` as a user runs it (subprocess) and the lessons MCP tool ``diagnose_log``
over stdio: the JSON keys, the exit codes, stdin, ``--learn`` into a real lesson store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from fixtures.cli import servetune
from fixtures.pinned_source import pinned_tree  # noqa: F401  (the session fixture)
from mcp import Client, StdioServerParameters

from domain.diagnosis import JSON_KEYS
from memory.store import LessonStore

REPO_ROOT = Path(__file__).resolve().parents[2]
# SGLang 0.5.23's own lines (entrypoints/engine.py:311, model_runner.py:1274/1373,
# memory_pool.py:2095, cuda_graph_setup.py:759, decode_cuda_graph_runner.py:603)
GRAPH_OOM_LOG = """\
[2026-01-01 10:00:00] server_args={'model_path': 'zai-org/GLM-5-FP8', 'tp_size': 8, \
'mem_fraction_static': 0.93, 'attention_backend': None}
[2026-01-01 10:00:05 TP0] Load weight begin. avail mem=177.10 GB
[2026-01-01 10:02:05 TP0] Load weight end. type=GlmMoeDsaForCausalLM, avail mem=90.20 GB
[2026-01-01 10:02:06 TP0] KV Cache is allocated. dtype: fp8_e4m3, #tokens: 700000, KV size: 36.1 GB
[2026-01-01 10:02:07 TP0] Capture target decode CUDA graph begin. backend=full, \
num_tokens_per_req=1, avail mem=3.00 GB
[2026-01-01 10:02:09 TP0] Capture cuda graph failed: CUDA out of memory. Tried to allocate 2.00 GiB.
"""
ENV = {"SERVETUNE_EMBEDDING": "hashing"}


def test_diagnose_json_keys_and_the_lesson_it_would_write(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(GRAPH_OOM_LOG)
    r = servetune("diagnose", str(log), "--engine", "sglang", "--version", "0.5.23", "--gpu",
                  "B200", "--json", tmp=tmp_path, env=ENV)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert tuple(out) == JSON_KEYS == ("class", "phase", "evidence", "source", "flags", "retry",
                                       "fix", "lesson")
    assert (out["class"], out["phase"], out["retry"]) == ("GRAPH_CAPTURE_OOM", "cuda_graph", False)
    assert out["evidence"].endswith("Capture cuda graph failed: CUDA out of memory. Tried to "
                                    "allocate 2.00 GiB.")
    assert "--mem-fraction-static" in out["flags"] and "--cuda-graph-max-bs-decode" in out["fix"]
    les = out["lesson"]
    assert les["failure_class"] == "GRAPH_CAPTURE_OOM" and les["verified"] is False
    assert les["scope"]["model"] == "glm-5" and les["scope"]["quantization"] == "fp8"
    clauses = {c["field"]: c["value"] for c in les["condition"]}
    assert clauses["mem_fraction_static"] == 0.93 and clauses["tp_size"] == 8


def test_diagnose_text_from_stdin_and_learn_stores_the_lesson(tmp_path):
    e = dict(os.environ, SERVETUNE_LESSONS_DIR=str(tmp_path / "lessons"),
             SERVETUNE_EMBEDDING="hashing", COLUMNS="200",
             SERVETUNE_SOURCE_CACHE=str(tmp_path / "no-source"))
    r = subprocess.run([sys.executable, "-m", "servetune.cli", "diagnose", "-", "--gpu", "B200",
                        "--learn"], input=GRAPH_OOM_LOG, capture_output=True, text=True,
                       cwd=tmp_path, env=e, timeout=300)
    assert r.returncode == 0, r.stderr
    for key in ("class", "phase", "evidence", "source", "fix", "lesson"):
        assert key in r.stdout
    assert "GRAPH_CAPTURE_OOM" in r.stdout and "stored lesson L-" in r.stdout
    with LessonStore(tmp_path / "lessons", embedding="hashing") as store:
        stored = store.list()
    assert [x.failure_class for x in stored] == ["GRAPH_CAPTURE_OOM"]


def test_diagnose_says_why_no_lesson_forms_without_a_config(tmp_path):
    log = tmp_path / "argparse.log"
    log.write_text("usage: sglang serve [-h] --model-path MODEL_PATH ...\n"
                   "sglang serve: error: unrecognized arguments: --enable-foo 1\n")
    r = servetune("diagnose", str(log), "--json", tmp=tmp_path, env=ENV)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["class"], out["phase"], out["flags"], out["lesson"]) == (
        "BAD_FLAG", "args", ["--enable-foo"], None)
    assert "lesson cannot be formed" in r.stderr and "--gpu" in r.stderr


@pytest.mark.parametrize("args, message", [
    (["missing.log"], "no log file"),
    (["empty.log"], "the log is empty"),
    (["ok.log", "--engine", "vllm"], "supported: sglang"),
    (["ok.log", "--version", "0.4.0"], "fetch it with `servetune source fetch --version 0.4.0`"),
    (["ok.log", "--gpu", "A100"], "known: B200"),
    (["ok.log", "--model", "gpt-9"], "known: llama-3.1-8b"),
])
def test_diagnose_bad_input_exits_2_naming_the_catalog(tmp_path, args, message):
    (tmp_path / "empty.log").write_text("\n \n")
    (tmp_path / "ok.log").write_text(GRAPH_OOM_LOG)
    r = servetune("diagnose", *args, tmp=tmp_path, env=ENV)
    assert r.returncode == 2 and message in r.stderr, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr


@pytest.mark.anyio
async def test_diagnose_log_tool_over_stdio(tmp_path):
    params = StdioServerParameters(
        command=sys.executable, cwd=str(REPO_ROOT),
        args=["-c", "from mcp_servers.lessons.server import main; "
                    f"main({str(tmp_path / 'store')!r}, 'hashing')"])
    with anyio.fail_after(60):
        async with Client(params) as client:
            r = await client.call_tool("diagnose_log", {"log": GRAPH_OOM_LOG, "gpu": "B200"})
            bad = await client.call_tool("diagnose_log", {"log": GRAPH_OOM_LOG, "gpu": "A100"})
            listed = await client.call_tool("list_lessons", {})
    assert not r.is_error
    out = r.structured_content
    assert (out["failure_class"], out["phase"], out["verified"]) == (
        "GRAPH_CAPTURE_OOM", "cuda_graph", False)
    assert out["lesson"]["scope"]["gpu"] == "B200" and out["no_lesson"] is None
    assert bad.is_error and "known: B200" in bad.content[0].text
    assert listed.structured_content["total"] == 0  # the tool stores nothing


# SGLang 0.5.23 layers/attention/vision.py:1331 refuses the vision encoder's fa3 on Blackwell;
# the log's server_args state the flag (quoted wording: sgl-project/sglang issue 12360)
FA3_VISION_LOG = """\
[2026-01-01 10:00:00] server_args={'model_path': 'zai-org/GLM-5-FP8', 'tp_size': 8, \
'mm_attention_backend': 'fa3'}
[2026-01-01 10:00:05 TP0] Load weight begin. avail mem=177.10 GB
Traceback (most recent call last):
ValueError: The 'fa3' backend is not supported on Blackwell GPUs
"""


def test_diagnose_grounded_in_the_pinned_source_builds_the_condition_from_the_guard(
        tmp_path, pinned_tree):  # noqa: F811  (the session fixture)
    log = tmp_path / "vision.log"
    log.write_text(FA3_VISION_LOG)
    r = servetune("diagnose", str(log), "--gpu", "B200", "--source", str(pinned_tree), "--json",
                  tmp=tmp_path, env=ENV)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["class"], out["phase"]) == ("UNSUPPORTED_BACKEND", "weights_load")
    assert out["source"] == "sglang/srt/layers/attention/vision.py:1331"
    assert out["flags"] == ["--mm-attention-backend"]
    les = out["lesson"]
    assert les["verified"] is True and les["source_site"] == out["source"]
    assert les["condition"] == [{"field": "mm_attention_backend", "op": "eq", "value": "fa3"}]
    assert les["scope"]["sm_major"] == 10 and les["scope"]["model"] is None  # any SM 100 GPU
    # without a source tree: the taxonomy's rule, the same flag, unverified
    r = servetune("diagnose", str(log), "--gpu", "B200", "--json", tmp=tmp_path, env=ENV)
    out = json.loads(r.stdout)
    assert out["lesson"]["verified"] is False and out["flags"] == ["--mm-attention-backend"]
    assert out["lesson"]["condition"] == [
        {"field": "mm_attention_backend", "op": "eq", "value": "fa3"}]
    assert "no SGLang 0.5.23 source tree" in r.stderr
