"""aiperf's artifacts -> records (:func:`parse_artifacts`).

- **Results** (:func:`parse_artifacts`): ``profile_export.jsonl`` back into
  :class:`~domain.metrics.RequestRecord` s (the HTTP runner's clock conventions) plus actual
  send times, and ``profile_export_aiperf.json`` as aiperf's own summary for cross-checks.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from domain.metrics import MetricsSummary, Percentiles, RequestRecord, summarize
from mcp_servers.bench.aiperf.common import (
    AIPERF_VERSION,
    CONNECT,
    DISCONNECT,
    HTTP_STATUS,
    LOG_FILE,
    RECORDS_FILE,
    STREAM,
    SUMMARY_FILE,
    TIMEOUT,
    TRUNCATED,
    AiperfError,
    brief,
)
from mcp_servers.bench.aiperf.trace import SESSION_RE, AiperfTrace
from mcp_servers.bench.http_runner import count_error_classes

# ---------------------------------------------------------------------------------------------
# Artifacts -> records


@dataclass
class AiperfRun:
    """One aiperf run read back: records in send order and how the client kept its schedule.

    Has the attributes of :class:`mcp_servers.bench.http_runner.HttpRun` (``records``,
    ``sent_s``, ``wall_s``, ``stopped_early``, ``error_class``, ``error_counts()``,
    ``cached_tokens``, ``client``, ``t0_mono``), so the bench service stores, classifies and
    summarizes it the same way.

    Attributes:
        records: One per request (replay: trace row order; else by credit issue time). Times
            are seconds on the run clock (0 = aiperf's profiling phase start): ``arrival_s`` =
            scheduled send (replay: the trace time; synthetic: when aiperf's timing service
            issued the request), ``first_token_s`` = send + aiperf's TTFT, ``itl_s`` = aiperf's
            ``inter_chunk_latency`` gaps, ``finish_s`` = last text chunk.
        sent_s: Actual send time of each record (aiperf's ``request_start_ns``), s.
        wall_s: Seconds from the phase start to the last response.
        stopped_early: Why the run is incomplete (cancelled or partial export), or None.
        aiperf_metrics: aiperf's own summary (``profile_export_aiperf.json``): metric tag ->
            ``{"unit", "avg", "p50", "p90", "p99", ...}``; empty when the file is absent.
        clock: How the run clock's zero was found (``phase start`` from aiperf's log, or
            ``least-late credit`` when the log lacks it; the latter hides a constant lateness
            of the timing service, typically < 1 ms).
        artifact_dir: Where the artifacts are.
        argv: The command that ran (empty when only parsed).
        returncode: aiperf's exit status (None when only parsed).
        notes: Things worth reporting (e.g. an exit status 1 with records).
        error_class: Per record, the class of its failure (:data:`HTTP_STATUS`,
            :data:`TIMEOUT`, :data:`CONNECT`, :data:`DISCONNECT`, :data:`STREAM`,
            :data:`TRUNCATED`), None when it succeeded.
        cached_tokens: Per record, prompt tokens the server reported as served from its prefix
            cache (aiperf's ``usage_prompt_cache_read_tokens``); -1 where it reported none.
        client: ``"aiperf"``.
        t0_mono: NaN: aiperf's clock is the wall clock (``time_ns``), not comparable with a
            local process's monotonic timestamps.
    """

    records: list[RequestRecord]
    sent_s: np.ndarray
    wall_s: float
    stopped_early: str | None = None
    aiperf_metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    clock: str = "phase start"
    artifact_dir: Path | None = None
    argv: list[str] = field(default_factory=list)
    returncode: int | None = None
    notes: list[str] = field(default_factory=list)
    error_class: list[str | None] = field(default_factory=list)
    cached_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    client: str = "aiperf"
    t0_mono: float = math.nan

    def error_counts(self) -> dict[str, int]:
        """Failed requests per error class (only classes that occurred)."""
        return count_error_classes(self.error_class)

    @property
    def dispatch_lag_ms(self) -> Percentiles:
        """Actual minus scheduled send time per request, ms."""
        arrivals = np.array([r.arrival_s for r in self.records], dtype=float)
        return Percentiles.of(self.sent_s - arrivals)

    @property
    def client_overhead_ms(self) -> Percentiles:
        """The ``credit_to_start_latency`` aiperf reports (timing service -> worker send), ms."""
        m = self.aiperf_metrics.get("credit_to_start_latency") or {}
        return Percentiles(p50=m.get("p50"), p90=m.get("p90"), p99=m.get("p99"),
                           mean=m.get("avg"))

    def summary(self, gpus: int, slo_ttft_ms: float | None = None,
                slo_tpot_ms: float | None = None) -> MetricsSummary:
        """The project's metrics summary of the records (:func:`domain.metrics.summarize`)."""
        return summarize(self.records, gpus, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)


_UNIT_S = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0}
_PHASE_START = re.compile(r"PhaseRecordsStats\(phase=CreditPhase\.PROFILING\b.*?[(, ]start_ns="
                          r"(\d+)")


def _seconds(metric: Any, what: str, where: str) -> float | list[float] | None:
    """A per-record metric ``{"value": x, "unit": u}`` in seconds (None when absent)."""
    if metric is None:
        return None
    try:
        scale = _UNIT_S[metric["unit"]]
        value = metric["value"]
        if isinstance(value, list):
            return [float(v) * scale for v in value]
        return float(value) * scale
    except (KeyError, TypeError, ValueError) as e:
        raise AiperfError(f"{where}: metric {what} is not {{value, unit}} in a time unit "
                          f"({brief(metric, 120)}); is this aiperf {AIPERF_VERSION}?") from e


def _count(metric: Any) -> int | None:
    if not isinstance(metric, dict) or not isinstance(metric.get("value"), int | float):
        return None
    return int(metric["value"])


def _error_text(err: Any) -> str:
    if not isinstance(err, dict):
        return brief(f"aiperf error: {err}")
    code, kind, msg = err.get("code"), err.get("type") or "error", err.get("message") or ""
    head = f"HTTP {code} {kind}" if code else str(kind)
    return brief(f"{head}: {msg}" if msg else head)


def _error_class(err: Any) -> str:
    """The error class of an aiperf ``error`` object (aiperf 0.13.0 ``ErrorDetails``).

    HTTP errors carry the status as ``code`` and the reason as ``type``; exceptions carry the
    class name as ``type`` (aiohttp's ``ClientConnectorError``, ``ServerDisconnectedError``,
    ``ClientPayloadError``, ``TimeoutError``; aiperf's ``RequestCancellationError`` with code 499
    when its timeout or the run's end cancels a request; ``SSEResponseError``).
    """
    kind = str(err.get("type") or "") if isinstance(err, dict) else ""
    code = err.get("code") if isinstance(err, dict) else None
    if kind == "RequestCancellationError" or "Timeout" in kind:
        return TIMEOUT
    if "Connector" in kind or "ConnectionRefused" in kind:
        return CONNECT
    if "Disconnect" in kind or kind in ("ClientPayloadError", "ClientOSError",
                                        "ConnectionResetError"):
        return DISCONNECT
    if isinstance(code, int) and not isinstance(code, bool) and code != 499:
        return HTTP_STATUS
    return STREAM


def _phase_start_ns(artifact_dir: Path) -> int | None:
    try:
        text = (artifact_dir / LOG_FILE).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    m = _PHASE_START.search(text)
    return int(m.group(1)) if m else None


def read_summary(artifact_dir: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The summary aiperf writes (``profile_export_aiperf.json``): metric tag -> statistics.

    Each value keeps aiperf's keys (``unit``, ``avg``, ``min``, ``max``, ``std``, ``p1`` ...
    ``p99``, ``count``); top-level scalars (``aiperf_version``, ``was_cancelled``,
    ``is_complete``) come under the key ``"run"``. Empty when the file does not exist.

    Raises:
        AiperfError: the file exists but is not a JSON object.
    """
    path = Path(artifact_dir) / SUMMARY_FILE
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
    except (OSError, ValueError) as e:
        raise AiperfError(f"aiperf's summary {path} is unreadable ({brief(e, 120)}); rerun "
                          "the benchmark") from e
    out: dict[str, dict[str, Any]] = {k: v for k, v in data.items()
                                      if isinstance(v, dict) and "unit" in v}
    out["run"] = {k: v for k, v in data.items() if isinstance(v, str | int | float | bool)}
    return out


def parse_artifacts(artifact_dir: str | os.PathLike[str],
                    trace: AiperfTrace | None = None, *, isl: int | None = None,
                    osl: int | None = None) -> AiperfRun:
    """Read an aiperf artifact folder back into per-request records.

    Records (``profile_export.jsonl``, one JSON object per request: ``metadata`` with
    ``conversation_id``, ``credit_issued_ns``, ``request_start_ns``, ``benchmark_phase``,
    ``was_cancelled``; ``metrics`` with ``time_to_first_token``, ``inter_chunk_latency`` (list),
    ``input_sequence_length``, ``output_sequence_length``, each ``{"value", "unit"}``; an
    ``error`` object ``{code, type, message}`` on failure) become
    :class:`~domain.metrics.RequestRecord` s as the built-in HTTP runner makes them:

    - Clock: 0 = the profiling phase start (``start_ns`` of aiperf's ``PhaseRecordsStats`` log
      line; for a replay aiperf schedules row ``i`` at phase start + ``timestamp_i``). Without
      it: the least-late ``credit_issued_ns - scheduled`` (aiperf's own anchoring for its
      ``replay_sched_lag`` metrics).
    - ``arrival_s``: replay: the row's scheduled time (rows are matched by ``conversation_id``
      = ``r<row>``); synthetic: the credit issue time. ``sent_s``: ``request_start_ns``.
    - TTFT and ITL: aiperf's, measured from the send (so TTFT on our records includes the
      dispatch lag, as for the HTTP runner); ``finish_s`` = first token + sum of gaps.
    - Tokens: ``output_sequence_length`` / ``input_sequence_length`` (server usage under
      ``--use-server-token-count``); the plan's lengths when the server sent none.
    - Errors, classed as the HTTP runner classes them (:func:`_error_class`): aiperf's error
      (``HTTP 503 Service Unavailable: ...``), a cancelled request (timeout), a stream without
      its final usage chunk while other streams had one (disconnect: aiperf 0.13.0 does not
      flag a connection dropped mid-stream; measured against ``tests/fixtures/openai_stub.py
      --disconnect-every``), and a response without any token or with fewer output tokens than
      asked (truncated). A trace row without a record is an error record ("no record", class
      stream), with its send time set to its schedule.
    - Cached prompt tokens: ``usage_prompt_cache_read_tokens`` (SGLang with
      ``--enable-cache-report``), -1 when absent.

    Args:
        artifact_dir: aiperf's ``--artifact-dir``.
        trace: The replayed trace (:func:`write_trace` / :func:`read_trace`); None for a
            synthetic run.
        isl: Planned input tokens of a synthetic run (for failed requests' records).
        osl: Output tokens each synthetic request asked for (fewer = truncated); None: unchecked.

    Raises:
        AiperfError: no records file, a malformed line, a record of another trace, or a
            record without its timestamps.
    """
    adir = Path(artifact_dir)
    path = adir / RECORDS_FILE
    if not path.is_file():
        listed = sorted(p.name for p in adir.iterdir())[:8] if adir.is_dir() else []
        raise AiperfError(f"aiperf wrote no per-request records ({RECORDS_FILE}) in {adir} "
                          f"(holds: {', '.join(listed) or 'nothing'}); see {adir / LOG_FILE} "
                          "and rerun the benchmark")
    raw: list[tuple[int, dict[str, Any]]] = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    if not isinstance(rec, dict) or not isinstance(rec.get("metadata"), dict):
                        raise ValueError("no 'metadata' object")
                except ValueError as e:
                    raise AiperfError(f"{path}:{n} is not an aiperf record ({brief(e, 120)}); "
                                      "the export is damaged: rerun the benchmark") from e
                if rec["metadata"].get("benchmark_phase", "profiling") == "profiling":
                    raw.append((n, rec))
    except (OSError, UnicodeDecodeError) as e:
        raise AiperfError(f"cannot read {path} ({brief(e, 120)}); rerun the benchmark") from e

    def ns(n: int, meta: dict[str, Any], key: str) -> int:
        v = meta.get(key)
        if not isinstance(v, int):
            raise AiperfError(f"{path}:{n} has no integer metadata.{key}; is this aiperf "
                              f"{AIPERF_VERSION} output?")
        return v

    rows: list[int] = []
    if trace is not None:
        for n, rec in raw:
            cid = str(rec["metadata"].get("conversation_id"))
            m = SESSION_RE.match(cid)
            if m is None or int(m.group(1)) >= len(trace):
                raise AiperfError(f"{path}:{n} is for conversation {cid!r}, not a row of "
                                  f"{trace.path.name} ({len(trace)} rows); parse with the trace "
                                  "that was replayed")
            rows.append(int(m.group(1)))
        if len(set(rows)) != len(rows):
            raise AiperfError(f"{path} holds two records for one trace row; parse each run's "
                              "own artifact folder")
    credit = [ns(n, rec["metadata"], "credit_issued_ns") for n, rec in raw]
    start = [ns(n, rec["metadata"], "request_start_ns") for n, rec in raw]
    sched_ns = [int(round(trace.arrival_s[i] * 1e9)) for i in rows] if trace is not None \
        else [0] * len(raw)
    logged = _phase_start_ns(adir)
    least = min((c - s for c, s in zip(credit, sched_ns, strict=True)), default=0)
    if logged is not None and logged <= least + 1_000_000_000:  # this run's phase start
        zero, clock = logged, "phase start"
    else:
        zero, clock = least, "least-late credit"
    any_usage = any("output_sequence_length" in (rec.get("metrics") or {}) for _, rec in raw)

    built: list[tuple[float, float, int | None, RequestRecord, str | None, int]] = []
    last_s = 0.0
    for k, (n, rec) in enumerate(raw):
        meta, metrics = rec["metadata"], rec.get("metrics") or {}
        where = f"{path}:{n}"
        sent = (start[k] - zero) / 1e9
        plan_out: int | None
        if trace is not None:
            row = rows[k]
            arrival = float(trace.arrival_s[row])
            plan_in, plan_out = int(trace.input_tokens[row]), int(trace.output_tokens[row])
        else:
            row, arrival = None, (credit[k] - zero) / 1e9
            plan_in, plan_out = isl or 1, osl
        n_in = _count(metrics.get("input_sequence_length")) or plan_in
        ttft = _seconds(metrics.get("time_to_first_token"), "time_to_first_token", where)
        gaps = _seconds(metrics.get("inter_chunk_latency"), "inter_chunk_latency", where)
        itl = np.asarray(gaps if isinstance(gaps, list) else [], dtype=float)
        n_out = _count(metrics.get("output_sequence_length"))
        chunks = 0 if ttft is None else 1 + len(itl)
        error: str | None = None
        eclass: str | None = None
        if rec.get("error") is not None:
            error, eclass = _error_text(rec["error"]), _error_class(rec["error"])
        elif meta.get("was_cancelled"):
            error = "cancelled by aiperf before the response finished (duration/grace ended)"
            eclass = TIMEOUT
        elif not isinstance(ttft, float):
            error, eclass = "response without any token", TRUNCATED
        elif n_out is None and any_usage:
            error = (f"stream ended without its final usage chunk after {chunks} text chunks "
                     "(connection dropped mid-stream?)")
            eclass = DISCONNECT
        elif n_out is not None and plan_out is not None and n_out < plan_out:
            error = f"truncated output: {n_out} of the {plan_out} tokens asked"
            eclass = TRUNCATED
        cached = _count(metrics.get("usage_prompt_cache_read_tokens"))
        if error is None:
            assert isinstance(ttft, float)
            first = sent + ttft
            finish = first + float(itl.sum())
            r = RequestRecord(arrival_s=arrival, input_tokens=n_in,
                              output_tokens=n_out if n_out is not None else chunks,
                              first_token_s=first, finish_s=finish, itl_s=itl)
            last_s = max(last_s, finish)
        else:
            first = sent + ttft if isinstance(ttft, float) else math.nan
            r = RequestRecord(arrival_s=arrival, input_tokens=n_in, output_tokens=chunks,
                              first_token_s=first, error=error)
        end_ns = meta.get("request_end_ns")
        if isinstance(end_ns, int):
            last_s = max(last_s, (end_ns - zero) / 1e9)
        built.append((credit[k] / 1e9, sent, row, r, eclass, -1 if cached is None else cached))

    if trace is not None:
        by_row = {b[2]: b for b in built}
        ordered = []
        for i in range(len(trace)):
            if i in by_row:
                ordered.append(by_row[i])
            else:
                a = float(trace.arrival_s[i])
                ordered.append((0.0, a, i, RequestRecord(
                    arrival_s=a, input_tokens=int(trace.input_tokens[i]), output_tokens=0,
                    error="aiperf returned no record for this trace row (never sent, or "
                          "dropped by aiperf)"), STREAM, -1))
    else:
        ordered = sorted(built, key=lambda b: (b[0], b[1]))

    ready = _read_ready(adir)
    stopped = None
    if ready.get("was_cancelled"):
        stopped = "aiperf cancelled the run before it finished"
    elif ready.get("partial"):
        stopped = "aiperf exported partial results"
    return AiperfRun(records=[b[3] for b in ordered],
                     sent_s=np.array([b[1] for b in ordered], dtype=float), wall_s=last_s,
                     stopped_early=stopped, aiperf_metrics=read_summary(adir), clock=clock,
                     artifact_dir=adir, error_class=[b[4] for b in ordered],
                     cached_tokens=np.array([b[5] for b in ordered], dtype=np.int64))


def _read_ready(adir: Path) -> dict[str, Any]:
    try:
        data = json.loads((adir / ".aiperf_results_ready.json").read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


