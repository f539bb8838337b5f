"""The manifest policy guard: one test per rule, combined violations, clean realistic manifests."""

from __future__ import annotations

import copy

import pytest

from sandbox.policy import (
    DEFAULT_IMAGE_ALLOW,
    Policy,
    PolicyViolation,
    enforce,
    gpu_demand,
    violations,
)

NS = "st-glm"
IMAGE = "lmsysorg/sglang:v0.5.23"
POD = "spec.template.spec"
C0 = f"{POD}.containers[0]"
LABELS = {"app.kubernetes.io/managed-by": "servetune", "servetune.io/deployment": "glm-tp8",
          "servetune.io/study": "s1", "servetune.io/trial": "3"}


def policy(**kw):
    return Policy(**{"namespace": NS, "gpu_budget": 16, **kw})


def sglang_deployment(replicas=1, gpus=8, name="glm-tp8"):
    """A Deployment like the one servetune renders for one SGLang replica group."""
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS, "labels": dict(LABELS)},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"servetune.io/deployment": name}},
            "template": {
                "metadata": {"labels": dict(LABELS)},
                "spec": {
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                        "runAsGroup": 1000, "fsGroup": 1000,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "terminationGracePeriodSeconds": 60,
                    "containers": [{
                        "name": "sglang",
                        "image": IMAGE,
                        "command": ["python3", "-m", "sglang.launch_server"],
                        "args": ["--model-path", "zai-org/GLM-5-FP4", "--tp-size", str(gpus),
                                 "--kv-cache-dtype", "fp8_e4m3", "--host", "0.0.0.0",
                                 "--port", "30000"],
                        "env": [{"name": "HOME", "value": "/cache/home"},
                                {"name": "HF_HOME", "value": "/models"},
                                {"name": "TRITON_CACHE_DIR", "value": "/cache/triton"}],
                        "ports": [{"name": "http", "containerPort": 30000}],
                        "resources": {"requests": {"nvidia.com/gpu": gpus, "cpu": "16",
                                                   "memory": "200Gi"},
                                      "limits": {"nvidia.com/gpu": gpus, "memory": "400Gi"}},
                        "readinessProbe": {"httpGet": {"path": "/health", "port": 30000},
                                           "periodSeconds": 10, "timeoutSeconds": 30},
                        "startupProbe": {"httpGet": {"path": "/health", "port": 30000},
                                         "periodSeconds": 10, "timeoutSeconds": 30,
                                         "failureThreshold": 180},
                        "securityContext": {"allowPrivilegeEscalation": False,
                                            "capabilities": {"drop": ["ALL"]},
                                            "runAsNonRoot": True,
                                            "seccompProfile": {"type": "RuntimeDefault"}},
                        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"},
                                         {"name": "models", "mountPath": "/models"},
                                         {"name": "cache", "mountPath": "/cache"},
                                         {"name": "tmp", "mountPath": "/tmp"}],
                    }],
                    "volumes": [
                        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}},
                        {"name": "models", "persistentVolumeClaim": {"claimName": "model-cache"}},
                        {"name": "cache", "emptyDir": {}},
                        {"name": "tmp", "emptyDir": {}},
                    ],
                },
            },
        },
    }


def service(name="glm-tp8"):
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": NS, "labels": dict(LABELS)},
            "spec": {"selector": {"servetune.io/deployment": name},
                     "ports": [{"name": "http", "port": 30000, "targetPort": 30000}]}}


def lws(replicas=1, size=2, gpus=8, leader=True):
    """A LeaderWorkerSet: one replica of ``size`` pods with ``gpus`` each."""
    pod = copy.deepcopy(sglang_deployment(gpus=gpus)["spec"]["template"])
    tmpl = {"size": size, "workerTemplate": pod}
    if leader:
        tmpl["leaderTemplate"] = copy.deepcopy(pod)
    return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": {"name": "glm-pp2", "namespace": NS, "labels": dict(LABELS)},
            "spec": {"replicas": replicas, "leaderWorkerTemplate": tmpl}}


def container(obj):
    return obj["spec"]["template"]["spec"]["containers"][0]


def pod_spec(obj):
    return obj["spec"]["template"]["spec"]


def only(reasons):
    assert len(reasons) == 1, reasons
    return reasons[0]


# --------------------------------------------------------------------------- clean manifests


def test_clean_sglang_deployment_and_service_pass():
    objs = [sglang_deployment(replicas=2), service()]
    assert violations(objs[0], policy()) == []
    assert violations(objs[1], policy()) == []
    enforce(objs, policy())  # 2 x 8 = 16 GPUs, exactly the budget
    assert gpu_demand(objs) == 16


def test_clean_configmap_and_job_pass():
    cm = {"apiVersion": "v1", "kind": "ConfigMap",
          "metadata": {"name": "study", "namespace": NS}, "data": {"study.yaml": "model: x"}}
    job = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": {"name": "bench", "namespace": NS},
           "spec": {"template": {"spec": copy.deepcopy(pod_spec(sglang_deployment(gpus=0)))}}}
    job["spec"]["template"]["spec"]["containers"][0]["image"] = "ghcr.io/servetune/servetune:0.1"
    job["spec"]["template"]["spec"]["restartPolicy"] = "Never"
    enforce([cm, job], policy(gpu_budget=0))


# --------------------------------------------------------------------------- one test per rule


def test_namespace_other_is_refused():
    d = sglang_deployment()
    d["metadata"]["namespace"] = "kube-system"
    r = only(violations(d, policy()))
    assert r.startswith("Deployment/glm-tp8: metadata.namespace: 'kube-system'")
    assert f"set it to '{NS}'" in r


def test_namespace_missing_is_refused():
    d = sglang_deployment()
    del d["metadata"]["namespace"]
    r = only(violations(d, policy()))
    assert "metadata.namespace: missing" in r and f"'{NS}'" in r


@pytest.mark.parametrize("kind,api", [
    ("Secret", "v1"), ("ClusterRole", "rbac.authorization.k8s.io/v1"), ("Namespace", "v1"),
    ("Pod", "v1"), ("Role", "rbac.authorization.k8s.io/v1"), ("DaemonSet", "apps/v1"),
    ("Deployment", "extensions/v1beta1"),
], ids=["secret", "clusterrole", "namespace", "pod", "role", "daemonset", "wrong-group"])
def test_kind_outside_role_is_refused(kind, api):
    obj = {"apiVersion": api, "kind": kind, "metadata": {"name": "x", "namespace": NS},
           "spec": {}}
    reasons = violations(obj, policy())
    kind_reasons = [r for r in reasons if ": kind: " in r]
    assert len(kind_reasons) == 1, reasons
    assert f"kind: {kind} ({api}) is outside the sandbox Role" in kind_reasons[0]
    assert "Deployment (apps)" in kind_reasons[0]  # says what is allowed instead


def test_cluster_scoped_kind_gets_only_the_kind_reason():
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "other"}}
    assert len(violations(ns, policy())) == 1


def test_missing_kind_is_refused():
    r = only(violations({"metadata": {"name": "x", "namespace": NS}}, policy()))
    assert "apiVersion/kind: missing" in r


def test_lws_and_dra_kinds_follow_the_role_options():
    obj = lws()
    r = only(violations(obj, policy()))
    assert "LeaderWorkerSet" in r and "--lws" in r
    assert violations(obj, policy(lws=True)) == []
    rct = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
           "metadata": {"name": "gpus", "namespace": NS}, "spec": {"spec": {"devices": {}}}}
    assert "--dra" in only(violations(rct, policy()))
    assert violations(rct, policy(dra=True)) == []


def test_privileged_is_refused():
    d = sglang_deployment()
    container(d)["securityContext"]["privileged"] = True
    r = only(violations(d, policy()))
    assert f"{C0}.securityContext.privileged: True" in r and "remove it" in r


@pytest.mark.parametrize("where", ["pod", "container"])
def test_run_as_user_zero_is_refused(where):
    d = sglang_deployment()
    sc = pod_spec(d)["securityContext"] if where == "pod" else container(d)["securityContext"]
    sc["runAsUser"] = 0
    path = f"{POD}.securityContext" if where == "pod" else f"{C0}.securityContext"
    r = only(violations(d, policy()))
    assert f"{path}.runAsUser: 0 runs as root" in r and "1000" in r


@pytest.mark.parametrize("where", ["pod", "container"])
def test_run_as_non_root_false_is_refused(where):
    d = sglang_deployment()
    sc = pod_spec(d)["securityContext"] if where == "pod" else container(d)["securityContext"]
    sc["runAsNonRoot"] = False
    path = f"{POD}.securityContext" if where == "pod" else f"{C0}.securityContext"
    r = only(violations(d, policy()))
    assert f"{path}.runAsNonRoot: False allows root; set it to true" in r


def test_run_as_non_root_unset_is_refused():
    d = sglang_deployment()
    del pod_spec(d)["securityContext"]["runAsNonRoot"]
    del container(d)["securityContext"]["runAsNonRoot"]
    r = only(violations(d, policy()))
    assert f"{POD}.securityContext.runAsNonRoot: unset, so {C0} may run as root" in r
    # Set on the container only is enough (the restricted profile reads it that way).
    container(d)["securityContext"]["runAsNonRoot"] = True
    assert violations(d, policy()) == []


def test_host_path_volume_is_refused():
    d = sglang_deployment()
    pod_spec(d)["volumes"].append({"name": "models-host", "hostPath": {"path": "/mnt/models"}})
    r = only(violations(d, policy()))
    assert f"{POD}.volumes[4].hostPath: mounts the node's '/mnt/models'" in r
    assert "PersistentVolumeClaim" in r


@pytest.mark.parametrize("field,words", [
    ("hostNetwork", "network"), ("hostPID", "process (PID)"), ("hostIPC", "IPC")])
def test_host_namespaces_are_refused(field, words):
    d = sglang_deployment()
    pod_spec(d)[field] = True
    r = only(violations(d, policy()))
    assert f"{POD}.{field}: True shares the node's {words} namespace; remove it" in r
    pod_spec(d)[field] = False
    assert violations(d, policy()) == []


def test_host_port_is_refused():
    d = sglang_deployment()
    container(d)["ports"][0]["hostPort"] = 30000
    assert f"{C0}.ports[0].hostPort: binds a port of the node" in only(violations(d, policy()))


def test_added_capabilities_are_refused():
    d = sglang_deployment()
    container(d)["securityContext"]["capabilities"]["add"] = ["SYS_ADMIN", "IPC_LOCK"]
    r = only(violations(d, policy()))
    assert f"{C0}.securityContext.capabilities.add: ['SYS_ADMIN', 'IPC_LOCK']" in r
    assert "drop: [ALL]" in r


def test_allow_privilege_escalation_is_refused():
    d = sglang_deployment()
    container(d)["securityContext"]["allowPrivilegeEscalation"] = True
    r = only(violations(d, policy()))
    assert f"{C0}.securityContext.allowPrivilegeEscalation: True; set it to false" in r


@pytest.mark.parametrize("field", ["containers", "initContainers", "ephemeralContainers"])
def test_image_outside_allow_list_is_refused(field):
    d = sglang_deployment()
    extra = {"name": "x", "image": "evil.io/miner:latest",
             "securityContext": {"allowPrivilegeEscalation": False}}
    if field == "containers":
        container(d)["image"] = extra["image"]
    else:
        pod_spec(d)[field] = [extra]
    r = only(violations(d, policy()))
    assert f"{POD}.{field}[0].image: 'evil.io/miner:latest' is outside the image allow-list" in r
    assert "'lmsysorg/sglang:'" in r


@pytest.mark.parametrize("image,ok", [
    ("lmsysorg/sglang:v0.5.23", True),
    ("docker.io/lmsysorg/sglang:v0.5.23-cu129", True),
    ("ghcr.io/servetune/servetune:0.1", True),
    ("lmsysorg/sglang-evil:v1", False),    # a longer repository name is not the prefix
    ("lmsysorg/sglang@sha256:abc", False),  # digest is not under the "lmsysorg/sglang:" prefix
    ("ghcr.io/servetune-x/a:1", False),
    ("", False),
], ids=lambda v: str(v) or "empty")
def test_image_allow_list_matching(image, ok):
    assert policy().image_allowed(image) is ok


def test_image_allow_exact_entry_and_missing_image():
    p = policy(image_allow=("lmsysorg/sglang:v0.5.23",))
    assert p.image_allowed("lmsysorg/sglang:v0.5.23")
    assert not p.image_allowed("lmsysorg/sglang:v0.5.23-rc")  # exact entry, not a prefix
    d = sglang_deployment()
    del container(d)["image"]
    assert f"{C0}.image: missing" in only(violations(d, policy()))


def test_gpu_budget_counts_replicas():
    d = sglang_deployment(replicas=3)  # 3 x 8 = 24 > 16
    r = only(violations(d, policy()))
    assert r.startswith("GPU budget: these objects request 24 GPUs")
    assert "3 pods (spec.replicas=3) x 8 GPUs per pod" in r
    assert "budget of 16" in r and "16 GPUs left" in r and "already holds" not in r


def test_gpu_budget_counts_already_used_and_every_object():
    objs = [sglang_deployment(name="a"), sglang_deployment(name="b")]  # 16
    enforce(objs, policy())
    with pytest.raises(PolicyViolation) as e:
        enforce(objs, policy(), already_used=8)
    r = only(e.value.reasons)
    assert "request 16 GPUs" in r and "already holds 8" in r and "8 GPUs left" in r
    assert "Deployment/a" in r and "Deployment/b" in r
    assert violations(objs[0], policy(), already_used=8) == []  # 8 + 8 fits alone


@pytest.mark.parametrize("replicas,size,leader,expected", [
    (1, 2, True, 16), (2, 2, True, 32), (1, 4, True, 32), (2, 3, False, 48)],
    ids=["1x2", "2x2", "1x4", "2x3-no-leader-template"])
def test_gpu_budget_counts_lws_group_size(replicas, size, leader, expected):
    obj = lws(replicas=replicas, size=size, leader=leader)
    assert gpu_demand([obj]) == expected
    assert violations(obj, policy(lws=True, gpu_budget=expected)) == []
    r = only(violations(obj, policy(lws=True, gpu_budget=expected - 1)))
    assert f"request {expected} GPUs" in r


def test_gpu_budget_job_parallelism_and_init_containers():
    job = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": {"name": "probe", "namespace": NS},
           "spec": {"parallelism": 2,
                    "template": {"spec": copy.deepcopy(pod_spec(sglang_deployment(gpus=2)))}}}
    spec = job["spec"]["template"]["spec"]
    # An init container's GPUs are held before the app containers start: the pod needs the max.
    spec["initContainers"] = [{"name": "warm", "image": IMAGE,
                               "resources": {"limits": {"nvidia.com/gpu": "4"}}}]
    assert gpu_demand([job]) == 2 * 4


def test_gpu_quantity_and_replicas_must_be_counts():
    d = sglang_deployment()
    container(d)["resources"]["limits"]["nvidia.com/gpu"] = "500m"
    d["spec"]["replicas"] = "two"
    reasons = violations(d, policy())
    assert any("spec.replicas: 'two' is not a count" in r for r in reasons)
    assert any("resources.limits['nvidia.com/gpu']: '500m' is not a whole GPU count" in r
               for r in reasons)


def dra_objs(count=8, mode=None, v1beta1=False):
    exact = {"deviceClassName": "gpu.nvidia.com", "count": count}
    if mode:
        exact["allocationMode"] = mode
    nic = {"deviceClassName": "rdma.mellanox.com", "count": 1}
    reqs = ([{"name": "gpus", **exact}, {"name": "nic", **nic}] if v1beta1 else
            [{"name": "gpus", "exactly": exact}, {"name": "nic", "exactly": nic}])
    rct = {"apiVersion": "resource.k8s.io/v1beta1" if v1beta1 else "resource.k8s.io/v1",
           "kind": "ResourceClaimTemplate", "metadata": {"name": "gpu-nic", "namespace": NS},
           "spec": {"spec": {"devices": {"requests": reqs}}}}
    d = sglang_deployment(replicas=2)
    res = container(d)["resources"]
    for section in ("requests", "limits"):
        del res[section]["nvidia.com/gpu"]
    res["claims"] = [{"name": "gpu-nic"}]
    pod_spec(d)["resourceClaims"] = [{"name": "gpu-nic", "resourceClaimTemplateName": "gpu-nic"}]
    return [rct, d]


@pytest.mark.parametrize("v1beta1", [False, True], ids=["v1", "v1beta1"])
def test_gpu_budget_counts_dra_claim_templates_per_pod(v1beta1):
    objs = dra_objs(v1beta1=v1beta1)
    assert gpu_demand(objs) == 16  # 2 pods x 8 GPUs; the NIC is not a GPU
    nic = {"dra_other_classes": ("rdma.mellanox.com",)}  # a NIC class the operator allows
    enforce(objs, policy(dra=True, **nic))
    with pytest.raises(PolicyViolation, match="request 16 GPUs"):
        enforce(objs, policy(dra=True, gpu_budget=8, **nic))
    with pytest.raises(PolicyViolation, match="'rdma.mellanox.com' is not a DeviceClass"):
        enforce(objs, policy(dra=True))


def test_dra_unbounded_or_missing_template_is_refused():
    rct, d = dra_objs(mode="All")
    r = only(violations(rct, policy(dra=True, dra_other_classes=("rdma.mellanox.com",))))
    assert "spec.spec.devices.requests[0].exactly.allocationMode: All" in r
    assert "ExactCount" in r
    r = only(violations(d, policy(dra=True)))
    assert "ResourceClaimTemplate 'gpu-nic' is not in this apply" in r


# --------------------------------------------------------------------------- combined and API


def test_combined_violations_are_all_reported_in_one_refusal():
    d = sglang_deployment(replicas=4)
    d["metadata"]["namespace"] = "default"
    pod_spec(d)["hostNetwork"] = True
    pod_spec(d)["volumes"].append({"name": "root", "hostPath": {"path": "/"}})
    container(d)["image"] = "ubuntu:24.04"
    container(d)["securityContext"].update(privileged=True, allowPrivilegeEscalation=True,
                                          capabilities={"add": ["NET_ADMIN"]})
    secret = {"apiVersion": "v1", "kind": "Secret",
              "metadata": {"name": "hf-token", "namespace": NS}}
    with pytest.raises(PolicyViolation) as e:
        enforce([d, secret, service()], policy())
    reasons = e.value.reasons
    expected = ["metadata.namespace: 'default'", f"{POD}.hostNetwork", f"{POD}.volumes[4]",
                f"{C0}.image: 'ubuntu:24.04'", f"{C0}.securityContext.privileged",
                f"{C0}.securityContext.allowPrivilegeEscalation",
                f"{C0}.securityContext.capabilities.add", "Secret/hf-token: kind: Secret",
                "GPU budget: these objects request 32 GPUs"]
    assert len(reasons) == len(expected), reasons
    for want in expected:
        assert sum(want in r for r in reasons) == 1, (want, reasons)
    msg = str(e.value)
    assert msg.startswith("the sandbox policy refused 9 problems (nothing was applied):\n- ")
    assert all(f"- {r}" in msg for r in reasons)


def test_policy_validates_itself():
    assert Policy(NS, 8).image_allow == DEFAULT_IMAGE_ALLOW
    with pytest.raises(ValueError, match="namespace"):
        Policy("", 8)
    with pytest.raises(ValueError, match="gpu_budget"):
        Policy(NS, -1)
    with pytest.raises(ValueError, match="empty entry"):
        Policy(NS, 8, image_allow=("",))
    with pytest.raises(ValueError, match="gpu_budget"):
        Policy(NS, ("lmsysorg/sglang:",))
    with pytest.raises(ValueError, match="tuple"):
        Policy(NS, 8, image_allow="lmsysorg/sglang:")


def test_not_a_mapping_is_refused():
    with pytest.raises(PolicyViolation, match="not a Kubernetes object"):
        enforce([["kind", "Deployment"]], policy())


# --------------------------------------------------------------------------- rendered manifests


@pytest.mark.parametrize("opts_kw,policy_kw", [
    ({}, {}),
    ({"router": True}, {}),
    ({"gpus_per_node": 4}, {"lws": True}),
    ({"dra": True, "k8s_version": "1.34"}, {"dra": True}),
    ({"dra": True, "dra_nic_class": "dranet"}, {"dra": True, "dra_other_classes": ("dranet",)}),
], ids=["deployment", "router", "lws", "dra", "dra-nic"])
def test_rendered_sglang_manifests_pass(opts_kw, policy_kw):
    try:
        from sandbox.manifests import SglangOptions, render_sglang
    except ImportError:
        pytest.skip("sandbox.manifests.render_sglang is not written yet")
    from domain.config import ServingConfig

    config = ServingConfig(model="glm-5", gpu="B200", tp_size=8, replicas=2, weights="nvfp4",
                           kv_cache_dtype="fp8_e4m3")
    objs = render_sglang(config, "glm-tp8", NS, dict(LABELS), opts=SglangOptions(**opts_kw))
    p = policy(gpu_budget=config.gpus, **policy_kw)
    enforce(objs, p)
    assert gpu_demand(objs) == config.gpus  # 2 replicas x tp 8
    with pytest.raises(PolicyViolation, match="GPU budget"):
        enforce(objs, policy(gpu_budget=config.gpus - 1, **policy_kw))


# --------------------------------------------------------------------------- D7: Secrets

SECRET_FORMS = ["volume", "projected", "envFrom", "secretKeyRef"]


def with_secret(form, name):
    """The SGLang Deployment reading Secret ``name`` in one of the four ways a pod can."""
    d = sglang_deployment()
    c, spec = container(d), pod_spec(d)
    if form == "volume":
        spec["volumes"].append({"name": "tok", "secret": {"secretName": name}})
    elif form == "projected":
        spec["volumes"].append({"name": "tok", "projected": {"sources": [
            {"configMap": {"name": "cm"}}, {"secret": {"name": name}}]}})
    elif form == "envFrom":
        c["envFrom"] = [{"secretRef": {"name": name}}]
    else:
        c["env"].append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": name, "key": "token"}}})
    return d


@pytest.mark.parametrize("form", SECRET_FORMS)
def test_d7_secret_reads_are_refused(form):
    r = only(violations(with_secret(form, "hf-token"), policy()))
    assert "'hf-token'" in r and "Secret" in r and "--model-token-secret" in r


@pytest.mark.parametrize("form", SECRET_FORMS)
def test_d7_only_the_named_model_token_secret_is_allowed(form):
    p = policy(model_token_secret="hf-token")
    assert violations(with_secret(form, "hf-token"), p) == []
    r = only(violations(with_secret(form, "cloud-creds"), p))
    assert "'cloud-creds'" in r and "only the Secret 'hf-token'" in r


def test_d7_model_token_secret_must_be_a_dns_subdomain():
    for bad in ("", "Bad_Name", "../etc", "a" * 254):
        with pytest.raises(ValueError, match="model_token_secret"):
            Policy(NS, 8, model_token_secret=bad)
    assert Policy(NS, 8, model_token_secret="hf.token-1").model_token_secret == "hf.token-1"


# --------------------------------------------------------------------------- D8: GPU resources


def with_limits(resources, budget=8):
    d = sglang_deployment(gpus=0)
    res = container(d)["resources"]
    for section in ("requests", "limits"):
        del res[section]["nvidia.com/gpu"]
        res[section].update(resources)
    return d


@pytest.mark.parametrize("resource", ["nvidia.com/mig-3g.40gb", "nvidia.com/gpu.shared",
                                      "nvidia.com/mig-1g.10gb"])
def test_d8_mig_and_shared_gpus_count_against_the_budget(resource):
    d = with_limits({resource: 16})
    assert gpu_demand([d]) == 16
    with pytest.raises(PolicyViolation, match="request 16 GPUs"):
        enforce([d], policy(gpu_budget=8))


@pytest.mark.parametrize("resource", ["amd.com/gpu", "gpu.intel.com/i915", "habana.ai/gaudi",
                                      "aws.amazon.com/neuroncore", "google.com/tpu",
                                      "example.com/foo"])
def test_d8_other_extended_resources_are_refused(resource):
    r = only(violations(with_limits({resource: 1}), policy()))
    assert f"[{resource!r}]" in r and "nvidia.com/gpu" in r


def test_d8_dra_mig_class_counts_and_unknown_classes_are_refused():
    rct, d = dra_objs(count=64)
    rct["spec"]["spec"]["devices"]["requests"] = [
        {"name": "gpus", "exactly": {"deviceClassName": "mig.nvidia.com", "count": 64}}]
    assert gpu_demand([rct, d]) == 128  # 2 pods x 64 MIG devices
    with pytest.raises(PolicyViolation, match="request 128 GPUs"):
        enforce([rct, d], policy(dra=True, gpu_budget=8))
    rct["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "tpu.example"
    r = only(violations(rct, policy(dra=True)))
    assert "deviceClassName: 'tpu.example'" in r and "gpu.nvidia.com" in r


# --------------------------------------------------------------------------- pod security

OTHER_NS = "team-x"  # a namespace servetune did not render: no Pod Security admission label


def other_ns(obj):
    obj["metadata"]["namespace"] = OTHER_NS
    return obj


POD_SECURITY_CASES = {
    "seccomp-unconfined-pod": (lambda d: pod_spec(d)["securityContext"].update(
        seccompProfile={"type": "Unconfined"}), "seccompProfile.type: 'Unconfined'"),
    "seccomp-unconfined-container": (lambda d: container(d)["securityContext"].update(
        seccompProfile={"type": "Unconfined"}), "seccompProfile.type: 'Unconfined'"),
    "seccomp-unset": (lambda d: (pod_spec(d)["securityContext"].pop("seccompProfile"),
                                 container(d)["securityContext"].pop("seccompProfile")),
                      "seccompProfile: unset"),
    "apparmor-unconfined": (lambda d: pod_spec(d)["securityContext"].update(
        appArmorProfile={"type": "Unconfined"}), "appArmorProfile.type: 'Unconfined'"),
    "apparmor-container": (lambda d: container(d)["securityContext"].update(
        appArmorProfile={"type": "Unconfined"}), "appArmorProfile.type: 'Unconfined'"),
    "apparmor-annotation": (lambda d: d["spec"]["template"]["metadata"].update(annotations={
        "container.apparmor.security.beta.kubernetes.io/sglang": "unconfined"}),
        "'unconfined'"),
    "sysctl": (lambda d: pod_spec(d)["securityContext"].update(sysctls=[
        {"name": "kernel.shm_rmid_forced", "value": "1"},
        {"name": "net.core.somaxconn", "value": "65535"}]), "'net.core.somaxconn'"),
    "gitrepo": (lambda d: pod_spec(d)["volumes"].append(
        {"name": "src", "gitRepo": {"repository": "https://x/y.git"}}), "volumes[4].gitRepo"),
    "nfs": (lambda d: pod_spec(d)["volumes"].append(
        {"name": "n", "nfs": {"server": "10.0.0.1", "path": "/"}}), "volumes[4].nfs"),
    "hostpath": (lambda d: pod_spec(d)["volumes"].append(
        {"name": "h", "hostPath": {"path": "/"}}), "volumes[4].hostPath"),
    "selinux": (lambda d: container(d)["securityContext"].update(
        seLinuxOptions={"type": "spc_t"}), "seLinuxOptions"),
    "procmount": (lambda d: container(d)["securityContext"].update(procMount="Unmasked"),
                  "procMount"),
    "windows-hostprocess": (lambda d: pod_spec(d)["securityContext"].update(
        windowsOptions={"hostProcess": True}), "hostProcess"),
}


@pytest.mark.parametrize("case", sorted(POD_SECURITY_CASES))
@pytest.mark.parametrize("ns", [NS, OTHER_NS])
def test_pod_security_restricted_fields_are_refused(case, ns):
    change, words = POD_SECURITY_CASES[case]
    d = sglang_deployment()
    d["metadata"]["namespace"] = ns
    change(d)
    r = only(violations(d, policy(namespace=ns)))
    assert words in r, r


def test_pod_security_allowed_values_pass():
    d = other_ns(sglang_deployment())
    pod_spec(d)["securityContext"].update(
        seccompProfile={"type": "Localhost", "localhostProfile": "p.json"},
        appArmorProfile={"type": "RuntimeDefault"},
        sysctls=[{"name": "net.ipv4.tcp_keepalive_time", "value": "60"}])
    del container(d)["securityContext"]["seccompProfile"]
    pod_spec(d)["volumes"].append({"name": "cfg", "configMap": {"name": "c"}})
    pod_spec(d)["volumes"].append({"name": "dapi", "downwardAPI": {"items": []}})
    assert violations(d, policy(namespace=OTHER_NS)) == []
    # seccomp set on every container (none at pod level) is enough
    d = sglang_deployment()
    del pod_spec(d)["securityContext"]["seccompProfile"]
    assert violations(d, policy()) == []


@pytest.mark.parametrize("ns", [NS, OTHER_NS])
@pytest.mark.parametrize("spec,words", [
    ({"type": "NodePort"}, "type: 'NodePort'"),
    ({"type": "LoadBalancer"}, "type: 'LoadBalancer'"),
    ({"type": "ExternalName", "externalName": "evil.example"}, "type: 'ExternalName'"),
    ({"externalIPs": ["203.0.113.7"]}, "externalIPs"),
], ids=["nodeport", "loadbalancer", "externalname", "externalips"])
def test_services_are_cluster_ip_only(ns, spec, words):
    s = service()
    s["metadata"]["namespace"] = ns
    s["spec"].update(spec)
    r = only(violations(s, policy(namespace=ns)))
    assert words in r and "ClusterIP" in r
    s["spec"] = {**service()["spec"], "type": "ClusterIP"}
    assert violations(s, policy(namespace=ns)) == []
