"""User-supplied text printed by the CLI, and study/trace paths no file can have (issue 16, fresh
user items 2, 3 and 8): a value holding Rich markup (``[/]``, ``[b]``) is printed literally, never
parsed (no MarkupError traceback, no vanished brackets); a study path with a name over 255 bytes,
or a study or trace that is a FIFO, a device or a folder, is one ``error:`` line with exit 2."""

from __future__ import annotations

import os

import pytest
from fixtures.cli import servetune, tiny_study, write
from typer.testing import CliRunner

from servetune.cli import app

ENV = {"SERVETUNE_EMBEDDING": "hashing"}


def _invoke(tmp_path, monkeypatch, *argv):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SERVETUNE_LESSONS_DIR", str(tmp_path / "lessons"))
    return CliRunner().invoke(app, list(argv))


def _one_error_line(r) -> str:
    assert r.exit_code == 2, (r.exit_code, r.output[-3000:])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.stderr.startswith("error:"), r.stderr[-3000:]
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    return r.stderr.strip()


def test_markup_in_a_missing_study_path_is_printed_literally(tmp_path, monkeypatch):
    line = _one_error_line(_invoke(tmp_path, monkeypatch, "run", "no[/]such.yaml"))
    assert "no[/]such.yaml" in line, line


def test_markup_in_a_run_id_is_printed_literally(tmp_path, monkeypatch):
    study = write(tmp_path, "tiny.yaml", tiny_study())
    line = _one_error_line(_invoke(tmp_path, monkeypatch, "run", str(study), "--run-id",
                                   "a[b]c"))
    assert "'a[b]c'" in line, line
    line = _one_error_line(_invoke(tmp_path, monkeypatch, "run", str(study), "--run-id", "x[/]"))
    assert "'x[/]'" in line, line


def test_markup_in_sandbox_and_twin_options_is_printed_literally(tmp_path, monkeypatch):
    line = _one_error_line(_invoke(tmp_path, monkeypatch, "sandbox", "render-config",
                                   "--config", "c[/].json", "--name", "x",
                                   "--namespace", "servetune"))
    assert "c[/].json" in line, line
    line = _one_error_line(_invoke(tmp_path, monkeypatch, "twin", "serve", "--config",
                                   "c[/].json"))
    assert "c[/].json" in line, line


@pytest.mark.parametrize("cmd", [["run"], ["twin", "serve", "--study"]])
def test_study_path_with_a_name_over_255_bytes_is_one_line(tmp_path, monkeypatch, cmd):
    path = str(tmp_path / ("a" * 300 + ".yaml"))
    line = _one_error_line(_invoke(tmp_path, monkeypatch, *cmd, path))
    assert "255" in line, line


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_study_that_is_not_a_regular_file_says_so(tmp_path, monkeypatch, kind):
    path = tmp_path / "study.yaml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path = "/dev/zero"
    line = _one_error_line(_invoke(tmp_path, monkeypatch, "run", str(path)))
    assert "not a regular file" in line and "not found" not in line, line


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_trace_that_is_not_a_regular_file_says_so(tmp_path, monkeypatch, kind):
    trace = tmp_path / "trace.jsonl"
    os.mkfifo(trace) if kind == "fifo" else trace.mkdir()
    s = tiny_study()
    s["replay"]["trace"] = str(trace)
    study = write(tmp_path, "tiny.yaml", s)
    line = _one_error_line(_invoke(tmp_path, monkeypatch, "run", str(study)))
    assert "not a regular file" in line and "not found" not in line, line


def test_trace_with_a_5000_digit_integer_gives_no_python_advice(tmp_path, monkeypatch):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 1, "input_length": ' + "9" * 5000
                     + ', "output_length": 5, "hash_ids": []}\n')
    s = tiny_study()
    s["replay"].update(trace=str(trace), start_s=0)
    study = write(tmp_path, "tiny.yaml", s)
    line = _one_error_line(_invoke(tmp_path, monkeypatch, "run", str(study)))
    assert "too many digits" in line and "set_int_max_str_digits" not in line, line


@pytest.mark.parametrize("budget", ["inf", "nan"])
def test_mcp_bench_compute_budget_must_be_finite(tmp_path, monkeypatch, budget):
    r = _invoke(tmp_path, monkeypatch, "mcp", "bench", "--compute-budget-s", budget)
    assert r.exit_code == 2, (r.exit_code, r.output[-3000:])  # nan: typer's range check
    assert "--compute-budget-s" in " ".join(r.stderr.split()), r.stderr


@pytest.mark.slow
def test_study_name_with_markup_runs_and_is_printed_verbatim(tmp_path):
    name = "x[/]y [fp8] [bold red]z"
    study = write(tmp_path, "named.yaml", tiny_study(
        name=name, finalists=1, sweep_concurrency=[8], budget={"max_trials": 2, "patience": 1}))
    r = servetune("run", str(study), "--run-id", "n1", tmp=tmp_path, env=ENV)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert f"study {name}:" in r.stdout, r.stdout[:2000]
    assert f"{name} — n1" in r.stdout, r.stdout[-3000:]  # the summary table's title
