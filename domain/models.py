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

from domain.checkpoints import (
    BF16,
    FP8_BLOCK,
    FP8_TENSOR,
    NVFP4,
    Checkpoint,
    _deepseek_r1,
    _deepseek_v3,
    _glm5,
    _llama_8b,
    _llama_70b,
    _qwen3_32b,
    _qwen3_235b,
)
from domain.errors import ConfigInvalid

__all__ = ["BF16", "FP8_BLOCK", "FP8_TENSOR", "NVFP4", "Checkpoint", "ModelArch"]

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "data" / "models"

AttentionKind = Literal["gqa", "mla", "dsa"]


class ModelArch(BaseModel):
    """Shapes of a decoder-only transformer (dense or MoE; GQA, MLA or DSA attention)."""

    model_config = ConfigDict(frozen=True)

    name: str
    attention: AttentionKind
    architecture: str = Field("", description="Hugging Face config.json architectures[0], "
                              "e.g. Qwen3MoeForCausalLM (the engine keys its rules on it)")
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
            architecture=(cfg.get("architectures") or [""])[0],
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


_REGISTERED: dict[str, ModelArch] = {}


def register_model(arch: ModelArch) -> ModelArch:
    """Make ``arch`` (a user's model) known to :func:`get_model` under ``arch.name``.

    Process-wide; a catalog entry of the same name is shadowed. Returns ``arch``.
    """
    _REGISTERED[arch.name] = arch
    return arch


def model_from_path(path: str | Path, *, name: str | None = None,
                    checkpoints: dict[str, Checkpoint] | None = None) -> ModelArch:
    """Read a model from a local Hugging Face ``config.json`` (or a directory holding one).

    Args:
        path: the config.json, or its directory.
        name: the model's name in servetune (default: the directory's name).
        checkpoints: weights key -> checkpoint (default: none).

    Raises:
        ConfigInvalid: a missing or unreadable file, or a config missing a required key.
    """
    p = Path(path)
    cfg_path = p / "config.json" if p.is_dir() else p
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigInvalid([f"model config {cfg_path}: cannot read it ({e})"]) from None
    if not isinstance(cfg, dict):
        raise ConfigInvalid([f"model config {cfg_path}: expected a JSON object"])
    arch = arch_from_hf_config(name or cfg_path.resolve().parent.name, cfg, source=str(cfg_path))
    return arch.model_copy(update={"checkpoints": checkpoints or {}})


@cache
def _load_catalog_model(name: str) -> ModelArch:
    if name not in CATALOG:
        raise ConfigInvalid([f"model: unknown model {name!r}; known: {', '.join(CATALOG)}"])
    filename, checkpoints = CATALOG[name]
    path = MODELS_DIR / filename
    arch = arch_from_hf_config(name, json.loads(path.read_text()), source=filename)
    return arch.model_copy(update={"checkpoints": checkpoints(arch)})


def load_model(name: str) -> ModelArch:
    """Return model ``name``: a registered one (:func:`register_model`), else the catalog's.

    Catalog models are built from their shipped config.json with their checkpoints attached.

    Raises:
        ConfigInvalid: unknown name, or a config missing a required key.
    """
    if name in _REGISTERED:
        return _REGISTERED[name]
    return _load_catalog_model(name)


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
