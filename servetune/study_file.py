"""Loading a study YAML file and checking its trace before anything runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from domain.errors import ConfigInvalid, TraceInvalid
from domain.study import Study, parse_study
from domain.study_sources import INLINE_GPU
from domain.trace_paths import check_trace_path, long_name_bytes, long_name_message
from domain.traces import load_trace
from domain.workload import Trace
from servetune.settings import REPO_ROOT

# Nodes that YAML aliases may add to a document once expanded. A 1.4 KB study of nested
# anchors expands to 10**9 values (a "billion laughs"); servetune's own studies use none.
MAX_ALIAS_NODES = 10_000


class _AliasCountingLoader(yaml.SafeLoader):
    """SafeLoader that keeps each anchor's node after composing, to size alias expansion."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.anchored: dict[str, yaml.Node] = {}

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        """Compose as PyYAML does, remembering the node an anchor names."""
        event = self.peek_event()
        node: yaml.Node = super().compose_node(parent, index)
        if not isinstance(event, yaml.AliasEvent) and event.anchor is not None:
            self.anchored[event.anchor] = node
        return node


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_aliases(root: yaml.Node, anchored: dict[str, yaml.Node]) -> None:
    """Refuse a node graph whose aliases expand to more than ``MAX_ALIAS_NODES`` extra nodes.

    Composing keeps an alias as a second reference to its anchor's node, so the expanded size
    is counted without expanding anything: size(node) = 1 + the sizes of its children, each
    node counted once (iteratively: no recursion limit, linear in the file).

    Raises:
        ConfigInvalid: naming the anchor whose expansion is largest, or the anchor that holds
            an alias of itself.
    """
    name_of = {id(node): name for name, node in anchored.items()}
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in _children(node))
        elif key in on_path:
            raise ConfigInvalid([f"the YAML anchor &{name_of.get(key, '?')} holds an alias of "
                                 "itself (a recursive value); write the values out"])
        elif key not in sizes:
            on_path.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in _children(node))
    extra = sizes[id(root)] - len(sizes)
    if extra > MAX_ALIAS_NODES:
        name, node = max(anchored.items(), key=lambda kv: sizes.get(id(kv[1]), 0))
        raise ConfigInvalid([
            f"YAML aliases expand it by {extra:,} nodes, more than the {MAX_ALIAS_NODES:,} "
            f"allowed (the anchor &{name} alone expands to {sizes[id(node)]:,}); write the "
            "values out instead of nesting aliases"])


def _load_yaml(text: str, loader_cls: type[_AliasCountingLoader]) -> Any:
    """Parse one YAML document, refusing an alias bomb before any Python object is built.

    Raises:
        ConfigInvalid: aliases that expand too far or recursively, or nesting too deep to parse.
        yaml.YAMLError: a syntax error (and whatever ``loader_cls``'s constructors refuse).
    """
    loader = loader_cls(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError as e:  # the composer recurses once per nesting level
            raise ConfigInvalid(["YAML nested too deeply to read"]) from e
        if node is None:
            return None
        _check_aliases(node, loader.anchored)
        return loader.construct_document(node)
    finally:
        loader.dispose()


class _StrictLoader(_AliasCountingLoader):
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


def _not_regular(path: Path) -> str:
    """What ``path`` is, for a path that exists but is not a regular file."""
    return "it is a folder" if path.is_dir() else "a FIFO, device or socket"


def load_study(path: Path) -> Study:
    """Parse and validate the study at ``path``.

    Raises:
        ConfigInvalid: missing file, not a regular file (a folder, FIFO or device), a name in
            the path over 255 bytes, YAML syntax error, aliases that expand by more than
            ``MAX_ALIAS_NODES`` nodes, or an invalid study (the message names the field).
    """
    n = long_name_bytes(path)
    if n is not None:
        raise ConfigInvalid([f"{str(path)[:60]}...: {long_name_message(n, 'study')}"])
    try:
        regular, there = path.is_file(), path.exists()
    except OSError as e:  # EACCES on a folder of the path, a path over PATH_MAX
        raise ConfigInvalid([f"{path}: cannot use the study path ({e.strerror or e})"]) from e
    if not there:
        raise ConfigInvalid([f"{path}: study file not found"])
    if not regular:  # a folder, a FIFO (reading would block), a device such as /dev/zero
        raise ConfigInvalid([f"{path}: not a regular file ({_not_regular(path)}); give a "
                             "study YAML file"])
    try:
        data = _load_yaml(path.read_text(encoding="utf-8"), _StrictLoader)
    except ConfigInvalid as e:
        raise ConfigInvalid([f"{path}: {v}" for v in e.violations]) from e
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
        gpu_source = INLINE_GPU
        if isinstance(data, dict) and isinstance(data.get("gpu"), str) \
                and names_gpu_file(data["gpu"]):
            gpu_file = resolve_gpu_path(data["gpu"], path.parent)
            data, gpu_source = {**data, "gpu": read_gpu_file(gpu_file, "gpu")}, str(gpu_file)
        return parse_study(data, base_dir=path.parent, gpu_source=gpu_source)
    except ConfigInvalid as e:
        raise ConfigInvalid([f"{path}: {v}" for v in e.violations]) from e


GPU_FILE_SUFFIXES = (".yaml", ".yml", ".json")


def names_gpu_file(value: str) -> bool:
    """Whether a ``gpu:`` (or ``--gpu``) string names a GPU spec file, not a catalog GPU.

    A path separator or a ``.yaml``/``.yml``/``.json`` ending makes it a file; catalog names
    hold neither.
    """
    return "/" in value or "\\" in value or value.lower().endswith(GPU_FILE_SUFFIXES)


def resolve_gpu_path(value: str, base_dir: Path) -> Path:
    """A GPU file's path: ``~`` expanded, a relative one taken from ``base_dir``."""
    p = Path(value).expanduser()
    return p if p.is_absolute() else base_dir / p


def read_gpu_file(path: Path, field: str) -> dict[str, Any]:
    """The mapping of GPU spec fields in a YAML or JSON file (JSON is YAML too).

    Args:
        path: the GPU file.
        field: how the caller names it in a message (``gpu`` in a study, ``--gpu`` on check).

    Raises:
        ConfigInvalid: one line naming ``field`` and the file: missing, not a regular file,
            unreadable, not YAML/JSON, an alias bomb, or not a mapping.
    """
    try:
        if not path.is_file():
            why = "not found" if not path.exists() else f"not a regular file ({_not_regular(path)})"
            raise ConfigInvalid([f"{field}: GPU file {path}: {why}"])
        data = _load_yaml(path.read_text(encoding="utf-8"), _StrictLoader)
    except ConfigInvalid as e:
        if e.violations[0].startswith(f"{field}: "):
            raise
        raise ConfigInvalid([f"{field}: GPU file {path}: {v}" for v in e.violations]) from e
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigInvalid([f"{field}: GPU file {path}: cannot read a YAML or JSON GPU spec "
                             f"({type(e).__name__}: {getattr(e, 'strerror', None) or e})"]
                            ) from e
    if not isinstance(data, dict):
        raise ConfigInvalid([f"{field}: GPU file {path}: expected a mapping of GPU spec fields "
                             "(name, hbm_gb, hbm_bytes_per_s, ...)"])
    return data


def resolve_trace(study: Study, study_path: Path) -> Path:
    """The replay trace as an absolute path: relative to the study file, else to the repo.

    Raises:
        TraceInvalid: if the file exists in neither place, is not a regular file (a folder,
            FIFO or device), or a name in its path is over 255 bytes.
    """
    check_trace_path(study.replay.trace)
    p = Path(study.replay.trace)
    candidates = [p] if p.is_absolute() else [study_path.parent / p, REPO_ROOT / p]
    for c in candidates:
        try:
            if c.is_file():
                return c.resolve()
            there = c.exists()
        except OSError as e:  # e.g. a folder on the way that may not be read
            raise TraceInvalid(str(c), f"cannot use the trace path ({e.strerror})") from e
        if there:  # a folder, a FIFO (reading would block), a device
            raise TraceInvalid(str(c), f"not a regular file ({_not_regular(c)}); give a trace "
                               "file")
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
        ValueError: unreadable, not YAML/JSON, an alias bomb (``MAX_ALIAS_NODES``), or not a
            mapping; the message names ``--config``.
    """
    try:
        data = _load_yaml(path.read_text(encoding="utf-8"), _AliasCountingLoader)
    except ConfigInvalid as e:
        raise ValueError(f"--config {path}: {e}") from e
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: cannot read a JSON or YAML ServingConfig "
                         f"({type(e).__name__}: {getattr(e, 'strerror', None) or e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of ServingConfig fields")
    return data
