"""SGLang startup on the twin: the log an SGLang 0.5.23 server prints, and the ways it dies.

The stage markers and error texts are the engine's own (servetune's sglang-knobs reference,
sections 2 and 3; the messages of ``arg_groups/speculative_hook.py``, ``kv_cache_hook.py``,
``validation_hook.py``, ``managers/tp_worker.py`` and ``mem_cache/pool_host/base.py``). A failed
startup yields the log up to the failure, so a classifier reads it exactly as it would read a
real pod log.

Phases, in the order the server reaches them:

- ``parse``: argparse refuses a flag or choice of the pinned version (exit 2).
- ``init_distributed``: tp_size exceeds one node (no ``--nnodes``).
- ``resolve``: the resolution pipeline refuses a flag combination -- a traceback ending in the
  engine's ``ValueError`` / ``AssertionError`` / ``TypeError`` before ``Load weight begin``
  (exit 1): HiCache with the radix cache disabled, every speculative refusal of
  :func:`domain.speculative.resolve_speculative_logged`, a negative
  ``--schedule-conservativeness``.
- ``model_init``: tensor-parallel divisibility (before weights), attention-backend refusals and
  a speculative draft worker without a draft model (after the target's weights load).
- ``load_weights``: CUDA out of memory while loading the target or the draft layers.
- ``kv_pool``: weights leave no KV cache; ``max_running_request is zero``; ``Memory pool size is
  too small``.
- ``cuda_graph``: CUDA-graph capture runs out of memory.
- ``host_pool``: the HiCache host pool is not larger than the device pool, or does not fit in
  host memory (``Not enough host memory available. Requesting X GB but only have Y GB free``).

A pool smaller than the context length is only a warning (``KV pool holds N tokens, fewer than
--context-length M``); that server starts.
"""

from __future__ import annotations

from domain.config import ServingConfig
from domain.engines import engine_for
from domain.errors import DoesNotFit, InvalidCombination, UnknownFlag
from domain.fit import CONTEXT_OVERHEAD_BYTES, FitReport, fit, host_pool_shortfall
from domain.hardware import get_gpu
from domain.models import ModelArch, get_model
from domain.speculative import (
    SPEC_MAX_RUNNING_REQUESTS,
    SpecResolution,
    resolve_speculative_logged,
    spec_capture_sizes,
)
from domain.twin.startup import Startup

# Weight loading from a local NVMe-backed model cache, bytes/s per GPU (sglang-knobs reference
# 7.3: typical of such caches); fixed start-up work besides loading (graph capture, warm-up), s.
LOAD_BYTES_PER_S = 2.5e9
FIXED_STARTUP_S = 60.0


def _backend_refusal(config: ServingConfig, sm_major: int, attention: str) -> str | None:
    """The engine's message if the attention backend cannot run here, else None.

    Sources: ``arg_groups/attention_hook.py`` and ``layers/attention/*`` of SGLang 0.5.23.
    """
    b = config.attention_backend
    if b is None:
        return None
    if b == "fa3" and not 8 <= sm_major <= 9:
        return ("AssertionError: FlashAttention v3 Backend requires SM>=80 and SM<=90. "
                "Please use --attention-backend flashinfer.")
    if b == "trtllm_mla" and sm_major < 10:
        return "ValueError: TRTLLM MLA backend is only supported on Blackwell GPUs (SM100/SM12x)."
    if b == "trtllm_mla" and attention == "gqa":
        return "ValueError: trtllm_mla backend can only be used with MLA models."
    if b == "trtllm_mha" and attention != "gqa":
        return "ValueError: trtllm_mha backend can only be used with non-MLA models."
    if b == "cutedsl_mla" and sm_major != 10:
        return "ValueError: CuteDSL MLA backend is only supported on Blackwell GPUs (SM100)."
    return None


def _traceback(where: tuple[str, str], line: str) -> list[str]:
    """A Python traceback ending in ``line``, raised in function ``where[1]`` of ``where[0]``."""
    return ["Traceback (most recent call last):", f'  File "{where[0]}", in {where[1]}', line]


def _resolve(config: ServingConfig) -> tuple[SpecResolution, list[str]]:
    """Run the checks of SGLang's resolution pipeline in its order.

    Returns:
        The speculative resolution and the warning lines logged on the way.

    Raises:
        InvalidCombination: with the engine's exception and message.
    """
    if config.enable_hierarchical_cache and config.disable_radix_cache:
        raise InvalidCombination(  # kv_cache_hook.py (0.5.23; _handle_cache_compatibility)
            "ValueError", "The arguments enable-hierarchical-cache and disable-radix-cache are "
            "mutually exclusive and cannot be used at the same time. Please use only one of "
            "them.", ("sglang/srt/arg_groups/kv_cache_hook.py", "handle_kv_cache"))
    spec = resolve_speculative_logged(config)
    if config.schedule_conservativeness is not None and config.schedule_conservativeness < 0:
        raise InvalidCombination("AssertionError", "schedule_conservativeness must be "
                                 "non-negative", ("sglang/srt/arg_groups/validation_hook.py",
                                                  "check_server_args"))
    return spec, list(spec.log)


def _load_lines(name: str, w: float, avail: float) -> list[str]:
    """``Load weight begin/end`` for ``w`` bytes per GPU with ``avail`` bytes free before."""
    return [f"Load weight begin. avail mem={avail / 2**30:.2f} GB",
            f"Load weight end. elapsed={w / LOAD_BYTES_PER_S:.2f} s, type={name}, "
            f"avail mem={(avail - w) / 2**30:.2f} GB, mem usage={w / 2**30:.2f} GB."]


def _oom_line(gpu_bytes: float) -> str:
    return ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a "
            f"total capacity of {gpu_bytes / 2**30:.2f} GiB of which 1.02 GiB is free.")


def _failed_memory(config: ServingConfig, model: ModelArch, e: DoesNotFit, log: list[str],
                   spec_on: bool) -> Startup:
    """The log and phase of a startup that ``fit`` rules out with ``e``."""
    gpu = get_gpu(config.gpu)
    w = model.weight_bytes(config.weights) / config.tp_size
    draft_w = model.draft_weight_bytes(config.weights) / config.tp_size if spec_on else 0.0
    avail = gpu.hbm_bytes - CONTEXT_OVERHEAD_BYTES
    loader = ('  File "sglang/srt/model_loader/loader.py", in load_model')
    if e.phase == "weights_load":
        if w > avail:  # the target's own shard does not fit
            log += [f"Load weight begin. avail mem={avail / 2**30:.2f} GB",
                    "Traceback (most recent call last):", loader, _oom_line(gpu.hbm_bytes)]
        else:  # the target loads, its draft (MTP) layers do not
            log += _load_lines(model.name, w, avail)
            log += [f"Load weight begin. avail mem={(avail - w) / 2**30:.2f} GB",
                    "Traceback (most recent call last):", loader, _oom_line(gpu.hbm_bytes)]
        return Startup(ready=False, phase="load_weights", exit_code=1, log=log)
    log += _load_lines(model.name, w, avail)
    if draft_w:
        log += _load_lines(f"{model.name}-nextn", draft_w, avail - w)
    if e.phase == "kv_pool" and e.cause == "no_room":
        need = round((w + draft_w) / gpu.hbm_bytes + 0.01, 2)
        log.append("RuntimeError: Loaded weights leave no GPU memory for the KV cache under "
                   f"--mem-fraction-static={config.mem_fraction_static}. Raise "
                   f"--mem-fraction-static above {need}.")
        return Startup(ready=False, phase="kv_pool", exit_code=1, log=log)
    if e.phase == "kv_pool":
        msg = ("max_running_request is zero" if e.cause == "zero_requests"
               else "Memory pool size is too small")
        per_token = e.required_gb / (2 if e.cause == "zero_requests" else 7)  # see fit()
        log.append(f"KV Cache is allocated. #tokens: {int(e.available_gb // per_token)}")
        log += _traceback(("sglang/srt/managers/tp_worker.py", "__init__"),
                          f"AssertionError: {msg}")
        return Startup(ready=False, phase="kv_pool", exit_code=1, log=log)
    log += ["Capture target decode CUDA graph begin. backend=full",
            "Capture cuda graph failed: CUDA out of memory. Tried to allocate 2.00 GiB.",
            "Possible solutions:",
            "1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)",
            "2. set --cuda-graph-max-bs-decode to a smaller value (e.g., 16)",
            "3. disable torch compile by not using --enable-torch-compile",
            "4. disable CUDA graph by --disable-cuda-graph. (Not recommended. Huge perf loss)"]
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


def start(config: ServingConfig) -> Startup:
    """Simulate ``sglang serve`` for one replica of ``config`` and return what happened.

    Never raises for a config the engine would reject: the rejection is the result (see the
    module docstring for the phases and their messages). Startup time (virtual s) is weight
    loading at ``LOAD_BYTES_PER_S`` per GPU plus ``FIXED_STARTUP_S``.
    """
    try:
        argv = engine_for(config).argv(config)
    except UnknownFlag as e:
        msg = e.violations[0]
        return Startup(ready=False, phase="parse", exit_code=2,
                       log=["usage: sglang serve [-h] [--model-path MODEL_PATH] ...",
                            f"sglang serve: error: argument {msg}"])
    model, gpu = get_model(config.model), get_gpu(config.gpu)
    log = [f"server_args={' '.join(argv[2:])}"]
    if config.tp_size > gpu.gpus_per_node:  # one node, no --nnodes: rank 8+ has no device
        log += ["Init torch distributed begin.",
                f"RuntimeError: CUDA error: invalid device ordinal (tp_size {config.tp_size} "
                f"needs more than the {gpu.gpus_per_node} GPUs of one node; multi-node "
                "serving needs --nnodes and --dist-init-addr)"]
        return Startup(ready=False, phase="init_distributed", exit_code=1, log=log)
    try:
        spec, warnings = _resolve(config)
    except InvalidCombination as e:
        log += _traceback(e.where, e.line)
        return Startup(ready=False, phase="resolve", exit_code=1, log=log)
    log += warnings
    for dim in (model.heads, model.kv_heads if model.attention == "gqa" else model.heads):
        if dim % config.tp_size:  # sglang/srt/distributed/utils.py: ensure_divisibility
            log += _traceback(("sglang/srt/distributed/utils.py", "ensure_divisibility"),
                              f"AssertionError: {dim} is not divisible by {config.tp_size}")
            return Startup(ready=False, phase="model_init", exit_code=1, log=log)
    refusal = _backend_refusal(config, gpu.sm_major, model.attention)
    try:
        rep = fit(config)
    except DoesNotFit as e:
        return _failed_memory(config, model, e, log, spec.params is not None)
    avail = gpu.hbm_bytes - CONTEXT_OVERHEAD_BYTES
    log += _load_lines(model.name, rep.weight_bytes_per_gpu, avail)
    if refusal:  # attention backends are built with the model runner, after weights load
        log += _traceback(("sglang/srt/model_executor/model_runner.py",
                           "init_attention_backend"), refusal)
        return Startup(ready=False, phase="model_init", exit_code=1, log=log)
    if spec.params is not None and not model.mtp_layers:
        # The twin's wording: the target ships no MTP/NextN layer, so the EAGLE draft worker has
        # no draft model (servetune does not model --speculative-draft-model-path).
        log += _traceback(("sglang/srt/speculative/eagle_worker_v2.py", "__init__"),
                          f"ValueError: {model.name} has no MTP/NextN draft layer and "
                          "--speculative-draft-model-path is not set; the EAGLE draft worker "
                          "has no draft model to load.")
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
    log += _graph_lines(rep)
    requested = config.max_running_requests or (
        SPEC_MAX_RUNNING_REQUESTS if rep.speculative is not None else None)
    if requested is not None and rep.max_running_requests < requested:
        log.append(f"max_running_requests was reduced from the requested {requested} to "
                   f"{rep.max_running_requests} (per dp worker) due to the available KV cache "
                   "capacity.")
    if rep.kv_smaller_than_context:
        log.append(f"KV pool holds {rep.kv_tokens} tokens, fewer than --context-length "
                   f"{rep.context_len}")
    if config.enable_hierarchical_cache:
        host = "sglang/srt/mem_cache/pool_host/base.py", "__init__"
        if rep.host_kv_tokens <= rep.kv_tokens:
            log += _traceback(host, "AssertionError: The host memory should be larger than the "
                                    "device memory with the current protocol")
            return Startup(ready=False, phase="host_pool", exit_code=1, log=log)
        short = host_pool_shortfall(config, rep)
        if short is not None:
            log += _traceback(host, f"ValueError: Not enough host memory available. Requesting "
                                    f"{short[0]:.2f} GB but only have {short[1]:.2f} GB free. "
                                    "Please reduce the size of the hierarchical cache.")
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
