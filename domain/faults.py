"""Fault injection on the twin, and which failure classes a retry can cure.

A study's ``faults`` block (:class:`FaultSpec`, all shares 0 by default: nothing is injected)
makes the twin fail the way clusters do, so the search's handling of failures can be tested
without one: a launch that dies of OOM at weight load or crash-loops after it came up, an image
that cannot be pulled, a server that never turns Ready, a server that dies mid-benchmark, a
benchmark that returns garbage or times out, a lesson store that briefly refuses calls.

Every draw is a hash of ``(seed, kind, key, attempt)`` (:func:`draw`), never a shared random
stream, so a run with the same study injects the same faults in the same places whatever else
it does, and a retry (``attempt + 1``) draws afresh.

The retry policy (:data:`RETRY`, :func:`rule`, :func:`should_retry`) is the failure taxonomy's
(:mod:`domain.failures`), per failure class: a retry helps only where the failure is transient
(the image registry, a slow start -- retried once --, a dying server, the benchmark harness, the
lesson store); a config the engine refuses or that runs out of memory fails the same way every
time, so it is never retried -- it becomes a lesson instead.
"""

from __future__ import annotations

import hashlib
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from domain.failures import MAX_ATTEMPTS as MAX_ATTEMPTS
from domain.failures import NO_RETRY as NO_RETRY
from domain.failures import TAXONOMY, RetryRule
from domain.failures import rule as rule
from domain.failures import should_retry as should_retry

DeployFault = Literal["oom", "crash_loop", "image_pull", "ready_timeout"]
BenchFault = Literal["server_death", "bench_garbage", "bench_timeout"]
DEPLOY_FAULTS: tuple[DeployFault, ...] = ("oom", "crash_loop", "image_pull", "ready_timeout")
BENCH_FAULTS: tuple[BenchFault, ...] = ("server_death", "bench_garbage", "bench_timeout")

# the failure class each injected fault must be classified as (from its log or result alone)
EXPECTED_CLASS: dict[str, str] = {
    "oom": "OOM_WEIGHTS", "crash_loop": "CRASH_LOOP", "image_pull": "IMAGE_PULL",
    "ready_timeout": "READY_TIMEOUT", "server_death": "SERVER_DIED",
    "bench_garbage": "BENCH_GARBAGE", "bench_timeout": "BENCH_TIMEOUT",
    "lessons_outage": "LESSONS_UNAVAILABLE"}

K = TypeVar("K", bound=str)

# The retry policy is the failure taxonomy's (domain/failures.py): one rule per class, stated
# there once; these names stay importable from here for the graph and the fault reports.
RETRY: dict[str, RetryRule] = {name: fc.retry for name, fc in TAXONOMY.items()}


class FaultSpec(BaseModel):
    """Shares of launches, benchmarks and lesson-store calls that fail on purpose (twin only).

    The four deploy shares split one draw per launch (their sum is the share of launches that
    fail); the three bench shares split one draw per saturation benchmark.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    seed: int = Field(0, ge=0, le=2**31, description="seed of every fault draw")
    oom: float = Field(0.0, ge=0, le=1, description="launches that die of CUDA out of memory "
                       "at weight load")
    crash_loop: float = Field(0.0, ge=0, le=1, description="launches whose server crashes "
                              "after Ready and again after every restart")
    image_pull: float = Field(0.0, ge=0, le=1, description="launches whose image cannot be "
                              "pulled (ImagePullBackOff)")
    ready_timeout: float = Field(0.0, ge=0, le=1, description="launches not Ready within the "
                                 "readiness timeout")
    server_death: float = Field(0.0, ge=0, le=1, description="saturation runs during which the "
                                "server dies")
    bench_garbage: float = Field(0.0, ge=0, le=1, description="saturation runs whose records "
                                 "are garbage (first token before the send, more tokens than "
                                 "asked)")
    bench_timeout: float = Field(0.0, ge=0, le=1, description="saturation runs whose requests "
                                 "time out (the harness stalls)")
    lessons_outage: float = Field(0.0, ge=0, le=1, description="lesson-store calls that start "
                                  "a brief outage")
    outage_calls: int = Field(2, ge=1, le=MAX_ATTEMPTS - 1, description="calls an outage "
                              "refuses in a row (fewer than a caller's tries)")

    @model_validator(mode="after")
    def _check(self) -> FaultSpec:
        for group, kinds in (("deploy", DEPLOY_FAULTS), ("bench", BENCH_FAULTS)):
            if sum(getattr(self, k) for k in kinds) > 1 + 1e-9:
                raise ValueError(f"faults: the {group} shares ({', '.join(kinds)}) add up to "
                                 "more than 1")
        return self

    @property
    def active(self) -> bool:
        """Whether anything is injected."""
        return any(getattr(self, k) > 0 for k in (*DEPLOY_FAULTS, *BENCH_FAULTS,
                                                   "lessons_outage"))

    def deploy_fault(self, key: str, attempt: int) -> DeployFault | None:
        """The fault of launch ``attempt`` of ``key`` (a config id), if one is injected."""
        return _pick(self, DEPLOY_FAULTS, draw(self.seed, "deploy", key, attempt))

    def bench_fault(self, key: str, attempt: int) -> BenchFault | None:
        """The fault of benchmark ``attempt`` of ``key`` (a bench id), if one is injected."""
        return _pick(self, BENCH_FAULTS, draw(self.seed, "bench", key, attempt))

    def lessons_fault(self, call: int) -> bool:
        """Whether lesson-store call number ``call`` starts an outage."""
        return draw(self.seed, "lessons", "", call) < self.lessons_outage


def draw(seed: int, kind: str, key: str, attempt: int) -> float:
    """A uniform number in [0, 1) fixed by its arguments (sha256, no random state)."""
    blob = f"{seed}:{kind}:{key}:{attempt}".encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "big") / 2**64


def _pick(spec: FaultSpec, kinds: tuple[K, ...], u: float) -> K | None:
    edge = 0.0
    for k in kinds:
        edge += float(getattr(spec, k))
        if u < edge:
            return k
    return None


UNAVAILABLE = "temporarily unavailable"  # in a lesson-store error that a retry can cure


def bench_failure_class(valid: bool, invalid_reason: str | None,
                        errors_by_class: dict[str, int]) -> str | None:
    """Failure class of a benchmark from its result alone (None: a valid run).

    - BENCH_GARBAGE: records that fail the bench server's sanity checks;
    - BENCH_TIMEOUT: most failed requests timed out (the harness or the server stalled);
    - SERVER_DIED: most failed requests lost or could not open their connection;
    - BENCH_INVALID: anything else (e.g. the engine refused the requests): not retried.
    """
    if valid:
        return None
    if "sanity checks" in (invalid_reason or ""):
        return "BENCH_GARBAGE"
    timeouts = errors_by_class.get("timeout", 0)
    dropped = errors_by_class.get("connect", 0) + errors_by_class.get("disconnect", 0)
    if timeouts and timeouts >= dropped:
        return "BENCH_TIMEOUT"
    if dropped:
        return "SERVER_DIED"
    return "BENCH_INVALID"
