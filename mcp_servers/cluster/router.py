"""The pinned SGLang router (``sglang-router`` 0.3.2) as a local process in front of replicas.

The local backend (:mod:`mcp_servers.cluster.local`) with ``router="sglang"`` starts one router
per deployment of two or more replicas, on the backend's loopback host and a free port, after
the replicas::

    python -m sglang_router.launch_router --worker-urls URL0 URL1 ... --policy POLICY \
        --host HOST --port PORT --prometheus-host HOST --prometheus-port PORT2 \
        --log-level warn [--cache-threshold X --balance-abs-threshold N \
        --balance-rel-threshold R]

``POLICY`` is the config's ``router_policy`` (the router's own names: ``round_robin``,
``power_of_two``, ``cache_aware``); the routing arguments are the config's own rendering
(``ServingConfig.router_args``, which the Kubernetes router Deployment uses too: for
``cache_aware`` the thresholds ``router_cache_threshold``, ``router_balance_abs_threshold`` and
``router_balance_rel_threshold``, defaults 0.3, 64 and 1.5, sglang-knobs.md section 6).
``kube_service`` (the Kubernetes Service baseline) and a single
replica get no router: the bench client spreads requests over the replicas itself (one
request after another, round-robin, :class:`~mcp_servers.bench.http.HttpRunner`), as a
Service's per-connection spreading does with one connection per request.

``--log-level warn``: at ``info`` the router writes two lines per request (2 x 400 bytes), which
a saturation run of 10,000 requests would turn into megabytes of log. ``--prometheus-host``:
the router's metrics listener binds ``0.0.0.0`` by default (sglang-knobs.md section 6); the
local backend binds loopback only. Readiness: ``GET /readiness`` answers 200 once every worker
is healthy (``{"status": "ready", "healthy_workers": 2, ...}``, measured with 0.3.2 in front of
two stub servers: ready 0.6 s after start).

The router is a separate package (the pyproject extra ``router``:
``pip install 'servetune[router]'``). When it is not installed, a deployment that needs it is
refused with that command (:func:`require_router`); nothing falls back silently.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from typing import Literal

from domain.config import ServingConfig
from mcp_servers.cluster.backend import BackendError

RouterMode = Literal["sglang", "none"]
ROUTER_MODES: tuple[RouterMode, ...] = ("sglang", "none")
ROUTER_PACKAGE = "sglang-router"
ROUTER_VERSION = "0.3.2"  # the pinned release (pyproject extra ``router``)
ROUTER_MODULE = "sglang_router.launch_router"
READINESS_PATH = "/readiness"  # sglang-router 0.3.2 (sglang-knobs.md 6.4)
ROUTER_LOG = "router.log"
# The router's own policies (sglang-router 0.3.2 --policy choices) the config's names map to.
ROUTER_POLICIES = ("round_robin", "power_of_two", "cache_aware")
# The router's log is colored (tracing's ANSI escapes, NO_COLOR is not honoured by 0.3.2)
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
INSTALL_HINT = (f"install the pinned router: pip install 'servetune[router]' (or pip install "
                f"{ROUTER_PACKAGE}=={ROUTER_VERSION}), or leave out --router (router='none'): the "
                "bench then spreads requests over the replicas itself")


def installed_version() -> str | None:
    """The installed ``sglang-router`` version, or None when its module cannot be imported."""
    try:
        if importlib.util.find_spec("sglang_router") is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        return importlib.metadata.version(ROUTER_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def require_router() -> str:
    """The installed router's version.

    Raises:
        BackendError: ``sglang-router`` is not installed, or is another release than the pinned
            one (its flags and routing differ), with the command that installs it.
    """
    v = installed_version()
    if v is None:
        raise BackendError(f"the local backend's router (--router) needs "
                           f"{ROUTER_PACKAGE} {ROUTER_VERSION}, which is not installed: "
                           f"{INSTALL_HINT}")
    if v != ROUTER_VERSION:
        raise BackendError(f"{ROUTER_PACKAGE} {v} is installed; servetune pins "
                           f"{ROUTER_VERSION} (its flags and routing are the ones modelled): "
                           f"{INSTALL_HINT}")
    return v


def plain(text: str) -> str:
    """``text`` without the router log's ANSI color escapes."""
    return ANSI_RE.sub("", text)


def fronted(config: ServingConfig) -> bool:
    """Whether a deployment of ``config`` gets the router: 2+ replicas and a router policy."""
    return config.replicas > 1 and config.router_policy in ROUTER_POLICIES


def router_argv(config: ServingConfig, workers: list[str], host: str, port: int,
                metrics_port: int, startup_timeout_s: float = 600.0) -> list[str]:
    """The router's argv in front of ``workers`` (base URLs), see the module docstring.

    ``startup_timeout_s`` bounds the router's own wait for healthy workers
    (``--worker-startup-timeout-secs``, default 1800 s in 0.3.2): the backend's ready timeout.

    Raises:
        BackendError: the config's policy is not one the router has (``kube_service``).
    """
    routing = config.router_args(workers)
    if routing is None or config.router_policy not in ROUTER_POLICIES:
        raise BackendError(f"router_policy {config.router_policy!r} is not a policy of "
                           f"{ROUTER_PACKAGE} (it has {', '.join(ROUTER_POLICIES)})")
    return [sys.executable, "-m", ROUTER_MODULE, *routing, "--host", host, "--port", str(port),
            "--prometheus-host", host, "--prometheus-port", str(metrics_port),
            "--log-level", "warn",
            "--worker-startup-timeout-secs", str(max(1, round(startup_timeout_s)))]
