"""Bad trace files: the loaders answer with a Trace or a TraceInvalid naming the file, the line and
the fix, never with another exception (hypothesis-generated rows, bytes and CSV, plus the kept
corpus in tests/fuzz/traces/).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from domain.errors import ConfigInvalid, TraceInvalid
from domain.traces import MAX_TRACE_TOKENS, load_trace
from domain.workload import Trace

CORPUS = Path(__file__).resolve().parents[1] / "fuzz" / "traces"
MANIFEST = json.loads((CORPUS / "MANIFEST.json").read_text())
FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])

# JSON values a damaged or hand-edited row may hold where a number or a list belongs.
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.integers(0, 5000),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.sampled_from(["0", "-1", "1e999", "NaN", "\u202e", "\x00"]),
)
values = st.one_of(scalars, st.lists(scalars, max_size=4), st.dictionaries(st.text(max_size=3),
                                                                            scalars, max_size=2))
good_row = st.builds(
    lambda ts, n_in, n_out: {"timestamp": ts, "input_length": n_in, "output_length": n_out,
                             "hash_ids": list(range(-(-n_in // 512)))},
    st.integers(0, 10**7), st.integers(1, 3000), st.integers(1, 3000))


@st.composite
def jsonl_files(draw: st.DrawFn) -> bytes:
    """Rows that are mostly well formed, with some fields, lines or bytes damaged."""
    rows = draw(st.lists(good_row, min_size=0, max_size=6))
    lines: list[bytes] = []
    for row in rows:
        damage = draw(st.sampled_from(["none", "none", "value", "drop", "extra", "cut",
                                       "bytes", "blank", "chat_id"]))
        if damage == "value":
            row[draw(st.sampled_from(sorted(row)))] = draw(values)
        elif damage == "drop":
            del row[draw(st.sampled_from(sorted(row)))]
        elif damage == "extra":
            row[draw(st.text(max_size=5))] = draw(values)
        elif damage == "chat_id":
            row["chat_id"] = draw(st.integers(0, 9))
        text = json.dumps(row, allow_nan=True).encode()
        if damage == "cut":
            text = text[:draw(st.integers(0, max(0, len(text) - 1)))]
        elif damage == "bytes":
            at = draw(st.integers(0, len(text)))
            text = text[:at] + draw(st.binary(min_size=1, max_size=4)) + text[at:]
        elif damage == "blank":
            text = b"  "
        lines.append(text)
    sep = draw(st.sampled_from([b"\n", b"\r\n"]))
    return sep.join(lines) + draw(st.sampled_from([b"", sep]))


def _write(data: bytes, suffix: str) -> str:
    fd, path = tempfile.mkstemp(suffix=suffix, prefix="fuzz-trace-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def _check(path: str, fmt: str, data: bytes) -> Trace | TraceInvalid:
    """Load ``path``; assert the outcome is a sound Trace or a TraceInvalid that names the line."""
    try:
        trace = load_trace(path, fmt)  # type: ignore[arg-type]
    except TraceInvalid as e:
        assert str(e).startswith(path), str(e)
        assert e.reason and len(str(e)) < 600, "the reason must be short and say what to do"
        if e.line is not None:
            assert 1 <= e.line <= data.count(b"\n") + 1, (e.line, str(e))
        return e
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals == sorted(arrivals) and all(math.isfinite(a) and a >= 0 for a in arrivals)
    assert all(1 <= r.input_tokens <= MAX_TRACE_TOKENS and 1 <= r.output_tokens
               <= MAX_TRACE_TOKENS for r in trace.requests)
    stats = trace.stats()  # numpy over every length: must not overflow
    assert stats.count == len(trace)
    assert len(trace.window(0, stats.span_s + arrivals[0] + 1)) == len(trace)
    return trace


@FUZZ
@given(data=jsonl_files(), fmt=st.sampled_from(["auto", "mooncake", "bailian"]),
       suffix=st.sampled_from([".jsonl", ".json", ".log"]))
@example(data=b'{"timestamp": 0, "input_length": ' + b"9" * 5000 + b"}\n", fmt="auto",
         suffix=".jsonl")
@example(data=b'{"timestamp": 0, "input_length": 5, "output_length": 100000000000000000000000,'
              b' "hash_ids": [1]}\n', fmt="bailian", suffix=".jsonl")
def test_jsonl_loaders_answer_a_trace_or_trace_invalid(data: bytes, fmt: str,
                                                        suffix: str) -> None:
    path = _write(data, suffix)
    try:
        _check(path, fmt, data)
    finally:
        os.unlink(path)


timestamps = st.one_of(
    st.builds(lambda y, mo, d, h, mi, s, f: f"{y:04d}-{mo:02d}-{d:02d} {h:02d}:{mi:02d}:{s:02d}"
              f".{f}", st.integers(0, 9999), st.integers(0, 13), st.integers(0, 32),
              st.integers(0, 25), st.integers(0, 61), st.integers(0, 61),
              st.integers(0, 10**9)),
    st.text(max_size=30),
    st.sampled_from(["2023-11-16 18:15:46.6805900", "2023-11-16T18:15:46Z",
                     "2023-11-16 18:15:46+05:30", "2023-11-16 18:15:46.1234567890"]))
tokens = st.one_of(st.integers(-5, 10**9).map(str), st.text(max_size=6),
                   st.sampled_from(["9" * 5000, " 12 ", "1.5", "+3", "", "0x10"]))


@FUZZ
@given(rows=st.lists(st.tuples(timestamps, tokens, tokens,
                               st.sampled_from(["", "", ",extra", '"', "\n"])), max_size=6),
       header=st.sampled_from(["TIMESTAMP,ContextTokens,GeneratedTokens", "TIMESTAMP,a,b", ""]),
       sep=st.sampled_from(["\n", "\r\n"]))
def test_azure_loader_answers_a_trace_or_trace_invalid(rows: list[tuple[str, str, str, str]],
                                                       header: str, sep: str) -> None:
    text = sep.join([header] + [f"{t},{a},{b}{x}" for t, a, b, x in rows]) + sep
    data = text.encode("utf-8", errors="surrogatepass")
    path = _write(data, ".csv")
    try:
        _check(path, "auto", data)
    finally:
        os.unlink(path)


@FUZZ
@given(data=st.binary(max_size=300), suffix=st.sampled_from([".jsonl", ".csv", ".txt", ""]))
def test_random_bytes_answer_trace_invalid(data: bytes, suffix: str) -> None:
    path = _write(data, suffix)
    try:
        _check(path, "auto", data)
    finally:
        os.unlink(path)


@pytest.mark.parametrize("name", sorted(MANIFEST), ids=str)
def test_trace_corpus(name: str) -> None:
    case = MANIFEST[name]
    path = str(CORPUS / name)
    got = _check(path, case["format"], (CORPUS / name).read_bytes())
    if case["error"] is None:
        assert isinstance(got, Trace), got
    else:
        assert isinstance(got, TraceInvalid), f"{name} loaded but should fail"
        assert case["error"] in got.reason, got.reason
        assert got.line == case["line"], (got.line, got.reason)


def test_unknown_format_names_the_choices() -> None:
    with pytest.raises(ConfigInvalid, match="format must be auto, mooncake, azure, bailian"):
        load_trace(CORPUS / "ok_mooncake.jsonl", "parquet")  # type: ignore[arg-type]


def test_directory_and_missing_file_are_trace_invalid(tmp_path: Path) -> None:
    for p in (tmp_path, tmp_path / "nope.jsonl"):
        with pytest.raises(TraceInvalid):
            load_trace(p)
