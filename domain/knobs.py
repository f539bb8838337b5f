"""The tunable knob catalog: which ServingConfig field a knob sets, its flag, and its domain.

A study names knobs by these names and lists values; ``"unset"`` (or YAML ``null``) means the
flag is not passed and SGLang's default rule applies. Values are validated through
ServingConfig itself, so the catalog and the schema of record cannot disagree.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from domain.config import ServingConfig, flag_for
from domain.errors import ConfigInvalid


class Knob(BaseModel):
    """One tunable knob."""

    model_config = ConfigDict(frozen=True)

    name: str
    flag: str | None  # None for knobs that are not one engine flag (weights, replicas layout)
    description: str
    unsettable: bool = True  # may take "unset" (engine default)


def _k(name: str, description: str, dest: str | None = None, unsettable: bool = True) -> Knob:
    return Knob(name=name, flag=flag_for(dest, "0.5.23") if dest else None,
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
    _k("schedule_policy", "waiting-queue order (fcfs, lpm)", "schedule_policy", False),
)}


def normalize_value(value: Any) -> Any:
    """Map the study spelling of "leave unset" (``"unset"``, ``None``) to None."""
    return None if value is None or (isinstance(value, str) and value.lower() == "unset") \
        else value


def apply_knob(config: ServingConfig, name: str, value: Any, gpu_count: int) -> ServingConfig:
    """Return ``config`` with knob ``name`` set to ``value``.

    Setting ``tp_size`` also sets ``replicas = gpu_count // tp_size``.

    Raises:
        ConfigInvalid: unknown knob, a value outside the knob's domain (the message names the
            knob and the reason), or a tp_size that does not divide ``gpu_count``.
    """
    if name not in KNOBS:
        raise ConfigInvalid([f"knobs.{name}: unknown knob; known: {', '.join(KNOBS)}"])
    v = normalize_value(value)
    if v is None and not KNOBS[name].unsettable:
        raise ConfigInvalid([f"knobs.{name}: cannot be 'unset'; give a value"])
    update: dict[str, Any] = {name: v}
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
