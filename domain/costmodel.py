"""Step-time model of one engine iteration on one replica: a roofline with fitted efficiencies.

For a step with prefill chunks and decoding sequences on a TP-``t`` replica (servetune's
estimators reference, section 6):

- Linear layers: ``max(2 x P_act x N / (t x eta_c x F), W_read / (t x eta_m x B))`` -- the
  roofline of Williams, Waterman & Patterson (CACM 2009) applied per phase as in Pope et al.,
  "Efficiently Scaling Transformer Inference" (MLSys 2023). ``W_read`` counts the experts a step
  touches: ``E x (1 - (1 - k/E)^N)`` per MoE layer under uniform routing.
- Prefill attention: ``4 x L x h x d x sum c_i (p_i + c_i / 2)`` FLOPs (FlashAttention count,
  Dao et al. 2022); for DSA the attended context is capped at ``index_topk`` and the lightning
  indexer scores the whole context in fp8 (DeepSeek-V3.2 report).
- Decode attention: memory-bound reads of the KV of every sequence; MLA/DSA latents are
  replicated on every TP rank (t_kv = 1, DeepSeek-V2 paper).
- TP all-reduce: two per layer of ``N x hidden x 2`` bytes, ring cost ``2 (t-1)/t x bytes / link``
  (Patarasuk & Yuan 2009) plus a fixed latency.
- A fixed per-step overhead; decode batches above the CUDA-graph max run eagerly (slower).

Units: seconds out; tokens in.
"""

from __future__ import annotations

from dataclasses import dataclass

from domain.config import ServingConfig
from domain.fit import KV_BYTES, FitReport
from domain.hardware import GPU, get_gpu
from domain.models import ModelArch, get_model

# Efficiencies (fractions of peak). eta_m 0.75 and eta_c 0.75 are servetune's fits to
# aiconfigurator step outputs for dense models (estimators reference, section 6); MoE GEMMs and
# MLA kernels run lower (AIC puts DeepSeek-V3 steps at ~30-35 % of SOL), hence 0.45 / 0.5 here.
ETA_MEM = 0.75
ETA_COMPUTE = 0.45
ETA_ATTN = 0.5
# Per-step launch + scheduler overhead with CUDA graphs and the overlap scheduler (0.5-3 ms in
# the estimators reference); eager decode launches every kernel of every layer: ~4x more.
STEP_OVERHEAD_S = 1.5e-3
EAGER_EXTRA_S = 6.0e-3
PREFILL_OVERHEAD_S = 2.5e-3
ALLREDUCE_LATENCY_S = 6e-6  # NCCL small-message all-reduce latency on NVLink (order of us)
ACT_BYTES = 2  # bf16 activations


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """Roofline step times for one replica of a config (build with :func:`build_cost_model`)."""

    t: int
    layers: int
    hidden: int
    active_attn_flops_per_token: float  # 2 x attention params (+ embed/lm_head), FLOPs
    active_mlp_flops_per_token: float   # 2 x active MLP/expert params, FLOPs
    f_attn: float                       # FLOP/s for non-expert GEMMs
    f_mlp: float                        # FLOP/s for MLP/expert GEMMs
    f_bf16: float
    f_fp8: float
    static_bytes: float                 # non-expert weight bytes streamed every step (all GPUs)
    expert_bytes: float                 # bytes of one routed expert
    moe_layers: int
    n_experts: int
    top_k: int
    bw: float                           # HBM bytes/s
    link: float                         # NVLink bytes/s
    attn_dim: int                       # h x d per layer for QK^T + AV (prefill)
    topk: int                           # DSA attended tokens (0 = dense attention)
    index_flops_per_pair: float         # DSA indexer FLOPs per (query, key) pair per layer
    latent_bytes: float                 # KV bytes per token per layer read in decode
    index_bytes: float                  # DSA indexer key bytes per token per layer
    graph_max_bs: int

    def _linear(self, n_tokens: int) -> float:
        compute = n_tokens * (self.active_attn_flops_per_token / self.f_attn
                              + self.active_mlp_flops_per_token / self.f_mlp) / (
            self.t * ETA_COMPUTE)
        touched = self.n_experts * (1 - (1 - self.top_k / self.n_experts) ** n_tokens) \
            if self.n_experts else 0.0
        read = self.static_bytes + self.moe_layers * touched * self.expert_bytes
        memory = read / (self.t * ETA_MEM * self.bw)
        return max(compute, memory)

    def _allreduce(self, n_tokens: int) -> float:
        if self.t == 1:
            return 0.0
        volume = 2 * (self.t - 1) / self.t * n_tokens * self.hidden * ACT_BYTES
        return 2 * self.layers * (volume / self.link + ALLREDUCE_LATENCY_S)

    def prefill_time(self, new_tokens: int, attn_pairs: float, index_pairs: float) -> float:
        """Seconds for a prefill (extend) step.

        Args:
            new_tokens: sum of new tokens over the chunks in the batch.
            attn_pairs: sum over chunks of c x attended context (query-key pairs).
            index_pairs: DSA only: sum over chunks of c x full context (indexer pairs).
        """
        attn = 4 * self.layers * self.attn_dim * attn_pairs / (self.t * ETA_ATTN * self.f_bf16)
        index = self.layers * self.index_flops_per_pair * index_pairs / (
            self.t * ETA_ATTN * self.f_fp8)
        return (self._linear(new_tokens) + attn + index + self._allreduce(new_tokens)
                + PREFILL_OVERHEAD_S)

    def decode_time(self, batch: int, context_sum: int) -> float:
        """Seconds for one decode step of ``batch`` sequences holding ``context_sum`` KV tokens.

        For DSA the sparse attention reads at most ``topk`` latents per sequence; the attended
        total is approximated by ``min(context_sum, batch x topk)``.
        """
        attended = min(context_sum, batch * self.topk) if self.topk else context_sum
        kv_read = self.layers * (attended * self.latent_bytes + context_sum * self.index_bytes)
        attn = kv_read / (ETA_MEM * self.bw)
        overhead = STEP_OVERHEAD_S + (EAGER_EXTRA_S if batch > self.graph_max_bs else 0.0)
        return self._linear(batch) + attn + self._allreduce(batch) + overhead


def build_cost_model(config: ServingConfig, report: FitReport) -> StepCostModel:
    """The step-time model of one replica of ``config`` with its resolved memory ``report``."""
    model: ModelArch = get_model(config.model)
    gpu: GPU = get_gpu(config.gpu)
    ckpt = model.checkpoint(config.weights)
    groups = model.param_groups()
    b = ckpt.bytes_per_param
    expert_dtype = ckpt.compute_dtype
    attn_dtype = "fp8" if b["attention"] < 2 else "bf16"
    active_mlp = (model.active_params - groups["attention"] - groups["embed"] // 2)
    kv_b = KV_BYTES[report.kv_dtype]
    if model.attention == "gqa":
        per_rank_heads = max(1, model.kv_heads // config.tp_size)
        latent = 2 * per_rank_heads * model.head_dim * kv_b * config.tp_size  # all ranks
        index_bytes = 0.0
    else:
        latent = (model.kv_lora_rank + model.qk_rope_head_dim) * kv_b
        index_bytes = float(model.index_head_dim + 4) if model.attention == "dsa" else 0.0
    static = (groups["embed"] * b["embed"] + groups["attention"] * b["attention"]
              + groups["dense_mlp"] * b["dense_mlp"])
    if model.n_routed_experts:
        shared = model.moe_layers * model.n_shared_experts * model.expert_params * b["experts"]
        static += shared
    return StepCostModel(
        t=config.tp_size, layers=model.layers, hidden=model.hidden,
        active_attn_flops_per_token=2 * (groups["attention"] + groups["embed"] // 2),
        active_mlp_flops_per_token=2 * active_mlp,
        f_attn=gpu.flops[attn_dtype], f_mlp=gpu.flops.get(expert_dtype, gpu.flops["fp8"]),
        f_bf16=gpu.flops["bf16"], f_fp8=gpu.flops["fp8"],
        static_bytes=static, expert_bytes=model.expert_params * b["experts"],
        moe_layers=model.moe_layers, n_experts=model.n_routed_experts,
        top_k=model.experts_per_tok, bw=gpu.hbm_bytes_per_s, link=gpu.link_bytes_per_s,
        attn_dim=model.heads * model.qk_head_dim, topk=model.index_topk,
        index_flops_per_pair=2 * model.index_n_heads * model.index_head_dim,
        latent_bytes=latent, index_bytes=index_bytes, graph_max_bs=report.cuda_graph_max_bs_decode,
    )
