"""The cluster backend interface and its twin implementation.

A backend owns deployments in ONE namespace, fixed when it is built; tools never take a
namespace argument. Backends: ``twin`` (here: simulated SGLang servers in virtual time);
``local`` processes and ``kubernetes`` implement the same protocol in later issues.
"""

from __future__ import annotations

import re
import time
from typing import Literal, Protocol

from pydantic import BaseModel, Field

from domain.config import ServingConfig
from domain.fit import FitReport
from domain.twin.startup import Startup, start

Phase = Literal["Ready", "Failed", "Terminated"]
NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?$")


class DeploymentStatus(BaseModel):
    """What ``status`` reports for one deployment."""

    name: str
    namespace: str
    phase: Phase
    replicas: int
    ready_replicas: int
    config: ServingConfig
    labels: dict[str, str] = Field(default_factory=dict)
    exit_code: int | None = Field(None, description="engine exit code when Failed")
    failed_stage: str | None = Field(None, description="startup stage that failed")
    message: str = Field("", description="last log line (the engine's error when Failed)")
    startup_s: float = Field(0.0, description="seconds from create to ready (virtual for twin)")


class BackendError(Exception):
    """A backend operation was refused or failed; the message says what to do next."""


class ClusterBackend(Protocol):
    """What every cluster backend offers (one namespace per backend instance)."""

    namespace: str
    kind: str

    def deploy(self, name: str, config: ServingConfig,
               labels: dict[str, str]) -> DeploymentStatus:
        """Create deployment ``name`` of ``config`` carrying ``labels``."""
        ...

    def status(self, name: str) -> DeploymentStatus:
        """Current status of ``name``."""
        ...

    def logs(self, name: str) -> list[str]:
        """Server log lines of ``name`` (replica 0)."""
        ...

    def teardown(self, name: str) -> DeploymentStatus:
        """Stop ``name`` (only what this backend created)."""
        ...

    def list(self) -> list[DeploymentStatus]:
        """Every deployment this backend created."""
        ...


class _TwinDeployment:
    def __init__(self, name: str, config: ServingConfig, labels: dict[str, str],
                 startup: Startup) -> None:
        self.name, self.config, self.labels, self.startup = name, config, labels, startup
        self.terminated = False
        self.created = time.time()


class TwinBackend:
    """Simulated SGLang deployments: startup fails or succeeds exactly as :func:`start` says."""

    kind = "twin"

    def __init__(self, namespace: str = "servetune") -> None:
        if not NAME_RE.match(namespace):
            raise BackendError(f"namespace {namespace!r} is not a valid DNS-1123 label")
        self.namespace = namespace
        self._deps: dict[str, _TwinDeployment] = {}

    def _get(self, name: str) -> _TwinDeployment:
        if name not in self._deps:
            known = ", ".join(sorted(self._deps)) or "none"
            raise BackendError(f"no deployment {name!r} in namespace {self.namespace}; "
                               f"existing: {known}. Call list_deployments to see them.")
        return self._deps[name]

    def deploy(self, name: str, config: ServingConfig,
               labels: dict[str, str]) -> DeploymentStatus:
        """Create deployment ``name`` (all replicas start identically in the twin).

        Raises:
            BackendError: invalid name, or the name is taken by a live deployment.
        """
        if not NAME_RE.match(name):
            raise BackendError(f"deployment name {name!r} must be a DNS-1123 label "
                               "(lowercase letters, digits, '-', at most 52 characters)")
        old = self._deps.get(name)
        if old is not None and not old.terminated:
            raise BackendError(f"deployment {name!r} already exists; tear it down first")
        self._deps[name] = _TwinDeployment(name, config, dict(labels), start(config))
        return self.status(name)

    def status(self, name: str) -> DeploymentStatus:
        """Current status of ``name``. Raises BackendError if it does not exist."""
        d = self._get(name)
        s = d.startup
        phase: Phase = "Terminated" if d.terminated else ("Ready" if s.ready else "Failed")
        return DeploymentStatus(
            name=name, namespace=self.namespace, phase=phase, replicas=d.config.replicas,
            ready_replicas=d.config.replicas if phase == "Ready" else 0, config=d.config,
            labels=d.labels, exit_code=None if s.ready else s.exit_code,
            failed_stage=None if s.ready else s.phase, message=s.reason,
            startup_s=s.startup_s)

    def logs(self, name: str) -> list[str]:
        """The server log of replica 0 of ``name`` (every twin replica logs the same)."""
        return list(self._get(name).startup.log)

    def teardown(self, name: str) -> DeploymentStatus:
        """Stop ``name``; idempotent. Raises BackendError if it never existed."""
        self._get(name).terminated = True
        return self.status(name)

    def list(self) -> list[DeploymentStatus]:
        """Every deployment this backend created, oldest first."""
        return [self.status(n) for n in self._deps]

    def ready_fit(self, name: str) -> tuple[ServingConfig, FitReport]:
        """Config and resolved memory layout of a Ready deployment (for the bench server).

        Raises:
            BackendError: if it is not Ready.
        """
        d = self._get(name)
        if d.terminated or not d.startup.ready or d.startup.fit is None:
            raise BackendError(f"deployment {name!r} is not Ready; benchmark only Ready "
                               "deployments (check status first)")
        return d.config, d.startup.fit
