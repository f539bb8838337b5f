"""The Kubernetes Job that runs aiperf beside the engine (sandbox/aiperf_job.py).

Moved from tests/integration/test_bench_aiperf.py with the renderer (issue 17); the argv comes
from the adapter's :func:`~mcp_servers.bench.aiperf.argv.profile_argv`.
"""

from __future__ import annotations

import json

import pytest

from mcp_servers.bench.aiperf import profile_argv
from sandbox.aiperf_job import AiperfJobError, job_manifest

BASE = dict(urls=["http://10.0.0.5:30000/"], model="glm-5", tokenizer="servetune/words-v1",
            artifact_dir="/results/run1", client_cpus=8)


def test_job_manifest():
    argv = profile_argv(mode="replay", input_file="/data/trace.jsonl", **BASE)
    job = job_manifest("bench-t3-replay", namespace="servetune-sbx", image="reg/aiperf:0.13.0",
                       aiperf_args=argv, client_cpus=8, memory_gib=6, data_claim="bench-data",
                       engine_labels={"servetune/trial": "t3"}, labels={"servetune/study": "s"})
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    meta = job["metadata"]
    assert meta["namespace"] == "servetune-sbx"
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "servetune"
    assert meta["labels"]["servetune/study"] == "s"
    spec = job["spec"]
    assert spec["backoffLimit"] == 0
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["aiperf"] and c["args"] == argv[1:]
    assert c["resources"]["requests"] == c["resources"]["limits"] == {"cpu": "8",
                                                                     "memory": "6144Mi"}
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HUB_CACHE"] == "/data/hf-cache"
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/data", "/results", "/tmp"}
    term = pod["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == {"servetune/trial": "t3"}
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    json.dumps(job)  # plain data
    for bad in (dict(name="Bad_Name"), dict(client_cpus=0), dict(aiperf_args=[])):
        kw = dict(name="ok", namespace="ns", image="i", aiperf_args=argv, client_cpus=2,
                  data_claim="c") | bad
        with pytest.raises(AiperfJobError):
            job_manifest(**kw)


def test_job_manifest_passes_the_sandbox_validation_and_policy():
    """The Job is one the sandbox's Role may create: strict schema for k8s 1.33, and the
    manifest policy (namespace, restricted pod, allowed image, no GPU)."""
    from sandbox.policy import Policy, violations
    from sandbox.validate import validate

    argv = profile_argv(mode="replay", input_file="/data/trace.jsonl", **BASE)
    job = job_manifest("bench-t3-replay", namespace="servetune-sbx",
                       image="ghcr.io/servetune/servetune:0.1.0", aiperf_args=argv,
                       client_cpus=2, data_claim="servetune-data",
                       engine_labels={"servetune.io/deployment": "t3"})
    assert validate([job], "1.33") == []
    assert violations(job, Policy(namespace="servetune-sbx", gpu_budget=0)) == []
    other = violations(job, Policy(namespace="elsewhere", gpu_budget=0,
                                   image_allow=("lmsysorg/sglang:",)))
    assert any("namespace" in v for v in other) and any("image" in v for v in other)
