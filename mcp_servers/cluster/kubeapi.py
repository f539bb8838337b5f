"""The narrow Kubernetes API the cluster server's Kubernetes backend uses, and its real client.

:class:`KubeApi` is the seam tests fake: six namespaced calls on plain dicts in the API's own
camelCase shape (``metadata.creationTimestamp``, ``status.containerStatuses``), never the client
library's models. :class:`RealKubeApi` implements it with the ``kubernetes`` python client:
``DynamicClient.server_side_apply`` (field manager ``servetune``, ``force=True``: servetune owns
every field it sets) for writes, the dynamic client for reads, and ``CoreV1Api`` for pod logs.

The real client is built on the first call, not when the backend is built (so a server starts,
and says what is wrong per call, when the cluster is unreachable). Credentials come from the
kubeconfig (``kubeconfig`` path or the library's default, ``$KUBECONFIG`` or ``~/.kube/config``,
and ``context``) or, when neither is given and servetune runs in a pod, from the pod's service
account. Secrets are never read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Protocol

import yaml
from kubernetes import client, config, dynamic
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError
from urllib3.exceptions import HTTPError

log = logging.getLogger("servetune.cluster.kubernetes")

FIELD_MANAGER = "servetune"
# what the client raises when the API refuses a call (ApiException, the dynamic client's
# subclasses of it) or cannot be reached (urllib3)
CLIENT_ERRORS = (ApiException, HTTPError)
MAX_LOG_BYTES = 8 << 20  # pod_logs reads at most the last 8 MiB (like the local backend)


class KubeApiError(Exception):
    """The API server refused or failed a call.

    Attributes:
        status: HTTP status (403 forbidden by RBAC, 404 not found, 409 conflict, 422 invalid,
            0 when the server could not be reached or the kind is not served).
        reason: the API's short reason (``Forbidden``, ``NotFound``, ...).
        message: the API's message (``Status.message``), for a person or a model.
    """

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}" if status else f"{reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


class KubeApi(Protocol):
    """Namespaced Kubernetes calls on plain dicts (the namespace is fixed by the implementation).

    Every call raises :class:`KubeApiError` when the API refuses it.
    """

    namespace: str

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj`` (field manager ``servetune``, conflicts forced); the result."""
        ...

    def get(self, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        """Object ``kind/name`` or None if there is none."""
        ...

    def list(self, api_version: str, kind: str, selector: str | None = None
             ) -> list[dict[str, Any]]:
        """Objects of ``kind`` matching the label ``selector`` (None: all)."""
        ...

    def delete(self, api_version: str, kind: str, name: str) -> None:
        """Delete ``kind/name`` (background propagation); a missing object is not an error."""
        ...

    def pod_logs(self, pod: str, container: str | None = None, tail: int = 10_000,
                 previous: bool = False) -> str:
        """Log of ``container`` of ``pod`` with RFC 3339 timestamps (``timestamps=True``).

        ``previous``: the log of the container's previous (terminated) instance.
        """
        ...

    def events(self, field_selector: str | None = None) -> list[dict[str, Any]]:
        """core/v1 Events of the namespace (optionally filtered by ``field_selector``)."""
        ...


def _error(e: BaseException) -> KubeApiError:
    """A client-library exception as a :class:`KubeApiError` (the Status message kept)."""
    status = int(getattr(e, "status", 0) or 0)
    reason = str(getattr(e, "reason", "") or type(e).__name__)
    message = str(e)
    body = getattr(e, "body", None)
    if body:
        try:
            status_obj = json.loads(body)
            message = status_obj.get("message", message)
            # the Status's reason (NotFound), not the HTTP phrase ApiException keeps (Not Found)
            reason = str(status_obj.get("reason") or reason)
        except (ValueError, TypeError, AttributeError):
            message = str(body)[:2000]
    return KubeApiError(status, reason, message)


def discovery_cache(host: str) -> str:
    """A private file for the dynamic client's discovery cache of ``host``.

    By default the kubernetes client caches discovery in ``/tmp/osrcp-<md5(host)>.json``, a
    predictable path other users of the machine can write, and trusts it on the next run. This
    puts it under ``$XDG_CACHE_HOME`` (default ``~/.cache``)``/servetune/kube`` (mode 0700).
    """
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "servetune" / "kube"
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    base.chmod(0o700)
    digest = hashlib.sha256(host.encode()).hexdigest()[:16]
    return str(base / f"discovery-{digest}.json")


class RealKubeApi:
    """:class:`KubeApi` over the ``kubernetes`` python client, confined to ``namespace``."""

    def __init__(self, namespace: str, kubeconfig: Path | None = None,
                 context: str | None = None) -> None:
        """Remember where to connect; nothing is read or contacted until the first call.

        Args:
            namespace: the one namespace every call acts in.
            kubeconfig: kubeconfig file (None: the library's default, or the pod's service
                account when servetune runs in a pod and no ``context`` is given).
            context: kubeconfig context (None: the file's current context).
        """
        self.namespace = namespace
        self.kubeconfig, self.context = kubeconfig, context
        self._lock = threading.Lock()
        self._clients: tuple[Any, Any] | None = None

    def _connect(self) -> tuple[Any, Any]:
        """(DynamicClient, CoreV1Api), built once.

        Raises:
            KubeApiError: no usable kubeconfig or service account, or discovery failed.
        """
        with self._lock:
            if self._clients is not None:
                return self._clients
            try:
                api_client = None
                if self.kubeconfig is None and self.context is None:
                    try:
                        cfg = client.Configuration()
                        config.load_incluster_config(client_configuration=cfg)
                        api_client = client.ApiClient(cfg)
                    except config.ConfigException:
                        api_client = None
                if api_client is None:
                    api_client = config.new_client_from_config(
                        config_file=str(self.kubeconfig) if self.kubeconfig else None,
                        context=self.context)
                self._clients = (
                    dynamic.DynamicClient(api_client, cache_file=discovery_cache(
                        api_client.configuration.host)),
                    client.CoreV1Api(api_client))
            except (config.ConfigException, OSError, yaml.YAMLError) as e:
                where = self.kubeconfig or "the default kubeconfig"
                raise KubeApiError(0, "NoCredentials",
                                   f"cannot load credentials from {where}"
                                   f"{f' (context {self.context})' if self.context else ''}: "
                                   f"{' '.join(str(e).split())}; give --kubeconfig/--context, "
                                   "or run in a pod with the sandbox's service account") from e
            except CLIENT_ERRORS as e:  # discovery
                raise _error(e) from e
            return self._clients

    def _resource(self, api_version: str, kind: str) -> Any:
        dyn, _ = self._connect()
        try:
            return dyn.resources.get(api_version=api_version, kind=kind)
        except CLIENT_ERRORS as e:
            raise _error(e) from e
        except ResourceNotFoundError as e:
            raise KubeApiError(0, "KindNotServed",
                               f"the cluster serves no {kind} in {api_version} (is its CRD "
                               "installed, e.g. LeaderWorkerSet?)") from e

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj`` into the namespace; the object as stored."""
        res = self._resource(obj["apiVersion"], obj["kind"])
        try:
            out = res.server_side_apply(body=obj, name=obj["metadata"]["name"],
                                        namespace=self.namespace, field_manager=FIELD_MANAGER,
                                        force_conflicts=True)
        except CLIENT_ERRORS as e:
            raise _error(e) from e
        return dict(out.to_dict())

    def get(self, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        """Object ``kind/name``, or None."""
        res = self._resource(api_version, kind)
        try:
            return dict(res.get(name=name, namespace=self.namespace).to_dict())
        except NotFoundError:
            return None
        except CLIENT_ERRORS as e:
            raise _error(e) from e

    def list(self, api_version: str, kind: str, selector: str | None = None
             ) -> list[dict[str, Any]]:
        """Objects of ``kind`` matching ``selector``."""
        res = self._resource(api_version, kind)
        try:
            out = res.get(namespace=self.namespace, label_selector=selector)
        except CLIENT_ERRORS as e:
            raise _error(e) from e
        return [dict(item) for item in out.to_dict().get("items", [])]

    def delete(self, api_version: str, kind: str, name: str) -> None:
        """Delete ``kind/name``; already gone is fine."""
        res = self._resource(api_version, kind)
        try:
            res.delete(name=name, namespace=self.namespace, propagation_policy="Background")
        except NotFoundError:
            return
        except CLIENT_ERRORS as e:
            raise _error(e) from e

    def pod_logs(self, pod: str, container: str | None = None, tail: int = 10_000,
                 previous: bool = False) -> str:
        """The last ``tail`` lines (at most 8 MiB) of a container's log, timestamped."""
        _, core = self._connect()
        try:
            return str(core.read_namespaced_pod_log(
                pod, self.namespace, container=container, tail_lines=tail, timestamps=True,
                previous=previous, limit_bytes=MAX_LOG_BYTES))
        except CLIENT_ERRORS as e:
            raise _error(e) from e

    def events(self, field_selector: str | None = None) -> list[dict[str, Any]]:
        """core/v1 Events of the namespace."""
        res = self._resource("v1", "Event")
        try:
            out = res.get(namespace=self.namespace, field_selector=field_selector)
        except CLIENT_ERRORS as e:
            raise _error(e) from e
        return [dict(item) for item in out.to_dict().get("items", [])]
