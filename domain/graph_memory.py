"""CUDA-graph capture memory of SGLang 0.5.23: captured batch sizes, activations, the pool.

Per GPU of one replica, bytes. :func:`domain.fit.fit` budgets :func:`graph_capture_bytes`
outside the static pool (with the prefill activations and the CUDA context), and
``servetune check`` reports it (``docs/diagnose-and-check.md``).
"""

from __future__ import annotations

from domain.models import ModelArch


def decode_capture_sizes(max_bs: int, speculative: bool) -> list[int]:
    """Decode batch sizes SGLang 0.5.23 captures a CUDA graph for, up to ``max_bs``.

    Source: ``arg_groups/cuda_graph_hook.py: generate_decode_cuda_graph_batch_sizes`` --
    without speculation 1, 2, 4, 8, 12, 16..256 step 8, 272..496 step 16, 512.. step 32; with
    speculation 1..8, 10..32 step 2, 40..64 step 4, 72..256 step 8, 272.. step 16; sizes above
    ``max_bs`` dropped and ``max_bs`` itself appended when missing.
    """
    if speculative:
        sizes = (list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4))
                 + list(range(72, 257, 8)) + list(range(272, max_bs + 1, 16)))
    else:
        sizes = ([1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16))
                 + list(range(512, max_bs + 1, 32)))
    sizes = [s for s in sizes if s <= max_bs]
    return sizes if max_bs in sizes else [*sizes, max_bs]


def decode_activation_bytes_per_token(model: ModelArch, tp_size: int) -> float:
    """Decode activation bytes of one token in the largest layer, on one GPU.

    Per layer, in bf16 (2 bytes): residual and normed hidden (2 x hidden), the attention tensors
    of the rank (GQA: q, k, v and output of ``heads/tp`` and ``max(1, kv_heads/tp)`` heads;
    MLA/DSA: q at ``qk_head_dim``, the latent-absorbed q and the attention output at
    ``kv_lora_rank + rope`` per head, the compressed KV, v at ``head_dim``; DSA adds the
    indexer's q and its ``index_topk`` int32 indices) and the o_proj output (hidden); dense
    layers the gate/up and down outputs of ``intermediate/tp``; MoE layers the fp32 router
    logits, per routed copy (``experts_per_tok``) the dispatched hidden, gate/up and down
    outputs of ``moe_intermediate/tp`` and the combined output, plus the shared experts. Shapes:
    DeepSeek-V3 report sec. 2, SGLang ``models/deepseek_v2.py``, ``layers/moe/fused_moe_triton``
    (its intermediate caches 1-3). The largest of the dense and MoE layers is returned: a
    layer's tensors are reused by the next.
    """
    h, t, e = model.hidden, tp_size, 2.0
    heads = max(1, model.heads // t)
    if model.attention == "gqa":
        attn = (2 * heads + 2 * max(1, model.kv_heads // t)) * model.head_dim
    else:
        latent = model.kv_lora_rank + model.qk_rope_head_dim
        attn = heads * model.qk_head_dim + 2 * heads * latent + latent + heads * model.head_dim
        if model.attention == "dsa":
            attn += model.index_n_heads * model.index_head_dim + model.index_topk * 2
    common = (3 * h + attn) * e
    dense = common + (3 * model.intermediate / t + h) * e
    moe = common + model.n_routed_experts * 4.0 + model.experts_per_tok * (
        2 * h + 3 * model.moe_intermediate / t) * e \
        + model.n_shared_experts * (3 * model.moe_intermediate / t) * e + h * e
    return max(dense if model.layers > model.moe_layers else 0.0,
               moe if model.moe_layers else 0.0)


# fa3 on MLA/DSA models: the first decode-graph capture takes about 5 GB on DeepSeek
# ("Deepseek use 5GB for cuda graph when using fa3", sgl-project/sglang issue #16143, decode
# graphs), a workspace of the backend that does not come from the model's activations.
FA3_MLA_CAPTURE_WORKSPACE_BYTES = 5e9


def graph_capture_bytes(model: ModelArch, tp_size: int, max_bs: int, attention_backend: str,
                        speculative: bool = False, sm_major: int = 9,
                        tokens_per_req: int = 1) -> float:
    """GPU memory the decode CUDA graphs of one GPU take, bytes.

    SGLang captures every decode graph into one shared memory pool, largest batch first "so
    cuda graphs share memory better" (``model_executor/runner/decode_cuda_graph_runner.py:
    _capture_one_stream``; captured sizes: :func:`decode_capture_sizes`), and every graph writes
    its logits into one persistent fp32 ``(max rows, vocab)`` buffer
    (``model_executor/graph_shared_output.py: get_logits_buffer``). So the graphs take:

    - the shared logits buffer: ``max_bs x tokens_per_req x vocab x 4`` bytes;
    - the largest graph's working set: ``max_bs x tokens_per_req x`` one layer's decode
      activations (:func:`decode_activation_bytes_per_token`; the pool reuses a layer's tensors
      for the next);
    - with the fa3 backend on MLA/DSA models, where fa3 runs (SM 8x/9x; elsewhere the engine
      refuses it before any capture), its capture workspace
      (:data:`FA3_MLA_CAPTURE_WORKSPACE_BYTES`, about 5 GB).

    Check point: DeepSeek-V3 FP8, TP8 on H200 (fa3), batch 256 -- about 6 GB for graphs alone
    (sgl-project/sglang PR #5634); this model gives 5.2 GB (within 30 %,
    tests/unit/test_preflight.py). With speculative decoding the target's decode graphs are
    verify graphs of ``tokens_per_req = num_draft_tokens`` rows per request:
    ``DecodeCudaGraphRunner`` sizes its token buffers and the shared logits buffer at
    ``max_bs x captured_req_width`` (``model_executor/runner/decode_cuda_graph_runner.py:
    359-361, 424-427, 466-476``; the width is ``decode_num_tokens_per_req``, the
    ``target_verify`` phase's ``num_draft_tokens``, ``model_executor/model_runner.py:876-895``,
    ``speculative/spec_registry.py: get_num_tokens_per_req_for_target_verify``). The draft
    layers' own graphs (one layer, ``eagle_draft_cuda_graph_runner.py``) are not counted.
    0 when ``max_bs`` is below 1.
    """
    if max_bs < 1:
        return 0.0
    bs = max(decode_capture_sizes(max_bs, speculative))
    workspace = FA3_MLA_CAPTURE_WORKSPACE_BYTES if (
        attention_backend == "fa3" and model.attention in ("mla", "dsa")
        and 8 <= sm_major <= 9) else 0.0
    rows = bs * max(1, tokens_per_req)
    return rows * model.vocab * 4.0 + rows * decode_activation_bytes_per_token(model, tp_size) \
        + workspace


# DeepEP all-to-all buffers (SGLang 0.5.23 ``layers/moe/token_dispatcher/deepep.py:203-305``
# ``DeepEPBuffer.get_deepep_buffer``; the sizes are DeepEP's, deepseek-ai/DeepEP
# ``csrc/config.hpp`` ``Config::get_nvl_buffer_size_hint`` / ``get_rdma_buffer_size_hint`` /
# ``get_low_latency_rdma_size_hint`` and ``deep_ep/buffer.py`` ``Buffer.num_sms = 20``,
# ``get_dispatch_config`` / ``get_combine_config``).
DEEPEP_NUM_SMS = 20  # deep_ep/buffer.py Buffer.num_sms (SGLang's DeepEPConfig default)
DEEPEP_NVL_PEERS = 8  # NUM_MAX_NVL_PEERS (csrc/kernels/configs.cuh)
DEEPEP_ALIGN = 128  # NUM_BUFFER_ALIGNMENT_BYTES (csrc/kernels/configs.cuh)
DEEPEP_MAX_TOPK = 128  # kNumMaxTopK in config.hpp
DEEPEP_MAX_SCALES = 128  # kNumMaxScales in config.hpp
DEEPEP_SOURCE_META_BYTES = 8  # internode::get_source_meta_bytes(): SourceMeta, two ints
# SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK default (environ.py:1439): low-latency tokens
DEEPEP_LL_TOKENS_PER_RANK = 128
# (num_max_nvl_chunked_recv_tokens, num_max_rdma_chunked_send, num_max_rdma_chunked_recv) of the
# dispatch and combine configs by EP ranks (deep_ep/buffer.py get_dispatch_config /
# get_combine_config); 2..8 ranks are intranode.
_DEEPEP_CONFIGS: dict[int, tuple[tuple[int, int, int], tuple[int, int, int]]] = {
    2: ((256, 6, 128), (256, 6, 128)), 4: ((256, 6, 128), (256, 6, 128)),
    8: ((256, 6, 128), (256, 6, 128)), 16: ((288, 20, 128), (288, 28, 128)),
    24: ((288, 32, 128), (288, 20, 128)), 32: ((288, 32, 128), (288, 20, 128)),
    64: ((288, 28, 128), (288, 20, 128)), 128: ((560, 32, 128), (560, 12, 128)),
    144: ((720, 12, 128), (720, 8, 128)), 160: ((720, 12, 128), (720, 8, 128)),
}


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def deepep_buffer_bytes(hidden: int, ep_ranks: int, num_experts: int, mode: str,
                        tokens_per_rank: int = DEEPEP_LL_TOKENS_PER_RANK) -> float:
    """Bytes of the DeepEP buffer one GPU allocates for ``--moe-a2a-backend deepep``.

    SGLang sizes one ``deep_ep.Buffer`` per rank (``token_dispatcher/deepep.py:221-304``):
    ``normal`` (and ``auto``) take the larger NVLink hint of the dispatch and combine configs
    at bf16 hidden states (``params_bytes = 2``, ``:403``) plus, across nodes (more than 8
    ranks), their RDMA hint; ``low_latency`` (and ``auto``) an RDMA buffer of
    ``get_low_latency_rdma_size_hint(tokens_per_rank, hidden, ranks, experts)``: two odd/even
    send, receive and signalling buffers, each receive ``experts x tokens x message``, a
    dispatch message ``16 + max(2 x hidden, hidden + hidden / 128 x 4)`` bytes and a combine
    one ``hidden / 128 x 4 + 2 x hidden`` (DeepEP ``csrc/config.hpp``). ``num_experts``:
    physical experts (routed + redundant). Example: DeepSeek-V3 (hidden 7168, 256 experts)
    over 8 ranks: normal 0.34 GB, low_latency 1.91 GB, auto 2.24 GB. 0 for ``ep_ranks`` < 2.

    Raises:
        ValueError: ``mode`` is not auto, normal or low_latency.
    """
    if mode not in ("auto", "normal", "low_latency"):
        raise ValueError(f"deepep mode {mode!r}: auto, normal or low_latency")
    if ep_ranks < 2:
        return 0.0
    nvl = rdma = 0
    if mode in ("auto", "normal"):
        known = [r for r in _DEEPEP_CONFIGS if r >= ep_ranks]
        configs = _DEEPEP_CONFIGS[known[0] if known else max(_DEEPEP_CONFIGS)]
        hidden_bytes = hidden * 2
        rdma_ranks = max(ep_ranks // DEEPEP_NVL_PEERS, 1)
        nvl_ranks = min(ep_ranks, DEEPEP_NVL_PEERS)
        channels = DEEPEP_NUM_SMS // 2
        per_token = (hidden_bytes + DEEPEP_SOURCE_META_BYTES + DEEPEP_MAX_TOPK * (8 + 4)
                     + DEEPEP_MAX_SCALES * 4)
        for nvl_recv, rdma_send, rdma_recv in configs:
            n = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4 \
                + channels * nvl_ranks * nvl_recv * per_token
            nvl = max(nvl, _align(n, 128))
            if ep_ranks > DEEPEP_NVL_PEERS:
                recv = _align(rdma_recv, rdma_send)
                r = channels * rdma_ranks * (DEEPEP_NVL_PEERS * 2 + 2) * 2 * 4 \
                    + channels * rdma_ranks * recv * (per_token + 16) * 2 + 1048576
                rdma = max(rdma, _align(r, 128))
    if mode in ("auto", "low_latency"):
        scales = hidden // 128
        dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)
        combine_msg = scales * 4 + hidden * 2
        send = max(tokens_per_rank * dispatch_msg, num_experts * tokens_per_rank * combine_msg)
        recv = num_experts * tokens_per_rank * max(dispatch_msg, combine_msg)
        local = num_experts // ep_ranks
        signal = _align(num_experts * 8 + local * 4, 128)
        total = 2 * (send + recv + signal)
        rdma = max(rdma, (total + DEEPEP_ALIGN) // DEEPEP_ALIGN * DEEPEP_ALIGN)
    return float(nvl + rdma)
