"""Weights and KV of one GPU under a parallel layout (issue 21), and the layout's resolutions.

Split from :mod:`domain.fit` (which sizes the pool from these): per pipeline stage, the bytes of
one GPU's weights under attention DP, expert parallelism, a dense-MLP TP width, redundant
experts and PP (:func:`stage_memory`), the resolved ``ep_size`` of an a2a backend, and the
constants of the engine's per-rank rules. SGLang 0.5.23 sites are cited at each rule. Units:
bytes, layers.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from domain.config import ServingConfig
from domain.model_arch import ModelArch

# Parallel layouts (issue 21). Every rule below is a no-op for a config whose layout fields hold
# their defaults (attn_dp 1, ep 1, pp 1, no a2a backend, ...): fit() then takes the TP-only path.
# Backends that force ep_size = tp_size (SGLang 0.5.23 arg_groups/overrides.py:1578-1593
# _A2A_EP_SPANNING_BACKENDS, applied by _a2a_ep_size at :1611-1620).
A2A_EP_SPANNING_BACKENDS = frozenset({"megamoe", "deepep", "deepep_v2", "mooncake", "nixl",
                                      "ascend_fuseep", "flashinfer", "flashinfer_megamoe",
                                      "mori", "pplx"})
# Decode servers reserve 2 x the per-worker cap as extra request slots when that cap is at most
# this (arg_groups/pd_disaggregation_hook.py:128-143).
PD_EXTRA_SLOTS_MAX_PER_WORKER = 32
# schedule_conservativeness is multiplied by this under attention DP
# (arg_groups/parallel_hook.py:314-319).
DP_ATTENTION_CONSERVATIVENESS = 0.3


def resolved_ep_size(config: ServingConfig) -> int:
    """``ep_size`` as the engine runs it: ``tp_size`` under an EP-spanning a2a backend.

    SGLang 0.5.23 ``arg_groups/overrides.py:1611-1620`` (``_a2a_ep_size``, logged "The expert
    parallel size is adjusted from X to the tensor parallel size"): a resolution, not a refusal.
    """
    if config.moe_a2a_backend in A2A_EP_SPANNING_BACKENDS:
        return config.tp_size
    return config.ep_size


def default_layout(config: ServingConfig) -> bool:
    """Every field that changes one GPU's weights or KV holds its default (TP-only path)."""
    return (config.attn_dp_size == 1 and config.pp_size == 1 and resolved_ep_size(config) == 1
            and config.moe_dense_tp_size in (None, config.tp_size)
            and not config.ep_num_redundant_experts and not config.enable_dp_lm_head
            and config.moe_a2a_backend in (None, "none"))


def pp_layer_ranges(layers: int, pp_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` decoder layers of each pipeline stage.

    SGLang 0.5.23 ``distributed/utils.py:110-150`` (``get_pp_indices``, no
    ``SGLANG_PP_LAYER_PARTITION``): ``layers // pp`` each, the last ``layers % pp`` stages one
    more.
    """
    base, extra = divmod(layers, pp_size)
    out, start = [], 0
    for rank in range(pp_size):
        n = base + (1 if rank >= pp_size - extra else 0)
        out.append((start, start + n))
        start += n
    return out


class StageMemory(BaseModel):
    """One pipeline stage's share of a GPU (bytes; ``kv_share``: its share of the KV bytes)."""

    model_config = ConfigDict(frozen=True)

    weight_bytes: float
    draft_weight_bytes: float
    kv_share: float
    layers: tuple[int, int]


_LAYER_CACHE: dict[tuple[object, ...], list[dict[str, float]]] = {}


def _layer_group_bytes(model: ModelArch, weights: str) -> tuple[list[dict[str, float]],
                                                                dict[str, float]]:
    """Per decoder layer ``{attention, dense, routed, shared, router}`` bytes, and the rest.

    All GPUs together, at the checkpoint's bytes per parameter of each group
    (:meth:`ModelArch.weight_bytes`' rule); when the checkpoint's size is exact
    (``model.safetensors.index.json``) every group is scaled by the same factor so the parts
    sum to it. The rest: ``embed``, ``lm_head`` (0 when tied) and ``vision``.
    """
    ckpt = model.checkpoint(weights)
    key = (model.name, weights, model.layers, model.hidden, model.n_routed_experts,
           model.vocab, ckpt.exact_total_bytes)
    bpp = ckpt.bytes_per_param
    computed = sum(n * bpp.get(g, 2.0) for g, n in model.param_groups().items())
    scale = model.weight_bytes(weights) / computed if computed else 1.0
    if key not in _LAYER_CACHE:
        rows = []
        for i in range(model.layers):
            row = dict.fromkeys(("attention", "dense", "routed", "shared", "router"), 0.0)
            for name, group, n in model.layer_modules(i):
                b = n * bpp.get(group, 2.0) * scale
                if group == "attention":
                    row["attention"] += b
                elif group == "dense_mlp":
                    row["dense"] += b
                elif ".experts." in name:
                    row["routed"] += b
                elif f".{model.shared_name}." in name:
                    row["shared"] += b
                else:
                    row["router"] += b
            rows.append(row)
        _LAYER_CACHE[key] = rows
    vh = model.vocab * model.hidden * bpp.get("embed", 2.0) * scale
    rest = {"embed": vh, "lm_head": 0.0 if model.tied_embeddings else vh,
            "vision": model.vision_params * bpp.get("vision", 2.0) * scale}
    return _LAYER_CACHE[key], rest


def stage_memory(config: ServingConfig, model: ModelArch, speculative: bool) -> list[StageMemory]:
    """Weights per GPU of each pipeline stage under ``config``'s layout, bytes.

    TP-only layouts (:func:`default_layout`): one stage, ``weights / tp_size`` (draft layers
    likewise). Otherwise, per GPU (SGLang 0.5.23):

    - attention (and a DSA indexer) over ``attn_tp_size`` -- replicated on every attention-DP
      rank (``layers/dp_attention.py compute_dp_attention_world_info``);
    - ``embed_tokens`` vocab-parallel over the attention TP group under attention DP, else over
      TP (``layers/vocab_parallel_embedding.py:168-185`` ``get_embedding_tp_kwargs``); on the
      first stage only (``models/deepseek_v2.py:2943-2949``: ``PPMissingLayer`` elsewhere);
    - ``lm_head`` over the attention TP group with ``--enable-dp-lm-head``, else over TP
      (``models/deepseek_v2.py:3296``, ``llama.py:578``, ``qwen3_moe.py:1022``
      ``use_attn_tp_group=enable_dp_lm_head``); on the last stage; a tied head is a copy there
      when PP splits it from the embedding;
    - dense MLP layers over ``moe_dense_tp_size`` (None = TP; ``validation_hook.py:207-211``
      allows None, 1 or tp_size);
    - routed experts: ``(experts + ep_num_redundant_experts) / ep_size`` physical experts per
      GPU (``eplb/expert_location.py:237-257``), each split over ``moe_tp_size = tp / ep`` --
      ``routed x physical / experts / tp``; shared experts replicated (TP 1) under an a2a
      backend, else over TP (``models/deepseek_v2.py:870-897``); the router over TP as the
      TP-only path counts it;
    - layers split over ``pp_size`` stages (:func:`pp_layer_ranges`); the speculative draft
      (MTP) layers on the last stage, attention over ``attn_tp_size`` and the rest over TP.

    ``kv_share``: the stage's share of the model's full-attention KV bytes per token (its
    full-attention layers, sliding ones at :data:`domain.model_arch.SWA_FULL_TOKENS_RATIO`).
    """
    t = config.tp_size
    draft_total = model.draft_weight_bytes(config.weights) if speculative else 0.0
    if default_layout(config):
        return [StageMemory(weight_bytes=model.weight_bytes(config.weights) / t,
                            draft_weight_bytes=draft_total / t, kv_share=1.0,
                            layers=(0, model.layers))]
    from domain.model_arch import SWA_FULL_TOKENS_RATIO

    rows, rest = _layer_group_bytes(model, config.weights)
    attn_tp = config.attn_tp_size
    dense_tp = config.moe_dense_tp_size or t
    physical = 1.0
    if model.n_routed_experts:
        physical = (model.n_routed_experts + config.ep_num_redundant_experts) \
            / model.n_routed_experts
    a2a = config.moe_a2a_backend not in (None, "none")
    embed_tp = attn_tp if config.attn_dp_size > 1 else t
    head_tp = attn_tp if config.enable_dp_lm_head and config.attn_dp_size > 1 else t
    lm_head = rest["lm_head"] or (rest["embed"] if config.pp_size > 1 else 0.0)
    if draft_total:
        ckpt = model.checkpoint(config.weights)
        b = ckpt.mtp_bytes_per_param or ckpt.bytes_per_param
        d_attn = model.mtp_layers * model.mtp_params_per_layer["attention"] * b["attention"]
        draft = d_attn / attn_tp + (draft_total - d_attn) / t
    else:
        draft = 0.0

    def kv_weight(i: int) -> float:
        kind = model.layer_kind(i)
        return 1.0 if kind == "full" else SWA_FULL_TOKENS_RATIO if kind == "sliding" else 0.0

    total_kv = sum(kv_weight(i) for i in range(model.layers)) or 1.0
    ranges = pp_layer_ranges(model.layers, config.pp_size)
    out = []
    for k, (a, z) in enumerate(ranges):
        w = sum(r["attention"] / attn_tp + r["dense"] / dense_tp + r["routed"] * physical / t
                + r["shared"] / (1 if a2a else t) + r["router"] / t for r in rows[a:z])
        if k == 0:
            w += rest["embed"] / embed_tp + rest["vision"] / t
        last = k == len(ranges) - 1
        if last:
            w += lm_head / head_tp
        out.append(StageMemory(weight_bytes=w, draft_weight_bytes=draft if last else 0.0,
                               kv_share=sum(kv_weight(i) for i in range(a, z)) / total_kv,
                               layers=(a, z)))
    return out


def layout_label(config: ServingConfig) -> str:
    """``TP8`` or e.g. ``TP8 (attention TP1 x DP8, EP8, PP2)``: the layout fit() sized."""
    parts = []
    if config.attn_dp_size > 1:
        parts.append(f"attention TP{config.attn_tp_size} x DP{config.attn_dp_size}")
    ep = resolved_ep_size(config)
    if ep > 1:
        parts.append(f"EP{ep}" + (f" (+{config.ep_num_redundant_experts} redundant)"
                                  if config.ep_num_redundant_experts else ""))
    if config.moe_dense_tp_size not in (None, config.tp_size):
        parts.append(f"dense MLP TP{config.moe_dense_tp_size}")
    if config.pp_size > 1:
        parts.append(f"PP{config.pp_size}")
    return f"TP{config.tp_size}" + (f" ({', '.join(parts)})" if parts else "")
