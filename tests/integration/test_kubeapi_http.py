"""RealKubeApi (the ``kubernetes`` python client) over real HTTP against a fake API server.

``tests/fixtures/fake_apiserver.py`` serves discovery and in-memory namespaced objects on
127.0.0.1; a kubeconfig in ``tmp_path`` points the client at it with a bearer token. These tests
check the requests the client really sends (server-side apply with field manager ``servetune``,
``force=true`` and the apply content type; label selectors; background deletion; timestamped
logs), how refusals become :class:`KubeApiError` and the backend's hints, and a
:class:`KubernetesBackend` deploy / status / logs / events / teardown over the wire. The
discovery cache the client writes (``kubeapi.discovery_cache``) goes to ``tmp_path``.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from fixtures.fake_apiserver import APPLY, FakeApiServer

from domain.config import ServingConfig
from mcp_servers.cluster.backend import BackendError
from mcp_servers.cluster.kubeapi import FIELD_MANAGER, KubeApiError, RealKubeApi
from mcp_servers.cluster.kubernetes import CONFIG_ANNOTATION, KubernetesBackend
from sandbox.policy import Policy

NS = "team-a"
TOKEN = "fake-token-123"
MANAGED = "app.kubernetes.io/managed-by"
DEPLOYMENT = "servetune.io/deployment"
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
              "all_proxy")


def kubeconfig_text(server: str, token: str = TOKEN) -> str:
    return f"""apiVersion: v1
kind: Config
clusters:
- name: fake
  cluster:
    server: {server}
users:
- name: tester
  user:
    token: {token}
contexts:
- name: fake
  context:
    cluster: fake
    user: tester
    namespace: {NS}
current-context: fake
"""


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the discovery cache
    for var in PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    server = FakeApiServer(token=TOKEN).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def kubeconfig(fake, tmp_path) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(kubeconfig_text(fake.url))
    return path


@pytest.fixture
def api(kubeconfig) -> RealKubeApi:
    return RealKubeApi(NS, kubeconfig=kubeconfig)


def configmap(name: str, labels: dict[str, str] | None = None, **data: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": NS, "labels": labels or {}},
            "data": data}


def config() -> ServingConfig:
    return ServingConfig(model="glm-5", gpu="B200", tp_size=8, replicas=1, weights="nvfp4",
                         kv_cache_dtype="fp8_e4m3")


def test_apply_is_server_side_apply_by_servetune_forced(api, fake):
    out = api.apply(configmap("cm1", {"a": "1"}, k="v"))
    assert out["data"] == {"k": "v"} and out["metadata"]["uid"]
    assert out["metadata"]["creationTimestamp"]  # the API's camelCase shape
    (req,) = fake.of("PATCH")
    assert req.path == f"/api/v1/namespaces/{NS}/configmaps/cm1"
    assert req.headers["content-type"] == APPLY
    assert req.query == {"fieldManager": [FIELD_MANAGER], "force": ["true"]}
    assert req.headers["authorization"] == f"Bearer {TOKEN}"
    assert req.body == configmap("cm1", {"a": "1"}, k="v")  # the object, as JSON
    assert fake.get("v1", "ConfigMap", "cm1", NS)["metadata"]["managedFields"][0]["manager"] \
        == "servetune"
    # the same apply again changes nothing; a group's kind goes to its group's path
    assert api.apply(configmap("cm1", {"a": "1"}, k="v"))["metadata"]["resourceVersion"] == \
        out["metadata"]["resourceVersion"]
    api.apply({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j1"},
               "spec": {"template": {"spec": {"containers": []}}}})
    assert fake.of("PATCH")[-1].path == f"/apis/batch/v1/namespaces/{NS}/jobs/j1"
    assert fake.get("batch/v1", "Job", "j1", NS)["metadata"]["namespace"] == NS


def test_force_takes_over_fields_another_manager_owns(api, fake):
    fake.put(configmap("cm1", k="old"), manager="kubectl-client-side-apply")
    out = api.apply(configmap("cm1", k="new"))  # the fake answers 409 without force=true
    assert out["data"] == {"k": "new"}
    assert out["metadata"]["managedFields"][0]["manager"] == "servetune"


def test_get_is_none_for_a_missing_object(api, fake):
    assert api.get("v1", "Service", "nope") is None
    fake.put({"apiVersion": "apps/v1", "kind": "Deployment",
              "metadata": {"name": "d1", "namespace": NS}, "spec": {"replicas": 2}})
    got = api.get("apps/v1", "Deployment", "d1")
    assert (got["kind"], got["spec"]["replicas"]) == ("Deployment", 2)
    paths = [r.path for r in fake.of("GET", "/namespaces/")]
    assert paths == [f"/api/v1/namespaces/{NS}/services/nope",
                     f"/apis/apps/v1/namespaces/{NS}/deployments/d1"]


def test_list_passes_the_label_selector(api, fake):
    fake.put(configmap("both", {"a": "1", "b": "2"}))
    fake.put(configmap("only-a", {"a": "1"}))
    fake.put({**configmap("other-ns", {"a": "1", "b": "2"}),
              "metadata": {"name": "other-ns", "namespace": "team-b",
                           "labels": {"a": "1", "b": "2"}}})
    items = api.list("v1", "ConfigMap", "a=1,b=2")
    assert [o["metadata"]["name"] for o in items] == ["both"]
    # the server sends list items without apiVersion/kind; the dynamic client fills them in
    assert (items[0]["apiVersion"], items[0]["kind"]) == ("v1", "ConfigMap")
    assert fake.of("GET", "/configmaps")[-1].query == {"labelSelector": ["a=1,b=2"]}
    assert sorted(o["metadata"]["name"] for o in api.list("v1", "ConfigMap")) == [
        "both", "only-a"]
    assert fake.of("GET", "/configmaps")[-1].query == {}  # no selector: none sent


def test_delete_is_background_and_a_missing_object_is_fine(api, fake):
    fake.put(configmap("cm1"))
    api.delete("v1", "ConfigMap", "cm1")
    assert fake.get("v1", "ConfigMap", "cm1", NS) is None
    api.delete("v1", "ConfigMap", "cm1")  # 404: already gone
    dels = fake.of("DELETE")
    assert [r.path for r in dels] == [f"/api/v1/namespaces/{NS}/configmaps/cm1"] * 2
    assert all(r.query["propagationPolicy"] == ["Background"] for r in dels)


def test_pod_logs_asks_for_timestamps(api, fake):
    fake.put({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p1", "namespace": NS}})
    fake.logs["p1"] = "".join(f"2026-05-28T10:00:0{i}.5Z line {i}\n" for i in range(5))
    text = api.pod_logs("p1", "sglang", tail=2, previous=True)
    assert text == "2026-05-28T10:00:03.5Z line 3\n2026-05-28T10:00:04.5Z line 4\n"
    (req,) = fake.of("GET", "/log")
    assert req.path == f"/api/v1/namespaces/{NS}/pods/p1/log"
    assert {k: v[0] for k, v in req.query.items()} == {
        "container": "sglang", "timestamps": "true", "tailLines": "2", "previous": "true",
        "limitBytes": str(8 << 20)}
    api.pod_logs("p1")
    q = fake.of("GET", "/log")[-1].query
    assert q["previous"] == ["false"] and "container" not in q
    with pytest.raises(KubeApiError) as e:
        api.pod_logs("p2")
    assert (e.value.status, e.value.reason, e.value.message) == (
        404, "NotFound", 'pods "p2" not found')
    fake.put({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p3", "namespace": NS}})
    with pytest.raises(KubeApiError) as e:  # its container has not started
        api.pod_logs("p3")
    assert (e.value.status, e.value.reason) == (400, "BadRequest")
    assert e.value.message.endswith("is waiting to start: ContainerCreating")


def test_events_pass_the_field_selector(api, fake):
    for n, obj in (("e1", "t1"), ("e2", "t2")):
        fake.put({"apiVersion": "v1", "kind": "Event", "metadata": {"name": n, "namespace": NS},
                  "involvedObject": {"kind": "Pod", "name": obj}, "reason": "Started"})
    evs = api.events("involvedObject.name=t1")
    assert [e["metadata"]["name"] for e in evs] == ["e1"]
    assert fake.of("GET", "/events")[-1].query == {"fieldSelector": ["involvedObject.name=t1"]}


def test_forbidden_is_a_kube_api_error_and_the_backend_names_the_role(api, fake):
    fake.forbid(rf"^PATCH /apis/apps/v1/namespaces/{NS}/deployments/")
    with pytest.raises(KubeApiError) as e:
        api.apply({"apiVersion": "apps/v1", "kind": "Deployment",
                   "metadata": {"name": "d1"}, "spec": {}})
    assert (e.value.status, e.value.reason) == (403, "Forbidden")
    assert e.value.message.startswith('deployments.apps "d1" is forbidden: User ')  # Status
    b = KubernetesBackend(NS, api, policy=Policy(namespace=NS, gpu_budget=8))
    with pytest.raises(BackendError, match=r"refused to apply Deployment t1: 403 Forbidden: "
                                           r".*bind the sandbox Role") as e2:
        b.deploy("t1", config(), {MANAGED: "servetune"})
    assert f"namespace {NS}" in str(e2.value)
    assert not any(k[1] in ("Deployment", "Service") for k in fake.objects)  # nothing applied


def test_a_kind_the_cluster_does_not_serve(api, fake):
    with pytest.raises(KubeApiError) as e:
        api.get("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "big")
    assert (e.value.status, e.value.reason) == (0, "KindNotServed")
    assert not fake.of("GET", "/namespaces/")


def test_a_bogus_kubeconfig_path_is_no_credentials(tmp_path, fake):
    missing = tmp_path / "no-such-kubeconfig"
    api = RealKubeApi(NS, kubeconfig=missing)
    with pytest.raises(KubeApiError) as e:
        api.get("v1", "Service", "t1")
    assert (e.value.status, e.value.reason) == (0, "NoCredentials")
    assert str(missing) in e.value.message and fake.requests == []
    b = KubernetesBackend(NS, api, policy=Policy(namespace=NS, gpu_budget=8))
    with pytest.raises(BackendError, match="cannot load credentials .* Check --kubeconfig"):
        b.status("t1")


def test_a_wrong_token_and_an_unreachable_server(tmp_path, fake):
    kc = tmp_path / "wrong-token"
    kc.write_text(kubeconfig_text(fake.url, token="not-it"))
    with pytest.raises(KubeApiError) as e:
        RealKubeApi(NS, kubeconfig=kc).get("v1", "Service", "t1")
    assert (e.value.status, e.value.reason) == (401, "Unauthorized")  # at discovery
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kc.write_text(kubeconfig_text(f"http://127.0.0.1:{port}"))
    with pytest.raises(KubeApiError) as e:
        RealKubeApi(NS, kubeconfig=kc).get("v1", "Service", "t1")
    assert e.value.status == 0


def test_backend_deploy_status_logs_events_teardown_over_http(api, fake):
    b = KubernetesBackend(NS, api, policy=Policy(namespace=NS, gpu_budget=8))
    st = b.deploy("t1", config(), {MANAGED: "servetune", "servetune.io/trial": "3"})
    assert (st.phase, st.ready_replicas) == ("Pending", 0)
    assert st.message == "0 engine pods for 1 replicas x 1: waiting for the rest"
    patches = fake.of("PATCH")
    assert [r.path for r in patches] == [f"/apis/apps/v1/namespaces/{NS}/deployments/t1",
                                         f"/api/v1/namespaces/{NS}/services/t1"]
    assert all(r.headers["content-type"] == APPLY and r.query == {
        "fieldManager": ["servetune"], "force": ["true"]} for r in patches)
    dep = fake.get("apps/v1", "Deployment", "t1", NS)
    svc = fake.get("v1", "Service", "t1", NS)
    for o in (dep, svc):
        assert o["metadata"]["labels"][MANAGED] == "servetune"
        assert o["metadata"]["labels"][DEPLOYMENT] == "t1"
    assert dep["spec"]["template"]["metadata"]["labels"]["servetune.io/trial"] == "3"
    assert ServingConfig.model_validate_json(svc["metadata"]["annotations"][
        CONFIG_ANNOTATION]) == config()
    pod_lists = fake.of("GET", f"/namespaces/{NS}/pods")
    assert pod_lists and pod_lists[-1].query == {"labelSelector": [f"{DEPLOYMENT}=t1"]}
    assert b.status("t1").phase == "Pending"
    assert b.deploy("t1", config(), {MANAGED: "servetune", "servetune.io/trial": "3"}).phase \
        == "Pending"  # the same config again: applied again, nothing changed
    assert fake.get("apps/v1", "Deployment", "t1", NS)["metadata"]["resourceVersion"] == \
        dep["metadata"]["resourceVersion"]

    # the pod the ReplicaSet would have made crashes: OOMKilled, then CrashLoopBackOff
    labels = dep["spec"]["template"]["metadata"]["labels"]
    fake.put({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "t1-5d8f7c9b4-x2x9k", "namespace": NS, "labels": labels,
        "creationTimestamp": "2026-05-28T10:00:00Z",
        "ownerReferences": [{"kind": "ReplicaSet", "name": "t1-5d8f7c9b4"}]},
        "spec": {"containers": [{"name": "sglang"}]},
        "status": {"phase": "Running", "podIP": "10.1.2.3", "containerStatuses": [{
            "name": "sglang", "ready": False, "restartCount": 1,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled",
                                         "finishedAt": "2026-05-28T10:01:00Z"}}}]}})
    fake.logs["t1-5d8f7c9b4-x2x9k"] = (
        "2026-05-28T10:00:01Z server_args=ServerArgs(model_path='glm-5')\n"
        "2026-05-28T10:00:59Z torch.OutOfMemoryError: CUDA out of memory.\n")
    fake.put({"apiVersion": "v1", "kind": "Event", "metadata": {
        "name": "t1-5d8f7c9b4-x2x9k.1", "namespace": NS},
        "involvedObject": {"kind": "Pod", "name": "t1-5d8f7c9b4-x2x9k"}, "reason": "BackOff",
        "type": "Warning", "message": "Back-off restarting failed container sglang",
        "lastTimestamp": "2026-05-28T10:01:05Z"})
    st = b.status("t1")
    assert (st.phase, st.exit_code, st.failed_stage) == ("Failed", 137, "startup")
    assert st.message.endswith("last log line: torch.OutOfMemoryError: CUDA out of memory.")
    lines = b.logs("t1")
    assert lines[-2].text == "torch.OutOfMemoryError: CUDA out of memory."
    assert lines[-1].text.startswith("servetune: pod t1-5d8f7c9b4-x2x9k ")
    assert "OOMKilled" in lines[-1].text
    log_q = fake.of("GET", "/log")[-1].query
    assert (log_q["previous"], log_q["timestamps"], log_q["container"]) == (
        ["true"], ["true"], ["sglang"])
    assert "BackOff" in [e.reason for e in b.events("t1")]

    down = b.teardown("t1")
    assert (down.phase, down.exit_code) == ("Terminated", 137)
    dels = fake.of("DELETE")
    assert [r.path for r in dels] == [f"/apis/apps/v1/namespaces/{NS}/deployments/t1",
                                      f"/api/v1/namespaces/{NS}/services/t1"]
    assert all(r.query == {"propagationPolicy": ["Background"]} for r in dels)
    assert fake.get("apps/v1", "Deployment", "t1", NS) is None
    assert fake.get("v1", "Service", "t1", NS) is None
    assert b.status("t1").phase == "Terminated"
    assert [(s.name, s.phase) for s in b.list()] == [("t1", "Terminated")]


def test_discovery_cache_is_private(fake, tmp_path):
    """The client's discovery cache is a private file, not a predictable /tmp path."""
    from mcp_servers.cluster.kubeapi import discovery_cache

    path = Path(discovery_cache("http://127.0.0.1:1"))
    assert path.parent == tmp_path / "cache" / "servetune" / "kube"
    assert path.parent.stat().st_mode & 0o777 == 0o700
