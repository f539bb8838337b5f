"""Where a lesson was learned, its status (active, quarantined, retracted) and the trust rules.

A lesson learned on the twin (the simulated engine) says what the twin refused; one learned on a
real backend (``local`` server processes, ``kubernetes`` pods) says what SGLang refused. Which
lessons may prune which study, and which are exported into the Claude Code skill, follows from
that provenance, from ``Lesson.verified`` (the condition was read from the engine's own check,
``Lesson.source_site``) and from the measurements that contradicted it:

- **trusted** = active and (source-verified, or learned on a real backend and never
  contradicted). Only trusted lessons are exported (``servetune lessons export-skill``).
- **pruning**: an active lesson prunes a twin study; it prunes a real-backend study only when
  it is source-verified or was not learned on the twin (a real backend, the memory-fit
  estimate's arithmetic, a source-reading research drop, a user's statement). A lesson of
  unknown provenance (stored before provenance existed) counts as twin-learned.
- **contradiction**: a config the lesson forbids ran and served (ready, benchmarked with a
  valid result). The lesson is quarantined at once. A real-backend measurement contradicts any
  lesson; a twin measurement contradicts only lessons not learned on a real backend (the twin
  is weaker evidence than a real server).
- quarantined and retracted lessons forbid nothing; ``restore`` makes a quarantined or
  retracted lesson active again (an operator's decision, kept in its history).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from domain.redact import RedactedStr

Backend = Literal["twin", "local", "kubernetes", "estimate", "research", "user"]
# Backends where a real SGLang server ran the trial (mcp_servers/cluster: local, kubernetes).
REAL_BACKENDS = frozenset({"local", "kubernetes"})
Status = Literal["active", "quarantined", "retracted"]
STATUSES: tuple[Status, ...] = ("active", "quarantined", "retracted")
# At most this many further runs are noted on a lesson's provenance, and this many evidence
# lines kept (a lesson's full evidence text stays in Lesson.evidence).
MAX_RUNS = 50
MAX_EVIDENCE_LINES = 8


def now_iso() -> str:
    """The current time as ISO 8601 UTC with seconds, e.g. ``2026-12-02T03:30:00Z``."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Provenance(BaseModel):
    """Where and how a lesson was learned."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Backend = Field(description="twin | local | kubernetes (a launched trial), "
                             "estimate (memory-fit arithmetic), research (a source-reading "
                             "drop), user (stated by a person)")
    engine: str | None = Field(None, description="e.g. 'sglang'")
    engine_version: str | None = Field(None, description="e.g. '0.5.23'")
    image: RedactedStr | None = Field(None, max_length=300, description="the engine's "
                                      "container image the trial ran (Engine.image)")
    run_id: RedactedStr | None = Field(None, max_length=200, description="the run that first "
                                       "learned it")
    trial: RedactedStr | None = Field(None, max_length=300, description="that run's trial "
                                      "key, e.g. 'search:3f2a...'")
    evidence: list[RedactedStr] = Field(default_factory=list, max_length=MAX_EVIDENCE_LINES,
                                        description="the log lines or arithmetic it rests on")
    learned_at: str | None = Field(None, description="ISO 8601 UTC")
    runs: list[RedactedStr] = Field(default_factory=list, max_length=MAX_RUNS,
                                    description="further runs that found the same lesson, "
                                    "oldest first")

    @property
    def real(self) -> bool:
        """Whether it was learned on a real SGLang server (local or kubernetes)."""
        return self.backend in REAL_BACKENDS

    def seen_again(self, run_id: str | None) -> Provenance:
        """This provenance noting that ``run_id`` found the same lesson (no-op if known)."""
        if run_id is None or run_id == self.run_id or run_id in self.runs \
                or len(self.runs) >= MAX_RUNS:
            return self
        return self.model_copy(update={"runs": [*self.runs, run_id]})

    def text(self) -> str:
        """One line, e.g. ``twin, sglang 0.5.23, image lmsysorg/sglang:..., run r1, trial k``."""
        parts: list[str] = [self.backend]
        if self.engine:
            parts.append(f"{self.engine} {self.engine_version or ''}".strip())
        parts += [f"{k} {v}" for k, v in (("image", self.image), ("run", self.run_id),
                                           ("trial", self.trial), ("at", self.learned_at)) if v]
        if self.runs:
            parts.append(f"seen again in {len(self.runs)} run(s)")
        return ", ".join(parts)


def evidence_lines(evidence: str) -> list[str]:
    """The last non-empty lines of a lesson's evidence text (at most MAX_EVIDENCE_LINES)."""
    lines = [ln.strip()[:500] for ln in evidence.splitlines() if ln.strip()]
    return lines[-MAX_EVIDENCE_LINES:]


class StatusChange(BaseModel):
    """One change of a lesson's status: to what, why, when and by whom or what."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    status: Status
    reason: RedactedStr = Field(min_length=1, max_length=2_000)
    at: str = Field(description="ISO 8601 UTC")
    by: RedactedStr = Field(max_length=200, description="who or what: 'operator (cli)', "
                            "'agent (mcp)', 'measurement run/trial'")


class Contradiction(BaseModel):
    """A measurement that contradicted a lesson: a config it forbids ran and served."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Backend
    run_id: RedactedStr | None = None
    trial: RedactedStr | None = Field(None, description="the trial key that served")
    config_id: str
    evidence: RedactedStr = Field("", max_length=2_000, description="what it measured, e.g. "
                                  "'ready; saturation 1234 tok/s/GPU, 0 errors'")
    at: str = Field(default_factory=now_iso)

    def weighs_against(self, learned: Provenance | None) -> bool:
        """Whether this measurement contradicts a lesson learned with ``learned`` provenance.

        A real-backend measurement contradicts any lesson; a twin one only lessons not learned
        on a real backend.
        """
        return self.backend in REAL_BACKENDS or learned is None or not learned.real
