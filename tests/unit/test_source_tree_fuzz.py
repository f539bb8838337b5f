"""SGLang source trees with odd files (symlink cycles and escapes, a FIFO, binary, non-UTF-8,
syntax errors, deep nesting, huge lines): opening, indexing, flag extraction and every file
operation answer or raise SourceError, never another exception (plus hypothesis-generated module
text in the flag-declaring file).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from fixtures.fuzz_sources import FIELDS, HOOK, ODD, build_tree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcp_servers.source import analysis
from mcp_servers.source import files as file_ops
from mcp_servers.source import outline as outline_ops
from mcp_servers.source.flags import extract_flags
from mcp_servers.source.tree import SourceError, SourceTree


@pytest.fixture(scope="module")
def odd_tree(tmp_path_factory: pytest.TempPathFactory) -> SourceTree:
    return SourceTree(build_tree(tmp_path_factory.mktemp("odd")))


def test_odd_tree_indexes_only_regular_files_inside(odd_tree: SourceTree) -> None:
    listed = set(odd_tree.sizes)
    assert "sglang/srt/latin1.py" in listed and "sglang/srt/dir.py/inner.py" in listed
    for gone in ("fifo.py", "self_a.py", "self_b.py", "dangling.py", "escape_file.py"):
        assert f"sglang/srt/{gone}" not in listed, gone
    assert not any(p.startswith("sglang/srt/escape_dir/") for p in listed)
    assert "sglang/srt/binary.so" not in odd_tree.texts  # binary: listed, not searched
    inv = extract_flags(odd_tree)
    assert {f.dest for f in inv.flags} >= {"max_running_requests", "chunked_prefill_size"}


PATHS = sorted({*ODD, "sglang/srt/fifo.py", "sglang/srt/self_a.py", "sglang/srt/dangling.py",
                "sglang/srt/escape_file.py", "sglang/srt/escape_dir", "sglang/srt/loop",
                "sglang/srt/loop/loop/crlf.py", "sglang/srt", "."})


@pytest.mark.parametrize("path", PATHS, ids=str)
def test_every_file_operation_on_odd_paths(odd_tree: SourceTree, path: str) -> None:
    ops = [
        lambda: file_ops.read_file(odd_tree, path, 1, None, 5, True),
        lambda: file_ops.list_files(odd_tree, path, None, 0, 10),
        lambda: file_ops.list_files(odd_tree, path, "**/*", 0, 10),
        lambda: file_ops.grep(odd_tree, "max_running", path, "**/*", False, 1, 0, 10),
        lambda: outline_ops.outline(odd_tree, path, 0, 10),
    ]
    for op in ops:
        try:
            op()
        except SourceError as e:
            assert str(e) and len(str(e)) < 1000


def test_analysis_over_odd_tree(odd_tree: SourceTree) -> None:
    inv = extract_flags(odd_tree)
    for flag in ("--max-running-requests", "--chunk-size", "schedule_policy"):
        analysis.where_used(odd_tree, inv, flag, None, 0, 50, False)
        analysis.constraints(odd_tree, inv, flag, 0, 50, False, None)


module_text = st.one_of(
    st.text(max_size=300),
    st.lists(st.sampled_from([
        "class Schedule(msgspec.Struct):", "    _NS_PATH = 'schedule'",
        "    max_running_requests: A[Optional[int], 'cap'] = None",
        "    x: A[int, Arg(help=1, choices=[1, 2], aliases=3)] = 8 * KIB",
        "    y: A[Literal[], 'bad'] = ", "    z: A = 1", "    w: A[int, Arg(**kw)] = f()",
        "    v: A[Optional[bool], Arg(action=argparse.BooleanOptionalAction)] = None",
        "    u: A[int, Derived(doc=None)] = 0", "def f(server_args):",
        "    assert server_args.max_running_requests > 0, 1", "    raise ValueError(f'{x}')",
        "if cfg.max_running_requests is None:", "        cfg.max_running_requests = 1", "\t",
        "    " * 3, "@decorator(", ")", "lambda: (yield)", "x = ['" + "a" * 300 + "']",
    ]), max_size=15).map("\n".join),
)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(fields=module_text, hook=module_text)
def test_generated_modules_never_crash_flag_extraction(fields: str, hook: str) -> None:
    root = Path(tempfile.mkdtemp(prefix="fuzz-src-"))
    try:
        build_tree(root, odd=False)
        (root / "sglang/srt/arg_groups/fields/schedule.py").write_text(
            FIELDS + "\n" + fields, encoding="utf-8", errors="surrogatepass")
        (root / "sglang/srt/arg_groups/memory_hook.py").write_text(
            HOOK + "\n" + hook, encoding="utf-8", errors="surrogatepass")
        tree = SourceTree(root)
        inv = extract_flags(tree)
        for f in inv.flags[:3]:
            analysis.constraints(tree, inv, f.dest, 0, 20, False, None)
            analysis.where_used(tree, inv, f.dest, None, 0, 20, False)
        outline_ops.outline(tree, "sglang/srt/arg_groups/fields/schedule.py", 0, 50)
    except SourceError:
        pass
    finally:
        shutil.rmtree(root)
