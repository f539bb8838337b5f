"""Per-SM architecture rules (domain/engines/sglang/arch.py) and the knobs of issue 19.

Each expectation below is the SGLang 0.5.23 rule quoted in the comment (file:line of the pinned
wheel); the audit of the refusal sites themselves is tests/unit/test_refusal_audit.py.
Synthetic GPUs (an H100 entry with another compute capability, or the RTX PRO 6000 Blackwell
numbers of its datasheet) stand in for catalog entries the GPUS helper adds in its branch.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from fixtures.configs import serving_config as cfg

import domain.hardware as hw
from domain.config import LAYOUT_FIELDS, ROUTER_FIELDS, V1_FIELDS, ServingConfig
from domain.costmodel import build_cost_model
from domain.engines.sglang.arch import resolved_backends
from domain.errors import ConfigInvalid
from domain.fit import default_max_running_requests, fit, resolve_attention_backend
from domain.hardware import Interconnect, get_gpu
from domain.knobs import KNOBS, apply_knob
from domain.models import get_model
from domain.preflight import arch_lints, check_command, check_config
from domain.study import parse_study
from domain.twin.startup import start


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """SM 8.0 / 8.9 parts, and an RTX PRO 6000 Blackwell Server (SM 12.0, 96 GB GDDR7 at
    1.792 TB/s, PCIe Gen5, two NUMA nodes; NVIDIA RTX PRO 6000 Blackwell datasheet)."""
    h100 = hw.GPUS["H100"]
    for name, major, minor in (("SM80", 8, 0), ("SM89", 8, 9)):
        monkeypatch.setitem(hw.GPUS, name, h100.model_copy(update={
            "name": name, "sm_major": major, "sm_minor": minor, "arch": f"sm{major}{minor}"}))
    monkeypatch.setitem(hw.GPUS, "RTXPRO6000", h100.model_copy(update={
        "name": "RTXPRO6000", "arch": "sm120", "sm_major": 12, "sm_minor": 0, "hbm_gb": 96.0,
        "hbm_bytes_per_s": 1.792e12, "flops": {"bf16": 503.8e12, "fp8": 1007.6e12,
                                                "fp4": 2015.2e12},
        "interconnect": Interconnect(kind="pcie", p2p=True, numa_nodes=2)}))


def on(gpu: str, **kw: Any) -> ServingConfig:
    return cfg(gpu=gpu, **kw)


# ---------------------------------------------------------------- auto resolution per SM
@pytest.mark.parametrize("gpu, gqa, mla", [
    # model_override_base.py:305-334 (MHA) and :337-351 (MLA); deepseek_v2.py:179-186
    ("SM80", "flashinfer", "triton"), ("SM89", "flashinfer", "triton"),
    ("H100", "fa3", "fa3"), ("B200", "trtllm_mha", "trtllm_mla"),
    ("RTXPRO6000", "flashinfer", "triton")])
def test_auto_attention_backend_per_sm(gpus: None, gpu: str, gqa: str, mla: str) -> None:
    g = get_gpu(gpu)
    llama = on(gpu, model="llama-3.1-8b", weights="bf16", tp_size=1)
    ds = on(gpu, model="deepseek-v3", weights="fp8")
    assert resolve_attention_backend(llama, get_model("llama-3.1-8b"), g)[0] == gqa
    assert resolve_attention_backend(ds, get_model("deepseek-v3"), g)[0] == mla
    # DSA models always take the dsa backend (deepseek_v2.py:100-104), page 64 (:168-172)
    assert resolve_attention_backend(on(gpu), get_model("glm-5"), g) == ("dsa", 64)


def test_sm120_is_not_sm100_for_mla_defaults(gpus: None) -> None:
    """DeepSeek-V3's trtllm_mla default is ``is_sm100`` only; MLA on SM 12 falls to triton,
    while an explicit trtllm_mla passes the ``is_blackwell`` check (overrides.py:1210)."""
    rtx = on("RTXPRO6000", model="deepseek-v3", weights="fp8")
    assert resolved_backends(rtx)["attention_backend"] == "triton"
    assert start(rtx.model_copy(update={"attention_backend": "trtllm_mla"})).phase != "resolve"
    assert start(on("H100", model="deepseek-v3", weights="fp8",
                    attention_backend="trtllm_mla")).phase == "resolve"


def test_glm5_nvfp4_on_8x_rtx_pro_6000_starts_with_what_sm120_runs(gpus: None) -> None:
    """The served setup: GLM-5-NVFP4, TP8, SM 12.0. KV auto -> fp8_e4m3 (major >= 10,
    overrides.py:533-535); DSA kernels flashinfer_sparse_mla (GLM DSA + fp8 KV on SM 12,
    :637-674); NVFP4 experts on flashinfer_cutlass (:1513-1522); FP4 GEMMs on
    flashinfer_cutlass (fp4_utils.py:149-160)."""
    c = on("RTXPRO6000", weights="nvfp4")
    s = start(c)
    assert s.ready, s.log[-3:]
    assert s.fit is not None and s.fit.kv_dtype == "fp8_e4m3"
    assert resolved_backends(c) == {
        "attention_backend": "dsa", "dsa_prefill_backend": "flashinfer_sparse_mla",
        "dsa_decode_backend": "flashinfer_sparse_mla", "moe_runner_backend": "flashinfer_cutlass",
        "fp4_gemm_runner_backend": "flashinfer_cutlass"}
    # the same checkpoint on B200 runs the SM100 kernels (overrides.py:810-823, fp4_utils.py)
    b200 = resolved_backends(on("B200", weights="nvfp4"))
    assert (b200["dsa_decode_backend"], b200["moe_runner_backend"],
            b200["fp4_gemm_runner_backend"]) == ("trtllm", "flashinfer_trtllm",
                                                 "flashinfer_cutedsl")


def test_fp4_gemm_default_per_sm(gpus: None) -> None:
    """fp4_utils.py:149-160: cutedsl on SM 10, marlin on SM 8.0-9.x, cutlass otherwise."""
    got = {g: resolved_backends(on(g, model="qwen3-235b-a22b", weights="nvfp4"))
           ["fp4_gemm_runner_backend"] for g in ("SM89", "H100", "B200", "RTXPRO6000")}
    assert got == {"SM89": "marlin", "H100": "marlin", "B200": "flashinfer_cutedsl",
                   "RTXPRO6000": "flashinfer_cutlass"}


# ---------------------------------------------------------------- refusals per SM
@pytest.mark.parametrize("gpu, backend, refused", [
    ("RTXPRO6000", "fa3", True), ("SM80", "fa3", False), ("B200", "fa3", True),
    ("SM89", "trtllm_mha", True), ("RTXPRO6000", "trtllm_mha", False),
    ("H100", "trtllm_mha", False)])
def test_gqa_backend_refusals_per_sm(gpus: None, gpu: str, backend: str, refused: bool) -> None:
    """fa3 asserts SM 8 (non-MLA) or 9 (attention_registry.py:243); trtllm_mha has kernels on
    SM 9/12 (XQA) and 10 (trtllm-gen) only (trtllm_mha_backend.py:1-10, the twin's stand-in)."""
    c = on(gpu, model="llama-3.1-8b", weights="bf16", tp_size=1, attention_backend=backend)
    s = start(c)
    assert (s.phase == "model_init") is refused, s.log[-2:]
    codes = [f.code for f in check_config(c).findings]
    assert ("UNSUPPORTED_BACKEND" in codes) is refused


def test_trtllm_gen_moe_runner_refused_off_sm100_in_twin_check_and_lints(gpus: None) -> None:
    c = on("RTXPRO6000", weights="nvfp4", moe_runner_backend="flashinfer_trtllm")
    s = start(c)
    assert s.phase == "model_init"
    assert s.log[-1] == ("RuntimeError: --moe-runner-backend flashinfer_trtllm: trtllm-gen MoE "
                         "kernels are SM100-only; this GPU is SM120. Use --moe-runner-backend "
                         "flashinfer_cutlass or leave it auto.")
    found = {f.code: f for f in check_config(c).findings}
    assert found["UNSUPPORTED_BACKEND"].severity == "refuse"
    lint = {f.code: f for f in arch_lints(c)}["ARCH_REFUSED"]  # on the candidate's ledger row
    assert lint.severity == "warn" and "SM100-only" in lint.message
    assert start(on("B200", weights="nvfp4", moe_runner_backend="flashinfer_trtllm")).ready
    # a dense model builds no MoE runner
    assert start(on("RTXPRO6000", model="llama-3.1-8b", weights="bf16", tp_size=1,
                    moe_runner_backend="flashinfer_trtllm")).ready


# ---------------------------------------------------------------- the modelled knobs
def test_context_length_sizes_the_default_requests_and_is_refused_above_the_model() -> None:
    base, short = fit(cfg()), fit(cfg(context_length=8192))
    assert base.context_len == get_model("glm-5").context_len and short.context_len == 8192
    # kv_cache_configurator.py resolve_max_num_reqs: clamp(kv / context x 512, 2048, 4096)
    assert short.max_running_requests == default_max_running_requests(short.kv_tokens, 8192)
    s = start(cfg(context_length=get_model("glm-5").context_len + 1))
    assert s.phase == "resolve" and "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1" in s.log[-1]


def test_page_size_rounds_the_pool_and_backends_keep_or_force_it(gpus: None) -> None:
    llama = dict(model="llama-3.1-8b", weights="bf16", tp_size=1)
    r = fit(on("RTXPRO6000", page_size=16, **llama))  # flashinfer keeps any page
    assert (r.page_size, r.kv_tokens % 16) == (16, 0)  # pool_configurator.py:646
    # trtllm_mha keeps 16/32/64/128, else 64 (overrides.py:1174-1191)
    assert fit(on("B200", page_size=32, **llama)).page_size == 32
    assert fit(on("B200", page_size=8, **llama)).page_size == 64
    # a --page-size that leaves the server's page as it was changes nothing: the same pool
    assert fit(on("B200", page_size=8, **llama)) == fit(on("B200", **llama))
    assert fit(on("B200", page_size=32, **llama)).kv_tokens % 32 == 0
    # DSA forces 64 x index_kpool (deepseek_v2.py:168-172) whatever --page-size says
    assert fit(cfg(page_size=16)).page_size == 64


def test_disable_cuda_graph_frees_graph_memory_and_decodes_eagerly() -> None:
    on_, off = fit(cfg()), fit(cfg(disable_cuda_graph=True))
    assert off.cuda_graph_max_bs_decode == 0 and on_.cuda_graph_max_bs_decode > 0
    # memory_hook.py reserve_for_graph_mb: neither decode (2 x max_bs MiB) nor prefill graphs
    # reserved; on a 180 GB B200 the 10 GiB floor may still hold, so the fraction never drops
    assert off.mem_fraction_static >= on_.mem_fraction_static
    h100 = dict(model="llama-3.1-8b", weights="bf16", tp_size=1, gpu="H100")
    # 80 GB H100, llama (GQA): 512 + 1.5 x 8192 + 128 + 2 x 256 + 8 x 58 = 13,904 MiB with
    # graphs, 12,928 MiB without -- both above the floor, so the fraction rises
    g_on, g_off = fit(cfg(**h100)), fit(cfg(disable_cuda_graph=True, **h100))
    mib = get_gpu("H100").hbm_mib
    assert g_on.mem_fraction_static == round((mib - 13904) / mib, 3)
    assert g_off.mem_fraction_static == round((mib - 12928) / mib, 3)
    a, b = build_cost_model(cfg(), on_), build_cost_model(cfg(disable_cuda_graph=True), off)
    assert b.decode_time(64, 64 * 2048) > a.decode_time(64, 64 * 2048)  # eager launch cost
    s = start(cfg(disable_cuda_graph=True))
    assert s.ready and not any("CUDA graph" in line for line in s.log)


def test_new_flags_reach_argv_and_default_configs_keep_their_id() -> None:
    c = cfg(context_length=32768, page_size=64, disable_cuda_graph=True,
            moe_runner_backend="flashinfer_cutlass", fp4_gemm_runner_backend="flashinfer_cutlass",
            num_continuous_decode_steps=4, enable_two_batch_overlap=True,
            enable_single_batch_overlap=True)
    argv = c.launch_command()
    for part in ("--context-length 32768", "--page-size 64", "--disable-cuda-graph",
                 "--moe-runner-backend flashinfer_cutlass",
                 "--fp4-gemm-backend flashinfer_cutlass", "--num-continuous-decode-steps 4",
                 "--enable-two-batch-overlap", "--enable-single-batch-overlap"):
        assert part in argv
    # config_id of a config leaving the new fields unset is the id it had before them: the
    # sha256 of its canonical JSON without them (ledgers of earlier runs stay resumable)
    new = ("context_length", "page_size", "disable_cuda_graph", "moe_runner_backend",
           "fp4_gemm_runner_backend", "num_continuous_decode_steps",
           "enable_two_batch_overlap", "enable_single_batch_overlap",
           "router_cache_threshold", "router_balance_abs_threshold",
           "router_balance_rel_threshold", *LAYOUT_FIELDS)
    data = {k: v for k, v in cfg().model_dump(mode="json").items() if k not in new
            and (k not in (*V1_FIELDS, *ROUTER_FIELDS)
                 or v != ServingConfig.model_fields[k].default)}
    blob = json.dumps(data, sort_keys=True).encode()
    assert cfg().config_id() == hashlib.sha256(blob).hexdigest()[:12]
    assert c.config_id() != cfg().config_id()


def test_knobs_take_the_new_values_and_refuse_an_unknown_runner() -> None:
    for name in ("context_length", "page_size", "disable_cuda_graph", "moe_runner_backend",
                 "fp4_gemm_runner_backend", "num_continuous_decode_steps",
                 "enable_two_batch_overlap", "enable_single_batch_overlap"):
        assert KNOBS[name].flag is not None
    assert apply_knob(cfg(), "moe_runner_backend", "triton", 8).moe_runner_backend == "triton"
    with pytest.raises(ConfigInvalid) as e:
        apply_knob(cfg(), "moe_runner_backend", "cutlass_v9", 8)
    assert len(e.value.violations) == 1 and "moe_runner_backend 'cutlass_v9' is not a choice" \
        in e.value.violations[0]


def test_passed_through_flags_are_not_modelled_in_check_and_lints() -> None:
    rep = check_command(["sglang", "serve", "--model-path", "zai-org/GLM-5-FP8", "--tp-size",
                         "8", "--fp4-gemm-backend", "flashinfer_cutlass",
                         "--num-continuous-decode-steps", "3"],
                        "B200", 8)
    info = next(f for f in rep.findings if f.code == "UNMODELLED_FLAGS")
    assert "not modelled" in info.message
    for flag in ("--fp4-gemm-backend", "--num-continuous-decode-steps"):
        assert flag in info.message
    assert "NOT_MODELLED" not in [f.code for f in rep.findings]  # the parser said it
    lint = {f.code: f for f in arch_lints(cfg(enable_single_batch_overlap=True))}
    assert lint["NOT_MODELLED"].message == ("not modelled (passed through as given): "
                                            "enable_single_batch_overlap=True")


def test_study_refuses_a_context_length_below_its_requests() -> None:
    import yaml
    from fixtures.paths import DEFAULT_STUDY

    s = yaml.safe_load(DEFAULT_STUDY.read_text())
    s["knobs"] = {"context_length": [4096, 200]}
    with pytest.raises(ConfigInvalid) as e:
        parse_study(s)
    need = s["saturation"]["isl"] + s["saturation"]["osl"]
    bad = [v for v in e.value.violations if v.startswith("knobs.context_length")]
    assert len(bad) == (2 if need > 4096 else 1) and "'200'" not in bad[-1]


def test_the_twin_reuses_a_cached_prefix_in_whole_pages() -> None:
    """radix_cache.py:178-220: a match is rounded down to ``page_size``. Blocks of 4 tokens; a
    second 20-token prompt shares 4 blocks (16 tokens) with the first: pages of 1 and 8 reuse
    all 16 (4 new tokens, 0.4 s at StepCost's 0.1 s per prefill token), a 12-token page one
    page (12 reused, 8 new), a 32-token page nothing."""
    from fixtures.step_cost import StepCost

    from domain.twin.engine import EngineLimits, TwinEngine
    from domain.twin.prefix_cache import PathIndex, PrefixCache

    def second_ttft(page: int) -> tuple[float, int]:
        limits = EngineLimits(kv_tokens=10_000, max_running_requests=64,
                              chunked_prefill_size=8192, context_len=100_000, page_size=page)
        idx = PathIndex()
        eng = TwinEngine(StepCost(), limits, PrefixCache(idx, 0))
        eng.submit(0.0, 20, 1, idx.path([1, 2, 3, 4, 5]), 4)
        eng.submit(5.0, 20, 1, idx.path([1, 2, 3, 4, 9]), 4)
        eng.advance(float("inf"))
        return eng.records()[1].ttft_s, eng.stats.cached_tokens

    assert second_ttft(1) == pytest.approx((0.4, 16))  # 4 new tokens
    assert second_ttft(8) == pytest.approx((0.4, 16))
    assert second_ttft(12) == pytest.approx((0.8, 12))  # one 12-token page
    assert second_ttft(32) == pytest.approx((2.0, 0))  # under one page: nothing reused


def test_refusals_of_the_new_knobs_teach_their_family(gpus: None) -> None:
    """The lesson of each new refusal names the family: every context length above the
    model's, and the trtllm-gen runner (on this GPU, the lesson's scope)."""
    from domain.engines import engine

    eng = engine()
    for c, want in ((cfg(context_length=10**6), [("context_length", "gt", 202752)]),
                    (on("RTXPRO6000", weights="nvfp4", moe_runner_backend="flashinfer_trtllm"),
                     [("moe_runner_backend", "eq", "flashinfer_trtllm")])):
        s = eng.start(c)
        cls, ev = eng.classify(s.log)
        lesson = eng.failure_lesson(c, cls, s.phase, ev, s.log[-20:], "r0", "t0")
        assert [(x.field, x.op, x.value) for x in lesson.condition] == want
        assert lesson.defect() is None


def test_vision_encoder_attention_per_sm(gpus: None) -> None:
    """vision.py:1304-1311: fa3 on SM 9, fa4 on SM 10, triton_attn elsewhere (SM 8.x, 12)."""
    from domain.engines.sglang.arch import mm_attention_backend

    got = {g: mm_attention_backend(on(g), get_gpu(g))
           for g in ("SM80", "SM89", "H100", "B200", "RTXPRO6000")}
    assert got == {"SM80": "triton_attn", "SM89": "triton_attn", "H100": "fa3", "B200": "fa4",
                   "RTXPRO6000": "triton_attn"}
    assert "mm_attention_backend" not in resolved_backends(on("B200"))  # no vision tower


def test_gpt_oss_and_kimi_thinking_take_their_model_rules(gpus: None) -> None:
    """gpt-oss's override (model_overrides/gpt_oss.py:29-44, :64-72): trtllm_mha / fa3 /
    triton by SM, MXFP4 experts on flashinfer_mxfp4 on SM 10 and 12; Kimi-K2-Thinking's int4
    W4A16 experts on flashinfer_trtllm on SM 10 (overrides.py:779-823)."""
    got = {g: resolved_backends(on(g, model="gpt-oss-120b", weights="mxfp4", tp_size=4))
           for g in ("SM89", "H100", "B200", "RTXPRO6000")}
    assert {g: (r["attention_backend"], r["moe_runner_backend"]) for g, r in got.items()} == {
        "SM89": ("triton", "auto"), "H100": ("fa3", "auto"),
        "B200": ("trtllm_mha", "flashinfer_mxfp4"), "RTXPRO6000": ("triton", "flashinfer_mxfp4")}
    kimi = on("B200", model="kimi-k2-thinking", weights="w4a16")
    assert resolved_backends(kimi)["moe_runner_backend"] == "flashinfer_trtllm"
    assert resolved_backends(kimi.model_copy(update={"gpu": "H100"}))[
        "moe_runner_backend"] == "auto"
