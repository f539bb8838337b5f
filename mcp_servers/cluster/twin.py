"""The twin cluster backend: simulated SGLang deployments that answer at once.

Startup fails or succeeds exactly as :func:`domain.twin.startup.start` says, for every server
group of the config (a PD layout starts one prefill and one decode server config; the
deployment is Ready when both are, and its status lists each group with its layout, schedulers
and one rank's memory); a Ready deployment lists no endpoints and is simulated by the bench
server from :meth:`TwinBackend.ready_fit`
(a :class:`~mcp_servers.cluster.backend.SimulatedBackend`). Records live in memory or, with a
``state_dir``, as JSON files another process (the bench server of Claude Code) reads too.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from domain.config import ServingConfig
from domain.faults import DeployFault, FaultSpec
from domain.fit import FitReport
from domain.hardware import get_gpu
from domain.layout import layout_label, server_label
from domain.twin.injected import inject_startup
from domain.twin.startup import Startup, start
from mcp_servers.cluster.backend import (
    MAX_HISTORY,
    NAME_RE,
    BackendError,
    CorruptRecord,
    DeploymentStatus,
    Event,
    LogLine,
    Phase,
    ServerGroup,
    check_name,
    read_record,
    refuse_flag_values,
    require_record,
    scan_records,
    when,
)
from mcp_servers.cluster.store import RecordStore

log = logging.getLogger("servetune.cluster")


class _TwinRecord(BaseModel):
    name: str
    config: ServingConfig
    labels: dict[str, str]
    created_at: float
    terminated_at: float | None = None
    history: list[Event] = []  # events of earlier deployments of this name


class TwinBackend:
    """Simulated SGLang deployments: startup fails or succeeds exactly as :func:`start` says.

    A :class:`SimulatedBackend`: the bench server simulates its Ready deployments
    (:meth:`ready_fit`).

    Without ``state_dir`` the records live in memory (the headless study uses this). With it,
    each record is a JSON file under ``state_dir/twin/<namespace>/``, re-read on every call, so
    another process over the same folder (the bench server of Claude Code) sees the same
    deployments; the startup is recomputed from the config (:func:`start` is deterministic).

    ``faults`` (a study's ``faults``, :mod:`domain.faults`) makes a share of the launches that
    would be Ready fail instead (:func:`~domain.twin.injected.inject_startup`); launch ``n`` of
    a name (its earlier ``Created`` events) draws its fault from ``(seed, config id, n)``.
    ``injected`` lists what was injected.
    """

    kind = "twin"

    def __init__(self, namespace: str = "servetune", state_dir: Path | None = None,
                 faults: FaultSpec | None = None) -> None:
        if not NAME_RE.match(namespace):
            raise BackendError(f"namespace {namespace!r} is not a valid DNS-1123 label")
        self.namespace = namespace
        root = None if state_dir is None else state_dir / "twin" / namespace
        self._store = RecordStore(root)
        self._startups: dict[str, Startup] = {}
        self.faults = faults
        self.injected: list[dict[str, Any]] = []

    def _get(self, name: str) -> _TwinRecord:
        return require_record(self._store, name, _TwinRecord, self.namespace)

    def _server_startup(self, config: ServingConfig) -> Startup:
        """:func:`start` of one server config (deterministic, so cached)."""
        key = config.model_dump_json()
        if key not in self._startups:
            self._startups[key] = start(config)
        return self._startups[key]

    def _groups(self, config: ServingConfig) -> list[tuple[str, int, ServingConfig, Startup]]:
        """``(role, servers, server config, its startup)`` of every server group."""
        return [(role, n, c, self._server_startup(c)) for role, n, c in config.servers()]

    def _startup(self, config: ServingConfig) -> Startup:
        """How the whole deployment starts.

        Aggregated: its one server config's startup (every replica starts alike). PD: the
        first group that fails (prefill before decode), else Ready with the decode server's
        fit (the ``domain.fit`` contract: a PD config's report is the decode worker's), its
        log, and the slower group's startup time.
        """
        if config.pd is None:
            return self._server_startup(config)
        groups = self._groups(config)
        failed = next((s for _, _, _, s in groups if not s.ready), None)
        if failed is not None:
            return failed
        decode = groups[-1][3]
        return decode.model_copy(update={"startup_s": max(s.startup_s for *_, s in groups)})

    def _group_status(self, config: ServingConfig) -> list[ServerGroup]:
        out = []
        for role, n, c, s in self._groups(config):
            rep = s.fit if s.ready else None
            out.append(ServerGroup(
                role=role, servers=n, layout=server_label(c), gpus_per_server=c.gpus_per_server,
                nodes_per_server=c.nnodes(get_gpu(c.gpu).gpus_per_node),
                schedulers=c.schedulers, ready=s.ready, message="" if s.ready else s.reason,
                weights_gb_per_gpu=None if rep is None else round(
                    (rep.weight_bytes_per_gpu + rep.draft_weight_bytes_per_gpu) / 1e9, 3),
                kv_pool_gb_per_gpu=None if rep is None else round(rep.kv_pool_gb, 3),
                kv_tokens_per_scheduler=None if rep is None else rep.kv_tokens,
                max_running_requests_per_scheduler=None if rep is None
                else rep.max_running_requests))
        return out

    @staticmethod
    def _servers(config: ServingConfig) -> str:
        """'2 replica(s)' or, for a PD layout, '1 prefill + 1 decode server(s)'."""
        if config.pd is None:
            return f"{config.replicas} replica(s)"
        return (f"{config.pd.prefill.workers} prefill + {config.pd.decode.workers} decode "
                "server(s)")

    def _fault(self, d: _TwinRecord) -> tuple[DeployFault | None, int]:
        """The fault injected into deployment ``d`` (None: none) and its launch number."""
        attempt = sum(e.reason == "Created" for e in d.history)
        if self.faults is None or not self._startup(d.config).ready:
            return None, attempt
        return self.faults.deploy_fault(d.config.config_id(), attempt), attempt

    def _run(self, d: _TwinRecord) -> Startup:
        """How deployment ``d`` started: :func:`start` of its config, or its injected fault."""
        fault, _ = self._fault(d)
        s = self._startup(d.config)
        return s if fault is None else inject_startup(s, fault, d.config)

    def deploy(self, name: str, config: ServingConfig, labels: dict[str, str],
               wait_s: float = 0.0) -> DeploymentStatus:
        """Create deployment ``name``; all replicas start identically.

        ``wait_s`` is unused: the twin answers Ready or Failed at once.

        Raises:
            BackendError: invalid name, or the name is taken by a live deployment.
        """
        check_name(name, self.namespace)
        refuse_flag_values(config)
        with self._store.locked():
            old = read_record(self._store, name, _TwinRecord)
            if old is not None and old.terminated_at is None:
                raise BackendError(f"deployment {name!r} already exists; tear it down first")
            history = [] if old is None else self._events_of(old)[-MAX_HISTORY:]
            rec = _TwinRecord(name=name, config=config, labels=dict(labels),
                              created_at=time.time(), history=history)
            self._store.write(name, rec.model_dump(mode="json"))
        fault, attempt = self._fault(rec)
        if fault is not None:
            self.injected.append({"fault": fault, "name": name, "attempt": attempt,
                                  "config_id": config.config_id()})
        return self._status(rec)

    def _status(self, d: _TwinRecord) -> DeploymentStatus:
        s = self._run(d)
        phase: Phase = ("Terminated" if d.terminated_at is not None
                        else ("Ready" if s.ready else "Failed"))
        message = s.reason
        groups = self._group_status(d.config)
        bad = next((g for g in groups if not g.ready), None)
        if d.config.pd is not None and bad is not None and not s.ready:
            message = f"{bad.role} servers ({bad.layout}): {s.reason}"
        if d.terminated_at is not None:
            message = (f"torn down at {when(d.terminated_at)}; last log line: "
                       f"{s.log[-1] if s.log else ''}")
        return DeploymentStatus(
            name=d.name, namespace=self.namespace, phase=phase, replicas=d.config.replicas,
            ready_replicas=d.config.replicas if phase == "Ready" else 0, config=d.config,
            labels=d.labels, created_at=d.created_at,
            exit_code=None if s.ready or s.exit_code < 0 else s.exit_code,
            failed_stage=None if s.ready else s.phase, message=message, startup_s=s.startup_s,
            groups=groups)

    def status(self, name: str) -> DeploymentStatus:
        """Current status of ``name``. Raises BackendError if it does not exist."""
        return self._status(self._get(name))

    def logs(self, name: str, replica: int | None = None) -> list[LogLine]:
        """The server log of ``name``, every line stamped with the creation time.

        Every twin replica logs the same. A PD layout's replicas are its servers, prefill
        first: ``replica`` i picks that server's group log; by default the group that failed
        (else the decode group, whose fit the bench simulates).

        Raises:
            BackendError: unknown name or replica index.
        """
        d = self._get(name)
        if d.config.pd is None:
            if replica is not None and not 0 <= replica < d.config.replicas:
                raise BackendError(f"{name} has replicas 0..{d.config.replicas - 1}")
            return [LogLine(t=d.created_at, text=x) for x in self._run(d).log]
        groups = self._groups(d.config)
        total = sum(n for _, n, _, _ in groups)
        if replica is None or self._fault(d)[0] is not None:
            log = self._run(d).log
        elif 0 <= replica < total:
            first = groups[0][1]
            log = (groups[0] if replica < first else groups[1])[3].log
        else:
            raise BackendError(f"{name} has replicas 0..{total - 1} (its servers: prefill "
                               "first, then decode)")
        return [LogLine(t=d.created_at, text=x) for x in log]

    def events(self, name: str | None = None) -> list[Event]:
        """Created, then Ready or Failed, then Killing after a teardown; oldest first.

        Earlier deployments of a name keep their events. Without ``name``, an unreadable
        record adds a Warning event (reason CorruptRecord) naming its file.
        """
        bad: list[CorruptRecord] = []
        if name is not None:
            recs = [self._get(name)]
        else:
            recs, bad = scan_records(self._store, _TwinRecord)
        out = [e.event() for e in bad]
        for d in recs:
            out += self._events_of(d)
        return sorted(out, key=lambda e: e.t)

    def _events_of(self, d: _TwinRecord) -> list[Event]:
        s, n = self._run(d), d.config.replicas
        out = list(d.history)
        layout = "" if not d.config.pd else f" ({layout_label(d.config)})"
        out.append(Event(t=d.created_at, type="Normal", reason="Created", object=d.name,
                         message=f"{self._servers(d.config)} of config "
                                 f"{d.config.config_id()}{layout}"))
        if s.ready:
            out.append(Event(t=d.created_at, type="Normal", reason="Ready", object=d.name,
                             message=f"{n}/{n} replicas ready after {s.startup_s:.1f} s "
                             "(virtual time)"))
        else:
            out.append(Event(t=d.created_at, type="Warning", reason="Failed", object=d.name,
                             message=f"stage {s.phase}, exit code {s.exit_code}: "
                             f"{s.reason}"))
        if d.terminated_at is not None:
            out.append(Event(t=d.terminated_at, type="Normal", reason="Killing",
                             object=d.name, message=f"stopped {n} replica(s)"))
        return out

    def teardown(self, name: str) -> DeploymentStatus:
        """Stop ``name``; idempotent.

        An unreadable record is moved aside (the twin runs no processes), freeing the name.

        Raises:
            BackendError: it never existed; or its record was unreadable (the message says it
                was moved aside: there is no status to report).
        """
        with self._store.locked():
            try:
                d = self._get(name)
            except CorruptRecord as e:
                dest = self._store.set_aside(name)
                log.warning("moved the unreadable record %s aside to %s", e.path, dest)
                raise BackendError(
                    f"the record of deployment {name!r} was unreadable ({e.path}: {e.reason}); "
                    f"it was moved aside to {dest}. The twin runs no processes, so nothing "
                    f"else was left running; {name!r} can be deployed again.") from e
            if d.terminated_at is None:
                d.terminated_at = time.time()
                self._store.write(name, d.model_dump(mode="json"))
        return self._status(d)

    def list(self) -> list[DeploymentStatus]:
        """Every deployment this backend created, oldest first.

        Unreadable records are skipped (logged; ``events()`` reports them).
        """
        return [self._status(d) for d in scan_records(self._store, _TwinRecord)[0]]

    def ready_fit(self, name: str) -> tuple[ServingConfig, FitReport]:
        """Config and resolved memory layout of a Ready deployment (for the bench server).

        Raises:
            BackendError: if it is not Ready.
        """
        d = self._get(name)
        s = self._run(d)
        if d.terminated_at is not None or not s.ready or s.fit is None:
            raise BackendError(f"deployment {name!r} is not Ready; benchmark only Ready "
                               "deployments (check status first)")
        return d.config, s.fit
