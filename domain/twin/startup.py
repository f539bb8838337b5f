"""Twin server startup: whether one replica of a config comes up, and the log it prints.

The twin starts a replica the way its engine would (:meth:`domain.engines.Engine.start`; for
SGLang: :mod:`domain.engines.sglang.startup`, its phases, log lines and refusals); a failed
startup yields the log up to the failure, so a classifier reads it exactly as it would read a
real pod log.
"""

from __future__ import annotations

from pydantic import BaseModel

from domain.config import ServingConfig
from domain.engines import engine_for
from domain.fit import FitReport


class Startup(BaseModel):
    """Outcome of starting one replica: ``ready`` with its fit, or the failing phase."""

    ready: bool
    phase: str  # "ready" | parse | init_distributed | resolve | model_init | load_weights |
    #             kv_pool | cuda_graph | host_pool
    log: list[str]
    exit_code: int
    fit: FitReport | None = None
    startup_s: float = 0.0

    @property
    def reason(self) -> str:
        """The engine's error line on failure, else the last log line.

        The error line is the last one that reports an error (``Error``, ``error:``, ``failed``).
        """
        for line in reversed(self.log):
            if "Error" in line or "error:" in line or " failed" in line:
                return line
        return self.log[-1] if self.log else ""


def start(config: ServingConfig) -> Startup:
    """Simulate the engine's server start for one replica of ``config`` and return what happened.

    Raises:
        ValueError: an engine or version servetune does not ship (:func:`domain.engines.engine`).
    """
    return engine_for(config).start(config)
