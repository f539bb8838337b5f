"""The shipped catalog against its sources, KV bytes per family and checkpoint bytes by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import domain.models as dm
from domain.config import ServingConfig
from domain.errors import ConfigInvalid
from domain.fit import fit
from domain.model_arch import MAMBA_FULL_MEMORY_RATIO, SWA_FULL_TOKENS_RATIO
from domain.model_catalog import catalog
from domain.models import MODELS_DIR, get_model, model_from_path, register_model
from domain.quant import (
    PRECISION_KEYS,
    fp8_block_bytes,
    int4_bytes,
    mxfp4_bytes,
    nvfp4_bytes,
    scheme_from_quantization_config,
)

ENTRIES = catalog()
QUANT_SUFFIXES = ("", "-BF16", "-FP8", "-NVFP4", "-FP4")


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_total_params_within_3_percent_of_the_stated_total(name: str) -> None:
    stated = ENTRIES[name]["stated"]
    assert stated["url"].startswith("https://")
    m = get_model(name)
    assert m.total_params == pytest.approx(stated["total_params"], rel=0.03), stated


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_every_entry_s_checkpoints_are_one_release(name: str) -> None:
    """A winner never switches the release: every hub id is the release or its quantization."""
    release = ENTRIES[name]["release"]
    for key, ck in get_model(name).checkpoints.items():
        repo = ck.model_path.split("/", 1)[1]
        assert repo.startswith(release) and repo[len(release):] in QUANT_SUFFIXES, (key, repo)


def test_qwen3_235b_fp8_is_the_2507_release() -> None:
    m = get_model("qwen3-235b-a22b")
    assert m.checkpoints["fp8"].model_path == "Qwen/Qwen3-235B-A22B-Instruct-2507-FP8"
    assert m.checkpoints["bf16"].model_path == "Qwen/Qwen3-235B-A22B-Instruct-2507"


# ------------------------------------------------------------------ KV bytes, one model a family
def test_kv_gqa_qwen3_30b_a3b() -> None:
    # 48 layers x (K, V) x 4 KV heads x 128 dims x 2 bytes
    assert get_model("qwen3-30b-a3b").kv_bytes_per_token(2, 1) == 48 * 2 * 4 * 128 * 2 == 98_304


def test_kv_mla_kimi_k2() -> None:
    # 61 layers x (kv_lora_rank 512 + rope 64) x 2 bytes, replicated on every rank
    m = get_model("kimi-k2-instruct")
    assert m.kv_bytes_per_token(2, 8) == m.kv_bytes_per_token(2, 1) == 61 * 576 * 2 == 70_272


def test_kv_dsa_deepseek_v32() -> None:
    # the latent plus the indexer key: 128 fp8 bytes + one fp32 scale per layer
    assert get_model("deepseek-v3.2").kv_bytes_per_token(2, 1) == 61 * (576 * 2 + 132)


def test_kv_alternating_sliding_window_gpt_oss() -> None:
    m = get_model("gpt-oss-120b")
    assert (m.count_layers("full"), m.count_layers("sliding"), m.sliding_window) == (18, 18, 128)
    per_layer = 2 * 8 * 64 * 2  # K, V x 8 KV heads x 64 dims x bf16
    assert SWA_FULL_TOKENS_RATIO == 0.8
    assert m.kv_bytes_per_token(2, 1) == pytest.approx(18 * per_layer + 0.8 * 18 * per_layer)
    assert m.kv_bytes_per_token(2, 1) == pytest.approx(66_355.2)


def test_kv_and_state_hybrid_linear_attention_qwen35() -> None:
    m = get_model("qwen3.5-397b-a17b")
    assert (m.count_layers("full"), m.count_layers("linear")) == (15, 45)
    assert m.kv_bytes_per_token(2, 1) == 15 * 2 * 2 * 256 * 2 == 30_720
    # per linear layer: conv (64 x 128 + 2 x 16 x 128) x (4 - 1) bf16 + SSM 64 x 128 x 128 fp32
    per_layer = (64 * 128 + 2 * 16 * 128) * 3 * 2 + 64 * 128 * 128 * 4
    assert m.recurrent_state_bytes(1) == 45 * per_layer == 192_061_440
    assert m.recurrent_state_bytes(8) == 45 * per_layer / 8


def test_kv_and_state_hybrid_mamba_nemotron() -> None:
    m = get_model("nemotron-3-nano-30b-a3b")
    assert (m.count_layers("full"), m.count_layers("mamba"), m.moe_layers) == (6, 23, 23)
    assert m.kv_bytes_per_token(2, 1) == 6 * 2 * 2 * 128 * 2 == 6_144
    per_layer = (64 * 64 + 2 * 8 * 128) * 3 * 2 + 64 * 64 * 128 * 4
    assert m.recurrent_state_bytes(1) == 23 * per_layer == 49_082_368


def test_multimodal_vision_weights_count_but_not_kv() -> None:
    m = get_model("qwen3-vl-235b-a22b")
    h, inter, merge = 1152, 4304, 4 * 1152
    vision = (27 * (4 * h * h + 2 * h * inter) + 3 * 2 * 16 * 16 * h + 2304 * h
              + 4 * (merge * merge + merge * 4096))
    assert m.vision_params == vision
    assert m.param_groups()["vision"] == vision
    assert m.total_params == get_model("qwen3-235b-a22b").total_params + vision
    assert m.kv_bytes_per_token(2, 1) == get_model("qwen3-235b-a22b").kv_bytes_per_token(2, 1)
    assert m.weight_bytes("bf16") == 2 * m.total_params


def test_state_pool_takes_its_share_of_the_room() -> None:
    """fit: the KV pool gets room / (1 + 0.9), the states the rest, capping the requests."""
    rep = fit(ServingConfig(model="nemotron-3-nano-30b-a3b", gpu="H200", tp_size=1,
                            weights="bf16"))
    m = get_model("nemotron-3-nano-30b-a3b")
    room = rep.mem_fraction_static * rep.gpu_bytes - rep.weight_bytes_per_gpu
    slots = int(room * 0.9 / 1.9 // m.recurrent_state_bytes(1))
    assert MAMBA_FULL_MEMORY_RATIO == 0.9
    assert rep.kv_pool_bytes_per_gpu == pytest.approx(room - slots * m.recurrent_state_bytes(1))
    assert rep.max_running_requests <= slots
    assert "recurrent states" in rep.arithmetic


# ------------------------------------------------------------------ checkpoint bytes by format
def test_bytes_per_parameter_of_each_format() -> None:
    assert fp8_block_bytes() == 1 + 4 / 16_384
    assert nvfp4_bytes() == 0.5 + 1 / 16
    assert mxfp4_bytes() == 0.5 + 1 / 32
    assert int4_bytes(128) == 0.5 + 2 / 128 + 0.5 / 128          # AWQ/GPTQ: fp16 scale + zero
    assert int4_bytes(32, zero_point=False) == 0.5 + 2 / 32      # W4A16 symmetric, bf16 scale
    awq = scheme_from_quantization_config(
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}, "t")
    gptq = scheme_from_quantization_config(
        {"quant_method": "gptq", "bits": 4, "group_size": 64}, "t")
    assert (awq.key, awq.quantization, awq.bytes_per_param) == ("int4-awq", "awq", int4_bytes(128))
    assert (gptq.key, gptq.quantization, gptq.bytes_per_param) == ("int4-gptq", "gptq",
                                                                   int4_bytes(64))
    assert set(PRECISION_KEYS) >= {"bf16", "fp8", "fp8-tensor", "nvfp4", "mxfp4", "int4-awq",
                                   "int4-gptq", "w4a16"}


def test_gpt_oss_mxfp4_experts_and_bf16_rest() -> None:
    m = get_model("gpt-oss-120b")
    experts = 36 * 128 * 3 * 2880 * 2880
    rest = m.total_params - experts  # attention, routers, embed + lm_head: bf16
    assert m.weight_bytes("mxfp4") == pytest.approx(experts * (0.5 + 1 / 32) + rest * 2)
    assert m.checkpoint("mxfp4").quantization == "mxfp4"


def test_kimi_k2_thinking_int4_routed_experts_only() -> None:
    m = get_model("kimi-k2-thinking")
    routed = 60 * 384 * 3 * 7168 * 2048
    rest = m.total_params - routed  # attention, shared experts, dense layer, routers, embed
    ck = m.checkpoint("w4a16")
    assert (ck.quantization, ck.compute_dtype) == ("compressed-tensors", "bf16")
    assert m.weight_bytes("w4a16") == pytest.approx(routed * (0.5 + 2 / 32) + rest * 2)


def test_nvfp4_exclusions_per_module_deepseek_v32() -> None:
    """nvidia/DeepSeek-V3.2-NVFP4 excludes q/kv projections and the indexer, not o_proj."""
    m = get_model("deepseek-v3.2")
    a = m.attention_params_per_layer
    o = 128 * 128 * 7168
    assert m.checkpoint("nvfp4").bytes_per_param["attention"] == pytest.approx(
        (o * nvfp4_bytes() + (a - o) * 2) / a)
    assert m.checkpoint("nvfp4").mtp_bytes_per_param is not None  # model.layers.61* excluded


def test_safetensors_total_size_overrides_the_computed_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # registered process-wide: undone at teardown so no other test sees the name
    monkeypatch.setitem(dm.MODELS, "my-qwen3-30b", None)
    monkeypatch.setitem(dm._REGISTERED, "my-qwen3-30b", None)
    (tmp_path / "config.json").write_text((MODELS_DIR / "Qwen--Qwen3-30B-A3B_config.json")
                                          .read_text())
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 61_064_000_000}, "weight_map": {}}))
    m = register_model(model_from_path(tmp_path, name="my-qwen3-30b"))
    assert m.weight_bytes("bf16") == 61_064_000_000
    assert "total_size" in m.checkpoint("bf16").source
    rep = fit(ServingConfig(model="my-qwen3-30b", gpu="H200", tp_size=1, weights="bf16"))
    assert "model.safetensors.index.json total_size" in rep.arithmetic


def test_bad_safetensors_index_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((MODELS_DIR / "Qwen--Qwen3-30B-A3B_config.json")
                                          .read_text())
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {"total_size": -1}}')
    with pytest.raises(ConfigInvalid) as e:
        model_from_path(tmp_path)
    (line,) = e.value.violations
    assert "total_size" in line


# ------------------------------------------------------------------ refused configs: one line
def test_deepseek_v4_is_refused_naming_its_family() -> None:
    with pytest.raises(ConfigInvalid) as e:
        model_from_path(MODELS_DIR / "deepseek-ai--DeepSeek-V4-Flash_config.json")
    (line,) = e.value.violations
    assert "deepseek_v4" in line and "not a modelled family" in line


def test_unknown_model_type_is_one_line(tmp_path: Path) -> None:
    cfg = json.loads((MODELS_DIR / "Qwen--Qwen3-30B-A3B_config.json").read_text())
    cfg["model_type"] = "rwkv7"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigInvalid) as e:
        model_from_path(tmp_path)
    (line,) = e.value.violations
    assert "'rwkv7' is not a supported family" in line and "qwen3_moe" in line


def test_multimodal_missing_text_field_names_it(tmp_path: Path) -> None:
    cfg = json.loads((MODELS_DIR / "Qwen--Qwen3-VL-235B-A22B-Instruct_config.json").read_text())
    del cfg["text_config"]["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigInvalid) as e:
        model_from_path(tmp_path)
    (line,) = e.value.violations
    assert "missing key 'vocab_size'" in line


def test_summary_of_a_hybrid_model() -> None:
    s = get_model("qwen3.5-397b-a17b").summary()
    assert s["architecture"] == "Qwen3_5MoeForConditionalGeneration"
    assert s["kv_bytes_per_token_bf16"] == 30_720
    # 32 query heads, 2 KV heads, 64 linear value heads: 32 divides all three ways
    assert s["max_tp"] == 32


def test_gemma3_sliding_window_pattern_by_hand(tmp_path: Path) -> None:
    """A Gemma-3-shaped config: 1 full layer in 6, the other 5 sliding (window 1024)."""
    cfg = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
           "num_hidden_layers": 12, "hidden_size": 640, "num_attention_heads": 4,
           "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 1000,
           "max_position_embeddings": 32768, "intermediate_size": 2048,
           "sliding_window": 1024, "sliding_window_pattern": 6, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = model_from_path(tmp_path)
    assert (m.count_layers("full"), m.count_layers("sliding")) == (2, 10)
    per_layer = 2 * 1 * 256 * 2
    assert m.kv_bytes_per_token(2, 1) == pytest.approx(2 * per_layer + 0.8 * 10 * per_layer)
    assert m.param_groups()["embed"] == 1000 * 640  # tied: counted once


def test_gemma4_is_refused_naming_why(tmp_path: Path) -> None:
    cfg = {"model_type": "gemma4", "text_config": {}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigInvalid) as e:
        model_from_path(tmp_path)
    (line,) = e.value.violations
    assert "gemma4" in line and "global_head_dim" in line
