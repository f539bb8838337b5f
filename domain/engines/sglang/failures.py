"""SGLang's failure classifier: which failure class a failed startup log shows, and where.

The table is servetune's sglang-knobs reference, section 3.2: each row a regex over the log
lines of SGLang 0.5.23 (its argparse, attention backends, memory pools, HiCache host pool,
speculative hooks) or of the backends' ``servetune:`` kubelet lines.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FailurePattern:
    """One row of the classifier table (servetune's sglang-knobs reference, section 3.2)."""

    failure_class: str
    regex: re.Pattern[str]
    retryable: bool
    meaning: str


FAILURE_PATTERNS: tuple[FailurePattern, ...] = tuple(FailurePattern(c, re.compile(r), rt, m)
                                                     for c, r, rt, m in (
    ("BAD_FLAG", r"error: (ambiguous option|unrecognized arguments|argument --[\w-]+)", False,
     "argparse refused a flag or value for this SGLang version"),
    ("UNSUPPORTED_BACKEND",
     r"(FlashAttention v3 Backend requires SM>=80 and SM<=90|backend is only supported on)",
     False, "the attention backend cannot run on this GPU architecture"),
    ("BACKEND_MODEL_MISMATCH", r"backend can only be used with (MLA|non-MLA) models", False,
     "the attention backend does not support this model's attention type"),
    ("OOM_WEIGHTS", r"(torch\.)?OutOfMemoryError: CUDA out of memory|CUDA error: out of memory",
     False, "the weight shard does not fit in GPU memory"),
    ("KV_NO_ROOM", r"Loaded weights leave no GPU memory for the KV cache|Not enough memory\. "
     r"Please try to increase --mem-fraction-static|max_running_request is zero|Memory pool "
     r"size is too small", False,
     "weights leave no (or too small a) KV cache under mem_fraction_static"),
    ("HOST_OOM_HICACHE", r"Not enough host memory available\. Requesting .* GB but only have "
     r".* GB free", False, "the HiCache host pool does not fit in the node's host memory"),
    # 0.5.23 only warns when the host pool is not larger (pool_host/base.py:239); older
    # versions asserted it
    ("HICACHE_HOST_TOO_SMALL", r"The host memory should be larger than the device memory",
     False, "hicache_ratio must make the host pool larger than the device KV pool"),
    ("NO_DRAFT_MODEL", r"has no MTP/NextN draft layer", False,
     "speculative decoding on a model whose checkpoint ships no draft head"),
    ("GRAPH_CAPTURE_OOM", r"Capture cuda graph failed", False,
     "too little memory outside the static pool for CUDA-graph capture"),
    # ensure_divisibility's message, or the attention layer's bare assert: the traceback's
    # source line (models/llama.py:183, qwen3_moe.py:516, deepseek_v2.py:2057, ...)
    ("TP_DIVISIBILITY", r"AssertionError: \d+ is not divisible by \d+|assert (self\.)?"
     r"(total_num_(kv_)?heads|num_heads|\w*tp_size) % (self\.)?\w+ == 0", False,
     "attention heads or MLP sizes do not split evenly over tp_size"),
    ("MULTI_NODE_REQUIRED", r"invalid device ordinal", False,
     "tp_size needs more GPUs than one node has"),
    # cluster-level failures (the kubelet's verdict in the backends' ``servetune:`` lines, the
    # engine's child-crash lines); retryable as domain.faults.RETRY says
    ("IMAGE_PULL", r"ImagePullBackOff|ErrImagePull|failed to pull (and unpack )?image", True,
     "the node could not pull the image (registry or network)"),
    ("READY_TIMEOUT", r"not ready after [\d.]+ s", True,
     "the server did not turn Ready within the readiness timeout"),
    # the engine's own refusal outranks the kubelet's generic verdict on the same crash
    ("INVALID_COMBINATION",
     r"(?<![\w.])(ValueError|AssertionError|NotImplementedError|TypeError)(: |$)", False,
     "the engine's argument resolution rejected a flag combination (a bare AssertionError is "
     "speculative_hook's all-three-or-none assert)"),
    ("CRASH_LOOP", r"CrashLoopBackOff|Scheduler hit an exception|Received sigquit from a child "
     r"process", False, "the server crashed after it started, and again after each restart"),
))


def classify(log: Sequence[str]) -> tuple[str, str]:
    """Failure class and the evidence line of a failed startup log.

    OOM rows are checked before the generic INVALID_COMBINATION row, so the first match in
    table order wins; the evidence is the first log line that matched.

    Returns:
        (failure_class, evidence line); ("UNKNOWN", last line) if nothing matched.
    """
    for p in FAILURE_PATTERNS:
        for line in log:
            if p.regex.search(line):
                return p.failure_class, line
    return "UNKNOWN", log[-1] if log else ""


FAILURE_CLASSES = tuple(p.failure_class for p in FAILURE_PATTERNS) + ("UNKNOWN",)
