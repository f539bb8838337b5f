"""Twin server startup: the log an SGLang 0.5.23 server prints, and the ways it dies.

The stage markers and error texts are the engine's own (servetune's sglang-knobs reference,
sections 3.1 and 3.2). A failed startup yields the log up to the failure, so a classifier reads
it exactly as it would read a real pod log.
"""

from __future__ import annotations

from pydantic import BaseModel

from domain.config import ServingConfig
from domain.errors import DoesNotFit, UnknownFlag
from domain.fit import CONTEXT_OVERHEAD_BYTES, FitReport, fit
from domain.hardware import get_gpu
from domain.models import get_model


class Startup(BaseModel):
    """Outcome of starting one replica: ``ready`` with its fit, or the failing phase."""

    ready: bool
    phase: str  # "ready" | parse | model_init | load_weights | kv_pool | cuda_graph
    log: list[str]
    exit_code: int
    fit: FitReport | None = None
    startup_s: float = 0.0

    @property
    def reason(self) -> str:
        """The engine's error line on failure, else the last log line.

        The error line is the last one that reports an error (``Error``, ``error:``, ``failed``).
        """
        for line in reversed(self.log):
            if "Error" in line or "error:" in line or " failed" in line:
                return line
        return self.log[-1] if self.log else ""


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


def start(config: ServingConfig) -> Startup:
    """Simulate ``sglang serve`` for one replica of ``config`` and return what happened.

    Never raises for a config the engine would reject: the rejection is the result.
    Startup time (virtual s) is dominated by weight loading at ~2.5 GB/s per GPU from a local
    model cache (typical of NVMe-backed caches; sglang-knobs reference 7.3).
    """
    try:
        argv = config.to_sglang_args()
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
    for dim in (model.heads, model.kv_heads if model.attention == "gqa" else model.heads):
        if dim % config.tp_size:  # sglang/srt/distributed/utils.py: ensure_divisibility
            log += ["Traceback (most recent call last):",
                    '  File "sglang/srt/distributed/utils.py", line 37, in ensure_divisibility',
                    f"AssertionError: {dim} is not divisible by {config.tp_size}"]
            return Startup(ready=False, phase="model_init", exit_code=1, log=log)
    refusal = _backend_refusal(config, gpu.sm_major, model.attention)
    avail = (gpu.hbm_bytes - CONTEXT_OVERHEAD_BYTES) / 2**30
    log.append(f"Load weight begin. avail mem={avail:.2f} GB")
    try:
        rep = fit(config)
    except DoesNotFit as e:
        if e.phase == "weights_load":
            log += ["Traceback (most recent call last):",
                    '  File "sglang/srt/model_loader/loader.py", line 412, in load_model',
                    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. "
                    f"GPU 0 has a total capacity of {gpu.hbm_bytes / 2**30:.2f} GiB of which "
                    "1.02 GiB is free."]
            return Startup(ready=False, phase="load_weights", exit_code=1, log=log)
        w = get_model(config.model).weight_bytes(config.weights) / config.tp_size
        log.append(f"Load weight end. elapsed={w / 2.5e9:.2f} s, type={model.name}, "
                   f"avail mem={(gpu.hbm_bytes - CONTEXT_OVERHEAD_BYTES - w) / 2**30:.2f} GB, "
                   f"mem usage={w / 2**30:.2f} GB.")
        if e.phase == "kv_pool":
            need = round(w / gpu.hbm_bytes + 0.01, 2)
            log.append("RuntimeError: Loaded weights leave no GPU memory for the KV cache under "
                       f"--mem-fraction-static={config.mem_fraction_static}. Raise "
                       f"--mem-fraction-static above {need}.")
            return Startup(ready=False, phase="kv_pool", exit_code=1, log=log)
        log += ["Capture target decode CUDA graph begin. backend=full",
                "Capture cuda graph failed: CUDA out of memory. Tried to allocate 2.00 GiB.",
                "Possible solutions:",
                "1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)",
                "2. set --cuda-graph-max-bs-decode to a smaller value (e.g., 16)",
                "3. disable torch compile by not using --enable-torch-compile",
                "4. disable CUDA graph by --disable-cuda-graph. (Not recommended. Huge perf loss)"]
        return Startup(ready=False, phase="cuda_graph", exit_code=1, log=log)
    load_s = rep.weight_bytes_per_gpu / 2.5e9
    left = gpu.hbm_bytes - CONTEXT_OVERHEAD_BYTES - rep.weight_bytes_per_gpu
    log.append(f"Load weight end. elapsed={load_s:.2f} s, type={model.name}, "
               f"avail mem={left / 2**30:.2f} GB, mem usage={rep.weight_bytes_per_gpu / 2**30:.2f}"
               " GB.")
    if refusal:  # attention backends are built with the model runner, after weights load
        log += ["Traceback (most recent call last):",
                '  File "sglang/srt/model_executor/model_runner.py", line 1890, in '
                "init_attention_backend", refusal]
        return Startup(ready=False, phase="model_init", exit_code=1, log=log)
    kv_gb = rep.kv_pool_bytes_per_gpu / 2**30
    log += [f"KV Cache is allocated. dtype: {rep.kv_dtype}, #tokens: {rep.kv_tokens}, "
            f"KV size: {kv_gb:.2f} GB",
            "Capture target decode CUDA graph begin. backend=full",
            f"Capture target decode CUDA graph end. bs=[1, ..., {rep.cuda_graph_max_bs_decode}]",
            f"max_total_num_tokens={rep.kv_tokens}, chunked_prefill_size="
            f"{rep.chunked_prefill_size}, max_prefill_tokens=16384, max_running_requests="
            f"{rep.max_running_requests}, context_len={rep.context_len}",
            "The server is fired up and ready to roll!"]
    return Startup(ready=True, phase="ready", exit_code=0, log=log, fit=rep,
                   startup_s=load_s + 60.0)
