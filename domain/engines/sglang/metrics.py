"""SGLang's Prometheus metric names that servetune reads.

Source: SGLang 0.5.23 ``srt/metrics/collector.py`` (every label set, e.g. ``cache_source``
device/host/storage, is summed by the reader).
"""

from __future__ import annotations

PREFIX = "sglang:"  # every metric of the SGLang server
METRICS: dict[str, str] = {
    "prompt_tokens": f"{PREFIX}prompt_tokens_total",  # prompt tokens admitted since start
    "cached_tokens": f"{PREFIX}cached_tokens_total",  # of those, served from the prefix cache
}
