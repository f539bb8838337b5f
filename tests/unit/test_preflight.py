"""servetune check in memory: the argv parser, each check and lint, the CUDA-graph memory model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from fixtures.pinned_source import pinned_tree  # noqa: F401
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.config import ServingConfig
from domain.engines import engine
from domain.engines.sglang.cmdline import cli_extras, split_program
from domain.errors import ConfigInvalid, DoesNotFit
from domain.fit import fit
from domain.graph_memory import decode_capture_sizes, graph_capture_bytes
from domain.models import find_checkpoint, get_model
from domain.preflight import (
    Finding,
    check_command,
    lint_config,
    min_mem_fraction,
    prefix_lint,
    verdict_of,
)
from domain.workload import Request, Trace

SGLANG = engine("sglang", "0.5.23")


def parse(cmd: str):
    return SGLANG.parse_command(cmd.split())


def codes(findings: list[Finding]) -> dict[str, str]:
    return {f.code: f.severity for f in findings}


# ---------------------------------------------------------------- the argv parser

def test_parser_reads_both_value_spellings_store_true_and_no_flags() -> None:
    p = parse("sglang serve --model-path zai-org/GLM-5-FP8 --tp-size=8 --mem-fraction-static 0.8"
              " --disable-radix-cache --no-enable-tf32-matmul --context-length 128k "
              "--cuda-graph-bs-decode 1 2 4 8")
    assert p.values["tp_size"] == 8 and p.values["mem_fraction_static"] == 0.8
    assert p.values["disable_radix_cache"] is True
    assert p.values["enable_tf32_matmul"] is False
    assert p.values["context_length"] == 128_000  # human_readable_int (utils/common.py)
    assert p.values["cuda_graph_bs_decode"] == [1, 2, 4, 8]  # nargs '+' from the source
    assert p.fields == {"model": "glm-5", "weights": "fp8", "engine": "sglang", "tp_size": 8,
                        "mem_fraction_static": 0.8, "disable_radix_cache": True,
                        "context_length": 128_000}  # modelled since issue 19
    unmodelled = next(f for f in p.findings if f.code == "UNMODELLED_FLAGS")
    assert "--cuda-graph-bs-decode" in unmodelled.message and unmodelled.severity == "info"
    assert "--context-length" not in unmodelled.message


@pytest.mark.parametrize("cmd, message", [
    ("--tp-size banana", "invalid int value: 'banana'"),
    ("--kv-cache-dtype fp9", "invalid choice: 'fp9'"),
    ("--no-such-flag 3", "unrecognized arguments: --no-such-flag 3"),
    ("--tp-size", "expected one argument"),
    ("--cuda-graph-max 2", "ambiguous option: --cuda-graph-max could match"),
])
def test_parser_refuses_what_argparse_refuses(cmd: str, message: str) -> None:
    p = parse(f"sglang serve --model-path zai-org/GLM-5-FP8 {cmd}")
    bad = [f for f in p.findings if f.severity == "refuse"]
    assert [f.code for f in bad] == ["BAD_FLAG"] and message in bad[0].message
    assert p.fields == {}


def test_retired_flag_is_refused_with_its_successor() -> None:
    p = parse("sglang serve --model-path zai-org/GLM-5-FP8 --cuda-graph-max-bs 256")
    (f,) = p.findings
    assert (f.severity, f.code) == ("refuse", "RETIRED_FLAG")
    assert "removed in SGLang 0.5.23" in f.message and "--cuda-graph-max-bs-decode" in f.fix
    p = parse("sglang serve --model-path zai-org/GLM-5-FP8 --enable-nan-detection")
    assert "names no successor" in p.findings[0].fix  # 0.5.9 had it, no alias action
    assert cli_extras("0.5.23")["retired"]["--stream-output"]["successor"] == \
        "--incremental-streaming-output"


def test_deprecated_spellings_warn_and_still_parse() -> None:
    p = parse("sglang serve --model-path zai-org/GLM-5-FP8 --disable-cuda-graph "
              "--attention-backend tokenspeed_mla --tp 8")
    got = codes(p.findings)
    assert got["DEPRECATED_FLAG"] == got["DEPRECATED_VALUE"] == got["ABBREVIATED_FLAG"] == "warn"
    assert p.values["attention_backend"] == "cutedsl_mla" and p.values["tp_size"] == 8
    assert not p.decode_cuda_graphs


def test_programs_positional_model_and_bad_input() -> None:
    p = parse("python3 -m sglang.launch_server --model deepseek-ai/DeepSeek-V3 --tp-size 8")
    assert p.fields["model"] == "deepseek-v3" and "LEGACY_ENTRYPOINT" in codes(p.findings)
    assert parse("sglang serve Qwen/Qwen3-32B-FP8 --tp-size 2").fields["model"] == "qwen3-32b"
    assert split_program(["/usr/bin/python3.11", "-m", "sglang.launch_server", "--x"])[1] == \
        ["--x"]
    for bad in ([], ["vllm", "serve", "m"], ["python", "-m", "vllm.entrypoints"]):
        with pytest.raises(ConfigInvalid, match="command"):
            split_program(bad)


def test_model_lookup_by_repo_id_and_unknown_model() -> None:
    assert find_checkpoint("zai-org/GLM-5-FP8") == ("glm-5", "fp8")
    assert find_checkpoint("/models/GLM-5-FP8/") == ("glm-5", "fp8")
    assert find_checkpoint("meta-llama/Llama-3.1-8B-Instruct", "fp8") == ("llama-3.1-8b", "fp8")
    assert find_checkpoint("meta-llama/Llama-3.1-8B-Instruct") == ("llama-3.1-8b", "bf16")
    p = parse("sglang serve --model-path mistralai/Mistral-7B --tp-size 1")
    (f,) = [f for f in p.findings if f.severity == "refuse"]
    assert f.code == "UNKNOWN_MODEL" and "glm-5" in f.message and "zai-org/GLM-5-FP8" in f.fix


def _derive_nargs(srt: Path) -> dict[str, str]:
    """nargs of every list flag, read from the fields' annotations (arg_utils.py rules)."""
    def kw(call: ast.Call, name: str) -> ast.expr | None:
        return next((k.value for k in call.keywords if k.arg == name), None)

    out: dict[str, str] = {}
    for f in sorted((srt / "arg_groups" / "fields").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(node.annotation, ast.Subscript)
                    and isinstance(node.annotation.slice, ast.Tuple)):
                continue
            typ, meta = node.annotation.slice.elts[:2]
            nargs, parser = None, False
            if isinstance(meta, ast.Call):
                n = kw(meta, "nargs")
                nargs = n.value if isinstance(n, ast.Constant) else None
                ak = kw(meta, "action_kwargs")
                if isinstance(ak, ast.Dict):
                    nargs = next((v.value for k, v in zip(ak.keys, ak.values, strict=True)
                                  if isinstance(k, ast.Constant) and k.value == "nargs"
                                  and isinstance(v, ast.Constant)), nargs)
                parser = kw(meta, "type_parser") is not None
                if kw(meta, "action") is not None and nargs is None:
                    continue
            if isinstance(typ, ast.Subscript) and ast.unparse(typ.value) == "Optional":
                typ = typ.slice
            if nargs is None and not parser and isinstance(typ, ast.Subscript) \
                    and ast.unparse(typ.value) in ("List", "list"):
                nargs = "+"
            if nargs is not None:
                out[node.target.id] = nargs
    return out


def test_nargs_table_matches_the_pinned_source(pinned_tree: Path) -> None:  # noqa: F811
    assert cli_extras("0.5.23")["nargs"] == _derive_nargs(pinned_tree / "sglang" / "srt")


# ---------------------------------------------------------------- checks

def test_backend_flags_are_checked_against_the_gpu_sm() -> None:
    r = check_command("sglang serve --model-path deepseek-ai/DeepSeek-V3 --tp-size 8 "
                      "--decode-attention-backend fa3".split(), "B200", 8)
    (f,) = [f for f in r.findings if f.code == "UNSUPPORTED_BACKEND"]
    assert "--decode-attention-backend fa3" in f.message and "SM>=80 and SM<=90" in f.message
    assert r.verdict == "refuse"
    ok = check_command("sglang serve --model-path deepseek-ai/DeepSeek-V3 --tp-size 8 "
                       "--attention-backend fa3".split(), "H200", 8)
    assert "UNSUPPORTED_BACKEND" not in codes(ok.findings)


def test_memory_refusal_and_min_mem_fraction() -> None:
    r = check_command("sglang serve --model-path zai-org/GLM-5-FP8 --tp-size 4".split(),
                      "B200", 8)
    assert r.verdict == "refuse" and codes(r.findings) == {"DOES_NOT_FIT": "refuse"}
    assert r.memory is not None and r.memory.min_mem_fraction_static is None
    assert r.memory.weights_bytes_per_gpu > 180e9
    r = check_command("sglang serve --model-path zai-org/GLM-5-FP8 --tp-size 8".split(),
                      "B200", 8)
    assert r.verdict == "ok" and r.memory is not None and r.config is not None
    least = r.memory.min_mem_fraction_static
    assert least is not None and 0.5 < least < 0.6
    fit(r.config.model_copy(update={"mem_fraction_static": least}))
    with pytest.raises(DoesNotFit):
        fit(r.config.model_copy(update={"mem_fraction_static": round(least - 0.01, 2)}))
    assert r.memory.kv_pool_tokens == fit(r.config).kv_tokens
    assert set(r.resolved) >= {"attention_backend", "max_running_requests",
                               "chunked_prefill_size", "cuda_graph_max_bs_decode"}
    assert r.resolved["attention_backend"] == "dsa" and r.resolved["page_size"] == 64


def test_gpu_count_and_startup_refusals() -> None:
    r = check_command("sglang serve --model-path zai-org/GLM-5-FP8 --tp-size 8".split(),
                      "B200", 4)
    assert codes(r.findings)["NOT_ENOUGH_GPUS"] == "refuse"
    r = check_command("sglang serve --model-path Qwen/Qwen3-32B-FP8 --tp-size 3".split(),
                      "H200", 8)
    # 0.5.23's Qwen3 attention asserts bare (models/qwen3.py:166): the finding names the line
    assert any(f.code.startswith("STARTUP_") and f.message == "AssertionError: assert "
               "self.total_num_heads % attn_tp_size == 0" for f in r.findings)
    r = check_command("sglang serve --model-path zai-org/GLM-5-FP8 --max-running-requests 0 "
                      "--tp-size 8".split(), "B200", 8)
    assert codes(r.findings) == {"INVALID_VALUE": "refuse"}
    with pytest.raises(ConfigInvalid, match="GPU catalog"):
        check_command(["sglang", "serve", "--model-path", "zai-org/GLM-5-FP8"], "X900")


def test_mem_fraction_below_the_weights_is_refused_with_the_smallest_that_fits() -> None:
    config = ServingConfig(model="glm-5", gpu="B200", weights="fp8", tp_size=8,
                           mem_fraction_static=0.4)
    least = min_mem_fraction(config)
    r = check_command("sglang serve --model-path zai-org/GLM-5-FP8 --tp-size 8 "
                      "--mem-fraction-static 0.4".split(), "B200", 8)
    (f,) = [f for f in r.findings if f.code == "DOES_NOT_FIT"]
    assert f.fix == f"--mem-fraction-static {least}" and "kv_pool" in f.message


# ---------------------------------------------------------------- CUDA-graph capture memory

def test_graph_memory_matches_the_deepseek_v3_h200_point() -> None:
    """sgl-project/sglang PR #5634: DeepSeek-V3 at batch 256 on H200 takes ~6 GB for graphs."""
    dsv3 = get_model("deepseek-v3")
    got = graph_capture_bytes(dsv3, 8, 256, "fa3", sm_major=9)
    assert abs(got - 6e9) / 6e9 < 0.30
    # grows with the captured batch; without fa3's workspace (B200: trtllm_mla) far smaller
    assert graph_capture_bytes(dsv3, 8, 128, "fa3") < got < graph_capture_bytes(dsv3, 8, 512, "fa3")
    assert graph_capture_bytes(dsv3, 8, 256, "trtllm_mla", sm_major=10) < 0.3e9
    assert graph_capture_bytes(dsv3, 8, 256, "fa3", sm_major=10) < 0.3e9  # refused, not captured
    assert graph_capture_bytes(dsv3, 8, 0, "fa3") == 0.0


def test_verify_graphs_hold_every_draft_token_row() -> None:
    """decode_cuda_graph_runner.py: buffers and logits at max_bs x num_draft_tokens rows."""
    dsv3 = get_model("deepseek-v3")
    one = graph_capture_bytes(dsv3, 8, 256, "trtllm_mla", True, 10)
    # no fa3 workspace: logits + activations scale with the rows, 256 x 4 = 1,024 here
    assert graph_capture_bytes(dsv3, 8, 256, "trtllm_mla", True, 10, 4) == pytest.approx(4 * one)


def test_capture_sizes_are_the_engine_lists() -> None:
    """cuda_graph_hook.py: generate_decode_cuda_graph_batch_sizes."""
    assert decode_capture_sizes(20, False) == [1, 2, 4, 8, 12, 16, 20]
    assert decode_capture_sizes(48, True)[-4:] == [32, 40, 44, 48]
    assert decode_capture_sizes(512, False)[-3:] == [480, 496, 512]
    assert decode_capture_sizes(300, False)[-1] == 300  # max_bs appended when missing


def test_fit_counts_the_graph_memory_outside_the_static_pool() -> None:
    base = dict(model="deepseek-v3", gpu="H200", weights="fp8", tp_size=8,
                attention_backend="fa3", chunked_prefill_size=2048)
    fit(ServingConfig(**base, mem_fraction_static=0.88, cuda_graph_max_bs_decode=16))
    with pytest.raises(DoesNotFit) as e:  # ~5 GB of fa3 graphs no longer fit in 1 - 0.95
        fit(ServingConfig(**base, mem_fraction_static=0.95, cuda_graph_max_bs_decode=256))
    assert e.value.phase == "cuda_graph"


# ---------------------------------------------------------------- lints

def _config(**kw: object) -> ServingConfig:
    return ServingConfig(**{"model": "glm-5", "gpu": "B200", "weights": "fp8", "tp_size": 8,
                            **kw})


def test_graph_ceiling_lint() -> None:
    (f,) = lint_config(_config(max_running_requests=1024, cuda_graph_max_bs_decode=64))
    assert (f.code, f.severity) == ("GRAPH_CEILING", "warn") and "eager" in f.message
    assert lint_config(_config(max_running_requests=96, cuda_graph_max_bs_decode=64)) == []
    assert lint_config(_config()) == []  # the engine's own defaults are not the user's choice


def test_speculative_default_cap_lint() -> None:
    (f,) = lint_config(_config(speculative_algorithm="NEXTN"))
    assert f.code == "SPEC_DEFAULT_CAP" and "48" in f.message
    assert lint_config(_config(speculative_algorithm="NEXTN", max_running_requests=64)) == []


def _trace(*prefixes: tuple[int, ...], block: int = 16) -> Trace:
    reqs = [Request(arrival_s=float(i), input_tokens=block * len(h) + 5, output_tokens=4,
                    hash_ids=h, block_size=block) for i, h in enumerate(prefixes)]
    return Trace(name="t", source_format="bailian", requests=reqs)


def test_prefix_shorter_than_the_page_lint() -> None:
    trace = _trace((1, 2, 3), (1, 2, 3, 9), (1, 2, 3, 4, 5, 6, 7), (8,))
    (f,) = prefix_lint(trace, 64)  # shared 48 and 48 tokens: both under one 64-token page
    assert (f.code, f.severity) == ("PREFIX_BELOW_PAGE", "warn")
    assert f.message.startswith("2 of 2 requests")
    assert prefix_lint(trace, 16) == [] and prefix_lint(trace, 1) == []
    (g,) = lint_config(_config(), trace=trace)  # GLM-5's dsa backend forces page 64
    assert g.code == "PREFIX_BELOW_PAGE"
    assert lint_config(_config(), trace=trace, page_size=16) == []


def test_verdict() -> None:
    def f(sev: str) -> Finding:
        return Finding(severity=sev, code="X", message="m", fix="f")  # type: ignore[arg-type]
    assert verdict_of([]) == "ok" and verdict_of([f("info")]) == "ok"
    assert verdict_of([f("info"), f("warn")]) == "warn"
    assert verdict_of([f("warn"), f("refuse")]) == "refuse"


TOKENS = ["--tp-size", "8", "--tp", "--tp-size=x", "--mem-fraction-static", "0.9", "1.5", "-1",
          "--cuda-graph-max-bs", "--cuda-graph-bs-decode", "1", "2", "--disable-radix-cache",
          "--no-enable-tf32-matmul", "--attention-backend", "fa3", "tokenspeed_mla", "--config",
          "--speculative-algorithm", "NEXTN", "EAGLE9", "--max-running-requests", "0", "--",
          "--kv-cache-dtype", "bfloat16", "nvfp4", "--context-length", "1Ki", "2.5Ki", "{",
          "--json-model-override-args", "--lora-paths", "--model-path", "zai-org/GLM-5-FP8",
          "--dp-size", "2", "--page-size", "64", "--enable-hier", "=", "--=", "-h", ""]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(TOKENS) | st.text(max_size=12), max_size=12),
       st.sampled_from(["B200", "H200", "H100"]))
def test_any_argv_gets_a_verdict_never_a_crash(tokens: list[str], gpu: str) -> None:
    r = check_command(["sglang", "serve", "--model-path", "zai-org/GLM-5-FP8", *tokens], gpu, 8)
    assert r.verdict in ("ok", "warn", "refuse")
    assert r.verdict == verdict_of(r.findings)
    assert all(f.message and f.fix for f in r.findings)
