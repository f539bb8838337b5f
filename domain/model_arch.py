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
LayerKind = Literal["full", "sliding", "linear", "mamba", "none"]
MlpKind = Literal["dense", "moe", "none"]

SWA_FULL_TOKENS_RATIO = 0.8
"""SWA layers' KV tokens per full-attention layer token: ``--swa-full-tokens-ratio`` falls back
to 0.8 (SGLang 0.5.23 ``srt/arg_groups/fields/schedule.py:150-161``; the pool sizes the SWA
side as ``full_tokens x ratio``, ``model_executor/pool_configurator.py:797-802``)."""


class ModelArch(BaseModel):
    """Shapes of a decoder-only transformer.

    Dense or MoE; GQA/MHA, MLA or DSA attention; per layer (``layer_kinds``) full attention,
    sliding-window attention, linear attention (Gated DeltaNet) or a Mamba2 mixer, and
    (``mlp_kinds``) a dense MLP, a MoE or none (Nemotron-H's mixer-only layers). Empty
    ``layer_kinds``/``mlp_kinds`` mean every layer is full attention, and MoE past
    ``first_k_dense`` when the model has routed experts.
    """

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
    layer_kinds: tuple[LayerKind, ...] = ()
    mlp_kinds: tuple[MlpKind, ...] = ()
    sliding_window: int = Field(0, description="tokens a sliding-window layer attends to")
    mlp_matrices: int = Field(3, description="3: gated (gate, up, down); 2: up, down (relu2)")
    attn_output_gate: bool = Field(False, description="q_proj also emits a sigmoid output gate "
                                   "(Qwen3-Next/Qwen3.5 full attention): 2x its output")
    ssm_heads: int = Field(0, description="linear/Mamba layers: value heads (GDN "
                           "linear_num_value_heads, Mamba2 mamba_num_heads)")
    ssm_head_dim: int = Field(0, description="GDN linear_value_head_dim; Mamba2 mamba_head_dim")
    ssm_groups: int = Field(0, description="GDN linear_num_key_heads; Mamba2 n_groups")
    ssm_state: int = Field(0, description="GDN linear_key_head_dim; Mamba2 ssm_state_size")
    conv_kernel: int = Field(0, description="causal conv1d width of linear/Mamba layers")
    ssm_state_bytes: int = Field(4, description="bytes per recurrent-state value (float32: "
                                 "mamba_ssm_dtype default, configs/mamba_utils.py:47-60)")
    vision_params: int = Field(0, description="vision tower parameters (multimodal; bf16)")
    # checkpoint module names, so quantization configs' excluded modules match
    moe_block: str = Field("mlp", description="MoE module of a layer: mlp, block_sparse_moe "
                           "(Mixtral, MiniMax), mixer (Nemotron-H)")
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    router_name: str = "gate"
    shared_name: str = "shared_experts"
    mtp_prefix: str = Field("", description="checkpoint name of the MTP layer when not "
                            "<layer_prefix>.<layers> (Qwen3.5: mtp.layers.0)")

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
        """Parameters of one routed expert (gate, up and down projections; up/down for relu2)."""
        return self.mlp_matrices * self.hidden * self.moe_intermediate

    def layer_kind(self, i: int) -> LayerKind:
        """Mixer of layer ``i``: full, sliding (window attention), linear (GDN), mamba, none."""
        return self.layer_kinds[i] if i < len(self.layer_kinds) else "full"

    def mlp_kind(self, i: int) -> MlpKind:
        """MLP of layer ``i`` (``i == layers``: the MTP layer): dense, moe or none."""
        if i < len(self.mlp_kinds):
            return self.mlp_kinds[i]
        return "moe" if self.n_routed_experts and i >= self.first_k_dense else "dense"

    def count_layers(self, *kinds: str) -> int:
        """Decoder layers whose mixer is one of ``kinds``."""
        return sum(self.layer_kind(i) in kinds for i in range(self.layers))

    @property
    def moe_layers(self) -> int:
        """Number of layers with a MoE MLP."""
        return sum(self.mlp_kind(i) == "moe" for i in range(self.layers))

    def layer_modules(self, i: int) -> list[Module]:
        """Linear modules of decoder layer ``i`` as (checkpoint name, group, parameters).

        Names follow the checkpoints' own (``model.layers.3.self_attn.o_proj``) so a
        quantization config's excluded modules match them (:func:`domain.quant.group_bytes`).
        One routed expert stands for all: its parameters are multiplied by their number.
        ``i == layers`` is the MTP/NextN layer (a full-attention layer with the MTP MLP).
        Linear-attention and Mamba mixers count in the ``attention`` group (conv1d included;
        per-head vectors A, D, dt_bias and norms are < 0.01 % and not counted).
        """
        p, h = f"{self.layer_prefix}.{i}", self.hidden
        if i >= self.layers and self.mtp_prefix:
            p = self.mtp_prefix
        kind = self.layer_kind(i) if i < self.layers else "full"
        nemotron = self.layer_prefix.startswith("backbone")  # backbone.layers.N.mixer.*
        if kind in ("full", "sliding"):
            out = self._attention_modules(f"{p}.mixer" if nemotron else f"{p}.self_attn")
        elif kind == "linear":  # Gated DeltaNet (models/qwen3_next.py)
            a = f"{p}.linear_attn"
            key, value = 2 * self.ssm_groups * self.ssm_state, self.ssm_heads * self.ssm_head_dim
            out = [(f"{a}.in_proj_qkvz", "attention", h * (key + 2 * value)),
                   (f"{a}.in_proj_ba", "attention", h * 2 * self.ssm_heads),
                   (f"{a}.conv1d", "attention", (key + value) * self.conv_kernel),
                   (f"{a}.out_proj", "attention", value * h)]
        elif kind == "mamba":  # Mamba2 (models/nemotron_h.py)
            a, inner = f"{p}.mixer", self.ssm_heads * self.ssm_head_dim
            bc = 2 * self.ssm_groups * self.ssm_state
            out = [(f"{a}.in_proj", "attention", h * (2 * inner + bc + self.ssm_heads)),
                   (f"{a}.conv1d", "attention", (inner + bc) * self.conv_kernel),
                   (f"{a}.out_proj", "attention", inner * h)]
        else:
            out = []
        m = f"{p}.mixer" if nemotron else f"{p}.mlp"
        names = ("gate_proj", "up_proj", "down_proj")[3 - self.mlp_matrices:]
        mlp = self.mlp_kind(i)
        if mlp == "moe":
            e, b = self.moe_intermediate, f"{p}.{self.moe_block}"
            out += [(f"{b}.experts.0.{w}", "experts", self.n_routed_experts * h * e)
                    for w in self.expert_proj[3 - self.mlp_matrices:]]
            out += [(f"{b}.{self.shared_name}.{w}", "experts", self.n_shared_experts * h * e)
                    for w in names if self.n_shared_experts]
            out.append((f"{b}.{self.router_name}", "experts", h * self.n_routed_experts))
        elif mlp == "dense":
            out += [(f"{m}.{w}", "dense_mlp", h * self.intermediate) for w in names]
        return out

    def _attention_modules(self, a: str) -> list[Module]:
        h, n = self.hidden, self.heads
        if self.attention == "gqa":
            d = self.head_dim
            return [(f"{a}.q_proj", "attention", h * n * d * (2 if self.attn_output_gate else 1)),
                    (f"{a}.k_proj", "attention", h * self.kv_heads * d),
                    (f"{a}.v_proj", "attention", h * self.kv_heads * d),
                    (f"{a}.o_proj", "attention", n * d * h)]
        qk, nope = self.qk_head_dim, self.qk_head_dim - self.qk_rope_head_dim
        out: list[Module] = ([(f"{a}.q_a_proj", "attention", h * self.q_lora_rank),
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
        if self.vision_params:
            out.append(("visual", "vision", self.vision_params))
        return out

    @property
    def max_tp(self) -> int:
        """Largest ``--tp-size`` SGLang 0.5.23 accepts for the attention heads.

        GQA: ``num_attention_heads % tp == 0`` and, when ``num_key_value_heads >= tp``,
        ``num_key_value_heads % tp == 0``, else ``tp % num_key_value_heads == 0``
        (``sglang/srt/models/llama.py:183-193``, ``qwen3.py:166-176``,
        ``qwen3_moe.py:506-512``, ``gpt_oss.py:394-400``). MLA/DSA: ``num_heads % tp == 0``
        (``sglang/srt/models/deepseek_v2.py:2057``). Linear-attention / Mamba layers also
        need ``tp`` to divide their value heads (``divide(num_heads, tp)`` in
        ``configs/mamba_utils.py:230``; ``distributed/utils.py:75`` asserts it).
        """
        def ok(tp: int) -> bool:
            if self.heads % tp or (self.ssm_heads and self.ssm_heads % tp):
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
        """Total parameters per group.

        embed, attention, dense_mlp, experts (routed + shared + routers), and vision for a
        multimodal model: sums of :meth:`modules`, cached per shape (name, checkpoints and
        source do not change them).
        """
        key = tuple(getattr(self, f) for f in type(self).model_fields
                    if f not in ("name", "checkpoints", "source"))
        if key not in _GROUPS_CACHE:
            g = {"embed": 0, "attention": 0, "dense_mlp": 0, "experts": 0}
            for _, group, n in self.modules():
                g[group] = g.get(group, 0) + n
            _GROUPS_CACHE[key] = g
        return dict(_GROUPS_CACHE[key])

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

    def recurrent_state_bytes(self, tp_size: int) -> float:
        """Bytes of one request's recurrent state on one GPU (0 without linear/Mamba layers).

        Per linear or Mamba layer, as SGLang 0.5.23 shapes it (``configs/mamba_utils.py:
        195-240``, GDN mapped in ``configs/qwen3_next.py:300-309``): a conv state of
        ``(heads x head_dim + 2 x groups x state) / tp x (conv_kernel - 1)`` bf16 values and a
        temporal (SSM) state of ``heads / tp x head_dim x state`` float32 values.
        """
        n = self.count_layers("linear", "mamba")
        if not n:
            return 0.0
        conv = (self.ssm_heads * self.ssm_head_dim + 2 * self.ssm_groups * self.ssm_state) \
            / tp_size * (self.conv_kernel - 1) * BF16
        temporal = self.ssm_heads / tp_size * self.ssm_head_dim * self.ssm_state \
            * self.ssm_state_bytes
        return n * (conv + temporal)

    def weight_bytes(self, weights: str) -> float:
        """Bytes of the whole checkpoint ``weights`` (all GPUs together), MTP layer excluded.

        Computed from the parameter groups and the checkpoint's bytes per parameter, or, when
        the checkpoint came with a ``model.safetensors.index.json``, its exact ``total_size``
        less the MTP layer's computed bytes (SGLang loads that layer only for speculation).

        Raises:
            ConfigInvalid: if the model has no such checkpoint.
        """
        ckpt = self.checkpoint(weights)
        if ckpt.exact_total_bytes is not None:  # model.safetensors.index.json total_size
            return ckpt.exact_total_bytes - self.draft_weight_bytes(weights)
        return sum(n * ckpt.bytes_per_param.get(g, BF16) for g, n in self.param_groups().items())

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
        if self.mlp_kind(self.layers) == "moe":
            mlp = ((self.n_routed_experts + self.n_shared_experts) * self.expert_params
                   + self.hidden * self.n_routed_experts)
        else:
            mlp = self.mlp_matrices * self.hidden * self.intermediate
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

    def kv_bytes_per_token(self, kv_bytes: float, tp_size: int,
                           swa_ratio: float = SWA_FULL_TOKENS_RATIO) -> float:
        """KV-cache bytes one token occupies on one GPU of a TP group.

        Args:
            kv_bytes: bytes per cached element (2 for bf16, 1 for fp8).
            tp_size: tensor-parallel width of the replica.
            swa_ratio: SWA-layer tokens per full-layer token (:data:`SWA_FULL_TOKENS_RATIO`).

        GQA: K and V of ``max(1, kv_heads // tp)`` heads per rank (heads are replicated when
        TP exceeds their number). MLA: the compressed latent (kv_lora_rank + rope dims) is
        replicated on every rank (DeepSeek-V2 paper, sec. 2.1). DSA adds the lightning indexer's
        key cache: index_head_dim fp8 bytes + one fp32 scale per token and layer (DeepSeek-V3.2
        report; SGLang's NSA token-to-KV pool stores it beside the latent).
        Only full-attention layers hold KV per token; sliding-window layers hold theirs in the
        SWA pool, ``swa_ratio`` tokens per full token; linear/Mamba layers hold a per-request
        state instead (:meth:`recurrent_state_bytes`).
        """
        full = self.count_layers("full") + swa_ratio * self.count_layers("sliding")
        if self.attention == "gqa":
            per_rank = max(1, self.kv_heads // tp_size)
            return full * 2 * per_rank * self.head_dim * kv_bytes
        latent = full * (self.kv_lora_rank + self.qk_rope_head_dim) * kv_bytes
        if self.attention == "dsa":
            latent += full * (self.index_head_dim + 4)
        return latent


_GROUPS_CACHE: dict[tuple[Any, ...], dict[str, int]] = {}
"""param_groups per model shape."""


MAMBA_FULL_MEMORY_RATIO = 0.9
"""Recurrent-state memory per unit of full-attention KV memory: ``--mamba-full-memory-ratio``
falls back to 0.9 (SGLang 0.5.23 ``srt/arg_groups/fields/schedule.py:220-227``)."""


def mamba_state_split(model: ModelArch, tp_size: int, room: float) \
        -> tuple[float, int | None, str]:
    """Split ``room`` bytes (per GPU) between the KV pool and a hybrid model's state pool.

    SGLang 0.5.23 (``mem_cache/kv_cache_configurator.py:3343-3351``, the default path: no
    ``--max-mamba-cache-size``) gives the recurrent states ``room x r / (1 + r)`` with
    ``r`` = :data:`MAMBA_FULL_MEMORY_RATIO`; ``max_mamba_cache_size`` is that budget over one
    request's state (:meth:`ModelArch.recurrent_state_bytes`), and caps the running requests.

    Returns:
        (bytes left for the KV pool, state slots or None for a model without linear/Mamba
        layers, a text fragment for the fit's arithmetic).
    """
    state = model.recurrent_state_bytes(tp_size)
    if not state or room <= 0:
        return room, None, ""
    r = MAMBA_FULL_MEMORY_RATIO
    slots = int(room * r / (1 + r) // state)
    taken = slots * state
    return room - taken, slots, (f" - {slots:,} recurrent states x {state / 1e6:.1f} MB "
                                 f"(mamba_full_memory_ratio {r})")
