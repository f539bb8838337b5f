"""Sandbox and SGLang manifests: every rendered kind validates, restricted pods, labels, probes.

Rendering goes through ``servetune sandbox render|render-config`` (typer's CliRunner) and the
``sandbox.manifests`` functions; validation is ``sandbox.validate`` (kubernetes-validate strict
for built-in kinds, the LeaderWorkerSet CRD schema for LWS).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from domain.config import ServingConfig
from domain.engines import engine
from sandbox.manifests import SglangOptions, dra_api_version, render_sandbox, render_sglang
from sandbox.rbac import role_rules
from sandbox.validate import check_k8s_version, supported_versions, validate
from servetune.cli import app

REPO = Path(__file__).resolve().parents[2]
STUDY = REPO / "studies" / "default.yaml"
NS = "servetune-sbx"
LABELS = {"app.kubernetes.io/managed-by": "servetune", "servetune.io/study": "glm5-b200",
          "servetune.io/trial": "t-0007"}
VERSIONS = ("1.33", "1.35")  # the pinned release and a later one (DRA v1beta2 vs v1)
# Volume types the restricted profile allows (Pod Security Standards, "Volume Types")
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def cfg(tp: int = 8, replicas: int = 2, **kw) -> ServingConfig:
    return ServingConfig(model="glm-5", gpu="B200", weights="fp8", tp_size=tp,
                         replicas=replicas, **kw)


LAYOUTS = {
    "deployment": (cfg(), SglangOptions()),
    "router": (cfg(replicas=3, router_policy="cache_aware"), SglangOptions(router=True)),
    "dra": (cfg(), SglangOptions(dra=True)),
    "dra-nic-router": (cfg(), SglangOptions(dra=True, dra_nic_class="dranet", router=True)),
    "lws": (cfg(tp=16), SglangOptions()),
    "lws-router-dra": (cfg(tp=16), SglangOptions(router=True, dra=True,
                                                 model_cache_pvc="models")),
}


def render(layout: str, k8s_version: str = "1.33") -> list[dict]:
    config, opts = LAYOUTS[layout]
    opts = opts.model_copy(update={"k8s_version": k8s_version})
    return render_sglang(config, "trial-7", NS, LABELS, opts=opts)


def sandbox_objs(k8s_version: str = "1.33", **kw) -> list[dict]:
    return render_sandbox(NS, 8, image="ghcr.io/servetune/servetune:0.1.0",
                          study_yaml=STUDY.read_text(), k8s_version=k8s_version, **kw)


def pod_templates(obj: dict) -> list[dict]:
    """(template) pod specs inside a workload object."""
    spec = obj.get("spec", {})
    if obj["kind"] in ("Deployment", "Job"):
        return [spec["template"]]
    if obj["kind"] == "LeaderWorkerSet":
        lwt = spec["leaderWorkerTemplate"]
        return [lwt["leaderTemplate"], lwt["workerTemplate"]]
    return []


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


# ----- validation of every rendered kind ------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_sglang_layout_validates(layout, version):
    objs = render(layout, version)
    assert validate(objs, version) == []


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("lws,dra", [(False, False), (True, True)], ids=["base", "lws-dra"])
def test_sandbox_validates(version, lws, dra):
    assert validate(sandbox_objs(version, lws=lws, dra=dra), version) == []


def test_every_kind_servetune_renders_is_covered():
    kinds = {o["kind"] for layout in LAYOUTS for o in render(layout)}
    kinds |= {o["kind"] for o in sandbox_objs(lws=True, dra=True)}
    assert kinds == {"Deployment", "Service", "LeaderWorkerSet", "ResourceClaimTemplate",
                     "Namespace", "ServiceAccount", "Role", "RoleBinding", "ResourceQuota",
                     "LimitRange", "NetworkPolicy", "ConfigMap", "PersistentVolumeClaim", "Job"}


def test_validator_refuses_unknown_fields_kinds_and_names():
    dep = render("deployment")[0]
    dep["spec"]["template"]["spec"]["containers"][0]["gpu"] = 8
    dep["spec"]["selector"]["matchLabels"]["servetune.io/trial"] = "another"
    errors = validate([dep, {"apiVersion": "example.com/v1", "kind": "Widget",
                             "metadata": {"name": "w"}},
                       {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "Bad_Svc"},
                        "spec": {"ports": [{"port": 80}]}}, "not an object"])
    assert errors == [
        "Deployment/trial-7: spec.template.spec.containers[0]: Additional properties are not "
        "allowed ('gpu' was unexpected)",
        "Deployment/trial-7: spec.selector: does not match the template's labels "
        "(spec.template.metadata.labels)",
        "Widget/w: unknown kind Widget of apiVersion example.com/v1 for Kubernetes 1.33: "
        "neither a built-in kind of that release nor a custom resource with a schema in "
        "sandbox/schemas (LeaderWorkerSet)",
        "Service/Bad_Svc: metadata.name: 'Bad_Svc' is not a DNS-1123 label (lowercase letters, "
        "digits and '-', at most 63 characters)",
        "object #3: not a Kubernetes object (needs apiVersion and kind)"]


def test_lws_is_checked_against_its_crd_schema():
    lws = render("lws")[0]
    lwt = lws["spec"]["leaderWorkerTemplate"]
    lwt["sise"] = 2                                                     # typo: unknown field
    lwt["workerTemplate"]["spec"]["containers"][0]["securityContext"]["privileged"] = "yes"
    lws["metadata"]["labels"]["bad"] = 1                                # ObjectMeta check
    assert validate([lws]) == [
        "LeaderWorkerSet/trial-7-engine: spec.leaderWorkerTemplate: Additional properties are "
        "not allowed ('sise' was unexpected)",
        "LeaderWorkerSet/trial-7-engine: spec.leaderWorkerTemplate.workerTemplate.spec."
        "containers[0].securityContext.privileged: 'yes' is not of type 'boolean'",
        "LeaderWorkerSet/trial-7-engine: metadata.labels.bad: 1 is not of type 'string', "
        "'null'",
        # the worker template again, as Kubernetes 1.33's own PodTemplateSpec
        "LeaderWorkerSet/trial-7-engine: spec.leaderWorkerTemplate.workerTemplate.spec."
        "containers[0].securityContext.privileged: 'yes' is not of type 'boolean', 'null'"]


def test_lws_schema_ships_with_its_license_and_source():
    schemas = REPO / "sandbox" / "schemas"
    data = json.loads((schemas / "leaderworkerset-v1.json").read_text())
    assert data["source"]["repository"] == "https://github.com/kubernetes-sigs/lws"
    assert data["source"]["commit"] == "2161f38ff333f9e24d3c44adef7cd5d9787cac00"
    assert "Apache License" in (schemas / "LICENSE-lws.txt").read_text()[:200]


@pytest.mark.parametrize("bad", ["1.20", "2.0", "latest", "1.99"])
def test_k8s_version_outside_the_shipped_schemas_is_refused(bad):
    with pytest.raises(ValueError, match="Kubernetes version"):
        validate([], bad)


def test_k8s_versions():
    assert check_k8s_version("v1.33.4") == "1.33"
    assert {"1.32", "1.33", "1.34"} <= set(supported_versions())


# ----- DRA -----------------------------------------------------------------------------------

@pytest.mark.parametrize("version,api", [("1.32", "resource.k8s.io/v1beta1"),
                                         ("1.33", "resource.k8s.io/v1beta2"),
                                         ("1.34", "resource.k8s.io/v1"),
                                         ("1.36", "resource.k8s.io/v1")])
def test_dra_api_version_follows_kubernetes(version, api):
    assert dra_api_version(version) == api
    claim = render("dra-nic-router", version)[0]
    assert claim["kind"] == "ResourceClaimTemplate" and claim["apiVersion"] == api
    assert validate([claim], version) == []
    devices = claim["spec"]["spec"]["devices"]
    first = devices["requests"][0]
    exact = ({k: v for k, v in first.items() if k != "name"} if api.endswith("v1beta1")
             else first["exactly"])                       # v1beta2 and v1 nest 'exactly'
    assert first["name"] == "gpu-0"
    assert exact == {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount",
                     "count": 1}
    # 8 GPUs each paired with a NIC under one PCIe root
    assert len(devices["requests"]) == 16
    assert devices["constraints"][3] == {"requests": ["gpu-3", "nic-3"],
                                         "matchAttribute": "resource.kubernetes.io/pcieRoot"}


def test_dra_claim_of_another_release_fails_validation():
    claim = render("dra", "1.34")[0]
    assert claim["apiVersion"] == "resource.k8s.io/v1"
    assert "unknown kind ResourceClaimTemplate" in validate([claim], "1.32")[0]
    with pytest.raises(ValueError, match="1.32 or later"):
        dra_api_version("1.31")


def test_dra_pods_claim_devices_instead_of_the_device_plugin():
    claim, dep, _ = render("dra")
    assert claim["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] == 8
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert pod["resourceClaims"] == [{"name": "devices",
                                      "resourceClaimTemplateName": "trial-7-devices"}]
    assert c["resources"]["claims"] == [{"name": "devices"}]
    assert "nvidia.com/gpu" not in c["resources"]["requests"]


# ----- restricted pod security ---------------------------------------------------------------

def all_pods() -> list[tuple[str, dict]]:
    objs = [o for layout in LAYOUTS for o in render(layout)] + sandbox_objs(lws=True, dra=True)
    return [(f"{o['kind']}/{o['metadata']['name']}", t["spec"])
            for o in objs for t in pod_templates(o)]


def test_every_pod_meets_the_restricted_profile():
    pods = all_pods()
    assert len(pods) >= 15
    for where, pod in pods:
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 1000, where
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), where
        for vol in pod.get("volumes", []):
            assert set(vol) - {"name"} <= RESTRICTED_VOLUMES, (where, vol)
        for c in pod["containers"] + pod.get("initContainers", []):
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False, where
            assert csc["capabilities"] == {"drop": ["ALL"]}, where
            assert csc.get("privileged") is not True and csc["runAsNonRoot"] is True, where
            assert all("hostPort" not in p for p in c.get("ports", [])), where


def test_sglang_writes_only_to_volumes():
    c = render("deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/dev/shm", "/tmp", "/cache", env["HOME"]} <= mounts
    for var in ("HF_HOME", "SGLANG_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert env[var].startswith("/cache/"), var


# ----- labels --------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_labels_tie_every_object_and_pod_to_study_and_trial(layout):
    want = {**LABELS, "servetune.io/deployment": "trial-7"}
    for obj in render(layout):
        assert want.items() <= obj["metadata"]["labels"].items(), obj["metadata"]["name"]
        assert obj["metadata"]["namespace"] == NS
        for t in pod_templates(obj):
            assert want.items() <= t["metadata"]["labels"].items()


def test_sandbox_objects_carry_the_study_label():
    for obj in sandbox_objs():
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "servetune"
        assert labels["servetune.io/study"] == "glm5-b200-default"  # the study file's name
        for t in pod_templates(obj):
            assert t["metadata"]["labels"]["servetune.io/study"] == "glm5-b200-default"


@pytest.mark.parametrize("name,labels,match", [
    ("Trial_7", LABELS, "DNS-1123 label"),
    ("t" * 41, LABELS, "at most 40"),
    ("trial-7", {"servetune.io/trial": "has space"}, "label servetune.io/trial"),
    ("trial-7", {"servetune.io/deployment": "other"}, "names another deployment"),
])
def test_bad_names_and_labels_are_refused(name, labels, match):
    with pytest.raises(ValueError, match=match):
        render_sglang(cfg(), name, NS, labels)


# ----- the engine pod: command, GPUs, probes -------------------------------------------------

def test_deployment_engine_container():
    config, _ = LAYOUTS["deployment"]
    dep, svc = render("deployment")
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"] == {"type": "Recreate"}
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "lmsysorg/sglang:v0.5.23"
    assert c["command"] == ["sglang", "serve"]
    assert c["args"] == engine("sglang").argv(config)[2:] + [
        "--host", "0.0.0.0", "--port", "30000", "--enable-metrics"]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "8"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert c["resources"]["limits"]["memory"] == "512Gi"          # 64 GiB x 8 GPUs
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}} in \
        pod["volumes"]
    assert svc["spec"]["ports"][0]["port"] == 30000
    assert svc["spec"]["selector"] == {"servetune.io/deployment": "trial-7",
                                       "servetune.io/component": "engine"}


@pytest.mark.parametrize("budget_s,failures", [(1800, 180), (95, 10)])
def test_probes_wait_past_the_health_check_and_weight_loading(budget_s, failures):
    objs = render_sglang(cfg(), "trial-7", NS, LABELS,
                         opts=SglangOptions(startup_budget_s=budget_s, router=True))
    probes = [(c["name"], kind, c[kind]) for o in objs for t in pod_templates(o)
              for c in t["spec"]["containers"]
              for kind in ("startupProbe", "readinessProbe", "livenessProbe") if kind in c]
    assert len(probes) == 2 * 3 + 2                                # 2 replicas + router
    for _, _, probe in probes:
        assert probe["timeoutSeconds"] > 20                        # SGLang's own /health wait
    engine = {kind: p for name, kind, p in probes if name == "sglang"}
    assert engine["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    start = engine["startupProbe"]
    assert start["failureThreshold"] == failures
    assert start["failureThreshold"] * start["periodSeconds"] >= budget_s


def test_replica_spanning_nodes_is_a_leader_worker_set():
    lws, svc = render("lws")
    assert lws["metadata"]["name"] == "trial-7-engine"
    spec = lws["spec"]
    assert spec["replicas"] == 2 and spec["leaderWorkerTemplate"]["size"] == 2  # 16 / 8
    leader = spec["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    worker = spec["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    for c in (leader, worker):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert c["args"][-6:] == ["--nnodes", "2", "--node-rank", "$(LWS_WORKER_INDEX)",
                                  "--dist-init-addr", "$(LWS_LEADER_ADDRESS):20000"]
    assert "readinessProbe" in leader and "readinessProbe" not in worker
    assert svc["spec"]["selector"]["servetune.io/component"] == "engine"   # leaders only


def test_uneven_multi_node_split_is_refused():
    with pytest.raises(ValueError, match="unevenly"):
        render_sglang(cfg(tp=16), "trial-7", NS, LABELS, opts=SglangOptions(gpus_per_node=6))


def test_router_reaches_every_replica_by_a_stable_name():
    objs = render("router")
    names = [o["metadata"]["name"] for o in objs]
    assert names == ["trial-7-r0", "trial-7-r1", "trial-7-r2", "trial-7-router",
                     "trial-7-r0", "trial-7-r1", "trial-7-r2", "trial-7"]
    router = by_kind(objs, "Deployment")[-1]["spec"]["template"]["spec"]["containers"][0]
    args = router["args"]
    assert router["command"] == ["python3", "-m", "sglang_router.launch_router"]
    assert args[args.index("--worker-urls") + 1:args.index("--policy")] == [
        f"http://trial-7-r{i}.{NS}.svc:30000" for i in range(3)]
    assert args[args.index("--policy") + 1] == "cache_aware"
    front = objs[-1]
    assert front["spec"]["selector"]["servetune.io/component"] == "router"
    assert objs[4]["spec"]["selector"]["servetune.io/replica"] == "0"


def test_router_thresholds_reach_the_router_and_kube_service_is_the_service_alone():
    opts = SglangOptions(router=True)
    tuned = cfg(replicas=2, router_policy="cache_aware", router_cache_threshold=0.5,
                router_balance_abs_threshold=16)
    router = by_kind(render_sglang(tuned, "trial-7", NS, LABELS, opts=opts), "Deployment")[-1]
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--cache-threshold") + 1] == "0.5"
    assert args[args.index("--balance-abs-threshold") + 1] == "16"
    assert args[args.index("--balance-rel-threshold") + 1] == "1.5"
    kube = render_sglang(cfg(replicas=2, router_policy="kube_service"), "trial-7", NS, LABELS,
                         opts=opts)
    # one Deployment of 2 pods behind the Service; no router
    assert [o["metadata"]["name"] for o in kube] == ["trial-7", "trial-7"]
    assert by_kind(kube, "Deployment")[0]["spec"]["replicas"] == 2


def test_router_over_multi_node_replicas_uses_leader_dns():
    router = by_kind(render("lws-router-dra"), "Deployment")[0]
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[1:3] == [f"http://trial-7-engine-0.trial-7-engine.{NS}:30000",
                         f"http://trial-7-engine-1.trial-7-engine.{NS}:30000"]


# ----- the sandbox ---------------------------------------------------------------------------

def test_sandbox_objects():
    objs = sandbox_objs(lws=True)
    ns = by_kind(objs, "Namespace")[0]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce-version"] == "v1.33"
    assert by_kind(objs, "Role")[0]["rules"] == role_rules(True, False)
    binding = by_kind(objs, "RoleBinding")[0]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "servetune",
                                    "namespace": NS}]
    hard = by_kind(objs, "ResourceQuota")[0]["spec"]["hard"]
    assert hard["requests.nvidia.com/gpu"] == "8"
    assert hard["requests.cpu"] == "66"                           # 8 x 8 GPUs + 2 (runner)
    assert hard["requests.memory"] == "516Gi"                     # 64 x 8 + 4
    egress = by_kind(objs, "NetworkPolicy")[0]["spec"]["egress"]
    assert egress[0] == {"to": [{"podSelector": {}}]}
    assert egress[1]["ports"] == [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
    assert [p["port"] for p in egress[2]["ports"]] == [443, 6443]
    assert by_kind(objs, "ConfigMap")[0]["data"]["study.yaml"] == STUDY.read_text()
    job = by_kind(objs, "Job")[0]["spec"]["template"]["spec"]
    assert job["serviceAccountName"] == "servetune"
    assert job["containers"][0]["args"] == [
        "run", "/etc/servetune/study.yaml", "--backend", "kubernetes", "--namespace", NS,
        "--out", "/data/runs", "--lessons-dir", "/data/lessons", "--run-id", "sandbox"]
    assert "deviceclass" not in " ".join(hard)
    dra_hard = by_kind(sandbox_objs(dra=True), "ResourceQuota")[0]["spec"]["hard"]
    assert dra_hard["gpu.nvidia.com.deviceclass.resource.k8s.io/devices"] == "8"


def test_runner_job_arguments_are_options_of_servetune_run():
    run = typer.main.get_command(app).commands["run"]
    options = {o for p in run.params for o in p.opts}
    if "--backend" not in options:
        pytest.skip("servetune run --backend/--namespace are not wired yet")
    job = by_kind(sandbox_objs(), "Job")[0]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    ctx = run.make_context("run", list(args[1:]))   # parses, or raises on an unknown option
    assert ctx.params["study_file"] == Path("/etc/servetune/study.yaml")


@pytest.mark.parametrize("kw,match", [
    ({"namespace": "Bad NS"}, "namespace"), ({"study_yaml": "- a list"}, "mapping"),
    ({"k8s_version": "1.9"}, "Kubernetes version"), ({"run_id": "-x"}, "run_id")])
def test_sandbox_bad_input(kw, match):
    args = {"namespace": NS, "gpus": 8, "image": "i", "study_yaml": "name: s\n", **kw}
    with pytest.raises(ValueError, match=match):
        render_sandbox(args.pop("namespace"), args.pop("gpus"), **args)


# ----- the CLI -------------------------------------------------------------------------------

runner = CliRunner()


def test_cli_render_prints_valid_multi_document_yaml():
    r = runner.invoke(app, ["sandbox", "render", "--namespace", NS, "--gpus", "8", "--image",
                            "ghcr.io/servetune/servetune:0.1.0", "--study", str(STUDY),
                            "--k8s-version", "1.34", "--lws", "--dra"])
    assert r.exit_code == 0, r.output
    objs = list(yaml.safe_load_all(r.stdout))
    assert [o["kind"] for o in objs][:2] == ["Namespace", "ServiceAccount"]
    assert validate(objs, "1.34") == []
    assert objs[0]["metadata"]["labels"]["pod-security.kubernetes.io/warn-version"] == "v1.34"
    # the study as written, but its shipped trace is named by its path in the image
    assert by_kind(objs, "ConfigMap")[0]["data"]["study.yaml"] == STUDY.read_text().replace(
        "trace: data/traces/mooncake_fast25_conversation_trace.jsonl",
        'trace: "/opt/servetune/data/traces/mooncake_fast25_conversation_trace.jsonl"')


def test_cli_render_writes_files(tmp_path):
    r = runner.invoke(app, ["sandbox", "render", "--namespace", NS, "--gpus", "8", "--image",
                            "img", "--study", str(STUDY), "--out", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    files = sorted((tmp_path / "m").iterdir())
    assert [f.name for f in files][:2] == [f"00-namespace-{NS}.yaml",
                                           "01-serviceaccount-servetune.yaml"]
    assert len(files) == 10
    assert validate([yaml.safe_load(f.read_text()) for f in files]) == []


@pytest.mark.parametrize("args,message", [
    (["--namespace", "Not_A_Name"], "--namespace 'Not_A_Name'"),
    (["--study", "missing.yaml"], "--study missing.yaml: cannot read"),
    (["--k8s-version", "1.5"], "--k8s-version"),
    (["--k8s-version", "banana"], "give MAJOR.MINOR"),
    (["--namespace", "kube-system"], "system or shared namespace"),
    (["--namespace", "default"], "system or shared namespace"),
    (["--gpus", "4"], "the quota must allow at least that many (--gpus 8)"),
    (["--image", ""], "--image '': give an image reference"),
    (["--image", "bad image!"], "give an image reference"),
    (["--dra", "true", "--k8s-version", "1.30"], "--dra needs Kubernetes 1.32"),
], ids=["namespace", "study", "old-version", "bad-version", "kube-system", "default",
        "too-few-gpus", "empty-image", "bad-image", "dra-too-old"])
def test_cli_render_errors_are_one_line(args, message):
    base = {"--namespace": NS, "--gpus": "8", "--image": "img", "--study": str(STUDY)}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    flags = [x for kv in base.items() for x in (kv[:1] if kv[1] == "true" else kv)]
    r = runner.invoke(app, ["sandbox", "render", *flags])
    assert r.exit_code == 2
    assert message in r.stderr and "Traceback" not in r.output
    assert r.stdout == ""


def test_cli_render_refuses_an_invalid_study(tmp_path):
    bad = tmp_path / "s.yaml"
    bad.write_text("name: x\nmodel: no-such-model\n")
    r = runner.invoke(app, ["sandbox", "render", "--namespace", NS, "--gpus", "8", "--image",
                            "img", "--study", str(bad)])
    assert r.exit_code == 2 and "--study" in r.stderr


def test_cli_render_config(tmp_path):
    config = tmp_path / "c.json"
    config.write_text(cfg(replicas=2, router_policy="cache_aware").model_dump_json())
    r = runner.invoke(app, ["sandbox", "render-config", "--config", str(config), "--name",
                            "best", "--namespace", NS, "--router", "--study-name", "glm5",
                            "--trial", "t-3"])
    assert r.exit_code == 0, r.output
    objs = list(yaml.safe_load_all(r.stdout))
    assert [o["metadata"]["name"] for o in objs] == [
        "best-r0", "best-r1", "best-router", "best-r0", "best-r1", "best"]
    assert validate(objs) == []
    assert objs[0]["metadata"]["labels"]["servetune.io/trial"] == "t-3"


@pytest.mark.parametrize("content,name,extra,message", [
    ("{\"model\": \"glm-5\"}", "best", [], "gpu"),
    ("[1, 2]", "best", [], "expected a mapping"),
    (None, "UPPER", [], "DNS-1123"),
    (None, "best", ["--k8s-version", "1.31", "--dra"], "DRA needs Kubernetes 1.32"),
], ids=["invalid-config", "not-a-mapping", "bad-name", "dra-too-old"])
def test_cli_render_config_errors(tmp_path, content, name, extra, message):
    config = tmp_path / "c.yaml"
    config.write_text(content if content is not None else cfg().model_dump_json())
    r = runner.invoke(app, ["sandbox", "render-config", "--config", str(config), "--name", name,
                            "--namespace", NS, *extra])
    assert r.exit_code == 2, r.output
    assert message in r.stderr and r.stdout == ""


# ----- D15: option values are checked before anything is written ----------------------------

@pytest.mark.parametrize("args,message", [
    (["--api-cidr", "not-a-cidr"], "--api-cidr 'not-a-cidr'"),
    (["--api-cidr", "10.0.0.1/8"], "--api-cidr '10.0.0.1/8'"),
    (["--storage", "20Gi; rm"], "--storage '20Gi; rm'"),
    (["--storage", "-5Gi"], "--storage '-5Gi'"),
    (["--storage-class", "fast; rm -rf"], "--storage-class 'fast; rm -rf'"),
    (["--storage-class", "../etc"], "--storage-class '../etc'"),
    (["--model-token-secret", "Bad_Name"], "--model-token-secret 'Bad_Name'"),
], ids=["cidr", "cidr-host-bits", "storage", "storage-negative", "storage-class",
        "storage-class-path", "token-secret"])
def test_d15_render_refuses_invalid_values(tmp_path, args, message):
    out = tmp_path / "m"
    r = runner.invoke(app, ["sandbox", "render", "--namespace", NS, "--gpus", "8", "--image",
                            "img", "--study", str(STUDY), "--out", str(out), *args])
    assert r.exit_code == 2, r.output
    assert message in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.output and r.stdout == "" and not out.exists()


@pytest.mark.parametrize("args,message", [
    (["--model-cache-pvc", "../etc"], "--model-cache-pvc '../etc'"),
    (["--model-cache-pvc", "models; rm"], "--model-cache-pvc 'models; rm'"),
    (["--model-token-secret", "../hf"], "--model-token-secret '../hf'"),
], ids=["pvc-path", "pvc-shell", "token-secret"])
def test_d15_render_config_refuses_invalid_values(tmp_path, args, message):
    config = tmp_path / "c.json"
    config.write_text(cfg().model_dump_json())
    out = tmp_path / "m"
    r = runner.invoke(app, ["sandbox", "render-config", "--config", str(config), "--name",
                            "best", "--namespace", NS, "--out", str(out), *args])
    assert r.exit_code == 2, r.output
    assert message in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert r.stdout == "" and not out.exists()


# ----- D7: the operator's model token Secret --------------------------------------------------

def test_d7_render_config_model_token_secret_passes_the_policy(tmp_path):
    from sandbox.policy import Policy, PolicyViolation, enforce

    config = tmp_path / "c.json"
    config.write_text(cfg(replicas=1).model_dump_json())
    r = runner.invoke(app, ["sandbox", "render-config", "--config", str(config), "--name",
                            "best", "--namespace", NS, "--model-token-secret", "hf-token"])
    assert r.exit_code == 0, r.output
    objs = list(yaml.safe_load_all(r.stdout))
    env = by_kind(objs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["env"]
    token = [e for e in env if e["name"] == "HF_TOKEN"]
    assert token and token[0]["valueFrom"]["secretKeyRef"]["name"] == "hf-token"
    enforce(objs, Policy(NS, 8, model_token_secret="hf-token"))
    with pytest.raises(PolicyViolation, match="--model-token-secret"):
        enforce(objs, Policy(NS, 8))  # the policy names no Secret: refused
    token[0]["valueFrom"]["secretKeyRef"]["name"] = "cloud-creds"
    with pytest.raises(PolicyViolation, match="'cloud-creds'"):
        enforce(objs, Policy(NS, 8, model_token_secret="hf-token"))


def test_d7_render_passes_the_model_token_secret_to_the_run():
    from sandbox.policy import Policy, violations

    r = runner.invoke(app, ["sandbox", "render", "--namespace", NS, "--gpus", "8", "--image",
                            "ghcr.io/servetune/servetune:0.1.0", "--study", str(STUDY),
                            "--model-token-secret", "hf-token"])
    assert r.exit_code == 0, r.output
    job = by_kind(list(yaml.safe_load_all(r.stdout)), "Job")[0]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--model-token-secret") + 1] == "hf-token"
    run = typer.main.get_command(app).commands["run"]
    ctx = run.make_context("run", list(args[1:]))  # an option servetune run knows
    assert ctx.params["model_token_secret"] == "hf-token"
    assert violations(job, Policy(NS, 0, model_token_secret="hf-token")) == []


# ----- the replay trace the Job reads ------------------------------------------------------------

def render_study(tmp_path, study_text, *extra):
    study = tmp_path / "study.yaml"
    study.write_text(study_text)
    return runner.invoke(app, ["sandbox", "render", "--namespace", NS, "--gpus", "8",
                               "--image", "img", "--study", str(study), *extra])


def configmap(r):
    return by_kind(list(yaml.safe_load_all(r.stdout)), "ConfigMap")[0]["data"]


def test_trace_shipped_is_read_from_the_image(tmp_path):
    r = runner.invoke(app, ["sandbox", "render", "--namespace", NS, "--gpus", "8", "--image",
                            "img", "--study", str(STUDY)])
    assert r.exit_code == 0, r.output
    data = configmap(r)
    study = yaml.safe_load(data["study.yaml"])
    assert study["replay"]["trace"] == \
        "/opt/servetune/data/traces/mooncake_fast25_conversation_trace.jsonl"
    assert set(data) == {"study.yaml"}
    # the same when the user's study names the shipped trace by its absolute path here
    text = STUDY.read_text().replace(
        "data/traces/", f"{REPO}/data/traces/")
    r = render_study(tmp_path, text)
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(configmap(r)["study.yaml"])["replay"]["trace"] == \
        "/opt/servetune/data/traces/mooncake_fast25_conversation_trace.jsonl"


def test_trace_of_the_user_goes_into_the_configmap(tmp_path):
    trace = tmp_path / "my trace.jsonl"
    lines = (REPO / "data/traces/mooncake_fast25_conversation_trace.jsonl").read_text(
        ).splitlines()[:200]
    trace.write_text("\n".join(lines) + "\n")
    text = STUDY.read_text().replace(
        "data/traces/mooncake_fast25_conversation_trace.jsonl", str(trace))
    r = render_study(tmp_path, text)
    assert r.exit_code == 0, r.output
    data = configmap(r)
    study = yaml.safe_load(data["study.yaml"])
    key = study["replay"]["trace"].removeprefix("/etc/servetune/")
    assert study["replay"]["trace"].startswith("/etc/servetune/") and key != "study.yaml"
    assert data[key] == trace.read_text()
    assert str(tmp_path) not in data["study.yaml"]
    assert "# Timestamp-faithful replay" in data["study.yaml"]  # the study's comments stay
    assert validate(list(yaml.safe_load_all(r.stdout))) == []
    # a trace next to the study, named relative to it, too
    (tmp_path / "t.jsonl").write_text(trace.read_text())
    r = render_study(tmp_path, text.replace(str(trace), "t.jsonl"))
    assert r.exit_code == 0, r.output
    study = yaml.safe_load(configmap(r)["study.yaml"])
    assert study["replay"]["trace"].startswith("/etc/servetune/")


def test_trace_over_a_mebibyte_is_refused_naming_the_options(tmp_path):
    trace = tmp_path / "big.jsonl"
    line = (REPO / "data/traces/mooncake_fast25_conversation_trace.jsonl").read_text(
        ).splitlines()[0]
    trace.write_text((line + "\n") * ((1 << 20) // len(line) + 10))
    text = STUDY.read_text().replace(
        "data/traces/mooncake_fast25_conversation_trace.jsonl", str(trace))
    r = render_study(tmp_path, text, "--out", str(tmp_path / "m"))
    assert r.exit_code == 2, r.output
    assert r.stderr.count("\n") == 1, r.stderr
    assert "1 MiB" in r.stderr and "PVC" in r.stderr and "image" in r.stderr
    assert not (tmp_path / "m").exists()
