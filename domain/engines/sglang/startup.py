"""SGLang startup on the twin: the log an SGLang 0.5.23 server prints, and the ways it dies.

The stage markers and error texts are the engine's own. Every refusal is a row of
:data:`domain.engines.sglang.refusals.REFUSALS`, which names the 0.5.23 statement it reproduces
(``file:line``); the traceback the twin prints has that file, line, function and source line,
and ends in the engine's exception and message. A failed startup yields the log up to the
failure, so a classifier reads it exactly as it would read a real pod log.

Phases, in the order the server reaches them:

- ``parse``: argparse refuses a flag or choice of the pinned version (exit 2;
  ``server_args.py:696``).
- ``init_distributed``: tp_size exceeds one node (no ``--nnodes``): rank ``tp_size - 1`` is
  given device ``tp_size - 1`` (``entrypoints/engine.py:935``), an invalid CUDA ordinal.
- ``resolve``: the resolution pipeline refuses a flag combination -- a traceback ending in the
  engine's ``ValueError`` / ``AssertionError`` / ``TypeError`` before ``Load weight begin``
  (exit 1): HiCache with the radix cache disabled, every speculative refusal of
  :func:`domain.speculative.resolve_speculative_logged`, trtllm_mla off Blackwell and
  cutedsl_mla off SM100 (``overrides.py``), a negative ``--schedule-conservativeness``.
- ``model_init``: the attention layer's tensor-parallel asserts (as the loader builds the
  model, after ``Load weight begin`` and before any weight is read: query heads
  divide by tp_size; KV heads divide by it, or tp_size by them -- KV heads are replicated when
  tp_size exceeds them), attention-backend refusals and a speculative draft worker without a
  draft model (after the target's weights load).
- ``load_weights``: CUDA out of memory while loading the target or the draft layers.
- ``kv_pool``: weights leave no KV cache (``Not enough memory. Please try to increase
  --mem-fraction-static``); ``max_running_request is zero``; ``Memory pool size is too small``.
- ``cuda_graph``: CUDA-graph capture runs out of memory.
- ``host_pool``: the HiCache host pool does not fit this rank's share of host memory (``Not
  enough host memory available. Requesting X GB but only have Y GB free``). A host pool not
  larger than the device pool is only a warning.

A pool smaller than the context length is only a warning (``KV pool holds N tokens, fewer than
--context-length M``); that server starts.
"""

from __future__ import annotations

import re

from domain.config import ServingConfig
from domain.engines import engine_for
from domain.engines.sglang.arch import (
    BLACKWELL_SM_MAJORS,
    TRTLLM_GEN_MOE_RUNNERS,
)
from domain.engines.sglang.layout_rules import (
    expert_refusal,
    layout_refusal,
    tbo_refusal,
)
from domain.engines.sglang.refusals import (
    CUDA_ERROR_HINT,
    CUDA_GRAPH_CAPTURE_FAILED_LINES,
    HICACHE_SMALL_HOST_WARNING,
    REFUSALS,
    attention_split_width,
    tp_refusal,
)
from domain.errors import DoesNotFit, InvalidCombination, UnknownFlag
from domain.fit import (
    CONTEXT_OVERHEAD_BYTES,
    FitReport,
    fit,
    host_pool_shortfall,
    resolve_attention_backend,
    resolved_ep_size,
    stage_memory,
)
from domain.hardware import get_gpu
from domain.models import ModelArch, get_model
from domain.speculative import (
    SPEC_MAX_RUNNING_REQUESTS,
    SpecResolution,
    hf_architecture,
    resolve_speculative_logged,
    spec_capture_sizes,
)
from domain.twin.startup import Startup

# Weight loading from a local NVMe-backed model cache, bytes/s per GPU (sglang-knobs reference
# 7.3: typical of such caches); fixed start-up work besides loading (graph capture, warm-up), s.
LOAD_BYTES_PER_S = 2.5e9
FIXED_STARTUP_S = 60.0
# trtllm_mha's kernels: XQA/fmha_v2 on SM90 and SM120, trtllm-gen on SM100
# (layers/attention/trtllm_mha_backend.py:1-10, :258)
TRTLLM_MHA_SM_MAJORS = (9, 10, 12)


def _uses_mla(model: ModelArch) -> bool:
    """``runner.use_mla_backend``: MLA and DSA (MLA-based) attention."""
    return model.attention != "gqa"


def _backend_refusal(config: ServingConfig, model: ModelArch, sm_major: int) -> str | None:
    """The key of the model-init attention-backend refusal (:data:`REFUSALS`), else None.

    The checks of ``layers/attention/attention_registry.py`` (0.5.23) as the model runner builds
    the resolved backend: fa3 asserts ``(major == 8 and not use_mla) or major == 9``;
    trtllm_mla and cutedsl_mla need an MLA model, trtllm_mha a non-MLA one, and then a GPU
    its kernels exist for (SM 9/10/12: the twin's stand-in ``backend_trtllm_mha_sm``).
    """
    b = resolve_attention_backend(config, model, get_gpu(config.gpu))[0]
    mla = _uses_mla(model)
    if b == "fa3" and not ((sm_major == 8 and not mla) or sm_major == 9):
        return "backend_fa3_sm"
    if b == "trtllm_mla" and not mla:
        return "backend_trtllm_mla_model"
    if b == "cutedsl_mla" and not mla:
        return "backend_cutedsl_model"
    if b == "trtllm_mha" and mla:
        return "backend_trtllm_mha_model"
    if b == "trtllm_mha" and sm_major not in TRTLLM_MHA_SM_MAJORS:
        return "backend_trtllm_mha_sm"
    return None


def moe_runner_refusal(config: ServingConfig) -> str | None:
    """``moe_trtllm_gen_sm`` when an explicit trtllm-gen MoE runner meets a GPU other than SM 10.

    ``--moe-runner-backend`` flashinfer_trtllm / flashinfer_trtllm_routed /
    experimental_sgl_trtllm run trtllm-gen kernels, SM100-only (``overrides.py:1513-1522``);
    a dense model builds no MoE runner. The twin's stand-in (no 0.5.23 refusing statement).
    """
    if config.moe_runner_backend not in TRTLLM_GEN_MOE_RUNNERS:
        return None
    if not get_model(config.model).n_routed_experts or get_gpu(config.gpu).sm_major == 10:
        return None
    return "moe_trtllm_gen_sm"


def mm_backend_refusal(config: ServingConfig) -> str | None:
    """``mm_fa3_blackwell`` for vision fa3 on Blackwell, else None.

    ``--mm-attention-backend fa3`` on a multimodal model on an ``is_blackwell`` GPU (SM
    10/11/12; ``layers/attention/vision.py:1330-1331``).

    A model without a vision tower (``ModelArch.vision_params`` 0 or absent) builds no vision
    encoder, so the flag is never read.
    """
    if config.mm_attention_backend != "fa3" or get_gpu(config.gpu).sm_major not in \
            BLACKWELL_SM_MAJORS:
        return None
    return "mm_fa3_blackwell" if getattr(get_model(config.model), "vision_params", 0) else None


def refusal_fields(config: ServingConfig) -> dict[str, object]:
    """The ``{name}`` fields of the per-SM refusal messages: ``sm`` (e.g. ``120``), ``runner``."""
    gpu = get_gpu(config.gpu)
    return {"sm": f"{gpu.sm_major}{gpu.sm_minor}", "runner": config.moe_runner_backend}


def attention_backend_refusal(config: ServingConfig) -> str | None:
    """The :data:`REFUSALS` key of the first refusal of ``config``'s attention backend, or None.

    In the engine's order: the argument-resolution checks (trtllm_mla off Blackwell,
    ``overrides.py:1211``; cutedsl_mla off SM100, ``:1245``), then the model runner's
    (:func:`_backend_refusal`). For one backend flag of a launch command, pass the config with
    ``attention_backend`` set to it.
    """
    model, gpu = get_model(config.model), get_gpu(config.gpu)
    backend = resolve_attention_backend(config, model, gpu)[0]
    if backend == "trtllm_mla" and gpu.sm_major not in BLACKWELL_SM_MAJORS:
        return "backend_trtllm_mla_sm"
    if backend == "cutedsl_mla" and gpu.sm_major != 10:
        return "backend_cutedsl_sm"
    return _backend_refusal(config, model, gpu.sm_major)


def _refuse(key: str, **fields: object) -> InvalidCombination:
    """An :class:`InvalidCombination` carrying the engine's refusal ``key``."""
    r = REFUSALS[key]
    msg = r.message.format(**fields) if fields else r.message
    return InvalidCombination(r.exception, msg, (r.file, r.function), key)


def _traceback(e: InvalidCombination) -> list[str]:
    """The Python traceback the engine prints for ``e``, its frame at the 0.5.23 site."""
    frame = REFUSALS[e.key].frame() if e.key in REFUSALS else [f'  File "{e.where[0]}", in '
                                                               f"{e.where[1]}"]
    return ["Traceback (most recent call last):", *frame, e.line]


def _resolve(config: ServingConfig, nnodes: int | None = None
             ) -> tuple[SpecResolution, list[str]]:
    """Run the checks of SGLang's resolution pipeline in its order.

    Returns:
        The speculative resolution and the warning lines logged on the way.

    Raises:
        InvalidCombination: with the engine's exception, message and refusal key: a
            ``--context-length`` above the model's (``configs/model_config.py:1314``, as the
            launcher builds the ModelConfig), HiCache with
            the radix cache disabled, every speculative refusal, trtllm_mla off Blackwell and
            cutedsl_mla off SM100 (``overrides.py`` post-process passes), a negative
            ``--schedule-conservativeness``.
    """
    derived = get_model(config.model).context_len
    if config.context_length is not None and config.context_length > derived:
        raise _refuse("context_length_too_long", asked=config.context_length, derived=derived)
    if config.enable_hierarchical_cache and config.disable_radix_cache:
        raise _refuse("hicache_without_radix")
    spec = resolve_speculative_logged(config)
    backend_key = attention_backend_refusal(config)
    if backend_key in ("backend_trtllm_mla_sm", "backend_cutedsl_sm"):
        raise _refuse(backend_key)
    layout = layout_refusal(config, nnodes)
    if layout is not None:
        raise _refuse(layout[0], **layout[1])
    if config.schedule_conservativeness is not None and config.schedule_conservativeness < 0:
        raise _refuse("schedule_conservativeness")
    tbo = tbo_refusal(config)
    if tbo is not None:
        raise _refuse(tbo)
    log = list(spec.log)
    ep = resolved_ep_size(config)
    if ep != config.ep_size:  # overrides.py:1611-1620: a resolution, logged
        log.append(f"{config.moe_a2a_backend} MoE is enabled. The expert parallel size is "
                   f"adjusted from {config.ep_size} to the tensor parallel size "
                   f"[{config.tp_size}].")
    return spec, log


def _load_lines(name: str, w: float, avail: float) -> list[str]:
    """``Load weight begin/end`` for ``w`` bytes per GPU with ``avail`` bytes free before."""
    return [f"Load weight begin. avail mem={avail / 2**30:.2f} GB",
            f"Load weight end. elapsed={w / LOAD_BYTES_PER_S:.2f} s, type={name}, "
            f"avail mem={(avail - w) / 2**30:.2f} GB, mem usage={w / 2**30:.2f} GB."]


def _oom_lines(gpu_bytes: float) -> list[str]:
    """CUDA OOM while the model's parameters are allocated (``REFUSALS['oom_weights']``)."""
    return REFUSALS["oom_weights"].traceback(total_gib=gpu_bytes / 2**30)


def _failed_memory(config: ServingConfig, model: ModelArch, e: DoesNotFit, log: list[str],
                   spec_on: bool) -> Startup:
    """The log and phase of a startup that ``fit`` rules out with ``e``."""
    gpu = get_gpu(config.gpu)
    heavy = max(stage_memory(config, model, spec_on),
                key=lambda st: st.weight_bytes + st.draft_weight_bytes)
    w, draft_w = heavy.weight_bytes, heavy.draft_weight_bytes
    avail = gpu.hbm_bytes - CONTEXT_OVERHEAD_BYTES
    if e.phase == "weights_load":
        if w > avail:  # the target's own shard does not fit
            log += [f"Load weight begin. avail mem={avail / 2**30:.2f} GB",
                    *_oom_lines(gpu.hbm_bytes)]
        else:  # the target loads, its draft (MTP) layers do not
            log += _load_lines(model.name, w, avail)
            log += [f"Load weight begin. avail mem={(avail - w) / 2**30:.2f} GB",
                    *_oom_lines(gpu.hbm_bytes)]
        return Startup(ready=False, phase="load_weights", exit_code=1, log=log)
    log += _load_lines(model.name, w, avail)
    if draft_w:
        log += _load_lines(f"{model.name}-nextn", draft_w, avail - w)
    if e.phase == "kv_pool" and e.cause == "no_room":
        # fit() reports the budget f x M as available_gb: the fraction, resolved default or not
        f = config.mem_fraction_static or round(e.available_gb * 1e9 / gpu.hbm_bytes, 3)
        log += REFUSALS["kv_no_room"].traceback(fraction=f)
        return Startup(ready=False, phase="kv_pool", exit_code=1, log=log)
    if e.phase == "kv_pool":
        key = "kv_zero_requests" if e.cause == "zero_requests" else "kv_pool_too_small"
        per_token = e.required_gb / 2  # fit() asks for 2 tokens' bytes in both causes
        log.append(f"KV Cache is allocated. #tokens: {int(e.available_gb // per_token)}")
        log += REFUSALS[key].traceback()
        return Startup(ready=False, phase="kv_pool", exit_code=1, log=log)
    log += ["Capture target decode CUDA graph begin. backend=full",
            *REFUSALS["graph_capture_oom"].traceback(), *CUDA_GRAPH_CAPTURE_FAILED_LINES]
    return Startup(ready=False, phase="cuda_graph", exit_code=1, log=log)


def _graph_lines(rep: FitReport) -> list[str]:
    """CUDA-graph capture markers (target decode, or target verify + draft with speculation)."""
    bs = rep.cuda_graph_max_bs_decode
    if rep.speculative is None:
        return ["Capture target decode CUDA graph begin. backend=full",
                f"Capture target decode CUDA graph end. bs=[1, ..., {bs}]"]
    sizes = spec_capture_sizes(bs)
    shown = f"[{', '.join(map(str, sizes[:4]))}, ..., {sizes[-1]}]" if len(sizes) > 5 \
        else str(sizes)
    sp = rep.speculative
    return [f"Capture target verify CUDA graph begin. backend=full, num_tokens_per_bs="
            f"{sp.draft_tokens}",
            f"Capture target verify CUDA graph end. bs={shown}",
            f"Capture draft CUDA graph begin. backend=full, num_steps={sp.num_steps}, "
            f"topk={sp.topk}",
            f"Capture draft CUDA graph end. bs={shown}",
            "Capture draft extend CUDA graph begin. backend=full",
            f"Capture draft extend CUDA graph end. bs={shown}"]


def _argparse_error(violation: str) -> str:
    """The argparse wording (``REFUSALS['argparse']``) of a flag-inventory violation.

    ``--flag: invalid choice 'v' for SGLang X (choose from a, b)`` becomes ``argument --flag:
    invalid choice: 'v' (choose from 'a', 'b')``; a flag the version lacks is ``unrecognized
    arguments: --flag``.
    """
    m = re.match(r"(--[\w-]+): invalid choice (.+?) for SGLang \S+ \(choose from (.*)\)$",
                 violation)
    if m:
        choices = ", ".join(repr(c) for c in m.group(3).split(", "))
        return f"argument {m.group(1)}: invalid choice: {m.group(2)} (choose from {choices})"
    dest = violation.split(":", 1)[0]
    return f"unrecognized arguments: --{dest.replace('_', '-')}"


def start(config: ServingConfig, nnodes: int | None = None) -> Startup:
    """Simulate ``sglang serve`` for one replica of ``config`` and return what happened.

    Never raises for a config the engine would reject: the rejection is the result (see the
    module docstring for the phases and their messages). Startup time (virtual s) is weight
    loading at ``LOAD_BYTES_PER_S`` per GPU plus ``FIXED_STARTUP_S``.

    ``nnodes``: the launch's ``--nnodes``; None: the argv's (a server wider than one node gets
    ``--nnodes``, :func:`domain.engines.sglang.flags.argv`). A launch on fewer nodes than its
    GPUs need (a pasted command without ``--nnodes``) fails as a one-node launch does.
    """
    try:
        argv = engine_for(config).argv(config)
    except UnknownFlag as e:
        return Startup(ready=False, phase="parse", exit_code=2,
                       log=["usage: sglang serve [-h] [--model-path MODEL_PATH] ...",
                            f"sglang serve: error: {_argparse_error(e.violations[0])}"])
    model, gpu = get_model(config.model), get_gpu(config.gpu)
    log = [f"server_args={' '.join(argv[2:])}"]
    try:  # the launcher resolves the arguments before it starts any scheduler process
        spec, warnings = _resolve(config, nnodes)
    except InvalidCombination as e:
        log += _traceback(e)
        return Startup(ready=False, phase="resolve", exit_code=1, log=log)
    log += warnings
    nodes = nnodes if nnodes is not None else config.nnodes(gpu.gpus_per_node)
    if config.gpus_per_server > gpu.gpus_per_node * nodes:  # rank 8+ of a node has no device
        log += ["Init torch distributed begin.",
                *REFUSALS["multi_node_device_ordinal"].traceback(), *CUDA_ERROR_HINT]
        return Startup(ready=False, phase="init_distributed", exit_code=1, log=log)
    if expert_refusal(config) is not None:  # the model runner, before the model is built
        log += REFUSALS["ep_divides_experts"].traceback()
        return Startup(ready=False, phase="model_init", exit_code=1, log=log)
    arch = hf_architecture(model)
    tp_key = tp_refusal(arch, model.heads, model.kv_heads if model.attention == "gqa" else None,
                        attention_split_width(arch, config.tp_size, config.attn_tp_size))
    tp_key = tp_key or mm_backend_refusal(config)  # the vision encoder is built with it
    if tp_key is not None:  # the attention layer's __init__: the loader builds the model
        # after "Load weight begin" and before any weight is read
        log.append(f"Load weight begin. avail mem="
                   f"{(gpu.hbm_bytes - CONTEXT_OVERHEAD_BYTES) / 2**30:.2f} GB")
        log += REFUSALS[tp_key].traceback()
        return Startup(ready=False, phase="model_init", exit_code=1, log=log)
    refusal = _backend_refusal(config, model, gpu.sm_major) or moe_runner_refusal(config)
    fields = refusal_fields(config)
    avail = gpu.hbm_bytes - CONTEXT_OVERHEAD_BYTES
    try:
        rep = fit(config)
    except DoesNotFit as e:
        if not (refusal and e.phase == "cuda_graph"):
            return _failed_memory(config, model, e, log, spec.params is not None)
        # the attention backend is built before the CUDA graphs are captured
        log += _load_lines(model.name, max(st.weight_bytes for st in stage_memory(
            config, model, spec.params is not None)), avail)
        log += REFUSALS[refusal].traceback(**fields)
        return Startup(ready=False, phase="model_init", exit_code=1, log=log)
    log += _load_lines(model.name, rep.weight_bytes_per_gpu, avail)
    if refusal:  # attention backends are built with the model runner, after weights load
        log += REFUSALS[refusal].traceback(**fields)
        return Startup(ready=False, phase="model_init", exit_code=1, log=log)
    if spec.params is not None and not model.mtp_layers:
        # The twin's stand-in (REFUSALS["no_draft_model"]): the target ships no MTP/NextN
        # layer and servetune does not model --speculative-draft-model-path.
        log += REFUSALS["no_draft_model"].traceback(model=model.name)
        return Startup(ready=False, phase="model_init", exit_code=1, log=log)
    if rep.draft_weight_bytes_per_gpu:
        log += _load_lines(f"{model.name}-nextn", rep.draft_weight_bytes_per_gpu,
                           avail - rep.weight_bytes_per_gpu)
    kv_gb = rep.kv_tokens * rep.kv_bytes_per_token / 2**30
    log.append(f"KV Cache is allocated. dtype: {rep.kv_dtype}, #tokens: {rep.kv_tokens}, "
               f"KV size: {kv_gb:.2f} GB")
    if rep.draft_kv_bytes_per_token:
        draft_gb = rep.kv_tokens * rep.draft_kv_bytes_per_token / 2**30
        log.append(f"KV Cache is allocated. dtype: {rep.kv_dtype}, #tokens: {rep.kv_tokens}, "
                   f"KV size: {draft_gb:.2f} GB")
    if not config.disable_cuda_graph:  # --disable-cuda-graph: decode and prefill run eagerly
        log += _graph_lines(rep)
    requested = config.max_running_requests or (
        SPEC_MAX_RUNNING_REQUESTS if rep.speculative is not None else None)
    if requested is not None:  # the cap is per attention-DP rank (kv_cache_configurator.py)
        requested = max(1, requested // config.attn_dp_size)
    if requested is not None and rep.max_running_requests < requested:
        log.append(f"max_running_requests was reduced from the requested {requested} to "
                   f"{rep.max_running_requests} (per dp worker) due to the available KV cache "
                   "capacity.")
    if rep.kv_smaller_than_context:
        log.append(f"KV pool holds {rep.kv_tokens} tokens, fewer than --context-length "
                   f"{rep.context_len}")
    if config.enable_hierarchical_cache:
        if rep.host_kv_tokens <= rep.kv_tokens:  # pool_host/base.py:238-240: a warning only
            log.append(HICACHE_SMALL_HOST_WARNING.format(label="KV", host=rep.host_kv_tokens,
                                                         device=rep.kv_tokens))
        short = host_pool_shortfall(config, rep)
        if short is not None:
            log += REFUSALS["hicache_host_oom"].traceback(requested=short[0], free=short[1])
            return Startup(ready=False, phase="host_pool", exit_code=1, log=log)
        log.append(f"Allocating {rep.host_kv_bytes_per_gpu / 1e9:.2f} GB host memory for "
                   "hierarchical KV cache.")
    log += [f"max_total_num_tokens={rep.kv_tokens}, chunked_prefill_size="
            f"{rep.chunked_prefill_size}, max_prefill_tokens=16384, max_running_requests="
            f"{rep.max_running_requests}, context_len={rep.context_len}",
            "The server is fired up and ready to roll!"]
    load_s = (rep.weight_bytes_per_gpu + rep.draft_weight_bytes_per_gpu) / LOAD_BYTES_PER_S
    return Startup(ready=True, phase="ready", exit_code=0, log=log, fit=rep,
                   startup_s=load_s + FIXED_STARTUP_S)
