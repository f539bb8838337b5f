"""``servetune mcp``: each MCP server over stdio (for Claude Code), and ``servetune source``.

``servetune source fetch`` unpacks the SGLang source tree the sglang-source server reads.
"""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.table import Table

from domain.errors import ServetuneError
from servetune.cli_common import (
    ContextOpt,
    KubeconfigOpt,
    LessonsDir,
    ModelTokenSecretOpt,
    console,
    fail,
    load_settings,
)

mcp_app = typer.Typer(no_args_is_help=True, help="Serve an MCP server over stdio.")
source_app = typer.Typer(no_args_is_help=True, help="The SGLang source tree the sglang-source "
                                                    "server reads.")


@mcp_app.command("lessons")
def mcp_lessons(lessons_dir: LessonsDir = None,
                allow_retract: Annotated[bool, typer.Option(
                    "--allow-retract", help="operator only: also serve retract_lesson and "
                    "restore_lesson (without it an agent can quarantine a lesson, never erase "
                    "or revive one)")] = False,
                ) -> None:
    """The lessons server over stdio (for Claude Code)."""
    from mcp_servers.lessons.server import main

    settings = load_settings()
    try:
        main(str(lessons_dir or settings.lessons_dir), settings.embedding,
             allow_retract=allow_retract)
    except ServetuneError as e:
        fail(str(e))


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
        "--router", help="kubernetes and local backends: the SGLang router (config."
                         "router_policy) in front of the replicas; local: the pinned "
                         "sglang-router 0.3.2 process (pip install 'servetune\\[router]'), "
                         "refused when it is not installed")]
    = False,
    model_token_secret: ModelTokenSecretOpt = None,
) -> None:
    """The cluster server ("kubectl": deploy, status, logs, events, teardown) over stdio."""
    import shlex

    from mcp_servers.cluster.backend import BackendError
    from mcp_servers.cluster.server import main

    settings = load_settings()
    argv = shlex.split(command) if command else None
    devices = None
    if visible_devices is not None:
        devices = [d.strip() for d in visible_devices.split(",")]
        if not all(devices):
            fail(f"--visible-devices {visible_devices!r}: give GPU ids separated by commas, "
                 "e.g. 0,1,2,3 (no empty entries)")
    kube: dict[str, Any] = {}
    if backend == "kubernetes":
        from sandbox.manifests import SglangOptions

        if gpu_budget is None:
            fail("--backend kubernetes needs --gpu-budget N: the GPUs its deployments may hold "
                 "together (the sandbox's ResourceQuota requests.nvidia.com/gpu)")
        try:
            opts = SglangOptions(gpus_per_node=gpus_per_node, model_cache_pvc=model_cache_pvc,
                                 router=router, dra=dra, k8s_version=k8s_version)
        except ValidationError as e:
            fail(f"kubernetes options: {e.errors()[0]['msg'].removeprefix('Value error, ')}")
        if kubeconfig is not None and not kubeconfig.is_file():
            fail(f"--kubeconfig {kubeconfig}: no such file")
        if model_token_secret is not None:
            from sandbox.podspec import check_subdomain

            try:
                check_subdomain(model_token_secret, "--model-token-secret")
            except ValueError as e:
                fail(str(e))
        kube = dict(kubeconfig=kubeconfig, context=context, gpu_budget=gpu_budget,
                    image_allow=image_allow, lws=lws, sglang_options=opts,
                    model_token_secret=model_token_secret)
    elif kubeconfig or context or gpu_budget is not None or image_allow or lws or dra or \
            model_cache_pvc or model_token_secret:
        fail("--kubeconfig, --context, --gpu-budget, --image-allow, --lws, --dra, "
             "--model-cache-pvc and --model-token-secret are options of --backend kubernetes")
    elif router:
        if backend != "local":
            fail("--router is an option of --backend local and --backend kubernetes")
        kube = {"router": "sglang"}
    try:
        main(backend, namespace, state_dir or settings.state_dir, argv, ready_timeout_s, devices,
             **kube)
    except (BackendError, ServetuneError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot use the state folder {state_dir or settings.state_dir}: {e.strerror or e}")


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
        fail("--kubeconfig and --context are options of --backend kubernetes")
    if not math.isfinite(compute_budget_s):  # inf would turn the twin's compute guard off
        fail(f"--compute-budget-s {compute_budget_s}: give a finite number of seconds > 0")

    settings = load_settings()
    traces = trace_dir or [REPO_ROOT / "data" / "traces"]
    for folder in traces:
        if not folder.is_dir():
            fail(f"--trace-dir {folder}: no such folder")
    if tokenizer is not None and not tokenizer.exists():
        fail(f"--tokenizer {tokenizer}: no such file or folder")
    if client not in ("aiohttp", "httpx"):
        fail(f"--client {client!r}: choose aiohttp or httpx")
    if runner not in ("auto", "builtin", "aiperf"):
        fail(f"--runner {runner!r}: choose auto, builtin or aiperf")
    try:
        main(backend, namespace, state_dir or settings.state_dir, records_dir, traces,
             allow_endpoint or [], tokenizer=tokenizer, client=client,  # type: ignore[arg-type]
             runner=runner, kubeconfig=kubeconfig, context=context,  # type: ignore[arg-type]
             compute_budget_s=compute_budget_s)
    except (BackendError, ServetuneError, ValueError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot use the state or records folder: {e.strerror or e} "
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

    settings = load_settings()
    try:
        main(tree or settings.sglang_source, version, settings.source_cache)
    except ServetuneError as e:
        fail(str(e))


@source_app.command("fetch")
def source_fetch(
    version: VersionOpt = "0.5.23",
    wheel: Annotated[Path | None, typer.Option(
        "--wheel", help="unpack this already-downloaded wheel instead of calling pip")] = None,
    data_dir: Annotated[Path | None, typer.Option(
        "--data-dir", help="write the flag inventory here (default: $SERVETUNE_ENGINE_DATA, "
                           "else ~/.cache/servetune/engines)")] = None,
) -> None:
    """Download the SGLang wheel (pip, no dependencies), unpack it, write its flag inventory.

    The inventory (``sglang-X-flags.json`` + ``sglang-X-cli.json``, static parse of the
    source) is what lets studies, ``servetune check`` and ``diagnose`` use version X.
    """
    from domain.engines import engine, user_data_dir
    from mcp_servers.source.fetch import default_cache_dir, fetch_wheel
    from mcp_servers.source.inventory import write_inventory

    settings = load_settings()
    cache = settings.source_cache or default_cache_dir()
    try:
        root = fetch_wheel(version, cache, wheel=wheel)
        flags_file, _ = write_inventory(root, version, data_dir or user_data_dir())
    except ServetuneError as e:
        fail(str(e))
    console.print(f"SGLang {version} source: {root}", highlight=False, markup=False,
                  soft_wrap=True)  # a path is copied whole, never broken over lines
    console.print(f"flag inventory: {flags_file}", highlight=False, markup=False, soft_wrap=True)
    note = engine("sglang", version).rules_note()
    if note:
        console.print(note, highlight=False, markup=False)
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
            fail(f"unknown server {n!r}; choose from {', '.join(MCP_SERVERS)}")

    async def ask(name: str) -> list[Any]:
        params = StdioServerParameters(command=sys.executable,
                                       args=["-m", "servetune.cli", "mcp", name])
        async with Client(params) as client:
            return list((await client.list_tools()).tools)

    for name in wanted:
        try:
            tools = asyncio.run(ask(name))
        except Exception as e:  # noqa: BLE001 - any start-up failure is reported, not raised
            fail(f"server {name} did not start over stdio: {e}; run `servetune mcp {name}` "
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
