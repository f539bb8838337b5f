"""The compute budget of twin simulations: wall seconds of work, checked while simulating.

A twin benchmark costs CPU time in proportion to the scheduler steps it simulates, the requests
it records and their output tokens (inter-token gaps, summarised and stored afterwards), not to
its virtual duration. :class:`SimCost` estimates that cost before a run starts, so a run that
obviously exceeds the budget is refused at once with the estimate; :class:`ComputeBudget` is
checked inside the simulation loops (every :data:`CHECK_EVERY` iterations, well under a
millisecond apart) and stops a run that reaches its deadline or was cancelled.

Cost per unit, measured on a loaded 2-core x86 machine (``simulate_closed_loop`` on GLM-5 FP8
TP8 B200 over seven workloads, least squares): 1.3 µs per scheduler step, 14 µs per request and
0.04 µs per output token; the bench server's summary, acceptance blocks and ``.npz`` store of
the records then take 0.3 µs per output token (20 M tokens: 6 s), and more per token as the
gaps' copies grow (82 M tokens: 110 s, 246 M tokens: 260 s, with other work on the machine).
The step and request constants below are half of those measured (a machine twice as fast); the
token constant grows in proportion past :data:`TOKEN_KNEE`. The up-front estimate decides what
cannot fit; the deadline in the simulation loops is what bounds a run that starts.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from domain.errors import ComputeBudgetExceeded

DEFAULT_COMPUTE_BUDGET_S = 60.0  # wall seconds of simulation per bench tool call
SECONDS_PER_STEP = 0.6e-6
SECONDS_PER_REQUEST = 7e-6
SECONDS_PER_TOKEN = 0.25e-6
TOKEN_KNEE = 10_000_000  # recorded tokens (80 MB of gaps) past which each costs more
CHECK_EVERY = 256  # loop iterations between two clock reads (a power of two)


@dataclass(frozen=True)
class SimCost:
    """Estimated work of a simulation.

    Attributes:
        steps: scheduler iterations (prefill and decode steps) over all replicas.
        requests: requests simulated and recorded.
        tokens: output tokens recorded (one inter-token gap each).
    """

    steps: float
    requests: float
    tokens: float

    @property
    def seconds(self) -> float:
        """Estimated wall seconds on a fast machine (see the module docstring)."""
        return (self.steps * SECONDS_PER_STEP + self.requests * SECONDS_PER_REQUEST
                + self.tokens * SECONDS_PER_TOKEN * max(1.0, self.tokens / TOKEN_KNEE))

    def __add__(self, other: SimCost) -> SimCost:
        return SimCost(self.steps + other.steps, self.requests + other.requests,
                       self.tokens + other.tokens)

    def text(self) -> str:
        """E.g. ``about 4.4e+06 scheduler steps, 100,000 requests and 4.1e+08 output tokens``."""
        return (f"about {_count(self.steps)} scheduler steps, {_count(self.requests)} requests "
                f"and {_count(self.tokens)} output tokens")


def _count(x: float) -> str:
    return f"{x:,.0f}" if x < 1e6 else f"{x:.2g}"


class ComputeBudget:
    """Wall seconds a simulation (or a whole sweep of them) may use; cancellable.

    Args:
        limit_s: the budget, wall seconds (None: unbounded, only a cancel stops).
        clock: monotonic clock, seconds.
        flag: who set the limit, named in messages (e.g. ``--compute-budget-s``).
    """

    def __init__(self, limit_s: float | None, clock: Callable[[], float] = time.monotonic,
                 flag: str = "--compute-budget-s") -> None:
        self.limit_s, self.flag, self._clock = limit_s, flag, clock
        self._start = clock()
        self._deadline = math.inf if limit_s is None else self._start + limit_s
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Stop the simulation at its next check (from any thread)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._cancelled.is_set()

    def spent_s(self) -> float:
        """Wall seconds since the budget was created."""
        return self._clock() - self._start

    def left_s(self) -> float:
        """Wall seconds left (inf when unbounded)."""
        return self._deadline - self._clock()

    def check(self) -> None:
        """Raise if the budget ran out or the run was cancelled.

        Raises:
            ComputeBudgetExceeded: deadline passed (``stage`` ``stopped``) or cancelled.
        """
        if self._cancelled.is_set():
            raise ComputeBudgetExceeded(self.limit_s, self.spent_s(), stage="cancelled",
                                        flag=self.flag)
        if self._clock() > self._deadline:
            raise ComputeBudgetExceeded(self.limit_s, self.spent_s(), stage="stopped",
                                        flag=self.flag)

    def refuse_over(self, cost: SimCost, what: str = "this twin run") -> None:
        """Refuse up front work whose estimate exceeds what is left of the budget.

        Raises:
            ComputeBudgetExceeded: ``cost.seconds`` > :meth:`left_s` (``stage`` ``refused``),
                or the budget already ran out / was cancelled.
        """
        self.check()
        if self.limit_s is not None and cost.seconds > self.left_s():
            raise ComputeBudgetExceeded(self.limit_s, self.spent_s(), stage="refused",
                                        estimated_s=cost.seconds,
                                        detail=f"{what}: {cost.text()}", flag=self.flag)
