"""SGLang behind the :class:`~domain.engines.Engine` interface.

Where each SGLang rule lives:

- flag inventory per version, argv of a config, launch program and image:
  :mod:`domain.engines.sglang.flags`;
- which versions exist (shipped or fetched inventories) and the derived-default rules each runs
  with (nearest modelled version): :mod:`domain.engines.sglang.versions`;
- resolved defaults (what SGLang runs a config with): :mod:`domain.engines.sglang.defaults`
  (the memory-fit rules themselves: :mod:`domain.fit`, :mod:`domain.speculative`);
- per-SM architecture rules (which attention, DSA, MoE and FP4 kernels a GPU runs):
  :mod:`domain.engines.sglang.arch`;
- startup log phases, log lines and refusals the twin prints: :mod:`domain.engines.sglang.startup`;
- failure classification of a log (phase, class, evidence): :mod:`domain.engines.sglang.failures`;
- the server arguments a log states: :mod:`domain.engines.sglang.logargs`;
- the lesson each failure teaches (family, fix, outcome): :mod:`domain.engines.sglang.lessons`;
- Prometheus metric names: :mod:`domain.engines.sglang.metrics`.

The modules that need the memory-fit estimate or the lesson model are imported when first used,
so the registry can build this engine while any domain module is still being imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from domain.engines.sglang import failures, flags
from domain.engines.sglang import versions as version_rules
from domain.engines.sglang.metrics import METRICS, PREFIX

if TYPE_CHECKING:
    from domain.config import ServingConfig
    from domain.engines import Engine
    from domain.failures import Diagnosis
    from domain.hardware import GPU
    from domain.lesson import Lesson
    from domain.models import ModelArch
    from domain.preflight import ParsedCommand
    from domain.twin.startup import Startup

VERSIONS = flags.VERSIONS


class SglangEngine:
    """SGLang ``version`` (one of :data:`VERSIONS`)."""

    name: str = "sglang"
    label: str = "SGLang"
    versions: tuple[str, ...] = VERSIONS
    failure_classes: tuple[str, ...] = failures.FAILURE_CLASSES
    image_allow: str = flags.IMAGE_REPOSITORY
    metrics: dict[str, str] = METRICS
    metric_prefix: str = PREFIX
    program: tuple[str, ...] = flags.PROGRAM

    def __init__(self, version: str) -> None:
        """SGLang ``version``; the version is checked by :func:`make`."""
        self.version = version
        self.image = flags.image(version)
        self.versions = version_rules.available()  # shipped + fetched when this was made
        self._dests: frozenset[str] | None = None

    def flag_inventory(self) -> dict[str, dict[str, Any]]:
        """The CLI flags of this version keyed by argparse dest."""
        return flags.flag_inventory(self.version)

    def flag_entries(self) -> list[dict[str, Any]]:
        """Every flag entry in declaration order, deprecated aliases included."""
        return flags.flag_entries(self.version)

    def memory_defaults(self) -> version_rules.MemoryDefaults:
        """The derived-default rules this version runs with (:func:`versions.rules`)."""
        return version_rules.rules(self.version)

    def rules_note(self) -> str | None:
        """The report's warning when another version's rules stand in (:func:`rules_note`)."""
        return version_rules.rules_note(self.version)

    def missing_flag(self, dest: str) -> str | None:
        """One line when this version has no flag for field ``dest``.

        None when it has one (under its own or an older name), or when no known version has a
        flag for ``dest`` (not a flag field).
        """
        if self._dests is None:  # an inventory never changes once found: read it once
            self._dests = frozenset(self.flag_inventory())
        if dest in self._dests or flags.renamed_dest(dest, self.version) \
                or not flags.known_dest(dest):
            return None
        if dest == "attn_dp_size" and "enable_dp_attention" in self._dests:
            return None  # spelled --dp-size N --enable-dp-attention before 0.5.23 (flags.argv)
        return flags.missing_flag_line(dest, self.version)

    def flag_for(self, dest: str, value: Any = None) -> str:
        """The canonical flag of ``dest``; checks ``value`` against the flag's choices."""
        return flags.flag_for(dest, self.version, value)

    def argv(self, config: ServingConfig) -> list[str]:
        """The argv of ``sglang serve`` for ONE replica of ``config``."""
        return flags.argv(config, self.version)

    def lesson_carries(self, site: str, learned_on: str) -> tuple[bool, str]:
        """Whether a lesson verified at ``site`` on ``learned_on`` holds here (carry.carries)."""
        from domain.engines.sglang import carry

        return carry.carries(site, learned_on, self.version)

    def resolved_settings(self, config: ServingConfig) -> tuple[Any, ...] | None:
        """What SGLang actually runs ``config`` with (:func:`defaults.resolved_settings`)."""
        from domain.engines.sglang import defaults

        return defaults.resolved_settings(config)

    def layout_coupling(self, fields: dict[str, int | str | None]
                        ) -> tuple[dict[str, int], list[str]]:
        """The a2a ``ep_size`` rewrite and the layout refusals (:func:`layout_coupling.couple`)."""
        from domain.engines.sglang import layout_coupling

        return layout_coupling.couple(fields)

    def layout_refusals(self, config: ServingConfig) -> list[str]:
        """The engine's other layout refusals (:func:`layout_coupling.config_refusals`)."""
        from domain.engines.sglang import layout_coupling

        return layout_coupling.config_refusals(config)

    def start(self, config: ServingConfig, nnodes: int | None = None) -> Startup:
        """The twin's start of one replica of ``config`` (:func:`startup.start`)."""
        from domain.engines.sglang import startup

        return startup.start(config, nnodes)

    def classify(self, log: Sequence[str]) -> tuple[str, str]:
        """Failure class and evidence line of a failed startup log (:func:`failures.classify`)."""
        return failures.classify(log)

    def diagnose(self, log: Sequence[str]) -> Diagnosis:
        """Class, phase and evidence of a failed log (:func:`failures.diagnose`)."""
        return failures.diagnose(log)

    def logged_settings(self, log: Sequence[str]) -> dict[str, Any]:
        """The server arguments of the log's ``server_args=`` line (:mod:`logargs`)."""
        from domain.engines.sglang import logargs

        return logargs.logged_settings(log, self.version)

    def diagnosis_lesson(self, config: ServingConfig, diagnosis: Diagnosis,
                         log_tail: Sequence[str]) -> Lesson:
        """The lesson of ``diagnosis`` for ``config`` (:func:`lessons.diagnosis_lesson`)."""
        from domain.engines.sglang import lessons

        return lessons.diagnosis_lesson(config, diagnosis, log_tail)

    def failure_lesson(self, config: ServingConfig, failure_class: str | None, stage: str | None,
                       evidence: str, log_tail: Sequence[str], run_id: str,
                       trial_key: str) -> Lesson:
        """The lesson of a failed launch (:func:`lessons.failure_lesson`)."""
        from domain.engines.sglang import lessons

        return lessons.failure_lesson(config, failure_class, stage, evidence, log_tail, run_id,
                                      trial_key)

    def parse_command(self, argv: Sequence[str], model: str | None = None) -> ParsedCommand:
        """A raw ``sglang serve`` / ``python -m sglang.launch_server`` argv (cmdline.parse)."""
        from domain.engines.sglang import cmdline

        return cmdline.parse(list(argv), self.version, model=model)

    def backend_refusals(self, config: ServingConfig,
                         values: dict[str, Any]) -> list[tuple[str, str]]:
        """Attention-backend flags the GPU refuses (startup_checks.backend_refusals)."""
        from domain.engines.sglang import startup_checks

        return startup_checks.backend_refusals(config, values)

    def attention_backend(self, config: ServingConfig, model: ModelArch,
                          gpu: GPU) -> tuple[str, int]:
        """``(attention backend, KV page size)`` by the per-SM rules (arch.attention_backend)."""
        from domain.engines.sglang import arch

        return arch.attention_backend(config, model, gpu)

    def resolved_backends(self, config: ServingConfig) -> dict[str, str]:
        """Attention, DSA, MoE-runner and FP4-GEMM kernels (arch.resolved_backends)."""
        from domain.engines.sglang import arch

        return arch.resolved_backends(config)


def make(version: str | None = None) -> Engine:
    """SGLang at ``version`` (None: the pinned release, 0.5.23).

    Raises:
        ValueError: a version without a flag inventory, shipped or fetched; the one line names
            ``servetune source fetch --version X`` (:func:`versions.unknown_version_line`).
    """
    v = version or version_rules.PINNED
    if version_rules.data_path(v) is None:
        raise ValueError(version_rules.unknown_version_line(v))
    return SglangEngine(v)
