"""The cluster MCP server ("kubectl" for servetune): deploy/status/logs/events/teardown/list.

Confined to the namespace of its backend (a tool's optional ``namespace`` argument must name
it); never reads Secrets, never execs into a server, and only tears down what it created.
Deployments outlive the server: with the ``local`` backend the server processes keep running
after this MCP server exits, until ``tear_down`` (a new server over the same state folder sees
them and can tear them down).
"""

# No `from __future__ import annotations`: the tools' annotations use `Namespace`, a type built
# per server (its description names the namespace), which must be evaluated where it is defined.
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import anyio
import anyio.from_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import Field

from domain.config import ServingConfig
from domain.errors import ServetuneError
from mcp_servers.cluster import ops
from mcp_servers.cluster.backend import (
    BackendError,
    ClusterBackend,
    DeploymentStatus,
    make_backend,
    settle,
)
from mcp_servers.tool_errors import StrictMCPServer, as_tool_errors
from sandbox.podspec import check_labels

log = logging.getLogger("servetune.mcp.cluster")
T = TypeVar("T")

Name = Annotated[str, Field(description="deployment name (DNS-1123 label, e.g. 'trial-007')",
                            min_length=1, max_length=52, pattern=r"^[a-z0-9][-a-z0-9]*$")]
Labels = Annotated[dict[str, str] | None, Field(
    description="extra labels of the deployment (Kubernetes label syntax), e.g. "
    "{'servetune/run-id': 'r1'}; servetune sets app.kubernetes.io/managed-by and "
    "servetune/config-id itself", max_length=16)]
RESERVED_LABELS = (*ops.MANAGED_BY, "servetune/config-id")
# Numeric arguments are strict (``Field(strict=True)``): ``true`` is not 1 and ``"5"`` is not
# 5, as in ServingConfig; a float argument takes a whole number.
SinceS = Annotated[float | None, Field(description="only entries from the last N seconds",
                                       gt=0, le=7 * 86400, strict=True)]


def build_server(backend: ClusterBackend) -> MCPServer:
    """An MCP server whose tools act on ``backend`` (namespace fixed by the backend)."""
    ns = backend.namespace
    server = StrictMCPServer("servetune-cluster", instructions=(
        f"Deploy and inspect SGLang serving deployments in namespace {ns} (backend: "
        f"{backend.kind}). deploy a ServingConfig (it waits up to wait_s seconds); while the "
        "phase is Pending, poll get_status every few seconds until Ready or Failed. On Failed, "
        "read get_logs (tail 40) and get_events to see why. Benchmark only Ready deployments, "
        "and always tear_down what you deployed when done: deployments keep running (and "
        "holding GPUs) after this server exits, until tear_down. A deployment whose record "
        "file is unreadable is left out of list_deployments and reported by get_events as a "
        "CorruptRecord warning; tear_down that name to stop it and free the name."))
    Namespace = Annotated[str | None, Field(  # noqa: N806 (a type alias local to this server)
        description=f"optional; this server acts only in namespace {ns!r}: omit it or pass "
        "exactly that")]

    def _guard(namespace: str | None, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if namespace is not None and namespace != ns:
            raise ToolError(f"this server is confined to namespace {ns!r}; it cannot act in "
                            f"{namespace!r}. Omit the namespace argument.")
        with as_tool_errors(BackendError):
            try:
                return fn(*args, **kwargs)
            except (BackendError, ServetuneError, ToolError):
                raise
            except Exception as e:  # a bug or a broken state folder: say so, do not hide it
                log.exception("%s failed", getattr(fn, "__name__", fn))
                raise ToolError(f"unexpected {type(e).__name__}: {e} (details in the cluster "
                                "server's log; the state folder may be damaged)") from e

    @server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False,
                                             idempotentHint=False, openWorldHint=False))
    def deploy(name: Name, config: ServingConfig, ctx: Context,
               wait_s: Annotated[float, Field(description="seconds to wait for Ready or "
                                              "Failed before answering Pending", ge=0,
                                              le=600, strict=True)] = 60.0,
               labels: Labels = None,
               namespace: Namespace = None) -> DeploymentStatus:
        """Create a deployment of `config` named `name` and start its replicas.

        Waits up to `wait_s` seconds (reporting progress) and returns the status: Ready (with
        `endpoints`), Failed with the server's error in `message` (read get_logs for the
        whole log), or Pending: then poll get_status until it is Ready or Failed. A name in
        use must be torn down first. `labels` are added to the deployment's labels.
        """
        def progress(st: DeploymentStatus, elapsed: float) -> None:
            try:
                anyio.from_thread.run(ctx.report_progress, elapsed, wait_s,
                                      f"{st.ready_replicas}/{st.replicas} replicas ready")
            except (anyio.RunFinishedError, anyio.ClosedResourceError,
                    anyio.BrokenResourceError) as e:  # nobody waits for the answer any more
                raise BackendError(f"the client left while {name} was starting; the "
                                   "deployment stays as it is (get_status, tear_down)") from e

        lab = dict(labels or {})
        if reserved := sorted(set(lab) & set(RESERVED_LABELS)):
            raise ToolError(f"labels {', '.join(reserved)} are set by servetune; leave them out")
        try:
            check_labels(lab, name)
        except ValueError as e:
            raise ToolError(str(e)) from None
        st = _guard(namespace, ops.deploy, backend, name, config, lab)
        if st.phase == "Pending" and wait_s > 0:
            st = ops.redact_status(_guard(namespace, settle, backend, name, wait_s, progress))
        log.info("deployed %s: %s", name, st.phase)
        return st

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True, openWorldHint=False))
    def get_status(name: Name, namespace: Namespace = None) -> DeploymentStatus:
        """Phase (Pending/Ready/Failed/Terminated), endpoints and last log line of `name`.

        Answers at once; while Pending, call it again after a few seconds.
        """
        return _guard(namespace, ops.status, backend, name)

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True, openWorldHint=False))
    def get_logs(name: Name,
                 tail: Annotated[int | None, Field(description="only the last N lines", ge=0,
                                                   le=10000, strict=True)] = None,
                 since_s: SinceS = None,
                 start: Annotated[int, Field(description="first line of the page", ge=0,
                                             strict=True)] = 0,
                 max_lines: Annotated[int, Field(description="page size", ge=1, le=500,
                                                 strict=True)] = 200,
                 replica: Annotated[int | None, Field(description="replica index; default: "
                                                      "the first that failed, else 0; -1: "
                                                      "the deployment's router (local "
                                                      "backend with --router)",
                                                      ge=-1, strict=True)] = None,
                 namespace: Namespace = None) -> ops.LogPage:
        """Server log of one replica of `name`, paged; continue with `start=next_start`.

        `since_s` keeps lines from the last N seconds, then `tail` the last N of those.
        """
        return _guard(namespace, ops.logs, backend, name, tail, since_s, start, max_lines,
                      replica)

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True, openWorldHint=False))
    def get_events(name: Annotated[str | None, Field(
                       description="deployment name; omit for every deployment",
                       min_length=1, max_length=52, pattern=r"^[a-z0-9][-a-z0-9]*$")] = None,
                   since_s: SinceS = None,
                   start: Annotated[int, Field(description="first event of the page",
                                               ge=0, strict=True)] = 0,
                   max_items: Annotated[int, Field(description="page size", ge=1,
                                                   le=500, strict=True)] = 100,
                   namespace: Namespace = None) -> ops.EventPage:
        """Events (Created, Started, Ready, Failed, Killing, ...), oldest first, paged.

        Continue with `start=next_start`. Warnings explain failures and refused actions.
        """
        return _guard(namespace, ops.events, backend, name, since_s, start, max_items)

    @server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True,
                                             idempotentHint=True, openWorldHint=False))
    def tear_down(name: Name, namespace: Namespace = None) -> DeploymentStatus:
        """Stop deployment `name` (only deployments this server's backend created).

        Idempotent; the answer's phase is Terminated.
        """
        return _guard(namespace, ops.teardown, backend, name)

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True, openWorldHint=False))
    def list_deployments(namespace: Namespace = None) -> list[DeploymentStatus]:
        """Every deployment created in this namespace, oldest first, with its current phase.

        A deployment whose record file is unreadable is left out; get_events (without a name)
        reports it as a CorruptRecord warning naming the file, and tear_down of that name
        stops what it started and frees the name.
        """
        return _guard(namespace, ops.list_deployments, backend)

    return server


def main(backend_kind: str = "twin", namespace: str = "servetune",
         state_dir: Path | None = None, command: list[str] | None = None,
         ready_timeout_s: float = 600.0, visible_devices: list[str] | None = None,
         router: str = "none", **kube: Any) -> None:
    """Run the cluster server over stdio (logs go to stderr).

    Args:
        backend_kind: ``twin``, ``local`` or ``kubernetes``.
        namespace: the namespace the server is confined to.
        state_dir: records shared with the bench server (``local`` requires it; the twin keeps
            them in memory without it).
        command: ``local`` only: server argv template with ``{host}``, ``{port}``,
            ``{config_json}`` (the path of a JSON file holding the ServingConfig); any other
            ``{word}`` is refused; None runs ``sglang serve`` with the config's flags.
        ready_timeout_s: ``local`` only: seconds until a replica that is not Ready is Failed.
        visible_devices: ``local`` only: GPU indices or UUIDs; each replica gets ``tp_size``
            of those not held by a deployment that is not torn down yet.
        router: ``local`` only: ``sglang`` (the pinned sglang-router in front of 2+ replicas,
            :mod:`mcp_servers.cluster.router`) or ``none``.
        **kube: ``kubernetes`` only: ``kubeconfig``, ``context``, ``gpu_budget``,
            ``image_allow``, ``lws``, ``sglang_options`` (see
            :func:`~mcp_servers.cluster.backend.make_backend`).
    """
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per health probe
    backend = make_backend(backend_kind, namespace, state_dir, command, ready_timeout_s,
                           visible_devices, **({"router": router} if router != "none" else {}),
                           **kube)
    build_server(backend).run()
