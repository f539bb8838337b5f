"""``servetune check``: pre-flight of a raw SGLang launch command before GPU time is spent.

``servetune check --gpu B200 --gpus 8 -- sglang serve --model-path zai-org/GLM-5-FP8 --tp-size 8``
parses the command with the pinned version's flags and checks it (:mod:`domain.preflight`).
Exit codes: 0 for ``ok`` and ``warn``, 1 for ``refuse``, 2 for bad input (no command, an unknown
GPU or version, an unreadable trace or study file).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from domain.errors import ServetuneError
from domain.preflight import CheckReport, check_command
from domain.study import Study
from domain.traces import load_trace
from domain.workload import Trace
from servetune.cli_common import console, fail
from servetune.study_file import check_replay, load_study, resolve_trace

_STYLE = {"refuse": "bold red", "warn": "yellow", "info": "dim", "ok": "bold green"}


def _context(trace: Path | None, study: Path | None) -> tuple[Study | None, Trace | None]:
    """The study and the trace the prefix lint reads (``--trace`` wins over the study's)."""
    s = load_study(study) if study is not None else None
    if trace is not None:
        return s, load_trace(trace)
    if s is not None and study is not None:
        return s, check_replay(s, resolve_trace(s, study))
    return s, None


def print_report(report: CheckReport) -> None:
    """The human form: verdict, each finding with its fix, the memory and resolved settings."""
    console.print(f"[{_STYLE[report.verdict]}]{report.verdict}[/]", highlight=False)
    for f in report.findings:
        console.print(f"  [{_STYLE[f.severity]}]{f.severity:<6}[/] {escape(f.code)}: "
                      f"{escape(f.message)}", highlight=False, soft_wrap=True)
        console.print(f"         fix: {escape(f.fix)}", highlight=False, soft_wrap=True)
    m = report.memory
    if m is not None:
        least = "none fits" if m.min_mem_fraction_static is None else m.min_mem_fraction_static
        console.print(f"  memory per GPU: weights {m.weights_bytes_per_gpu / 1e9:.1f} GB, KV "
                      f"{m.kv_bytes_per_token:,.0f} B/token, pool {m.kv_pool_tokens:,} tokens, "
                      f"CUDA graphs {m.graph_capture_bytes / 1e9:.2f} GB; smallest "
                      f"--mem-fraction-static {least}", highlight=False, soft_wrap=True)
    if report.resolved:
        console.print("  resolved: " + ", ".join(f"{k}={v}" for k, v in report.resolved.items()),
                      highlight=False, soft_wrap=True)


def check(
    command: Annotated[list[str] | None, typer.Argument(
        help="the launch command after --: sglang serve ... or python -m "
             "sglang.launch_server ...")] = None,
    gpu: Annotated[str, typer.Option(help="GPU model of the node, e.g. B200, H200")] = "",
    gpus: Annotated[int | None, typer.Option(min=1, help="GPUs the server may use")] = None,
    version: Annotated[str | None, typer.Option(
        "--version", help="SGLang version whose flags the command is read with (default: the "
                          "pinned one)")] = None,
    trace: Annotated[Path | None, typer.Option(
        help="trace file for the shared-prefix lint")] = None,
    study: Annotated[Path | None, typer.Option(
        help="study file: its replay trace and load for the lints")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Pre-flight a raw launch command: flags, backends vs the GPU, memory fit, lints."""
    if not command:
        fail("check: give the launch command after --, e.g. servetune check --gpu B200 --gpus 8 "
             "-- sglang serve --model-path zai-org/GLM-5-FP8 --tp-size 8")
    if not gpu:
        fail("check: give --gpu (e.g. --gpu B200)")
    try:
        s, t = _context(trace, study)
        report = check_command(list(command or []), gpu, gpus, version=version, study=s, trace=t)
    except ServetuneError as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        print_report(report)
    raise typer.Exit(1 if report.verdict == "refuse" else 0)
