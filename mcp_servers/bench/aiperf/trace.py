"""Traces -> aiperf's ``mooncake_trace`` JSONL (:func:`write_trace`, :func:`convert_trace`).

- **Traces** (:func:`write_trace`, :func:`convert_trace`): every supported trace (Mooncake,
  Azure, Qwen-Bailian, synthetic; :mod:`domain.workload`) becomes aiperf's ``mooncake_trace``
  JSONL, one row per request: ``timestamp`` (float ms), ``input_length``, ``output_length``,
  ``hash_ids`` (when the trace has them) and a ``session_id`` ``r<row>`` that comes back in
  each per-request record as ``conversation_id``, so records map to rows exactly. Timestamps are
  pre-scaled by the replay's time scale and re-based on the window start in the file: aiperf's
  ``--synthesis-speedup-ratio`` failed on the real Mooncake trace and ``--replay-speedup``
  applies only to ``baseten_trace`` [7]; Azure CSV is not read by that loader [7]. ``hash_ids``
  are cut to ``ceil(input_length / block)`` because aiperf refuses a final block outside
  ``(0, block]`` (``PromptGenerator._build_token_sequence``), and a partial final block whose
  id stands for another size elsewhere loses that id (aiperf materializes an id at one size
  only); the block size (512 Mooncake, 16 Bailian) is passed with ``--isl-block-size``.
- **Schedule**: ``--fixed-schedule --fixed-schedule-start-offset 0`` makes the file's
  timestamps absolute offsets from the phase start, so the idle time before a window's first
  request is kept, as :meth:`domain.workload.Trace.window` keeps it (aiperf 0.13.0 otherwise
  defaults to ``auto_offset``, which shifts the first request to 0).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from domain.workload import Request, load_trace
from mcp_servers.bench.aiperf.common import AiperfError, brief

# ---------------------------------------------------------------------------------------------
# Traces -> aiperf mooncake_trace JSONL


def session_id(row: int) -> str:
    """The ``session_id`` of trace row ``row`` (0-based) in a file written by :func:`write_trace`.

    aiperf echoes it as each record's ``metadata.conversation_id``.
    """
    return f"r{row:06d}"


SESSION_RE = re.compile(r"^r(\d{6,})$")


@dataclass(frozen=True)
class AiperfTrace:
    """A trace file in aiperf's ``mooncake_trace`` format and the schedule it encodes.

    Attributes:
        path: The JSONL file.
        arrival_s: Scheduled send time of each row, seconds after the phase start (already
            scaled and re-based on the window start).
        input_tokens: Planned prompt length of each row, tokens.
        output_tokens: Planned output length of each row, tokens.
        block_size: Tokens per ``hash_ids`` block (512 Mooncake, 16 Bailian); 0 when the rows
            carry no hash ids (Azure, synthetic), then aiperf samples each prompt on its own.
    """

    path: Path
    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    block_size: int

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def span_s(self) -> float:
        """Seconds from the phase start to the last scheduled send."""
        return float(self.arrival_s[-1]) if len(self.arrival_s) else 0.0


def trace_rows(requests: Sequence[Request]) -> tuple[list[dict[str, Any]], int]:
    """The aiperf ``mooncake_trace`` rows of ``requests`` and their common hash block size.

    Args:
        requests: Requests sorted by ``arrival_s`` (seconds; already windowed and scaled).

    aiperf materializes each hash id once, at one size, and fails the run when a trace uses
    an id at two sizes ("hash_id 2 requested at 16 tokens but was already materialized at 8
    tokens", measured with the Bailian fixture, where a partial final block's id comes back
    as a full block in the next turn). So a row whose *partial* final block carries an id that
    stands for another size elsewhere loses that last id: aiperf then fills the tail with fresh
    tokens (its "prefix only" layout), and the shared full blocks stay shared.

    Returns:
        ``(rows, block_size)``: one dict per request with ``session_id``, ``timestamp`` (ms,
        rounded to 1 µs), ``input_length``, ``output_length`` and, when the request has hash ids,
        ``hash_ids`` cut to ``ceil(input_length / block_size)`` (less a conflicting partial
        tail, above); ``block_size`` is 0 when no request has hash ids.

    Raises:
        AiperfError: for no requests, unsorted arrivals, or requests with different block
            sizes (aiperf takes one ``--isl-block-size`` per run).
    """
    if not requests:
        raise AiperfError("the trace window holds no request; pick a window with requests")
    sizes = {r.block_size for r in requests if r.hash_ids and r.block_size > 0}
    if len(sizes) > 1:
        raise AiperfError(f"requests mix hash block sizes {sorted(sizes)}; aiperf takes one "
                          "block size per run: replay one trace format at a time")
    block = sizes.pop() if sizes else 0
    ids_of = [list(r.hash_ids[:-(-r.input_tokens // block)]) if block and r.hash_ids else []
              for r in requests]
    # Tokens each id stands for: a full block, or the partial final block of its row.
    seen: dict[int, set[int]] = {}
    for r, ids in zip(requests, ids_of, strict=True):
        for k, h in enumerate(ids):
            last = k == len(ids) - 1
            seen.setdefault(h, set()).add(min(block, r.input_tokens - k * block) if last else block)
    rows: list[dict[str, Any]] = []
    previous = -math.inf
    for i, (r, ids) in enumerate(zip(requests, ids_of, strict=True)):
        if r.arrival_s < previous:
            raise AiperfError(f"request {i} arrives at {r.arrival_s} s, before request {i - 1} "
                              f"({previous} s); sort the requests by arrival_s")
        previous = r.arrival_s
        row: dict[str, Any] = {"session_id": session_id(i),
                               "timestamp": round(r.arrival_s * 1000.0, 3),
                               "input_length": r.input_tokens,
                               "output_length": r.output_tokens}
        if ids and len(seen[ids[-1]]) > 1 and r.input_tokens - (len(ids) - 1) * block < block:
            ids = ids[:-1]  # a partial tail whose id also stands for other sizes: unhashed
        if ids:
            row["hash_ids"] = ids
        rows.append(row)
    return rows, block


def write_trace(requests: Sequence[Request], path: str | os.PathLike[str]) -> AiperfTrace:
    """Write ``requests`` as an aiperf ``mooncake_trace`` JSONL file (see :func:`trace_rows`).

    The file is written to a temporary name and renamed, so a reader never sees half of it.

    Args:
        requests: Windowed, scaled requests sorted by arrival (seconds from the window start).
        path: Destination file; its folder is created.

    Raises:
        AiperfError: see :func:`trace_rows`; or the file cannot be written.
    """
    rows, block = trace_rows(requests)
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, separators=(",", ":")) + "\n")
        os.replace(tmp, out)
    except OSError as e:
        raise AiperfError(f"cannot write the aiperf trace {out} ({e.strerror or e}); "
                          "give a writable artifacts folder") from e
    return AiperfTrace(
        path=out,
        arrival_s=np.array([r.arrival_s for r in requests], dtype=float),
        input_tokens=np.array([r.input_tokens for r in requests], dtype=np.int64),
        output_tokens=np.array([r.output_tokens for r in requests], dtype=np.int64),
        block_size=block)


def convert_trace(source: str | os.PathLike[str], out: str | os.PathLike[str], *,
                  format: Literal["auto", "mooncake", "azure", "bailian"] = "auto",
                  start_s: float = 0.0, duration_s: float | None = None,
                  time_scale: float = 1.0) -> AiperfTrace:
    """Convert a window of a Mooncake, Azure or Qwen-Bailian trace file for aiperf.

    The window ``[start_s, start_s + duration_s)`` (trace seconds) is cut with
    :meth:`~domain.workload.Trace.window` (arrivals re-based on ``start_s``, idle lead kept),
    then replayed ``time_scale`` times faster (:meth:`~domain.workload.Trace.scaled`): the
    file's timestamps are ``(arrival - start_s) / time_scale`` in ms, exactly the schedule the
    built-in HTTP runner sends.

    Args:
        source: Trace file (``.jsonl`` Mooncake/Bailian, ``.csv`` Azure).
        out: The aiperf JSONL to write.
        format: Loader to use, or ``"auto"`` (:func:`domain.workload.load_trace`).
        start_s: Window start, trace seconds.
        duration_s: Window length, trace seconds; None for the rest of the trace.
        time_scale: Speed-up factor (2.0 = twice the request rate).

    Raises:
        TraceInvalid: malformed trace; ConfigInvalid: empty window or bad scale;
        AiperfError: the file cannot be written.
    """
    trace = load_trace(source, format)
    if duration_s is None:
        duration_s = max(trace.requests[-1].arrival_s - start_s, 0.0) + 1.0
    return write_trace(trace.window(start_s, duration_s).scaled(time_scale).requests, out)


def read_trace(path: str | os.PathLike[str], block_size: int = 0) -> AiperfTrace:
    """Read back a file written by :func:`write_trace` (e.g. to parse a Kubernetes Job's run).

    ``block_size`` is not stored in the file; pass the one :func:`write_trace` reported if
    the result is used for more than parsing.

    Raises:
        AiperfError: the file is missing, not JSONL, or its rows lack the fields or the
            ``r<row>`` session ids :func:`write_trace` writes.
    """
    p = Path(path)
    arrival: list[float] = []
    n_in: list[int] = []
    n_out: list[int] = []
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise AiperfError(f"cannot read the aiperf trace {p} ({e}); convert the trace again "
                          "with write_trace") from e
    for n, line in enumerate(x for x in lines if x.strip()):
        try:
            row = json.loads(line)
            if row["session_id"] != session_id(n):
                raise ValueError(f"session_id {row['session_id']!r}, expected {session_id(n)!r}")
            arrival.append(float(row["timestamp"]) / 1000.0)
            n_in.append(int(row["input_length"]))
            n_out.append(int(row["output_length"]))
        except (ValueError, KeyError, TypeError) as e:
            raise AiperfError(f"{p} row {n + 1} is not a row write_trace writes ({brief(e)}); "
                              "convert the trace again with write_trace") from e
    if not arrival:
        raise AiperfError(f"{p} holds no rows; convert the trace again with write_trace")
    return AiperfTrace(path=p, arrival_s=np.array(arrival), input_tokens=np.array(n_in),
                       output_tokens=np.array(n_out), block_size=block_size)


