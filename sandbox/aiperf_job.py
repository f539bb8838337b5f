"""The Kubernetes Job that runs ``aiperf profile`` beside the engine (rendered only).

:func:`job_manifest` is a ``batch/v1`` Job manifest dict (pinned image, explicit CPU requests =
limits, pod-security ``restricted``) for the sandbox's Role to create; the command line, the
converted trace, the tokenizer cache and the artifacts come from the aiperf adapter
(:mod:`mcp_servers.bench.aiperf`). This module owns the pinned aiperf release and the offline
Hugging Face environment both the Job and the local runner give aiperf.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

AIPERF_VERSION = "0.13.0"
"""The aiperf release servetune is written and tested against (pyproject extra ``aiperf``, the
sandbox image's ``EXTRAS=aiperf``)."""


class AiperfJobError(ValueError):
    """The aiperf Job cannot be rendered: bad name, CPUs or memory, or no command."""


def hf_offline_env(cache_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Environment for aiperf: the HF cache ``cache_dir``, and no hub access at all (loadgen [3]).

    aiperf's trace-replay decode workers force ``HF_HUB_OFFLINE=1``; the other variables keep
    transformers, datasets and telemetry off the network too (``shared/reference/loadgen.md``).
    """
    return {"HF_HUB_CACHE": str(cache_dir), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1"}


def job_manifest(name: str, *, namespace: str, image: str, aiperf_args: Sequence[str],
                 client_cpus: int, memory_gib: float = 4.0, data_claim: str,
                 data_mount: str = "/data", results_mount: str = "/results",
                 hf_cache_subpath: str = "hf-cache",
                 engine_labels: Mapping[str, str] | None = None,
                 topology_key: str = "kubernetes.io/hostname",
                 labels: Mapping[str, str] | None = None,
                 active_deadline_s: int = 7200, ttl_after_finished_s: int = 3600
                 ) -> dict[str, Any]:
    """A Kubernetes ``batch/v1`` Job that runs ``aiperf profile`` beside the engine (rendered only).

    The pod gets ``client_cpus`` dedicated CPUs (requests = limits, integer, so the Guaranteed
    QoS class and, under the static CPU manager policy, exclusive cores: the client's CPU is
    part of the experiment, loadgen [8]) and ``--workers-max`` should match them
    (``profile_argv`` of :mod:`mcp_servers.bench.aiperf` with the same ``client_cpus``). One
    PersistentVolumeClaim ``data_claim`` carries the converted trace, the tokenizer cache
    (``<data>/<hf_cache_subpath>`` in the HF layout, the adapter's ``prepare_tokenizer``) and,
    under ``<results_mount>``, the artifacts that the adapter's ``parse_artifacts`` reads back.
    ``/tmp`` is a writable emptyDir (aiperf's ZMQ IPC sockets). The pod satisfies pod-security
    ``restricted`` (non-root, no privilege escalation, all capabilities dropped, RuntimeDefault
    seccomp, read-only root filesystem). With
    ``engine_labels`` it prefers the engine pods' ``topology_key`` domain (default: the same
    node, i.e. beside the engine).

    Args:
        name: Job name (DNS-1123 label, at most 63 characters).
        namespace: The sandbox namespace.
        image: Image with ``aiperf==0.13.0`` installed (``aiperf`` on PATH).
        aiperf_args: The command line (``profile_argv`` with in-pod paths), starting with
            the executable.
        client_cpus: Dedicated CPUs (>= 1).
        memory_gib: Memory request = limit, GiB.
        data_claim: PersistentVolumeClaim holding trace, tokenizer cache and results.
        data_mount: Where the claim is mounted.
        results_mount: Mount path of the claim's ``results`` sub-path (the artifact dir).
        hf_cache_subpath: Sub-path of the claim with the HF cache (``HF_HUB_CACHE``).
        engine_labels: Labels of the engine pods to run beside; None for no affinity.
        topology_key: Node label defining "beside" (``kubernetes.io/hostname``: same node;
            ``topology.kubernetes.io/zone``: same zone).
        labels: Extra labels (study, trial) on the Job and its pod.
        active_deadline_s: Kubernetes stops the Job after this many seconds.
        ttl_after_finished_s: The finished Job is garbage-collected after this.

    Raises:
        AiperfJobError: bad name, CPUs or memory, or no command.
    """
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name):
        raise AiperfJobError(f"job name {name!r} must be a DNS-1123 label (lowercase letters, "
                          "digits, '-', at most 63 characters)")
    if client_cpus < 1 or not memory_gib > 0:
        raise AiperfJobError(f"the aiperf Job needs client_cpus >= 1 and memory_gib > 0 (got "
                          f"{client_cpus}, {memory_gib})")
    if not aiperf_args:
        raise AiperfJobError("the aiperf Job needs its command line (profile_argv)")
    all_labels = {"app.kubernetes.io/managed-by": "servetune",
                  "app.kubernetes.io/name": "aiperf",
                  "app.kubernetes.io/component": "loadgen",
                  "app.kubernetes.io/version": AIPERF_VERSION, **(labels or {})}
    resources = {"cpu": str(client_cpus), "memory": f"{int(memory_gib * 1024)}Mi"}
    hf_cache = f"{data_mount.rstrip('/')}/{hf_cache_subpath}"
    env = [{"name": k, "value": v} for k, v in hf_offline_env(hf_cache).items()]
    env += [{"name": "HOME", "value": "/tmp"}, {"name": "MPLCONFIGDIR", "value": "/tmp"}]
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
                            "fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{
            "name": "aiperf", "image": image, "command": [aiperf_args[0]],
            "args": list(aiperf_args[1:]), "env": env, "workingDir": "/tmp",
            "resources": {"requests": resources, "limits": dict(resources)},
            "securityContext": {"allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]},
                                "readOnlyRootFilesystem": True, "runAsNonRoot": True},
            "volumeMounts": [{"name": "data", "mountPath": data_mount},
                             {"name": "data", "mountPath": results_mount,
                              "subPath": "results"},
                             {"name": "tmp", "mountPath": "/tmp"}],
        }],
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": data_claim}},
                    {"name": "tmp", "emptyDir": {"sizeLimit": "2Gi"}}],
    }
    if engine_labels:
        pod_spec["affinity"] = {"podAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{
                "weight": 100, "podAffinityTerm": {
                    "labelSelector": {"matchLabels": dict(engine_labels)},
                    "topologyKey": topology_key}}]}}
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": all_labels},
        "spec": {"backoffLimit": 0, "activeDeadlineSeconds": active_deadline_s,
                 "ttlSecondsAfterFinished": ttl_after_finished_s,
                 "template": {"metadata": {"labels": all_labels}, "spec": pod_spec}},
    }
