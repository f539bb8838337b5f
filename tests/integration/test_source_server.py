"""The sglang-source MCP server: a small SGLang-like tree built here, every tool through
mcp.Client, hardening (path traversal, symlink escape, option-like arguments, catastrophic
regex), fetch/unpack with a stand-in pip, one stdio round trip, and the real 0.5.23 wheel when it
is on disk ($SERVETUNE_SGLANG_WHEEL or /tmp/sglwhl/sglang-*.whl).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import anyio
import pytest
from fixtures import warm_cli
from mcp import Client, StdioServerParameters

from mcp_servers.source import analysis
from mcp_servers.source import files as files_mod
from mcp_servers.source import outline as outline_ops
from mcp_servers.source.fetch import (
    check_version,
    default_cache_dir,
    fetch_wheel,
    pip_download_argv,
    unpack_wheel,
)
from mcp_servers.source.files import expanded_size, grep, list_files, read_file
from mcp_servers.source.flags import extract_flags
from mcp_servers.source.server import build_server, open_tree, servetune_executable
from mcp_servers.source.tree import SourceError, SourceTree

pytestmark = pytest.mark.anyio
REPO_ROOT = Path(__file__).resolve().parents[2]
FETCH_HINT = "servetune source fetch --version 0.5.23"



# -- a small SGLang-like tree -------------------------------------------------------------------

FILES = {
    "sglang/__init__.py": "",
    "sglang/_version.py": "__version__ = version = '0.0.1'\n",
    "sglang/srt/__init__.py": "",
    "sglang/srt/arg_groups/__init__.py": "",
    "sglang/srt/arg_groups/choices.py": """\
        ATTENTION_BACKEND_CHOICES = ["fa3", "triton"]
        EVICTION_CHOICES = ["lru"] + ["lfu"]
        """,
    "sglang/srt/arg_groups/fields/__init__.py": "",
    "sglang/srt/arg_groups/fields/schedule.py": """\
        \"\"\"Config fields of the schedule namespace.\"\"\"
        import argparse
        from typing import List, Literal, Optional

        import msgspec

        from sglang.srt.arg_groups.arg_utils import A, Arg, Derived
        from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, EVICTION_CHOICES

        KIB = 1024


        class Schedule(msgspec.Struct):
            \"\"\"Namespace schedule.\"\"\"

            _NS_PATH = "schedule"
            max_running_requests: A[Optional[int], "The maximum number of running requests."] = None
            mem_fraction_static: A[
                Optional[float],
                Arg(help="Fraction of GPU memory for weights and KV cache.", resolvable=True),
            ] = None
            schedule_policy: A[Literal["fcfs", "lpm"], "The scheduling policy."] = "fcfs"
            attention_backend: A[
                Optional[str], Arg(help="Attention kernels.", choices=ATTENTION_BACKEND_CHOICES)
            ] = None
            eviction_policy: A[str, Arg(help="Eviction.", choices=EVICTION_CHOICES)] = "lru"
            chunked_prefill_size: A[int, Arg(help="Chunk size.", aliases=["--chunk-size"])] = (
                8 * KIB
            )
            enable_metrics: A[bool, "Enable metrics."] = False
            enable_tf32: A[
                Optional[bool], Arg(help="TF32 matmuls.", action=argparse.BooleanOptionalAction)
            ] = None
            tp_size: A[
                int, Arg(help="Tensor parallel size.", cli_name="--tensor-parallel-size",
                         aliases=["--tp-size"])
            ] = 1
            lora_paths: A[Optional[List[str]], "LoRA adapters."] = None
            watermark: A[float, Arg(help="Watermark.", fallback=0.5)] = None
            disable_cuda_graph: A[bool, Arg(no_cli=True)] = False
            sampling_backend: A[Optional[str], Arg(no_cli=True)] = "flashinfer"
            gpu_id: A[int, Derived(doc="set at run time")] = 0
            _private_state: A[bool, Arg(no_cli=True)] = False
        """,
    "sglang/srt/arg_groups/memory_hook.py": """\
        import logging
        import warnings

        logger = logging.getLogger(__name__)


        def handle_gpu_memory_settings(server_args, gpu_mem):
            cfg = server_args
            if cfg.mem_fraction_static is None:
                if gpu_mem > 60 * 1024:
                    reserved = 10 * 1024
                else:
                    reserved = 4 * 1024
                mem_fraction_static = round((gpu_mem - reserved) / gpu_mem, 3)
                declare_resolution(server_args, "memory", mem_fraction_static=mem_fraction_static)
            assert 0 < cfg.mem_fraction_static < 1, "--mem-fraction-static must be in (0, 1)"
            if cfg.max_running_requests is not None and cfg.max_running_requests < 1:
                raise ValueError("max_running_requests must be >= 1")
            if cfg.max_running_requests is None:
                server_args.max_running_requests = 256
                logger.warning("max_running_requests is unset; using %d", 256)
            if cfg.enable_tf32 and gpu_mem < 1000:
                warnings.warn("TF32 on a small GPU")
            if gpu_mem < 10:
                raise RuntimeError("GPU too small")
        """,
    "sglang/srt/server_args.py": """\
        class ServerArgs:
            \"\"\"Raw server configuration.\"\"\"

            @staticmethod
            def add_cli_args(parser):
                sampling_choices = _sampling_choices()
                parser.add_argument(
                    "--sampling-backend",
                    type=str,
                    choices=sampling_choices,
                    default=_declared_default("sampling_backend"),
                    help="Choose the kernels for sampling layers.",
                )
                parser.add_argument(
                    "--disable-cuda-graph",
                    action=DeprecatedStoreTrueAction,
                    help="Deprecated. Use --cuda-graph-backend=disabled instead.",
                )
        """,
    "sglang/srt/managers/__init__.py": "",
    "sglang/srt/managers/scheduler.py": """\
        \"\"\"A scheduler that manages a GPU worker.\"\"\"


        class Scheduler:
            \"\"\"Schedules batches.\"\"\"

            def __init__(self, server_args):
                self.max_running_requests = server_args.max_running_requests
                self.policy = getattr(server_args, "schedule_policy")
                self.running = []

            async def run(self, n: int = 1) -> None:
                \"\"\"Run one step.\"\"\"
                # max_running_requests caps the running batch
                if len(self.running) >= self.max_running_requests:
                    return


        def helper(x, *, max_running_requests=None):
            return {"max_running_requests": max_running_requests, "x": x}
        """,
    "sglang/srt/long_line.py": "X = '" + "a" * 5000 + "b'\n",
    "sglang/srt/arg_groups/cache_policy.py": """\
        import logging

        logger = logging.getLogger(__name__)


        def resolve_cache_policy(server_args):
            cfg = server_args
            if cfg.tp_size <= 1 or not cfg.lora_paths:
                return
            if cfg.eviction_policy not in (None, "lru"):
                raise NotImplementedError("only lru eviction with tensor parallelism")
            for rank in range(cfg.tp_size):
                if rank == 0:
                    continue
                if cfg.eviction_policy == "lfu":
                    logger.warning("lfu on rank %d", rank)
            if cfg.schedule_policy == "lpm":
                return
            elif cfg.watermark is None:
                return
            assert cfg.eviction_policy != "fifo", "fifo is gone"
            if cfg.eviction_policy is not None:
                return
            eviction_policy = "lru"
            cfg.eviction_policy = eviction_policy


        def get_eviction_policy():
            \"\"\"Retired accessor, kept for old imports.\"\"\"
            raise RuntimeError("read get_schedule().eviction_policy")


        def check_pool(pool):
            if pool.free < 0:
                raise ValueError("pool exhausted; try another --eviction-policy")
            logger.warning("pool %s uses eviction_policy %s", pool, pool.eviction_policy)


        def get_policy():
            raise RuntimeError("get_policy() was removed: read cfg.eviction_policy")


        def alloc_paged(pool):
            raise NotImplementedError("this pool supports no --eviction-policy but lru")
        """,
    "sglang/srt/mem_cache/__init__.py": "",
    "sglang/srt/mem_cache/kv_cache_configurator.py": """\
        class KVCacheConfigurator:
            def resolve_max_num_reqs(self, token_capacity):
                max_num_reqs = get_schedule().max_running_requests
                if max_num_reqs is None:
                    max_num_reqs = token_capacity // 2
                if max_num_reqs <= 0:
                    raise RuntimeError("KV cache too small; reduce --max-running-requests")
                return max_num_reqs

            def _resolve_memory_pool_config(self, config):
                config.max_running_requests = self.resolve_max_num_reqs(config.max_total_num_tokens)
                return config
        """,
    "sglang/srt/mem_cache/pool_log.py": """\
        def log_pool(pool, logger):
            logger.warning("pool uses --eviction-policy %s", pool.eviction_policy)
        """,
    "sglang/test/__init__.py": "",
    "sglang/test/mock_runner.py": """\
        class MockModelRunner:
            def __init__(self, server_args):
                server_args.max_running_requests = 4
                assert server_args.max_running_requests > 0, "mock needs requests"
        """,
    "sglang-0.0.1.dist-info/METADATA": "Name: sglang\nVersion: 0.0.1\n",
}


def build_tree(root: Path) -> Path:
    """Write the small tree under root/tree plus things outside it (a secret, a directory)."""
    tree = root / "tree"
    for rel, text in FILES.items():
        p = tree / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    (tree / "sglang/srt/rust.so").write_bytes(b"\x7fELF\x00\x01\x02" * 100)
    (tree / "sglang/srt/latin1.py").write_bytes(b"# caf\xe9 = 'coffee'\nX = 1\n")
    (root / "secret.txt").write_text("TOP SECRET max_running_requests\n")
    (root / "outside").mkdir()
    (root / "outside/evil.py").write_text("max_running_requests = 'outside'\n")
    (tree / "sglang/srt/link_out.txt").symlink_to(root / "secret.txt")
    (tree / "sglang/srt/dir_out").symlink_to(root / "outside", target_is_directory=True)
    (tree / "sglang/srt/link_in.py").symlink_to(tree / "sglang/srt/managers/scheduler.py")
    return tree


@pytest.fixture
def mini(tmp_path) -> SourceTree:
    return SourceTree(build_tree(tmp_path))


# -- tree operations ----------------------------------------------------------------------------

def test_tree_root_forms_and_version(tmp_path):
    tree = build_tree(tmp_path)
    wheel_like = SourceTree(tree)
    assert (wheel_like.root, wheel_like.version) == (tree.resolve(), "0.0.1")
    checkout = tmp_path / "checkout"
    shutil.copytree(tree / "sglang", checkout / "python/sglang", symlinks=True)
    opened = SourceTree(checkout)
    assert (opened.root, opened.kind) == ((checkout / "python").resolve(), "git checkout")
    assert "sglang/srt/managers/scheduler.py" in opened.texts
    pkg = SourceTree(tree / "sglang")
    assert pkg.kind == "package dir" and pkg.root == tree.resolve()
    assert all(p.startswith("sglang/") for p in pkg.sizes)  # the dist-info is outside the scope
    with pytest.raises(SourceError, match="is not an SGLang source tree"):
        SourceTree(tmp_path / "outside")
    with pytest.raises(SourceError, match="servetune source fetch"):
        SourceTree(tmp_path / "missing")


def test_index_skips_links_out_binaries_and_decodes_non_utf8(mini):
    assert "sglang/srt/link_out.txt" not in mini.sizes
    assert not any(p.startswith("sglang/srt/dir_out") for p in mini.sizes)
    assert "sglang/srt/link_in.py" in mini.texts  # a link that stays inside is part of the tree
    assert "sglang/srt/rust.so" in mini.sizes and "sglang/srt/rust.so" not in mini.texts
    assert mini.texts["sglang/srt/latin1.py"].startswith("# caf\ufffd")


@pytest.mark.parametrize("path", [
    pytest.param("../secret.txt", id="dotdot"),
    pytest.param("sglang/../../secret.txt", id="dotdot-inside"),
    pytest.param("/etc/passwd", id="absolute"),
    pytest.param("-rf", id="option-like"),
    pytest.param("sglang/srt/link_out.txt", id="file-symlink-escape"),
    pytest.param("sglang/srt/dir_out/evil.py", id="dir-symlink-escape"),
])
def test_paths_outside_the_tree_are_refused(mini, path):
    with pytest.raises(SourceError):
        read_file(mini, path)


def test_list_files_children_glob_and_paging(mini):
    top = list_files(mini, ".")
    assert [e.path for e in top.entries] == ["sglang-0.0.1.dist-info/", "sglang/"]
    srt = list_files(mini, "sglang/srt")
    names = [e.path for e in srt.entries]
    assert names[:4] == ["sglang/srt/arg_groups/", "sglang/srt/managers/", "sglang/srt/mem_cache/",
                         "sglang/srt/__init__.py"]
    assert "sglang/srt/link_out.txt" not in names and "sglang/srt/dir_out/" not in names
    hooks = list_files(mini, "sglang", glob="**/*_hook.py")
    assert [e.path for e in hooks.entries] == ["sglang/srt/arg_groups/memory_hook.py"]
    page = list_files(mini, "sglang/srt", glob="**/*.py", max_items=2)
    assert (len(page.entries), page.next_start) == (2, 2) and page.total > 2
    with pytest.raises(SourceError, match="is a file"):
        list_files(mini, "sglang/srt/server_args.py")
    t0 = time.perf_counter()
    assert list_files(mini, ".", glob="*a" * 40 + "b").total == 0  # no backtracking blow-up
    assert list_files(mini, ".", glob="**/" * 50 + "scheduler.py").total == 1
    assert time.perf_counter() - t0 < 1


def test_read_file_ranges_and_paging(mini):
    first = read_file(mini, "sglang/srt/managers/scheduler.py", max_lines=3)
    assert (first.start_line, first.end_line, first.next_start_line) == (1, 3, 4)
    assert first.text.splitlines()[0] == '     1  """A scheduler that manages a GPU worker."""'
    mid = read_file(mini, "sglang/srt/managers/scheduler.py", start_line=8, end_line=8,
                    numbered=False)
    assert mid.text == "        self.max_running_requests = server_args.max_running_requests"
    last = read_file(mini, "sglang/srt/managers/scheduler.py", start_line=first.total_lines)
    assert last.next_start_line is None
    with pytest.raises(SourceError, match="past the end"):
        read_file(mini, "sglang/srt/managers/scheduler.py", start_line=999)
    with pytest.raises(SourceError, match="binary"):
        read_file(mini, "sglang/srt/rust.so")


def test_grep_regex_glob_context_paging(mini):
    r = grep(mini, r"self\.max_running_requests", path="sglang", context_lines=1)
    assert [(h.path, h.line) for h in r.hits] == [
        ("sglang/srt/link_in.py", 8), ("sglang/srt/link_in.py", 15),
        ("sglang/srt/managers/scheduler.py", 8), ("sglang/srt/managers/scheduler.py", 15)]
    assert r.hits[2].before == ["    def __init__(self, server_args):"]
    assert r.next_start is None and r.files_skipped == 0
    assert not any("secret" in h.path or "dir_out" in h.path
                   for h in grep(mini, "max_running_requests", path_glob="**/*").hits)
    one = grep(mini, "MAX_RUNNING", ignore_case=True, max_hits=1)
    two = grep(mini, "MAX_RUNNING", ignore_case=True, max_hits=1, start=one.next_start)
    assert one.next_start == 1 and two.hits[0].line != one.hits[0].line or \
        two.hits[0].path != one.hits[0].path
    so = grep(mini, "ELF", path_glob="**/*.so")
    assert (so.hits, so.files_skipped) == ([], 1)
    with pytest.raises(SourceError, match="invalid regular expression"):
        grep(mini, "(unclosed")


def test_catastrophic_regex_is_bounded(mini):
    t0 = time.perf_counter()
    with pytest.raises(SourceError, match="ran past its 0.3 s budget"):
        grep(mini, r"(a+)+$", path_glob="**/long_line.py", budget_s=0.3)
    assert time.perf_counter() - t0 < 2


@pytest.mark.parametrize("pattern", ["x{1000000000}", "(x{1000}){1000}", "((ab){200}c){200}"])
def test_huge_counted_repetitions_are_refused_before_compiling(mini, pattern):
    with pytest.raises(SourceError, match="repeats too much"):
        grep(mini, pattern)


@pytest.mark.parametrize("pattern", ["(?x) x { 1000000000 }", "(?#[)x{1000000000}"],
                         ids=["verbose-whitespace", "comment-with-bracket"])
def test_disguised_repetitions_are_refused_by_the_trial_compile(mini, pattern):
    # the syntax estimate misreads these; the capped trial compile in a child process does not.
    # Which cap stops it first depends on the machine's load: the 1 GiB memory cap, or the 2 s
    # time cap while the child is still allocating; both refuse the pattern.
    with pytest.raises(SourceError, match="is refused: compiling it (needs more than 1 GiB|"
                                          "takes longer than 2 s)"):
        grep(mini, pattern)


def test_a_page_past_the_search_budget_says_so(mini):
    with pytest.raises(SourceError, match="page start=100000000 .* lies past what a"):
        grep(mini, "^", path_glob="**/*", start=100_000_000, budget_s=1e-4)


def test_small_counted_repetitions_and_classes_still_work(mini):
    assert expanded_size(r"[a-z]{3}_\d{2,4}(?:ab|cd){5}") < 100
    assert grep(mini, r"max_running_requests{1}", max_hits=1).hits


def test_a_grep_page_stops_at_its_text_budget(mini, monkeypatch):
    monkeypatch.setattr(files_mod, "MAX_RESULT_CHARS", 200)
    r = grep(mini, "max_running_requests", path_glob="**/*", context_lines=2, max_hits=1000)
    assert 0 < len(r.hits) < 10 and r.next_start == len(r.hits)
    rest = grep(mini, "max_running_requests", path_glob="**/*", context_lines=2,
                max_hits=1000, start=r.next_start)
    assert rest.hits and (rest.hits[0].path, rest.hits[0].line) != (r.hits[0].path,
                                                                    r.hits[0].line)


# -- flags and analysis -------------------------------------------------------------------------

def test_flag_inventory_from_fields_and_add_argument(mini):
    inv = extract_flags(mini)
    by = {f.flags[0]: f for f in inv.flags}
    assert list(by) == [
        "--max-running-requests", "--mem-fraction-static", "--schedule-policy",
        "--attention-backend", "--eviction-policy", "--chunked-prefill-size", "--enable-metrics",
        "--enable-tf32", "--tensor-parallel-size", "--lora-paths", "--watermark",
        "--sampling-backend", "--disable-cuda-graph"]
    m = by["--max-running-requests"]
    assert (m.dest, m.type, m.value_type, m.default, m.help, m.namespace, m.source) == (
        "max_running_requests", "Optional[int]", "int", None,
        "The maximum number of running requests.", "Schedule",
        "sglang/srt/arg_groups/fields/schedule.py:17")
    assert by["--schedule-policy"].choices == ["fcfs", "lpm"]
    assert by["--attention-backend"].choices == ["fa3", "triton"]
    assert by["--eviction-policy"].choices == ["lru", "lfu"]
    assert (by["--chunked-prefill-size"].default, by["--chunked-prefill-size"].flags) == (
        8192, ["--chunked-prefill-size", "--chunk-size"])
    assert (by["--enable-metrics"].action, by["--enable-metrics"].default) == ("store_true", False)
    assert by["--enable-tf32"].flags == ["--enable-tf32", "--no-enable-tf32"]
    assert by["--tensor-parallel-size"].dest == "tp_size"
    assert (by["--lora-paths"].nargs, by["--lora-paths"].value_type) == ("+", "str")
    assert by["--mem-fraction-static"].resolvable and by["--watermark"].fallback == 0.5
    sb = by["--sampling-backend"]
    assert (sb.default, sb.choices, sb.choices_source, sb.namespace) == (
        "flashinfer", None, "sampling_choices", "add_argument")
    dc = by["--disable-cuda-graph"]
    assert (dc.deprecated, dc.default, dc.action) == (True, False, "DeprecatedStoreTrueAction")
    assert inv.fields["disable_cuda_graph"].no_cli and "gpu_id" in inv.fields
    assert "_private_state" not in inv.fields
    assert inv.dest_of("--tp-size") == inv.dest_of("tp_size") == "tp_size"
    with pytest.raises(SourceError, match="did you mean: max_running_requests"):
        inv.dest_of("max_running_request")
    with pytest.raises(SourceError, match="is not a flag name"):
        inv.dest_of("-x")


def test_where_used_classifies_lines(mini):
    inv = extract_flags(mini)
    r = analysis.where_used(mini, inv, "--max-running-requests")
    got = {(h.path, h.line, h.kind) for h in r.hits}
    sched = "sglang/srt/managers/scheduler.py"
    assert {(sched, 8, "write"), (sched, 15, "read"), (sched, 19, "keyword"),
            (sched, 20, "string"),
            ("sglang/srt/arg_groups/fields/schedule.py", 17, "declaration"),
            ("sglang/srt/arg_groups/memory_hook.py", 20, "write"),
            ("sglang/srt/arg_groups/memory_hook.py", 17, "read"),
            ("sglang/srt/arg_groups/memory_hook.py", 18, "string")} <= got
    assert (sched, 14, "comment") not in got
    assert not any("secret" in h.path or "outside" in h.path for h in r.hits)
    only = analysis.where_used(mini, inv, "max_running_requests", kinds=["comment"])
    assert {h.line for h in only.hits} == {14} and only.total == 2
    mfs = analysis.where_used(mini, inv, "mem_fraction_static")
    # one hit per line, the strongest kind: line 16 both reads it and spells the CLI flag
    assert [(h.line, h.kind) for h in mfs.hits if h.path.endswith("memory_hook.py")] == [
        (9, "read"), (14, "keyword"), (15, "keyword"), (16, "read")]
    cli = analysis.where_used(mini, inv, "disable_cuda_graph", kinds=["cli-string"])
    assert [(h.path, h.line) for h in cli.hits] == [("sglang/srt/server_args.py", 15)]


def test_where_used_counts_add_up_and_tests_are_opt_in(mini):
    inv = extract_flags(mini)
    r = analysis.where_used(mini, inv, "max_running_requests")
    # counts cover exactly the returned hits; the rest is accounted for separately
    assert sum(r.counts.values()) == r.total == len(r.hits)
    assert set(r.counts) <= set(analysis.DEFAULT_KINDS)
    assert r.excluded_counts == {"comment": 2} and r.tests_excluded == 2
    assert not any(h.path.startswith("sglang/test/") for h in r.hits)
    everything = analysis.where_used(mini, inv, "max_running_requests", include_tests=True,
                                     kinds=list(analysis._RANK))
    assert everything.excluded_counts == {} and everything.tests_excluded == 0
    assert everything.total == r.total + sum(r.excluded_counts.values()) + r.tests_excluded
    assert {(h.path, h.line, h.kind) for h in everything.hits} >= {
        ("sglang/test/mock_runner.py", 3, "write"), ("sglang/test/mock_runner.py", 4, "read")}
    page = analysis.where_used(mini, inv, "max_running_requests", max_hits=3)
    assert page.counts == r.counts and len(page.hits) == 3 and page.next_start == 3


def test_constraints_finds_asserts_raises_warnings(mini):
    inv = extract_flags(mini)
    hook = "sglang/srt/arg_groups/memory_hook.py"
    mfs = analysis.constraints(mini, inv, "mem_fraction_static")
    assert [(c.path, c.line, c.kind) for c in mfs.items] == [(hook, 16, "assert")]
    assert mfs.items[0].condition == "0 < cfg.mem_fraction_static < 1"
    assert mfs.items[0].message == "'--mem-fraction-static must be in (0, 1)'"
    mrr = analysis.constraints(mini, inv, "max_running_requests")
    assert [(c.line, c.kind, c.function, c.stage, c.involves) for c in mrr.items] == [
        (18, "raise", "handle_gpu_memory_settings", "arg-resolution", "condition"),
        (21, "warning", "handle_gpu_memory_settings", "arg-resolution", "condition"),
        (7, "raise", "KVCacheConfigurator.resolve_max_num_reqs", "engine-startup", "message")]
    assert mrr.items[0].condition == ("cfg.max_running_requests is not None and "
                                      "cfg.max_running_requests < 1")
    assert mrr.items[0].phase == mrr.items[2].phase == "startup"
    assert mrr.tests_excluded == 1  # the mock runner's assert, listed only on request
    with_tests = analysis.constraints(mini, inv, "max_running_requests", include_tests=True)
    assert [(c.path, c.line, c.stage) for c in with_tests.items][-1] == (
        "sglang/test/mock_runner.py", 4, "test")
    tf32 = analysis.constraints(mini, inv, "--enable-tf32")
    assert [(c.line, c.kind) for c in tf32.items] == [(23, "warning")]
    assert analysis.constraints(mini, inv, "enable_metrics").items == []


def test_constraints_mentions_keeps_the_checks_that_name_a_value(mini):
    inv = extract_flags(mini)
    mrr = analysis.constraints(mini, inv, "max_running_requests", mentions="max_num_reqs")
    assert [(c.line, c.function) for c in mrr.items] == [
        (7, "KVCacheConfigurator.resolve_max_num_reqs")]  # a word of the function name
    assert mrr.total == 1 and mrr.not_mentioning == 2 and mrr.tests_excluded == 1
    assert analysis.constraints(mini, inv, "max_running_requests", mentions="nope").items == []


def test_constraints_report_early_exit_guards(mini):
    inv = extract_flags(mini)
    pol = "sglang/srt/arg_groups/cache_policy.py"
    tp_guard = "cfg.tp_size > 1 and cfg.lora_paths"  # negated `if ... : return`, De Morgan
    ev = analysis.constraints(mini, inv, "eviction_policy")
    got = [(c.path, c.line, c.kind, c.involves, c.condition, c.reached_only_if)
           for c in ev.items]
    assert got == [
        (pol, 11, "raise", "condition", "cfg.eviction_policy not in (None, 'lru')", [tp_guard]),
        (pol, 16, "warning", "condition", "cfg.eviction_policy == 'lfu'",
         [tp_guard, "rank != 0"]),  # `continue` guards the rest of the loop body
        (pol, 21, "assert", "test", "cfg.eviction_policy != 'fifo'",
         [tp_guard, "cfg.schedule_policy != 'lpm'", "cfg.watermark is not None"]),  # elif chain
        (pol, 35, "raise", "message", "pool.free < 0", []),
        (pol, 36, "warning", "message", "", []),  # unconditional, but in resolution code
        (pol, 44, "raise", "message", "", [])]  # an unsupported-operation stub
    # named only in the message of a retired accessor (line 30), of a migration note (line 40)
    # or of an unconditional runtime log line (pool_log.py): not constraints
    assert not {c.function for c in ev.items} & {"get_eviction_policy", "get_policy", "log_pool"}
    # a guard that names a flag makes the checks after it constraints of that flag
    tp = analysis.constraints(mini, inv, "tp_size")
    assert [(c.line, c.involves) for c in tp.items] == [(11, "guard"), (16, "guard"),
                                                         (21, "guard")]
    # explain_default carries the guards too; the last one makes the local an unset-default
    ex = analysis.explain_default(mini, inv, "eviction_policy")
    assert [(a.line, a.kind, a.guards[-1]) for a in ex.assignments] == [
        (24, "local", "cfg.eviction_policy is None"),
        (25, "attribute", "cfg.eviction_policy is None")]
    assert ex.assignments[0].guards[0] == tp_guard


def test_explain_default_shows_resolution_sites(mini):
    inv = extract_flags(mini)
    hook = "sglang/srt/arg_groups/memory_hook.py"
    mfs = analysis.explain_default(mini, inv, "mem_fraction_static")
    assert (mfs.declared_default, mfs.declared_at, mfs.resolvable) == (
        None, "sglang/srt/arg_groups/fields/schedule.py:18", True)
    assert [(a.path, a.line, a.kind, a.conditions) for a in mfs.assignments] == [
        (hook, 14, "local", ["cfg.mem_fraction_static is None"]),
        (hook, 15, "declare", ["cfg.mem_fraction_static is None"])]
    assert mfs.assignments[0].value == "round((gpu_mem - reserved) / gpu_mem, 3)"
    mrr = analysis.explain_default(mini, inv, "max_running_requests")
    conf = "sglang/srt/mem_cache/kv_cache_configurator.py"
    assert [(a.path, a.line, a.kind, a.phase, a.stage) for a in mrr.assignments] == [
        (hook, 20, "attribute", "startup", "arg-resolution"),
        (conf, 11, "attribute", "startup", "engine-startup"),
        ("sglang/srt/link_in.py", 8, "attribute", "runtime", "runtime"),
        ("sglang/srt/managers/scheduler.py", 8, "attribute", "runtime", "runtime")]
    assert mrr.assignments[0].function == "handle_gpu_memory_settings"
    assert mrr.assignments[1].computed_by == f"resolve_max_num_reqs ({conf}:2)"
    assert mrr.assignments[3].function == "Scheduler.__init__"
    assert "1 start-up resolution site(s)" in mrr.summary
    assert "arg_groups/memory_hook.py:20 (= 256)" in mrr.summary
    assert "mem_cache/kv_cache_configurator.py:11 (resolve_max_num_reqs)" in mrr.summary
    assert "1 in test code left out" in mrr.summary and mrr.tests_excluded == 1
    with_tests = analysis.explain_default(mini, inv, "max_running_requests", include_tests=True)
    assert (with_tests.assignments[-1].path, with_tests.assignments[-1].stage) == (
        "sglang/test/mock_runner.py", "test")
    assert "fallback 0.5" in analysis.explain_default(mini, inv, "watermark").summary


def test_outline(mini):
    o = outline_ops.outline(mini, "sglang/srt/managers/scheduler.py")
    assert o.doc == "A scheduler that manages a GPU worker."
    assert [(i.kind, i.name, i.line, i.is_async) for i in o.items] == [
        ("class", "Scheduler", 4, False), ("method", "Scheduler.__init__", 7, False),
        ("method", "Scheduler.run", 12, True), ("function", "helper", 19, False)]
    assert o.items[2].signature == "(self, n: int=1) -> None"
    assert o.items[2].doc == "Run one step."
    with pytest.raises(SourceError, match="not a Python module"):
        outline_ops.outline(mini, "sglang-0.0.1.dist-info/METADATA")


# -- tools through mcp.Client -------------------------------------------------------------------

async def call(client: Client, tool: str, args: dict):
    r = await client.call_tool(tool, args)
    return r


async def test_tools_listed_with_annotations(mini):
    async with Client(build_server(mini)) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
    assert set(tools) == {"source_info", "list_files", "read_file", "grep", "outline",
                          "list_flags", "get_flag", "where_used", "constraints",
                          "explain_default", "locate_message"}
    for t in tools.values():
        a = t.annotations
        assert (a.read_only_hint, a.idempotent_hint, a.open_world_hint) == (True, True, False)
        assert t.description and t.output_schema


async def test_every_tool_through_client(mini):
    async with Client(build_server(mini, version="0.0.1")) as client:
        info = (await call(client, "source_info", {})).structured_content
        assert (info["configured"], info["version"], info["flags"], info["note"]) == (
            True, "0.0.1", 13, "ok")
        ls = (await call(client, "list_files", {"path": "sglang/srt/arg_groups",
                                               "glob": "*.py"})).structured_content
        assert [e["path"].rsplit("/", 1)[1] for e in ls["entries"]] == [
            "__init__.py", "cache_policy.py", "choices.py", "memory_hook.py"]
        rf = (await call(client, "read_file", {"path": "sglang/srt/server_args.py",
                                               "start_line": 5, "max_lines": 2}))
        assert rf.structured_content["next_start_line"] == 7
        assert "parser):" in rf.structured_content["text"]
        g = (await call(client, "grep", {"pattern": r"def \w+\(", "path": "sglang/srt/managers",
                                         "max_hits": 2})).structured_content
        assert [h["line"] for h in g["hits"]] == [7, 12] and g["next_start"] == 2
        o = (await call(client, "outline", {"path": "sglang/srt/managers/scheduler.py"}))
        assert o.structured_content["total"] == 4
        lf = (await call(client, "list_flags", {"name_contains": "tensor-parallel"}))
        assert [f["dest"] for f in lf.structured_content["flags"]] == ["tp_size"]
        ns = (await call(client, "list_flags", {"namespace": "add_argument"})).structured_content
        assert [f["dest"] for f in ns["flags"]] == ["sampling_backend", "disable_cuda_graph"]
        gf = (await call(client, "get_flag", {"flag": "--disable-cuda-graph"})).structured_content
        assert gf["entries"][0]["deprecated"] is True and gf["field"]["no_cli"] is True
        nf = (await call(client, "get_flag", {"flag": "gpu_id"})).structured_content
        assert (nf["entries"], nf["field"]["namespace"]) == ([], "Schedule")
        wu = (await call(client, "where_used", {"flag": "max_running_requests",
                                                "kinds": ["read"]})).structured_content
        assert {(h["path"], h["line"]) for h in wu["hits"]} >= {
            ("sglang/srt/managers/scheduler.py", 15)}
        c = (await call(client, "constraints", {"flag": "mem_fraction_static"}))
        assert c.structured_content["items"][0]["kind"] == "assert"
        e = (await call(client, "explain_default", {"flag": "--mem-fraction-static"}))
        assert e.structured_content["assignments"][1]["kind"] == "declare"


@pytest.mark.parametrize(("tool", "args", "message"), [
    pytest.param("read_file", {"path": "../secret.txt"}, "climbs out", id="traversal"),
    pytest.param("read_file", {"path": "sglang/srt/link_out.txt"}, "leads outside",
                 id="symlink-escape"),
    pytest.param("list_files", {"path": "sglang/srt/dir_out"}, "leads outside",
                 id="dir-symlink-escape"),
    pytest.param("outline", {"path": "/etc/passwd"}, "is absolute", id="absolute"),
    pytest.param("read_file", {"path": "--help"}, "starts with '-'", id="path-option"),
    pytest.param("grep", {"pattern": "x", "path": "-r"}, "starts with '-'", id="grep-path-option"),
    pytest.param("grep", {"pattern": "x", "path_glob": "-*"}, "starts with '-'",
                 id="glob-option"),
    pytest.param("list_files", {"glob": "../*"}, "climbs out", id="glob-traversal"),
    pytest.param("get_flag", {"flag": "-rf"}, "String should match pattern", id="flag-option"),
    pytest.param("where_used", {"flag": "--max-running-request"}, "did you mean",
                 id="unknown-flag"),
    pytest.param("grep", {"pattern": "("}, "invalid regular expression", id="bad-regex"),
    pytest.param("grep", {"pattern": r"(a+)+$", "path_glob": "**/long_line.py"},
                 "ran past its 2 s budget", id="catastrophic-regex"),
    pytest.param("read_file", {"path": "sglang", "max_lines": 5}, "is a directory", id="dir"),
    pytest.param("list_files", {"path": ".", "recursive": True}, "has no argument 'recursive'",
                 id="invented-argument"),
])
async def test_refusals_are_tool_errors(mini, tool, args, message):
    async with Client(build_server(mini)) as client:
        r = await client.call_tool(tool, args)
    assert r.is_error
    assert message in r.content[0].text


LONG = "a" * 300  # one path component over the 255-byte file-name limit (ENAMETOOLONG)


@pytest.mark.parametrize(("tool", "args"), [
    pytest.param("read_file", {"path": f"sglang/{LONG}.py"}, id="read_file"),
    pytest.param("list_files", {"path": f"sglang/{LONG}"}, id="list_files"),
    pytest.param("grep", {"pattern": "x", "path": f"sglang/{LONG}"}, id="grep"),
    pytest.param("outline", {"path": f"sglang/{LONG}.py"}, id="outline"),
    pytest.param("read_file", {"path": f"sglang/{'b' * 200}/{'c' * 256}/x.py"}, id="256-inner"),
    pytest.param("read_file", {"path": "sglang/" + "\u00e9" * 130 + ".py"}, id="263-utf8-bytes"),
])
async def test_a_path_component_over_255_characters_is_a_clear_tool_error(mini, tool, args):
    async with Client(build_server(mini)) as client:
        r = await client.call_tool(tool, args)
    assert r.is_error
    text = r.content[0].text
    assert "255" in text and "component" in text, text


@pytest.mark.parametrize(("tool", "args"), [
    pytest.param("read_file", {"path": "sglang/locked/x.py"}, id="read_file"),
    pytest.param("list_files", {"path": "sglang/locked"}, id="list_files"),
    pytest.param("grep", {"pattern": "x", "path": "sglang/locked"}, id="grep"),
    pytest.param("outline", {"path": "sglang/locked/x.py"}, id="outline"),
])
async def test_an_unreadable_path_is_a_clear_tool_error(mini, monkeypatch, tool, args):
    # Tests run as root here, where chmod 000 does not deny: stat() is made to raise EACCES,
    # as it does for another user's directory.
    real_stat = Path.stat

    def stat(self, *a, **kw):
        if "locked" in self.parts:
            raise PermissionError(13, "Permission denied", str(self))
        return real_stat(self, *a, **kw)

    monkeypatch.setattr(Path, "stat", stat)
    async with Client(build_server(mini)) as client:
        r = await client.call_tool(tool, args)
    assert r.is_error
    assert "Permission denied" in r.content[0].text and "locked" in r.content[0].text


@pytest.mark.parametrize(("tool", "args", "message"), [
    pytest.param("read_file", {"path": "sglang/loop"}, "symlink cycle", id="eloop-read"),
    pytest.param("list_files", {"path": "sglang/loop/x"}, "symlink cycle", id="eloop-list"),
    pytest.param("read_file", {"path": "sglang/__init__.py/x"}, "no such file",
                 id="enotdir-read"),
    pytest.param("outline", {"path": "sglang/__init__.py/x.py"}, "no such file",
                 id="enotdir-outline"),
    pytest.param("read_file", {"path": "sglang/" + "a" * 255}, "no such file",
                 id="255-is-a-name"),
])
async def test_loops_and_files_used_as_dirs_are_tool_errors(tmp_path, tool, args, message):
    root = build_tree(tmp_path)
    (root / "sglang/loop").symlink_to("loop")
    async with Client(build_server(SourceTree(root))) as client:
        r = await client.call_tool(tool, args)
    assert r.is_error and message in r.content[0].text, r.content[0].text


async def test_server_without_tree_answers_with_fetch_command():
    async with Client(build_server(None, version="0.5.23")) as client:
        info = (await client.call_tool("source_info", {})).structured_content
        assert info["configured"] is False and info["fetch_command"] == FETCH_HINT
        assert FETCH_HINT in info["note"]
        for tool, args in [("list_files", {}), ("read_file", {"path": "x.py"}),
                           ("grep", {"pattern": "x"}), ("outline", {"path": "x.py"}),
                           ("list_flags", {}), ("get_flag", {"flag": "tp_size"}),
                           ("where_used", {"flag": "tp_size"}),
                           ("constraints", {"flag": "tp_size"}),
                           ("explain_default", {"flag": "tp_size"})]:
            r = await client.call_tool(tool, args)
            assert r.is_error and FETCH_HINT in r.content[0].text, tool


def test_servetune_executable(tmp_path):
    assert servetune_executable("/opt/st/.venv/bin/servetune") == "/opt/st/.venv/bin/servetune"
    assert servetune_executable("bin/servetune") == os.path.abspath("bin/servetune")
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    python = str(bindir / "python")
    assert servetune_executable("-c", python=python) is None  # no servetune next to python
    script = bindir / "servetune"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    # started as `python -m servetune.cli ...`: the venv's servetune script is the one to run
    assert servetune_executable("/repo/servetune/cli.py", python=python) == str(script)


async def test_fetch_hint_names_the_running_servetune(tmp_path, monkeypatch):
    exe = tmp_path / "my venv" / "bin" / "servetune"
    monkeypatch.setattr(sys, "argv", [str(exe), "mcp", "sglang-source"])
    async with Client(build_server(None, version="0.5.23")) as client:
        info = (await client.call_tool("source_info", {})).structured_content
        r = await client.call_tool("where_used", {"flag": "tp_size"})
    here = f"(here: `'{exe}' source fetch --version 0.5.23`)"  # quoted: the path has a space
    assert info["fetch_command"] == FETCH_HINT and FETCH_HINT in info["note"]
    assert here in info["note"]
    assert r.is_error and FETCH_HINT in r.content[0].text and here in r.content[0].text


async def test_include_tests_through_client(mini):
    async with Client(build_server(mini)) as client:
        default = (await call(client, "where_used", {"flag": "max_running_requests"}))
        opted = (await call(client, "where_used", {"flag": "max_running_requests",
                                                   "include_tests": True}))
        c = (await call(client, "constraints", {"flag": "max_running_requests",
                                                "include_tests": True}))
        e = (await call(client, "explain_default", {"flag": "max_running_requests"}))
    d, o = default.structured_content, opted.structured_content
    assert d["tests_excluded"] == 2 and o["tests_excluded"] == 0
    assert o["total"] == d["total"] + 2 and sum(d["counts"].values()) == d["total"]
    assert c.structured_content["items"][-1]["stage"] == "test"
    assert e.structured_content["tests_excluded"] == 1


async def test_stdio_round_trip(tmp_path):
    tree = build_tree(tmp_path)
    params = StdioServerParameters(
        command=sys.executable, cwd=str(REPO_ROOT),
        args=["-c", f"from mcp_servers.source.server import main; main({str(tree)!r})"])
    with anyio.fail_after(60):
        async with Client(params) as client:
            names = sorted(t.name for t in (await client.list_tools()).tools)
            r = await client.call_tool("where_used", {"flag": "max_running_requests"})
    assert len(names) == 11
    assert ("sglang/srt/managers/scheduler.py", 15, "read") in {
        (h["path"], h["line"], h["kind"]) for h in r.structured_content["hits"]}


@pytest.mark.parametrize("name", [pytest.param(LONG, id="dir"),
                                  pytest.param(LONG + ".whl", id="wheel")])
def test_a_tree_path_component_over_255_characters_is_refused(tmp_path, name):
    with pytest.raises(SourceError, match="cannot be read"):
        open_tree(tmp_path / name, cache_dir=tmp_path / "cache")


def test_cli_tree_path_component_over_255_characters_is_one_line(tmp_path):
    env = dict(os.environ, SERVETUNE_SOURCE_CACHE=str(tmp_path / "cache"), COLUMNS="200")
    r = warm_cli.run(["mcp", "sglang-source", "--tree", str(tmp_path / LONG)], cwd=REPO_ROOT,
                     env=env, timeout=60)  # a process of its own, stdin /dev/null
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stdout + r.stderr
    assert "error:" in r.stdout + r.stderr and "File name too long" in r.stdout + r.stderr


def test_a_wheel_or_cache_path_component_over_255_characters_is_refused(tmp_path):
    with pytest.raises(SourceError, match="File name too long"):
        fetch_wheel("0.5.23", tmp_path / "cache", wheel=tmp_path / (LONG + ".whl"))
    with pytest.raises(SourceError, match="File name too long"):
        open_tree(None, cache_dir=tmp_path / LONG)
    with pytest.raises(SourceError, match="File name too long"):
        fetch_wheel("0.5.23", tmp_path / LONG, run=lambda *a, **k: pytest.fail("pip ran"))


def test_cli_source_fetch_wheel_component_over_255_characters_is_one_line(tmp_path):
    env = dict(os.environ, SERVETUNE_SOURCE_CACHE=str(tmp_path / "cache"), COLUMNS="200")
    r = warm_cli.run(["source", "fetch", "--wheel", str(tmp_path / (LONG + ".whl"))],
                     cwd=REPO_ROOT, env=env, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stdout + r.stderr
    assert "error:" in r.stdout + r.stderr and "File name too long" in r.stdout + r.stderr


# -- fetch --------------------------------------------------------------------------------------

def make_wheel(path: Path, members: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in members.items():
            zf.writestr(name, text)
    return path


@pytest.mark.parametrize("version", ["-i http://evil", "--index-url=x", "0.5.23; rm -rf /",
                                     "latest", "0.5.23 --pre", "", "../0.5"])
def test_bad_versions_are_refused(version, tmp_path):
    with pytest.raises(SourceError, match="not a release number"):
        check_version(version)
    with pytest.raises(SourceError):
        fetch_wheel(version, tmp_path, run=lambda *a, **k: pytest.fail("pip must not run"))


def test_fetch_runs_pip_once_and_unpacks(tmp_path):
    calls = []

    def fake_pip(argv, **kwargs):
        calls.append(argv)
        dest = Path(argv[argv.index("--dest") + 1])
        make_wheel(dest / "sglang-0.0.1-cp311-cp311-manylinux_2_34_x86_64.whl",
                   {"sglang/__init__.py": "", "sglang/srt/server_args.py": "X = 1\n",
                    "sglang-0.0.1.dist-info/METADATA": "Version: 0.0.1\n"})
        return subprocess.CompletedProcess(argv, 0, "", "")

    root = fetch_wheel("0.0.1", tmp_path / "cache", run=fake_pip)
    assert root == tmp_path / "cache" / "sglang-0.0.1"
    assert calls == [pip_download_argv("0.0.1", Path(calls[0][calls[0].index("--dest") + 1]))]
    assert calls[0][:7] == [sys.executable, "-m", "pip", "download", "sglang==0.0.1",
                            "--no-deps", "--only-binary=:all:"]
    assert SourceTree(root).version == "0.0.1"
    assert fetch_wheel("0.0.1", tmp_path / "cache", run=fake_pip) == root and len(calls) == 1
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["sglang-0.0.1"]


def test_fetch_reports_pip_failure(tmp_path):
    def failing(argv, **kwargs):
        return subprocess.CompletedProcess(argv, 1, "", "ERROR: No matching distribution found "
                                                        "for sglang==9.9.9")

    with pytest.raises(SourceError, match="(?s)No matching distribution.*--wheel"):
        fetch_wheel("9.9.9", tmp_path, run=failing)
    assert not (tmp_path / "sglang-9.9.9").exists()


def test_unpack_refuses_escaping_members(tmp_path):
    evil = make_wheel(tmp_path / "sglang-0.0.2-py3-none-any.whl",
                      {"sglang/__init__.py": "", "../../evil.py": "boom"})
    with pytest.raises(SourceError, match="escapes the tree"):
        fetch_wheel("0.0.2", tmp_path / "cache", wheel=evil)
    assert not (tmp_path / "cache" / "sglang-0.0.2").exists()
    assert list((tmp_path / "cache").iterdir()) == []  # no staging directory left behind
    assert not (tmp_path / "evil.py").exists()
    other = make_wheel(tmp_path / "other-1.0-py3-none-any.whl", {"other/__init__.py": ""})
    with pytest.raises(SourceError, match="no sglang/ package"):
        unpack_wheel(other, tmp_path / "x")
    with pytest.raises(SourceError, match="not the sglang 0.0.3 wheel"):
        fetch_wheel("0.0.3", tmp_path / "cache", wheel=other)


def test_default_cache_dir_and_open_tree(tmp_path, monkeypatch):
    assert default_cache_dir({"SERVETUNE_SOURCE_CACHE": "/c"}) == Path("/c")
    assert default_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/servetune/sglang")
    assert default_cache_dir({}) == Path.home() / ".cache/servetune/sglang"
    cache = tmp_path / "cache"
    assert open_tree(None, "0.0.1", cache) is None
    whl = make_wheel(tmp_path / "sglang-0.0.1-py3-none-any.whl",
                     {"sglang/__init__.py": "", "sglang/_version.py": "__version__ = '0.0.1'\n"})
    opened = open_tree(whl, "0.0.1", cache)
    assert opened is not None and opened.root == (cache / "sglang-0.0.1").resolve()
    assert open_tree(None, "0.0.1", cache).root == opened.root  # found in the cache now
    with pytest.raises(SourceError, match="starts with '-'"):
        open_tree("-x", "0.0.1", cache)


# -- the real SGLang 0.5.23 wheel (skipped when it is not on disk) ------------------------------

def _real_wheel() -> Path | None:
    env = os.environ.get("SERVETUNE_SGLANG_WHEEL")
    if env and Path(env).is_file():
        return Path(env)
    found = sorted(Path("/tmp/sglwhl").glob("sglang-0.5.23-*.whl"))
    return found[0] if found else None


def _fetched_tree() -> Path | None:
    """The tree `servetune source fetch --version 0.5.23` unpacked, if a user ran it."""
    tree = default_cache_dir() / "sglang-0.5.23"
    return tree if (tree / "sglang" / "srt").is_dir() else None


REAL_WHEEL = _real_wheel()
FETCHED_TREE = _fetched_tree() if REAL_WHEEL is None else None
real = pytest.mark.skipif(REAL_WHEEL is None and FETCHED_TREE is None,
                          reason="no sglang 0.5.23 wheel or fetched tree on disk (run "
                                 "`servetune source fetch --version 0.5.23` or set "
                                 "SERVETUNE_SGLANG_WHEEL)")


@pytest.fixture(scope="session")
def real_tree(tmp_path_factory) -> SourceTree:
    if REAL_WHEEL is None:
        assert FETCHED_TREE is not None
        return SourceTree(FETCHED_TREE)
    root = fetch_wheel("0.5.23", tmp_path_factory.mktemp("sglang-cache"), wheel=REAL_WHEEL)
    return SourceTree(root)


@pytest.fixture(scope="session")
def real_inventory(real_tree):
    return extract_flags(real_tree)


@real
def test_real_inventory_matches_argparse_ground_truth(real_inventory):
    truth = json.loads((REPO_ROOT / "domain/data/sglang-0.5.23-flags.json").read_text())["flags"]
    mine = {tuple(f.flags): f for f in real_inventory.flags}
    gt = {tuple(f["flags"]): f for f in truth}
    assert len(real_inventory.flags) == len(truth) == 531
    assert set(mine) == set(gt)
    assert all(mine[k].dest == gt[k]["dest"] for k in gt)
    defaults = sum(mine[k].default == gt[k]["default"] for k in gt)
    choices = sum(sorted(map(str, mine[k].choices or [])) == sorted(map(str, gt[k]["choices"]
                                                                         or [])) for k in gt)
    print(f"defaults match {defaults}/531, choices match {choices}/531")
    assert defaults == 531
    assert choices >= 526  # the rest are computed at run time (kept as choices_source)


@real
async def test_real_where_used_is_fast_over_mcp(real_tree, real_inventory):
    async with Client(build_server(real_tree, inventory=real_inventory)) as client:
        t0 = time.perf_counter()
        r = await client.call_tool("where_used", {"flag": "max_running_requests",
                                                  "max_hits": 2000})
        elapsed = time.perf_counter() - t0
    assert not r.is_error and elapsed < 2.0, elapsed
    out = r.structured_content
    hits = out["hits"]
    assert sum(out["counts"].values()) == out["total"] == len(hits)
    assert {"name", "comment"} <= set(out["excluded_counts"]) and out["tests_excluded"] > 0
    assert not ({"name", "comment"} & set(out["counts"]))
    assert not any(h["path"].startswith("sglang/test/") for h in hits)
    assert any(h["path"].startswith("sglang/srt/managers/scheduler") and h["kind"] == "read"
               for h in hits)
    assert any(h["kind"] == "declaration" and h["path"].endswith("fields/schedule.py")
               for h in hits)


@real
@pytest.mark.parametrize("flag", ["mem_fraction_static", "max_running_requests",
                                  "speculative_algorithm"])
def test_real_constraints_and_defaults(real_tree, real_inventory, flag):
    c = analysis.constraints(real_tree, real_inventory, flag, max_items=500)
    e = analysis.explain_default(real_tree, real_inventory, flag, max_items=500)
    assert c.total > 0 and e.total > 0
    assert any(a.phase == "startup" for a in e.assignments)
    if flag == "mem_fraction_static":
        assert any(a.path.endswith("arg_groups/memory_hook.py") and a.kind == "declare"
                   and "cfg.mem_fraction_static is None" in a.conditions for a in e.assignments)
    if flag == "max_running_requests":
        assert any(a.path.endswith("speculative_hook.py") and a.value == "48"
                   for a in e.assignments)
        # the retired accessor's message names the flag, but it is no constraint on it
        assert not any(x.path == "sglang/srt/server_args.py" and x.function ==
                       "get_global_server_args" for x in c.items)
        # the KV-pool resolution is engine start-up, ranked before runtime and named in the
        # summary; the mock runners under sglang/test/ are left out unless asked for
        kv = next(a for a in e.assignments
                  if a.path == "sglang/srt/mem_cache/kv_cache_configurator.py"
                  and a.function == "KVCacheConfigurator._resolve_memory_pool_config")
        assert (kv.phase, kv.stage) == ("startup", "engine-startup")
        assert kv.computed_by and kv.computed_by.startswith("resolve_max_num_reqs (")
        assert f"mem_cache/kv_cache_configurator.py:{kv.line} (resolve_max_num_reqs)" in \
            e.summary
        assert "speculative_hook.py:" in e.summary
        ranks = [analysis.STAGE_RANK[a.stage] for a in e.assignments]
        assert ranks == sorted(ranks)
        assert not any(a.path.startswith("sglang/test/") for a in e.assignments)
        assert e.tests_excluded >= 11
        all_sites = analysis.explain_default(real_tree, real_inventory, flag, max_items=500,
                                             include_tests=True)
        assert all_sites.assignments[-1].path.startswith("sglang/test/")
    if flag == "speculative_algorithm":
        at = {(x.path.rsplit("/", 1)[1], x.line, x.kind): x for x in c.items}
        for key in [("attention_hook.py", 161, "assert"), ("kv_cache_hook.py", 678, "assert"),
                    ("validation_hook.py", 91, "raise"), ("speculative_hook.py", 1082, "raise"),
                    ("hicache_hook.py", 142, "raise")]:
            assert key in at, key
        # the early return at hicache_hook.py:132 guards the EAGLE raise
        hc = at[("hicache_hook.py", 142, "raise")]
        assert hc.condition == "cfg.speculative_algorithm not in (None, 'DSPARK')"
        assert hc.reached_only_if == ["cfg.dcp_size > 1 and cfg.enable_hierarchical_cache"]


@real
def test_real_constraints_mentions_finds_the_fa3_sm_check_by_its_alias(real_tree,
                                                                      real_inventory):
    everything = analysis.constraints(real_tree, real_inventory, "attention_backend",
                                      max_items=500)
    fa3 = analysis.constraints(real_tree, real_inventory, "attention_backend", mentions="fa3")
    assert fa3.total + fa3.not_mentioning == everything.total and fa3.total < 20
    # "FlashAttention v3 Backend requires SM>=80 and SM<=90" never says "fa3"
    assert any("SM>=80 and SM<=90" in c.message for c in fa3.items)


async def test_locate_message_through_client(mini):
    async with Client(build_server(mini)) as client:
        r = await client.call_tool("locate_message", {"message": "the quick brown fox"})
        bad = await client.call_tool("locate_message", {"message": "x", "exception": "-rf"})
    assert (r.structured_content["total"], r.structured_content["sites"]) == (0, [])
    assert bad.is_error and "String should match pattern" in bad.content[0].text


async def test_locate_message_over_stdio_on_the_pinned_tree():
    """The real 0.5.23 tree served over stdio: the vision encoder's fa3 refusal on Blackwell."""
    from fixtures.pinned_source import pinned_tree_path

    tree = pinned_tree_path()
    params = StdioServerParameters(
        command=sys.executable, cwd=str(REPO_ROOT),
        args=["-c", f"from mcp_servers.source.server import main; main({str(tree)!r})"])
    with anyio.fail_after(120):
        async with Client(params) as client:
            r = await client.call_tool("locate_message", {
                "message": "ValueError: The 'fa3' backend is not supported on Blackwell GPUs"})
            empty = await client.call_tool("locate_message", {"message": "   "})
    best = r.structured_content["sites"][0]
    assert (best["site"], best["exception"], best["flags"], best["hardware"]) == (
        "sglang/srt/layers/attention/vision.py:1331", "ValueError", ["mm_attention_backend"],
        ["get_platform().is_blackwell"])
    [[flag, sm]] = best["facts"]["disjuncts"]
    assert (flag["dest"], flag["op"], flag["value"]) == ("mm_attention_backend", "eq", "fa3")
    assert (sm["kind"], sm["op"], sm["value"]) == ("sm", "in", [10, 11, 12])
    assert empty.is_error and "give the error message" in empty.content[0].text
