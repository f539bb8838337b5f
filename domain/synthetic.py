"""Synthetic workloads: fixed-length requests at a fixed (Poisson or uniform) rate, seeded.

Units: arrival times in seconds from the start of the workload, lengths in tokens.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

from domain.errors import ConfigInvalid
from domain.workload import Request, Trace


def synthetic_fixed(
    n: int,
    isl: int,
    osl: int,
    rate_per_s: float | None = None,
    arrival: Literal["poisson", "uniform"] = "poisson",
    seed: int = 0,
) -> Trace:
    """Build ``n`` requests of fixed input/output length (deterministic for a given seed).

    The first request arrives at 0 s. With ``rate_per_s=None`` every request arrives at 0 s (a
    closed-loop saturation run; ``arrival`` is then ignored). ``"poisson"`` draws exponential
    gaps with mean ``1 / rate_per_s`` s from ``numpy.random.default_rng(seed)``; ``"uniform"``
    spaces requests exactly ``1 / rate_per_s`` s apart.

    Args:
        n: Number of requests, >= 1.
        isl: Input length of every request, tokens, >= 1.
        osl: Output length of every request, tokens, >= 1.
        rate_per_s: Mean arrival rate, requests/s, > 0; None for all at once.
        arrival: ``"poisson"`` or ``"uniform"`` inter-arrival gaps.
        seed: Seed of the random generator.

    Returns:
        A trace with ``source_format="synthetic"``, no hash ids.

    Raises:
        ConfigInvalid: listing every parameter out of range.
    """
    problems: list[str] = []
    if n < 1:
        problems.append(f"n must be >= 1, got {n}")
    if isl < 1 or osl < 1:
        problems.append(f"isl and osl must be >= 1 token, got isl={isl}, osl={osl}")
    if rate_per_s is not None and (not math.isfinite(rate_per_s) or rate_per_s <= 0):
        problems.append(f"rate_per_s must be a finite number > 0 or None, got {rate_per_s}")
    if arrival not in ("poisson", "uniform"):
        problems.append(f"arrival must be 'poisson' or 'uniform', got {arrival!r}")
    if problems:
        raise ConfigInvalid(problems)
    if rate_per_s is None:
        times = np.zeros(n)
    elif arrival == "uniform":
        times = np.arange(n) / rate_per_s
    else:
        gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, size=n - 1)
        times = np.concatenate(([0.0], np.cumsum(gaps)))
    requests = [Request(arrival_s=float(t), input_tokens=isl, output_tokens=osl) for t in times]
    rate = "inf" if rate_per_s is None else f"{rate_per_s:g}/s {arrival}"
    return Trace(
        name=f"synthetic n={n} isl={isl} osl={osl} rate={rate} seed={seed}",
        source_format="synthetic",
        requests=requests,
    )
