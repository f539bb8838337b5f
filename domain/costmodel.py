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
- Decode attention: memory-bound reads of the KV of every sequence (per GPU: its own KV heads for
  GQA, the whole latent for MLA/DSA, which is replicated on every TP rank -- DeepSeek-V2 paper);
  DSA reads at most ``index_topk`` latents per sequence but scans the indexer keys of the whole
  context.
- TP all-reduce: two per layer of ``N x hidden x 2`` bytes over the node's real topology
  (:mod:`domain.interconnect`: SGLang's custom all-reduce or NCCL, fitted latencies and bus
  efficiencies on the ring's slowest link -- NVLink, PCIe, the NUMA hop or the NIC). A model
  built without a GPU keeps the plain ring ``2 (t-1)/t x bytes / link`` plus a fixed latency
  (Patarasuk & Yuan 2009), the fit's baseline.
- MoE grouped GEMMs: every touched expert pays the compute of ``moe_gemm_half_tokens`` more
  token rows (the kernel's M tile), i.e. their compute efficiency is ``eta x m / (m + h)`` at
  ``m`` tokens per touched expert -- fitted on the wheel's measured SGLang MoE kernel table
  (``benchmarks/spec_kernels.py``). At decode batches the weight read still binds; at verify
  batches (``batch x draft tokens``) the tile term makes the MoE layer compute-bound earlier.
- Speculative verify (:meth:`StepCostModel.verify_time`): the linear layers at ``batch x draft
  tokens``; attention per query token (DSA: SGLang runs each draft token as its own decode row,
  so top-k gathers and the lightning indexer's scan are paid per draft token; MLA/GQA: KV read
  once per sequence plus the attention FLOPs of every extra query token). Draft
  (:meth:`draft_time`): ``steps - 1`` draft decode forwards at ``batch x topk`` plus one
  draft-extend forward over the verified window (SGLang ``eagle_worker_v2.py``); every prefill
  step adds the draft layers' extend over its prompt tokens (:meth:`draft_prefill_time`).
- A fixed kernel-chain latency per layer and op class (dense, MoE, MLA, DSA).
- Decode/verify steps: GPU time overlapped with the scheduler's CPU time (a fixed part plus a
  part per running request), i.e. ``max(gpu, cpu)`` -- SGLang's overlap scheduler; decode batches
  above the CUDA-graph max run eagerly: ``layers x eager_layer_s`` more (kernel launches one at
  a time). Prefill steps add a fixed overhead.

Efficiencies and latencies come from :mod:`domain.calibration` per GPU (fitted by
``benchmarks/twin_fidelity.py``). Units: seconds out; tokens in.

Parallel layouts (attention DP, expert parallelism with its all-to-all, the expert imbalance,
two-batch overlap, pipeline stages with micro-batches and their bubble) are priced by
:mod:`domain.layout_cost` for a config that sets any of them (``layout``); a config at the
default layout never reaches that module, so its numbers stay those of the plain replica.
Every method prices ONE scheduler (one attention-DP rank of one ``dp_size`` copy) at its own
batch; ``t`` is then that rank's attention TP width.

Longer than 500 lines on purpose: every term of one step (linear layers, attention, the
DSA indexer, all-reduces, verify and draft, eager launch, scheduler CPU) shares this class's
constants and its memo of batch-size-only terms, and ``benchmarks/twin_fidelity.py`` patches
``efficiency`` here to fit them; split across modules the fit's patch and the memo would have
to follow each part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from domain.calibration import Efficiency, efficiency
from domain.config import ServingConfig
from domain.fit import KV_BYTES, FitReport
from domain.hardware import GPU, get_gpu
from domain.interconnect import allreduce_seconds
from domain.layout_cost import (
    FP8_DISPATCH_BYTES,
    NVFP4_DISPATCH_BYTES,
    Layout,
    comm_seconds,
    forward_seconds,
    linear_seconds,
    micro_batch,
    pp_round,
)
from domain.models import BF16, ModelArch, get_model

ACT_BYTES = 2  # bf16 activations
# Host <-> GPU link when the GPU catalog gives none (0): PCIe Gen5 x16, 64 GB/s per direction
# (PCI-SIG PCIe 5.0 spec: 32 GT/s x 16 lanes, 128b/130b encoding ~ 63 GB/s).
PCIE5_X16_BYTES_PER_S = 64e9


def _dtype_of(bytes_per_param: float, gpu: GPU) -> str:
    """GEMM dtype of a parameter group stored at ``bytes_per_param`` (scales included)."""
    if bytes_per_param < 0.75 and "fp4" in gpu.flops:
        return "fp4"
    return "fp8" if bytes_per_param < 1.5 else "bf16"


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """Roofline step times for one replica of a config (build with :func:`build_cost_model`).

    Byte counts are over the whole replica (all ``t`` GPUs) unless named ``_gpu``; FLOPs are per
    token. Every public method returns seconds.
    """

    t: int
    layers: int
    hidden: int
    eff: Efficiency
    attn_flops_per_token: float   # 2 x (attention params + lm_head), FLOPs
    mlp_flops_per_token: float    # 2 x active MLP/expert params, FLOPs
    f_attn: float                 # FLOP/s for non-expert GEMMs
    f_mlp: float                  # FLOP/s for MLP/expert GEMMs
    f_bf16: float
    f_fp8: float
    moe: bool                     # MLP GEMMs are MoE expert GEMMs (eta_compute_moe)
    static_bytes: float           # non-expert weight bytes streamed every step
    expert_bytes: float           # bytes of one routed expert
    moe_layers: int
    n_experts: int
    top_k: int
    bw: float                     # HBM bytes/s per GPU
    link: float                   # NVLink bytes/s per GPU per direction
    attn_dim: int                 # heads x qk head dim per layer (prefill QK^T + AV)
    topk: int                     # DSA attended tokens (0 = dense attention)
    index_flops_per_pair: float   # DSA indexer FLOPs per (query, key) pair per layer
    latent_bytes_gpu: float       # KV bytes per token per layer one GPU reads in decode
    index_bytes_gpu: float        # DSA indexer key bytes per token per layer (one GPU)
    mla: bool                     # MLA/DSA latent KV (eta_kv_mla) rather than GQA (eta_kv)
    graph_max_bs: int
    mtp_layers: int = 0
    draft_static_bytes: float = 0.0   # one draft forward: non-expert layer bytes + lm_head
    draft_flops_per_token: float = 0.0
    draft_moe: bool = False           # the draft layer has routed experts
    # FLOPs of the shared lm_head per token (2 x vocab x hidden), part of draft_flops_per_token
    draft_lm_head_flops: float = 0.0
    kv_bytes_per_token_gpu: float = 0.0
    host_link: float = PCIE5_X16_BYTES_PER_S
    expert_params: float = 0.0        # parameters of one routed expert (its GEMM FLOPs / 2)
    # decode-kernel attention FLOPs per (query, key) pair per layer, all heads (0: 4 x attn_dim)
    decode_pair_flops: float = 0.0
    # the GPU whose interconnect prices the all-reduces (None: the plain ring over ``link``)
    gpu: GPU | None = field(default=None, compare=False)
    # the parallel layout (None: plain TP over ``t`` GPUs, the default layout); with one, ``t``
    # is the attention TP width and the parts below split ``static_bytes`` by how each is
    # sharded (domain/layout_cost.py)
    layout: Layout | None = None
    attn_bytes: float = 0.0           # attention weights (all layers)
    embed_bytes: float = 0.0          # embedding + lm_head
    dense_bytes: float = 0.0          # dense MLP layers
    shared_bytes: float = 0.0         # shared experts (all MoE layers)
    routed_flops_per_token: float = 0.0   # 2 x routed active expert params (part of mlp_flops)
    lm_head_bytes: float = 0.0        # the lm_head's weights (on the last PP stage)
    lm_head_params: float = 0.0       # vocab x hidden
    # memo of the batch-size-only terms (pure functions of their arguments): the twin calls
    # them once per simulated step with few distinct batch sizes
    _memo: dict[tuple[object, ...], float] = field(default_factory=dict, init=False,
                                                   repr=False, compare=False)

    @property
    def eta_mlp(self) -> float:
        """Compute efficiency of the MLP GEMMs (MoE grouped GEMMs or dense)."""
        return self.eff.eta_compute_moe if self.moe else self.eff.eta_compute

    @property
    def eta_kv(self) -> float:
        """HBM efficiency of the decode KV read (MLA/DSA or GQA kernels)."""
        return self.eff.eta_kv_mla if self.mla else self.eff.eta_kv

    # ---- building blocks ----
    def _touched(self, n_tokens: int) -> float:
        """Routed experts one MoE layer reads for ``n_tokens`` under uniform top-k routing."""
        if not self.n_experts:
            return 0.0
        return float(self.n_experts * (1 - (1 - self.top_k / self.n_experts) ** n_tokens))

    def _linear(self, n_tokens: int, ideal: bool = False) -> float:
        """Linear layers (and lm_head) over ``n_tokens``: max(compute, weight streaming)."""
        key = ("lin", n_tokens, ideal)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._linear_uncached(n_tokens, ideal)
        return hit

    def _linear_uncached(self, n_tokens: int, ideal: bool) -> float:
        e = self.eff
        eta_c, eta_mlp, eta_m = (1.0, 1.0, 1.0) if ideal else (e.eta_compute, self.eta_mlp,
                                                              e.eta_mem)
        compute = n_tokens * (self.attn_flops_per_token / (self.f_attn * eta_c)
                              + self.mlp_flops_per_token / (self.f_mlp * eta_mlp)) / self.t
        if not ideal:
            compute += self._moe_tile(n_tokens, self.moe_layers)
        read = self.static_bytes + self.moe_layers * self._touched(n_tokens) * self.expert_bytes
        return max(compute, read / (self.t * eta_m * self.bw))

    def _moe_tile(self, n_tokens: int, layers: int) -> float:
        """Seconds of the M-tile padding of ``layers`` MoE layers' grouped GEMMs at ``n_tokens``.

        Each of the ``E_t`` touched experts (:meth:`_touched`) computes ``moe_gemm_half_tokens``
        (``h``) token rows more than it was routed: the expert GEMMs then run at
        ``eta_compute_moe x m / (m + h)`` of the peak, ``m = n k / E_t`` tokens per touched
        expert (the saturating efficiency of a grouped GEMM whose M tile is mostly padding at
        decode batches). ``h`` per expert row costs ``2 x 3 x hidden x moe_intermediate``
        FLOPs, i.e. ``2 x expert params``, split over the ``t`` TP ranks. 0.0 for dense models.
        Source of ``h``: ``benchmarks/spec_kernels.py`` on the aiconfigurator 0.12.0 wheel's
        SGLang 0.5.14 ``moe_perf`` tables (see :class:`domain.calibration.Efficiency`).
        """
        h = self.eff.moe_gemm_half_tokens
        if not self.moe or not self.n_experts or h <= 0:
            return 0.0
        flops = 2.0 * self.expert_params * h * self._touched(n_tokens) * layers
        return flops / (self.t * self.f_mlp * self.eta_mlp)

    def _allreduce(self, n_tokens: int, layers: int, ideal: bool = False) -> float:
        """Two ring all-reduces per layer of ``n_tokens x hidden`` bf16 activations."""
        key = ("ar", n_tokens, layers, ideal)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._allreduce_uncached(n_tokens, layers, ideal)
        return hit

    def _allreduce_uncached(self, n_tokens: int, layers: int, ideal: bool) -> float:
        if self.t == 1:
            return 0.0
        nbytes = n_tokens * self.hidden * ACT_BYTES
        if self.gpu is not None:
            return 2 * layers * allreduce_seconds(nbytes, self.t, self.gpu, ideal=ideal)
        volume = 2 * (self.t - 1) / self.t * nbytes
        lat = 0.0 if ideal else self.eff.allreduce_latency_s
        return 2 * layers * (volume / self.link + lat)

    def allreduce_time(self, n_tokens: int, layers: int) -> float:
        """Seconds of the two all-reduces per layer of ``layers`` layers at ``n_tokens`` tokens."""
        return self._allreduce(n_tokens, layers)

    def decode_allreduce_time(self, batch: int, draft_tokens: int = 0, draft_steps: int = 0,
                              draft_topk: int = 1) -> float:
        """Seconds of one decode (or verify + draft) iteration spent in TP all-reduces.

        Plain decode: the target forward at ``batch`` tokens. Speculative: the verify forward at
        ``batch x draft_tokens`` plus ``draft_steps - 1`` draft forwards at ``batch x
        draft_topk`` and one draft extend at ``batch x draft_tokens`` over the MTP layers -- the
        all-reduce terms of :meth:`verify_time` and :meth:`draft_time`.
        """
        if self.layout is not None:
            return self._layout_comm(batch, max(1, draft_tokens))
        if draft_tokens <= 0:
            return self._allreduce(batch, self.layers)
        draft = ((max(0, draft_steps - 1) * self._allreduce(batch * max(1, draft_topk),
                                                             self.mtp_layers)
                  + self._allreduce(batch * draft_tokens, self.mtp_layers))
                 if self.mtp_layers and draft_steps > 0 else 0.0)
        return self._allreduce(batch * draft_tokens, self.layers) + draft

    def _kv_read(self, batch: int, context_sum: float, layers: int,
                 ideal: bool = False) -> float:
        """Decode attention: read every sequence's KV once (DSA: at most ``topk`` latents).

        DSA also scans the indexer keys of the whole context (scoring + top-k selection).
        """
        attended = min(context_sum, batch * self.topk) if self.topk else context_sum
        eta_kv, eta_index = (1.0, 1.0) if ideal else (self.eta_kv, self.eff.eta_dsa_index)
        latent = layers * attended * self.latent_bytes_gpu / (eta_kv * self.bw)
        index = layers * context_sum * self.index_bytes_gpu / (eta_index * self.bw)
        return latent + index

    def _layer_latency(self, layers: int, moe_layers: int) -> float:
        """Fixed kernel-chain latency of ``layers`` layers, ``moe_layers`` of them MoE."""
        e = self.eff
        per_layer = e.layer_latency_s
        if self.mla:
            per_layer += e.mla_layer_latency_s
        if self.topk:
            per_layer += e.dsa_layer_latency_s
        return layers * per_layer + moe_layers * e.moe_layer_latency_s

    def eager(self, batch: int) -> bool:
        """Whether a decode step of ``batch`` sequences runs eagerly (above the graph max).

        SGLang replays a captured decode graph only for batches up to the largest captured size
        (0.5.23 ``model_executor/runner/decode_cuda_graph_runner.py:845`` ``can_run_graph``);
        larger batches run the model eagerly.
        """
        return batch > self.graph_max_bs

    def eager_time(self, batch: int) -> float:
        """Extra seconds of a decode step of ``batch`` sequences for launching it eagerly.

        ``layers x eager_layer_s`` above ``graph_max_bs`` (every kernel of every layer launched
        one at a time from Python; :class:`~domain.calibration.Efficiency`), else 0.
        """
        return self.layers * self.eff.eager_layer_s if self.eager(batch) else 0.0

    def cpu_time(self, batch: int) -> float:
        """Scheduler CPU seconds of one decode iteration over ``batch`` running requests.

        ``step_overhead_s + batch x request_overhead_s`` (the part :meth:`_step` overlaps with
        the GPU work); the engine adds the waiting-queue scan of the pass that formed the step.
        """
        e = self.eff
        return e.step_overhead_s + batch * e.request_overhead_s

    def scan_time(self, waiting: float) -> float:
        """Scheduler CPU seconds of one admission pass that matches ``waiting`` queued requests.

        ``waiting x waiting_request_overhead_s``: SGLang 0.5.23 computes the queue's priority on
        each pass that may admit (``managers/scheduler.py:4129``), matching waiting requests
        against the radix tree (``managers/schedule_policy.py:213-302``; how many: the engine's
        ``TwinEngine._scanned``).
        """
        return waiting * self.eff.waiting_request_overhead_s

    def _step(self, gpu_s: float, batch: int) -> float:
        """Seconds of a decode-like step: GPU work overlapped with the scheduler's CPU work.

        GPU: ``gpu_s`` + layer latencies (+ :meth:`eager_time` above the graph max); CPU:
        :meth:`cpu_time` (SGLang's overlap scheduler runs them concurrently).
        """
        gpu = gpu_s + self._layer_latency(self.layers, self.moe_layers) + self.eager_time(batch)
        return max(gpu, self.cpu_time(batch))

    # ---- parallel layouts (domain/layout_cost.py) ----
    def _layout_step(self, batch: int, queries: int, context_sum: float) -> float:
        """Decode (``queries == 1``) or verify step of ``batch`` sequences under the layout.

        The running batch splits into PP micro-batches of ``b = ceil(batch / pp)`` sequences
        (:func:`~domain.layout_cost.micro_batch`; ``b = batch`` without PP) holding ``b /
        batch`` of the context; one micro-batch's forward at ``b x queries`` tokens
        (:func:`~domain.layout_cost.forward_seconds`, attention by :meth:`_verify_attention`,
        eager launches above the graph max at ``b``), then one PP round
        (:func:`~domain.layout_cost.pp_round`: the scheduler CPU of each micro-batch, the stage
        sends and latencies).
        """
        lay = self.layout
        assert lay is not None
        if batch <= 0:
            return self._step(0.0, 0)
        b = micro_batch(lay, batch)
        ctx = context_sum * b / batch
        attention = self._verify_attention(b, queries, ctx, self.layers)
        gpu = (forward_seconds(self, lay, b * queries, attention, "decode", spec=queries > 1)
               + self.eager_time(b))
        return pp_round(self, lay, gpu, self.cpu_time(b), b * queries)

    def _layout_comm(self, batch: int, queries: int) -> float:
        """Seconds of one decode/verify forward's communication under the layout (per round).

        :func:`~domain.layout_cost.comm_seconds` of one micro-batch at ``b x queries`` tokens
        over all layers; each of the ``b``-sequence micro-batches of a PP round pays its own,
        but the stages run them in parallel, so a round holds one forward's worth.
        """
        lay = self.layout
        assert lay is not None
        b = micro_batch(lay, batch)
        return comm_seconds(self, lay, b * queries, self.layers, self.moe_layers, "decode",
                            spec=queries > 1)

    # ---- step times ----
    def _prefill_attention(self, attn_pairs: float, index_pairs: float,
                           layers: int) -> tuple[float, float]:
        """Seconds of prefill attention and of the DSA indexer over ``layers`` layers.

        ``4 x layers x h x d x attn_pairs`` FLOPs at the bf16 peak and ``layers x`` indexer
        FLOPs per pair ``x index_pairs`` at the fp8 peak, both at ``eta_attn`` (module
        docstring). Returns (attention s, indexer s).
        """
        e = self.eff
        attn = 4 * layers * self.attn_dim * attn_pairs / (self.t * e.eta_attn * self.f_bf16)
        index = layers * self.index_flops_per_pair * index_pairs / (
            self.t * e.eta_attn * self.f_fp8)
        return attn, index

    def _draft_weights(self, n_tokens: int) -> float:
        """Seconds one draft forward at ``n_tokens`` tokens streams its weights.

        The draft layers' non-expert bytes and the shared lm_head (``draft_static_bytes``) plus
        the routed experts ``n_tokens`` touch in each MTP layer, at ``eta_mem`` of HBM.
        """
        touched = self._touched(n_tokens) if self.draft_moe else 0.0
        read = self.draft_static_bytes + self.mtp_layers * touched * self.expert_bytes
        return read / (self.t * self.eff.eta_mem * self.bw)

    def prefill_time(self, new_tokens: int, attn_pairs: float, index_pairs: float) -> float:
        """Seconds for a prefill (extend) step.

        Args:
            new_tokens: sum of new tokens over the chunks in the batch.
            attn_pairs: sum over chunks of c x attended context (query-key pairs).
            index_pairs: DSA only: sum over chunks of c x full context (indexer pairs).
        """
        e = self.eff
        attn, index = self._prefill_attention(attn_pairs, index_pairs, self.layers)
        if self.layout is not None:
            gpu = forward_seconds(self, self.layout, new_tokens, attn + index, "extend")
            return pp_round(self, self.layout, gpu, 0.0, new_tokens) + e.prefill_overhead_s
        return (self._linear(new_tokens) + attn + index
                + self._allreduce(new_tokens, self.layers)
                + self._layer_latency(self.layers, self.moe_layers) + e.prefill_overhead_s)

    def decode_time(self, batch: int, context_sum: int) -> float:
        """Seconds for one decode step of ``batch`` sequences holding ``context_sum`` KV tokens.

        For DSA the sparse attention reads at most ``topk`` latents per sequence; the attended
        total is approximated by ``min(context_sum, batch x topk)``. With a layout
        (:mod:`domain.layout_cost`): the step of the scheduler's WHOLE running batch, i.e. one
        PP round over its micro-batches (:meth:`_layout_step`).
        """
        if self.layout is not None:
            return self._layout_step(batch, 1, context_sum)
        return self._step(self._linear(batch) + self._kv_read(batch, context_sum, self.layers)
                          + self._allreduce(batch, self.layers), batch)

    def decode_roofline_time(self, batch: int, context_sum: int) -> float:
        """The decode step of :meth:`decode_time` at 100 % of every peak.

        Efficiencies 1, no fixed latencies, no CPU or eager overhead; the all-reduce volume at
        the peak of the ring's slowest link stays (it is physical). ``roofline / decode_time``
        is the share of the decode roofline a step reaches.
        """
        if self.layout is not None:  # one PP micro-batch through all layers (_layout_step)
            b = micro_batch(self.layout, batch)
            ctx = context_sum * b / batch if batch else 0.0
            return (linear_seconds(self, self.layout, b, ideal=True)
                    + self._kv_read(b, ctx, self.layers, ideal=True)
                    + comm_seconds(self, self.layout, b, self.layers, self.moe_layers,
                                   "decode", ideal=True))
        return (self._linear(batch, ideal=True)
                + self._kv_read(batch, context_sum, self.layers, ideal=True)
                + self._allreduce(batch, self.layers, ideal=True))

    def _verify_attention(self, batch: int, queries: int, context_sum: float,
                          layers: int) -> float:
        """Attention of a forward with ``queries`` query tokens per sequence over its whole KV.

        ``queries == 1`` is exactly :meth:`_kv_read` (decode). Beyond one query token:

        - DSA: SGLang expands every draft token into its own decode row
          (``layers/attention/nsa_backend.py: NativeSparseAttnBackend.init_forward_metadata``,
          target_verify / draft_extend: ``max_seqlen_q = 1``, the page table
          ``repeat_interleave``'d per draft token, DeepGEMM's paged MQA-logits schedule over
          the expanded seqlens), so each row gathers its own top-k latents (the latent term is
          ``queries x`` the decode one) and the lightning indexer scores and selects over the
          full context per row: ``(1 - r + r x queries)`` times the decode index term,
          ``r = spec_index_query_share`` (1.0 for that expansion). The aiconfigurator 0.12.0
          wheel's kernel tables agree on the latents (``glm5_dsa_attn_module_perf``, B200,
          batch 256, 1,024 cached tokens: 0.133 ms at 1 query token per sequence, 0.448 ms at
          4, 0.946 ms at 8); their batched ragged indexer reads keys once (r 0.22,
          ``benchmarks/spec_kernels.py``).
        - MLA/GQA: the KV of a sequence is read once for all its query tokens (one kernel over
          ``queries`` rows: FlashMLA / FlashInfer with ``seq_len_q > 1``); each extra query
          token adds its attention FLOPs, ``decode_pair_flops`` per (query, key) pair per layer
          at ``eta_attn`` of the bf16 peak: for MLA the absorbed form, ``2 x heads x (2 x
          kv_lora_rank + qk_rope_head_dim)`` (scores over the 576-wide latent, values over the
          512-wide one; DeepSeek-V2 paper, sec. 2.1.3, weight absorption), for GQA
          ``4 x heads x head_dim`` (FlashAttention's count, as in :meth:`prefill_time`).
        """
        base = self._kv_read(batch, context_sum, layers)
        extra = max(0, queries - 1)
        if not extra:
            return base
        if self.topk:
            attended = min(context_sum, batch * self.topk)
            latent = layers * attended * self.latent_bytes_gpu / (self.eta_kv * self.bw)
            index = base - latent
            r = self.eff.spec_index_query_share
            return queries * latent + index * (1 - r + r * queries)
        pair = self.decode_pair_flops or 4.0 * self.attn_dim
        flops = layers * pair * extra * context_sum
        return base + flops / (self.t * self.eff.eta_attn * self.f_bf16)

    def verify_time(self, batch: int, draft_tokens: int, context_sum: int) -> float:
        """Seconds for a speculative verify step: one target forward over ``batch x draft_tokens``.

        Linear layers (MoE tile term included, :meth:`_moe_tile`) and all-reduces run at
        ``N = batch x draft_tokens`` tokens; attention is priced per query token
        (:meth:`_verify_attention`: for DSA ``draft_tokens`` sparse gathers and indexer
        passes per sequence, for MLA/GQA one KV read plus the extra queries' FLOPs), so at
        large batch the verify step turns compute-bound rather than staying at the cost of one
        decode step. The CUDA-graph limit applies to ``batch`` (SGLang captures verify graphs
        per batch size). ``draft_tokens == 1`` is exactly :meth:`decode_time`.
        """
        d = max(1, draft_tokens)
        if self.layout is not None:
            return self._layout_step(batch, d, context_sum)
        n = batch * d
        return self._step(self._linear(n)
                          + self._verify_attention(batch, d, context_sum, self.layers)
                          + self._allreduce(n, self.layers), batch)

    def _draft_forward(self, batch: int, tokens_per_seq: int, context_sum: int) -> float:
        """One forward of the MTP/NextN draft layers at ``batch x tokens_per_seq`` tokens.

        It streams the draft layers' non-expert weights and the shared lm_head, the routed
        experts its tokens touch (plus the MoE tile term, :meth:`_moe_tile`), computes at
        ``draft_flops_per_token`` per token, runs the draft layers' attention over their own KV
        per query token (:meth:`_verify_attention`) and pays their all-reduces and per-layer
        latency.
        """
        n = batch * max(1, tokens_per_seq)
        memory = self._draft_weights(n)
        compute = n * self.draft_flops_per_token / (self.t * self.f_mlp * self.eta_mlp)
        if self.draft_moe:
            compute += self._moe_tile(n, self.mtp_layers)
        moe = self.mtp_layers if self.draft_moe else 0
        return (max(memory, compute)
                + self._verify_attention(batch, max(1, tokens_per_seq), context_sum,
                                         self.mtp_layers)
                + self._allreduce(n, self.mtp_layers) + self._layer_latency(self.mtp_layers, moe))

    def draft_time(self, batch: int, steps: int, topk: int, context_sum: int = 0,
                   draft_tokens: int | None = None) -> float:
        """Seconds of the draft work of one speculative iteration (MTP/NextN draft head).

        SGLang 0.5.23 ``speculative/eagle_worker_v2.py``: ``EagleDraftWorker.draft_forward``
        loops over ``num_steps`` but skips the last forward (``if i == num_steps - 1: break``:
        the first draft token comes from the previous draft extend), so it runs ``steps - 1``
        draft decode forwards at ``batch x topk`` tokens; ``_draft_extend_for_decode`` then
        runs one draft forward over the verified window, ``draft_tokens`` per request ("fills
        the whole tree width"), to write the draft layer's KV and produce the next first draft
        token. The scheduler's CPU work is charged once, in :meth:`verify_time` (where it
        overlaps the GPU work). 0.0 for a model without MTP layers or ``steps`` 0.

        Args:
            batch: sequences in the batch.
            steps: ``speculative_num_steps`` of this iteration.
            topk: branches per step (``--speculative-eagle-topk``).
            context_sum: KV tokens of the batch (the draft layer's KV read; default 0).
            draft_tokens: tokens verified per request (None: ``steps + 1``, a chain).
        """
        if steps <= 0 or not self.mtp_layers:
            return 0.0
        window = steps + 1 if draft_tokens is None else max(1, draft_tokens)
        return ((steps - 1) * self._draft_forward(batch, max(1, topk), context_sum)
                + self._draft_forward(batch, window, context_sum))

    def draft_prefill_time(self, new_tokens: int, attn_pairs: float, index_pairs: float,
                           requests: int) -> float:
        """Seconds of the draft extend that follows a prefill step with speculative decoding on.

        SGLang 0.5.23 ``speculative/eagle_worker_v2.py``:
        ``EAGLEWorkerV2._forward_prefill_batch`` runs the target prefill with
        ``CaptureHiddenMode.FULL`` and then ``EagleDraftWorker._draft_extend_for_prefill``
        (same file, line 961) over the same batch: the MTP/NextN draft layers run over every
        new prompt token (each shifted by one, the target's next token appended) to fill the
        draft KV and produce the first draft token. Priced as :meth:`prefill_time` restricted
        to the ``mtp_layers`` draft layers: their weights (non-expert bytes + the experts
        ``new_tokens`` touch) against their compute at ``draft_flops_per_token`` per token (MoE
        tile term included); the shared lm_head only for the last token of each of the
        ``requests`` extends (the logits processor keeps the last position of an extend:
        ``return_logprob = False`` with ``CaptureHiddenMode.LAST``,
        ``eagle_worker_v2.py:1019-1031``); the prompt attention (and DSA indexer) pairs over
        the draft layers; their all-reduces and per-layer latency. No ``prefill_overhead_s``:
        it is part of the same scheduler step. 0.0 for a model without MTP layers.

        Args:
            new_tokens: sum of new tokens over the chunks in the batch.
            attn_pairs: sum over chunks of c x attended context (as :meth:`prefill_time`).
            index_pairs: DSA only: sum over chunks of c x full context.
            requests: chunks in the batch (one lm_head row each).
        """
        if not self.mtp_layers or new_tokens <= 0:
            return 0.0
        e = self.eff
        n = new_tokens
        memory = self._draft_weights(n)
        layer_flops = self.draft_flops_per_token - self.draft_lm_head_flops
        compute = (n * layer_flops / (self.t * self.f_mlp * self.eta_mlp)
                   + requests * self.draft_lm_head_flops / (self.t * self.f_attn * e.eta_compute))
        if self.draft_moe:
            compute += self._moe_tile(n, self.mtp_layers)
        attn, index = self._prefill_attention(attn_pairs, index_pairs, self.mtp_layers)
        moe = self.mtp_layers if self.draft_moe else 0
        return (max(memory, compute) + attn + index + self._allreduce(n, self.mtp_layers)
                + self._layer_latency(self.mtp_layers, moe))

    # ---- the TTFT path outside the GPU steps (domain/calibration.py) ----
    @property
    def request_fixed_s(self) -> float:
        """Seconds of a request's fixed serving-path latency (HTTP, ZMQ hops, detokenize).

        ``Efficiency.request_fixed_s``; the engine adds it to every token's time of a request
        (TTFT and E2E grow by it, inter-token gaps do not).
        """
        return self.eff.request_fixed_s

    def tokenize_time(self, tokens: float) -> float:
        """Seconds the ONE tokenizer-manager process spends tokenizing a ``tokens``-token prompt.

        ``tokens / Efficiency.tokenizer_tokens_per_s`` (SGLang 0.5.23
        ``managers/tokenizer_manager.py``: ``TokenizerManager`` is one process; requests queue
        behind each other there, which the engine models).
        """
        return tokens / self.eff.tokenizer_tokens_per_s

    def host_load_time(self, tokens: int) -> float:
        """Seconds to load ``tokens`` KV tokens back from the HiCache host tier to each GPU.

        ``tokens x`` KV bytes per token per GPU over the host link of one GPU (every GPU of the
        replica loads its own share in parallel).
        """
        return tokens * self.kv_bytes_per_token_gpu / self.host_link


def build_cost_model(config: ServingConfig, report: FitReport) -> StepCostModel:
    """The step-time model of one scheduler of ``config`` with its resolved memory ``report``.

    One scheduler: the whole replica at the default layout; one attention-DP rank of one
    ``dp_size`` copy otherwise (its methods take that rank's batch; PP, EP, TBO inside).
    Efficiencies come from :func:`domain.calibration.efficiency` for the config's GPU.

    Raises:
        ConfigInvalid: unknown model, GPU or checkpoint.
    """
    model: ModelArch = get_model(config.model)
    gpu: GPU = get_gpu(config.gpu)
    eff = efficiency(gpu.name)
    ckpt = model.checkpoint(config.weights)
    groups = model.param_groups()
    b = ckpt.bytes_per_param
    lm_head = model.vocab * model.hidden
    active_mlp = model.active_params - groups["attention"] - lm_head
    kv_b = KV_BYTES[report.kv_dtype]
    layout = _layout(config, model, gpu, eff, b["experts"])
    # one scheduler's attention TP group (the whole TP group at the default layout)
    t = config.attn_tp_size if layout is not None else config.tp_size
    if model.attention == "gqa":
        # hybrid models: only full (and, at the SWA pool's ratio, sliding) layers hold KV; the
        # share is exactly 1.0 for every-layer-full models (domain/model_arch.py:kv_bytes_per_token)
        kv_share = model.kv_bytes_per_token(kv_b, t) / (
            model.layers * 2 * max(1, model.kv_heads // t) * model.head_dim * kv_b)
        latent = 2 * max(1, model.kv_heads // t) * model.head_dim * kv_b * kv_share
        index_bytes = 0.0
    else:  # MLA/DSA latents are replicated on every TP rank
        latent = (model.kv_lora_rank + model.qk_rope_head_dim) * kv_b
        index_bytes = float(model.index_head_dim + 4) if model.attention == "dsa" else 0.0
    static = (groups["embed"] * b["embed"] + groups["attention"] * b["attention"]
              + groups["dense_mlp"] * b["dense_mlp"])
    shared = 0.0
    if model.n_routed_experts:
        shared = model.moe_layers * model.n_shared_experts * model.expert_params * b["experts"]
        static += shared
    f_mlp = gpu.flops.get(ckpt.compute_dtype, gpu.flops["fp8"])
    # draft head: one MTP layer's attention + dense/shared MLP, plus the shared lm_head
    draft_static = draft_flops = 0.0
    if model.mtp_layers:
        mb = ckpt.mtp_bytes_per_param or b
        mp = model.mtp_params_per_layer
        if model.n_routed_experts:
            dense_part = model.n_shared_experts * model.expert_params
            active = (model.experts_per_tok + model.n_shared_experts) * model.expert_params
            mlp_b = mb["experts"]
        else:
            dense_part = active = mp["mlp"]
            mlp_b = mb["dense_mlp"]
        per_layer = mp["attention"] * mb["attention"] + dense_part * mlp_b + mp["glue"] * BF16
        draft_static = model.mtp_layers * per_layer + lm_head * b["embed"]
        draft_flops = 2.0 * (model.mtp_layers * (mp["attention"] + active + mp["glue"])
                             + lm_head)
    host_link = gpu.host_link_bytes_per_s or PCIE5_X16_BYTES_PER_S
    return StepCostModel(
        t=t, layers=model.layers, hidden=model.hidden, eff=eff,
        attn_flops_per_token=2.0 * (groups["attention"] + lm_head),
        mlp_flops_per_token=2.0 * active_mlp,
        f_attn=gpu.flops[_dtype_of(b["attention"], gpu)], f_mlp=f_mlp,
        f_bf16=gpu.flops["bf16"], f_fp8=gpu.flops["fp8"],
        moe=bool(model.n_routed_experts),
        static_bytes=static, expert_bytes=model.expert_params * b["experts"],
        moe_layers=model.moe_layers, n_experts=model.n_routed_experts,
        top_k=model.experts_per_tok, bw=gpu.hbm_bytes_per_s, link=gpu.link_bytes_per_s,
        attn_dim=model.heads * model.qk_head_dim, topk=model.index_topk,
        index_flops_per_pair=2.0 * model.index_n_heads * model.index_head_dim,
        latent_bytes_gpu=latent, index_bytes_gpu=index_bytes,
        mla=model.attention in ("mla", "dsa"),
        graph_max_bs=report.cuda_graph_max_bs_decode,
        mtp_layers=model.mtp_layers, draft_static_bytes=draft_static,
        draft_flops_per_token=draft_flops, draft_moe=bool(model.n_routed_experts),
        draft_lm_head_flops=2.0 * lm_head if model.mtp_layers else 0.0,
        kv_bytes_per_token_gpu=report.kv_bytes_per_token, host_link=host_link, gpu=gpu,
        expert_params=float(model.expert_params if model.n_routed_experts else 0),
        decode_pair_flops=(2.0 * model.heads * (2 * model.kv_lora_rank + model.qk_rope_head_dim)
                           if model.attention in ("mla", "dsa") else 0.0),
        layout=layout, attn_bytes=groups["attention"] * b["attention"],
        embed_bytes=groups["embed"] * b["embed"], dense_bytes=groups["dense_mlp"] * b["dense_mlp"],
        shared_bytes=shared,
        routed_flops_per_token=2.0 * model.moe_layers * model.experts_per_tok * model.expert_params,
        lm_head_bytes=float(lm_head * b["embed"]), lm_head_params=float(lm_head),
    )


def _layout(config: ServingConfig, model: ModelArch, gpu: GPU, eff: Efficiency,
            expert_bytes_per_param: float) -> Layout | None:
    """The :class:`~domain.layout_cost.Layout` of ``config``; None at the default layout.

    Default: no attention DP, no EP, no PP, no two-batch overlap, dense MLP over the TP group,
    no DP lm_head (``dp_size`` copies are plain replicas, priced one scheduler at a time). The
    EP all-to-all runs when ``ep_size > 1`` with a ``moe_a2a_backend`` other than none; the
    imbalance is ``expert_imbalance_eplb`` with ``enable_eplb`` or redundant experts, else
    ``expert_imbalance``; the dispatch wire format nvfp4 for NVFP4 experts, else fp8
    (:mod:`domain.layout_cost` constants).
    """
    tp = config.tp_size
    dense_tp = config.moe_dense_tp_size or tp
    if (config.attn_dp_size == 1 and config.ep_size == 1 and config.pp_size == 1
            and not config.enable_two_batch_overlap and dense_tp == tp
            and not config.enable_dp_lm_head):
        return None
    ep = config.ep_size
    eplb = config.enable_eplb or config.ep_num_redundant_experts > 0
    experts = model.n_routed_experts + config.ep_num_redundant_experts
    return Layout(
        tp=tp, attn_dp=config.attn_dp_size, ep=ep, dense_tp=dense_tp, pp=config.pp_size,
        a2a=ep > 1 and (config.moe_a2a_backend or "none") != "none",
        deepep_mode=config.deepep_mode or "auto", tbo=config.enable_two_batch_overlap,
        dp_lm_head=config.enable_dp_lm_head,
        imbalance=(eff.expert_imbalance_eplb if eplb else eff.expert_imbalance) if ep > 1
        else 1.0,
        local_experts=experts / ep if ep > 1 else float(experts),
        dispatch_bytes=(NVFP4_DISPATCH_BYTES if expert_bytes_per_param < 0.75
                        else FP8_DISPATCH_BYTES),
        gpu=gpu)
