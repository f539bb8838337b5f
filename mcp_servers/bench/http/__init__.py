"""The HTTP runner: real-time streaming load against OpenAI-compatible servers, by what it does.

- :mod:`~mcp_servers.bench.http.runner`: :class:`HttpRunner` (the closed-loop and open-loop
  drivers, per-request records on the run clock) and its result :class:`HttpRun`.
- :mod:`~mcp_servers.bench.http.schedule`: open-loop plans (:class:`PlannedRequest`) and
  fixed-rate schedules (:func:`arrival_schedule`).
- :mod:`~mcp_servers.bench.http.clients`: the client libraries behind the runner (aiohttp by
  default, httpx for comparison) and why aiohttp is the default.
- :mod:`~mcp_servers.bench.http.sse`: the SSE parser of one streamed completion.
- :mod:`~mcp_servers.bench.http.errors`: why a failed request failed (:class:`ErrorClass`).
- :mod:`~mcp_servers.bench.http.probes`: ``/v1/models`` and the ``/metrics`` prefix-cache
  counters.
"""

from mcp_servers.bench.http.clients import CLIENTS, DEFAULT_CLIENT, ClientKind
from mcp_servers.bench.http.errors import ErrorClass, count_error_classes
from mcp_servers.bench.http.probes import (
    counter_delta,
    fetch_cache_counters,
    fetch_counter,
    fetch_counter_each,
    fetch_model_id,
)
from mcp_servers.bench.http.runner import MAX_CONCURRENCY, HttpRun, HttpRunner, Snapshot, TickFn
from mcp_servers.bench.http.schedule import PlannedRequest, arrival_schedule

__all__ = [
    "CLIENTS", "DEFAULT_CLIENT", "MAX_CONCURRENCY", "ClientKind", "ErrorClass", "HttpRun",
    "HttpRunner", "PlannedRequest", "Snapshot", "TickFn", "arrival_schedule",
    "count_error_classes", "counter_delta", "fetch_cache_counters", "fetch_counter",
    "fetch_counter_each", "fetch_model_id",
]
