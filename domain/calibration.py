"""Efficiency constants of the step-time model, per GPU and op class, with their fit source.

The roofline in :mod:`domain.costmodel` divides ideal times by efficiencies (shares of peak) and
adds fixed latencies. Their values live in ``domain/data/twin-calibration.json``: a ``default``
block (the hand-set starting values below, used for any GPU the fit did not cover) and per-GPU
blocks written by ``benchmarks/twin_fidelity.py --fit``, together with the fit's data source
(wheel, file inside it, row filter, row count), date, command and errors. Loading the file needs
nothing but the standard library, so the default twin has no external dependency.

Op classes:

- ``eta_mem``: HBM efficiency of weight streaming (linear layers, memory-bound side).
- ``eta_kv`` / ``eta_kv_mla``: HBM efficiency of the decode-attention KV read for MHA/GQA and for
  MLA/DSA latents (different kernels: FlashInfer/FA3 vs FlashMLA/FlashInfer-MLA).
- ``eta_compute`` / ``eta_compute_moe``: GEMM share of the dense tensor peak for dense linears
  and for MoE expert (grouped) GEMMs.
- ``eta_attn``: prefill attention (FlashAttention) share of the bf16 peak.
- ``eta_dsa_index``: DSA only: effective HBM efficiency of the decode-time lightning-indexer
  pass over the FULL context (scoring every cached index key and selecting the top-k); it is
  charged on the index-key bytes, so a low value stands for the scoring and top-k kernels.
- ``layer_latency_s``: fixed latency of one transformer layer in a forward, the chain of kernels
  (norms, projections, rope, attention, all-reduces) each with a few us of launch/tail latency
  even inside a CUDA graph (aiconfigurator's system files charge 3 us per memory-bound op;
  estimators reference sec. 6). ``moe_layer_latency_s`` is added per MoE layer (router, top-k,
  token permutation, grouped GEMMs, shared expert), ``mla_layer_latency_s`` per MLA/DSA layer
  (latent projections, absorbed BMMs) and ``dsa_layer_latency_s`` per DSA layer (indexer).
- ``step_overhead_s`` + ``request_overhead_s`` x batch: CPU time of one decode iteration of the
  scheduler (batch preparation, sampling result processing, output streaming: a Python loop over
  the running requests). SGLang's overlap scheduler (on by default since v0.4, "zero-overhead
  batch scheduler") runs it while the GPU executes the previous batch, so a decode step takes
  max(GPU time, CPU time). ``prefill_overhead_s`` is the fixed extra time of a prefill step.
- ``request_fixed_s``: the TTFT path outside the GPU steps, per request: HTTP receive
  (``entrypoints/http_server.py``, FastAPI/uvicorn), the hand-off of the tokenized request over
  ZMQ to the scheduler, which reads its socket once per iteration (``managers/scheduler.py:
  recv_requests``), and the way back of each token batch through the detokenizer process
  (``managers/detokenizer_manager.py: DetokenizerManager.event_loop``) and the tokenizer manager's
  streaming response (all SGLang 0.5.23, ``python/sglang/srt/``). The twin adds it to every
  token's time (a pipeline delay: TTFT and E2E grow by it, inter-token gaps do not). Prior 3 ms:
  two ZMQ hops and two asyncio/uvicorn hand-offs, each well under 1 ms on an idle host, plus the
  first detokenize; the fit moves it (``benchmarks/twin_fidelity.py --fit``).
- ``tokenizer_tokens_per_s``: tokenization throughput of the tokenizer manager, ONE process
  (``managers/tokenizer_manager.py``: ``TokenizerManager`` "is a process that tokenizes the
  text"; ``generate_request`` awaits ``_tokenize_one_request`` then ``_send_one_request``;
  ``--tokenizer-worker-num`` defaults to 1, sglang-knobs reference). Requests queue behind each
  other there: a request becomes schedulable ``input_tokens / tokenizer_tokens_per_s`` after the
  tokenizer is free. Prior 5e5 tokens/s: the HuggingFace ``tokenizers`` README ("less than 20
  seconds to tokenize a GB of text on a server's CPU", i.e. ~12 M tokens/s at ~4 bytes per
  token over all cores of a server) divided over ~24 cores for one single-threaded
  ``encode`` of one prompt; not fitted (the measured rows' prompts, <= 8k tokens, spend
  <= 16 ms there).
- ``moe_gemm_half_tokens``: tokens per touched expert at which an MoE grouped GEMM reaches
  half its compute efficiency (the M-tile padding of small expert GEMMs), fitted on the wheel's
  measured SGLang MoE kernel table by ``benchmarks/spec_kernels.py`` (not by the step fit).
- ``spec_index_query_share``: the share of the DSA lightning indexer's decode time (one query
  token per sequence) paid again for every extra query token of a speculative verify step: 1.0,
  SGLang runs each draft token as its own decode row (``nsa_backend.py``); 0.22 would be a
  kernel that reads the index keys once per sequence (``benchmarks/spec_kernels.py``).
- ``eager_layer_s``: the extra cost per layer of a decode (or verify) step whose batch is above
  ``cuda_graph_max_bs_decode``: SGLang replays a captured graph only up to the largest captured
  batch (``model_executor/runner/decode_cuda_graph_runner.py:845`` ``can_run_graph``; larger
  batches run the model eagerly), so every kernel of every layer is dispatched from Python one
  at a time and the GPU waits on the launches. Prior 170 us per layer, from the measured rows:
  a one-parameter least-squares fit of log TPOT on the 8 H200 Llama-3.1-8B rows above the graph
  max (352-512 clients, SGLang 0.5.6.post2) with the other committed H200 constants gives 170 us
  (RMS error 3.6 %; median predicted/measured TPOT 0.87 at 1 us, 0.98 at 150 us, 1.07 at 250 us):
  5.4 ms per step on 32 layers, the flat 6 ms the twin charged before. Physically ~20 kernels
  per layer (norms, projections, rope, attention, all-reduces, router and expert GEMMs) at
  ~8.5 us of eager PyTorch dispatch each (the launch itself is a few us -- aiconfigurator
  charges 3 us per memory-bound op, estimators reference sec. 6 -- plus the Python op dispatch
  around it). ``benchmarks/twin_fidelity.py --fit`` fits it with the rest where measured rows
  run above the graph max (H200 only; H100 starts from H200's fit, B200 keeps the prior).
- ``waiting_request_overhead_s``: CPU time per waiting request a scheduling pass matches
  against the radix tree. SGLang 0.5.23 computes the queue's priority on every pass that can
  admit (``managers/scheduler.py:4129`` ``calc_priority``): under LPM a ``match_kv_cache`` per
  waiting request while the queue holds at most 128 (FCFS above), under FCFS with the default
  radix cache a recency refresh of the first 128 waiting prefixes every 32nd pass
  (``managers/schedule_policy.py:213-314``) -- a Python walk of the tree per request; a pass is
  skipped while the running batch is full (``scheduler.py:4098-4126``: no free slot, or the
  last pass ran out of KV; cleared when a request leaves). Prior 10 us per request matched (a
  prompt's token list concatenated and walked page by page, at the ~20 us per running request
  of ``request_overhead_s``' prior); not fitted: the measured rows are closed loops whose
  clients do not queue beyond the slots.
- ``pd_transfer_eta`` / ``pd_transfer_latency_s``: prefill/decode disaggregation: the share of
  the NICs' bandwidth a prompt's KV transfer from the prefill to the decode server reaches, and
  the fixed seconds per request around it (bootstrap handshake, completion poll); priors and
  sources at the fields, the mechanics in :mod:`domain.twin.pd`.
- ``allreduce_latency_s``: the fixed latency of the plain ring all-reduce of a cost model built
  without a GPU (order of us). A model built for a GPU prices all-reduces with
  :mod:`domain.interconnect` instead (latencies fitted per topology on the wheel's tables).
- ``a2a_eta``, ``a2a_latency_s``, ``a2a_ll_latency_s``: expert-parallel dispatch + combine
  (DeepEP normal and low-latency kernels) per MoE layer, ``latency + wire bytes / (eta x
  link)`` (:func:`domain.layout_cost.a2a_seconds`); ``expert_imbalance`` /
  ``expert_imbalance_eplb``: the busiest EP rank's routed work over the mean, without and with
  EPLB; ``pp_stage_latency_s``: the fixed cost of one pipeline stage boundary per micro-batch.
  Priors fitted on the wheel's kernel tables by ``benchmarks/a2a_kernels.py`` (values and
  sources at the fields).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from functools import cache
from pathlib import Path
from typing import Any

CALIBRATION_PATH = Path(__file__).resolve().parent / "data" / "twin-calibration.json"


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Efficiencies (fractions of peak, 0-1] and fixed latencies (seconds) of one GPU type."""

    eta_mem: float = 0.75
    eta_kv: float = 0.75
    eta_kv_mla: float = 0.75
    eta_compute: float = 0.45
    eta_compute_moe: float = 0.45
    eta_attn: float = 0.5
    eta_dsa_index: float = 0.75
    layer_latency_s: float = 0.0
    moe_layer_latency_s: float = 0.0
    mla_layer_latency_s: float = 0.0
    dsa_layer_latency_s: float = 0.0
    step_overhead_s: float = 1.5e-3
    request_overhead_s: float = 0.0
    prefill_overhead_s: float = 2.5e-3
    allreduce_latency_s: float = 6e-6
    # The per-request fixed latency of SGLang's serving path outside the GPU steps, added to
    # TTFT (and to every token's time: it is a pipeline delay, so ITL/TPOT do not see it).
    request_fixed_s: float = 3.0e-3
    # Tokenization throughput of the ONE tokenizer-manager process (--tokenizer-worker-num 1).
    tokenizer_tokens_per_s: float = 5.0e5
    # tokens per touched expert at which an MoE grouped GEMM reaches half its compute efficiency
    # (eta_compute_moe x m / (m + h)); median of the five SGLang 0.5.14 moe_perf fits of
    # benchmarks/spec_kernels.py (B200 nvfp4/fp8 TP4/TP8: 100, 62, 75, 54; H200 fp8 TP8: 28)
    moe_gemm_half_tokens: float = 62.0
    # share of the DSA indexer's one-query-token decode time paid again per extra query token of
    # a verify or draft-extend step: 1.0 because SGLang expands each draft token into its own
    # decode row (layers/attention/nsa_backend.py init_forward_metadata, target_verify and
    # draft_extend branches: max_seqlen_q 1, page table repeat_interleave'd per draft token, the
    # paged MQA-logits schedule over the expanded seqlens), so every row scans its full context;
    # a batched kernel reading keys once would pay 0.22 (the wheel's ragged-kernel tables,
    # benchmarks/spec_kernels.py)
    spec_index_query_share: float = 1.0
    # per layer of a decode step above cuda_graph_max_bs_decode (eager launches; prior above)
    eager_layer_s: float = 1.7e-4
    # CPU per waiting request of a scheduling pass that scans the queue (prior above)
    waiting_request_overhead_s: float = 1.0e-5
    # Parallel layouts (issue 21; domain/layout_cost.py). Priors fitted on the aiconfigurator-core
    # 0.12.0 wheel's SGLang 0.5.12 DeepEP tables (one node, EP 8, 20 SMs) and its 0.5.10 wide-EP
    # MoE tables by `benchmarks/a2a_kernels.py --wheel W` (output in docs/benchmarks.md);
    # benchmarks/twin_fidelity.py refits them end to end on the measured EP rows.
    # Share of the NVLink (or NIC) bandwidth per GPU a DeepEP dispatch + combine reaches on its
    # wire bytes (domain/layout_cost.py:a2a_seconds): median of the H100/H200 fits, normal 0.561
    # / 0.568, low-latency 0.494 / 0.508 (median APE 6-9 %; B200: normal 0.281 at 20 SMs of a
    # 900 GB/s link, low-latency 0.595)
    a2a_eta: float = 0.53
    # fixed seconds of one dispatch + combine per MoE layer, normal kernels: H100/H200 fits 66 us
    # (B200 85 us)
    a2a_latency_s: float = 6.6e-5
    # the same, low-latency kernels (per-expert slots, CUDA-graph capturable): H200 21 us, H100
    # 23 us (B200 39 us)
    a2a_ll_latency_s: float = 2.1e-5
    # routed tokens (expert GEMM work) of the busiest EP rank over the mean without EPLB: the
    # wheel's H200 DeepEP MoE kernel (DeepSeek-V3 shape, EP 8, >= 1,024 tokens, compute-bound
    # context table) under power_law_1.01 routing (aiconfigurator's default skew for DeepSeek:
    # wheel sdk/config.py:37 workload_distribution "power_law", sdk/models/deepseek.py:170
    # alpha 1.01) over uniform: 1.66 (the
    # generation table's 1.10 is the same skew on memory-bound kernels, which the model's
    # read cap reproduces)
    expert_imbalance: float = 1.66
    # the same with EPLB / redundant experts: the table's mildest skew, power_law_0.6, 1.36 (an
    # upper bound: a static rebalancing leaves the step-to-step spread)
    expert_imbalance_eplb: float = 1.36
    # per stage boundary per micro-batch of pipeline parallelism: an NCCL send/recv of the
    # proxy tensors plus the request objects' send (scheduler_pp_mixin.py:104-214); prior the
    # two-GPU NCCL small-message latencies of domain/data/allreduce-fit.json (LL / Simple:
    # 6.5 / 18.8 us on H200, 6.4 / 16.8 us on RTX PRO 6000) plus the pyobj send, ~ 30 us
    pp_stage_latency_s: float = 3.0e-5
    # PD disaggregation (domain/twin/pd.py): the share of the NIC bandwidth a KV transfer
    # between a prefill and a decode server reaches. Prior 0.475: the Mooncake Transfer Engine
    # README (kvcache-ai/Mooncake) reports 190 GB/s on 8 x 400 Gbps RoCE (400 GB/s: 8 GPUs x the
    # catalog's 50e9 B/s NIC) for 40 GB transfers; the wheel's disaggregated rows fit it
    pd_transfer_eta: float = 0.475
    # PD: fixed seconds per request outside the bytes on the wire: the decode server's
    # preallocation metadata sent to the prefill's bootstrap (ZMQ), the transfer's completion
    # notification and one poll of each scheduler loop. Prior 1 ms (an assumption: two ZMQ
    # messages of well under 1 ms each on an idle host, as request_fixed_s' hops; polls run
    # once per iteration, a few ms apart under load); the wheel's disaggregated rows fit it
    pd_transfer_latency_s: float = 1.0e-3

    def updated(self, values: dict[str, float]) -> Efficiency:
        """A copy with ``values`` replacing fields of the same name.

        Raises:
            ValueError: on an unknown name or an efficiency outside (0, 1.5] / negative latency.
        """
        known = {f.name for f in fields(self)}
        bad = sorted(set(values) - known)
        if bad:
            raise ValueError(f"unknown efficiency constant(s) {', '.join(bad)}; "
                             f"known: {', '.join(sorted(known))}")
        for k, v in values.items():
            if (k.startswith("eta_") or k.endswith("_eta")) and not 0 < v <= 1.5:
                raise ValueError(f"{k} = {v} is not a share of peak in (0, 1.5]")
            if k.endswith("_s") and v < 0:
                raise ValueError(f"{k} = {v} s is negative")
            if k == "tokenizer_tokens_per_s" and v <= 0:
                raise ValueError(f"{k} = {v} tokens/s is not a positive throughput")
            if k.endswith("_share") and not 0 <= v <= 1:
                raise ValueError(f"{k} = {v} is not a share in [0, 1]")
            if k.endswith("_tokens") and v < 0:
                raise ValueError(f"{k} = {v} tokens is negative")
            if k.startswith("expert_imbalance") and not 1 <= v <= 64:
                raise ValueError(f"{k} = {v} is not a max/mean load ratio in [1, 64]")
        return replace(self, **{k: float(v) for k, v in values.items()})

    def as_dict(self) -> dict[str, float]:
        """Field name -> value."""
        return asdict(self)


# The hand-set starting values (servetune's estimators reference, section 6): eta_m 0.75 and
# eta_c 0.75 were fitted to aiconfigurator step outputs for dense models; MoE GEMMs and MLA
# kernels run lower (AIC puts DeepSeek-V3 steps at ~30-35 % of SOL), hence 0.45 / 0.5.
UNCALIBRATED = Efficiency()


@cache
def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def calibration_file(path: Path = CALIBRATION_PATH) -> dict[str, Any]:
    """The parsed calibration JSON (empty dict when the file is absent)."""
    return _load(path)


def efficiency(gpu: str, path: Path = CALIBRATION_PATH) -> Efficiency:
    """Constants for ``gpu``: the file's ``default`` block overlaid by its ``gpus[gpu]`` block.

    Falls back to :data:`UNCALIBRATED` where the file or a block is absent.

    Raises:
        ValueError: if the file holds an unknown constant or an out-of-range value.
    """
    data = _load(path)
    eff = UNCALIBRATED.updated(data.get("default", {}))
    return eff.updated(data.get("gpus", {}).get(gpu, {}) if _shipped(gpu) else {})


def is_calibrated(gpu: str, path: Path = CALIBRATION_PATH) -> bool:
    """Whether ``benchmarks/twin_fidelity.py --fit`` wrote constants for ``gpu`` (its own block).

    A GPU without a block runs with the ``default`` constants (:func:`efficiency`), and so does
    a user's spec registered under a calibrated GPU's name (the fit holds for the shipped GPU).
    """
    return gpu in _load(path).get("gpus", {}) and _shipped(gpu)


def _shipped(gpu: str) -> bool:
    """Whether ``gpu`` runs the shipped catalog entry of that name (not a user's spec of it)."""
    from domain.hardware import is_shipped_spec  # hardware's catalog loads only when asked

    return is_shipped_spec(gpu)


@dataclass(frozen=True, slots=True)
class ErrorBand:
    """What the fidelity benchmark measured against the wheel's measured rows (percent).

    ``fitted_*``: median absolute percentage error of the twin with the fitted constants on the
    calibrated GPUs (TPOT and output throughput over ``rows`` rows); ``default_*``: the same rows
    with the default constants -- what an uncalibrated GPU runs with.
    """

    rows: int
    fitted_tpot_pct: float
    fitted_throughput_pct: float
    default_tpot_pct: float
    default_throughput_pct: float
    gpus: tuple[str, ...]

    def line(self) -> str:
        """One report phrase, e.g. ``twin error on calibrated GPUs (B200, H100, H200): ...``."""
        return (f"twin error on calibrated GPUs ({', '.join(self.gpus)}): TPOT median "
                f"{self.fitted_tpot_pct:.0f} %, throughput median "
                f"{self.fitted_throughput_pct:.0f} % over {self.rows} measured rows; with the "
                f"default constants on those GPUs: TPOT {self.default_tpot_pct:.0f} %, "
                f"throughput {self.default_throughput_pct:.0f} %")


def error_band(path: Path = CALIBRATION_PATH) -> ErrorBand | None:
    """The twin's error band from the calibration file's ``fit.errors_pct`` (None without one).

    Reads ``fitted`` and ``uncalibrated`` (default constants) median APEs of TPOT
    (``tpot_median_ape``) and throughput (``thr_median_ape``) written by
    ``benchmarks/twin_fidelity.py``.
    """
    data = _load(path)
    errors = data.get("fit", {}).get("errors_pct", {})
    fitted, default = errors.get("fitted"), errors.get("uncalibrated")
    if not fitted or not default:
        return None
    return ErrorBand(rows=int(fitted["n"]), fitted_tpot_pct=float(fitted["tpot_median_ape"]),
                     fitted_throughput_pct=float(fitted["thr_median_ape"]),
                     default_tpot_pct=float(default["tpot_median_ape"]),
                     default_throughput_pct=float(default["thr_median_ape"]),
                     gpus=tuple(sorted(data.get("gpus", {}))))


def calibration_line(gpu: str, path: Path = CALIBRATION_PATH) -> str:
    """``calibrated (...)`` or ``uncalibrated (twin error on calibrated GPUs: ...)`` for ``gpu``."""
    if is_calibrated(gpu, path):
        date = _load(path).get("fit", {}).get("date", "")
        return ("calibrated (twin constants fitted by benchmarks/twin_fidelity.py"
                + (f", {date}" if date else "") + ")")
    band = error_band(path)
    return ("uncalibrated (default twin constants" + (f"; {band.line()}" if band else "")
            + ")")
