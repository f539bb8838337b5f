"""The endpoint allow-list: which OpenAI-compatible URLs the bench server may load.

An allowed entry is a base URL: ``http://127.0.0.1`` allows every port of that host,
``https://llm.example:8443/team-a`` only that port and paths under ``/team-a``. Matching is by
parsed parts, never by string prefix (``http://127.0.0.1.evil.example`` does not match
``http://127.0.0.1``).
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import SplitResult, urlsplit

from mcp_servers.cluster.backend import BackendError

SCHEMES = ("http", "https")


def _parse(url: str, what: str) -> SplitResult:
    try:
        u = urlsplit(url.strip())
        u.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as e:
        raise BackendError(f"{what} {url!r} is not a URL ({e}); give e.g. "
                           "http://127.0.0.1:30000") from e
    if u.scheme not in SCHEMES or not u.hostname:
        raise BackendError(f"{what} {url!r} must be an http:// or https:// URL with a host, "
                           "e.g. http://127.0.0.1:30000")
    if u.username is not None or u.password is not None:
        raise BackendError(f"{what} must not carry credentials (user:password@); give the "
                           "bare base URL")
    if u.query or u.fragment:
        raise BackendError(f"{what} {url!r} must not have a query or fragment; give the base "
                           "URL of the server, e.g. http://127.0.0.1:30000")
    return u


def _path(u: SplitResult) -> str:
    return u.path.rstrip("/")


def check_endpoint(url: str, allowed: Sequence[str]) -> str:
    """The base URL (no trailing ``/`` or ``/v1``) of ``url`` if the allow-list admits it.

    Raises:
        BackendError: not an http(s) URL, credentials/query in it, or not allowed.
    """
    u = _parse(url, "endpoint")
    path = _path(u)
    if path.endswith("/v1"):
        path = path[:-3]
    for entry in allowed:
        a = _parse(entry, "allowed endpoint")
        a_path = _path(a)
        if (a.scheme == u.scheme and a.hostname == u.hostname
                and (a.port is None or a.port == u.port)
                and (path == a_path or path.startswith(a_path + "/"))):
            host = u.hostname or ""
            netloc = f"[{host}]" if ":" in host else host  # IPv6 literal in brackets
            if u.port is not None:
                netloc += f":{u.port}"
            return f"{u.scheme}://{netloc}{path}"
    listed = ", ".join(allowed) or "none"
    raise BackendError(
        f"endpoint {url!r} is not on this bench server's allow-list (allowed: {listed}). "
        "Benchmark a deployment by name instead, or ask the operator to restart the bench "
        "server with this base URL allowed (allowed_endpoints / the CLI's allow-endpoint "
        "option).")
