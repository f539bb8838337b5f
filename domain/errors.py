"""The one exception hierarchy of servetune's domain core.

Every error carries fields a caller can act on, and a message written for a person (or a model)
that says what to do next.
"""

from __future__ import annotations


class ServetuneError(Exception):
    """Base of every error servetune raises on purpose."""


class ConfigInvalid(ServetuneError):
    """A study, knob value or serving config is invalid.

    Attributes:
        violations: One line per problem, each naming the field and the fix.
    """

    def __init__(self, violations: list[str]) -> None:
        self.violations = list(violations)
        super().__init__("; ".join(self.violations))


class UnknownFlag(ConfigInvalid):
    """A flag is not accepted by the pinned engine version (argparse would exit with code 2)."""


class TraceInvalid(ServetuneError):
    """A trace file is missing or malformed.

    Attributes:
        path: The trace file.
        line: 1-based line (row) number of the first bad record, or None for file-level problems.
        reason: What is wrong and how to fix it.
    """

    def __init__(self, path: str, reason: str, line: int | None = None) -> None:
        self.path, self.line, self.reason = path, line, reason
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {reason}")


class DoesNotFit(ServetuneError):
    """A serving config does not fit in GPU memory.

    Attributes:
        phase: ``"weights_load"`` (weights exceed the GPU: CUDA OOM while loading),
            ``"kv_pool"`` (weights fit but leave no KV cache under mem_fraction_static),
            ``"cuda_graph"`` (too little memory left outside the static pool for graph capture).
        required_gb: Memory the phase needs per GPU, in GB (1e9 bytes).
        available_gb: Memory the phase has per GPU, in GB (1e9 bytes).
        arithmetic: The computation, spelled out, for lessons and reports.
    """

    def __init__(self, phase: str, required_gb: float, available_gb: float,
                 arithmetic: str) -> None:
        self.phase, self.required_gb, self.available_gb = phase, required_gb, available_gb
        self.arithmetic = arithmetic
        super().__init__(
            f"does not fit ({phase}): needs {required_gb:.1f} GB per GPU, "
            f"has {available_gb:.1f} GB; {arithmetic}"
        )


class DeployFailed(ServetuneError):
    """A deployment did not become ready.

    Attributes:
        phase: Startup stage at which it died (``parse``, ``resolve``, ``load_weights``,
            ``kv_pool``, ``cuda_graph``, ``model_init``, ``timeout``).
        reason: The engine's own message.
    """

    def __init__(self, phase: str, reason: str) -> None:
        self.phase, self.reason = phase, reason
        super().__init__(f"{phase}: {reason}")


class BudgetExceeded(ServetuneError):
    """A study budget ran out. Attributes: kind (``trials``, ``wall_time``...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        super().__init__(f"budget exhausted: {kind}")
