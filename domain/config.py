"""ServingConfig: the schema of record for one serving configuration.

The same model is the MCP tool input of the cluster server, the planner's output and the ledger
row, so they cannot drift. ``None`` means "unset": the flag is not passed and the engine's own
default rule decides (see ``domain/fit.py`` for those rules). Its command line is the engine's
(:meth:`domain.engines.Engine.argv`).

Longer than 500 lines on purpose: ``ServingConfig`` is the one schema of record; each
field carries its flag's description, and the PD layout classes and the server expansion
(:meth:`ServingConfig.servers`) must validate with it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shlex
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator


def check_engine_version(v: str) -> str:
    """Accept only versions whose flag inventory ships here (the only engine: SGLang).

    Raises:
        ValueError: naming the supported versions (:func:`domain.engines.engine`).
    """
    from domain.engines import engine

    engine("sglang", v)
    return v


EngineVersion = Annotated[str, AfterValidator(check_engine_version)]

# Fields added since twin v1; config_id() leaves them out while they hold their default.
V1_FIELDS = ("schedule_conservativeness", "speculative_algorithm", "speculative_num_steps",
             "speculative_eagle_topk", "speculative_num_draft_tokens", "speculative_adaptive",
             "disable_radix_cache", "enable_hierarchical_cache", "hicache_ratio",
             "mm_attention_backend")
# Fields that are not engine flags (their values never reach the argv as themselves).
# Router knobs (sglang-router 0.3.2 flags --cache-threshold, --balance-abs-threshold,
# --balance-rel-threshold; issue 20); config_id() leaves them out at their default, as V1_FIELDS.
ROUTER_FIELDS = ("router_cache_threshold", "router_balance_abs_threshold",
                 "router_balance_rel_threshold")
_NOT_FLAGS = ("engine", "engine_version", "model", "gpu", "weights", "replicas", "router_policy",
              "pd", *ROUTER_FIELDS)
_FLAG_DEFAULTS: tuple[tuple[str, Any], ...] | None = None  # (field, default) of the others
# String fields whose values are the choices of the engine version's flag inventory.
CHOICE_FIELDS = ("attention_backend", "mm_attention_backend", "moe_runner_backend",
                 "fp4_gemm_runner_backend", "moe_a2a_backend",
                 "disaggregation_transfer_backend")
# Fields passed through to the launch command as given whose effect on memory and speed the
# twin does not model: the report and ``servetune check`` list them as "not modelled".
PASSED_THROUGH = ("fp4_gemm_runner_backend", "num_continuous_decode_steps",
                  "enable_single_batch_overlap")
# Fields added by issue 19; config_id() leaves them out while unset, as it does V1_FIELDS.
V19_FIELDS = ("context_length", "page_size", "disable_cuda_graph", "moe_runner_backend",
              "enable_two_batch_overlap", *PASSED_THROUGH)
# Parallel layouts (issue 21); config_id() leaves them out while they hold their default.
LAYOUT_FIELDS = ("attn_dp_size", "dp_size", "ep_size", "moe_a2a_backend", "deepep_mode",
                 "moe_dense_tp_size", "enable_eplb", "ep_num_redundant_experts", "pp_size",
                 "enable_dp_lm_head", "disaggregation_mode", "disaggregation_transfer_backend",
                 "pd", "load_balance_method")
# The fields a PD worker group may set for itself (the rest it shares with the config).
PD_GROUP_FIELDS = ("tp_size", "attn_dp_size", "ep_size", "pp_size", "moe_a2a_backend",
                   "deepep_mode", "moe_dense_tp_size", "max_running_requests",
                   "chunked_prefill_size", "cuda_graph_max_bs_decode", "mem_fraction_static")


def _gpu_name(name: str) -> str:
    """The GPU registry's spelling of ``name`` ("h200" -> "H200").

    An unknown name is left for ``_catalogs`` to refuse (see
    :func:`domain.hardware.canonical_gpu_name`).
    """
    from domain.hardware import GPUS

    return GPUS.resolve(name) or name


class PDGroup(BaseModel):
    """One worker group of a prefill/decode (PD) disaggregated layout.

    ``workers`` servers of this role, each with the config's layout except the fields given
    here (None = the config's own value; see ``PD_GROUP_FIELDS``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    workers: int = Field(1, ge=1, le=256, description="servers of this role")
    tp_size: int | None = Field(None, ge=1, le=512, description="--tp-size of each server")
    attn_dp_size: int | None = Field(None, ge=1, le=512, description="--attn-dp-size")
    ep_size: int | None = Field(None, ge=1, le=512, description="--ep-size")
    pp_size: int | None = Field(None, ge=1, le=64, description="--pp-size")
    moe_a2a_backend: str | None = Field(None, description="--moe-a2a-backend")
    deepep_mode: Literal["auto", "normal", "low_latency"] | None = Field(
        None, description="--deepep-mode")
    moe_dense_tp_size: int | None = Field(None, ge=1, le=512,
                                          description="--moe-dense-tp-size")
    max_running_requests: int | None = Field(None, ge=1, le=65536,
                                             description="--max-running-requests")
    chunked_prefill_size: int | None = Field(None, ge=-1, le=1 << 20,
                                             description="--chunked-prefill-size")
    cuda_graph_max_bs_decode: int | None = Field(None, ge=1, le=4096,
                                                 description="--cuda-graph-max-bs-decode")
    mem_fraction_static: float | None = Field(None, gt=0.0, lt=1.0,
                                              description="--mem-fraction-static")


class PDLayout(BaseModel):
    """A prefill/decode disaggregated layout: a prefill group, a decode group, a PD router.

    Prefill servers run ``--disaggregation-mode prefill``, decode servers ``--disaggregation-mode
    decode``; the KV of each prompt moves from a prefill to a decode server over the config's
    ``disaggregation_transfer_backend``; sglang-router runs with ``--pd-disaggregation``
    (sglang-knobs reference 1.11 and 6.3). A study may write it ``"<n>P<m>D"`` (e.g. ``"1P1D"``:
    one prefill and one decode server with the config's layout).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    prefill: PDGroup = Field(default_factory=PDGroup)
    decode: PDGroup = Field(default_factory=PDGroup)

    @model_validator(mode="before")
    @classmethod
    def _short(cls, data: Any) -> Any:
        if isinstance(data, str):
            m = re.fullmatch(r"\s*(\d+)\s*[pP]\s*(\d+)\s*[dD]\s*", data)
            if m is None:
                raise ValueError(f"pd {data!r} is not a layout: write <n>P<m>D (e.g. 1P1D) or "
                                 "give prefill and decode groups")
            return {"prefill": {"workers": int(m.group(1))},
                    "decode": {"workers": int(m.group(2))}}
        return data

    def label(self) -> str:
        """``"1P1D"``-style name (group overrides not included)."""
        return f"{self.prefill.workers}P{self.decode.workers}D"


class ServingConfig(BaseModel):
    """One SGLang serving configuration for a pool of GPUs.

    The pool runs ``replicas`` independent servers of ``gpus_per_server`` GPUs each (``tp_size x
    pp_size x dp_size``; attention DP and expert parallelism split work inside the TP group),
    and load is spread over them by ``router_policy``; or, with ``pd``, a prefill and a decode
    group behind the router in PD mode (:meth:`servers`).

    Numbers and booleans are strict: ``true`` is not 1, ``"8"`` is not 8, ``8.0`` is not an
    integer and ``1`` is not true (a float field takes a whole number). Strings and ``Literal``
    choices are taken as given, JSON or Python.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    engine: Literal["sglang"] = "sglang"
    engine_version: EngineVersion = Field("0.5.23",
                                          description="SGLang release whose flags are emitted")
    model: str = Field(description="model catalog key, e.g. 'glm-5'")
    gpu: Annotated[str, AfterValidator(_gpu_name)] = Field(description=(
        "GPU catalog key, e.g. 'B200' (any case; stored as the catalog spells it)"))
    tp_size: int = Field(1, ge=1, le=512, description="--tp-size: GPUs per replica (a "
                         "multi-node server spans --nnodes nodes; a PD group as wide as its own)")
    replicas: int = Field(1, ge=1, le=512, description="independent servers behind the router")
    weights: str = Field(description="checkpoint key of the model, e.g. 'fp8' or 'nvfp4'")
    kv_cache_dtype: Literal["auto", "bf16", "fp8_e4m3"] = Field(
        "auto", description="--kv-cache-dtype")
    mem_fraction_static: float | None = Field(
        None, gt=0.0, lt=1.0, description="--mem-fraction-static: share of GPU memory for "
        "weights + KV pool; None = engine heuristic")
    max_running_requests: int | None = Field(
        None, ge=1, le=65536, description="--max-running-requests (per replica); None = engine "
        "default rule")
    chunked_prefill_size: int | None = Field(
        None, ge=-1, le=1 << 20, description="--chunked-prefill-size, tokens; None = by GPU memory")
    cuda_graph_max_bs_decode: int | None = Field(
        None, ge=1, le=4096, description="--cuda-graph-max-bs-decode; None = by GPU memory")
    attention_backend: str | None = Field(None, description="--attention-backend; None = auto")
    mm_attention_backend: str | None = Field(
        None, description="--mm-attention-backend: attention kernels of a multimodal model's "
        "vision/audio encoder; None = by platform (SGLang 0.5.23 "
        "layers/attention/vision.py _determine_attention_backend: fa3 on SM 9, fa4 on SM 10)")
    schedule_policy: Literal["fcfs", "lpm"] = Field("fcfs", description="--schedule-policy")
    schedule_conservativeness: float | None = Field(
        None, allow_inf_nan=False, description="--schedule-conservativeness: scales the "
        "admission's estimate of future decode tokens; None = engine default 1.0 (a negative "
        "value is refused by the engine at startup, not here)")
    router_policy: Literal["round_robin", "power_of_two", "cache_aware", "kube_service"] = Field(
        "round_robin", description="how the router (sglang-router 0.3.2 --policy) spreads "
        "requests over replicas; kube_service = no router, the Kubernetes Service (kube-proxy "
        "picks a random endpoint per new connection); not a server flag")
    router_cache_threshold: float = Field(
        0.3, ge=0.0, le=1.0, description="sglang-router --cache-threshold (cache_aware): "
        "matched prompt characters / prompt characters above which a request goes to the "
        "worker with the longest match (default 0.3, sglang-router 0.3.2 router_args.py)")
    router_balance_abs_threshold: int = Field(
        64, ge=0, le=1_000_000, description="sglang-router --balance-abs-threshold "
        "(cache_aware): the fleet is imbalanced when max - min in-flight requests exceeds it "
        "(and the rel test holds); then the least-loaded worker gets the request (default 64)")
    router_balance_rel_threshold: float = Field(
        1.5, ge=1.0, le=1000.0, description="sglang-router --balance-rel-threshold "
        "(cache_aware): imbalanced also needs max > rel x min in-flight requests (default 1.5)")
    # Speculative decoding (sglang-knobs reference 1.10 and 2.6). Combinations SGLang 0.5.23
    # rejects (a partial triple, ...) are accepted here and refused by the twin's startup with
    # the engine's own message, as the real server would.
    speculative_algorithm: Literal["EAGLE", "EAGLE3", "NEXTN"] | None = Field(
        None, description="--speculative-algorithm; NEXTN is SGLang's alias of EAGLE for the "
        "MTP/NextN head shipped in the checkpoint; None = off")
    speculative_num_steps: int | None = Field(
        None, ge=0, le=16, description="--speculative-num-steps: draft depth; None = engine "
        "default ((3, 1, 4) for GLM/DeepSeek-class models, with topk and draft tokens)")
    speculative_eagle_topk: int | None = Field(
        None, ge=1, le=16, description="--speculative-eagle-topk: branching per draft step")
    speculative_num_draft_tokens: int | None = Field(
        None, ge=1, le=256, description="--speculative-num-draft-tokens: tokens verified per "
        "step (forced to steps + 1 when topk is 1)")
    speculative_adaptive: bool = Field(
        False, description="--speculative-adaptive: pick the draft depth per batch-size bucket "
        "from an EMA of the accept length (EAGLE family, topk 1 only)")
    # Prefix cache / HiCache (sglang-knobs reference 1.5)
    disable_radix_cache: bool = Field(False, description="--disable-radix-cache")
    enable_hierarchical_cache: bool = Field(
        False, description="--enable-hierarchical-cache: host-memory (L2) tier behind the "
        "radix cache")
    hicache_ratio: float | None = Field(
        None, gt=0.0, le=100.0, allow_inf_nan=False, description="--hicache-ratio: host KV "
        "pool as a multiple of the device KV pool; None = engine default 2.0 (shrunk to fit the "
        "host memory)")
    # Knobs of issue 19 (SGLang 0.5.23 flags; arch rules: domain/engines/sglang/arch.py)
    context_length: int | None = Field(
        None, ge=2, le=1 << 24, description="--context-length: longest request (prompt + "
        "output), tokens; sizes the default max_running_requests; None = the model's "
        "max_position_embeddings (a longer value is refused, configs/model_config.py:1314)")
    page_size: int | None = Field(
        None, ge=1, le=4096, description="--page-size: KV pool granularity and prefix-cache "
        "match unit, tokens; None = 1, or the size the attention backend forces")
    disable_cuda_graph: bool = Field(
        False, description="--disable-cuda-graph (deprecated in 0.5.23 for "
        "--cuda-graph-backend-{decode,prefill}=disabled, still accepted): no CUDA-graph "
        "memory, every decode step runs eagerly")
    moe_runner_backend: str | None = Field(
        None, description="--moe-runner-backend: MoE expert kernels; None = auto (by "
        "architecture and quantization: flashinfer_trtllm for the DeepSeek family on SM 10, "
        "flashinfer_cutlass for NVFP4 on SM 12)")
    fp4_gemm_runner_backend: str | None = Field(
        None, description="--fp4-gemm-backend: FP4 GEMM kernels; passed through, not modelled")
    num_continuous_decode_steps: int | None = Field(
        None, ge=1, le=1024, description="--num-continuous-decode-steps; passed through, not "
        "modelled")
    enable_two_batch_overlap: bool = Field(
        False, description="--enable-two-batch-overlap: split a batch into two micro-batches "
        "so one's all-to-all/all-reduce overlaps the other's compute")
    enable_single_batch_overlap: bool = Field(
        False, description="--enable-single-batch-overlap; passed through, not modelled")
    # Parallel layouts (issue 21; SGLang 0.5.23 flags, sglang-knobs reference 1.1, 1.9, 1.11).
    # The engine's rules for them (divisibility, what requires what) are refused pre-flight
    # with the engine's words (domain/engines/sglang/startup.py), not here.
    attn_dp_size: int = Field(
        1, ge=1, le=512, description="--attn-dp-size: attention data-parallel ranks inside the "
        "TP group (each its own scheduler, KV pool and share of max_running_requests; the "
        "MoE/MLP stays tensor/expert parallel over all tp_size GPUs); emitted as --dp-size N "
        "--enable-dp-attention for SGLang before 0.5.23")
    dp_size: int = Field(
        1, ge=1, le=64, description="--dp-size: full data-parallel copies inside one server, "
        "each tp_size x pp_size GPUs with its own scheduler (spread by --load-balance-method)")
    ep_size: int = Field(
        1, ge=1, le=512, description="--ep-size: expert-parallel width of the MoE layers "
        "(experts sharded over ep_size GPUs; moe TP = tp_size / ep_size)")
    moe_a2a_backend: str | None = Field(
        None, description="--moe-a2a-backend: all-to-all token dispatch of expert parallelism "
        "(deepep, mooncake, ...); None = 'none' (all-gather/all-reduce MoE)")
    deepep_mode: Literal["auto", "normal", "low_latency"] | None = Field(
        None, description="--deepep-mode: DeepEP dispatch kernels (normal for prefill, "
        "low_latency for decode; auto picks per batch); None = auto")
    moe_dense_tp_size: int | None = Field(
        None, ge=1, le=512, description="--moe-dense-tp-size: TP width of the dense MLP "
        "layers (1 or tp_size); None = tp_size")
    enable_eplb: bool = Field(
        False, description="--enable-eplb: rebalance expert placement from routing statistics")
    ep_num_redundant_experts: int = Field(
        0, ge=0, le=4096, description="--ep-num-redundant-experts: extra expert replicas "
        "for EPLB")
    pp_size: int = Field(
        1, ge=1, le=64, description="--pp-size: pipeline stages (layers split over them)")
    enable_dp_lm_head: bool = Field(
        False, description="--enable-dp-lm-head: vocab-parallel lm_head inside each attention "
        "DP group (skips the all-gather over the whole TP group)")
    disaggregation_mode: Literal["null", "prefill", "decode"] = Field(
        "null", description="--disaggregation-mode of one server: null (colocated), prefill "
        "or decode (set on the workers of ``pd``, not by a study)")
    disaggregation_transfer_backend: str | None = Field(
        None, description="--disaggregation-transfer-backend: KV transfer between PD servers "
        "(mooncake, nixl, ...); None = mooncake")
    pd: PDLayout | None = Field(
        None, description="prefill/decode disaggregation: the prefill and decode worker groups "
        "(None = aggregated: every server prefills and decodes)")
    load_balance_method: Literal["auto", "round_robin", "total_requests", "total_tokens",
                                 "follow_bootstrap_room"] | None = Field(
        None, description="--load-balance-method: how the DP controller spreads a server's "
        "requests over its schedulers (dp_size x attn_dp_size); None = auto (round_robin, "
        "follow_bootstrap_room on a PD prefill server)")

    @model_validator(mode="after")
    def _chunk(self) -> ServingConfig:
        if self.chunked_prefill_size == 0:
            raise ValueError("chunked_prefill_size 0 is not a size: give -1 (no chunking) or a "
                             "positive token count")
        return self

    @model_validator(mode="after")
    def _catalogs(self) -> ServingConfig:
        from domain.hardware import GPUS
        from domain.models import MODELS, get_model

        if self.gpu not in GPUS:
            raise ValueError(f"gpu {self.gpu!r} is not in the GPU catalog: {', '.join(GPUS)}")
        if self.model not in MODELS:
            raise ValueError(f"model {self.model!r} is not in the model catalog: "
                             f"{', '.join(MODELS)}")
        known = get_model(self.model).checkpoints
        if self.weights not in known:
            raise ValueError(f"weights {self.weights!r}: model {self.model} has the checkpoints "
                             f"{', '.join(known)}")
        return self

    @model_validator(mode="after")
    def _flags_of_version(self) -> ServingConfig:
        """Refuse a set field whose flag ``engine_version`` lacks.

        One line naming the releases that have it, or its successor when the flag was removed
        (:meth:`domain.engines.Engine.missing_flag`).
        """
        from domain.engines import engine_for

        global _FLAG_DEFAULTS
        if _FLAG_DEFAULTS is None:
            _FLAG_DEFAULTS = tuple((n, f.default) for n, f in ServingConfig.model_fields.items()
                                   if n not in _NOT_FLAGS)
        eng = engine_for(self)
        for name, default in _FLAG_DEFAULTS:
            if getattr(self, name) == default:
                continue
            line = eng.missing_flag(name)
            if line is not None:
                raise ValueError(line)
        return self

    @model_validator(mode="after")
    def _choices(self) -> ServingConfig:
        for name in CHOICE_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            from domain.engines import engine_for

            eng = engine_for(self)
            if name not in eng.flag_inventory():
                continue  # _flags_of_version names it
            choices = eng.flag_inventory()[name]["choices"] or []
            if value not in choices:
                raise ValueError(f"{name} {value!r} is not a choice of {eng.label} "
                                 f"{self.engine_version}: {', '.join(choices)}")
        return self

    @model_validator(mode="after")
    def _pd_shape(self) -> ServingConfig:
        if self.pd is not None and self.replicas != 1:
            raise ValueError("a PD layout (pd) sets its own worker counts: give replicas 1 "
                             "(prefill.workers and decode.workers are the servers)")
        if self.pd is not None and self.disaggregation_mode != "null":
            raise ValueError("pd and disaggregation_mode are exclusive: pd describes the whole "
                             "layout, disaggregation_mode one of its servers")
        return self

    @property
    def attn_tp_size(self) -> int:
        """GPUs of one attention TP group: ``tp_size // attn_dp_size``.

        SGLang 0.5.23 ``layers/dp_attention.py compute_dp_attention_world_info``.
        """
        return max(1, self.tp_size // self.attn_dp_size)

    @property
    def moe_tp_size(self) -> int:
        """TP width of each expert: ``tp_size // ep_size`` (SGLang ``moe_tp_size``)."""
        return max(1, self.tp_size // self.ep_size)

    @property
    def gpus_per_server(self) -> int:
        """GPUs of one server: ``tp_size x pp_size x dp_size`` (attention DP lives inside TP)."""
        return self.tp_size * self.pp_size * self.dp_size

    @property
    def schedulers(self) -> int:
        """Schedulers in one server (each its own queue, KV pool and cap): dp x attn_dp."""
        return self.dp_size * self.attn_dp_size

    def nnodes(self, gpus_per_node: int) -> int:
        """Nodes one server spans (``--nnodes``): ``ceil(gpus_per_server / gpus_per_node)``."""
        return max(1, math.ceil(self.gpus_per_server / max(1, gpus_per_node)))

    def pd_worker(self, role: Literal["prefill", "decode"]) -> ServingConfig:
        """The config of one ``role`` server of this PD layout.

        The group's fields (``PD_GROUP_FIELDS``) replace the config's, ``pd`` is cleared,
        ``replicas`` is 1 and ``disaggregation_mode`` is ``role``.

        Raises:
            ValueError: the config has no PD layout, or the worker's fields are invalid.
        """
        if self.pd is None:
            raise ValueError("not a PD layout: pd is None")
        group = self.pd.prefill if role == "prefill" else self.pd.decode
        data = self.model_dump()
        data.update(pd=None, replicas=1, disaggregation_mode=role)
        for name in PD_GROUP_FIELDS:
            value = getattr(group, name)
            if value is not None:
                data[name] = value
        return ServingConfig.model_validate(data)

    def servers(self) -> list[tuple[str, int, ServingConfig]]:
        """``(role, count, server config)`` for every server group of this config.

        Aggregated: ``[("server", replicas, self)]``; PD: the prefill and the decode group
        (:meth:`pd_worker`), in that order.
        """
        if self.pd is None:
            return [("server", self.replicas, self)]
        return [("prefill", self.pd.prefill.workers, self.pd_worker("prefill")),
                ("decode", self.pd.decode.workers, self.pd_worker("decode"))]

    @property
    def gpus(self) -> int:
        """GPUs the whole config uses: every server's ``gpus_per_server`` x its count.

        Aggregated: ``tp_size x pp_size x dp_size x replicas``.
        """
        return sum(n * c.gpus_per_server for _, n, c in self.servers())

    def config_id(self) -> str:
        """Stable 12-hex-digit id of this config (sha256 of its canonical JSON).

        Fields added in twin v1 (``V1_FIELDS``), by issue 19 (``V19_FIELDS``), the router
        knobs (``ROUTER_FIELDS``) and the parallel layouts (``LAYOUT_FIELDS``) enter the JSON
        only when set, so every config that leaves them at their default keeps the id it had
        before (ledgers stay resumable).
        """
        data = self.model_dump(mode="json")
        for name in (*V1_FIELDS, *V19_FIELDS, *ROUTER_FIELDS, *LAYOUT_FIELDS):
            if data[name] == ServingConfig.model_fields[name].default:
                del data[name]
        blob = json.dumps(data, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def set_fields(self) -> dict[str, Any]:
        """The knob fields that differ from their unset/default value (for 'fewer flags' ties)."""
        defaults = ServingConfig(model=self.model, gpu=self.gpu, weights=self.weights)
        skip = {"model", "gpu", "weights", "tp_size", "replicas", "engine", "engine_version"}
        return {k: v for k, v in self.model_dump().items()
                if k not in skip and v != getattr(defaults, k)}

    def launch_command(self) -> str:
        """One replica's command line (:meth:`domain.engines.Engine.argv`), shell-quoted."""
        from domain.engines import engine_for

        return shlex.join(engine_for(self).argv(self))


    def router_args(self, worker_urls: list[str]) -> list[str] | None:
        """The sglang-router 0.3.2 arguments for this config's router, or None without one.

        ``python -m sglang_router.launch_router`` takes ``--worker-urls``, ``--policy`` and, for
        ``cache_aware``, ``--cache-threshold``, ``--balance-abs-threshold`` and
        ``--balance-rel-threshold`` (sglang-knobs reference 6.3; ``launch_router --help`` of
        the 0.3.2 wheel). None for ``kube_service``: no router runs, the Kubernetes Service
        spreads connections itself.

        Args:
            worker_urls: the replicas' base URLs, in order.
        """
        if self.router_policy == "kube_service":
            return None
        args = ["--worker-urls", *worker_urls, "--policy", self.router_policy]
        if self.router_policy == "cache_aware":
            args += ["--cache-threshold", f"{self.router_cache_threshold:g}",
                     "--balance-abs-threshold", str(self.router_balance_abs_threshold),
                     "--balance-rel-threshold", f"{self.router_balance_rel_threshold:g}"]
        return args

    def pd_router_args(self, prefill_urls: list[str], decode_urls: list[str],
                       bootstrap_port: int = 8998) -> list[str]:
        """The sglang-router 0.3.2 arguments of a PD layout's router.

        ``--pd-disaggregation``, then ``--prefill URL BOOTSTRAP_PORT`` per prefill server (the
        port of its ``--disaggregation-bootstrap-port``, default 8998) and ``--decode URL`` per
        decode server, then the routing policy as :meth:`router_args` gives it (one policy for
        both pools; the router's own default is ``cache_aware``, which in PD mode picks prefill
        servers cache-aware and decode servers by load). ``kube_service`` passes no
        ``--policy``: a PD layout always needs the router (it pairs each request's prefill and
        decode server), so the router's default applies. Sources: sglang-knobs reference 6.1
        and 6.3; ``sglang_router/router_args.py`` of the 0.3.2 wheel (``--prefill`` takes
        ``URL [BOOTSTRAP_PORT|none]``, ``--decode`` takes ``URL``; ``--policy`` choices
        random, round_robin, cache_aware, power_of_two, manual).

        Args:
            prefill_urls: the prefill servers' base URLs, in order.
            decode_urls: the decode servers' base URLs, in order.
            bootstrap_port: the prefill servers' KV bootstrap port.

        Raises:
            ValueError: an empty group, or a port outside 1..65535.
        """
        if not prefill_urls or not decode_urls:
            raise ValueError("a PD router needs at least one prefill and one decode URL")
        if not 1 <= bootstrap_port <= 65535:
            raise ValueError(f"bootstrap port {bootstrap_port} is outside 1..65535")
        args = ["--pd-disaggregation"]
        for url in prefill_urls:
            args += ["--prefill", url, str(bootstrap_port)]
        for url in decode_urls:
            args += ["--decode", url]
        routing = self.router_args([])
        if routing is not None:
            args += routing[1:]  # drop "--worker-urls"
        return args
