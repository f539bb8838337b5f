"""Where SGLang 0.5.23 refuses each config the twin refuses: one raise or assert site per refusal.

Every startup refusal of :mod:`domain.engines.sglang.startup` (and of
:func:`domain.speculative.resolve_speculative_logged`, which names its refusal by key) is a row
of :data:`REFUSALS`: the file under the wheel's root and the line of the engine statement that
raises, the function it is in, that statement's first source line (what a Python traceback
prints under the ``File`` line), the exception and the engine's message (``{name}`` marks an
f-string field). The lines are those of the pinned 0.5.23 wheel (``pip download sglang==0.5.23``,
unpacked by ``tests/fixtures/pinned_source.py``); ``tests/unit/test_refusal_audit.py`` reads
each site back from that tree, checks the code and message there, and evaluates the guarding
condition it parses there against the twin's verdict.

Rows whose ``stand_in`` is set are the twin's own: 0.5.23 has no statement that refuses that
config while starting (the text says what the engine does instead), so their site is where the
engine's path goes on, not a raise.
"""

from __future__ import annotations

from dataclasses import dataclass

# Where the lmsysorg/sglang images install the package: tracebacks of a served engine print
# /sgl-workspace/sglang/python/sglang/srt/... (the image's editable install of the repo).
TRACE_ROOT = "/sgl-workspace/sglang/python/"


@dataclass(frozen=True)
class Refusal:
    """One refusal site of SGLang 0.5.23.

    Attributes:
        file: path below the wheel root, ``sglang/srt/...py``.
        line: 1-based line of the refusing statement (a ``raise``, an ``assert``, or the
            comparison that raises ``TypeError``) in the pinned 0.5.23 wheel.
        function: the function that statement is in.
        code: that line's source text, stripped (printed under the traceback's ``File`` line).
        exception: the exception class the engine raises.
        message: the engine's message; ``{name}`` fields are filled per config; "" for a bare
            ``assert``.
        stand_in: "" for an engine refusal; else why the twin refuses where 0.5.23 has no
            refusing statement.
    """

    file: str
    line: int
    function: str
    code: str
    exception: str
    message: str
    stand_in: str = ""

    @property
    def site(self) -> str:
        """``file:line``, e.g. ``sglang/srt/arg_groups/speculative_hook.py:1278``."""
        return f"{self.file}:{self.line}"

    def text(self, **fields: object) -> str:
        """The traceback's last line, ``Exception: message`` (bare ``Exception`` if no message)."""
        msg = self.message.format(**fields) if fields else self.message
        return f"{self.exception}: {msg}" if msg else self.exception

    def frame(self) -> list[str]:
        """The innermost traceback frame as Python prints it (two lines)."""
        return [f'  File "{TRACE_ROOT}{self.file}", line {self.line}, in {self.function}',
                f"    {self.code}"]

    def traceback(self, **fields: object) -> list[str]:
        """``Traceback (most recent call last):``, the frame, and :meth:`text`."""
        return ["Traceback (most recent call last):", *self.frame(), self.text(**fields)]


_SPEC = "sglang/srt/arg_groups/speculative_hook.py"
_REG = "sglang/srt/layers/attention/attention_registry.py"
_OVR = "sglang/srt/arg_groups/overrides.py"
_PAR = "sglang/srt/arg_groups/parallel_hook.py"
_MOE = "sglang/srt/arg_groups/moe_hook.py"
_VAL = "sglang/srt/arg_groups/validation_hook.py"
_NONE_GT = "'>' not supported between instances of 'NoneType' and 'int'"

# In the order the twin (and the engine) reach them: argparse; the launcher's argument resolution;
# the scheduler processes' devices; the model's attention layers; weights; the KV pool; the
# attention backend; the speculative draft worker; CUDA-graph capture; the HiCache host pool.
REFUSALS: dict[str, Refusal] = {
    # parse: argparse exits 2 (prints usage and "error:", no traceback)
    "argparse": Refusal("sglang/srt/server_args.py", 696, "prepare_server_args",
                        "raw_args = parser.parse_args(argv)", "SystemExit", ""),
    # resolve: the argument resolution pipeline (ModelConfig is built from it first)
    "context_length_too_long": Refusal(
        "sglang/srt/configs/model_config.py", 1314, "_derive_context_length",
        "raise ValueError(", "ValueError",
        "Warning: User-specified context_length ({asked}) is greater than the derived "
        "context_length ({derived}). This may lead to incorrect model outputs or CUDA errors. "
        "Note that the derived context_length may differ from max_position_embeddings in the "
        "model's config. To allow overriding this maximum, set the env var "
        "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"),
    "hicache_without_radix": Refusal(
        "sglang/srt/arg_groups/kv_cache_hook.py", 394, "handle_cache_compatibility",
        "raise ValueError(", "ValueError",
        "The arguments enable-hierarchical-cache and disable-radix-cache are mutually exclusive "
        "and cannot be used at the same time. Please use only one of them."),
    "spec_adaptive_steps": Refusal(
        _SPEC, 1417, "_init_adaptive_speculative_params", "raise ValueError(", "ValueError",
        "--speculative-num-steps={steps} is not in the adaptive config candidate_steps "
        "{candidates}. Pass one of those values."),
    "spec_partial_triple": Refusal(_SPEC, 1160, "_handle_eagle_family", "assert (",
                                   "AssertionError", ""),
    "spec_trtllm_mha_topk_none": Refusal(
        _SPEC, 1177, "_handle_eagle_family", "if cfg.speculative_eagle_topk > 1:", "TypeError",
        _NONE_GT),
    "spec_trtllm_mha_topk": Refusal(
        _SPEC, 1178, "_handle_eagle_family", "raise ValueError(", "ValueError",
        "trtllm_mha backend only supports topk = 1 for speculative decoding."),
    "spec_topk_none": Refusal(_SPEC, 1274, "_handle_eagle_family",
                              "cfg.speculative_eagle_topk > 1", "TypeError", _NONE_GT),
    "spec_page_tree": Refusal(
        _SPEC, 1278, "_handle_eagle_family", "raise ValueError(", "ValueError",
        "speculative_eagle_topk > 1 with page_size > 1 is only supported on {backends}; got "
        "attention_backend={backend!r}. Use page_size == 1 or one of those backends."),
    "spec_draft_tokens_none": Refusal(
        "sglang/srt/speculative/eagle_worker_v2.py", 199, "__init__",
        "self.speculative_num_draft_tokens = get_spec().speculative_num_draft_tokens",
        "TypeError", "unsupported operand type(s) for *: 'int' and 'NoneType'",
        stand_in="speculative_hook.py lets topk > 1 with --speculative-num-draft-tokens unset "
        "pass; the EAGLE worker takes the None here and fails later, on first use"),
    "backend_trtllm_mla_sm": Refusal(
        _OVR, 1211, "_mla_kv_cache_dtype_checks", "raise ValueError(", "ValueError",
        "TRTLLM MLA backend is only supported on Blackwell GPUs (SM100/SM12x). Please use a "
        "different backend."),
    "backend_cutedsl_sm": Refusal(
        _OVR, 1245, "_cutedsl_prefill_backend_fill", "raise ValueError(", "ValueError",
        "CuteDSL MLA backend is only supported on Blackwell GPUs (SM100). Please use a "
        "different backend."),
    # resolve: parallel layouts (issue 21), in the pipeline's order: handle_pd_disaggregation
    # (pipeline.py:147), handle_data_parallelism (:274), handle_moe_kernel_config (:294),
    # handle_a2a_moe (:295), handle_eplb_and_dispatch (:297), then check_server_args
    # (server_args.py:511)
    "pd_prefill_fake": Refusal(
        "sglang/srt/arg_groups/pd_disaggregation_hook.py", 146, "handle_pd_disaggregation",
        'assert cfg.disaggregation_transfer_backend != "fake", (', "AssertionError",
        "Prefill server does not support 'fake' as the transfer backend"),
    "dp_with_attn_dp": Refusal(
        _PAR, 288, "handle_data_parallelism", "raise ValueError(", "ValueError",
        "--dp-size {dp} with --attn-dp-size {attn_dp}: data-parallel replicas combined with "
        "attention data parallelism are not supported."),
    "attn_dp_divides_tp": Refusal(_PAR, 326, "handle_data_parallelism",
                                  "assert cfg.tp_size % cfg.attn_dp_size == 0",
                                  "AssertionError", ""),
    "dp_lm_head_without_attn_dp": Refusal(
        _OVR, 1425, "_dp_lm_head_validation", "assert attn_dp_enabled_of(view), (",
        "AssertionError", "--enable-dp-lm-head requires attention DP (--attn-dp-size)."),
    "cutlass_moe_ep": Refusal(
        _MOE, 89, "handle_moe_kernel_config", "assert view.ep_size in [", "AssertionError",
        "The expert parallel size must be 1 or the same as the tensor parallel size"),
    "cutedsl_moe_ep": Refusal(
        _MOE, 102, "handle_moe_kernel_config", "assert view.ep_size in [", "AssertionError",
        "The expert parallel size must be 1 or the same as the tensor parallel size"),
    "cutlass_fp8_ep": Refusal(
        _MOE, 161, "handle_moe_kernel_config",
        "assert resolved_view(server_args).ep_size == 1, (", "AssertionError",
        "FP8/MXFP8 Cutlass MoE is only supported with ep_size == 1"),
    "megamoe_attn_dp": Refusal(
        _MOE, 325, "handle_a2a_moe",
        "assert attn_dp_enabled_of(cfg) and cfg.attn_dp_size == cfg.tp_size, (",
        "AssertionError",
        "FlashInfer MegaMOE is only supported with --attn-dp-size equal to --tp-size"),
    "pplx_attn_dp": Refusal(
        _MOE, 591, "handle_a2a_moe", "assert cfg.attn_dp_size >= 2, (", "AssertionError",
        "moe_a2a_backend='pplx' requires attention DP with at least 2 groups "
        "(--attn-dp-size >= 2)."),
    "eplb_without_ep": Refusal(_PAR, 791, "handle_eplb_and_dispatch",
                               "assert resolved_view(server_args).ep_size > 1",
                               "AssertionError", ""),
    "nnodes_divide_tp": Refusal(
        _VAL, 179, "check_server_args",
        "assert (cfg.tp_size * cfg.pp_size) % cfg.nnodes == 0, (", "AssertionError",
        "tp_size must be divisible by number of nodes"),
    "pp_spec_eagle_only": Refusal(
        _VAL, 132, "check_pipeline_parallel_compat", "assert (", "AssertionError",
        "Pipeline parallelism currently only supports EAGLE (non-multi-layer) speculative "
        "decoding"),
    "pp_spec_prefill_only": Refusal(
        _VAL, 161, "check_pipeline_parallel_compat",
        'assert cfg.disaggregation_mode == "prefill", (', "AssertionError",
        "PP + speculative decoding (MTP) is only supported on prefill nodes "
        "(disaggregation-mode=prefill)"),
    "multi_node_dp": Refusal(
        _VAL, 199, "check_server_args", "assert not (cfg.dp_size > 1 and cfg.nnodes != 1), (",
        "AssertionError", "multi-node data-parallel replicas are not supported; use attention "
        "DP (--attn-dp-size) across nodes"),
    "moe_dense_tp": Refusal(
        _VAL, 207, "check_server_args", "assert cfg.moe_dense_tp_size in (", "AssertionError",
        "moe_dense_tp_size only supports None, 1, or tp_size currently"),
    "schedule_conservativeness": Refusal(
        "sglang/srt/arg_groups/validation_hook.py", 314, "check_server_args",
        "assert cfg.schedule_conservativeness >= 0, (", "AssertionError",
        "schedule_conservativeness must be non-negative"),
    # resolve: check_two_batch_overlap, called at the end of check_server_args
    # (validation_hook.py:346), after the schedule_conservativeness assert
    "tbo_without_attn_dp": Refusal(
        _VAL, 768, "check_two_batch_overlap", "raise ValueError(", "ValueError",
        "When enabling two batch overlap without an EP a2a backend (moe_a2a_backend='none'), "
        "attention DP (--attn-dp-size) is required (DeepSeek-V4 non-EP DP TBO path)."),
    # init_distributed: rank tp_rank's device is base_gpu_id + tp_rank; CUDA has no such ordinal
    "multi_node_device_ordinal": Refusal(
        "sglang/srt/entrypoints/engine.py", 935, "_launch_scheduler_processes", "gpu_id = (",
        "RuntimeError", "CUDA error: invalid device ordinal"),
    # model_init: the model runner lays out the experts over the EP ranks before it builds the
    # model (model_runner.py:708 maybe_init_expert_location_metadata, before load_model at :715)
    "ep_divides_experts": Refusal("sglang/srt/eplb/expert_location.py", 256, "_init_common",
                                  "assert num_physical_experts % ep_size == 0",
                                  "AssertionError", ""),
    # model_init: the attention layer's tensor-parallel split (bare asserts), per architecture
    "tp_heads.LlamaForCausalLM": Refusal("sglang/srt/models/llama.py", 183, "__init__",
                                         "assert self.total_num_heads % tp_size == 0",
                                         "AssertionError", ""),
    "tp_kv_heads.LlamaForCausalLM": Refusal("sglang/srt/models/llama.py", 189, "__init__",
                                            "assert self.total_num_kv_heads % tp_size == 0",
                                            "AssertionError", ""),
    "tp_kv_replicas.LlamaForCausalLM": Refusal("sglang/srt/models/llama.py", 193, "__init__",
                                               "assert tp_size % self.total_num_kv_heads == 0",
                                               "AssertionError", ""),
    "tp_heads.Qwen3ForCausalLM": Refusal("sglang/srt/models/qwen3.py", 166, "__init__",
                                         "assert self.total_num_heads % attn_tp_size == 0",
                                         "AssertionError", ""),
    "tp_kv_heads.Qwen3ForCausalLM": Refusal(
        "sglang/srt/models/qwen3.py", 172, "__init__",
        "assert self.total_num_kv_heads % attn_tp_size == 0", "AssertionError", ""),
    "tp_kv_replicas.Qwen3ForCausalLM": Refusal(
        "sglang/srt/models/qwen3.py", 176, "__init__",
        "assert attn_tp_size % self.total_num_kv_heads == 0", "AssertionError", ""),
    "tp_heads.Qwen3MoeForCausalLM": Refusal(
        "sglang/srt/models/qwen3_moe.py", 506, "__init__",
        "assert self.total_num_heads % attn_tp_size == 0", "AssertionError", ""),
    "tp_kv_heads.Qwen3MoeForCausalLM": Refusal(
        "sglang/srt/models/qwen3_moe.py", 512, "__init__",
        "assert self.total_num_kv_heads % attn_tp_size == 0", "AssertionError", ""),
    "tp_kv_replicas.Qwen3MoeForCausalLM": Refusal(
        "sglang/srt/models/qwen3_moe.py", 516, "__init__",
        "assert attn_tp_size % self.total_num_kv_heads == 0", "AssertionError", ""),
    # issue 19's catalog architectures: the same three asserts in their own attention classes
    "tp_heads.MixtralAttention": Refusal(
        "sglang/srt/models/mixtral.py", 139, "__init__",
        "assert self.total_num_heads % tp_size == 0", "AssertionError", ""),
    "tp_kv_heads.MixtralAttention": Refusal(
        "sglang/srt/models/mixtral.py", 145, "__init__",
        "assert self.total_num_kv_heads % tp_size == 0", "AssertionError", ""),
    "tp_kv_replicas.MixtralAttention": Refusal(
        "sglang/srt/models/mixtral.py", 149, "__init__",
        "assert tp_size % self.total_num_kv_heads == 0", "AssertionError", ""),
    "tp_heads.MiniMaxM2Attention": Refusal(
        "sglang/srt/models/minimax_m2.py", 647, "__init__",
        "assert self.total_num_heads % attn_tp_size == 0", "AssertionError", ""),
    "tp_kv_heads.MiniMaxM2Attention": Refusal(
        "sglang/srt/models/minimax_m2.py", 654, "__init__",
        "assert self.total_num_kv_heads % attn_tp_size == 0", "AssertionError", ""),
    "tp_kv_replicas.MiniMaxM2Attention": Refusal(
        "sglang/srt/models/minimax_m2.py", 658, "__init__",
        "assert attn_tp_size % self.total_num_kv_heads == 0", "AssertionError", ""),
    "tp_heads.GptOssAttention": Refusal(
        "sglang/srt/models/gpt_oss.py", 394, "__init__",
        "assert self.total_num_heads % attn_tp_size == 0", "AssertionError", ""),
    "tp_kv_heads.GptOssAttention": Refusal(
        "sglang/srt/models/gpt_oss.py", 400, "__init__",
        "assert self.total_num_kv_heads % attn_tp_size == 0", "AssertionError", ""),
    "tp_kv_replicas.GptOssAttention": Refusal(
        "sglang/srt/models/gpt_oss.py", 404, "__init__",
        "assert attn_tp_size % self.total_num_kv_heads == 0", "AssertionError", ""),
    "tp_heads.NemotronHAttention": Refusal(
        "sglang/srt/models/nemotron_h.py", 696, "__init__",
        "assert self.total_num_heads % tp_size == 0", "AssertionError", ""),
    "tp_kv_heads.NemotronHAttention": Refusal(
        "sglang/srt/models/nemotron_h.py", 702, "__init__",
        "assert self.total_num_kv_heads % tp_size == 0", "AssertionError", ""),
    "tp_kv_replicas.NemotronHAttention": Refusal(
        "sglang/srt/models/nemotron_h.py", 706, "__init__",
        "assert tp_size % self.total_num_kv_heads == 0", "AssertionError", ""),
    "tp_heads.Qwen3_5AttentionDecoderLayer": Refusal(
        "sglang/srt/models/qwen3_5.py", 1293, "__init__",
        "assert self.total_num_heads % self.attn_tp_size == 0", "AssertionError", ""),
    "tp_kv_heads.Qwen3_5AttentionDecoderLayer": Refusal(
        "sglang/srt/models/qwen3_5.py", 1297, "__init__",
        "assert self.total_num_kv_heads % self.kv_tp_size == 0", "AssertionError", ""),
    "tp_kv_replicas.Qwen3_5AttentionDecoderLayer": Refusal(
        "sglang/srt/models/qwen3_5.py", 1299, "__init__",
        "assert self.kv_tp_size % self.total_num_kv_heads == 0", "AssertionError", ""),
    # DeepseekV2AttentionMLA serves DeepseekV3ForCausalLM and GlmMoeDsaForCausalLM (glm4_moe.py
    # subclasses DeepseekV2ForCausalLM); the MLA latent is replicated, only heads are split
    "tp_heads.DeepseekV2AttentionMLA": Refusal(
        "sglang/srt/models/deepseek_v2.py", 2057, "__init__",
        "assert num_heads % attn_tp_size == 0", "AssertionError", ""),
    # model_init: a multimodal model's vision encoder picks its attention as it is built
    "mm_fa3_blackwell": Refusal(
        "sglang/srt/layers/attention/vision.py", 1331, "_determine_attention_backend",
        """raise ValueError("The 'fa3' backend is not supported on Blackwell GPUs")""",
        "ValueError", "The 'fa3' backend is not supported on Blackwell GPUs"),
    # load_weights: the model's parameters are allocated on the GPU as it is constructed
    "oom_weights": Refusal(
        "sglang/srt/model_loader/loader.py", 1014, "load_model", "model = _initialize_model(",
        "torch.OutOfMemoryError", "CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a "
        "total capacity of {total_gib:.2f} GiB of which 1.02 GiB is free."),
    # kv_pool
    "kv_no_room": Refusal(
        "sglang/srt/model_executor/pool_configurator.py", 99, "__post_init__",
        "raise RuntimeError(msg)", "RuntimeError",
        "Not enough memory. Please try to increase --mem-fraction-static. Current value: "
        "mem_fraction_static={fraction}"),
    "kv_zero_requests": Refusal(
        "sglang/srt/managers/tp_worker.py", 420, "alloc_memory_pool",
        'assert self.model_runner.max_running_requests > 0, "max_running_request is zero"',
        "AssertionError", "max_running_request is zero"),
    "kv_pool_too_small": Refusal(
        "sglang/srt/managers/tp_worker.py", 425, "alloc_memory_pool",
        'assert max_req_len > 0, "Memory pool size is too small"', "AssertionError",
        "Memory pool size is too small"),
    # model_init: the attention backend is built with the model runner
    "backend_fa3_sm": Refusal(
        _REG, 243, "create_flashattention_v3_backend",
        "assert (major == 8 and not runner.use_mla_backend) or major == 9, (",
        "AssertionError", "FlashAttention v3 Backend requires SM>=80 and SM<=90. Please use "
        "`--attention-backend flashinfer`."),
    "backend_trtllm_mla_model": Refusal(
        _REG, 97, "create_trtllm_mla_backend",
        'raise ValueError("trtllm_mla backend can only be used with MLA models.")',
        "ValueError", "trtllm_mla backend can only be used with MLA models."),
    "backend_cutedsl_model": Refusal(
        _REG, 121, "create_cutedsl_mla_backend",
        'raise ValueError("cutedsl_mla backend can only be used with MLA models.")',
        "ValueError", "cutedsl_mla backend can only be used with MLA models."),
    "backend_trtllm_mha_sm": Refusal(
        "sglang/srt/layers/attention/trtllm_mha_backend.py", 258, "__init__",
        "self.is_xqa_impl = get_platform().is_sm90 or get_platform().is_sm120",
        "RuntimeError", "trtllm_mha is only supported on SM90, SM100 and SM120; this GPU is "
        "SM{sm}. Please use --attention-backend flashinfer.",
        stand_in="the backend dispatches XQA/fmha_v2 on SM90 and SM120 and trtllm-gen on SM100 "
        "(trtllm_mha_backend.py:1-10); on any other SM it takes the trtllm-gen path, whose "
        "FlashInfer kernels exist for SM100 only, and fails on its first launch"),
    "backend_trtllm_mha_model": Refusal(
        _REG, 280, "create_trtllm_mha_backend",
        'raise ValueError("trtllm_mha backend can only be used with non-MLA models.")',
        "ValueError", "trtllm_mha backend can only be used with non-MLA models."),
    # model_init: the MoE layers' runner is built with the model (trtllm-gen kernels: SM100)
    "moe_trtllm_gen_sm": Refusal(
        "sglang/srt/arg_groups/overrides.py", 1513, "_moe_runner_backend_quant_constraints",
        "if (", "RuntimeError",
        "--moe-runner-backend {runner}: trtllm-gen MoE kernels are SM100-only; this GPU is "
        "SM{sm}. Use --moe-runner-backend flashinfer_cutlass or leave it auto.",
        stand_in="0.5.23 has no refusing statement; this `if` steers NVFP4 MoE on SM110/SM120 "
        "to flashinfer_cutlass because \"trtllm-gen MoE kernels are SM100-only\" (its log line, "
        ":1519-1522); an explicit flashinfer_trtllm runner there fails in the kernel"),
    "no_draft_model": Refusal(
        _SPEC, 1138, "_handle_eagle_family",
        "if cfg.speculative_draft_model_path is None:", "ValueError",
        "{model} has no MTP/NextN draft layer and --speculative-draft-model-path is not set; "
        "the EAGLE draft worker has no draft model to load.",
        stand_in="only the architectures listed above this line get the target's own path as "
        "their draft (their checkpoints carry the MTP/NextN layer); for any other the draft "
        "path stays None, the draft worker falls back to the target's model_path "
        "(configs/model_config.py: model_path or cfg.model_path) and has no draft head to load"),
    # cuda_graph: decode CUDA-graph capture runs out of memory (runner_backend_utils'
    # CUDA_GRAPH_CAPTURE_FAILED_MSG follows on its own lines)
    "graph_capture_oom": Refusal(
        "sglang/srt/model_executor/runner/decode_cuda_graph_runner.py", 602, "__init__",
        "raise Exception(", "Exception",
        "Capture cuda graph failed: CUDA out of memory. Tried to allocate 2.00 GiB."),
    # host_pool: the HiCache host pool does not fit this rank's share of host memory
    "hicache_host_oom": Refusal(
        "sglang/srt/mem_cache/pool_host/base.py", 252, "_allocate_host_buffer",
        "raise ValueError(", "ValueError",
        "Not enough host memory available. Requesting {requested:.2f} GB but only have "
        "{free:.2f} GB free. Please reduce the size of the hierarchical cache."),
}

REFUSAL_SITES: dict[str, str] = {key: r.site for key, r in REFUSALS.items()}

# runner_backend_utils/__init__.py: CUDA_GRAPH_CAPTURE_FAILED_MSG (0.5.23), one line each.
CUDA_GRAPH_CAPTURE_FAILED_LINES = (
    "Possible solutions:",
    "1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)",
    "2. set --cuda-graph-max-bs-decode to a smaller value (e.g., 16)",
    "3. disable decode CUDA graph by --cuda-graph-backend-decode=disabled. (Not recommended. "
    "Huge performance loss)",
    "Open an issue on GitHub https://github.com/sgl-project/sglang/issues/new/choose ",
)
# The lines torch prints after a CUDA error raised from a device call.
CUDA_ERROR_HINT = ("CUDA kernel errors might be asynchronously reported at some other API "
                   "call, so the stacktrace below might be incorrect.",
                   "For debugging consider passing CUDA_LAUNCH_BLOCKING=1")
# mem_cache/pool_host/base.py:239-241: the warning (not a refusal) when the host pool is not
# larger than the device pool; %s/%d filled as logging would.
HICACHE_SMALL_HOST_WARNING = (
    "HiCache {label} host pool ({host} tokens) is smaller than the device pool ({device} tokens);"
    "L2 cache effectiveness is reduced.Consider increasing --hicache-ratio (or --hicache-size) "
    "for higher L2 cache hit rate.")
# Architecture -> the key suffix of its attention layer's tensor-parallel asserts.
TP_ATTENTION_CLASS = {
    "LlamaForCausalLM": "LlamaForCausalLM", "Qwen3ForCausalLM": "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM": "DeepseekV2AttentionMLA",
    "GlmMoeDsaForCausalLM": "DeepseekV2AttentionMLA",
    # Qwen3VLMoeForConditionalGeneration builds Qwen3MoeDecoderLayer (qwen3_vl_moe.py:34)
    "Qwen3VLMoeForConditionalGeneration": "Qwen3MoeForCausalLM",
    "DeepseekV32ForCausalLM": "DeepseekV2AttentionMLA",
    "MixtralForCausalLM": "MixtralAttention", "MiniMaxM2ForCausalLM": "MiniMaxM2Attention",
    "GptOssForCausalLM": "GptOssAttention", "NemotronHForCausalLM": "NemotronHAttention",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5AttentionDecoderLayer",
}


# Attention classes that split heads over the whole TP group (``tp_size =
# get_parallel().tp_size``: models/llama.py:181, mixtral.py:137); the others split them over the
# attention TP group (``get_parallel().attn_tp_size``, e.g. deepseek_v2.py:2051,
# nemotron_h.py:694), which attention DP narrows to ``tp_size / attn_dp_size``.
TP_FULL_WIDTH_CLASSES = frozenset({"LlamaForCausalLM", "MixtralAttention"})


def attention_split_width(architecture: str, tp_size: int, attn_tp_size: int) -> int:
    """The width the attention layer of ``architecture`` splits its heads over (see above)."""
    cls = TP_ATTENTION_CLASS.get(architecture, "")
    return tp_size if cls in TP_FULL_WIDTH_CLASSES else attn_tp_size


def tp_refusal(architecture: str, heads: int, kv_heads: int | None, tp_size: int) -> str | None:
    """The key of the attention layer's tensor-parallel assert ``tp_size`` trips, else None.

    SGLang 0.5.23's GQA attention layers (``models/llama.py:183-194``, ``qwen3.py:166-177``,
    ``qwen3_moe.py:506-517``): query heads must split evenly; KV heads must split evenly when
    there are at least ``tp_size`` of them, else ``tp_size`` must be a multiple of them (each
    KV head is replicated on ``tp_size // kv_heads`` ranks; every rank holds
    ``max(1, kv_heads // tp_size)``). MLA/DSA (``deepseek_v2.py:2057``) splits only the query
    heads (``kv_heads`` None): the latent is replicated. An architecture outside
    :data:`TP_ATTENTION_CLASS` (a user's config.json) is held to the same rule, cited at the
    layer of its attention kind (llama.py for GQA, deepseek_v2.py for MLA/DSA): 74 of the
    0.5.23 model files assert ``total_num_heads % tp_size == 0`` the same way.
    """
    cls = TP_ATTENTION_CLASS.get(architecture) or (
        "LlamaForCausalLM" if kv_heads is not None else "DeepseekV2AttentionMLA")
    if heads % tp_size:
        return f"tp_heads.{cls}"
    if kv_heads is None:
        return None
    if kv_heads >= tp_size:
        return f"tp_kv_heads.{cls}" if kv_heads % tp_size else None
    return f"tp_kv_replicas.{cls}" if tp_size % kv_heads else None
