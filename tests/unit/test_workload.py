"""Tests of domain.workload: trace loaders, Trace arithmetic and synthetic workloads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from domain.errors import ConfigInvalid, TraceInvalid
from domain.synthetic import synthetic_fixed
from domain.traces import load_azure, load_bailian, load_mooncake, load_trace
from domain.workload import Request, Trace

ROOT = Path(__file__).resolve().parents[2]
MOONCAKE_CONV = ROOT / "data/traces/mooncake_fast25_conversation_trace.jsonl"
AZURE_CONV = ROOT / "data/traces/AzureLLMInferenceTrace_conv.csv"
MOONCAKE_SYNTH = ROOT.parent / "shared" / "traces" / "mooncake_fast25_synthetic_trace.jsonl"
BAILIAN_TINY = ROOT / "tests/fixtures/qwen_bailian_tiny.jsonl"
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


def mc(ts: object, inp: object = 600, out: object = 10, ids: object = None, **extra: object) -> str:
    """One Mooncake JSONL line; hash_ids default to the right count for ``inp``."""
    if ids is None:
        ids = list(range(math.ceil(inp / 512))) if isinstance(inp, int) and inp > 0 else [0]
    row = {"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids, **extra}
    return json.dumps(row)


def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    p = tmp_path / name
    if isinstance(content, str):
        p.write_bytes(content.encode())
    else:
        p.write_bytes(content)
    return p


# 5 rows: arrivals 0, 1, 2.5, 2.5, 6 s; inputs 512, 513, 100, 1024, 2000; outputs 10..50.
TINY_MOONCAKE = "\n".join(
    [mc(0, 512, 10), mc(1000, 513, 20), mc(2500, 100, 30), mc(2500, 1024, 40), mc(6000, 2000, 50)]
)


@pytest.fixture
def tiny(tmp_path: Path) -> Trace:
    return load_mooncake(write(tmp_path, "tiny.jsonl", TINY_MOONCAKE + "\n"))


# ----------------------------------------------------------------------------- shipped traces


@pytest.fixture(scope="module")
def mooncake_conv() -> Trace:
    return load_trace(MOONCAKE_CONV)


@pytest.fixture(scope="module")
def azure_conv() -> Trace:
    return load_trace(AZURE_CONV)


def test_mooncake_conversation_matches_readme(mooncake_conv: Trace) -> None:
    t = mooncake_conv
    assert t.source_format == "mooncake"
    assert t.path == str(MOONCAKE_CONV)
    assert t.name == "mooncake_fast25_conversation_trace"
    assert len(t.requests) == 12_031
    assert t.requests[0].arrival_s == 0.0
    assert t.requests[-1].arrival_s == 3536.999
    assert all(r.block_size == 512 for r in t.requests)
    assert all(len(r.hash_ids) == math.ceil(r.input_tokens / 512) for r in t.requests)
    assert all(r.hash_ids[0] == 0 for r in t.requests)  # README: shared first block
    s = t.stats()
    assert s.count == 12_031
    assert s.span_s == 3536.999
    assert s.rate_per_s == pytest.approx(12_031 / 3536.999)
    assert round(s.input_tokens.mean) == 12_035
    assert round(s.output_tokens.mean) == 343
    assert (s.input_tokens.p50, s.input_tokens.p90, s.input_tokens.max) == (6909, 27367, 126195)
    assert (s.output_tokens.p50, s.output_tokens.p90, s.output_tokens.max) == (350, 597, 2000)
    assert round(s.input_tokens.p99) == 85400


def test_azure_conversation_matches_readme(azure_conv: Trace) -> None:
    t = azure_conv
    assert t.source_format == "azure"
    assert len(t.requests) == 19_366
    assert t.requests[0].arrival_s == 0.0
    assert t.requests[1].arrival_s == pytest.approx(50.9951690 - 46.6805900, abs=1e-9)
    assert all(r.hash_ids == () and r.block_size == 0 for r in t.requests)
    s = t.stats()
    assert s.span_s == pytest.approx(3501.7, abs=0.1)
    assert s.rate_per_s == pytest.approx(5.53, abs=0.005)
    assert s.input_tokens.p50 == 1020
    assert s.output_tokens.p50 == 129
    assert (round(s.input_tokens.mean), s.input_tokens.max) == (1155, 14050)
    assert (round(s.output_tokens.mean), s.output_tokens.max) == (211, 1000)
    assert (s.input_tokens.p99, s.output_tokens.p90, s.output_tokens.p99) == (4142, 424, 601)


@pytest.mark.skipif(not MOONCAKE_SYNTH.exists(), reason="shared synthetic trace not present")
def test_mooncake_synthetic_matches_readme() -> None:
    t = load_trace(MOONCAKE_SYNTH)
    assert len(t.requests) == 3_993
    assert t.stats().span_s == 1022.025
    assert round(t.stats().input_tokens.mean) == 15_325


# ----------------------------------------------------------------------------- small fixtures


def test_tiny_mooncake_loads_in_seconds(tiny: Trace) -> None:
    assert [r.arrival_s for r in tiny.requests] == [0.0, 1.0, 2.5, 2.5, 6.0]
    assert [len(r.hash_ids) for r in tiny.requests] == [1, 2, 1, 2, 4]
    assert tiny.requests[1] == Request(
        arrival_s=1.0, input_tokens=513, output_tokens=20, hash_ids=(0, 1), block_size=512
    )


def test_window_counts_and_rebases(tiny: Trace) -> None:
    w = tiny.window(1.0, 2.0)  # [1, 3): the rows at 1.0, 2.5, 2.5
    assert [r.arrival_s for r in w.requests] == [0.0, 1.5, 1.5]
    assert [r.input_tokens for r in w.requests] == [513, 100, 1024]
    assert w.source_format == "mooncake" and w.path == tiny.path
    assert len(tiny.window(0.0, 6.0).requests) == 4  # the end is exclusive: 6.0 is out
    assert [r.arrival_s for r in tiny.window(0.5, 100).requests] == [0.5, 2.0, 2.0, 5.5]


def test_scaled_divides_arrivals(tiny: Trace) -> None:
    assert [r.arrival_s for r in tiny.scaled(2.0).requests] == [0.0, 0.5, 1.25, 1.25, 3.0]
    assert [r.arrival_s for r in tiny.scaled(0.5).requests] == [0.0, 2.0, 5.0, 5.0, 12.0]
    assert tiny.scaled(2.0).stats().rate_per_s == pytest.approx(2 * 5 / 6)
    assert tiny.requests[1].arrival_s == 1.0  # the original is untouched


def test_head(tiny: Trace) -> None:
    assert [r.output_tokens for r in tiny.head(2).requests] == [10, 20]
    assert len(tiny.head(99).requests) == 5


def test_stats_hand_computed(tiny: Trace) -> None:
    s = tiny.stats()
    assert (s.count, s.span_s) == (5, 6.0)
    assert s.rate_per_s == pytest.approx(5 / 6)
    # inputs sorted: 100, 512, 513, 1024, 2000 -> p90 at index 3.6 = 1024 + 0.6 * 976
    assert s.input_tokens.p50 == 513
    assert s.input_tokens.p90 == pytest.approx(1609.6)
    assert s.input_tokens.mean == pytest.approx(4149 / 5)
    assert s.input_tokens.max == 2000
    # outputs 10..50 -> p99 at index 3.96 = 40 + 0.96 * 10
    assert s.output_tokens.p99 == pytest.approx(49.6)
    assert s.output_tokens.mean == 30


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda t: t.window(0.0, 0.0), id="window-zero-duration"),
        pytest.param(lambda t: t.window(-1.0, 5.0), id="window-negative-start"),
        pytest.param(lambda t: t.window(math.nan, 5.0), id="window-nan-start"),
        pytest.param(lambda t: t.window(6.5, 10.0), id="window-empty"),
        pytest.param(lambda t: t.scaled(0.0), id="scale-zero"),
        pytest.param(lambda t: t.scaled(-2.0), id="scale-negative"),
        pytest.param(lambda t: t.scaled(math.inf), id="scale-inf"),
        pytest.param(lambda t: t.head(0), id="head-zero"),
    ],
)
def test_bad_trace_parameters_raise_config_invalid(tiny: Trace, call) -> None:
    with pytest.raises(ConfigInvalid):
        call(tiny)


def test_models_validate_directly() -> None:
    with pytest.raises(ValidationError):
        Request(arrival_s=0.0, input_tokens=0, output_tokens=1)
    with pytest.raises(ValidationError):
        Request(arrival_s=-1.0, input_tokens=1, output_tokens=1)
    a = Request(arrival_s=2.0, input_tokens=1, output_tokens=1)
    b = Request(arrival_s=1.0, input_tokens=1, output_tokens=1)
    with pytest.raises(ValidationError):
        Trace(name="x", source_format="synthetic", requests=[a, b])
    with pytest.raises(ValidationError):
        Trace(name="x", source_format="synthetic", requests=[])
    with pytest.raises(ValidationError):
        a.arrival_s = 3.0  # frozen


def test_bailian_fixture_seconds_and_16_token_blocks() -> None:
    t = load_bailian(BAILIAN_TINY)
    assert t.source_format == "bailian"
    assert [r.arrival_s for r in t.requests] == [0.0, 0.25, 1.5, 1.5, 4.75]
    assert [r.input_tokens for r in t.requests] == [40, 16, 70, 33, 100]
    assert t.requests[2].hash_ids == (0, 1, 2, 4, 5)
    assert {r.block_size for r in t.requests} == {16}


def test_azure_seven_digit_fraction_midnight_and_offsets(tmp_path: Path) -> None:
    rows = [
        AZURE_HEADER,
        "2023-11-16 23:59:58.6805900,374,44",
        "2023-11-16 23:59:59.9999999,10,1",
        "2023-11-17 00:00:00.0000001,20,2",
        "2023-11-17 00:00:01,5,6",
    ]
    t = load_azure(write(tmp_path, "a.csv", "\r\n".join(rows) + "\r\n"))
    got = [r.arrival_s for r in t.requests]
    assert got == pytest.approx([0.0, 1.3194099, 1.3194101, 2.31941], abs=1e-9)
    assert [(r.input_tokens, r.output_tokens) for r in t.requests][0] == (374, 44)
    rows = [AZURE_HEADER, "2024-05-10 00:00:00.009930+00:00,1,1", "2024-05-10 02:00:01+02:00,2,2"]
    t = load_azure(write(tmp_path, "b.csv", "\n".join(rows)))
    assert t.requests[1].arrival_s == pytest.approx(0.99007, abs=1e-9)


def test_load_trace_detects_formats(tmp_path: Path, tiny: Trace) -> None:
    assert load_trace(BAILIAN_TINY).source_format == "bailian"
    assert load_trace(tiny.path).source_format == "mooncake"
    assert load_trace(write(tmp_path, "m.txt", TINY_MOONCAKE)).source_format == "mooncake"
    azure = AZURE_HEADER + "\r\n2023-11-16 18:15:46.6805900,374,44\r\n"
    assert load_trace(write(tmp_path, "a.log", azure)).source_format == "azure"
    assert load_trace(write(tmp_path, "a.csv", azure)).source_format == "azure"
    forced = load_trace(tiny.path, format="bailian")  # ms read as seconds: the caller's choice
    assert (forced.requests[1].arrival_s, forced.requests[1].block_size) == (1000.0, 16)
    with pytest.raises(ConfigInvalid):
        load_trace(BAILIAN_TINY, format="parquet")  # type: ignore[arg-type]
    with pytest.raises(TraceInvalid) as e:
        load_trace(write(tmp_path, "x.dat", "hello\n"))
    assert e.value.line is None and "format=" in str(e.value)


# ----------------------------------------------------------------------------- malformed input

A_ROW = "2023-11-16 18:15:46.6805900,374,44"
B_ROW = "2023-11-16 18:15:50.9951690,396,109"

BAD = [
    # (loader, file content, expected line or None, a word the message must contain)
    ("mooncake", b"", None, "empty"),
    ("mooncake", "\n  \n", None, "no requests"),
    ("mooncake", mc(0).encode() + b'\n{"timestamp": 1\xff\xfe}\n', 2, "UTF-8"),
    ("mooncake", mc(0) + '\n{"timestamp": 0,\n', 2, "malformed JSON"),
    ("mooncake", "[1, 2]\n", 1, "JSON object"),
    ("mooncake", mc(0) + '\n\n{"timestamp": 5, "input_length": 1, "hash_ids": [0]}', 3, "output_"),
    ("mooncake", mc("0"), 1, "timestamp"),
    ("mooncake", mc(None), 1, "timestamp"),
    ("mooncake", mc(True), 1, "timestamp"),
    ("mooncake", mc(0).replace("0", "NaN", 1), 1, "finite"),
    ("mooncake", mc(0) + "\n" + mc(10**400), 2, "finite"),
    ("mooncake", mc(0) + "\n" + mc(-5), 2, "negative"),
    ("mooncake", mc(0) + "\n" + mc(2000) + "\n" + mc(1000), 3, "sort"),
    ("mooncake", mc(0, inp=1.5, ids=[0]), 1, "input_length"),
    ("mooncake", mc(0, inp="100", ids=[0]), 1, "input_length"),
    ("mooncake", mc(0) + "\n" + mc(1, out=0), 2, "output_length"),
    ("mooncake", mc(0, inp=-5, ids=[]), 1, "input_length"),
    ("mooncake", mc(0) + "\n" + mc(1, inp=1025, ids=[0, 1]), 2, "ceil(1025/512) = 3"),
    ("mooncake", mc(0, ids="abc"), 1, "hash_ids"),
    ("mooncake", mc(0, ids=[0, "1"]), 1, "hash_ids"),
    ("bailian", '{"timestamp": 0.5, "input_length": 5, "output_length": 5}', 1, "hash_ids"),
    ("bailian", BAILIAN_TINY.read_text() + mc(1.0, ids=[0], chat_id=1), 6, "sort"),
    ("azure", b"", None, "empty"),
    ("azure", AZURE_HEADER + "\r\n", None, "no requests"),
    ("azure", "TIMESTAMP,Context,Generated\r\n" + A_ROW, 1, "header"),
    ("azure", f"{AZURE_HEADER}\r\n{A_ROW}\r\n".encode() + b"2023-11-16\xe9,1,1\r\n", 3, "UTF-8"),
    ("azure", f"{AZURE_HEADER}\r\n2023-11-16 18:15:46.6805900,374\r\n", 2, "3 comma-separated"),
    ("azure", f"{AZURE_HEADER}\r\n{A_ROW},7\r\n", 2, "3 comma-separated"),
    ("azure", f'{AZURE_HEADER}\r\n{A_ROW}\r\n"2023-11-16 18:15:50"x,1,1\r\n', 3, "malformed CSV"),
    ("azure", f"{AZURE_HEADER}\r\nyesterday,374,44\r\n", 2, "TIMESTAMP"),
    ("azure", f"{AZURE_HEADER}\r\n2023-13-16 18:15:46.6805900,374,44\r\n", 2, "month"),
    ("azure", f"{AZURE_HEADER}\r\n2023-11-16 24:15:46.6805900,374,44\r\n", 2, "time of day"),
    ("azure", f"{AZURE_HEADER}\r\n{A_ROW}\r\n{B_ROW[:28]}abc,1\r\n", 3, "ContextTokens"),
    ("azure", f"{AZURE_HEADER}\r\n{A_ROW}\r\n{B_ROW[:-3]}0\r\n", 3, "GeneratedTokens"),
    ("azure", f"{AZURE_HEADER}\r\n{B_ROW}\r\n{A_ROW}\r\n", 3, "sort"),
    ("azure", f"{AZURE_HEADER}\r\n{A_ROW}\r\n2023-11-16 18:15:50+00:00,1,1\r\n", 3, "UTC offsets"),
]
BAD_IDS = [
    "mc-empty", "mc-blank-lines", "mc-not-utf8", "mc-json-truncated", "mc-not-object",
    "mc-missing-field", "mc-ts-string", "mc-ts-null", "mc-ts-bool", "mc-ts-nan", "mc-ts-huge",
    "mc-ts-negative", "mc-unsorted", "mc-input-float", "mc-input-string", "mc-output-zero",
    "mc-input-negative", "mc-hash-count", "mc-hash-not-list", "mc-hash-string-item",
    "bl-missing-hash-ids", "bl-unsorted", "az-empty", "az-header-only", "az-wrong-header",
    "az-not-utf8", "az-two-fields", "az-four-fields", "az-bad-quote", "az-bad-timestamp",
    "az-month-13", "az-hour-24", "az-context-not-int", "az-generated-zero", "az-unsorted",
    "az-mixed-offsets",
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "content", "line", "word"), BAD, ids=BAD_IDS)
def test_malformed_input_raises_trace_invalid(
    tmp_path: Path, fmt: str, content: str | bytes, line: int | None, word: str
) -> None:
    path = write(tmp_path, "bad.csv" if fmt == "azure" else "bad.jsonl", content)
    loader = {"mooncake": load_mooncake, "bailian": load_bailian, "azure": load_azure}[fmt]
    with pytest.raises(TraceInvalid) as e:
        loader(path)
    assert e.value.line == line
    assert e.value.path == str(path)
    where = f"{path}:{line}: " if line is not None else f"{path}: "
    assert str(e.value).startswith(where)
    assert word in str(e.value)


def test_missing_file_raises_trace_invalid(tmp_path: Path) -> None:
    for load in (load_mooncake, load_azure, load_bailian, load_trace):
        with pytest.raises(TraceInvalid) as e:
            load(tmp_path / "nope.jsonl")
        assert e.value.line is None and "not found" in e.value.reason
    with pytest.raises(TraceInvalid):
        load_trace(tmp_path)  # a directory


@pytest.mark.parametrize("fmt", ["mooncake", "azure"])
def test_every_truncation_is_loaded_or_refused_cleanly(tmp_path: Path, fmt: str) -> None:
    text = (
        TINY_MOONCAKE
        if fmt == "mooncake"
        else f"{AZURE_HEADER}\r\n{A_ROW}\r\n{B_ROW}\r\n2023-11-16 18:15:52.5,1,1\r\n"
    )
    load = load_mooncake if fmt == "mooncake" else load_azure
    for cut in range(len(text)):
        path = write(tmp_path, f"cut.{fmt}", text[:cut])
        try:
            load(path)
        except TraceInvalid:
            pass  # anything else (KeyError, ValueError, ...) fails the test


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_poisson_rate_and_lengths() -> None:
    t = synthetic_fixed(2000, isl=1024, osl=128, rate_per_s=10.0, seed=0)
    assert t.source_format == "synthetic" and t.path is None
    assert len(t.requests) == 2000
    assert {(r.input_tokens, r.output_tokens) for r in t.requests} == {(1024, 128)}
    assert t.requests[0].arrival_s == 0.0
    s = t.stats()
    assert s.rate_per_s == pytest.approx(10.0, rel=0.05)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(t.requests, t.requests[1:], strict=False)]
    mean = sum(gaps) / len(gaps)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert cv == pytest.approx(1.0, abs=0.1)  # exponential gaps


def test_synthetic_is_deterministic_per_seed() -> None:
    a = synthetic_fixed(50, 10, 10, rate_per_s=5.0, seed=7)
    b = synthetic_fixed(50, 10, 10, rate_per_s=5.0, seed=7)
    c = synthetic_fixed(50, 10, 10, rate_per_s=5.0, seed=8)
    assert a.requests == b.requests
    assert a.requests != c.requests


def test_synthetic_uniform_and_all_at_once() -> None:
    u = synthetic_fixed(5, 100, 10, rate_per_s=2.0, arrival="uniform")
    assert [r.arrival_s for r in u.requests] == [0.0, 0.5, 1.0, 1.5, 2.0]
    burst = synthetic_fixed(4, 100, 10)
    assert [r.arrival_s for r in burst.requests] == [0.0] * 4
    s = burst.stats()
    assert (s.count, s.span_s, s.rate_per_s) == (4, 0.0, None)


def test_synthetic_bad_parameters_listed_together() -> None:
    with pytest.raises(ConfigInvalid) as e:
        synthetic_fixed(0, 0, 5, rate_per_s=-1.0, arrival="burst")  # type: ignore[arg-type]
    assert len(e.value.violations) == 4
