"""Memory fit: weights per GPU, KV bytes per token, the KV pool, and SGLang's default rules.

The derived defaults live in :mod:`domain.memory_defaults` and the per-stage weights of a
parallel layout in :mod:`domain.layout_memory`; both are re-exported here.

Everything is per GPU of one replica unless named otherwise. Units: bytes for memory (GB = 1e9
bytes in messages), tokens for pool sizes.

SGLang 0.5.23 rules reproduced here (servetune's sglang-knobs reference, section 2):
- ``mem_fraction_static`` unset: ``python/sglang/srt/arg_groups/memory_hook.py:
  handle_gpu_memory_settings`` -- reserved MiB = 512 + 1.5 x activation_tokens
  + (tp x pp / 8) x 1024 + graph reserve, at least 10,240 MiB above 60 GiB of GPU memory;
  fraction = (gpu_mem - reserved) / gpu_mem. It runs before the speculative hook, so the decode
  graph size in the reserve is the memory tier's (or an explicit --max-running-requests').
- KV budget (``mem_cache/kv_cache_configurator.py: _profile_available_bytes``): free memory after
  loading weights minus (1 - mem_fraction_static) x free memory before loading, i.e.
  ``f x M - weights`` per GPU, where weights include the speculative draft (MTP/NextN) layers.
  With speculation the draft model's KV pool holds as many tokens as the target's, so a token
  costs the target's and the draft layers' KV bytes.
- ``max_running_requests`` (``KVCacheConfigurator.resolve_max_num_reqs``): unset,
  ``min(clamp(int(kv_tokens / context_len x 512), 2048, 4096), kv_tokens // 2)``; explicit (or
  the 48 any speculative algorithm sets, ``speculative_hook.py``), ``min(max(1, value),
  kv_tokens // 2)``. Zero fails the server (``tp_worker.py``: ``max_running_request is zero``).
- ``chunked_prefill_size`` and decode CUDA-graph max batch size by GPU memory tier; the
  captured decode sizes are clamped to the request-slot pool (``base_cuda_graph_runner.py:
  get_batch_sizes_to_capture``), i.e. to max_running_requests (48 with speculation).
- HiCache host pool (``mem_cache/pool_host/base.py``): ``int(kv_tokens x hicache_ratio)`` tokens
  per GPU process at the device pool's bytes per token; ``hicache_ratio`` unset is 2.0, shrunk to
  fit when the host is short (``hicache_hook.py``, sglang-knobs reference 2.7).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from domain.config import ServingConfig
from domain.errors import DoesNotFit, InvalidCombination
from domain.graph_memory import deepep_buffer_bytes, graph_capture_bytes
from domain.hardware import GPU, get_gpu
from domain.layout_memory import (
    A2A_EP_SPANNING_BACKENDS as A2A_EP_SPANNING_BACKENDS,
)
from domain.layout_memory import (
    DP_ATTENTION_CONSERVATIVENESS,
    PD_EXTRA_SLOTS_MAX_PER_WORKER,
    StageMemory,
)
from domain.layout_memory import default_layout as default_layout
from domain.layout_memory import layout_label as layout_label
from domain.layout_memory import pp_layer_ranges as pp_layer_ranges
from domain.layout_memory import resolved_ep_size as resolved_ep_size
from domain.layout_memory import stage_memory as stage_memory
from domain.memory_defaults import GIB as GIB
from domain.memory_defaults import MIB as MIB
from domain.memory_defaults import default_chunked_prefill as default_chunked_prefill
from domain.memory_defaults import default_decode_graph_bs as default_decode_graph_bs
from domain.memory_defaults import (
    default_max_running_requests as default_max_running_requests,
)
from domain.memory_defaults import default_mem_fraction as default_mem_fraction
from domain.memory_defaults import prefill_capture_sizes as prefill_capture_sizes
from domain.memory_defaults import (
    resolve_max_running_requests as resolve_max_running_requests,
)
from domain.memory_defaults import version_defaults as version_defaults
from domain.model_arch import mamba_state_split
from domain.models import ModelArch, get_model
from domain.speculative import (
    SPEC_MAX_RUNNING_REQUESTS,
    SpecParams,
    resolve_speculative,
)

# CUDA context, NCCL buffers and allocator slack present before weights load (~1.5 GB per GPU in
# SGLang startup logs: "Load weight begin. avail mem=" sits about this far below the HBM size).
CONTEXT_OVERHEAD_BYTES = 1.5e9
# Activation memory actually touched per prefill token outside the static pool. SGLang reserves a
# conservative 1.5 MiB/token in memory_hook.py; measured peaks are lower, ~0.5 MiB/token for a
# 6k-hidden MoE (assumption of the twin, refined in twin v1).
ACTIVATION_BYTES_PER_TOKEN = 0.5 * MIB
KV_BYTES = {"bf16": 2.0, "fp8_e4m3": 1.0}
# ServingConfig fields that size GPU memory (weights, draft layers, KV pool, activations, CUDA
# graphs): a memory failure other than weights-too-large is a property of exactly these values.
MEMORY_FIELDS = ("weights", "tp_size", "kv_cache_dtype", "mem_fraction_static",
                 "max_running_requests", "chunked_prefill_size", "cuda_graph_max_bs_decode",
                 "speculative_algorithm")
# The layout fields that also size one GPU's memory (issue 21; domain/layout_memory.py): a
# memory lesson about a layout config conditions on those it sets off their default.
LAYOUT_MEMORY_FIELDS = ("attn_dp_size", "ep_size", "moe_a2a_backend", "deepep_mode",
                        "moe_dense_tp_size", "ep_num_redundant_experts", "enable_dp_lm_head",
                        "pp_size", "disaggregation_mode")
# HiCache host pool (SGLang 0.5.23): hicache_ratio when unset (hicache_hook.py:
# handle_hicache_ratio_default); each process keeps HICACHE_HOST_MEMORY_RESERVE_BYTES = 10 GiB of
# host memory free (pool_host/base.py); an unset ratio is shrunk to fit 80 % of the host memory
# left after that reserve (sglang-knobs reference 2.7).
HICACHE_DEFAULT_RATIO = 2.0
HICACHE_HOST_RESERVE_BYTES = 10 * GIB
HICACHE_AUTO_HOST_FRACTION = 0.8
class FitReport(BaseModel):
    """Resolved memory layout of one replica (per GPU unless the name says per replica).

    Units: bytes, tokens, requests. ``kv_bytes_per_token`` is the target model's KV per token
    and GPU; ``draft_kv_bytes_per_token`` the speculative draft layers' (0 when off), and the
    pool holds ``kv_tokens`` tokens of both. ``host_kv_tokens`` is the HiCache host tier per GPU
    process (0 when off) at ``kv_bytes_per_token`` each.

    Per scheduler: ``kv_tokens``, ``max_running_requests`` and ``chunked_prefill_size`` are one
    scheduler's (one attention-DP rank: each holds its own pool; one ``--dp-size`` copy);
    ``schedulers`` is how many a server runs (``config.schedulers``). With pipeline
    parallelism the per-GPU fields are the stage that bounds the pool (the engine MIN-reduces
    the stages' token capacities). ``deepep_buffer_bytes_per_gpu``: the DeepEP all-to-all
    buffers (0 without ``--moe-a2a-backend deepep``); ``graph_bytes_per_gpu``: the decode CUDA
    graphs; both outside the static pool. ``decode_extra_slots``: request slots a PD decode
    server adds for transfers in flight; ``conservativeness_scale``: the factor the engine
    applies to ``schedule_conservativeness`` (0.3 under attention DP);
    ``radix_cache_off_by_role``: a PD decode server runs without the radix cache.
    """

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
    attention_backend: str = ""
    page_size: int = 1
    speculative: SpecParams | None = None
    draft_weight_bytes_per_gpu: float = 0.0
    draft_kv_bytes_per_token: float = 0.0
    host_kv_tokens: int = 0
    hicache_ratio: float = 0.0
    host_kv_bytes_per_gpu: float = 0.0
    # Parallel layouts (issue 21): per scheduler = one attention-DP rank or one dp copy.
    schedulers: int = 1
    deepep_buffer_bytes_per_gpu: float = 0.0
    graph_bytes_per_gpu: float = 0.0
    decode_extra_slots: int = 0
    conservativeness_scale: float = 1.0
    radix_cache_off_by_role: bool = False

    @property
    def kv_pool_gb(self) -> float:
        """KV pool per GPU in GB (1e9 bytes)."""
        return self.kv_pool_bytes_per_gpu / 1e9

    @property
    def kv_smaller_than_context(self) -> bool:
        """The pool cannot hold one max-context request (SGLang warns; the server still runs)."""
        return self.kv_tokens < self.context_len


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


def resolve_attention_backend(config: ServingConfig, model: ModelArch,
                              gpu: GPU) -> tuple[str, int]:
    """``(attention backend, KV page size in tokens)`` the engine runs ``config`` with.

    The engine's per-SM rules (SGLang 0.5.23: ``domain/engines/sglang/arch.py``, each with its
    source line): ``--attention-backend`` unset resolves by the model's attention (GQA, MLA,
    DSA) and the GPU's SM major; the page size is ``--page-size`` (unset: 1) unless the
    backend forces or restricts it.
    """
    from domain.engines import engine_for

    return engine_for(config).attention_backend(config, model, gpu)


def hicache_host_pool(config: ServingConfig, gpu: GPU, kv_tokens: int,
                      kv_bytes_per_token: float) -> tuple[float, int]:
    """``(effective hicache_ratio, host KV tokens)`` of one GPU process; ``(0.0, 0)`` when off.

    An explicit ``--hicache-ratio`` is taken as given (a host that cannot hold it fails the
    server, see :func:`host_pool_shortfall`). Unset, the ratio is 2.0 shrunk so the node's
    processes together stay within 80 % of the host memory left after the 10 GiB reserve -- the
    twin's reading of 0.5.23's auto-sizing, which splits the node's host memory evenly over the
    GPU processes that share it (``min(gpus_per_node, tp_size x replicas)``).
    """
    if not config.enable_hierarchical_cache:
        return 0.0, 0
    ratio = config.hicache_ratio
    if ratio is None:
        ratio = HICACHE_DEFAULT_RATIO
        ranks = min(gpu.gpus_per_node, config.gpus)
        budget = HICACHE_AUTO_HOST_FRACTION * (gpu.host_mem_bytes_per_node
                                               - HICACHE_HOST_RESERVE_BYTES) / ranks
        device = kv_tokens * kv_bytes_per_token
        if device > 0 and ratio * device > budget:
            ratio = budget / device
    return ratio, int(kv_tokens * ratio)


def host_pool_shortfall(config: ServingConfig, report: FitReport) -> tuple[float, float] | None:
    """``(requested GB, free GB)`` when one GPU process's HiCache host pool does not fit.

    SGLang 0.5.23 (``mem_cache/pool_host/base.py:84-108`` and ``:250-252``): each rank may
    claim ``(available host memory - HICACHE_HOST_MEMORY_RESERVE_BYTES) // ranks_per_host``
    bytes, the node's ``n = min(gpus_per_node, tp_size x replicas)`` processes splitting it
    evenly, and raises ``Not enough host memory available. Requesting X GB but only have Y GB
    free`` when its pool is larger. None when the pool fits or HiCache is off. GB = 1e9 bytes.
    """
    gpu = get_gpu(config.gpu)
    x = report.host_kv_bytes_per_gpu
    if x <= 0:
        return None
    free = (gpu.host_mem_bytes_per_node - HICACHE_HOST_RESERVE_BYTES) // min(gpu.gpus_per_node,
                                                                             config.gpus)
    return (x / 1e9, free / 1e9) if x > free else None


def _lenient_spec(config: ServingConfig) -> SpecParams | None:
    """The resolved speculative parameters, or None when off or refused at startup.

    Flag combinations the engine refuses are startup's business
    (``domain/engines/sglang/startup.py``); the memory estimate then sizes the config as if
    speculation were off.
    """
    try:
        return resolve_speculative(config)
    except InvalidCombination:
        return None


def fit_servers(config: ServingConfig) -> list[tuple[str, int, ServingConfig, FitReport]]:
    """``(role, count, server config, its fit)`` of every server group of ``config``.

    Aggregated: ``[("server", replicas, config, fit(config))]``; PD: the prefill then the
    decode group (:meth:`ServingConfig.servers`), each fitted as one server of its role.

    Raises:
        DoesNotFit: a group's servers do not fit (the first that does not).
        ConfigInvalid: unknown model, GPU or checkpoint.
    """
    return [(role, n, c, fit(c)) for role, n, c in config.servers()]


def fit(config: ServingConfig) -> FitReport:
    """Resolve the memory layout of one server of ``config``, or raise ``DoesNotFit``.

    Per GPU and per scheduler (see :class:`FitReport`); with a PD layout, one decode server's
    (:func:`fit_servers` fits every group). Flag combinations SGLang refuses while resolving
    arguments are not checked here (see ``domain/engines/sglang/startup.py``), nor is the
    HiCache host pool against host memory (:func:`host_pool_shortfall`).

    Layouts (:func:`stage_memory` for the weights): the KV pool of each attention-DP rank holds
    GQA KV heads over ``attn_tp_size`` (an MLA latent whole on every GPU) of its stage's layers;
    the pool's tokens are the smallest over the PP stages; ``chunked_prefill_size`` is divided
    by ``attn_dp_size`` after the memory fraction is resolved (``parallel_hook.py:326-336``);
    the explicit or speculative ``max_running_requests`` is split over the ranks
    (:func:`resolve_max_running_requests`); DeepEP's buffers
    (:func:`domain.graph_memory.deepep_buffer_bytes`) and the decode graphs sit outside the
    static pool; a PD prefill server captures no decode graph and a decode server no prefill
    graph (``cuda_graph_hook.py:557-576``); ``--deepep-mode normal`` disables both graphs
    after the fraction is resolved (``moe_hook.py:383-398``).

    Raises:
        DoesNotFit: phase ``weights_load`` when the weight shard (draft layers included) plus
            the CUDA context exceed the GPU (the engine dies with CUDA out of memory while
            loading); ``kv_pool`` when the weights exceed ``mem_fraction_static`` x memory (no
            room for a KV cache, or room for less than one token: cause ``no_room``,
            ``pool_configurator.py:95``), when the pool holds fewer than 2 tokens so
            max_running_requests is 0 (cause ``zero_requests``, ``tp_worker.py:420``), or
            ``min(context_len, tokens) - 1 <= 0`` (cause ``pool_too_small``,
            ``tp_worker.py:425``; with ``tokens // 2`` requests that needs a one-token context);
            and ``cuda_graph`` when 1 - mem_fraction_static leaves less than the prefill
            activations, the decode graphs and the DeepEP buffers need.
        ConfigInvalid: unknown model, GPU or checkpoint.
    """
    if config.pd is not None:
        return fit(config.pd_worker("decode"))
    model, gpu = get_model(config.model), get_gpu(config.gpu)
    if config.context_length is not None:  # --context-length: the context the server runs
        model = model.model_copy(update={"context_len": config.context_length})
    t = config.tp_size
    spec = _lenient_spec(config)
    total_w = model.weight_bytes(config.weights)
    stages = stage_memory(config, model, spec is not None)
    tp_only = default_layout(config)
    heavy = max(stages, key=lambda st: st.weight_bytes + st.draft_weight_bytes)
    w, draft_w = heavy.weight_bytes, heavy.draft_weight_bytes
    M = gpu.hbm_bytes
    exact = " (model.safetensors.index.json total_size)" \
        if model.checkpoint(config.weights).exact_total_bytes is not None else ""
    if tp_only:
        head = (f"{config.weights} weights{exact} {total_w / 1e9:.1f} GB / TP{t} = "
                f"{w / 1e9:.1f} GB per GPU; {gpu.name} has {gpu.hbm_gb:.0f} GB")
    else:
        where = f" on the largest of {len(stages)} stages" if len(stages) > 1 else ""
        head = (f"{config.weights} weights{exact} {total_w / 1e9:.1f} GB over "
                f"{layout_label(config)} = {w / 1e9:.1f} GB per GPU{where}; {gpu.name} has "
                f"{gpu.hbm_gb:.0f} GB")
    if draft_w:
        head += f"; draft (MTP) layers {draft_w / 1e9:.2f} GB per GPU"
    if w + draft_w + CONTEXT_OVERHEAD_BYTES > M:
        draft_txt = f" + {draft_w / 1e9:.1f} GB draft" if draft_w else ""
        raise DoesNotFit("weights_load", (w + draft_w + CONTEXT_OVERHEAD_BYTES) / 1e9, M / 1e9,
                         f"{head}; {w / 1e9:.1f}{draft_txt} + "
                         f"{CONTEXT_OVERHEAD_BYTES / 1e9:.1f} GB CUDA context > "
                         f"{gpu.hbm_gb:.0f} GB")
    ver = config.engine_version
    role = config.disaggregation_mode
    dp = config.attn_dp_size
    chunked = config.chunked_prefill_size or default_chunked_prefill(gpu, ver)
    if chunked == -1:
        chunked = 16384  # max_prefill_tokens default when chunking is disabled
    graph_bs = default_decode_graph_bs(gpu, t, ver)
    if config.max_running_requests is not None and version_defaults(ver).clamp_graph_to_running:
        graph_bs = min(graph_bs, config.max_running_requests)
    if config.cuda_graph_max_bs_decode is not None:
        graph_bs = config.cuda_graph_max_bs_decode
    if config.disable_cuda_graph or role == "prefill":  # cuda_graph_hook.py:55-57, :559-566
        graph_bs = 0
    deepep = config.moe_a2a_backend == "deepep"
    prefill_graphs = (not config.disable_cuda_graph and config.pp_size == 1
                      and not config.enable_two_batch_overlap
                      and config.moe_a2a_backend in (None, "none", "deepep", "megamoe",
                                                     "flashinfer"))
    f_default = config.mem_fraction_static is None
    # a PD decode server runs decode batches only (memory_hook.py:298-303 sizes its activations
    # by them); every other server its prefill chunk
    decode_tokens = (config.max_running_requests or graph_bs or 1) \
        * (config.speculative_num_draft_tokens or 1)
    act_tokens = max(decode_tokens, 2048) if role == "decode" else chunked
    f = default_mem_fraction(
        model, gpu, t, chunked, graph_bs, ver, spec.algorithm if spec else None,
        prefill_graphs=prefill_graphs, pp_size=config.pp_size, attn_dp_size=dp, role=role,
        deepep=deepep, decode_tokens=decode_tokens) if f_default \
        else config.mem_fraction_static
    assert f is not None
    if deepep and (config.deepep_mode or "auto") == "normal":  # moe_hook.py:383-398
        graph_bs = 0
    budget = f * M
    if w + draft_w >= budget:
        raise DoesNotFit("kv_pool", (w + draft_w) / 1e9, budget / 1e9,
                         f"{head}; mem_fraction_static {f} x {gpu.hbm_gb:.0f} GB = "
                         f"{budget / 1e9:.1f} GB leaves no KV cache", cause="no_room")
    backend, page = resolve_attention_backend(config, model, gpu)
    # --page-size rounds the pool to whole pages where it changes the server's page; the
    # rounding to a backend's own page (< 64 tokens of a pool) is left out of the twin
    paged = page if config.page_size is not None and page != resolve_attention_backend(
        config.model_copy(update={"page_size": None}), model, gpu)[1] else 1
    kv_dtype = resolve_kv_dtype(config, model, gpu)
    full_tok = model.kv_bytes_per_token(KV_BYTES[kv_dtype], config.attn_tp_size)
    # the pool of each stage; the engine runs the smallest (the pipeline MIN-reduce)
    best: tuple[int, StageMemory, float, float, float, int | None, str] | None = None
    for st in stages:
        per_tok = full_tok * st.kv_share
        draft_per_tok = full_tok / model.layers * model.mtp_layers \
            if spec and st.draft_weight_bytes else 0.0
        if per_tok + draft_per_tok <= 0:
            continue  # a stage without attention layers holds no KV
        pool = budget - st.weight_bytes - st.draft_weight_bytes
        # hybrid linear-attention/Mamba models: the per-request state pool takes ratio/(1 +
        # ratio) of the room and caps the requests (domain/model_arch.py:mamba_state_split)
        pool, state_slots, state_txt = mamba_state_split(model, config.attn_tp_size, pool)
        tokens = int(pool // (per_tok + draft_per_tok))
        tokens = tokens // paged * paged  # whole pages (pool_configurator.py:646)
        if best is None or tokens < best[0]:
            best = (tokens, st, per_tok, draft_per_tok, pool, state_slots, state_txt)
    assert best is not None
    kv_tokens, st, per_tok, draft_per_tok, pool, state_slots, state_txt = best
    w, draft_w = st.weight_bytes, st.draft_weight_bytes
    mrr = resolve_max_running_requests(config.max_running_requests, kv_tokens,
                                       model.context_len, spec is not None, ver,
                                       attn_dp_size=dp)
    if state_slots is not None:
        mrr = min(mrr, state_slots)
    kv_txt = (f"{kv_dtype} KV {per_tok:,.0f} B/token"
              + (f" + draft {draft_per_tok:,.0f} B/token" if draft_per_tok else ""))
    stage_txt = f" (stage layers {st.layers[0]}-{st.layers[1] - 1})" if len(stages) > 1 else ""
    pool_txt = (f"{head}; pool = {f} x {gpu.hbm_gb:.0f} GB - {(w + draft_w) / 1e9:.1f} GB"
                f"{stage_txt}{state_txt} = {pool / 1e9:.3f} GB; {kv_txt} -> {kv_tokens:,} "
                f"tokens" + (" per attention-DP rank" if dp > 1 else ""))
    if kv_tokens <= 0:  # pool_configurator.py:95 (MemoryPoolConfig: max_total_num_tokens <= 0)
        raise DoesNotFit("kv_pool", (w + draft_w + per_tok + draft_per_tok) / 1e9, budget / 1e9,
                         f"{pool_txt}: not one token", cause="no_room")
    if mrr < 1:
        raise DoesNotFit("kv_pool", 2 * (per_tok + draft_per_tok) / 1e9, pool / 1e9,
                         f"{pool_txt}; max_running_requests = min(..., {kv_tokens} // 2) = 0",
                         cause="zero_requests")
    if min(model.context_len - 1, kv_tokens - 1) <= 0:  # tp_worker.py:421-425: max_req_len
        raise DoesNotFit("kv_pool", 2 * (per_tok + draft_per_tok) / 1e9, pool / 1e9,
                         f"{pool_txt}; the longest request would be {kv_tokens - 1} tokens",
                         cause="pool_too_small")
    # Outside the static pool the engine needs prefill activations, the decode CUDA graphs and
    # the DeepEP buffers; captured sizes stop at the request-slot pool (max_running_requests).
    captured_bs = min(graph_bs, mrr)
    outside = (1 - f) * M
    graphs = 0.0 if config.disable_cuda_graph else graph_capture_bytes(
        model, config.attn_tp_size, captured_bs, backend, spec is not None, gpu.sm_major,
        spec.draft_tokens if spec is not None else 1)
    a2a = 0.0
    if deepep and model.n_routed_experts:
        a2a = deepep_buffer_bytes(model.hidden, resolved_ep_size(config),
                                  model.n_routed_experts + config.ep_num_redundant_experts,
                                  config.deepep_mode or "auto")
    need = act_tokens * ACTIVATION_BYTES_PER_TOKEN + graphs + a2a
    if need > outside - CONTEXT_OVERHEAD_BYTES:
        a2a_txt = f" + DeepEP buffers {a2a / 1e9:.2f} GB" if a2a else ""
        raise DoesNotFit("cuda_graph", (need + CONTEXT_OVERHEAD_BYTES) / 1e9, outside / 1e9,
                         f"(1 - {f}) x {gpu.hbm_gb:.0f} GB = {outside / 1e9:.1f} GB outside the "
                         f"static pool < {need / 1e9:.1f} GB activations for {act_tokens} tokens + "
                         f"graphs for batch {captured_bs}{a2a_txt} + "
                         f"{CONTEXT_OVERHEAD_BYTES / 1e9:.1f} GB")
    ratio, host_tokens = hicache_host_pool(config, gpu, kv_tokens, per_tok)
    arithmetic = f"{pool_txt}; max_running_requests {mrr}"
    requested = config.max_running_requests or (SPEC_MAX_RUNNING_REQUESTS if spec else None)
    if dp > 1 and requested is not None:
        arithmetic += f" ({requested} // attn_dp_size {dp} per rank, x {dp} ranks)"
    if spec:
        arithmetic += (f" ({SPEC_MAX_RUNNING_REQUESTS} with speculative decoding unless set); "
                       f"{spec.algorithm} steps {spec.num_steps} topk {spec.topk} draft tokens "
                       f"{spec.draft_tokens}")
    rank_chunk = chunked
    if dp > 1 and config.chunked_prefill_size != -1:  # parallel_hook.py:326-336
        rank_chunk = chunked // dp
        arithmetic += f"; chunked_prefill_size {chunked} // {dp} = {rank_chunk} per rank"
    if a2a:
        arithmetic += (f"; DeepEP {config.deepep_mode or 'auto'} buffers {a2a / 1e9:.2f} GB "
                       f"per GPU (EP{resolved_ep_size(config)})")
    if host_tokens:
        arithmetic += (f"; HiCache host pool {ratio:.2f} x {kv_tokens:,} = {host_tokens:,} tokens "
                       f"= {host_tokens * per_tok / 1e9:.1f} GB per GPU")
    extra = 0
    if role == "decode" and config.max_running_requests is not None:  # pd_..._hook.py:133-143
        per_worker = max(1, config.max_running_requests // config.schedulers)
        extra = 2 * per_worker if per_worker <= PD_EXTRA_SLOTS_MAX_PER_WORKER else 0
    return FitReport(
        weight_bytes_per_gpu=w, gpu_bytes=M, mem_fraction_static=f,
        mem_fraction_was_default=f_default, kv_dtype=kv_dtype, kv_bytes_per_token=per_tok,
        kv_pool_bytes_per_gpu=pool, kv_tokens=kv_tokens, context_len=model.context_len,
        max_running_requests=mrr, chunked_prefill_size=rank_chunk,
        cuda_graph_max_bs_decode=captured_bs, arithmetic=arithmetic,
        attention_backend=backend, page_size=page, speculative=spec,
        draft_weight_bytes_per_gpu=draft_w, draft_kv_bytes_per_token=draft_per_tok,
        host_kv_tokens=host_tokens, hicache_ratio=ratio,
        host_kv_bytes_per_gpu=host_tokens * per_tok, schedulers=config.schedulers,
        deepep_buffer_bytes_per_gpu=a2a, graph_bytes_per_gpu=graphs, decode_extra_slots=extra,
        conservativeness_scale=DP_ATTENTION_CONSERVATIVENESS if dp > 1 else 1.0,
        radix_cache_off_by_role=role == "decode",
    )
