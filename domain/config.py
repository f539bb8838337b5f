"""ServingConfig: the schema of record for one serving configuration, and its SGLang command line.

The same model is the MCP tool input of the cluster server, the planner's output and the ledger
row, so they cannot drift. ``None`` means "unset": the flag is not passed and the engine's own
default rule decides (see ``domain/fit.py`` for those rules).
"""

from __future__ import annotations

import hashlib
import json
import shlex
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from domain.errors import UnknownFlag

DATA_DIR = Path(__file__).resolve().parent / "data"
SUPPORTED_VERSIONS = ("0.5.23",)


def check_engine_version(v: str) -> str:
    """Accept only SGLang versions whose flag inventory ships here.

    Raises:
        ValueError: naming the supported versions.
    """
    if v not in SUPPORTED_VERSIONS:
        raise ValueError(f"SGLang {v} has no flag inventory here; supported: "
                         f"{', '.join(SUPPORTED_VERSIONS)}")
    return v


EngineVersion = Annotated[str, AfterValidator(check_engine_version)]


class ServingConfig(BaseModel):
    """One SGLang serving configuration for a pool of GPUs.

    The pool runs ``replicas`` independent servers of ``tp_size`` GPUs each, and load is spread
    over them by ``router_policy``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: Literal["sglang"] = "sglang"
    engine_version: EngineVersion = Field("0.5.23",
                                          description="SGLang release whose flags are emitted")
    model: str = Field(description="model catalog key, e.g. 'glm-5'")
    gpu: str = Field(description="GPU catalog key, e.g. 'B200'")
    tp_size: int = Field(1, ge=1, le=64, description="--tp-size: GPUs per replica")
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
    schedule_policy: Literal["fcfs", "lpm"] = Field("fcfs", description="--schedule-policy")
    router_policy: Literal["round_robin"] = Field(
        "round_robin", description="how requests are spread over replicas")

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
    def _choices(self) -> ServingConfig:
        if self.attention_backend is not None:
            inv = flag_inventory(self.engine_version)
            choices = inv["attention_backend"]["choices"] or []
            if self.attention_backend not in choices:
                raise ValueError(f"attention_backend {self.attention_backend!r} is not a choice "
                                 f"of SGLang {self.engine_version}: {', '.join(choices)}")
        return self

    @property
    def gpus(self) -> int:
        """GPUs the whole config uses (tp_size x replicas)."""
        return self.tp_size * self.replicas

    def config_id(self) -> str:
        """Stable 12-hex-digit id of this config (sha256 of its canonical JSON)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def set_fields(self) -> dict[str, Any]:
        """The knob fields that differ from their unset/default value (for 'fewer flags' ties)."""
        defaults = ServingConfig(model=self.model, gpu=self.gpu, weights=self.weights)
        skip = {"model", "gpu", "weights", "tp_size", "replicas", "engine", "engine_version"}
        return {k: v for k, v in self.model_dump().items()
                if k not in skip and v != getattr(defaults, k)}

    def to_sglang_args(self, version: str | None = None) -> list[str]:
        """The argv of ``sglang serve`` for ONE replica, with exact flag names of ``version``.

        Args:
            version: SGLang release; defaults to ``engine_version``.

        Returns:
            e.g. ``['sglang', 'serve', '--model-path', 'zai-org/GLM-5-FP8', '--tp-size', '8']``.

        Raises:
            UnknownFlag: if a flag or choice is not in that version's inventory (argparse would
                exit with code 2).
        """
        from domain.models import get_model  # local: models imports nothing from here

        version = version or self.engine_version
        ckpt = get_model(self.model).checkpoint(self.weights)
        pairs: list[tuple[str, Any]] = [("model_path", ckpt.model_path), ("tp_size", self.tp_size)]
        if ckpt.quantization:
            pairs.append(("quantization", ckpt.quantization))
        if self.kv_cache_dtype != "auto":
            pairs.append(("kv_cache_dtype", self.kv_cache_dtype))
        for name in ("mem_fraction_static", "max_running_requests", "chunked_prefill_size",
                     "cuda_graph_max_bs_decode", "attention_backend"):
            value = getattr(self, name)
            if value is not None:
                pairs.append((name, value))
        if self.schedule_policy != "fcfs":
            pairs.append(("schedule_policy", self.schedule_policy))
        argv = ["sglang", "serve"]
        for dest, value in pairs:
            argv += [flag_for(dest, version, value), str(value)]
        return argv

    def launch_command(self) -> str:
        """``to_sglang_args()`` as one shell-quoted line."""
        return shlex.join(self.to_sglang_args())


@cache
def flag_inventory(version: str) -> dict[str, dict[str, Any]]:
    """The CLI flags of SGLang ``version`` keyed by argparse dest.

    Source: ``domain/data/sglang-<version>-flags.json``, dumped from the real
    ``ServerArgs.add_cli_args`` parser of the PyPI wheel (servetune's shared reference).

    Raises:
        UnknownFlag: if no inventory ships for that version.
    """
    path = DATA_DIR / f"sglang-{version}-flags.json"
    if not path.is_file():
        raise UnknownFlag([f"engine_version: no flag inventory for SGLang {version}; supported: "
                           f"{', '.join(SUPPORTED_VERSIONS)}"])
    return {f["dest"]: f for f in json.loads(path.read_text())["flags"]}


def flag_for(dest: str, version: str, value: Any = None) -> str:
    """The canonical (first, long) flag of ``dest`` in ``version``; checks ``value`` on choices.

    Raises:
        UnknownFlag: unknown dest, or a value outside the flag's choices.
    """
    inv = flag_inventory(version)
    if dest not in inv:
        raise UnknownFlag([f"{dest}: SGLang {version} has no such flag"])
    entry = inv[dest]
    choices = entry.get("choices")
    if choices and value is not None and str(value) not in [str(c) for c in choices]:
        raise UnknownFlag([f"{entry['flags'][0]}: invalid choice {value!r} for SGLang {version} "
                           f"(choose from {', '.join(map(str, choices))})"])
    return str(entry["flags"][0])
