"""The Kubernetes backend of the cluster server against a fake API at its seam (tests/fakes_k8s).

Scripted pod fates (Ready after N polls, CrashLoopBackOff with an exit code and a log, OOMKilled,
Unschedulable, ImagePullBackOff, a crash after serving), the policy checked before any apply,
idempotent re-apply, teardown by labels only, and the same through the cluster MCP server and the
deployer's failure classifier. The real client is only checked to contact nothing when built.
"""

from __future__ import annotations

import pytest
from fixtures.fakes_k8s import Clock, FakeKubeApi, Fate
from mcp import Client
from typer.testing import CliRunner

from agents.deployer import Deployer
from domain.config import ServingConfig
from domain.engines.sglang.failures import classify
from mcp_servers.cluster import ops
from mcp_servers.cluster.backend import BackendError, make_backend
from mcp_servers.cluster.kubeapi import KubeApiError, RealKubeApi
from mcp_servers.cluster.kubernetes import CONFIG_ANNOTATION, KubernetesBackend
from mcp_servers.cluster.kubeview import log_lines, parse_time
from mcp_servers.cluster.server import build_server as cluster_server
from sandbox.manifests import SglangOptions
from sandbox.policy import Policy
from servetune.cli import _cluster_backend, app
from servetune.settings import Settings

NS = "team-a"
MANAGED = "app.kubernetes.io/managed-by"


def config(**kw) -> ServingConfig:
    c = dict(model="glm-5", gpu="B200", tp_size=8, replicas=1, weights="nvfp4",
             kv_cache_dtype="fp8_e4m3")
    c.update(kw)
    return ServingConfig(**c)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def api(clock) -> FakeKubeApi:
    return FakeKubeApi(NS, clock)


def backend(api, clock, budget=16, **kw) -> KubernetesBackend:
    policy = Policy(NS, gpu_budget=budget, **{k: kw.pop(k) for k in ("image_allow", "lws")
                                              if k in kw})
    return KubernetesBackend(NS, api, kw.pop("opts", None), policy, clock=clock, **kw)


def applies(api) -> list[tuple[str, ...]]:
    return [c for c in api.calls if c[0] == "apply"]


def test_deploy_is_pending_then_ready_with_pod_endpoints(api, clock):
    b = backend(api, clock)
    api.fates["t1"] = Fate("ready", after=2)
    st = b.deploy("t1", config(replicas=2), {MANAGED: "servetune", "servetune.io/trial": "7"})
    assert (st.phase, st.ready_replicas, st.endpoints) == ("Pending", 0, [])
    assert "ContainerCreating" in st.message
    assert applies(api) == [("apply", "Deployment"), ("apply", "Service")]
    svc = api.objects[("v1", "Service", "t1")]
    assert ServingConfig.model_validate_json(svc["metadata"]["annotations"][CONFIG_ANNOTATION]) \
        == config(replicas=2)
    dep = api.objects[("apps/v1", "Deployment", "t1")]
    assert dep["metadata"]["labels"]["servetune.io/deployment"] == "t1"
    assert dep["spec"]["template"]["metadata"]["labels"]["servetune.io/trial"] == "7"
    clock.t += 40
    assert b.status("t1").phase == "Pending"  # Pending for 2 polls
    clock.t += 20
    st = b.status("t1")  # poll 3: Ready, stamped now
    assert (st.phase, st.ready_replicas) == ("Ready", 2)
    assert st.startup_s == 60.0
    assert st.endpoints == ["http://10.0.0.3:30000", "http://10.0.0.4:30000"]
    assert st.labels["servetune.io/trial"] == "7"
    reasons = [e.reason for e in b.events("t1")]
    assert reasons[-1] == "Ready" and "Applied" in reasons and "Started" in reasons
    lines = b.logs("t1", replica=1)
    assert lines[-1].text.endswith("] The server is fired up and ready to roll!")
    assert lines[0].t == parse_time(dep["metadata"]["creationTimestamp"]) + 1


def test_redeploy_same_config_changes_nothing_other_config_refused(api, clock):
    b = backend(api, clock)
    b.deploy("t1", config(), {MANAGED: "servetune"})
    before = {k: (o["metadata"]["resourceVersion"], o["metadata"]["uid"])
              for k, o in api.objects.items() if k[1] != "Pod"}
    b.deploy("t1", config(), {MANAGED: "servetune"})
    after = {k: (o["metadata"]["resourceVersion"], o["metadata"]["uid"])
             for k, o in api.objects.items() if k[1] != "Pod"}
    assert before == after and len(applies(api)) == 4  # applied again, nothing changed
    n = len(applies(api))
    with pytest.raises(BackendError, match="already runs config .* tear it down"):
        b.deploy("t1", config(mem_fraction_static=0.8), {MANAGED: "servetune"})
    assert len(applies(api)) == n


@pytest.mark.parametrize("kw, pattern", [
    ({"budget": 4}, r"GPU budget: these objects request 8 GPUs"),
    ({"image_allow": ("ghcr.io/servetune/",)}, r"image: 'lmsysorg/sglang:v0.5.23' is outside"),
], ids=["gpu-budget", "image-allow"])
def test_policy_refuses_before_any_apply(api, clock, kw, pattern):
    b = backend(api, clock, **kw)
    with pytest.raises(BackendError, match=pattern) as e:
        b.deploy("t1", config(), {MANAGED: "servetune"})
    assert "nothing was applied" in str(e.value)
    assert applies(api) == [] and api.objects == {}


def test_gpus_of_other_live_deployments_count_against_the_budget(api, clock):
    b = backend(api, clock, budget=8)
    b.deploy("t1", config(), {MANAGED: "servetune"})
    with pytest.raises(BackendError, match="request 8 GPUs .* already holds 8"):
        b.deploy("t2", config(), {MANAGED: "servetune"})
    b.teardown("t1")
    assert b.deploy("t2", config(), {MANAGED: "servetune"}).phase == "Pending"


def test_object_servetune_did_not_create_is_never_overwritten(api, clock):
    api.objects[("v1", "Service", "t1")] = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "t1", "namespace": NS, "labels": {"app": "theirs"}}}
    b = backend(api, clock)
    with pytest.raises(BackendError, match="servetune did not create it"):
        b.deploy("t1", config(), {MANAGED: "servetune"})
    assert applies(api) == []


CRASH_LOG = ["[2026-05-28 10:00:01] server_args=ServerArgs(model_path='nvidia/GLM-5-NVFP4')",
             "Traceback (most recent call last):",
             "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]


@pytest.mark.parametrize("fate, exit_code, stage, in_message, cls", [
    (Fate("crash", exit_code=1, log=CRASH_LOG), 1, "startup",
     "CrashLoopBackOff (last: Error), exit code 1", "OOM_WEIGHTS"),
    (Fate("oom", log=CRASH_LOG[:1]), 137, "startup", "OOMKilled), exit code 137", "CRASH_LOOP"),
    (Fate("image"), None, "startup", "ImagePullBackOff", "IMAGE_PULL"),
    (Fate("serve_then_crash", after=1, exit_code=139, log=["segfault in worker"]), 139,
     "serving", "exit code 139", "CRASH_LOOP"),
], ids=["crashloop", "oomkilled", "image-pull", "crash-after-ready"])
def test_failures_are_classified_from_logs(api, clock, fate, exit_code, stage, in_message, cls):
    b = backend(api, clock)
    api.fates["t1"] = fate
    b.deploy("t1", config(), {MANAGED: "servetune"})
    st = b.status("t1")
    for _ in range(3):
        if st.phase != "Pending" and (stage != "serving" or st.phase == "Failed"):
            break
        clock.t += 10
        st = b.status("t1")
    assert (st.phase, st.exit_code, st.failed_stage) == ("Failed", exit_code, stage)
    assert in_message in st.message and st.endpoints == []
    lines = [ln.text for ln in b.logs("t1")]
    assert lines[-1].startswith("servetune: pod t1-") and in_message in lines[-1]
    assert classify(lines)[0] == cls
    if fate.kind == "crash":
        assert "last log line: torch.OutOfMemoryError" in st.message
        assert ("logs", st.message.split()[1]) in api.calls
    events = b.events("t1")
    assert events[-1].reason == "Failed" and events[-1].type == "Warning"
    assert b.status("t1").phase == "Failed"  # stays Failed (the fake's pod is still crashing)


def test_unschedulable_is_pending_then_failed_after_its_timeout(api, clock):
    b = backend(api, clock, unschedulable_timeout_s=300)
    api.fates["t1"] = Fate("unschedulable")
    st = b.deploy("t1", config(), {MANAGED: "servetune"})
    assert st.phase == "Pending"
    assert st.message.endswith("Unschedulable: 0/4 nodes are available: 4 Insufficient "
                               "nvidia.com/gpu.")
    clock.t += 299
    assert b.status("t1").phase == "Pending"
    assert ("logs",) not in {c[:1] for c in api.calls}  # a pod that never ran has no log
    clock.t += 2
    st = b.status("t1")
    assert (st.phase, st.exit_code, st.failed_stage) == ("Failed", None, "startup")
    assert "could not be scheduled for 301 s" in st.message
    lines = b.logs("t1")
    assert lines[-1].text.startswith("servetune: pod ") and "has not started: Unschedulable" \
        in lines[-1].text
    ev = [e for e in b.events("t1") if e.reason == "FailedScheduling"]
    assert ev and ev[0].type == "Warning" and "Insufficient nvidia.com/gpu" in ev[0].message


def test_not_ready_by_the_deadline_fails(api, clock):
    b = backend(api, clock, ready_timeout_s=600)
    api.fates["t1"] = Fate("ready", after=10**6)
    b.deploy("t1", config(), {MANAGED: "servetune"})
    clock.t += 600
    assert b.status("t1").phase == "Pending"
    clock.t += 1
    st = b.status("t1")
    assert st.phase == "Failed" and st.message.startswith("not Ready 600 s after creation")


def test_default_deadline_is_the_startup_budget_plus_scheduling(api, clock):
    b = KubernetesBackend(NS, api, SglangOptions(startup_budget_s=900), None)
    assert b.ready_timeout_s == 1500
    with pytest.raises(BackendError, match="read-only"):
        b.deploy("t1", config(), {})


def test_teardown_deletes_only_labelled_objects_and_keeps_a_record(api, clock):
    b = backend(api, clock)
    api.fates["t1"] = Fate("crash", log=CRASH_LOG)
    b.deploy("t1", config(), {MANAGED: "servetune"})
    clock.t += 1
    b.deploy("t2", config(), {MANAGED: "servetune"})
    foreign = ("apps/v1", "Deployment", "t1-extra")
    api.objects[foreign] = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {
        "name": "t1-extra", "namespace": NS, "labels": {"servetune.io/deployment": "t1"}},
        "spec": {"replicas": 0, "template": {"metadata": {"labels": {}}, "spec": {}}}}
    assert b.status("t1").phase == "Failed"
    clock.t += 100
    st = b.teardown("t1")
    assert st.phase == "Terminated" and st.exit_code == 1 and st.failed_stage == "startup"
    deleted = [c for c in api.calls if c[0] == "delete"]
    assert deleted == [("delete", "Deployment"), ("delete", "Service")]
    assert foreign in api.objects  # no managed-by label: not ours
    assert ("apps/v1", "Deployment", "t2") in api.objects and not api.pods("t1")
    assert b.teardown("t1").phase == "Terminated"  # idempotent, nothing more deleted
    assert [c for c in api.calls if c[0] == "delete"] == deleted
    assert b.status("t1").phase == "Terminated"
    assert b.logs("t1")[-2].text.startswith("torch.OutOfMemoryError")  # the saved tail
    assert [e.reason for e in b.events("t1")][-1] == "Deleted"
    assert [(s.name, s.phase) for s in b.list()] == [("t1", "Terminated"), ("t2", "Ready")]
    with pytest.raises(BackendError, match="no deployment 'nope'.*live: t2"):
        b.teardown("nope")
    # the name is free again; the earlier run's events stay
    api.fates["t1"] = Fate("ready", after=0)
    assert b.deploy("t1", config(), {MANAGED: "servetune"}).phase == "Ready"
    assert "BackOff" in [e.reason for e in b.events("t1")]


def test_records_of_torn_down_deployments_are_shared_over_a_state_dir(api, clock, tmp_path):
    one = backend(api, clock, state_dir=tmp_path)
    one.deploy("t1", config(), {MANAGED: "servetune"})
    two = KubernetesBackend(NS, api, None, None, state_dir=tmp_path, clock=clock)
    assert two.status("t1").phase == "Ready"  # the cluster is the record of live ones
    one.teardown("t1")
    assert two.status("t1").phase == "Terminated"
    assert [s.name for s in two.list()] == ["t1"]


def test_api_refusals_say_what_to_do(api, clock):
    api.refuse[("apply", "Deployment")] = KubeApiError(
        403, "Forbidden", 'deployments.apps "t1" is forbidden: User "system:serviceaccount:'
        'team-a:servetune" cannot patch resource "deployments"')
    b = backend(api, clock)
    with pytest.raises(BackendError, match="bind the sandbox Role"):
        b.deploy("t1", config(), {MANAGED: "servetune"})
    with pytest.raises(BackendError, match="DNS-1123"):
        b.deploy("T1", config(), {MANAGED: "servetune"})
    with pytest.raises(BackendError, match="cannot render.*label"):
        b.deploy("t1", config(), {"bad key!": "x"})


def test_a_replica_spanning_nodes_is_a_leaderworkerset(api, clock):
    b = backend(api, clock, lws=True, opts=SglangOptions(gpus_per_node=4))
    st = b.deploy("big", config(), {MANAGED: "servetune"})
    assert applies(api) == [("apply", "LeaderWorkerSet"), ("apply", "Service")]
    clock.t += 5
    st = b.status("big")
    assert (st.phase, st.endpoints) == ("Ready", ["http://10.0.0.3:30000"])  # the leader only
    assert len(api.pods("big")) == 2
    b.teardown("big")
    assert api.objects == {}
    no_lws = backend(FakeKubeApi(NS, clock), clock, opts=SglangOptions(gpus_per_node=4))
    with pytest.raises(BackendError, match="LeaderWorkerSet .*outside the sandbox Role"):
        no_lws.deploy("big", config(), {MANAGED: "servetune"})


def test_with_the_router_the_endpoint_is_the_service(api, clock):
    b = backend(api, clock, opts=SglangOptions(router=True))
    b.deploy("rt", config(tp_size=4, replicas=2), {MANAGED: "servetune"})
    clock.t += 5
    st = b.status("rt")
    assert (st.phase, st.ready_replicas) == ("Ready", 2)
    assert st.endpoints == ["http://rt.team-a.svc:30000"]


def test_log_lines_parse_kubelet_timestamps():
    lines = log_lines("2026-05-28T10:00:01.123456789Z first\nno stamp\n"
                      "2026-05-28T10:00:02Z \x1b[32mgreen\x1b[0m\rdone\n", 0.0)
    t = parse_time("2026-05-28T10:00:01Z")
    assert [(ln.t - t, ln.text) for ln in lines] == [
        (pytest.approx(0.123456), "first"), (pytest.approx(0.123456), "no stamp"),
        (1.0, "done")]


def test_make_backend_builds_a_real_client_that_contacts_nothing_until_used(tmp_path):
    missing = tmp_path / "kubeconfig"
    b = make_backend("kubernetes", NS, None, kubeconfig=missing, context="lab", gpu_budget=8)
    assert isinstance(b, KubernetesBackend) and b.kind == "kubernetes"
    assert isinstance(b.api, RealKubeApi) and b.policy is not None
    assert b.policy.gpu_budget == 8 and b.policy.namespace == NS
    with pytest.raises(BackendError, match=r"cannot load credentials from .*kubeconfig "
                                           r"\(context lab\)"):
        b.status("t1")
    assert make_backend("kubernetes", NS).policy is None  # the bench server's read-only view
    with pytest.raises(BackendError, match="gpu_budget"):
        make_backend("kubernetes", NS, gpu_budget=-1)


@pytest.mark.anyio
async def test_cluster_mcp_tools_over_the_kubernetes_backend(api, clock):
    b = backend(api, clock)
    api.fates["bad"] = Fate("crash", log=CRASH_LOG)
    async with Client(cluster_server(b)) as c:
        r = await c.call_tool("deploy", {"name": "ok", "config": config().model_dump(
            mode="json"), "wait_s": 5})
        st = r.structured_content
        assert not r.is_error and st["phase"] == "Ready", st
        assert st["labels"][MANAGED] == "servetune"
        assert st["labels"]["servetune/config-id"] == config().config_id()
        r = await c.call_tool("deploy", {"name": "bad", "config": config().model_dump(
            mode="json"), "wait_s": 5})
        assert r.structured_content["phase"] == "Failed"
        page = (await c.call_tool("get_logs", {"name": "bad", "tail": 40})).structured_content
        assert classify(page["lines"])[0] == "OOM_WEIGHTS"
        ev = (await c.call_tool("get_events", {"name": "bad"})).structured_content
        assert any(e["reason"] == "BackOff" for e in ev["events"])
        r = await c.call_tool("deploy", {"name": "big", "config": config(
            replicas=3).model_dump(mode="json")})
        assert r.is_error and "GPU budget" in r.content[0].text
        r = await c.call_tool("get_status", {"name": "ok", "namespace": "other"})
        assert r.is_error and "confined to namespace 'team-a'" in r.content[0].text
        down = (await c.call_tool("tear_down", {"name": "bad"})).structured_content
        assert down["phase"] == "Terminated"
        listed = (await c.call_tool("list_deployments", {})).structured_content["result"]
        assert sorted((d["name"], d["phase"]) for d in listed) == [
            ("bad", "Terminated"), ("ok", "Ready")]
        # the deterministic deployer classifies a crash through the same tools
        api.fates["bad2"] = Fate("crash", exit_code=1, log=[
            "ValueError: speculative_num_steps must be set with speculative_algorithm"])
        out = await Deployer(c, poll_s=0).launch("bad2", config(), {})
        assert (out.ready, out.failure_class, out.stage) == (False, "INVALID_COMBINATION",
                                                            "startup")
        assert out.evidence.startswith("ValueError: speculative_num_steps")


def test_ops_deploy_adds_servetune_labels(api, clock):
    b = backend(api, clock)
    st = ops.deploy(b, "t1", config(), {"servetune.io/study": "s1"})
    assert st.labels["servetune.io/study"] == "s1"
    pod_labels = api.objects[("apps/v1", "Deployment", "t1")]["spec"]["template"]["metadata"][
        "labels"]
    assert pod_labels[MANAGED] == "servetune" and pod_labels["servetune.io/study"] == "s1"


@pytest.mark.parametrize("argv, message", [
    (["run", "--backend", "k8s"], "--backend 'k8s': choose twin, local, kubernetes"),
    (["run", "--kubeconfig", "kc.yaml"], "give them with --backend kubernetes"),
    (["mcp", "cluster", "--backend", "kubernetes"], "needs --gpu-budget N"),
    (["mcp", "cluster", "--gpu-budget", "8"], "are options of --backend kubernetes"),
    (["mcp", "bench", "--context", "lab"], "are options of --backend kubernetes"),
], ids=["run-unknown-backend", "run-kubeconfig-without-kubernetes", "cluster-no-budget",
        "cluster-budget-on-twin", "bench-context-on-twin"])
def test_cli_kubernetes_options_are_checked(argv, message):
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 2, r.output
    assert message in " ".join(r.output.split())


def test_cli_run_builds_the_kubernetes_backend_with_the_study_budget(tmp_path, monkeypatch):
    kc = tmp_path / "kubeconfig"
    kc.write_text("apiVersion: v1\nkind: Config\n")
    monkeypatch.setattr(KubernetesBackend, "list", lambda self: [])  # the pre-flight call
    backend, flags = _cluster_backend("kubernetes", "tune-a", kc, "lab", 8,
                                      Settings(state_dir=tmp_path))
    assert isinstance(backend, KubernetesBackend) and backend.namespace == "tune-a"
    assert backend.policy.gpu_budget == 8
    assert flags == f" --backend kubernetes --namespace tune-a --kubeconfig {kc} --context lab"
    twin, flags = _cluster_backend("twin", "servetune", None, None, 8, Settings())
    assert (twin.kind, flags) == ("twin", "")


@pytest.mark.parametrize("namespace", ["kube-system", "default", "kube-public"])
def test_system_namespaces_are_refused(namespace, clock):
    with pytest.raises(BackendError, match="system or shared namespace"):
        KubernetesBackend(namespace, FakeKubeApi(namespace, clock), None, None)


def test_cli_run_with_unusable_credentials_fails_in_one_line_before_any_work(tmp_path):
    kc = tmp_path / "kubeconfig"
    kc.write_text("apiVersion: v1\nclusters: [\n")  # not YAML
    out = tmp_path / "runs"
    r = CliRunner().invoke(app, ["run", "--backend", "kubernetes", "--namespace", "tune-a",
                                 "--kubeconfig", str(kc), "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert r.stderr.count("\n") == 1 and "NoCredentials" in r.stderr
    assert "--backend kubernetes: cannot reach Kubernetes" in r.stderr
    assert not out.exists()  # no run folder was made


# ----- D7: the one model token Secret, from the command line to the policy ----------------------

def test_d7_model_token_secret_reaches_the_policy_and_the_pods(api, clock):
    b = backend(api, clock, opts=SglangOptions(hf_token_secret="hf-token"))
    with pytest.raises(BackendError, match="--model-token-secret"):
        b.deploy("t1", config(), {MANAGED: "servetune"})  # the policy names no Secret
    assert applies(api) == []
    b = make_backend("kubernetes", NS, None, gpu_budget=16, model_token_secret="hf-token")
    assert b.policy.model_token_secret == "hf-token" and b.opts.hf_token_secret == "hf-token"
    b = KubernetesBackend(NS, api, b.opts, b.policy, clock=clock)
    b.deploy("t1", config(), {MANAGED: "servetune"})
    env = api.objects[("apps/v1", "Deployment", "t1")]["spec"]["template"]["spec"][
        "containers"][0]["env"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "hf-token", "key": "token", "optional": True}}} in env
    with pytest.raises(BackendError, match="model_token_secret"):
        make_backend("kubernetes", NS, gpu_budget=8, model_token_secret="Bad_Name")


def test_d7_cli_run_model_token_secret(tmp_path, monkeypatch):
    kc = tmp_path / "kubeconfig"
    kc.write_text("apiVersion: v1\nkind: Config\n")
    monkeypatch.setattr(KubernetesBackend, "list", lambda self: [])  # the pre-flight call
    backend, flags = _cluster_backend("kubernetes", "tune-a", kc, None, 8,
                                      Settings(state_dir=tmp_path),
                                      model_token_secret="hf-token")
    assert backend.policy.model_token_secret == "hf-token"
    assert backend.opts.hf_token_secret == "hf-token"
    assert flags.endswith(" --model-token-secret hf-token")
    for argv, message in [
            (["run", "--model-token-secret", "hf-token"], "--backend kubernetes"),
            (["run", "--backend", "kubernetes", "--kubeconfig", str(kc),
              "--model-token-secret", "Bad_Name"], "--model-token-secret 'Bad_Name'"),
            (["mcp", "cluster", "--model-token-secret", "hf-token"], "--backend kubernetes"),
            (["mcp", "cluster", "--backend", "kubernetes", "--gpu-budget", "8",
              "--model-token-secret", "../x"], "--model-token-secret '../x'")]:
        r = CliRunner().invoke(app, argv)
        assert r.exit_code == 2, (argv, r.output)
        assert message in " ".join(r.stderr.split()) and "Traceback" not in r.output


def test_d7_cli_mcp_cluster_model_token_secret_reaches_the_policy(tmp_path, monkeypatch):
    import types

    from mcp_servers.cluster import server

    built = []
    monkeypatch.setattr(server, "build_server", lambda b: built.append(b) or
                        types.SimpleNamespace(run=lambda: None))
    r = CliRunner().invoke(app, ["mcp", "cluster", "--backend", "kubernetes", "--namespace", NS,
                                 "--gpu-budget", "8", "--state-dir", str(tmp_path),
                                 "--model-token-secret", "hf-token"])
    assert r.exit_code == 0, r.output
    (b,) = built
    assert b.policy.model_token_secret == "hf-token" and b.opts.hf_token_secret == "hf-token"
