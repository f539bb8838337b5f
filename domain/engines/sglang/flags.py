"""SGLang's command line: the flag inventory of each shipped version and the argv of a config.

Source of the inventories: ``sglang-<version>-flags.json``, shipped in ``domain/data/`` for
0.5.9, 0.5.19 and 0.5.23 or written by ``servetune source fetch --version X`` into the user's
engine data directory (:mod:`domain.engines.sglang.versions`); 0.5.23's is the dump of the real
``ServerArgs.add_cli_args`` parser of its PyPI wheel, the others the static parser's
(``mcp_servers/source/inventory.py``), which agrees with that dump on 0.5.9, 0.5.19 and 0.5.23.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from domain.engines import version_key
from domain.engines.sglang import versions
from domain.errors import UnknownFlag

if TYPE_CHECKING:
    from domain.config import ServingConfig

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
# SGLang releases with a flag inventory (shipped or fetched) when servetune started; ask
# versions.available() for the current list (a fetch adds one)
VERSIONS = versions.available()
PROGRAM = ("sglang", "serve")  # the command that starts one server


IMAGE_REPOSITORY = "lmsysorg/sglang:"  # every SGLang image tag the sandbox allows by default


def image(version: str) -> str:
    """The engine image of SGLang ``version``, tagged as lmsysorg/sglang publishes it."""
    return f"{IMAGE_REPOSITORY}v{version}"


def flag_inventory(version: str) -> dict[str, dict[str, Any]]:
    """The CLI flags of SGLang ``version`` keyed by argparse dest.

    Source: ``sglang-<version>-flags.json``, shipped (``domain/data/``) or fetched
    (:func:`domain.engines.sglang.versions.data_path`).

    Raises:
        UnknownFlag: no inventory for that version (the line names the fetch command).
    """
    path = versions.data_path(version)
    if path is None:
        raise UnknownFlag([f"engine_version: {versions.unknown_version_line(version)}"])
    return _read_inventory(path)


def flag_entries(version: str) -> list[dict[str, Any]]:
    """Every flag entry of ``version`` in declaration order, deprecated aliases included.

    Raises:
        UnknownFlag: no inventory for that version (the line names the fetch command).
    """
    path = versions.data_path(version)
    if path is None:
        raise UnknownFlag([f"engine_version: {versions.unknown_version_line(version)}"])
    return list(_read_entries(path))


@cache
def _read_entries(path: Path) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = json.loads(path.read_text())["flags"]
    return entries


@cache
def _read_inventory(path: Path) -> dict[str, dict[str, Any]]:
    """Entries by dest.

    A deprecated alias (0.5.19's ``--cuda-graph-max-bs``, which sets
    ``cuda_graph_max_bs_decode``) never hides the flag it stands for.
    """
    out: dict[str, dict[str, Any]] = {}
    for f in _read_entries(path):
        if f["dest"] not in out or out[f["dest"]]["deprecated"] and not f["deprecated"]:
            out[f["dest"]] = f
    return out


def renamed_dest(dest: str, version: str) -> str | None:
    """The dest ``version`` spells ServerArgs field ``dest`` with, when it is another name.

    Two dests are one field when a spelling links them in some known version (0.5.19 accepts
    ``--cuda-graph-max-bs`` as the deprecated alias of ``cuda_graph_max_bs_decode``, which 0.5.9
    names ``cuda_graph_max_bs``). None: ``version`` has ``dest`` itself, or no flag for it.
    """
    inv = flag_inventory(version)
    if dest in inv:
        return None
    def entries(v: str) -> list[dict[str, Any]]:
        path = versions.data_path(v)
        return _read_entries(path) if path else []

    spellings = {s for v in versions.available() for f in entries(v) if f["dest"] == dest
                 for s in f["flags"]}
    return next((f["dest"] for f in entries(version) if spellings & set(f["flags"])), None)


def known_dest(dest: str) -> bool:
    """Whether any known version (shipped or fetched) has a flag setting ``dest``."""
    return any(dest in flag_inventory(v) for v in versions.available())


def missing_flag_line(dest: str, version: str) -> str:
    """One line for a field ``version`` has no flag for, naming where it exists.

    E.g. ``hicache_ratio: SGLang 0.5.9 has no such flag (--hicache-ratio exists in 0.5.19,
    0.5.23)``; with the successor when ``version`` is newer than every release that had it.
    """
    have = [v for v in versions.available() if dest in flag_inventory(v)]
    if not have:
        return f"{dest}: SGLang {version} has no such flag"
    flag = flag_inventory(have[-1])[dest]["flags"][0]
    if version_key(version) > version_key(have[-1]):
        retired = cli_retired(version).get(flag) or {}
        succ = retired.get("successor")
        return (f"{dest}: {flag} was removed in SGLang {retired.get('removed_in', version)} "
                f"(last in {have[-1]}); " + (f"use its successor {succ}" if succ else
                                             "it names no successor; drop it"))
    return f"{dest}: SGLang {version} has no such flag ({flag} exists in {', '.join(have)})"


def cli_retired(version: str) -> dict[str, dict[str, Any]]:
    """``retired`` of ``sglang-<version>-cli.json`` ({} when the version has no such file)."""
    path = versions.data_path(version, "cli")
    if path is None:
        return {}
    retired: dict[str, dict[str, Any]] = json.loads(path.read_text()).get("retired", {})
    return retired


def flag_for(dest: str, version: str, value: Any = None) -> str:
    """The canonical (first, long) flag of ``dest`` in ``version``; checks ``value`` on choices.

    A field ``version`` names differently is spelled its way (:func:`renamed_dest`); of a
    flag's spellings, the one 0.5.23 writes first is preferred (0.5.9 lists ``--tp-size``
    second, after ``--tensor-parallel-size``).

    Raises:
        UnknownFlag: unknown dest, or a value outside the flag's choices.
    """
    inv = flag_inventory(version)
    field = dest
    if dest not in inv:
        dest = renamed_dest(dest, version) or dest
    if dest not in inv:
        raise UnknownFlag([missing_flag_line(dest, version)])
    entry = inv[dest]
    choices = entry.get("choices")
    if choices and value is not None and str(value) not in [str(c) for c in choices]:
        raise UnknownFlag([f"{entry['flags'][0]}: invalid choice {value!r} for SGLang {version} "
                           f"(choose from {', '.join(map(str, choices))})"])
    pinned = _read_inventory(versions.DATA_DIR / f"sglang-{versions.PINNED}-flags.json")
    usual = pinned[field]["flags"][0] if field in pinned else None
    return str(usual if usual in entry["flags"] else entry["flags"][0])


def argv(config: ServingConfig, version: str) -> list[str]:
    """The argv of ``sglang serve`` for ONE replica, with exact flag names of ``version``.

    Returns:
        e.g. ``['sglang', 'serve', '--model-path', 'zai-org/GLM-5-FP8', '--tp-size', '8']``.

    Raises:
        UnknownFlag: if a flag or choice is not in that version's inventory (argparse would
            exit with code 2).
    """
    from domain.models import get_model  # local: models imports nothing from here

    ckpt = get_model(config.model).checkpoint(config.weights)
    pairs: list[tuple[str, Any]] = [("model_path", ckpt.model_path), ("tp_size", config.tp_size)]
    if ckpt.quantization:
        pairs.append(("quantization", ckpt.quantization))
    if config.kv_cache_dtype != "auto":
        pairs.append(("kv_cache_dtype", config.kv_cache_dtype))
    for name in ("mem_fraction_static", "max_running_requests", "chunked_prefill_size",
                 "cuda_graph_max_bs_decode", "attention_backend", "mm_attention_backend"):
        value = getattr(config, name)
        if value is not None:
            pairs.append((name, value))
    if config.schedule_policy != "fcfs":
        pairs.append(("schedule_policy", config.schedule_policy))
    for name in ("schedule_conservativeness", "speculative_algorithm",
                 "speculative_num_steps", "speculative_eagle_topk",
                 "speculative_num_draft_tokens", "hicache_ratio", "context_length",
                 "page_size", "moe_runner_backend", "fp4_gemm_runner_backend",
                 "num_continuous_decode_steps"):
        value = getattr(config, name)
        if value is not None:
            pairs.append((name, value))
    pairs += _layout_pairs(config, version)
    out = list(PROGRAM)
    for dest, value in pairs:
        out += [flag_for(dest, version, value), str(value)]
    # store_true flags: passed bare, and only when on
    for name in ("speculative_adaptive", "disable_radix_cache", "enable_hierarchical_cache",
                 "disable_cuda_graph", "enable_two_batch_overlap", "enable_single_batch_overlap",
                 "enable_eplb", "enable_dp_lm_head"):
        if getattr(config, name):
            out.append(flag_for(name, version))
    if config.attn_dp_size > 1 and "attn_dp_size" not in flag_inventory(version):
        out.append(flag_for("enable_dp_attention", version))
    return out


def _layout_pairs(config: ServingConfig, version: str) -> list[tuple[str, Any]]:
    """The ``(dest, value)`` pairs of a config's parallel layout, in argv order.

    Only values off their default are passed. A server wider than one node
    (``gpus_per_server`` above the GPU's ``gpus_per_node``) gets ``--nnodes N``; each pod adds
    its own ``--node-rank`` and ``--dist-init-addr`` (the manifests do, ``sandbox/``).
    ``attn_dp_size`` is ``--attn-dp-size N`` from
    0.5.23; before it existed (0.5.9, 0.5.19) it is ``--dp-size N`` plus the bare
    ``--enable-dp-attention`` that :func:`argv` appends (sglang-knobs reference, "DP
    attention spelling changed in 0.5.23"; 0.5.23 ``arg_groups/parallel_hook.py
    handle_deprecated_dp_attention`` rewrites the old spelling the same way).
    """
    from domain.hardware import get_gpu  # local: hardware imports nothing from here

    pairs: list[tuple[str, Any]] = []
    nodes = config.nnodes(get_gpu(config.gpu).gpus_per_node)
    if nodes > 1:  # one server over several nodes; --node-rank/--dist-init-addr are per pod
        pairs.append(("nnodes", nodes))
    if config.pp_size != 1:
        pairs.append(("pp_size", config.pp_size))
    if config.attn_dp_size > 1 and "attn_dp_size" not in flag_inventory(version):
        pairs.append(("dp_size", config.attn_dp_size))
    else:
        if config.dp_size != 1:
            pairs.append(("dp_size", config.dp_size))
        if config.attn_dp_size != 1:
            pairs.append(("attn_dp_size", config.attn_dp_size))
    if config.ep_size != 1:
        pairs.append(("ep_size", config.ep_size))
    for name in ("moe_a2a_backend", "deepep_mode", "moe_dense_tp_size"):
        value = getattr(config, name)
        if value is not None:
            pairs.append((name, value))
    if config.ep_num_redundant_experts:
        pairs.append(("ep_num_redundant_experts", config.ep_num_redundant_experts))
    if config.load_balance_method is not None:
        pairs.append(("load_balance_method", config.load_balance_method))
    if config.disaggregation_mode != "null":
        pairs.append(("disaggregation_mode", config.disaggregation_mode))
        if config.disaggregation_transfer_backend is not None:
            pairs.append(("disaggregation_transfer_backend",
                          config.disaggregation_transfer_backend))
    return pairs
