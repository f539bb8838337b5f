"""Parallel layouts in Kubernetes manifests: multi-node servers, DP attention + EP, PD groups.

Every layout renders through ``sandbox.manifests.render_sglang``, validates with
``sandbox.validate`` (kubernetes-validate strict for built-in kinds; the LeaderWorkerSet CRD
schema plus the release's PodTemplateSpec for LWS) and passes ``sandbox.policy.enforce`` in the
sandbox namespace; the same objects in another namespace are refused object by object.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest

from domain.config import ServingConfig
from sandbox.manifests import (
    BOOTSTRAP_PORT,
    KV_TRANSFER_ANNOTATION,
    ROLE_LABEL,
    SglangOptions,
    render_sglang,
)
from sandbox.policy import Policy, PolicyViolation, enforce, gpu_demand
from sandbox.validate import validate

NS = "tune-dsv3"
LABELS = {"app.kubernetes.io/managed-by": "servetune", "servetune.io/study": "dsv3-h200",
          "servetune.io/trial": "t-0003"}


def dsv3(**kw) -> ServingConfig:
    return ServingConfig(model="deepseek-v3", gpu="H200", weights="fp8", **kw)


LAYOUTS = {
    # TP16 over two 8-GPU nodes: one LeaderWorkerSet group of 2 pods
    "tp16-lws": (dsv3(tp_size=16), SglangOptions()),
    # attention DP 8 + EP 8 with DeepEP on one node: one Deployment of 8 GPUs
    "dp-attn8-ep8": (dsv3(tp_size=8, attn_dp_size=8, ep_size=8, moe_a2a_backend="deepep"),
                     SglangOptions()),
    # one prefill and one decode server of TP8 each, plus the PD router
    "pd-1p1d": (dsv3(tp_size=8, pd="1P1D"), SglangOptions()),
    # two TP16 prefill groups and one decode group over LWS, GPUs and NICs by DRA
    "pd-2p1d-lws-dra": (dsv3(tp_size=16, pd="2P1D", router_policy="cache_aware"),
                        SglangOptions(dra=True, dra_nic_class="dranet", k8s_version="1.34")),
    # TP4 x PP2 over 4-GPU nodes: the pipeline spans the two pods
    "tp4xpp2-lws": (dsv3(tp_size=4, pp_size=2), SglangOptions(gpus_per_node=4)),
}


def render(layout: str) -> tuple[ServingConfig, list[dict]]:
    config, opts = LAYOUTS[layout]
    return config, render_sglang(config, "trial-3", NS, LABELS, opts=opts)


def policy(config: ServingConfig, opts: SglangOptions, namespace: str = NS,
           budget: int | None = None) -> Policy:
    return Policy(namespace, config.gpus if budget is None else budget, lws=True, dra=opts.dra,
                  dra_other_classes=(opts.dra_nic_class,) if opts.dra_nic_class else ())


def containers(obj: dict) -> list[tuple[str, dict]]:
    spec = obj["spec"]
    if obj["kind"] == "Deployment":
        return [("pod", spec["template"]["spec"]["containers"][0])]
    if obj["kind"] == "LeaderWorkerSet":
        lwt = spec["leaderWorkerTemplate"]
        return [(k, lwt[k]["spec"]["containers"][0]) for k in ("leaderTemplate",
                                                               "workerTemplate")]
    return []


def named(objs: list[dict], kind: str, name: str) -> dict:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_validates_and_passes_the_policy_only_in_its_namespace(layout):
    config, objs = render(layout)
    opts = LAYOUTS[layout][1]
    assert validate(objs, opts.k8s_version) == []
    enforce(objs, policy(config, opts))
    assert gpu_demand(objs, policy(config, opts)) == config.gpus
    with pytest.raises(PolicyViolation, match="GPU budget"):
        enforce(objs, policy(config, opts, budget=config.gpus - 1))
    elsewhere = copy.deepcopy(objs)
    for o in elsewhere:
        o["metadata"]["namespace"] = "team-prod"
    with pytest.raises(PolicyViolation) as e:
        enforce(elsewhere, policy(config, opts))
    refused = [line for line in str(e.value).splitlines() if "'team-prod' is outside" in line]
    assert len(refused) == len(objs)  # every object, each by name


def test_tp16_is_one_lws_group_of_two_nodes():
    config, objs = render("tp16-lws")
    lws = named(objs, "LeaderWorkerSet", "trial-3-engine")
    assert lws["spec"]["replicas"] == 1 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    for _, c in containers(lws):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"          # 16 GPUs / 2 pods
        assert flag(c["args"], "--tp-size") == "16"
        assert flag(c["args"], "--nnodes") == "2"
        assert flag(c["args"], "--node-rank") == "$(LWS_WORKER_INDEX)"
        assert flag(c["args"], "--dist-init-addr") == "$(LWS_LEADER_ADDRESS):20000"


def test_pipeline_stages_span_nodes_with_tp_times_pp_gpus():
    _, objs = render("tp4xpp2-lws")
    lws = named(objs, "LeaderWorkerSet", "trial-3-engine")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2              # 4 x 2 GPUs / 4
    (_, leader), _ = containers(lws)
    assert flag(leader["args"], "--pp-size") == "2"
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == "4"


def test_attention_dp_and_ep_stay_on_one_node():
    _, objs = render("dp-attn8-ep8")
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [
        ("Deployment", "trial-3"), ("Service", "trial-3")]
    (_, c), = containers(objs[0])
    args = c["args"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"   # attention DP adds no GPU
    assert (flag(args, "--tp-size"), flag(args, "--attn-dp-size"), flag(args, "--ep-size"),
            flag(args, "--moe-a2a-backend")) == ("8", "8", "8", "deepep")
    assert "--nnodes" not in args


def test_pd_groups_router_and_bootstrap_port():
    config, objs = render("pd-1p1d")
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [
        ("Deployment", "trial-3-p0"), ("Deployment", "trial-3-d0"),
        ("Deployment", "trial-3-router"), ("Service", "trial-3-p0"), ("Service", "trial-3-d0"),
        ("Service", "trial-3")]
    (_, pre), = containers(objs[0])
    (_, dec), = containers(objs[1])
    assert flag(pre["args"], "--disaggregation-mode") == "prefill"
    assert flag(pre["args"], "--disaggregation-bootstrap-port") == str(BOOTSTRAP_PORT) == "8998"
    assert {"name": "bootstrap", "containerPort": 8998} in pre["ports"]
    assert flag(dec["args"], "--disaggregation-mode") == "decode"
    assert "--disaggregation-bootstrap-port" not in dec["args"]
    for obj, role in ((objs[0], "prefill"), (objs[1], "decode")):
        meta = obj["spec"]["template"]["metadata"]
        assert meta["labels"][ROLE_LABEL] == role
        assert "RDMA" in meta["annotations"][KV_TRANSFER_ANNOTATION]  # mooncake by default
        assert not obj["spec"]["template"]["spec"].get("hostNetwork")
    ports = {p["name"]: p["port"] for p in named(objs, "Service", "trial-3-p0")["spec"]["ports"]}
    assert ports == {"http": 30000, "bootstrap": 8998}
    router = named(objs, "Deployment", "trial-3-router")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:6] == ["--pd-disaggregation", "--prefill", f"http://trial-3-p0.{NS}.svc:30000",
                        "8998", "--decode", f"http://trial-3-d0.{NS}.svc:30000"]
    assert named(objs, "Service", "trial-3")["spec"]["selector"][
        "servetune.io/component"] == "router"


def test_pd_groups_spanning_nodes_are_one_lws_per_role():
    _, objs = render("pd-2p1d-lws-dra")
    pre = named(objs, "LeaderWorkerSet", "trial-3-prefill")
    dec = named(objs, "LeaderWorkerSet", "trial-3-decode")
    assert (pre["spec"]["replicas"], dec["spec"]["replicas"]) == (2, 1)
    assert pre["spec"]["leaderWorkerTemplate"]["size"] == 2
    claims = [o["metadata"]["name"] for o in objs if o["kind"] == "ResourceClaimTemplate"]
    assert claims == ["trial-3-prefill-devices", "trial-3-decode-devices"]
    router = named(objs, "Deployment", "trial-3-router")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    lead = f"trial-3-prefill-{{}}.trial-3-prefill.{NS}"
    assert args[1:7] == ["--prefill", f"http://{lead.format(0)}:30000", "8998",
                         "--prefill", f"http://{lead.format(1)}:30000", "8998"]
    assert flag(args, "--decode") == f"http://trial-3-decode-0.trial-3-decode.{NS}:30000"
    assert flag(args, "--policy") == "cache_aware"


def test_mooncake_tcp_needs_no_rdma():
    config = dsv3(tp_size=8, pd="1P1D", disaggregation_transfer_backend="mooncake_tcp")
    dep = render_sglang(config, "trial-3", NS, LABELS)[0]
    note = dep["spec"]["template"]["metadata"]["annotations"][KV_TRANSFER_ANNOTATION]
    assert "TCP on the pod network" in note
    assert flag(dep["spec"]["template"]["spec"]["containers"][0]["args"],
                "--disaggregation-transfer-backend") == "mooncake_tcp"


def test_full_dp_copies_across_nodes_are_refused():
    with pytest.raises(ValueError, match="dp_size 2 across 2 nodes"):
        render_sglang(dsv3(tp_size=8, dp_size=2), "trial-3", NS, LABELS)


def test_pd_router_args_parse_with_the_pinned_router():
    config = dsv3(tp_size=8, pd="2P1D", router_policy="power_of_two")
    args = config.pd_router_args(["http://p0:30000", "http://p1:30000"], ["http://d0:30000"])
    assert args == ["--pd-disaggregation", "--prefill", "http://p0:30000", "8998",
                    "--prefill", "http://p1:30000", "8998", "--decode", "http://d0:30000",
                    "--policy", "power_of_two"]
    kube = dsv3(tp_size=8, pd="1P1D", router_policy="kube_service")
    assert "--policy" not in kube.pd_router_args(["http://p0"], ["http://d0"], 9000)
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        config.pd_router_args([], ["http://d0:30000"])
    if importlib.util.find_spec("sglang_router") is None:
        return
    import argparse

    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser)
    parsed = RouterArgs.from_cli_args(parser.parse_args(args))
    assert parsed.pd_disaggregation is True
    assert parsed.prefill_urls == [("http://p0:30000", 8998), ("http://p1:30000", 8998)]
    assert parsed.decode_urls == ["http://d0:30000"]
