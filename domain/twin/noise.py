"""Run-to-run noise for twin benchmarks, to exercise the acceptance gate.

The twin is deterministic: the same config and workload give the same numbers to the last
digit, which no GPU does. A real run differs from the next by a few percent (clocks, thermals,
placement, background load) while staying steady within itself. The twin models that as one
multiplicative factor per run on every step time: the factor is ``exp(sigma * z)`` with
``sigma = noise_pct / 100`` and ``z`` a standard normal drawn from a generator seeded by
``(config_id, repeat, seed)``, so a rerun reproduces its noise and ``noise_pct = 0`` gives the
factor 1 exactly (today's numbers). For ``sigma`` of a few percent the factor's standard
deviation is ``sigma`` (a lognormal's is ``sigma`` to first order) and it is never negative.

In a closed-loop run (synthetic saturation, the frontier sweep) every time then scales by the
factor, and throughput by its inverse, which :func:`scale_records` applies to the measured
records. Open-loop runs (trace replay, fixed rate) are left alone: scaling their times would
change the offered load, not the server's speed.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from domain.metrics import RequestRecord


def noise_factor(config_id: str, repeat: int, noise_pct: float, seed: int = 0) -> float:
    """The step-time factor of run ``repeat`` of ``config_id`` (1.0 when ``noise_pct`` is 0).

    Args:
        config_id: the config's id (:meth:`~domain.config.ServingConfig.config_id`).
        repeat: 0-based index of the run among the config's repeats.
        noise_pct: standard deviation of the factor, percent (0 = no noise).
        seed: study-level seed (a different seed draws other noise).

    Raises:
        ValueError: ``noise_pct`` negative or ``repeat`` negative.
    """
    if noise_pct < 0 or repeat < 0:
        raise ValueError("noise_pct and repeat must be >= 0")
    if noise_pct == 0:
        return 1.0
    digest = hashlib.sha256(f"{config_id}:{repeat}:{seed}".encode()).digest()
    z = float(np.random.default_rng(int.from_bytes(digest[:8], "big")).standard_normal())
    return math.exp(noise_pct / 100 * z)


def scale_records(records: Sequence[RequestRecord], factor: float) -> list[RequestRecord]:
    """Closed-loop ``records`` as if every step had taken ``factor`` times as long.

    Every timestamp (send, first token, finish) and every inter-token gap is multiplied by
    ``factor``; token counts and errors are unchanged. ``factor == 1`` returns the records as
    they are.
    """
    if factor == 1.0:
        return list(records)
    return [replace(r, arrival_s=r.arrival_s * factor, first_token_s=r.first_token_s * factor,
                    finish_s=r.finish_s * factor, itl_s=np.asarray(r.itl_s) * factor)
            for r in records]
