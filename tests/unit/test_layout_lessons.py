"""Parallel layouts in lessons: a failure of a DP-attention/EP, PP or PD config forbids its
family only, through the analyst's failure lesson and the lessons MCP server's tools
(``add_lesson``, ``check_config``)."""

from __future__ import annotations

import pytest
from mcp import Client

from agents.analyst import failure_lesson
from agents.deployer import DeployOutcome
from domain.config import ServingConfig
from domain.errors import DoesNotFit
from domain.lesson import Clause, config_value, layout_clauses
from mcp_servers.lessons.server import build_server

OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.50 GiB."


def dsv3(**kw: object) -> ServingConfig:
    return ServingConfig(model="deepseek-v3", gpu="H200", weights="fp8", **kw)


DP8_EP8 = dsv3(tp_size=8, attn_dp_size=8, ep_size=8, moe_a2a_backend="deepep")


def lesson_of(config: ServingConfig, failure_class: str, stage: str):
    out = DeployOutcome(name="t", ready=False, failure_class=failure_class, evidence=OOM,
                        stage=stage, log_tail=[OOM])
    return failure_lesson(config, out, "run-1", "search:x")


async def allowed(client: Client, config: ServingConfig) -> bool:
    r = await client.call_tool("check_config", {"config": config.model_dump(mode="json")})
    assert not r.is_error, r.content
    return bool(r.structured_content["allowed"])


@pytest.mark.anyio
async def test_a_deepep_oom_forbids_its_layout_family_only(store):
    # a DeepEP buffer that does not fit at graph capture: exactly this memory and layout
    lesson = lesson_of(DP8_EP8, "GRAPH_CAPTURE_OOM", "cuda_graph")
    assert "attn_dp_size == 8 AND ep_size == 8 AND moe_a2a_backend == 'deepep'" in \
        lesson.condition_text()
    async with Client(build_server(store)) as c:
        r = await c.call_tool("add_lesson", {"lesson": lesson.model_dump(mode="json")})
        assert not r.is_error, r.content
        assert not await allowed(c, DP8_EP8)
        assert await allowed(c, dsv3(tp_size=8))                               # TP8, no EP
        assert await allowed(c, dsv3(tp_size=8, ep_size=8, moe_a2a_backend="deepep"))
        assert await allowed(c, DP8_EP8.model_copy(update={"moe_a2a_backend": "mooncake"}))


@pytest.mark.anyio
async def test_a_weights_oom_widens_along_pp_and_attention_dp(store):
    # TP4 PP1 does not hold the weights: neither does TP2 or attention DP at TP4, but PP2 may
    tp4 = dsv3(tp_size=4)
    lesson = lesson_of(tp4, "OOM_WEIGHTS", "weights_load")
    assert lesson.condition_text() == "weights == 'fp8' AND tp_size <= 4 AND pp_size <= 1"
    dp_lesson = lesson_of(dsv3(tp_size=4, attn_dp_size=2), "OOM_WEIGHTS", "weights_load")
    assert dp_lesson.condition_text() == ("weights == 'fp8' AND tp_size <= 4 AND "
                                          "attn_dp_size >= 2 AND pp_size <= 1")
    async with Client(build_server(store)) as c:
        for one in (lesson, dp_lesson):
            await c.call_tool("add_lesson", {"lesson": one.model_dump(mode="json")})
        assert not await allowed(c, dsv3(tp_size=2))
        assert not await allowed(c, dsv3(tp_size=4, attn_dp_size=4))
        assert await allowed(c, dsv3(tp_size=4, pp_size=2))    # half the layers per GPU
        assert await allowed(c, dsv3(tp_size=8))


@pytest.mark.anyio
async def test_a_pd_failure_forbids_that_pd_layout_not_the_aggregated_config(store):
    pd = dsv3(tp_size=8, pd="1P1D")
    lesson = lesson_of(pd, "KV_NO_ROOM", "kv_pool")
    assert lesson.condition[-1] == Clause(field="pd", op="eq", value="1P1D")
    async with Client(build_server(store)) as c:
        await c.call_tool("add_lesson", {"lesson": lesson.model_dump(mode="json")})
        assert not await allowed(c, pd)
        assert await allowed(c, dsv3(tp_size=8))                   # aggregated TP8
        assert await allowed(c, dsv3(tp_size=8, pd="2P1D"))


def test_pd_clauses_compare_the_layout_name():
    plain = dsv3(tp_size=8, pd="1P1D")
    tuned = dsv3(tp_size=8, pd={"decode": {"attn_dp_size": 8}})
    assert config_value(plain, "pd") == "1P1D"
    assert config_value(tuned, "pd") == "1P1D+decode.attn_dp_size=8"
    assert config_value(dsv3(tp_size=8), "pd") is None
    assert [c.text() for c in layout_clauses(tuned)] == ["pd is set"]
    assert layout_clauses(dsv3(tp_size=8)) == []              # no layout: no clause
    assert Clause(field="pd", op="eq", value="1P1D").matches(plain)
    assert not Clause(field="pd", op="eq", value="1P1D").matches(tuned)


def test_a_crash_of_a_pd_config_names_its_layout_not_a_raw_dict():
    # the set-knobs fallback (UNKNOWN): pd is pinned by name, not compared as a nested dict
    lesson = lesson_of(dsv3(tp_size=8, pd="1P1D", ep_size=8), "UNKNOWN", "serving")
    texts = [c.text() for c in lesson.condition]
    assert texts[-2:] == ["ep_size == 8", "pd == '1P1D'"]
    assert lesson.forbids(dsv3(tp_size=8, pd="1P1D", ep_size=8))
    assert not lesson.forbids(dsv3(tp_size=8, ep_size=8))


def test_the_memory_estimate_keeps_pp_configs_open():
    from domain.fit import fit
    from domain.lesson_builders import estimate_lesson
    from domain.study import parse_study

    study = parse_study({
        "name": "dsv3-h200", "model": "deepseek-v3", "gpu": "H200", "gpu_count": 8,
        "baseline": {"weights": "fp8", "tp_size": 8}, "knobs": {"tp_size": [2, 4, 8]},
        "saturation": {"isl": 1024, "osl": 256, "concurrency": 8, "duration_s": 10},
        "replay": {"trace": "data/traces/mooncake_fast25_conversation_trace.jsonl",
                   "start_s": 0, "duration_s": 10, "time_scale": 1.0},
        "slo": {"ttft_p99_ms": 2000}, "budget": {"max_trials": 4, "patience": 2}})
    tp4 = dsv3(tp_size=4)
    with pytest.raises(DoesNotFit) as e:  # 673 GB / 4 = 168 GB per GPU > 141 GB
        fit(tp4)
    lesson = estimate_lesson(tp4, e.value, study)
    assert lesson.condition_text() == "weights == 'fp8' AND tp_size <= 4 AND pp_size <= 1"
    assert lesson.forbids(tp4) and lesson.forbids(dsv3(tp_size=2))
    assert not lesson.forbids(dsv3(tp_size=4, pp_size=2))
