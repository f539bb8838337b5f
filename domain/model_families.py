"""Read a Hugging Face ``config.json`` into a :class:`~domain.model_arch.ModelArch`, by family.

Families (``model_type`` -> how its config is read):

* dense GQA/MHA: llama, mistral, qwen2, qwen3; gemma2/gemma3 (alternating sliding-window and
  full layers from ``layer_types``, ``sliding_window_pattern`` or Gemma-2's every other layer);
* MoE with routed (+ shared) experts: qwen3_moe, mixtral and minimax_m2 (``num_local_experts``,
  experts of ``intermediate_size``), gpt_oss (also alternating sliding/full attention from
  ``layer_types``), llama4 (MoE every ``interleave_moe_layer_step`` layers, a shared expert),
  glm4_moe;
* MLA: deepseek_v2, deepseek_v3, kimi_k2; DSA (MLA + lightning indexer): deepseek_v32,
  glm_moe_dsa;
* hybrid linear attention: qwen3_next, qwen3_5, qwen3_5_moe (``layer_types`` linear_attention /
  full_attention, Gated DeltaNet); hybrid Mamba: nemotron_h (``hybrid_override_pattern``:
  M Mamba2, * attention, - MLP, E MoE);
* multimodal: the text model under ``text_config`` (qwen3_vl, qwen3_vl_moe, qwen3_5*, kimi_k25,
  llama4), the vision tower's parameters from ``vision_config`` counted as weights.

Anything else is refused with one line naming the ``model_type`` (DeepSeek-V4's compressed
attention and Gemma-4's global layers, for two, are not families here).
"""

from __future__ import annotations

from typing import Any

from domain.errors import ConfigInvalid
from domain.model_arch import AttentionKind, LayerKind, MlpKind, ModelArch

DENSE = {"llama", "mistral", "qwen2", "qwen3", "qwen3_vl_text", "qwen3_vl", "gemma2", "gemma3",
         "gemma3_text"}
MOE = {"qwen3_moe", "qwen3_vl_moe", "qwen3_vl_moe_text", "mixtral", "minimax_m2", "gpt_oss",
       "llama4", "llama4_text", "glm4_moe"}
MLA = {"deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25", "deepseek_v32", "glm_moe_dsa"}
HYBRID = {"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
          "nemotron_h"}
SUPPORTED = DENSE | MOE | MLA | HYBRID
"""model_type values read here."""

UNSUPPORTED = {
    "deepseek_v4": "DeepSeek-V4 compressed sparse attention (compress_ratios, hc_mult, "
                   "o_lora_rank) is not a modelled family",
    "deepseek_ref": "DeepSeek-V4 compressed sparse attention (compress_ratios, hc_mult, "
                    "o_lora_rank) is not a modelled family",
    "gemma4": "Gemma-4 global layers of another head size and KV heads (global_head_dim, "
              "num_global_key_value_heads, attention_k_eq_v) are not modelled",
}


def _need(cfg: dict[str, Any], key: str, source: str) -> Any:
    """``cfg[key]``, a whole number of at least 1 (every key read with it is a size or count).

    Raises:
        ConfigInvalid: one line: the key missing, or its value not a whole number >= 1.
    """
    if key not in cfg or cfg[key] is None:
        raise ConfigInvalid([f"model config {source}: missing key {key!r}"])
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigInvalid([f"model config {source}: {key} = {v!r}: must be a whole number "
                             ">= 1"])
    return v


def _check_heads(heads: int, kv_heads: Any, mla: bool, source: str) -> int:
    """The KV head count: a whole number >= 1 that divides the query heads (GQA groups).

    Raises:
        ConfigInvalid: one line naming ``num_key_value_heads``.
    """
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1:
        raise ConfigInvalid([f"model config {source}: num_key_value_heads = {kv_heads!r}: must "
                             "be a whole number >= 1"])
    if not mla and heads % kv_heads:
        raise ConfigInvalid([f"model config {source}: num_key_value_heads = {kv_heads} does "
                             f"not divide num_attention_heads = {heads} (each KV head serves "
                             "a whole group of query heads)"])
    return kv_heads


def _layer_kinds(cfg: dict[str, Any], layers: int, source: str) \
        -> tuple[tuple[LayerKind, ...], tuple[MlpKind, ...] | None]:
    """Per-layer mixers (and, for Nemotron-H, MLPs) from layer_types / hybrid_override_pattern."""
    pattern = cfg.get("hybrid_override_pattern")
    if pattern:
        mixer = {"M": "mamba", "*": "full", "-": "none", "E": "none"}
        mlp = {"M": "none", "*": "none", "-": "dense", "E": "moe"}
        if len(pattern) != layers or set(pattern) - set(mixer):
            raise ConfigInvalid([f"model config {source}: hybrid_override_pattern has "
                                 f"{len(pattern)} layers of {sorted(set(pattern))}, expected "
                                 f"{layers} of M * - E"])
        return (tuple(mixer[c] for c in pattern),  # type: ignore[misc]
                tuple(mlp[c] for c in pattern))  # type: ignore[misc]
    types = cfg.get("layer_types")
    if not types and cfg.get("full_attention_interval"):  # Qwen3-Next without layer_types
        n = int(cfg["full_attention_interval"])
        types = ["full_attention" if (i + 1) % n == 0 else "linear_attention"
                 for i in range(layers)]
    every = cfg.get("sliding_window_pattern")  # Gemma-3 before layer_types: 1 full in N
    if not types and every and cfg.get("sliding_window"):
        types = ["full_attention" if (i + 1) % int(every) == 0 else "sliding_attention"
                 for i in range(layers)]
    if not types and cfg.get("model_type") == "gemma2" and cfg.get("sliding_window"):
        types = ["sliding_attention" if i % 2 == 0 else "full_attention"  # Gemma-2 alternates
                 for i in range(layers)]
    if not types:
        return (), None
    names = {"full_attention": "full", "sliding_attention": "sliding",
             "linear_attention": "linear"}
    if len(types) != layers or set(types) - set(names):
        raise ConfigInvalid([f"model config {source}: layer_types has {len(types)} entries of "
                             f"{sorted(set(types))}, expected {layers} of {sorted(names)}"])
    return tuple(names[t] for t in types), None  # type: ignore[misc]


def _vision_params(v: dict[str, Any]) -> int:
    """Parameters of a ViT vision tower (Qwen2.5/3-VL style) from its ``vision_config``.

    depth x (qkv + proj = 4 h^2, MLP up + down = 2 h x intermediate), the patch embedding
    (channels x temporal x patch^2 x h), learned position embeddings and the patch merger(s)
    (spatial_merge^2 x h -> itself -> out_hidden_size; one more per deepstack index).
    Biases and norms (< 0.1 %) are not counted.
    """
    h = int(v.get("hidden_size") or v.get("embed_dim") or 0)
    depth = int(v.get("depth") or v.get("num_hidden_layers") or 0)
    if not h or not depth:
        return 0
    inter = int(v.get("intermediate_size") or 4 * h)
    patch = int(v.get("patch_size", 14))
    patch_embed = int(v.get("in_channels", 3)) * int(v.get("temporal_patch_size", 1)) \
        * patch * patch * h
    merge = int(v.get("spatial_merge_size", 1)) ** 2 * h
    out = int(v.get("out_hidden_size") or h)
    mergers = 1 + len(v.get("deepstack_visual_indexes") or [])
    return (depth * (4 * h * h + 2 * h * inter) + patch_embed
            + int(v.get("num_position_embeddings", 0)) * h
            + mergers * (merge * merge + merge * out))


def arch_from_hf_config(name: str, cfg: dict[str, Any], source: str) -> ModelArch:
    """Build a ModelArch from a Hugging Face ``config.json`` dict.

    A multimodal config's text model is read from ``text_config`` (its ``architectures`` and
    ``tie_word_embeddings`` from the top level). Without a ``model_type`` the config is read
    as a generic decoder (dense or MoE, GQA or MLA by its keys).

    Raises:
        ConfigInvalid: one line: a required key missing (named), or a ``model_type`` that is
            not a supported family (named, with the supported ones).
    """
    top = cfg
    mtype = top.get("model_type")
    if mtype in UNSUPPORTED:
        raise ConfigInvalid([f"model config {source}: model_type {mtype!r}: "
                             f"{UNSUPPORTED[mtype]}"])
    if mtype is not None and mtype not in SUPPORTED:
        raise ConfigInvalid([f"model config {source}: model_type {mtype!r} is not a supported "
                             f"family (supported: {', '.join(sorted(SUPPORTED))})"])
    text = top.get("text_config")
    cfg = {**text, "tie_word_embeddings": top.get("tie_word_embeddings",
                                                    text.get("tie_word_embeddings", False))} \
        if isinstance(text, dict) else top
    nested = cfg is not top
    mla = bool(cfg.get("kv_lora_rank"))
    attention: AttentionKind = ("dsa" if cfg.get("index_topk") else "mla") if mla else "gqa"
    layers = int(_need(cfg, "num_hidden_layers", source))
    hidden = int(_need(cfg, "hidden_size", source))
    heads = int(_need(cfg, "num_attention_heads", source))
    if mla:
        head_dim = int(_need(cfg, "v_head_dim", source))
        qk = cfg.get("qk_head_dim") or (int(_need(cfg, "qk_nope_head_dim", source))
                                        + int(_need(cfg, "qk_rope_head_dim", source)))
    else:
        head_dim = int(cfg.get("head_dim") or cfg.get("attention_head_dim") or hidden // heads)
        qk = head_dim
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_experts")
                  or cfg.get("num_local_experts") or 0)
    moe_inter = int(cfg.get("moe_intermediate_size") or (_need(cfg, "intermediate_size", source)
                                                         if experts else 0))
    # a MoE-only model (Qwen3.5-MoE) has no dense MLP and may omit intermediate_size
    inter = int(cfg.get("intermediate_size_mlp") or cfg.get("intermediate_size")
                or (moe_inter if experts else _need(cfg, "intermediate_size", source)))
    shared = int(cfg.get("n_shared_experts") or 0)
    shared_inter = int(cfg.get("shared_expert_intermediate_size")
                       or cfg.get("moe_shared_expert_intermediate_size") or 0)
    if shared_inter and moe_inter:  # one shared expert of another width, as N routed ones
        shared = max(1, round(shared_inter / moe_inter)) * max(shared, 1)
    if cfg.get("model_type") in ("llama4_text",) or top.get("model_type") == "llama4":
        shared = 1  # Llama-4 MoE layers: a shared expert of intermediate_size (models/llama4.py)
    kinds, nemotron_mlp = _layer_kinds(cfg, layers, source)
    mlp_kinds: tuple[MlpKind, ...] = ()
    if nemotron_mlp is not None:
        mlp_kinds = nemotron_mlp
    elif experts and cfg.get("interleave_moe_layer_step"):
        step = int(cfg["interleave_moe_layer_step"])
        mlp_kinds = tuple("moe" if (i + 1) % step == 0 else "dense" for i in range(layers))
    elif experts and cfg.get("mlp_only_layers"):
        dense = set(cfg["mlp_only_layers"])
        mlp_kinds = tuple("dense" if i in dense else "moe" for i in range(layers))
    naming: dict[str, Any] = {}
    family = cfg.get("model_type") or mtype
    if family in ("mixtral", "minimax_m2"):  # block_sparse_moe.experts.N.w1/w3/w2
        naming = {"moe_block": "block_sparse_moe", "expert_proj": ("w1", "w3", "w2")}
    elif family == "gpt_oss":  # mlp.experts.gate_up_proj (fused), mlp.router
        naming = {"expert_proj": ("gate_up_proj", "gate_up_proj", "down_proj"),
                  "router_name": "router"}
    elif str(family).startswith(("qwen3_5", "qwen3_next")):  # mlp.shared_expert, mtp.layers.0
        naming = {"shared_name": "shared_expert", "mtp_prefix": "mtp.layers.0"}
    elif family == "nemotron_h":
        naming = {"moe_block": "mixer"}
    linear = any(k == "linear" for k in kinds)
    mamba = any(k == "mamba" for k in kinds)
    vision = cfg is not top and isinstance(top.get("vision_config"), dict)
    return ModelArch(
        name=name,
        attention=attention,
        architecture=(top.get("architectures") or [""])[0],
        layers=layers, hidden=hidden, heads=heads,
        kv_heads=_check_heads(heads, cfg.get("num_key_value_heads") or heads, mla, source),
        head_dim=head_dim, qk_head_dim=int(qk),
        vocab=int(_need(cfg, "vocab_size", source)),
        context_len=int(_need(cfg, "max_position_embeddings", source)),
        intermediate=inter,
        first_k_dense=int(cfg.get("first_k_dense_replace") or 0),
        n_routed_experts=experts,
        experts_per_tok=int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token")
                            or 0),
        n_shared_experts=shared,
        moe_intermediate=moe_inter,
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
        qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
        index_head_dim=int(cfg.get("index_head_dim") or 0),
        index_n_heads=int(cfg.get("index_n_heads") or 0),
        index_topk=int(cfg.get("index_topk") or 0),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # DeepSeek-style NextN only: SGLang 0.5.23 hands the target checkpoint to the draft
        # worker for the architectures at arg_groups/speculative_hook.py:1121-1137, and Qwen3.5's
        # mtp_num_hidden_layers is not modelled as a draft layer
        mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        source=source,
        layer_prefix=("backbone.layers" if mamba else
                      "model.language_model.layers" if nested else "model.layers"),
        layer_kinds=kinds, mlp_kinds=mlp_kinds,
        sliding_window=int(cfg.get("sliding_window") or 0) if "sliding" in kinds else 0,
        mlp_matrices=2 if cfg.get("mlp_hidden_act") == "relu2" else 3,
        attn_output_gate=bool(cfg.get("attn_output_gate", linear)),
        ssm_heads=int(cfg.get("linear_num_value_heads") or cfg.get("mamba_num_heads") or 0)
        if linear or mamba else 0,
        ssm_head_dim=int(cfg.get("linear_value_head_dim") or cfg.get("mamba_head_dim") or 0)
        if linear or mamba else 0,
        ssm_groups=int(cfg.get("linear_num_key_heads") or cfg.get("n_groups") or 0)
        if linear or mamba else 0,
        ssm_state=int(cfg.get("linear_key_head_dim") or cfg.get("ssm_state_size") or 0)
        if linear or mamba else 0,
        conv_kernel=int(cfg.get("linear_conv_kernel_dim") or cfg.get("conv_kernel") or 4)
        if linear or mamba else 0,
        vision_params=_vision_params(top["vision_config"]) if vision else 0,
        **naming,
    )
