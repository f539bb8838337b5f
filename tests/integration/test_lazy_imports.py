"""Code paths load only what they use: importing the run loop and the CLI loads neither the
anthropic SDK (about 1 s) nor scipy.stats (about 1 s); a deterministic run never needs the SDK,
and scipy.stats loads inside the few functions that compute with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from fixtures.paths import REPO

HEAVY = ("anthropic", "scipy.stats")


def test_importing_the_run_loop_and_the_cli_loads_no_sdk_and_no_scipy_stats():
    code = ("import json, sys; import graph.run, servetune.cli; "
            f"print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_a_refused_run_exits_before_loading_mcp(tmp_path):
    """`servetune run` of a missing study is refused before the agents' MCP client (about
    0.8 s to import) loads: a bad study or option is answered at once."""
    code = ("import json, sys; from typer.testing import CliRunner; import servetune.cli; "
            "r = CliRunner().invoke(servetune.cli.app, ['run', 'nope.yaml']); "
            "print(json.dumps([r.exit_code, r.stderr, "
            f"[m for m in ('mcp', *{list(HEAVY)!r}) if m in sys.modules]]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    code_, stderr, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert code_ == 2 and "study file not found" in stderr, stderr
    assert loaded == []
