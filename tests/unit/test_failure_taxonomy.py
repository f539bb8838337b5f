"""The failure taxonomy and the phase-aware SGLang classifier (issue 18, items 1 and 2).

Covers ``domain.failures`` (every class: phases, retry rule, fix, outcome; the retry policy and
the lesson fixes read it), ``domain.engines.sglang.failures.phase_at`` / ``diagnose`` over the
issue's measured misclassifications, and the lessons they now write. Engine log lines quoted
from public issue threads carry their URL.
"""

from __future__ import annotations

import pytest
from fixtures.configs import serving_config as cfg

from domain import faults
from domain.engines import engine
from domain.engines.sglang import lessons
from domain.engines.sglang.failures import FAILURE_CLASSES, diagnose, phase_at
from domain.engines.sglang.logargs import logged_settings
from domain.failures import (
    MAX_ATTEMPTS,
    PHASES,
    TAXONOMY,
    Diagnosis,
    NoLesson,
    failure_class,
    rule,
    should_retry,
)
from domain.twin.startup import start

SGL = engine("sglang", "0.5.23")


# ---------------------------------------------------------------- the taxonomy itself
def test_every_class_states_phase_retry_fix_outcome_and_condition_once():
    assert set(FAILURE_CLASSES) <= set(TAXONOMY)
    assert FAILURE_CLASSES[-1] == "UNKNOWN"
    for name, fc in TAXONOMY.items():
        assert fc.name == name and fc.phases and set(fc.phases) <= set(PHASES), name
        assert fc.meaning and fc.fix and fc.condition, name
        assert (fc.outcome is None) == fc.retry.retry or name == "BENCH_INVALID", name
        assert 1 <= fc.retry.max_attempts <= MAX_ATTEMPTS
        assert fc.retry.retry == (fc.retry.max_attempts > 1), name
    assert failure_class("NOPE") is TAXONOMY["UNKNOWN"] and failure_class(None).name == "UNKNOWN"


def test_retry_policy_and_lesson_fixes_read_the_taxonomy():
    assert faults.RETRY == {n: fc.retry for n, fc in TAXONOMY.items()}
    assert faults.rule is rule and faults.should_retry is should_retry
    assert lessons.FIXES == {n: fc.fix for n, fc in TAXONOMY.items()}
    assert lessons.OUTCOME["GRAPH_CAPTURE_OOM"] == "oom" and "READY_TIMEOUT" not in lessons.OUTCOME
    # a readiness timeout is retried once (two tries), an image pull up to MAX_ATTEMPTS
    assert [should_retry("READY_TIMEOUT", a) for a in range(3)] == [True, False, False]
    assert [should_retry("IMAGE_PULL", a) for a in range(3)] == [True, True, False]
    assert not any(should_retry(c, 0) for c in ("OOM_WEIGHTS", "GRAPH_CAPTURE_OOM", "BAD_FLAG",
                                                 "KV_THRASH", "MODEL_LOAD", "UNKNOWN", None))


# ---------------------------------------------------------------- phases
def test_phases_follow_the_engines_own_lines():
    log = ["usage: sglang serve [-h]",  # 0 args
           "[TP0] server_args={'model_path': 'zai-org/GLM-5-FP8', 'tp_size': 8}",  # 1 init
           "[TP0] Load weight begin. avail mem=177.00 GB",  # 2 weights_load
           "[TP0] Load weight end. type=GlmMoeDsaForCausalLM, avail mem=90.00 GB",  # 3 kv_pool
           "[TP0] KV Cache is allocated. dtype: fp8_e4m3, #tokens: 1000, KV size: 1.00 GB",
           "[TP0] Capture target decode CUDA graph begin. backend=full",  # 5 cuda_graph
           "[TP0] The server is fired up and ready to roll!",  # 6 serving
           "[TP0] Decode batch, #running-req: 6, #token: 10"]
    assert phase_at(log) == ["args", "init", "weights_load", "kv_pool", "kv_pool", "cuda_graph",
                             "serving", "serving"]
    # a draft model's second load goes back to weights_load; a traceback frame names its phase
    assert phase_at([log[3], "Load weight begin. avail mem=9 GB"])[-1] == "weights_load"
    assert phase_at(['  File "x/model_runner.py", line 934, in init_cuda_graphs']) == [
        "cuda_graph"]


def test_twin_startups_report_their_phase():
    assert SGL.diagnose(start(cfg(tp_size=4, replicas=2)).log).phase == "weights_load"
    assert SGL.diagnose(start(cfg(mem_fraction_static=0.5)).log).phase == "kv_pool"
    d = SGL.diagnose(start(cfg(mem_fraction_static=0.99)).log)
    assert (d.failure_class, d.phase, d.retry) == ("GRAPH_CAPTURE_OOM", "cuda_graph", False)


# ---------------------------------------------------------------- the measured examples
def test_cuda_oom_while_capturing_graphs_is_graph_capture_oom_not_weights():
    # https://github.com/sgl-project/sglang/issues/5285 (the OOM raised in CudaGraphRunner)
    tb = ["Traceback (most recent call last):",
          '  File "/sgl-workspace/sglang/python/sglang/srt/model_executor/model_runner.py", '
          "line 934, in init_cuda_graphs",
          "Exception: Capture cuda graph failed: CUDA out of memory. Tried to allocate 448.00 MiB."
          " GPU 7 has a total capacity of 95.00 GiB"]
    d = diagnose(tb)
    assert (d.failure_class, d.phase) == ("GRAPH_CAPTURE_OOM", "cuda_graph")
    # the same torch OOM line at weight load is OOM_WEIGHTS: the phase decides
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB."
    assert diagnose(["Load weight begin. avail mem=70.00 GB", oom]).failure_class == "OOM_WEIGHTS"
    assert diagnose(["Capture target decode CUDA graph begin.", oom]).failure_class == \
        "GRAPH_CAPTURE_OOM"
    assert "more GPUs" not in d.fix and "--cuda-graph-max-bs-decode" in d.fix


def test_blackwell_fa3_vision_refusal_is_unsupported_backend_naming_its_flag():
    line = "ValueError: The 'fa3' backend is not supported on Blackwell GPUs"
    d = diagnose(["[TP0] Load weight begin. avail mem=177.00 GB",
                  "Traceback (most recent call last):", line])
    assert (d.failure_class, d.evidence, d.flags) == (
        "UNSUPPORTED_BACKEND", line, ["--mm-attention-backend"])
    assert d.source == "sglang/srt/layers/attention/vision.py:1331" and not d.verified


def test_an_unrecognized_flag_is_bad_flag_and_its_lesson_names_the_flag():
    d = diagnose(["usage: launch_server.py [-h] --model-path MODEL_PATH ...",
                  "launch_server.py: error: unrecognized arguments: --enable-foo 1"])
    assert (d.failure_class, d.phase, d.flags) == ("BAD_FLAG", "args", ["--enable-foo"])
    # the flag is no ServingConfig field: no lesson (never "fp8 AND tp_size == 8")
    with pytest.raises(NoLesson, match="--enable-foo"):
        SGL.diagnosis_lesson(cfg(), d, [])
    # a flag the config sets: the lesson is that flag at its value, any GPU or model
    c = cfg(attention_backend="fa3")
    bad = Diagnosis.of("BAD_FLAG", "args", "sglang serve: error: argument --attention-backend: "
                       "invalid choice: 'fa3'")
    les = SGL.diagnosis_lesson(c, bad, [])
    assert les.condition_text() == "attention_backend == 'fa3'"
    assert (les.scope.gpu, les.scope.model, les.outcome) == (None, None, "invalid-flag")


def test_flashinfer_unsupported_architecture_under_a_scheduler_crash_is_unsupported_backend():
    # https://github.com/flashinfer-ai/flashinfer/issues/5445 (sm_120, TllmGenFmhaRunner)
    log = ["[2026-09-22 17:29:06 TP1] Scheduler hit an exception: Traceback (most recent call "
           "last):",
           '  File "/x/sglang/srt/managers/scheduler.py", line 1991, in event_loop_overlap',
           "tvm.error.InternalError: Error in function 'TllmGenFmhaRunner' at /x/flashinfer/trtllm"
           "/fmha/fmhaRunner.cuh:37: Unsupported architecture",
           "[2026-09-22 17:29:06] Received sigquit from a child process. It usually means the "
           "child failed."]
    d = diagnose(log)
    assert (d.failure_class, d.phase) == ("UNSUPPORTED_BACKEND", "serving")
    assert d.evidence == log[2]
    # a model architecture the engine lacks is MODEL_LOAD, not a GPU refusal
    assert diagnose(["ValueError: Model architectures ['FooForCausalLM'] are not supported for "
                     "now."]).failure_class == "MODEL_LOAD"


def test_repeated_retraction_while_serving_is_kv_thrash():
    # the scheduler's warning (sglang/srt/managers/scheduler.py:4526 of 0.5.23)
    retract = ("[TP0] KV cache pool is full. Retract requests. #retracted_reqs: 3, "
               "#new_tokens_gained: 1024, #new_token_ratio: 0.4000 -> 0.7000")
    ready = ["The server is fired up and ready to roll!",
             "[TP0] Decode batch, #running-req: 256, #token: 90000, token usage: 0.99"]
    d = diagnose([*ready, retract, ready[1], retract])
    assert (d.failure_class, d.phase, d.retry) == ("KV_THRASH", "serving", False)
    assert diagnose([*ready, retract]).failure_class == "UNKNOWN"  # once is not thrashing
    scrape = ['sglang:num_retracted_reqs{model_name="glm-5"} 12.0']
    assert diagnose([*ready, *scrape]).failure_class == "KV_THRASH"
    les = SGL.diagnosis_lesson(cfg(), d, [])
    assert les.outcome == "slo-miss" and not les.forbids(cfg())  # informs, never prunes


def test_model_load_and_nccl_classes():
    d = diagnose(["[TP0] server_args={'model_path': '/models/x'}",
                  "RuntimeError: Cannot find any model weights with `/models/x`"])
    assert (d.failure_class, d.phase, d.retry) == ("MODEL_LOAD", "init", False)
    d = diagnose(["[TP0] server_args={'model_path': '/models/x'}",
                  "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
                  "unhandled system error"])
    assert (d.failure_class, d.retry) == ("NCCL", True)
    assert [should_retry("NCCL", a) for a in range(2)] == [True, False]


def test_a_silent_stop_then_a_readiness_timeout_is_a_timeout_at_that_phase():
    log = ["[TP0] server_args={'model_path': 'zai-org/GLM-5-FP8'}",
           "[TP0] Load weight begin. avail mem=177.00 GB",
           "servetune: replica 0 not ready after 600 s; last log line: [TP0] Load weight begin."]
    d = diagnose(log)
    assert (d.failure_class, d.phase, d.retry) == ("READY_TIMEOUT", "weights_load", True)
    with pytest.raises(NoLesson, match="transient"):
        SGL.diagnosis_lesson(cfg(), d, log)


# ---------------------------------------------------------------- the lessons they write
def test_graph_capture_oom_lesson_bans_the_memory_layout_not_every_fp8_config():
    c = cfg(mem_fraction_static=0.99)
    d = SGL.diagnose(start(c).log)
    les = SGL.diagnosis_lesson(c, d, start(c).log)
    assert les.forbids(c) and les.failure_class == "GRAPH_CAPTURE_OOM"
    assert not les.forbids(c.model_copy(update={"mem_fraction_static": 0.85}))
    assert not les.forbids(c.model_copy(update={"tp_size": 4, "replicas": 2}))


def test_server_args_line_is_read_back_in_each_form():
    assert logged_settings(["[x] server_args={'model_path': 'a/b', 'tp_size': 8, "
                            "'attention_backend': None, 'mem_fraction_static': 0.85}"],
                           "0.5.23") == {"model_path": "a/b", "tp_size": 8,
                                         "attention_backend": None, "mem_fraction_static": 0.85}
    got = logged_settings(["server_args=ServerArgs(model_path='a/b', tp_size=4, x=Obj())"],
                          "0.5.23")
    assert (got["model_path"], got["tp_size"]) == ("a/b", 4)
    assert logged_settings(["server_args=--model-path a/b --tp-size 8 --disable-radix-cache"],
                           "0.5.23") == {"model_path": "a/b", "tp_size": 8,
                                         "disable_radix_cache": True}
    assert logged_settings(["no args here"], "0.5.23") == {}


def test_the_lessons_page_lists_every_class_as_the_taxonomy_states_it():
    from fixtures.paths import REPO

    text = (REPO / "docs" / "lessons.md").read_text()
    rows = {r.split("|")[1].strip(" `"): [c.strip() for c in r.split("|")[2:-1]]
            for r in text.splitlines() if r.startswith("| `")}
    for name, fc in TAXONOMY.items():
        assert name in rows, name
        phases, _retry, outcome, condition = rows[name]
        assert (phases, outcome, condition) == (", ".join(fc.phases), fc.outcome or "-",
                                                fc.condition), name


# -- what a pasted log must not teach (found by a new user's tries) ---------------------------

HEALTHY = ["[2026-01-01 10:00:00] server_args={'model_path': 'deepseek-ai/DeepSeek-V3', "
           "'tp_size': 8, 'mem_fraction_static': 0.85}",
           "[2026-01-01 10:00:05 TP0] Load weight begin. avail mem=139.10 GB",
           "[2026-01-01 10:02:05 TP0] Load weight end. type=DeepseekV3ForCausalLM",
           "[2026-01-01 10:02:06 TP0] KV Cache is allocated. #tokens: 400000",
           "[2026-01-01 10:02:30] The server is fired up and ready to roll!",
           "[2026-01-01 10:02:31 TP0] Decode batch, #running-req: 1, #token: 90"]
GRAPH_OOM = ["[2026-01-01 09:00:00] server_args={'model_path': 'zai-org/GLM-5-FP8', "
             "'tp_size': 8, 'mem_fraction_static': 0.93}",
             "[2026-01-01 09:00:05 TP0] Load weight begin. avail mem=177.10 GB",
             "[2026-01-01 09:02:06 TP0] KV Cache is allocated. #tokens: 700000",
             "[2026-01-01 09:02:07 TP0] Capture target decode CUDA graph begin. backend=full",
             "[2026-01-01 09:02:09 TP0] Capture cuda graph failed: CUDA out of memory."]


def test_a_healthy_log_teaches_no_lesson():
    from domain.diagnosis import diagnose_log

    r = diagnose_log(HEALTHY, gpu="H200")
    assert r.diagnosis.failure_class == "UNKNOWN" and r.diagnosis.phase == "serving"
    assert r.lesson is None and "healthy log teaches nothing" in (r.no_lesson or "")


def test_a_log_of_several_launches_is_read_from_the_last_one():
    from domain.diagnosis import diagnose_log

    assert diagnose(GRAPH_OOM + HEALTHY).failure_class == "UNKNOWN"  # the last launch served
    r = diagnose_log(HEALTHY + GRAPH_OOM, gpu="B200")
    assert r.diagnosis.failure_class == "GRAPH_CAPTURE_OOM"
    assert r.config is not None and r.config.model == "glm-5" and r.lesson is not None
    assert r.lesson.scope.model == "glm-5"  # not the healthy DeepSeek-V3 launch before it


def test_junk_is_unknown_and_its_evidence_is_bounded_and_printable():
    from domain.diagnosis import MAX_LINE_CHARS, diagnose_log

    assert diagnose(["\x00\x01\x7fELF\x02", "x" * 10]).failure_class == "UNKNOWN"
    r = diagnose_log(["\x00\x01binary\x02" + "y" * 100_000], gpu="B200")
    assert r.diagnosis.failure_class == "UNKNOWN" and r.lesson is None
    assert len(r.diagnosis.evidence) <= MAX_LINE_CHARS and "\x00" not in r.diagnosis.evidence
