"""What an open-loop run of the HTTP runner sends: planned requests and fixed-rate schedules.

A plan is a list of :class:`PlannedRequest` (a trace's scaled arrival times, or a fixed request
rate from :func:`arrival_schedule`, constant or Poisson, seeded), sorted by ``arrival_s``, with
every request body built before the clock starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np


@dataclass(slots=True)
class PlannedRequest:
    """One request of an open-loop run; ``body`` is the complete JSON request.

    ``output_tokens`` is what the body asks for: a server that reports fewer in its usage
    produced a truncated output (an error). 0 = unknown, not checked.
    """

    arrival_s: float
    body: bytes
    input_tokens: int
    output_tokens: int


def arrival_schedule(rate: float, *, duration_s: float | None = None, count: int | None = None,
                     process: Literal["constant", "poisson"] = "poisson",
                     seed: int = 0) -> np.ndarray:
    """Send times (s from the run start) of a fixed request rate, first request at 0.

    Args:
        rate: mean requests per second (> 0).
        duration_s: keep the requests scheduled before this many seconds.
        count: or: exactly this many requests (one of the two is required; both: the first
            limit reached).
        process: ``constant`` (one request every ``1/rate`` s) or ``poisson`` (exponential gaps
            with mean ``1/rate``, seeded: the same seed gives the same schedule).
        seed: seed of the Poisson gaps.

    Raises:
        ValueError: a non-positive rate, or neither ``duration_s`` nor ``count`` given.
    """
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a finite number > 0, got {rate}")
    if duration_s is None and count is None:
        raise ValueError("give duration_s or count")
    n = count if count is not None else 0
    if duration_s is not None:
        expect = rate * duration_s
        n_dur = int(expect + 6 * math.sqrt(expect) + 16) if process == "poisson" else \
            math.ceil(expect)
        n = n_dur if count is None else min(count, n_dur)
    if process == "constant":
        t = np.arange(n, dtype=float) / rate
    elif process == "poisson":
        gaps = np.random.default_rng([seed, 0x5E7]).exponential(1.0 / rate, n)
        t = np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if n else np.zeros(0)
    else:
        raise ValueError(f"unknown arrival process {process!r}; use 'constant' or 'poisson'")
    return t[t < duration_s] if duration_s is not None else t
