"""The one failure taxonomy: every failure class, where it happens, whether a retry helps, the fix.

Each :class:`FailureClass` states, once, for one class:

- ``phases``: the startup or serving phases (:data:`Phase`) it can happen in, its defining phase
  first;
- ``retry``: its :class:`RetryRule` (whether a retry can cure it, how many tries in all, whether
  the retry needs a fresh deployment);
- ``meaning``, ``fix``: what it says about the config and what to change;
- ``outcome``: the outcome of the lesson it teaches (None: a transient failure teaches none);
- ``condition``: how that lesson's condition is formed (which fields of the failed config it
  tests);
- ``fields``: the config fields that condition tests when the engine's message names no other.

Who reads it: the engine classifiers (``domain/engines/<name>/failures.py``: the class and the
phase of a log), the retry policy (:mod:`domain.faults` re-exports :func:`rule` and
:func:`should_retry`), and the lesson builders (``domain/engines/<name>/lessons.py``: the fix
and the outcome of each class). Engine-neutral: the engines' own log wording lives with the
engines.

Phases (the order a server reaches them; an engine's classifier maps its log lines onto them):

- ``args``: argument parsing and resolution (argparse, the server-args validation) -- before
  the engine logs its resolved server arguments;
- ``init``: process and distributed setup (NCCL, the model config), until weights load; also
  where a pod that never ran (an image pull) stops;
- ``weights_load``: loading the checkpoint shards (target and draft);
- ``kv_pool``: from the end of weight loading through the KV pool (device and HiCache host)
  and the attention-backend setup;
- ``cuda_graph``: CUDA-graph capture;
- ``serving``: after the server reported ready (the scheduler's batches, the benchmark).
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

Phase = Literal["args", "init", "weights_load", "kv_pool", "cuda_graph", "serving"]
PHASES: tuple[Phase, ...] = get_args(Phase)
STARTUP: tuple[Phase, ...] = PHASES[:-1]  # every phase before the server is ready
# the lesson outcomes a class can have (a subset of domain.lesson.Outcome, kept literal here so
# the taxonomy imports no lesson model)
LessonOutcome = Literal["oom", "crash", "invalid-flag", "unsupported", "slo-miss"]

MAX_ATTEMPTS = 3  # tries of one launch or one benchmark, the first included


class RetryRule(BaseModel):
    """Whether a failure class is worth another try, how many tries in all, and why."""

    model_config = ConfigDict(frozen=True)

    retry: bool
    redeploy: bool = Field(False, description="the retry needs a fresh deployment (the server "
                           "is gone), not only a new benchmark on the same one")
    max_attempts: int = Field(MAX_ATTEMPTS, ge=1, le=MAX_ATTEMPTS,
                              description="tries in all, the first included (1 = never "
                                          "retried)")
    why: str


NO_RETRY = RetryRule(retry=False, max_attempts=1, why="the engine refuses the config or runs "
                     "out of memory the same way every time; the failure becomes a lesson")


class FailureClass(BaseModel):
    """One failure class of the taxonomy (see the module docstring for each field's reader)."""

    model_config = ConfigDict(frozen=True)

    name: str
    phases: tuple[Phase, ...] = Field(min_length=1, description="where it happens, its "
                                      "defining phase first")
    retry: RetryRule = NO_RETRY
    meaning: str
    fix: str
    outcome: LessonOutcome | None = Field(description="outcome of its lesson (None: transient,"
                                          " no lesson)")
    condition: str = Field(description="how its lesson's condition is formed")
    fields: tuple[str, ...] = Field((), description="ServingConfig fields that condition "
                                    "tests when the engine's message names no others")


def _c(name: str, phases: tuple[Phase, ...], meaning: str, fix: str,
       outcome: LessonOutcome | None, condition: str, fields: tuple[str, ...] = (),
       retry: RetryRule = NO_RETRY) -> FailureClass:
    return FailureClass(name=name, phases=phases, retry=retry, meaning=meaning, fix=fix,
                        outcome=outcome, condition=condition, fields=fields)


_MEMORY = ("weights", "tp_size", "kv_cache_dtype", "mem_fraction_static", "max_running_requests",
           "chunked_prefill_size", "cuda_graph_max_bs_decode", "speculative_algorithm")
_ANY: tuple[Phase, ...] = PHASES

TAXONOMY: dict[str, FailureClass] = {c.name: c for c in (
    _c("BAD_FLAG", ("args",), "argparse refused a flag or a value of this engine version",
       "use only flags and values of the pinned engine version's inventory (the message names "
       "the flag)", "invalid-flag",
       "the flag the message names, at the value the failed config gave it; this engine "
       "version, any GPU or model"),
    _c("UNSUPPORTED_BACKEND", _ANY, "a backend or kernel cannot run on this GPU architecture "
       "(an argument check, a kernel's runtime error or a wrapped traceback)",
       "leave the backend flag unset (the engine picks one for the GPU architecture) or choose "
       "one the architecture supports", "unsupported",
       "the backend flag the message names (attention backend by default) at its failed value, "
       "on this GPU; any model or checkpoint", ("attention_backend",)),
    _c("BACKEND_MODEL_MISMATCH", ("init", "weights_load", "kv_pool"),
       "the attention backend does not support this model's attention type",
       "choose an attention backend made for this model's attention type (MLA/DSA or MHA/GQA), "
       "or leave it unset", "unsupported",
       "the attention backend at its failed value, for this model on any GPU",
       ("attention_backend",)),
    _c("OOM_WEIGHTS", ("weights_load", "init"), "the weight shard (with any draft layers) does "
       "not fit in GPU memory", "use more GPUs per replica (higher --tp-size) or a smaller "
       "checkpoint", "oom",
       "these weights at this or any smaller tp_size and pp_size (and the same speculative "
       "algorithm when one is on; inside the same parallel layout: attention DP at least as "
       "wide, the other layout fields as they were): weights per GPU only grow as tp_size or "
       "pp_size falls", ("weights", "tp_size", "pp_size")),
    _c("GRAPH_CAPTURE_OOM", ("cuda_graph",), "CUDA-graph capture ran out of the memory left "
       "outside the static pool", "lower --mem-fraction-static or --cuda-graph-max-bs-decode",
       "oom", "exactly this memory layout (weights, tp_size, KV dtype, memory fraction, "
       "admission cap, chunk size, decode graph size, speculation)", _MEMORY),
    _c("KV_NO_ROOM", ("kv_pool",), "the weights leave no (or too small a) KV cache under "
       "--mem-fraction-static", "raise --mem-fraction-static, raise --tp-size or use a smaller "
       "checkpoint", "oom", "exactly this memory layout (as GRAPH_CAPTURE_OOM)", _MEMORY),
    _c("HOST_OOM_HICACHE", ("kv_pool",), "the HiCache host pool does not fit in the node's host "
       "memory", "lower --hicache-ratio (or leave it unset) so the host KV pool fits the node's "
       "memory", "oom", "HiCache on at this tp_size with a host ratio above the largest that "
       "fits (ratio x free / requested GB from the message; never above the failing ratio)",
       ("enable_hierarchical_cache", "tp_size", "hicache_ratio")),
    _c("HICACHE_HOST_TOO_SMALL", ("kv_pool",), "--hicache-ratio must make the host pool larger "
       "than the device KV pool", "use --hicache-ratio above 1 (the host pool must exceed the "
       "device pool)", "crash", "HiCache on with a host ratio <= 1, any model",
       ("enable_hierarchical_cache", "hicache_ratio")),
    _c("NO_DRAFT_MODEL", ("kv_pool", "args", "init", "weights_load"),
       "speculative decoding on a model whose checkpoint ships no draft head (or without the "
       "draft model path the algorithm needs)", "speculative decoding needs a model with "
       "MTP/NextN layers or a draft model", "unsupported",
       "this speculative algorithm on this model", ("speculative_algorithm",)),
    _c("TP_DIVISIBILITY", ("init", "weights_load"), "attention heads or MLP sizes do not split "
       "evenly over tp_size", "choose a tp_size that divides the attention heads (e.g. 2, 4, 8)",
       "crash", "this tp_size for this model (on any GPU)", ("tp_size",)),
    _c("MULTI_NODE_REQUIRED", ("init",), "tp_size needs more GPUs than one node has",
       "keep tp_size within one node's GPUs or serve across nodes with --nnodes", "crash",
       "this tp_size for this model on this GPU", ("tp_size",)),
    _c("INVALID_COMBINATION", ("args", "init"), "the engine's argument resolution rejected a "
       "flag combination", "drop or adjust the conflicting flags the engine's message names",
       "crash", "the combination the message names (e.g. HiCache with the radix cache disabled, "
       "a partial speculative triple), this engine version on any GPU or model; a message the "
       "builder does not know: exactly the failed config's set knobs"),
    _c("MODEL_LOAD", ("weights_load", "init"), "the weights or the model config are missing, "
       "need remote code, or are in a format the engine cannot read",
       "check --model-path (downloaded, complete, readable), pass --trust-remote-code when the "
       "model ships its own code, or use a checkpoint format the engine reads", "crash",
       "these weights at this exact tp_size on this model (the checkpoint, not the flags, is at "
       "fault)", ("weights", "tp_size")),
    _c("NCCL", ("init", "cuda_graph", "serving"),
       "a collective (NCCL, or gloo's TCP transport) failed to initialise or timed out",
       "check the GPUs' interconnect and the NCCL environment (NCCL_DEBUG=INFO names the failing "
       "link); a retry on a fresh pod often clears a stuck collective", None,
       "no lesson: a retry on a fresh deployment decides (a failure on every try is recorded, "
       "not learned)", ("tp_size",),
       RetryRule(retry=True, redeploy=True, max_attempts=2, why="a collective timed out or a "
                 "peer was slow to join; one fresh deployment tells a stuck link from a broken "
                 "one")),
    _c("KV_THRASH", ("serving",), "the scheduler retracted (preempted) running requests again "
       "and again because the KV pool filled up", "lower --max-running-requests or "
       "--chunked-prefill-size, raise --mem-fraction-static, or give the pool more GPUs",
       "slo-miss", "exactly this memory layout (informative: the config runs, it forbids "
       "nothing)", _MEMORY),
    _c("CRASH_LOOP", ("serving", "cuda_graph", "kv_pool"), "the server crashed after it "
       "started, and again after each restart", "inspect the last traceback; avoid this exact "
       "combination", "crash", "exactly the failed config's set knobs (weights and tp_size "
       "included)"),
    _c("IMAGE_PULL", ("init",), "the node could not pull the image (registry or network)",
       "check the image name and the node's registry access; a new pod pulls again", None,
       "no lesson (transient)", retry=RetryRule(
           retry=True, redeploy=True, why="the registry or the node's network failed, not the "
           "config; a new pod pulls again")),
    _c("READY_TIMEOUT", ("init", "args", "weights_load", "kv_pool", "cuda_graph"),
       "the server stopped logging mid-startup and did not turn "
       "Ready within the readiness timeout", "raise the readiness timeout or check the node "
       "(slow storage, a stuck JIT compile); the phase says where it stalled", None,
       "no lesson (retried once; not an engine refusal)", retry=RetryRule(
           retry=True, redeploy=True, max_attempts=2, why="a slow node or storage delayed the "
           "start; one fresh pod tells a slow start from a stuck one")),
    _c("SERVER_DIED", ("serving",), "the server died under load after it had started fine",
       "inspect the server's log around the benchmark", None, "no lesson (transient)",
       retry=RetryRule(retry=True, redeploy=True, why="the server died under load after it had "
                       "started fine; a new deployment runs the benchmark again")),
    _c("BENCH_TIMEOUT", ("serving",), "the benchmark harness stalled", "run it again", None,
       "no lesson (transient)", retry=RetryRule(
           retry=True, why="the benchmark harness stalled; the deployment is still up, run it "
           "again")),
    _c("BENCH_GARBAGE", ("serving",), "the benchmark's records fail the sanity checks",
       "measure again", None, "no lesson (transient)", retry=RetryRule(
           retry=True, why="records that fail the sanity checks say nothing about the config; "
           "measure again")),
    _c("BENCH_INVALID", ("serving",), "the benchmark failed for another reason (e.g. the engine "
       "refused the requests)", "inspect the failed requests", None, "no lesson"),
    _c("LESSONS_UNAVAILABLE", ("serving",), "the lesson store is briefly down",
       "wait and call again", None, "no lesson (transient)", retry=RetryRule(
           retry=True, why="the lesson store is briefly down; the call is retried after a "
           "short pause")),
    _c("UNKNOWN", _ANY, "no known failure line was found", "inspect the log; avoid this exact "
       "combination", "crash", "exactly the failed config's set knobs (weights and tp_size "
       "included)"),
)}


def failure_class(name: str | None) -> FailureClass:
    """The taxonomy entry of ``name`` (None or a name it does not know: UNKNOWN)."""
    return TAXONOMY.get(name or "", TAXONOMY["UNKNOWN"])


def rule(name: str | None) -> RetryRule:
    """The retry rule of failure class ``name`` (engine refusals and OOMs: never retried)."""
    return TAXONOMY[name].retry if name in TAXONOMY else NO_RETRY


def should_retry(name: str | None, attempt: int) -> bool:
    """Whether try ``attempt`` (0 = the first) that failed with class ``name`` is retried.

    A class is retried while tries remain under its ``max_attempts`` (READY_TIMEOUT and NCCL:
    once; the other transient classes: up to :data:`MAX_ATTEMPTS` tries in all).
    """
    r = rule(name)
    return r.retry and attempt + 1 < r.max_attempts


class NoLesson(ValueError):  # noqa: N818 -- a verdict, not an error of the caller
    """The class's rule cannot form a lesson condition for this config (the message says why)."""


class Diagnosis(BaseModel):
    """What a failed log shows: its class, the phase it died in, the line that proves it.

    ``source`` and ``verified`` come from the engine's source when a tree is at hand (the raise
    or assert site of the message); without one ``source`` is None (or the site the engine's
    classifier table records) and ``verified`` False: the condition is the taxonomy's rule.
    """

    failure_class: str
    phase: Phase
    evidence: str = Field(description="the log line that decided the class")
    source: str | None = Field(None, description="file:line of the engine check, if known")
    flags: list[str] = Field(default_factory=list, description="the server flags the lesson's "
                             "condition tests, e.g. ['--attention-backend']")
    retry: bool = Field(description="a retry can cure it (the class's retry rule)")
    fix: str
    verified: bool = Field(False, description="source and flags were read from the engine's "
                           "source tree (not only the taxonomy's rule)")

    @classmethod
    def of(cls, name: str, phase: Phase, evidence: str, source: str | None = None,
           flags: list[str] | None = None, fix: str | None = None) -> Diagnosis:
        """A diagnosis of class ``name`` whose retry and (default) fix come from the taxonomy."""
        fc = failure_class(name)
        return cls(failure_class=name, phase=phase, evidence=evidence, source=source,
                   flags=flags or [], retry=fc.retry.retry, fix=fix or fc.fix)
