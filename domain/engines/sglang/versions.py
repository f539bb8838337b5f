"""SGLang versions: where each version's flag inventory lives, and which default rules apply.

Two questions, one module:

- **Which versions exist here.** A version is usable when its flag inventory
  (``sglang-<version>-flags.json``) is found: first in the shipped ``domain/data/`` (0.5.9,
  0.5.19, 0.5.23, built by the static parser ``mcp_servers/source/flags.py`` from each PyPI
  wheel), then in the user's engine data directory, where ``servetune source fetch --version X``
  writes the inventory of any other release (:func:`domain.engines.user_data_dir`). A version
  in neither is unknown and refused with the fetch command (:func:`unknown_version_line`).
- **Which derived-default rules apply.** The memory-dependent defaults SGLang derives at start
  (chunked prefill size and decode CUDA-graph batch size by GPU memory tier, the static memory
  reserve behind ``mem_fraction_static``, ``max_running_requests`` from the KV pool) are modelled
  for 0.5.9, 0.5.19 and 0.5.23 (:data:`RULES`, each constant cited to its wheel's file:line).
  Any other version with an inventory runs with the nearest modelled version's rules
  (:func:`rules_version`) and the report says so (:func:`rules_note`).

Units: GPU memory in GiB (what ``nvidia-smi`` reports, as SGLang's ``get_device_memory_capacity``
compares it), reserves in MiB, pool sizes in tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from domain.engines import user_data_dir, version_key

DATA_DIR = Path(__file__).resolve().parents[2] / "data"  # domain/data: shipped inventories
PINNED = "0.5.23"  # the release the twin's startup log, refusals and failure rows are read from
FETCH_COMMAND = "servetune source fetch --version {version}"


def data_path(version: str, kind: str = "flags") -> Path | None:
    """``sglang-<version>-<kind>.json`` (kind ``flags`` or ``cli``): shipped first, then fetched.

    Returns None when neither directory holds it.
    """
    name = f"sglang-{version}-{kind}.json"
    if name in _FOUND and _FOUND[name].is_file():
        return _FOUND[name]
    for folder in (DATA_DIR, user_data_dir()):
        try:
            if (folder / name).is_file():
                _FOUND[name] = folder / name
                return folder / name
        except OSError:  # an unusable $SERVETUNE_ENGINE_DATA is the same as an empty one
            continue
    return None


_FOUND: dict[str, Path] = {}  # files found before (a fetch may add one; none is forgotten)


def available() -> tuple[str, ...]:
    """Every version with a flag inventory, shipped or fetched, oldest first."""
    found: set[str] = set()
    for folder in (DATA_DIR, user_data_dir()):
        try:
            names = [p.name for p in folder.glob("sglang-*-flags.json")]
        except OSError:
            continue
        found.update(n[len("sglang-"):-len("-flags.json")] for n in names)
    return tuple(sorted(found, key=lambda v: (version_key(v), v)))


def unknown_version_line(version: str) -> str:
    """The one line that refuses a version without a flag inventory, naming the fetch command."""
    return (f"SGLang {version} has no flag inventory here (have: "
            f"{', '.join(available())}); fetch it with `{FETCH_COMMAND.format(version=version)}`")


@dataclass(frozen=True)
class MemoryDefaults:
    """SGLang's memory-dependent derived defaults of one release (GPU memory in GiB).

    Attributes:
        version: the release these rules are read from.
        source: file:line of each rule in that release's wheel.
        chunked_tiers: ``(upper GiB bound, chunked_prefill_size)``, first bound above wins.
        chunked_top: chunked_prefill_size at or above the last bound.
        graph_tiers: ``(upper GiB bound, decode max bs with TP < 4, with TP >= 4)``.
        graph_top: decode CUDA-graph max batch size at or above the last bound.
        clamp_graph_to_running: a default decode max bs is lowered to an explicit
            ``--max-running-requests`` before the reserve is computed.
        prefill_graph_reserve: the prefill CUDA graph is captured by default and reserved
            (8 MiB per captured size; a flat 1.5 GiB with an MLA backend).
        speculative_reserve_mib: extra reserve per speculative algorithm, added after the
            10 GiB floor (None: no such term in this release).
        explicit_running_cap: how an explicit ``--max-running-requests`` is bounded by the pool:
            ``"none"`` (taken as given), ``"half"`` (``min(value, tokens // 2)``) or
            ``"half_min1"`` (``min(max(1, value), tokens // 2)``).
    """

    version: str
    source: Mapping[str, str]
    chunked_tiers: tuple[tuple[int, int], ...]
    chunked_top: int
    graph_tiers: tuple[tuple[int, int, int], ...]
    graph_top: int
    clamp_graph_to_running: bool
    prefill_graph_reserve: bool
    speculative_reserve_mib: Mapping[str, int] | None
    explicit_running_cap: str

    def chunked_prefill(self, gpu_gib: float) -> int:
        """``chunked_prefill_size`` when unset on a GPU of ``gpu_gib`` GiB, tokens."""
        return next((size for limit, size in self.chunked_tiers if gpu_gib < limit),
                    self.chunked_top)

    def decode_graph_bs(self, gpu_gib: float, tp_size: int) -> int:
        """Largest decode CUDA-graph batch size when unset, requests."""
        for limit, small, large in self.graph_tiers:
            if gpu_gib < limit:
                return small if tp_size < 4 else large
        return self.graph_top

    def speculative_reserve(self, algorithm: str | None) -> int:
        """Extra static reserve of ``algorithm`` (e.g. 'EAGLE'), MiB; 0 when none applies."""
        if algorithm is None or not self.speculative_reserve_mib:
            return 0
        table = self.speculative_reserve_mib
        return table.get(algorithm.upper(), table.get("*", 0))

    def explicit_running(self, requested: int, kv_tokens: int) -> int:
        """An explicit ``--max-running-requests`` as the pool bounds it, requests."""
        if self.explicit_running_cap == "none":
            return requested
        if self.explicit_running_cap == "half":
            return min(requested, kv_tokens // 2)
        return min(max(1, requested), kv_tokens // 2)


# 0.5.9 and 0.5.19 share the tiers below 35 GiB (2k chunks, decode max bs 24 / 80); 0.5.23
# raised them to 4k and 48 / 160 (memory_hook.py:101-117, the RTX 5090 comment).
_OLD_CHUNKS = ((20, 2048), (35, 2048), (60, 4096), (90, 8192), (160, 8192))
_OLD_GRAPHS = ((20, 8, 8), (35, 24, 80), (60, 32, 160), (90, 256, 512), (160, 256, 512))
RULES: dict[str, MemoryDefaults] = {
    "0.5.9": MemoryDefaults(
        version="0.5.9",
        source={
            "tiers": "sglang/srt/server_args.py:936-992 (_handle_gpu_memory_settings)",
            "reserve": "sglang/srt/server_args.py:1020-1061 (512 + 1.5 x max(chunk, 2048) + "
                       "2 x decode max bs + tp x pp / 8 x 1024; piecewise prefill graph only "
                       "with --enable-piecewise-cuda-graph, off by default, line 604)",
            "speculative": "sglang/srt/server_args.py:1051-1057 (STANDALONE +6 GiB, EAGLE-like "
                           "+2 GiB, NGRAM none, after the 10 GiB floor)",
            "max_running_requests": "sglang/srt/model_executor/model_runner_kv_cache_mixin.py:"
                                    "344-353 and model_runner.py:593-600",
        },
        chunked_tiers=_OLD_CHUNKS, chunked_top=16384, graph_tiers=_OLD_GRAPHS, graph_top=512,
        clamp_graph_to_running=False, prefill_graph_reserve=False,
        speculative_reserve_mib={"STANDALONE": 6 * 1024, "NGRAM": 0, "*": 2 * 1024},
        explicit_running_cap="none"),
    "0.5.19": MemoryDefaults(
        version="0.5.19",
        source={
            "tiers": "sglang/srt/arg_groups/memory_hook.py:63-140 (handle_gpu_memory_settings)",
            "reserve": "sglang/srt/arg_groups/memory_hook.py:232-266 and reserve_for_graph_mb "
                       "292-334",
            "max_running_requests": "sglang/srt/mem_cache/kv_cache_configurator.py:2105-2118 "
                                    "(resolve_max_num_reqs)",
        },
        chunked_tiers=_OLD_CHUNKS, chunked_top=16384, graph_tiers=_OLD_GRAPHS, graph_top=512,
        clamp_graph_to_running=False, prefill_graph_reserve=True, speculative_reserve_mib=None,
        explicit_running_cap="half"),
    "0.5.23": MemoryDefaults(
        version="0.5.23",
        source={
            "tiers": "sglang/srt/arg_groups/memory_hook.py:89-170 (handle_gpu_memory_settings)",
            "clamp": "sglang/srt/arg_groups/memory_hook.py:182-188",
            "reserve": "sglang/srt/arg_groups/memory_hook.py:280-320 and reserve_for_graph_mb",
            "max_running_requests": "sglang/srt/mem_cache/kv_cache_configurator.py:3119-3131 "
                                    "(resolve_max_num_reqs)",
        },
        chunked_tiers=((20, 2048), (35, 4096), (60, 4096), (90, 8192), (160, 8192)),
        chunked_top=16384,
        graph_tiers=((20, 8, 8), (35, 48, 160), (60, 32, 160), (90, 256, 512), (160, 256, 512)),
        graph_top=512, clamp_graph_to_running=True, prefill_graph_reserve=True,
        speculative_reserve_mib=None, explicit_running_cap="half_min1"),
}
MODELLED = tuple(sorted(RULES, key=version_key))


def rules_version(version: str | None) -> str:
    """The modelled release whose derived-default rules ``version`` runs with.

    The release itself when modelled; else the nearest patch release of the same ``X.Y``
    series (a tie goes to the newer: 0.5.14 -> 0.5.19), else the newest modelled release older
    than it (0.6.1 -> 0.5.23), else the oldest one. None: the pinned release.
    """
    if version is None or version in RULES:
        return version or PINNED
    key = version_key(version)
    same = [m for m in MODELLED if version_key(m)[:2] == key[:2]]
    if same:  # nearest patch release of the series; a tie goes to the newer
        return min(same, key=lambda m: (abs(version_key(m)[2] - key[2]), -version_key(m)[2]))
    older = [m for m in MODELLED if version_key(m) < key]
    return older[-1] if older else MODELLED[0]


def is_exact(version: str | None) -> bool:
    """Whether ``version``'s own derived-default rules are modelled (not a nearest one's)."""
    return rules_version(version) == (version or PINNED)


def rules_note(version: str | None) -> str | None:
    """The report's warning for a version run with another version's rules.

    E.g. 'rules of 0.5.19 used for 0.5.17 (...)'; None when the version's own are modelled.
    """
    if is_exact(version):
        return None
    return (f"SGLang derived defaults: rules of {rules_version(version)} used for {version} "
            f"(modelled: {', '.join(MODELLED)}); memory tiers, mem_fraction_static and "
            "max_running_requests may differ")


def rules(version: str | None) -> MemoryDefaults:
    """The derived-default rules ``version`` runs with (:func:`rules_version`)."""
    return RULES[rules_version(version)]
