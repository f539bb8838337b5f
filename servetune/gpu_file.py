"""A user's GPU: a catalog name, a spec file (YAML or JSON), or a spec mapping given inline.

Every form ends in :func:`domain.hardware.gpu_from_spec` (the validator the shipped catalog goes
through) and :func:`domain.hardware.register_gpu`, so each ``get_gpu`` of the process sees it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from domain.errors import ConfigInvalid
from domain.hardware import GPU, GPUS, get_gpu, gpu_from_spec, register_gpu
from servetune.study_file import _load_yaml, _StrictLoader

SPEC_SUFFIXES = (".yaml", ".yml", ".json")


def load_gpu_file(path: Path) -> GPU:
    """Read and validate the GPU spec in ``path`` (a YAML or JSON mapping of GPU fields).

    Does not register it (see :func:`resolve_gpu`).

    Raises:
        ConfigInvalid: one line each: a missing or unreadable file, not UTF-8, not YAML/JSON, an
            alias bomb, not a mapping, or every problem :func:`gpu_from_spec` finds (each line
            names the file and the field).
    """
    where = f"gpu file {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigInvalid([f"{where}: not found"]) from None
    except IsADirectoryError:
        raise ConfigInvalid([f"{where}: is a folder; give a YAML or JSON GPU spec"]) from None
    except OSError as e:
        raise ConfigInvalid([f"{where}: cannot read ({e.strerror or e})"]) from e
    except UnicodeDecodeError as e:
        raise ConfigInvalid([f"{where}: not UTF-8 text (byte {e.start})"]) from e
    try:
        data: Any = _load_yaml(text, _StrictLoader)
    except ConfigInvalid as e:
        raise ConfigInvalid([f"{where}: {v}" for v in e.violations]) from e
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigInvalid([f"{where}: not valid YAML or JSON ({e.problem or e.context}{at})"]
                            ) from e
    except yaml.YAMLError as e:
        raise ConfigInvalid([f"{where}: not valid YAML or JSON ({type(e).__name__})"]) from e
    return gpu_from_spec(data, str(path))


def resolve_gpu(value: str | Mapping[str, Any], *, base: Path | None = None,
                where: str = "gpu") -> GPU:
    """The GPU a study's ``gpu:`` (or a ``--gpu`` option) names, registered for the process.

    ``value`` is a catalog name (any case, aliases too: returned as is, nothing registered), a
    path to a ``.yaml``/``.yml``/``.json`` spec (relative to ``base``, the study's folder), or
    a spec mapping given inline (``where`` names it in messages, e.g. "study.yaml: gpu").

    Raises:
        ConfigInvalid: an unknown name (one line listing the catalog), or the file's / spec's
            problems (see :func:`load_gpu_file`, :func:`domain.hardware.gpu_from_spec`).
    """
    if isinstance(value, Mapping):
        return register_gpu(gpu_from_spec(value, where))
    if GPUS.resolve(value) is not None:
        return get_gpu(value)
    if value.lower().endswith(SPEC_SUFFIXES):
        path = Path(value)
        return register_gpu(load_gpu_file(path if path.is_absolute() or base is None
                                          else base / path))
    return get_gpu(value)  # raises the one-line "unknown GPU" refusal
