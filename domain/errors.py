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


class InvalidCombination(ConfigInvalid):
    """A flag combination the pinned engine refuses while resolving its arguments.

    ServingConfig accepts such configs (the engine's argparse does too); SGLang's resolution
    pipeline then raises before any weight loads, and the twin's startup reproduces that.

    Attributes:
        exception: The Python exception the engine raises (``ValueError``, ``AssertionError``,
            ``TypeError``, ``NotImplementedError``).
        message: The engine's own message ("" for a bare ``assert``).
        where: ``(file, function)`` of the engine code that raises, for the traceback.
        key: the refusal's key in the engine's table of refusal sites (for SGLang
            ``domain/engines/sglang/refusals.py:REFUSALS``, which holds its ``file:line``);
            "" when the raiser names none.
    """

    def __init__(self, exception: str, message: str, where: tuple[str, str],
                 key: str = "") -> None:
        self.exception, self.message, self.where, self.key = exception, message, where, key
        super().__init__([self.line])

    @property
    def line(self) -> str:
        """The last traceback line as the engine prints it, e.g. ``ValueError: ...``."""
        return f"{self.exception}: {self.message}" if self.message else self.exception


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


class RunFileDamaged(ServetuneError):
    """A run file a resume would read or append to is damaged or contradicts another.

    Attributes:
        path: The damaged file (``ledger.sqlite``, ``checkpoint.sqlite`` or ``events.jsonl``,
            or the ``-wal``/``-shm`` file of a database).
        why: What is wrong with it.
        way_on: How to go on with this run id (the other way is always a new run id).
    """

    def __init__(self, path: str, why: str, way_on: str) -> None:
        self.path, self.why, self.way_on = path, why, way_on
        super().__init__(f"{path} is damaged ({why}); {way_on}, or start a new run with "
                         "another --run-id")


class DoesNotFit(ServetuneError):
    """A serving config does not fit in GPU memory.

    Attributes:
        phase: ``"weights_load"`` (weights exceed the GPU: CUDA OOM while loading),
            ``"kv_pool"`` (weights fit but leave no KV cache under mem_fraction_static),
            ``"cuda_graph"`` (too little memory left outside the static pool for graph capture).
        required_gb: Memory the phase needs per GPU, in GB (1e9 bytes).
        available_gb: Memory the phase has per GPU, in GB (1e9 bytes).
        arithmetic: The computation, spelled out, for lessons and reports.
        cause: Finer reason within the phase (``kv_pool``: ``no_room`` -- weights fill
            mem_fraction_static; ``zero_requests`` -- the pool holds < 2 tokens so
            max_running_requests is 0; ``pool_too_small`` -- no request fits), "" otherwise.
    """

    def __init__(self, phase: str, required_gb: float, available_gb: float,
                 arithmetic: str, cause: str = "") -> None:
        self.phase, self.required_gb, self.available_gb = phase, required_gb, available_gb
        self.arithmetic, self.cause = arithmetic, cause
        super().__init__(
            f"does not fit ({phase}): needs {required_gb:.1f} GB per GPU, "
            f"has {available_gb:.1f} GB; {arithmetic}"
        )


class DeployFailed(ServetuneError):
    """A deployment did not become ready.

    Attributes:
        phase: Startup stage at which it died (``parse``, ``init_distributed``, ``resolve``,
            ``model_init``, ``load_weights``, ``kv_pool``, ``cuda_graph``, ``host_pool``,
            ``timeout``).
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


class ComputeBudgetExceeded(BudgetExceeded):
    """A twin simulation would exceed, or reached, its compute budget, or was cancelled.

    Attributes:
        kind: ``compute_s``.
        limit_s: the budget, wall seconds (None: unbounded).
        spent_s: wall seconds used when it was raised.
        stage: ``refused`` (estimated over the budget, nothing simulated), ``stopped`` (the
            deadline passed while simulating) or ``cancelled`` (the caller cancelled).
        estimated_s: the up-front estimate, wall seconds (``refused`` only).
        detail: what the estimate counted.
        flag: the option that sets the limit, for the message.
    """

    def __init__(self, limit_s: float | None, spent_s: float, stage: str,
                 estimated_s: float | None = None, detail: str = "",
                 flag: str = "--compute-budget-s") -> None:
        self.kind, self.limit_s, self.spent_s, self.stage = "compute_s", limit_s, spent_s, stage
        self.estimated_s, self.detail, self.flag = estimated_s, detail, flag
        limit = "no limit" if limit_s is None else f"{limit_s:g} s"
        budget = f"the bench server's twin compute budget of {limit} per call ({flag})"
        fix = ("shorten duration_s, lower concurrency, isl or osl, or run fewer sweep points; "
               "the operator can raise " + flag)
        if stage == "refused":
            message = (f"refused: {detail} is an estimated {estimated_s:.1f} s of compute, over "
                       f"{budget} ({max(0.0, (limit_s or 0) - spent_s):.1f} s left); {fix}")
        elif stage == "cancelled":
            message = f"twin simulation cancelled by the client after {spent_s:.1f} s"
        else:
            message = (f"stopped: the twin simulation used up {budget} after {spent_s:.1f} s; "
                       f"{fix}")
        ServetuneError.__init__(self, message)
