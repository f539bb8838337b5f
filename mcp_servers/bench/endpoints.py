"""The endpoint allow-list: which OpenAI-compatible URLs the bench server may load.

An allowed entry is a base URL: ``http://127.0.0.1`` allows every port of that host,
``https://llm.example:8443/team-a`` only that port and paths under ``/team-a``. Matching is by
parsed parts, never by string prefix (``http://127.0.0.1.evil.example`` does not match
``http://127.0.0.1``).

Paths are compared in their RFC 3986 normal form, and a URL whose path is not already normal, or
that some client, proxy or server on the way could read as another path, is refused rather than
normalised: a dot segment (``/team-a/../team-b``), a percent-encoded dot, slash, backslash or
unreserved character (``/team-a/%2e%2e/team-b``, ``%2f``, ``%74``), a backslash, an encoded
``%`` (``%252e``, decoded twice), a ``;`` (``/team-a/..;/team-b``), control characters,
whitespace and non-ASCII characters (``..%00``, ``..%20``, fullwidth dots) would be resolved to a
path the allow-list never checked. :func:`_check_normal` lists each rule and why. The same rules
apply to the allow-list entries themselves.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from urllib.parse import SplitResult, urljoin, urlsplit

from mcp_servers.cluster.backend import BackendError

SCHEMES = ("http", "https")
# RFC 3986 2.3 unreserved characters; with "/" and "\\" these must never arrive percent-encoded
UNRESERVED = frozenset(string.ascii_letters + string.digits + "-._~/\\")
# RFC 3986 3.3 pchar (unreserved / sub-delims / ":" / "@", pct-encoded apart) and "/", less ";"
PATH_CHARS = frozenset(string.ascii_letters + string.digits + "-._~" + "!$&'()*+,=" + ":@/")
HEX = frozenset(string.hexdigits)


def _control(text: str) -> str | None:
    """The first control character (U+0000-U+001F, U+007F-U+009F) of ``text``, if any."""
    return next((ch for ch in text if ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F), None)


def _parse(url: str, what: str) -> SplitResult:
    url = url.strip()
    ctrl = _control(url)
    if ctrl is not None:  # before urlsplit, which silently drops tab, CR and LF
        raise BackendError(f"{what} {url!r}: a control character ({ord(ctrl):#04x}) in the URL "
                           "is not allowed (clients strip or refuse it, servers may cut the "
                           f"path at it); give the {what} without it, e.g. "
                           "http://127.0.0.1:30000/team-a")
    try:
        u = urlsplit(url)
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


def _octet_problem(octet: int) -> tuple[str, str] | None:
    """What the percent-encoded ``octet`` is and why it may not be in a path (None: it may)."""
    ch = chr(octet)
    if octet < 0x20 or octet == 0x7F:
        return "a control character", "servers may strip it or cut the path at it"
    if octet == 0x20:
        return "a space", "servers may trim it from a segment ('.. ' read as '..')"
    if octet >= 0x80:
        return ("a non-ASCII octet", "Unicode-normalising or lax UTF-8 decoders may read it as "
                "'.' (fullwidth or overlong dots); a base URL never needs one")
    if ch == "%":
        return "'%'", "a proxy or server that decodes twice reads '%252e' as '.'"
    if ch == ";":
        return "';'", "a decoding proxy forwards it as a path parameter ('..;' read as '..')"
    if ch in UNRESERVED:
        return repr(ch), "clients and servers decode it before routing"
    return None


def _check_normal(path: str, url: str, what: str) -> None:
    r"""Refuse a path that an HTTP client, proxy or server could route as another path.

    The allow-list compares paths as given, so every rewriting any hop might do must be a no-op.
    The path must be:

    1. free of control characters, raw anywhere in the URL (checked by ``_parse``, before
       ``urlsplit``, which drops tab, CR and LF silently, per the WHATWG URL standard) or
       percent-encoded (``%00``-``%1F``, ``%7F``): RFC 3986 2 allows neither, and a server may
       cut the path at a NUL or strip them (``..%00`` read as ``..``).
    2. without a backslash: WHATWG URL parsers and Windows servers read it as ``/``.
    3. made of RFC 3986 3.3 path characters only (``pchar``: unreserved, sub-delims, ``:``,
       ``@``, percent-encoded octets; and ``/``), so the client sends it unchanged. In
       particular refused:

       - whitespace (raw, or ``%20``): servers may trim a segment's trailing whitespace
         (``.. `` read as ``..``); clients send a raw space as ``%20``.
       - non-ASCII characters (raw, or octets ``%80``-``%FF``): clients send them UTF-8
         encoded, and Unicode-normalising servers (NFKC) read U+FF0E fullwidth full stop
         (``%EF%BC%8E``) as ``.``; lax UTF-8 decoders read overlong ``%C0%AE`` as ``.``. An
         OpenAI-compatible base URL never needs them.
       - ``;``, raw or ``%3B``: RFC 3986 3.3 lets sub-delims delimit segment parameters, and
         Tomcat and Spring strip ``;...`` from each segment before resolving dot segments, so
         ``/team-a/..;/team-b`` is served as ``/team-b``; a decoding proxy forwards ``%3B`` as
         ``;``.
       - other characters outside ``pchar`` (``"<>^`{|}[]``), which clients percent-encode.

    4. percent-encoded as RFC 3986 2.1 says (``%`` and two hex digits): clients send a stray
       ``%`` as is or re-encode it as ``%25``, which a second decoding then reads as an escape.
    5. without an encoded ``%`` (``%25``): a proxy or server that decodes twice (double
       decoding, CWE-174) reads ``%252e`` as ``%2e`` and then as ``.``.
    6. without percent-encoded unreserved characters, ``/`` or ``\`` (``%2e``, ``%74``,
       ``%2f``, ``%5c``): RFC 3986 6.2.2.2 makes an encoded unreserved octet equivalent to the
       character, so clients and servers decode it before routing, and many servers decode
       ``%2f`` before splitting segments.
    7. without dot segments (``.``/``..``), and equal to its own ``remove_dot_segments``
       (RFC 3986 5.2.4, which ``urllib.parse.urljoin`` implements): the normal form of RFC
       3986 6.2.2, which the client and server resolve before routing.

    Args:
        path: the path of the parsed URL (``urlsplit(url).path``).
        url: the whole URL, for the message.
        what: ``endpoint`` or ``allowed endpoint``, for the message.

    Raises:
        BackendError: one line naming the rule the path breaks.
    """
    fix = f"give the {what} without it, e.g. http://127.0.0.1:30000/team-a"
    if "\\" in path:
        raise BackendError(f"{what} {url!r}: a backslash in the path is not allowed; {fix}")
    for ch in path:
        if ch in PATH_CHARS or ch == "%":
            continue
        if ch == ";":
            problem = ("a ';' (path parameters: Tomcat and Spring read '..;' as '..')")
        elif ch.isspace():
            problem = f"whitespace ({ord(ch):#04x}; servers may trim '.. ' to '..')"
        elif ord(ch) >= 0x80:
            problem = (f"a non-ASCII character ({ch!r}, U+{ord(ch):04X}; servers may "
                       "normalise it, e.g. fullwidth dots to '..')")
        else:
            problem = f"{ch!r}, which is not a URL path character (RFC 3986 3.3)"
        raise BackendError(f"{what} {url!r}: the path has {problem}; {fix}")
    i = path.find("%")
    while i != -1:
        digits = path[i + 1:i + 3]
        if len(digits) != 2 or not set(digits) <= HEX:
            raise BackendError(f"{what} {url!r}: a '%' in the path is not followed by two hex "
                               f"digits (RFC 3986 2.1); {fix}")
        octet_problem = _octet_problem(int(digits, 16))
        if octet_problem is not None:
            name, why = octet_problem
            raise BackendError(f"{what} {url!r}: the path percent-encodes {name} (%{digits}): "
                               f"{why}; {fix}")
        i = path.find("%", i + 3)
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
