"""model_from_path: a local config.json (or its directory) with explicit checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from domain.errors import ConfigInvalid
from domain.models import MODELS, MODELS_DIR, get_model, model_from_path
from domain.quant import fp8_block_bytes


def _dir(tmp_path: Path, cfg_file: str, quant: str | None = None) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text((MODELS_DIR / cfg_file).read_text())
    if quant:
        (d / "hf_quant_config.json").write_text((MODELS_DIR / quant).read_text())
    return d


def test_checkpoints_map_weights_keys_to_hub_ids(tmp_path: Path) -> None:
    d = _dir(tmp_path, "Qwen--Qwen3-235B-A22B-FP8_config.json")
    m = model_from_path(d, name="q", checkpoints={
        "bf16": "Qwen/Qwen3-235B-A22B-Instruct-2507",
        "fp8": "Qwen/Qwen3-235B-A22B-Instruct-2507-FP8"})
    assert m.name == "q" and set(m.checkpoints) == {"bf16", "fp8"}
    bf16, fp8 = m.checkpoints["bf16"], m.checkpoints["fp8"]
    assert (bf16.model_path, bf16.quantization) == ("Qwen/Qwen3-235B-A22B-Instruct-2507", None)
    assert (fp8.model_path, fp8.quantization) == ("Qwen/Qwen3-235B-A22B-Instruct-2507-FP8", "fp8")
    # the directory's own quantization_config: routers (mlp.gate) stay bf16, so the experts
    # group is a little over 1 + 4/16384 bytes per parameter; attention is exactly that
    assert fp8.bytes_per_param["attention"] == fp8_block_bytes()
    g = get_model("qwen3-235b-a22b")
    router = g.moe_layers * g.hidden * g.n_routed_experts
    experts = g.param_groups()["experts"]
    assert fp8.bytes_per_param["experts"] == pytest.approx(
        ((experts - router) * fp8_block_bytes() + router * 2) / experts)
    assert m.weight_bytes("bf16") == 2 * m.total_params


def test_without_checkpoints_the_directory_is_its_own_checkpoint(tmp_path: Path) -> None:
    d = _dir(tmp_path, "zai-org--GLM-5_config.json",
             quant="nvidia--GLM-5-NVFP4_hf_quant_config.json")
    m = model_from_path(d)
    assert m.name == "m" and list(m.checkpoints) == ["nvfp4"]
    ck = m.checkpoints["nvfp4"]
    assert (ck.model_path, ck.quantization, ck.compute_dtype) == (str(d.resolve()),
                                                                  "modelopt_fp4", "fp4")
    catalog = get_model("glm-5").checkpoints["nvfp4"]
    # the same recipe read from its exclude_modules: attention + indexer and the MTP layer bf16
    assert ck.bytes_per_param["attention"] == catalog.bytes_per_param["attention"] == 2.0
    assert ck.bytes_per_param["experts"] == pytest.approx(catalog.bytes_per_param["experts"],
                                                          rel=1e-4)
    assert ck.mtp_bytes_per_param is not None and ck.mtp_bytes_per_param["experts"] == 2.0


def test_unknown_weights_key_is_one_line(tmp_path: Path) -> None:
    d = _dir(tmp_path, "Qwen--Qwen3-32B_config.json")
    with pytest.raises(ConfigInvalid) as e:
        model_from_path(d, checkpoints={"fp6": "x/y"})
    (line,) = e.value.violations
    assert "fp6" in line and "nvfp4" in line


def test_summary_keys_and_max_tp() -> None:
    s = get_model("llama-3.1-8b").summary()
    assert s == {"architecture": "LlamaForCausalLM", "layers": 32,
                 "total_params": 8_029_995_008, "active_params": 7_504_658_432,
                 "kv_bytes_per_token_bf16": 32 * 2 * 8 * 128 * 2, "max_tp": 32}
    assert get_model("deepseek-v3").max_tp == 128  # num_heads % tp (deepseek_v2.py:2057)


def test_modules_sum_to_param_groups() -> None:
    for name in MODELS:
        m = get_model(name)
        by_group: dict[str, int] = {}
        for _, g, p in m.modules():
            by_group[g] = by_group.get(g, 0) + p
        assert by_group == {g: n for g, n in m.param_groups().items() if n}, name


def test_missing_field_one_line(tmp_path: Path) -> None:
    cfg = json.loads((MODELS_DIR / "Qwen--Qwen3-32B_config.json").read_text())
    del cfg["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigInvalid) as e:
        model_from_path(tmp_path)
    assert len(e.value.violations) == 1 and "num_hidden_layers" in e.value.violations[0]


@pytest.mark.parametrize("key, value, needle", [
    ("num_hidden_layers", -4, "num_hidden_layers = -4: must be a whole number >= 1"),
    ("num_attention_heads", 0, "num_attention_heads = 0: must be a whole number >= 1"),
    ("num_hidden_layers", "16", "num_hidden_layers = '16': must be a whole number >= 1"),
    ("hidden_size", 5120.5, "hidden_size = 5120.5: must be a whole number >= 1"),
    ("num_key_value_heads", 7, "num_key_value_heads = 7 does not divide num_attention_heads = 64"),
    ("num_key_value_heads", -8, "num_key_value_heads = -8: must be a whole number >= 1"),
])
def test_impossible_shapes_are_one_line(tmp_path: Path, key: str, value: object,
                                        needle: str) -> None:
    """A size or count that no model has (negative layers, no heads, a number written as a
    string, KV heads that do not group the query heads) is refused by name, not sized."""
    cfg = json.loads((MODELS_DIR / "Qwen--Qwen3-32B_config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, key: value}))
    with pytest.raises(ConfigInvalid) as e:
        model_from_path(tmp_path)
    assert len(e.value.violations) == 1 and needle in e.value.violations[0], e.value.violations


def test_find_checkpoint_knows_the_new_releases() -> None:
    from domain.models import find_checkpoint

    assert find_checkpoint("openai/gpt-oss-120b") == ("gpt-oss-120b", "mxfp4")
    assert find_checkpoint("/models/Kimi-K2-Thinking") == ("kimi-k2-thinking", "w4a16")
    assert find_checkpoint("Qwen/Qwen3-235B-A22B-Instruct-2507-FP8") == ("qwen3-235b-a22b", "fp8")
    # one repo, two checkpoints: --quantization fp8 picks SGLang's online FP8 of the bf16 release
    assert find_checkpoint("mistralai/Mixtral-8x7B-Instruct-v0.1", "fp8") == ("mixtral-8x7b",
                                                                              "fp8")
    assert find_checkpoint("mistralai/Mixtral-8x7B-Instruct-v0.1") == ("mixtral-8x7b", "bf16")
