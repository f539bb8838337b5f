"""The endpoint allow-list: which OpenAI-compatible URLs the bench server may load.

An allowed entry is a base URL: ``http://127.0.0.1`` allows every port of that host,
``https://llm.example:8443/team-a`` only that port and paths under ``/team-a``. Matching is by
parsed parts, never by string prefix (``http://127.0.0.1.evil.example`` does not match
``http://127.0.0.1``).

Paths are compared in their RFC 3986 normal form, and a URL whose path is not already normal is
refused rather than normalised: a dot segment (``/team-a/../team-b``), a percent-encoded dot,
slash, backslash or unreserved character (``/team-a/%2e%2e/team-b``, ``%2f``, ``%74``) or a
backslash would be resolved by the HTTP client or the server to a path the allow-list never
checked.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from urllib.parse import SplitResult, unquote, urljoin, urlsplit

from mcp_servers.cluster.backend import BackendError

SCHEMES = ("http", "https")
# RFC 3986 2.3 unreserved characters; with "/" and "\\" these must never arrive percent-encoded
UNRESERVED = frozenset(string.ascii_letters + string.digits + "-._~/\\")


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
    _check_normal(u.path, url, what)
    return u


def _check_normal(path: str, url: str, what: str) -> None:
    """Refuse a path that an HTTP client or server would rewrite before routing it.

    The normal form (RFC 3986 6.2.2): percent-encoded unreserved octets decoded (6.2.2.2), then
    dot segments removed (``remove_dot_segments`` of 5.2.4, which ``urllib.parse.urljoin``
    implements). A path must already be in it, with no encoded ``/`` and no backslash.

    Raises:
        BackendError: the path has a dot segment, a backslash, or a percent-encoded unreserved
            character, slash or backslash.
    """
    fix = f"give the {what} without it, e.g. http://127.0.0.1:30000/team-a"
    if "\\" in path:
        raise BackendError(f"{what} {url!r}: a backslash in the path is not allowed; {fix}")
    parts = path.split("%")
    for part in parts[1:]:
        decoded = unquote("%" + part[:2])
        if decoded in UNRESERVED:
            raise BackendError(f"{what} {url!r}: the path percent-encodes {decoded!r} "
                               f"(%{part[:2]}), which clients and servers decode before "
                               f"routing; {fix}")
    segments = path.split("/")
    if "." in segments or ".." in segments:
        raise BackendError(f"{what} {url!r}: the path has a '.' or '..' segment (RFC 3986 "
                           f"dot segments are resolved before routing); {fix}")
    if urljoin("http://h/", path or "/") != "http://h" + (path or "/"):  # remove_dot_segments
        raise BackendError(f"{what} {url!r}: the path is not in its normal form; {fix}")


def _path(u: SplitResult) -> str:
    return u.path.rstrip("/")


def check_endpoint(url: str, allowed: Sequence[str]) -> str:
    """The base URL (no trailing ``/`` or ``/v1``) of ``url`` if the allow-list admits it.

    Raises:
        BackendError: not an http(s) URL, credentials/query in it, a path not in its normal
            form (see the module docstring), or not allowed; also for a malformed entry of
            ``allowed``.
    """
    entries = [_parse(entry, "allowed endpoint") for entry in allowed]
    u = _parse(url, "endpoint")
    path = _path(u)
    if path.endswith("/v1"):
        path = path[:-3]
    for a in entries:
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
