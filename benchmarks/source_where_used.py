"""Latency of the sglang-source MCP server on a real SGLang tree, over stdio, after start-up.

The server runs as its own process (``main(tree)`` over stdio, as Claude Code starts it). Timed
calls: ``where_used("max_running_requests")`` (first call, then repeated), ``grep`` of the same
name over every ``*.py``, and the first ``constraints`` / ``explain_default`` of that flag.
Baselines measured in the same run: a fresh ``grep -rnw --include=*.py`` process over the tree
(what a shell-only agent would run per question) and a naive per-call Python scan that re-reads
every file and searches it line by line. Target (issue 4): where_used under 2 s.

    .venv/bin/python benchmarks/source_where_used.py [--tree DIR] [--repeats N]

Without --tree it unpacks $SERVETUNE_SGLANG_WHEEL or /tmp/sglwhl/sglang-0.5.23-*.whl into a
temporary cache first.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
from mcp import Client, StdioServerParameters

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mcp_servers.source.fetch import fetch_wheel  # noqa: E402

FLAG = "max_running_requests"


def find_tree(tmp: Path) -> Path:
    env = os.environ.get("SERVETUNE_SGLANG_WHEEL")
    wheels = [Path(env)] if env else sorted(Path("/tmp/sglwhl").glob("sglang-0.5.23-*.whl"))
    if not wheels or not wheels[0].is_file():
        sys.exit("no tree: pass --tree DIR or set SERVETUNE_SGLANG_WHEEL")
    version = wheels[0].name.split("-")[1]
    return fetch_wheel(version, tmp, wheel=wheels[0])


def naive_scan(tree: Path, name: str) -> int:
    """Per-call baseline: walk, read and regex-search every .py file."""
    rx = re.compile(rf"(?<!\w){re.escape(name)}(?!\w)")
    hits = 0
    for dirpath, _, files in os.walk(tree):
        for f in files:
            if f.endswith(".py"):
                text = Path(dirpath, f).read_text(encoding="utf-8", errors="replace")
                hits += sum(1 for line in text.splitlines() if rx.search(line))
    return hits


def timed(fn, repeats: int) -> tuple[float, object]:
    out = None
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


async def serve_and_time(tree: Path, repeats: int) -> dict[str, float]:
    params = StdioServerParameters(
        command=sys.executable, cwd=str(ROOT),
        args=["-c", f"from mcp_servers.source.server import main; main({str(tree)!r})"])
    res: dict[str, float] = {}
    t0 = time.perf_counter()
    async with Client(params) as client:
        await client.list_tools()
        res["start-up (process + index + flags)"] = time.perf_counter() - t0

        async def call(tool: str, args: dict) -> dict:
            t = time.perf_counter()
            r = await client.call_tool(tool, args)
            assert not r.is_error, r.content
            return {"s": time.perf_counter() - t, "out": r.structured_content}

        first = await call("where_used", {"flag": FLAG, "max_hits": 2000})
        res["where_used first call"] = first["s"]
        res["where_used hits"] = first["out"]["total"]
        res["where_used files"] = first["out"]["files"]
        later = [(await call("where_used", {"flag": FLAG, "max_hits": 2000}))["s"]
                 for _ in range(repeats)]
        res["where_used repeated (median)"] = statistics.median(later)
        g = [await call("grep", {"pattern": rf"\b{FLAG}\b", "max_hits": 1000})
             for _ in range(repeats)]
        res["grep over *.py (median)"] = statistics.median(x["s"] for x in g)
        res["grep hits"] = len(g[0]["out"]["hits"])
        res["constraints first call"] = (await call("constraints", {"flag": FLAG}))["s"]
        res["explain_default after it"] = (await call("explain_default", {"flag": FLAG}))["s"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tree = args.tree or find_tree(Path(tmp))
        res = anyio.run(serve_and_time, tree, args.repeats)
        grep_bin = shutil.which("grep")
        base_grep, out = timed(lambda: subprocess.run(
            [grep_bin, "-rnw", "--include=*.py", FLAG, str(tree)], capture_output=True,
            check=False).stdout.count(b"\n"), args.repeats) if grep_bin else (float("nan"), 0)
        base_naive, naive_hits = timed(lambda: naive_scan(tree, FLAG), 1)
    print(f"SGLang tree: {tree}")
    for k, v in res.items():
        print(f"  {k:<40} " + (f"{v:8.3f} s" if isinstance(v, float) else f"{v:8d}"))
    wu = res["where_used first call"]
    gr = res["grep over *.py (median)"]
    print(f"  baseline: grep -rnw process (median)     {base_grep:8.3f} s ({out} lines)")
    print(f"  baseline: naive per-call re-read + re    {base_naive:8.3f} s ({naive_hits} lines)")
    print(f"ratio baseline/ours: where_used first call vs grep process {base_grep / wu:.2f}, vs "
          f"naive re-read {base_naive / wu:.1f}; grep tool vs grep process {base_grep / gr:.2f}, "
          f"vs naive re-read {base_naive / gr:.1f}")
    print(f"target where_used < 2 s after start-up: {'met' if wu < 2 else 'MISSED'} ({wu:.3f} s)")


if __name__ == "__main__":
    main()
