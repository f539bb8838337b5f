"""Kubernetes cluster backend: SGLang deployments rendered by :mod:`sandbox.manifests`.

``deploy`` renders the config with :func:`sandbox.manifests.render_sglang` (a Deployment of the
replicas, one Deployment per replica plus the router with ``opts.router``, or a LeaderWorkerSet
when a replica spans nodes; the Service ``<name>``), checks every object with the sandbox policy
(:func:`sandbox.policy.enforce`, the GPUs of the other live deployments counted as already used)
*before* applying anything, then server-side applies each object (field manager ``servetune``).
Re-deploying a live name with the same config applies the same objects again, which changes
nothing (server-side apply is idempotent); another config under a live name is refused, and an
object servetune did not create for that name is never overwritten.

The Service ``<name>`` is the deployment's record: its annotations hold the ServingConfig
(``servetune.io/config``), every applied object (``servetune.io/objects``) and the pods per
replica (``servetune.io/pods-per-replica``), so another process (the bench server) sees the same
deployments. Every object and pod carries ``app.kubernetes.io/managed-by=servetune`` and
``servetune.io/deployment=<name>``.

``status`` reads that Service and the pods labelled with the deployment
(:mod:`mcp_servers.cluster.kubeview`): Ready when every replica's pods (and the router's) are
Ready; ``endpoints`` are ``http://<pod IP>:<port>`` of the Ready replicas (a LeaderWorkerSet's
leaders), or with the router the Service URL ``http://<name>.<namespace>.svc:<port>`` in front
of it. Failed when a container terminated, restarted or is stuck (CrashLoopBackOff,
ImagePullBackOff...; ``exit_code`` of its last termination, ``failed_stage`` ``serving`` if this
backend saw that pod Ready before, else ``startup``), when a pod stayed unschedulable longer than
``unschedulable_timeout_s``, or when the deployment was not Ready ``ready_timeout_s`` after its
creation (the deadline). Else Pending, the message saying what it waits for. A Failed deployment
stays Failed (as this backend instance saw it) until it is torn down.

``logs`` reads a pod's log with timestamps (the previous container's when it restarted) and ends
with a ``servetune:`` line stating the kubelet's verdict (``container sglang: OOMKilled, exit code
137``) or, for a pod that never started, why (``Unschedulable: 0/4 nodes are available...``): the
deployer's failure classifier (``agents.deployer.classify`` over ``get_logs``) reads the engine's
own lines, and a person reads the verdict. ``events`` maps the core/v1 Events of the deployment's
objects, ReplicaSets and pods, plus this backend's own Applied / Ready / Failed / Deleted events.

``teardown`` deletes only objects that carry both labels (found by that label selector, for the
kinds the deployment applied), after saving its last status, events and log tail as a record (in
memory, or under ``state_dir/kubernetes/<namespace>/``) that later calls report as Terminated.
Secrets are never read, nothing is exec'd.

Longer than 500 lines on purpose: render, policy check, server-side apply, status, logs, events
and teardown of one deployment are one backend over one API client and one record (the Service).
"""

from __future__ import annotations

import builtins
import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from domain.config import ServingConfig
from mcp_servers.cluster.backend import (
    MAX_HISTORY,
    BackendError,
    CorruptRecord,
    DeploymentStatus,
    Event,
    LogLine,
    check_name,
    read_record,
    refuse_flag_values,
    scan_records,
    settle,
    when,
)
from mcp_servers.cluster.kubeapi import KubeApi, KubeApiError
from mcp_servers.cluster.kubeview import (
    PodView,
    log_lines,
    parse_time,
    pod_view,
    selector,
    to_event,
)
from mcp_servers.cluster.store import RecordStore
from sandbox.manifests import (
    ROLE_LABEL,
    SglangOptions,
    dra_api_version,
    render_sglang,
    server_nodes,
    service_url,
)
from sandbox.podspec import (
    COMPONENT_LABEL,
    DEPLOYMENT_LABEL,
    MANAGED_BY_LABEL,
    check_namespace,
)
from sandbox.policy import Policy, PolicyViolation, enforce, gpu_demand

log = logging.getLogger("servetune.cluster.kubernetes")

MANAGED_BY = {MANAGED_BY_LABEL: "servetune"}
CONFIG_ANNOTATION = "servetune.io/config"
OBJECTS_ANNOTATION = "servetune.io/objects"
PODS_ANNOTATION = "servetune.io/pods-per-replica"
# [[role, servers, pods per server], ...] of every server group ("" for an aggregated config's
# replicas; "prefill", "decode" for a PD layout)
SERVERS_ANNOTATION = "servetune.io/servers"
ROLE_ORDER = {"": 0, "server": 0, "prefill": 0, "decode": 1}
DEPLOYMENT = ("apps/v1", "Deployment")
LWS = ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
SERVICE = ("v1", "Service")
REPLICA_LABEL = "servetune.io/replica"  # sandbox.manifests: one Deployment per replica
LWS_GROUP = "leaderworkerset.sigs.k8s.io/group-index"  # kubernetes-sigs/lws pod labels
LWS_WORKER = "leaderworkerset.sigs.k8s.io/worker-index"
KEPT_LOG_LINES = 500  # of the failed (else first) pod, saved at teardown


class _Tombstone(BaseModel):
    """What is left of a torn-down deployment."""

    name: str
    config: ServingConfig
    labels: dict[str, str]
    created_at: float
    terminated_at: float
    replicas: int
    exit_code: int | None = None
    failed_stage: str | None = None
    message: str = ""
    events: list[Event] = []
    log: list[LogLine] = []


class _Seen(BaseModel):
    """What this backend remembers of one live deployment (its record's uid)."""

    uid: str
    ready_pods: set[str] = set()
    failed: DeploymentStatus | None = None
    ready_reported: bool = False


class _Live:
    """One live deployment as read now: its record (the Service) and its pods."""

    def __init__(self, name: str, record: dict[str, Any], pods: list[PodView]) -> None:
        self.name, self.record = name, record
        ann = _meta(record).get("annotations") or {}
        try:
            self.config = ServingConfig.model_validate_json(ann.get(CONFIG_ANNOTATION) or "")
        except ValidationError as e:
            raise CorruptRecord(name, None, f"the annotation {CONFIG_ANNOTATION} of Service "
                                f"{name} is not a ServingConfig ({e.error_count()} errors, "
                                f"first: {e.errors()[0]['msg']})") from e
        try:
            refs = json.loads(ann.get(OBJECTS_ANNOTATION) or "[]")
            self.objects = [(str(a), str(k), str(n)) for a, k, n in refs]
            self.per_replica = max(1, int(ann.get(PODS_ANNOTATION) or 1))
            groups = json.loads(ann.get(SERVERS_ANNOTATION) or "null") or [
                ["", self.config.replicas, self.per_replica]]
            self.servers = [(str(r), int(n), max(1, int(k))) for r, n, k in groups]
        except (ValueError, TypeError) as e:
            raise CorruptRecord(name, None, f"the annotations {OBJECTS_ANNOTATION} / "
                                f"{PODS_ANNOTATION} of Service {name} are unreadable: {e}") from e
        self.router = [p for p in pods if p.labels.get(COMPONENT_LABEL) == "router"]
        self.pods = [p for p in pods if p.labels.get(COMPONENT_LABEL) != "router"]
        self.all_pods = pods

    def replicas(self) -> list[list[PodView]]:
        """Engine pods per server, leader first (a LeaderWorkerSet group, else one pod).

        A PD layout's prefill servers come first, then its decode servers.
        """
        def role(p: PodView) -> int:
            return ROLE_ORDER.get(p.labels.get(ROLE_LABEL, ""), 2)

        def key(p: PodView) -> tuple[int, int, int, float, str]:
            group = p.labels.get(LWS_GROUP, p.labels.get(REPLICA_LABEL, "-1"))
            worker = p.labels.get(LWS_WORKER, "0")
            return (role(p), _int(group), _int(worker), p.created, p.name)

        pods = sorted(self.pods, key=key)
        if not any(LWS_GROUP in p.labels or REPLICA_LABEL in p.labels for p in pods):
            return [[p] for p in pods]
        groups: dict[tuple[int, str], list[PodView]] = {}
        for p in pods:
            groups.setdefault((role(p), p.labels.get(LWS_GROUP, p.labels.get(REPLICA_LABEL, ""))),
                              []).append(p)
        return [groups[k] for k in sorted(groups, key=lambda k: (k[0], _int(k[1])))]

    @property
    def pd(self) -> bool:
        """Whether this deployment is a PD layout (its groups are prefill and decode)."""
        return any(r in ("prefill", "decode") for r, _, _ in self.servers)

    def ready_servers(self) -> dict[str, int]:
        """Ready servers per role: groups with all their pods, every one Ready."""
        pods = {r: k for r, _, k in self.servers}
        out = {r: 0 for r, _, _ in self.servers}
        for g in self.replicas():
            r = g[0].labels.get(ROLE_LABEL, "") if self.pd else self.servers[0][0]
            if r in out and len(g) >= pods[r] and all(p.ready for p in g):
                out[r] += 1
        return out


def _int(text: str) -> int:
    return int(text) if text.isdigit() else 1 << 30


def _meta(obj: dict[str, Any]) -> dict[str, Any]:
    m = obj.get("metadata")
    return m if isinstance(m, dict) else {}


def _ref(obj: dict[str, Any]) -> tuple[str, str, str]:
    return str(obj.get("apiVersion")), str(obj.get("kind")), str(_meta(obj).get("name"))


def _ours(obj: dict[str, Any], name: str) -> bool:
    labels = _meta(obj).get("labels") or {}
    return labels.get(MANAGED_BY_LABEL) == "servetune" and labels.get(DEPLOYMENT_LABEL) == name


class KubernetesBackend:
    """Deployments on a Kubernetes cluster through :class:`KubeApi`; see the module docstring."""

    kind = "kubernetes"

    def __init__(self, namespace: str, api: KubeApi, opts: SglangOptions | None = None,
                 policy: Policy | None = None, state_dir: Path | None = None,
                 ready_timeout_s: float | None = None, unschedulable_timeout_s: float = 600.0,
                 clock: Callable[[], float] = time.time) -> None:
        """Build the backend (contacts nothing).

        Args:
            namespace: the one namespace it acts in (DNS-1123 label; ``api`` must use it).
            api: the Kubernetes calls (:class:`~mcp_servers.cluster.kubeapi.RealKubeApi`).
            opts: cluster facts for rendering (default ``SglangOptions()``: 8 GPUs per node,
                port 30000, a 1800 s startup budget).
            policy: the sandbox policy every apply must pass; None makes a read-only backend
                whose ``deploy`` is refused (the bench server's view of the deployments).
            state_dir: where records of torn-down deployments live
                (``state_dir/kubernetes/<namespace>/``); None keeps them in memory.
            ready_timeout_s: the deadline: a deployment not Ready this long after its creation
                is Failed (default: the startup probe's budget ``opts.startup_budget_s`` plus
                600 s for scheduling and the image pull).
            unschedulable_timeout_s: a pod the scheduler could not place for this long fails
                the deployment (seconds).
            clock: epoch seconds now (tests pass a fake clock).

        Raises:
            BackendError: bad namespace, or a policy or api for another namespace.
        """
        try:
            check_namespace(namespace)
        except ValueError as e:
            raise BackendError(str(e)) from e
        if getattr(api, "namespace", namespace) != namespace:
            raise BackendError(f"the Kubernetes client acts in {api.namespace!r}, not "
                               f"{namespace!r}")
        if policy is not None and policy.namespace != namespace:
            raise BackendError(f"the policy is for namespace {policy.namespace!r}, not "
                               f"{namespace!r}")
        self.namespace, self.api, self.policy = namespace, api, policy
        self.opts = opts if opts is not None else SglangOptions()
        self.ready_timeout_s = (ready_timeout_s if ready_timeout_s is not None
                                else float(self.opts.startup_budget_s) + 600.0)
        self.unschedulable_timeout_s = unschedulable_timeout_s
        self.clock = clock
        self._store = RecordStore(None if state_dir is None
                                  else state_dir / "kubernetes" / namespace)
        self._seen: dict[str, _Seen] = {}  # by deployment name
        self._own: dict[str, list[Event]] = {}  # this backend's events, by deployment name

    # ----- API calls ---------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except KubeApiError as e:
            hint = ""
            if e.status == 403:
                hint = (f" The service account lacks this permission in namespace "
                        f"{self.namespace}: bind the sandbox Role to it (servetune sandbox "
                        "render).")
            elif e.status == 0:
                hint = " Check --kubeconfig / --context and that the cluster is reachable."
                raise BackendError(f"cannot reach Kubernetes to {what}: {e}.{hint}") from e
            raise BackendError(f"Kubernetes refused to {what}: {e}.{hint}") from e

    def _kinds(self) -> list[tuple[str, str]]:
        """Workload kinds the backend may have applied (LWS / DRA only when the Role has them)."""
        lws = self.policy is None or self.policy.lws
        out = [DEPLOYMENT] + ([LWS] if lws else [])
        if self.policy is not None and self.policy.dra:
            out.append((dra_api_version(self.opts.k8s_version), "ResourceClaimTemplate"))
        return out

    def _record(self, name: str) -> dict[str, Any] | None:
        """The Service ``name`` if it is a servetune deployment's record."""
        svc = self._call(f"get Service {name}", self.api.get, *SERVICE, name)
        if svc is None or not _ours(svc, name) or \
                CONFIG_ANNOTATION not in (_meta(svc).get("annotations") or {}):
            return None
        return dict(svc)

    def _live(self, name: str, record: dict[str, Any]) -> _Live:
        raw = self._call(f"list the pods of {name}", self.api.list, "v1", "Pod",
                         selector({DEPLOYMENT_LABEL: name}))
        pods = [p for p in map(pod_view, raw) if not p.terminating]
        return _Live(name, record, pods)

    def _records(self) -> builtins.list[dict[str, Any]]:
        svcs = self._call("list Services", self.api.list, *SERVICE, selector(MANAGED_BY))
        return [s for s in svcs
                if (_meta(s).get("labels") or {}).get(DEPLOYMENT_LABEL) == _meta(s).get("name")
                and CONFIG_ANNOTATION in (_meta(s).get("annotations") or {})]

    # ----- deploy ------------------------------------------------------------------------

    def deploy(self, name: str, config: ServingConfig, labels: dict[str, str],
               wait_s: float = 0.0) -> DeploymentStatus:
        """Render, check against the policy, server-side apply; wait up to ``wait_s`` s.

        Raises:
            BackendError: invalid name or labels; a read-only backend; the policy refused an
                object (nothing applied; the message lists every reason); the name is live with
                another config or held by an object servetune did not create for it; the API
                refused a call.
        """
        check_name(name, self.namespace)
        refuse_flag_values(config)
        if self.policy is None:
            raise BackendError("this Kubernetes backend is read-only (built without a GPU "
                               "budget); deploy through the cluster server (servetune mcp "
                               "cluster --backend kubernetes --gpu-budget N)")
        try:
            objs = render_sglang(config, name, self.namespace, {**labels, **MANAGED_BY},
                                 opts=self.opts)
        except ValueError as e:
            raise BackendError(f"cannot render deployment {name!r}: {e}") from e
        record = next((o for o in objs if _ref(o) == (*SERVICE, name)), None)
        if record is None:
            raise BackendError(f"the rendered manifests hold no Service {name!r}; nothing "
                               "was applied")
        lws = [o for o in objs if o.get("kind") == LWS[1]]
        per_replica = (lws[0].get("spec", {}).get("leaderWorkerTemplate", {}).get("size", 1)
                       if lws else 1)
        refs = [list(_ref(o)) for o in objs]
        ann = {CONFIG_ANNOTATION: config.model_dump_json(), OBJECTS_ANNOTATION: json.dumps(refs),
               PODS_ANNOTATION: str(per_replica)}
        if config.pd is not None:  # rendered already, so every group splits evenly
            ann[SERVERS_ANNOTATION] = json.dumps(
                [[role, n, server_nodes(c, self.opts.gpus_per_node)]
                 for role, n, c in config.servers()])
        _meta(record).setdefault("annotations", {}).update(ann)
        live = self._record(name)
        if live is not None:
            self._check_redeploy(name, config, live)
        try:
            enforce(objs, self.policy, already_used=self._gpus_in_use(name))
        except PolicyViolation as e:
            raise BackendError(str(e)) from e
        for o in objs:
            found = self._call(f"get {o['kind']} {_meta(o)['name']}", self.api.get, *_ref(o))
            if found is not None and not _ours(found, name):
                raise BackendError(f"{o['kind']} {_meta(o)['name']!r} exists in namespace "
                                   f"{self.namespace} and servetune did not create it for "
                                   f"{name!r}; choose another deployment name")
        if live is None:
            self._seen.pop(name, None)
        for o in objs:
            self._call(f"apply {o['kind']} {_meta(o)['name']}", self.api.apply, o)
        self._own.setdefault(name, []).append(Event(
            t=self.clock(), type="Normal", reason="Applied", object=name,
            message="server-side applied " + ", ".join(f"{k}/{n}" for _, k, n in refs) +
            f" (config {config.config_id()}, field manager servetune)"))
        st = self.status(name)
        return settle(self, name, wait_s) if st.phase == "Pending" and wait_s > 0 else st

    def _check_redeploy(self, name: str, config: ServingConfig, record: dict[str, Any]) -> None:
        try:
            old = _Live(name, record, []).config
        except CorruptRecord as e:
            raise BackendError(f"deployment {name!r} exists but its config cannot be read; "
                               f"tear it down first ({e.reason})") from e
        if old.config_id() != config.config_id():
            raise BackendError(f"deployment {name!r} already runs config {old.config_id()}; "
                               f"tear it down before deploying config {config.config_id()} "
                               "under this name, or choose another name")

    def _gpus_in_use(self, name: str) -> int:
        """GPUs the other servetune deployments of the namespace hold (from their objects)."""
        objs = [o for api_version, kind in self._kinds()
                for o in self._call(f"list {kind}s", self.api.list, api_version, kind,
                                    selector(MANAGED_BY))
                if (_meta(o).get("labels") or {}).get(DEPLOYMENT_LABEL) != name]
        return gpu_demand(objs, self.policy)

    # ----- status ------------------------------------------------------------------------

    def status(self, name: str) -> DeploymentStatus:
        """Status of ``name`` after one look at its record and pods.

        Raises:
            BackendError: no such deployment; CorruptRecord: its record is unreadable.
        """
        check_name(name, self.namespace)
        record = self._record(name)
        if record is None:
            return self._tombstone_status(self._tombstone(name, required=True))
        return self._status(self._live(name, record))

    def _status(self, d: _Live, with_log: bool = True) -> DeploymentStatus:
        name, config, meta = d.name, d.config, _meta(d.record)
        created = parse_time(meta.get("creationTimestamp")) or 0.0
        uid = str(meta.get("uid") or meta.get("creationTimestamp") or "")
        seen = self._seen.get(name)
        if seen is None or seen.uid != uid:
            seen = self._seen[name] = _Seen(uid=uid)
        base: dict[str, Any] = dict(name=name, namespace=self.namespace, replicas=config.replicas,
                                    config=config, labels=dict(meta.get("labels") or {}),
                                    created_at=created)
        seen.ready_pods.update(p.uid for p in d.all_pods if p.ready)
        if seen.failed is not None:
            return seen.failed
        now = self.clock()
        failed = [p for p in d.all_pods if p.failure is not None]
        if failed:
            p = min(failed, key=lambda x: (x.failure.at if x.failure else None) or now)
            f = p.failure
            assert f is not None
            stage = "serving" if p.uid in seen.ready_pods else "startup"
            last = self._last_line(p, f.container, f.previous) if with_log else ""
            return self._fail(seen, base, f.exit_code, stage, f"pod {p.name} {f.line()}" +
                              (f"; last log line: {last}" if last else ""))
        stuck = [p for p in d.all_pods if p.unschedulable_since is not None and
                 now - p.unschedulable_since > self.unschedulable_timeout_s]
        if stuck:
            p = stuck[0]
            return self._fail(seen, base, None, "startup", f"pod {p.name} could not be "
                              f"scheduled for {now - (p.unschedulable_since or now):.0f} s: "
                              f"{p.waiting}")
        ready = [g for g in d.replicas() if len(g) >= d.per_replica and all(p.ready for p in g)]
        n_ready = min(len(ready), config.replicas)
        router_ready = bool(d.router) and all(p.ready for p in d.router)
        with_router = any(k == "Deployment" and n == f"{name}-router" for _, k, n in d.objects)
        if with_router:
            urls = [service_url(name, self.namespace, self.opts.port)] if router_ready else []
        else:
            urls = [f"http://{g[0].ip}:{self.opts.port}" for g in ready if g[0].ip]
        servers_up = True
        if d.pd:  # every group's servers, then the router (its one entry point) is the replica
            up = d.ready_servers()
            servers_up = all(up[r] >= n for r, n, _ in d.servers)
            n_ready = int(servers_up and router_ready)
            ready = [g for g in d.replicas() if all(p.ready for p in g)]
        if n_ready >= config.replicas and servers_up and (router_ready or not with_router):
            pods = [p for g in ready for p in g] + d.router
            startup = max(0.0, max((p.ready_at or created) for p in pods) - created)
            if not seen.ready_reported:
                seen.ready_reported = True
                self._own.setdefault(name, []).append(Event(
                    t=now, type="Normal", reason="Ready", object=name,
                    message=f"{n_ready}/{config.replicas} replicas ready after {startup:.1f} s"))
            return DeploymentStatus(**base, phase="Ready", ready_replicas=n_ready,
                                    endpoints=urls[:config.replicas], startup_s=round(startup, 3),
                                    message=f"{n_ready}/{config.replicas} replicas ready")
        waiting = next((p for p in d.all_pods if not p.ready), None)
        if now - created > self.ready_timeout_s:
            why = f"pod {waiting.name}: {waiting.waiting}" if waiting else "too few pods"
            return self._fail(seen, base, None, "startup",
                              f"not Ready {self.ready_timeout_s:g} s after creation "
                              f"({n_ready}/{config.replicas} replicas ready); {why}")
        if waiting is None and d.pd:
            up = d.ready_servers()
            msg = ("ready servers: " + ", ".join(f"{r} {up[r]}/{n}" for r, n, _ in d.servers) +
                   "; waiting for the rest")
        elif waiting is None:
            msg = (f"{len(d.pods)} engine pods for {config.replicas} replicas x "
                   f"{d.per_replica}: waiting for the rest")
        else:
            last = self._last_line(waiting, waiting.main, False) if (
                waiting.started and with_log) else ""
            msg = f"pod {waiting.name}: {last or waiting.waiting}"
        return DeploymentStatus(**base, phase="Pending", ready_replicas=n_ready,
                                endpoints=urls, message=msg)

    def _fail(self, seen: _Seen, base: dict[str, Any], exit_code: int | None, stage: str,
              message: str) -> DeploymentStatus:
        seen.failed = DeploymentStatus(**base, phase="Failed", ready_replicas=0,
                                       exit_code=exit_code, failed_stage=stage, message=message)
        self._own.setdefault(base["name"], []).append(Event(
            t=self.clock(), type="Warning", reason="Failed", object=base["name"],
            message=f"stage {stage}, exit code {exit_code}: {message}"))
        return seen.failed

    def _last_line(self, pod: PodView, container: str, previous: bool) -> str:
        """The last non-empty log line of a container (one API call; '' if none)."""
        try:
            text = self.api.pod_logs(pod.name, container or None, 5, previous)
        except KubeApiError as e:
            log.info("no log of %s/%s: %s", pod.name, container, e)
            return ""
        lines = [ln.text for ln in log_lines(text, self.clock()) if ln.text.strip()]
        return lines[-1] if lines else ""

    # ----- logs and events ---------------------------------------------------------------

    def logs(self, name: str, replica: int | None = None) -> builtins.list[LogLine]:
        """Log of one replica's pod (a LeaderWorkerSet's leader), ending with a servetune line.

        ``replica`` picks it; by default the first pod that failed (the router's too), else
        replica 0. After a teardown: the log tail saved then.

        Raises:
            BackendError: unknown name or replica index.
        """
        check_name(name, self.namespace)
        record = self._record(name)
        if record is None:
            tomb = self._tombstone(name, required=True)
            assert tomb is not None
            if replica is not None and not 0 <= replica < tomb.replicas:
                raise BackendError(f"{name} has replicas 0..{tomb.replicas - 1}")
            return list(tomb.log)
        d = self._live(name, record)
        n = sum(c for _, c, _ in d.servers)  # a PD layout: its prefill, then decode servers
        if replica is not None and not 0 <= replica < n:
            raise BackendError(f"{name} has replicas 0..{n - 1}" + (
                " (prefill servers first, then decode)" if d.pd else ""))
        return self._pod_log(d, replica)

    def _pod_log(self, d: _Live, replica: int | None,
                 tail: int = 10_000) -> builtins.list[LogLine]:
        groups = d.replicas()
        if replica is None:
            failed = [p for p in d.all_pods if p.failure is not None]
            pod = (min(failed, key=lambda p: (p.failure.at if p.failure else None) or 0.0)
                   if failed else (groups[0][0] if groups else None))
        else:
            pod = groups[replica][0] if replica < len(groups) and groups[replica] else None
        now = self.clock()
        if pod is None:
            return [LogLine(t=now, text="servetune: no pod of this replica exists yet")]
        f = pod.failure
        out: list[LogLine] = []
        if pod.started:
            try:
                text = self.api.pod_logs(pod.name, (f.container if f else pod.main) or None,
                                         tail, bool(f and f.previous))
                out = log_lines(text, pod.created)
            except KubeApiError as e:
                out = [LogLine(t=now, text=f"servetune: no log of pod {pod.name}: {e}")]
        if f is not None:
            out.append(LogLine(t=f.at or now, text=f"servetune: pod {pod.name} {f.line()}"))
        elif not pod.started:
            out.append(LogLine(t=now, text=f"servetune: pod {pod.name} has not started: "
                                           f"{pod.waiting}"))
        return out

    def events(self, name: str | None = None) -> builtins.list[Event]:
        """Kubernetes Events of the deployment's objects and pods, and this backend's; by time.

        Without ``name``: of every deployment, live or torn down; an unreadable teardown record
        adds a Warning event (reason CorruptRecord) naming its file.

        Raises:
            BackendError: unknown name.
        """
        bad: list[CorruptRecord] = []
        if name is not None:
            check_name(name, self.namespace)
            record = self._record(name)
            tomb = self._tombstone(name, required=record is None)
            live = {name: record} if record is not None else {}
            tombs = {name: tomb} if tomb is not None else {}
        else:
            live = {str(_meta(r).get("name")): r for r in self._records()}
            recs, bad = scan_records(self._store, _Tombstone)
            tombs = {t.name: t for t in recs}
        raw = self._call("list Events", self.api.events, None) if live else []
        out = [b.event() for b in bad]
        for n, record in live.items():
            try:
                out += self._k8s_events(self._live(n, record), raw)
            except CorruptRecord as e:
                out.append(e.event())
        for n in set(live) | set(tombs):
            if n in tombs:
                out += tombs[n].events  # earlier runs of this name
            if n in live:
                out += self._own.get(n, [])
        return sorted(out, key=lambda e: e.t)

    @staticmethod
    def _k8s_events(d: _Live, raw: builtins.list[dict[str, Any]]) -> builtins.list[Event]:
        names = {d.name, *(n for _, _, n in d.objects), *(p.name for p in d.all_pods)}
        owners = {o for p in d.all_pods for o in p.owners}
        names |= owners
        # pods replaced since (ReplicaSet pods: <rs>-<5 chars>; StatefulSet pods: <sts>-<i>)
        pod_of = re.compile("^(" + "|".join(map(re.escape, sorted(owners))) +
                            r")-[a-z0-9]+$") if owners else None
        out = []
        for ev in raw:
            inv = ev.get("involvedObject") or {}
            n = str(inv.get("name", ""))
            if n in names or (pod_of is not None and inv.get("kind") == "Pod" and
                              pod_of.match(n)):
                out.append(to_event(ev, d.name))
        return out

    # ----- teardown and list -------------------------------------------------------------

    def teardown(self, name: str) -> DeploymentStatus:
        """Delete every object of ``name`` that carries servetune's labels; idempotent.

        Raises:
            BackendError: no such deployment (live or torn down); or its record was unreadable
                (its objects are deleted all the same; the message says which).
        """
        check_name(name, self.namespace)
        record = self._record(name)
        live = None
        try:
            live = self._live(name, record) if record is not None else None
        except CorruptRecord as e:
            deleted = self._delete(self._labelled(name, None))
            raise BackendError(f"deleted {', '.join(deleted) or 'nothing'} of {name!r}; its "
                               f"record was unreadable ({e.reason}), so there is no status to "
                               f"report. {name!r} can be deployed again.") from e
        targets = self._labelled(name, live)
        if live is None and not targets:
            return self._tombstone_status(self._tombstone(name, required=True))
        now = self.clock()
        tomb = self._bury(live, now) if live is not None else self._tombstone(name, False)
        deleted = self._delete(targets)
        if tomb is None:
            raise BackendError(f"deleted {', '.join(deleted)} of {name!r} (its record, the "
                               f"Service {name}, was already gone, so there is no status to "
                               "report)")
        tomb.events.append(Event(t=now, type="Normal", reason="Deleted", object=name,
                                 message=f"deleted {', '.join(deleted) or 'nothing'}"))
        with self._store.locked():
            self._store.write(name, tomb.model_dump(mode="json"))
        self._seen.pop(name, None)
        self._own.pop(name, None)
        return self._tombstone_status(tomb)

    def _labelled(self, name: str, live: _Live | None) -> builtins.list[dict[str, Any]]:
        """Objects to delete: those of the applied kinds carrying both labels, workloads first."""
        sel = selector({**MANAGED_BY, DEPLOYMENT_LABEL: name})
        kinds = {*self._kinds(), SERVICE}
        if live is not None:
            kinds |= {(a, k) for a, k, _ in live.objects}
        found: dict[tuple[str, str, str], dict[str, Any]] = {}
        for api_version, kind in sorted(kinds):
            try:
                items = self.api.list(api_version, kind, sel)
            except KubeApiError as e:
                if (api_version, kind) in (DEPLOYMENT, SERVICE):
                    raise BackendError(f"Kubernetes refused to list {kind}s: {e}") from e
                log.info("teardown of %s: cannot list %s (%s)", name, kind, e)
                continue
            for o in items:
                if _ours(o, name):
                    found[_ref(o)] = o
        return sorted(found.values(), key=lambda o: (o.get("kind") == "Service", _ref(o)))

    def _delete(self, objs: builtins.list[dict[str, Any]]) -> builtins.list[str]:
        done = []
        for o in objs:
            api_version, kind, n = _ref(o)
            self._call(f"delete {kind} {n}", self.api.delete, api_version, kind, n)
            done.append(f"{kind}/{n}")
        return done

    def _bury(self, d: _Live, now: float) -> _Tombstone:
        """The record of ``d`` as it is torn down: last status, events, log tail."""
        st = self._status(d, with_log=False)
        try:
            kept = self._pod_log(d, None, KEPT_LOG_LINES)
        except BackendError as e:
            kept = [LogLine(t=now, text=f"servetune: the log could not be saved: {e}")]
        try:
            events = self.events(d.name)
        except BackendError as e:
            old = self._tombstone(d.name, required=False)
            events = [*(old.events if old else []), *self._own.get(d.name, []),
                      Event(t=now, type="Warning", reason="EventsLost", object=d.name,
                            message=f"the events could not be read before deletion: {e}")]
        return _Tombstone(name=d.name, config=st.config, labels=st.labels,
                          created_at=st.created_at, terminated_at=now, replicas=st.replicas,
                          exit_code=st.exit_code, failed_stage=st.failed_stage,
                          message=st.message, events=events[-MAX_HISTORY:],
                          log=kept[-KEPT_LOG_LINES:])

    def _tombstone(self, name: str, required: bool) -> _Tombstone | None:
        tomb = read_record(self._store, name, _Tombstone)
        if tomb is None and required:
            known = ", ".join(sorted(str(_meta(r).get("name")) for r in self._records()))
            raise BackendError(f"no deployment {name!r} in namespace {self.namespace}; live: "
                               f"{known or 'none'}. Call list_deployments to see them.")
        return tomb

    def _tombstone_status(self, tomb: _Tombstone | None) -> DeploymentStatus:
        assert tomb is not None
        return DeploymentStatus(
            name=tomb.name, namespace=self.namespace, phase="Terminated", replicas=tomb.replicas,
            ready_replicas=0, config=tomb.config, labels=tomb.labels, created_at=tomb.created_at,
            exit_code=tomb.exit_code, failed_stage=tomb.failed_stage,
            message=f"torn down at {when(tomb.terminated_at)}; before: {tomb.message}")

    def list(self) -> builtins.list[DeploymentStatus]:
        """Every live deployment (each looked at once) and every torn-down one, oldest first.

        A live deployment whose record is unreadable is skipped (logged; ``events()`` reports
        it as a CorruptRecord warning).
        """
        out: dict[str, DeploymentStatus] = {}
        for record in self._records():
            n = str(_meta(record).get("name"))
            try:
                out[n] = self._status(self._live(n, record))
            except CorruptRecord as e:
                log.warning("skipping a deployment: %s", e)
        for tomb in scan_records(self._store, _Tombstone)[0]:
            out.setdefault(tomb.name, self._tombstone_status(tomb))
        return sorted(out.values(), key=lambda s: s.created_at)
