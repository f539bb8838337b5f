"""Pre-flight check of a serving launch before GPU time is spent: findings, verdict, memory.

``servetune check`` (``servetune/cli_check.py``) and the lessons MCP tool ``check_command`` run
:func:`check_command` on a raw launch command; the search and the report run :func:`lint_config`
on every candidate. Engine-specific reading (the argv, which backend flags a GPU refuses) is the
engine's (:meth:`domain.engines.Engine.parse_command`, :meth:`~domain.engines.Engine.
backend_refusals`); the memory arithmetic is :func:`domain.fit.fit`'s, so the twin and the check
agree. Units: bytes, tokens, requests.

Verdict: ``refuse`` if any finding refuses (the engine would not start, or the memory does not
fit), else ``warn`` if any warns, else ``ok``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from domain.config import ServingConfig
from domain.errors import ConfigInvalid, DoesNotFit
from domain.fit import (
    KV_BYTES,
    FitReport,
    default_decode_graph_bs,
    default_layout,
    fit,
    layout_label,
    resolve_attention_backend,
    resolved_ep_size,
    stage_memory,
)
from domain.fit import resolve_kv_dtype as _kv_dtype
from domain.graph_memory import graph_capture_bytes
from domain.hardware import get_gpu
from domain.models import get_model
from domain.speculative import SPEC_MAX_RUNNING_REQUESTS
from domain.study import Study
from domain.workload import Trace

Severity = Literal["info", "warn", "refuse"]
Verdict = Literal["ok", "warn", "refuse"]
# --max-running-requests at least this many times the decode CUDA-graph ceiling is "far above":
# the excess decode batches run eagerly (SGLang captures no graph above cuda_graph_max_bs_decode)
GRAPH_CEILING_FACTOR = 2.0
# share of prefix-sharing requests whose shared prefix is shorter than one KV page from which the
# prefix lint warns (below it, an info)
PREFIX_BELOW_PAGE_SHARE = 0.10
# the smallest step of the --mem-fraction-static search
FRACTION_STEP = 0.01


class Finding(BaseModel):
    """One result of the check: how bad, a stable code, what is wrong and what to do."""

    model_config = ConfigDict(frozen=True)

    severity: Severity
    code: str = Field(description="e.g. UNSUPPORTED_BACKEND, DOES_NOT_FIT, GRAPH_CEILING")
    message: str
    fix: str


class ParsedCommand(BaseModel):
    """A launch command as the engine's argparse reads it (:meth:`Engine.parse_command`).

    ``values``: argparse dest -> value of every flag given; ``fields``: the ServingConfig
    fields (all but ``gpu``) they set, empty when the model is not in the catalog or a flag is
    refused; ``findings``: what parsing found (refusals, deprecations, unmodelled flags).
    """

    program: list[str] = Field(default_factory=list)
    version: str
    values: dict[str, Any] = Field(default_factory=dict)
    fields: dict[str, Any] = Field(default_factory=dict)
    findings: list[Finding] = Field(default_factory=list)
    decode_cuda_graphs: bool = Field(True, description="False: the command disables them")


# MemoryReport fields present only for a parallel layout (left out of to_json when None)
LAYOUT_MEMORY_KEYS = ("layout", "schedulers", "kv_tokens_per_rank",
                      "max_running_requests_per_rank", "chunked_prefill_size_per_rank",
                      "deepep_buffer_bytes_per_gpu")


class MemoryReport(BaseModel):
    """Per GPU of one server: weights, KV per token, the pool, the smallest fraction, graphs.

    With a parallel layout (attention DP, EP, PP, an a2a backend, ``--dp-size``, a PD role)
    also, per scheduler (one attention-DP rank or ``--dp-size`` copy): its pool's tokens, its
    ``max_running_requests`` and prefill chunk, and per GPU the DeepEP buffers; the weights
    and KV bytes are then the largest PP stage's (:func:`domain.fit.stage_memory`).
    """

    weights_bytes_per_gpu: float
    kv_bytes_per_token: float
    kv_pool_tokens: int = Field(description="0 when the config does not fit; per scheduler")
    min_mem_fraction_static: float | None = Field(
        description="smallest --mem-fraction-static (to 0.01) that fits; None if none does")
    graph_capture_bytes: float
    layout: str | None = Field(None, description="e.g. 'TP8 (attention TP1 x DP8, EP8)'")
    schedulers: int | None = Field(None, description="schedulers of the server (dp x attn_dp)")
    kv_tokens_per_rank: int | None = None
    max_running_requests_per_rank: int | None = None
    chunked_prefill_size_per_rank: int | None = None
    deepep_buffer_bytes_per_gpu: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The fields, the layout ones only when set (a TP-only command keeps its keys)."""
        return {k: v for k, v in self.model_dump().items()
                if k not in LAYOUT_MEMORY_KEYS or v is not None}


class CheckReport(BaseModel):
    """The whole answer of a check (``to_json`` gives the documented ``--json`` keys)."""

    verdict: Verdict
    findings: list[Finding]
    model: dict[str, Any] | None = Field(None, description=(
        "the model checked: name plus ModelArch.summary() (architecture, layers, "
        "total_params, active_params, kv_bytes_per_token_bf16, max_tp); None when unknown"))
    memory: MemoryReport | None = None
    resolved: dict[str, Any] = Field(default_factory=dict)
    config: ServingConfig | None = None

    def to_json(self) -> dict[str, Any]:
        """``{verdict, findings[{severity, code, message, fix}], model, memory, resolved}``."""
        return {"verdict": self.verdict,
                "findings": [f.model_dump() for f in self.findings],
                "model": self.model,
                "memory": self.memory.to_json() if self.memory else None,
                "resolved": self.resolved}


def model_summary(name: str) -> dict[str, Any]:
    """Model ``name`` (catalog or registered) as ``check --json`` shows it under ``model``.

    ``{name, architecture, layers, total_params, active_params, kv_bytes_per_token_bf16,
    max_tp}``: :meth:`ModelArch.summary` with the name. Units: parameters (counts), bytes
    per token of the whole model (all layers, TP 1, bf16 KV).

    Raises:
        ConfigInvalid: an unknown model.
    """
    return {"name": name, **get_model(name).summary()}


def verdict_of(findings: list[Finding]) -> Verdict:
    """``refuse`` if any finding refuses, else ``warn`` if any warns, else ``ok``."""
    severities = {f.severity for f in findings}
    return "refuse" if "refuse" in severities else "warn" if "warn" in severities else "ok"


def _fits(config: ServingConfig) -> FitReport | None:
    try:
        return fit(config)
    except DoesNotFit:
        return None


def min_mem_fraction(config: ServingConfig) -> float | None:
    """The smallest ``--mem-fraction-static`` at which ``config`` fits, or None.

    Searched from 0.01 to 0.99 in steps of 0.01 with :func:`domain.fit.fit`; None when no
    fraction fits (e.g. weights larger than the GPU).
    """
    for i in range(1, 100):
        f = round(i * FRACTION_STEP, 2)
        if _fits(config.model_copy(update={"mem_fraction_static": f})) is not None:
            return f
    return None


def memory_report(config: ServingConfig, decode_graphs: bool = True
                  ) -> tuple[MemoryReport, FitReport | None, Finding | None]:
    """The memory numbers of ``config``, its fit (None if it does not fit) and that refusal.

    ``decode_graphs`` False (the command turns decode CUDA graphs off): no graph memory is
    reported; :func:`domain.fit.fit` still budgets it, so the fit is conservative then.
    """
    model, gpu = get_model(config.model), get_gpu(config.gpu)
    finding = None
    try:
        rep: FitReport | None = fit(config)
    except DoesNotFit as e:
        rep = None
        least = min_mem_fraction(config)
        fix = (f"--mem-fraction-static {least}" if least is not None and e.phase != "cuda_graph"
               else f"--mem-fraction-static {least} or a smaller --cuda-graph-max-bs-decode"
               if least is not None else "more GPUs per replica (--tp-size) or a smaller "
               "checkpoint")
        finding = Finding(severity="refuse", code="DOES_NOT_FIT",
                          message=str(e), fix=fix)
    backend = rep.attention_backend if rep else resolve_attention_backend(config, model, gpu)[0]
    per_tok = rep.kv_bytes_per_token if rep else model.kv_bytes_per_token(
        KV_BYTES[_kv_dtype(config, model, gpu)], config.attn_tp_size)
    graph_bs = rep.cuda_graph_max_bs_decode if rep else (
        config.cuda_graph_max_bs_decode
        or default_decode_graph_bs(gpu, config.tp_size, config.engine_version))
    if not decode_graphs:
        graph_bs = 0
    spec_on = config.speculative_algorithm is not None
    weights = rep.weight_bytes_per_gpu if rep else max(
        st.weight_bytes for st in stage_memory(config, model, spec_on))
    layout: dict[str, Any] = {}
    if not default_layout(config) or config.schedulers > 1 or config.disaggregation_mode != "null":
        layout = {"layout": layout_label(config), "schedulers": config.schedulers,
                  "kv_tokens_per_rank": rep.kv_tokens if rep else 0,
                  "max_running_requests_per_rank": rep.max_running_requests if rep else 0,
                  "chunked_prefill_size_per_rank": rep.chunked_prefill_size if rep else 0,
                  "deepep_buffer_bytes_per_gpu": rep.deepep_buffer_bytes_per_gpu if rep
                  else 0.0}
    mem = MemoryReport(
        weights_bytes_per_gpu=weights,
        kv_bytes_per_token=per_tok, kv_pool_tokens=rep.kv_tokens if rep else 0,
        min_mem_fraction_static=min_mem_fraction(config),
        graph_capture_bytes=graph_capture_bytes(model, config.attn_tp_size, graph_bs, backend,
                                                spec_on, gpu.sm_major), **layout)
    return mem, rep, finding


def _shared_prefixes(trace: Trace) -> list[int]:
    """Per request with prefix hashes: tokens of its longest prefix an earlier request shares."""
    seen: set[tuple[int, int]] = set()
    out = []
    for r in trace.requests:
        if not r.hash_ids or not r.block_size:
            continue
        chain, shared, matching = 0, 0, True
        for i, h in enumerate(r.hash_ids):
            chain = hash((chain, h))
            if matching and (i, chain) in seen:
                shared = i + 1
            else:
                matching = False
            seen.add((i, chain))
        out.append(min(shared * r.block_size, r.input_tokens))
    return out


def prefix_lint(trace: Trace, page_size: int) -> list[Finding]:
    """Shared prefixes shorter than one KV page: the radix cache reuses whole pages only."""
    shared = [s for s in _shared_prefixes(trace) if s > 0]
    if page_size <= 1 or not shared:
        return []
    below = sum(1 for s in shared if s < page_size)
    lost = sum(s % page_size for s in shared) / sum(shared)
    if not below:
        return []
    share = below / len(shared)
    return [Finding(
        severity="warn" if share >= PREFIX_BELOW_PAGE_SHARE else "info",
        code="PREFIX_BELOW_PAGE",
        message=f"{below} of {len(shared)} requests that share a prefix share fewer tokens than "
                f"one KV page (page_size {page_size}) and reuse nothing from the radix cache; "
                f"{lost:.0%} of all shared prefix tokens fall in partial pages",
        fix="a backend with a smaller page (or --page-size 1 where the backend allows it), or "
            "prompts whose shared prefix spans whole pages")]


def lint_config(config: ServingConfig, study: Study | None = None, *,
                trace: Trace | None = None, page_size: int | None = None) -> list[Finding]:
    """Lints of one config: settings that start but serve worse than they could.

    - ``GRAPH_CEILING``: an explicit ``--max-running-requests`` or ``--cuda-graph-max-bs-decode``
      leaves the resolved request cap at least :data:`GRAPH_CEILING_FACTOR` x the decode
      CUDA-graph ceiling: decode batches above the ceiling run eagerly, and a long queue keeps
      them there.
    - ``SPEC_DEFAULT_CAP``: speculative decoding without ``--max-running-requests`` runs at
      most 48 requests (:data:`domain.speculative.SPEC_MAX_RUNNING_REQUESTS`,
      ``speculative_hook.py``), whatever the load (the study's saturation concurrency is named
      when it is above that).
    - ``PREFIX_BELOW_PAGE`` (with ``trace``): requests whose shared prefix is shorter than the
      KV page the server runs (``page_size`` when given and not the config's own
      ``--page-size``; else the fit's page: a backend's forced page included, :func:`fit`).

    Returns [] when nothing trips, and for a config that does not fit (that is a refusal of
    :func:`check_config`, not a lint). No I/O.
    """
    rep = _fits(config)
    if rep is None:
        return []
    out: list[Finding] = []
    explicit = (config.max_running_requests is not None
                or config.cuda_graph_max_bs_decode is not None)
    ceiling = rep.cuda_graph_max_bs_decode
    if explicit and rep.max_running_requests >= GRAPH_CEILING_FACTOR * ceiling:
        out.append(Finding(
            severity="warn", code="GRAPH_CEILING",
            message=f"max_running_requests {rep.max_running_requests} is "
                    f"{rep.max_running_requests / ceiling:.0f}x the decode CUDA-graph ceiling "
                    f"{ceiling}: decode batches above {ceiling} run eagerly (slower per token) "
                    "and a backlog keeps them there",
            fix=f"--cuda-graph-max-bs-decode {min(rep.max_running_requests, 1024)} (more graph "
                f"memory) or --max-running-requests {ceiling}"))
    if config.speculative_algorithm is not None and config.max_running_requests is None:
        load = ""
        dp = config.attn_dp_size
        per_rank = (f", {SPEC_MAX_RUNNING_REQUESTS // dp} per attention-DP rank x {dp}"
                    if dp > 1 else "")
        if study is not None and study.saturation.concurrency > SPEC_MAX_RUNNING_REQUESTS:
            load = f"; the study runs {study.saturation.concurrency} clients"
        out.append(Finding(
            severity="warn", code="SPEC_DEFAULT_CAP",
            message=f"--speculative-algorithm {config.speculative_algorithm} without "
                    f"--max-running-requests caps the server at {SPEC_MAX_RUNNING_REQUESTS} "
                    f"running requests{per_rank} (speculative_hook.py){load}",
            fix="set --max-running-requests to the concurrency you serve (e.g. 256)"))
    if trace is not None:
        page = rep.page_size if page_size in (None, config.page_size) else page_size
        out += prefix_lint(trace, page)
    return out


def arch_lints(config: ServingConfig) -> list[Finding]:
    """The GPU-architecture lints of a search candidate, on its ledger row with its lints.

    ``servetune check`` says the same as ``UNSUPPORTED_BACKEND`` and ``UNMODELLED_FLAGS``.

    - ``ARCH_REFUSED`` (warn): a backend value the GPU's architecture rules refuse (the
      engine's :meth:`~domain.engines.Engine.backend_refusals`, e.g. fa3 on an SM 12 GPU, a
      trtllm-gen MoE runner off SM 10): the launch fails at startup, once, and the run
      learns it as a lesson.
    - ``NOT_MODELLED`` (info): flags passed through as given whose effect the estimate does
      not include (:data:`domain.config.PASSED_THROUGH`).
    """
    from domain.config import PASSED_THROUGH
    from domain.engines import engine_for

    out = [Finding(severity="warn", code="ARCH_REFUSED", message=f"on {config.gpu}: {msg}",
                   fix=f"another {flag} for this GPU, or leave it unset for the engine's choice")
           for flag, msg in engine_for(config).backend_refusals(config, {})]
    passed = {k: v for k, v in config.set_fields().items() if k in PASSED_THROUGH}
    if passed:
        out.append(Finding(severity="info", code="NOT_MODELLED",
                           message="not modelled (passed through as given): " + ", ".join(
                               f"{k}={v}" for k, v in passed.items()),
                           fix="measure them on real GPUs; the twin's numbers leave them out"))
    return out


def resolved(rep: FitReport | None, config: ServingConfig) -> dict[str, Any]:
    """The server settings the engine would resolve (empty when the config does not fit).

    With the kernels the GPU's SM picks (:meth:`domain.engines.Engine.resolved_backends`):
    ``dsa_prefill_backend``/``dsa_decode_backend``, ``moe_runner_backend``,
    ``fp4_gemm_runner_backend`` where they apply. With a parallel layout also the resolved
    ``ep_size``, ``attn_tp_size``, ``attn_dp_size``, ``schedulers`` (``deepep_mode`` with
    DeepEP; a PD decode server's ``disable_radix_cache`` and extra request slots).
    """
    if rep is None:
        return {}
    from domain.engines import engine_for

    kernels = engine_for(config).resolved_backends(config)  # attention, DSA, MoE, FP4 GEMM
    out = {**kernels, "attention_backend": rep.attention_backend,
           "max_running_requests": rep.max_running_requests,
           "chunked_prefill_size": rep.chunked_prefill_size,
           "cuda_graph_max_bs_decode": rep.cuda_graph_max_bs_decode,
           "page_size": rep.page_size, "kv_cache_dtype": rep.kv_dtype,
           "mem_fraction_static": rep.mem_fraction_static}
    if not default_layout(config) or config.schedulers > 1 or config.disaggregation_mode != "null":
        # per scheduler: the request cap and chunk above are one rank's
        out.update(ep_size=resolved_ep_size(config), attn_tp_size=config.attn_tp_size,
                   attn_dp_size=config.attn_dp_size, schedulers=config.schedulers)
        if config.moe_a2a_backend == "deepep":
            out["deepep_mode"] = config.deepep_mode or "auto"
        if config.disaggregation_mode == "decode":  # pd_disaggregation_hook.py:116-143
            out.update(disable_radix_cache=True,
                       disaggregation_decode_extra_slots=rep.decode_extra_slots)
    return out


def check_config(config: ServingConfig, values: dict[str, Any] | None = None, *,
                 gpus: int | None = None, study: Study | None = None,
                 trace: Trace | None = None, decode_graphs: bool = True,
                 nnodes: int | None = None) -> CheckReport:
    """Check one config: backend flags against the GPU, GPU count, memory, startup, lints.

    ``values`` are the parsed flags of the launch command (argparse dest -> value) when there is
    one: every attention-backend flag among them is checked, and ``page_size`` read.
    ``decode_graphs`` False: the command disables decode CUDA graphs (no graph memory, no
    graph-ceiling lint). ``nnodes``: the command's ``--nnodes`` (None: the config's own argv,
    which spans nodes when the server needs them). An a2a backend's ``ep_size = tp_size`` is
    an ``EP_RESOLVED`` info finding and ``resolved["ep_size"]``, not a refusal.
    """
    from domain.engines import engine_for

    eng = engine_for(config)
    values = values or {}
    findings = [Finding(severity="refuse", code="UNSUPPORTED_BACKEND", message=msg,
                        fix=f"another {flag}, or leave it unset for the engine's choice")
                for flag, msg in eng.backend_refusals(config, values)]
    if gpus is not None and config.gpus > gpus:
        shape = f"tp {config.tp_size}" + (f" x pp {config.pp_size}" if config.pp_size > 1
                                          else "")
        copies = config.dp_size * config.replicas
        findings.append(Finding(severity="refuse", code="NOT_ENOUGH_GPUS",
                                message=f"the command needs {config.gpus} GPUs "
                                        f"({shape} x dp {copies}); {gpus} given",
                                fix=f"--tp-size {gpus} or fewer, or more GPUs"))
    ep = resolved_ep_size(config)
    if ep != config.ep_size:
        findings.append(Finding(
            severity="info", code="EP_RESOLVED",
            message=f"--moe-a2a-backend {config.moe_a2a_backend} sets ep_size {config.ep_size} "
                    f"-> {ep} (= tp_size; arg_groups/overrides.py:1611-1620 _a2a_ep_size)",
            fix="none needed; the memory and speed estimates use ep_size "
                f"{ep}"))
    mem, rep, refusal = memory_report(config, decode_graphs)
    if refusal is not None:
        findings.append(refusal)
    start = eng.start(config, nnodes)
    said = {f.message for f in findings}
    if not start.ready and start.phase not in ("load_weights", "kv_pool", "cuda_graph") \
            and not any(start.log[-1].endswith(s) or s.endswith(start.log[-1]) for s in said):
        # the traceback's exception line (CUDA errors print hints after it)
        at = max((i for i, line in enumerate(start.log) if line.startswith("    ")),
                 default=len(start.log) - 2) + 1
        last = start.log[min(at, len(start.log) - 1)]
        if ": " not in last and start.log[at - 1].startswith("    "):
            last = f"{last}: {start.log[at - 1].strip()}"  # a bare assert: its source line
        fix = "see the engine's message"
        if start.phase == "init_distributed":
            from domain.hardware import get_gpu

            per_node = get_gpu(config.gpu).gpus_per_node
            fix = (f"launch it over {config.nnodes(per_node)} nodes of {per_node} GPUs: "
                   f"--nnodes {config.nnodes(per_node)} with each pod's --node-rank and "
                   "--dist-init-addr, or fewer GPUs per server")
        findings.append(Finding(severity="refuse", code=f"STARTUP_{start.phase.upper()}",
                                message=last, fix=fix))
    findings += [f for f in lint_config(config, study, trace=trace,
                                        page_size=values.get("page_size"))
                 if decode_graphs or f.code != "GRAPH_CEILING"]
    return CheckReport(verdict=verdict_of(findings), findings=findings,
                       model=model_summary(config.model), memory=mem,
                       resolved=resolved(rep, config), config=config)


def check_command(argv: list[str], gpu: str, gpus: int | None = None, *, engine: str = "sglang",
                  version: str | None = None, study: Study | None = None,
                  trace: Trace | None = None, model: str | None = None) -> CheckReport:
    """Pre-flight of a raw launch command (``sglang serve ...``) on ``gpus`` x ``gpu``.

    Args:
        argv: the launch command, program first.
        gpu: a catalog GPU, or one registered (:func:`domain.hardware.register_gpu`).
        gpus: GPUs the server may use (None: not checked).
        engine: the engine whose flags read ``argv``.
        version: its version (None: the newest shipped).
        study: the study whose load the lints read.
        trace: the trace of the shared-prefix lint.
        model: a registered model (``--model-config``) the command serves, instead of the
            catalog model its ``--model-path`` names; the report's ``model`` key then holds it
            even when the command is refused.

    Raises:
        ConfigInvalid: bad input (not a launch command, unknown GPU, model or engine version).
    """
    from domain.engines import engine as get_engine
    from domain.hardware import GPUS, get_gpu

    try:
        get_gpu(gpu)
    except ConfigInvalid:
        raise ConfigInvalid([f"gpu {gpu!r} is not in the GPU catalog: {', '.join(GPUS)}"]
                            ) from None
    summary = model_summary(model) if model is not None else None
    try:
        eng = get_engine(engine, version)
    except ValueError as e:
        raise ConfigInvalid([str(e)]) from e
    parsed = eng.parse_command(list(argv), model=model)
    if not parsed.fields or any(f.severity == "refuse" for f in parsed.findings):
        return CheckReport(verdict=verdict_of(parsed.findings) if parsed.findings else "refuse",
                           findings=parsed.findings, model=summary)
    try:
        config = ServingConfig(gpu=gpu, engine_version=eng.version, **parsed.fields)
    except ValidationError as e:
        bad = [Finding(severity="refuse", code="INVALID_VALUE",
                       message=f"{'.'.join(map(str, err['loc']))}: {err['msg']}",
                       fix="give a value SGLang accepts") for err in e.errors()]
        return CheckReport(verdict="refuse", findings=parsed.findings + bad, model=summary)
    report = check_config(config, parsed.values, gpus=gpus, study=study, trace=trace,
                          decode_graphs=parsed.decode_cuda_graphs,
                          nnodes=int(parsed.values.get("nnodes", 1)))
    findings = parsed.findings + report.findings
    return report.model_copy(update={"findings": findings, "verdict": verdict_of(findings)})
