"""What ``servetune run`` prints: the study, the brains, the spend, the summary and the report.

User text (names, paths, messages) is escaped: a '[' in it is text, never Rich markup.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from domain.errors import ServetuneError
from servetune.cli_common import console, open_store
from servetune.settings import Settings


def print_study(study: Any, trace_path: Path, window: Any, cluster: Any,
                settings: Settings) -> Any:
    """Print what the run replays and where research reads; the SGLang source tree (or None)."""
    r = study.replay
    # user text (names, paths, messages) is escaped: a '[' in it is text, never Rich markup
    console.print(f"study [bold]{escape(study.name)}[/]: {escape(study.model)} on "
                  f"{study.gpu_count}x{escape(study.gpu)}, SGLang {escape(study.engine_version)}; "
                  f"replay {escape(trace_path.name)} "
                  f"[{r.start_s:g}, {r.start_s + r.duration_s:g}) s at {r.time_scale:g}x = "
                  f"{len(window)} requests", highlight=False)
    from domain.engines import engine
    from domain.models import get_model

    note = engine(study.engine, study.engine_version).rules_note()
    if note:
        console.print(f"[yellow]warning:[/] {escape(note)}", highlight=False)
    ctx_len = get_model(study.model).context_len
    too_long = sum(q.input_tokens + q.output_tokens > ctx_len for q in window.requests)
    if too_long:
        console.print(f"[yellow]warning:[/] {too_long} of {len(window)} replay requests exceed "
                      f"the {ctx_len:,}-token context of {study.model}; the engine refuses "
                      "them, so no config can serve every request", highlight=False)
    span = window.requests[-1].arrival_s * r.time_scale
    if span < 0.9 * r.duration_s:
        console.print(f"[yellow]warning:[/] the trace holds only {span:,.0f} s of arrivals in "
                      f"the {r.duration_s:,.0f} s window (it ends early)", highlight=False)
    realtime_notice(study, cluster, settings.repeats)
    routing_notice(cluster)
    from mcp_servers.source.server import open_tree

    try:
        tree = open_tree(settings.sglang_source, study.engine_version, settings.source_cache)
    except ServetuneError as e:
        console.print(f"[yellow]warning:[/] SGLang source not usable ({escape(str(e))}); "
                      "research reads lessons only", highlight=False)
        tree = None
    console.print(f"research: SGLang {study.engine_version} source at {tree.root}"
                  if tree is not None else
                  f"research: no SGLang source tree (`servetune source fetch --version "
                  f"{study.engine_version}` lets the source researcher cite it)",
                  highlight=False, markup=False)
    return tree


def print_brains(claude: Any, settings: Settings, run_dir: Path) -> Any:
    """Print who decides; the Claude setup metered into the run's llm_calls.jsonl (or None)."""
    if claude is None:
        console.print("brains: deterministic" + (
            "" if settings.brains == "deterministic"
            else " (set ANTHROPIC_API_KEY for Claude agents)"), highlight=False)
        return None
    why = ("ANTHROPIC_API_KEY is set; --brains deterministic makes no API call"
           if settings.brains == "auto" else "--brains claude")
    console.print(f"brains: Claude ({claude.model}) for the planner, deployer, analyst and "
                  f"researchers: this run calls the paid Messages API ({why})",
                  highlight=False)
    from domain.usage import LLM_CALLS, llm_calls_meter

    return dataclasses.replace(claude, meter=llm_calls_meter(run_dir / LLM_CALLS))


def realtime_notice(study: Any, cluster: Any, repeats: int) -> None:
    """On the local backend with twin servers (no GPU), say that the study runs in real time."""
    from mcp_servers.cluster.local import TWIN_SERVE_COMMAND, TWIN_SERVE_STARTUP_S

    if getattr(cluster, "kind", "") != "local" or cluster.command != TWIN_SERVE_COMMAND:
        return
    minutes = study.realtime_s(TWIN_SERVE_STARTUP_S, repeats) / 60
    console.print(f"[yellow]note:[/] local backend without a GPU: trial servers are twin servers "
                  f"running in real time; expected about {minutes:,.0f} min at most for this "
                  f"study's budget ({study.budget.max_trials} launches, {study.finalists} "
                  "replays, the frontier sweep); the twin backend (--backend twin) simulates the "
                  "same study in virtual time, in seconds", highlight=False, soft_wrap=True)


def routing_notice(cluster: Any) -> None:
    """On the local backend, say who routes a trial's replicas: sglang-router or the bench."""
    if getattr(cluster, "kind", "") != "local":
        return
    if getattr(cluster, "router", "none") == "sglang":
        from mcp_servers.cluster.router import ROUTER_PACKAGE, ROUTER_VERSION

        console.print(f"routing: {ROUTER_PACKAGE} {ROUTER_VERSION} (the config's router_policy) "
                      "in front of every trial of 2+ replicas (kube_service, the Kubernetes "
                      "Service baseline, is the bench's own per-request spreading); its log is "
                      "router.log beside the replicas' logs", highlight=False, soft_wrap=True)
    else:
        console.print("routing: no router on the local backend: the bench spreads a trial's "
                      "requests over its replicas round-robin (--router puts the pinned "
                      "sglang-router in front)", highlight=False, soft_wrap=True)


def fronted_by(config: Any) -> str:
    """What the winner line says fronts the replicas: the router with its flags, or the Service.

    ``kube_service`` runs no router (the Kubernetes Service spreads connections); a
    ``cache_aware`` router carries its threshold flags
    (:meth:`domain.config.ServingConfig.router_args`) so the line is the command that was measured.

    Args:
        config: the winner's :class:`~domain.config.ServingConfig`.
    """
    args = config.router_args([])
    if args is None:
        return "behind a Kubernetes Service (no router)"
    flags = " ".join(args[args.index("--policy") + 2:])
    return f"behind the {config.router_policy} router" + (f" ({flags})" if flags else "")


def print_spend(run_dir: Path, settings: Settings, out: Any) -> None:
    """One line: the run's Messages API calls, tokens and estimated USD so far (if any)."""
    from domain.usage import spend_line

    line = spend_line(run_dir, settings.prices())
    if line is not None:
        out.print(line, highlight=False)


def api_error(e: Exception) -> str:
    """One line about a Messages API error, never echoing a key."""
    import anthropic

    from agents.claude import redact

    if isinstance(e, anthropic.AuthenticationError):
        return "authentication failed (401): check ANTHROPIC_API_KEY"
    if isinstance(e, anthropic.PermissionDeniedError):
        return "permission denied (403) for this key or model"
    if isinstance(e, anthropic.NotFoundError):
        return "not found (404): check the model id (resume with a valid --model)"
    if isinstance(e, anthropic.APIStatusError):
        body = e.body.get("error") if isinstance(e.body, dict) else None
        said = body.get("message") if isinstance(body, dict) else None
        hint = {400: "the request was refused", 413: "the request was too large",
                429: "rate limited after the SDK's retries: resume later",
                529: "the API is overloaded: resume later"}.get(
            e.status_code, "the API failed after the SDK's retries: resume later"
            if e.status_code >= 500 else "the request was refused")
        return redact(f"HTTP {e.status_code}, {hint}: {said or e.message}")[:300]
    if isinstance(e, anthropic.APIConnectionError):
        return ("cannot reach the API (connection failed or timed out after the SDK's "
                "retries); check the network and ANTHROPIC_BASE_URL if you set it")
    return redact(f"{type(e).__name__}: {e}")[:300]


def finish(study: Any, rid: str, run_dir: Path, stop_reason: str, trace_path: Path,
           n_requests: int, record: Any, settings: Settings,
           lessons_dir: Path | None) -> None:
    """Render the report of a finished run (a :class:`graph.session.RunRecord`) and sum it up."""
    from servetune.report import render_report
    from servetune.report.format import summary_rows

    trials, elapsed = record.trials, record.elapsed_s
    store = open_store(settings, lessons_dir)
    try:
        lessons = [lesson for i in record.lesson_ids if (lesson := store.get(i)) is not None]
    finally:
        store.close()
    report = render_report(run_dir, study, trials, lessons, run_id=rid,
                           stop_reason=stop_reason or "finished", elapsed_s=elapsed,
                           replay_requests=n_requests, trace_file=trace_path.name,
                           brains=record.brains, extra_usage=record.extra_usage,
                           prices=settings.prices())
    table = Table(title=escape(f"{study.name} — {rid}"))
    for col in ("#", "status", "changed", "tok/s/GPU", "reason"):
        table.add_column(col, overflow="ellipsis", no_wrap=col != "reason")
    shown = [t for t in trials if t.phase != "frontier"]
    for row in summary_rows(shown):
        obj = row.get("objective")
        table.add_row(str(row["seq"]), escape(row["status"]), escape(row["changed"] or "baseline"),
                      f"{obj:,.0f}" if obj is not None else "", escape(str(row["reason"])[:70]))
    console.print(table)
    sweep = sum(t.phase == "frontier" and t.status == "sweep" for t in trials)
    if sweep:
        console.print(f"frontier: {sweep} sweep points (see the report)")
    winner = next((t for t in trials if t.status == "winner"), None)
    if winner is not None:
        console.print(f"winner: {winner.config.replicas} x "
                      f"[bold]{escape(winner.config.launch_command())}[/] "
                      f"{escape(fronted_by(winner.config))}", highlight=False, soft_wrap=True)
    else:
        console.print(f"no finalist met the SLO (TTFT p99 <= {study.slo.ttft_p99_ms:,.0f} ms)")
    console.print(f"stopped: {stop_reason or 'finished'}", highlight=False, markup=False)
    print_spend(run_dir, settings, console)
    console.print(f"report: {report}", markup=False)
    console.print(f"elapsed: {elapsed:.1f} s")
