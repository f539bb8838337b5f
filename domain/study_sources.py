"""A study's model and GPU given by source instead of by catalog name.

``model:`` takes a catalog key (``glm-5``), a path to a Hugging Face ``config.json`` or to the
directory holding one (``models/my-moe``), or a mapping ``{hf_config: PATH, name: NAME,
checkpoints: {WEIGHTS_KEY: HUB_ID, ...}}``. ``gpu:`` takes a catalog name (``H200``) or a
mapping of GPU spec fields (:func:`domain.hardware.gpu_from_spec`); a GPU file is read into such
a mapping at the edge (``servetune/study_file.py``), where YAML is parsed. Paths are relative to
the study file's folder. The model and the GPU are built (:func:`domain.models.model_from_path`,
:func:`domain.hardware.gpu_from_spec`) and registered in this process
(:func:`domain.models.register_model`, :func:`domain.hardware.register_gpu`), so every
``get_model`` / ``get_gpu`` after the study is read sees them; a resumed run reads the study
again and registers them again.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from domain.errors import ConfigInvalid
from domain.hardware import GPU, register_gpu
from domain.models import ModelArch, model_from_path, register_model

# A servetune name of a user's model or GPU: it labels ledger rows, lessons, reports and
# (with the kubernetes backend) pod labels, so it is kept to one plain token.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$"
INLINE_GPU = "inline in the study"  # the source of a gpu: mapping written in the study
_FORMS = ("a catalog key (e.g. glm-5), a path to a Hugging Face config.json or its folder, or "
          "a mapping {hf_config: PATH, name: NAME, checkpoints: {bf16: HUB_ID, ...}}")


class ModelSource(BaseModel):
    """``model:`` as a mapping: a model outside the catalog, read from its ``config.json``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    hf_config: str = Field(min_length=1, max_length=4096, description=(
        "the model's Hugging Face config.json, or the folder holding it (with "
        "hf_quant_config.json / model.safetensors.index.json when it has them); relative to "
        "the study file"))
    name: str | None = Field(None, pattern=NAME_PATTERN, description=(
        "the model's name in servetune (ledger, lessons, report); default: the config's "
        "folder name"))
    checkpoints: dict[str, str] | None = Field(None, description=(
        "weights key (bf16, fp8, nvfp4, ...) -> Hugging Face hub id the server loads; "
        "default: the folder's own precision as its one checkpoint"))


def _errors(prefix: str, e: ValidationError) -> ConfigInvalid:
    """One line per pydantic error, each naming ``prefix.field``."""
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in (prefix, *err["loc"]))
        lines.append(f"{loc}: {err['msg'].removeprefix('Value error, ')}")
    return ConfigInvalid(lines)


def _resolve_path(value: str, base_dir: Path | None) -> Path:
    """``value`` as a path: ``~`` expanded, a relative one taken from ``base_dir``."""
    p = Path(value).expanduser()
    return p if p.is_absolute() or base_dir is None else base_dir / p


def _is_catalog_key(value: str) -> bool:
    """Whether ``value`` is a shipped catalog key.

    A model registered earlier in this process is not: a study naming its folder reads it again.
    """
    from domain.models import CATALOG

    return value in CATALOG


def names_a_path(value: str, base_dir: Path | None) -> bool:
    """Whether a ``model:`` string names a local config rather than a catalog key.

    A catalog key wins; otherwise a string holding a path separator, ending in
    ``.json``, starting with ``.`` or ``~``, or naming something that exists next to the study
    file is a path. Catalog keys hold none of these.
    """
    if _is_catalog_key(value):
        return False
    if "/" in value or "\\" in value or value.endswith(".json") or value[:1] in (".", "~"):
        return True
    try:
        return _resolve_path(value, base_dir).exists()
    except OSError:  # a name over the OS's limits is no path of ours
        return False


def _reworded(e: ConfigInvalid, field: str, drop: str = "", then: str = "") -> ConfigInvalid:
    """``e`` with each line starting with the study field's path (``model: ...``).

    Every study violation does. A line's leading ``drop`` (the reader's own prefix) becomes
    ``then``.
    """
    lines = [then + v.removeprefix(drop) if drop and v.startswith(drop) else v
             for v in e.violations]
    return ConfigInvalid([v if v.startswith((f"{field}:", f"{field}."))
                          else f"{field}: {v}" for v in lines])


def resolve_model(value: Any, base_dir: Path | None) -> ModelArch | None:
    """The user's model a ``model:`` value names, built and registered; None for a catalog key.

    Args:
        value: the study's ``model`` value as parsed (string or mapping).
        base_dir: the study file's folder (relative paths start there); None: the working
            folder.

    Raises:
        ConfigInvalid: one line naming ``model`` (or ``model.<key>``): a mapping with an
            unknown or missing key, a value of the wrong type, an unreadable config, a config
            missing a field or of an unsupported family (the reader's message), a folder name
            that is no servetune name (:data:`NAME_PATTERN`).
    """
    if isinstance(value, str):
        if not names_a_path(value, base_dir):
            return None  # a catalog key, or an unknown name the catalog lookup refuses
        try:
            arch = model_from_path(_resolve_path(value, base_dir))
        except ConfigInvalid as e:
            raise _reworded(e, "model") from e
    elif isinstance(value, dict):
        try:
            src = ModelSource.model_validate(value)
        except ValidationError as e:
            raise _errors("model", e) from e
        try:
            arch = model_from_path(_resolve_path(src.hf_config, base_dir), name=src.name,
                                   checkpoints=src.checkpoints)
        except ConfigInvalid as e:
            raise _reworded(e, "model") from e
    else:
        raise ConfigInvalid([f"model: give {_FORMS}, not {type(value).__name__}"])
    if not re.fullmatch(NAME_PATTERN, arch.name):  # a folder name such as "Qwen3 30B"
        raise ConfigInvalid([f"model: the folder name {arch.name!r} is not a servetune name "
                             "(letters, digits, '.', '_', '+', '-'; at most 64): give "
                             "model: {hf_config: PATH, name: NAME}"])
    return register_model(arch)


def resolve_gpu(value: Any, source: str) -> GPU | None:
    """The user's GPU a ``gpu:`` mapping describes, built and registered; None for a name.

    Args:
        value: the study's ``gpu`` value (a catalog name, or a mapping of GPU spec fields).
        source: where the spec comes from, kept as the GPU's ``source`` ("inline in the
            study", or the GPU file's path: named in each message then).

    Raises:
        ConfigInvalid: one line naming ``gpu``: a spec with a missing field or impossible
            numbers (:func:`domain.hardware.gpu_from_spec`), or a value of the wrong type.
    """
    if isinstance(value, str):
        return None
    if not isinstance(value, dict):
        raise ConfigInvalid(["gpu: give a catalog name (e.g. H200), a GPU spec file "
                             "(.yaml/.json) or a mapping of GPU spec fields, not "
                             f"{type(value).__name__}"])
    from domain.hardware import gpu_from_spec

    try:
        gpu = gpu_from_spec(value, source)
    except ConfigInvalid as e:
        inline = source == INLINE_GPU
        raise _reworded(e, "gpu", drop=f"gpu ({source}): ",
                        then="" if inline else f"{source}: ") from e
    return register_gpu(gpu)


# The file beside a deployment's config.json that carries a study's own model and GPU to a
# server process of the local backend (``servetune twin serve --config``), which registers them
# before it reads the config (mcp_servers/cluster/local.py writes it).
USER_CATALOG_FILE = "user-catalog.json"


def user_catalog(model: str, gpu: str) -> dict[str, list[dict[str, Any]]]:
    """The registered (not shipped) model and GPU among ``model`` and ``gpu``, JSON-ready.

    Returns:
        ``{"models": [ModelArch dump], "gpus": [GPU dump]}``; both lists empty when the
        catalogs ship both (nothing to carry to another process).
    """
    from domain import hardware, models

    return {"models": [models._REGISTERED[model].model_dump(mode="json")]
            if model in models._REGISTERED else [],
            "gpus": [hardware._REGISTERED[gpu].model_dump(mode="json")]
            if gpu in hardware._REGISTERED else []}


def register_user_catalog(data: Any, source: str) -> None:
    """Register the models and GPUs of a :func:`user_catalog` mapping read back from ``source``.

    Raises:
        ConfigInvalid: one line naming ``source``: not such a mapping, or an entry that does
            not validate.
    """
    if not isinstance(data, dict) or not all(isinstance(data.get(k, []), list)
                                             for k in ("models", "gpus")):
        raise ConfigInvalid([f"{source}: expected {{models: [...], gpus: [...]}}"])
    try:
        for m in data.get("models", []):
            register_model(ModelArch.model_validate(m))
        for g in data.get("gpus", []):
            register_gpu(GPU.model_validate(g))
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigInvalid([f"{source}: {'.'.join(map(str, err['loc']))}: {err['msg']}"]
                            ) from e
