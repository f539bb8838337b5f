"""The ``servetune`` command line (Typer): run a study, query lessons, serve MCP over stdio.

Bad input (a missing or malformed study or trace, an unknown knob, an impossible value, a run id
reused for another study) prints one line and exits with code 2, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import logging
import math
import re
import secrets
import signal
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from domain.errors import ServetuneError
from servetune.interrupt import Interrupt, until_signal
from servetune.sandbox_cli import sandbox_app
from servetune.settings import DEFAULT_STUDY, MODEL_NAME, Settings

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Tune how LLMs are served: agents search SGLang configs on a twin or "
                       "a cluster.")
lessons_app = typer.Typer(no_args_is_help=True, help="Query the lesson memory.")
mcp_app = typer.Typer(no_args_is_help=True, help="Serve an MCP server over stdio.")
source_app = typer.Typer(no_args_is_help=True, help="The SGLang source tree the sglang-source "
                                                    "server reads.")
app.add_typer(lessons_app, name="lessons")
app.add_typer(mcp_app, name="mcp")
app.add_typer(source_app, name="source")
app.add_typer(sandbox_app, name="sandbox")
console = Console()
# A run id is the servetune/run-id label of every deployment, so it is a Kubernetes label value
# (at most 63 characters, first and last a letter or digit; the apimachinery validation rule),
# without '.' so that it is also a plain folder name.
RUN_ID_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?")
err_console = Console(stderr=True)


def _fail(message: str, code: int = 2) -> None:
    """Print ``error: <message>`` (the message as plain text, never Rich markup) and exit."""
    err_console.print(Text.assemble(("error:", "bold red"), " ", message), highlight=False,
                      soft_wrap=True)
    raise typer.Exit(code)


def _new_run_id() -> str:
    return f"{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def _open_store(settings: Settings, lessons_dir: Path | None) -> Any:
    from memory.store import LessonStore

    return LessonStore(lessons_dir or settings.lessons_dir, settings.embedding)


def _settings() -> Settings:
    try:
        return Settings()
    except ValidationError as e:
        err = e.errors()[0]
        _fail(f"SERVETUNE_{str(err['loc'][0]).upper()}: {err['msg']}")
        raise  # unreachable: _fail exits


@contextlib.contextmanager
def _run_lock(run_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``run_dir`` so two processes never run one id at once."""
    with (run_dir / ".lock").open("w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _fail(f"run {run_dir.name} is in use by another servetune process; wait for it "
                  "or choose another --run-id")
        yield


KubeconfigOpt = Annotated[Path | None, typer.Option(
    "--kubeconfig", help="kubernetes backend: kubeconfig file (default $KUBECONFIG or "
                         "~/.kube/config; in a pod, its service account)")]
ContextOpt = Annotated[str | None, typer.Option(
    "--context", help="kubernetes backend: kubeconfig context (default: the current one)")]
ModelTokenSecretOpt = Annotated[str | None, typer.Option(
    "--model-token-secret", help="kubernetes backend: Secret whose key 'token' becomes the "
                                 "engines' HF_TOKEN (gated weights); the one Secret the sandbox "
                                 "policy lets pods read (default: none)")]


@app.command()
def run(
    study_file: Annotated[Path | None, typer.Argument(
        help="study YAML (default: the shipped studies/default.yaml)")] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="reuse to resume a run")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="folder of run folders: outputs go to OUT/<run-id>/ (default ./runs, "
                      "or $SERVETUNE_RUNS_DIR)")] = None,
    lessons_dir: Annotated[Path | None, typer.Option(
        "--lessons-dir", help="lesson store (default $SERVETUNE_LESSONS_DIR or "
                              "./.servetune/lessons)")] = None,
    brains: Annotated[str | None, typer.Option(
        "--brains", help="auto (Claude when ANTHROPIC_API_KEY is set), claude or "
                         "deterministic (default $SERVETUNE_BRAINS or auto)")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", help="Claude model of every agent (default $SERVETUNE_MODEL or "
                        "claude-sonnet-5-5)")] = None,
    backend: Annotated[str, typer.Option(
        "--backend", help="where trials run: twin (simulated SGLang, default), local (server "
                          "processes on 127.0.0.1) or kubernetes (SGLang pods in --namespace of "
                          "the --kubeconfig/--context cluster, GPU budget = the study's GPUs)")]
    = "twin",
    namespace: Annotated[str, typer.Option(
        "--namespace", help="the one namespace trials are deployed in (kubernetes: the "
                            "sandbox namespace)")] = "servetune",
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    model_token_secret: ModelTokenSecretOpt = None,
) -> None:
    """Run (or resume) a study and write runs/<run-id>/ with report.md, plots and the ledger."""
    t0 = time.time()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)  # MCP servers log INFO
    settings = _settings()
    if brains is not None:
        if brains not in ("auto", "claude", "deterministic"):
            _fail(f"--brains {brains!r}: choose auto, claude or deterministic")
        settings = settings.model_copy(update={"brains": brains})
    if model is not None:
        if len(model) > 128 or not re.fullmatch(MODEL_NAME, model.strip()):
            _fail(f"--model {model!r}: give a Claude model id (letters, digits, '.', '-', "
                  "'_', ':', '@', '/'), e.g. claude-sonnet-5-5")
        settings = settings.model_copy(update={"model": model.strip()})
    claude = _claude_setup(settings)
    path = study_file or DEFAULT_STUDY
    try:
        from servetune.study_file import check_replay, load_study, resolve_trace

        study = load_study(path)
        trace_path = resolve_trace(study, path)
        window = check_replay(study, trace_path)
    except ServetuneError as e:
        _fail(str(e))
    cluster, cluster_flags = _cluster_backend(backend, namespace, kubeconfig, context,
                                              study.gpu_count, settings,
                                              model_token_secret=model_token_secret)
    if run_id is not None and not RUN_ID_RE.fullmatch(run_id):
        _fail(f"--run-id {run_id!r}: use ASCII letters, digits, '-' and '_', starting and "
              "ending with a letter or digit, at most 63 characters (it labels the run's "
              "deployments)")
    rid = run_id or _new_run_id()
    run_dir = (out or settings.runs_dir) / rid
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with _run_lock(run_dir):
            _run_locked(study, path, trace_path, window, rid, run_dir, settings, lessons_dir,
                        t0, announce=run_id is None, claude=claude, cluster=cluster,
                        cluster_flags=cluster_flags)
    except OSError as e:  # name the file the OS refused (report.md, .lock, the lessons dir);
        # a failed os.replace of a temporary file names its destination second
        name = e.filename2 or e.filename
        where = f"{name}" if name else f"the run folder {run_dir}"
        _fail(f"cannot write {where}: {e.strerror or e}")


def _cluster_backend(kind: str, namespace: str, kubeconfig: Path | None, context: str | None,
                     gpus: int, settings: Settings, *,
                     model_token_secret: str | None = None) -> tuple[Any, str]:
    """The run's cluster backend and the flags that rebuild it (for the resume hint).

    The twin keeps its records in memory, as before; local and kubernetes share the state
    folder with the MCP servers. The kubernetes backend's GPU budget is the study's GPU count;
    ``model_token_secret`` is the one Secret its policy lets pods read (``--model-token-secret``).
    """
    from mcp_servers.cluster.backend import BACKEND_KINDS, BackendError, make_backend
    from sandbox.podspec import check_subdomain

    if kind not in BACKEND_KINDS:
        _fail(f"--backend {kind!r}: choose {', '.join(BACKEND_KINDS)}")
    if kind != "kubernetes" and (kubeconfig is not None or context is not None):
        _fail("--kubeconfig and --context choose a cluster: give them with --backend kubernetes")
    if model_token_secret is not None:
        if kind != "kubernetes":
            _fail("--model-token-secret names a Secret of the cluster: give it with --backend "
                  "kubernetes")
        try:
            check_subdomain(model_token_secret, "--model-token-secret")
        except ValueError as e:
            _fail(str(e))
    if kubeconfig is not None and not kubeconfig.is_file():
        _fail(f"--kubeconfig {kubeconfig}: no such file")
    try:
        backend = make_backend(kind, namespace, None if kind == "twin" else settings.state_dir,
                               kubeconfig=kubeconfig, context=context,
                               gpu_budget=gpus if kind == "kubernetes" else None,
                               **({"model_token_secret": model_token_secret}
                                  if model_token_secret is not None else {}))
    except BackendError as e:
        _fail(str(e))
    if kind == "kubernetes":  # credentials, reachability and RBAC, before any work starts
        try:
            backend.list()
        except BackendError as e:
            _fail(f"--backend kubernetes: {e}")
    import shlex

    flags = "" if kind == "twin" else f" --backend {kind}"
    flags += f" --namespace {namespace}" if namespace != "servetune" else ""
    flags += f" --kubeconfig {shlex.quote(str(kubeconfig))}" if kubeconfig is not None else ""
    flags += f" --context {shlex.quote(context)}" if context is not None else ""
    flags += (f" --model-token-secret {model_token_secret}"
              if model_token_secret is not None else "")
    return backend, flags


def _claude_setup(settings: Settings) -> Any:
    """The Claude setup the settings ask for (None: deterministic brains).

    Exits 2 on ``--brains claude`` without ``ANTHROPIC_API_KEY``.
    """
    from agents.claude import ClaudeSetup, anthropic_client_from_env, default_model

    if settings.brains == "deterministic":
        return None
    client = anthropic_client_from_env()
    if client is None:
        if settings.brains == "claude":
            _fail("--brains claude needs ANTHROPIC_API_KEY in the environment (or use "
                  "--brains deterministic)")
        return None
    return ClaudeSetup(client=client, model=settings.model or default_model())


def _run_locked(study: Any, path: Path, trace_path: Path, window: Any, rid: str, run_dir: Path,
                settings: Settings, lessons_dir: Path | None, t0: float, announce: bool,
                claude: Any = None, cluster: Any = None, cluster_flags: str = "") -> None:
    from graph.session import RunSession

    try:  # checks the run files read-only, then opens the ledger: once for the whole run
        session = RunSession(run_dir, rid, study, path, t0)
    except ServetuneError as e:
        _fail(str(e))
    with session:
        if announce:
            console.print(f"run id: [bold]{escape(rid)}[/]")
        try:
            store = _open_store(settings, lessons_dir)
        except ServetuneError as e:
            _fail(str(e))
        study_run = study.model_copy(update={"replay": study.replay.model_copy(
            update={"trace": str(trace_path)})})
        tree = _print_study(study, trace_path, window, cluster, settings)
        claude = _print_brains(claude, settings, run_dir)
        session.record_brains(f"claude:{claude.model}" if claude is not None
                              else "deterministic")
        again = (f" --brains claude --model {claude.model}" if claude is not None else
                 " --brains deterministic" if settings.brains == "deterministic" else "")
        again += cluster_flags
        extra = f" --out {run_dir.parent}" if run_dir.parent != Path("runs") else ""
        extra += f" --lessons-dir {lessons_dir}" if lessons_dir else ""
        resume = f"servetune run {path} --run-id {rid}{extra}{again}"
        outcome = _drive(session, study_run, store, trace_path, tree, claude, cluster,
                         settings, resume)
        if outcome.resumed and outcome.already_done:
            console.print(f"run {rid} was already complete; the report is rendered again",
                          markup=False)
        record = session.finish(outcome)
    _finish(study, rid, run_dir, outcome.stop_reason, trace_path, len(window), record,
            settings, lessons_dir)


def _print_study(study: Any, trace_path: Path, window: Any, cluster: Any,
                 settings: Settings) -> Any:
    """Print what the run replays and where research reads; the SGLang source tree (or None)."""
    r = study.replay
    # user text (names, paths, messages) is escaped: a '[' in it is text, never Rich markup
    console.print(f"study [bold]{escape(study.name)}[/]: {escape(study.model)} on "
                  f"{study.gpu_count}x{escape(study.gpu)}, SGLang {escape(study.engine_version)}; "
                  f"replay {escape(trace_path.name)} "
                  f"[{r.start_s:g}, {r.start_s + r.duration_s:g}) s at {r.time_scale:g}x = "
                  f"{len(window)} requests", highlight=False)
    from domain.models import get_model

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
    _realtime_notice(study, cluster, settings.repeats)
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


def _print_brains(claude: Any, settings: Settings, run_dir: Path) -> Any:
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


def _drive(session: Any, study_run: Any, store: Any, trace_path: Path, tree: Any, claude: Any,
           cluster: Any, settings: Settings, resume: str) -> Any:
    """Run the study under a progress bar; its outcome.

    On SIGINT/SIGTERM: tear down, save the elapsed time and the spend, print how to resume
    (``resume``, the command) and exit with the signal's code. On a Messages API error: the
    same, exit 1. A ServetuneError exits 1 with its message.
    """
    import anthropic

    rid = session.run_id
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  console=console, transient=False) as bar:
        task = bar.add_task("preparing", total=study_run.budget.max_trials)

        def progress(ev: dict[str, Any]) -> None:
            if "pruned" in ev:
                why = ev["reason"].split(":")[0]
                bar.console.print(f"  pruned {ev['pruned']} ({why})", highlight=False,
                                  markup=False)
                return
            phase, n, total = ev.get("phase"), ev.get("trial"), ev.get("total")
            bar.update(task, description=escape(f"{phase}: trial {n}/{total} "
                                                f"[{ev.get('config')}]"),
                       completed=(n or 1) - 1, total=total)

        err: Exception | None = None
        stop = Interrupt()  # SIGINT/SIGTERM cancel the run's task (servetune/interrupt.py)
        threads = set(threading.enumerate())
        try:
            try:
                outcome = asyncio.run(until_signal(session.run(
                    study_run, store, [trace_path.parent], progress=progress,
                    source_tree=tree, claude=claude, backend=cluster,
                    repeats=settings.repeats), stop))
            except BaseException as e:
                if stop.signum is None and not isinstance(e, KeyboardInterrupt):
                    raise
                # what unwinding the cancelled run raised is a consequence of the signal
                logging.getLogger("servetune.run").debug("run %s interrupted", rid, exc_info=e)
                stop.signum = stop.signum or signal.SIGINT
        except BaseExceptionGroup as group:  # raised inside the MCP clients' task groups
            known = _first_leaf(group, (anthropic.APIError, ServetuneError))
            if known is None:
                raise
            err = known
        except (anthropic.APIError, ServetuneError) as e:
            err = e
        finally:
            store.close()
        if stop.signum is not None:
            bar.stop()
            _stop_interrupted(cluster, rid, threads)
            session.save_elapsed()
            _print_spend(session.run_dir, settings, err_console)
            err_console.print(f"interrupted ({signal.Signals(stop.signum).name}); every "
                              f"finished trial is saved. Resume with: {resume}",
                              highlight=False, soft_wrap=True, markup=False)
            raise typer.Exit(stop.exit_code)
        if isinstance(err, ServetuneError):
            _fail(str(err), code=1)
        if err is not None:
            bar.stop()
            session.save_elapsed()
            _print_spend(session.run_dir, settings, err_console)
            _fail(f"Claude API: {_api_error(err)}; every finished trial is saved. Resume with: "
                  f"{resume}", code=1)
        bar.update(task, description="finished", completed=bar.tasks[0].total)
    return outcome


def _realtime_notice(study: Any, cluster: Any, repeats: int) -> None:
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


def _stop_interrupted(cluster: Any, rid: str, threads: set[threading.Thread]) -> None:
    """Tear down the deployments of interrupted run ``rid`` (a warning for each refused).

    First waits for the worker threads started since ``threads`` (see
    :func:`servetune.interrupt.join_new_threads`).
    """
    from graph.run import stop_run
    from mcp_servers.cluster.backend import BackendError
    from servetune.interrupt import join_new_threads, signals_ignored

    with signals_ignored():
        join_new_threads(threads)
        try:
            _, failed = stop_run(cluster, rid)
        except BackendError as e:
            failed = [f"listing the deployments failed: {e}"]
    for why in failed:
        err_console.print(f"[yellow]warning:[/] could not tear down {escape(why)}; tear it "
                          "down with the cluster server's tear_down", highlight=False,
                          soft_wrap=True)


def _first_leaf(group: BaseExceptionGroup[Any], kinds: tuple[type[Exception], ...]
                ) -> Exception | None:
    """The first exception of ``kinds`` in a (nested) exception group, else None."""
    for e in group.exceptions:
        if isinstance(e, BaseExceptionGroup):
            found = _first_leaf(e, kinds)
            if found is not None:
                return found
        elif isinstance(e, kinds):
            return e
    return None


def _print_spend(run_dir: Path, settings: Settings, out: Any) -> None:
    """One line: the run's Messages API calls, tokens and estimated USD so far (if any)."""
    from domain.usage import spend_line

    line = spend_line(run_dir, settings.prices())
    if line is not None:
        out.print(line, highlight=False)


def _api_error(e: Exception) -> str:
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


def _finish(study: Any, rid: str, run_dir: Path, stop_reason: str, trace_path: Path,
            n_requests: int, record: Any, settings: Settings,
            lessons_dir: Path | None) -> None:
    """Render the report of a finished run (a :class:`graph.session.RunRecord`) and sum it up."""
    from servetune.report import render_report, summary_rows

    trials, elapsed = record.trials, record.elapsed_s
    store = _open_store(settings, lessons_dir)
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
                      f"[bold]{escape(winner.config.launch_command())}[/] behind the "
                      f"{escape(winner.config.router_policy)} router", highlight=False,
                      soft_wrap=True)
    else:
        console.print(f"no finalist met the SLO (TTFT p99 <= {study.slo.ttft_p99_ms:,.0f} ms)")
    console.print(f"stopped: {stop_reason or 'finished'}", highlight=False, markup=False)
    _print_spend(run_dir, settings, console)
    console.print(f"report: {report}", markup=False)
    console.print(f"elapsed: {elapsed:.1f} s")


@lessons_app.command("query")
def lessons_query(
    text: Annotated[str, typer.Argument(help="what you want to know, in words")],
    k: Annotated[int, typer.Option("-k", min=1, max=50, help="how many lessons")] = 5,
    gpu: Annotated[str | None, typer.Option(help="only lessons that apply to this GPU")] = None,
    lessons_dir: Annotated[Path | None, typer.Option("--lessons-dir")] = None,
) -> None:
    """Lessons most similar to TEXT, best first."""
    if not text.strip():
        _fail("lessons query: give some words to search for, e.g. \"fp8 out of memory\"")
    settings = _settings()
    try:
        store = _open_store(settings, lessons_dir)
        total = store.count()
        hits = store.query(text, k=k, **({"gpu": gpu} if gpu else {}))
        store.close()
    except ServetuneError as e:
        _fail(str(e))
    if not hits:
        console.print("no lessons yet (run a study first)" if total == 0 else
                      f"no lesson applies to GPU {gpu!r} ({total} lessons in the store)")
        return
    for lesson, score in hits:  # a lesson's words are plain text, never Rich markup
        console.print(f"[bold]{escape(lesson.id)}[/] ({score:.2f}) {escape(lesson.title)}",
                      highlight=False)
        console.print(escape(f"  when: {lesson.condition_text()}  outcome: {lesson.outcome}"
                             f" ({lesson.failure_class})\n  fix: {lesson.fix}"),
                      highlight=False)


@lessons_app.command("list")
def lessons_list(
    gpu: Annotated[str | None, typer.Option(help="only lessons that apply to this GPU")] = None,
    lessons_dir: Annotated[Path | None, typer.Option("--lessons-dir")] = None,
) -> None:
    """Every lesson in the store, oldest first."""
    settings = _settings()
    try:
        store = _open_store(settings, lessons_dir)
        items = store.list(**({"gpu": gpu} if gpu else {}))
        store.close()
    except ServetuneError as e:
        _fail(str(e))
    table = Table(title=f"{len(items)} lessons")
    for col in ("id", "outcome", "title", "when"):
        table.add_column(col, overflow="fold")
    for lesson in items:  # text as plain text: a lesson's words are never Rich markup
        defect = lesson.defect()
        when = lesson.condition_text() + (f"\nignored (forbids nothing): {defect}"
                                          if defect else "")
        table.add_row(lesson.id, lesson.outcome, escape(lesson.title), escape(when))
    console.print(table)


@lessons_app.command("export-skill")
def lessons_export_skill(
    out: Annotated[Path | None, typer.Option(
        "--out", help="file to write (default .claude/skills/NAME/SKILL.md)")] = None,
    name: Annotated[str, typer.Option(help="skill name")] = "servetune-lessons",
    gpu: Annotated[str | None, typer.Option(help="only lessons that apply to this GPU")] = None,
    model: Annotated[str | None, typer.Option(help="only lessons for this model")] = None,
    lessons_dir: Annotated[Path | None, typer.Option("--lessons-dir")] = None,
) -> None:
    """Write the lessons as a Claude Code skill file, so chat sessions know them."""
    from mcp_servers.lessons.ops import export_skill

    settings = _settings()
    try:
        store = _open_store(settings, lessons_dir)
        try:
            skill = export_skill(store, name=name, gpu=gpu, model=model)
        finally:
            store.close()
    except (ServetuneError, ValueError) as e:
        _fail(str(e))
    path = out or Path(skill.path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(skill.content, encoding="utf-8")
        tmp.replace(path)
    except OSError as e:
        _fail(f"cannot write {path}: {e.strerror or e}")
    console.print(f"wrote {skill.lesson_count} lessons to {path}", highlight=False,
                  markup=False)


@mcp_app.command("lessons")
def mcp_lessons(lessons_dir: Annotated[Path | None, typer.Option("--lessons-dir")] = None,
                ) -> None:
    """The lessons server over stdio (for Claude Code)."""
    from mcp_servers.lessons.server import main

    settings = _settings()
    try:
        main(str(lessons_dir or settings.lessons_dir), settings.embedding)
    except ServetuneError as e:
        _fail(str(e))


BackendOpt = Annotated[str, typer.Option(
    "--backend", help="twin (simulated SGLang, default), local (server processes on 127.0.0.1) "
                      "or kubernetes (pods in --namespace of the --kubeconfig/--context cluster)")]
NamespaceOpt = Annotated[str, typer.Option(
    "--namespace", help="the one namespace the server acts in")]
StateDirOpt = Annotated[Path | None, typer.Option(
    "--state-dir", help="deployment records shared by the cluster and bench servers (default "
                        "$SERVETUNE_STATE_DIR or ./.servetune/state)")]


@mcp_app.command("cluster")
def mcp_cluster(
    backend: BackendOpt = "twin",
    namespace: NamespaceOpt = "servetune",
    state_dir: StateDirOpt = None,
    command: Annotated[str | None, typer.Option(
        "--command", help="local backend: server command with {host}, {port}, {config_json} "
                          "placeholders (default: `sglang serve` with the config's flags)")] = None,
    ready_timeout_s: Annotated[float, typer.Option(
        "--ready-timeout-s", min=1, help="local backend: seconds until a server that is not "
                                         "Ready counts as Failed")] = 600.0,
    visible_devices: Annotated[str | None, typer.Option(
        "--visible-devices", help="local backend: GPUs to hand out, e.g. 0,1,2,3 or GPU-<uuid>; "
                                  "each replica gets tp_size GPUs not held by another live "
                                  "deployment")] = None,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    gpu_budget: Annotated[int | None, typer.Option(
        "--gpu-budget", min=0, help="kubernetes backend (required): GPUs the deployments may "
                                    "hold together (the sandbox's ResourceQuota)")] = None,
    image_allow: Annotated[list[str] | None, typer.Option(
        "--image-allow", help="kubernetes backend: allowed image prefix (repeatable; default "
                              "lmsysorg/sglang: and ghcr.io/servetune/)")] = None,
    lws: Annotated[bool, typer.Option(
        "--lws", help="kubernetes backend: the sandbox Role grants LeaderWorkerSets (replicas "
                      "spanning nodes)")] = False,
    dra: Annotated[bool, typer.Option(
        "--dra", help="kubernetes backend: GPUs through DRA ResourceClaimTemplates")] = False,
    k8s_version: Annotated[str, typer.Option(
        "--k8s-version", help="kubernetes backend: the cluster's release (DRA API version)")]
    = "1.33",
    gpus_per_node: Annotated[int, typer.Option(
        "--gpus-per-node", min=1, help="kubernetes backend: GPUs of one node (a larger "
                                       "replica needs --lws)")] = 8,
    model_cache_pvc: Annotated[str | None, typer.Option(
        "--model-cache-pvc", help="kubernetes backend: PVC for the weights and JIT caches "
                                  "(default an emptyDir per pod)")] = None,
    router: Annotated[bool, typer.Option(
        "--router", help="kubernetes backend: the SGLang router in front of the replicas")]
    = False,
    model_token_secret: ModelTokenSecretOpt = None,
) -> None:
    """The cluster server ("kubectl": deploy, status, logs, events, teardown) over stdio."""
    import shlex

    from mcp_servers.cluster.backend import BackendError
    from mcp_servers.cluster.server import main

    settings = _settings()
    argv = shlex.split(command) if command else None
    devices = None
    if visible_devices is not None:
        devices = [d.strip() for d in visible_devices.split(",")]
        if not all(devices):
            _fail(f"--visible-devices {visible_devices!r}: give GPU ids separated by commas, "
                  "e.g. 0,1,2,3 (no empty entries)")
    kube: dict[str, Any] = {}
    if backend == "kubernetes":
        from sandbox.manifests import SglangOptions

        if gpu_budget is None:
            _fail("--backend kubernetes needs --gpu-budget N: the GPUs its deployments may hold "
                  "together (the sandbox's ResourceQuota requests.nvidia.com/gpu)")
        try:
            opts = SglangOptions(gpus_per_node=gpus_per_node, model_cache_pvc=model_cache_pvc,
                                 router=router, dra=dra, k8s_version=k8s_version)
        except ValidationError as e:
            _fail(f"kubernetes options: {e.errors()[0]['msg'].removeprefix('Value error, ')}")
        if kubeconfig is not None and not kubeconfig.is_file():
            _fail(f"--kubeconfig {kubeconfig}: no such file")
        if model_token_secret is not None:
            from sandbox.podspec import check_subdomain

            try:
                check_subdomain(model_token_secret, "--model-token-secret")
            except ValueError as e:
                _fail(str(e))
        kube = dict(kubeconfig=kubeconfig, context=context, gpu_budget=gpu_budget,
                    image_allow=image_allow, lws=lws, sglang_options=opts,
                    model_token_secret=model_token_secret)
    elif kubeconfig or context or gpu_budget is not None or image_allow or lws or dra or \
            router or model_cache_pvc or model_token_secret:
        _fail("--kubeconfig, --context, --gpu-budget, --image-allow, --lws, --dra, --router, "
              "--model-cache-pvc and --model-token-secret are options of --backend kubernetes")
    try:
        main(backend, namespace, state_dir or settings.state_dir, argv, ready_timeout_s, devices,
             **kube)
    except (BackendError, ServetuneError) as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"cannot use the state folder {state_dir or settings.state_dir}: {e.strerror or e}")


@mcp_app.command("bench")
def mcp_bench(
    backend: BackendOpt = "twin",
    namespace: NamespaceOpt = "servetune",
    state_dir: StateDirOpt = None,
    trace_dir: Annotated[list[Path] | None, typer.Option(
        "--trace-dir", help="folder replays may read traces from (repeatable; default: the "
                            "shipped data/traces)")] = None,
    records_dir: Annotated[Path | None, typer.Option(
        "--records-dir", help="where per-request records go (default STATE_DIR/bench)")] = None,
    allow_endpoint: Annotated[list[str] | None, typer.Option(
        "--allow-endpoint", help="base URL that may be benchmarked directly, e.g. "
                                 "http://127.0.0.1:30000 (repeatable; none by default)")] = None,
    tokenizer: Annotated[Path | None, typer.Option(
        "--tokenizer", help="the served model's local tokenizer.json / vocab.txt (or its "
                            "folder) for prompts of exact token lengths (default: one token "
                            "per word, exact for the twin server)")] = None,
    client: Annotated[str, typer.Option(
        "--client", help="HTTP client of the load generator: aiohttp (default) or httpx")]
    = "aiohttp",
    runner: Annotated[str, typer.Option(
        "--runner", help="load generator of runs that ask for auto: auto (aiperf for a "
                         "cluster backend's deployments when installed, else the built-in "
                         "runner), builtin, or aiperf (the \\[aiperf] extra)")] = "auto",
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    compute_budget_s: Annotated[float, typer.Option(
        "--compute-budget-s", min=0.001, help="twin runs: wall seconds of simulation one tool "
                                              "call may use, a run_sweep sharing one; a run "
                                              "estimated over it is refused, one reaching it "
                                              "stopped (finite, default 60)")] = 60.0,
) -> None:
    """The bench server (saturation, trace replay, concurrency sweep) over stdio."""
    from mcp_servers.bench.server import main
    from mcp_servers.cluster.backend import BackendError
    from servetune.settings import REPO_ROOT

    if backend != "kubernetes" and (kubeconfig is not None or context is not None):
        _fail("--kubeconfig and --context are options of --backend kubernetes")
    if not math.isfinite(compute_budget_s):  # inf would turn the twin's compute guard off
        _fail(f"--compute-budget-s {compute_budget_s}: give a finite number of seconds > 0")

    settings = _settings()
    traces = trace_dir or [REPO_ROOT / "data" / "traces"]
    for folder in traces:
        if not folder.is_dir():
            _fail(f"--trace-dir {folder}: no such folder")
    if tokenizer is not None and not tokenizer.exists():
        _fail(f"--tokenizer {tokenizer}: no such file or folder")
    if client not in ("aiohttp", "httpx"):
        _fail(f"--client {client!r}: choose aiohttp or httpx")
    if runner not in ("auto", "builtin", "aiperf"):
        _fail(f"--runner {runner!r}: choose auto, builtin or aiperf")
    try:
        main(backend, namespace, state_dir or settings.state_dir, records_dir, traces,
             allow_endpoint or [], tokenizer=tokenizer, client=client,  # type: ignore[arg-type]
             runner=runner, kubeconfig=kubeconfig, context=context,  # type: ignore[arg-type]
             compute_budget_s=compute_budget_s)
    except (BackendError, ServetuneError, ValueError) as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"cannot use the state or records folder: {e.strerror or e} "
              f"({e.filename or state_dir or settings.state_dir})")


VersionOpt = Annotated[str, typer.Option("--version", help="SGLang release, e.g. 0.5.23")]


@mcp_app.command("sglang-source")
def mcp_sglang_source(
    version: VersionOpt = "0.5.23",
    tree: Annotated[Path | None, typer.Option(
        "--tree", help="SGLang source: an unpacked wheel, a git checkout, the sglang package "
                       "folder or a .whl (default $SERVETUNE_SGLANG_SOURCE, else the tree "
                       "`servetune source fetch` unpacked)")] = None,
) -> None:
    """The sglang-source server (flags, where used, constraints, defaults, grep) over stdio."""
    from mcp_servers.source.server import main

    settings = _settings()
    try:
        main(tree or settings.sglang_source, version, settings.source_cache)
    except ServetuneError as e:
        _fail(str(e))


@source_app.command("fetch")
def source_fetch(
    version: VersionOpt = "0.5.23",
    wheel: Annotated[Path | None, typer.Option(
        "--wheel", help="unpack this already-downloaded wheel instead of calling pip")] = None,
) -> None:
    """Download the SGLang wheel (pip, no dependencies) and unpack it into the cache."""
    from mcp_servers.source.fetch import default_cache_dir, fetch_wheel

    settings = _settings()
    cache = settings.source_cache or default_cache_dir()
    try:
        root = fetch_wheel(version, cache, wheel=wheel)
    except ServetuneError as e:
        _fail(str(e))
    console.print(f"SGLang {version} source: {root}", highlight=False, markup=False)
    console.print("serve it with: servetune mcp sglang-source --version " + version,
                  highlight=False)


MCP_SERVERS = ("cluster", "bench", "lessons", "sglang-source")


@mcp_app.command("tools")
def mcp_tools(
    names: Annotated[list[str] | None, typer.Argument(
        help=f"servers to ask (default all: {', '.join(MCP_SERVERS)})")] = None,
) -> None:
    """Start each server over stdio, as Claude Code does, and list its tools."""
    from mcp import Client, StdioServerParameters

    wanted = names or list(MCP_SERVERS)
    for n in wanted:
        if n not in MCP_SERVERS:
            _fail(f"unknown server {n!r}; choose from {', '.join(MCP_SERVERS)}")

    async def ask(name: str) -> list[Any]:
        params = StdioServerParameters(command=sys.executable,
                                       args=["-m", "servetune.cli", "mcp", name])
        async with Client(params) as client:
            return list((await client.list_tools()).tools)

    for name in wanted:
        try:
            tools = asyncio.run(ask(name))
        except Exception as e:  # noqa: BLE001 - any start-up failure is reported, not raised
            _fail(f"server {name} did not start over stdio: {e}; run `servetune mcp {name}` "
                  "to see its error", code=1)
        table = Table(title=f"servetune mcp {name}: {len(tools)} tools")
        for col in ("tool", "hints", "description"):
            table.add_column(col, overflow="fold")
        for t in tools:
            a = t.annotations
            hints = ", ".join(h for h, on in (
                ("read-only", a and a.read_only_hint), ("destructive", a and a.destructive_hint),
                ("idempotent", a and a.idempotent_hint), ("open-world", a and a.open_world_hint))
                if on)
            table.add_row(t.name, hints, (t.description or "").strip().split("\n")[0])
        console.print(table)


# ----- servetune twin serve ------------------------------------------------------------------
twin_app = typer.Typer(no_args_is_help=True, help="The digital twin as an OpenAI-compatible "
                                                  "server.")
app.add_typer(twin_app, name="twin")


def _twin_config(config: Path | None, study: Path | None, replicas: int | None) -> Any:
    """The ServingConfig to serve: a JSON/YAML file, a study's baseline, or the default's."""
    from domain.config import ServingConfig
    from servetune.study_file import load_study, read_config_file

    if config is not None and study is not None:
        _fail("give --config or --study, not both")
    try:
        if config is not None:
            try:
                data = read_config_file(config)
            except ValueError as e:
                _fail(str(e))
            cfg = ServingConfig(**data)
        else:
            cfg = load_study(study or DEFAULT_STUDY).base_config()
        if replicas is not None:
            cfg = ServingConfig(**{**cfg.model_dump(), "replicas": replicas})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"])) or "config"
        _fail(f"{config or study}: {where}: {err['msg'].removeprefix('Value error, ')}")
    except ServetuneError as e:
        _fail(str(e))
    return cfg


@twin_app.command("serve")
def twin_serve(
    config: Annotated[Path | None, typer.Option(
        "--config", help="ServingConfig as a JSON or YAML file (e.g. the local backend's "
                         "{config_json})")] = None,
    study: Annotated[Path | None, typer.Option(
        "--study", help="serve this study's baseline config (default: the shipped study's)")
    ] = None,
    host: Annotated[str, typer.Option("--host", help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535,
                                      help="port to bind (0: a free one)")] = 30000,
    port_file: Annotated[Path | None, typer.Option(
        "--port-file", help="write the bound port here once serving")] = None,
    speedup: Annotated[float, typer.Option(
        "--speedup", min=1e-3, max=1e4, help="virtual seconds per wall second (10: every "
                                             "latency is a tenth of the engine's)")] = 1.0,
    replicas: Annotated[int | None, typer.Option(
        "--replicas", min=1, max=512, help="serve this many replicas instead of the config's "
                                           "(1: one replica per process, as the local "
                                           "backend starts them)")] = None,
    record: Annotated[bool, typer.Option(
        "--record", help="keep each request's server-side timing (the twin's token times and "
                         "when each was written) for GET /twin/timing, to check a load "
                         "generator's bias")] = False,
) -> None:
    """Serve a config's twin over HTTP (OpenAI API, SSE, /metrics) with the engine's timing."""
    from servetune.twin_server import serve

    cfg = _twin_config(config, study, replicas)
    try:
        code = serve(cfg, host=host, port=port, port_file=port_file, speedup=speedup,
                     record=record)
    except OSError as e:
        _fail(f"cannot serve on {host}:{port}: {e.strerror or e}", code=1)
    raise typer.Exit(code)


def main() -> None:  # pragma: no cover - console entry for `python -m servetune.cli`
    """Entry point."""
    sys.exit(app())


if __name__ == "__main__":  # pragma: no cover
    main()
