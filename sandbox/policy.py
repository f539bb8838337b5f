"""The manifest policy guard the cluster server runs before every apply.

Pure functions over manifest dicts (no cluster): each refusal names the object, the path inside
it (``spec.template.spec.containers[0].securityContext.privileged``), what is wrong and what to do
instead, so an agent can fix its request without reading Kubernetes documentation.

Rules (one test each in ``tests/unit/test_sandbox_policy.py``):

- **namespace**: every object lives in ``Policy.namespace`` (a missing namespace is refused too:
  the server would put it in the client's default namespace);
- **kind**: only the (API group, kind) pairs the sandbox Role may write,
  :func:`sandbox.rbac.writable_kinds` -- no Secrets, Pods, ClusterRoles, Namespaces...;
- **privileged** containers, **root** (``runAsUser: 0``, ``runAsNonRoot`` not true at the pod or
  container level, as the pod-security ``restricted`` profile reads them), **hostNetwork /
  hostPID / hostIPC** and container ``hostPort``, added **capabilities**,
  **allowPrivilegeEscalation: true**, **images** outside the allow-list (init and ephemeral
  containers included);
- the other controls of the Pod Security Standards ``restricted`` profile
  (kubernetes.io/docs/concepts/security/pod-security-standards/), checked here because the
  namespace's Pod Security admission label is only set on a sandbox servetune rendered:
  **volume types** other than configMap, csi, downwardAPI, emptyDir, ephemeral,
  persistentVolumeClaim, projected and secret (hostPath, gitRepo, nfs...), a **seccomp** profile
  other than RuntimeDefault or Localhost (set at the pod level, or on every container),
  **AppArmor** other than RuntimeDefault or Localhost (fields and the beta annotations),
  **sysctls** outside the safe set (:data:`SAFE_SYSCTLS`), **SELinux** types and users,
  ``procMount`` other than Default, Windows ``hostProcess``;
- **Secrets**: no pod reads a Secret (``secret`` and projected volumes, ``envFrom.secretRef``,
  ``env.valueFrom.secretKeyRef``, a CSI ``nodePublishSecretRef``) except the one the operator names
  as ``Policy.model_token_secret`` (``--model-token-secret``: the Hugging Face token of gated
  weights), by name;
- **Services** are ClusterIP only (no NodePort, LoadBalancer or ExternalName) without
  ``externalIPs``: nothing is exposed outside the cluster;
- **GPU budget**: the GPUs the applied objects request (GPU resources of each pod x its pods --
  Deployment replicas, Job parallelism, LeaderWorkerSet replicas x group size -- plus the devices
  of DRA claims of a GPU device class) plus ``already_used`` stay within ``Policy.gpu_budget``.
  ``nvidia.com/gpu``, ``nvidia.com/gpu.shared`` and every ``nvidia.com/mig-*`` count one GPU
  each; any other extended resource (a name with a ``/`` outside the ``kubernetes.io`` domains,
  e.g. ``amd.com/gpu``, ``gpu.intel.com/i915``, ``habana.ai/gaudi``, ``aws.amazon.com/neuron``) is
  refused, since the budget cannot tell an accelerator from something else; native resources
  (``cpu``, ``memory``, ``ephemeral-storage``, ``hugepages-*``) have no ``/``. DRA requests count
  by device class: ``Policy.dra_gpu_classes`` count their devices, ``Policy.dra_other_classes``
  (NICs) count none, any other class is refused.

Parallel layouts add no kind and no exception: a server spanning nodes is a LeaderWorkerSet
(allowed with ``Policy.lws``), a prefill/decode layout is Deployments or LeaderWorkerSets per
group plus the router's Deployment and ClusterIP Services, every one of them inside
``Policy.namespace`` and under every rule above (no ``hostNetwork`` for RDMA either).

Pod templates are read from Deployments, Jobs, LeaderWorkerSets (``leaderTemplate`` and
``workerTemplate``), and, so that one answer lists every problem, also from kinds the Role refuses
(Pod, ReplicaSet, StatefulSet, DaemonSet, CronJob).

Longer than 500 lines on purpose: one rule per refusal, each with its message; the rules are one
list that ``enforce`` runs in order, and reading them together is the review of the policy.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from domain.engines import ENGINES, engine
from domain.errors import ServetuneError
from sandbox.podspec import check_subdomain
from sandbox.rbac import writable_kinds

DEFAULT_IMAGE_ALLOW: tuple[str, ...] = (*(engine(n).image_allow for n in ENGINES),
                                         "ghcr.io/servetune/")
"""Image prefixes allowed by default: every engine's images (``lmsysorg/sglang:``) and
servetune's own images."""

# Separators an allow-list entry must end with to act as a prefix: "lmsysorg/sglang" alone would
# also allow "lmsysorg/sglang-evil:latest".
_PREFIX_ENDS = (":", "/", "@")
# Registry spellings of Docker Hub that name the same image as the bare "owner/name".
_DOCKER_HUB = ("docker.io/", "index.docker.io/", "registry-1.docker.io/")

# Kinds without a namespace (Kubernetes 1.33 built-ins); any other kind is treated as namespaced.
CLUSTER_SCOPED_KINDS = frozenset({
    "Namespace", "Node", "PersistentVolume", "ClusterRole", "ClusterRoleBinding",
    "CustomResourceDefinition", "StorageClass", "PriorityClass", "RuntimeClass", "IngressClass",
    "CSIDriver", "CSINode", "VolumeAttachment", "CertificateSigningRequest", "APIService",
    "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
    "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "DeviceClass",
    "ResourceSlice", "FlowSchema", "PriorityLevelConfiguration",
})

_DRA_KINDS = ("ResourceClaim", "ResourceClaimTemplate")

DEFAULT_DRA_GPU_CLASSES: tuple[str, ...] = ("gpu.nvidia.com", "mig.nvidia.com")
"""DeviceClasses of the NVIDIA DRA driver (k8s-dra-driver-gpu): whole GPUs and MIG devices."""

# Extended resources counted as one GPU per unit: the NVIDIA device plugin's whole GPUs, its
# time-sliced/MPS replicas (renamed to nvidia.com/gpu.shared with renameByDefault) and its MIG
# devices under the "mixed" strategy (nvidia.com/mig-<slices>g.<memory>gb).
_GPU_RESOURCES = ("nvidia.com/gpu", "nvidia.com/gpu.shared")
_MIG_PREFIX = "nvidia.com/mig-"

# Pod Security Standards, "restricted" profile: the volume types it allows.
RESTRICTED_VOLUME_TYPES = frozenset({
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret"})
# Pod Security Standards, "baseline" Sysctls control (pod-security-admission check_sysctls.go,
# the set for Kubernetes 1.32+): namespaced sysctls isolated from other pods.
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"})
# Pod Security Standards, "baseline" SELinux control: the allowed seLinuxOptions.type values.
_SELINUX_TYPES = ("container_t", "container_init_t", "container_kvm_t", "container_engine_t")
_PROFILE_TYPES = ("RuntimeDefault", "Localhost")  # seccomp (restricted) and AppArmor (baseline)
_APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
_SECCOMP_ANNOTATIONS = ("seccomp.security.alpha.kubernetes.io/pod",
                        "container.seccomp.security.alpha.kubernetes.io/")
_HOST_NS = {"hostNetwork": "network", "hostPID": "process (PID)", "hostIPC": "IPC"}


@dataclass(frozen=True)
class Policy:
    """What the sandbox allows one study to apply.

    Attributes:
        namespace: The sandbox namespace every object must live in.
        gpu_budget: GPUs the study may hold at once (count, >= 0); the namespace's ResourceQuota
            ``requests.nvidia.com/gpu`` is the cluster-side backstop.
        image_allow: Allowed images. An entry ending with ``:``, ``/`` or ``@`` is a prefix
            (``lmsysorg/sglang:`` allows every tag); any other entry allows exactly that image.
            ``docker.io/owner/name`` is read as ``owner/name``.
        lws: The Role grants LeaderWorkerSets (a replica spanning nodes).
        dra: The Role grants ResourceClaims and ResourceClaimTemplates (DRA).
        model_token_secret: The one Secret pods may read (a DNS-1123 subdomain), in any form
            (volume, projected, envFrom, secretKeyRef): the operator's ``--model-token-secret``,
            the Hugging Face token of gated weights. None (default): no Secret at all.
        dra_gpu_classes: DRA DeviceClasses whose devices count as GPUs against the budget.
        dra_other_classes: DRA DeviceClasses pods may claim that hold no GPU (NICs, e.g.
            ``dranet``); a claim of any class in neither tuple is refused.

    Raises:
        ValueError: Empty namespace, negative budget, an empty allow-list entry, or a
            ``model_token_secret`` or DeviceClass that is not a DNS-1123 subdomain.
    """

    namespace: str
    gpu_budget: int
    image_allow: tuple[str, ...] = DEFAULT_IMAGE_ALLOW
    lws: bool = False
    dra: bool = False
    model_token_secret: str | None = None
    dra_gpu_classes: tuple[str, ...] = DEFAULT_DRA_GPU_CLASSES
    dra_other_classes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.namespace:
            raise ValueError("Policy.namespace is empty: give the sandbox namespace")
        if (isinstance(self.gpu_budget, bool) or not isinstance(self.gpu_budget, int)
                or self.gpu_budget < 0):
            raise ValueError(f"Policy.gpu_budget must be a GPU count >= 0, got {self.gpu_budget!r}")
        if isinstance(self.image_allow, str):
            raise ValueError("Policy.image_allow is a tuple of entries, not one string")
        if any(not entry for entry in self.image_allow):
            raise ValueError("Policy.image_allow has an empty entry (it would allow every image)")
        if self.model_token_secret is not None:
            check_subdomain(self.model_token_secret, "Policy.model_token_secret")
        for field in ("dra_gpu_classes", "dra_other_classes"):
            classes = getattr(self, field)
            if isinstance(classes, str):
                raise ValueError(f"Policy.{field} is a tuple of DeviceClass names, not one string")
            for name in classes:
                check_subdomain(name, f"Policy.{field} entry")

    def image_allowed(self, image: str) -> bool:
        """Whether ``image`` matches an entry of :attr:`image_allow` (see the class doc)."""
        names = {image} | {image[len(p):] for p in _DOCKER_HUB if image.startswith(p)}
        for entry in self.image_allow:
            for name in names:
                if name == entry or (entry.endswith(_PREFIX_ENDS) and name.startswith(entry)):
                    return True
        return False


class PolicyViolation(ServetuneError):
    """The policy refused a set of manifests; nothing was applied.

    Attributes:
        reasons: One line per problem: ``Kind/name: path: what is wrong; what to do instead``.
    """

    def __init__(self, reasons: list[str]) -> None:
        self.reasons = list(reasons)
        n = len(self.reasons)
        lines = "\n".join(f"- {r}" for r in self.reasons)
        super().__init__(f"the sandbox policy refused {n} problem{'s' * (n != 1)} "
                         f"(nothing was applied):\n{lines}")


def violations(obj: dict[str, Any], policy: Policy, *, already_used: int = 0) -> list[str]:
    """Every reason the policy refuses one manifest (empty when it may be applied).

    Args:
        obj: One Kubernetes object as a dict (``apiVersion``, ``kind``, ``metadata``, ``spec``).
        policy: The sandbox policy.
        already_used: GPUs the study already holds (count); the object's GPUs plus these must fit
            ``policy.gpu_budget``.

    Returns:
        One line per problem, in rule order: namespace, kind, pod rules, GPU budget.
    """
    return _object_violations(obj, policy) + _budget_violations([obj], policy, already_used)


def enforce(objs: Iterable[dict[str, Any]], policy: Policy, *, already_used: int = 0) -> None:
    """Refuse the whole apply when any object breaks the policy.

    The GPU budget is checked over all ``objs`` together (plus ``already_used``), so pass every
    object of one deployment in one call.

    Args:
        objs: The manifests about to be applied.
        policy: The sandbox policy.
        already_used: GPUs the study already holds outside ``objs`` (count).

    Raises:
        PolicyViolation: With every reason, when at least one rule is broken.
    """
    objs = list(objs)
    reasons = [r for obj in objs for r in _object_violations(obj, policy)]
    reasons += _budget_violations(objs, policy, already_used)
    if reasons:
        raise PolicyViolation(reasons)


def gpu_demand(objs: Iterable[dict[str, Any]], policy: Policy | None = None) -> int:
    """GPUs the objects hold once running (count), as the budget rule counts them.

    Useful to compute ``already_used`` from the objects a study has applied. Unreadable
    quantities and refused resources count as 0 here (the budget rule refuses them).
    ``policy`` gives the DRA GPU device classes (default :data:`DEFAULT_DRA_GPU_CLASSES`).
    """
    return _count_gpus(list(objs), policy)[0]


# --------------------------------------------------------------------------- helpers


def _d(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _l(x: Any) -> list[Any]:
    return x if isinstance(x, list) else []


def _who(obj: dict[str, Any]) -> str:
    kind = obj.get("kind") or "<no kind>"
    return f"{kind}/{_d(obj.get('metadata')).get('name') or '<no name>'}"


def _group(api_version: str) -> str:
    return api_version.split("/", 1)[0] if "/" in api_version else ""


def _count(value: Any, default: int) -> int | None:
    """A replica-like count, ``default`` when absent, None when not a non-negative integer."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


@dataclass
class _Pods:
    """One pod template of a workload: where it is, its spec, and how many pods run it."""

    path: str  # path of the pod spec, e.g. "spec.template.spec"
    spec: dict[str, Any]
    pods: int
    why: str  # how ``pods`` was computed, for the budget message
    errors: list[str]


def _pod_templates(obj: dict[str, Any]) -> list[_Pods]:
    kind, spec = obj.get("kind"), _d(obj.get("spec"))

    def count(field: str, default: int = 1, at: str = "spec") -> tuple[int, list[str]]:
        n = _count(_d(_at(obj, at)).get(field), default)
        if n is None:
            return 0, [f"{at}.{field}: {_d(_at(obj, at)).get(field)!r} is not a count; "
                       f"give a non-negative integer"]
        return n, []

    if kind == "Pod":
        return [_Pods("spec", spec, 1, "1 pod", [])]
    if kind in ("Deployment", "ReplicaSet", "StatefulSet"):
        n, err = count("replicas")
        return [_Pods("spec.template.spec", _d(_d(spec.get("template")).get("spec")), n,
                      f"spec.replicas={n}", err)]
    if kind == "DaemonSet":
        return [_Pods("spec.template.spec", _d(_d(spec.get("template")).get("spec")), 1,
                      "1 pod per node", [])]
    if kind in ("Job", "CronJob"):
        at = "spec" if kind == "Job" else "spec.jobTemplate.spec"
        n, err = count("parallelism", 1, at)
        tmpl = _d(_d(_at(obj, at)).get("template")).get("spec")
        return [_Pods(f"{at}.template.spec", _d(tmpl), n, f"{at}.parallelism={n}", err)]
    if kind == "LeaderWorkerSet":
        lwt = _d(spec.get("leaderWorkerTemplate"))
        reps, err = count("replicas")
        size, err2 = count("size", 1, "spec.leaderWorkerTemplate")
        err += err2
        base = "spec.leaderWorkerTemplate"
        worker = _d(_d(lwt.get("workerTemplate")).get("spec"))
        if "leaderTemplate" not in lwt:
            return [_Pods(f"{base}.workerTemplate.spec", worker, reps * size,
                          f"spec.replicas={reps} x {base}.size={size}", err)]
        leader = _d(_d(lwt.get("leaderTemplate")).get("spec"))
        return [_Pods(f"{base}.leaderTemplate.spec", leader, reps,
                      f"spec.replicas={reps} leaders", err),
                _Pods(f"{base}.workerTemplate.spec", worker, reps * max(size - 1, 0),
                      f"spec.replicas={reps} x ({base}.size={size} - 1) workers", [])]
    return []


def _at(obj: dict[str, Any], dotted: str) -> Any:
    cur: Any = obj
    for key in dotted.split("."):
        cur = _d(cur).get(key)
    return cur


def _containers(spec: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{path}.{field}[{i}]", _d(c))
            for field in ("initContainers", "containers", "ephemeralContainers")
            for i, c in enumerate(_l(spec.get(field)))]


# --------------------------------------------------------------------------- per-object rules


def _object_violations(obj: Any, policy: Policy) -> list[str]:
    if not isinstance(obj, dict):
        return [f"{obj!r}: not a Kubernetes object; give a mapping with apiVersion, kind, "
                "metadata and spec"]
    who = _who(obj)
    out = [f"{who}: {r}" for r in _namespace_rule(obj, policy) + _kind_rule(obj, policy)
           + _service_rule(obj)]
    for pods in _pod_templates(obj):
        meta_path = pods.path.removesuffix("spec") + "metadata"
        out += [f"{who}: {r}" for r in _pod_rules(pods.spec, pods.path, policy)
                + _annotation_rules(_d(_at(obj, meta_path)), meta_path)]
    return out


def _service_rule(obj: dict[str, Any]) -> list[str]:
    if obj.get("kind") != "Service" or _group(str(obj.get("apiVersion", ""))) != "":
        return []
    spec, out = _d(obj.get("spec")), []
    kind = spec.get("type")
    if kind not in (None, "ClusterIP"):
        out.append(f"spec.type: {kind!r} reaches the Service from outside the cluster (or "
                   "elsewhere); remove type or set it to ClusterIP (clients in the cluster use "
                   "http://<name>.<namespace>.svc)")
    if spec.get("externalIPs"):
        out.append(f"spec.externalIPs: {spec['externalIPs']!r} takes traffic for addresses "
                   "outside the cluster; remove externalIPs and keep the Service ClusterIP")
    return out


def _annotation_rules(meta: dict[str, Any], path: str) -> list[str]:
    out = []
    for key, value in _d(meta.get("annotations")).items():
        key, value = str(key), str(value)
        if key.startswith(_APPARMOR_ANNOTATION) and not (
                value == "runtime/default" or value.startswith("localhost/")):
            out.append(f"{path}.annotations[{key!r}]: {value!r} lifts AppArmor confinement; "
                       "remove the annotation (the runtime's default profile applies)")
        if key.startswith(_SECCOMP_ANNOTATIONS) and not (
                value in ("runtime/default", "docker/default") or value.startswith("localhost/")):
            out.append(f"{path}.annotations[{key!r}]: {value!r} lifts seccomp confinement; "
                       "remove it and set securityContext.seccompProfile.type: RuntimeDefault")
    return out


def _secret_rule(name: Any, where: str, policy: Policy) -> list[str]:
    """A pod reads Secret ``name`` at ``where``: refused unless it is the model token Secret."""
    if policy.model_token_secret is not None and name == policy.model_token_secret:
        return []
    allowed = (f"only the Secret {policy.model_token_secret!r} (--model-token-secret) may be "
               "read" if policy.model_token_secret else "no Secret may be read; the operator "
               "names the one model token Secret (e.g. a Hugging Face token) with "
               "--model-token-secret NAME")
    return [f"{where}: reads Secret {name!r}; {allowed}; remove this reference"]


def _volume_rules(vol: dict[str, Any], path: str, policy: Policy) -> list[str]:
    out: list[str] = []
    for vtype in sorted(k for k in vol if k != "name"):
        if vtype == "hostPath":
            hp = _d(vol.get("hostPath")).get("path")
            out.append(f"{path}.hostPath: mounts the node's {hp!r}; use an emptyDir (scratch, "
                       "/dev/shm with medium: Memory) or a PersistentVolumeClaim (model cache) "
                       "instead")
        elif vtype not in RESTRICTED_VOLUME_TYPES:
            out.append(f"{path}.{vtype}: this volume type is outside the restricted Pod Security "
                       f"profile; use one of {', '.join(sorted(RESTRICTED_VOLUME_TYPES))} (a "
                       "PersistentVolumeClaim for storage)")
    if "secret" in vol:
        out += _secret_rule(_d(vol["secret"]).get("secretName"), f"{path}.secret", policy)
    for j, src in enumerate(_l(_d(vol.get("projected")).get("sources"))):
        if "secret" in _d(src):
            out += _secret_rule(_d(_d(src)["secret"]).get("name"),
                                f"{path}.projected.sources[{j}].secret", policy)
    ref = _d(vol.get("csi")).get("nodePublishSecretRef")
    if ref is not None:
        out += _secret_rule(_d(ref).get("name"), f"{path}.csi.nodePublishSecretRef", policy)
    return out


def _security_context_rules(sc: dict[str, Any], where: str) -> list[str]:
    """Controls of the restricted profile read alike at the pod and the container level."""
    out = []
    seccomp = _d(sc.get("seccompProfile")).get("type")
    if "seccompProfile" in sc and seccomp not in _PROFILE_TYPES:
        out.append(f"{where}.seccompProfile.type: {seccomp!r} lifts the system-call filter; set "
                   "it to RuntimeDefault")
    apparmor = _d(sc.get("appArmorProfile")).get("type")
    if "appArmorProfile" in sc and apparmor not in _PROFILE_TYPES:
        out.append(f"{where}.appArmorProfile.type: {apparmor!r} lifts AppArmor confinement; "
                   "remove it or set it to RuntimeDefault")
    selinux = _d(sc.get("seLinuxOptions"))
    if (selinux.get("type") not in (None, "", *_SELINUX_TYPES) or selinux.get("user")
            or selinux.get("role")):
        out.append(f"{where}.seLinuxOptions: {selinux!r} changes the SELinux label; remove it "
                   "(only the container_t types, without user or role, are allowed)")
    if _d(sc.get("windowsOptions")).get("hostProcess") not in (None, False):
        out.append(f"{where}.windowsOptions.hostProcess: runs on the node itself; remove it")
    return out


def _namespace_rule(obj: dict[str, Any], policy: Policy) -> list[str]:
    ns = _d(obj.get("metadata")).get("namespace")
    if obj.get("kind") in CLUSTER_SCOPED_KINDS:
        return []  # the kind rule refuses it; a namespace would not scope it anyway
    if not ns:
        return [f"metadata.namespace: missing; set it to {policy.namespace!r} (the sandbox "
                "namespace; without it the object would land in the client's default namespace)"]
    if ns != policy.namespace:
        return [f"metadata.namespace: {ns!r} is outside the sandbox; set it to "
                f"{policy.namespace!r} (the only namespace this study may write)"]
    return []


def _kind_rule(obj: dict[str, Any], policy: Policy) -> list[str]:
    kind, api = obj.get("kind"), obj.get("apiVersion")
    if not isinstance(kind, str) or not kind or not isinstance(api, str) or not api:
        return ["apiVersion/kind: missing; give both (e.g. apiVersion: apps/v1, kind: Deployment)"]
    allowed = writable_kinds(policy.lws, policy.dra)
    group = _group(api)
    if (group, kind) in allowed:
        return []
    names = ", ".join(sorted(f"{k} ({g or 'core'})" for g, k in allowed))
    hint = ""
    if kind == "LeaderWorkerSet" and not policy.lws:
        hint = ("; a replica spanning nodes needs the sandbox rendered with --lws, otherwise "
                "lower tp/pp so one replica fits a node")
    elif kind in _DRA_KINDS and not policy.dra:
        hint = ("; DRA claims need the sandbox rendered with --dra, otherwise request "
                "nvidia.com/gpu in the container resources")
    elif kind == "Pod":
        hint = "; wrap the pod in a Deployment or a Job"
    elif any(k == kind for _, k in allowed):
        hint = f"; {kind} is allowed under another apiVersion group"
    return [f"kind: {kind} ({api}) is outside the sandbox Role; apply only {names}{hint}"]


def _pod_rules(spec: dict[str, Any], path: str, policy: Policy) -> list[str]:
    out: list[str] = []
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field) not in (None, False):
            rdma = (" and a PD layout's KV transfer gets RDMA NICs through DRA "
                    "(SglangOptions.dra_nic_class) or uses mooncake_tcp"
                    if field == "hostNetwork" else "")
            out.append(f"{path}.{field}: {spec[field]!r} shares the node's {_HOST_NS[field]} "
                       "namespace; remove it (pods reach each other over the pod network and "
                       f"the Service{rdma})")
    for i, vol in enumerate(_l(spec.get("volumes"))):
        out += _volume_rules(_d(vol), f"{path}.volumes[{i}]", policy)
    pod_sc = _d(spec.get("securityContext"))
    out += _security_context_rules(pod_sc, f"{path}.securityContext")
    unsafe = [str(_d(x).get("name")) for x in _l(pod_sc.get("sysctls"))
              if _d(x).get("name") not in SAFE_SYSCTLS]
    if unsafe:
        out.append(f"{path}.securityContext.sysctls: {', '.join(map(repr, unsafe))} outside the "
                   "safe set of the Pod Security Standards; remove them (allowed: "
                   f"{', '.join(sorted(SAFE_SYSCTLS))})")
    if pod_sc.get("runAsUser") == 0:
        out.append(f"{path}.securityContext.runAsUser: 0 runs as root; set runAsUser: 1000 "
                   "(the image's non-root user)")
    pod_nonroot = pod_sc.get("runAsNonRoot")
    if pod_nonroot is not None and pod_nonroot is not True:
        out.append(f"{path}.securityContext.runAsNonRoot: {pod_nonroot!r} allows root; set it "
                   "to true")
    unset, no_seccomp = [], []
    pod_seccomp = "seccompProfile" in pod_sc
    for cpath, c in _containers(spec, path):
        out += _container_rules(c, cpath, policy)
        sc = _d(c.get("securityContext"))
        if sc.get("runAsNonRoot") is None and pod_nonroot is None:
            unset.append(cpath)
        if not pod_seccomp and "seccompProfile" not in sc:
            no_seccomp.append(cpath)
    if unset:
        out.append(f"{path}.securityContext.runAsNonRoot: unset, so {', '.join(unset)} may run "
                   "as root; set runAsNonRoot: true (and runAsUser: 1000) in the pod's "
                   "securityContext")
    if no_seccomp:
        out.append(f"{path}.securityContext.seccompProfile: unset, so {', '.join(no_seccomp)} "
                   "may run without a system-call filter; set seccompProfile.type: "
                   "RuntimeDefault in the pod's securityContext")
    return out


def _container_rules(c: dict[str, Any], path: str, policy: Policy) -> list[str]:
    out: list[str] = []
    image = c.get("image")
    if not isinstance(image, str) or not image:
        out.append(f"{path}.image: missing; give an image matching "
                   f"{', '.join(policy.image_allow)}")
    elif not policy.image_allowed(image):
        out.append(f"{path}.image: {image!r} is outside the image allow-list; use an image "
                   f"starting with {' or '.join(repr(p) for p in policy.image_allow)} "
                   "(the pinned SGLang image is lmsysorg/sglang:v<engine_version>)")
    for i, port in enumerate(_l(c.get("ports"))):
        if _d(port).get("hostPort") not in (None, 0):
            out.append(f"{path}.ports[{i}].hostPort: binds a port of the node; remove hostPort "
                       "and reach the pod through its Service")
    sc = _d(c.get("securityContext"))
    where = f"{path}.securityContext"
    if sc.get("privileged") not in (None, False):
        out.append(f"{where}.privileged: {sc['privileged']!r} gives the container the node; "
                   "remove it (SGLang needs only the GPUs it requests)")
    if sc.get("allowPrivilegeEscalation") not in (None, False):
        out.append(f"{where}.allowPrivilegeEscalation: {sc['allowPrivilegeEscalation']!r}; set "
                   "it to false")
    added = _l(_d(sc.get("capabilities")).get("add"))
    if added:
        out.append(f"{where}.capabilities.add: {added!r} adds kernel capabilities; remove the "
                   "add list and keep capabilities.drop: [ALL]")
    if sc.get("runAsUser") == 0:
        out.append(f"{where}.runAsUser: 0 runs as root; set runAsUser: 1000 or remove it")
    out += _security_context_rules(sc, where)
    if sc.get("procMount") not in (None, "Default"):
        out.append(f"{where}.procMount: {sc['procMount']!r} unmasks /proc; remove it")
    for i, src in enumerate(_l(c.get("envFrom"))):
        if "secretRef" in _d(src):
            out += _secret_rule(_d(_d(src)["secretRef"]).get("name"),
                                f"{path}.envFrom[{i}].secretRef", policy)
    for i, var in enumerate(_l(c.get("env"))):
        ref = _d(_d(var).get("valueFrom")).get("secretKeyRef")
        if ref is not None:
            out += _secret_rule(_d(ref).get("name"),
                                f"{path}.env[{i}].valueFrom.secretKeyRef", policy)
    nonroot = sc.get("runAsNonRoot")
    if nonroot is not None and nonroot is not True:
        out.append(f"{where}.runAsNonRoot: {nonroot!r} allows root; set it to true or remove it "
                   "(the pod's securityContext sets it)")
    return out


# --------------------------------------------------------------------------- GPU budget


def _gpu_quantity(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def _is_gpu_resource(name: str) -> bool:
    return name in _GPU_RESOURCES or name.startswith(_MIG_PREFIX)


def _container_gpus(c: dict[str, Any], path: str) -> tuple[int, list[str]]:
    """GPUs of one container: its GPU resources summed (one GPU per unit of each).

    A resource name with a ``/`` that is neither a GPU resource nor in a ``kubernetes.io``
    domain (reserved for Kubernetes' own resources) is an extended resource the budget cannot
    judge -- another vendor's accelerator (``amd.com/gpu``, ``habana.ai/gaudi``...) or a device
    plugin of unknown kind -- and is refused.
    """
    res = _d(c.get("resources"))
    per_name: dict[str, int] = {}
    errors: list[str] = []
    refused: set[str] = set()
    for section in ("limits", "requests"):
        for key, value in _d(res.get(section)).items():
            key = str(key)
            domain = key.split("/", 1)[0] if "/" in key else None
            if not _is_gpu_resource(key):
                if domain is not None and domain != "kubernetes.io" and \
                        not domain.endswith(".kubernetes.io") and key not in refused:
                    refused.add(key)  # once, not once per limits and requests
                    errors.append(
                        f"{path}.resources.{section}[{key!r}]: an extended resource the GPU "
                        "budget cannot count; request GPUs as nvidia.com/gpu (or "
                        "nvidia.com/gpu.shared, nvidia.com/mig-*) and nothing else")
                continue
            q = _gpu_quantity(value)
            if q is None:
                errors.append(f"{path}.resources.{section}[{key!r}]: {value!r} is not a whole GPU "
                              "count; give an integer such as 8")
            else:  # requests equal limits for extended resources; take the larger
                per_name[key] = max(per_name.get(key, 0), q)
    return sum(per_name.values()), errors


def _pod_gpus(spec: dict[str, Any], path: str,
              claims: dict[str, int]) -> tuple[int, list[str]]:
    """GPUs of one pod: Kubernetes' effective request (max of init peak and running sum)."""
    errors: list[str] = []

    def gpus(field: str) -> list[tuple[int, bool]]:
        out = []
        for i, c in enumerate(_l(spec.get(field))):
            n, err = _container_gpus(_d(c), f"{path}.{field}[{i}]")
            errors.extend(err)
            out.append((n, _d(c).get("restartPolicy") == "Always"))  # sidecar init container
        return out

    inits, mains = gpus("initContainers"), gpus("containers")
    sidecars = sum(n for n, side in inits if side)
    running = sum(n for n, _ in mains) + sidecars
    peak = max((n for n, side in inits if not side), default=0)
    dra = 0
    for i, ref in enumerate(_l(spec.get("resourceClaims"))):
        ref = _d(ref)
        tmpl = ref.get("resourceClaimTemplateName") or _d(ref.get("source")).get(
            "resourceClaimTemplateName")
        if not tmpl:
            continue  # a shared ResourceClaim counts once, as its own object
        if tmpl not in claims:
            errors.append(f"{path}.resourceClaims[{i}]: ResourceClaimTemplate {tmpl!r} is not "
                          "in this apply, so its GPUs cannot be counted against the budget; "
                          "apply the template together with the workload")
            continue
        dra += claims[tmpl]
    return max(running, peak) + dra, errors


def _claim_gpus(obj: dict[str, Any], policy: Policy | None) -> tuple[int, list[str]]:
    """GPUs of a ResourceClaim(Template): devices of a GPU device class, per instance.

    A request of a class in neither ``policy.dra_gpu_classes`` nor ``policy.dra_other_classes``
    (defaults without a policy: :data:`DEFAULT_DRA_GPU_CLASSES`, none) is refused.
    """
    gpu_classes = policy.dra_gpu_classes if policy else DEFAULT_DRA_GPU_CLASSES
    other_classes = policy.dra_other_classes if policy else ()
    spec = _d(obj.get("spec"))
    if obj.get("kind") == "ResourceClaimTemplate":
        spec, base = _d(spec.get("spec")), "spec.spec.devices.requests"
    else:
        base = "spec.devices.requests"
    n, errors = 0, []
    for i, req in enumerate(_l(_d(spec.get("devices")).get("requests"))):
        req = _d(req)
        # v1/v1beta2: {exactly: {...}} or {firstAvailable: [...]}; v1beta1: fields inline.
        options = ([(f"{base}[{i}].exactly", _d(req["exactly"]))] if "exactly" in req else
                   [(f"{base}[{i}].firstAvailable[{j}]", _d(s))
                    for j, s in enumerate(_l(req.get("firstAvailable")))] or
                   [(f"{base}[{i}]", req)])
        most = 0
        for path, r in options:
            device_class = r.get("deviceClassName")
            if device_class in other_classes:
                continue
            if device_class not in gpu_classes:
                errors.append(
                    f"{path}.deviceClassName: {device_class!r} is not a DeviceClass the GPU "
                    f"budget counts; claim {' or '.join(gpu_classes) or 'no class'}"
                    + (f" (or {', '.join(other_classes)}, which hold no GPU)"
                       if other_classes else ""))
                continue
            if r.get("allocationMode") == "All":
                errors.append(f"{path}.allocationMode: All takes every matching GPU of a node, "
                              "which the budget cannot bound; use allocationMode: ExactCount "
                              "with count")
                continue
            q = _gpu_quantity(r.get("count", 1))
            if q is None:
                errors.append(f"{path}.count: {r.get('count')!r} is not a whole GPU count; give "
                              "an integer")
                continue
            most = max(most, q)  # one subrequest is chosen: count the largest
        n += most
    return n, errors


def _count_gpus(objs: list[Any],
                policy: Policy | None = None) -> tuple[int, list[str], list[str]]:
    """(total GPUs, one breakdown line per object holding GPUs, errors)."""
    objs = [o for o in objs if isinstance(o, dict)]
    claims: dict[str, int] = {}
    total, lines, errors = 0, [], []
    for obj in objs:
        if obj.get("kind") in _DRA_KINDS:
            n, err = _claim_gpus(obj, policy)
            errors += [f"{_who(obj)}: {e}" for e in err]
            if obj["kind"] == "ResourceClaimTemplate":
                claims[str(_d(obj.get("metadata")).get("name"))] = n
            elif n:
                total += n
                lines.append(f"{_who(obj)}: {n} (a shared claim)")
    for obj in objs:
        for pods in _pod_templates(obj):
            per_pod, err = _pod_gpus(pods.spec, pods.path, claims)
            errors += [f"{_who(obj)}: {e}" for e in pods.errors + err]
            if per_pod and pods.pods:
                total += per_pod * pods.pods
                lines.append(f"{_who(obj)}: {pods.pods} pod{'s' * (pods.pods != 1)} "
                             f"({pods.why}) x {per_pod} GPUs per pod of {pods.path} "
                             f"= {per_pod * pods.pods}")
    return total, lines, errors


def _budget_violations(objs: list[Any], policy: Policy, already_used: int) -> list[str]:
    total, lines, errors = _count_gpus(objs, policy)
    out = list(errors)
    if total + already_used > policy.gpu_budget:
        left = max(policy.gpu_budget - already_used, 0)
        held = f" and the study already holds {already_used}" if already_used else ""
        out.append(
            f"GPU budget: these objects request {total} GPUs ({'; '.join(lines)}){held}, "
            f"beyond the study's budget of {policy.gpu_budget}; fit the "
            f"request in the {left} GPUs left (fewer replicas, a smaller tp/pp size or "
            "LeaderWorkerSet size) or tear down a running deployment first")
    return out
