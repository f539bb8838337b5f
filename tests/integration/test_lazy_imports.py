"""Code paths load only what they use: importing the run loop and the CLI loads neither the
anthropic SDK (about 1 s) nor scipy.stats (about 1 s); a deterministic run never needs the SDK,
and scipy.stats loads inside the few functions that compute with it."""

from __future__ import annotations

import json
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
