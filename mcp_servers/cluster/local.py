"""Local-process cluster backend: every replica is a server process on 127.0.0.1.

``deploy`` starts ``config.replicas`` processes, each on a free port, in a new session (so each
leads its own process group), with stdout and stderr written to a log file under the state
folder. The argv is ``command`` with ``{host}``, ``{port}`` and ``{config_json}`` replaced in
every element (no shell ever parses it), or, without a command, the real SGLang server:
``config.to_sglang_args() + ['--host', host, '--port', port]``.

A replica is Ready when ``GET http://host:port{health_path}`` answers 200, and Failed when its
process exits (stage ``startup`` before Ready, ``serving`` after; the message is its last
non-empty log line) or when no replica answered within ``ready_timeout_s``.

``teardown`` sends SIGTERM to the process group of each recorded PID, then SIGKILL after
``stop_grace_s``, and only while that PID still has the start time recorded when it was started
(``/proc/PID/stat``): a PID the kernel handed to another process is never signalled. Processes
are never looked up or killed by name.

Records (:mod:`mcp_servers.cluster.store`) live under ``state_dir/local/<namespace>/``, so another
process over the same folder sees the deployments and can tear them down. Exit codes are known
to the process that started a server (it reaps it); others report None. Log lines carry the
time a reader first saw them on disk (the log file's mtime at that read), so ``since_s`` is as
precise as the polling.
"""

from __future__ import annotations

import ipaddress
import os
import shlex
import subprocess
import threading
import time
from pathlib import Path

import httpx
from pydantic import BaseModel

from domain.config import ServingConfig
from mcp_servers.cluster import logfile
from mcp_servers.cluster.backend import (
    NAME_RE,
    BackendError,
    DeploymentStatus,
    Event,
    LogLine,
    Phase,
    check_name,
    refuse_flag_values,
    settle,
)
from mcp_servers.cluster.procs import free_ports, proc_stat, running, stop_groups
from mcp_servers.cluster.store import RecordStore, write_atomic

MAX_MARKS = 1000  # per replica; beyond, every other mark is dropped


class _Replica(BaseModel):
    index: int
    pid: int
    start_ticks: int  # /proc/PID/stat field 22: tells this process from a later one with its PID
    port: int
    url: str  # base URL, e.g. http://127.0.0.1:31001
    argv: list[str]
    log: str  # file name in the deployment's folder
    started_at: float
    ready_at: float | None = None
    exited_at: float | None = None
    exit_code: int | None = None
    marks: list[logfile.Mark] = []  # stamps of the log's lines (see logfile)


class _Record(BaseModel):
    name: str
    config: ServingConfig
    labels: dict[str, str]
    created_at: float
    replicas: list[_Replica]
    health_path: str = "/health"  # the deploying backend's settings, which every reader uses
    ready_timeout_s: float = 600.0
    events: list[Event] = []
    gave_up_at: float | None = None
    terminated_at: float | None = None


class LocalProcessBackend:
    """Deployments as local server processes; see the module docstring."""

    kind = "local"

    def __init__(self, namespace: str, state_dir: Path, command: list[str] | None = None,
                 host: str = "127.0.0.1", ready_timeout_s: float = 600.0,
                 health_path: str = "/health", stop_grace_s: float = 15.0,
                 visible_devices: list[str] | None = None) -> None:
        """Build the backend.

        Args:
            namespace: DNS-1123 label; records go to ``state_dir/local/<namespace>/``.
            state_dir: folder shared by every server process of one user.
            command: server argv template (``{host}``, ``{port}``, ``{config_json}``), or None
                for ``sglang serve`` with the config's flags.
            host: loopback address the servers bind.
            ready_timeout_s: a deployment with a replica not Ready after this long is Failed.
            health_path: path that answers 200 once a server is ready.
            stop_grace_s: seconds between SIGTERM and SIGKILL at teardown.
            visible_devices: GPU ids; replica ``i`` gets ``CUDA_VISIBLE_DEVICES`` =
                ids ``[i*tp_size, (i+1)*tp_size)``. None: the environment's, unchanged.

        Raises:
            BackendError: bad namespace, empty command, non-loopback host, bad health path.
        """
        if not NAME_RE.match(namespace):
            raise BackendError(f"namespace {namespace!r} is not a valid DNS-1123 label")
        if command is not None and not command:
            raise BackendError("command must name a program (or be None for sglang serve)")
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise BackendError(f"host {host!r}: the local backend only binds loopback addresses")
        if not health_path.startswith("/"):
            raise BackendError(f"health_path {health_path!r} must start with '/'")
        self.namespace = namespace
        self.command = list(command) if command is not None else None
        self.host, self.health_path = host, health_path
        self.ready_timeout_s, self.stop_grace_s = ready_timeout_s, stop_grace_s
        self.visible_devices = visible_devices
        self._store = RecordStore(state_dir / "local" / namespace)
        # servers this process started, by (pid, start ticks): only a parent can reap a child
        # and learn its exit code; Popen caches the code once reaped.
        self._children: dict[tuple[int, int], subprocess.Popen[bytes]] = {}
        self._children_lock = threading.Lock()

    # ----- records ---------------------------------------------------------------------------

    def _get(self, name: str) -> _Record:
        raw = self._store.read(name) if NAME_RE.match(name) else None
        if raw is None:
            known = ", ".join(sorted(self._store.names())) or "none"
            raise BackendError(f"no deployment {name!r} in namespace {self.namespace}; "
                               f"existing: {known}. Call list_deployments to see them.")
        return _Record.model_validate(raw)

    def _put(self, rec: _Record) -> None:
        self._store.write(rec.name, rec.model_dump(mode="json"))

    def _records(self) -> list[_Record]:
        recs = [self._store.read(n) for n in self._store.names()]
        return sorted((_Record.model_validate(r) for r in recs if r is not None),
                      key=lambda d: d.created_at)

    # ----- processes -------------------------------------------------------------------------

    def _url(self, port: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{port}"

    def _argv(self, config: ServingConfig, port: int, config_json: Path) -> list[str]:
        if self.command is None:
            return config.to_sglang_args() + ["--host", self.host, "--port", str(port)]
        subs = {"{host}": self.host, "{port}": str(port), "{config_json}": str(config_json)}
        out = []
        for arg in self.command:
            for key, value in subs.items():
                arg = arg.replace(key, value)
            out.append(arg)
        return out

    def _env(self, config: ServingConfig, index: int) -> dict[str, str] | None:
        if self.visible_devices is None:
            return None
        tp = config.tp_size
        ids = self.visible_devices[index * tp:(index + 1) * tp]
        return {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(ids)}

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
        return self._store.folder(name) / r.log

    def _last_line(self, name: str, r: _Replica) -> str:
        return logfile.last_line(self._log_path(name, r))

    # ----- protocol --------------------------------------------------------------------------

    def deploy(self, name: str, config: ServingConfig, labels: dict[str, str],
               wait_s: float = 0.0) -> DeploymentStatus:
        """Start ``config.replicas`` server processes as ``name``; wait up to ``wait_s`` s.

        Raises:
            BackendError: invalid name or config, the name is taken by a live deployment, too
                few visible devices, or the server program cannot be started.
            UnknownFlag: the config has a flag this SGLang version lacks (no command given).
        """
        check_name(name, self.namespace)
        refuse_flag_values(config)
        if self.visible_devices is not None and \
                len(self.visible_devices) < config.gpus:
            raise BackendError(f"{name} needs {config.gpus} GPUs (tp_size x replicas) but the "
                               f"backend has {len(self.visible_devices)} visible devices")
        self._reap()
        with self._store.locked():
            old = self._store.read(name)
            if old is not None and old.get("terminated_at") is None:
                raise BackendError(f"deployment {name!r} already exists; tear it down first")
            folder = self._store.folder(name)
            config_json = folder / "config.json"
            write_atomic(config_json, config.model_dump_json(indent=1))
            created = time.time()
            events = [Event(t=created, type="Normal", reason="Created", object=name,
                            message=f"{config.replicas} replica(s) of config "
                            f"{config.config_id()}")]
            ports = free_ports(config.replicas, self.host)
            argvs = [self._argv(config, port, config_json) for port in ports]
            replicas: list[_Replica] = []
            try:
                for i, (port, argv) in enumerate(zip(ports, argvs, strict=True)):
                    log = f"replica-{i}.log"
                    with open(folder / log, "wb") as out:
                        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                             stderr=subprocess.STDOUT, start_new_session=True,
                                             env=self._env(config, i))
                    st = proc_stat(p.pid)  # a child stays in /proc (zombie) until reaped
                    ticks = st.start_ticks if st is not None else -1
                    with self._children_lock:
                        self._children[(p.pid, ticks)] = p
                    now = time.time()
                    replicas.append(_Replica(index=i, pid=p.pid, start_ticks=ticks, port=port,
                                             url=self._url(port), argv=argv, log=log,
                                             started_at=now))
                    events.append(Event(t=now, type="Normal", reason="Started", object=name,
                                        message=f"replica {i}: pid {p.pid}, "
                                        f"{self._url(port)}: {shlex.join(argv)[:400]}"))
            except OSError as e:
                self._stop(replicas)
                raise BackendError(f"could not start {argvs[0][0]!r} for {name}: {e}. Install "
                                   "the server program or configure the backend's "
                                   "command") from e
            self._put(_Record(name=name, config=config, labels=dict(labels),
                              created_at=created, replicas=replicas,
                              health_path=self.health_path,
                              ready_timeout_s=self.ready_timeout_s, events=events))
        return settle(self, name, wait_s)

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
            if (mark := logfile.growth(self._log_path(rec.name, r), r.marks)) is not None:
                marks[r.index] = mark
        now = time.time()
        timed_out = (rec.gave_up_at is None and not exits and
                     now - rec.created_at > rec.ready_timeout_s and
                     any(r.ready_at is None for r in rec.replicas if r.index not in ready))
        if not (exits or ready or marks or timed_out):
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
            if timed_out and rec.gave_up_at is None:
                rec.gave_up_at = now
                rec.events.append(Event(
                    t=now, type="Warning", reason="Unhealthy", object=rec.name,
                    message=f"not every replica answered 200 on {rec.health_path} within "
                    f"{rec.ready_timeout_s:g} s; tear it down"))
            self._put(rec)
        return rec

    def _status(self, rec: _Record) -> DeploymentStatus:
        live_ready = [r for r in rec.replicas if r.ready_at is not None and r.exited_at is None]
        exited = [r for r in rec.replicas if r.exited_at is not None]
        exit_code, stage, startup_s = None, None, 0.0
        phase: Phase
        if rec.terminated_at is not None:
            phase, message = "Terminated", "torn down"
            live_ready = []
        elif exited:
            first = min(exited, key=lambda r: r.exited_at or 0.0)
            phase, exit_code = "Failed", first.exit_code
            stage = "startup" if first.ready_at is None else "serving"
            message = self._last_line(rec.name, first)
        elif rec.gave_up_at is not None:
            waiting = next(r for r in rec.replicas if r.ready_at is None)
            phase, stage = "Failed", "startup"
            message = (f"replica {waiting.index} not ready after {rec.ready_timeout_s:g} s; "
                       f"last log line: {self._last_line(rec.name, waiting)}")
        elif len(live_ready) == len(rec.replicas):
            phase = "Ready"
            startup_s = max(r.ready_at or 0.0 for r in live_ready) - rec.created_at
            message = self._last_line(rec.name, rec.replicas[0])
        else:
            phase = "Pending"
            waiting = next(r for r in rec.replicas if r.ready_at is None)
            message = self._last_line(rec.name, waiting)
        return DeploymentStatus(
            name=rec.name, namespace=self.namespace, phase=phase, replicas=len(rec.replicas),
            ready_replicas=len(live_ready), config=rec.config, labels=rec.labels,
            endpoints=[r.url for r in live_ready] if phase in ("Ready", "Pending")
            else [], created_at=rec.created_at, exit_code=exit_code, failed_stage=stage,
            message=message, startup_s=round(startup_s, 3))

    def logs(self, name: str, replica: int | None = None) -> list[LogLine]:
        """Log of one replica of ``name`` (the last 8 MiB).

        ``replica`` picks it; by default the first replica that failed, else replica 0.

        Raises:
            BackendError: unknown name or replica index.
        """
        rec = self._get(name)
        if replica is not None:
            if not 0 <= replica < len(rec.replicas):
                raise BackendError(f"{name} has replicas 0..{len(rec.replicas) - 1}")
            r = rec.replicas[replica]
        else:
            # a replica that failed before any teardown (teardown stamps the others)
            exited = [x for x in rec.replicas if x.exited_at is not None and
                      (rec.terminated_at is None or x.exited_at < rec.terminated_at)]
            r = min(exited, key=lambda x: x.exited_at or 0.0) if exited else rec.replicas[0]
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

    def events(self, name: str | None = None) -> list[Event]:
        """Recorded events of ``name`` (or of every deployment), oldest first."""
        recs = [self._get(name)] if name is not None else self._records()
        return sorted((e for rec in recs for e in rec.events), key=lambda e: e.t)

    def teardown(self, name: str) -> DeploymentStatus:
        """Stop every replica of ``name`` (SIGTERM, SIGKILL after ``stop_grace_s``); idempotent.

        Only process groups whose leader still has the recorded PID and start time are
        signalled; a recycled PID gets a ForeignProcess event instead.

        Raises:
            BackendError: unknown name.
        """
        self._reap()
        rec = self._get(name)
        if rec.terminated_at is not None:
            return self._status(rec)
        events = self._stop(rec.replicas, name)
        with self._store.locked():
            fresh = self._get(name)
            if fresh.terminated_at is None and fresh.created_at == rec.created_at:
                now = time.time()
                for r in fresh.replicas:
                    _, rc = self._exit_of(r)
                    if r.exited_at is None:
                        r.exited_at = now
                    if r.exit_code is None:
                        r.exit_code = rc
                fresh.events += events
                fresh.events.append(Event(t=now, type="Normal", reason="Stopped", object=name,
                                          message=f"{len(fresh.replicas)} replica(s) stopped"))
                fresh.terminated_at = now
                self._put(fresh)
        return self._status(self._get(name))

    def _stop(self, replicas: list[_Replica], name: str = "") -> list[Event]:
        """Stop the replicas' process groups (see :func:`stop_groups`); events of what was done."""
        outcome = stop_groups([(r.pid, r.start_ticks) for r in replicas], self.stop_grace_s,
                              self._reap)
        events = []
        for r in replicas:
            o = outcome[r.pid]
            if o == "foreign":
                events.append(Event(
                    t=time.time(), type="Warning", reason="ForeignProcess", object=name,
                    message=f"replica {r.index}: pid {r.pid} is no longer the process group "
                    "leader servetune started (its start time or group differs); not signalled"))
            elif o in ("terminated", "killed"):
                events.append(Event(t=time.time(), type="Normal", reason="Killing", object=name,
                                    message=f"replica {r.index}: SIGTERM to process group "
                                    f"{r.pid}"))
            if o == "killed":
                events.append(Event(
                    t=time.time(), type="Warning", reason="Killing", object=name,
                    message=f"replica {r.index}: still running {self.stop_grace_s:g} s after "
                    f"SIGTERM; SIGKILL to process group {r.pid}"))
        return events

    def list(self) -> list[DeploymentStatus]:
        """Every deployment in the namespace, oldest first (each looked at once)."""
        return [self.status(rec.name) for rec in self._records()]

    def processes(self, name: str) -> list[int]:
        """PIDs of the replicas of ``name`` as started (for operators and tests)."""
        return [r.pid for r in self._get(name).replicas]
