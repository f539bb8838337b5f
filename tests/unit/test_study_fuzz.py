"""Bad study files: parsing answers with a Study or a ConfigInvalid whose every line names the field
(``path.to.field: what is wrong``), never with another exception (hypothesis mutations of the
shipped default study, random YAML text, and the kept corpus in tests/fuzz/studies/).
"""

from __future__ import annotations

import copy
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from domain.errors import ConfigInvalid, TraceInvalid
from domain.knobs import KNOBS
from domain.study import Study, parse_study
from servetune.study_file import check_replay, load_study

REPO = Path(__file__).resolve().parents[2]
CORPUS = Path(__file__).resolve().parents[1] / "fuzz" / "studies"
MANIFEST = json.loads((CORPUS / "MANIFEST.json").read_text())
DEFAULT = yaml.safe_load((REPO / "studies" / "default.yaml").read_text())
FUZZ = settings(max_examples=100, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])
# A violation starts with the field it is about: "replay.duration_s: ..." or "knobs.tp_size: ...";
# a key that is blank or holds separators is quoted ("' ': Extra inputs are not permitted").
_PART = r"""(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\s:.'"]+)"""
FIELD_LINE = re.compile(rf"^{_PART}(?:\.{_PART})*: ", re.S)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**20), 10**20), st.integers(-2, 600),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=10),
    st.sampled_from(["unset", "auto", "-rf", "../../etc/passwd", "B200", "fp8", "fa3", "", "0",
                     "eagle", "nvfp4", "8", "1e999", "\x00"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated_studies(draw: st.DrawFn) -> dict[str, Any]:
    """The default study with one to three fields replaced, dropped, added or re-typed."""
    data = copy.deepcopy(DEFAULT)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(data)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent: Any = data
        for k in path[:-1]:
            parent = parent[k]
        op = draw(st.sampled_from(["replace", "replace", "drop", "add", "knob"]))
        if op == "replace":
            parent[path[-1]] = draw(values)
        elif op == "drop":
            del parent[path[-1]]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=8))] = draw(values)
        elif op == "knob":
            where = draw(st.sampled_from(["knobs", "baseline"]))
            name = draw(st.sampled_from([*KNOBS, "tp", "speculative_algo"]))
            val = draw(st.lists(values, max_size=3)) if where == "knobs" else draw(values)
            if isinstance(data.get(where), dict):
                data[where][name] = val
    return data


def _check(data: Any) -> Study | ConfigInvalid:
    try:
        return parse_study(data)
    except ConfigInvalid as e:
        assert e.violations, "an error with no line"
        for v in e.violations:
            assert FIELD_LINE.match(v), f"violation does not start with its field: {v!r}"
            assert len(v) < 3000, v[:200]
        return e


@FUZZ
@given(data=mutated_studies())
def test_mutated_study_answers_study_or_config_invalid(data: dict[str, Any]) -> None:
    got = _check(data)
    if isinstance(got, Study):
        got.base_config()  # a parsed study always has a buildable baseline
        assert len(got.digest()) == 16


@FUZZ
@given(data=values)
def test_any_yaml_value_at_top_level(data: Any) -> None:
    _check(data)


@FUZZ
@given(text=st.one_of(
    st.text(max_size=200),
    st.lists(st.sampled_from(["name: x", "model: [", "gpu: *a", "&a gpu: B200", "? [a]: 1",
                              "!!python/object:os.system x", "knobs: {tp_size: [1, 2]}",
                              "  - - -", "\t", "%YAML 1.1", "---", "...", "{{", "name: x",
                              "replay: {trace: x, duration_s: .nan}", "gpu_count: 1e400"]),
             max_size=8).map("\n".join)))
def test_study_file_text_answers_study_or_config_invalid(text: str) -> None:
    fd, path = tempfile.mkstemp(suffix=".yaml", prefix="fuzz-study-")
    with os.fdopen(fd, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(text)
    try:
        load_study(Path(path))
    except ConfigInvalid as e:
        assert all(v.startswith(path) for v in e.violations), e.violations
    finally:
        os.unlink(path)


@pytest.mark.parametrize("name", sorted(MANIFEST), ids=str)
def test_study_corpus(name: str) -> None:
    with pytest.raises(ConfigInvalid) as info:
        load_study(CORPUS / name)
    text = str(info.value)
    for want in MANIFEST[name]:
        assert want in text, text


@settings(max_examples=40, deadline=None, derandomize=True)
@given(start=st.floats(0, 20, allow_nan=False), duration=st.floats(0.001, 100, allow_nan=False),
       scale=st.floats(0.001, 1000, allow_nan=False))
def test_replay_window_answers_trace_or_trace_invalid(start: float, duration: float,
                                                      scale: float) -> None:
    data = copy.deepcopy(DEFAULT)
    data["replay"].update(trace="ok_mooncake.jsonl", start_s=start, duration_s=duration,
                          time_scale=scale, format="auto")
    study = parse_study(data)
    try:
        win = check_replay(study, REPO / "tests" / "fuzz" / "traces" / "ok_mooncake.jsonl")
    except TraceInvalid as e:
        assert "holds no request" in str(e), str(e)
    else:
        assert len(win) >= 1
