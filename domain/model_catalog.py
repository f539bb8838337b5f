"""The shipped model catalog: ``data/models/catalog.json`` read into models with checkpoints.

Each entry names its config.json (a file beside the catalog), the totals its source states (with
the URL; ``tests/unit/test_models_catalog.py`` holds every computed total within 3 % of them)
and its checkpoints: weights key -> Hugging Face hub id and how the bytes are known (a shipped
quantization config, a stated recipe, or the key's format). The field meanings are in the
file's own ``fields`` block.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from domain.checkpoints import BF16, Checkpoint, build_checkpoint
from domain.errors import ConfigInvalid
from domain.model_arch import ModelArch
from domain.model_families import arch_from_hf_config
from domain.quant import (
    QuantScheme,
    scheme_for_key,
    scheme_from_hf_quant_config,
    scheme_from_quantization_config,
)

MODELS_DIR = Path(__file__).resolve().parent.parent / "data" / "models"
CATALOG_FILE = MODELS_DIR / "catalog.json"


@cache
def catalog() -> dict[str, dict[str, Any]]:
    """Catalog key -> its entry (config, release, stated, checkpoints), in file order."""
    doc = json.loads(CATALOG_FILE.read_text())
    models: dict[str, dict[str, Any]] = doc["models"]
    return models


def _scheme(spec: Mapping[str, Any], key: str) -> QuantScheme:
    """The storage scheme of one catalog checkpoint (see the catalog's ``fields``)."""
    fmt = spec.get("format", key)
    if "quant_config" in spec:
        name = spec["quant_config"]
        doc = json.loads((MODELS_DIR / name).read_text())
        scheme = scheme_from_hf_quant_config(doc, name) if "quantization" in doc \
            else scheme_from_quantization_config(doc["quantization_config"], name)
    elif "recipe" in spec:
        r = spec["recipe"]
        scheme = scheme_from_hf_quant_config(r, "catalog recipe") if "quantization" in r \
            else scheme_from_quantization_config(r, "catalog recipe")
    else:
        scheme = scheme_for_key(fmt)
    update: dict[str, Any] = {"source": spec["source"]}
    if "quantization" in spec:
        update["quantization"] = spec["quantization"]
    return scheme.model_copy(update=update)


def _uniform(arch: ModelArch, hub_id: str, spec: Mapping[str, Any],
             scheme: QuantScheme) -> Checkpoint:
    """A checkpoint whose linear groups all take the format's bytes (embeddings bf16).

    ``bf16_groups`` stay bf16; ``attention: o_proj-only`` quantizes only o_proj, the other
    projections bf16, weighted by their shapes (DeepSeek NVFP4 recipe: q/kv projections in
    its ``exclude_modules``); ``mtp_bf16`` keeps the MTP layer bf16.
    """
    body = scheme.bytes_per_param
    groups = {"embed": BF16, "attention": body, "dense_mlp": body, "experts": body}
    for g in spec.get("bf16_groups", ()):
        groups[g] = BF16
    if spec.get("attention") == "o_proj-only":
        o = arch.heads * arch.head_dim * arch.hidden
        total = arch.attention_params_per_layer
        groups["attention"] = (o * body + (total - o) * BF16) / total
    mtp = dict.fromkeys(groups, BF16) if spec.get("mtp_bf16") else None
    return Checkpoint(model_path=hub_id, quantization=scheme.quantization,
                      compute_dtype=scheme.compute_dtype, bytes_per_param=groups,
                      mtp_bytes_per_param=mtp, source=scheme.source)


@cache
def catalog_model(name: str) -> ModelArch:
    """Catalog model ``name`` built from its config with its checkpoints.

    Raises:
        ConfigInvalid: unknown name (the line lists the known ones).
    """
    entries = catalog()
    if name not in entries:
        raise ConfigInvalid([f"model: unknown model {name!r}; known: {', '.join(entries)}"])
    entry = entries[name]
    arch = arch_from_hf_config(name, json.loads((MODELS_DIR / entry["config"]).read_text()),
                               source=entry["config"])
    ckpts: dict[str, Checkpoint] = {}
    for key, spec in entry["checkpoints"].items():
        scheme = _scheme(spec, key)
        ckpts[key] = _uniform(arch, spec["hub_id"], spec, scheme) if spec.get("uniform") \
            else build_checkpoint(arch, spec["hub_id"], scheme)
    return arch.model_copy(update={"checkpoints": ckpts})
