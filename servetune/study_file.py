"""Loading a study YAML file and checking its trace before anything runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from domain.errors import ConfigInvalid, TraceInvalid
from domain.study import Study, parse_study
from domain.workload import Trace, check_trace_path, load_trace
from servetune.settings import REPO_ROOT


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML would keep the last)."""


def _no_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, str | int | float | bool | None):  # `? [a]: 1`, `? {a: 1}: 1`
            raise yaml.constructor.ConstructorError(
                None, None, "a key must be a plain name, not a list or mapping",
                key_node.start_mark)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def load_study(path: Path) -> Study:
    """Parse and validate the study at ``path``.

    Raises:
        ConfigInvalid: missing file, YAML syntax error, or an invalid study (the message names
            the field).
    """
    if not path.is_file():
        raise ConfigInvalid([f"{path}: study file not found"])
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)  # noqa: S506
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigInvalid([f"{path}: not valid YAML ({e.problem or e.context}{where})"]) from e
    except UnicodeDecodeError as e:
        raise ConfigInvalid([f"{path}: not UTF-8 text (byte {e.start}); save the study as "
                             "UTF-8 YAML"]) from e
    except yaml.YAMLError as e:
        raise ConfigInvalid([f"{path}: not valid YAML ({type(e).__name__})"]) from e
    try:
        return parse_study(data)
    except ConfigInvalid as e:
        raise ConfigInvalid([f"{path}: {v}" for v in e.violations]) from e


def resolve_trace(study: Study, study_path: Path) -> Path:
    """The replay trace as an absolute path: relative to the study file, else to the repo.

    Raises:
        TraceInvalid: if the file exists in neither place, or a name in its path is over 255
            bytes.
    """
    check_trace_path(study.replay.trace)
    p = Path(study.replay.trace)
    candidates = [p] if p.is_absolute() else [study_path.parent / p, REPO_ROOT / p]
    for c in candidates:
        try:
            if c.is_file():
                return c.resolve()
        except OSError as e:  # e.g. a folder on the way that may not be read
            raise TraceInvalid(str(c), f"cannot use the trace path ({e.strerror})") from e
    raise TraceInvalid(study.replay.trace, "trace file not found (looked next to the study "
                       "file and in the repository)")


def check_replay(study: Study, trace_path: Path) -> Trace:
    """Load the trace and cut the study's window, so a bad trace fails before the run.

    Raises:
        TraceInvalid: malformed trace, or a window holding no request.
    """
    trace = load_trace(trace_path, study.replay.format)
    try:
        win = trace.window(study.replay.start_s, study.replay.duration_s)
    except ConfigInvalid as e:
        raise TraceInvalid(str(trace_path), f"replay window: {e}") from e
    return win.scaled(study.replay.time_scale)


def read_config_file(path: Path) -> dict[str, Any]:
    """The mapping of ServingConfig fields in a JSON or YAML file (JSON is YAML too).

    Raises:
        ValueError: unreadable, not YAML/JSON, or not a mapping; the message names ``--config``.
    """
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: cannot read a JSON or YAML ServingConfig "
                         f"({type(e).__name__}: {getattr(e, 'strerror', None) or e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of ServingConfig fields")
    return data
