"""The manifest policy guard the cluster server runs before every apply.

Pure functions over manifest dicts (no cluster): each refusal names the object, the path inside
it (``spec.template.spec.containers[0].securityContext.privileged``), what is wrong and what to do
instead, so an agent can fix its request without reading Kubernetes documentation.

Rules (one test each in ``tests/test_policy.py``):

- **namespace**: every object lives in ``Policy.namespace`` (a missing namespace is refused too:
  the server would put it in the client's default namespace);
- **kind**: only the (API group, kind) pairs the sandbox Role may write,
  :func:`sandbox.rbac.writable_kinds` -- no Secrets, Pods, ClusterRoles, Namespaces...;
- **privileged** containers, **root** (``runAsUser: 0``, ``runAsNonRoot`` not true at the pod or
  container level, as the pod-security ``restricted`` profile reads them), **hostPath** volumes,
  **hostNetwork / hostPID / hostIPC** and container ``hostPort``, added **capabilities**,
  **allowPrivilegeEscalation: true**, **images** outside the allow-list (init and ephemeral
  containers included);
- **GPU budget**: the GPUs the applied objects request (``*/gpu`` extended resources of each pod x
  its pods -- Deployment replicas, Job parallelism, LeaderWorkerSet replicas x group size -- plus
  GPUs of DRA claims) plus ``already_used`` stay within ``Policy.gpu_budget``.

Pod templates are read from Deployments, Jobs, LeaderWorkerSets (``leaderTemplate`` and
``workerTemplate``), and, so that one answer lists every problem, also from kinds the Role refuses
(Pod, ReplicaSet, StatefulSet, DaemonSet, CronJob).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from domain.errors import ServetuneError
from sandbox.rbac import writable_kinds

DEFAULT_IMAGE_ALLOW: tuple[str, ...] = ("lmsysorg/sglang:", "ghcr.io/servetune/")
"""Image prefixes allowed by default: the pinned SGLang images and servetune's own images."""

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

    Raises:
        ValueError: Empty namespace, negative budget, or an empty allow-list entry.
    """

    namespace: str
    gpu_budget: int
    image_allow: tuple[str, ...] = DEFAULT_IMAGE_ALLOW
    lws: bool = False
    dra: bool = False

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


def gpu_demand(objs: Iterable[dict[str, Any]]) -> int:
    """GPUs the objects hold once running (count), as the budget rule counts them.

    Useful to compute ``already_used`` from the objects a study has applied. Unreadable
    quantities count as 0 here (the budget rule refuses them).
    """
    return _count_gpus(list(objs))[0]


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
    out = [f"{who}: {r}" for r in _namespace_rule(obj, policy) + _kind_rule(obj, policy)]
    for pods in _pod_templates(obj):
        out += [f"{who}: {r}" for r in _pod_rules(pods.spec, pods.path, policy)]
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
            out.append(f"{path}.{field}: {spec[field]!r} shares the node's {_HOST_NS[field]} "
                       "namespace; remove it (pods reach each other over the pod network and "
                       "the Service)")
    for i, vol in enumerate(_l(spec.get("volumes"))):
        if "hostPath" in _d(vol):
            hp = _d(_d(vol).get("hostPath")).get("path")
            out.append(f"{path}.volumes[{i}].hostPath: mounts the node's {hp!r}; use an emptyDir "
                       "(scratch, /dev/shm with medium: Memory) or a PersistentVolumeClaim "
                       "(model cache) instead")
    pod_sc = _d(spec.get("securityContext"))
    if pod_sc.get("runAsUser") == 0:
        out.append(f"{path}.securityContext.runAsUser: 0 runs as root; set runAsUser: 1000 "
                   "(the image's non-root user)")
    pod_nonroot = pod_sc.get("runAsNonRoot")
    if pod_nonroot is not None and pod_nonroot is not True:
        out.append(f"{path}.securityContext.runAsNonRoot: {pod_nonroot!r} allows root; set it "
                   "to true")
    unset = []
    for cpath, c in _containers(spec, path):
        out += _container_rules(c, cpath, policy)
        nonroot = _d(c.get("securityContext")).get("runAsNonRoot")
        if nonroot is None and pod_nonroot is None:
            unset.append(cpath)
    if unset:
        out.append(f"{path}.securityContext.runAsNonRoot: unset, so {', '.join(unset)} may run "
                   "as root; set runAsNonRoot: true (and runAsUser: 1000) in the pod's "
                   "securityContext")
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


def _container_gpus(c: dict[str, Any], path: str) -> tuple[int, list[str]]:
    res = _d(c.get("resources"))
    n, errors = 0, []
    for section in ("limits", "requests"):
        for key, value in _d(res.get(section)).items():
            if not str(key).endswith("/gpu"):
                continue
            q = _gpu_quantity(value)
            if q is None:
                errors.append(f"{path}.resources.{section}[{key!r}]: {value!r} is not a whole GPU "
                              "count; give an integer such as 8")
            else:
                n = max(n, q)  # requests equal limits for extended resources; take the larger
    return n, errors


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


def _claim_gpus(obj: dict[str, Any]) -> tuple[int, list[str]]:
    """GPUs of a ResourceClaim(Template): devices of a GPU device class, per instance."""
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
            if "gpu" not in str(r.get("deviceClassName", "")).lower():
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


def _count_gpus(objs: list[Any]) -> tuple[int, list[str], list[str]]:
    """(total GPUs, one breakdown line per object holding GPUs, errors)."""
    objs = [o for o in objs if isinstance(o, dict)]
    claims: dict[str, int] = {}
    total, lines, errors = 0, [], []
    for obj in objs:
        if obj.get("kind") in _DRA_KINDS:
            n, err = _claim_gpus(obj)
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
    total, lines, errors = _count_gpus(objs)
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
