"""Published checkpoints: stored bytes per parameter and how SGLang 0.5.23 loads each one.

Split from :mod:`domain.models` (the architectures); the catalog (``data/models/catalog.json``,
read by :mod:`domain.model_catalog`) attaches these to its models.
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
    exact_total_bytes: float | None = Field(
        None, description="bytes of every tensor of the checkpoint as its "
        "model.safetensors.index.json states (metadata.total_size); overrides the computed "
        "weight bytes (the MTP layer's computed bytes are taken out of it)")


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
