"""The layout knobs move together (domain/knobs.py apply_knobs): hand-computable cases."""

from __future__ import annotations

import pytest

from domain.config import ServingConfig
from domain.errors import ConfigInvalid
from domain.knobs import KNOBS, apply_knob, apply_knobs
from domain.study import parse_study

BASE = ServingConfig(model="deepseek-v3", gpu="H200", tp_size=8, weights="fp8")


def test_shape_knobs_recompute_the_replicas() -> None:
    assert apply_knob(BASE, "tp_size", 2, 8).replicas == 4
    # 8 GPUs: tp 2 x pp 2 = 4 GPUs a server, 2 servers; tp 2 x pp 2 x dp 2 = 8, one server
    assert apply_knobs(BASE, {"tp_size": 2, "pp_size": 2}, 8).replicas == 2
    assert apply_knobs(BASE, {"tp_size": 2, "pp_size": 2, "dp_size": 2}, 8).replicas == 1
    with pytest.raises(ConfigInvalid, match="tp_size 2 x pp_size 3 x dp_size 1 = 6 GPUs"):
        apply_knobs(BASE, {"tp_size": 2, "pp_size": 3}, 8)


def test_a_server_may_span_nodes() -> None:
    two = apply_knob(BASE, "tp_size", 16, 16)  # an H200 node holds 8
    assert (two.replicas, two.gpus, two.nnodes(8)) == (1, 16, 2)


def test_attn_dp_must_divide_tp_and_the_order_does_not_matter() -> None:
    tp4 = apply_knob(BASE, "tp_size", 4, 8)
    with pytest.raises(ConfigInvalid) as e:
        apply_knob(tp4, "attn_dp_size", 8, 8)
    assert "attn_dp_size 8 does not divide tp_size 4" in str(e.value)
    assert "parallel_hook.py:326" in str(e.value)
    # set together, in either order, from the tp 4 config: tp 8 with 8 attention-DP ranks
    for settings in ({"attn_dp_size": 8, "tp_size": 8}, {"tp_size": 8, "attn_dp_size": 8}):
        cfg = apply_knobs(tp4, settings, 8)
        assert (cfg.tp_size, cfg.attn_dp_size, cfg.attn_tp_size, cfg.replicas) == (8, 8, 1, 1)
    with pytest.raises(ConfigInvalid, match="data-parallel replicas combined with attention"):
        apply_knobs(BASE, {"tp_size": 4, "dp_size": 2, "attn_dp_size": 2}, 8)


def test_ep_sets_deepep_and_an_a2a_backend_forces_ep_to_tp() -> None:
    ep = apply_knob(BASE, "ep_size", 8, 8)
    assert (ep.ep_size, ep.moe_a2a_backend, ep.moe_tp_size) == (8, "deepep", 1)
    # ep 4 under deepep: SGLang rewrites it to tp 8 (overrides.py:1611), so do the knobs
    assert apply_knob(BASE, "ep_size", 4, 8) == ep
    assert apply_knob(BASE, "moe_a2a_backend", "deepep", 8) == ep
    # tp moves, ep follows the a2a backend: tp 4 -> ep 4, two servers
    tp4 = apply_knob(ep, "tp_size", 4, 8)
    assert (tp4.ep_size, tp4.replicas) == (4, 2)
    # ep back to 1 drops the backend it brought; an explicit none keeps EP without all-to-all
    assert apply_knob(ep, "ep_size", 1, 8) == BASE
    plain = apply_knobs(BASE, {"ep_size": 4, "moe_a2a_backend": "none"}, 8)
    assert (plain.ep_size, plain.moe_a2a_backend, plain.moe_tp_size) == (4, "none", 2)
    with pytest.raises(ConfigInvalid, match="ep_size 3 does not divide tp_size 8"):
        apply_knobs(BASE, {"ep_size": 3, "moe_a2a_backend": "none"}, 8)


def test_pd_sets_one_replica_and_must_fit_the_pool() -> None:
    with pytest.raises(ConfigInvalid, match="1P1D needs 1 prefill x 8 GPUs \\+ 1 decode x 8 "
                                            "GPUs = 16 GPUs but the pool has 8"):
        apply_knob(BASE, "pd", "1P1D", 8)
    pd = apply_knobs(BASE, {"pd": "1P1D", "tp_size": 4}, 8)
    assert (pd.replicas, pd.gpus, [(r, n) for r, n, _ in pd.servers()]) == (
        1, 8, [("prefill", 1), ("decode", 1)])
    # off (YAML reads a bare off as false) is the aggregated layout: replicas back to 2
    for off in ("off", False, None, "unset"):
        agg = apply_knob(pd, "pd", off, 8)
        assert (agg.pd, agg.replicas) == (None, 2)
    # groups with their own layout: 1 prefill server of tp 2 + 3 decode servers of tp 2
    groups = {"prefill": {"workers": 1, "tp_size": 2}, "decode": {"workers": 3, "tp_size": 2}}
    assert apply_knob(BASE, "pd", groups, 8).gpus == 8
    bad = {"prefill": {"workers": 1}, "decode": {"workers": 1, "attn_dp_size": 3}}
    with pytest.raises(ConfigInvalid, match="the decode servers: attn_dp_size 3 does not"):
        apply_knob(apply_knob(BASE, "tp_size", 4, 8), "pd", bad, 8)


def test_two_batch_overlap_is_modelled_not_passed_through() -> None:
    from domain.config import PASSED_THROUGH

    assert "enable_two_batch_overlap" not in PASSED_THROUGH
    assert "not modelled" not in KNOBS["enable_two_batch_overlap"].description
    assert KNOBS["attn_dp_size"].flag == "--attn-dp-size" and KNOBS["pd"].flag is None


def _study(**knobs: list[object]) -> dict[str, object]:
    return dict(name="t", model="deepseek-v3", gpu="H200", gpu_count=8,
                baseline=dict(tp_size=4, weights="fp8"), knobs=knobs,
                saturation=dict(isl=1024, osl=256, concurrency=64, duration_s=10.0),
                replay=dict(trace="data/traces/AzureLLMInferenceTrace_conv.csv",
                            format="azure", start_s=0, duration_s=60, time_scale=1.0),
                slo=dict(ttft_p99_ms=2000), budget=dict(max_trials=4, patience=4))


def test_a_study_takes_a_value_valid_with_another_layout_value() -> None:
    # attn_dp_size 8 is refused under the tp 4 baseline, valid with the study's tp 8
    parse_study(_study(tp_size=[4, 8], attn_dp_size=[1, 8])).validate_space()
    with pytest.raises(ConfigInvalid, match="attn_dp_size 8 does not divide tp_size 4"):
        parse_study(_study(tp_size=[2, 4], attn_dp_size=[1, 8])).validate_space()
    # the baseline is applied at once too: its order does not matter
    data = _study(tp_size=[8])
    data["baseline"] = dict(attn_dp_size=8, tp_size=8, weights="fp8", pd="off")
    assert parse_study(data).base_config().attn_dp_size == 8


def test_the_engines_other_layout_refusals_are_skipped_before_any_launch() -> None:
    # EPLB without expert parallelism: the engine asserts ep_size > 1 (parallel_hook.py:791)
    with pytest.raises(ConfigInvalid, match="parallel_hook.py:791"):
        apply_knob(BASE, "enable_eplb", True, 8)
    assert apply_knobs(BASE, {"enable_eplb": True, "ep_size": 8}, 8).enable_eplb
    # two-batch overlap needs an a2a backend or attention DP (validation_hook.py:768)
    with pytest.raises(ConfigInvalid, match="two batch overlap"):
        apply_knob(BASE, "enable_two_batch_overlap", True, 8)
    assert apply_knobs(BASE, {"enable_two_batch_overlap": True, "attn_dp_size": 8}, 8)
