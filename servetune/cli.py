"""The ``servetune`` command line (Typer): run a study, query lessons, serve MCP over stdio.

Bad input (a missing or malformed study or trace, an unknown knob, an impossible value, a run id
reused for another study) prints one line and exits with code 2, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
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
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from domain.errors import ServetuneError
from servetune.cli_check import check as check_cmd
from servetune.cli_common import (
    LESSONS_DIR_HELP,
    ContextOpt,
    KubeconfigOpt,
    ModelTokenSecretOpt,
    console,
    err_console,
    fail,
    load_settings,
    open_store,
)
from servetune.cli_diagnose import diagnose
from servetune.cli_lessons import lessons_app
from servetune.cli_mcp import mcp_app, source_app
from servetune.cli_run_print import (
    api_error,
    finish,
    print_brains,
    print_spend,
    print_study,
)
from servetune.cli_twin import twin_app
from servetune.interrupt import Interrupt, until_signal
from servetune.sandbox_cli import sandbox_app
from servetune.settings import DEFAULT_STUDY, MODEL_NAME, Settings

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Tune how LLMs are served: agents search SGLang configs on a twin or "
                       "a cluster.")
app.add_typer(lessons_app, name="lessons")
app.add_typer(mcp_app, name="mcp")
app.add_typer(source_app, name="source")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(twin_app, name="twin")
app.command("check")(check_cmd)
app.command("diagnose")(diagnose)
# A run id is the servetune/run-id label of every deployment, so it is a Kubernetes label value
# (at most 63 characters, first and last a letter or digit; the apimachinery validation rule),
# without '.' so that it is also a plain folder name.
RUN_ID_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?")


def _new_run_id() -> str:
    return f"{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


@contextlib.contextmanager
def _run_lock(run_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``run_dir`` so two processes never run one id at once."""
    with (run_dir / ".lock").open("w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fail(f"run {run_dir.name} is in use by another servetune process; wait for it "
                 "or choose another --run-id")
        yield


@app.command()
def run(
    study_file: Annotated[Path | None, typer.Argument(
        help="study YAML (default: the shipped studies/default.yaml)")] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="reuse to resume a run")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="folder of run folders: outputs go to OUT/<run-id>/ (default ./runs, "
                      "or $SERVETUNE_RUNS_DIR)")] = None,
    lessons_dir: Annotated[Path | None, typer.Option(
        "--lessons-dir", help=LESSONS_DIR_HELP)] = None,
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
    router: Annotated[bool, typer.Option(
        "--router", help="local and kubernetes backends: the SGLang router (the config's "
                         "router_policy) in front of a trial's replicas; local: the pinned "
                         "sglang-router 0.3.2 process (pip install 'servetune\\[router]'), "
                         "refused when it is not installed")] = False,
) -> None:
    """Run (or resume) a study and write runs/<run-id>/ with report.md, plots and the ledger."""
    t0 = time.time()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)  # MCP servers log INFO
    settings = load_settings()
    if brains is not None:
        if brains not in ("auto", "claude", "deterministic"):
            fail(f"--brains {brains!r}: choose auto, claude or deterministic")
        settings = settings.model_copy(update={"brains": brains})
    if model is not None:
        if len(model) > 128 or not re.fullmatch(MODEL_NAME, model.strip()):
            fail(f"--model {model!r}: give a Claude model id (letters, digits, '.', '-', "
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
        fail(str(e))
    cluster, cluster_flags = _cluster_backend(backend, namespace, kubeconfig, context,
                                              study.gpu_count, settings,
                                              model_token_secret=model_token_secret,
                                              router=router)
    if run_id is not None and not RUN_ID_RE.fullmatch(run_id):
        fail(f"--run-id {run_id!r}: use ASCII letters, digits, '-' and '_', starting and "
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
        fail(f"cannot write {where}: {e.strerror or e}")


def _cluster_backend(kind: str, namespace: str, kubeconfig: Path | None, context: str | None,
                     gpus: int, settings: Settings, *,
                     model_token_secret: str | None = None,
                     router: bool = False) -> tuple[Any, str]:
    """The run's cluster backend and the flags that rebuild it (for the resume hint).

    The twin keeps its records in memory, as before; local and kubernetes share the state
    folder with the MCP servers. The kubernetes backend's GPU budget is the study's GPU count;
    ``model_token_secret`` is the one Secret its policy lets pods read (``--model-token-secret``).
    ``router``: the SGLang router in front of the replicas (local: the pinned sglang-router
    process, :mod:`mcp_servers.cluster.router`; kubernetes: the router Deployment).
    """
    from mcp_servers.cluster.backend import BACKEND_KINDS, BackendError, make_backend
    from sandbox.podspec import check_subdomain

    if kind not in BACKEND_KINDS:
        fail(f"--backend {kind!r}: choose {', '.join(BACKEND_KINDS)}")
    if kind != "kubernetes" and (kubeconfig is not None or context is not None):
        fail("--kubeconfig and --context choose a cluster: give them with --backend kubernetes")
    if model_token_secret is not None:
        if kind != "kubernetes":
            fail("--model-token-secret names a Secret of the cluster: give it with --backend "
                 "kubernetes")
        try:
            check_subdomain(model_token_secret, "--model-token-secret")
        except ValueError as e:
            fail(str(e))
    if kubeconfig is not None and not kubeconfig.is_file():
        fail(f"--kubeconfig {kubeconfig}: no such file")
    if router and kind == "twin":
        fail("--router puts a router process in front of real replicas: give it with "
             "--backend local or kubernetes (the twin backend routes with its own model of "
             "the config's router_policy)")
    extra: dict[str, Any] = {}
    if router and kind == "local":
        extra["router"] = "sglang"
    elif router:
        from sandbox.manifests import SglangOptions

        extra["sglang_options"] = SglangOptions(router=True)
    try:
        backend = make_backend(kind, namespace, None if kind == "twin" else settings.state_dir,
                               kubeconfig=kubeconfig, context=context,
                               gpu_budget=gpus if kind == "kubernetes" else None,
                               **({"model_token_secret": model_token_secret}
                                  if model_token_secret is not None else {}), **extra)
    except BackendError as e:
        fail(str(e))
    if kind == "kubernetes":  # credentials, reachability and RBAC, before any work starts
        try:
            backend.list()
        except BackendError as e:
            fail(f"--backend kubernetes: {e}")
    import shlex

    flags = "" if kind == "twin" else f" --backend {kind}"
    flags += f" --namespace {namespace}" if namespace != "servetune" else ""
    flags += f" --kubeconfig {shlex.quote(str(kubeconfig))}" if kubeconfig is not None else ""
    flags += f" --context {shlex.quote(context)}" if context is not None else ""
    flags += (f" --model-token-secret {model_token_secret}"
              if model_token_secret is not None else "")
    flags += " --router" if router else ""
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
            fail("--brains claude needs ANTHROPIC_API_KEY in the environment (or use "
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
        fail(str(e))
    with session:
        if announce:
            console.print(f"run id: [bold]{escape(rid)}[/]")
        try:
            store = open_store(settings, lessons_dir)
        except ServetuneError as e:
            fail(str(e))
        study_run = study.model_copy(update={"replay": study.replay.model_copy(
            update={"trace": str(trace_path)})})
        tree = print_study(study, trace_path, window, cluster, settings)
        claude = print_brains(claude, settings, run_dir)
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
    finish(study, rid, run_dir, outcome.stop_reason, trace_path, len(window), record,
           settings, lessons_dir)


def _drive(session: Any, study_run: Any, store: Any, trace_path: Path, tree: Any, claude: Any,
           cluster: Any, settings: Settings, resume: str) -> Any:
    """Run the study under a progress bar; its outcome.

    On SIGINT/SIGTERM: tear down, save the elapsed time and the spend, print how to resume
    (``resume``, the command) and exit with the signal's code. On a Messages API error: the
    same, exit 1. A ServetuneError exits 1 with its message.
    """
    from agents.claude import api_errors  # the SDK's errors, without importing it (1 s)

    rid = session.run_id
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  console=console, transient=False) as bar:
        task = bar.add_task("preparing", total=study_run.budget.max_trials)

        def progress(ev: dict[str, Any]) -> None:
            if "quarantined" in ev:  # a measurement contradicted a lesson (graph/state.py)
                bar.console.print(f"  quarantined lesson {ev['quarantined']}: {ev['reason']}",
                                  highlight=False, markup=False)
                return
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
            known = _first_leaf(group, (*api_errors(), ServetuneError))
            if known is None:
                raise
            err = known
        except (*api_errors(), ServetuneError) as e:
            err = e
        finally:
            store.close()
        if stop.signum is not None:
            bar.stop()
            _stop_interrupted(cluster, rid, threads)
            session.save_elapsed()
            print_spend(session.run_dir, settings, err_console)
            err_console.print(f"interrupted ({signal.Signals(stop.signum).name}); every "
                              f"finished trial is saved. Resume with: {resume}",
                              highlight=False, soft_wrap=True, markup=False)
            raise typer.Exit(stop.exit_code)
        if isinstance(err, ServetuneError):
            fail(str(err), code=1)
        if err is not None:
            bar.stop()
            session.save_elapsed()
            print_spend(session.run_dir, settings, err_console)
            fail(f"Claude API: {api_error(err)}; every finished trial is saved. Resume with: "
                 f"{resume}", code=1)
        bar.update(task, description="finished", completed=bar.tasks[0].total)
    return outcome


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


def main() -> None:  # pragma: no cover - console entry for `python -m servetune.cli`
    """Entry point."""
    sys.exit(app())


if __name__ == "__main__":  # pragma: no cover
    main()
