"""Workloads: the requests a serving deployment is asked to answer.

A :class:`Trace` is loaded from a public trace file by :mod:`domain.traces` (formats, units and
the shipped traces: ``data/traces/SOURCES.md``) or built by :mod:`domain.synthetic`. Units here:
arrival times in seconds from the start of the workload, lengths in tokens.

``Request`` is a frozen pydantic model: construction measured about 2 µs per request with 14
hash ids and 5 µs with 247 (the largest Mooncake row), well under the 10 µs budget, so the
schema of record stays pydantic.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from domain.errors import ConfigInvalid

SourceFormat = Literal["mooncake", "azure", "bailian", "synthetic"]


class Request(BaseModel):
    """One request of a workload."""

    model_config = ConfigDict(frozen=True)

    arrival_s: float = Field(ge=0, allow_inf_nan=False, description="seconds from workload start")
    input_tokens: int = Field(ge=1, description="prompt length, tokens")
    output_tokens: int = Field(ge=1, description="generated length, tokens")
    hash_ids: tuple[int, ...] = Field(default=(), description="prefix block hashes, in order")
    block_size: int = Field(
        default=0, ge=0, description="tokens per hash block: 512 Mooncake, 16 Bailian, 0 none"
    )


class LengthStats(BaseModel):
    """Distribution of one length column, in tokens (percentiles interpolate linearly)."""

    model_config = ConfigDict(frozen=True)

    p50: float
    p90: float
    p99: float
    mean: float
    max: int


class TraceStats(BaseModel):
    """Summary of a trace, computed the way the traces README computes its tables."""

    model_config = ConfigDict(frozen=True)

    count: int = Field(description="number of requests")
    span_s: float = Field(description="last arrival minus first arrival, seconds")
    rate_per_s: float | None = Field(
        description="count / span_s, requests/s; None when every request arrives at once"
    )
    input_tokens: LengthStats
    output_tokens: LengthStats


class Trace(BaseModel):
    """A loaded workload: a non-empty list of requests sorted by arrival time."""

    model_config = ConfigDict(frozen=True)

    name: str
    path: str | None = Field(default=None, description="file it was loaded from; None if built")
    source_format: SourceFormat
    requests: list[Request] = Field(min_length=1)

    @field_validator("requests")
    @classmethod
    def _sorted(cls, requests: list[Request]) -> list[Request]:
        for i in range(1, len(requests)):
            if requests[i].arrival_s < requests[i - 1].arrival_s:
                raise ValueError(f"requests must be sorted by arrival_s (index {i} goes back)")
        return requests

    def __len__(self) -> int:
        return len(self.requests)

    def window(self, start_s: float, duration_s: float) -> Trace:
        """Return the requests arriving in ``[start_s, start_s + duration_s)``.

        Arrivals are re-based so that ``start_s`` becomes 0 (a request at ``start_s + 0.5`` comes
        out at 0.5; the idle time before the first request in the window is kept).

        Args:
            start_s: Window start, seconds from the start of this trace.
            duration_s: Window length, seconds; must be > 0.

        Raises:
            ConfigInvalid: for a non-finite or negative start, a non-positive duration, or a
                window that holds no request.
        """
        problems: list[str] = []
        if not math.isfinite(start_s) or start_s < 0:
            problems.append(f"window start_s must be a finite number >= 0, got {start_s}")
        if not math.isfinite(duration_s) or duration_s <= 0:
            problems.append(f"window duration_s must be a finite number > 0, got {duration_s}")
        if problems:
            raise ConfigInvalid(problems)
        end = start_s + duration_s
        picked = [
            r.model_copy(update={"arrival_s": r.arrival_s - start_s})
            for r in self.requests
            if start_s <= r.arrival_s < end
        ]
        if not picked:
            last = self.requests[-1].arrival_s
            raise ConfigInvalid(
                [
                    f"window [{start_s}, {end}) s of {self.name} holds no request; "
                    f"arrivals run from {self.requests[0].arrival_s} to {last} s"
                ]
            )
        name = f"{self.name}[{start_s:g}s+{duration_s:g}s]"
        return self.model_copy(update={"name": name, "requests": picked})

    def scaled(self, time_scale: float) -> Trace:
        """Return the trace replayed ``time_scale`` times faster (arrivals divided by it).

        Args:
            time_scale: Speed-up factor; 2.0 halves every arrival time (twice the request rate),
                0.5 doubles them. Must be finite and > 0.

        Raises:
            ConfigInvalid: for a non-finite or non-positive factor.
        """
        if not math.isfinite(time_scale) or time_scale <= 0:
            raise ConfigInvalid([f"time_scale must be a finite number > 0, got {time_scale}"])
        picked = [
            r.model_copy(update={"arrival_s": r.arrival_s / time_scale}) for r in self.requests
        ]
        return self.model_copy(update={"name": f"{self.name}x{time_scale:g}", "requests": picked})

    def head(self, n: int) -> Trace:
        """Return the first ``n`` requests (all of them if the trace is shorter).

        Raises:
            ConfigInvalid: if ``n`` < 1.
        """
        if n < 1:
            raise ConfigInvalid([f"head n must be >= 1, got {n}"])
        return self.model_copy(update={"name": f"{self.name}[:{n}]", "requests": self.requests[:n]})

    def stats(self) -> TraceStats:
        """Count, span, mean rate and length percentiles (numpy, linear interpolation)."""
        arrivals = np.fromiter((r.arrival_s for r in self.requests), float, len(self.requests))
        span = float(arrivals[-1] - arrivals[0])
        return TraceStats(
            count=len(self.requests),
            span_s=span,
            rate_per_s=len(self.requests) / span if span > 0 else None,
            input_tokens=_length_stats([r.input_tokens for r in self.requests]),
            output_tokens=_length_stats([r.output_tokens for r in self.requests]),
        )


def _length_stats(values: list[int]) -> LengthStats:
    arr = np.asarray(values, dtype=np.int64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99], method="linear")
    return LengthStats(
        p50=float(p50), p90=float(p90), p99=float(p99), mean=float(arr.mean()), max=int(arr.max())
    )
