"""The warm CLI runner the CLI tests use (tests/fixtures/warm_cli.py) gives what a plain
``python -m servetune.cli`` subprocess gives: exit code, stdout and stderr, from the
environment, terminal width and working folder it is handed; past its timeout the command is
killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from fixtures import warm_cli
from fixtures.cli import tiny_study, write


def _both(args: list[str], tmp, env) -> tuple[subprocess.CompletedProcess[str], ...]:
    before = dict(warm_cli.USED)
    warm = warm_cli.run(args, cwd=tmp, env=env, timeout=120)
    assert warm_cli.USED["warm"] == before["warm"] + 1, warm_cli.USED  # it took the warm path
    plain = subprocess.run([sys.executable, "-m", "servetune.cli", *args], cwd=tmp, env=env,
                           capture_output=True, text=True, timeout=120)
    return warm, plain


def test_a_refusal_reads_the_same_warm_or_plain(tmp_path):
    env = dict(os.environ, SERVETUNE_LESSONS_DIR=str(tmp_path / "lessons"), COLUMNS="200")
    (tmp_path / "dup.yaml").write_text("name: a\nname: b\n")
    warm, plain = _both(["run", "dup.yaml"], tmp_path, env)  # relative: the working folder
    assert (warm.returncode, warm.stdout, warm.stderr) == (
        plain.returncode, plain.stdout, plain.stderr)
    assert warm.returncode == 2 and "key 'name' is given twice" in warm.stderr


def test_the_environment_is_the_one_given(tmp_path):
    env = dict(os.environ, SERVETUNE_LESSONS_DIR=str(tmp_path / "lessons"), COLUMNS="200",
               SERVETUNE_EMBEDDING="bogus")
    warm, plain = _both(["lessons", "list"], tmp_path, env)
    assert warm.returncode == plain.returncode == 2
    assert warm.stderr == plain.stderr and warm.stderr.startswith("error: SERVETUNE_EMBEDDING")


def test_a_usage_error_reads_the_same(tmp_path):
    env = dict(os.environ, SERVETUNE_LESSONS_DIR=str(tmp_path / "lessons"), COLUMNS="200")
    warm, plain = _both(["--no-such-option"], tmp_path, env)
    assert (warm.returncode, warm.stderr) == (plain.returncode, plain.stderr)
    assert warm.returncode == 2


def test_a_timeout_kills_the_command(tmp_path):
    env = dict(os.environ, SERVETUNE_LESSONS_DIR=str(tmp_path / "lessons"), COLUMNS="200",
               SERVETUNE_EMBEDDING="hashing", SERVETUNE_SOURCE_CACHE=str(tmp_path / "none"))
    study = write(tmp_path, "tiny.yaml", tiny_study())
    before = warm_cli.USED["warm"]
    with pytest.raises(subprocess.TimeoutExpired):
        warm_cli.run(["run", str(study)], cwd=tmp_path, env=env, timeout=1)
    assert warm_cli.USED["warm"] == before + 1


def test_another_terminal_width_takes_the_plain_path(tmp_path):
    """The CLI's rich Consoles take their width from COLUMNS when they are made, at import
    (a run's wrapped lines depend on it): the zygote imported at 200 columns, so a command at
    another width runs as a plain subprocess; either way it reads as a fresh process."""
    (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
    for columns, path in (("200", "warm"), ("60", "plain")):
        env = dict(os.environ, SERVETUNE_LESSONS_DIR=str(tmp_path / "lessons"),
                   COLUMNS=columns)
        before = warm_cli.USED[path]
        r = warm_cli.run(["run", "broken.yaml"], cwd=tmp_path, env=env, timeout=120)
        assert warm_cli.USED[path] == before + 1
        p = subprocess.run([sys.executable, "-m", "servetune.cli", "run", "broken.yaml"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert (r.returncode, r.stderr) == (p.returncode, p.stderr) and r.returncode == 2


def test_popen_runs_in_the_background_and_dies_by_its_pid(tmp_path):
    """``warm_cli.popen`` (what the chaos and local-backend tests start runs with): the exit
    code and output of ``warm_cli.run`` (which reads as a plain process, above), in the
    background, and SIGKILL by its PID ends it with -9."""
    env = dict(os.environ, SERVETUNE_LESSONS_DIR=str(tmp_path / "lessons"), COLUMNS="200",
               SERVETUNE_EMBEDDING="hashing", SERVETUNE_SOURCE_CACHE=str(tmp_path / "none"))
    (tmp_path / "dup.yaml").write_text("name: a\nname: b\n")
    cmd = [sys.executable, "-m", "servetune.cli", "run", "dup.yaml"]
    before = warm_cli.USED["warm"]
    with open(tmp_path / "out", "wb") as out, open(tmp_path / "err", "wb") as err:
        p = warm_cli.popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=err)
    assert isinstance(p, warm_cli.WarmProcess) and warm_cli.USED["warm"] == before + 1
    assert p.wait(timeout=60) == 2 and p.poll() == 2
    same = warm_cli.run(["run", "dup.yaml"], cwd=tmp_path, env=env, timeout=120)
    assert (tmp_path / "err").read_text() == same.stderr and same.returncode == 2
    assert "key 'name' is given twice" in same.stderr  # as a plain process says (above)
    study = write(tmp_path, "tiny.yaml", tiny_study())
    p = warm_cli.popen([*cmd[:4], str(study)], cwd=tmp_path, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.2)
    assert p.poll() is None
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL
    p.kill()  # reaped: no signal goes to its PID again
