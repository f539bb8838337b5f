"""The serving engine seam: what servetune knows about one engine, behind one interface.

Every engine-specific rule -- the flag inventory of each version, the argv of a
:class:`~domain.config.ServingConfig`, the settings the engine resolves from its defaults, the
startup log (phases and failure messages) the twin prints, the classifier that reads a failed
log and the lesson a failure teaches, the Prometheus metric names, the launch command and the
image -- lives in one package per engine (``domain/engines/<name>/``) that implements
:class:`Engine`. Everything else asks :func:`engine` / :func:`engine_for` for the engine object,
so a second engine (vLLM, issue 22) is a second package, not edits across the tree.

An import-linter contract (``pyproject.toml``) keeps the engine packages out of the
engine-neutral modules: the registry imports an engine's package by name at run time
(:data:`ENGINES`), so importing this module imports no engine.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from domain.config import ServingConfig
    from domain.failures import Diagnosis
    from domain.hardware import GPU
    from domain.lesson import Lesson
    from domain.models import ModelArch
    from domain.preflight import ParsedCommand
    from domain.twin.startup import Startup

# engine name -> its package; the package's ``make(version)`` returns the Engine
ENGINES: dict[str, str] = {"sglang": "domain.engines.sglang"}
_RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?$")


def _cache_dir(env: Mapping[str, str] | None, override: str, leaf: str) -> Path:
    """``$override``, else ``$XDG_CACHE_HOME/servetune/leaf``, else ``~/.cache/servetune/leaf``."""
    env = os.environ if env is None else env
    if env.get(override):
        return Path(env[override]).expanduser()
    base = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else \
        Path.home() / ".cache"
    return base / "servetune" / leaf


def user_data_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where ``servetune source fetch`` writes fetched engine versions' flag inventories.

    ``$SERVETUNE_ENGINE_DATA``, else ``$XDG_CACHE_HOME/servetune/engines``, else
    ``~/.cache/servetune/engines`` (it need not exist). Shipped inventories are read first
    (``domain/data/``), then this directory.
    """
    return _cache_dir(env, "SERVETUNE_ENGINE_DATA", "engines")


def source_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where fetched SGLang trees are unpacked (``<dir>/sglang-X/``; need not exist).

    ``$SERVETUNE_SOURCE_CACHE``, else ``$XDG_CACHE_HOME/servetune/sglang``, else
    ``~/.cache/servetune/sglang``: the one rule ``servetune source fetch``
    (``mcp_servers/source/fetch.py:default_cache_dir``) and the lesson carry check share.
    """
    return _cache_dir(env, "SERVETUNE_SOURCE_CACHE", "sglang")


def version_key(version: str) -> tuple[int, ...]:
    """Sort key of a release ``X.Y.Z[.postN]``; anything else sorts first, as (-1,)."""
    m = _RELEASE.match(version)
    return tuple(int(g or 0) for g in m.groups()) if m else (-1,)


class DerivedDefaults(Protocol):
    """An engine version's memory-dependent derived defaults (GPU memory in GiB, reserves MiB).

    SGLang's: :class:`domain.engines.sglang.versions.MemoryDefaults`, one per modelled release.
    """

    @property
    def version(self) -> str:
        """The release whose rules these are (the nearest modelled one may stand in)."""
        ...

    @property
    def clamp_graph_to_running(self) -> bool:
        """A default decode graph max batch is lowered to an explicit max_running_requests."""
        ...

    @property
    def prefill_graph_reserve(self) -> bool:
        """The prefill CUDA graph is captured by default and reserved for."""
        ...

    def chunked_prefill(self, gpu_gib: float) -> int:
        """chunked_prefill_size when unset, tokens."""
        ...

    def decode_graph_bs(self, gpu_gib: float, tp_size: int) -> int:
        """Largest decode CUDA-graph batch size when unset, requests."""
        ...

    def speculative_reserve(self, algorithm: str | None) -> int:
        """Extra static reserve of a speculative algorithm, MiB."""
        ...

    def explicit_running(self, requested: int, kv_tokens: int) -> int:
        """An explicit max_running_requests as the KV pool bounds it, requests."""
        ...


class Engine(Protocol):
    """One serving engine at one version (the SGLang one: :mod:`domain.engines.sglang`)."""

    name: str  # e.g. "sglang"
    label: str  # how messages name it, e.g. "SGLang"
    version: str  # e.g. "0.5.23"
    versions: tuple[str, ...]  # versions whose flag inventory ships with servetune
    image: str  # the engine's container image of this version
    image_allow: str  # the image prefix the sandbox policy allows by default, every version
    program: tuple[str, ...]  # the command that starts one server, e.g. ("sglang", "serve")
    failure_classes: tuple[str, ...]  # every class :meth:`classify` returns, UNKNOWN last
    metrics: dict[str, str]  # servetune's name of a counter -> the engine's Prometheus name
    metric_prefix: str  # the prefix of every Prometheus metric the engine serves

    def flag_inventory(self) -> dict[str, dict[str, Any]]:
        """The CLI flags of this version keyed by argparse dest."""
        ...

    def flag_for(self, dest: str, value: Any = None) -> str:
        """The canonical flag of ``dest``; checks ``value`` against the flag's choices."""
        ...

    def flag_entries(self) -> list[dict[str, Any]]:
        """Every flag entry of this version in declaration order, deprecated aliases included."""
        ...

    def memory_defaults(self) -> DerivedDefaults:
        """The memory-dependent derived-default rules this version runs with."""
        ...

    def rules_note(self) -> str | None:
        """A warning when another version's derived-default rules stand in for this one's."""
        ...

    def missing_flag(self, dest: str) -> str | None:
        """One line when this version has no flag for field ``dest`` (None: it has one)."""
        ...

    def lesson_carries(self, site: str, learned_on: str) -> tuple[bool, str]:
        """Whether a lesson verified at ``site`` on ``learned_on`` holds here, and why."""
        ...

    def argv(self, config: ServingConfig) -> list[str]:
        """The command line of ONE replica of ``config`` (program and flags)."""
        ...

    def resolved_settings(self, config: ServingConfig) -> tuple[Any, ...] | None:
        """What the engine actually runs ``config`` with, as a hashable signature."""
        ...

    def layout_coupling(self, fields: dict[str, int | str | None]
                        ) -> tuple[dict[str, int], list[str]]:
        """The engine's rewrite of one server's layout fields and its refusals of the result.

        ``fields``: ``tp_size``, ``attn_dp_size``, ``dp_size``, ``ep_size``,
        ``moe_a2a_backend``. Returns ``(rewritten fields, refusal lines)``.
        """
        ...

    def layout_refusals(self, config: ServingConfig) -> list[str]:
        """The engine's refusals of one server's layout, in its words with their site.

        Beyond :meth:`layout_coupling`'s (e.g. ``--enable-eplb`` without expert parallelism);
        empty when the engine resolves it.
        """
        ...

    def start(self, config: ServingConfig, nnodes: int | None = None) -> Startup:
        """The twin's start of one replica: the engine's startup log, ready or the failure.

        ``nnodes``: the launch's node count (None: the argv's, :meth:`argv`).
        """
        ...

    def classify(self, log: Sequence[str]) -> tuple[str, str]:
        """Failure class and evidence line of a failed startup log (:meth:`diagnose`'s)."""
        ...

    def diagnose(self, log: Sequence[str]) -> Diagnosis:
        """Class, phase, evidence line, flags and retry rule of a failed log.

        A :class:`domain.failures.Diagnosis` by the taxonomy's rule (``verified`` False).
        """
        ...

    def logged_settings(self, log: Sequence[str]) -> dict[str, Any]:
        """``{dest: value}`` of the server arguments the log states ({} if it states none)."""
        ...

    def diagnosis_lesson(self, config: ServingConfig, diagnosis: Diagnosis,
                         log_tail: Sequence[str]) -> Lesson:
        """The lesson ``diagnosis`` teaches for ``config``.

        Raises:
            domain.failures.NoLesson: the class's rule forms no condition for ``config``.
        """
        ...

    def failure_lesson(self, config: ServingConfig, failure_class: str | None, stage: str | None,
                       evidence: str, log_tail: Sequence[str], run_id: str,
                       trial_key: str) -> Lesson:
        """The lesson of a failed launch, its condition covering the family it dooms."""
        ...

    def parse_command(self, argv: Sequence[str], model: str | None = None) -> ParsedCommand:
        """A raw launch command read with this version's flags (``servetune check``).

        ``model``: a registered model the command serves (``servetune check --model-config``),
        instead of the catalog lookup of its ``--model-path``.
        """
        ...

    def backend_refusals(self, config: ServingConfig,
                         values: dict[str, Any]) -> list[tuple[str, str]]:
        """``(flag, engine message)`` of every backend flag the config's GPU refuses."""
        ...

    def attention_backend(self, config: ServingConfig, model: ModelArch,
                          gpu: GPU) -> tuple[str, int]:
        """``(attention backend, KV page size)`` the engine runs ``config`` with on ``gpu``."""
        ...

    def resolved_backends(self, config: ServingConfig) -> dict[str, str]:
        """Every kernel choice (attention, MoE runner, FP4 GEMM ...) by flag dest, resolved."""
        ...


@cache
def engine(name: str = "sglang", version: str | None = None) -> Engine:
    """The engine ``name`` at ``version`` (None: the newest version servetune ships).

    Raises:
        ValueError: an engine servetune does not know, or a version without a flag inventory
            (the message names the supported ones).
    """
    if name not in ENGINES:
        raise ValueError(f"engine {name!r} is not supported; supported: {', '.join(ENGINES)}")
    made: Engine = importlib.import_module(ENGINES[name]).make(version)
    return made


def engine_for(config: ServingConfig) -> Engine:
    """The engine that runs ``config`` (its ``engine`` and ``engine_version``)."""
    return engine(config.engine, config.engine_version)


def failure_classes() -> tuple[str, ...]:
    """Every failure class any engine's classifier returns, in table order, UNKNOWN last."""
    seen = dict.fromkeys(c for n in ENGINES for c in engine(n).failure_classes if c != "UNKNOWN")
    return (*seen, "UNKNOWN")


def resolved_settings(config: ServingConfig) -> tuple[Any, ...] | None:
    """What ``config``'s engine actually runs it with (:meth:`Engine.resolved_settings`)."""
    return engine_for(config).resolved_settings(config)
