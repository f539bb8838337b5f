"""The study spec: what to tune, on which workloads, toward which objective, under which SLO.

Parsing YAML happens at the edge (``servetune/``); this module validates the parsed mapping and
resolves every knob value against the catalog, so a bad study fails before anything runs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from domain.config import EngineVersion, ServingConfig
from domain.errors import ConfigInvalid
from domain.faults import FaultSpec
from domain.knobs import COUPLED_KNOBS, KNOBS, apply_knob, apply_knobs

# Combinations of the other layout knobs tried before a coupled knob value is refused
# (Study._coupled_somewhere); a study's layout knobs have a few values each.
COUPLED_TRIES = 4096


class SaturationSpec(BaseModel):
    """Synthetic closed-loop saturation run: fixed ISL/OSL at a fixed concurrency."""

    model_config = ConfigDict(extra="forbid", strict=True)

    isl: int = Field(ge=1, le=1_000_000, description="input tokens per request")
    osl: int = Field(ge=1, le=100_000, description="output tokens per request")
    concurrency: int = Field(ge=1, le=100_000, description="clients in flight (whole pool)")
    duration_s: float = Field(gt=0, le=3600, description="virtual seconds new requests start")


class ReplaySpec(BaseModel):
    """Timestamp-faithful replay of a real trace window."""

    model_config = ConfigDict(extra="forbid", strict=True)

    trace: str = Field(min_length=1, max_length=4096,
                       description="trace file path, relative to the study file or the repo")
    format: Literal["auto", "mooncake", "azure", "bailian"] = "auto"
    start_s: float = Field(0.0, ge=0, description="window start in trace time, s")
    duration_s: float = Field(gt=0, le=86_400, description="window length in trace time, s")
    time_scale: float = Field(1.0, gt=0, le=1000,
                              description="arrival speed-up: 2.0 replays twice as fast")


class SLO(BaseModel):
    """Latency targets checked on the trace replay."""

    model_config = ConfigDict(extra="forbid", strict=True)

    ttft_p99_ms: float = Field(gt=0, description="TTFT p99 target on the replay, ms")

    def met(self, ttft_p99_ms: float | None, errors: int) -> bool:
        """Whether a replay met the SLO: TTFT p99 within the target and every request served.

        The one statement of the SLO rule (the supervisor's validation, the admission retune
        and the report all ask it).

        Args:
            ttft_p99_ms: the replay's TTFT p99, ms (None: no request produced a first token).
            errors: requests of the replay that failed.
        """
        return ttft_p99_ms is not None and ttft_p99_ms <= self.ttft_p99_ms and errors == 0


class Budget(BaseModel):
    """When the search stops."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_trials: int = Field(ge=1, le=10_000, description="launched trials (pruned ones are free)")
    patience: int = Field(ge=1, le=10_000,
                          description="stop after this many launched trials without improvement")
    max_wall_s: float | None = Field(None, gt=0, description=(
        "stop the search once its trials and research took this many wall seconds"))
    max_gpu_hours: float | None = Field(None, gt=0, description=(
        "stop the search once its benchmarks used this many GPU-hours (GPUs x benchmark "
        "seconds; virtual seconds on the twin)"))
    max_llm_tokens: int | None = Field(None, ge=1, description=(
        "stop the search once Claude agents (research, planner, deployer, analyst) used this many "
        "LLM tokens (input, output, cache reads and writes)"))
    max_research_questions: int | None = Field(None, ge=0, description=(
        "research questions per run; once asked, candidates launch without research"))


class SearchSpec(BaseModel):
    """Which planner brain proposes candidates.

    Lessons and the memory-fit estimate prune every brain's candidates before launch.
    """

    model_config = ConfigDict(extra="forbid", strict=True)
    brain: Literal["ovat", "guided", "tpe", "grid"] = Field(
        "ovat", description="ovat: one knob at a time from the current best; guided: every "
        "combination ranked by the steady-state estimate (domain/estimate.py: throughput and "
        "replay TTFT against the SLO), corrected by what the run measured; tpe: Optuna's TPE "
        "sampler (constrained by pruning); grid: every combination of the knob values in a "
        "seeded order")
    seed: int = Field(0, ge=0, le=2**31, description="seed of the tpe and grid brains (and "
                      "of the guided brain's sample of a space over 65,536 points)")


class AcceptanceSpec(BaseModel):
    """Noise-gated acceptance: a candidate replaces the best only if its gain exceeds the noise."""

    model_config = ConfigDict(extra="forbid", strict=True)
    repeats: int | None = Field(None, ge=1, le=20, description=(
        "saturation runs per launched candidate (and of the incumbent); None: the settings' "
        "SERVETUNE_REPEATS (default 1)"))
    confidence: float = Field(0.95, gt=0.5, lt=1, description=(
        "level of the bootstrap confidence interval on the relative gain"))
    twin_noise_pct: float = Field(0.0, ge=0, le=50, description=(
        "twin only: run-to-run noise injected into each benchmark, in percent (the standard "
        "deviation of a per-run multiplicative factor on step times), to test the gate"))


class ValidationSpec(BaseModel):
    """The validate phase beyond the replay of the finalists."""

    model_config = ConfigDict(extra="forbid", strict=True)
    tune_admission: bool = Field(True, description=(
        "when the replay shows over-admission (throughput flat while TTFT and queue keep "
        "rising), retune max_running_requests (and hicache_ratio where prefixes repeat) under "
        "the trace"))
    quality_min_token_match: float = Field(0.98, gt=0, le=1, description=(
        "quality gate on real endpoints: greedy outputs of a numerics-changing winner must "
        "match the reference config's on at least this share of tokens"))


class Study(BaseModel):
    """A whole study as written in ``studies/*.yaml``.

    Numbers and booleans are strict in every block and knob value (``true`` is not 1,
    ``"8"`` is not 8, ``8.0`` is not an integer); a float field takes a whole number.
    ``model`` and ``gpu`` hold names: a model or GPU the file gives by source (a config.json,
    an inline GPU spec; :mod:`domain.study_sources`) is registered under its name by
    :func:`parse_study`, which keeps what it built in ``sources`` for the digest.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    description: str = ""
    model: str = Field(description="catalog key or the registered name of the study's model")
    gpu: str = Field(description="catalog name or the registered name of the study's GPU")
    gpu_count: int = Field(ge=1, le=4096)
    engine: Literal["sglang"] = "sglang"
    engine_version: EngineVersion = "0.5.23"
    baseline: dict[str, Any] = Field(description="knob -> value of the starting config")
    knobs: dict[str, list[Any]] = Field(description="knob -> values searched")
    saturation: SaturationSpec
    replay: ReplaySpec
    objective: Literal["output_tok_s_per_gpu"] = "output_tok_s_per_gpu"
    min_improvement: float = Field(0.01, ge=0, le=1,
                                   description="relative gain a change must bring to be kept")
    drop_regressions: float = Field(
        0.5, gt=0, le=1, description="a knob value whose launch cost more than this share of "
        "the incumbent's tok/s/GPU is not retried from later incumbents")
    slo: SLO
    finalists: int = Field(3, ge=1, le=50, description="best configs replayed on the trace")
    sweep_concurrency: list[Annotated[int, Field(ge=1, le=100_000)]] = Field(
        default_factory=lambda: [8, 32, 128, 512], min_length=1, max_length=32,
        description="concurrencies of the frontier sweep")
    budget: Budget
    search: SearchSpec = Field(default_factory=SearchSpec)
    acceptance: AcceptanceSpec = Field(default_factory=AcceptanceSpec)
    validation: ValidationSpec = Field(default_factory=ValidationSpec)
    faults: FaultSpec = Field(default_factory=FaultSpec, description=(
        "twin only: shares of launches, benchmarks and lesson-store calls that fail on "
        "purpose (domain/faults.py); default none"))
    # what the file gave by source: "model" -> ModelArch, "gpu" -> GPU (parse_study sets it)
    _sources: dict[str, Any] = PrivateAttr(default_factory=dict)

    @property
    def sources(self) -> dict[str, Any]:
        """``{"model": ModelArch, "gpu": GPU}`` for what the file gave by source (else {})."""
        return self._sources

    @model_validator(mode="after")
    def _check(self) -> Study:
        problems = []
        for name, values in self.knobs.items():
            if name not in KNOBS:
                problems.append(f"knobs.{name}: unknown knob; known: {', '.join(KNOBS)}")
            elif not values:
                problems.append(f"knobs.{name}: give at least one value")
        for name in self.baseline:
            if name not in KNOBS:
                problems.append(f"baseline.{name}: unknown knob; known: {', '.join(KNOBS)}")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def digest(self) -> str:
        """sha256 (16 hex) of the canonical study, to refuse reusing a run id for another."""
        data = self.model_dump(mode="json")
        if not self.faults.active:  # studies without faults keep the digest they had
            data.pop("faults")
        for key, built in sorted(self._sources.items()):  # a changed config.json or GPU spec
            # is another study; string-form studies keep their digest (nothing added)
            data[f"{key}_source"] = built.model_dump(mode="json", exclude={"source"})
        blob = json.dumps(data, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def realtime_s(self, startup_s: float, repeats: int = 1) -> float:
        """Wall seconds this study takes at most on servers running in real time.

        The budget's phases: every search launch (``budget.max_trials``, each ``startup_s``
        plus ``repeats`` saturation runs), each finalist's replay (its trace window at
        ``time_scale``), the quality reference's launch, and the frontier sweep of the
        finalists and the winner's speculative variant (a saturation run per concurrency).
        Saturation drains and admission retunes come on top; an early stop (patience) saves
        launches.

        Args:
            startup_s: seconds from deploy to Ready of one server.
            repeats: saturation runs per search launch when ``acceptance.repeats`` is unset.
        """
        sat = self.saturation.duration_s
        reps = self.acceptance.repeats or repeats
        search = self.budget.max_trials * (startup_s + reps * sat)
        replay = self.finalists * (startup_s + self.replay.duration_s / self.replay.time_scale)
        frontier = (self.finalists + 1) * (startup_s + len(self.sweep_concurrency) * sat)
        return search + replay + startup_s + frontier

    def base_config(self) -> ServingConfig:
        """The baseline ServingConfig.

        Raises:
            ConfigInvalid: a baseline value outside its knob's domain.
        """
        for key, what in (("weights", "a checkpoint key of the model, e.g. fp8 or nvfp4"),
                          ("tp_size", "GPUs per replica, e.g. 8")):
            if key not in self.baseline:
                raise ConfigInvalid([f"baseline.{key}: required ({what})"])
        try:
            cfg = ServingConfig(model=self.model, gpu=self.gpu,
                                weights=str(self.baseline["weights"]),
                                engine_version=self.engine_version, tp_size=1,
                                replicas=self.gpu_count)
        except ValidationError as e:
            raise ConfigInvalid([
                f"{'.'.join(map(str, err['loc'])) or 'study'}: "
                f"{err['msg'].removeprefix('Value error, ')}" for err in e.errors()]) from e
        # all at once: the coupled layout knobs hold in any order (domain.knobs.apply_knobs)
        return apply_knobs(cfg, {name.replace("baseline.", ""): value
                                 for name, value in self.baseline.items()}, self.gpu_count)

    def _coupled_somewhere(self, base: ServingConfig, name: str,
                           value: Any) -> ServingConfig | None:
        """A config of the space where knob ``name`` takes ``value``, or None.

        A value coupled to the layout (``attn_dp_size 8`` under a ``tp_size 4`` baseline,
        ``pd 1P1D`` where the baseline's servers fill the pool, ``enable_eplb`` under an
        ``ep_size 1`` baseline) may be refused on the baseline alone and valid with another
        value of the study's layout knobs (:data:`domain.knobs.COUPLED_KNOBS`); the first
        :data:`COUPLED_TRIES` combinations are tried.
        """
        others = [n for n in self.knobs if n in COUPLED_KNOBS and n != name]
        combos = itertools.product(*(self.knobs[n] for n in others))
        for combo in itertools.islice(combos, COUPLED_TRIES):
            try:
                return apply_knobs(base, {**dict(zip(others, combo, strict=True)),
                                          name: value}, self.gpu_count)
            except ConfigInvalid:
                continue
        return None

    def validate_space(self) -> None:
        """Check every knob value against the catalog and the model (weights keys, choices).

        Raises:
            ConfigInvalid: listing every bad value with the knob it belongs to.
        """
        from domain.hardware import get_gpu
        from domain.models import get_model

        problems: list[str] = []
        get_gpu(self.gpu)
        model = get_model(self.model)
        s = self.saturation
        if s.isl + s.osl > model.context_len:
            raise ConfigInvalid([f"saturation: isl {s.isl} + osl {s.osl} exceeds the context "
                                 f"length of {self.model} ({model.context_len:,} tokens)"])
        try:
            base = self.base_config()
            get_model(self.model).checkpoint(base.weights)
        except ConfigInvalid as e:
            raise ConfigInvalid([v if v.startswith("baseline") else f"baseline: {v}"
                                 for v in e.violations]) from e
        need = s.isl + s.osl
        if base.context_length is not None and need > base.context_length:
            problems.append(f"baseline.context_length: {base.context_length} is shorter than "
                            f"the saturation's isl {s.isl} + osl {s.osl}")
        for name, values in self.knobs.items():
            for v in values:
                try:
                    cfg = apply_knob(base, name, v, self.gpu_count)
                    get_model(self.model).checkpoint(cfg.weights)
                except ConfigInvalid as e:
                    if self._coupled_somewhere(base, name, v) is None:
                        problems += e.violations
                    continue
                if name == "context_length" and cfg.context_length is not None \
                        and need > cfg.context_length:
                    problems.append(f"knobs.context_length: {v!r} is shorter than the "
                                    f"saturation's isl {s.isl} + osl {s.osl}: every request "
                                    "would be refused")
        if problems:
            raise ConfigInvalid(problems)


def _loc_part(part: int | str) -> str:
    """One step of a field path; a key that is blank or holds separators is quoted."""
    text = str(part)
    return text if re.fullmatch(r"[\w-]+", text) else repr(text)


def parse_study(data: Any, *, base_dir: Path | None = None,
                gpu_source: str = "") -> Study:
    """Validate a parsed study mapping.

    A ``model`` or ``gpu`` given by source (:mod:`domain.study_sources`) is built and
    registered first, and the study holds its name.

    Args:
        data: the parsed YAML.
        base_dir: the study file's folder, where relative model paths start (None: the
            working folder).
        gpu_source: the ``source`` a GPU spec is recorded with (default: ``INLINE_GPU``, a
            mapping written in the study).

    Raises:
        ConfigInvalid: one line per problem, each naming the field path.
    """
    from domain.study_sources import INLINE_GPU, resolve_gpu, resolve_model

    if not isinstance(data, dict):
        raise ConfigInvalid(["study: expected a mapping at the top level"])
    sources: dict[str, Any] = {}
    arch = resolve_model(data["model"], base_dir) if "model" in data else None
    gpu = resolve_gpu(data["gpu"], gpu_source or INLINE_GPU) if "gpu" in data else None
    if arch is not None:
        sources["model"], data = arch, {**data, "model": arch.name}
    if gpu is not None:
        sources["gpu"], data = gpu, {**data, "gpu": gpu.name}
    try:
        study = Study.model_validate(data)
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            loc = ".".join(_loc_part(x) for x in err["loc"]) or "study"
            msg = err["msg"].removeprefix("Value error, ")
            value = err.get("input")
            if err["type"] in ("int_type", "float_type", "bool_type") \
                    and isinstance(value, bool | int | float | str) and len(repr(value)) <= 40:
                msg += f", not {value!r}"  # strict types: say what was written (true, "8")
            msgs.append(f"{loc}: {msg}")
        raise ConfigInvalid(msgs) from e
    study._sources = sources
    study.validate_space()
    return study
