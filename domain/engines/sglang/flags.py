"""SGLang's command line: the flag inventory of each shipped version and the argv of a config.

Source of the inventories: ``domain/data/sglang-<version>-flags.json``, dumped from the real
``ServerArgs.add_cli_args`` parser of the PyPI wheel (servetune's shared reference).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from domain.errors import UnknownFlag

if TYPE_CHECKING:
    from domain.config import ServingConfig

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
VERSIONS = ("0.5.23",)  # SGLang releases whose flag inventory ships here
PROGRAM = ("sglang", "serve")  # the command that starts one server


IMAGE_REPOSITORY = "lmsysorg/sglang:"  # every SGLang image tag the sandbox allows by default


def image(version: str) -> str:
    """The engine image of SGLang ``version``, tagged as lmsysorg/sglang publishes it."""
    return f"{IMAGE_REPOSITORY}v{version}"


@cache
def flag_inventory(version: str) -> dict[str, dict[str, Any]]:
    """The CLI flags of SGLang ``version`` keyed by argparse dest.

    Source: ``domain/data/sglang-<version>-flags.json``, dumped from the real
    ``ServerArgs.add_cli_args`` parser of the PyPI wheel (servetune's shared reference).

    Raises:
        UnknownFlag: if no inventory ships for that version.
    """
    path = DATA_DIR / f"sglang-{version}-flags.json"
    if not path.is_file():
        raise UnknownFlag([f"engine_version: no flag inventory for SGLang {version}; supported: "
                           f"{', '.join(VERSIONS)}"])
    return {f["dest"]: f for f in json.loads(path.read_text())["flags"]}


def flag_for(dest: str, version: str, value: Any = None) -> str:
    """The canonical (first, long) flag of ``dest`` in ``version``; checks ``value`` on choices.

    Raises:
        UnknownFlag: unknown dest, or a value outside the flag's choices.
    """
    inv = flag_inventory(version)
    if dest not in inv:
        raise UnknownFlag([f"{dest}: SGLang {version} has no such flag"])
    entry = inv[dest]
    choices = entry.get("choices")
    if choices and value is not None and str(value) not in [str(c) for c in choices]:
        raise UnknownFlag([f"{entry['flags'][0]}: invalid choice {value!r} for SGLang {version} "
                           f"(choose from {', '.join(map(str, choices))})"])
    return str(entry["flags"][0])


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
    out = list(PROGRAM)
    for dest, value in pairs:
        out += [flag_for(dest, version, value), str(value)]
    # store_true flags: passed bare, and only when on
    for name in ("speculative_adaptive", "disable_radix_cache", "enable_hierarchical_cache",
                 "disable_cuda_graph", "enable_two_batch_overlap", "enable_single_batch_overlap"):
        if getattr(config, name):
            out.append(flag_for(name, version))
    return out
