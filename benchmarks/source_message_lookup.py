"""Recall and latency of ``locate_message`` (message -> raise/assert site) on a real SGLang tree.

Every raise or assert site with a message under the given directories of the tree (default
``sglang/srt/arg_groups/``: the argument checks a launch fails on first) is turned back into
the message it would print, each formatted part replaced by ``42``, prefixed with its exception
type, and looked up. A site is found when it is the best match, or ties with the best one on
template and exception (two sites raising the same words cannot be told apart by the message).
Prints the recall, the misses, and the per-lookup latency (median and p95).

    .venv/bin/python benchmarks/source_message_lookup.py [--tree DIR] [--under sglang/srt/...]
        [--limit N]

Without --tree it uses the cached 0.5.23 tree (``servetune source fetch --version 0.5.23``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mcp_servers.source.fetch import cached_tree, default_cache_dir  # noqa: E402
from mcp_servers.source.flags import extract_flags  # noqa: E402
from mcp_servers.source.raises import MIN_LITERAL_CHARS, _file_sites, locate_message  # noqa: E402
from mcp_servers.source.tree import SourceTree  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, default=None)
    ap.add_argument("--under", action="append", default=None,
                    help="directory prefix inside the tree (repeatable)")
    ap.add_argument("--limit", type=int, default=0, help="at most this many sites (0 = all)")
    args = ap.parse_args()
    path = args.tree or cached_tree("0.5.23", default_cache_dir())
    if path is None:
        sys.exit("no tree: pass --tree DIR or run `servetune source fetch --version 0.5.23`")
    t0 = time.perf_counter()
    tree = SourceTree(path)
    inv = extract_flags(tree)
    print(f"opened {tree.root} (SGLang {tree.version}) in {time.perf_counter() - t0:.2f} s")
    under = args.under or ["sglang/srt/arg_groups/"]
    rels = sorted(r for r in tree.texts if r.endswith(".py") and r.startswith(tuple(under)))
    sites = [s for r in rels for s in _file_sites(tree, r) if s.literal >= MIN_LITERAL_CHARS]
    if args.limit:
        sites = sites[:args.limit]
    found, misses, times = 0, [], []
    for s in sites:
        message = "".join(p if p is not None else "42" for p in s.parts)
        t = time.perf_counter()
        r = locate_message(tree, inv, f"{s.exception}: {message}")
        times.append(time.perf_counter() - t)
        best = r.sites[0] if r.sites else None
        tied = [x.site for x in r.sites if best and x.template == best.template
                and x.exception == best.exception]
        if f"{s.rel}:{s.line}" in tied:
            found += 1
        else:
            misses.append((f"{s.rel}:{s.line}", message[:70], best.site if best else None))
    n = len(sites)
    print(f"{n} sites with a message under {', '.join(under)}: {found} found "
          f"({100 * found / max(n, 1):.1f} %)")
    if times:
        p95 = sorted(times)[int(0.95 * (len(times) - 1))]
        print(f"lookup: median {statistics.median(times):.3f} s, p95 {p95:.3f} s, "
              f"max {max(times):.3f} s")
    for site, message, best in misses:
        print(f"  missed {site}: {message!r} -> {best}")


if __name__ == "__main__":
    main()
