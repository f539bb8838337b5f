"""Parallel-layout step costs (domain/layout_cost.py) on tiny hand-computable scenarios."""

from __future__ import annotations

import math

import pytest

from domain.calibration import Efficiency
from domain.config import ServingConfig
from domain.costmodel import StepCostModel, build_cost_model
from domain.fit import fit
from domain.layout_cost import (
    FP8_DISPATCH_BYTES,
    Layout,
    a2a_seconds,
    comm_seconds,
    forward_seconds,
    linear_seconds,
    micro_batch,
    pp_round,
    remote_copies,
)

EFF = Efficiency(eta_mem=0.5, eta_kv=0.25, eta_kv_mla=0.5, eta_compute=0.5,
                 eta_compute_moe=0.25, eta_attn=0.5, layer_latency_s=1e-5,
                 moe_layer_latency_s=2e-5, step_overhead_s=1e-3, request_overhead_s=1e-4,
                 prefill_overhead_s=2e-3, allreduce_latency_s=1e-6, eager_layer_s=4e-4,
                 moe_gemm_half_tokens=0.0, a2a_eta=0.5, a2a_latency_s=1e-5,
                 a2a_ll_latency_s=5e-6, expert_imbalance=1.5, expert_imbalance_eplb=1.1,
                 pp_stage_latency_s=2e-5)


def layout(**kw: object) -> Layout:
    base: dict[str, object] = dict(tp=2, attn_dp=1, ep=1, dense_tp=2, pp=1, a2a=False,
                                   deepep_mode="auto", tbo=False, dp_lm_head=False,
                                   imbalance=1.0, local_experts=8.0,
                                   dispatch_bytes=FP8_DISPATCH_BYTES)
    base.update(kw)
    return Layout(**base)  # type: ignore[arg-type]


def toy(lay: Layout | None = None, **kw: object) -> StepCostModel:
    """A 2-GPU MoE toy: 4 layers (2 MoE), 8 experts top-2 of 1e8 params (1e8 B), no GPU.

    Weights: attention 2e9 B + embed 1e9 + dense MLP 1e9 (static 4e9) + 8 x 2 x 1e8 experts;
    FLOPs per token: attention 2e9, MLP 1e9 of which routed 2 x 2 layers x 2 x 1e8 = 8e8.
    1 TB/s HBM, 100 GB/s link, 1e15 FLOP/s.
    """
    base: dict[str, object] = dict(
        t=2 if lay is None else lay.attn_tp, layers=4, hidden=1000, eff=EFF,
        attn_flops_per_token=2e9, mlp_flops_per_token=1e9, f_attn=1e15, f_mlp=1e15,
        f_bf16=1e15, f_fp8=2e15, moe=True, static_bytes=4e9, expert_bytes=1e8,
        moe_layers=2, n_experts=8, top_k=2, bw=1e12, link=1e11, attn_dim=4096, topk=0,
        index_flops_per_pair=0.0, latent_bytes_gpu=1000.0, index_bytes_gpu=0.0, mla=False,
        graph_max_bs=64, expert_params=1e8, layout=lay, attn_bytes=2e9, embed_bytes=1e9,
        dense_bytes=1e9, shared_bytes=0.0, routed_flops_per_token=8e8)
    base.update(kw)
    return StepCostModel(**base)  # type: ignore[arg-type]


def test_default_layout_is_the_plain_model() -> None:
    # an all-ones layout prices exactly what the plain TP model does
    plain, lay = toy(), toy(layout())
    for n, ctx in ((1, 100), (10, 20_000), (100, 300_000)):
        assert lay.decode_time(n, ctx) == pytest.approx(plain.decode_time(n, ctx), rel=1e-12)
        assert lay.verify_time(n, 3, ctx) == pytest.approx(plain.verify_time(n, 3, ctx),
                                                           rel=1e-12)
    assert lay.prefill_time(4096, 1e6, 0.0) == pytest.approx(
        plain.prefill_time(4096, 1e6, 0.0), rel=1e-12)
    # and a config at the default layout builds no layout at all
    cfg = ServingConfig(model="deepseek-v3", gpu="H200", weights="fp8", tp_size=8)
    assert build_cost_model(cfg, fit(cfg)).layout is None


def test_remote_copies_low_latency_and_normal() -> None:
    lay = layout(ep=4)
    # low-latency: one copy per routed expert, 3 of 4 ranks remote: 2 x 3/4
    assert remote_copies(lay, "low_latency", 8, 2) == pytest.approx(1.5)
    # normal: one copy per destination rank; P(a rank holds none of 2 experts of 8, 2 per
    # rank) = C(6,2)/C(8,2) = 15/28, so 3 x 13/28 other ranks
    assert remote_copies(lay, "normal", 8, 2) == pytest.approx(3 * 13 / 28)
    assert remote_copies(layout(), "normal", 8, 2) == 0.0


def test_a2a_bytes_and_time() -> None:
    lay = layout(ep=2, a2a=True)
    m = toy(lay)
    # decode under auto = low-latency: 10 tokens x 2 x 1/2 copies x 1000 x (1.03125 + 2) B
    wire = 10 * 1.0 * 1000 * (1.03125 + 2.0)
    assert a2a_seconds(m, lay, 10, "decode") == pytest.approx(5e-6 + wire / (0.5 * 1e11))
    # extend under auto = normal: 1 x (1 - C(4,2)/C(8,2)) = 22/28 copies, normal latency
    wire = 10 * (22 / 28) * 1000 * (1.03125 + 2.0)
    assert a2a_seconds(m, lay, 10, "extend") == pytest.approx(1e-5 + wire / (0.5 * 1e11))
    assert a2a_seconds(m, lay, 10, "extend", ideal=True) == pytest.approx(wire / 1e11)
    # forced low-latency in extend too
    ll = layout(ep=2, a2a=True, deepep_mode="low_latency")
    assert a2a_seconds(toy(ll), ll, 10, "extend") == pytest.approx(
        5e-6 + 10 * 1000 * 3.03125 / 5e10)


def test_a2a_splits_over_nvlink_and_nic() -> None:
    from domain.hardware import get_gpu
    from domain.interconnect import a2a_link_shares

    ic = get_gpu("H200").interconnect  # 8 GPUs a node, NVLink 450 GB/s, NIC 50 GB/s
    (intra, il), (inter, nl) = a2a_link_shares(16, ic)
    # 7 of 15 peers in the node, 8 across the NIC
    assert (intra, inter) == pytest.approx((7 / 15, 8 / 15))
    assert (il, nl) == (450e9, 50e9)
    assert a2a_link_shares(8, ic)[1][0] == 0.0


def test_attention_dp_gather_replaces_the_allreduce() -> None:
    lay = layout(attn_dp=2)  # attention TP 1: no attention all-reduce
    m = toy(lay)
    g_bytes = 20 * 1000 * 2  # the gathered 2 x 10 tokens
    # decode without a GPU: MAX_LEN, all-gather + reduce-scatter, each (1/2) x bytes / link + lat
    per_layer = 2 * (0.5 * g_bytes / 1e11 + 1e-6)
    assert comm_seconds(m, lay, 10, 4, 2, "decode") == pytest.approx(4 * per_layer)
    # extend: SUM_LEN, two all-reduces of the summed buffer, 2 x (2 x 1/2 x bytes / link + lat)
    per_layer = 2 * (g_bytes / 1e11 + 1e-6)
    assert comm_seconds(m, lay, 10, 4, 2, "extend") == pytest.approx(4 * per_layer)
    # plain TP: two all-reduces of the rank's own 10 tokens per layer
    assert comm_seconds(toy(layout()), layout(), 10, 4, 2, "decode") == pytest.approx(
        4 * 2 * (10 * 1000 * 2 / 1e11 + 1e-6))


def test_attention_dp_splits_the_kv_read() -> None:
    # GQA: each GPU holds kv_heads / attn_tp heads; attention DP 2 of TP 8 doubles them per GPU
    c = ServingConfig(model="llama-3.1-8b", gpu="H200", weights="bf16", tp_size=8)
    r = fit(c)
    tp = build_cost_model(c, r)
    dp = build_cost_model(c.model_copy(update={"attn_dp_size": 2}), r)
    assert dp.t == 4 and dp.latent_bytes_gpu == pytest.approx(2 * tp.latent_bytes_gpu)
    # MLA: the latent is read whole by every GPU of a rank, but a rank reads only its own
    # sequences: at DP 8 each GPU reads 1/8 of the batch's latents
    c = ServingConfig(model="deepseek-v3", gpu="H200", weights="fp8", tp_size=8)
    r = fit(c)
    tp = build_cost_model(c, r)
    dp = build_cost_model(c.model_copy(update={"attn_dp_size": 8}), r)
    assert dp.latent_bytes_gpu == tp.latent_bytes_gpu
    assert dp._kv_read(8, 8000, dp.layers) == pytest.approx(tp._kv_read(64, 64_000, tp.layers) / 8)


def test_pp_round_and_bubble() -> None:
    lay = layout(pp=2)
    m = toy(lay)
    assert (micro_batch(lay, 5), micro_batch(lay, 4), micro_batch(lay, 1)) == (3, 2, 1)
    # round: max(T, pp x cpu) + 1 boundary of 2 tensors x 3 x 1000 x 2 B / link + 2 latencies
    assert pp_round(m, lay, 0.01, 0.004, 3) == pytest.approx(0.01 + 12_000 / 1e11 + 2 * 2e-5)
    assert pp_round(m, lay, 0.001, 0.004, 3) == pytest.approx(0.008 + 12_000 / 1e11 + 4e-5)
    # 5 layers on 2 stages: the last holds 3 and the lm_head (1e9 B over 2 GPUs at 0.5 x 1 TB/s
    # = 1 ms, its 2 x 5e8 FLOPs per token far below), and both slots last as long as it
    odd = toy(lay, layers=5, lm_head_bytes=1e9, lm_head_params=5e8)
    assert pp_round(odd, lay, 0.01, 0.0, 3) == pytest.approx(
        2 * (0.01 * 3 / 5 + 1e-3) + 12_000 / 1e11 + 2 * 2e-5)
    # the bubble: one sequence costs the round of two (one micro-batch slot stays empty)
    assert m.decode_time(1, 100) == pytest.approx(m.decode_time(2, 200))
    # a round of 4 sequences is one micro-batch of 2 through both stages
    gpu = forward_seconds(m, lay, 2, m._kv_read(2, 400, 4), "decode")
    assert m.decode_time(4, 800) == pytest.approx(pp_round(m, lay, gpu, m.cpu_time(2), 2))


def test_two_batch_overlap_hides_communication() -> None:
    base = layout(attn_dp=2)
    tbo = layout(attn_dp=2, tbo=True)
    # slow link (5 MB/s): communication dominates
    m, mt = toy(base, link=5e6), toy(tbo, link=5e6)
    kv = m._kv_read(10, 1000, 4)
    lat = m._layer_latency(4, 2)
    c = [linear_seconds(mt, tbo, k) + kv * k / 10 + lat for k in (5, 5)]
    comm = [comm_seconds(mt, tbo, k, 4, 2, "decode") for k in (5, 5)]
    assert comm[0] > c[0]
    assert forward_seconds(mt, tbo, 10, kv, "decode") == pytest.approx(max(sum(c), sum(comm)))
    plain = forward_seconds(m, base, 10, kv, "decode")
    assert plain == pytest.approx(linear_seconds(m, base, 10) + kv + lat
                                  + comm_seconds(m, base, 10, 4, 2, "decode"))
    assert forward_seconds(mt, tbo, 10, kv, "decode") < plain
    # one sequence does not split
    assert forward_seconds(mt, tbo, 1, kv, "decode") == pytest.approx(
        forward_seconds(m, base, 1, kv, "decode"))


def test_expert_imbalance_scales_the_busiest_rank() -> None:
    bal = layout(ep=2, local_experts=4.0)
    skew = layout(ep=2, imbalance=1.5, local_experts=4.0)
    m = toy(bal)
    # compute-bound (1e6 tokens): routed 8e8 of the 1e9 MLP FLOPs per token scale by 1.5
    n = 1_000_000
    balanced = n / 2 * (2e9 / (1e15 * 0.5) + 1e9 / (1e15 * 0.25))
    skewed = n / 2 * (2e9 / (1e15 * 0.5) + (2e8 + 1.5 * 8e8) / (1e15 * 0.25))
    assert linear_seconds(m, bal, n) == pytest.approx(balanced)
    assert linear_seconds(m, skew, n) == pytest.approx(skewed)
    # memory-bound (1 token): 2 experts touched, 1 per rank x 1.5 on the busiest; all its
    # reads: attention 2e9 + embed 1e9 + dense 1e9 over 2 GPUs, experts 1.5 x 1e8 per MoE layer
    touched = 8 * (1 - (1 - 2 / 8) ** 2)
    read = (4e9 / 2 + 2 * (touched / 2 * 1.5) * 1e8) / (0.5 * 1e12)
    assert linear_seconds(m, skew, 2) == pytest.approx(read)
    # never more than the rank's own experts: at many tokens all 4 are read, skew or not
    assert linear_seconds(m, skew, 10_000, ideal=True) >= linear_seconds(m, bal, 10_000,
                                                                         ideal=True)


def test_eplb_and_backend_pick_the_layout_constants() -> None:
    c = ServingConfig(model="deepseek-v3", gpu="H200", weights="fp8", tp_size=8,
                      attn_dp_size=8, ep_size=8, moe_a2a_backend="deepep")
    r = fit(c)
    lay = build_cost_model(c, r).layout
    assert lay is not None and lay.a2a and lay.attn_tp == 1
    assert lay.imbalance == build_cost_model(c, r).eff.expert_imbalance
    eplb = build_cost_model(c.model_copy(update={"enable_eplb": True,
                                                 "ep_num_redundant_experts": 32}), r).layout
    assert eplb is not None and eplb.imbalance == eplb_eff(c)
    assert eplb.local_experts == pytest.approx((256 + 32) / 8)
    assert math.isclose(lay.local_experts, 32.0)


def eplb_eff(c: ServingConfig) -> float:
    from domain.calibration import efficiency

    return efficiency(c.gpu).expert_imbalance_eplb


def _tput(c: ServingConfig, conc: int, ctx: int) -> float:
    """Decode tok/s of ``conc`` sequences of ``ctx`` KV tokens spread over the schedulers, each
    at most the batch its KV pool and running cap allow."""
    r = fit(c)
    m = build_cost_model(c, r)
    per = max(1, min(conc // c.schedulers, r.kv_tokens // ctx, r.max_running_requests))
    return per * c.schedulers / m.decode_time(per, per * ctx)


def test_dsv3_dp_attention_ep_slower_at_8_faster_at_256() -> None:
    """issue 21 'done when', cost level: DeepSeek-V3 FP8 on 8x H200, TP8 + attention DP 8 +
    EP8 (deepep) against TP8, 1,500 KV tokens per sequence, at the batch each pool allows."""
    tp8 = ServingConfig(model="deepseek-v3", gpu="H200", weights="fp8", tp_size=8)
    dpep = tp8.model_copy(update={"attn_dp_size": 8, "ep_size": 8, "moe_a2a_backend": "deepep"})
    assert _tput(dpep, 8, 1500) < _tput(tp8, 8, 1500)
    assert _tput(dpep, 256, 1500) > _tput(tp8, 256, 1500)


def _pp_pair(model: str, weights: str, gpu: str) -> tuple[StepCostModel, StepCostModel, int]:
    """TP8 and TP4+PP2 step models on one report, and the TP8 report's KV tokens."""
    tp8 = ServingConfig(model=model, gpu=gpu, weights=weights, tp_size=8)
    r = fit(tp8)
    pp = tp8.model_copy(update={"tp_size": 4, "pp_size": 2})
    return build_cost_model(tp8, r), build_cost_model(pp, r), r.kv_tokens


@pytest.mark.parametrize(("model", "weights"), [("kimi-k2-thinking", "w4a16"),
                                                ("glm-5", "nvfp4")])
def test_pp_beats_tp8_over_pcie_at_saturation(model: str, weights: str) -> None:
    """issue 21 'done when', cost level: 8x RTX PRO 6000, TP4+PP2 >= 1.05x TP8 at the batch
    each KV pool allows (3,000 tokens a sequence). Both hold 1/8 of the weights per GPU; a
    TP4+PP2 GPU keeps the whole MLA latent of half the layers, so twice TP8's tokens."""
    m8, mpp, kv = _pp_pair(model, weights, "RTX-PRO-6000")
    n8, npp = kv // 3000, 2 * kv // 3000
    tp8 = n8 / m8.decode_time(n8, n8 * 3000)
    assert npp / mpp.decode_time(npp, npp * 3000) >= 1.05 * tp8
    # the TP4 groups stay inside a NUMA node and all-reduce half the tokens: cheaper
    # communication per round even at TP8's batch
    assert mpp.decode_allreduce_time(n8) < 0.5 * m8.decode_allreduce_time(n8)


def test_pp_gains_nothing_from_the_allreduce_over_nvlink() -> None:
    """On 8x B200 the all-reduce is cheap: at TP8's batch TP4+PP2 is <= 1.02x TP8 for
    Kimi-K2-Thinking (it streams the weights once per micro-batch). The issue's <= 1.02x at
    saturation does not hold: PP halves the replicated MLA latent (docs/twin.md)."""
    m8, mpp, kv = _pp_pair("kimi-k2-thinking", "w4a16", "B200")
    for ctx in (1500, 3000):
        n = kv // ctx
        assert m8.decode_time(n, n * ctx) / mpp.decode_time(n, n * ctx) <= 1.02


def test_p2p_link_between_pipeline_stages() -> None:
    from domain.hardware import get_gpu
    from domain.interconnect import p2p_link_bytes_per_s

    rtx = get_gpu("RTX-PRO-6000").interconnect  # PCIe Gen5 x16, NUMA 0-3 | 4-7 at 40 GB/s
    assert p2p_link_bytes_per_s(0, 4, 4, rtx) == 40e9          # TP4+PP2 crosses the NUMA hop
    assert p2p_link_bytes_per_s(0, 2, 2, rtx) == pytest.approx(16 * 3.938e9)  # inside NUMA 0
    h200 = get_gpu("H200").interconnect
    assert p2p_link_bytes_per_s(0, 4, 4, h200) == 450e9         # NVLink inside the node
    assert p2p_link_bytes_per_s(0, 8, 8, h200) == 50e9          # TP8+PP2: the next host's NIC
