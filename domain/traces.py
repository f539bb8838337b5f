"""Reading trace files: the Mooncake, Bailian and Azure loaders and format detection.

Formats, units and the exact contents of the shipped traces are documented in
``data/traces/SOURCES.md`` (the "traces README"); the shipped copies live in
``data/traces/``.
Units here: arrival times in seconds from the start of the workload, lengths in tokens.

Every loader streams its file line by line, validates each record explicitly and raises
:class:`~domain.errors.TraceInvalid` with the path, the 1-based line number and a fix hint; no
``KeyError``/``ValueError``/``UnicodeDecodeError`` escapes. Loaders refuse rows whose arrival time
is earlier than the row before (the traces README documents every supported trace as sorted), so a
damaged or hand-edited file is reported instead of silently reordered.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Iterator
from datetime import date
from typing import Any, BinaryIO, Literal

from domain.errors import ConfigInvalid, TraceInvalid
from domain.trace_paths import check_trace_path
from domain.workload import Request, SourceFormat, Trace

MOONCAKE_BLOCK = 512
BAILIAN_BLOCK = 16
AZURE_HEADER = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
MAX_TRACE_TOKENS = 100_000_000  # 10x the longest context of any model (10M); larger is damage


def _lines(path: str) -> Iterator[tuple[int, str]]:
    """Yield (1-based line number, text with its line ending) for every line of ``path``.

    Decodes each line strictly as UTF-8 so a bad byte is reported at its own line; strips a
    leading byte-order mark. Raises TraceInvalid for a missing, unreadable or empty file.
    """
    check_trace_path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError as e:
        raise TraceInvalid(path, "file not found; check the path (shipped: data/traces/)") from e
    except OSError as e:
        raise TraceInvalid(
            path, f"cannot open the file ({e.strerror}); pass a readable file"
        ) from e
    with f:
        n = 0
        for n, raw in enumerate(_read(path, f), start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TraceInvalid(
                    path,
                    f"bytes are not UTF-8 ({e.reason} at byte {e.start} of the line); "
                    "re-export the trace as UTF-8 text",
                    n,
                ) from e
            if n == 1 and text.startswith("\ufeff"):
                text = text[1:]
            yield n, text
        if n == 0:
            raise TraceInvalid(path, "file is empty (0 bytes); pass a trace with at least one row")


def _read(path: str, f: BinaryIO) -> Iterator[bytes]:
    while True:
        try:
            raw = f.readline()
        except OSError as e:
            raise TraceInvalid(path, f"cannot read the file ({e.strerror})") from e
        if not raw:
            return
        yield raw


def _fields(path: str, line: int, text: str, wanted: tuple[str, ...]) -> dict[str, Any]:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceInvalid(
            path,
            f"malformed JSON ({e.msg} at column {e.colno}); each line must be one JSON object",
            line,
        ) from e
    except ValueError as e:  # an integer literal beyond Python's int digit limit (4300)
        raise TraceInvalid(
            path, "a number has too many digits to be a count or a time; the row is damaged: "
            "drop it", line
        ) from e
    except RecursionError as e:  # arrays/objects nested deeper than the parser's stack
        raise TraceInvalid(
            path, "JSON nested too deeply to parse; each line must be one flat JSON object "
            "(the row is damaged: drop it)", line
        ) from e
    if not isinstance(row, dict):
        raise TraceInvalid(path, f"expected a JSON object, got {type(row).__name__}", line)
    missing = [k for k in wanted if k not in row]
    if missing:
        raise TraceInvalid(
            path,
            f"missing field(s) {', '.join(missing)}; every row needs {', '.join(wanted)}",
            line,
        )
    return row


def _number(path: str, line: int, row: dict[str, Any], key: str, unit: str) -> float:
    v = row[key]
    try:
        value = float(v) if type(v) in (int, float) else math.nan  # bool, str, None: refused
    except OverflowError:  # an integer literal beyond the float range
        value = math.nan
    if not math.isfinite(value):
        raise TraceInvalid(path, f"{key} must be a finite number of {unit}, got {v!r:.80}", line)
    if value < 0:
        raise TraceInvalid(
            path,
            f"{key} is negative ({v}); timestamps are relative to the trace start (>= 0)",
            line,
        )
    return value


def _length(path: str, line: int, value: object, key: str) -> int:
    if type(value) is not int:
        raise TraceInvalid(
            path, f"{key} must be an integer number of tokens, got {value!r:.80}", line
        )
    if value < 1:
        raise TraceInvalid(path, f"{key} must be >= 1 token, got {value}; drop the row", line)
    if value > MAX_TRACE_TOKENS:
        raise TraceInvalid(path, f"{key} is {value} tokens, more than any model's context "
                           f"(limit {MAX_TRACE_TOKENS:,}); the row is damaged: drop it", line)
    return value


def _hash_ids(path: str, line: int, value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not set(map(type, value)) <= {int}:
        raise TraceInvalid(path, "hash_ids must be a JSON list of integers", line)
    return tuple(value)


def _check_order(path: str, line: int, arrival_s: float, previous_s: float) -> None:
    if arrival_s < previous_s:
        raise TraceInvalid(
            path,
            f"timestamp goes back in time ({arrival_s} s after {previous_s} s on the "
            "previous row); the format is sorted by arrival: sort the file by timestamp",
            line,
        )


def _finish(path: str, requests: list[Request], fmt: SourceFormat) -> Trace:
    if not requests:
        raise TraceInvalid(path, "holds no requests (only blank lines or a header)")
    return Trace(
        name=os.path.splitext(os.path.basename(path))[0],
        path=path,
        source_format=fmt,
        requests=requests,
    )


def _load_jsonl(path: str, fmt: Literal["mooncake", "bailian"]) -> Trace:
    wanted = ("timestamp", "input_length", "output_length", "hash_ids")
    block = MOONCAKE_BLOCK if fmt == "mooncake" else BAILIAN_BLOCK
    unit = "milliseconds" if fmt == "mooncake" else "seconds"
    requests: list[Request] = []
    previous = 0.0
    for line, text in _lines(path):
        if not text.strip():
            continue
        row = _fields(path, line, text, wanted)
        ts = _number(path, line, row, "timestamp", unit)
        arrival = ts / 1000.0 if fmt == "mooncake" else ts
        n_in = _length(path, line, row["input_length"], "input_length")
        n_out = _length(path, line, row["output_length"], "output_length")
        ids = _hash_ids(path, line, row["hash_ids"])
        if fmt == "mooncake" and len(ids) != -(-n_in // block):
            raise TraceInvalid(
                path,
                f"{len(ids)} hash_ids for input_length {n_in}, expected "
                f"ceil({n_in}/{block}) = {-(-n_in // block)}; the row is damaged",
                line,
            )
        _check_order(path, line, arrival, previous)
        previous = arrival
        requests.append(
            Request(
                arrival_s=arrival,
                input_tokens=n_in,
                output_tokens=n_out,
                hash_ids=ids,
                block_size=block,
            )
        )
    return _finish(path, requests, fmt)


def load_mooncake(path: str | os.PathLike[str]) -> Trace:
    """Load a Mooncake FAST'25 JSONL trace (traces README, sections 2 and 3).

    Each line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
    "hash_ids": [...]}``: ``timestamp`` is integer **milliseconds** relative to the trace start
    (converted to seconds here), ``hash_ids`` are 512-token prefix blocks and must number
    ``ceil(input_length / 512)``. Blank lines are skipped; other keys are ignored.
    Rows must be sorted by timestamp (ties allowed); an unsorted file is refused, not sorted.

    Args:
        path: The ``.jsonl`` file.

    Returns:
        A trace with ``source_format="mooncake"`` and ``block_size=512`` on every request.

    Raises:
        TraceInvalid: for a missing, empty or non-UTF-8 file, malformed JSON, a missing or
            wrongly typed field, a length < 1, a negative or non-finite timestamp, a timestamp
            earlier than the previous row's, or a ``hash_ids`` count that does not match.
    """
    return _load_jsonl(os.fspath(path), "mooncake")


def load_bailian(path: str | os.PathLike[str]) -> Trace:
    """Load a Qwen-Bailian usage trace (JSONL; traces README, "Traces that are not included").

    Each line holds ``timestamp`` (float **seconds** relative to the file start),
    ``input_length`` and ``output_length`` (tokens) and ``hash_ids`` (16-token blocks). The
    session keys ``chat_id``, ``parent_chat_id``, ``type`` and ``turn`` are ignored. The
    ``hash_ids`` count is not checked against ``input_length`` (no shipped data to verify the
    rule against). Rows must be sorted by timestamp; an unsorted file is refused, not sorted.

    Args:
        path: The ``.jsonl`` file.

    Returns:
        A trace with ``source_format="bailian"`` and ``block_size=16`` on every request.

    Raises:
        TraceInvalid: for a missing, empty or non-UTF-8 file, malformed JSON, a missing or
            wrongly typed field, a length < 1, a negative or non-finite timestamp, or a
            timestamp earlier than the previous row's.
    """
    return _load_jsonl(os.fspath(path), "bailian")


_AZURE_TS = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"(Z|[+-]\d{2}:\d{2})?"
)


def _azure_seconds(path: str, line: int, text: str) -> tuple[float, float, bool]:
    """Parse an Azure TIMESTAMP into (whole seconds since 0001-01-01, fraction, has offset)."""
    m = _AZURE_TS.fullmatch(text.strip())
    bad = (
        f"TIMESTAMP {text!r} is not 'YYYY-MM-DD HH:MM:SS[.fffffff][+HH:MM]'; "
        "keep the format of the published Azure trace"
    )
    if m is None:
        raise TraceInvalid(path, bad, line)
    y, mo, d, hh, mm, ss = (int(g) for g in m.groups()[:6])
    try:
        day = date(y, mo, d).toordinal()
    except ValueError as e:
        raise TraceInvalid(path, f"{bad} ({e})", line) from e
    if hh > 23 or mm > 59 or ss > 59:
        raise TraceInvalid(path, f"{bad} (time of day out of range)", line)
    whole = day * 86400 + hh * 3600 + mm * 60 + ss
    digits, offset = m.group(7), m.group(8)
    if offset and offset != "Z":
        sign = 1 if offset[0] == "+" else -1
        whole -= sign * (int(offset[1:3]) * 3600 + int(offset[4:6]) * 60)
    frac = int(digits) / 10 ** len(digits) if digits else 0.0
    return float(whole), frac, offset is not None


def load_azure(path: str | os.PathLike[str]) -> Trace:
    """Load an Azure LLM inference CSV trace (traces README, section 1).

    The header must be ``TIMESTAMP,ContextTokens,GeneratedTokens``; line endings may be CRLF.
    ``TIMESTAMP`` is an absolute wall-clock time with up to 9 fractional digits (the 2023
    traces have 7, which ``datetime.strptime`` cannot read, so it is parsed by hand) and an
    optional UTC offset (the 2024 traces); arrivals are seconds after the first row.
    ``ContextTokens``/``GeneratedTokens`` are the input/output lengths in tokens. Rows must be
    sorted by time; an unsorted file is refused, not sorted. The trace has no prefix hashes.

    Args:
        path: The ``.csv`` file.

    Returns:
        A trace with ``source_format="azure"``, empty ``hash_ids`` and ``block_size=0``.

    Raises:
        TraceInvalid: for a missing, empty or non-UTF-8 file, a wrong header, a row without
            exactly 3 fields, an unparsable timestamp or length, a length < 1, timestamps that
            mix UTC offsets with naive times, or a row earlier than the previous one.
    """
    p = os.fspath(path)
    requests: list[Request] = []
    first: tuple[float, float, bool] | None = None  # whole seconds, fraction, has UTC offset
    previous = 0.0
    for line, text in _lines(p):
        try:  # one request per physical line: parsing line by line keeps line numbers exact
            fields = next(csv.reader([text], strict=True), [])
        except csv.Error as e:
            raise TraceInvalid(p, f"malformed CSV ({e}); one request per line", line) from e
        if line == 1:
            if [f.strip() for f in fields] != AZURE_HEADER:
                raise TraceInvalid(
                    p,
                    f"header is {','.join(fields)!r}, expected {','.join(AZURE_HEADER)!r}; "
                    "is this an Azure LLM inference trace?",
                    1,
                )
            continue
        if not "".join(fields).strip():
            continue
        if len(fields) != 3:
            raise TraceInvalid(p, f"expected 3 comma-separated fields, got {len(fields)}", line)
        ts = _azure_seconds(p, line, fields[0])
        if first is None:
            first = ts
        elif ts[2] != first[2]:
            raise TraceInvalid(
                p, "timestamps mix UTC offsets and naive times; use one form throughout", line
            )
        arrival = (ts[0] - first[0]) + (ts[1] - first[1])
        n_in = _length(p, line, _csv_int(fields[1]), "ContextTokens")
        n_out = _length(p, line, _csv_int(fields[2]), "GeneratedTokens")
        _check_order(p, line, arrival, previous)
        previous = arrival
        requests.append(Request(arrival_s=arrival, input_tokens=n_in, output_tokens=n_out))
    return _finish(p, requests, "azure")


def _csv_int(text: str) -> int | str:
    s = text.strip()
    return int(s) if re.fullmatch(r"[+-]?\d{1,30}", s) else text  # int() refuses > 4300 digits


def load_trace(
    path: str | os.PathLike[str],
    format: Literal["auto", "mooncake", "azure", "bailian"] = "auto",
) -> Trace:
    """Load a trace file, detecting its format unless ``format`` names it.

    Detection: ``.csv`` is Azure; ``.jsonl``/``.json`` is Bailian when the first non-blank line
    is an object carrying ``chat_id`` (Bailian's session key), else Mooncake. Any other
    extension is sniffed by content (a ``TIMESTAMP,`` header is Azure, a ``{`` line JSONL).

    Args:
        path: The trace file.
        format: ``"auto"``, or the loader to use.

    Raises:
        ConfigInvalid: for an unknown ``format``.
        TraceInvalid: when the format cannot be told, and everything the chosen loader raises.
    """
    p = os.fspath(path)
    loaders = {"mooncake": load_mooncake, "azure": load_azure, "bailian": load_bailian}
    if format != "auto":
        if format not in loaders:
            raise ConfigInvalid([f"format must be auto, {', '.join(loaders)}; got {format!r}"])
        return loaders[format](p)
    return loaders[_detect(p)](p)


def _detect(path: str) -> Literal["mooncake", "azure", "bailian"]:
    ext = os.path.splitext(path)[1].lower()
    if ext == ".csv":
        return "azure"
    first = ""
    for _, text in _lines(path):
        if text.strip():
            first = text.strip()
            break
    if ext in (".jsonl", ".json") or first.startswith("{"):
        try:
            row = json.loads(first)
        except (ValueError, RecursionError):  # malformed, an int over the digit limit, or
            return "mooncake"  # nested too deeply: the loader reports the line precisely
        return "bailian" if isinstance(row, dict) and "chat_id" in row else "mooncake"
    if first.startswith("TIMESTAMP,"):
        return "azure"
    raise TraceInvalid(
        path,
        f"cannot tell the trace format from extension {ext!r} or the first line; "
        "pass format='mooncake', 'azure' or 'bailian'",
    )
