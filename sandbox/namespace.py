"""The sandbox namespace a headless ``servetune run`` lives in, as Kubernetes objects.

Its blast radius is the namespace: the runner's ServiceAccount holds a namespaced Role with
exactly the grants of ``sandbox.rbac`` (no Secrets, no pods/exec, nothing cluster-wide), a
ResourceQuota caps GPUs, pods, CPU and memory, the NetworkPolicy keeps traffic inside the
namespace (plus DNS and the API server), and Pod Security admission enforces ``restricted``.
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any

import yaml

from sandbox.podspec import (
    MANAGED_BY_LABEL,
    STUDY_LABEL,
    check_image,
    check_namespace,
    check_quantity,
    check_subdomain,
    container_security,
    label_value,
    pod_security,
)
from sandbox.rbac import role_rules
from sandbox.validate import check_k8s_version, minor

SA_NAME = "servetune"
STUDY_CONFIGMAP = "servetune-study"
DATA_PVC = "servetune-data"
RUNNER_JOB = "servetune-run"
STUDY_DIR = "/etc/servetune"  # where the runner Job mounts the study ConfigMap
STUDY_PATH = f"{STUDY_DIR}/study.yaml"
DATA_DIR = "/data"
# Where sandbox/Dockerfile puts the repository (WORKDIR /opt/servetune; COPY data ./data): a
# trace shipped under data/ is read from there in the Job.
IMAGE_REPO_ROOT = "/opt/servetune"
# A ConfigMap holds at most 1 MiB of data, all keys together (Kubernetes docs, "ConfigMaps":
# MaxSecretSize).
CONFIGMAP_MAX_BYTES = 1 << 20
TRACE_KEY = "replay-trace"  # ConfigMap key of an embedded user trace (plus the file's suffix)
_CONFIGMAP_KEY = re.compile(r"[-._a-zA-Z0-9]+")  # k8s IsConfigMapKey
# Sizing defaults matching sandbox.manifests.SglangOptions (8 CPU, 64 GiB per GPU) plus the
# runner; not measurements.
CPU_PER_GPU = 8
MEMORY_PER_GPU_GIB = 64
RUNNER_CPU, RUNNER_MEMORY = "2", "4Gi"
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # servetune.cli RUN_ID_RE


def render_sandbox(namespace: str, gpus: int, *, image: str, study_yaml: str,
                   k8s_version: str = "1.33", lws: bool = False, dra: bool = False,
                   storage: str = "20Gi", storage_class: str | None = None,
                   cpu: str | None = None, memory: str | None = None, max_pods: int = 32,
                   api_cidr: str = "0.0.0.0/0", run_id: str = "sandbox",
                   api_key_secret: str | None = None,
                   dra_gpu_class: str = "gpu.nvidia.com",
                   model_token_secret: str | None = None,
                   files: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Namespace, RBAC, quotas, network policy, study ConfigMap, data PVC and the runner Job.

    The Job runs ``servetune run /etc/servetune/study.yaml --backend kubernetes --namespace NS
    --out /data/runs --lessons-dir /data/lessons --run-id RUN_ID`` as uid 1000; a retried pod
    resumes the same run from its checkpoint on the PVC.

    Args:
        namespace: the sandbox namespace (a DNS-1123 label).
        gpus: GPUs the study may hold at once (``requests.nvidia.com/gpu``; with ``dra`` also
            ``<dra_gpu_class>.deviceclass.resource.k8s.io/devices``). Only the ``requests.``
            prefix exists for extended resources in a quota (Kubernetes docs, "Resource
            Quotas": overcommit is not allowed for them).
        image: the servetune image (``sandbox/Dockerfile``).
        study_yaml: the study file's text, stored in a ConfigMap (its ``name`` labels objects);
            its ``replay.trace`` must be a path inside the Job (:func:`study_with_trace`).
        k8s_version: target release, e.g. ``'1.33'`` (Pod Security ``*-version`` labels).
        lws: grant LeaderWorkerSets.
        dra: grant ResourceClaims and ResourceClaimTemplates, and quota DRA GPUs.
        storage: size of the PVC holding runs and lessons (a Kubernetes quantity, > 0).
        storage_class: the PVC's storage class (a DNS-1123 subdomain; None: the cluster
            default).
        cpu: quota ``requests.cpu`` (a quantity); None = 8 per GPU + 2 for the runner.
        memory: quota ``requests.memory``/``limits.memory`` (a quantity); None = 64 GiB per
            GPU + 4 GiB.
        max_pods: quota ``pods`` (>= 1).
        api_cidr: where the API server is (egress on TCP 443 and 6443), an IPv4 or IPv6
            network in CIDR notation without host bits. The default allows those ports
            anywhere, which also lets the Claude API and model downloads through; narrow it to
            the control plane (``kubectl get endpoints kubernetes``) when the model cache is
            pre-filled and the brains are deterministic.
        run_id: ``servetune run --run-id``.
        api_key_secret: a Secret whose key ``api-key`` becomes ANTHROPIC_API_KEY (optional).
        dra_gpu_class: DeviceClass of GPUs under DRA.
        model_token_secret: passed on as ``servetune run --model-token-secret``: the Secret
            whose key ``token`` becomes the engines' HF_TOKEN, the one Secret the policy lets
            pods read (optional).
        files: more ConfigMap entries, mounted next to the study under ``/etc/servetune``
            (an embedded trace); keys are ConfigMap keys; study and files together hold at
            most :data:`CONFIGMAP_MAX_BYTES`.

    Returns:
        Manifests as dicts, in apply order.

    Raises:
        ValueError: bad namespace, GPU count, Kubernetes version, quantity, name, CIDR or
            ConfigMap key, or a study that is not a YAML mapping or exceeds a ConfigMap.
    """
    check_namespace(namespace)
    check_image(image)
    version = check_k8s_version(k8s_version)
    if dra and minor(version) < 32:
        raise ValueError(f"--dra needs Kubernetes 1.32 or later (resource.k8s.io/v1beta1 with "
                         f"structured parameters); {version} has no usable DRA API")
    if not RUN_ID.fullmatch(run_id):
        raise ValueError(f"run_id {run_id!r}: a letter or digit, then letters, digits, '-' "
                         "or '_' (at most 64 characters), as servetune run --run-id accepts")
    if gpus < 1:
        raise ValueError(f"gpus {gpus}: give the number of GPUs the study may use (>= 1)")
    if isinstance(max_pods, bool) or not isinstance(max_pods, int) or max_pods < 1:
        raise ValueError(f"max_pods {max_pods!r}: give a pod count >= 1")
    check_cidr(api_cidr, "api_cidr")
    check_quantity(storage, "storage")
    for value, what in ((cpu, "cpu"), (memory, "memory")):
        if value is not None:
            check_quantity(value, what)
    for value, what in ((storage_class, "storage_class"), (api_key_secret, "api_key_secret"),
                        (model_token_secret, "model_token_secret"),
                        (dra_gpu_class, "dra_gpu_class")):
        if value is not None:
            check_subdomain(value, what)
    files = dict(files or {})
    for key in files:
        if key == "study.yaml" or not _CONFIGMAP_KEY.fullmatch(key) or len(key) > 253:
            raise ValueError(f"ConfigMap key {key!r}: letters, digits, '-', '_' or '.', not "
                             "study.yaml")
    try:
        study = yaml.safe_load(study_yaml)
    except yaml.YAMLError as e:
        raise ValueError(f"study YAML does not parse: {e}") from e
    if not isinstance(study, dict):
        raise ValueError("study YAML must be a mapping (a servetune study file)")
    size = len(study_yaml.encode()) + sum(len(v.encode()) for v in files.values())
    if size > CONFIGMAP_MAX_BYTES:
        raise ValueError(f"the study YAML and its files are {size} bytes; a ConfigMap holds "
                         f"at most {CONFIGMAP_MAX_BYTES}")
    labels = {MANAGED_BY_LABEL: "servetune", "app.kubernetes.io/part-of": "servetune-sandbox",
              STUDY_LABEL: label_value(str(study.get("name") or "study")) or "study"}

    def meta(name: str, namespaced: bool = True) -> dict[str, Any]:
        m: dict[str, Any] = {"name": name, "labels": dict(labels)}
        if namespaced:
            m["namespace"] = namespace
        return m

    pss = {f"pod-security.kubernetes.io/{mode}{suffix}": value
           for mode in ("enforce", "audit", "warn")
           for suffix, value in (("", "restricted"), ("-version", f"v{version}"))}
    ns_obj = {"apiVersion": "v1", "kind": "Namespace", "metadata": meta(namespace, False)}
    ns_obj["metadata"]["labels"].update(pss)
    quota: dict[str, str] = {
        "requests.nvidia.com/gpu": str(gpus), "pods": str(max_pods),
        "requests.cpu": cpu or str(CPU_PER_GPU * gpus + int(RUNNER_CPU)),
        "requests.memory": memory or f"{MEMORY_PER_GPU_GIB * gpus + 4}Gi",
        "limits.memory": memory or f"{MEMORY_PER_GPU_GIB * gpus + 4}Gi"}
    if dra:
        quota[f"{dra_gpu_class}.deviceclass.resource.k8s.io/devices"] = str(gpus)
    pvc_spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"],
                                "resources": {"requests": {"storage": storage}}}
    if storage_class:
        pvc_spec["storageClassName"] = storage_class
    return [
        ns_obj,
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(SA_NAME)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta(SA_NAME),
         "rules": role_rules(lws, dra)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": meta(SA_NAME),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": SA_NAME},
         "subjects": [{"kind": "ServiceAccount", "name": SA_NAME, "namespace": namespace}]},
        {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": meta("servetune-quota"),
         "spec": {"hard": quota}},
        # Defaults for containers that set nothing; no default CPU limit (a default below an
        # SGLang pod's request would make the pod invalid) and no max.
        {"apiVersion": "v1", "kind": "LimitRange", "metadata": meta("servetune-limits"),
         "spec": {"limits": [{"type": "Container",
                              "defaultRequest": {"cpu": "100m", "memory": "128Mi"},
                              "default": {"memory": "512Mi"}}]}},
        _network_policy(meta("servetune-sandbox"), api_cidr),
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(STUDY_CONFIGMAP),
         "data": {"study.yaml": study_yaml, **files}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta(DATA_PVC),
         "spec": pvc_spec},
        _runner_job(meta(RUNNER_JOB), labels, namespace, image, run_id, api_key_secret,
                    model_token_secret),
    ]


def check_cidr(cidr: str, what: str = "cidr") -> str:
    """``cidr`` if it is an IPv4 or IPv6 network (``10.0.0.0/16``; no host bits set).

    Raises:
        ValueError: not a network in CIDR notation (``ipaddress.ip_network``, strict).
    """
    try:
        ipaddress.ip_network(cidr, strict=True)
        if "/" not in cidr:
            raise ValueError("no prefix length")
    except (ValueError, TypeError) as e:
        raise ValueError(f"{what} {cidr!r}: give a network in CIDR notation, such as "
                         f"10.96.0.0/12 or 0.0.0.0/0 ({e})") from e
    return cidr


def trace_key(file_name: str) -> str:
    """The ConfigMap key of an embedded trace: ``replay-trace`` plus the file's suffix."""
    suffix = "." + file_name.rsplit(".", 1)[1] if "." in file_name else ""
    return TRACE_KEY + (suffix if _CONFIGMAP_KEY.fullmatch(suffix or "x") else "")


def study_with_trace(study_yaml: str, trace: str) -> str:
    """The study text with ``replay.trace`` set to ``trace`` (a path inside the Job).

    The scalar is replaced where it stands, so comments and layout stay; a study where that
    cannot be done (an alias, flow style) is dumped again from its parsed form.

    Raises:
        ValueError: the study has no ``replay`` mapping with a ``trace``.
    """
    data = yaml.safe_load(study_yaml)
    if not isinstance(data, dict) or not isinstance(data.get("replay"), dict) \
            or "trace" not in data["replay"]:
        raise ValueError("the study has no replay.trace to point at the Job's copy")
    want = {**data, "replay": {**data["replay"], "trace": trace}}
    node = yaml.compose(study_yaml, Loader=yaml.SafeLoader)
    text = None
    for key, value in node.value if isinstance(node, yaml.MappingNode) else []:
        if key.value == "replay" and isinstance(value, yaml.MappingNode):
            for k, v in value.value:
                if k.value == "trace" and isinstance(v, yaml.ScalarNode):
                    start, end = v.start_mark.index, v.end_mark.index
                    text = study_yaml[:start] + json.dumps(trace) + study_yaml[end:]
    if text is None or yaml.safe_load(text) != want:
        text = yaml.safe_dump(want, sort_keys=False, allow_unicode=True)
    return text


def _network_policy(meta: dict[str, Any], api_cidr: str) -> dict[str, Any]:
    in_namespace = [{"podSelector": {}}]
    dns = {"to": [{"namespaceSelector": {"matchLabels": {
                      "kubernetes.io/metadata.name": "kube-system"}},
                   "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
           "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    api = {"to": [{"ipBlock": {"cidr": api_cidr}}],
           "ports": [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}]}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta,
            "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"],
                     "ingress": [{"from": in_namespace}],
                     "egress": [{"to": in_namespace}, dns, api]}}


def _runner_job(meta: dict[str, Any], labels: dict[str, str], namespace: str, image: str,
                run_id: str, api_key_secret: str | None,
                model_token_secret: str | None) -> dict[str, Any]:
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/home/servetune"},
        {"name": "SERVETUNE_STATE_DIR", "value": f"{DATA_DIR}/state"}]
    if api_key_secret:
        env.append({"name": "ANTHROPIC_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": api_key_secret, "key": "api-key", "optional": True}}})
    container = {
        "name": "servetune", "image": image, "command": ["servetune"],
        "args": ["run", STUDY_PATH, "--backend", "kubernetes", "--namespace", namespace,
                 "--out", f"{DATA_DIR}/runs", "--lessons-dir", f"{DATA_DIR}/lessons",
                 "--run-id", run_id,
                 *(["--model-token-secret", model_token_secret] if model_token_secret else [])],
        "env": env, "securityContext": container_security(),
        "resources": {"requests": {"cpu": RUNNER_CPU, "memory": RUNNER_MEMORY},
                      "limits": {"memory": RUNNER_MEMORY}},
        "volumeMounts": [{"name": "study", "mountPath": STUDY_DIR, "readOnly": True},
                         {"name": "data", "mountPath": DATA_DIR},
                         {"name": "home", "mountPath": "/home/servetune"},
                         {"name": "tmp", "mountPath": "/tmp"}]}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": {"backoffLimit": 2, "template": {
                "metadata": {"labels": {**labels, "servetune.io/component": "runner"}},
                "spec": {"serviceAccountName": SA_NAME, "restartPolicy": "Never",
                         "securityContext": pod_security(), "containers": [container],
                         "volumes": [
                             {"name": "study", "configMap": {"name": STUDY_CONFIGMAP}},
                             {"name": "data", "persistentVolumeClaim": {"claimName": DATA_PVC}},
                             {"name": "home", "emptyDir": {}},
                             {"name": "tmp", "emptyDir": {}}]}}}}
