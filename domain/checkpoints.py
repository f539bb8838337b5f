"""Published checkpoints: stored bytes per parameter and how SGLang 0.5.23 loads each one.

Split from :mod:`domain.models` (the architectures); the catalog there attaches these to its
models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from domain.quant import QuantScheme, group_bytes

if TYPE_CHECKING:
    from domain.models import ModelArch


class Checkpoint(BaseModel):
    """One published checkpoint of a model and how SGLang 0.5.23 is told to load it.

    ``bytes_per_param`` maps a parameter group (``embed``, ``attention``, ``dense_mlp``,
    ``experts``) to stored bytes per parameter, scales included.
    """

    model_config = ConfigDict(frozen=True)

    model_path: str = Field(description="value of --model-path")
    quantization: str | None = Field(description="value of --quantization (None: not passed)")
    compute_dtype: Literal["bf16", "fp8", "fp4"] = Field(description="GEMM dtype of the experts")
    bytes_per_param: dict[str, float]
    mtp_bytes_per_param: dict[str, float] | None = Field(
        None, description="bytes per parameter of the MTP/NextN layer's groups when the "
        "checkpoint stores that layer at another precision; None: as bytes_per_param")
    source: str


# ---- stored bytes per parameter, scales included ----
BF16 = 2.0
# FP8 block-wise checkpoints store one fp32 scale per 128x128 block (weight_block_size in the
# checkpoint's quantization_config): 4 / 16384 bytes per parameter on top of 1 byte.
FP8_BLOCK = 1 + 4 / (128 * 128)
# FP8 per-tensor (ModelOpt FP8 checkpoints, SGLang's online ``--quantization fp8``): one fp32
# scale per weight matrix, negligible against its millions of 1-byte values.
FP8_TENSOR = 1.0
# NVFP4 (ModelOpt): 4-bit values plus one fp8 scale per 16 values (group_size 16 in
# hf_quant_config.json) = 0.5 + 1/16 bytes per parameter; the per-tensor fp32 scale is negligible.
NVFP4 = 0.5 + 1 / 16
_BUNDLE = "aiconfigurator-core 0.12.0 bundle"


GROUPS = ("embed", "attention", "dense_mlp", "experts")


def build_checkpoint(arch: ModelArch, model_path: str, scheme: QuantScheme) -> Checkpoint:
    """The checkpoint ``model_path`` of ``arch`` stored as ``scheme`` says.

    Bytes per parameter group are averaged over the model's modules
    (:func:`domain.quant.group_bytes`: excluded modules bf16); the MTP/NextN layer gets its
    own ``mtp_bytes_per_param`` when the scheme stores it differently (e.g. ModelOpt NVFP4
    excluding ``model.layers.78*``). Groups the model lacks carry the scheme's bytes.
    """
    def fill(b: dict[str, float]) -> dict[str, float]:
        return {g: b.get(g, BF16 if g == "embed" else scheme.bytes_per_param) for g in
                (*GROUPS, *b)}
    per = fill(group_bytes(arch.modules(), scheme))
    mtp = None
    if arch.mtp_layers:
        m = fill(group_bytes(arch.layer_modules(arch.layers), scheme))
        mlp = "experts" if arch.n_routed_experts else "dense_mlp"
        if any(abs(m[g] - per[g]) > 1e-12 for g in ("attention", mlp)):
            mtp = m
    return Checkpoint(model_path=model_path, quantization=scheme.quantization,
                      compute_dtype=scheme.compute_dtype, bytes_per_param=per,
                      mtp_bytes_per_param=mtp, source=scheme.source)


def _groups(embed: float, body: float, attention: float | None = None) -> dict[str, float]:
    """bytes_per_param with ``body`` for every linear group (attention may differ)."""
    return {"embed": embed, "attention": body if attention is None else attention,
            "dense_mlp": body, "experts": body}


def _bf16_ckpt(model_path: str) -> Checkpoint:
    return Checkpoint(model_path=model_path, quantization=None, compute_dtype="bf16",
                      bytes_per_param=_groups(BF16, BF16),
                      source=f"{model_path}: bf16 release (torch_dtype bfloat16 in its config)")


def _fp8_block_ckpt(model_path: str, source: str) -> Checkpoint:
    """Native FP8 block-wise release: embeddings and lm_head bf16, every linear fp8 + scales."""
    return Checkpoint(model_path=model_path, quantization="fp8", compute_dtype="fp8",
                      bytes_per_param=_groups(BF16, FP8_BLOCK), source=source)


def _llama_8b(arch: ModelArch) -> dict[str, Checkpoint]:
    """Llama-3.1-8B: the bf16 release, and the same weights quantized by SGLang at load.

    ``--quantization fp8`` on a bf16 checkpoint is SGLang's online FP8 (``Fp8LinearMethod`` with
    an unserialized checkpoint): each linear weight becomes fp8 with a per-tensor/per-channel
    scale; embeddings and lm_head stay bf16.
    """
    path = "meta-llama/Llama-3.1-8B-Instruct"
    return {
        "bf16": _bf16_ckpt(path),
        "fp8": Checkpoint(model_path=path, quantization="fp8", compute_dtype="fp8",
                          bytes_per_param=_groups(BF16, FP8_TENSOR),
                          source="SGLang online FP8 quantization of the bf16 release"),
    }


def _llama_70b(arch: ModelArch) -> dict[str, Checkpoint]:
    """Llama-3.1-70B: bf16 release and nvidia/Llama-3.1-70B-Instruct-FP8 (ModelOpt FP8).

    The ModelOpt checkpoint is per-tensor FP8 with only ``lm_head`` excluded
    (``nvidia--Llama-3.1-70B-Instruct-FP8_hf_quant_config.json``); embeddings are not linears.
    """
    return {
        "bf16": _bf16_ckpt("meta-llama/Llama-3.1-70B-Instruct"),
        "fp8": Checkpoint(model_path="nvidia/Llama-3.1-70B-Instruct-FP8",
                          quantization="modelopt_fp8", compute_dtype="fp8",
                          bytes_per_param=_groups(BF16, FP8_TENSOR),
                          source=f"nvidia/Llama-3.1-70B-Instruct-FP8 hf_quant_config.json "
                                 f"({_BUNDLE})"),
    }


def _qwen3_32b(arch: ModelArch) -> dict[str, Checkpoint]:
    """Qwen3-32B: bf16 release and Qwen/Qwen3-32B-FP8 (fp8 block 128x128, its config.json)."""
    return {
        "bf16": _bf16_ckpt("Qwen/Qwen3-32B"),
        "fp8": _fp8_block_ckpt("Qwen/Qwen3-32B-FP8",
                               f"Qwen/Qwen3-32B-FP8 quantization_config ({_BUNDLE})"),
    }


def _qwen3_235b(arch: ModelArch) -> dict[str, Checkpoint]:
    """Qwen3-235B-A22B: bf16, Qwen's FP8 block release and nvidia/Qwen3-235B-A22B-NVFP4.

    The NVFP4 checkpoint quantizes every linear, attention included; only the routers
    (``mlp.gate``) and ``lm_head`` are excluded (its hf_quant_config.json).
    """
    return {
        "bf16": _bf16_ckpt("Qwen/Qwen3-235B-A22B-Instruct-2507"),
        "fp8": _fp8_block_ckpt("Qwen/Qwen3-235B-A22B-FP8",
                               f"Qwen/Qwen3-235B-A22B-FP8 quantization_config ({_BUNDLE})"),
        "nvfp4": Checkpoint(model_path="nvidia/Qwen3-235B-A22B-NVFP4",
                            quantization="modelopt_fp4", compute_dtype="fp4",
                            bytes_per_param=_groups(BF16, NVFP4),
                            source=f"nvidia/Qwen3-235B-A22B-NVFP4 hf_quant_config.json "
                                   f"({_BUNDLE})"),
    }


def _deepseek_nvfp4_attention(arch: ModelArch) -> float:
    """Mean bytes per attention parameter of DeepSeek NVFP4 checkpoints.

    Their ``exclude_modules`` keep q_a/q_b/kv_a/kv_b projections in bf16 while ``o_proj`` is
    NVFP4 (nvidia--DeepSeek-V3.1-NVFP4_hf_quant_config.json), so the group is a mix weighted by
    the shapes: o_proj has heads x v_head_dim x hidden parameters.
    """
    o = arch.heads * arch.head_dim * arch.hidden
    total = arch.attention_params_per_layer
    return (o * NVFP4 + (total - o) * BF16) / total


def _deepseek_v3(arch: ModelArch) -> dict[str, Checkpoint]:
    """DeepSeek-V3: the native FP8 block-wise release (its config.json quantization_config)."""
    return {"fp8": _fp8_block_ckpt("deepseek-ai/DeepSeek-V3",
                                   f"deepseek-ai/DeepSeek-V3 quantization_config ({_BUNDLE})")}


def _deepseek_r1(arch: ModelArch) -> dict[str, Checkpoint]:
    """DeepSeek-R1-0528 (same shapes as V3): native FP8 and nvidia/DeepSeek-R1-0528-FP4.

    The NVFP4 checkpoint's precisions are taken from the ModelOpt recipe of the bundled
    nvidia/DeepSeek-V3.1-NVFP4 (same architecture): experts, dense MLPs and o_proj in NVFP4; the
    other attention projections, lm_head and the whole MTP layer (``model.layers.61*``) in bf16.
    """
    nvfp4_bytes = _groups(BF16, NVFP4, attention=_deepseek_nvfp4_attention(arch))
    return {
        "fp8": _fp8_block_ckpt("deepseek-ai/DeepSeek-R1-0528",
                               f"deepseek-ai/DeepSeek-R1 quantization_config ({_BUNDLE})"),
        "nvfp4": Checkpoint(model_path="nvidia/DeepSeek-R1-0528-FP4",
                            quantization="modelopt_fp4", compute_dtype="fp4",
                            bytes_per_param=nvfp4_bytes, mtp_bytes_per_param=_groups(BF16, BF16),
                            source=f"ModelOpt NVFP4 recipe of nvidia/DeepSeek-V3.1-NVFP4 "
                                   f"hf_quant_config.json ({_BUNDLE})"),
    }


def _glm5(arch: ModelArch) -> dict[str, Checkpoint]:
    """GLM-5 (zai-org), 744B total / ~40B active, DSA sparse attention.

    zai-org/GLM-5-FP8 keeps embeddings and lm_head in bf16 and everything else fp8 block-wise
    (its quantization_config: quant_method fp8, weight_block_size [128, 128]); nvidia/GLM-5-NVFP4
    quantizes MLP and expert linears to NVFP4 and keeps all attention and indexer projections,
    lm_head and the MTP layer (``model.layers.78*``) in bf16 (``exclude_modules`` of its
    hf_quant_config.json).
    """
    return {
        "fp8": _fp8_block_ckpt("zai-org/GLM-5-FP8",
                               f"zai-org/GLM-5-FP8 quantization_config ({_BUNDLE})"),
        "nvfp4": Checkpoint(
            model_path="nvidia/GLM-5-NVFP4", quantization="modelopt_fp4", compute_dtype="fp4",
            bytes_per_param=_groups(BF16, NVFP4, attention=BF16),
            mtp_bytes_per_param=_groups(BF16, BF16),
            source=f"nvidia/GLM-5-NVFP4 hf_quant_config.json ({_BUNDLE})",
        ),
    }
