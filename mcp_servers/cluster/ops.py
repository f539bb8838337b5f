"""Cluster operations: plain functions over an injected backend, returning pydantic models."""

from __future__ import annotations

from pydantic import BaseModel

from domain.config import ServingConfig
from mcp_servers.cluster.backend import ClusterBackend, DeploymentStatus

MAX_LOG_LINES = 500


class LogPage(BaseModel):
    """A page of log lines (newest last)."""

    name: str
    lines: list[str]
    total_lines: int
    start: int
    next_start: int | None


def deploy(backend: ClusterBackend, name: str, config: ServingConfig,
           labels: dict[str, str] | None = None) -> DeploymentStatus:
    """Deploy ``config`` as ``name`` with servetune's labels added."""
    lab = {"app.kubernetes.io/managed-by": "servetune", "servetune/config-id": config.config_id()}
    lab.update(labels or {})
    return backend.deploy(name, config, lab)


def logs(backend: ClusterBackend, name: str, tail: int | None = None, start: int = 0,
         max_lines: int = 200) -> LogPage:
    """Lines of ``name``'s log: the last ``tail`` lines, or a page from ``start``.

    Args:
        backend: the cluster backend.
        name: deployment name.
        tail: if given, only the last ``tail`` lines are considered.
        start: index of the first line of the page (within the considered lines).
        max_lines: page size, at most 500.
    """
    lines = backend.logs(name)
    if tail is not None:
        lines = lines[-tail:] if tail > 0 else []
    max_lines = max(1, min(max_lines, MAX_LOG_LINES))
    page = lines[start:start + max_lines]
    nxt = start + max_lines if start + max_lines < len(lines) else None
    return LogPage(name=name, lines=page, total_lines=len(lines), start=start, next_start=nxt)
