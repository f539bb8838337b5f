"""SGLang's derived defaults the memory fit sizes a server with (sglang-knobs reference, 2.x).

Split from :mod:`domain.fit` (which re-exports every name): ``chunked_prefill_size``, the decode
CUDA-graph max batch size, the prefill graph's captured sizes, ``mem_fraction_static`` when
unset and ``max_running_requests``, each by the version's rules
(:func:`version_defaults`). Units: tokens, requests, MiB for reserves, GiB for memory tiers.
"""

from __future__ import annotations

from functools import cache

from domain.engines import DerivedDefaults
from domain.hardware import GPU
from domain.model_arch import ModelArch
from domain.speculative import SPEC_MAX_RUNNING_REQUESTS

GIB = 2**30
MIB = 2**20


@cache
def version_defaults(version: str | None = None) -> DerivedDefaults:
    """The derived-default rules of SGLang ``version`` (None: 0.5.23).

    Or its nearest modelled release's (``domain/engines/sglang/versions.py``: 0.5.9, 0.5.19,
    0.5.23, file:line each).

    Raises:
        ValueError: a version without a flag inventory (the line names the fetch command).
    """
    from domain.engines import engine

    return engine("sglang", version).memory_defaults()


def default_chunked_prefill(gpu: GPU, version: str | None = None) -> int:
    """``chunked_prefill_size`` when unset, by GPU memory tier (memory_hook.py), tokens.

    0.5.23 tiers of nvidia-smi memory: < 20 GiB 2048; < 35 GiB 4096; < 60 GiB 4096; < 90 GiB
    8192; < 160 GiB 8192; else 16384 (sglang-knobs reference 2.3); 0.5.9 and 0.5.19 use 2048
    below 35 GiB (:func:`version_defaults`).
    """
    return version_defaults(version).chunked_prefill(gpu.hbm_bytes / GIB)


def default_decode_graph_bs(gpu: GPU, tp_size: int, version: str | None = None) -> int:
    """Largest decode CUDA-graph batch size when unset, by GPU memory tier (memory_hook.py).

    0.5.23: < 20 GiB 8; < 35 GiB 48 (TP < 4) / 160; < 60 GiB 32 / 160; < 160 GiB 256 / 512;
    else 512 (sglang-knobs reference 2.3); 0.5.9 and 0.5.19: 24 / 80 below 35 GiB.
    """
    return version_defaults(version).decode_graph_bs(gpu.hbm_bytes / GIB, tp_size)


def prefill_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts the prefill CUDA graph captures, up to ``max_tokens``.

    Source: ``cuda_graph_hook.py`` (sglang-knobs reference 2.3): 4..32 step 4, 48..256 step 16,
    288..512 step 32, 576..1024 step 64, 1280..4096 step 256, then step 512 (58 sizes for 8192).
    """
    sizes = (list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
             + list(range(576, 1025, 64)) + list(range(1280, 4097, 256))
             + list(range(4608, max(max_tokens, 4608) + 1, 512)))
    return [s for s in sizes if s <= max_tokens]


def default_mem_fraction(model: ModelArch, gpu: GPU, tp_size: int, chunked: int,
                         graph_bs: int, version: str | None = None,
                         speculative: str | None = None, prefill_graphs: bool = True, *,
                         pp_size: int = 1, attn_dp_size: int = 1, role: str = "null",
                         deepep: bool = False, decode_tokens: int | None = None) -> float:
    """``mem_fraction_static`` when unset (memory_hook.py: handle_gpu_memory_settings).

    Reserved MiB = 512 + 1.5 x max(chunked, 2048) + tp/8 x 1024 + 2 x decode graph max bs
    + prefill graph reserve (flat 1,536 MiB for MLA/DSA models, else 8 MiB per captured prefill
    size up to ``chunked``: 50 sizes for 4096 tokens, 58 for 8192, 74 for 16384); at least
    10,240 MiB when the GPU has more than 60 GiB. The fraction is rounded to 3 decimals.
    SGLang 0.5.9 (``version``) reserves no prefill graph and adds 2 GiB for EAGLE-like
    ``speculative`` algorithms (6 GiB STANDALONE) after the floor (:func:`version_defaults`).
    ``--disable-cuda-graph`` (``graph_bs`` 0, ``prefill_graphs`` False) reserves neither graph
    term (0.5.23 ``memory_hook.py:359-398`` reserve_for_graph_mb: only phases not DISABLED).

    Layouts (0.5.23 ``memory_hook.py:297-317, 357-414``; the hook runs before attention DP
    divides the chunk): the parallel term is ``tp x pp / 8 x 1024``; a PD ``role`` prefill
    server reserves no decode graph, a decode server no prefill graph and sizes the
    activations by ``decode_tokens`` (``max((max_running_requests or graph max bs or 1) x
    (num_draft_tokens or 1), 2048)``); attention DP adds ``3 x graph_bs x attn_dp_size`` (and
    ``1.5 x`` more above a max bs of 300); DeepEP (``deepep``) adds 1,024 for the breakable
    prefill graph and, with decode graphs, 2,048 after the 10 GiB floor. The caller passes
    ``prefill_graphs`` False where the engine disables the prefill graph first
    (``cuda_graph_hook.py:150-161`` PP, ``:218-229`` TBO or an a2a backend other than
    none/deepep/megamoe/flashinfer, ``:568-576`` a decode server).
    """
    rules = version_defaults(version)
    gpu_mib = gpu.hbm_mib
    prefill_graph = 1536 if model.attention in ("mla", "dsa") \
        else 8 * len(prefill_capture_sizes(chunked))
    if not rules.prefill_graph_reserve or not prefill_graphs or role == "decode":
        prefill_graph = 0
    elif deepep:
        prefill_graph += 1024
    decode_graph: float = 0 if role == "prefill" else 2 * graph_bs
    if attn_dp_size > 1 and role != "prefill":
        decode_graph += graph_bs * attn_dp_size * (4.5 if graph_bs > 300 else 3)
    tokens = max(decode_tokens if role == "decode" and decode_tokens else chunked, 2048)
    reserved = 512 + 1.5 * tokens + tp_size * pp_size / 8 * 1024 + decode_graph + prefill_graph
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10240)
    if deepep and role != "prefill" and graph_bs:
        reserved += 2048
    reserved += rules.speculative_reserve(speculative)
    return round((gpu_mib - reserved) / gpu_mib, 3)


def default_max_running_requests(kv_tokens: int, context_len: int) -> int:
    """The engine default (kv_cache_configurator.py: resolve_max_num_reqs), requests."""
    estimate = min(max(int(kv_tokens / context_len * 512), 2048), 4096)
    return min(estimate, kv_tokens // 2)


def resolve_max_running_requests(requested: int | None, kv_tokens: int, context_len: int,
                                 speculative: bool, version: str | None = None,
                                 attn_dp_size: int = 1) -> int:
    """``max_running_requests`` per replica as ``resolve_max_num_reqs`` sets it, requests.

    Args:
        requested: ``--max-running-requests`` (None: unset).
        kv_tokens: KV pool size, tokens.
        context_len: the model's context length, tokens.
        speculative: a speculative algorithm is on (unset then means 48, speculative_hook.py).
        version: SGLang release (None: 0.5.23); 0.5.19 bounds an explicit value by
            ``kv_tokens // 2`` only, 0.5.9 takes it as given (:func:`version_defaults`).
        attn_dp_size: attention-DP ranks; an explicit (or speculative) value is the whole
            server's and each rank gets ``value // attn_dp_size``
            (``kv_cache_configurator.py:3126-3129``; 48 -> 6 per rank at DP 8). ``kv_tokens``
            is then one rank's pool.

    Returns:
        ``min(max(1, value // attn_dp_size), kv_tokens // 2)`` for an explicit (or speculative
        48) value, else :func:`default_max_running_requests`; 0 when the pool holds fewer than
        2 tokens. Per scheduler.
    """
    if requested is None and speculative:
        requested = SPEC_MAX_RUNNING_REQUESTS
    if requested is None:
        return default_max_running_requests(kv_tokens, context_len)
    return version_defaults(version).explicit_running(requested // attn_dp_size, kv_tokens)
