"""An SGLang version's flag inventory as the data files the domain reads.

``servetune source fetch --version X`` unpacks X's wheel and writes, with the static parser
(:func:`mcp_servers.source.flags.extract_flags`, no import of SGLang):

- ``sglang-X-flags.json``: every ``sglang serve`` flag in the schema of the shipped inventories
  (``dest``, ``flags``, ``action`` as argparse's class name, ``type`` as the converter's name,
  ``default``, ``choices``, ``deprecated``; plus ``nargs`` and the declaration's ``source``
  file:line), read by :func:`domain.engines.sglang.flags.flag_inventory`;
- ``sglang-X-cli.json``: what ``servetune check`` needs beyond the parser (:mod:`
  domain.engines.sglang.cmdline`): each list flag's ``nargs``, the deprecated spellings X still
  accepts with the flag that replaces them, and the flags older known versions had and X
  dropped (``retired``), each with its successor when X has a flag for the same ServerArgs field.

The shipped 0.5.9 and 0.5.19 files were written this way from their PyPI wheels
(``servetune source fetch --version 0.5.9 --data-dir domain/data``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from domain.engines import engine, version_key
from mcp_servers.source.flags import FlagInfo, extract_flags
from mcp_servers.source.tree import SourceError, SourceTree

ACTIONS = {"store": "StoreAction", "store_true": "StoreTrueAction",
           "store_false": "StoreFalseAction"}


def _entry(f: FlagInfo) -> dict[str, Any]:
    """One flag in the shipped inventories' schema."""
    action = ACTIONS.get(f.action, f.action)
    typ = f.value_type.rsplit(".", 1)[-1] if f.value_type and action in (
        "StoreAction", "LoRAPathAction", "DeprecatedAliasStoreAction") else None
    return {"dest": f.dest, "flags": f.flags, "action": action, "type": typ,
            "default": f.default, "choices": f.choices, "deprecated": f.deprecated,
            "nargs": f.nargs, "source": f.source, "successor": f.new_flag}


def retired_flags(version: str, flags: list[dict[str, Any]],
                  older: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Spellings an older known version accepted and ``version`` does not, with successors.

    Args:
        version: the new release, e.g. '0.5.23'.
        flags: its inventory entries.
        older: inventories of older releases by version.

    Returns:
        ``{spelling: {last_version, removed_in, last_dest, last_action, successor}}``; the
        successor is ``version``'s first non-deprecated flag setting the same dest, else None.
    """
    spellings = {s for f in flags for s in f["flags"]}
    canonical = {f["dest"]: f["flags"][0] for f in flags if not f["deprecated"]}
    chain = sorted(older, key=version_key)
    out: dict[str, dict[str, Any]] = {}
    for i, old in enumerate(chain):  # oldest first: the newest release that had it wins
        removed_in = chain[i + 1] if i + 1 < len(chain) else version
        for f in older[old]:
            for s in f["flags"]:
                if s in spellings:
                    continue
                out[s] = {"last_action": f["action"], "last_dest": f["dest"],
                          "last_version": old, "removed_in": removed_in,
                          "successor": canonical.get(f["dest"])}
    return dict(sorted(out.items()))


def cli_data(version: str, flags: list[dict[str, Any]],
             older: dict[str, list[dict[str, Any]]], source: str) -> dict[str, Any]:
    """The ``sglang-<version>-cli.json`` content (nargs, deprecated, retired)."""
    canonical = {f["dest"]: f["flags"][0] for f in flags if not f["deprecated"]}
    deprecated = {}
    for f in flags:
        if f["deprecated"]:
            succ = f.get("successor") or canonical.get(f["dest"])
            deprecated[f["flags"][0]] = {"source": f.get("source"), "successor": succ}
    return {"source": source, "version": version,
            "nargs": {f["dest"]: f["nargs"] for f in flags if f.get("nargs")},
            "deprecated": dict(sorted(deprecated.items())),
            "deprecated_values": {"aliases": {}, "dests": [],
                                  "source": "not extracted by the static parser"},
            "retired": retired_flags(version, flags, older)}


def write_inventory(root: Path, version: str, out_dir: Path) -> tuple[Path, Path]:
    """Parse the unpacked tree ``root`` of SGLang ``version``; write its two data files.

    Older known versions (shipped or fetched: ``engine("sglang").versions``) supply the
    retired flags. Files are written whole to a temporary name, then renamed.

    Returns:
        ``(flags file, cli file)`` paths under ``out_dir``.

    Raises:
        SourceError: the tree holds no recognisable flag declaration, or ``out_dir`` cannot be
            written.
    """
    tree = SourceTree(root)
    inv = extract_flags(tree)
    if not inv.flags:
        raise SourceError(f"{root}: no sglang serve flag found (no arg_groups/fields/ nor "
                          "server_args.py add_argument calls); is it an SGLang tree?")
    flags = [_entry(f) for f in inv.flags]
    source = (f"static parse (mcp_servers/source/flags.py) of the sglang {version} PyPI wheel "
              "(ServerArgs fields and add_argument calls), help text omitted")
    older = {v: engine("sglang", v).flag_entries() for v in engine("sglang").versions
             if version_key(v) < version_key(version)}
    files = ((out_dir / f"sglang-{version}-flags.json",
              {"source": source, "version": version, "flags": flags}),
             (out_dir / f"sglang-{version}-cli.json", cli_data(version, flags, older, source)))
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for path, data in files:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
            tmp.replace(path)
    except OSError as e:
        raise SourceError(f"cannot write the flag inventory to {out_dir} ({e.strerror}); set "
                          "SERVETUNE_ENGINE_DATA to a writable directory") from e
    return files[0][0], files[1][0]
