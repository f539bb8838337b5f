"""SGLang's failure classifier: the phase a failed log reached, its failure class, and the line.

Two reads of one log (SGLang 0.5.23's own wording; file:line below are of that version):

1. **Phase** (:func:`phase_reached`): the engine's phase lines, in the order it prints them --
   argparse's ``usage:`` / ``error:`` lines (``args``); ``server_args=...`` (``init``;
   ``entrypoints/engine.py:311``, printed once the arguments are resolved); ``Load weight
   begin`` (``weights_load``; ``model_executor/model_runner.py:1274``); ``Load weight end``
   (``model_runner.py:1373``), ``KV Cache is allocated`` (``mem_cache/memory_pool.py:2095``) and
   ``Memory pool end`` (``mem_cache/kv_cache_configurator.py:499``) (``kv_pool``); ``Capture
   ... CUDA graph begin`` (``model_runner_components/cuda_graph_setup.py:759``; older versions:
   ``Capture cuda graph begin``) (``cuda_graph``); ``The server is fired up and ready to roll!``
   (``entrypoints/http_server.py:2600``) and the scheduler's ``Prefill batch`` / ``Decode
   batch`` lines (``managers/scheduler_components/metrics_reporter.py:754, 963``) (``serving``).
2. **Class** (:func:`diagnose`): each row of :data:`FAILURE_PATTERNS` is a regex over one line
   with the phases it applies in and a rank. The best rank wins and, within a rank, the LAST
   matching line (the last error decides). A CUDA out-of-memory line is classed by the phase it
   happened in: weight load (OOM_WEIGHTS), KV pool (KV_NO_ROOM), graph capture
   (GRAPH_CAPTURE_OOM), serving (CRASH_LOOP). Repeated retraction while serving
   (``KV cache pool is full. Retract requests.``, ``managers/scheduler.py:4526``; the
   ``sglang:num_retracted_reqs`` gauge, ``observability/metrics_collector.py:553``) is
   KV_THRASH. A readiness timeout after the log stopped mid-startup is READY_TIMEOUT at the
   phase it stalled in (retried once: :mod:`domain.failures`).

Meaning, fix, retry rule and lesson rule of each class: the taxonomy, :mod:`domain.failures`.
The ``servetune:`` lines are the cluster backends' kubelet verdicts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from domain.engines.sglang.flags import flag_inventory
from domain.engines.sglang.versions import PINNED
from domain.failures import PHASES, TAXONOMY, Diagnosis, Phase, failure_class

VERSION = PINNED  # the version whose log wording and flag names these rows are

# ------------------------------------------------------------------------------------- phases
# (phase, line regex, may the phase go back to it): the engine's own phase lines, then the
# frames of a traceback that say where it was raised (a log excerpt may hold only the traceback)
_MARKERS: tuple[tuple[Phase, str, bool], ...] = (
    ("args", r"^usage: |: error: (argument|unrecognized arguments|ambiguous option)", False),
    # "Connecting to tcp://": the ranks' message-queue setup of distributed init
    # (distributed/device_communicators/shm_broadcast.py:291)
    ("init", r"server_args=|Init torch distributed begin|Started server process|Scheduler "
     r"hit an exception|, in run_scheduler_process$|Connecting to tcp://", False),
    ("weights_load", r"Load weight begin", True),  # a draft model loads after the target
    ("weights_load", r"Loading safetensors checkpoint shards|, in (load_model|load_weights)"
     r"$|model_loader/", False),
    ("kv_pool", r"Load weight end|KV Cache is allocated|Memory pool end|, in "
     r"(init_memory_pool|profile_max_num_token)$", False),
    ("cuda_graph", r"Capture .*(CUDA|cuda) graph begin|Capture cuda graph bs|Running FlashInfer "
     r"autotune|Capture (cuda|"
     r"CUDA|prefill CUDA) graph failed|, in (init_cuda_graphs|capture|"
     r"capture_one_batch_size)$|Capturing batches", False),
    ("serving", r"The server is fired up and ready to roll|Prefill batch[ ,]|Decode batch[ ,]|"
     r", in (event_loop_overlap|event_loop_normal|run_batch)$", False),
)
PHASE_MARKERS: tuple[tuple[Phase, re.Pattern[str], bool], ...] = tuple(
    (p, re.compile(r), back) for p, r, back in _MARKERS)


def phase_at(log: Sequence[str]) -> list[Phase]:
    """The phase the server was in at each line of ``log`` (its markers: the module docstring).

    A line before any marker is in ``args``; a phase once entered lasts until a later one is
    entered (only ``Load weight begin`` of a draft model goes back, to ``weights_load``).
    """
    phase: Phase = "args"
    out: list[Phase] = []
    for line in log:
        for p, rx, back in PHASE_MARKERS:
            if (back or PHASES.index(p) > PHASES.index(phase)) and rx.search(line):
                phase = p
        out.append(phase)
    return out


def phase_reached(log: Sequence[str]) -> tuple[Phase, bool]:
    """The last phase ``log`` reached, and whether any phase line was seen at all."""
    seen = any(rx.search(line) for line in log for _, rx, _ in PHASE_MARKERS)
    return (phase_at(log)[-1] if log else "args"), seen


# -------------------------------------------------------------------------------- the rows
@dataclass(frozen=True)
class FailurePattern:
    """One row of the classifier: ``regex`` over a line, in ``phases``, at ``rank``.

    ``failure_class`` "OOM" is classed by its phase (:data:`OOM_BY_PHASE`). ``site`` is the
    0.5.23 raise site of the message when one file raises it; ``flags`` the dests of the server
    flags its check tests (else the taxonomy's fields of the class); ``phase`` where the message
    is raised: the phase of an excerpt without any phase line (else the class's own phase) and,
    when ``floor``, the earliest phase the failure can be in (a log cut short, or whose only
    phase line is the scheduler's, reached at least that far). A kernel's runtime refusal has
    no floor: it is raised wherever the kernel first runs.
    """

    failure_class: str
    regex: re.Pattern[str]
    rank: int = 1
    phases: tuple[Phase, ...] = PHASES
    site: str | None = None
    flags: tuple[str, ...] = ()
    phase: Phase | None = None
    floor: bool = True


OOM_BY_PHASE: dict[Phase, str] = {"args": "OOM_WEIGHTS", "init": "OOM_WEIGHTS",
                                  "weights_load": "OOM_WEIGHTS", "kv_pool": "KV_NO_ROOM",
                                  "cuda_graph": "GRAPH_CAPTURE_OOM", "serving": "CRASH_LOOP"}
_EXC = r"(?<![\w.])(ValueError|AssertionError|NotImplementedError|TypeError)(: |:?$)"
_START: tuple[Phase, ...] = ("args", "init")
_ATTN = "sglang/srt/layers/attention/attention_registry.py"
_HOST = ("hicache_ratio", "hicache_size")


def _row(cls: str, rx: str, rank: int = 1, phases: tuple[Phase, ...] = PHASES,
         site: str | None = None, flags: tuple[str, ...] = (),
         phase: Phase | None = None, floor: bool = True) -> FailurePattern:
    return FailurePattern(cls, re.compile(rx), rank, phases, site, flags, phase, floor)


FAILURE_PATTERNS: tuple[FailurePattern, ...] = (
    # rank 1: the engine's own refusal or resource message
    _row("BAD_FLAG", r"error: (ambiguous option|unrecognized arguments|argument \S+)"),
    _row("UNSUPPORTED_BACKEND", r"The '\w+' backend is not supported on Blackwell GPUs",
         site="sglang/srt/layers/attention/vision.py:1331", flags=("mm_attention_backend",),
         phase="weights_load"),  # the vision encoder's attention, built with the model
    _row("UNSUPPORTED_BACKEND", r"backends are supported on Blackwell GPUs for hybrid GDN",
         site=f"{_ATTN}:474", flags=("attention_backend",), phase="kv_pool"),
    _row("UNSUPPORTED_BACKEND", r"FlashAttention v3 Backend requires SM>=80 and SM<=90",
         site=f"{_ATTN}:244", flags=("attention_backend",), phase="kv_pool"),
    _row("UNSUPPORTED_BACKEND",  # an argument check of the attention backends
         r"backends? (is|are) only supported on|is only supported on (Blackwell|Hopper|Ampere|"
         r"SM ?\d+|sm_?\d+)|is not supported on (Blackwell|Hopper|Ampere|this GPU|SM ?\d+|"
         r"sm_?\d+)|requires (GPUs with )?(SM|sm_?) ?\d+", flags=("attention_backend",),
         phase="kv_pool"),
    _row("UNSUPPORTED_BACKEND",  # a kernel's runtime refusal (FlashInfer, a CUDA build)
         r"Unsupported architecture(?!: *[A-Za-z_])|no kernel image is available for execution|"
         r"not (available or )?supported on this (GPU|hardware|device|architecture)",
         flags=("attention_backend",), phase="serving", floor=False),
    _row("UNSUPPORTED_BACKEND", r"trtllm-gen MoE kernels are SM100-only; this GPU",
         flags=("moe_runner_backend",), phase="kv_pool"),
    _row("INVALID_COMBINATION", r"context_length \(\d+\) is greater than the derived "
         r"context_length", site="sglang/srt/configs/model_config.py:1314",
         flags=("context_length",), phase="args"),
    _row("BACKEND_MODEL_MISMATCH", r"backend can only be used with (MLA|non-MLA) models",
         site=_ATTN, phase="kv_pool"),
    _row("OOM", r"OutOfMemoryError|CUDA out of memory|CUDA error: out of memory"),
    _row("KV_NO_ROOM", r"Loaded weights leave no GPU memory for the KV cache|Not enough memory\. "
         r"Please try to increase --mem-fraction-static|max_running_request is zero|Memory pool "
         r"size is too small"),
    _row("HOST_OOM_HICACHE", r"Not enough host memory available\. Requesting .* GB but only "
         r"have .* GB free", site="sglang/srt/mem_cache/pool_host/base.py:253",
         flags=("enable_hierarchical_cache", *_HOST)),
    # 0.5.23 only warns when the host pool is not larger (pool_host/base.py:239); older
    # versions asserted it
    _row("HICACHE_HOST_TOO_SMALL", r"The host memory should be larger than the device memory",
         flags=("enable_hierarchical_cache", *_HOST)),
    _row("HICACHE_HOST_TOO_SMALL", r"Unified host backing must fit at least one page",
         site="sglang/srt/mem_cache/pool_host/unified.py:158", flags=_HOST),
    _row("HICACHE_HOST_TOO_SMALL", r"Host token capacity must be positive and page-aligned",
         site="sglang/srt/mem_cache/pool_host/base.py:215", flags=_HOST),
    _row("NO_DRAFT_MODEL", r"has no MTP/NextN draft layer"),
    _row("NO_DRAFT_MODEL", r"speculative decoding requires setting\s+"
         r"(--speculative-draft-model-path)?", site="sglang/srt/arg_groups/speculative_hook.py",
         flags=("speculative_draft_model_path",), phase="args"),
    _row("TP_DIVISIBILITY", r"AssertionError: \d+ is not divisible by \d+",
         site="sglang/srt/distributed/utils.py:70", flags=("tp_size",), phase="weights_load"),
    # the attention layer's bare assert: the traceback's source line (models/llama.py:183,
    # qwen3_moe.py:516, deepseek_v2.py:2057, ...)
    _row("TP_DIVISIBILITY", r"assert (self\.)?(total_num_(kv_)?heads|num_heads|\w*tp_size) % "
         r"(self\.)?\w+ == 0", flags=("tp_size",), phase="weights_load"),
    _row("TP_DIVISIBILITY", r"is not divisible by weight quantization block_n",
         flags=("tp_size",), phase="weights_load"),
    _row("MULTI_NODE_REQUIRED", r"invalid device ordinal", flags=("tp_size", "nnodes")),
    _row("INVALID_COMBINATION", r"multi-node data-parallel replicas are not supported",
         site="sglang/srt/arg_groups/validation_hook.py:199", flags=("dp_size", "nnodes")),
    _row("MODEL_LOAD", r"Cannot find any model weights|No model weights found|Model architectures "
         r"\[.*\] are not supported|Unsupported architecture: *[A-Za-z_]|is not a local folder "
         r"and is not a valid model identifier|does not appear to have a file named|Can't load "
         r"(the )?(configuration|config|tokenizer)|set the option `trust_remote_code=True`|"
         r"requires you to execute the configuration file|RepositoryNotFoundError|"
         r"GatedRepoError|LocalEntryNotFoundError|SafetensorError|HeaderTooLarge|Unrecognized "
         r"model in|does not recognize this architecture|No such file or directory: .*"
         r"(config\.json|\.safetensors|\.bin)", flags=("model_path",)),
    # rank 2: a collective failed (often another rank's failure seen from its peers)
    _row("NCCL", r"NCCL error|nccl(Internal|System|UnhandledCuda|Remote|InvalidUsage)Error|"
         r"DistNetworkError|NCCL communicator|gloo/transport", rank=2, phase="init",
         floor=False),
    _row("NCCL", r"Watchdog caught collective operation timeout|ProcessGroupNCCL.*(timeout|"
         r"timed out)|DistBackendError", rank=2, phase="serving", floor=False),
    # rank 3: a capture failure of no known cause (the engine's hint: memory), and an
    # argument-resolution refusal without a message the rows above know
    _row("GRAPH_CAPTURE_OOM", r"Capture (cuda|CUDA|prefill CUDA) graph failed", rank=3),
    _row("INVALID_COMBINATION", _EXC, rank=3, phases=_START),
    # rank 4: the cluster's verdicts and the engine's generic crash lines
    _row("IMAGE_PULL", r"ImagePullBackOff|ErrImagePull|failed to pull (and unpack )?image",
         rank=4),
    _row("CRASH_LOOP", r"CrashLoopBackOff|(Scheduler|DataParallelController|TokenizerManager|"
         r"DetokenizerManager) hit an exception|Received sigquit from a child proces", rank=4),
    _row("READY_TIMEOUT", r"not ready after [\d.]+ s|readiness (probe )?timed? ?out", rank=5),
)
# 0.5.23 managers/scheduler.py:4526; earlier versions: "Decode out of memory happened"
RETRACT = re.compile(r"KV cache pool is full\. Retract requests\.|Decode out of memory happened\. "
                     r"#retracted_reqs")
RETRACT_METRIC = re.compile(r"sglang:num_retracted_(reqs|requests_total)(\{[^}]*\})? "
                            r"([0-9.eE+]+)")
THRASH_MIN = 2  # retractions that make thrashing: "repeated" (two or more)
BAD_FLAG_NAME = (re.compile(r"unrecognized arguments: (--?[\w-]+)"),
                 re.compile(r"ambiguous option: (--?[\w-]+)"),
                 re.compile(r"argument (--?[\w-]+)"), re.compile(r"argument ([a-z_]+):"))


def named_fields(cls: str, evidence: str) -> tuple[str, ...]:
    """The ServingConfig fields the message ``evidence`` of class ``cls`` names.

    The fields of the first row of ``cls`` whose regex matches ``evidence`` (e.g. the vision
    encoder's ``mm_attention_backend``), else the taxonomy's fields of ``cls``.
    """
    for p in FAILURE_PATTERNS:
        if p.failure_class == cls and p.flags and p.regex.search(evidence):
            return p.flags
    return failure_class(cls).fields


def _is_args_line(line: str) -> bool:
    return "server_args=" in line or "ServerArgs(" in line


def _thrash(log: Sequence[str]) -> tuple[int, str] | None:
    """(line index, evidence) of repeated retraction while serving, or None."""
    hits = [i for i, x in enumerate(log) if RETRACT.search(x)]
    retracted = 0.0
    last_metric = None
    for i, x in enumerate(log):
        m = RETRACT_METRIC.search(x)
        if m and float(m.group(3)) > 0:
            retracted, last_metric = max(retracted, float(m.group(3))), i
    if len(hits) >= THRASH_MIN:
        return hits[-1], log[hits[-1]]
    if last_metric is not None and retracted >= THRASH_MIN:
        return last_metric, log[last_metric]
    return None


def bad_flag_name(evidence: str) -> str | None:
    """The flag an argparse refusal names (``--foo``), or None."""
    for rx in BAD_FLAG_NAME:
        m = rx.search(evidence)
        if m:
            name = m.group(1)
            return name if name.startswith("-") else "--" + name.replace("_", "-")
    return None


VERDICT = re.compile(r"^servetune: |; last log line: |^pod \S+ container ")  # a backend's line


def _best(log: Sequence[str], at: list[Phase]) -> tuple[FailurePattern, int] | None:
    """The deciding row and line of ``log`` (None: no row matched).

    Best rank first, then an engine line over a backend's verdict (which may quote the engine's
    last line), then the LAST such line, then table order.
    """
    best: tuple[tuple[int, bool, int, int], FailurePattern] | None = None
    for order, p in enumerate(FAILURE_PATTERNS):
        for i in range(len(log) - 1, -1, -1):
            if at[i] in p.phases and not _is_args_line(log[i]) and p.regex.search(log[i]):
                key = (p.rank, bool(VERDICT.search(log[i])), -i, order)
                if best is None or key < best[0]:
                    best = key, p
                if not key[1]:
                    break
    return None if best is None else (best[1], -best[0][2])


_TRACEBACK = re.compile(r"Traceback \(most recent call last\)|(Error|Exception)(: |$)")
# a flag named in a message, with or without its dashes ("The arguments enable-hierarchical-cache
# and disable-radix-cache are mutually exclusive", kv_cache_hook.py); only inventory flags count
_NAMED_FLAG = re.compile(r"(?<![\w-])(?:--)?([a-z][a-z0-9]*(?:-[a-z0-9]+)+)")


# the line a launch starts with (SGLang 0.5.23 prints its resolved arguments once,
# entrypoints/engine.py:311); a log holding several launches is read from the last one
_SERVER_START = re.compile(r"server_args=")


def diagnose(log: Sequence[str]) -> Diagnosis:
    """The failure class, phase and evidence line of a failed SGLang log (module docstring).

    The phase is the one the log reached (a traceback printed after the error names the frames
    it was raised in); an excerpt without any phase line takes the phase the deciding row's
    message is raised in, else the class's own. A log that stops mid-startup with no error
    line at all is READY_TIMEOUT at the phase it reached (the readiness timeout follows); a log
    without any of SGLang's phase lines and no error (an empty paste, not a server log) is
    UNKNOWN. A log of several launches (several ``server_args=`` lines) is read from the last.
    ``source`` is the row's 0.5.23 raise site when known (else None); ``flags`` the server
    flags the failing check tests (the flag an argparse refusal names; the row's; the flags the
    message names; else the taxonomy's fields); ``verified`` is False: nothing here was read
    from a source tree.

    Returns:
        The :class:`~domain.failures.Diagnosis`; class UNKNOWN (evidence the last line) if no
        row matched.
    """
    lines = [x.rstrip("\n") for x in log]
    starts = [i for i, x in enumerate(lines) if _SERVER_START.search(x)]
    if len(starts) > 1:  # several launches in one log: the last one is the one that failed
        lines = lines[starts[-1]:]
    at = phase_at(lines)
    reached, seen = phase_reached(lines)
    found = _best(lines, at)
    if found is None:  # no error line: thrashing, a silent stop, or nothing known
        thrash = _thrash(lines)
        if thrash is not None:
            return _diagnosis("KV_THRASH", "serving", thrash[1], None, ())
        last = next((x for x in reversed(lines) if x.strip()), "")
        if seen and reached != "serving" and not any(_TRACEBACK.search(x) for x in lines):
            return _diagnosis("READY_TIMEOUT", reached, last, None, ())  # a silent stop
        return _diagnosis("UNKNOWN", reached, last, None, ())
    row, i = found
    if not seen:
        phase = row.phase or failure_class(
            "OOM_WEIGHTS" if row.failure_class == "OOM" else row.failure_class).phases[0]
    elif row.phase is not None and row.floor:
        phase = max(reached, row.phase, key=PHASES.index)
    else:
        phase = reached
    cls = OOM_BY_PHASE[phase] if row.failure_class == "OOM" else row.failure_class
    flags = row.flags or tuple(_named_flags(lines[i]))
    return _diagnosis(cls, phase, lines[i], row.site, flags)


def _named_flags(evidence: str) -> list[str]:
    """Dests of the 0.5.23 server flags the message names (``--dcp-size`` -> ``dcp_size``)."""
    by_flag = {f: dest for dest, e in flag_inventory(VERSION).items() for f in e["flags"]}
    return list(dict.fromkeys(by_flag["--" + m] for m in _NAMED_FLAG.findall(evidence)
                              if "--" + m in by_flag))


def _diagnosis(cls: str, phase: Phase, evidence: str, site: str | None,
               flags: tuple[str, ...]) -> Diagnosis:
    fc = failure_class(cls)
    if phase not in fc.phases:  # e.g. a HiCache host pool sized after graph capture
        phase = fc.phases[0]
    if cls == "BAD_FLAG":
        named = bad_flag_name(evidence)
        out = [named] if named else []
    else:
        out = [_flag(f) for f in (flags or fc.fields) if f != "weights"]
    return Diagnosis.of(cls, phase, evidence, source=site, flags=out)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def classify(log: Sequence[str]) -> tuple[str, str]:
    """Failure class and evidence line of a failed log (:func:`diagnose`, for older callers).

    Returns:
        (failure_class, evidence line); ("UNKNOWN", last line) if nothing matched.
    """
    d = diagnose(log)
    return d.failure_class, d.evidence


# every class the classifier returns, in taxonomy order, UNKNOWN last
FAILURE_CLASSES = tuple(c for c in TAXONOMY if c != "UNKNOWN" and (
    c in {p.failure_class for p in FAILURE_PATTERNS} | set(OOM_BY_PHASE.values())
    | {"KV_THRASH"})) + ("UNKNOWN",)
