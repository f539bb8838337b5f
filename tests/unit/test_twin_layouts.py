"""Issue 21 "done when" through the simulated twin: saturation tok/s of parallel layouts.

Closed-loop saturation runs of a few virtual seconds with short outputs (each well under a
second of wall time): the whole twin -- memory per rank (``domain/fit.py``), the per-scheduler
step model (``domain/costmodel.py``, ``domain/layout_cost.py``) and the schedulers behind the
DP controller in lockstep (``domain/twin/dp.py``). Output tok/s of the whole server.
"""

from __future__ import annotations

import pytest

from domain.config import ServingConfig
from domain.fit import fit
from domain.metrics import summarize
from domain.twin.cluster import simulate_closed_loop

TP8 = ServingConfig(model="deepseek-v3", gpu="H200", weights="fp8", tp_size=8)
DPEP = TP8.model_copy(update={"attn_dp_size": 8, "ep_size": 8, "moe_a2a_backend": "deepep"})
# attention DP as its recipes deploy it: a decode CUDA-graph max sized to a rank's batch
# (SGLang reserves max_bs x attn_dp x 4.5 MB for DP-attention graphs above 300,
# arg_groups/memory_hook.py:370-378, which the default max_bs 512 makes 18 GB per GPU)
DPEP_GRAPH64 = DPEP.model_copy(update={"cuda_graph_max_bs_decode": 64})
ISL, OSL, DURATION_S = 2048, 256, 6.0


def tok_s(config: ServingConfig, concurrency: int, isl: int = ISL, osl: int = OSL,
          duration_s: float = DURATION_S) -> float:
    """Output tok/s of a closed loop of ``concurrency`` clients on one server of ``config``."""
    recs, _ = simulate_closed_loop(config, fit(config), concurrency, duration_s, isl, osl)
    rate = summarize(recs, config.gpus).output_tok_s
    assert rate is not None and rate > 0
    return float(rate)


# ---------------------------------------------------------------- DP attention + EP
@pytest.mark.parametrize("dp", [DPEP, DPEP_GRAPH64], ids=["default", "graph-max-64"])
def test_dp_attention_ep_is_slower_than_tp8_at_concurrency_8(dp):
    # one request per rank: every rank reads all the attention weights (replicated) and the
    # MoE dispatch/combine runs for 8 tokens (twin: 0.68x)
    assert tok_s(dp, 8) < 0.9 * tok_s(TP8, 8)


@pytest.mark.parametrize("concurrency", [256, 512])
def test_dp_attention_ep_is_faster_than_tp8_at_high_concurrency(concurrency):
    # each rank holds and reads only its own requests' MLA latent (TP8 replicates it on every
    # GPU): twice TP8's decode batch at 256 and 512 clients (twin: 1.13x, 1.30x)
    assert tok_s(DPEP_GRAPH64, concurrency) > 1.05 * tok_s(TP8, concurrency)


@pytest.mark.xfail(strict=True, reason=(
    "SGLang 0.5.23's default memory for attention DP: 18 GB per GPU reserved for the DP "
    "decode graphs at the default max_bs 512 (memory_hook.py:370-378) plus the attention "
    "weights replicated on every rank leave each rank 46 k KV tokens, 0.37 M for the server "
    "against TP8's 0.56 M: DP8 runs a smaller decode batch (twin: 0.84x at 256 clients)"))
def test_dp_attention_ep_with_default_memory_is_faster_than_tp8_at_256():
    assert tok_s(DPEP, 256) > tok_s(TP8, 256)


def test_the_default_dp_memory_holds_fewer_kv_tokens_than_tp8():
    # the mechanism of the xfail above: KV tokens the whole server holds (distinct requests)
    tp8, dp_default, dp_graph64 = (fit(c).kv_tokens * c.schedulers
                                   for c in (TP8, DPEP, DPEP_GRAPH64))
    assert dp_default < tp8 < dp_graph64


# ---------------------------------------------------------------- TP4 + PP2
@pytest.mark.parametrize(("model", "weights"), [("kimi-k2-thinking", "w4a16"),
                                                ("glm-5", "nvfp4")])
@pytest.mark.parametrize(("gpu", "low", "high"), [("RTX-PRO-6000", 1.05, None),
                                                  ("B200", None, 1.02)],
                         ids=["pcie-rtx-pro-6000", "nvlink-b200"])
def test_tp4_pp2_against_tp8_at_saturation(model, weights, gpu, low, high):
    # PCIe: TP8's two all-reduces per layer over PCIe (across the NUMA hop) dominate; TP4
    # groups stay inside a NUMA node and each PP GPU holds twice the KV tokens (twin: Kimi
    # 1.19x, GLM-5 1.45x). NVLink: the all-reduce is cheap, PP's stage sends, bubble and the
    # weights streamed per micro-batch remain (twin: 0.73x, 0.80x)
    tp8 = ServingConfig(model=model, gpu=gpu, weights=weights, tp_size=8)
    pp = tp8.model_copy(update={"tp_size": 4, "pp_size": 2})
    ratio = tok_s(pp, 1024, 1024, 128, 5.0) / tok_s(tp8, 1024, 1024, 128, 5.0)
    if low is not None:
        assert ratio >= low
    if high is not None:
        assert ratio <= high
