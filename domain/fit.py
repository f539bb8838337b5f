"""Memory fit: weights per GPU, KV bytes per token, the KV pool, and SGLang's default rules.

Everything is per GPU of one replica unless named otherwise. Units: bytes for memory (GB = 1e9
bytes in messages), tokens for pool sizes.

SGLang 0.5.23 rules reproduced here (servetune's sglang-knobs reference, section 2):
- ``mem_fraction_static`` unset: ``python/sglang/srt/arg_groups/memory_hook.py:
  handle_gpu_memory_settings`` -- reserved MiB = 512 + 1.5 x activation_tokens
  + (tp x pp / 8) x 1024 + graph reserve, at least 10,240 MiB above 60 GiB of GPU memory;
  fraction = (gpu_mem - reserved) / gpu_mem.
- KV budget (``mem_cache/kv_cache_configurator.py: _profile_available_bytes``): free memory after
  loading weights minus (1 - mem_fraction_static) x free memory before loading, i.e.
  ``f x M - weights`` per GPU.
- ``max_running_requests`` unset (``KVCacheConfigurator.resolve_max_num_reqs``):
  ``min(clamp(int(kv_tokens / context_len x 512), 2048, 4096), kv_tokens // 2)``; explicit:
  ``min(value, kv_tokens // 2)``.
- ``chunked_prefill_size`` and decode CUDA-graph max batch size by GPU memory tier.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from domain.config import ServingConfig
from domain.errors import DoesNotFit
from domain.hardware import GPU, get_gpu
from domain.models import ModelArch, get_model

GIB = 2**30
MIB = 2**20
# CUDA context, NCCL buffers and allocator slack present before weights load (~1.5 GB per GPU in
# SGLang startup logs: "Load weight begin. avail mem=" sits about this far below the HBM size).
CONTEXT_OVERHEAD_BYTES = 1.5e9
# Activation memory actually touched per prefill token outside the static pool. SGLang reserves a
# conservative 1.5 MiB/token in memory_hook.py; measured peaks are lower, ~0.5 MiB/token for a
# 6k-hidden MoE (assumption of the twin, refined in twin v1).
ACTIVATION_BYTES_PER_TOKEN = 0.5 * MIB
KV_BYTES = {"bf16": 2.0, "fp8_e4m3": 1.0}
# ServingConfig fields that size GPU memory (weights, KV pool, activations, CUDA graphs): a
# memory failure other than weights-too-large is a property of exactly these values.
MEMORY_FIELDS = ("weights", "tp_size", "mem_fraction_static", "max_running_requests",
                 "chunked_prefill_size", "cuda_graph_max_bs_decode")


class FitReport(BaseModel):
    """Resolved memory layout of one replica (per GPU unless the name says per replica)."""

    model_config = ConfigDict(frozen=True)

    weight_bytes_per_gpu: float
    gpu_bytes: float
    mem_fraction_static: float
    mem_fraction_was_default: bool
    kv_dtype: str
    kv_bytes_per_token: float
    kv_pool_bytes_per_gpu: float
    kv_tokens: int
    context_len: int
    max_running_requests: int
    chunked_prefill_size: int
    cuda_graph_max_bs_decode: int
    arithmetic: str

    @property
    def kv_pool_gb(self) -> float:
        """KV pool per GPU in GB (1e9 bytes)."""
        return self.kv_pool_bytes_per_gpu / 1e9


def resolve_kv_dtype(config: ServingConfig, model: ModelArch, gpu: GPU) -> str:
    """The KV dtype SGLang 0.5.23 uses for ``kv_cache_dtype``.

    ``auto`` resolves to fp8_e4m3 for DSA models on SM100 and newer
    (``mem_cache/kv_cache_dtype.py``; sglang-knobs reference 1.2), else to the model dtype (bf16).
    """
    if config.kv_cache_dtype != "auto":
        return config.kv_cache_dtype
    if model.attention == "dsa" and gpu.sm_major >= 10:
        return "fp8_e4m3"
    return "bf16"


def default_chunked_prefill(gpu: GPU) -> int:
    """``chunked_prefill_size`` when unset, by GPU memory tier (memory_hook.py), tokens."""
    gib = gpu.hbm_bytes / GIB
    for limit, size in ((20, 2048), (35, 4096), (60, 4096), (90, 8192), (160, 8192)):
        if gib < limit:
            return size
    return 16384


def default_decode_graph_bs(gpu: GPU, tp_size: int) -> int:
    """Largest decode CUDA-graph batch size when unset, by GPU memory tier (memory_hook.py)."""
    gib = gpu.hbm_bytes / GIB
    if gib < 20:
        return 8
    if gib < 35:
        return 48 if tp_size < 4 else 160
    if gib < 60:
        return 32 if tp_size < 4 else 160
    if gib < 160:
        return 256 if tp_size < 4 else 512
    return 512


def default_mem_fraction(model: ModelArch, gpu: GPU, tp_size: int, chunked: int,
                         graph_bs: int) -> float:
    """``mem_fraction_static`` when unset (memory_hook.py: handle_gpu_memory_settings).

    Reserved MiB = 512 + 1.5 x max(chunked, 2048) + tp/8 x 1024 + 2 x decode graph max bs
    + prefill graph reserve (flat 1,536 MiB for MLA/DSA models, else 8 MiB per captured size,
    58 sizes for 8192 tokens); at least 10,240 MiB when the GPU has more than 60 GiB.
    """
    gpu_mib = gpu.hbm_mib
    prefill_graph = 1536 if model.attention in ("mla", "dsa") else 8 * 58
    reserved = 512 + 1.5 * max(chunked, 2048) + tp_size / 8 * 1024 + 2 * graph_bs + prefill_graph
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10240)
    return round((gpu_mib - reserved) / gpu_mib, 3)


def default_max_running_requests(kv_tokens: int, context_len: int) -> int:
    """The engine default (kv_cache_configurator.py: resolve_max_num_reqs), requests."""
    estimate = min(max(int(kv_tokens / context_len * 512), 2048), 4096)
    return min(estimate, kv_tokens // 2)


def fit(config: ServingConfig) -> FitReport:
    """Resolve the memory layout of one replica of ``config``, or raise ``DoesNotFit``.

    Raises:
        DoesNotFit: phase ``weights_load`` when the weight shard plus the CUDA context exceed the
            GPU (the engine dies with CUDA out of memory while loading); ``kv_pool`` when the
            weights exceed ``mem_fraction_static`` x memory (no room for a KV cache); and
            ``cuda_graph`` when 1 - mem_fraction_static leaves less than the prefill activations
            and decode graphs need.
        ConfigInvalid: unknown model, GPU or checkpoint.
    """
    model, gpu = get_model(config.model), get_gpu(config.gpu)
    t = config.tp_size
    total_w = model.weight_bytes(config.weights)
    w = total_w / t
    M = gpu.hbm_bytes
    head = (f"{config.weights} weights {total_w / 1e9:.1f} GB / TP{t} = {w / 1e9:.1f} GB per GPU; "
            f"{gpu.name} has {gpu.hbm_gb:.0f} GB")
    if w + CONTEXT_OVERHEAD_BYTES > M:
        raise DoesNotFit("weights_load", (w + CONTEXT_OVERHEAD_BYTES) / 1e9, M / 1e9,
                         f"{head}; {w / 1e9:.1f} + {CONTEXT_OVERHEAD_BYTES / 1e9:.1f} GB CUDA "
                         f"context > {gpu.hbm_gb:.0f} GB")
    chunked = config.chunked_prefill_size or default_chunked_prefill(gpu)
    if chunked == -1:
        chunked = 16384  # max_prefill_tokens default when chunking is disabled
    graph_bs = default_decode_graph_bs(gpu, t)
    if config.max_running_requests is not None:
        graph_bs = min(graph_bs, config.max_running_requests)
    if config.cuda_graph_max_bs_decode is not None:
        graph_bs = config.cuda_graph_max_bs_decode
    f_default = config.mem_fraction_static is None
    f = default_mem_fraction(model, gpu, t, chunked, graph_bs) if f_default \
        else config.mem_fraction_static
    assert f is not None
    budget = f * M
    if w >= budget:
        raise DoesNotFit("kv_pool", w / 1e9, budget / 1e9,
                         f"{head}; mem_fraction_static {f} x {gpu.hbm_gb:.0f} GB = "
                         f"{budget / 1e9:.1f} GB leaves no KV cache")
    # Outside the static pool the engine needs prefill activations and the decode CUDA graphs.
    outside = (1 - f) * M
    graphs = 2 * graph_bs * MIB + (1536 * MIB if model.attention in ("mla", "dsa") else 0)
    need = chunked * ACTIVATION_BYTES_PER_TOKEN + graphs
    if need > outside - CONTEXT_OVERHEAD_BYTES:
        raise DoesNotFit("cuda_graph", (need + CONTEXT_OVERHEAD_BYTES) / 1e9, outside / 1e9,
                         f"(1 - {f}) x {gpu.hbm_gb:.0f} GB = {outside / 1e9:.1f} GB outside the "
                         f"static pool < {need / 1e9:.1f} GB activations for {chunked} tokens + "
                         f"graphs for batch {graph_bs} + {CONTEXT_OVERHEAD_BYTES / 1e9:.1f} GB")
    kv_dtype = resolve_kv_dtype(config, model, gpu)
    per_tok = model.kv_bytes_per_token(KV_BYTES[kv_dtype], t)
    pool = budget - w
    kv_tokens = int(pool // per_tok)
    if config.max_running_requests is None:
        mrr = default_max_running_requests(kv_tokens, model.context_len)
    else:
        mrr = min(config.max_running_requests, kv_tokens // 2)
    arithmetic = (f"{head}; pool = {f} x {gpu.hbm_gb:.0f} GB - {w / 1e9:.1f} GB = "
                  f"{pool / 1e9:.1f} GB; {kv_dtype} KV {per_tok:,.0f} B/token -> "
                  f"{kv_tokens:,} tokens; max_running_requests {mrr}")
    return FitReport(
        weight_bytes_per_gpu=w, gpu_bytes=M, mem_fraction_static=f,
        mem_fraction_was_default=f_default, kv_dtype=kv_dtype, kv_bytes_per_token=per_tok,
        kv_pool_bytes_per_gpu=pool, kv_tokens=kv_tokens, context_len=model.context_len,
        max_running_requests=mrr, chunked_prefill_size=chunked,
        cuda_graph_max_bs_decode=graph_bs, arithmetic=arithmetic,
    )
