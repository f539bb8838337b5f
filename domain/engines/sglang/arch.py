"""Per-SM architecture rules of SGLang 0.5.23: which kernels a GPU's compute capability runs.

Every rule is read from the pinned 0.5.23 wheel (``~/.cache/servetune/sglang/sglang-0.5.23``),
``file:line`` below ``sglang/srt/``. SGLang's platform probes (``utils/common.py:287-336``,
``runtime_context.py:1831-1836``) match on the CUDA capability MAJOR only:

- ``is_hopper_with_cuda_12_3`` / ``is_sm90``: major 9 (H100, H200, GH200);
- ``is_sm100``: major 10 -- B200, GB200 and also B300/GB300 (SM 10.3);
- ``is_sm120``: major 12 -- RTX PRO 6000 Blackwell, RTX 5090 (12.0) and GB10 (12.1);
- ``is_blackwell``: majors 10, 11 and 12 (datacenter AND consumer Blackwell).

So "Blackwell" in a message (``trtllm_mla``, overrides.py:1210) admits SM 12.x, while
``is_sm100`` gates (cutedsl_mla, the trtllm-gen MoE kernels, the DeepSeek trtllm_mla default,
the FP4 GEMM default) exclude it: sm_120 is not sm_100.

What ``auto`` resolves to, per model attention and SM major (``model_override_base.py:277``
``get_default_attn_backend``, ``model_overrides/deepseek_v2.py:100-104`` and ``:179-186``):

========  =====================  =====================================  ==================
SM        MHA/GQA                MLA                                    DSA (GLM-5, V3.2)
========  =====================  =====================================  ==================
8.0-8.9   flashinfer (triton if  triton                                 dsa
          attention sinks)
9.0       fa3 (flashinfer with   fa3                                    dsa
          EAGLE topk > 1)
10.x      trtllm_mha (fa4 with   trtllm_mla for DeepseekV3ForCausalLM,  dsa
          asymmetric K/V)        else flashinfer
12.x      flashinfer (triton if  triton                                 dsa
          attention sinks)
========  =====================  =====================================  ==================

gpt-oss takes its own override (``model_overrides/gpt_oss.py:29-44``): trtllm_mha on SM 10, fa3
on SM 9, triton elsewhere. Not modelled: the hybrid models' overrides on Blackwell
(``model_overrides/qwen3_5.py:17-50`` picks triton or trtllm_mha on SM 10 by the Mamba radix
cache strategy, ``nemotron_h.py:123-148`` trtllm_mha/triton by speculation): the general rule
above stands for them.

DSA's own prefill/decode kernels (``overrides.py:601`` ``_dsa_split_backend_resolution``):
GLM DSA (``GlmMoeDsaForCausalLM``) with an fp8_e4m3 KV cache on SM 12 runs
``flashinfer_sparse_mla`` for both (``:637-643``, ``:665-674``; the only DSA kernel SM 12
accepts for it, ``kernels/ops/attention/flash_mla_sm120.py:678-712``) -- the GLM-5-NVFP4 on
8x RTX PRO 6000 setup; otherwise fp8 KV -> ``trtllm`` on SM >= 10, ``flashmla_kv`` below;
bf16 KV -> prefill ``flashmla_sparse``, decode ``trtllm`` (SM >= 10) / ``fa3``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from domain.config import ServingConfig
    from domain.hardware import GPU
    from domain.models import ModelArch

# utils/common.py:297-302: is_blackwell_supported, CUDA capability majors 10, 11 and 12
BLACKWELL_SM_MAJORS = (10, 11, 12)
# overrides.py:745-760 _DEEPSEEK_FAMILY_ARCHS (the catalog's members)
DEEPSEEK_FAMILY = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
                   "KimiK25ForConditionalGeneration")
# Catalog keys of the DeepSeek-V3 architecture (their ModelArch predates ``architecture``)
_DEEPSEEK_V3_KEYS = ("deepseek-v3", "deepseek-r1")
# attention backend -> page size it forces whatever --page-size says (overrides.py:1147-1152
# flashmla 64, :1193-1199 hpc_ops 64; the DSA model override forces 64 x index_kpool,
# deepseek_v2.py:168-172, index_kpool 1 for the catalog's DSA models)
FORCED_PAGE_SIZE = {"flashmla": 64, "hpc_ops": 64, "dsa": 64}
# backend -> the page sizes it keeps, any other becoming 64 (overrides.py:1153-1191: trtllm_mla
# and cutedsl_mla 32/64, trtllm_mha 16/32/64/128; page 1, the default, is not among them)
ALLOWED_PAGE_SIZES = {"trtllm_mla": (32, 64), "cutedsl_mla": (32, 64),
                      "trtllm_mha": (16, 32, 64, 128)}
# MoE runners built on trtllm-gen kernels: "trtllm-gen MoE kernels are SM100-only"
# (overrides.py:1513-1522, the reason the SM110/SM120 modelopt_fp4 default is flashinfer_cutlass)
TRTLLM_GEN_MOE_RUNNERS = ("flashinfer_trtllm", "flashinfer_trtllm_routed",
                          "experimental_sgl_trtllm")
# Quantizations for which the DeepSeek family defaults its MoE runner to flashinfer_trtllm on
# SM100 (overrides.py:810-823; None = bf16)
_DEEPSEEK_TRTLLM_MOE_QUANTS = ("fp8", "modelopt_fp8", "modelopt_fp4", "modelopt_mixed", None)


def is_deepseek_v3(model: ModelArch) -> bool:
    """The model is served by ``DeepseekV3ForCausalLM`` (MLA, not DSA)."""
    return model.architecture == "DeepseekV3ForCausalLM" or model.name in _DEEPSEEK_V3_KEYS


def has_attention_sinks(model: ModelArch) -> bool:
    """``model_config.has_attention_sinks`` (gpt-oss): FlashInfer cannot run them.

    Read from the ModelArch field ``attention_sinks`` when the model registry has one (False
    otherwise).
    """
    return bool(getattr(model, "attention_sinks", False))


def _spec_topk_one(config: ServingConfig, page: int | None) -> bool:
    """``utils/common.py:3960`` is_no_spec_infer_or_topk_one: topk unset, or 1 with page 1."""
    topk = config.speculative_eagle_topk
    return topk is None or (topk == 1 and page in (1, None))


def auto_attention_backend(config: ServingConfig, model: ModelArch, gpu: GPU) -> str:
    """The backend 0.5.23 picks when ``--attention-backend`` (and the phase flags) are unset.

    See the module table. ``--speculative-eagle-topk`` unset with speculation on counts as
    topk > 1 on SM 10 (``model_override_base.py:312-320``), so trtllm_mha is not picked there.
    """
    major = gpu.sm_major
    if model.attention == "dsa":
        return "dsa"  # model_overrides/deepseek_v2.py:100-104
    if model.architecture == "GptOssForCausalLM":  # model_overrides/gpt_oss.py:29-44
        return {10: "trtllm_mha", 9: "fa3"}.get(major, "triton")
    if model.attention == "mla":
        if major == 10 and is_deepseek_v3(model):
            return "trtllm_mla"  # deepseek_v2.py:179-186 (is_sm100 only)
        if major == 9:
            return "fa3"  # model_override_base.py:337-338
        return "flashinfer" if major == 10 else "triton"  # :339-340, :350-351
    one = _spec_topk_one(config, config.page_size)
    if major == 9 and one:
        return "fa3"  # model_override_base.py:305-311
    if major == 10 and one and (config.speculative_algorithm is None
                                or config.speculative_eagle_topk is not None):
        asymmetric = model.qk_head_dim != model.head_dim
        return "fa4" if asymmetric else "trtllm_mha"  # :312-325
    return "triton" if has_attention_sinks(model) else "flashinfer"  # :330-334


def page_size(config: ServingConfig, model: ModelArch, gpu: GPU, backend: str) -> int:
    """The KV page size (tokens) the server runs with: the backend's forced or allowed size.

    ``--page-size`` unset is 1 (``overrides.py:1341`` _page_size_default on CUDA); forced
    sizes (:data:`FORCED_PAGE_SIZE`) win over it, a backend with :data:`ALLOWED_PAGE_SIZES`
    keeps a value among them and takes 64 otherwise; fa4 on SM 10 takes 128 for non-MLA
    models unless EAGLE runs topk > 1 (``overrides.py:1274-1298``).
    """
    asked = config.page_size or 1
    if backend in FORCED_PAGE_SIZE:
        return FORCED_PAGE_SIZE[backend]
    if backend in ALLOWED_PAGE_SIZES:
        return asked if asked in ALLOWED_PAGE_SIZES[backend] else 64
    if backend == "fa4" and gpu.sm_major == 10 and model.attention == "gqa" \
            and (config.speculative_eagle_topk or 0) <= 1:
        return 128
    return asked


def attention_backend(config: ServingConfig, model: ModelArch, gpu: GPU) -> tuple[str, int]:
    """``(attention backend, KV page size)`` SGLang 0.5.23 runs ``config`` with."""
    backend = config.attention_backend or auto_attention_backend(config, model, gpu)
    return backend, page_size(config, model, gpu, backend)


def dsa_backends(model: ModelArch, gpu: GPU, kv_dtype: str) -> tuple[str, str] | None:
    """``(dsa prefill, dsa decode)`` kernels of a DSA model with KV dtype ``kv_dtype``.

    None for a model without DSA. ``overrides.py:601-733`` (CUDA, no learnable sinks, no
    HiSparse): see the module docstring.
    """
    if model.attention != "dsa":
        return None
    major = gpu.sm_major
    if kv_dtype == "fp8_e4m3":
        if model.architecture == "GlmMoeDsaForCausalLM" and major == 12:
            return "flashinfer_sparse_mla", "flashinfer_sparse_mla"  # :637-674
        fp8 = "trtllm" if major >= 10 else "flashmla_kv"  # :713-720
        return fp8, fp8
    return "flashmla_sparse", "trtllm" if major >= 10 else "fa3"  # :721-726


def moe_runner_backend(config: ServingConfig, model: ModelArch, gpu: GPU,
                       quantization: str | None) -> str:
    """The ``--moe-runner-backend`` the server resolves for a MoE model ("" for a dense one).

    Explicit values are kept. ``auto``: the DeepSeek family (DeepSeek-V3/V3.2, GLM-5, Kimi)
    on SM 10 with fp8 / modelopt_fp8 / modelopt_fp4 / bf16 experts, or Kimi-K2-Thinking's
    compressed-tensors int4 (group 32) experts, takes ``flashinfer_trtllm`` without an a2a
    backend (``overrides.py:771-832``; with one, e.g. DeepEP, it stays ``auto``: the
    quantization method picks DeepGEMM at load time); gpt-oss's MXFP4 experts on SM 10 and
    SM 12 take ``flashinfer_mxfp4`` and its bf16 experts ``triton_kernel``
    (``model_overrides/gpt_oss.py:64-117``); a ModelOpt NVFP4 checkpoint on SM 11/12 takes
    ``flashinfer_cutlass`` (``overrides.py:1513-1522``: trtllm-gen MoE kernels are SM100-only);
    anything else stays ``auto`` (the quantization method picks its kernels at load time,
    e.g. ``layers/quantization/fp8.py:1530``).
    """
    if not model.n_routed_experts:
        return ""
    runner = config.moe_runner_backend or "auto"
    if runner != "auto":
        return runner
    int4_w4a16 = quantization == "compressed-tensors" and config.weights == "w4a16"
    if gpu.sm_major == 10 and model.architecture in DEEPSEEK_FAMILY \
            and config.moe_a2a_backend in (None, "none") \
            and (quantization in _DEEPSEEK_TRTLLM_MOE_QUANTS or int4_w4a16):
        return "flashinfer_trtllm"
    if model.architecture == "GptOssForCausalLM":
        if quantization == "mxfp4":
            return "flashinfer_mxfp4" if gpu.sm_major in (10, 12) else "auto"
        return "triton_kernel" if quantization is None else "auto"
    if quantization == "modelopt_fp4" and gpu.sm_major in (11, 12):
        return "flashinfer_cutlass"
    return "auto"


def fp4_gemm_backend(config: ServingConfig, gpu: GPU) -> str:
    """``--fp4-gemm-backend`` as resolved: explicit, else by SM.

    ``layers/quantization/fp4_utils.py:149-160`` initialize_fp4_gemm_config: ``auto`` is
    ``flashinfer_cutedsl`` on SM 10, ``marlin`` (weight-only W4A16) on SM 8.0-9.x,
    ``flashinfer_cutlass`` otherwise (SM 11/12).
    """
    if config.fp4_gemm_runner_backend not in (None, "auto"):
        return str(config.fp4_gemm_runner_backend)
    if gpu.sm_major == 10:
        return "flashinfer_cutedsl"
    return "marlin" if 8 <= gpu.sm_major < 10 else "flashinfer_cutlass"


def mm_attention_backend(config: ServingConfig, gpu: GPU) -> str:
    """The vision encoder's attention kernels: explicit, else by SM major.

    ``layers/attention/vision.py:1304-1311`` _determine_attention_backend (CUDA): ``fa3`` on
    SM 9, ``fa4`` on SM 10, ``triton_attn`` otherwise (SM 8.x, SM 12).
    """
    if config.mm_attention_backend is not None:
        return config.mm_attention_backend
    return {9: "fa3", 10: "fa4"}.get(gpu.sm_major, "triton_attn")


def resolved_backends(config: ServingConfig) -> dict[str, str]:
    """Every kernel choice of ``config`` on its GPU, by SGLang's flag dest.

    Keys: ``attention_backend``, ``dsa_prefill_backend`` / ``dsa_decode_backend`` (DSA models),
    ``moe_runner_backend`` (MoE models), ``fp4_gemm_runner_backend`` (FP4 checkpoints),
    ``mm_attention_backend`` (multimodal models: a vision tower, ``ModelArch.vision_params``,
    or an explicit ``--mm-attention-backend``).
    """
    from domain.fit import resolve_kv_dtype
    from domain.hardware import get_gpu
    from domain.models import get_model

    model, gpu = get_model(config.model), get_gpu(config.gpu)
    ckpt = model.checkpoint(config.weights)
    out = {"attention_backend": attention_backend(config, model, gpu)[0]}
    dsa = dsa_backends(model, gpu, resolve_kv_dtype(config, model, gpu))
    if dsa is not None:
        out["dsa_prefill_backend"], out["dsa_decode_backend"] = dsa
    moe = moe_runner_backend(config, model, gpu, ckpt.quantization)
    if moe:
        out["moe_runner_backend"] = moe
    if ckpt.compute_dtype == "fp4":
        out["fp4_gemm_runner_backend"] = fp4_gemm_backend(config, gpu)
    if getattr(model, "vision_params", 0) or config.mm_attention_backend is not None:
        out["mm_attention_backend"] = mm_attention_backend(config, gpu)
    return out
