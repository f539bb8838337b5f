"""Model architecture catalog: layer shapes, parameter counts and shipped checkpoints.

Architectures are read from Hugging Face ``config.json`` files (the hub is never contacted: the
files ship under ``data/models/`` or are given as a local path). Parameter counts are computed from
the shapes, so they can be checked against the published totals.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache, partial
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
    mtp_bytes_per_param: dict[str, float] | None = Field(
        None, description="bytes per parameter of the MTP/NextN layer's groups when the "
        "checkpoint stores that layer at another precision; None: as bytes_per_param")
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
    tied_embeddings: bool = Field(False, description="lm_head shares embed_tokens' weights")
    mtp_layers: int = Field(0, description="MTP/NextN draft layers shipped with the checkpoint "
                            "(HF config num_nextn_predict_layers)")
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
            # embed_tokens, plus lm_head unless tied to it
            "embed": (1 if self.tied_embeddings else 2) * self.vocab * self.hidden,
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
        return self.vocab * self.hidden + g["attention"] + g["dense_mlp"] + active_experts

    def weight_bytes(self, weights: str) -> float:
        """Bytes of the whole checkpoint ``weights`` (all GPUs together).

        Raises:
            ConfigInvalid: if the model has no such checkpoint.
        """
        ckpt = self.checkpoint(weights)
        return sum(n * ckpt.bytes_per_param[g] for g, n in self.param_groups().items())

    @property
    def mtp_params_per_layer(self) -> dict[str, int]:
        """Parameters of one MTP/NextN layer per group: attention, mlp, glue.

        The layer (DeepSeek-V3 report, sec. 2.2, fig. 3; SGLang ``models/deepseek_nextn.py``) is
        one full decoder layer -- attention plus the MLP that layer index ``num_hidden_layers``
        would have: MoE (routed + shared experts + router) past ``first_k_dense_replace``, else the
        dense MLP -- plus ``eh_proj`` (a ``2 x hidden -> hidden`` linear joining the embedding and
        the target's hidden state) and five RMSNorm vectors (enorm, hnorm, input,
        post-attention and shared_head norms) as "glue". Its embedding and ``shared_head.head``
        (lm_head) are the target model's: SGLang's EAGLE worker hands the target's embed and head
        to the draft model (``set_embed_and_head``), so they are not counted.
        """
        if self.n_routed_experts and self.layers >= self.first_k_dense:
            mlp = ((self.n_routed_experts + self.n_shared_experts) * self.expert_params
                   + self.hidden * self.n_routed_experts)
        else:
            mlp = 3 * self.hidden * self.intermediate
        return {"attention": self.attention_params_per_layer, "mlp": mlp,
                "glue": 2 * self.hidden * self.hidden + 5 * self.hidden}

    def draft_weight_bytes(self, weights: str) -> float:
        """Bytes of the MTP/NextN draft layer(s) of checkpoint ``weights`` (all GPUs together).

        ``mtp_layers x`` the layer of :attr:`mtp_params_per_layer`; attention and MLP at the
        checkpoint's bytes per parameter for the MTP layer (``mtp_bytes_per_param``: e.g. the
        NVFP4 checkpoints keep the whole layer in bf16 -- ``model.layers.61*`` /
        ``model.layers.78*`` in their ``exclude_modules``), the glue in bf16 (``eh_proj`` and the
        norms are in ``modules_to_not_convert`` of zai-org/GLM-5-FP8). 0.0 without MTP layers.

        Raises:
            ConfigInvalid: if the model has no such checkpoint.
        """
        ckpt = self.checkpoint(weights)
        if not self.mtp_layers:
            return 0.0
        b = ckpt.mtp_bytes_per_param or ckpt.bytes_per_param
        p = self.mtp_params_per_layer
        mlp_group = "experts" if self.n_routed_experts else "dense_mlp"
        per_layer = (p["attention"] * b["attention"] + p["mlp"] * b[mlp_group]
                     + p["glue"] * BF16)
        return self.mtp_layers * per_layer

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
            qk_head_dim=(cfg.get("qk_head_dim")
                         or cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) if mla
            else head_dim,
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
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mtp_layers=cfg.get("num_nextn_predict_layers") or 0,
            source=source,
        )
    except KeyError as e:
        raise ConfigInvalid([f"model config {source}: missing key {e.args[0]!r}"]) from e


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


# catalog key -> (HF config.json under data/models/, checkpoints of that architecture)
CATALOG: dict[str, tuple[str, Callable[[ModelArch], dict[str, Checkpoint]]]] = {
    "llama-3.1-8b": ("meta-llama--Meta-Llama-3.1-8B_config.json", _llama_8b),
    "llama-3.1-70b": ("meta-llama--Meta-Llama-3.1-70B_config.json", _llama_70b),
    "qwen3-32b": ("Qwen--Qwen3-32B_config.json", _qwen3_32b),
    "qwen3-235b-a22b": ("Qwen--Qwen3-235B-A22B_config.json", _qwen3_235b),
    "deepseek-v3": ("deepseek-ai--DeepSeek-V3_config.json", _deepseek_v3),
    "deepseek-r1": ("deepseek-ai--DeepSeek-R1_config.json", _deepseek_r1),
    "glm-5": ("zai-org--GLM-5_config.json", _glm5),
}


@cache
def load_model(name: str) -> ModelArch:
    """Build catalog model ``name`` from its shipped config.json and attach its checkpoints.

    Raises:
        ConfigInvalid: unknown name, or a config missing a required key.
    """
    if name not in CATALOG:
        raise ConfigInvalid([f"model: unknown model {name!r}; known: {', '.join(CATALOG)}"])
    filename, checkpoints = CATALOG[name]
    path = MODELS_DIR / filename
    arch = arch_from_hf_config(name, json.loads(path.read_text()), source=filename)
    return arch.model_copy(update={"checkpoints": checkpoints(arch)})


def glm5() -> ModelArch:
    """GLM-5 from the catalog (see :func:`_glm5` for its checkpoints)."""
    return load_model("glm-5")


MODELS: dict[str, Callable[[], ModelArch]] = {
    name: partial(load_model, name) for name in CATALOG
}


def get_model(name: str) -> ModelArch:
    """Return the catalog model ``name``.

    Raises:
        ConfigInvalid: unknown name.
    """
    return load_model(name)


def find_checkpoint(model_path: str, quantization: str | None = None) -> tuple[str, str] | None:
    """``(catalog model, checkpoint key)`` whose ``--model-path`` is ``model_path``, or None.

    ``model_path`` is a Hugging Face repo id (``zai-org/GLM-5-FP8``, matched without regard to
    case) or a local directory named after one (``/models/GLM-5-FP8``: its last part against the
    repo's name). Where one repo backs two checkpoints (a bf16 release and SGLang's online fp8
    of it) ``quantization`` (``--quantization``) picks: the checkpoint passing that value, else
    the one passing none.
    """
    want = model_path.rstrip("/").casefold()
    tail = want.rsplit("/", 1)[-1]
    hits = [(name, key, ckpt) for name in CATALOG for key, ckpt in load_model(name).checkpoints
            .items() if ckpt.model_path.casefold() == want]
    if not hits:
        hits = [(name, key, ckpt) for name in CATALOG for key, ckpt in load_model(name)
                .checkpoints.items() if ckpt.model_path.casefold().rsplit("/", 1)[-1] == tail]
    if len(hits) > 1:
        hits = [h for h in hits if h[2].quantization == quantization] or hits
    return (hits[0][0], hits[0][1]) if hits else None
