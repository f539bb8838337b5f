"""servetune check as a user runs it (exit codes, --json keys) and the MCP tool check_command.

One check runs in a ``servetune`` subprocess (the real entry point); the others in this process
through typer's CliRunner (fixtures/cli_runner.py), the same command without 1 s of imports each.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio
import pytest
from fixtures.cli import servetune, tiny_study, write
from fixtures.cli_runner import invoke
from fixtures.user_model import (
    H20_SPEC,
    LAB_MOE_KV_BF16,
    LAB_MOE_PARAMS,
    clean_registry,  # noqa: F401 (a fixture)
    write_model_dir,
)
from mcp import Client, StdioServerParameters

from domain.lesson import Clause, Lesson, Scope
from memory.store import LessonStore

REPO_ROOT = Path(__file__).resolve().parents[2]
BAILIAN = REPO_ROOT / "tests" / "fixtures" / "qwen_bailian_tiny.jsonl"
GLM5 = ["sglang", "serve", "--model-path", "zai-org/GLM-5-FP8"]


def check(tmp: Path, *args: str):
    return invoke("check", "--gpu", "B200", "--gpus", "8", *args, tmp=tmp)


def test_exit_codes_and_json_keys(tmp_path: Path) -> None:
    ok = servetune("check", "--gpu", "B200", "--gpus", "8", "--json", "--", *GLM5,
                   "--tp-size", "8", tmp=tmp_path)
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    assert list(out) == ["verdict", "findings", "model", "memory", "resolved"]
    assert out["model"]["name"] == "glm-5" and out["model"]["layers"] == 78
    assert out["verdict"] == "ok" and out["findings"] == []
    assert list(out["memory"]) == ["weights_bytes_per_gpu", "kv_bytes_per_token",
                                   "kv_pool_tokens", "min_mem_fraction_static",
                                   "graph_capture_bytes"]
    assert out["resolved"]["attention_backend"] == "dsa"

    warn = check(tmp_path, "--json", "--", "python", "-m", "sglang.launch_server",
                 "--model-path", "zai-org/GLM-5-FP8", "--tp-size", "8",
                 "--speculative-algorithm", "NEXTN")
    assert warn.returncode == 0
    report = json.loads(warn.stdout)
    assert report["verdict"] == "warn"
    assert all(list(f) == ["severity", "code", "message", "fix"] for f in report["findings"])
    assert "SPEC_DEFAULT_CAP" in {f["code"] for f in report["findings"]}

    refuse = check(tmp_path, "--", *GLM5, "--tp-size", "4")  # 186.5 GB of weights per GPU
    assert refuse.returncode == 1 and "DOES_NOT_FIT" in refuse.stdout
    retired = check(tmp_path, "--", *GLM5, "--tp-size", "8", "--cuda-graph-max-bs", "256")
    assert retired.returncode == 1 and "--cuda-graph-max-bs-decode" in retired.stdout


def test_bad_input_exits_2(tmp_path: Path) -> None:
    for args in ((), ("--", "vllm", "serve", "x"), ("--trace", "missing.jsonl", "--", *GLM5)):
        r = check(tmp_path, *args)
        assert r.returncode == 2 and r.stderr.startswith("error:"), (args, r.stderr)
    r = invoke("check", "--gpu", "X900", "--", *GLM5, tmp=tmp_path)
    assert r.returncode == 2 and "GPU catalog" in r.stderr


@pytest.mark.usefixtures("clean_registry")
def test_model_config_and_a_gpu_file(tmp_path: Path) -> None:
    """--model-config reads a model outside the catalog: its summary under ``model`` beside the
    memory fit, hand-checked (fixtures/user_model.py), and the text output's model line."""
    d = write_model_dir(tmp_path)
    (tmp_path / "h20.yaml").write_text(json.dumps(H20_SPEC))  # JSON is YAML too
    r = invoke("check", "--model-config", str(d / "config.json"), "--gpu", "h20.yaml",
               "--gpus", "8", "--json", "--", "sglang", "serve", "--model-path", str(d),
               "--tp-size", "2", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["model"] == {"name": "lab-moe", "architecture": "Qwen3MoeForCausalLM",
                            "layers": 24, "total_params": LAB_MOE_PARAMS,
                            "active_params": out["model"]["active_params"],
                            "kv_bytes_per_token_bf16": LAB_MOE_KV_BF16, "max_tp": 32}
    assert out["model"]["active_params"] < LAB_MOE_PARAMS / 4
    assert out["memory"]["weights_bytes_per_gpu"] == LAB_MOE_PARAMS * 2 / 2  # bf16, TP2
    assert out["memory"]["kv_bytes_per_token"] == LAB_MOE_KV_BF16 / 2  # 4 KV heads over TP2
    text = invoke("check", "--model-config", str(d), "--gpu", "H200", "--gpus", "8", "--",
                  "sglang", "serve", "--model-path", "any/name", "--tp-size", "2", tmp=tmp_path)
    assert text.returncode == 0, text.stderr
    assert "model: lab-moe (Qwen3MoeForCausalLM), 24 layers, 8.3B parameters" in text.stdout
    study = write(tmp_path, "s.yaml", tiny_study(  # the study's own model serves the command
        model="lab-moe", gpu="H200", gpu_count=2, baseline={"tp_size": 1, "weights": "bf16"},
        knobs={"tp_size": [1, 2]}, replay={"trace": str(BAILIAN), "format": "bailian",
                                           "start_s": 0, "duration_s": 100}))
    r = invoke("check", "--gpu", "H200", "--study", str(study), "--json", "--", "sglang",
               "serve", "--model-path", "lab/anything", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"]["name"] == "lab-moe"
    two = write_model_dir(tmp_path, "two")
    r = invoke("check", "--model-config", str(two), "--gpu", "H200", "--", "sglang", "serve",
               "--model-path", str(two), "--tp-size", "3", tmp=tmp_path)  # 32 heads, 4 KV
    assert r.returncode == 1 and "STARTUP_" in r.stdout and "model: two" in r.stdout


def test_trace_and_study_feed_the_prefix_lint(tmp_path: Path) -> None:
    r = check(tmp_path, "--json", "--trace", str(BAILIAN), "--", *GLM5, "--tp-size", "8")
    assert r.returncode == 0
    (f,) = json.loads(r.stdout)["findings"]
    assert f["code"] == "PREFIX_BELOW_PAGE" and "page_size 64" in f["message"]
    # DSA forces 64-token pages whatever --page-size says (model_overrides/deepseek_v2.py:171)
    r = check(tmp_path, "--json", "--trace", str(BAILIAN), "--", *GLM5, "--tp-size", "8",
              "--page-size", "16")
    (f,) = json.loads(r.stdout)["findings"]
    assert r.returncode == 0 and "page_size 64" in f["message"]
    study = write(tmp_path, "s.yaml", tiny_study(replay={
        "trace": str(BAILIAN), "format": "bailian", "start_s": 0, "duration_s": 100}))
    r = check(tmp_path, "--json", "--study", str(study), "--", *GLM5, "--tp-size", "8")
    assert r.returncode == 0 and "PREFIX_BELOW_PAGE" in r.stdout


@pytest.mark.anyio
async def test_check_command_tool_over_stdio(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with LessonStore(path, embedding="hashing") as s:
        s.add_many([Lesson(title="GLM-5 fp8 TP8 crashed on B200", scope=Scope(gpu="B200",
                                                                            model="glm-5"),
                           condition=[Clause(field="tp_size", op="eq", value=8)],
                           outcome="crash", root_cause="r", fix="use TP4 nvfp4",
                           evidence="e")])
    params = StdioServerParameters(
        command=sys.executable, cwd=str(REPO_ROOT),
        args=["-c", f"from mcp_servers.lessons.server import main; main({str(path)!r})"])
    with anyio.fail_after(60):
        async with Client(params) as client:
            ok = await client.call_tool("check_command", {
                "command": [*GLM5, "--tp-size", "8"], "gpu": "B200", "gpus": 8})
            bad = await client.call_tool("check_command", {"command": ["vllm", "serve"],
                                                           "gpu": "B200"})
    assert not ok.is_error
    out = ok.structured_content
    assert out["verdict"] == "warn" and out["memory"]["kv_pool_tokens"] > 0
    assert [f["code"] for f in out["findings"]] == ["KNOWN_FAILURE"]
    assert out["forbidding"][0]["fix"] == "use TP4 nvfp4"
    assert bad.is_error and "not an SGLang server launch" in bad.content[0].text


def test_a_verified_sm_scoped_lesson_reaches_check_command_and_the_skill(tmp_path):
    """A source-verified lesson on --mm-attention-backend (scope: SM 10) forbids the command
    that sets it on a B200, and the exported skill says which GPUs it holds for."""
    from domain.provenance import Provenance
    from mcp_servers.lessons.ops import check_command, export_skill
    from memory.store import LessonStore

    store = LessonStore(tmp_path / "lessons", embedding="hashing")
    try:
        stored = store.add(Lesson(
            title="SGLang 0.5.23 refuses mm_attention_backend == 'fa3'",
            scope=Scope(engine="sglang", engine_version="0.5.23", sm_major=10),
            condition=[Clause(field="mm_attention_backend", op="eq", value="fa3")],
            outcome="unsupported", failure_class="UNSUPPORTED_BACKEND",
            root_cause="vision.py:1331 raises on Blackwell", fix="leave it unset",
            evidence="ValueError: The 'fa3' backend is not supported on Blackwell GPUs",
            source="user", verified=True, source_site="sglang/srt/layers/attention/vision.py:1331",
            provenance=Provenance(backend="user")).with_id())
        cmd = ["sglang", "serve", "--model-path", "zai-org/GLM-5-FP8", "--tp-size", "8",
               "--mm-attention-backend", "fa3"]
        on_b200 = check_command(store, cmd, "B200", 8)
        assert any(f["code"] == "KNOWN_FAILURE" and stored.id in f["message"]
                   for f in on_b200.findings), on_b200
        on_h200 = check_command(store, cmd, "H200", 8)  # SM 9: the lesson does not hold there
        assert not any(f["code"] == "KNOWN_FAILURE" for f in on_h200.findings), on_h200
        skill = export_skill(store).content
        assert stored.id in skill and "any SM 10.x GPU" in skill, skill
    finally:
        store.close()


def test_a_layout_command_shows_memory_per_rank(tmp_path: Path) -> None:
    """Attention DP 8 + DeepEP on 8x H200 (issue 21): per-rank pool, cap and DeepEP buffers,
    the old --dp-size N --enable-dp-attention spelling read as attention DP."""
    cmd = ["sglang", "serve", "--model-path", "deepseek-ai/DeepSeek-V3", "--tp-size", "8",
           "--dp-size", "8", "--enable-dp-attention", "--moe-a2a-backend", "deepep",
           "--speculative-algorithm", "EAGLE"]
    r = invoke("check", "--gpu", "H200", "--gpus", "8", "--", *cmd, tmp=tmp_path)
    assert r.returncode == 0, r.stdout  # warn: the deprecated flag and the spec cap
    assert "per rank (TP8 (attention TP1 x DP8, EP8), 8 schedulers)" in r.stdout
    assert "max_running_requests 6" in r.stdout and "DeepEP buffers 2.24 GB" in r.stdout
    out = json.loads(invoke("check", "--gpu", "H200", "--gpus", "8", "--json", "--", *cmd,
                            tmp=tmp_path).stdout)
    assert out["memory"]["max_running_requests_per_rank"] == 6
    assert out["resolved"]["ep_size"] == 8
    bad = invoke("check", "--gpu", "H200", "--gpus", "8", "--", *cmd[:6], "--attn-dp-size",
                 "3", tmp=tmp_path)
    assert bad.returncode == 1 and "assert cfg.tp_size % cfg.attn_dp_size == 0" in bad.stdout
