"""The shapes of a decoder-only model and what follows from them: parameters, bytes, KV size.

Split from :mod:`domain.models` (the registry and catalog); :mod:`domain.model_families` reads
a Hugging Face config.json into a :class:`ModelArch`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from domain.checkpoints import BF16, Checkpoint
from domain.errors import ConfigInvalid
from domain.quant import Module

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
    layer_prefix: str = Field("model.layers", description="checkpoint name of the decoder "
                              "layer list (model.language_model.layers for Qwen3.5/Qwen3-VL)")

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

    def layer_modules(self, i: int) -> list[Module]:
        """Linear modules of decoder layer ``i`` as (checkpoint name, group, parameters).

        Names follow the checkpoints' own (``model.layers.3.self_attn.o_proj``) so a
        quantization config's excluded modules match them (:func:`domain.quant.group_bytes`).
        One routed expert stands for all: its parameters are multiplied by their number.
        ``i == layers`` is the MTP/NextN layer (a full MoE layer past ``first_k_dense``).
        """
        p, h, n = f"{self.layer_prefix}.{i}", self.hidden, self.heads
        a = f"{p}.self_attn"
        if self.attention == "gqa":
            d = self.head_dim
            out: list[Module] = [(f"{a}.q_proj", "attention", h * n * d),
                                 (f"{a}.k_proj", "attention", h * self.kv_heads * d),
                                 (f"{a}.v_proj", "attention", h * self.kv_heads * d),
                                 (f"{a}.o_proj", "attention", n * d * h)]
        else:
            qk, nope = self.qk_head_dim, self.qk_head_dim - self.qk_rope_head_dim
            out = ([(f"{a}.q_a_proj", "attention", h * self.q_lora_rank),
                    (f"{a}.q_b_proj", "attention", self.q_lora_rank * n * qk)]
                   if self.q_lora_rank else [(f"{a}.q_proj", "attention", h * n * qk)])
            out += [(f"{a}.kv_a_proj_with_mqa", "attention",
                     h * (self.kv_lora_rank + self.qk_rope_head_dim)),
                    (f"{a}.kv_b_proj", "attention", self.kv_lora_rank * n * (nope + self.head_dim)),
                    (f"{a}.o_proj", "attention", n * self.head_dim * h)]
            if self.attention == "dsa":
                ih, idim = self.index_n_heads, self.index_head_dim
                out += [(f"{a}.indexer.wq_b", "attention", self.q_lora_rank * ih * idim),
                        (f"{a}.indexer.wk", "attention", h * idim),
                        (f"{a}.indexer.weights_proj", "attention", h * ih)]
        m = f"{p}.mlp"
        if self.n_routed_experts and i >= self.first_k_dense:
            e = self.moe_intermediate
            out += [(f"{m}.experts.0.{w}", "experts", self.n_routed_experts * h * e)
                    for w in ("gate_proj", "up_proj", "down_proj")]
            out += [(f"{m}.shared_experts.{w}", "experts", self.n_shared_experts * h * e)
                    for w in ("gate_proj", "up_proj", "down_proj") if self.n_shared_experts]
            out.append((f"{m}.gate", "experts", h * self.n_routed_experts))
        else:
            out += [(f"{m}.{w}", "dense_mlp", h * self.intermediate)
                    for w in ("gate_proj", "up_proj", "down_proj")]
        return out

    def modules(self) -> list[Module]:
        """All linear modules and embeddings (the MTP layer excluded).

        As :meth:`layer_modules`; ``lm_head`` is absent when tied to ``embed_tokens``.
        """
        out: list[Module] = [("model.embed_tokens", "embed", self.vocab * self.hidden)]
        if not self.tied_embeddings:
            out.append(("lm_head", "embed", self.vocab * self.hidden))
        for i in range(self.layers):
            out += self.layer_modules(i)
        return out

    @property
    def max_tp(self) -> int:
        """Largest ``--tp-size`` SGLang 0.5.23 accepts for the attention heads.

        GQA: ``num_attention_heads % tp == 0`` and, when ``num_key_value_heads >= tp``,
        ``num_key_value_heads % tp == 0``, else ``tp % num_key_value_heads == 0``
        (``sglang/srt/models/llama.py:183-193``, ``qwen3.py:166-176``,
        ``qwen3_moe.py:506-512``, ``gpt_oss.py:394-400``). MLA/DSA: ``num_heads % tp == 0``
        (``sglang/srt/models/deepseek_v2.py:2057``).
        """
        def ok(tp: int) -> bool:
            if self.heads % tp:
                return False
            if self.attention != "gqa":
                return True
            kv = self.kv_heads
            return kv % tp == 0 if kv >= tp else tp % kv == 0
        return max(tp for tp in range(1, self.heads + 1) if ok(tp))

    def summary(self) -> dict[str, Any]:
        """What ``servetune check --json`` shows under ``model``.

        Keys: architecture, layers, total_params, active_params (parameters),
        kv_bytes_per_token_bf16 (bytes, bf16 KV, whole model: all layers, one token, TP 1) and
        max_tp (:attr:`max_tp`).
        """
        return {"architecture": self.architecture, "layers": self.layers,
                "total_params": self.total_params, "active_params": self.active_params,
                "kv_bytes_per_token_bf16": self.kv_bytes_per_token(2, 1),
                "max_tp": self.max_tp}

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


