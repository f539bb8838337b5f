"""The cluster MCP server ("kubectl" for servetune): deploy / status / logs / teardown / list.

Confined to the namespace of its backend; never reads Secrets, never execs into pods, and only
tears down what it created.
"""

from __future__ import annotations

import logging
import sys
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations
from pydantic import Field

from domain.config import ServingConfig
from mcp_servers.cluster import ops
from mcp_servers.cluster.backend import BackendError, ClusterBackend, DeploymentStatus
from mcp_servers.tool_errors import StrictMCPServer, as_tool_errors

log = logging.getLogger("servetune.mcp.cluster")

Name = Annotated[str, Field(description="deployment name (DNS-1123 label, e.g. 'trial-007')",
                            min_length=1, max_length=52, pattern=r"^[a-z0-9][-a-z0-9]*$")]


def build_server(backend: ClusterBackend) -> MCPServer:
    """An MCP server whose tools act on ``backend`` (namespace fixed by the backend)."""
    server = StrictMCPServer("servetune-cluster", instructions=(
        f"Deploy and inspect SGLang serving deployments in namespace {backend.namespace} "
        f"(backend: {backend.kind}). Deploy a ServingConfig, poll get_status until Ready or "
        "Failed, read get_logs on failure, and always tear_down when done."))

    def _guard(fn, *args, **kwargs):  # noqa: ANN001, ANN202
        with as_tool_errors(BackendError):
            return fn(*args, **kwargs)

    @server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False,
                                             idempotentHint=False))
    def deploy(name: Name, config: ServingConfig) -> DeploymentStatus:
        """Create a deployment of `config` named `name` and start its replicas.

        Returns the status right after startup: phase Ready, or Failed with the engine's error
        in `message` (read get_logs for the full startup log).
        """
        st = _guard(ops.deploy, backend, name, config)
        log.info("deployed %s: %s", name, st.phase)
        return st

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True))
    def get_status(name: Name) -> DeploymentStatus:
        """Phase (Ready/Failed/Terminated), ready replicas and the last log line of `name`."""
        return _guard(backend.status, name)

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True))
    def get_logs(name: Name,
                 tail: Annotated[int | None, Field(description="only the last N lines", ge=0,
                                                   le=10000)] = None,
                 start: Annotated[int, Field(description="first line of the page", ge=0)] = 0,
                 max_lines: Annotated[int, Field(description="page size", ge=1, le=500)] = 200,
                 ) -> ops.LogPage:
        """Server log of replica 0 of `name`, paged; continue with `start=next_start`."""
        return _guard(ops.logs, backend, name, tail, start, max_lines)

    @server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True,
                                             idempotentHint=True))
    def tear_down(name: Name) -> DeploymentStatus:
        """Stop deployment `name` (only deployments this server created). Idempotent."""
        return _guard(backend.teardown, name)

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True))
    def list_deployments() -> list[DeploymentStatus]:
        """Every deployment created in this namespace, oldest first."""
        return backend.list()

    return server


def main(namespace: str = "servetune") -> None:
    """Run the cluster server with the twin backend over stdio (logs go to stderr)."""
    from mcp_servers.cluster.backend import TwinBackend

    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    build_server(TwinBackend(namespace)).run()
