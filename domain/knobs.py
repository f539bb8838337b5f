"""The tunable knob catalog: which ServingConfig field a knob sets, its flag, and its domain.

A study names knobs by these names and lists values; ``"unset"`` (or YAML ``null``) means the
flag is not passed and SGLang's default rule applies. Values are validated through
ServingConfig itself, so the catalog and the schema of record cannot disagree.

A knob sets the ServingConfig field of its name, except ``tp_size`` (which also sets
``replicas``) and ``speculative`` (one coherent bundle of the five speculative fields, so a
one-knob change never leaves a partial speculative triple behind).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from domain.config import ServingConfig
from domain.engines import engine
from domain.errors import ConfigInvalid


class Knob(BaseModel):
    """One tunable knob."""

    model_config = ConfigDict(frozen=True)

    name: str
    flag: str | None  # None for knobs that are not one engine flag (weights, replicas layout)
    description: str
    unsettable: bool = True  # may take "unset" (engine default)


def _k(name: str, description: str, dest: str | None = None, unsettable: bool = True) -> Knob:
    return Knob(name=name, flag=engine("sglang", "0.5.23").flag_for(dest) if dest else None,
                description=description, unsettable=unsettable)


KNOBS: dict[str, Knob] = {k.name: k for k in (
    _k("tp_size", "GPUs per replica; replicas = GPUs of the pool // tp_size", "tp_size", False),
    _k("weights", "checkpoint: sets --model-path and --quantization (e.g. fp8, nvfp4)",
       None, False),
    _k("kv_cache_dtype", "KV cache storage dtype (auto, bf16, fp8_e4m3)", "kv_cache_dtype",
       False),
    _k("mem_fraction_static", "share of GPU memory for weights + KV pool",
       "mem_fraction_static"),
    _k("max_running_requests", "admission cap per replica", "max_running_requests"),
    _k("chunked_prefill_size", "max new tokens per prefill chunk", "chunked_prefill_size"),
    _k("cuda_graph_max_bs_decode", "largest decode batch captured in a CUDA graph",
       "cuda_graph_max_bs_decode"),
    _k("attention_backend", "attention kernel family", "attention_backend"),
    _k("mm_attention_backend", "attention kernels of a multimodal model's vision encoder",
       "mm_attention_backend"),
    _k("schedule_policy", "waiting-queue order (fcfs, lpm)", "schedule_policy", False),
    _k("schedule_conservativeness", "admission's estimate of future decode tokens (x 0.7 "
       "initial new-token ratio); higher admits fewer requests", "schedule_conservativeness"),
    _k("speculative", "speculative decoding as one coherent bundle: off | nextn (MTP head, "
       "engine defaults (3, 1, 4)) | nextn_adaptive (depth per batch size) | "
       "nextn:<steps>,<topk>,<draft_tokens>", "speculative_algorithm", False),
    _k("disable_radix_cache", "turn the radix prefix cache off (true/false)",
       "disable_radix_cache", False),
    _k("enable_hierarchical_cache", "HiCache: host-memory tier behind the radix cache "
       "(true/false)", "enable_hierarchical_cache", False),
    _k("hicache_ratio", "HiCache host pool as a multiple of the device KV pool (setting it "
       "turns HiCache on)", "hicache_ratio"),
    # issue 19: modelled (memory, step cost, per-SM rules) ...
    _k("context_length", "longest request (prompt + output), tokens; sizes the default "
       "max_running_requests; above the model's own it is refused", "context_length"),
    _k("page_size", "KV page, tokens: pool granularity and prefix-cache match unit (a "
       "backend may force its own)", "page_size"),
    _k("disable_cuda_graph", "no CUDA graphs (true/false): no graph memory, every decode "
       "step eager", "disable_cuda_graph", False),
    _k("moe_runner_backend", "MoE expert kernels (auto, flashinfer_cutlass, "
       "flashinfer_trtllm (SM 10 only), triton, ...)", "moe_runner_backend"),
    # ... and passed through as given, "not modelled" in the report and servetune check
    _k("fp4_gemm_runner_backend", "FP4 GEMM kernels (--fp4-gemm-backend); not modelled",
       "fp4_gemm_runner_backend"),
    _k("num_continuous_decode_steps", "decode steps per scheduling round; not modelled",
       "num_continuous_decode_steps"),
    _k("enable_two_batch_overlap", "two-batch overlap (true/false); not modelled",
       "enable_two_batch_overlap", False),
    _k("enable_single_batch_overlap", "single-batch overlap (true/false); not modelled",
       "enable_single_batch_overlap", False),
    _k("router_policy", "how the router spreads requests over replicas (round_robin, "
       "power_of_two, cache_aware, kube_service = the Kubernetes Service, no router); a "
       "router flag, not a server flag", None, False),
    _k("router_cache_threshold", "cache_aware router: prefix-match share (characters) above "
       "which the longest-matching worker wins (--cache-threshold, default 0.3)", None, False),
    _k("router_balance_abs_threshold", "cache_aware router: in-flight spread (max - min) "
       "above which, with the rel test, the least-loaded worker wins "
       "(--balance-abs-threshold, default 64)", None, False),
    _k("router_balance_rel_threshold", "cache_aware router: max > rel x min in-flight also "
       "needed for load balancing (--balance-rel-threshold, default 1.5)", None, False),
)}
# ServingConfig fields the ``speculative`` knob sets together, so no partial triple survives a
# change of bundle.
SPECULATIVE_FIELDS = ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                      "speculative_num_draft_tokens", "speculative_adaptive")


def speculative_bundle(value: Any) -> dict[str, Any]:
    """The ServingConfig fields of a ``speculative`` knob value.

    ``off`` clears speculation; ``nextn`` turns on the checkpoint's MTP/NextN head with the
    engine's default triple; ``nextn_adaptive`` adds ``--speculative-adaptive``;
    ``nextn:S,K,D`` sets steps S, topk K and draft tokens D explicitly.

    Raises:
        ConfigInvalid: any other value, naming the accepted ones.
    """
    off: dict[str, Any] = dict.fromkeys(SPECULATIVE_FIELDS)
    off["speculative_adaptive"] = False
    if value is False:  # YAML 1.1 reads a bare `off` as false
        return off
    text = str(value).strip().lower() if isinstance(value, str) else None
    if text == "off":
        return off
    if text in ("nextn", "nextn_adaptive"):
        return {**off, "speculative_algorithm": "NEXTN",
                "speculative_adaptive": text == "nextn_adaptive"}
    if text is not None and text.startswith("nextn:"):
        parts = text.removeprefix("nextn:").split(",")
        if len(parts) == 3 and all(p.strip().isdigit() for p in parts):
            steps, topk, draft = (int(p) for p in parts)
            return {**off, "speculative_algorithm": "NEXTN", "speculative_num_steps": steps,
                    "speculative_eagle_topk": topk, "speculative_num_draft_tokens": draft}
    raise ConfigInvalid([f"knobs.speculative: {value!r} is not a bundle; give off, nextn, "
                         "nextn_adaptive or nextn:<steps>,<topk>,<draft_tokens> (e.g. "
                         "nextn:3,1,4); quote values in YAML ('nextn:3,1,4')"])


def normalize_value(value: Any) -> Any:
    """Map the study spelling of "leave unset" (``"unset"``, ``None``) to None."""
    return None if value is None or (isinstance(value, str) and value.lower() == "unset") \
        else value


def apply_knob(config: ServingConfig, name: str, value: Any, gpu_count: int) -> ServingConfig:
    """Return ``config`` with knob ``name`` set to ``value``.

    Setting ``tp_size`` also sets ``replicas = gpu_count // tp_size``; ``speculative`` sets the
    five speculative fields together (:func:`speculative_bundle`).

    Raises:
        ConfigInvalid: unknown knob, a value outside the knob's domain (the message names the
            knob and the reason), or a tp_size that does not divide ``gpu_count``.
    """
    if name not in KNOBS:
        raise ConfigInvalid([f"knobs.{name}: unknown knob; known: {', '.join(KNOBS)}"])
    v = normalize_value(value)
    if v is None and not KNOBS[name].unsettable:
        raise ConfigInvalid([f"knobs.{name}: cannot be 'unset'; give a value"])
    update: dict[str, Any] = speculative_bundle(v) if name == "speculative" else {name: v}
    if name == "hicache_ratio" and v is not None:
        update["enable_hierarchical_cache"] = True  # a host ratio only means something with it
    if name == "tp_size":
        if not isinstance(v, int) or isinstance(v, bool) or v < 1 or gpu_count % v:
            raise ConfigInvalid([f"knobs.tp_size: {value!r} must be a positive integer that "
                                 f"divides the {gpu_count} GPUs of the pool"])
        update["replicas"] = gpu_count // v
        from domain.hardware import get_gpu

        per_node = get_gpu(config.gpu).gpus_per_node
        if v > per_node:
            raise ConfigInvalid([f"knobs.tp_size: {v} spans more than one {config.gpu} node "
                                 f"({per_node} GPUs); multi-node replicas are not supported "
                                 "yet"])
    data = config.model_dump()
    data.update(update)
    try:
        return ServingConfig.model_validate(data)
    except ValidationError as e:
        msgs = [f"knobs.{name}: {value!r} is invalid: {err['msg'].removeprefix('Value error, ')}"
                for err in e.errors()]
        raise ConfigInvalid(msgs) from e
