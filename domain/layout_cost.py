"""Step-time terms of parallel layouts: attention DP, expert parallelism, TBO and pipeline stages.

:class:`domain.costmodel.StepCostModel` prices one scheduler's step; for a config that leaves
every layout field at its default it never calls this module (its numbers are those of the
plain tensor-parallel replica). With a :class:`Layout` it prices, per scheduler (one attention
DP rank of one ``dp_size`` copy; every attention-DP rank is assumed to run the same batch, so
the MoE sees the gathered ``n x attn_dp_size`` tokens):

- **Linear layers** (:func:`linear_seconds`): one roofline ``max(compute, weight read)`` per
  GPU as in the plain model. Attention projections (and the lm_head) over the ``attn_tp_size``
  GPUs of the rank on its ``n`` tokens; the attention weights are replicated on every DP rank.
  Dense MLP layers over ``moe_dense_tp_size`` GPUs; shared experts over the TP group, or
  replicated on every GPU with an EP all-to-all backend (SGLang 0.5.23
  ``models/deepseek_v2.py:870-896``: ``_shared_expert_use_tp1`` for deepep/mooncake/...,
  ``parallel_group="replicated"``). Routed experts on the gathered ``G = n x attn_dp`` tokens,
  sharded over ``ep_size x moe_tp_size`` GPUs; the busiest EP rank gets ``imbalance`` times the
  mean routed tokens (its expert GEMMs, tile padding and touched-expert reads scale by it; its
  reads stay at most its local experts). Compute per GPU is then ``n / attn_tp x`` the per-token
  FLOPs for every part but the routed experts (``G / tp = n / attn_tp``).
- **Communication** (:func:`comm_seconds`): without attention DP and without an all-to-all
  backend the plain model's two TP all-reduces per layer over ``tp_size`` GPUs (``ep_size > 1``
  without a backend runs the same all-gather/all-reduce MoE). With attention DP: an all-reduce
  in the attention TP group (when ``attn_tp > 1``) plus the DP gather of the hidden states
  before the MLP and the combine after it over the whole TP group (``layers/dp_attention.py``
  ``DpPaddingMode``, lines 152-220): SUM_LEN -- one all-reduce of the summed ``G``-token buffer
  each way -- for extend batches and for decode batches whose buffer fits the custom all-reduce
  v2 (lines 222-243); MAX_LEN -- all-gather + reduce-scatter, each priced as an NCCL all-reduce
  of half the bytes (a ring all-gather moves ``(k-1)/k x bytes``, an all-reduce twice that) --
  otherwise. Dense layers with ``moe_dense_tp_size == 1`` skip the gather. With an EP
  all-to-all backend each MoE layer reduce-scatters / all-gathers in the attention TP group and
  runs a dispatch + combine (:func:`a2a_seconds`).
- **Two-batch overlap** (``enable_two_batch_overlap``, ``batch_overlap/two_batch_overlap.py``:
  decode split at ``batch // 2``, line 96-98): two micro-batches whose compute and
  communication alternate, so a step takes ``max(C, M)`` with ``C`` the compute of both halves
  (weights streamed twice and every kernel chain paid twice: the split's cost) and ``M`` their
  communication, instead of ``C + M`` of the whole batch. Batches of one sequence do not split.
- **Pipeline parallelism** (:func:`pp_round`): SGLang's PP event loop keeps ``pp_size``
  micro-batches in flight (``managers/scheduler_pp_mixin.py:104-214``, ``pp_loop_size =
  pp_size + pp_async_batch_depth``, depth 0 by default, line 561-564), each at most
  ``pp_max_micro_batch_size = max_running_requests // pp_size`` (``managers/scheduler.py:
  1237-1243``). A running batch of ``n`` splits into micro-batches of ``b = ceil(n / pp)``
  sequences; in one round every micro-batch advances one token through all stages, and a
  stage is busy ``pp x`` its slot. Round time ``pp x max(S(b), cpu(b)) + (pp - 1) x p2p(b) +
  pp x pp_stage_latency_s``: ``S(b)`` the slowest stage's share of one micro-batch's forward
  (``ceil(layers / pp)`` layers plus the lm_head of the last stage, :func:`pp_round`), the
  scheduler's CPU work per micro-batch on each slot, the send of the hidden states and the
  residual (two ``b x hidden`` bf16 tensors: ``layers/layer_boundary/residual/batch.py:269``
  ``to_pp``, read back at ``access.py:57-71``) over the link between consecutive stages
  (:func:`domain.interconnect.p2p_link_bytes_per_s`), a fixed latency per boundary. Fewer
  sequences than stages leave slots empty: the bubble (``n < pp``: a round still costs ``pp``
  slots for ``n`` tokens).

All functions take the cost model's constants and return seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from domain.interconnect import (
    a2a_link_shares,
    allreduce_seconds,
    backend_for,
    p2p_link_bytes_per_s,
)

if TYPE_CHECKING:
    from domain.costmodel import StepCostModel
    from domain.hardware import GPU

ACT_BYTES = 2            # bf16 hidden states
COMBINE_BYTES = 2.0      # DeepEP combine runs in bf16 (layers/moe/token_dispatcher/deepep.py)
# FP8 dispatch with one fp32 scale per 128 values (deepep.py:565-573
# sglang_per_token_group_quant_fp8(hidden_states, 128)), the default wire format
# (layers/moe/utils.py:344-357 get_deepep_output_dtype: "Otherwise -> FP8")
FP8_DISPATCH_BYTES = 1.0 + 4.0 / 128
# NVFP4 experts dispatch nvfp4 (utils.py:374-377): 4-bit values + one e4m3 scale per 16
NVFP4_DISPATCH_BYTES = 0.5 + 1.0 / 16
PP_PROXY_TENSORS = 2     # hidden_states and residual sent between stages

Mode = Literal["extend", "decode"]


@dataclass(frozen=True, slots=True)
class Layout:
    """The parallel layout of one server as the step model needs it (per scheduler).

    ``tp`` GPUs per stage; ``attn_dp`` attention DP ranks of ``attn_tp = tp / attn_dp`` GPUs
    each; ``ep`` expert-parallel ranks of ``moe_tp = tp / ep`` GPUs each; ``dense_tp`` GPUs of
    a dense MLP layer; ``pp`` stages. ``a2a``: an EP all-to-all backend (deepep, mooncake, ...)
    dispatches tokens; ``deepep_mode`` ``auto``/``normal``/``low_latency``. ``imbalance``:
    routed tokens of the busiest EP rank over the mean (1.0 for ``ep == 1``);
    ``local_experts``: routed expert copies per EP rank (redundant ones included).
    ``dispatch_bytes``: bytes per hidden element of a dispatch.
    """

    tp: int
    attn_dp: int
    ep: int
    dense_tp: int
    pp: int
    a2a: bool
    deepep_mode: str
    tbo: bool
    dp_lm_head: bool
    imbalance: float
    local_experts: float
    dispatch_bytes: float
    gpu: GPU | None = None

    @property
    def attn_tp(self) -> int:
        """GPUs of one attention DP rank."""
        return max(1, self.tp // self.attn_dp)

    @property
    def moe_tp(self) -> int:
        """TP width of each expert."""
        return max(1, self.tp // self.ep)

    def a2a_mode(self, mode: Mode) -> str:
        """DeepEP kernels of a step: ``auto`` is normal for extend, low-latency for decode.

        SGLang 0.5.23 ``layers/moe/utils.py:278-285`` ``DeepEPMode.resolve``.
        """
        if self.deepep_mode in ("normal", "low_latency"):
            return self.deepep_mode
        return "normal" if mode == "extend" else "low_latency"


def _memo(m: StepCostModel, key: tuple[object, ...], fn: Callable[[], float]) -> float:
    """``fn()`` cached in the cost model's memo of batch-size-only terms (pure in ``key``)."""
    hit = m._memo.get(key)
    if hit is None:
        hit = m._memo[key] = fn()
    return hit


def _group_allreduce(m: StepCostModel, nbytes: float, n: int, ideal: bool) -> float:
    """One all-reduce of ``nbytes`` over ``n`` GPUs (the plain ring without a GPU)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if m.gpu is not None:
        return allreduce_seconds(nbytes, n, m.gpu, ideal=ideal)
    lat = 0.0 if ideal else m.eff.allreduce_latency_s
    return 2 * (n - 1) / n * nbytes / m.link + lat


def _gather_half(m: StepCostModel, nbytes: float, n: int, ideal: bool) -> float:
    """One all-gather or reduce-scatter of ``nbytes`` (the whole buffer) over ``n`` GPUs.

    A ring all-gather moves ``(n-1)/n x nbytes`` per GPU, half an all-reduce's bus traffic:
    priced as an NCCL all-reduce of ``nbytes / 2`` (same protocol latencies).
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    if m.gpu is not None:
        return allreduce_seconds(nbytes / 2, n, m.gpu, custom_allowed=False, ideal=ideal)
    lat = 0.0 if ideal else m.eff.allreduce_latency_s
    return (n - 1) / n * nbytes / m.link + lat


def dp_gather_seconds(m: StepCostModel, lay: Layout, g_tokens: int, mode: Mode,
                      spec: bool, ideal: bool = False) -> float:
    """Gather before and combine after one layer's MLP of ``g_tokens`` DP tokens over ``tp``.

    SUM_LEN (two all-reduces of the ``g_tokens x hidden`` bf16 buffer) for extend, and for
    decode when the custom all-reduce v2 holds the buffer (NVLink node, no all-to-all backend,
    no speculative decoding: ``dp_attention.py:194-243``); MAX_LEN (all-gather +
    reduce-scatter, :func:`_gather_half`) otherwise -- equal rank batches make
    ``sum * 2 >= max * width``, the MAX_LEN branch of line 200-203.
    """
    nbytes = g_tokens * m.hidden * ACT_BYTES
    gpu = m.gpu
    sum_len = mode == "extend" or (
        not spec and not lay.a2a and gpu is not None and gpu.interconnect.kind == "nvlink"
        and backend_for(nbytes, lay.tp, gpu.interconnect) == "custom")
    if sum_len:
        return 2 * _group_allreduce(m, nbytes, lay.tp, ideal)
    return 2 * _gather_half(m, nbytes, lay.tp, ideal)


def remote_copies(lay: Layout, mode: str, n_experts: int, top_k: int) -> float:
    """Copies of one token's hidden state a dispatch sends to other EP ranks.

    Low-latency kernels send one copy per routed expert (DeepEP's per-expert receive slots):
    ``top_k x (ep-1)/ep`` off-rank under uniform placement. Normal kernels send one copy per
    destination rank (DeepEP ``get_dispatch_layout``: ``is_token_in_rank``): the expected
    number of other ranks among ``top_k`` distinct experts of ``n_experts`` spread evenly,
    ``(ep-1) x (1 - C(E - E/ep, k) / C(E, k))``.
    """
    e = lay.ep
    if e <= 1:
        return 0.0
    if mode == "low_latency" or n_experts < e or top_k <= 0:
        return top_k * (e - 1) / e
    per_rank = n_experts // e
    miss = math.comb(n_experts - per_rank, top_k) / math.comb(n_experts, top_k)
    return (e - 1) * (1.0 - miss)


def a2a_seconds(m: StepCostModel, lay: Layout, tokens_gpu: float, mode: Mode,
                ideal: bool = False) -> float:
    """Dispatch + combine of one MoE layer for ``tokens_gpu`` tokens on each GPU.

    Bytes per GPU ``tokens x copies x hidden x (dispatch + combine bytes)`` (copies:
    :func:`remote_copies`; dispatch fp8 with scales, or nvfp4; combine bf16), split between the
    GPUs of the node (NVLink, or the PCIe/NUMA ring link) and the other nodes (the NIC) in
    proportion to the EP ranks there (:func:`domain.interconnect.a2a_link_shares`); time
    ``latency + max(intra / (a2a_eta x link), inter / (a2a_eta x nic))``, latency
    ``a2a_latency_s`` (normal) or ``a2a_ll_latency_s`` (low-latency). ``ideal``: the link peaks,
    no latency. Without a GPU every peer is on the model's ``link``. 0.0 for ``ep == 1`` or no
    tokens.
    """
    if lay.ep <= 1 or tokens_gpu <= 0:
        return 0.0
    kernel = lay.a2a_mode(mode)
    copies = remote_copies(lay, kernel, m.n_experts, m.top_k)
    nbytes = tokens_gpu * copies * m.hidden * (lay.dispatch_bytes + COMBINE_BYTES)
    (intra, intra_link), (inter, inter_link) = (
        a2a_link_shares(lay.ep, m.gpu.interconnect) if m.gpu is not None
        else ((1.0, m.link), (0.0, m.link)))
    eta = 1.0 if ideal else m.eff.a2a_eta
    wire = max(nbytes * intra / (eta * intra_link), nbytes * inter / (eta * inter_link))
    if ideal:
        return wire
    lat = m.eff.a2a_latency_s if kernel == "normal" else m.eff.a2a_ll_latency_s
    return lat + wire


def comm_seconds(m: StepCostModel, lay: Layout, n: int, layers: int, moe_layers: int,
                 mode: Mode, spec: bool = False, ideal: bool = False) -> float:
    """Communication of one forward of ``layers`` layers (``moe_layers`` MoE) at ``n`` tokens.

    ``n``: tokens of this attention DP rank (the gathered MoE batch is ``n x attn_dp``). The
    rules are the module docstring's; 0.0 on one GPU.
    """
    nbytes = n * m.hidden * ACT_BYTES
    at = lay.attn_tp
    if lay.attn_dp == 1 and not lay.a2a:
        return 2 * layers * _group_allreduce(m, nbytes, lay.tp, ideal)
    dense_layers = layers - moe_layers
    if lay.attn_dp == 1:
        dense = 2 * _group_allreduce(m, nbytes, lay.tp, ideal)
    else:
        gather = (dp_gather_seconds(m, lay, n * lay.attn_dp, mode, spec, ideal)
                  if lay.dense_tp > 1 else 0.0)
        dense = _group_allreduce(m, nbytes, at, ideal) + gather
    if lay.a2a:
        moe = (2 * _gather_half(m, nbytes, at, ideal)
               + a2a_seconds(m, lay, n / at, mode, ideal))
    elif lay.attn_dp == 1:
        moe = dense
    else:
        moe = (_group_allreduce(m, nbytes, at, ideal)
               + dp_gather_seconds(m, lay, n * lay.attn_dp, mode, spec, ideal))
    return dense_layers * dense + moe_layers * moe


def _busy_touched(m: StepCostModel, lay: Layout, g_tokens: int) -> float:
    """Routed experts the busiest EP rank's GPUs read per MoE layer, in whole-expert units / tp.

    ``touched(G) / ep x imbalance`` experts on the busiest rank, at most its local experts,
    each split over ``moe_tp`` GPUs; returned as the equivalent count over ``tp`` GPUs (so the
    plain model's ``touched / tp`` is ``ep == 1``).
    """
    touched = m._touched(g_tokens)
    if lay.ep <= 1:
        return touched
    busy = min(touched / lay.ep * lay.imbalance, lay.local_experts)
    return busy * lay.ep


def linear_seconds(m: StepCostModel, lay: Layout, n: int, ideal: bool = False) -> float:
    """Linear layers of one rank's forward at ``n`` tokens: max(compute, weight read) per GPU.

    Module docstring (Linear layers). The plain model's ``_linear`` is this at ``attn_dp ==
    ep == 1`` (the same sums over ``tp`` GPUs).
    """
    e = m.eff
    eta_c, eta_mlp, eta_m = (1.0, 1.0, 1.0) if ideal else (e.eta_compute, m.eta_mlp, e.eta_mem)
    at, tp = lay.attn_tp, lay.tp
    g = n * lay.attn_dp
    imb = lay.imbalance if lay.ep > 1 else 1.0
    rest = m.mlp_flops_per_token - m.routed_flops_per_token
    compute = n / at * (m.attn_flops_per_token / (m.f_attn * eta_c)
                        + (rest + imb * m.routed_flops_per_token) / (m.f_mlp * eta_mlp))
    busy = _busy_touched(m, lay, g)
    h = e.moe_gemm_half_tokens
    if not ideal and m.moe and m.n_experts and h > 0:
        compute += (2.0 * m.expert_params * h * busy * m.moe_layers) / (tp * m.f_mlp * eta_mlp)
    embed_gpus = at if lay.dp_lm_head else tp
    read = (m.attn_bytes / at + m.embed_bytes / embed_gpus + m.dense_bytes / lay.dense_tp
            + (m.shared_bytes if lay.a2a else m.shared_bytes / tp)
            + m.moe_layers * busy * m.expert_bytes / tp)
    return max(compute, read / (eta_m * m.bw))


def p2p_seconds(m: StepCostModel, lay: Layout, n: int) -> float:
    """Seconds of the stage-to-stage sends of one micro-batch of ``n`` tokens through the pipe.

    ``pp - 1`` boundaries, each ``PP_PROXY_TENSORS x n x hidden x 2`` bytes over the link
    between the two stages' GPUs (:func:`domain.interconnect.p2p_link_bytes_per_s`; every TP
    rank sends its own copy to its peer in parallel); without a GPU, the model's ``link``.
    """
    if lay.pp <= 1 or n <= 0:
        return 0.0
    nbytes = PP_PROXY_TENSORS * n * m.hidden * ACT_BYTES
    total = 0.0
    for s in range(lay.pp - 1):
        link = (p2p_link_bytes_per_s(s * lay.tp, (s + 1) * lay.tp, lay.tp, m.gpu.interconnect)
                if m.gpu is not None else m.link)
        total += nbytes / link
    return total


def micro_batch(lay: Layout, n: int) -> int:
    """Sequences of the largest PP micro-batch of a running batch of ``n``: ``ceil(n / pp)``."""
    return max(1, -(-n // lay.pp)) if n > 0 else 0


def lm_head_seconds(m: StepCostModel, lay: Layout, n: int) -> float:
    """The lm_head of one forward at ``n`` tokens: max(compute, weight read) per GPU.

    ``2 x lm_head params`` FLOPs per token over the rank's ``attn_tp`` GPUs; its weights over
    the ``attn_tp`` GPUs with ``enable_dp_lm_head``, else over the TP group.
    """
    if m.lm_head_bytes <= 0 or n <= 0:
        return 0.0
    e = m.eff
    compute = n * 2.0 * m.lm_head_params / (lay.attn_tp * m.f_attn * e.eta_compute)
    read = m.lm_head_bytes / (lay.attn_tp if lay.dp_lm_head else lay.tp)
    return max(compute, read / (e.eta_mem * m.bw))


def pp_round(m: StepCostModel, lay: Layout, gpu_forward: float, cpu: float, b: int) -> float:
    """One PP round: ``max(pp x S, pp x cpu) + (pp-1) p2p(b) + pp x pp_stage_latency_s``.

    ``S`` the slowest stage's slot: ``T x ceil(L / pp) / L + H``. ``gpu_forward``: all ``L``
    layers of one micro-batch (``T``); SGLang splits the layers evenly and gives the last
    ``L mod pp`` stages one more (``distributed/utils.py:110-115`` ``get_pp_indices``), and the
    last stage also runs the lm_head (``H``, :func:`lm_head_seconds`), so it is the slowest,
    and each of the ``pp`` slots of a round lasts as long as it. ``cpu``: scheduler CPU of one
    micro-batch; ``b``: its tokens (module docstring). ``pp == 1``: ``max(T, cpu)``, the plain
    overlap-scheduler step.
    """
    if lay.pp <= 1:
        return max(gpu_forward, cpu)
    per_stage = -(-m.layers // lay.pp)
    slot = gpu_forward * per_stage / m.layers + _memo(m, ("lay_lm", b),
                                                      lambda: lm_head_seconds(m, lay, b))
    return (lay.pp * max(slot, cpu) + _memo(m, ("lay_p2p", b), lambda: p2p_seconds(m, lay, b))
            + lay.pp * m.eff.pp_stage_latency_s)


def forward_seconds(m: StepCostModel, lay: Layout, n: int, attention: float, mode: Mode,
                    spec: bool = False) -> float:
    """GPU seconds of one rank's forward at ``n`` tokens whose attention costs ``attention``.

    Compute ``C`` = linear layers + attention + the layers' fixed kernel latencies;
    communication ``M`` (:func:`comm_seconds`). ``C + M``; with two-batch overlap and ``n >=
    2``: ``max(C(n1) + C(n2), M(n1) + M(n2))`` over the halves ``n1 = n // 2``, ``n2 = n - n1``
    (attention split in proportion).
    """
    lat = m._layer_latency(m.layers, m.moe_layers)

    def compute(k: int) -> float:
        return _memo(m, ("lay_lin", k), lambda: linear_seconds(m, lay, k)) + attention * k / n + lat

    def comm(k: int) -> float:
        return _memo(m, ("lay_comm", k, mode, spec),
                     lambda: comm_seconds(m, lay, k, m.layers, m.moe_layers, mode, spec))

    if lay.tbo and n >= 2:
        n1 = n // 2
        n2 = n - n1
        return max(compute(n1) + compute(n2), comm(n1) + comm(n2))
    return compute(n) + comm(n)
