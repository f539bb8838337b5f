"""What the bench reads from a server besides completions: its model id and engine counters.

``GET /v1/models`` names the served model (and the twin server's ``x-servetune-simulated``
header marks a simulated endpoint); ``GET /metrics`` gives the engine's prompt and cached-token
counters, read before and after a run for its prefix-cache hit rate, and its retraction counter
(:func:`fetch_counter`), read around every run for the run's retractions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import httpx

from domain.engines import engine
from domain.quality import SIMULATED_HEADER


async def fetch_model_id(base_url: str, timeout_s: float = 5.0,
                         simulated: dict[str, str] | None = None) -> str | None:
    """The first model id ``GET {base_url}/v1/models`` lists, or None if it cannot be read.

    Args:
        base_url: the server.
        timeout_s: timeout of the request, s.
        simulated: when given, ``base_url`` -> the value of the server's
            ``x-servetune-simulated`` header (:data:`domain.quality.SIMULATED_HEADER`) is
            recorded in it if the server sends one (the twin server does; SGLang never).
    """
    try:
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
            r = await client.get(base_url + "/v1/models")
            if simulated is not None and r.headers.get(SIMULATED_HEADER):
                simulated[base_url] = r.headers[SIMULATED_HEADER][:64]
            r.raise_for_status()
            data = r.json().get("data") or []
            return str(data[0]["id"]) if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


_PROMPT, _CACHED = (engine().metrics[k] for k in ("prompt_tokens", "cached_tokens"))
_SAMPLE = re.compile(rf"^({re.escape(_PROMPT)}|{re.escape(_CACHED)})(?:\{{[^}}]*\}})?\s+(\S+)",
                     re.M)


async def fetch_cache_counters(base_urls: Sequence[str],
                               timeout_s: float = 5.0) -> tuple[float, float] | None:
    """``(prompt tokens, cached prompt tokens)`` summed over the servers' ``/metrics``.

    Reads SGLang's counters ``sglang:prompt_tokens_total`` and ``sglang:cached_tokens_total``
    (every label set, e.g. ``cache_source`` device/host/storage, summed; SGLang
    ``srt/metrics/collector.py``). None when a server has no such counters or cannot be read; the
    difference of two readings around a run gives the run's prefix-cache hit rate.
    """
    pages = await _metrics_pages(base_urls, timeout_s)
    if pages is None:
        return None
    prompt = cached = 0.0
    try:
        for text in pages:
            seen = set()
            for name, value in _SAMPLE.findall(text):
                seen.add(name)
                if name == _PROMPT:
                    prompt += float(value)
                else:
                    cached += float(value)
            if len(seen) < 2:
                return None
    except ValueError:
        return None
    return prompt, cached


async def _metrics_pages(base_urls: Sequence[str], timeout_s: float) -> list[str] | None:
    """The ``/metrics`` text of each server (duplicates read once); None if one cannot be read."""
    pages = []
    try:
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
            for url in dict.fromkeys(base_urls):
                r = await client.get(url + "/metrics")
                if r.status_code != 200:
                    return None
                pages.append(r.text)
    except httpx.HTTPError:
        return None
    return pages


def _sample_of(name: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)", re.M)


async def fetch_counter(base_urls: Sequence[str], key: str,
                        timeout_s: float = 5.0) -> float | None:
    """One engine counter summed over the servers' ``/metrics`` (every label set), or None.

    Args:
        base_urls: the servers (duplicates read once).
        key: servetune's name of the counter, resolved to the engine's Prometheus name through
            the engine seam (``Engine.metrics``; e.g. ``retracted_requests`` ->
            ``sglang:num_retracted_requests_total``).
        timeout_s: per request, s.

    Returns:
        The sum, or None when a server cannot be read or does not expose the counter (the
        difference of two readings around a run is the run's count).

    Raises:
        KeyError: ``key`` is not a metric the engine names.
    """
    pattern = _sample_of(engine().metrics[key])
    pages = await _metrics_pages(base_urls, timeout_s)
    if pages is None:
        return None
    total = 0.0
    try:
        for text in pages:
            values = pattern.findall(text)
            if not values:
                return None
            total += sum(float(v) for v in values)
    except ValueError:
        return None
    return total


async def fetch_counter_each(base_urls: Sequence[str], key: str,
                             timeout_s: float = 5.0) -> list[float] | None:
    """One engine counter of each server (every label set summed), in ``base_urls`` order.

    None when a server cannot be read or does not expose the counter; see :func:`fetch_counter`.

    Raises:
        KeyError: ``key`` is not a metric the engine names.
    """
    out = []
    for url in base_urls:
        v = await fetch_counter([url], key, timeout_s)
        if v is None:
            return None
        out.append(v)
    return out


def counter_delta(before: float | None, after: float | None) -> int | None:
    """``after - before`` of a counter read around a run, rounded to a count.

    None if either reading is unknown or the counter went down (the server restarted).
    """
    if before is None or after is None or after < before:
        return None
    return round(after - before)
