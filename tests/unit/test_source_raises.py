"""locate_message on the real SGLang 0.5.23 tree: an engine error message finds its raise or
assert site (literal, f-string, .format, % and concatenated templates), ranked by exception type
and literal length, with the flags and hardware facts its guard tests.
"""

from __future__ import annotations

import textwrap

import pytest
from fixtures.pinned_index import pinned_index_fixture  # noqa: F401

from domain.grounding import FlagAtom, SmAtom
from mcp_servers.source.flags import extract_flags
from mcp_servers.source.raises import (
    evaluate_site,
    locate_message,
    site_at,
    split_exception,
)
from mcp_servers.source.templates import prefix_literal
from mcp_servers.source.tree import SourceError, SourceTree

KV_HOOK = "sglang/srt/arg_groups/kv_cache_hook.py"
OVERRIDES = "sglang/srt/arg_groups/overrides.py"
VALIDATION = "sglang/srt/arg_groups/validation_hook.py"

# (log line, site, exception, flags its guard tests); the messages are the engine's own
# (0.5.23 source at that file:line), several as the twin refuses with them
# (domain/engines/sglang/startup.py) and as the knobs reference quotes them.
REAL = [
    pytest.param("ValueError: The 'fa3' backend is not supported on Blackwell GPUs",
                 "sglang/srt/layers/attention/vision.py:1331", "ValueError",
                 ["mm_attention_backend"], id="vision-fa3-blackwell"),
    pytest.param("AssertionError: 4 is not divisible by 8", "sglang/srt/distributed/utils.py:70",
                 "AssertionError", [], id="format-template"),
    pytest.param("ValueError: The arguments enable-hierarchical-cache and disable-radix-cache "
                 "are mutually exclusive and cannot be used at the same time. Please use only "
                 "one of them.", f"{KV_HOOK}:394", "ValueError",
                 ["enable_hierarchical_cache", "disable_radix_cache"], id="implicit-concat"),
    pytest.param("AssertionError: FlashAttention v3 Backend requires SM>=80 and SM<=90. Please "
                 "use `--attention-backend flashinfer`.",
                 "sglang/srt/layers/attention/attention_registry.py:243", "AssertionError",
                 ["attention_backend"], id="fa3-sm-assert-registered-backend"),
    pytest.param("ValueError: TRTLLM MLA backend is only supported on Blackwell GPUs "
                 "(SM100/SM12x). Please use a different backend.", f"{OVERRIDES}:1211",
                 "ValueError", ["attention_backend", "decode_attention_backend"],
                 id="trtllm-mla-blackwell"),
    pytest.param("ValueError: CuteDSL MLA backend is only supported on Blackwell GPUs (SM100). "
                 "Please use a different backend.", f"{OVERRIDES}:1245", "ValueError",
                 ["attention_backend", "decode_attention_backend", "prefill_attention_backend"],
                 id="cutedsl-sm100"),
    pytest.param("AssertionError: schedule_conservativeness must be non-negative",
                 f"{VALIDATION}:314", "AssertionError", ["schedule_conservativeness"],
                 id="schedule-conservativeness"),
    pytest.param("ValueError: Not enough host memory available. Requesting 812.35 GB but only "
                 "have 501.20 GB free. Please reduce the size of the hierarchical cache.",
                 "sglang/srt/mem_cache/pool_host/base.py:252", "ValueError", [],
                 id="f-string-format-spec"),
    pytest.param("AssertionError: chunked_prefill_size must be divisible by page_size",
                 f"{VALIDATION}:244", "AssertionError",
                 ["chunked_prefill_size", "disaggregation_mode", "page_size"],
                 id="arithmetic-guard"),
    pytest.param("ValueError: --retraction-policy priority requires --enable-priority-scheduling",
                 f"{VALIDATION}:304", "ValueError",
                 ["retraction_policy", "enable_priority_scheduling"], id="retraction-policy"),
    pytest.param("AssertionError: tp_size must be divisible by number of nodes",
                 f"{VALIDATION}:179", "AssertionError",
                 ["ep_join_mode", "tp_size", "pp_size", "nnodes"], id="tp-nodes"),
    # the knobs reference quotes the start of these two messages: a cut log line
    pytest.param("AssertionError: To use priority scheduling, schedule_policy must be 'fcfs' "
                 "or 'lof'.", f"{VALIDATION}:282", "AssertionError",
                 ["enable_priority_scheduling", "schedule_policy"], id="start-of-f-string"),
    pytest.param("--disable-cuda-graph-padding is incompatible with --enable-torch-compile.",
                 f"{VALIDATION}:188", "AssertionError",
                 ["disable_cuda_graph_padding", "enable_torch_compile"], id="start-of-assert"),
    pytest.param("RuntimeError: Cannot get host and port information from tcp://10.0.0.1, "
                 "error: not enough values to unpack!",
                 "sglang/srt/model_executor/mindspore_runner.py:46", "RuntimeError", [],
                 id="percent-template"),
]


@pytest.mark.parametrize(("line", "site", "exception", "flags"), REAL)
def test_a_real_message_finds_its_site_and_guard(pinned_index, line, site, exception, flags):
    tree, inv = pinned_index
    found = locate_message(tree, inv, line)
    best = found.sites[0]
    assert (best.site, best.exception, best.flags) == (site, exception, flags)
    assert found.exception in (exception, None) and best.path == site.rsplit(":", 1)[0]
    assert best.partial == line.endswith(("torch-compile.", "or 'lof'."))
    assert tree.texts[best.path].split("\n")[best.line - 1].lstrip().startswith(
        ("raise", "assert"))


def test_the_vision_fa3_refusal_tests_the_backend_and_blackwell(pinned_index):
    tree, inv = pinned_index
    best = locate_message(tree, inv, "The 'fa3' backend is not supported on Blackwell GPUs",
                          exception="ValueError").sites[0]
    assert best.guard == "backend == 'fa3' and get_platform().is_blackwell"
    assert best.function.endswith("_determine_attention_backend")
    [[flag, sm]] = best.facts.disjuncts
    assert isinstance(flag, FlagAtom) and (flag.dest, flag.op, flag.value) == (
        "mm_attention_backend", "eq", "fa3")
    assert "backend = override_backend" in (flag.via or "")
    assert "get_mm().mm_attention_backend" in (flag.via or "")
    # is_blackwell_supported: partial(_check_cuda_device_version, device_capability_majors=
    # [10, 11, 12]) in utils/common.py, reached through runtime_context._PLATFORM_PROBES
    assert isinstance(sm, SmAtom) and (sm.op, sm.value) == ("in", [10, 11, 12])
    assert sm.source == "sglang/srt/utils/common.py:297"
    assert best.hardware == ["get_platform().is_blackwell"] and not best.tests_model


def test_a_quote_without_backticks_still_matches(pinned_index):
    """The twin and the knobs reference quote the fa3 assert without its Markdown marks."""
    tree, inv = pinned_index
    found = locate_message(tree, inv, "AssertionError: FlashAttention v3 Backend requires "
                           "SM>=80 and SM<=90. Please use --attention-backend flashinfer.")
    assert found.sites[0].site == "sglang/srt/layers/attention/attention_registry.py:243"
    assert not found.sites[0].partial


def test_negated_hardware_and_model_properties(pinned_index):
    tree, inv = pinned_index
    trt = site_at(tree, inv, OVERRIDES, 1211)
    assert [[(a.kind, a.op, a.value) for a in d if isinstance(a, SmAtom)]
            for d in trt.facts.disjuncts] == [[("sm", "not_in", [10, 11, 12])]] * 2
    fa3 = site_at(tree, inv, "sglang/srt/layers/attention/attention_registry.py", 243)
    assert fa3.tests_model  # runner.use_mla_backend
    # @register_attention_backend("fa3"): the factory runs for --attention-backend fa3
    assert fa3.guard.startswith("(server_args.attention_backend == 'fa3') and ")
    assert {(a.op, a.value) for d in fa3.facts.disjuncts for a in d
            if isinstance(a, SmAtom)} == {("ne", 8), ("ne", 9)}  # major, _ = capability


def test_ranking_prefers_the_exception_named_in_the_log_line(pinned_index):
    tree, inv = pinned_index
    plain = locate_message(tree, inv, "schedule_conservativeness must be non-negative")
    assert plain.sites[0].site == f"{VALIDATION}:314"  # the longest literal match
    # named ValueError, which no likely file raises with it: the search widens, and a
    # ValueError site with a shorter literal match ranks before the assert
    as_value = locate_message(tree, inv, "ValueError: schedule_conservativeness must be "
                              "non-negative")
    first, *rest = as_value.sites
    assert (first.exception, first.template) == ("ValueError", "{} must be non-negative")
    assert first.literal_chars < plain.sites[0].literal_chars
    assert f"{VALIDATION}:314" in [s.site for s in rest]


def test_the_serving_runtime_ranks_before_other_packages(pinned_index):
    tree, inv = pinned_index
    found = locate_message(tree, inv, "AssertionError: 4 is not divisible by 8")
    assert [s.path for s in found.sites[:2]] == [
        "sglang/srt/distributed/utils.py", "sglang/multimodal_gen/runtime/distributed/utils.py"]
    assert found.sites[0].template == "{} is not divisible by {}"


def test_evaluate_site_reads_the_guard_ast(pinned_index):
    tree, inv = pinned_index
    both = {"enable_hierarchical_cache": True, "disable_radix_cache": True}
    assert evaluate_site(tree, inv, KV_HOOK, 394, both, sm_major=10) is True
    assert evaluate_site(tree, inv, KV_HOOK, 394, {**both, "disable_radix_cache": False},
                         sm_major=10) is False
    vision = "sglang/srt/layers/attention/vision.py"
    fa3 = {"mm_attention_backend": "fa3"}
    assert evaluate_site(tree, inv, vision, 1331, fa3, sm_major=10) is True
    assert evaluate_site(tree, inv, vision, 1331, fa3, sm_major=9) is False
    assert evaluate_site(tree, inv, vision, 1331, {}, sm_major=10) is None  # backend unknown
    with pytest.raises(SourceError, match="no raise or assert"):
        site_at(tree, inv, KV_HOOK, 1)


def test_unmatched_and_bad_messages(pinned_index):
    tree, inv = pinned_index
    none = locate_message(tree, inv, "ValueError: the quick brown fox jumps over servetune")
    assert (none.total, none.sites) == (0, [])
    for bad in ("", "   ", "x" * 5000):
        with pytest.raises(SourceError, match="give the error message"):
            locate_message(tree, inv, bad)


def test_a_fragment_matches_the_start_of_its_template(pinned_index):
    tree, inv = pinned_index
    cut = locate_message(tree, inv, "ValueError: The arguments enable-hierarchical-cache and "
                         "disable-radix-cache are mutually exclusive ...")
    assert (cut.sites[0].site, cut.sites[0].partial) == (f"{KV_HOOK}:394", True)
    assert prefix_literal(["a {x} b", None, " tail"], "a {x} b 12") == 7
    assert prefix_literal(["The ", None, " is not divisible by ", None], "The 4 is not div") == 15
    assert prefix_literal(["The ", None, " is odd"], "A 4 is odd") is None


def test_a_traceback_or_a_multi_line_message(pinned_index):
    tree, inv = pinned_index
    tb = ("Traceback (most recent call last):\n"
          '  File "/sgl/python/sglang/srt/arg_groups/validation_hook.py", line 314, in check\n'
          "    assert cfg.schedule_conservativeness >= 0, (\n"
          "AssertionError: schedule_conservativeness must be non-negative")
    assert locate_message(tree, inv, tb).sites[0].site == f"{VALIDATION}:314"
    # an f-string message of several lines (moe_hook.py): every line is part of it
    multi = ("AssertionError: Invalid quantization 'w8a8_int8'. \nFlashInfer TRTLLM MOE "
             "supports only: 'modelopt_fp4', 'nvfp4_online', 'fp8', 'modelopt_fp8', "
             "'modelopt_mixed', 'compressed-tensors', or bfloat16 (None).")
    found = locate_message(tree, inv, multi)
    assert found.sites[0].site == "sglang/srt/arg_groups/moe_hook.py:124"
    assert found.sites[0].flags == ["moe_runner_backend", "quantization"]


def test_split_exception():
    assert split_exception("ValueError: boom here") == ("ValueError", "boom here")
    assert split_exception("[2026-01-01 TP0] torch.OutOfMemoryError: CUDA out of memory") == (
        "OutOfMemoryError", "CUDA out of memory")
    assert split_exception("no exception here") == (None, "no exception here")


def test_templates_locals_and_early_exits(tmp_path):
    src = tmp_path / "sglang"
    (src / "srt").mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "srt" / "server_args.py").write_text(textwrap.dedent('''\
        class ServerArgs:
            tp_size: int = 1
            page_size: int = 1

            def check(self):
                if self.page_size == 1:
                    return
                msg = "page size " + str(self.page_size) + " needs tp_size > 1"
                if self.tp_size < 2:
                    raise ValueError(msg)
                raise RuntimeError("tp %d with page %s is odd" % (self.tp_size, 3))
        '''))
    tree = SourceTree(tmp_path)
    inv = extract_flags(tree)
    hit = locate_message(tree, inv, "ValueError: page size 16 needs tp_size > 1").sites[0]
    assert (hit.line, hit.template) == (10, "page size {} needs tp_size > 1")
    assert hit.guard == "(self.page_size != 1) and (self.tp_size < 2)"  # the early exit
    assert [(a.dest, a.op, a.value) for a in hit.facts.disjuncts[0]] == [
        ("page_size", "ne", 1), ("tp_size", "lt", 2)]
    odd = locate_message(tree, inv, "tp 4 with page 3 is odd").sites[0]
    assert (odd.line, odd.exception, odd.template) == (11, "RuntimeError",
                                                        "tp {} with page {} is odd")
    # the earlier raise is passed, not part of the guard: a config failing it fails there
    assert (odd.guard, odd.reached_only_if) == ("self.page_size != 1", ["self.tp_size >= 2"])
    assert [(a.dest, a.op) for a in odd.facts.disjuncts[0]] == [("page_size", "ne")]
