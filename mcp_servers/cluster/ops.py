"""Cluster operations: plain functions over an injected backend, returning pydantic models.

Every answer that carries engine output (a status's message, log lines, event messages) passes
through :func:`domain.redact.redact` here, so no backend can hand a secret to the model.
"""

from __future__ import annotations

import time

from pydantic import BaseModel

from domain.config import ServingConfig
from domain.redact import redact
from mcp_servers.cluster.backend import ClusterBackend, DeploymentStatus, Event

MAX_LOG_LINES = 500
MAX_EVENTS = 500
MANAGED_BY = {"app.kubernetes.io/managed-by": "servetune"}


class LogPage(BaseModel):
    """A page of log lines (newest last)."""

    name: str
    lines: list[str]
    total_lines: int
    start: int
    next_start: int | None


class EventPage(BaseModel):
    """A page of events (oldest first)."""

    name: str | None
    events: list[Event]
    total_events: int
    start: int
    next_start: int | None


def deploy(backend: ClusterBackend, name: str, config: ServingConfig,
           labels: dict[str, str] | None = None, wait_s: float = 0.0) -> DeploymentStatus:
    """Deploy ``config`` as ``name`` with servetune's labels added; wait up to ``wait_s`` s."""
    lab = {**MANAGED_BY, "servetune/config-id": config.config_id()}
    lab.update(labels or {})
    return redact_status(backend.deploy(name, config, lab, wait_s))


def redact_status(st: DeploymentStatus) -> DeploymentStatus:
    """``st`` with its message (the engine's last log line or error) redacted."""
    return st.model_copy(update={"message": redact(st.message)})


def status(backend: ClusterBackend, name: str) -> DeploymentStatus:
    """The status of ``name``, its message redacted."""
    return redact_status(backend.status(name))


def teardown(backend: ClusterBackend, name: str) -> DeploymentStatus:
    """Tear ``name`` down; its final status, the message redacted."""
    return redact_status(backend.teardown(name))


def list_deployments(backend: ClusterBackend) -> list[DeploymentStatus]:
    """Every deployment of the backend, oldest first, messages redacted."""
    return [redact_status(st) for st in backend.list()]


def logs(backend: ClusterBackend, name: str, tail: int | None = None,
         since_s: float | None = None, start: int = 0, max_lines: int = 200,
         replica: int | None = None) -> LogPage:
    """A page of ``name``'s log lines.

    Of the lines newer than ``since_s`` seconds ago, the last ``tail``, then a page from
    ``start``.

    Args:
        backend: the cluster backend.
        name: deployment name.
        tail: if given, only the last ``tail`` lines are considered.
        since_s: if given, only lines stamped after ``now - since_s`` are considered.
        start: index of the first line of the page (within the considered lines).
        max_lines: page size, at most 500.
        replica: which replica; None = the backend's choice (the first that failed, else 0).
    """
    lines = backend.logs(name) if replica is None else backend.logs(name, replica=replica)
    if since_s is not None:
        cutoff = time.time() - since_s
        lines = [ln for ln in lines if ln.t >= cutoff]
    if tail is not None:
        lines = lines[-tail:] if tail > 0 else []
    max_lines = max(1, min(max_lines, MAX_LOG_LINES))
    page = lines[start:start + max_lines]
    nxt = start + max_lines if start + max_lines < len(lines) else None
    return LogPage(name=name, lines=[redact(ln.text) for ln in page], total_lines=len(lines),
                   start=start, next_start=nxt)


def events(backend: ClusterBackend, name: str | None = None, since_s: float | None = None,
           start: int = 0, max_items: int = 100) -> EventPage:
    """Events of ``name`` (or of all deployments), oldest first, paged.

    Args:
        backend: the cluster backend.
        name: deployment name, or None for every deployment of the namespace.
        since_s: if given, only events after ``now - since_s``.
        start: index of the first event of the page.
        max_items: page size, at most 500.
    """
    evs = backend.events(name)
    if since_s is not None:
        cutoff = time.time() - since_s
        evs = [e for e in evs if e.t >= cutoff]
    max_items = max(1, min(max_items, MAX_EVENTS))
    page = [e.model_copy(update={"message": redact(e.message)})
            for e in evs[start:start + max_items]]
    nxt = start + max_items if start + max_items < len(evs) else None
    return EventPage(name=name, events=page, total_events=len(evs), start=start,
                     next_start=nxt)
