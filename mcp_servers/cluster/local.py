"""Local-process cluster backend: every replica is a server process on 127.0.0.1.

``deploy`` starts ``config.replicas`` processes, each on a free port, in a new session (so each
leads its own process group), with stdout and stderr written to a log file under the state
folder. The argv is ``command`` with ``{host}``, ``{port}`` and ``{config_json}`` replaced in
every element (no shell ever parses it; ``{config_json}`` is the path of a JSON file holding the
ServingConfig; any other ``{word}`` is refused when the backend is built), or, without a command,
the real SGLang server: ``engine_for(config).argv(config) + ['--host', host, '--port', port]``.

On a machine without a GPU (:func:`gpu_present`), :func:`~mcp_servers.cluster.backend.make_backend`
(what ``servetune mcp cluster --backend local`` builds) defaults the command to the twin server
instead, one replica per process (:data:`TWIN_SERVE_COMMAND`)::

    servetune twin serve --config {config_json} --host {host} --port {port} --replicas 1

(add ``--speedup X`` to a ``--command`` of your own to run the twin X times faster than real time).

With ``visible_devices``, each replica gets ``tp_size`` GPUs in ``CUDA_VISIBLE_DEVICES``, taken
from the devices that no deployment of this state folder holds: a deployment holds its GPUs
until it is torn down (a Failed one too: its processes may linger). A deploy needing more free
GPUs than remain is refused, naming who holds them.

Server processes are not children that die with the MCP server: local deployments keep
running after the cluster server exits, until ``teardown``; a new server (or backend) over the
same state folder sees them and can tear them down.

A replica is Ready when ``GET http://host:port{health_path}`` answers 200, and Failed when its
process exits (stage ``startup`` before Ready, ``serving`` after; the message is its last
non-empty log line) or when no replica answered within ``ready_timeout_s``.

``teardown`` sends SIGTERM to the process group of each recorded PID, then SIGKILL after
``stop_grace_s``, and only while that PID still has the start time recorded when it was started
(``/proc/PID/stat``): a PID the kernel handed to another process is never signalled. A group
whose leader has exited (the server killed, a helper it forked still running) is signalled while
one of its processes carries the replica's random token in its environment
(``SERVETUNE_REPLICA_TOKEN``, see :mod:`mcp_servers.cluster.procs`). Processes are never looked
up or killed by name.

Records (:mod:`mcp_servers.cluster.store`) live under ``state_dir/local/<namespace>/``, so another
process over the same folder sees the deployments and can tear them down. Beside each record,
the deployment's folder ``<name>/`` holds ``config.json``, the logs ``replica-<i>.log`` and a
small ``replica-<i>.pid`` per replica (PID, start time, port, GPUs), written atomically when the
replica starts: if the record becomes unreadable, ``teardown`` still stops the replicas from
these files (only a PID whose start time matches), moves the record aside (``*.corrupt``) and
leaves a Terminated record in its place. Paths are never taken from a record: a replica's log
is a plain file name, resolved inside the deployment's folder (else refused). Redeploying a
torn-down name keeps the earlier runs' events. Exit codes are known
to the process that started a server (it reaps it); others report None. Log lines carry the
time a reader first saw them on disk (the log file's mtime at that read), so ``since_s`` is as
precise as the polling.

Longer than 500 lines on purpose: process start, readiness, log reading and group teardown of one
replica share its record and its safety checks (the replica token, start-time checks), which a
split would have to pass between modules.
"""

from __future__ import annotations

import builtins
import ipaddress
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from domain.config import ServingConfig
from domain.engines import engine_for
from domain.hardware import get_gpu
from domain.study_sources import USER_CATALOG_FILE, user_catalog
from mcp_servers.cluster import logfile
from mcp_servers.cluster.backend import (
    MAX_HISTORY,
    NAME_RE,
    BackendError,
    CorruptRecord,
    DeploymentStatus,
    Event,
    LogLine,
    Phase,
    check_name,
    read_record,
    refuse_flag_values,
    require_record,
    scan_records,
    settle,
    when,
)
from mcp_servers.cluster.procs import TOKEN_ENV, free_ports, proc_stat, running, stop_groups
from mcp_servers.cluster.router import (
    READINESS_PATH,
    ROUTER_LOG,
    ROUTER_MODES,
    RouterMode,
    fronted,
    plain,
    require_router,
    router_argv,
)
from mcp_servers.cluster.store import RecordStore, write_atomic

MAX_MARKS = 1000  # per replica; beyond, every other mark is dropped
PLACEHOLDERS = ("{host}", "{port}", "{config_json}")
PLACEHOLDER_RE = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*\}")
HEALTH_PATH_RE = re.compile(r"^/[A-Za-z0-9._~/-]*$")
DEVICE_RE = re.compile(r"^(GPU|MIG)-[0-9A-Za-z/-]+$")
ROUTER_PID = "router.pid"  # the router's pid file in the deployment's folder
LOG_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
log = logging.getLogger("servetune.cluster.local")
# The twin as the server program: every replica a ``servetune twin serve`` process serving one
# replica of the config (``--replicas 1``; the deployment starts ``config.replicas`` of them).
TWIN_SERVE_COMMAND = [sys.executable, "-m", "servetune.cli", "twin", "serve",
                      "--config", "{config_json}", "--host", "{host}", "--port", "{port}",
                      "--replicas", "1"]
# Seconds from deploy to Ready of a twin server (a Python process importing servetune: 2-5 s
# measured on a 2-core machine); the CLI's estimate of a local run without a GPU uses it.
TWIN_SERVE_STARTUP_S = 5.0
# NVIDIA driver device nodes (present on a machine with an NVIDIA GPU and its driver).
NVIDIA_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0")


def gpu_present() -> bool:
    """Whether this machine has an NVIDIA GPU: a driver device node or ``nvidia-smi``."""
    return any(os.path.exists(p) for p in NVIDIA_DEVICE_NODES) or \
        shutil.which("nvidia-smi") is not None


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Replica(BaseModel):
    index: int = Field(ge=0)
    pid: int = Field(ge=2)  # never 0 or 1 (os.killpg(0) would be our own group)
    start_ticks: int  # /proc/PID/stat field 22: tells this process from a later one with its PID
    port: int = Field(ge=1, le=65535)
    url: str  # base URL, e.g. http://127.0.0.1:31001
    argv: list[str]
    log: str  # file name in the deployment's folder
    started_at: float
    devices: list[str] = []  # its CUDA_VISIBLE_DEVICES (empty: the environment's)
    token: str = ""  # its procs.TOKEN_ENV value (empty in records written before it existed)
    ready_at: float | None = None
    exited_at: float | None = None
    exit_code: int | None = None
    marks: list[logfile.Mark] = []  # stamps of the log's lines (see logfile)

    @field_validator("log")
    @classmethod
    def _plain_file_name(cls, v: str) -> str:
        if not LOG_NAME_RE.match(v) or ".." in v:
            raise ValueError(f"log {v!r} must be a plain file name in the deployment's folder")
        return v

    @field_validator("url")
    @classmethod
    def _loopback_url(cls, v: str) -> str:
        try:
            u = httpx.URL(v)
        except (httpx.InvalidURL, TypeError) as e:
            raise ValueError(f"url {v!r} is not a URL") from e
        if u.scheme != "http" or not _loopback(u.host) or u.userinfo or u.path not in ("", "/") \
                or u.query or u.fragment:
            raise ValueError(f"url {v!r} must be http://<loopback host>:<port>")
        return v


class _PidFile(_Replica):
    """``<name>/replica-<i>.pid``: a replica as started, for a teardown without the record."""

    created_at: float


class _Record(BaseModel):
    name: str
    config: ServingConfig
    labels: dict[str, str]
    created_at: float
    replicas: list[_Replica] = Field(min_length=1)
    health_path: str = "/health"  # the deploying backend's settings, which every reader uses
    ready_timeout_s: float = 600.0
    events: list[Event] = []
    gave_up_at: float | None = None
    terminated_at: float | None = None
    router: _Replica | None = None  # the sglang-router process in front (router="sglang")

    @field_validator("health_path")
    @classmethod
    def _path_only(cls, v: str) -> str:
        if not HEALTH_PATH_RE.match(v):
            raise ValueError(f"health_path {v!r} must be a plain URL path like /health")
        return v

    @model_validator(mode="after")
    def _indexed(self) -> _Record:
        if [r.index for r in self.replicas] != list(range(len(self.replicas))):
            raise ValueError("replica indices must be 0, 1, ... in order")
        return self


def check_devices(devices: list[str] | None) -> list[str] | None:
    """``visible_devices`` normalized (``"01"`` -> ``"1"``); None stays None.

    Raises:
        BackendError: an empty list, a value that is neither a GPU index nor a GPU UUID, or a
            device listed twice.
    """
    if devices is None:
        return None
    if not devices:
        raise BackendError("visible_devices is empty: give GPU ids (e.g. 0,1) or none at all to "
                           "keep the environment's CUDA_VISIBLE_DEVICES")
    out: list[str] = []
    for d in devices:
        v = str(d).strip()
        if v.isascii() and v.isdigit():
            v = str(int(v))
        elif not DEVICE_RE.match(v):
            raise BackendError(f"visible device {d!r} is neither a non-negative GPU index (0, 1, "
                               "...) nor a GPU UUID (GPU-...); give e.g. 0,1,2,3")
        if v in out:
            raise BackendError(f"visible device {v!r} is listed twice; list each GPU once")
        out.append(v)
    return out


def check_command(command: list[str] | None) -> None:
    """Refuse an argv template with a ``{word}`` placeholder other than the known ones.

    Raises:
        BackendError: naming the unknown placeholder and the valid ones.
    """
    for arg in command or []:
        for ph in PLACEHOLDER_RE.findall(arg):
            if ph not in PLACEHOLDERS:
                raise BackendError(
                    f"command argument {arg!r} has the unknown placeholder {ph}; the valid ones "
                    "are {host}, {port} and {config_json} (the path of a JSON file holding the "
                    "ServingConfig)")


def refuse_layout(config: ServingConfig) -> None:
    """Refuse what one machine's processes cannot serve: a PD layout, a server spanning nodes.

    A PD layout needs prefill and decode servers, a KV transfer backend between them and the
    router in PD mode; a server of more GPUs than one node of its GPU type has
    (``config.nnodes`` > 1) needs one process per node with ``--nnodes``. Both run on the twin
    backend (simulated) or the kubernetes backend (Deployments, LeaderWorkerSets and the PD
    router, :mod:`sandbox.manifests`).

    Raises:
        BackendError: saying which and where to run it instead.
    """
    if config.pd is not None:
        raise BackendError(
            f"the local backend does not run prefill/decode disaggregation (pd "
            f"{config.pd.label()}): it starts one server process per replica on this machine, "
            "without the KV transfer between servers or the router in PD mode; deploy it on "
            "the twin backend (simulated) or the kubernetes backend")
    nodes = config.nnodes(get_gpu(config.gpu).gpus_per_node)
    if nodes > 1:
        raise BackendError(
            f"one server of this config needs {config.gpus_per_server} GPUs (tp {config.tp_size}"
            f" x pp {config.pp_size} x dp {config.dp_size}), {nodes} nodes of "
            f"{get_gpu(config.gpu).gpus_per_node} {config.gpu}: the local backend runs "
            "single-node servers only; deploy it on the kubernetes backend (a LeaderWorkerSet "
            "with --lws) or the twin backend")


class LocalProcessBackend:
    """Deployments as local server processes; see the module docstring."""

    kind = "local"

    def __init__(self, namespace: str, state_dir: Path, command: list[str] | None = None,
                 host: str = "127.0.0.1", ready_timeout_s: float = 600.0,
                 health_path: str = "/health", stop_grace_s: float = 15.0,
                 visible_devices: list[str] | None = None, router: RouterMode = "none") -> None:
        """Build the backend.

        Args:
            namespace: DNS-1123 label; records go to ``state_dir/local/<namespace>/``.
            state_dir: folder shared by every server process of one user.
            command: server argv template (``{host}``, ``{port}``, ``{config_json}``: the path
                of a JSON file with the ServingConfig), or None for ``sglang serve`` with the
                config's flags.
            host: loopback address the servers bind.
            ready_timeout_s: a deployment with a replica not Ready after this long is Failed.
            health_path: path that answers 200 once a server is ready.
            stop_grace_s: seconds between SIGTERM and SIGKILL at teardown.
            visible_devices: GPU indices or UUIDs (``GPU-...``); each replica gets
                ``tp_size`` of those no live deployment of the state folder holds, as
                ``CUDA_VISIBLE_DEVICES``. None: the environment's, unchanged.
            router: ``sglang``: the pinned sglang-router in front of every deployment of 2+
                replicas with a router policy (:mod:`mcp_servers.cluster.router`); ``none``:
                no router, the bench spreads requests over the replicas.

        Raises:
            BackendError: bad namespace, empty command or unknown ``{placeholder}``,
                non-loopback host, bad health path, bad or duplicate visible devices, an
                unknown router mode, or ``router="sglang"`` without the pinned sglang-router
                installed (the message says how to install it).
        """
        if not NAME_RE.match(namespace):
            raise BackendError(f"namespace {namespace!r} is not a valid DNS-1123 label")
        if command is not None and not command:
            raise BackendError("command must name a program (or be None for sglang serve)")
        check_command(command)
        if not _loopback(host):
            raise BackendError(f"host {host!r}: the local backend only binds loopback addresses")
        if not HEALTH_PATH_RE.match(health_path):
            raise BackendError(f"health_path {health_path!r} must be a URL path starting with "
                               "'/' (letters, digits, '._~/-')")
        self.namespace = namespace
        self.command = list(command) if command is not None else None
        self.host, self.health_path = host, health_path
        self.ready_timeout_s, self.stop_grace_s = ready_timeout_s, stop_grace_s
        self.visible_devices = check_devices(visible_devices)
        if router not in ROUTER_MODES:
            raise BackendError(f"router {router!r}: choose {' or '.join(ROUTER_MODES)}")
        if router == "sglang":
            require_router()
        self.router: RouterMode = router
        self._store = RecordStore(state_dir / "local" / namespace)
        # servers this process started, by (pid, start ticks): only a parent can reap a child
        # and learn its exit code; Popen caches the code once reaped.
        self._children: dict[tuple[int, int], subprocess.Popen[bytes]] = {}
        self._children_lock = threading.Lock()

    # ----- records ---------------------------------------------------------------------------

    def _get(self, name: str) -> _Record:
        """Record ``name``. Raises BackendError if there is none, CorruptRecord if unusable."""
        return require_record(self._store, name, _Record, self.namespace)

    def _put(self, rec: _Record) -> None:
        self._store.write(rec.name, rec.model_dump(mode="json"))

    def _folder(self, name: str) -> Path:
        assert self._store.root is not None
        return self._store.root / name

    def _pid_files(self, name: str) -> list[_PidFile]:
        """The replicas' pid files of ``name`` that parse (others are logged and skipped)."""
        folder = self._folder(name)
        out: dict[int, _PidFile] = {}
        if not folder.is_dir():
            return []
        for path in sorted(folder.glob("replica-*.pid")):
            try:
                pf = _PidFile.model_validate_json(path.read_bytes())
            except (OSError, ValueError, ValidationError) as e:
                log.warning("ignoring unreadable pid file %s: %s", path, e)
                continue
            out.setdefault(pf.index, pf)
        return [out[i] for i in sorted(out)]

    def _router_pid_file(self, name: str) -> _PidFile | None:
        """The router's pid file of ``name``, when there is one that parses."""
        path = self._folder(name) / ROUTER_PID
        try:
            return _PidFile.model_validate_json(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, ValidationError) as e:
            log.warning("ignoring unreadable pid file %s: %s", path, e)
            return None

    def _drop_pid_files(self, name: str) -> None:
        folder = self._folder(name)
        if folder.is_dir():
            for path in [*folder.glob("replica-*.pid"), folder / ROUTER_PID]:
                path.unlink(missing_ok=True)

    def _held(self) -> dict[str, str]:
        """GPU -> the deployment holding it (every deployment not torn down yet).

        A deployment with an unreadable record holds the GPUs of its pid files whose process
        still runs.
        """
        held: dict[str, str] = {}
        for name in self._store.names():
            if not NAME_RE.match(name):
                continue
            try:
                rec = read_record(self._store, name, _Record)
            except CorruptRecord:
                for pf in self._pid_files(name):
                    if running(pf.pid, pf.start_ticks):
                        for d in pf.devices:
                            held[d] = f"{name} (unreadable record)"
                continue
            if rec is not None and rec.terminated_at is None:
                for r in rec.replicas:
                    for d in r.devices:
                        held[d] = name
        return held

    def _allocate(self, name: str, config: ServingConfig) -> list[list[str]]:
        """GPUs for each replica of ``config`` (empty lists without visible_devices).

        Call with the store locked.

        Raises:
            BackendError: fewer free visible devices than ``config.gpus``.
        """
        if self.visible_devices is None:
            return [[] for _ in range(config.replicas)]
        held = self._held()
        free = [d for d in self.visible_devices if d not in held]
        if len(free) < config.gpus:
            mine = [d for d in self.visible_devices if d in held]
            who = "; ".join(f"GPU {d} by {held[d]!r}" for d in mine) or "none"
            raise BackendError(
                f"{name} needs {config.gpus} GPUs (tp_size x replicas) but only {len(free)} of "
                f"the {len(self.visible_devices)} visible devices are free "
                f"({', '.join(free) or 'none'}); held: {who}. Tear down a deployment you no "
                "longer need (tear_down frees its GPUs), then deploy again.")
        tp = config.tp_size
        return [free[i * tp:(i + 1) * tp] for i in range(config.replicas)]

    # ----- processes -------------------------------------------------------------------------

    def _url(self, port: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{port}"

    def _argv(self, config: ServingConfig, port: int, config_json: Path) -> list[str]:
        if self.command is None:
            return engine_for(config).argv(config) + ["--host", self.host, "--port", str(port)]
        subs = {"{host}": self.host, "{port}": str(port), "{config_json}": str(config_json)}
        out = []
        for arg in self.command:
            for key, value in subs.items():
                arg = arg.replace(key, value)
            out.append(arg)
        return out

    def _env(self, devices: list[str], token: str) -> dict[str, str]:
        env = {**os.environ, TOKEN_ENV: token}
        if self.visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        return env

    def _exit_of(self, r: _Replica) -> tuple[bool, int | None]:
        """(has exited, exit code if this process started it)."""
        p = self._children.get((r.pid, r.start_ticks))
        if p is not None:
            rc = p.poll()
            return rc is not None, rc
        return not running(r.pid, r.start_ticks), None

    def _reap(self) -> None:
        """Collect the exit status of every child that exited (so none stays a zombie)."""
        with self._children_lock:
            for p in self._children.values():
                p.poll()

    @staticmethod
    def _healthy(url: str) -> bool:
        try:
            r = httpx.get(url, timeout=1.0, trust_env=False)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def _log_path(self, name: str, r: _Replica) -> Path:
        """The log file of ``r``, confined to the deployment's folder.

        Raises:
            BackendError: the file resolves outside the folder (a symlink) or is not a
                regular file.
        """
        folder = self._store.folder(name).resolve()
        path = (folder / r.log).resolve()
        if path.parent != folder:
            raise BackendError(f"the log of replica {r.index} of {name!r} ({r.log!r}) resolves "
                               f"to {path}, outside the deployment's folder {folder}; refusing "
                               "to read it")
        if path.exists() and not path.is_file():
            raise BackendError(f"the log of replica {r.index} of {name!r} ({path}) is not a "
                               "regular file; refusing to read it")
        return path

    def _last_line(self, name: str, r: _Replica) -> str:
        try:
            return logfile.last_line(self._log_path(name, r))
        except (BackendError, OSError) as e:
            return f"(log unreadable: {e})"

    # ----- protocol --------------------------------------------------------------------------

    def deploy(self, name: str, config: ServingConfig, labels: dict[str, str],
               wait_s: float = 0.0) -> DeploymentStatus:
        """Start ``config.replicas`` server processes as ``name``; wait up to ``wait_s`` s.

        Raises:
            BackendError: invalid name or config, a PD layout or a server spanning nodes
                (:func:`refuse_layout`), the name is taken by a live deployment, too
                few visible devices, or the server program cannot be started.
            UnknownFlag: the config has a flag this SGLang version lacks (no command given).
        """
        check_name(name, self.namespace)
        refuse_flag_values(config)
        refuse_layout(config)
        if self.visible_devices is not None and \
                len(self.visible_devices) < config.gpus:
            raise BackendError(f"{name} needs {config.gpus} GPUs (tp_size x replicas) but the "
                               f"backend has {len(self.visible_devices)} visible devices")
        self._reap()
        with self._store.locked():
            old = read_record(self._store, name, _Record)  # CorruptRecord: tear it down first
            if old is not None and old.terminated_at is None:
                raise BackendError(f"deployment {name!r} already exists; tear it down first")
            devices = self._allocate(name, config)
            folder = self._store.folder(name)
            self._drop_pid_files(name)  # of an earlier run, torn down
            config_json = folder / "config.json"
            write_atomic(config_json, config.model_dump_json(indent=1))
            carried = user_catalog(config.model, config.gpu)  # a study's own model or GPU
            if carried["models"] or carried["gpus"]:
                write_atomic(folder / USER_CATALOG_FILE, json.dumps(carried))
            created = time.time()
            prior = old.events[-MAX_HISTORY:] if old is not None else []
            events = [*prior, Event(t=created, type="Normal", reason="Created", object=name,
                                    message=f"{config.replicas} replica(s) of config "
                                    f"{config.config_id()}")]
            routed = self.router == "sglang" and fronted(config)
            ports = free_ports(config.replicas + (2 if routed else 0), self.host)
            router_ports, ports = ports[config.replicas:], ports[:config.replicas]
            argvs = [self._argv(config, port, config_json) for port in ports]
            replicas: list[_Replica] = []
            router: _Replica | None = None
            try:
                for i, (port, argv) in enumerate(zip(ports, argvs, strict=True)):
                    log = f"replica-{i}.log"
                    token = secrets.token_hex(16)
                    with open(folder / log, "wb") as out:
                        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                             stderr=subprocess.STDOUT, start_new_session=True,
                                             env=self._env(devices[i], token))
                    st = proc_stat(p.pid)  # a child stays in /proc (zombie) until reaped
                    ticks = st.start_ticks if st is not None else -1
                    with self._children_lock:
                        self._children[(p.pid, ticks)] = p
                    now = time.time()
                    rep = _Replica(index=i, pid=p.pid, start_ticks=ticks, port=port,
                                   url=self._url(port), argv=argv, log=log, started_at=now,
                                   devices=devices[i], token=token)
                    replicas.append(rep)
                    write_atomic(folder / f"replica-{i}.pid", _PidFile(
                        **rep.model_dump(), created_at=created).model_dump_json())
                    gpus = (f", CUDA_VISIBLE_DEVICES={','.join(devices[i])}"
                            if self.visible_devices is not None else "")
                    events.append(Event(t=now, type="Normal", reason="Started", object=name,
                                        message=f"replica {i}: pid {p.pid}{gpus}, "
                                        f"{self._url(port)}: {shlex.join(argv)[:400]}"))
                if routed:
                    router = self._start_router(name, config, [r.url for r in replicas],
                                                router_ports, created)
                    events.append(Event(
                        t=router.started_at, type="Normal", reason="Started", object=name,
                        message=f"router: pid {router.pid}, {router.url} "
                        f"(sglang-router, policy {config.router_policy}): "
                        f"{shlex.join(router.argv)[:400]}"))
            except OSError as e:
                self._stop([*replicas, *([router] if router is not None else [])])
                raise BackendError(f"could not start {argvs[0][0]!r} for {name}: {e}. Install "
                                   "the server program or configure the backend's "
                                   "command") from e
            self._put(_Record(name=name, config=config, labels=dict(labels),
                              created_at=created, replicas=replicas,
                              health_path=self.health_path,
                              ready_timeout_s=self.ready_timeout_s, events=events,
                              router=router))
        return settle(self, name, wait_s)

    def _start_router(self, name: str, config: ServingConfig, workers: list[str],
                      ports: list[int], created: float) -> _Replica:
        """Start sglang-router in front of ``workers`` on ``ports`` (HTTP, metrics).

        Like a replica: its own session (process group), a token, its log ``router.log`` and a
        pid file ``router.pid`` in the deployment's folder. Call with the store locked.

        Raises:
            OSError: the router program could not be started.
        """
        folder = self._store.folder(name)
        argv = router_argv(config, workers, self.host, ports[0], ports[1], self.ready_timeout_s)
        token = secrets.token_hex(16)
        with open(folder / ROUTER_LOG, "wb") as out:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, TOKEN_ENV: token})
        st = proc_stat(p.pid)
        ticks = st.start_ticks if st is not None else -1
        with self._children_lock:
            self._children[(p.pid, ticks)] = p
        rep = _Replica(index=0, pid=p.pid, start_ticks=ticks, port=ports[0],
                       url=self._url(ports[0]), argv=argv, log=ROUTER_LOG,
                       started_at=time.time(), token=token)
        write_atomic(folder / ROUTER_PID, _PidFile(**rep.model_dump(),
                                                   created_at=created).model_dump_json())
        return rep

    def status(self, name: str) -> DeploymentStatus:
        """Status of ``name`` after one look at each replica.

        The look: has the process exited; for a replica not Ready yet, one health probe.

        Raises:
            BackendError: unknown name.
        """
        self._reap()
        rec = self._get(name)
        if rec.terminated_at is None:
            rec = self._observe(rec)
        return self._status(rec)

    def _observe(self, rec: _Record) -> _Record:
        """Look at the processes and health endpoints; persist what changed (with events)."""
        exits: dict[int, int | None] = {}
        ready: set[int] = set()
        marks: dict[int, tuple[int, float]] = {}
        for r in rec.replicas:
            exited, rc = self._exit_of(r)
            if r.exited_at is None and exited:
                exits[r.index] = rc
            elif r.exited_at is not None and r.exit_code is None and rc is not None:
                exits[r.index] = rc  # the parent learnt the code after another process saw it
            elif (r.exited_at is None and r.ready_at is None and
                  self._healthy(r.url + rec.health_path)):
                ready.add(r.index)
            try:
                mark = logfile.growth(self._log_path(rec.name, r), r.marks)
            except (BackendError, OSError):
                mark = None
            if mark is not None:
                marks[r.index] = mark
        rt, router_exit, router_ready = rec.router, None, False
        if rt is not None and rt.exited_at is None:
            exited, rc = self._exit_of(rt)
            if exited:
                router_exit = (rc,)
            elif rt.ready_at is None and self._healthy(rt.url + READINESS_PATH):
                router_ready = True
        now = time.time()
        router_waits = rt is not None and rt.ready_at is None and not router_ready
        timed_out = (rec.gave_up_at is None and not exits and router_exit is None and
                     now - rec.created_at > rec.ready_timeout_s and
                     (router_waits or
                      any(r.ready_at is None for r in rec.replicas if r.index not in ready)))
        if not (exits or ready or marks or timed_out or router_exit or router_ready):
            return rec
        with self._store.locked():
            seen, rec = rec, self._get(rec.name)  # another process may have written meanwhile
            if rec.terminated_at is not None or rec.created_at != seen.created_at:
                return rec  # torn down, or even deployed anew: these observations are stale
            for r in rec.replicas:
                if r.index in marks and marks[r.index][0] > (r.marks[-1][0] if r.marks else 0):
                    r.marks.append(marks[r.index])
                    if len(r.marks) > MAX_MARKS:  # thin out: old lines get a later stamp
                        r.marks = r.marks[1::2]
                if r.index in ready and r.ready_at is None:
                    r.ready_at = now
                    rec.events.append(Event(
                        t=now, type="Normal", reason="Ready", object=rec.name,
                        message=f"replica {r.index} answered 200 on {rec.health_path} after "
                        f"{now - rec.created_at:.1f} s"))
                if r.index in exits:
                    if r.exited_at is None:
                        r.exited_at, r.exit_code = now, exits[r.index]
                        stage = "startup" if r.ready_at is None else "serving"
                        rec.events.append(Event(
                            t=now, type="Warning", reason="Failed", object=rec.name,
                            message=f"replica {r.index} (pid {r.pid}) exited with code "
                            f"{r.exit_code} during {stage}: {self._last_line(rec.name, r)}"))
                    elif r.exit_code is None:
                        r.exit_code = exits[r.index]
            self._observe_router(rec, router_exit, router_ready, now)
            if timed_out and rec.gave_up_at is None:
                rec.gave_up_at = now
                rec.events.append(Event(
                    t=now, type="Warning", reason="Unhealthy", object=rec.name,
                    message=f"not every replica answered 200 on {rec.health_path} within "
                    f"{rec.ready_timeout_s:g} s; tear it down"))
            self._put(rec)
        return rec

    def _observe_router(self, rec: _Record, exit_: tuple[int | None] | None, ready: bool,
                        now: float) -> None:
        """Record the router's Ready or its exit (with an event) on ``rec`` (store locked)."""
        rt = rec.router
        if rt is None or rt.exited_at is not None:
            return
        if exit_ is not None:
            rt.exited_at, rt.exit_code = now, exit_[0]
            stage = "startup" if rt.ready_at is None else "serving"
            rec.events.append(Event(
                t=now, type="Warning", reason="Failed", object=rec.name,
                message=f"router (pid {rt.pid}) exited with code {rt.exit_code} during "
                f"{stage}: {plain(self._last_line(rec.name, rt))}"))
        elif ready and rt.ready_at is None:
            rt.ready_at = now
            rec.events.append(Event(
                t=now, type="Normal", reason="Ready", object=rec.name,
                message=f"router answered 200 on {READINESS_PATH} after "
                f"{now - rec.created_at:.1f} s"))

    def _status(self, rec: _Record) -> DeploymentStatus:
        live_ready = [r for r in rec.replicas if r.ready_at is not None and r.exited_at is None]
        exited = [r for r in rec.replicas if r.exited_at is not None]
        rt = rec.router
        exit_code, stage, startup_s = None, None, 0.0
        phase: Phase
        if rec.terminated_at is not None:
            phase = "Terminated"
            message = (f"torn down at {when(rec.terminated_at)}; last log line: "
                       f"{self._last_line(rec.name, self._first_failed(rec))}")
            live_ready = []
        elif exited:
            first = min(exited, key=lambda r: r.exited_at or 0.0)
            phase, exit_code = "Failed", first.exit_code
            stage = "startup" if first.ready_at is None else "serving"
            message = self._last_line(rec.name, first)
        elif rt is not None and rt.exited_at is not None:
            phase, exit_code = "Failed", rt.exit_code
            stage = "startup" if rt.ready_at is None else "serving"
            message = f"router: {plain(self._last_line(rec.name, rt))}"
        elif rec.gave_up_at is not None:
            waiting = next((r for r in rec.replicas if r.ready_at is None), rt)
            assert waiting is not None  # gave up: a replica or the router was not ready
            who = "router" if waiting is rt else f"replica {waiting.index}"
            phase, stage = "Failed", "startup"
            message = (f"{who} not ready after {rec.ready_timeout_s:g} s; "
                       f"last log line: {plain(self._last_line(rec.name, waiting))}")
        elif len(live_ready) == len(rec.replicas) and (rt is None or rt.ready_at is not None):
            phase = "Ready"
            startup_s = max(r.ready_at or 0.0 for r in [*live_ready, *([rt] if rt else [])]) \
                - rec.created_at
            message = self._last_line(rec.name, rec.replicas[0])
            if rt is not None:  # the router's gRPC probe leaves a warning in the replicas' logs
                message = (f"sglang-router ({rec.config.router_policy}) at {rt.url} in front of "
                           f"{len(rec.replicas)} replicas; replica 0's last log line: {message}")
        else:
            phase = "Pending"
            waiting = next((r for r in rec.replicas if r.ready_at is None), rt)
            assert waiting is not None
            message = plain(self._last_line(rec.name, waiting))
        return DeploymentStatus(
            name=rec.name, namespace=self.namespace, phase=phase, replicas=len(rec.replicas),
            ready_replicas=len(live_ready), config=rec.config, labels=rec.labels,
            endpoints=[r.url for r in live_ready] if phase in ("Ready", "Pending")
            else [], router=rt.url if rt is not None and phase == "Ready" else None,
            created_at=rec.created_at, exit_code=exit_code, failed_stage=stage,
            message=message, startup_s=round(startup_s, 3))

    def logs(self, name: str, replica: int | None = None) -> list[LogLine]:
        """Log of one replica of ``name`` (the last 8 MiB).

        ``replica`` picks it; by default the first replica that failed, else replica 0; ``-1``
        is the deployment's router (``router.log``; its lines stamped with the file's mtime).

        Raises:
            BackendError: unknown name or replica index.
        """
        rec = self._get(name)
        if replica == -1 and rec.router is not None:
            out, _ = logfile.lines(self._log_path(name, rec.router), rec.router.marks)
            return [LogLine(t=ln.t, text=plain(ln.text)) for ln in out]
        if replica is not None:
            if not 0 <= replica < len(rec.replicas):
                router = "; -1 is its router" if rec.router is not None else ""
                raise BackendError(f"{name} has replicas 0..{len(rec.replicas) - 1}{router}")
            r = rec.replicas[replica]
        else:
            r = self._first_failed(rec)
        out, mark = logfile.lines(self._log_path(name, r), r.marks)
        if mark is not None:  # persist it, so every reader stamps these lines alike
            with self._store.locked():
                fresh = self._get(name)
                fr = fresh.replicas[r.index]
                if fresh.created_at == rec.created_at and \
                        mark[0] > (fr.marks[-1][0] if fr.marks else 0):
                    fr.marks.append(mark)
                    self._put(fresh)
        return out

    @staticmethod
    def _first_failed(rec: _Record) -> _Replica:
        """The first replica that failed before any teardown (which stamps the others), or 0."""
        exited = [x for x in rec.replicas if x.exited_at is not None and
                  (rec.terminated_at is None or x.exited_at < rec.terminated_at)]
        return min(exited, key=lambda x: x.exited_at or 0.0) if exited else rec.replicas[0]

    def events(self, name: str | None = None) -> list[Event]:
        """Recorded events of ``name`` (or of every deployment), oldest first.

        Events of earlier deployments of a name are kept. Without ``name``, each unreadable
        record adds a Warning event (reason CorruptRecord) naming its file.
        """
        if name is not None:
            return sorted(self._get(name).events, key=lambda e: e.t)
        recs, bad = scan_records(self._store, _Record)
        return sorted([*(e for rec in recs for e in rec.events), *(b.event() for b in bad)],
                      key=lambda e: e.t)

    def teardown(self, name: str) -> DeploymentStatus:
        """Stop every replica of ``name`` (SIGTERM, SIGKILL after ``stop_grace_s``); idempotent.

        Only process groups whose leader still has the recorded PID and start time are
        signalled; a recycled PID gets a ForeignProcess event instead. The replicas' pid files
        are stopped as well (same check), should the record name other PIDs.

        If the record is unreadable, the replicas are stopped from their pid files instead (same
        PID and start-time check), the record is moved aside (``*.corrupt``) and, when the
        deployment's ``config.json`` is intact, a Terminated record takes its place.

        Raises:
            BackendError: unknown name; or an unreadable record without an intact config.json
                (the message says what was stopped and where the record went).
        """
        self._reap()
        try:
            rec = self._get(name)
        except CorruptRecord as e:
            return self._teardown_corrupt(name, e)
        if rec.terminated_at is not None:
            return self._status(rec)
        # the pid files too: a record edited by hand may name other PIDs than were started
        own = [*rec.replicas, *([rec.router] if rec.router is not None else [])]
        known = {(r.pid, r.start_ticks) for r in own}
        rpf = self._router_pid_file(name)
        extra = [pf for pf in [*self._pid_files(name), *([rpf] if rpf else [])]
                 if pf.created_at == rec.created_at and (pf.pid, pf.start_ticks) not in known]
        events = self._stop([*own, *extra], name)
        with self._store.locked():
            fresh = self._get(name)
            if fresh.terminated_at is None and fresh.created_at == rec.created_at:
                now = time.time()
                for r in [*fresh.replicas, *([fresh.router] if fresh.router else [])]:
                    _, rc = self._exit_of(r)
                    if r.exited_at is None:
                        r.exited_at = now
                    if r.exit_code is None:
                        r.exit_code = rc
                fresh.events += events
                router = " and the router" if fresh.router is not None else ""
                fresh.events.append(Event(t=now, type="Normal", reason="Stopped", object=name,
                                          message=f"{len(fresh.replicas)} replica(s)"
                                          f"{router} stopped"))
                fresh.terminated_at = now
                self._put(fresh)
                self._drop_pid_files(name)
        return self._status(self._get(name))

    def _teardown_corrupt(self, name: str, err: CorruptRecord) -> DeploymentStatus:
        """Teardown of a deployment whose record is unreadable; see :meth:`teardown`."""
        pids = self._pid_files(name)
        rpf = self._router_pid_file(name)
        t0 = time.time()
        stopped = self._stop([*pids, *([rpf] if rpf is not None else [])], name)
        with self._store.locked():
            try:
                read_record(self._store, name, _Record)
            except CorruptRecord:
                dest = self._store.set_aside(name)
            else:  # another process replaced the record meanwhile: a normal teardown
                return self.teardown(name)
            now = time.time()
            what = (f"the record {err.path} was unreadable ({err.reason}); moved aside to "
                    f"{dest}; stopped the replicas of its {len(pids)} pid file(s)")
            log.warning("teardown of %s: %s", name, what)
            try:
                config = ServingConfig.model_validate_json(
                    (self._folder(name) / "config.json").read_bytes())
            except (OSError, ValueError, ValidationError):
                config = None
            if config is None or not pids:
                self._drop_pid_files(name)
                raise BackendError(f"{what}; no intact config.json or pid file was left to "
                                   f"report a status from. {name!r} can be deployed again.")
            replicas = [_Replica(**{**pf.model_dump(exclude={"created_at"}),
                                    "index": i, "exited_at": now})
                        for i, pf in enumerate(pids)]
            rec = _Record(name=name, config=config, labels={},
                          created_at=min(pf.created_at for pf in pids), replicas=replicas,
                          health_path=self.health_path, ready_timeout_s=self.ready_timeout_s,
                          events=[Event(t=t0, type="Warning", reason="CorruptRecord",
                                        object=name, message=what), *stopped,
                                  Event(t=now, type="Normal", reason="Stopped", object=name,
                                        message=f"{len(replicas)} replica(s) stopped")],
                          terminated_at=now)
            self._put(rec)
            self._drop_pid_files(name)
        return self._status(rec)

    def _stop(self, replicas: list[_Replica], name: str = "") -> list[Event]:
        """Stop the replicas' process groups (see :func:`stop_groups`); events of what was done."""
        outcome = stop_groups([(r.pid, r.start_ticks, r.token) for r in replicas],
                              self.stop_grace_s, self._reap)
        events = []
        for r in replicas:
            o = outcome[r.pid]
            who = "router" if r.log == ROUTER_LOG else f"replica {r.index}"
            if o == "foreign":
                events.append(Event(
                    t=time.time(), type="Warning", reason="ForeignProcess", object=name,
                    message=f"{who}: pid {r.pid} is no longer the process group "
                    "leader servetune started (its start time or group differs); not signalled"))
            elif o == "unproven":
                events.append(Event(
                    t=time.time(), type="Warning", reason="ForeignProcess", object=name,
                    message=f"{who}: pid {r.pid} has exited and no process left in "
                    f"its process group carries the replica's {TOKEN_ENV}; not signalled"))
            elif o in ("terminated", "killed"):
                events.append(Event(t=time.time(), type="Normal", reason="Killing", object=name,
                                    message=f"{who}: SIGTERM to process group "
                                    f"{r.pid}"))
            if o == "killed":
                events.append(Event(
                    t=time.time(), type="Warning", reason="Killing", object=name,
                    message=f"{who}: still running {self.stop_grace_s:g} s after "
                    f"SIGTERM; SIGKILL to process group {r.pid}"))
        return events

    def list(self) -> list[DeploymentStatus]:
        """Every deployment in the namespace, oldest first (each looked at once).

        Unreadable records are skipped (logged; ``events()`` reports them).
        """
        out = []
        for rec in scan_records(self._store, _Record)[0]:
            try:
                out.append(self.status(rec.name))
            except CorruptRecord as e:  # broke between the scan and the look
                log.warning("skipping a deployment record: %s", e)
        return out

    def processes(self, name: str) -> builtins.list[int]:
        """PIDs of the replicas of ``name`` as started (for operators and tests)."""
        return [r.pid for r in self._get(name).replicas]
