"""Model architecture catalog: layer shapes, parameter counts and shipped checkpoints.

Architectures are read from Hugging Face ``config.json`` files (the hub is never contacted: the
files ship under ``data/models/`` or are given as a local path). Parameter counts are computed from
the shapes, so they can be checked against the published totals.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from domain.errors import ConfigInvalid

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "data" / "models"

AttentionKind = Literal["gqa", "mla", "dsa"]


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
    source: str


class ModelArch(BaseModel):
    """Shapes of a decoder-only transformer (dense or MoE; GQA, MLA or DSA attention)."""

    model_config = ConfigDict(frozen=True)

    name: str
    attention: AttentionKind
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int = Field(description="per-head dim for GQA; v_head_dim for MLA/DSA")
    qk_head_dim: int
    vocab: int
    context_len: int = Field(description="max_position_embeddings, tokens")
    intermediate: int = Field(description="dense MLP intermediate size")
    first_k_dense: int = Field(0, description="leading layers with a dense MLP instead of MoE")
    n_routed_experts: int = 0
    experts_per_tok: int = 0
    n_shared_experts: int = 0
    moe_intermediate: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    index_head_dim: int = 0
    index_n_heads: int = 0
    index_topk: int = Field(0, description="DSA: KV tokens each query attends to")
    checkpoints: dict[str, Checkpoint] = Field(default_factory=dict)
    source: str = ""

    # ---- parameter counts (parameters, not bytes) ----
    @property
    def attention_params_per_layer(self) -> int:
        """Attention (and DSA indexer) parameters of one layer."""
        h, n = self.hidden, self.heads
        if self.attention == "gqa":
            return h * n * self.head_dim * 2 + h * self.kv_heads * self.head_dim * 2
        q = (h * self.q_lora_rank + self.q_lora_rank * n * self.qk_head_dim) if self.q_lora_rank \
            else h * n * self.qk_head_dim
        nope = self.qk_head_dim - self.qk_rope_head_dim
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) \
            + self.kv_lora_rank * n * (nope + self.head_dim)
        o = n * self.head_dim * h
        idx = 0
        if self.attention == "dsa":
            idx = (self.q_lora_rank * self.index_n_heads * self.index_head_dim
                   + h * self.index_head_dim + h * self.index_n_heads)
        return q + kv + o + idx

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden * self.moe_intermediate

    @property
    def moe_layers(self) -> int:
        """Number of layers with a MoE MLP."""
        return self.layers - self.first_k_dense if self.n_routed_experts else 0

    def param_groups(self) -> dict[str, int]:
        """Total parameters per group: embed, attention, dense_mlp, experts (routed + shared)."""
        dense_layers = self.layers - self.moe_layers
        experts = self.moe_layers * (
            (self.n_routed_experts + self.n_shared_experts) * self.expert_params
            + self.hidden * self.n_routed_experts  # router
        )
        return {
            "embed": 2 * self.vocab * self.hidden,  # embed_tokens + untied lm_head
            "attention": self.layers * self.attention_params_per_layer,
            "dense_mlp": dense_layers * 3 * self.hidden * self.intermediate,
            "experts": experts,
        }

    @property
    def total_params(self) -> int:
        """All parameters (the MTP/NextN layer excluded: SGLang loads it only for speculation)."""
        return sum(self.param_groups().values())

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (routed top-k plus shared experts)."""
        g = self.param_groups()
        active_experts = self.moe_layers * (
            (self.experts_per_tok + self.n_shared_experts) * self.expert_params
        )
        return g["embed"] // 2 + g["attention"] + g["dense_mlp"] + active_experts

    def weight_bytes(self, weights: str) -> float:
        """Bytes of the whole checkpoint ``weights`` (all GPUs together).

        Raises:
            ConfigInvalid: if the model has no such checkpoint.
        """
        ckpt = self.checkpoint(weights)
        return sum(n * ckpt.bytes_per_param[g] for g, n in self.param_groups().items())

    def checkpoint(self, weights: str) -> Checkpoint:
        """Return the checkpoint called ``weights`` (e.g. ``fp8``, ``nvfp4``).

        Raises:
            ConfigInvalid: naming the checkpoints that exist.
        """
        try:
            return self.checkpoints[weights]
        except KeyError:
            raise ConfigInvalid([
                f"weights: model {self.name} has no {weights!r} checkpoint; "
                f"known: {', '.join(self.checkpoints)}"
            ]) from None

    def kv_bytes_per_token(self, kv_bytes: float, tp_size: int) -> float:
        """KV-cache bytes one token occupies on one GPU of a TP group.

        Args:
            kv_bytes: bytes per cached element (2 for bf16, 1 for fp8).
            tp_size: tensor-parallel width of the replica.

        GQA: K and V of ``max(1, kv_heads // tp)`` heads per rank (heads are replicated when
        TP exceeds their number). MLA: the compressed latent (kv_lora_rank + rope dims) is
        replicated on every rank (DeepSeek-V2 paper, sec. 2.1). DSA adds the lightning indexer's
        key cache: index_head_dim fp8 bytes + one fp32 scale per token and layer (DeepSeek-V3.2
        report; SGLang's NSA token-to-KV pool stores it beside the latent).
        """
        if self.attention == "gqa":
            per_rank = max(1, self.kv_heads // tp_size)
            return self.layers * 2 * per_rank * self.head_dim * kv_bytes
        latent = self.layers * (self.kv_lora_rank + self.qk_rope_head_dim) * kv_bytes
        if self.attention == "dsa":
            latent += self.layers * (self.index_head_dim + 4)
        return latent


def arch_from_hf_config(name: str, cfg: dict[str, Any], source: str) -> ModelArch:
    """Build a ModelArch from a Hugging Face ``config.json`` dict.

    Raises:
        ConfigInvalid: if a required key is missing.
    """
    try:
        mla = bool(cfg.get("kv_lora_rank"))
        attention: AttentionKind = ("dsa" if cfg.get("index_topk") else "mla") if mla else "gqa"
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("v_head_dim") if mla else cfg.get("head_dim",
                                                             cfg["hidden_size"] // heads)
        return ModelArch(
            name=name,
            attention=attention,
            layers=cfg["num_hidden_layers"],
            hidden=cfg["hidden_size"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=head_dim,
            qk_head_dim=cfg.get("qk_head_dim", head_dim) if mla else head_dim,
            vocab=cfg["vocab_size"],
            context_len=cfg["max_position_embeddings"],
            intermediate=cfg["intermediate_size"],
            first_k_dense=cfg.get("first_k_dense_replace", 0),
            n_routed_experts=cfg.get("n_routed_experts", cfg.get("num_experts", 0)) or 0,
            experts_per_tok=cfg.get("num_experts_per_tok", 0) or 0,
            n_shared_experts=cfg.get("n_shared_experts", 0) or 0,
            moe_intermediate=cfg.get("moe_intermediate_size", 0) or 0,
            q_lora_rank=cfg.get("q_lora_rank") or 0,
            kv_lora_rank=cfg.get("kv_lora_rank") or 0,
            qk_rope_head_dim=cfg.get("qk_rope_head_dim") or 0,
            index_head_dim=cfg.get("index_head_dim") or 0,
            index_n_heads=cfg.get("index_n_heads") or 0,
            index_topk=cfg.get("index_topk") or 0,
            source=source,
        )
    except KeyError as e:
        raise ConfigInvalid([f"model config {source}: missing key {e.args[0]!r}"]) from e


# FP8 block-wise checkpoints store one fp32 scale per 128x128 block (weight_block_size in the
# checkpoint's quantization_config): 4 / 16384 bytes per parameter on top of 1 byte.
_FP8_BLOCK = 1 + 4 / (128 * 128)
# NVFP4 (modelopt): 4-bit values plus one fp8 scale per 16 values (group_size 16 in
# hf_quant_config.json) = 0.5 + 1/16 bytes per parameter; the per-tensor fp32 scale is negligible.
_NVFP4 = 0.5 + 1 / 16


@cache
def glm5() -> ModelArch:
    """GLM-5 (zai-org), 744B total / ~40B active, DSA sparse attention.

    Shapes come from ``data/models/zai-org--GLM-5_config.json``, the GLM-5 config bundled in the
    aiconfigurator-core 0.12.0 wheel (Apache-2.0; identical in the FP8 and NVFP4 variants there).
    Checkpoint precisions: zai-org/GLM-5-FP8 keeps embeddings and lm_head in bf16 and everything
    else fp8 block-wise (its quantization_config: quant_method fp8, weight_block_size [128, 128]);
    nvidia/GLM-5-NVFP4 quantizes MLP and expert linears to NVFP4 and keeps all attention and
    indexer projections and lm_head in bf16 (``exclude_modules`` of its hf_quant_config.json).
    """
    path = MODELS_DIR / "zai-org--GLM-5_config.json"
    arch = arch_from_hf_config("glm-5", json.loads(path.read_text()), source=str(path.name))
    checkpoints = {
        "fp8": Checkpoint(
            model_path="zai-org/GLM-5-FP8", quantization="fp8", compute_dtype="fp8",
            bytes_per_param={"embed": 2, "attention": _FP8_BLOCK, "dense_mlp": _FP8_BLOCK,
                             "experts": _FP8_BLOCK},
            source="zai-org/GLM-5-FP8 quantization_config (aiconfigurator-core 0.12.0 bundle)",
        ),
        "nvfp4": Checkpoint(
            model_path="nvidia/GLM-5-NVFP4", quantization="modelopt_fp4", compute_dtype="fp4",
            bytes_per_param={"embed": 2, "attention": 2, "dense_mlp": _NVFP4, "experts": _NVFP4},
            source="nvidia/GLM-5-NVFP4 hf_quant_config.json (aiconfigurator-core 0.12.0 bundle)",
        ),
    }
    return arch.model_copy(update={"checkpoints": checkpoints})


MODELS = {"glm-5": glm5}


def get_model(name: str) -> ModelArch:
    """Return the catalog model ``name``.

    Raises:
        ConfigInvalid: unknown name.
    """
    if name in MODELS:
        return MODELS[name]()
    raise ConfigInvalid([f"model: unknown model {name!r}; known: {', '.join(MODELS)}"])
