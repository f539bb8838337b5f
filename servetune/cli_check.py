"""``servetune check``: pre-flight of a raw SGLang launch command before GPU time is spent.

``servetune check --gpu B200 --gpus 8 -- sglang serve --model-path zai-org/GLM-5-FP8 --tp-size 8``
parses the command with the pinned version's flags and checks it (:mod:`domain.preflight`).
``--model-config FILE`` checks a model outside the catalog (its Hugging Face config.json or the
folder holding it) and ``--gpu FILE`` a GPU given by spec (YAML or JSON).
Exit codes: 0 for ``ok`` and ``warn``, 1 for ``refuse``, 2 for bad input (no command, an unknown
GPU or version, an unreadable or invalid model config, GPU spec, trace or study file).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from domain.errors import ConfigInvalid, ServetuneError
from domain.preflight import CheckReport, check_command
from domain.study import Study
from domain.traces import load_trace
from domain.workload import Trace
from servetune.cli_common import console, fail
from servetune.study_file import (
    check_replay,
    load_study,
    names_gpu_file,
    read_gpu_file,
    resolve_trace,
)

_STYLE = {"refuse": "bold red", "warn": "yellow", "info": "dim", "ok": "bold green"}


def _context(trace: Path | None, study: Path | None) -> tuple[Study | None, Trace | None]:
    """The study and the trace the prefix lint reads (``--trace`` wins over the study's)."""
    s = load_study(study) if study is not None else None
    if trace is not None:
        return s, load_trace(trace)
    if s is not None and study is not None:
        return s, check_replay(s, resolve_trace(s, study))
    return s, None


def _user_gpu(value: str) -> str:
    """``--gpu``'s GPU name: a catalog name as given, a spec file read and registered.

    Raises:
        ConfigInvalid: an unreadable file or an impossible spec (one line naming --gpu).
    """
    if not names_gpu_file(value):
        return value
    from domain.hardware import gpu_from_spec, register_gpu

    path = Path(value).expanduser()  # the spec's lines name the file: gpu (PATH): field ...
    return register_gpu(gpu_from_spec(read_gpu_file(path, "--gpu"), str(path))).name


def _user_model(path: Path) -> str:
    """The name of the model ``--model-config`` reads (registered for this check).

    Raises:
        ConfigInvalid: an unreadable config, a missing field, an unsupported family.
    """
    from domain.models import model_from_path, register_model

    try:
        return register_model(model_from_path(path)).name
    except ConfigInvalid as e:
        raise ConfigInvalid([f"--model-config: {v}" for v in e.violations]) from e


def _model_line(m: dict[str, Any]) -> str:
    """One line on the model checked: family, layers, parameters, KV per token, TP limit."""
    active = (f" ({m['active_params'] / 1e9:.1f}B active)"
              if m["active_params"] != m["total_params"] else "")
    return (f"  model: {m['name']} ({m['architecture'] or 'architecture unnamed'}), "
            f"{m['layers']} layers, {m['total_params'] / 1e9:.1f}B parameters{active}, KV "
            f"{m['kv_bytes_per_token_bf16'] / 1024:,.1f} KiB/token in bf16 (whole model, TP "
            f"1), TP at most {m['max_tp']}")


def print_report(report: CheckReport) -> None:
    """The human form: verdict, each finding with its fix, the model, memory and settings."""
    console.print(f"[{_STYLE[report.verdict]}]{report.verdict}[/]", highlight=False)
    for f in report.findings:
        console.print(f"  [{_STYLE[f.severity]}]{f.severity:<6}[/] {escape(f.code)}: "
                      f"{escape(f.message)}", highlight=False, soft_wrap=True)
        console.print(f"         fix: {escape(f.fix)}", highlight=False, soft_wrap=True)
    if report.model is not None:
        console.print(escape(_model_line(report.model)), highlight=False, soft_wrap=True)
    m = report.memory
    if m is not None:
        least = "none fits" if m.min_mem_fraction_static is None else m.min_mem_fraction_static
        console.print(f"  memory per GPU: weights {m.weights_bytes_per_gpu / 1e9:.1f} GB, KV "
                      f"{m.kv_bytes_per_token:,.0f} B/token, pool {m.kv_pool_tokens:,} tokens, "
                      f"CUDA graphs {m.graph_capture_bytes / 1e9:.2f} GB; smallest "
                      f"--mem-fraction-static {least}", highlight=False, soft_wrap=True)
        if m.layout is not None:  # a parallel layout: what each scheduler (rank) holds
            deepep = (f", DeepEP buffers {m.deepep_buffer_bytes_per_gpu / 1e9:.2f} GB per GPU"
                      if m.deepep_buffer_bytes_per_gpu else "")
            console.print(f"  per rank ({m.layout}, {m.schedulers} schedulers): pool "
                          f"{m.kv_tokens_per_rank:,} tokens, max_running_requests "
                          f"{m.max_running_requests_per_rank}, chunked_prefill_size "
                          f"{m.chunked_prefill_size_per_rank}{deepep}", highlight=False,
                          soft_wrap=True)
    if report.resolved:
        console.print("  resolved: " + ", ".join(f"{k}={v}" for k, v in report.resolved.items()),
                      highlight=False, soft_wrap=True)


def check(
    command: Annotated[list[str] | None, typer.Argument(
        help="the launch command after --: sglang serve ... or python -m "
             "sglang.launch_server ...")] = None,
    gpu: Annotated[str, typer.Option(
        help="GPU model of the node, e.g. B200, H200; or a GPU spec file (.yaml/.json)")] = "",
    gpus: Annotated[int | None, typer.Option(min=1, help="GPUs the server may use")] = None,
    version: Annotated[str | None, typer.Option(
        "--version", help="SGLang version whose flags the command is read with (default: the "
                          "pinned one)")] = None,
    trace: Annotated[Path | None, typer.Option(
        help="trace file for the shared-prefix lint")] = None,
    study: Annotated[Path | None, typer.Option(
        help="study file: its replay trace and load for the lints")] = None,
    model_config: Annotated[Path | None, typer.Option(
        "--model-config", help="the served model's Hugging Face config.json (or its folder, "
                               "with hf_quant_config.json): checked instead of the catalog "
                               "model --model-path names")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Pre-flight a raw launch command: flags, backends vs the GPU, memory fit, lints."""
    if not command:
        fail("check: give the launch command after --, e.g. servetune check --gpu B200 --gpus 8 "
             "-- sglang serve --model-path zai-org/GLM-5-FP8 --tp-size 8")
    if not gpu:
        fail("check: give --gpu (e.g. --gpu B200)")
    try:
        gpu_name = _user_gpu(gpu)
        model = _user_model(model_config) if model_config is not None else None
        s, t = _context(trace, study)
        if model is None and s is not None and "model" in s.sources:
            model = s.model  # the study's own config.json serves the command
        report = check_command(list(command or []), gpu_name, gpus, version=version, study=s,
                               trace=t, model=model)
    except ServetuneError as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        print_report(report)
    raise typer.Exit(1 if report.verdict == "refuse" else 0)
