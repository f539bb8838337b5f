"""The ``aiperf profile`` command line (:func:`profile_argv`).

- **Run** (:func:`profile_argv`, :class:`AiperfRunner`): ``--no-server-metrics
  --no-gpu-telemetry --ui none`` (no scraping, no DCGM probes), explicit ``--workers-max`` from
  the client CPUs (aiperf's own default uses the host's CPU count) [5, 8], ``ignore_eos`` in
  every body [7], ``--use-server-token-count`` (token counts from the server's usage, as the
  built-in HTTP runner does), records export.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Literal

from mcp_servers.bench.aiperf.common import AiperfError, Mode

# ---------------------------------------------------------------------------------------------
# The aiperf command line


def default_workers(client_cpus: int) -> int:
    """Worker processes of aiperf for ``client_cpus`` dedicated CPUs: ``max(1, 0.75 * cpus - 1)``.

    aiperf's own formula (``--workers-max`` help, 0.13.0), applied to the CPUs the client is
    given rather than to the host's count, which in a container is the node's. On 2 cores that
    is one worker, which the loadgen reference found best (more workers made TTFT worse) [5].
    """
    return max(1, int(client_cpus * 0.75) - 1)


def profile_argv(*, urls: Sequence[str], model: str, tokenizer: str, artifact_dir: str,
                 client_cpus: int, mode: Mode, input_file: str | None = None,
                 block_size: int = 0, concurrency: int | None = None,
                 request_rate: float | None = None,
                 arrival: Literal["poisson", "constant", "gamma"] = "poisson",
                 isl: int | None = None, osl: int | None = None,
                 duration_s: float | None = None, request_count: int | None = None,
                 dataset_entries: int | None = None,
                 endpoint_type: Literal["completions", "chat"] = "completions",
                 request_timeout_s: float = 600.0, seed: int = 0,
                 slo_ttft_ms: float | None = None, workers: int | None = None,
                 prompt_corpus: Literal["sonnet", "coding", "random"] | None = None,
                 aiperf: str = "aiperf") -> list[str]:
    """The ``aiperf profile`` command line for one run (aiperf 0.13.0 flags).

    Modes:

    - ``replay``: ``input_file`` (from :func:`write_trace`) as ``mooncake_trace`` with
      ``--fixed-schedule --fixed-schedule-start-offset 0`` (timestamps = ms after the phase
      start) and ``--isl-block-size block_size`` when the rows carry hash ids.
    - ``concurrency``: ``concurrency`` clients, synthetic ``isl``/``osl`` prompts (stddev 0),
      for ``duration_s`` (then in-flight requests drain for up to ``request_timeout_s``) or
      ``request_count`` requests.
    - ``rate``: open loop at ``request_rate`` req/s with ``arrival`` gaps, same sizing.

    Synthetic prompts come from a pool of ``dataset_entries`` (default: ``request_count``, else
    ``max(1000, 4 * concurrency)``) that aiperf reuses in turn; a server with a prefix cache can
    hit on a reused prompt, so size it above the requests a run sends.

    Always: streaming, ``ignore_eos`` in the body, server-reported token counts, per-request
    records export, no server-metrics scraping, no GPU telemetry, no UI, no plots, explicit
    workers.

    Args:
        urls: Server roots (``http://host:port``), round-robin.
        model: Model name sent in each body.
        tokenizer: ``--tokenizer`` value (a :class:`TokenizerRef` repo id).
        artifact_dir: Where aiperf writes its artifacts.
        client_cpus: CPUs dedicated to the client; sets ``--workers-max`` (see
            :func:`default_workers`) unless ``workers`` is given.
        mode: ``replay``, ``concurrency`` or ``rate``.
        input_file: Trace file (replay).
        block_size: Tokens per hash block in ``input_file``; 0 for none.
        concurrency: Clients in flight (concurrency mode).
        request_rate: Requests per second (rate mode).
        arrival: Inter-arrival distribution (rate mode).
        isl: Input tokens per synthetic request.
        osl: Output tokens per synthetic request.
        duration_s: Seconds of new load (synthetic modes).
        request_count: Requests to send (synthetic modes), instead of or with a duration.
        dataset_entries: Distinct synthetic prompts.
        endpoint_type: ``completions`` (``/v1/completions``) or ``chat``.
        request_timeout_s: A request not finished this long after its send fails.
        seed: ``--random-seed`` (prompts and arrivals are reproducible).
        slo_ttft_ms: Adds aiperf's ``--goodput time_to_first_token:<ms>``.
        workers: Override of ``--workers-max``.
        prompt_corpus: ``--prompt-corpus``; None for aiperf's default text corpus (see
            :func:`build_tokenizer` on why not ``random``).
        aiperf: The executable.

    Raises:
        AiperfError: a mode without its parameters, or parameters out of range.
    """
    problems = []
    if not urls:
        problems.append("at least one server URL")
    if client_cpus < 1:
        problems.append(f"client_cpus >= 1 (got {client_cpus})")
    if mode == "replay":
        if not input_file:
            problems.append("an input_file for a replay")
        if concurrency is not None or request_rate is not None:
            problems.append("no concurrency or request_rate with a replay (the trace times it)")
    elif mode in ("concurrency", "rate"):
        if isl is None or osl is None or isl < 1 or osl < 1:
            problems.append(f"isl and osl >= 1 for a synthetic run (got {isl}, {osl})")
        if duration_s is None and request_count is None:
            problems.append("duration_s or request_count for a synthetic run")
        if duration_s is not None and not duration_s > 0:
            problems.append(f"duration_s > 0 (got {duration_s})")
        if request_count is not None and request_count < 1:
            problems.append(f"request_count >= 1 (got {request_count})")
        if mode == "concurrency" and (concurrency is None or concurrency < 1):
            problems.append(f"concurrency >= 1 in concurrency mode (got {concurrency})")
        if mode == "rate" and (request_rate is None or not request_rate > 0
                               or not math.isfinite(request_rate)):
            problems.append(f"a finite request_rate > 0 in rate mode (got {request_rate})")
    else:
        problems.append(f"mode replay, concurrency or rate (got {mode!r})")
    if problems:
        raise AiperfError("aiperf run needs " + "; ".join(problems))
    argv = [aiperf, "profile", "--model", model, "--tokenizer", tokenizer]
    for u in urls:
        argv += ["--url", u.rstrip("/")]
    argv += ["--endpoint-type", endpoint_type, "--streaming",
             "--extra-inputs", json.dumps({"ignore_eos": True}),
             "--use-server-token-count",
             "--request-timeout-seconds", f"{request_timeout_s:g}",
             "--artifact-dir", artifact_dir, "--export-level", "records",
             "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry", "--no-auto-plot",
             "--random-seed", str(seed),
             "--workers-max", str(workers or default_workers(client_cpus))]
    if mode == "replay":
        assert input_file is not None
        argv += ["--input-file", input_file, "--custom-dataset-type", "mooncake_trace",
                 "--fixed-schedule", "--fixed-schedule-start-offset", "0"]
        if block_size > 0:
            argv += ["--isl-block-size", str(block_size)]
    else:
        assert isl is not None and osl is not None
        entries = dataset_entries or request_count or max(1000, 4 * (concurrency or 1))
        argv += ["--isl", str(isl), "--isl-stddev", "0", "--osl", str(osl),
                 "--osl-stddev", "0", "--num-dataset-entries", str(entries)]
        if mode == "concurrency":
            argv += ["--concurrency", str(concurrency)]
        else:
            argv += ["--request-rate", f"{request_rate:g}", "--arrival-pattern", arrival]
        if duration_s is not None:
            argv += ["--benchmark-duration", f"{duration_s:g}",
                     "--benchmark-grace-period", f"{request_timeout_s:g}"]
        if request_count is not None:
            argv += ["--request-count", str(request_count)]
    if prompt_corpus is not None:
        argv += ["--prompt-corpus", prompt_corpus]
    if slo_ttft_ms is not None:
        argv += ["--goodput", f"time_to_first_token:{slo_ttft_ms:g}"]
    return argv


