"""The HTTP client libraries behind the runner: one session per run, one streaming POST each.

Client choice, measured by ``benchmarks/loadgen_fidelity.py`` (2 shared cores, the test stub
on the same machine with TTFT 50 ms / ITL 10 ms, ISL 256 / OSL 64, constant rate; one run, load
average ~1): at 50 req/s the client's own overhead (client TTFT - the stub's own TTFT) was
1.96 ms for aiohttp on uvloop, 2.67 ms for aiohttp on asyncio, 6.91 ms for httpx on asyncio (the
earlier runner) and 1.70 ms for a raw-socket floor; dispatch lag p99 3.56 / 3.89 / 7.87 ms. The
highest rate with at most 5 ms of overhead was 300 req/s for aiohttp (either loop; the stub
itself fell behind at 400), 25-50 req/s for httpx, 50 req/s for aiperf 0.13.0. httpx's cost is
its connection pool (httpcore scans every connection on each request: ~10x aiohttp's CPU per
request in a profile at 100 req/s). So aiohttp is the default; ``client="httpx"`` stays for
comparison. Both: connection limit at least the run's concurrency, no proxies from the
environment, each request a streaming ``POST {base}/v1/completions``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from typing import Literal

import aiohttp
import httpx

from mcp_servers.bench.http.errors import ErrorClass, brief, cause
from mcp_servers.bench.http.sse import SseStream

HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}
ClientKind = Literal["aiohttp", "httpx"]
CLIENTS: tuple[ClientKind, ...] = ("aiohttp", "httpx")
DEFAULT_CLIENT: ClientKind = "aiohttp"
DRAIN_S = 1.0  # after 'data: [DONE]', wait at most this long for the end of the body


class Client(abc.ABC):
    """One HTTP client library behind the runner: open a session, stream one POST.

    Implemented by :class:`AiohttpClient` and :class:`HttpxClient`.
    """

    kind: ClientKind

    @abc.abstractmethod
    async def __aenter__(self) -> Client:
        """Open the client's connection pool."""

    @abc.abstractmethod
    async def __aexit__(self, *exc: object) -> None:
        """Close the connection pool."""

    @abc.abstractmethod
    async def post(self, url: str, body: bytes,
                   acc: SseStream) -> tuple[str, ErrorClass] | None:
        """Stream one request into ``acc``; the transport error and its class, if any."""


class AiohttpClient(Client):
    """aiohttp: a TCPConnector pool of ``connections``, connect timeout per request."""

    kind: ClientKind = "aiohttp"

    def __init__(self, connections: int, connect_timeout_s: float) -> None:
        self.connections = connections
        self.connect_timeout_s = connect_timeout_s
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.connections, limit_per_host=0,
                                           ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
            trust_env=False)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()

    async def post(self, url: str, body: bytes,
                   acc: SseStream) -> tuple[str, ErrorClass] | None:
        """Stream one request into ``acc``; the transport error and its class, if any."""
        assert self.session is not None
        try:
            async with self.session.post(url, data=body, headers=HEADERS) as resp:
                if resp.status != 200:
                    text = (await resp.read()).decode(errors="replace")
                    return f"HTTP {resp.status} from {url}: {brief(text)}", \
                        ErrorClass.HTTP_STATUS
                chunks = resp.content.iter_any()
                async for data in chunks:
                    if acc.feed_bytes(data):
                        break
                if acc.done:  # read the body's end, so the connection goes back to the pool
                    with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                        async with asyncio.timeout(DRAIN_S):
                            async for _ in chunks:
                                pass
        except aiohttp.ClientConnectorError as e:
            return f"cannot connect to {url}: {cause(e)}", ErrorClass.CONNECT
        except (aiohttp.ClientError, OSError) as e:  # resets, payload/protocol errors
            return (f"{type(e).__name__} talking to {url} after {len(acc.times)} text chunks: "
                    f"{cause(e)}", ErrorClass.DISCONNECT)
        return None


class HttpxClient(Client):
    """httpx: an AsyncClient pool of ``connections``; its timeouts end as TimeoutError."""

    kind: ClientKind = "httpx"

    def __init__(self, connections: int, connect_timeout_s: float,
                 request_timeout_s: float) -> None:
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=connections,
                                max_keepalive_connections=connections),
            timeout=httpx.Timeout(connect=connect_timeout_s, read=request_timeout_s,
                                  write=request_timeout_s, pool=None),
            trust_env=False)

    async def __aenter__(self) -> Client:
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.__aexit__(None, None, None)

    async def post(self, url: str, body: bytes,
                   acc: SseStream) -> tuple[str, ErrorClass] | None:
        """Stream one request into ``acc``; the transport error and its class, if any."""
        try:
            async with self.client.stream("POST", url, content=body, headers=HEADERS) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    return f"HTTP {resp.status_code} from {url}: {brief(text)}", \
                        ErrorClass.HTTP_STATUS
                chunks = resp.aiter_bytes()
                async for data in chunks:
                    if acc.feed_bytes(data):
                        break
                if acc.done:  # read the body's end, so the connection goes back to the pool
                    with contextlib.suppress(TimeoutError, httpx.HTTPError):
                        async with asyncio.timeout(DRAIN_S):
                            async for _ in chunks:
                                pass
        except httpx.ConnectError as e:
            return f"cannot connect to {url}: {cause(e)}", ErrorClass.CONNECT
        except httpx.TimeoutException as e:
            raise TimeoutError from e
        except httpx.HTTPError as e:  # resets, protocol errors
            return (f"{type(e).__name__} talking to {url} after {len(acc.times)} text chunks: "
                    f"{cause(e)}", ErrorClass.DISCONNECT)
        return None
