"""Kubernetes manifests of one SGLang deployment, rendered from a ServingConfig.

``render_sglang`` gives the objects the Kubernetes backend applies for one trial: the engine
(a Deployment, or a LeaderWorkerSet when one replica spans nodes), the Service clients use
(``http://<name>.<namespace>.svc:<port>``), and optionally the SGLang router and a DRA
ResourceClaimTemplate. Every pod meets the ``restricted`` Pod Security profile: it runs as
uid 1000 with every capability dropped, and the caches SGLang writes (HOME, /tmp, the JIT caches
under ``SGLANG_CACHE_DIR``, the Hugging Face cache) are volumes, so the image's root-owned
paths are never written.

Facts used here come from servetune's SGLang reference (``sglang-knobs.md``, SGLang 0.5.23,
sglang-router 0.3.2) and the LeaderWorkerSet sources (kubernetes-sigs/lws v0.10.0); each
constant names its source. The sandbox the backend runs in is rendered by
``sandbox.namespace.render_sandbox`` (re-exported here).

Longer than 500 lines on purpose: every layout (one node, LeaderWorkerSet, PD groups and
the PD router) renders from the same pod spec and labels, which the policy checks as one set.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from domain.config import ServingConfig
from domain.engines import engine_for
from domain.trial import manifest_for
from sandbox.namespace import render_sandbox
from sandbox.podspec import (
    COMPONENT_LABEL,
    DEPLOYMENT_LABEL,
    check_image,
    check_labels,
    check_name,
    check_quantity,
    check_subdomain,
    container_security,
    pod_security,
)
from sandbox.validate import minor

__all__ = ["SglangOptions", "dra_api_version", "render_sandbox", "render_sglang",
           "service_url"]

HEALTH_PATH = "/health"
# /health blocks up to SGLANG_HEALTH_CHECK_TIMEOUT = 20 s waiting for one generated token
# (sglang-knobs.md 5 and 7.2), so every probe on it waits longer than that.
PROBE_TIMEOUT_S = 30
PROBE_PERIOD_S = 10
READY_FAILURES = 3          # sglang-knobs.md 7.2 readinessProbe
LIVENESS_PERIOD_S = 30      # sglang-knobs.md 7.2 livenessProbe: lenient, a long prefill
LIVENESS_FAILURES = 5       # can starve the health request
DIST_INIT_PORT = 20000      # torch.distributed rendezvous, as kubernetes-sigs/lws
#                             docs/examples/sglang/lws.yaml
ROUTER_METRICS_PORT = 29000  # sglang-router 0.3.2 --prometheus-port default (sglang-knobs.md 6)
# Standard DRA attribute: devices under one PCIe root (kubernetes.io/docs/reference/node/
# dra-standard-device-attributes/).
PCIE_ROOT_ATTRIBUTE = "resource.kubernetes.io/pcieRoot"
# --disaggregation-bootstrap-port default: the prefill server's KV bootstrap service, which the
# router names with each prefill URL (sglang-knobs.md 1.11 and 6.3)
BOOTSTRAP_PORT = 8998
ROLE_LABEL = "servetune.io/role"        # prefill | decode (a PD layout's engine pods)
REPLICA_LABEL = "servetune.io/replica"  # one Deployment per server: its index
KV_TRANSFER_ANNOTATION = "servetune.io/kv-transfer"
# --disaggregation-transfer-backend values that move the KV over RDMA verbs (sglang-knobs.md
# 1.11: mooncake and nixl need RDMA NICs, --disaggregation-ib-device, unless mooncake_tcp)
RDMA_TRANSFER = ("mooncake", "nixl", "mori")
CACHE_DIR = "/cache"
HOME_DIR = "/home/sglang"
DRA_CLAIM = "devices"
# Longest deployment name: leaves room for '-router', '-r<i>' and LWS pod suffixes in 63.
MAX_NAME = 40


class SglangOptions(BaseModel):
    """How a ServingConfig becomes Kubernetes objects (cluster facts, not tuning knobs)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    image: str | None = Field(None, description="engine image; None = lmsysorg/sglang:v<engine "
                              "version> (domain.trial.manifest_for)")
    gpus_per_node: int = Field(8, ge=1, le=64, description="GPUs of one node; a server with "
                               "more GPUs (tp x pp x dp) spans nodes as a LeaderWorkerSet")
    model_cache_pvc: str | None = Field(None, description="PVC mounted at /cache for weights "
                                        "(HF_HOME) and JIT caches; None = an emptyDir per pod "
                                        "(ReadWriteMany when replicas share it)")
    router: bool = Field(False, description="put the SGLang router (config.router_policy) in "
                         "front of the replicas")
    dra: bool = Field(False, description="GPUs (and NICs) through a DRA ResourceClaimTemplate "
                      "instead of the nvidia.com/gpu device-plugin resource")
    k8s_version: str = Field("1.33", description="target Kubernetes release; picks the DRA "
                             "apiVersion")
    startup_budget_s: int = Field(1800, ge=60, description="seconds the startup probe allows "
                                  "for weight load + graph capture (DeepSeek-class models "
                                  "take 10-30+ min, sglang-knobs.md 7.3)")
    port: int = Field(30000, ge=1, le=65535, description="HTTP port of engine and router")
    shm_size: str = Field("32Gi", description="/dev/shm size (sglang-knobs.md 7.2 template)")
    cpu_per_gpu: int = Field(8, ge=1, description="CPU request per GPU: a sizing default, "
                             "not a measurement")
    memory_per_gpu_gib: int = Field(64, ge=1, description="memory request and limit per GPU, "
                                    "GiB; must hold /dev/shm and the HiCache host pool")
    hf_token_secret: str | None = Field(None, description="Secret whose key 'token' becomes "
                                        "HF_TOKEN (optional: gated models need it)")
    dra_gpu_class: str = Field("gpu.nvidia.com", description="DeviceClass of the NVIDIA DRA "
                               "GPU driver")
    dra_nic_class: str | None = Field(None, description="DeviceClass of NICs (e.g. 'dranet'); "
                                      "set: one NIC per GPU under the same PCIe root")

    @field_validator("model_cache_pvc", "hf_token_secret", "dra_gpu_class", "dra_nic_class")
    @classmethod
    def _object_name(cls, value: str | None, info: Any) -> str | None:
        """PVC, Secret and DeviceClass names are DNS-1123 subdomains."""
        return None if value is None else check_subdomain(value, info.field_name)

    @field_validator("shm_size")
    @classmethod
    def _quantity(cls, value: str) -> str:
        return check_quantity(value, "shm_size")

    @field_validator("image")
    @classmethod
    def _image(cls, value: str | None) -> str | None:
        return None if value is None else check_image(value)


def dra_api_version(k8s_version: str) -> str:
    """The ``resource.k8s.io`` apiVersion the release serves by default.

    v1 is GA from 1.34, v1beta2 from 1.33, v1beta1 (structured parameters) from 1.32
    (Kubernetes release notes; kubernetes-validate ships the matching schemas).

    Raises:
        ValueError: before 1.32 (only the v1alpha3 API, off by default).
    """
    n = minor(k8s_version)
    if n >= 34:
        return "resource.k8s.io/v1"
    if n == 33:
        return "resource.k8s.io/v1beta2"
    if n == 32:
        return "resource.k8s.io/v1beta1"
    raise ValueError(f"DRA needs Kubernetes 1.32 or later (resource.k8s.io/v1beta1 with "
                     f"structured parameters); {k8s_version} has no usable DRA API")


def service_url(name: str, namespace: str, port: int = 30000) -> str:
    """The URL of a Service inside the cluster: ``http://<name>.<namespace>.svc:<port>``."""
    return f"http://{name}.{namespace}.svc:{port}"


def render_sglang(config: ServingConfig, name: str, namespace: str, labels: dict[str, str], *,
                  opts: SglangOptions = SglangOptions()) -> list[dict[str, Any]]:  # noqa: B008
    """The objects that serve ``config`` as deployment ``name`` in ``namespace``.

    Layouts (``replicas`` = config.replicas; GPUs per server = ``config.gpus_per_server``,
    tp x pp x dp; attention DP and EP live inside the TP group and add no GPU):

    - one server fits a node, no router: Deployment ``name`` (replicas pods) + Service ``name``.
    - with ``opts.router``: one Deployment and Service ``name-r<i>`` per replica (a stable DNS
      name per worker for ``--worker-urls``), Deployment ``name-router``; Service ``name``
      selects the router.
    - a server spans nodes (``gpus_per_server > gpus_per_node``): LeaderWorkerSet
      ``name-engine``, one group of ``config.nnodes(gpus_per_node)`` pods per replica
      (``--nnodes``/``--node-rank``/``--dist-init-addr`` from the LWS env); Service ``name``
      selects the leaders, or the router, whose workers are the leaders' DNS names.
    - a PD layout (``config.pd``): see :func:`render_pd`.
    - ``opts.dra``: ResourceClaimTemplate ``name-devices``; pods claim it instead of
      ``nvidia.com/gpu``.

    Args:
        config: the serving configuration (one server = ``engine_for(config).argv(config)``).
        name: deployment name, a DNS label of at most 40 characters.
        namespace: target namespace.
        labels: put on every object and pod; should hold ``app.kubernetes.io/managed-by``,
            ``servetune.io/study`` and ``servetune.io/trial``; ``servetune.io/deployment`` is
            set to ``name``.
        opts: cluster facts.

    Returns:
        Manifests as dicts, in apply order (claim template, engine, router, Services).

    Raises:
        ValueError: bad name or labels, a server spanning nodes unevenly or with ``dp_size``
            > 1, DRA before 1.32.
    """
    check_name(name, MAX_NAME)
    labels = check_labels(labels, name)
    if config.pd is not None:
        return render_pd(config, name, namespace, labels, opts=opts)
    nodes = server_nodes(config, opts.gpus_per_node)
    ctx = _Ctx(config, name, namespace, labels, opts, config.gpus_per_server // nodes)
    objs: list[dict[str, Any]] = []
    if opts.dra:
        objs.append(ctx.claim_template())
    # kube_service is the Service itself spreading connections: no router Deployment
    use_router = opts.router and config.router_args([]) is not None
    if nodes > 1:
        lws = f"{name}-engine"
        objs.append(ctx.leader_worker_set(lws, config.replicas, nodes, {}))
        workers = [leader_url(lws, i, namespace, opts.port) for i in range(config.replicas)]
    elif use_router:
        for i in range(config.replicas):
            objs.append(ctx.deployment(f"{name}-r{i}", 1, {REPLICA_LABEL: str(i)}))
        workers = [service_url(f"{name}-r{i}", namespace, opts.port)
                   for i in range(config.replicas)]
    else:
        objs.append(ctx.deployment(name, config.replicas, {}))
        workers = []
    if use_router:
        objs.append(ctx.router(config.router_args(workers) or []))
        if nodes == 1:
            objs += [ctx.service(f"{name}-r{i}", {REPLICA_LABEL: str(i)})
                     for i in range(config.replicas)]
        objs.append(ctx.service(name, {COMPONENT_LABEL: "router"}))
    else:
        objs.append(ctx.service(name, {}))
    return objs


def render_pd(config: ServingConfig, name: str, namespace: str, labels: dict[str, str], *,
              opts: SglangOptions = SglangOptions()) -> list[dict[str, Any]]:  # noqa: B008
    """The objects of a prefill/decode (PD) disaggregated layout (``config.pd``).

    Each group (``config.servers()``: prefill, then decode; each server is
    ``config.pd_worker(role)``, with ``--disaggregation-mode prefill|decode``):

    - a server that fits a node: Deployment and Service ``name-p<i>`` (prefill) or
      ``name-d<i>`` (decode) per server, so the router reaches each server by a stable name
      (a prefill Service also exposes the KV bootstrap port, 8998: the decode servers connect
      to it, sglang-knobs reference 1.11 and 7.2);
    - a server that spans nodes: LeaderWorkerSet ``name-prefill`` or ``name-decode`` with one
      group per server; the router reaches each group's leader by its pod DNS name.

    Then the router in PD mode, Deployment ``name-router``
    (:meth:`~domain.config.ServingConfig.pd_router_args`: ``--pd-disaggregation --prefill URL
    8998 ... --decode URL ...``), and Service ``name`` selecting it: a PD layout always has its
    router, whatever ``opts.router`` says. Engine pods carry ``servetune.io/role`` (prefill or
    decode) and the annotation ``servetune.io/kv-transfer`` stating what the KV transfer
    backend needs from the network (RDMA NICs for mooncake, nixl, mori: claim them with DRA
    ``dra_nic_class`` or an RDMA device plugin; servetune never renders ``hostNetwork``, which
    the sandbox policy refuses; ``mooncake_tcp`` runs over the pod network).

    Args:
        config: a config with ``pd`` set (replicas 1).
        name: deployment name, a DNS label of at most 40 characters.
        namespace: target namespace.
        labels: as :func:`render_sglang`.
        opts: cluster facts.

    Returns:
        Manifests in apply order: claim templates, engine groups (prefill, decode), router,
        the per-server Services, Service ``name``.

    Raises:
        ValueError: no PD layout, a bad name or labels, a server spanning nodes unevenly.
    """
    if config.pd is None:
        raise ValueError("render_pd needs a config with a PD layout (pd)")
    check_name(name, MAX_NAME)
    labels = check_labels(labels, name)
    objs: list[dict[str, Any]] = []
    engines: list[dict[str, Any]] = []
    services: list[dict[str, Any]] = []
    urls: dict[str, list[str]] = {}
    for role, count, server in config.servers():
        nodes = server_nodes(server, opts.gpus_per_node)
        ctx = _Ctx(server, name, namespace, labels, opts, server.gpus_per_server // nodes,
                   role=role, claim=f"{name}-{role}-devices")
        if opts.dra:
            objs.append(ctx.claim_template())
        if nodes > 1:
            lws = f"{name}-{role}"
            engines.append(ctx.leader_worker_set(lws, count, nodes, {ROLE_LABEL: role}))
            urls[role] = [leader_url(lws, i, namespace, opts.port) for i in range(count)]
            continue
        urls[role] = []
        for i in range(count):
            one = f"{name}-{role[0]}{i}"
            extra = {ROLE_LABEL: role, REPLICA_LABEL: str(i)}
            engines.append(ctx.deployment(one, 1, extra))
            services.append(ctx.service(one, extra))
            urls[role].append(service_url(one, namespace, opts.port))
    router = _Ctx(config, name, namespace, labels, opts, 0).router(
        config.pd_router_args(urls["prefill"], urls["decode"], BOOTSTRAP_PORT))
    return [*objs, *engines, router, *services,
            _Ctx(config, name, namespace, labels, opts, 0).service(
                name, {COMPONENT_LABEL: "router"})]


def server_nodes(config: ServingConfig, gpus_per_node: int) -> int:
    """Nodes (pods) one server of ``config`` spans: ``config.nnodes(gpus_per_node)``.

    Raises:
        ValueError: the server's GPUs do not split evenly over whole nodes (SGLang needs
            tp x pp divisible by ``--nnodes``, sglang-knobs reference 1.1 and 7.2), or
            ``dp_size`` > 1 across nodes (full DP copies are not supported across nodes,
            sglang-knobs reference 1.1: use attention DP or separate servers there).
    """
    gpus = config.gpus_per_server
    nodes = config.nnodes(gpus_per_node)
    if nodes == 1:
        return 1
    if gpus % gpus_per_node:
        raise ValueError(f"a server of {gpus} GPUs (tp {config.tp_size} x pp {config.pp_size} "
                         f"x dp {config.dp_size}) spans nodes of {gpus_per_node} GPUs unevenly: "
                         "SGLang needs tp*pp divisible by --nnodes (sglang-knobs.md 7.2)")
    if config.dp_size > 1:
        raise ValueError(f"dp_size {config.dp_size} across {nodes} nodes: SGLang runs full "
                         "data-parallel copies on one node only (sglang-knobs.md 1.1); use "
                         "attn_dp_size, or more replicas behind the router")
    return nodes


def leader_url(lws: str, group: int, namespace: str, port: int) -> str:
    """The URL of group ``group``'s leader pod of LeaderWorkerSet ``lws``.

    LWS names a leader ``<lws>-<group>`` under the headless Service ``<lws>`` (subdomain
    policy Shared, the default: kubernetes-sigs/lws ``pkg/utils/pod/pod_utils.go``).
    """
    return f"http://{lws}-{group}.{lws}.{namespace}:{port}"


def kv_transfer_needs(config: ServingConfig) -> str:
    """What a PD server's KV transfer backend needs from the network, in one sentence.

    The backend is ``config.disaggregation_transfer_backend`` (None = mooncake, the 0.5.23
    default, sglang-knobs reference 1.11).
    """
    backend = config.disaggregation_transfer_backend or "mooncake"
    if backend in RDMA_TRANSFER:
        return (f"{backend} moves the KV over RDMA: the pod needs RDMA NICs (claim them with "
                "DRA, SglangOptions.dra_nic_class, or an RDMA device plugin); hostNetwork is "
                "never rendered (the sandbox policy refuses it); without RDMA use "
                "disaggregation_transfer_backend mooncake_tcp")
    if backend == "mooncake_tcp":
        return "mooncake_tcp moves the KV over TCP on the pod network (no RDMA needed)"
    return f"{backend}: no network needs known to servetune"


class _Ctx:
    """What every object of one deployment shares."""

    def __init__(self, config: ServingConfig, name: str, namespace: str, labels: dict[str, str],
                 opts: SglangOptions, per_pod: int, role: str | None = None,
                 claim: str | None = None) -> None:
        self.config, self.name, self.ns, self.labels = config, name, namespace, labels
        self.opts, self.per_pod, self.role = opts, per_pod, role
        self.claim = claim or f"{name}-devices"
        self.image = opts.image or manifest_for(config, "kubernetes").image

    def meta(self, name: str) -> dict[str, Any]:
        return {"name": name, "namespace": self.ns, "labels": dict(self.labels)}

    def pod_labels(self, component: str, extra: dict[str, str]) -> dict[str, str]:
        return {**self.labels, COMPONENT_LABEL: component, **extra}

    def engine_args(self, multi_node: int = 0) -> tuple[list[str], list[str]]:
        eng = engine_for(self.config)
        argv, n = eng.argv(self.config), len(eng.program)
        args = argv[n:] + [eng.flag_for("host"), "0.0.0.0", eng.flag_for("port"),
                           str(self.opts.port), eng.flag_for("enable_metrics")]
        if self.role == "prefill":  # the decode servers and the router reach it there
            args += [eng.flag_for("disaggregation_bootstrap_port"), str(BOOTSTRAP_PORT)]
        if multi_node:  # LWS injects these env vars into every container of the group
            args += [eng.flag_for("nnodes"), str(multi_node),
                     eng.flag_for("node_rank"), "$(LWS_WORKER_INDEX)",
                     eng.flag_for("dist_init_addr"), f"$(LWS_LEADER_ADDRESS):{DIST_INIT_PORT}"]
        return argv[:n], args

    def pod_meta(self, component: str, extra: dict[str, str]) -> dict[str, Any]:
        """A pod template's metadata: labels, and for a PD server the KV transfer's needs."""
        meta: dict[str, Any] = {"labels": self.pod_labels(component, extra)}
        if self.role is not None:
            meta["annotations"] = {KV_TRANSFER_ANNOTATION: kv_transfer_needs(self.config)}
        return meta

    def engine_pod(self, serves_http: bool, multi_node: int = 0) -> dict[str, Any]:
        o = self.opts
        command, args = self.engine_args(multi_node)
        memory = f"{o.memory_per_gpu_gib * self.per_pod}Gi"
        resources: dict[str, Any] = {
            "requests": {"cpu": str(o.cpu_per_gpu * self.per_pod), "memory": memory},
            "limits": {"memory": memory}}
        if o.dra:
            resources["claims"] = [{"name": DRA_CLAIM}]
        else:
            resources["requests"]["nvidia.com/gpu"] = str(self.per_pod)
            resources["limits"]["nvidia.com/gpu"] = str(self.per_pod)
        env = [{"name": "HOME", "value": HOME_DIR},
               {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
               # 0.5.23: the triton/inductor/flashinfer/deep_gemm JIT caches (sglang-knobs 7.2)
               {"name": "SGLANG_CACHE_DIR", "value": f"{CACHE_DIR}/sglang"},
               {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"}]
        if o.hf_token_secret:
            env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
                "name": o.hf_token_secret, "key": "token", "optional": True}}})
        container: dict[str, Any] = {
            "name": "sglang", "image": self.image, "command": command, "args": args,
            "env": env, "resources": resources, "securityContext": container_security(),
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                             {"name": "cache", "mountPath": CACHE_DIR},
                             {"name": "home", "mountPath": HOME_DIR},
                             {"name": "tmp", "mountPath": "/tmp"}]}
        if multi_node:
            container["ports"] = [{"name": "dist-init", "containerPort": DIST_INIT_PORT}]
        if serves_http and self.role == "prefill":
            container["ports"] = [{"name": "bootstrap", "containerPort": BOOTSTRAP_PORT},
                                  *container.get("ports", [])]
        if serves_http:
            container["ports"] = [{"name": "http", "containerPort": o.port},
                                  *container.get("ports", [])]
            probe = {"httpGet": {"path": HEALTH_PATH, "port": "http"},
                     "timeoutSeconds": PROBE_TIMEOUT_S}
            container["startupProbe"] = {
                **probe, "periodSeconds": PROBE_PERIOD_S,
                "failureThreshold": math.ceil(o.startup_budget_s / PROBE_PERIOD_S)}
            container["readinessProbe"] = {**probe, "periodSeconds": PROBE_PERIOD_S,
                                           "failureThreshold": READY_FAILURES}
            container["livenessProbe"] = {**probe, "periodSeconds": LIVENESS_PERIOD_S,
                                          "failureThreshold": LIVENESS_FAILURES}
        cache: dict[str, Any] = ({"persistentVolumeClaim": {"claimName": o.model_cache_pvc}}
                                 if o.model_cache_pvc else {"emptyDir": {}})
        spec: dict[str, Any] = {
            "securityContext": pod_security(), "containers": [container],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory",
                                                      "sizeLimit": o.shm_size}},
                        {"name": "cache", **cache},
                        {"name": "home", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}],
            "automountServiceAccountToken": False, "enableServiceLinks": False}
        if o.dra:
            spec["resourceClaims"] = [{"name": DRA_CLAIM,
                                       "resourceClaimTemplateName": self.claim}]
        return spec

    def deployment(self, name: str, replicas: int, extra: dict[str, str]) -> dict[str, Any]:
        pod_labels = self.pod_labels("engine", extra)
        selector = {k: pod_labels[k] for k in (DEPLOYMENT_LABEL, COMPONENT_LABEL, *extra)}
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": self.meta(name),
                "spec": {"replicas": replicas, "selector": {"matchLabels": selector},
                         # a rolling update would need a second replica's GPUs
                         "strategy": {"type": "Recreate"},
                         "template": {"metadata": self.pod_meta("engine", extra),
                                      "spec": self.engine_pod(serves_http=True)}}}

    def leader_worker_set(self, lws: str, groups: int, nodes: int,
                          extra: dict[str, str]) -> dict[str, Any]:
        """LeaderWorkerSet ``lws``: ``groups`` servers of ``nodes`` pods (leader first)."""
        return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
                "metadata": self.meta(lws),
                "spec": {"replicas": groups, "startupPolicy": "LeaderCreated",
                         "leaderWorkerTemplate": {
                             "size": nodes, "restartPolicy": "RecreateGroupOnPodRestart",
                             "leaderTemplate": {
                                 "metadata": self.pod_meta("engine", extra),
                                 "spec": self.engine_pod(True, nodes)},
                             "workerTemplate": {
                                 "metadata": self.pod_meta("engine-worker", extra),
                                 "spec": self.engine_pod(False, nodes)}}}}

    def router(self, routing: list[str]) -> dict[str, Any]:
        """Deployment ``name-router``: sglang-router with ``routing`` (its workers, policy)."""
        o = self.opts
        labels = self.pod_labels("router", {})
        args = [*routing,
                "--host", "0.0.0.0", "--port", str(o.port),
                "--prometheus-port", str(ROUTER_METRICS_PORT),
                # the router's own wait for healthy workers (default 1800 s, sglang-knobs 6)
                "--worker-startup-timeout-secs", str(o.startup_budget_s)]
        probe = {"httpGet": {"port": "http"}, "timeoutSeconds": PROBE_TIMEOUT_S,
                 "periodSeconds": PROBE_PERIOD_S}
        container = {
            "name": "router", "image": self.image,
            "command": ["python3", "-m", "sglang_router.launch_router"], "args": args,
            "env": [{"name": "HOME", "value": HOME_DIR}],
            "ports": [{"name": "http", "containerPort": o.port},
                      {"name": "metrics", "containerPort": ROUTER_METRICS_PORT}],
            "resources": {"requests": {"cpu": "2", "memory": "4Gi"},
                          "limits": {"memory": "4Gi"}},
            "securityContext": container_security(),
            # router endpoints /readiness and /liveness (sglang-router 0.3.2, sglang-knobs 6.4)
            "readinessProbe": {**probe, "httpGet": {"path": "/readiness", "port": "http"}},
            "livenessProbe": {**probe, "httpGet": {"path": "/liveness", "port": "http"},
                              "failureThreshold": LIVENESS_FAILURES},
            "volumeMounts": [{"name": "home", "mountPath": HOME_DIR},
                             {"name": "tmp", "mountPath": "/tmp"}]}
        return {"apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": self.meta(f"{self.name}-router"),
                "spec": {"replicas": 1,
                         "selector": {"matchLabels": {DEPLOYMENT_LABEL: self.name,
                                                      COMPONENT_LABEL: "router"}},
                         "template": {"metadata": {"labels": labels}, "spec": {
                             "securityContext": pod_security(), "containers": [container],
                             "volumes": [{"name": "home", "emptyDir": {}},
                                         {"name": "tmp", "emptyDir": {}}],
                             "automountServiceAccountToken": False,
                             "enableServiceLinks": False}}}}

    def service(self, name: str, select: dict[str, str]) -> dict[str, Any]:
        selector = {DEPLOYMENT_LABEL: self.name, COMPONENT_LABEL: "engine", **select}
        ports = [{"name": "http", "port": self.opts.port, "targetPort": "http",
                  "protocol": "TCP"}]
        if self.role == "prefill":
            ports.append({"name": "bootstrap", "port": BOOTSTRAP_PORT,
                          "targetPort": "bootstrap", "protocol": "TCP"})
        return {"apiVersion": "v1", "kind": "Service", "metadata": self.meta(name),
                "spec": {"selector": selector, "ports": ports}}

    def claim_template(self) -> dict[str, Any]:
        o = self.opts
        api = dra_api_version(o.k8s_version)
        beta1 = api.endswith("v1beta1")

        def request(rname: str, device_class: str, count: int) -> dict[str, Any]:
            exact = {"deviceClassName": device_class, "allocationMode": "ExactCount",
                     "count": count}
            return {"name": rname, **exact} if beta1 else {"name": rname, "exactly": exact}

        if o.dra_nic_class is None:
            devices: dict[str, Any] = {"requests": [request("gpus", o.dra_gpu_class,
                                                            self.per_pod)]}
        else:  # one NIC per GPU, each pair under one PCIe root
            devices = {"requests": [], "constraints": []}
            for i in range(self.per_pod):
                devices["requests"] += [request(f"gpu-{i}", o.dra_gpu_class, 1),
                                        request(f"nic-{i}", o.dra_nic_class, 1)]
                devices["constraints"].append({"requests": [f"gpu-{i}", f"nic-{i}"],
                                               "matchAttribute": PCIE_ROOT_ATTRIBUTE})
        return {"apiVersion": api, "kind": "ResourceClaimTemplate",
                "metadata": self.meta(self.claim),
                "spec": {"metadata": {"labels": dict(self.labels)},
                         "spec": {"devices": devices}}}

