"""Memory per rank under parallel layouts (issue 21): weights per GPU, the KV pool of each
attention-DP rank, the request cap split over the ranks, PP stages, DeepEP buffers, PD roles.

Every expected number is worked out by hand in the comments from the model's parameter groups
(domain/model_arch.py) and SGLang 0.5.23's rules (domain/fit.py docstrings cite them)."""

from __future__ import annotations

import pytest

from domain.config import ServingConfig
from domain.fit import (
    default_mem_fraction,
    fit,
    fit_servers,
    pp_layer_ranges,
    resolve_max_running_requests,
    resolved_ep_size,
    stage_memory,
)
from domain.graph_memory import deepep_buffer_bytes
from domain.hardware import get_gpu
from domain.models import get_model

DSV3 = {"model": "deepseek-v3", "gpu": "H200", "tp_size": 8, "weights": "fp8"}


def _dsv3(**kw: object) -> ServingConfig:
    return ServingConfig.model_validate({**DSV3, **kw})


def _group_bytes(group: str) -> float:
    m = get_model("deepseek-v3")
    return m.param_groups()[group] * m.checkpoint("fp8").bytes_per_param[group]


def test_attention_dp_replicates_attention_and_embedding_per_rank() -> None:
    # TP8: every group / 8. Attention DP 8 (attention TP 1): attention and embed_tokens whole
    # on each GPU; lm_head stays over TP8 (no --enable-dp-lm-head); experts over all 8 GPUs.
    tp8, dp8 = fit(_dsv3()), fit(_dsv3(attn_dp_size=8, ep_size=8))
    embed_tokens = get_model("deepseek-v3").vocab * 7168 * 2.0  # bf16, lm_head excluded
    extra = (_group_bytes("attention") + embed_tokens) * 7 / 8
    assert dp8.weight_bytes_per_gpu == pytest.approx(tp8.weight_bytes_per_gpu + extra, rel=1e-9)
    # with --enable-dp-lm-head the head (another vocab x hidden in bf16) is whole too
    head = fit(_dsv3(attn_dp_size=8, ep_size=8, enable_dp_lm_head=True))
    assert head.weight_bytes_per_gpu == pytest.approx(dp8.weight_bytes_per_gpu
                                                      + embed_tokens * 7 / 8, rel=1e-9)
    assert dp8.schedulers == 8 and tp8.schedulers == 1


def test_mla_latent_is_whole_on_every_rank_gqa_heads_split_over_attention_tp() -> None:
    # DeepSeek-V3 MLA: (512 + 64) x 61 layers x 2 bytes = 70,272 B/token whatever the layout
    assert fit(_dsv3()).kv_bytes_per_token == fit(_dsv3(attn_dp_size=8)).kv_bytes_per_token \
        == 70_272
    # Llama-3.1-70B (8 KV heads, 80 layers, head 128): TP8 holds 1 head per GPU,
    # attention TP 4 (TP8 x attn DP 2) holds 2: 80 x 2 x 2 x 128 x 2 = 81,920 B/token
    llama = {"model": "llama-3.1-70b", "gpu": "H200", "tp_size": 8, "weights": "bf16"}
    assert fit(ServingConfig(**llama)).kv_bytes_per_token == 40_960  # type: ignore[arg-type]
    assert fit(ServingConfig(**llama, attn_dp_size=2)).kv_bytes_per_token == 81_920  # type: ignore[arg-type]


def test_max_running_requests_is_split_over_the_attention_dp_ranks() -> None:
    # speculative decoding's 48 is the server's: 48 // 8 = 6 per rank (kv_cache_configurator)
    assert resolve_max_running_requests(None, 100_000, 163_840, True, attn_dp_size=8) == 6
    assert resolve_max_running_requests(256, 100_000, 163_840, False, attn_dp_size=8) == 32
    assert resolve_max_running_requests(4, 100_000, 163_840, False, attn_dp_size=8) == 1
    # unset: each rank's own default from its own pool (not divided)
    assert resolve_max_running_requests(None, 100_000, 163_840, False, attn_dp_size=8) == 2048
    rep = fit(_dsv3(attn_dp_size=8, ep_size=8, speculative_algorithm="EAGLE"))
    assert rep.max_running_requests == 6
    assert rep.cuda_graph_max_bs_decode == 6  # captured graphs stop at the request slots
    assert fit(_dsv3(speculative_algorithm="EAGLE")).max_running_requests == 48


def test_chunk_and_conservativeness_per_rank() -> None:
    rep = fit(_dsv3(attn_dp_size=8, ep_size=8))
    assert rep.chunked_prefill_size == 8192 // 8  # H200 tier 8192, divided by attn_dp_size
    assert rep.conservativeness_scale == 0.3
    assert fit(_dsv3()).chunked_prefill_size == 8192 and fit(_dsv3()).conservativeness_scale == 1


def test_attention_dp_graph_reserve_in_the_default_fraction() -> None:
    # memory_hook.py: 512 + 1.5 x 8192 + 8 x 1 / 8 x 1024 + 2 x 512 (decode graphs)
    # + 512 x 8 x 4.5 (attention DP, max bs > 300) + 1536 (MLA prefill graph) = 34,816 MiB
    model, gpu = get_model("deepseek-v3"), get_gpu("H200")
    mib = gpu.hbm_mib
    assert default_mem_fraction(model, gpu, 8, 8192, 512, attn_dp_size=8) == \
        round((mib - 34_816) / mib, 3)
    assert fit(_dsv3(attn_dp_size=8)).mem_fraction_static == round((mib - 34_816) / mib, 3)
    # DeepEP adds 1,024 (breakable prefill graph) and 2,048 after the floor
    assert default_mem_fraction(model, gpu, 8, 8192, 512, attn_dp_size=8, deepep=True) == \
        round((mib - 34_816 - 1024 - 2048) / mib, 3)


def test_expert_parallelism_alone_moves_no_bytes_redundant_experts_do() -> None:
    # EP8 x moe TP1 holds 32 whole experts per GPU = routed / 8, as TP8 x moe TP8 does
    assert fit(_dsv3(ep_size=8)).weight_bytes_per_gpu == pytest.approx(
        fit(_dsv3()).weight_bytes_per_gpu, rel=1e-12)
    # +32 redundant experts: 288 physical, 36 per GPU: routed x 32 / 256 / 8 more
    m = get_model("deepseek-v3")
    routed = m.moe_layers * m.n_routed_experts * m.expert_params * 1.000244140625
    more = fit(_dsv3(ep_size=8, ep_num_redundant_experts=32)).weight_bytes_per_gpu
    assert more == pytest.approx(fit(_dsv3()).weight_bytes_per_gpu + routed * 32 / 256 / 8,
                                 rel=1e-9)


def test_a2a_backend_forces_ep_to_tp_and_replicates_shared_experts() -> None:
    c = _dsv3(moe_a2a_backend="deepep")
    assert resolved_ep_size(c) == 8  # overrides.py _a2a_ep_size: a resolution
    m = get_model("deepseek-v3")
    shared = m.moe_layers * m.n_shared_experts * m.expert_params * 1.000244140625
    assert fit(c).weight_bytes_per_gpu == pytest.approx(
        fit(_dsv3()).weight_bytes_per_gpu + shared * 7 / 8, rel=1e-9)


def test_pipeline_stages_split_layers_and_the_pool_is_the_smallest_stage() -> None:
    assert pp_layer_ranges(61, 2) == [(0, 30), (30, 61)]  # the last stage takes the extra one
    assert pp_layer_ranges(10, 4) == [(0, 2), (2, 4), (4, 7), (7, 10)]
    c = _dsv3(tp_size=4, pp_size=2)
    stages = stage_memory(c, get_model("deepseek-v3"), False)
    assert [s.layers for s in stages] == [(0, 30), (30, 61)]
    assert stages[0].kv_share == pytest.approx(30 / 61) and stages[1].kv_share == pytest.approx(
        31 / 61)
    rep = fit(c)
    # the last stage (31 layers + lm_head) is the heavier and holds fewer tokens
    assert rep.weight_bytes_per_gpu == stages[1].weight_bytes
    assert rep.kv_bytes_per_token == pytest.approx(70_272 * 31 / 61)
    # TP4 x PP2 sums to the whole model once over 8 GPUs
    total = get_model("deepseek-v3").weight_bytes("fp8")
    assert sum(s.weight_bytes for s in stages) * 4 == pytest.approx(total, rel=1e-9)


def test_deepep_buffers_by_hand() -> None:
    # low latency (DeepEP csrc/config.hpp): hidden 7168, 256 experts, 128 tokens per rank:
    # dispatch message 16 + 14,336 = 14,352 B; combine 56 x 4 + 14,336 = 14,560 B; send and
    # receive 256 x 128 x 14,560 = 477,102,080 each; signalling align(256 x 8 + 32 x 4, 128) =
    # 2,176; 2 x (477,102,080 x 2 + 2,176) = 1,908,412,672, aligned up: 1,908,412,800
    assert deepep_buffer_bytes(7168, 8, 256, "low_latency") == 1_908_412_800
    # normal, 8 ranks: 10 channels x 8 ranks x (5 x 4 B + 256 tokens x (14,336 + 8 + 128 x 12
    # + 128 x 4)) = 1,600 + 335,708,160 = 335,709,760 -> aligned to 128: 335,709,824
    assert deepep_buffer_bytes(7168, 8, 256, "normal") == 335_709_824
    assert deepep_buffer_bytes(7168, 8, 256, "auto") == 335_709_824 + 1_908_412_800
    rep = fit(_dsv3(attn_dp_size=8, moe_a2a_backend="deepep"))
    assert rep.deepep_buffer_bytes_per_gpu == 335_709_824 + 1_908_412_800
    assert fit(_dsv3(moe_a2a_backend="deepep", deepep_mode="normal")).graph_bytes_per_gpu == 0


def test_pd_roles_and_fit_servers() -> None:
    pd = _dsv3(pd="1P1D")
    rows = fit_servers(pd)
    assert [(role, n) for role, n, _, _ in rows] == [("prefill", 1), ("decode", 1)]
    prefill, decode = rows[0][3], rows[1][3]
    assert prefill.cuda_graph_max_bs_decode == 0 and prefill.graph_bytes_per_gpu == 0
    assert decode.radix_cache_off_by_role and not prefill.radix_cache_off_by_role
    assert fit(pd) == decode  # fit() of a PD config is the decode server's
    # decode extra slots: 2 x the per-worker cap when it is <= 32 (pd_disaggregation_hook.py)
    small = fit(_dsv3(disaggregation_mode="decode", max_running_requests=16))
    assert small.decode_extra_slots == 32
    assert fit(_dsv3(disaggregation_mode="decode", max_running_requests=64)
               ).decode_extra_slots == 0
    agg = _dsv3()
    assert [(r, n) for r, n, _, _ in fit_servers(agg)] == [("server", 1)]
