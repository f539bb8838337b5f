"""A fake Kubernetes API at the Kubernetes backend's seam (:class:`KubeApi`), with scripted pods.

``FakeKubeApi`` keeps objects in a dict, applies like server-side apply does for a single field
manager that always sends whole objects (the stored object becomes the applied one; uid,
creationTimestamp and status are kept; ``resourceVersion`` and ``generation`` change only when
labels, annotations or spec change), and plays the controllers: a Deployment gets
``spec.replicas`` pods, a LeaderWorkerSet ``replicas x size`` pods with the LWS labels. Each
deployment's pods follow a scripted :class:`Fate`, advanced by one step each time the pods are
listed (one ``status`` poll), so tests never sleep.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from mcp_servers.cluster.kubeapi import KubeApiError

T0 = 1_780_000_000.0  # 2026-05-28, epoch s


class Clock:
    """Epoch seconds under test control."""

    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def stamp(t: float, nanos: bool = False) -> str:
    """RFC 3339 as the API writes it (seconds), or as pod logs do (nanoseconds)."""
    d = datetime.fromtimestamp(t, UTC)
    if nanos:
        return d.strftime("%Y-%m-%dT%H:%M:%S.") + f"{d.microsecond:06d}000Z"
    return d.strftime("%Y-%m-%dT%H:%M:%SZ")


READY_LOG = ["[2026-05-28 10:00:01] server_args=ServerArgs(model_path='nvidia/GLM-5-NVFP4')",
             "[2026-05-28 10:00:09] Load weight end. mem usage=58.20 GB",
             "[2026-05-28 10:01:30] The server is fired up and ready to roll!"]


@dataclass
class Fate:
    """What happens to every engine pod of a deployment, step by step.

    Attributes:
        kind: ``ready``; ``crash`` (the container exits with ``exit_code`` after printing
            ``log``, then CrashLoopBackOff); ``oom`` (OOMKilled, exit code 137); ``unschedulable``
            (the scheduler never places it; ``message`` is its reason); ``image`` (the image
            cannot be pulled); ``serve_then_crash`` (Ready for ``after`` polls, then a crash).
        after: polls of Pending (ContainerCreating) before the fate shows.
    """

    kind: Literal["ready", "crash", "oom", "unschedulable", "image", "serve_then_crash"] = "ready"
    after: int = 1
    exit_code: int = 1
    log: list[str] = field(default_factory=lambda: list(READY_LOG))
    message: str = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."


def _match(labels: dict[str, str], sel: str | None) -> bool:
    if not sel:
        return True
    for term in sel.split(","):
        k, _, v = term.partition("=")
        if labels.get(k) != v:
            return False
    return True


class FakeKubeApi:
    """In-memory :class:`~mcp_servers.cluster.kubeapi.KubeApi` for one namespace."""

    def __init__(self, namespace: str = "team-a", clock: Clock | None = None) -> None:
        self.namespace = namespace
        self.clock = clock or Clock()
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.fates: dict[str, Fate] = {}  # by servetune.io/deployment
        self.calls: list[tuple[str, ...]] = []
        self.refuse: dict[tuple[str, str], KubeApiError] = {}  # (verb, kind) -> error
        self.served: set[str] = {"v1", "apps/v1", "leaderworkerset.x-k8s.io/v1"}
        self._events: list[dict[str, Any]] = []
        self._polls: dict[str, int] = {}  # pod name -> list calls seen
        self._uid = 0

    # ----- helpers ----------------------------------------------------------------------

    def _check(self, verb: str, api_version: str, kind: str) -> None:
        self.calls.append((verb, kind))
        if (verb, kind) in self.refuse:
            raise self.refuse[(verb, kind)]
        if api_version not in self.served:
            raise KubeApiError(0, "KindNotServed", f"the cluster serves no {kind} in "
                               f"{api_version}")

    def _next_uid(self) -> str:
        self._uid += 1
        return f"uid-{self._uid:04d}"

    def event(self, kind: str, name: str, reason: str, message: str,
              type_: str = "Normal") -> None:
        """Record a core/v1 Event about ``kind/name``."""
        self._events.append({"apiVersion": "v1", "kind": "Event",
                             "metadata": {"name": f"{name}.{len(self._events)}",
                                          "namespace": self.namespace},
                             "involvedObject": {"kind": kind, "name": name},
                             "reason": reason, "message": message, "type": type_,
                             "lastTimestamp": stamp(self.clock()), "count": 1})

    def pods(self, deployment: str | None = None) -> list[dict[str, Any]]:
        """Pods stored now (of one deployment)."""
        return [o for (_, k, _), o in self.objects.items() if k == "Pod" and
                (deployment is None or
                 o["metadata"]["labels"].get("servetune.io/deployment") == deployment)]

    # ----- KubeApi ------------------------------------------------------------------------

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply of a whole object by the only field manager."""
        self._check("apply", obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        if meta.get("namespace", self.namespace) != self.namespace:
            raise KubeApiError(400, "BadRequest", "the namespace of the provided object does "
                               "not match the namespace sent on the request")
        key = (obj["apiVersion"], obj["kind"], meta["name"])
        new = copy.deepcopy(obj)
        new["metadata"]["namespace"] = self.namespace
        old = self.objects.get(key)
        if old is None:
            new["metadata"].update(uid=self._next_uid(), creationTimestamp=stamp(self.clock()),
                                   resourceVersion="1", generation=1)
            self.objects[key] = new
            self.event(obj["kind"], meta["name"], "Applied", "created by servetune")
            return copy.deepcopy(new)
        if any(old["metadata"].get(f) != new["metadata"].get(f)
               for f in ("labels", "annotations")) or old.get("spec") != new.get("spec"):
            for f in ("uid", "creationTimestamp", "generation", "resourceVersion"):
                new["metadata"][f] = old["metadata"][f]
            new["metadata"]["resourceVersion"] = str(int(old["metadata"]["resourceVersion"]) + 1)
            new["metadata"]["generation"] = old["metadata"]["generation"] + 1
            if "status" in old:
                new["status"] = old["status"]
            self.objects[key] = new
        return copy.deepcopy(self.objects[key])

    def get(self, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        """A copy of the object, or None."""
        self._check("get", api_version, kind)
        o = self.objects.get((api_version, kind, name))
        return copy.deepcopy(o) if o is not None else None

    def list(self, api_version: str, kind: str, selector: str | None = None
             ) -> list[dict[str, Any]]:
        """Objects matching ``selector``; listing Pods runs the controllers and the fates."""
        self._check("list", api_version, kind)
        if kind == "Pod":
            self._reconcile()
        return [copy.deepcopy(o) for (a, k, _), o in sorted(self.objects.items())
                if (a, k) == (api_version, kind) and
                _match(o["metadata"].get("labels") or {}, selector)]

    def delete(self, api_version: str, kind: str, name: str) -> None:
        """Delete the object; its pods go at once (garbage collection)."""
        self._check("delete", api_version, kind)
        self.objects.pop((api_version, kind, name), None)
        for key, o in list(self.objects.items()):
            if key[1] == "Pod" and o["metadata"].get("ownerName") == name:
                del self.objects[key]

    def pod_logs(self, pod: str, container: str | None = None, tail: int = 10_000,
                 previous: bool = False) -> str:
        """The scripted log, stamped one second apart from the pod's creation."""
        self.calls.append(("logs", pod))
        o = self.objects.get(("v1", "Pod", pod))
        if o is None:
            raise KubeApiError(404, "NotFound", f'pods "{pod}" not found')
        fate = self.fates.get(o["metadata"]["labels"].get("servetune.io/deployment", ""),
                              Fate())
        cs = (o["status"].get("containerStatuses") or [{}])[0]
        crashed = bool(cs.get("lastState", {}).get("terminated"))
        if previous and not crashed:
            raise KubeApiError(400, "BadRequest", "previous terminated container \"sglang\" in "
                               f'pod "{pod}" not found')
        if not crashed and "running" not in cs.get("state", {}):
            raise KubeApiError(400, "BadRequest", f'container "sglang" in pod "{pod}" is '
                               "waiting to start: ContainerCreating")
        t0 = float(o["metadata"]["t"])
        out = [f"{stamp(t0 + i + 1, nanos=True)} {line}" for i, line in enumerate(fate.log)]
        return "".join(x + "\n" for x in out[-tail:])

    def events(self, field_selector: str | None = None) -> list[dict[str, Any]]:
        """Every Event (``field_selector`` is not used by the backend)."""
        self._check("list", "v1", "Event")
        return copy.deepcopy(self._events)

    # ----- controllers ----------------------------------------------------------------------

    def _reconcile(self) -> None:
        for (_, kind, name), o in list(self.objects.items()):
            if kind == "Deployment":
                tmpl = o["spec"]["template"]
                rs = f"{name}-{hashlib.sha256(name.encode()).hexdigest()[:9]}"
                for i in range(o["spec"].get("replicas", 1)):
                    self._pod(f"{rs}-{i:05d}", tmpl, name, rs, {})
            elif kind == "LeaderWorkerSet":
                lwt = o["spec"]["leaderWorkerTemplate"]
                for g in range(o["spec"].get("replicas", 1)):
                    for w in range(lwt.get("size", 1)):
                        tmpl = lwt["leaderTemplate"] if w == 0 else lwt["workerTemplate"]
                        pod = f"{name}-{g}" if w == 0 else f"{name}-{g}-{w}"
                        self._pod(pod, tmpl, name, f"{name}-{g}" if w else name, {
                            "leaderworkerset.sigs.k8s.io/name": name,
                            "leaderworkerset.sigs.k8s.io/group-index": str(g),
                            "leaderworkerset.sigs.k8s.io/worker-index": str(w)})
        for o in self.pods():
            self._advance(o)

    def _pod(self, name: str, tmpl: dict[str, Any], owner: str, rs: str,
             extra: dict[str, str]) -> None:
        key = ("v1", "Pod", name)
        if key in self.objects:
            return
        self.objects[key] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": self.namespace, "uid": self._next_uid(),
                         "creationTimestamp": stamp(self.clock()), "t": self.clock(),
                         "labels": {**tmpl["metadata"]["labels"], **extra},
                         "ownerName": owner,
                         "ownerReferences": [{"kind": "ReplicaSet", "name": rs}]},
            "spec": copy.deepcopy(tmpl["spec"]),
            "status": {"phase": "Pending", "conditions": []}}
        self._polls[name] = -1

    def _advance(self, o: dict[str, Any]) -> None:
        name = o["metadata"]["name"]
        labels = o["metadata"]["labels"]
        fate = self.fates.get(labels.get("servetune.io/deployment", ""), Fate())
        if labels.get("servetune.io/component") == "router":
            fate = Fate()
        self._polls[name] += 1
        n = self._polls[name]
        now = stamp(self.clock())
        created = o["metadata"]["creationTimestamp"]
        st: dict[str, Any] = {"phase": "Pending", "podIP": None}
        sched = {"type": "PodScheduled", "status": "True", "lastTransitionTime": created}
        cs: dict[str, Any] = {"name": "sglang", "restartCount": 0, "ready": False,
                              "state": {"waiting": {"reason": "ContainerCreating"}}}
        ready = {"type": "Ready", "status": "False", "lastTransitionTime": created}
        if fate.kind == "unschedulable":
            sched = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": fate.message, "lastTransitionTime": created}
            if n == 0:
                self.event("Pod", name, "FailedScheduling", fate.message, "Warning")
            st["conditions"] = [sched]
            o["status"] = st
            return
        ip = f"10.0.0.{int(o['metadata']['uid'][-4:])}"
        crash_at = fate.after if fate.kind != "serve_then_crash" else 2 * fate.after
        if n >= fate.after:
            st.update(phase="Running", podIP=ip)
            if fate.kind in ("ready", "serve_then_crash") and n < crash_at or \
                    fate.kind == "ready":
                old = next((c["lastTransitionTime"] for c in o["status"].get("conditions", [])
                            if c["type"] == "Ready" and c["status"] == "True"), None)
                ready = {"type": "Ready", "status": "True", "lastTransitionTime": old or now}
                cs.update(ready=True, state={"running": {"startedAt": created}})
                if old is None:
                    self.event("Pod", name, "Started", "Started container sglang")
            elif fate.kind == "image":
                st["podIP"] = None
                cs["state"] = {"waiting": {"reason": "ImagePullBackOff", "message":
                                           'Back-off pulling image "lmsysorg/sglang:v0.5.23"'}}
            else:
                code, reason = ((137, "OOMKilled") if fate.kind == "oom"
                                else (fate.exit_code, "Error"))
                cs.update(restartCount=1, lastState={"terminated": {
                    "exitCode": code, "reason": reason, "finishedAt": now, "startedAt": created}},
                    state={"waiting": {"reason": "CrashLoopBackOff", "message":
                                       "back-off 10s restarting failed container=sglang"}})
                if n == crash_at:
                    self.event("Pod", name, "BackOff", "Back-off restarting failed container "
                               "sglang", "Warning")
        st["conditions"] = [sched, ready]
        st["containerStatuses"] = [cs]
        o["status"] = st
