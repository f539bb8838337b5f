"""``servetune check`` on layout commands (issue 21): the layout flags parsed in both spellings,
the memory per rank, the engine's layout refusals, and logs read back the same way."""

from __future__ import annotations

import pytest

from domain.engines import engine
from domain.engines.sglang.logargs import logged_settings
from domain.fit import fit
from domain.preflight import check_command

DSV3 = ["sglang", "serve", "--model-path", "deepseek-ai/DeepSeek-V3", "--tp-size", "8"]


@pytest.mark.parametrize("version", ["0.5.19", "0.5.23"])
def test_old_attention_dp_spelling_is_attention_dp_in_every_version(version: str) -> None:
    # --dp-size 8 --enable-dp-attention: attention DP 8, one server (parallel_hook.py:39-61)
    p = engine("sglang", version).parse_command([*DSV3, "--dp-size", "8",
                                                 "--enable-dp-attention", "--ep", "8"])
    assert p.fields["attn_dp_size"] == 8 and p.fields["dp_size"] == 1
    assert p.fields["ep_size"] == 8  # --ep is --ep-size's alias
    assert "UNMODELLED_FLAGS" not in {f.code for f in p.findings}


def test_new_spelling_and_the_other_layout_flags() -> None:
    p = engine("sglang").parse_command([
        *DSV3, "--attn-dp-size", "4", "--moe-a2a-backend", "deepep", "--deepep-mode",
        "low_latency", "--moe-dense-tp-size", "1", "--enable-dp-lm-head", "--pp-size", "1",
        "--disaggregation-mode", "decode", "--ep-num-redundant-experts", "32", "--enable-eplb",
        "--nnodes", "1"])
    f = p.fields
    assert (f["attn_dp_size"], f["moe_a2a_backend"], f["deepep_mode"], f["moe_dense_tp_size"],
            f["enable_dp_lm_head"], f["disaggregation_mode"], f["ep_num_redundant_experts"],
            f["enable_eplb"], f["pp_size"]) == (4, "deepep", "low_latency", 1, True, "decode",
                                                32, True, 1)
    assert "nnodes" not in f  # read by the check, not a config field
    # the engine's spelled-out defaults are the config's None
    q = engine("sglang").parse_command([*DSV3, "--moe-a2a-backend", "none",
                                        "--deepep-mode", "auto"])
    assert "moe_a2a_backend" not in q.fields and "deepep_mode" not in q.fields
    # --dp-size alone: data-parallel copies inside the server (no longer replicas)
    r = engine("sglang").parse_command([*DSV3, "--dp-size", "2"])
    assert r.fields["dp_size"] == 2 and "replicas" not in r.fields


def test_check_shows_memory_per_rank_for_attention_dp_and_ep() -> None:
    r = check_command([*DSV3, "--attn-dp-size", "8", "--ep-size", "8",
                       "--speculative-algorithm", "EAGLE"], "H200", 8)
    m = r.memory
    assert m is not None and m.layout == "TP8 (attention TP1 x DP8, EP8)" and m.schedulers == 8
    assert m.max_running_requests_per_rank == 6  # speculative 48 // 8 ranks
    assert m.chunked_prefill_size_per_rank == 1024  # 8192 // 8
    rep = r.config and fit(r.config)
    assert rep and m.kv_tokens_per_rank == rep.kv_tokens and m.weights_bytes_per_gpu == \
        rep.weight_bytes_per_gpu
    assert r.resolved["ep_size"] == 8 and r.resolved["max_running_requests"] == 6
    assert set(r.to_json()["memory"]) >= {"kv_tokens_per_rank", "max_running_requests_per_rank"}
    # a TP-only command keeps its memory keys
    tp = check_command(DSV3, "H200", 8).to_json()["memory"]
    assert "schedulers" not in tp and "layout" not in tp


def test_check_resolves_ep_for_an_a2a_backend_and_shows_deepep_buffers() -> None:
    r = check_command([*DSV3, "--attn-dp-size", "8", "--moe-a2a-backend", "deepep"], "H200", 8)
    codes = {f.code for f in r.findings}
    assert "EP_RESOLVED" in codes and r.resolved["ep_size"] == 8
    assert r.memory is not None and r.memory.deepep_buffer_bytes_per_gpu == pytest.approx(
        2.244e9, rel=1e-3)  # normal 0.336 GB + low-latency 1.908 GB (auto), test_layout_memory


@pytest.mark.parametrize(("flags", "message"), [
    (["--attn-dp-size", "3"], "AssertionError: assert cfg.tp_size % cfg.attn_dp_size == 0"),
    (["--attn-dp-size", "8", "--dp-size", "2"],
     "ValueError: --dp-size 2 with --attn-dp-size 8: data-parallel replicas combined with "
     "attention data parallelism are not supported."),
    (["--moe-dense-tp-size", "2"],
     "AssertionError: moe_dense_tp_size only supports None, 1, or tp_size currently"),
    (["--enable-two-batch-overlap"], "ValueError: When enabling two batch overlap without an EP "
     "a2a backend (moe_a2a_backend='none'), attention DP (--attn-dp-size) is required "
     "(DeepSeek-V4 non-EP DP TBO path)."),
])
def test_check_refuses_layout_rules_with_the_engines_words(flags: list[str],
                                                           message: str) -> None:
    r = check_command([*DSV3, *flags], "H200", 16)
    assert r.verdict == "refuse"
    assert message in {f.message for f in r.findings if f.code == "STARTUP_RESOLVE"}


def test_a_pasted_multi_node_command_needs_nnodes() -> None:
    wide = [*DSV3[:-1], "16"]
    r = check_command(wide, "H200", 16)
    bad = [f for f in r.findings if f.code == "STARTUP_INIT_DISTRIBUTED"]
    assert bad and bad[0].message == "RuntimeError: CUDA error: invalid device ordinal"
    assert "--nnodes 2" in bad[0].fix
    assert check_command([*wide, "--nnodes", "2"], "H200", 16).verdict == "ok"
    odd = check_command([*DSV3[:-1], "12", "--nnodes", "3"], "H200", 16)
    assert "AssertionError: tp_size must be divisible by number of nodes" not in {
        f.message for f in odd.findings}  # 12 % 3 == 0: the nodes split it
    assert check_command([*DSV3[:-1], "12", "--nnodes", "5"], "H200", 16).verdict == "refuse"


def test_logs_read_the_layout_in_both_spellings() -> None:
    old = logged_settings(["server_args=ServerArgs(model_path='a', tp_size=8, dp_size=8, "
                           "enable_dp_attention=True, moe_a2a_backend='none')"], "0.5.19")
    assert (old["attn_dp_size"], old["dp_size"]) == (8, 1) and "moe_a2a_backend" not in old
    new = logged_settings(["server_args={'tp_size': 8, 'attn_dp_size': 8, 'dp_size': 1, "
                           "'enable_dp_attention': True, 'ep_size': 8}"], "0.5.23")
    assert (new["attn_dp_size"], new["dp_size"], new["ep_size"]) == (8, 1, 8)
    argv = logged_settings(["server_args=--model-path a --tp-size 8 --dp-size 4 "
                            "--enable-dp-attention"], "0.5.19")
    assert (argv["attn_dp_size"], argv["dp_size"]) == (4, 1)


def test_a_pd_decode_command_resolves_its_role_rules() -> None:
    r = check_command([*DSV3, "--disaggregation-mode", "decode", "--max-running-requests",
                       "16"], "H200", 8)
    # radix cache off, 2 x 16 extra request slots (pd_disaggregation_hook.py:116-143)
    assert r.resolved["disable_radix_cache"] is True
    assert r.resolved["disaggregation_decode_extra_slots"] == 32


def test_deepseek_on_sm100_keeps_auto_moe_runner_under_an_a2a_backend() -> None:
    from domain.config import ServingConfig
    from domain.engines.sglang.arch import resolved_backends

    base = {"model": "deepseek-v3", "gpu": "B200", "tp_size": 8, "weights": "fp8"}
    assert resolved_backends(ServingConfig(**base))["moe_runner_backend"] == \
        "flashinfer_trtllm"  # type: ignore[arg-type]
    # overrides.py:810-811: only with --moe-a2a-backend none
    deepep = ServingConfig(**base, attn_dp_size=8, moe_a2a_backend="deepep")  # type: ignore[arg-type]
    assert resolved_backends(deepep)["moe_runner_backend"] == "auto"
