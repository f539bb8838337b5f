"""Model architecture catalog: layer shapes, parameter counts and shipped checkpoints.

Architectures are read from Hugging Face ``config.json`` files (the hub is never contacted: the
files ship under ``data/models/`` or are given as a local path). Parameter counts are computed from
the shapes, so they can be checked against the published totals.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path

from domain.checkpoints import BF16, FP8_BLOCK, FP8_TENSOR, NVFP4, Checkpoint, build_checkpoint
from domain.errors import ConfigInvalid
from domain.model_arch import ModelArch
from domain.model_catalog import MODELS_DIR, catalog, catalog_model
from domain.model_families import arch_from_hf_config
from domain.quant import read_scheme, scheme_for_key

__all__ = ["BF16", "FP8_BLOCK", "FP8_TENSOR", "NVFP4", "MODELS_DIR", "Checkpoint", "ModelArch",
           "arch_from_hf_config", "model_from_path", "register_model", "get_model"]

# catalog key -> its entry in data/models/catalog.json (config file, release, stated totals,
# checkpoints); see domain/model_catalog.py
CATALOG: dict[str, dict[str, object]] = catalog()


_REGISTERED: dict[str, ModelArch] = {}


def register_model(arch: ModelArch) -> ModelArch:
    """Make ``arch`` (a user's model) known to :func:`get_model` under ``arch.name``.

    Process-wide; a catalog entry of the same name is shadowed. The name also joins
    :data:`MODELS` (so a ``ServingConfig`` naming it validates). Returns ``arch``.
    """
    _REGISTERED[arch.name] = arch
    MODELS[arch.name] = partial(load_model, arch.name)
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
            bytes from that config -- or, when the directory holds a
            ``model.safetensors.index.json``, its exact ``metadata.total_size`` -- the others use
            the key's default recipe. Default: one checkpoint, the directory's own precision,
            with the directory as its model path.

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
    exact = _index_total_size(directory) if p.is_dir() else None
    built = {}
    for key, hub_id in wanted.items():
        scheme = own if own is not None and key == own_key else scheme_for_key(key)
        ck = build_checkpoint(arch, str(hub_id), scheme)
        if exact is not None and key == own_key:
            ck = ck.model_copy(update={"exact_total_bytes": exact, "source": ck.source
                                       + "; weight bytes: model.safetensors.index.json "
                                       f"total_size {exact:,.0f}"})
        built[key] = ck
    return arch.model_copy(update={"checkpoints": built})


def _index_total_size(directory: Path) -> float | None:
    """``metadata.total_size`` (bytes) of ``directory/model.safetensors.index.json``, if any.

    Raises:
        ConfigInvalid: the index is unreadable or its total_size is not a positive number.
    """
    p = directory / "model.safetensors.index.json"
    if not p.is_file():
        return None
    try:
        total = json.loads(p.read_text())["metadata"]["total_size"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigInvalid([f"{p}: cannot read metadata.total_size ({e})"]) from None
    if not isinstance(total, (int, float)) or isinstance(total, bool) or total <= 0:
        raise ConfigInvalid([f"{p}: metadata.total_size {total!r} is not a positive byte count"])
    return float(total)


def load_model(name: str) -> ModelArch:
    """Return model ``name``: a registered one (:func:`register_model`), else the catalog's.

    Catalog models are built from their shipped config.json with their checkpoints attached.

    Raises:
        ConfigInvalid: unknown name, or a config missing a required key.
    """
    if name in _REGISTERED:
        return _REGISTERED[name]
    return catalog_model(name)


def glm5() -> ModelArch:
    """GLM-5 from the catalog (its checkpoints: ``data/models/catalog.json``)."""
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
