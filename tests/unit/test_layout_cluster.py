"""Parallel layouts through the cluster server's backends: kubernetes (fake API), twin, local.

The kubernetes backend renders a PD layout (prefill and decode groups, the PD router), checks it
against the policy and reports Ready only when every group's servers and the router are Ready.
"""

from __future__ import annotations

import re

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


# ----- twin backend --------------------------------------------------------------------------

PD_1P1D = dsv3(tp_size=8, pd="1P1D")
# a decode group of TP1: DeepSeek-V3's 673 GB of FP8 weights do not load on one H200
PD_BAD_DECODE = dsv3(tp_size=8, pd={"prefill": {"workers": 1},
                                    "decode": {"workers": 1, "tp_size": 1}})


@pytest.mark.anyio
async def test_twin_deploys_a_pd_layout_through_the_mcp_tool():
    from mcp import Client

    from mcp_servers.cluster.server import build_server
    from mcp_servers.cluster.twin import TwinBackend

    twin = TwinBackend(NS)
    async with Client(build_server(twin)) as c:
        r = await c.call_tool("deploy", {"name": "pd", "config": PD_1P1D.model_dump(
            mode="json"), "wait_s": 0})
        st = r.structured_content
        assert not r.is_error and st["phase"] == "Ready", st
        groups = [(g["role"], g["servers"], g["layout"], g["gpus_per_server"], g["ready"])
                  for g in st["groups"]]
        assert groups == [("prefill", 1, "TP8", 8, True), ("decode", 1, "TP8", 8, True)]
        for g in st["groups"]:  # one rank's memory, as domain.fit resolves the server
            assert g["weights_gb_per_gpu"] > 80 and g["kv_tokens_per_scheduler"] > 0
        decode_kv = st["groups"][1]["kv_tokens_per_scheduler"]
        ev = (await c.call_tool("get_events", {"name": "pd"})).structured_content["events"]
        assert ev[0]["message"].startswith("1 prefill + 1 decode server(s) of config ")
        assert ev[0]["message"].endswith("(1P1D TP8)")
        r = await c.call_tool("get_logs", {"name": "pd", "replica": 2})
        assert r.is_error and "replicas 0..1 (its servers: prefill first" in r.content[0].text
        r = await c.call_tool("deploy", {"name": "bad", "config": PD_BAD_DECODE.model_dump(
            mode="json"), "wait_s": 0})
        st = r.structured_content
        assert st["phase"] == "Failed"
        assert st["message"].startswith("decode servers (TP1): torch.OutOfMemoryError")
        assert [g["ready"] for g in st["groups"]] == [True, False]
        assert st["groups"][1]["weights_gb_per_gpu"] is None
    config, report = twin.ready_fit("pd")  # the bench simulates the PD config, decode's fit
    assert config == PD_1P1D and report.kv_tokens == decode_kv


def test_twin_status_shows_schedulers_of_attention_dp():
    from mcp_servers.cluster.twin import TwinBackend

    config = dsv3(tp_size=8, attn_dp_size=8, ep_size=8, moe_a2a_backend="deepep")
    st = TwinBackend(NS).deploy("dp8", config, {})
    (g,) = st.groups
    assert (g.role, g.layout, g.schedulers, g.nodes_per_server) == (
        "server", "TP8 DP-attn8 EP8", 8, 1)


@pytest.mark.parametrize("config,words", [
    (PD_1P1D, "does not run prefill/decode disaggregation (pd 1P1D)"),
    (dsv3(tp_size=16), "needs 16 GPUs (tp 16 x pp 1 x dp 1), 2 nodes of 8 H200"),
])
def test_local_backend_refuses_pd_and_multi_node_servers(tmp_path, config, words):
    from mcp_servers.cluster.backend import make_backend

    local = make_backend("local", NS, tmp_path, command=["true", "{host}", "{port}",
                                                         "{config_json}"])
    with pytest.raises(BackendError, match=re.escape(words)):
        local.deploy("t1", config, {})
    assert local.list() == []  # nothing started, no record
