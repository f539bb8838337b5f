"""SGLang 0.5.23's parallel-layout rules (issue 21): which refusal a layout trips, in order.

Split from :mod:`domain.engines.sglang.startup` (which raises them): each function returns the
key of a :data:`domain.engines.sglang.refusals.REFUSALS` row (its ``file:line``, exception and
message) or None. ``tests/unit/test_refusal_audit.py`` evaluates each site's guard from the
pinned tree against these verdicts.
"""

from __future__ import annotations

from domain.config import ServingConfig
from domain.engines.sglang.arch import resolved_backends
from domain.fit import resolved_ep_size
from domain.hardware import get_gpu
from domain.models import get_model


def layout_refusal(config: ServingConfig, nnodes: int | None = None
                   ) -> tuple[str, dict[str, object]] | None:
    """The first :data:`REFUSALS` key (and its message fields) the parallel layout trips.

    SGLang 0.5.23, in the engine's order (each row names its ``file:line``):
    ``handle_pd_disaggregation`` -- a prefill server with the ``fake`` transfer backend;
    ``handle_data_parallelism`` -- ``--dp-size`` with ``--attn-dp-size``, then ``attn_dp_size``
    must divide ``tp_size`` (a bare assert); ``_dp_lm_head_validation`` --
    ``--enable-dp-lm-head`` without attention DP (with one DP rank the flag is silently reset,
    ``overrides.py:1367-1370``, so only ``--dp-size`` > 1 reaches it); the MoE runner's EP
    asserts (:func:`moe_kernel_refusal`); ``handle_a2a_moe`` --
    FlashInfer MegaMOE needs ``attn_dp_size == tp_size``, pplx at least 2 attention-DP ranks
    (an a2a backend's ``ep_size = tp_size`` is a resolution, :func:`domain.fit.resolved_ep_size`,
    never a refusal); ``handle_eplb_and_dispatch`` -- ``--enable-eplb`` needs ``ep_size`` > 1;
    ``check_server_args`` -- ``(tp x pp) % nnodes``, PP with speculative decoding (EAGLE only,
    and only on a PD prefill server), ``--dp-size`` > 1 across nodes, ``moe_dense_tp_size`` in
    (None, 1, tp). Two-batch overlap is checked after ``schedule_conservativeness``
    (:func:`_resolve`).

    Args:
        config: the server.
        nnodes: ``--nnodes`` of the launch; None: the argv's (:meth:`ServingConfig.nnodes`
            over the GPU's node: one server spanning nodes gets ``--nnodes``).
    """
    nodes = nnodes if nnodes is not None else config.nnodes(get_gpu(config.gpu).gpus_per_node)
    t, dp = config.tp_size, config.attn_dp_size
    if config.disaggregation_mode == "prefill" and config.disaggregation_transfer_backend == "fake":
        return "pd_prefill_fake", {}
    if dp > 1 and config.dp_size > 1:
        return "dp_with_attn_dp", {"dp": config.dp_size, "attn_dp": dp}
    if dp > 1 and t % dp:
        return "attn_dp_divides_tp", {}
    if config.enable_dp_lm_head and dp == 1 and config.schedulers > 1:
        return "dp_lm_head_without_attn_dp", {}
    moe = moe_kernel_refusal(config)
    if moe is not None:
        return moe, {}
    if config.moe_a2a_backend == "flashinfer_megamoe" and not (dp > 1 and dp == t):
        return "megamoe_attn_dp", {}
    if config.moe_a2a_backend == "pplx" and dp < 2:
        return "pplx_attn_dp", {}
    if config.enable_eplb and resolved_ep_size(config) <= 1:
        return "eplb_without_ep", {}
    if (t * config.pp_size) % nodes:
        return "nnodes_divide_tp", {}
    spec = config.speculative_algorithm
    if config.pp_size > 1 and spec is not None:
        if spec == "EAGLE3":  # NEXTN is EAGLE by then (speculative_hook.py)
            return "pp_spec_eagle_only", {}
        if config.disaggregation_mode != "prefill":
            return "pp_spec_prefill_only", {}
    if config.dp_size > 1 and nodes != 1:
        return "multi_node_dp", {}
    if config.moe_dense_tp_size not in (None, 1, t):
        return "moe_dense_tp", {}
    return None


def moe_kernel_refusal(config: ServingConfig) -> str | None:
    """The MoE runner's EP asserts (``moe_hook.py:79-163``, ``handle_moe_kernel_config``).

    They read ``ep_size`` before an a2a backend resolves it (``handle_a2a_moe`` runs next,
    ``pipeline.py:294-295``): flashinfer_cutlass and flashinfer_cutedsl need ``ep_size`` 1 or
    ``tp_size`` (``:89``, ``:102``); cutlass on an fp8 checkpoint ``ep_size`` 1 (``:161``). The
    runner is the resolved one (:func:`domain.engines.sglang.arch.resolved_backends`: an
    explicit ``--moe-runner-backend`` or the GPU's default); dense models build none.
    """
    runner = resolved_backends(config).get("moe_runner_backend")
    ep, t = config.ep_size, config.tp_size
    quant = get_model(config.model).checkpoint(config.weights).quantization
    # each EP assert follows its runner's quantization assert (:81, :96), not modelled here:
    # the twin claims the EP one only where that one passes
    if runner == "flashinfer_cutlass" and ep not in (1, t) \
            and quant in ("modelopt_fp4", "modelopt_fp8", "modelopt_mixed", None):
        return "cutlass_moe_ep"
    if runner == "flashinfer_cutedsl" and ep not in (1, t) \
            and quant in ("modelopt_fp4", "modelopt_mixed", "nvfp4_online"):
        return "cutedsl_moe_ep"
    if runner == "cutlass" and quant in ("fp8", "mxfp8") and ep != 1:
        return "cutlass_fp8_ep"
    return None


def tbo_refusal(config: ServingConfig) -> str | None:
    """``tbo_without_attn_dp`` when two-batch overlap has neither an a2a backend nor attention DP.

    ``validation_hook.py:755-772`` (``check_two_batch_overlap``).
    """
    if config.enable_two_batch_overlap and config.moe_a2a_backend in (None, "none") \
            and config.attn_dp_size == 1:
        return "tbo_without_attn_dp"
    return None


def expert_refusal(config: ServingConfig) -> str | None:
    """``ep_divides_experts`` when ``ep_size`` does not divide the physical experts.

    ``eplb/expert_location.py:237-257``: ``experts + --ep-num-redundant-experts`` must split
    evenly over the (resolved) EP ranks; the model runner lays them out before it builds the
    model (``model_runner.py:705-715``). Dense models lay out no experts.
    """
    model = get_model(config.model)
    if not model.n_routed_experts:
        return None
    physical = model.n_routed_experts + config.ep_num_redundant_experts
    return "ep_divides_experts" if physical % resolved_ep_size(config) else None
