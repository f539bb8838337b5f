"""The tunable knob catalog: which ServingConfig field a knob sets, its flag, and its domain.

A study names knobs by these names and lists values; ``"unset"`` (or YAML ``null``) means the
flag is not passed and SGLang's default rule applies. Values are validated through
ServingConfig itself, so the catalog and the schema of record cannot disagree.

A knob sets the ServingConfig field of its name, except ``speculative`` (one coherent bundle of
the five speculative fields, so a one-knob change never leaves a partial speculative triple
behind) and the parallel layouts, whose knobs move together (:func:`apply_knobs`):

- ``tp_size``, ``pp_size``, ``dp_size`` set the server's shape; ``replicas`` is recomputed as
  ``gpu_count // (tp_size x pp_size x dp_size)`` (a server may span nodes: the argv then
  carries ``--nnodes``);
- ``ep_size > 1`` with ``moe_a2a_backend`` unset sets it to ``deepep`` (servetune's choice:
  expert parallelism means DeepEP's dispatch unless a study writes ``none``), and ``ep_size 1``
  drops an all-to-all backend the same call did not set; an a2a backend that spans experts
  forces ``ep_size = tp_size``, as SGLang 0.5.23 does (``arg_groups/overrides.py:1611``, from
  ``arg_groups/moe_hook.py:293``), also when ``tp_size`` changes later;
- ``attn_dp_size`` must divide ``tp_size`` and ``ep_size`` must divide ``tp_size``; ``dp_size``
  and ``attn_dp_size`` are never both above 1 (``arg_groups/parallel_hook.py:162``, ``:287``;
  the engine's words, through :meth:`domain.engines.Engine.layout_coupling`);
- ``pd`` (``1P1D``-style, or ``off``) sets ``replicas`` to 1 and its prefill plus decode
  servers must fit the pool's GPUs.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    _k("tp_size", "GPUs of one tensor-parallel group; replicas = GPUs of the pool // (tp_size "
       "x pp_size x dp_size)", "tp_size", False),
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
    _k("enable_two_batch_overlap", "two-batch overlap (true/false): a batch runs as two "
       "micro-batches so one's all-to-all / all-reduce overlaps the other's compute",
       "enable_two_batch_overlap", False),
    _k("enable_single_batch_overlap", "single-batch overlap (true/false); not modelled",
       "enable_single_batch_overlap", False),
    # issue 21: parallel layouts (coupled: apply_knobs)
    _k("attn_dp_size", "attention data-parallel ranks inside the TP group (each its own "
       "scheduler, KV pool and share of max_running_requests); must divide tp_size",
       "attn_dp_size", False),
    _k("dp_size", "full data-parallel copies inside one server (tp_size x pp_size GPUs each); "
       "replicas = GPUs of the pool // (tp_size x pp_size x dp_size)", "dp_size", False),
    _k("ep_size", "expert-parallel width of the MoE layers (divides tp_size); above 1 with "
       "moe_a2a_backend unset it sets deepep", "ep_size", False),
    _k("moe_a2a_backend", "all-to-all token dispatch of expert parallelism (deepep, ...; none "
       "= all-gather MoE); any but none forces ep_size = tp_size", "moe_a2a_backend"),
    _k("deepep_mode", "DeepEP kernels: auto, normal (prefill), low_latency (decode)",
       "deepep_mode"),
    _k("moe_dense_tp_size", "TP width of the dense MLP layers of a MoE model (1 or tp_size)",
       "moe_dense_tp_size"),
    _k("enable_eplb", "expert-parallel load balancer: rebalance expert placement (true/false)",
       "enable_eplb", False),
    _k("ep_num_redundant_experts", "extra expert replicas for the load balancer",
       "ep_num_redundant_experts", False),
    _k("pp_size", "pipeline stages (layers split over them); replicas = GPUs of the pool // "
       "(tp_size x pp_size x dp_size)", "pp_size", False),
    _k("enable_dp_lm_head", "vocab-parallel lm_head inside each attention-DP group "
       "(true/false)", "enable_dp_lm_head", False),
    _k("pd", "prefill/decode disaggregation: '<n>P<m>D' (n prefill and m decode servers with "
       "the config's layout, behind the router in PD mode) or off; replicas becomes 1",
       None),
    _k("disaggregation_transfer_backend", "KV transfer between PD servers (mooncake, nixl, "
       "...)", "disaggregation_transfer_backend"),
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


# Layout knobs whose valid values depend on each other's (a study checks a value of one
# against the other's values, domain.study.Study.validate_space).
COUPLED_KNOBS = ("tp_size", "pp_size", "dp_size", "attn_dp_size", "ep_size", "moe_a2a_backend",
                 "pd")
# Knobs that shape a server or the pool: setting one recomputes the replicas (or PD's fit).
SHAPE_KNOBS = ("tp_size", "pp_size", "dp_size", "pd")
# The a2a backend an ep_size above 1 sets when moe_a2a_backend is unset (see the module doc).
EP_DEFAULT_A2A = "deepep"


def pd_value(value: Any) -> Any:
    """A ``pd`` knob value as the field takes it: None for ``off``/unset, else as given.

    YAML 1.1 reads a bare ``off`` as false, so False is off too.
    """
    if value is None or value is False:
        return None
    if isinstance(value, str) and value.strip().lower() in ("off", "none", "null", "unset"):
        return None
    return value


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _update(name: str, value: Any, v: Any, gpu_count: int) -> dict[str, Any]:
    """The ServingConfig fields knob ``name`` sets to ``v`` (``value`` as the study wrote it)."""
    if name == "speculative":
        return speculative_bundle(v)
    if name == "pd":
        return {"pd": pd_value(v)}
    if name in ("tp_size", "pp_size", "dp_size") and not _positive_int(v):
        raise ConfigInvalid([f"knobs.{name}: {value!r} must be a positive integer that "
                             f"divides the {gpu_count} GPUs of the pool"])
    update: dict[str, Any] = {name: v}
    if name == "hicache_ratio" and v is not None:
        update["enable_hierarchical_cache"] = True  # a host ratio only means something with it
    return update


def _couple(data: dict[str, Any], names: set[str], label: str, gpu_count: int) -> None:
    """Move the coupled layout fields of ``data`` together, in place (module docstring).

    Raises:
        ConfigInvalid: the engine refuses the layout, the server does not divide the pool, or
            a PD layout needs more GPUs than the pool has.
    """
    if "ep_size" in names and "moe_a2a_backend" not in names and data["ep_size"] == 1:
        if data["moe_a2a_backend"] not in (None, "none"):
            data["moe_a2a_backend"] = None  # EP off: the dispatch goes with it
    if isinstance(data["ep_size"], int) and data["ep_size"] > 1 \
            and data["moe_a2a_backend"] is None:
        data["moe_a2a_backend"] = EP_DEFAULT_A2A
    eng = engine(data.get("engine", "sglang"), data["engine_version"])
    fields = {k: data[k] for k in ("tp_size", "attn_dp_size", "dp_size", "ep_size",
                                   "moe_a2a_backend")}
    if not all(isinstance(fields[k], int) and not isinstance(fields[k], bool) and fields[k] >= 1
               for k in ("tp_size", "attn_dp_size", "dp_size", "ep_size")):
        return  # ServingConfig's own validation names the bad value
    rewrites, violations = eng.layout_coupling(fields)
    data.update(rewrites)
    if violations:
        raise ConfigInvalid([f"knobs.{label}: {v}" for v in violations])
    gps = data["tp_size"] * data["pp_size"] * data["dp_size"]
    if data["pd"] is not None:
        data["replicas"] = 1
    elif names & set(SHAPE_KNOBS):
        if gpu_count % gps:
            if gps == data["tp_size"]:
                raise ConfigInvalid([f"knobs.{label}: {gps} must be a positive integer that "
                                     f"divides the {gpu_count} GPUs of the pool"])
            raise ConfigInvalid([f"knobs.{label}: a server of tp_size {data['tp_size']} x "
                                 f"pp_size {data['pp_size']} x dp_size {data['dp_size']} = "
                                 f"{gps} GPUs must divide the {gpu_count} GPUs of the pool"])
        data["replicas"] = gpu_count // gps


def _check_pd(cfg: ServingConfig, label: str, gpu_count: int) -> None:
    """Refuse a PD layout larger than the pool, or a worker layout the engine refuses.

    A worker's layout is its group's fields over the config's
    (:meth:`domain.engines.Engine.layout_coupling`).
    """
    if cfg.pd is None:
        return
    problems: list[str] = []
    for role, _, worker in cfg.servers():
        _, bad = engine(worker.engine, worker.engine_version).layout_coupling(
            {k: getattr(worker, k) for k in ("tp_size", "attn_dp_size", "dp_size", "ep_size",
                                             "moe_a2a_backend")})
        problems += [f"knobs.{label}: the {role} servers: {b}" for b in bad]
    if not problems and cfg.gpus > gpu_count:
        parts = " + ".join(f"{n} {role} x {w.gpus_per_server} GPUs"
                           for role, n, w in cfg.servers())
        problems.append(f"knobs.{label}: {cfg.pd.label()} needs {parts} = {cfg.gpus} GPUs but "
                        f"the pool has {gpu_count}")
    if problems:
        raise ConfigInvalid(problems)


def apply_knobs(config: ServingConfig, settings: Mapping[str, Any],
                gpu_count: int) -> ServingConfig:
    """Return ``config`` with every knob of ``settings`` set at once, coupled fields moved.

    All values are set first and the coupling (module docstring) is resolved on the result, so
    the order of ``settings`` does not matter (``attn_dp_size 8`` with ``tp_size 8`` is valid
    from a ``tp_size 4`` config). ``speculative`` sets its bundle (:func:`speculative_bundle`),
    ``hicache_ratio`` turns HiCache on.

    Args:
        config: the config to change.
        settings: knob name -> value as a study writes it (``"unset"`` / None: engine default).
        gpu_count: GPUs of the study's pool.

    Raises:
        ConfigInvalid: an unknown knob, a value outside the knob's domain (the message names
            the knob and the reason), a server that does not divide ``gpu_count``, a layout the
            engine refuses (naming both values), or a PD layout larger than the pool.
    """
    updates: dict[str, Any] = {}
    for name, value in settings.items():
        if name not in KNOBS:
            raise ConfigInvalid([f"knobs.{name}: unknown knob; known: {', '.join(KNOBS)}"])
        v = normalize_value(value)
        if v is None and not KNOBS[name].unsettable:
            raise ConfigInvalid([f"knobs.{name}: cannot be 'unset'; give a value"])
        updates.update(_update(name, value, v, gpu_count))
    names = set(settings)
    label = next(iter(settings)) if len(settings) == 1 else "+".join(settings)
    data = config.model_dump()
    data.update(updates)
    _couple(data, names, label, gpu_count)
    try:
        cfg = ServingConfig.model_validate(data)
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            where = str(err["loc"][0]) if err["loc"] else ""
            name = where if where in settings else label
            shown = settings.get(name, data.get(where))
            msgs.append(f"knobs.{name}: {shown!r} is invalid: "
                        f"{err['msg'].removeprefix('Value error, ')}")
        raise ConfigInvalid(msgs) from e
    problems = [f"knobs.{label}: {line}" for _, _, server in cfg.servers()
                for line in engine(server.engine, server.engine_version).layout_refusals(server)]
    if problems:
        raise ConfigInvalid(list(dict.fromkeys(problems)))
    _check_pd(cfg, label, gpu_count)
    return cfg


def apply_knob(config: ServingConfig, name: str, value: Any, gpu_count: int) -> ServingConfig:
    """Return ``config`` with knob ``name`` set to ``value`` (:func:`apply_knobs` of one knob).

    Setting ``tp_size``, ``pp_size`` or ``dp_size`` also sets ``replicas = gpu_count //
    (tp_size x pp_size x dp_size)``; ``speculative`` sets the five speculative fields together
    (:func:`speculative_bundle`); the layouts move together (module docstring).

    Raises:
        ConfigInvalid: unknown knob, a value outside the knob's domain (the message names the
            knob and the reason), a server that does not divide ``gpu_count``, or a layout the
            engine refuses.
    """
    return apply_knobs(config, {name: value}, gpu_count)
