"""A small SGLang-like source tree with odd files, shared by the fuzz tests of the source server."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

FIELDS = """\
    import argparse
    from typing import Literal, Optional

    from sglang.srt.arg_groups.arg_utils import A, Arg


    class Schedule(msgspec.Struct):
        \"\"\"Namespace schedule.\"\"\"

        _NS_PATH = "schedule"
        max_running_requests: A[Optional[int], "The maximum number of running requests."] = None
        schedule_policy: A[Literal["fcfs", "lpm"], "The scheduling policy."] = "fcfs"
        chunked_prefill_size: A[int, Arg(help="Chunk size.", aliases=["--chunk-size"])] = 8192
    """
HOOK = """\
    def handle_gpu_memory_settings(server_args, gpu_mem):
        cfg = server_args
        if cfg.max_running_requests is not None and cfg.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if cfg.max_running_requests is None:
            server_args.max_running_requests = 256
    """

# Odd files: what a fetched wheel or a hand-edited checkout may hold.
ODD: dict[str, bytes] = {
    "sglang/srt/syntax_error.py": b"def broken(:\n    max_running_requests = \n",
    "sglang/srt/latin1.py": b"# caf\xe9\nmax_running_requests = 1\n",
    "sglang/srt/nul.py": b"x = 1\x00\x00\nmax_running_requests = 2\n",
    "sglang/srt/bom.py": b"\xef\xbb\xbfmax_running_requests = 3\n",
    "sglang/srt/utf16.py": "max_running_requests = 4\n".encode("utf-16"),
    "sglang/srt/empty.py": b"",
    "sglang/srt/crlf.py": b"def f(server_args):\r\n    return server_args.max_running_requests\r\n",
    "sglang/srt/only_cr.py": b"a = 1\rb = 2\rmax_running_requests = 5\r",
    "sglang/srt/long_line.py": b"X = '" + b"a" * 300_000 + b"'\n",
    "sglang/srt/deep_nesting.py": b"x = " + b"(" * 500 + b"1" + b")" * 500 + b"\n",
    "sglang/srt/many_lines.py": b"pass\n" * 50_000,
    "sglang/srt/binary.so": bytes(range(256)) * 8,
    "sglang/srt/weird name with spaces.py": b"max_running_requests = 6\n",
    "sglang/srt/-dash.py": b"y = 1\n",
    "sglang/srt/unicod\u00e9.py": b"z = 1\n",
    "sglang/srt/dir.py/inner.py": b"w = 1\n",
    "sglang/srt/arg_groups/fields/not_a_struct.py":
        b"class Schedule:\n    max_running_requests = 1\n",
    "sglang/srt/arg_groups/fields/garbage_fields.py":
        b"class X(msgspec.Struct):\n    a: A[[[[, 'x'] = 1\n",
}


def build_tree(root: Path, odd: bool = True) -> Path:
    """Write the tree under ``root`` (the folder holding ``sglang/``) and return ``root``."""
    files = {
        "sglang/__init__.py": b"",
        "sglang/_version.py": b"__version__ = version = '0.0.1'\n",
        "sglang/srt/__init__.py": b"",
        "sglang/srt/arg_groups/__init__.py": b"",
        "sglang/srt/arg_groups/fields/__init__.py": b"",
        "sglang/srt/arg_groups/fields/schedule.py": textwrap.dedent(FIELDS).encode(),
        "sglang/srt/arg_groups/memory_hook.py": textwrap.dedent(HOOK).encode(),
    }
    if odd:
        files.update(ODD)
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    if odd:
        srt = root / "sglang" / "srt"
        os.symlink("/etc", srt / "escape_dir")  # symlinks out of the tree
        os.symlink("/etc/hostname", srt / "escape_file.py")
        os.symlink("missing_target.py", srt / "dangling.py")
        os.symlink(".", srt / "loop")  # a directory cycle
        os.symlink("self_a.py", srt / "self_b.py")
        os.symlink("self_b.py", srt / "self_a.py")  # a symlink cycle
        os.mkfifo(srt / "fifo.py")  # reading it would block forever
    return root
