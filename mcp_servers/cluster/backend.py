"""The cluster backend interface, its shared records and helpers, and ``make_backend``.

A backend owns deployments in ONE namespace, fixed when it is built (the model never picks it).
Backends: ``twin`` (:mod:`mcp_servers.cluster.twin`: simulated SGLang servers that answer
at once), ``local``
(:mod:`mcp_servers.cluster.local`: server processes on 127.0.0.1) and ``kubernetes``
(:mod:`mcp_servers.cluster.kubernetes`). The protocol is shaped so that the Kubernetes backend
maps onto it directly:

- ``deploy``: server-side apply of a Deployment (``replicas``, the engine's argv,
  ``engine_for(config).argv(config)``) and its Service, named ``name``, carrying ``labels``
  (at least ``app.kubernetes.io/managed-by=servetune``), after the manifest policy accepted
  them; returns Pending, and with ``wait_s`` polls until Ready/Failed like :func:`settle`.
- ``status``: the Deployment's and its pods' conditions: Pending until every pod is Ready;
  Failed when a container terminated or is in CrashLoopBackOff (``exit_code`` from its last
  termination state, ``failed_stage`` ``startup`` if the pod was never Ready, else
  ``serving``, ``message`` its last log line); ``endpoints`` the Ready pods' ``http://IP:port``.
- ``logs``: pod logs (``read_namespaced_pod_log(timestamps=True)``; the timestamp becomes
  :attr:`LogLine.t`) of one replica (pod); ``events``: core/v1 Events whose involvedObject is
  the deployment or its pods, mapped field by field onto :class:`Event`.
- ``teardown``: delete only objects that carry the managed-by label and the name (never by a
  selector the model wrote); ``list``: a label selector on managed-by.

No backend reads Secrets, execs into a server, or deletes anything it did not create.

A record file that cannot be used (not JSON, wrong types, missing fields) never breaks the
server: ``list`` skips it (logging a warning), ``events()`` reports it as a Warning event with
reason ``CorruptRecord`` naming the file, and a call naming that deployment raises
:class:`CorruptRecord` (a :class:`BackendError`) saying to ``teardown`` it, which stops what it
can, moves the file aside (``*.corrupt``) and frees the name.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, Field, ValidationError

from domain.config import ServingConfig
from domain.fit import FitReport
from mcp_servers.cluster.store import RecordStore, UnreadableRecord

log = logging.getLogger("servetune.cluster")
M = TypeVar("M", bound=BaseModel)

Phase = Literal["Pending", "Ready", "Failed", "Terminated"]
SETTLED: tuple[Phase, ...] = ("Ready", "Failed", "Terminated")
NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?$")


class ServerGroup(BaseModel):
    """One group of servers of a deployment: the replicas, or a PD layout's prefill/decode pool.

    Memory is one rank's (per GPU; KV tokens and the request cap per scheduler, i.e. per
    attention-DP rank or DP copy); None where the backend does not know it.
    """

    role: str = Field(description="'server' (aggregated replicas), 'prefill' or 'decode'")
    servers: int = Field(description="servers in the group")
    layout: str = Field(description="one server's layout, e.g. 'TP8 DP-attn8 EP8', 'TP4xPP2'")
    gpus_per_server: int = Field(description="tp x pp x dp")
    nodes_per_server: int = Field(description="nodes one server spans (--nnodes)")
    schedulers: int = Field(description="schedulers per server (dp x attention DP)")
    ready: bool = Field(description="every server of the group started")
    message: str = Field("", description="the group's error when it failed to start")
    weights_gb_per_gpu: float | None = Field(None, description="weight shard per GPU, GB "
                                             "(1e9 bytes), draft layers included")
    kv_pool_gb_per_gpu: float | None = Field(None, description="KV pool per GPU, GB")
    kv_tokens_per_scheduler: int | None = Field(None, description="KV pool tokens of one "
                                                "scheduler")
    max_running_requests_per_scheduler: int | None = Field(
        None, description="running-request cap of one scheduler")


class DeploymentStatus(BaseModel):
    """What ``status`` reports for one deployment."""

    name: str
    namespace: str
    phase: Phase
    replicas: int
    ready_replicas: int
    config: ServingConfig
    labels: dict[str, str] = Field(default_factory=dict)
    endpoints: list[str] = Field(
        default_factory=list, description="base URLs of the Ready replicas, e.g. "
        "'http://127.0.0.1:31001' (empty for the twin, which serves no HTTP, and once Failed or "
        "Terminated)")
    router: str | None = Field(
        None, description="base URL of the router in front of the replicas (local backend "
        "with --router: the pinned sglang-router; send requests there, read engine "
        "metrics from endpoints); None: no router, spread requests over endpoints")
    created_at: float = Field(description="when the deployment was created, epoch seconds")
    exit_code: int | None = Field(None, description="server exit code when Failed (None if "
                                  "unknown: it never exited, or another process reaped it)")
    failed_stage: str | None = Field(None, description="where it failed: an engine startup "
                                     "stage (twin), 'startup' (before Ready) or 'serving' "
                                     "(after Ready)")
    message: str = Field("", description="the engine's error when Failed, else the last log "
                         "line")
    startup_s: float = Field(0.0, description="seconds from create to Ready (virtual for the "
                             "twin; 0 until Ready)")
    groups: list[ServerGroup] = Field(
        default_factory=list, description="the server groups (a PD layout: prefill, then "
        "decode) with one rank's memory (twin); empty where the backend does not report them")


class LogLine(BaseModel):
    """One server log line."""

    t: float = Field(description="epoch seconds: when the line was written (or, for a backend "
                     "that cannot tell, when it first read it)")
    text: str


class Event(BaseModel):
    """What happened to a deployment, in the manner of a Kubernetes Event."""

    t: float = Field(description="epoch seconds")
    type: Literal["Normal", "Warning"]
    reason: str = Field(description="Created, Started, Ready, Failed, Unhealthy, Killing, "
                        "Stopped, ForeignProcess, ...")
    object: str = Field(description="the deployment's name")
    message: str


class BackendError(Exception):
    """A backend operation was refused or failed; the message says what to do next."""


class CorruptRecord(BackendError):
    """The record file of a deployment cannot be used (bad JSON, wrong types, missing fields)."""

    def __init__(self, name: str, path: Path | None, reason: str) -> None:
        super().__init__(
            f"the record of deployment {name!r} is unreadable: {path or name}: {reason}. Call "
            f"tear_down({name!r}): it stops whatever the deployment started that can still be "
            "identified, moves the file aside (*.corrupt) and frees the name for a new deploy.")
        self.name, self.path, self.reason = name, path, reason

    def event(self) -> Event:
        """A Warning event (reason CorruptRecord) for this record, stamped with its mtime."""
        try:
            t = self.path.stat().st_mtime if self.path is not None else time.time()
        except OSError:
            t = time.time()
        return Event(t=t, type="Warning", reason="CorruptRecord", object=self.name,
                     message=str(self))


def require_record(store: RecordStore, name: str, model: type[M], namespace: str) -> M:
    """Record ``name`` validated as ``model``.

    Raises:
        BackendError: no such deployment (the message lists the existing ones).
        CorruptRecord: the record exists but is unusable.
    """
    rec = read_record(store, name, model) if NAME_RE.match(name) else None
    if rec is None:
        known = ", ".join(sorted(store.names())) or "none"
        raise BackendError(f"no deployment {name!r} in namespace {namespace}; "
                           f"existing: {known}. Call list_deployments to see them.")
    return rec


def read_record(store: RecordStore, name: str, model: type[M]) -> M | None:
    """Record ``name`` of ``store`` validated as ``model``; None if there is none.

    Raises:
        CorruptRecord: the file is not JSON, fails ``model``'s validation, or names another
            deployment.
    """
    try:
        raw = store.read(name)
    except UnreadableRecord as e:
        raise CorruptRecord(name, e.path, e.reason) from e
    if raw is None:
        return None
    try:
        rec = model.model_validate(raw)
    except ValidationError as e:
        errs = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'record'}: {err['msg']}"
                         for err in e.errors()[:3])
        more = f" (+{e.error_count() - 3} more)" if e.error_count() > 3 else ""
        raise CorruptRecord(name, store.path(name), f"invalid fields: {errs}{more}") from e
    if getattr(rec, "name", name) != name:
        raise CorruptRecord(name, store.path(name),
                            f"it names deployment {getattr(rec, 'name', '')!r}, not {name!r}")
    return rec


def scan_records(store: RecordStore, model: type[M]) -> tuple[list[M], list[CorruptRecord]]:
    """Every usable record of ``store`` (by ``created_at``) and the errors of the others."""
    good: list[M] = []
    bad: list[CorruptRecord] = []
    for name in store.names():
        if not NAME_RE.match(name):
            bad.append(CorruptRecord(name, store.path(name), "the file name is not a "
                                     "deployment name (DNS-1123 label); remove the file"))
            continue
        try:
            rec = read_record(store, name, model)
        except CorruptRecord as e:
            bad.append(e)
            continue
        if rec is not None:
            good.append(rec)
    for err in bad:
        log.warning("skipping a deployment record: %s", err)
    return sorted(good, key=lambda d: getattr(d, "created_at", 0.0)), bad


def when(t: float) -> str:
    """Epoch seconds as an ISO-8601 UTC time, to the second."""
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


class ClusterBackend(Protocol):
    """What every cluster backend offers (one namespace per backend instance)."""

    namespace: str
    kind: str

    def deploy(self, name: str, config: ServingConfig, labels: dict[str, str],
               wait_s: float = 0.0) -> DeploymentStatus:
        """Create deployment ``name`` of ``config`` carrying ``labels``.

        Waits up to ``wait_s`` seconds for it to leave Pending; a Pending result is polled with
        ``status``.
        """
        ...

    def status(self, name: str) -> DeploymentStatus:
        """Current status of ``name`` (non-blocking: at most one probe per replica)."""
        ...

    def logs(self, name: str, replica: int | None = None) -> list[LogLine]:
        """Server log of one replica of ``name``.

        ``replica`` picks it; by default the first replica that failed, else replica 0.
        """
        ...

    def events(self, name: str | None = None) -> list[Event]:
        """Events of ``name`` (or of every deployment), oldest first."""
        ...

    def teardown(self, name: str) -> DeploymentStatus:
        """Stop ``name`` (only what this backend created). Idempotent."""
        ...

    def list(self) -> list[DeploymentStatus]:
        """Every deployment this backend created, oldest first."""
        ...



@runtime_checkable
class SimulatedBackend(ClusterBackend, Protocol):
    """A cluster backend whose Ready deployments are simulated, not served (the twin's).

    Their statuses list no endpoints; the bench server simulates them from the config and
    memory fit this returns (:class:`~mcp_servers.bench.targets.twin.TwinTarget`).
    """

    def ready_fit(self, name: str) -> tuple[ServingConfig, FitReport]:
        """Config and resolved memory layout of Ready deployment ``name``.

        Raises:
            BackendError: it is not Ready.
        """
        ...

def check_name(name: str, namespace: str) -> None:
    """Refuse a deployment name that is not a DNS-1123 label (so never a flag or a path).

    Raises:
        BackendError: with the rule.
    """
    if not NAME_RE.match(name):
        raise BackendError(f"deployment name {name!r} must be a DNS-1123 label (lowercase "
                           "letters, digits, '-', at most 52 characters, starting and ending "
                           f"with a letter or digit); namespace {namespace}")


def refuse_flag_values(config: ServingConfig) -> None:
    """Refuse a config whose text values start with '-' (they would be read as flags).

    ``ServingConfig`` validation already limits text fields to catalogs; this guards configs
    built without validation (``model_construct``) before they reach an argv.

    Raises:
        BackendError: naming the field.
    """
    for field, value in config.__dict__.items():
        if isinstance(value, str) and value.startswith("-"):
            raise BackendError(f"config.{field} = {value!r} starts with '-' and would be read as "
                               "a command-line flag; give a catalog value")


def settle(backend: ClusterBackend, name: str, wait_s: float,
           on_poll: Callable[[DeploymentStatus, float], None] | None = None,
           max_poll_s: float = 1.0) -> DeploymentStatus:
    """Poll ``status(name)`` until it leaves Pending or ``wait_s`` seconds have passed.

    Polls start 50 ms apart and back off to ``max_poll_s``. ``on_poll(status, elapsed_s)`` is
    called before each wait (for progress reports).
    """
    t0 = time.monotonic()
    st = backend.status(name)
    pause = 0.05
    while st.phase == "Pending" and (left := wait_s - (time.monotonic() - t0)) > 0:
        if on_poll is not None:
            on_poll(st, time.monotonic() - t0)
        time.sleep(min(pause, left))
        pause = min(pause * 1.5, max_poll_s)
        st = backend.status(name)
    return st


BACKEND_KINDS = ("twin", "local", "kubernetes")
MAX_HISTORY = 1000  # events kept of earlier deployments of one name


def make_backend(kind: str = "twin", namespace: str = "servetune", state_dir: Path | None = None,
                 command: list[str] | None = None, ready_timeout_s: float = 600.0,
                 visible_devices: list[str] | None = None, *, kubeconfig: Path | None = None,
                 context: str | None = None, gpu_budget: int | None = None,
                 image_allow: Sequence[str] | None = None, lws: bool = False,
                 sglang_options: Any = None,
                 model_token_secret: str | None = None,
                 router: str = "none") -> ClusterBackend:
    """The backend ``kind`` over ``state_dir`` (what the cluster and bench servers share).

    Args:
        kind: ``twin``, ``local`` or ``kubernetes``.
        namespace: the one namespace the backend acts in.
        state_dir: where records live; optional for the twin (None: in memory) and for
            ``kubernetes`` (records of torn-down deployments), required for ``local``.
        command: ``local`` only: server argv template (see
            :class:`~mcp_servers.cluster.local.LocalProcessBackend`); None: ``sglang serve``,
            or on a machine without a GPU (and no ``visible_devices``) the twin server
            (:data:`~mcp_servers.cluster.local.TWIN_SERVE_COMMAND`).
        ready_timeout_s: ``local`` only: seconds until a replica that is not Ready is Failed.
        visible_devices: ``local`` only: GPU ids handed out to replicas.
        kubeconfig: ``kubernetes`` only: kubeconfig file (None: ``$KUBECONFIG`` or
            ``~/.kube/config``, or the pod's service account in a pod).
        context: ``kubernetes`` only: kubeconfig context (None: the current one).
        gpu_budget: ``kubernetes`` only: GPUs the deployments may hold together (the sandbox
            policy's budget); None builds a read-only backend (the bench server's).
        image_allow: ``kubernetes`` only: allowed image prefixes (default the policy's:
            ``lmsysorg/sglang:``, ``ghcr.io/servetune/``).
        lws: ``kubernetes`` only: the sandbox Role grants LeaderWorkerSets (a replica spanning
            nodes).
        sglang_options: ``kubernetes`` only: a :class:`sandbox.manifests.SglangOptions`
            (None: its defaults); its ``dra`` also allows DRA claims in the policy, its DRA GPU
            and NIC DeviceClasses are the ones the policy allows.
        model_token_secret: ``kubernetes`` only: the one Secret the pods may read
            (``--model-token-secret``): the engine gets ``HF_TOKEN`` from its key ``token`` and
            the policy allows that Secret, by name, and no other (None: the options'
            ``hf_token_secret``, else no Secret).
        router: ``local`` only: ``sglang`` puts the pinned sglang-router in front of every
            deployment of 2+ replicas (:mod:`mcp_servers.cluster.router`; refused when it is
            not installed); ``none`` (default) lets the bench spread requests itself.

    Raises:
        BackendError: unknown kind, ``local`` without a state_dir, or a bad policy.
    """
    if router != "none" and kind != "local":
        raise BackendError(f"router {router!r} is an option of the local backend (Kubernetes: "
                           "SglangOptions.router, --router of servetune mcp cluster)")
    if kind == "twin":
        from mcp_servers.cluster.twin import TwinBackend  # twin imports this module

        return TwinBackend(namespace, state_dir)
    if kind == "local":
        from mcp_servers.cluster.local import (  # local imports this module
            TWIN_SERVE_COMMAND,
            LocalProcessBackend,
            gpu_present,
        )

        if state_dir is None:
            raise BackendError("the local backend needs a state_dir for its records and logs")
        if command is None and visible_devices is None and not gpu_present():
            log.info("no GPU on this machine: the local backend starts the twin server "
                     "(servetune twin serve); give a command to start another")
            command = list(TWIN_SERVE_COMMAND)
        return LocalProcessBackend(namespace, state_dir, command=command,
                                   ready_timeout_s=ready_timeout_s,
                                   visible_devices=visible_devices,
                                   router=router)  # type: ignore[arg-type]  # checked there
    if kind == "kubernetes":
        from pydantic import ValidationError

        from mcp_servers.cluster.kubeapi import RealKubeApi  # imports the kubernetes client
        from mcp_servers.cluster.kubernetes import KubernetesBackend
        from sandbox.manifests import SglangOptions
        from sandbox.podspec import check_subdomain
        from sandbox.policy import DEFAULT_DRA_GPU_CLASSES, DEFAULT_IMAGE_ALLOW, Policy

        try:
            opts = sglang_options if sglang_options is not None else SglangOptions()
            if model_token_secret is not None:
                check_subdomain(model_token_secret, "model_token_secret")
                opts = SglangOptions(**{**opts.model_dump(), "hf_token_secret":
                                        model_token_secret})
            gpu_classes = tuple(dict.fromkeys((*DEFAULT_DRA_GPU_CLASSES, opts.dra_gpu_class)))
            policy = None if gpu_budget is None else Policy(
                namespace, gpu_budget, tuple(image_allow or DEFAULT_IMAGE_ALLOW), lws=lws,
                dra=opts.dra, model_token_secret=opts.hf_token_secret,
                dra_gpu_classes=gpu_classes,
                dra_other_classes=(opts.dra_nic_class,) if opts.dra_nic_class else ())
        except ValidationError as e:  # the message names the option
            raise BackendError(e.errors()[0]["msg"].removeprefix("Value error, ")) from e
        except ValueError as e:
            raise BackendError(str(e)) from e
        return KubernetesBackend(namespace, RealKubeApi(namespace, kubeconfig, context), opts,
                                 policy, state_dir)
    raise BackendError(f"unknown cluster backend {kind!r}; choose one of "
                       f"{', '.join(BACKEND_KINDS)}")
