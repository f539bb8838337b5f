"""The engine's layout rules refused at startup with the engine's words (issue 21): one config per
rule, its phase, the 0.5.23 site of the traceback's last frame and the message; multi-node
servers start with --nnodes; an a2a backend's ep_size = tp_size is a resolution, not a refusal.
The sites themselves are proved against the pinned tree by test_refusal_audit.py."""

from __future__ import annotations

from typing import Any

import pytest

from domain.config import ServingConfig
from domain.engines import engine
from domain.engines.sglang.refusals import REFUSALS
from domain.engines.sglang.startup import start


def _c(**kw: Any) -> ServingConfig:
    base: dict[str, Any] = {"model": "deepseek-v3", "gpu": "H200", "tp_size": 8,
                            "weights": "fp8"}
    return ServingConfig.model_validate({**base, **kw})


CASES = [
    ({"attn_dp_size": 8, "dp_size": 2}, "dp_with_attn_dp",
     "ValueError: --dp-size 2 with --attn-dp-size 8: data-parallel replicas combined with "
     "attention data parallelism are not supported."),
    ({"attn_dp_size": 3}, "attn_dp_divides_tp", "AssertionError"),
    ({"tp_size": 4, "dp_size": 2, "enable_dp_lm_head": True}, "dp_lm_head_without_attn_dp",
     "AssertionError: --enable-dp-lm-head requires attention DP (--attn-dp-size)."),
    ({"moe_a2a_backend": "pplx"}, "pplx_attn_dp",
     "AssertionError: moe_a2a_backend='pplx' requires attention DP with at least 2 groups "
     "(--attn-dp-size >= 2)."),
    ({"enable_eplb": True}, "eplb_without_ep", "AssertionError"),
    ({"tp_size": 9, "gpu": "H200"}, "nnodes_divide_tp",
     "AssertionError: tp_size must be divisible by number of nodes"),
    ({"tp_size": 4, "pp_size": 2, "speculative_algorithm": "EAGLE3"}, "pp_spec_eagle_only",
     "AssertionError: Pipeline parallelism currently only supports EAGLE (non-multi-layer) "
     "speculative decoding"),
    ({"tp_size": 4, "pp_size": 2, "speculative_algorithm": "EAGLE"}, "pp_spec_prefill_only",
     "AssertionError: PP + speculative decoding (MTP) is only supported on prefill nodes "
     "(disaggregation-mode=prefill)"),
    ({"dp_size": 2}, "multi_node_dp",
     "AssertionError: multi-node data-parallel replicas are not supported; use attention DP "
     "(--attn-dp-size) across nodes"),
    ({"moe_dense_tp_size": 2}, "moe_dense_tp",
     "AssertionError: moe_dense_tp_size only supports None, 1, or tp_size currently"),
    ({"enable_two_batch_overlap": True}, "tbo_without_attn_dp",
     "ValueError: When enabling two batch overlap without an EP a2a backend "
     "(moe_a2a_backend='none'), attention DP (--attn-dp-size) is required (DeepSeek-V4 non-EP "
     "DP TBO path)."),
    ({"ep_size": 8, "ep_num_redundant_experts": 3}, "ep_divides_experts", "AssertionError"),
]


@pytest.mark.parametrize(("kw", "key", "last"), CASES, ids=[c[1] for c in CASES])
def test_layout_rule_refused_with_the_engines_words(kw: dict[str, Any], key: str,
                                                    last: str) -> None:
    s = start(_c(**kw))
    r = REFUSALS[key]
    assert not s.ready and s.phase == ("model_init" if key == "ep_divides_experts"
                                       else "resolve")
    assert s.log[-3:] == [*r.frame(), last], s.log[-4:]


def test_megamoe_needs_attention_dp_equal_to_tp() -> None:
    key = "megamoe_attn_dp"
    c = _c(gpu="B200", moe_a2a_backend="flashinfer_megamoe", attn_dp_size=4)
    assert start(c).log[-1] == REFUSALS[key].text()
    ok = start(_c(gpu="B200", moe_a2a_backend="flashinfer_megamoe", attn_dp_size=8))
    assert REFUSALS[key].frame()[0] not in ok.log


def test_valid_layouts_start() -> None:
    for kw in ({"attn_dp_size": 8, "ep_size": 8}, {"tp_size": 4, "pp_size": 2},
               {"attn_dp_size": 8, "enable_two_batch_overlap": True},
               {"moe_dense_tp_size": 1, "attn_dp_size": 8},
               {"tp_size": 4, "pp_size": 2, "speculative_algorithm": "EAGLE",
                "disaggregation_mode": "prefill"},
               {"ep_size": 8, "ep_num_redundant_experts": 32, "enable_eplb": True}):
        s = start(_c(**kw))
        assert s.ready, (kw, s.log[-3:])


def test_an_a2a_backend_resolves_ep_to_tp_in_the_log() -> None:
    s = start(_c(attn_dp_size=8, moe_a2a_backend="deepep", deepep_mode="low_latency"))
    assert s.ready
    assert ("deepep MoE is enabled. The expert parallel size is adjusted from 1 to the tensor "
            "parallel size [8].") in s.log


def test_multi_node_server_gets_nnodes_a_pasted_one_node_launch_does_not_start() -> None:
    c = _c(tp_size=16)
    argv = engine("sglang").argv(c)
    assert argv[argv.index("--nnodes") + 1] == "2"
    assert start(c).ready
    one_node = start(c, nnodes=1)
    assert one_node.phase == "init_distributed"
    assert one_node.log[-3] == REFUSALS["multi_node_device_ordinal"].text()
    assert "--nnodes" not in engine("sglang").argv(_c())  # one node: no flag


def test_pd_and_moe_runner_layout_rules() -> None:
    prefill = start(_c(disaggregation_mode="prefill", disaggregation_transfer_backend="fake"))
    assert prefill.log[-1] == REFUSALS["pd_prefill_fake"].text()
    # GLM-5 NVFP4 on SM 12 runs flashinfer_cutlass by default: EP 1 or TP only (moe_hook.py:89)
    glm = {"model": "glm-5", "gpu": "RTX-PRO-6000", "weights": "nvfp4", "tp_size": 8}
    assert start(ServingConfig(**glm, ep_size=4)).log[-1] == REFUSALS[  # type: ignore[arg-type]
        "cutlass_moe_ep"].text()
    assert REFUSALS["cutlass_moe_ep"].frame()[0] not in start(
        ServingConfig(**glm, ep_size=8)).log  # type: ignore[arg-type]
    fp8 = start(_c(ep_size=8, moe_runner_backend="cutlass"))
    assert fp8.log[-1] == REFUSALS["cutlass_fp8_ep"].text()


def test_the_request_cap_log_is_per_rank() -> None:
    # speculative 48 over 8 attention-DP ranks is 6 each: not "reduced" (the pool holds more)
    s = start(_c(attn_dp_size=8, ep_size=8, speculative_algorithm="EAGLE"))
    assert s.ready and not any("was reduced" in line for line in s.log)
    assert "max_running_requests=6," in s.log[-2]
