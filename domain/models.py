"""Model architecture catalog: layer shapes, parameter counts and shipped checkpoints.

Architectures are read from Hugging Face ``config.json`` files (the hub is never contacted: the
files ship under ``data/models/`` or are given as a local path). Parameter counts are computed from
the shapes, so they can be checked against the published totals.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from functools import cache, partial
from pathlib import Path
from typing import Any

from domain.checkpoints import (
    BF16,
    FP8_BLOCK,
    FP8_TENSOR,
    NVFP4,
    Checkpoint,
    _deepseek_r1,
    _deepseek_v3,
    _glm5,
    _llama_8b,
    _llama_70b,
    _qwen3_32b,
    _qwen3_235b,
    build_checkpoint,
)
from domain.errors import ConfigInvalid
from domain.model_arch import AttentionKind, ModelArch
from domain.quant import read_scheme, scheme_for_key

__all__ = ["BF16", "FP8_BLOCK", "FP8_TENSOR", "NVFP4", "Checkpoint", "ModelArch",
           "model_from_path", "register_model", "get_model"]

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "data" / "models"

def arch_from_hf_config(name: str, cfg: dict[str, Any], source: str) -> ModelArch:
    """Build a ModelArch from a Hugging Face ``config.json`` dict.

    Raises:
        ConfigInvalid: if a required key is missing.
    """
    try:
        mla = bool(cfg.get("kv_lora_rank"))
        attention: AttentionKind = ("dsa" if cfg.get("index_topk") else "mla") if mla else "gqa"
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("v_head_dim") if mla else cfg.get("head_dim",
                                                             cfg["hidden_size"] // heads)
        return ModelArch(
            name=name,
            attention=attention,
            architecture=(cfg.get("architectures") or [""])[0],
            layers=cfg["num_hidden_layers"],
            hidden=cfg["hidden_size"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=head_dim,
            qk_head_dim=(cfg.get("qk_head_dim")
                         or cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) if mla
            else head_dim,
            vocab=cfg["vocab_size"],
            context_len=cfg["max_position_embeddings"],
            intermediate=cfg["intermediate_size"],
            first_k_dense=cfg.get("first_k_dense_replace", 0),
            n_routed_experts=cfg.get("n_routed_experts", cfg.get("num_experts", 0)) or 0,
            experts_per_tok=cfg.get("num_experts_per_tok", 0) or 0,
            n_shared_experts=cfg.get("n_shared_experts", 0) or 0,
            moe_intermediate=cfg.get("moe_intermediate_size", 0) or 0,
            q_lora_rank=cfg.get("q_lora_rank") or 0,
            kv_lora_rank=cfg.get("kv_lora_rank") or 0,
            qk_rope_head_dim=cfg.get("qk_rope_head_dim") or 0,
            index_head_dim=cfg.get("index_head_dim") or 0,
            index_n_heads=cfg.get("index_n_heads") or 0,
            index_topk=cfg.get("index_topk") or 0,
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mtp_layers=cfg.get("num_nextn_predict_layers") or 0,
            source=source,
        )
    except KeyError as e:
        raise ConfigInvalid([f"model config {source}: missing key {e.args[0]!r}"]) from e


# catalog key -> (HF config.json under data/models/, checkpoints of that architecture)
CATALOG: dict[str, tuple[str, Callable[[ModelArch], dict[str, Checkpoint]]]] = {
    "llama-3.1-8b": ("meta-llama--Meta-Llama-3.1-8B_config.json", _llama_8b),
    "llama-3.1-70b": ("meta-llama--Meta-Llama-3.1-70B_config.json", _llama_70b),
    "qwen3-32b": ("Qwen--Qwen3-32B_config.json", _qwen3_32b),
    "qwen3-235b-a22b": ("Qwen--Qwen3-235B-A22B_config.json", _qwen3_235b),
    "deepseek-v3": ("deepseek-ai--DeepSeek-V3_config.json", _deepseek_v3),
    "deepseek-r1": ("deepseek-ai--DeepSeek-R1_config.json", _deepseek_r1),
    "glm-5": ("zai-org--GLM-5_config.json", _glm5),
}


_REGISTERED: dict[str, ModelArch] = {}


def register_model(arch: ModelArch) -> ModelArch:
    """Make ``arch`` (a user's model) known to :func:`get_model` under ``arch.name``.

    Process-wide; a catalog entry of the same name is shadowed. Returns ``arch``.
    """
    _REGISTERED[arch.name] = arch
    return arch


def model_from_path(path: str | Path, *, name: str | None = None,
                    checkpoints: Mapping[str, str] | None = None) -> ModelArch:
    """Read a model from a local Hugging Face ``config.json`` (or a directory holding one).

    Args:
        path: the config.json, or its directory (which may also hold ``hf_quant_config.json``
            and ``model.safetensors.index.json``).
        name: the model's name in servetune (default: the directory's name).
        checkpoints: weights key -> Hugging Face hub id (the ``--model-path`` SGLang is given),
            e.g. ``{"bf16": "Qwen/Qwen3-30B-A3B", "fp8": "Qwen/Qwen3-30B-A3B-FP8"}``. Keys are
            precisions (:data:`domain.quant.PRECISION_KEYS`: bf16, fp8, fp8-tensor, nvfp4,
            mxfp4, int4-awq, int4-gptq, w4a16). The key matching the directory's own
            quantization (its ``quantization_config`` or ``hf_quant_config.json``) takes its
            bytes from that config; the others use the key's default recipe. Default: one
            checkpoint, the directory's own precision, with the directory as its model path.

    Raises:
        ConfigInvalid: a missing or unreadable file, a config missing a required key or of an
            unsupported family, an unknown weights key, an unmodelled quantization format.
    """
    p = Path(path)
    cfg_path = p / "config.json" if p.is_dir() else p
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigInvalid([f"model config {cfg_path}: cannot read it ({e})"]) from None
    if not isinstance(cfg, dict):
        raise ConfigInvalid([f"model config {cfg_path}: expected a JSON object"])
    directory = cfg_path.resolve().parent
    arch = arch_from_hf_config(name or directory.name, cfg, source=str(cfg_path))
    own = read_scheme(cfg, directory, str(cfg_path))
    own_key = own.key if own else "bf16"
    wanted = dict(checkpoints) if checkpoints else {own_key: str(directory)}
    built = {}
    for key, hub_id in wanted.items():
        scheme = own if own is not None and key == own_key else scheme_for_key(key)
        built[key] = build_checkpoint(arch, str(hub_id), scheme)
    return arch.model_copy(update={"checkpoints": built})


@cache
def _load_catalog_model(name: str) -> ModelArch:
    if name not in CATALOG:
        raise ConfigInvalid([f"model: unknown model {name!r}; known: {', '.join(CATALOG)}"])
    filename, checkpoints = CATALOG[name]
    path = MODELS_DIR / filename
    arch = arch_from_hf_config(name, json.loads(path.read_text()), source=filename)
    return arch.model_copy(update={"checkpoints": checkpoints(arch)})


def load_model(name: str) -> ModelArch:
    """Return model ``name``: a registered one (:func:`register_model`), else the catalog's.

    Catalog models are built from their shipped config.json with their checkpoints attached.

    Raises:
        ConfigInvalid: unknown name, or a config missing a required key.
    """
    if name in _REGISTERED:
        return _REGISTERED[name]
    return _load_catalog_model(name)


def glm5() -> ModelArch:
    """GLM-5 from the catalog (see :func:`_glm5` for its checkpoints)."""
    return load_model("glm-5")


MODELS: dict[str, Callable[[], ModelArch]] = {
    name: partial(load_model, name) for name in CATALOG
}


def get_model(name: str) -> ModelArch:
    """Return the catalog model ``name``.

    Raises:
        ConfigInvalid: unknown name.
    """
    return load_model(name)


def find_checkpoint(model_path: str, quantization: str | None = None) -> tuple[str, str] | None:
    """``(catalog model, checkpoint key)`` whose ``--model-path`` is ``model_path``, or None.

    ``model_path`` is a Hugging Face repo id (``zai-org/GLM-5-FP8``, matched without regard to
    case) or a local directory named after one (``/models/GLM-5-FP8``: its last part against the
    repo's name). Where one repo backs two checkpoints (a bf16 release and SGLang's online fp8
    of it) ``quantization`` (``--quantization``) picks: the checkpoint passing that value, else
    the one passing none.
    """
    want = model_path.rstrip("/").casefold()
    tail = want.rsplit("/", 1)[-1]
    hits = [(name, key, ckpt) for name in CATALOG for key, ckpt in load_model(name).checkpoints
            .items() if ckpt.model_path.casefold() == want]
    if not hits:
        hits = [(name, key, ckpt) for name in CATALOG for key, ckpt in load_model(name)
                .checkpoints.items() if ckpt.model_path.casefold().rsplit("/", 1)[-1] == tail]
    if len(hits) > 1:
        hits = [h for h in hits if h[2].quantization == quantization] or hits
    return (hits[0][0], hits[0][1]) if hits else None
