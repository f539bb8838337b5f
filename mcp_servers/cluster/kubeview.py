"""Reading Kubernetes objects for the Kubernetes backend: pods, log lines, events, timestamps.

Pure functions over the API's dicts (camelCase, as :class:`~mcp_servers.cluster.kubeapi.KubeApi`
returns them), so the backend's phase logic can be tested with hand-written pods.

A pod's container has *failed* when it terminated (any exit code: SGLang is a server and never
exits on purpose), restarted after a termination (``lastState.terminated``; the pod may be
Running again), or waits for a reason that does not clear by itself (:data:`STUCK_WAITING`,
e.g. ``CrashLoopBackOff``, ``ImagePullBackOff``). An init container fails only on a non-zero exit
or a stuck wait. A pod the scheduler cannot place is not failed, but ``unschedulable_since``
tells the backend how long it has waited.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from mcp_servers.cluster.backend import Event, LogLine

# Waiting reasons of a container that persist until someone changes the manifest or the node.
STUCK_WAITING = frozenset({
    "CrashLoopBackOff", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
})
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)\s?(.*)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def parse_time(value: Any) -> float | None:
    """An RFC 3339 timestamp (``2026-05-01T12:00:00Z``, fractions of any length) as epoch s."""
    if not isinstance(value, str) or not value:
        return None
    m = _STAMP.match(value + " ")
    if m is None:
        return None
    frac = (m.group(2) or ".0")[:7]  # datetime takes at most microseconds
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    try:
        return datetime.fromisoformat(f"{m.group(1)}{frac}{zone}").timestamp()
    except ValueError:
        return None


def log_lines(text: str, default_t: float) -> list[LogLine]:
    """A ``timestamps=True`` pod log as lines; a line without a stamp takes the previous one's.

    Carriage-return rewrites (progress bars) keep their last part; ANSI colours are removed.
    """
    out: list[LogLine] = []
    t = default_t
    for raw in text.split("\n"):  # not splitlines(): a '\r' rewrites a line, it ends none
        if not raw.strip():
            continue
        m = _STAMP.match(raw)
        body = raw
        if m is not None:
            stamp = parse_time(raw.split(" ", 1)[0])
            t = stamp if stamp is not None else t
            body = m.group(4)
        body = _ANSI.sub("", body.rstrip("\r").split("\r")[-1]).rstrip()
        out.append(LogLine(t=t, text=body))
    return out


def selector(labels: dict[str, str]) -> str:
    """An equality label selector (``k=v,k2=v2``, keys sorted)."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


@dataclass
class Failure:
    """Why a pod's container failed (see the module docstring).

    Attributes:
        container: the container's name.
        reason: ``OOMKilled``, ``Error``, ``CrashLoopBackOff (last: OOMKilled)``, ``Evicted``...
        exit_code: its last exit code (None when it never ran, e.g. an image pull failure).
        previous: its log is the previous instance's (it has restarted since).
        detail: the kubelet's message or the termination message ('' if none).
        at: when it terminated, epoch s (None if unknown).
    """

    container: str
    reason: str
    exit_code: int | None
    previous: bool
    detail: str = ""
    at: float | None = None

    def line(self) -> str:
        """One line: ``container sglang: OOMKilled, exit code 137``."""
        code = f", exit code {self.exit_code}" if self.exit_code is not None else ""
        more = f" ({self.detail})" if self.detail else ""
        return f"container {self.container}: {self.reason}{code}{more}"


@dataclass
class PodView:
    """What the backend needs to know about one pod."""

    name: str
    uid: str
    ip: str | None
    created: float
    ready: bool
    ready_at: float | None
    terminating: bool
    started: bool  # some container has run (so it has a log)
    main: str  # the first container's name (SGLang)
    labels: dict[str, str]
    owners: list[str] = field(default_factory=list)
    failure: Failure | None = None
    waiting: str = ""  # why it is not Ready yet, for a Pending message
    unschedulable_since: float | None = None


def _d(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _terminated(cs: dict[str, Any], key: str) -> dict[str, Any] | None:
    t = _d(_d(cs.get(key)).get("terminated"))
    return t or None


def _container_failure(cs: dict[str, Any], init: bool) -> Failure | None:
    name = str(cs.get("name", "?"))
    state = _d(cs.get("state"))
    waiting = _d(state.get("waiting"))
    now_t, last_t = _terminated(cs, "state"), _terminated(cs, "lastState")
    if now_t is not None and not (init and now_t.get("exitCode") == 0):
        return Failure(name, str(now_t.get("reason") or "Terminated"), now_t.get("exitCode"),
                       False, str(now_t.get("message") or "").strip()[-500:],
                       parse_time(now_t.get("finishedAt")))
    if waiting.get("reason") in STUCK_WAITING:
        reason = str(waiting["reason"])
        if last_t is not None:
            reason += f" (last: {last_t.get('reason') or 'Terminated'})"
            return Failure(name, reason, last_t.get("exitCode"), True,
                           str(waiting.get("message") or "").strip()[-500:],
                           parse_time(last_t.get("finishedAt")))
        return Failure(name, reason, None, False, str(waiting.get("message") or "")[-500:])
    if last_t is not None and not init:  # restarted and running again
        return Failure(name, str(last_t.get("reason") or "Terminated"), last_t.get("exitCode"),
                       True, str(last_t.get("message") or "").strip()[-500:],
                       parse_time(last_t.get("finishedAt")))
    return None


def pod_view(pod: dict[str, Any]) -> PodView:
    """The :class:`PodView` of a pod dict."""
    meta, spec, status = _d(pod.get("metadata")), _d(pod.get("spec")), _d(pod.get("status"))
    conds = {c.get("type"): _d(c) for c in status.get("conditions") or [] if isinstance(c, dict)}
    ready_c = conds.get("Ready", {})
    ready = ready_c.get("status") == "True"
    containers = spec.get("containers") or [{}]
    v = PodView(name=str(meta.get("name", "")), uid=str(meta.get("uid", meta.get("name", ""))),
                ip=status.get("podIP"), created=parse_time(meta.get("creationTimestamp")) or 0.0,
                ready=ready, ready_at=parse_time(ready_c.get("lastTransitionTime")) if ready
                else None, terminating=bool(meta.get("deletionTimestamp")), started=False,
                main=str(_d(containers[0]).get("name", "")), labels=dict(meta.get("labels") or {}),
                owners=[str(o.get("name")) for o in meta.get("ownerReferences") or []
                        if isinstance(o, dict)])
    sched = conds.get("PodScheduled", {})
    if sched.get("status") == "False":
        v.waiting = f"{sched.get('reason') or 'NotScheduled'}: {sched.get('message') or ''}"
        if sched.get("reason") == "Unschedulable":
            v.unschedulable_since = parse_time(sched.get("lastTransitionTime")) or v.created
    for init, key in ((True, "initContainerStatuses"), (False, "containerStatuses")):
        for cs in status.get(key) or []:
            cs = _d(cs)
            st = _d(cs.get("state"))
            if st.get("running") or st.get("terminated") or _d(cs.get("lastState")).get(
                    "terminated"):
                v.started = True
            f = _container_failure(cs, init)
            if f is not None and v.failure is None:
                v.failure = f
            w = _d(st.get("waiting"))
            if w and not v.waiting:
                v.waiting = f"container {cs.get('name')}: {w.get('reason') or 'Waiting'}" + (
                    f": {w['message']}" if w.get("message") else "")
    if status.get("phase") == "Failed" and v.failure is None:  # evicted, deadline exceeded
        v.failure = Failure(v.main, str(status.get("reason") or "PodFailed"), None, False,
                            str(status.get("message") or ""))
    if not v.waiting and not ready:
        v.waiting = f"pod {status.get('phase') or 'Pending'}, not Ready yet"
    return v


def to_event(ev: dict[str, Any], deployment: str) -> Event:
    """A core/v1 Event as an :class:`Event` of ``deployment`` (the object's kind/name leads)."""
    inv = _d(ev.get("involvedObject"))
    t = (parse_time(ev.get("lastTimestamp")) or parse_time(ev.get("eventTime")) or
         parse_time(ev.get("firstTimestamp")) or
         parse_time(_d(ev.get("metadata")).get("creationTimestamp")) or 0.0)
    count = ev.get("count") or _d(ev.get("series")).get("count") or 1
    msg = f"{inv.get('kind', '?')}/{inv.get('name', '?')}: {str(ev.get('message') or '').strip()}"
    if isinstance(count, int) and count > 1:
        msg += f" (x{count})"
    return Event(t=t, type="Warning" if ev.get("type") == "Warning" else "Normal",
                 reason=str(ev.get("reason") or "Unknown"), object=deployment, message=msg)
