"""Hand-computed checks of the model catalog (weights, KV bytes, MTP layer) and the cost model."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from domain.calibration import UNCALIBRATED, Efficiency, calibration_file, efficiency
from domain.config import ServingConfig
from domain.costmodel import PCIE5_X16_BYTES_PER_S, StepCostModel, build_cost_model
from domain.errors import ConfigInvalid
from domain.fit import fit
from domain.models import (
    BF16,
    FP8_BLOCK,
    MODELS,
    NVFP4,
    Checkpoint,
    ModelArch,
    arch_from_hf_config,
    get_model,
)

REPO = Path(__file__).resolve().parents[2]

QUANTIZATION_CHOICES = next(
    f["choices"] for f in json.loads(
        (REPO / "domain/data/sglang-0.5.23-flags.json").read_text())["flags"]
    if f["dest"] == "quantization")

# ---------------------------------------------------------------- a tiny made-up model
TINY = {  # 2 layers, hidden 64, 4 query heads, 2 KV heads of 16 dims, vocab 100
    "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100,
    "max_position_embeddings": 4096, "intermediate_size": 128,
}
TINY_MOE = {**TINY, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "moe_intermediate_size": 32, "first_k_dense_replace": 1,
            "num_nextn_predict_layers": 1}


def ckpt(embed: float, body: float, mtp: float | None = None) -> Checkpoint:
    groups = {"embed": embed, "attention": body, "dense_mlp": body, "experts": body}
    return Checkpoint(model_path="x/y", quantization=None, compute_dtype="bf16",
                      bytes_per_param=groups,
                      mtp_bytes_per_param=None if mtp is None else dict.fromkeys(groups, mtp),
                      source="test")


def tiny(cfg: dict[str, object] = TINY) -> ModelArch:
    arch = arch_from_hf_config("tiny", dict(cfg), source="test")
    return arch.model_copy(update={"checkpoints": {
        "bf16": ckpt(BF16, BF16), "fp8": ckpt(BF16, FP8_BLOCK), "nvfp4": ckpt(BF16, NVFP4),
        "nvfp4_mtp_bf16": ckpt(BF16, NVFP4, mtp=BF16)}})


def test_byte_constants():
    assert FP8_BLOCK == 1 + 4 / 16384  # one fp32 scale per 128x128 block
    assert NVFP4 == 0.5 + 1 / 16       # one fp8 scale per 16 fp4 values


def test_tiny_dense_param_groups_and_weights_per_quantization():
    m = tiny()
    # attention: q + o = 64*4*16*2 = 8192; k + v = 64*2*16*2 = 4096 -> 12288 per layer
    assert m.attention_params_per_layer == 12_288
    assert m.param_groups() == {"embed": 2 * 100 * 64, "attention": 2 * 12_288,
                                "dense_mlp": 2 * 3 * 64 * 128, "experts": 0}
    assert m.total_params == 12_800 + 24_576 + 49_152 == 86_528
    assert m.weight_bytes("bf16") == 2 * 86_528 == 173_056
    # fp8: embed/lm_head stay bf16; 73,728 linear params at 1 B + 73,728 * 4 / 16384 = 18 B
    assert m.weight_bytes("fp8") == pytest.approx(25_600 + 73_728 + 18)
    # nvfp4 with its fp8 group scales: 73,728 x 0.5625 = 41,472
    assert m.weight_bytes("nvfp4") == pytest.approx(25_600 + 41_472)
    assert m.mtp_layers == 0 and m.draft_weight_bytes("fp8") == 0.0


def test_tied_embeddings_count_once():
    m = tiny({**TINY, "tie_word_embeddings": True})
    assert m.param_groups()["embed"] == 100 * 64
    assert m.active_params == 6_400 + 24_576 + 49_152  # lm_head (= embed) still computes


def test_tiny_moe_groups_and_mtp_draft_bytes():
    m = tiny(TINY_MOE)
    assert (m.moe_layers, m.mtp_layers, m.expert_params) == (1, 1, 3 * 64 * 32)
    # one MoE layer: (4 routed + 1 shared) x 6144 + router 64 x 4
    assert m.param_groups()["experts"] == 5 * 6_144 + 256 == 30_976
    assert m.param_groups()["dense_mlp"] == 3 * 64 * 128  # the first_k_dense layer
    assert m.active_params == 6_400 + 24_576 + 24_576 + 3 * 6_144
    assert m.mtp_params_per_layer == {"attention": 12_288, "mlp": 30_976,
                                      "glue": 2 * 64 * 64 + 5 * 64}
    # fp8: attention + MoE at 1 + 4/16384 B; eh_proj + norms (8,512) in bf16
    assert m.draft_weight_bytes("fp8") == pytest.approx(43_264 * FP8_BLOCK + 8_512 * 2)
    assert m.draft_weight_bytes("fp8") == pytest.approx(60_298.5625)
    # an NVFP4 checkpoint that keeps the MTP layer in bf16 (GLM-5 / DeepSeek ModelOpt recipe)
    assert m.draft_weight_bytes("nvfp4_mtp_bf16") == (12_288 + 30_976 + 8_512) * 2 == 103_552
    assert m.weight_bytes("nvfp4_mtp_bf16") == m.weight_bytes("nvfp4")  # MTP not in the total


def test_unknown_checkpoint_raises():
    with pytest.raises(ConfigInvalid, match="known: bf16"):
        tiny().draft_weight_bytes("int4")


# ---------------------------------------------------------------- real configs
def test_llama_8b_weights_bf16_and_fp8():
    m = get_model("llama-3.1-8b")
    embed = 2 * 128_256 * 4_096                           # 1,050,673,152
    attn = 32 * (4_096 * 32 * 128 * 2 + 4_096 * 8 * 128 * 2)  # 1,342,177,280
    mlp = 32 * 3 * 4_096 * 14_336                         # 5,637,144,576
    assert m.total_params == embed + attn + mlp == 8_029_995_008
    assert m.weight_bytes("bf16") == 16_059_990_016
    assert m.weight_bytes("fp8") == 2 * embed + attn + mlp == 9_080_668_160
    assert m.checkpoint("fp8").quantization == "fp8"


def test_qwen3_235b_nvfp4_keeps_qkv_and_routers_bf16():
    """nvidia/Qwen3-235B-A22B-Instruct-2507-NVFP4 (the bf16 release's own NVFP4) keeps q/k/v,
    the routers and lm_head bf16; o_proj and the experts are NVFP4. Its safetensors hold
    139,202,447,840 bytes (norms included, which are not counted here)."""
    m = get_model("qwen3-235b-a22b")
    embed = 2 * 151_936 * 4_096
    qkv = 94 * 4_096 * (64 + 4 + 4) * 128
    o_proj = 94 * 64 * 128 * 4_096
    routers = 94 * 4_096 * 128
    experts = 94 * 128 * 3 * 4_096 * 1_536
    assert m.total_params == embed + qkv + o_proj + experts + routers
    assert m.total_params / 1e9 == pytest.approx(235.09, abs=0.01)
    assert m.weight_bytes("nvfp4") == pytest.approx(
        2 * (embed + qkv + routers) + (o_proj + experts) * 0.5625)
    assert m.weight_bytes("nvfp4") == pytest.approx(139_202_447_840, rel=1e-4)
    ck = m.checkpoint("nvfp4")
    assert (ck.model_path, ck.quantization) == ("nvidia/Qwen3-235B-A22B-Instruct-2507-NVFP4",
                                                "modelopt_fp4")


def test_deepseek_r1_shapes_weights_and_mtp_layer():
    m = get_model("deepseek-r1")
    assert (m.attention, m.qk_head_dim, m.mtp_layers) == ("mla", 192, 1)
    # q_a + q_b: 7168*1536 + 1536*128*192; kv_a + kv_b: 7168*576 + 512*128*256; o: 128*128*7168
    assert m.attention_params_per_layer == 48_758_784 + 20_905_984 + 117_440_512 == 187_105_280
    assert m.total_params / 1e9 == pytest.approx(671.03, abs=0.01)  # published: 671B
    # MTP: attention + 257 experts + router at fp8 block, eh_proj + 5 norms in bf16
    mlp = 257 * 3 * 7_168 * 2_048 + 7_168 * 256
    glue = 2 * 7_168 * 7_168 + 5 * 7_168
    assert m.draft_weight_bytes("fp8") == pytest.approx(
        (187_105_280 + mlp) * FP8_BLOCK + glue * 2)
    assert m.draft_weight_bytes("fp8") == pytest.approx(11_715_671_600)
    # NVFP4: the MTP layer (model.layers.61*) stays bf16 -> about twice the fp8 layer
    assert m.draft_weight_bytes("nvfp4") == (187_105_280 + mlp + glue) * 2


def test_glm5_mtp_layer_and_existing_totals():
    m = get_model("glm-5")
    assert m.mtp_layers == 1
    assert m.total_params / 1e9 == pytest.approx(744, abs=1)
    assert m.draft_weight_bytes("nvfp4") == pytest.approx(
        2 * sum(m.mtp_params_per_layer.values()))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_catalog_entries_load_with_real_paths(name: str):
    m = get_model(name)
    assert m.checkpoints and m.source.endswith(".json")
    for ck in m.checkpoints.values():
        assert "/" in ck.model_path
        # a --quantization choice of the pinned 0.5.23 inventory (or none)
        assert ck.quantization in (None, *QUANTIZATION_CHOICES)
        assert {"embed", "attention", "dense_mlp", "experts"} <= set(ck.bytes_per_param)


# ---------------------------------------------------------------- KV bytes per token
def test_kv_bytes_gqa_mha_and_replication():
    m = tiny()
    # layers x (K, V) x heads on this rank x head_dim x bytes
    assert m.kv_bytes_per_token(2, 1) == 2 * 2 * 2 * 16 * 2 == 256
    assert m.kv_bytes_per_token(1, 1) == 128  # fp8 halves it
    assert m.kv_bytes_per_token(2, 2) == 2 * 2 * 1 * 16 * 2 == 128
    # TP 4 > 2 KV heads: each rank keeps one (replicated) head, not half a head
    assert m.kv_bytes_per_token(2, 4) == 128
    mha = tiny({**TINY, "num_key_value_heads": 4})
    assert mha.kv_bytes_per_token(2, 1) == 2 * 2 * 4 * 16 * 2 == 512
    llama = get_model("llama-3.1-8b")
    assert llama.kv_bytes_per_token(2, 1) == 32 * 2 * 8 * 128 * 2 == 131_072
    assert llama.kv_bytes_per_token(2, 8) == llama.kv_bytes_per_token(2, 16) == 16_384
    qwen = get_model("qwen3-235b-a22b")  # 4 KV heads under TP8: one per rank
    assert qwen.kv_bytes_per_token(2, 8) == 94 * 2 * 1 * 128 * 2 == 48_128


def test_kv_bytes_mla_and_dsa():
    ds = get_model("deepseek-r1")
    assert ds.kv_bytes_per_token(2, 8) == 61 * (512 + 64) * 2 == 70_272
    assert ds.kv_bytes_per_token(1, 8) == 35_136 == ds.kv_bytes_per_token(1, 1)
    glm = get_model("glm-5")  # latent + indexer key (128 fp8 + 4 B scale), not halved
    assert glm.kv_bytes_per_token(2, 8) == 78 * (576 * 2 + 132)
    assert glm.kv_bytes_per_token(1, 8) == 78 * (576 + 132)


# ---------------------------------------------------------------- calibration
def test_calibration_file_loads_and_validates():
    eff = efficiency("H200")
    assert 0 < eff.eta_mem <= 1 and eff.step_overhead_s >= 0
    assert efficiency("NO-SUCH-GPU") == UNCALIBRATED.updated(
        calibration_file().get("default", {}))
    with pytest.raises(ValueError, match="unknown efficiency"):
        UNCALIBRATED.updated({"eta_magic": 0.5})
    with pytest.raises(ValueError, match="share of peak"):
        UNCALIBRATED.updated({"eta_mem": 0.0})


# ---------------------------------------------------------------- step times by hand
EFF = Efficiency(eta_mem=0.5, eta_kv=0.25, eta_kv_mla=0.5, eta_compute=0.5,
                 eta_compute_moe=0.25, eta_attn=0.5, eta_dsa_index=0.1, layer_latency_s=1e-5,
                 moe_layer_latency_s=2e-5, mla_layer_latency_s=3e-5, dsa_layer_latency_s=4e-5,
                 step_overhead_s=1e-3, request_overhead_s=1e-4, prefill_overhead_s=2e-3,
                 allreduce_latency_s=1e-6, eager_layer_s=4e-4)


def toy(**kw: object) -> StepCostModel:
    """A 2-GPU dense toy with round numbers: 1 TB/s HBM, 100 GB/s link, 1e15 FLOP/s."""
    base: dict[str, object] = dict(
        t=2, layers=10, hidden=1000, eff=EFF,
        attn_flops_per_token=2e9, mlp_flops_per_token=6e9, f_attn=1e15, f_mlp=1e15,
        f_bf16=1e15, f_fp8=2e15, moe=False, static_bytes=8e9, expert_bytes=0.0,
        moe_layers=0, n_experts=0, top_k=0, bw=1e12, link=1e11, attn_dim=4096, topk=0,
        index_flops_per_pair=0.0, latent_bytes_gpu=1000.0, index_bytes_gpu=0.0, mla=False,
        graph_max_bs=64, kv_bytes_per_token_gpu=10_000.0, host_link=5e10)
    base.update(kw)
    return StepCostModel(**base)  # type: ignore[arg-type]


def test_decode_time_by_hand():
    c = toy()
    # weights: 8e9 B / (2 GPUs x 0.5 x 1e12) = 8 ms (compute 10 x 8e9 / (2 x 0.5e15) = 0.08 ms)
    # KV: 10 layers x 20,000 tokens x 1000 B / (0.25 x 1e12) = 0.8 ms
    # all-reduce: 2 x 10 x (2 x 1/2 x 10 x 1000 x 2 B / 1e11 + 1 us) = 2 x 10 x 1.2 us = 24 us
    # layer latency: 10 layers x 10 us. GPU total 8.924 ms > CPU 1 ms + 10 x 0.1 ms = 2 ms
    assert c.decode_time(10, 20_000) == pytest.approx(8e-3 + 0.8e-3 + 24e-6 + 0.1e-3)
    # above the CUDA-graph max (64) the eager penalty applies: 10 layers x 0.4 ms = 4 ms (and
    # compute still < memory)
    ar = 2 * 10 * (65 * 1000 * 2 / 1e11 + 1e-6)
    assert c.decode_time(65, 20_000) == pytest.approx(8e-3 + 0.8e-3 + ar + 0.1e-3 + 4e-3)


def test_decode_time_cpu_bound_by_overlap_scheduler():
    c = toy(static_bytes=1e9)
    # GPU: 1e9 / 1e12 = 1 ms weights + 10 x 1000 x 1000 / 0.25e12 = 0.04 ms KV + 0.1 ms layers
    # + all-reduce 2 x 10 x (100 x 1000 x 2 / 1e11 + 1 us) = 60 us; CPU: 1 ms + 100 x 0.1 ms
    assert c.decode_time(100, 1_000) == pytest.approx(11e-3)
    gpu = 1e-3 + 40e-6 + 0.1e-3 + 2 * 10 * (1000 * 2 / 1e11 + 1e-6)
    assert c.decode_time(1, 1_000) == pytest.approx(max(gpu, 1.1e-3))


def test_layer_latency_by_op_class_and_dsa_index_scan():
    c = toy(moe=True, moe_layers=8, n_experts=0, mla=True, topk=100, index_bytes_gpu=100.0,
            static_bytes=0.0, t=1)
    # 10 layers x (10 + 30 MLA + 40 DSA) us + 8 MoE layers x 20 us = 0.96 ms
    assert c._layer_latency(10, 8) == pytest.approx(0.96e-3)
    # DSA: latents of min(ctx, batch x topk) = 200 tokens at eta_kv_mla 0.5; index keys of the
    # whole 5,000-token context at eta_dsa_index 0.1
    kv = 10 * 200 * 1000 / (0.5 * 1e12) + 10 * 5_000 * 100 / (0.1 * 1e12)
    assert c._kv_read(2, 5_000, 10) == pytest.approx(kv)
    assert c._kv_read(2, 5_000, 10, ideal=True) == pytest.approx(
        10 * 200 * 1000 / 1e12 + 10 * 5_000 * 100 / 1e12)


def test_decode_roofline_is_ideal_and_below_actual():
    c = toy()
    # 8e9 / (2 x 1e12) + 10 x 20,000 x 1000 / 1e12 + 2 x 10 x 0.2 us
    assert c.decode_roofline_time(10, 20_000) == pytest.approx(4e-3 + 0.2e-3 + 4e-6)
    assert c.decode_roofline_time(10, 20_000) < c.decode_time(10, 20_000)


def test_prefill_time_by_hand():
    c = toy()
    # 4000 tokens: compute 4000 x (2e9/0.5e15 + 6e9/0.5e15) / 2 = 32 ms > weights 8 ms
    # attention: 4 x 10 x 4096 x (4000 x 2000 pairs) / (2 x 0.5 x 1e15) = 1.31072 ms
    # all-reduce: 2 x 10 x (4000 x 1000 x 2 / 1e11 + 1 us) = 1.62 ms; layers 0.1 + prefill 2 ms
    expected = 32e-3 + 1.31072e-3 + 1.62e-3 + 0.1e-3 + 2e-3
    assert c.prefill_time(4000, 4000 * 2000, 0.0) == pytest.approx(expected)


def test_verify_time_by_hand():
    c = toy()
    # 8 sequences x 4 draft tokens = 32 tokens: still weight-bound (8 ms); KV read once per
    # sequence (10 x 16,000 x 1000 / 0.25e12 = 0.64 ms) plus the 3 extra query tokens'
    # attention FLOPs: 4 x 10 layers x 4096 x 3 x 16,000 pairs / (2 x 0.5 x 1e15) = 7.864 us;
    # all-reduce at 32 tokens
    ar = 2 * 10 * (32 * 1000 * 2 / 1e11 + 1e-6)
    attn = 0.64e-3 + 4 * 10 * 4096 * 3 * 16_000 / (2 * 0.5 * 1e15)
    assert c.verify_time(8, 4, 16_000) == pytest.approx(8e-3 + attn + ar + 0.1e-3)
    assert c.verify_time(8, 1, 16_000) == pytest.approx(c.decode_time(8, 16_000))


def test_dsa_verify_prices_every_draft_token():
    # DSA toy: top-k 100 latents per query token, index keys 100 B per token per layer
    c = toy(topk=100, index_bytes_gpu=100.0, mla=True)
    ctx, b = 16_000, 8  # 2,000 cached tokens per sequence > top-k
    latent = 10 * b * 100 * 1000 / (0.5 * 1e12)  # decode: 8 x 100 latents, eta_kv_mla 0.5
    index = 10 * ctx * 100 / (0.1 * 1e12)        # decode: the whole context's index keys
    assert c._kv_read(b, ctx, 10) == pytest.approx(latent + index)
    r = c.eff.spec_index_query_share
    # verify at 4 tokens: 4 sparse gathers per sequence, indexer (1 - r + 4 r) x decode
    assert c._verify_attention(b, 4, ctx, 10) == pytest.approx(
        4 * latent + index * (1 - r + 4 * r))
    assert c._verify_attention(b, 1, ctx, 10) == pytest.approx(c._kv_read(b, ctx, 10))


def test_mla_verify_pays_absorbed_attention_flops_per_extra_query():
    # MLA toy: KV read once (as decode) + 3 extra queries x 16,000 pairs x 10 layers x the
    # absorbed pair FLOPs 1e5 / (2 GPUs x eta_attn 0.5 x 1e15)
    c = toy(mla=True, decode_pair_flops=1e5)
    assert c._verify_attention(8, 4, 16_000, 10) == pytest.approx(
        c._kv_read(8, 16_000, 10) + 10 * 1e5 * 3 * 16_000 / (2 * 0.5 * 1e15))
    ds = ServingConfig(model="deepseek-v3", gpu="H200", tp_size=8, weights="fp8")
    m = get_model("deepseek-v3")  # 128 heads x (2 x 512 + 64): 278,528 FLOPs per pair
    assert build_cost_model(ds, fit(ds)).decode_pair_flops == 2 * m.heads * (
        2 * m.kv_lora_rank + m.qk_rope_head_dim) == 278_528


def test_moe_tile_term_by_hand():
    eff = replace(EFF, moe_gemm_half_tokens=10.0)
    c = toy(moe=True, n_experts=4, top_k=2, moe_layers=1, expert_bytes=1e9, expert_params=1e9,
            eff=eff)
    # 2 tokens touch 3 experts; each pays 10 extra rows of 2 x 1e9 FLOPs at 0.25 x 1e15 on 2 GPUs
    assert c._moe_tile(2, 1) == pytest.approx(2e9 * 10 * 3 / (2 * 1e15 * 0.25))
    # the efficiency form: routed rows n k = 4 at eta x m / (m + h), m = 4 / 3 rows per expert
    m = 4 / 3
    routed = 4 * 2e9 / (2 * 1e15 * 0.25)
    assert routed / (m / (m + 10)) == pytest.approx(routed + c._moe_tile(2, 1))
    assert toy()._moe_tile(100, 10) == 0.0  # dense: no tile term
    assert c._linear(2, ideal=True) < c._linear(2)


def test_draft_time_by_hand():
    assert toy().draft_time(8, 3, 1) == 0.0  # no MTP layer
    c = toy(mtp_layers=1, draft_static_bytes=1e9, draft_flops_per_token=1e9)
    # steps - 1 = 2 draft decode forwards at 8 tokens: 1e9 B / (2 x 0.5 x 1e12) = 1 ms; KV 1
    # layer x 8000 x 1000 / 0.25e12 = 32 us; all-reduce 2 x (8 x 1000 x 2 / 1e11 + 1 us);
    # layer latency 10 us. One draft extend over the 4-token window: 1 ms weights, KV 32 us +
    # 3 extra queries x 8000 pairs x 4 x 4096 / (2 x 0.5e15), all-reduce at 32 tokens, 10 us
    one = 1e-3 + 32e-6 + 2 * (8 * 1000 * 2 / 1e11 + 1e-6) + 1e-5
    ext = (1e-3 + 32e-6 + 3 * 8000 * 4 * 4096 / (2 * 0.5e15)
           + 2 * (32 * 1000 * 2 / 1e11 + 1e-6) + 1e-5)
    assert c.draft_time(8, 3, 1, context_sum=8_000) == pytest.approx(2 * one + ext)
    assert c.draft_time(8, 3, 1, 8_000, 4) == c.draft_time(8, 3, 1, 8_000)
    assert c.draft_time(8, 1, 1, 8_000) == pytest.approx(
        1e-3 + 32e-6 + 8000 * 4 * 4096 / (2 * 0.5e15) + 2 * (16 * 1000 * 2 / 1e11 + 1e-6)
        + 1e-5)  # one step: the extend over 2 tokens only


def test_host_load_time_by_hand():
    # 1,000 tokens x 10,000 B / 50 GB/s = 0.2 ms
    assert toy().host_load_time(1_000) == pytest.approx(2e-4)


def test_moe_touched_experts_and_moe_efficiency():
    c = toy(moe=True, n_experts=4, top_k=2, moe_layers=1, expert_bytes=1e9, static_bytes=0.0)
    # 1 token touches 2 of 4 experts; 2 tokens 4 x (1 - 0.5^2) = 3
    assert c._touched(1) == 2.0 and c._touched(2) == 3.0
    # weights 3e9 / (2 x 0.5 x 1e12) = 3 ms; MLP compute uses eta_compute_moe (0.25)
    assert c._linear(2) == pytest.approx(3e-3)
    assert c.eta_mlp == 0.25 and toy().eta_mlp == 0.5
    assert toy(mla=True).eta_kv == 0.5


# ---------------------------------------------------------------- build from a config
def test_build_cost_model_llama_8b_h100_by_hand():
    config = ServingConfig(model="llama-3.1-8b", gpu="H100", tp_size=1, weights="bf16",
                           mem_fraction_static=0.85)
    c = replace(build_cost_model(config, fit(config)), eff=EFF)
    assert c.static_bytes == 16_059_990_016 and c.latent_bytes_gpu == 2 * 8 * 128 * 2
    assert c.f_attn == c.f_mlp == 989e12 and c.host_link == PCIE5_X16_BYTES_PER_S
    # weights 16.06 GB / (0.5 x 3.35 TB/s); KV 32 x 1000 x 4096 B / (0.25 x 3.35 TB/s)
    expected = (16_059_990_016 / (0.5 * 3.35e12) + 32 * 1000 * 4096 / (0.25 * 3.35e12)
                + 32 * 1e-5)
    assert c.decode_time(1, 1000) == pytest.approx(expected)


def test_build_cost_model_draft_head_glm5():
    config = ServingConfig(model="glm-5", gpu="B200", tp_size=8, weights="fp8")
    c = build_cost_model(config, fit(config))
    m = get_model("glm-5")
    assert c.mtp_layers == 1 and c.draft_moe
    mp = m.mtp_params_per_layer
    lm_head = m.vocab * m.hidden
    shared = m.n_shared_experts * m.expert_params
    assert c.draft_static_bytes == pytest.approx(
        (mp["attention"] + shared) * FP8_BLOCK + mp["glue"] * 2 + lm_head * 2)
    assert 0 < c.draft_time(4, 3, 1, 4000) < c.decode_time(4, 4000)
