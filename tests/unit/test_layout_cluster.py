"""Parallel layouts through the cluster server's backends: kubernetes (fake API), twin, local.

The kubernetes backend renders a PD layout (prefill and decode groups, the PD router), checks it
against the policy and reports Ready only when every group's servers and the router are Ready.
"""

from __future__ import annotations

import pytest
from fixtures.fakes_k8s import Clock, FakeKubeApi, Fate

from domain.config import ServingConfig
from mcp_servers.cluster.backend import BackendError
from mcp_servers.cluster.kubernetes import KubernetesBackend
from sandbox.manifests import SglangOptions
from sandbox.policy import Policy

NS = "team-a"
MANAGED = {"app.kubernetes.io/managed-by": "servetune"}


def dsv3(**kw) -> ServingConfig:
    return ServingConfig(model="deepseek-v3", gpu="H200", weights="fp8", **kw)


def kube(clock: Clock, budget: int, lws: bool = False,
         opts: SglangOptions | None = None) -> tuple[KubernetesBackend, FakeKubeApi]:
    api = FakeKubeApi(NS, clock)
    return KubernetesBackend(NS, api, opts, Policy(NS, gpu_budget=budget, lws=lws),
                             clock=clock), api


def test_kubernetes_pd_is_ready_when_both_groups_and_the_router_are():
    clock = Clock()
    b, api = kube(clock, budget=16)
    api.fates["pd"] = Fate("ready", after=2)
    st = b.deploy("pd", dsv3(tp_size=8, pd="1P1D"), MANAGED)
    assert [c[1] for c in api.calls if c[0] == "apply"] == [
        "Deployment", "Deployment", "Deployment", "Service", "Service", "Service"]
    assert st.phase == "Pending"
    clock.t += 10
    assert b.status("pd").phase == "Pending"
    clock.t += 10
    st = b.status("pd")
    assert (st.phase, st.ready_replicas, st.endpoints) == ("Ready", 1, [f"http://pd.{NS}.svc:30000"])
    # replica 0 is the prefill server, 1 the decode server; there is no third
    assert b.logs("pd", replica=1)
    with pytest.raises(BackendError, match=r"replicas 0\.\.1 \(prefill servers first"):
        b.logs("pd", replica=2)
    with pytest.raises(BackendError, match="GPU budget: these objects request 16 GPUs"):
        kube(clock, budget=8)[0].deploy("pd", dsv3(tp_size=8, pd="1P1D"), MANAGED)


def test_kubernetes_pd_groups_spanning_nodes_wait_for_every_pod():
    clock = Clock()
    b, api = kube(clock, budget=48, lws=True)
    st = b.deploy("big", dsv3(tp_size=16, pd="2P1D"), MANAGED)
    clock.t += 5
    st = b.status("big")
    assert st.phase == "Ready"
    assert len([p for p in api.pods("big")
                if p["metadata"]["labels"].get("servetune.io/component") != "router"]) == 6
