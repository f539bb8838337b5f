"""SGLang's Prometheus metric names that servetune reads.

Source: SGLang 0.5.23 ``srt/metrics/collector.py`` (every label set, e.g. ``cache_source``
device/host/storage, is summed by the reader). Retractions: ``srt/observability/
metrics_collector.py:552-561`` declares the gauge ``sglang:num_retracted_reqs`` (the requests
retracted in the last logging interval, reset after each log: ``scheduler_components/
metrics_reporter.py:874-876``) and the counter ``sglang:num_retracted_requests_total``
(incremented by every ``retract_decode``, ``managers/scheduler.py:4503-4505``); a run's count is
the counter's difference around it, the gauge only tells that retraction is happening now.
"""

from __future__ import annotations

PREFIX = "sglang:"  # every metric of the SGLang server
METRICS: dict[str, str] = {
    "prompt_tokens": f"{PREFIX}prompt_tokens_total",  # prompt tokens admitted since start
    "cached_tokens": f"{PREFIX}cached_tokens_total",  # of those, served from the prefix cache
    # requests retracted to the queue because decode ran out of KV, since start (counter)
    "retracted_requests": f"{PREFIX}num_retracted_requests_total",
    # retracted in the last logging interval (gauge)
    "retracted_reqs_now": f"{PREFIX}num_retracted_reqs",
    # requests the server finished since start (counter; 0.5.23 observability/
    # metrics_collector.py:1940-1944, incremented once per finished request at :2136)
    "finished_requests": f"{PREFIX}num_requests_total",
}
