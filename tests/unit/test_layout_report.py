"""Parallel layouts in the report: layout labels in trial names, the winner's launch commands per
server group with the PD router's command, and one rank's memory per group."""

from __future__ import annotations

from pathlib import Path

import pytest

from domain.config import ServingConfig
from domain.layout import fit_groups, has_layout, layout_label, memory_line, server_label
from domain.metrics import MetricsSummary, Percentiles
from domain.study import Study, parse_study
from domain.trial import Trial
from servetune.report import render_report
from servetune.report.format import summary_rows
from servetune.report.layout import pd_text

RUN_ID = "run-layout-1"


def dsv3(**kw: object) -> ServingConfig:
    return ServingConfig(model="deepseek-v3", gpu="H200", weights="fp8", **kw)


@pytest.mark.parametrize(("config", "label"), [
    (dsv3(tp_size=8), "TP8"),
    (dsv3(tp_size=8, replicas=2), "2x TP8"),
    (dsv3(tp_size=8, attn_dp_size=8, ep_size=8, moe_a2a_backend="deepep"), "TP8 DP-attn8 EP8"),
    (dsv3(tp_size=4, pp_size=2), "TP4xPP2"),
    (dsv3(tp_size=4, dp_size=2), "DP2xTP4"),
    (dsv3(tp_size=4, pd="1P1D"), "1P1D TP4"),
    (dsv3(tp_size=8, pd={"prefill": {"workers": 2}, "decode": {"workers": 1,
                                                              "attn_dp_size": 8}}),
     "2P1D P TP8 / D TP8 DP-attn8"),
])
def test_layout_labels(config: ServingConfig, label: str) -> None:
    assert layout_label(config) == label
    assert has_layout(config) is (label not in ("TP8", "2x TP8"))


def test_memory_line_is_one_rank_of_each_group() -> None:
    (pre, dec) = fit_groups(dsv3(tp_size=8, pd="1P1D"))
    assert (pre.role, pre.servers, dec.role) == ("prefill", 1, "decode")
    rep = dec.report
    assert rep is not None
    line = memory_line(dec)
    assert line.startswith("decode (1 server of TP8, 8 GPUs each, 1 scheduler per server): ")
    assert f"weights {rep.weight_bytes_per_gpu / 1e9:,.1f} GB" in line
    assert f"{rep.kv_tokens:,} KV tokens" in line
    (bad,) = fit_groups(dsv3(tp_size=1))  # 673 GB of FP8 weights on one 141 GB H200
    assert bad.report is None and "weights_load" in memory_line(bad)
    assert server_label(dsv3(tp_size=16)) == "TP16"


def test_pd_text_names_group_overrides() -> None:
    assert pd_text(None) == "unset"
    assert pd_text(dsv3(tp_size=8, pd="2P1D").pd) == "2P1D"
    pd = dsv3(tp_size=8, pd={"decode": {"attn_dp_size": 8, "ep_size": 8}}).pd
    assert pd_text(pd) == "1P1D (decode attn_dp_size=8, ep_size=8)"


def summary(tok_gpu: float) -> MetricsSummary:
    p = Percentiles(p50=100.0, p90=200.0, p99=300.0, mean=100.0)
    return MetricsSummary(
        requests=100, completed=100, errors=0, duration_s=60.0, input_tokens=100_000,
        output_tokens=20_000, output_tok_s=tok_gpu * 16, input_tok_s=1000.0,
        output_tok_s_per_gpu=tok_gpu, tok_s_per_user=30.0, request_rate=1.5, ttft_ms=p,
        itl_ms=p, tpot_ms=p, e2e_ms=p, gpus=16, retractions=0)


def trial(seq: int, phase: str, status: str, config: ServingConfig, changed: str,
          **kw: object) -> Trial:
    return Trial(run_id=RUN_ID, seq=seq, key=f"{phase}:{config.config_id()}", phase=phase,
                 status=status, config=config, changed=changed, reason="ok", **kw)


@pytest.fixture(scope="module")
def study() -> Study:
    return parse_study({
        "name": "dsv3-h200", "model": "deepseek-v3", "gpu": "H200", "gpu_count": 16,
        "baseline": {"weights": "fp8", "tp_size": 8},
        "knobs": {"max_running_requests": [128, 256]},
        "saturation": {"isl": 2048, "osl": 512, "concurrency": 64, "duration_s": 120},
        "replay": {"trace": "data/traces/mooncake_fast25_conversation_trace.jsonl",
                   "start_s": 30, "duration_s": 300, "time_scale": 2.5},
        "slo": {"ttft_p99_ms": 2000},
        "budget": {"max_trials": 10, "patience": 3},
    })


BASE = dsv3(tp_size=8, replicas=2)
PD = dsv3(tp_size=8, pd="1P1D", router_policy="cache_aware")


def test_report_names_layouts_and_gives_the_pd_launch(tmp_path: Path, study: Study) -> None:
    trials = [trial(1, "search", "baseline", BASE, "", objective=1000.0,
                    saturation=summary(1000.0)),
              trial(2, "search", "keep", PD, "pd=1P1D", objective=1100.0,
                    saturation=summary(1100.0)),
              trial(3, "validate", "winner", PD, "pd=1P1D", parent_seq=2, objective=1100.0,
                    saturation=summary(1100.0), replay=summary(300.0))]
    text = render_report(tmp_path, study, trials, [], run_id=RUN_ID, stop_reason="done",
                         elapsed_s=1.0, replay_requests=100,
                         trace_file="mooncake_fast25_conversation_trace.jsonl").read_text()
    trials_rows = [r for r in text.split("## Trials")[1].split("\n## ")[0].splitlines()
                   if r.startswith("| ")][1:]
    assert trials_rows[0].startswith("| 1 | baseline | baseline | 1,000.0 |")  # no layout
    assert trials_rows[1].startswith("| 2 | keep | pd=1P1D [1P1D TP8] | 1,100.0 |")
    assert summary_rows(trials)[1]["changed"] == "pd=1P1D [1P1D TP8]"
    result = text.split("## Result")[1].split("\n## ")[0]
    assert "reached by pd=1P1D [1P1D TP8]" in result
    assert "Layout 1P1D TP8: a prefill and a decode server group" in result
    pre = PD.pd_worker("prefill").launch_command() + " --disaggregation-bootstrap-port 8998"
    assert f"```bash\n{pre}\n```" in result
    assert f"```bash\n{PD.pd_worker('decode').launch_command()}\n```" in result
    assert ("python -m sglang_router.launch_router --pd-disaggregation --prefill "
            "http://PREFILL_0:30000 8998 --decode http://DECODE_0:30000 --policy cache_aware "
            "--cache-threshold 0.3 ") in result
    assert "- servers: 1 prefill (TP8, 8 GPUs each), 1 decode (TP8, 8 GPUs each); 16 GPUs" \
        in result
    for g in fit_groups(PD):
        assert f"- {memory_line(g)}" in result
    assert "clients sending requests to the PD router above" in result
    assert "pd unset -> 1P1D" in result and "replicas 2 -> 1" in result
    assert "\n\n\n" not in result


def test_report_gives_per_node_flags_for_a_server_spanning_nodes(tmp_path: Path,
                                                                  study: Study) -> None:
    tp16 = dsv3(tp_size=16)
    trials = [trial(1, "search", "baseline", BASE, "", objective=1000.0,
                    saturation=summary(1000.0)),
              trial(2, "validate", "winner", tp16, "tp_size=16", parent_seq=1,
                    objective=900.0, saturation=summary(900.0), replay=summary(300.0))]
    text = render_report(tmp_path, study, trials, [], run_id=RUN_ID, stop_reason="done",
                         elapsed_s=1.0, replay_requests=100,
                         trace_file="mooncake_fast25_conversation_trace.jsonl").read_text()
    result = text.split("## Result")[1].split("\n## ")[0]
    # TP alone is no layout (its name stays plain), but the server spans two nodes
    assert "reached by tp_size=16;" in result
    assert "Layout TP16. Launch command for ONE replica:" in result
    assert f"```bash\n{tp16.launch_command()}\n```" in result
    assert ("One server spans 2 nodes of 8 H200: run the command on each of them with "
            "`--nnodes 2 --node-rank <0..1> --dist-init-addr <node 0>:20000`") in result
    assert "- replicas: 1 (tp_size 16 each, 16 GPUs)" in result
