"""MCP server "servetune-sglang-source": read an SGLang source tree (never imported).

Thin wiring only: each tool checks its arguments (pydantic, from the signature), calls the
matching operation of :mod:`mcp_servers.source.tree`, :mod:`~mcp_servers.source.flags` or
:mod:`~mcp_servers.source.analysis` over the tree this server was built with, and turns expected
failures into tool errors the model can act on. The tree is indexed once at start-up. Without a
tree the server still starts; every tool then answers with the command that fetches one.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field

from mcp_servers.source import analysis, raises
from mcp_servers.source import files as file_ops
from mcp_servers.source import outline as outline_ops
from mcp_servers.source.fetch import cached_tree, check_version, default_cache_dir, fetch_wheel
from mcp_servers.source.flags import FieldDecl, FlagInfo, FlagInventory, extract_flags
from mcp_servers.source.tree import SourceError, SourceTree, short_path
from mcp_servers.tool_errors import StrictMCPServer, as_tool_errors

log = logging.getLogger("servetune.mcp.source")

SERVER_NAME = "servetune-sglang-source"
DEFAULT_VERSION = "0.5.23"
READ_ONLY = ToolAnnotations(readOnlyHint=True, destructiveHint=False, idempotentHint=True,
                            openWorldHint=False)

Path_ = Annotated[str, Field(min_length=1, max_length=500, description=(
    "path relative to the tree root, e.g. 'sglang/srt/server_args.py' ('.' is the root)"))]
Flag = Annotated[str, Field(min_length=1, max_length=120, pattern=r"^(--)?[A-Za-z_][\w-]*$",
                            description="a flag as its dest ('max_running_requests') or CLI "
                                        "spelling ('--max-running-requests')")]
Start = Annotated[int, Field(ge=0, description="index of the first item; pass next_start of "
                                               "the previous page")]
IncludeTests = Annotated[bool, Field(description=(
    "also list sites in test code (sglang/test/ mock runners and kits, tests/, test_*.py); "
    "by default they are only counted in tests_excluded"))]


def fetch_command(version: str) -> str:
    """The shell command that fetches the tree of ``version``."""
    return f"servetune source fetch --version {version}"


def servetune_executable(argv0: str | None = None, python: str | None = None) -> str | None:
    """Absolute path of the ``servetune`` command running this server, when it can be known.

    That is ``sys.argv[0]`` when its name is ``servetune`` (started as ``servetune mcp
    sglang-source``), else a ``servetune`` script next to the running Python (a venv's bin/, as
    when started with ``python -m servetune.cli``); None otherwise.
    """
    argv0 = sys.argv[0] if argv0 is None else argv0
    if argv0 and os.path.basename(argv0) == "servetune":
        return os.path.abspath(argv0)
    beside = Path(os.path.abspath(python or sys.executable)).parent / "servetune"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def fetch_hint(version: str, executable: str | None = None) -> str:
    """``fetch_command`` plus, when known, the same command with this servetune's full path.

    The bare command works when servetune is on PATH; a client such as Claude Code may start
    this server with a venv's servetune that is not, so the full path is the one to copy.
    """
    exe = executable if executable is not None else servetune_executable()
    plain = fetch_command(version)
    if not exe:
        return f"`{plain}`"
    return f"`{plain}` (here: `{shlex.quote(exe)} source fetch --version {version}`)"


class SourceInfo(BaseModel):
    """What this server reads."""

    configured: bool = Field(description="false when no tree is open (see fetch_command)")
    root: str | None = Field(description="directory holding the sglang package")
    kind: str | None
    version: str | None = Field(description="SGLang version found in the tree")
    files: int = 0
    text_files: int = Field(default=0, description="files indexed for grep (text, <= 2 MB)")
    python_files: int = 0
    flags: int = Field(default=0, description="command-line flags found by static parsing")
    indexed_in_s: float | None = Field(default=None, description="start-up indexing time")
    fetch_command: str
    note: str


class FlagDetails(BaseModel):
    """What the source declares about one setting."""

    dest: str
    entries: list[FlagInfo] = Field(description="its command-line flags: usually one; a "
                                                "deprecated spelling adds another; empty for a "
                                                "field without a flag")
    field: FieldDecl | None = Field(description="the ServerArgs field declaration, if any")


class FlagPage(BaseModel):
    """A page of the flag inventory, in declaration order."""

    version: str | None
    total: int = Field(description="flags matching the filters, over all pages")
    flags: list[FlagInfo]
    next_start: int | None


def build_server(tree: SourceTree | None, version: str = DEFAULT_VERSION,
                 inventory: FlagInventory | None = None) -> MCPServer:
    """An MCP server over ``tree`` (or over nothing: every tool then says how to fetch a tree).

    Args:
        tree: the opened source tree, or None.
        version: the SGLang version the study pins; named in the fetch hint.
        inventory: the tree's flag inventory (computed here when None).

    Returns:
        The server, with tools source_info, list_files, read_file, grep, outline, list_flags,
        get_flag, where_used, constraints, explain_default and locate_message.
    """
    inv = inventory if inventory is not None or tree is None else extract_flags(tree)
    hint = (f"No SGLang source tree is configured. Run {fetch_hint(version)} (pip downloads "
            "the wheel once, no dependencies), then restart this server: it finds the fetched "
            "tree in its cache (or pass --tree with the directory the fetch prints).")
    where = f"SGLang {tree.version or '(unknown version)'} at {tree.root}" if tree else \
        "no tree yet"
    server = StrictMCPServer(SERVER_NAME, instructions=(
        f"Read-only access to the SGLang source ({where}); never executed. Cite file:line. "
        "get_flag / list_flags give a flag's type, default, choices and help; explain_default "
        "shows where an unset default is computed at start-up; constraints lists the asserts, "
        "raises and warnings that involve a flag; locate_message finds the raise or assert an "
        "error message comes from, with the flags and hardware facts its guard tests; "
        "where_used lists the lines that read it; "
        "grep, outline and read_file (paged by line) follow up."
        + ("" if tree else " " + hint)))

    def need() -> tuple[SourceTree, FlagInventory]:
        if tree is None or inv is None:
            raise ToolError(hint)
        return tree, inv

    @server.tool(annotations=READ_ONLY)
    def source_info() -> SourceInfo:
        """Which SGLang tree this server reads (version, root, file and flag counts)."""
        if tree is None:
            return SourceInfo(configured=False, root=None, kind=None, version=None,
                              fetch_command=fetch_command(version), note=hint)
        note = "ok"
        if tree.version and tree.version != version:
            note = (f"the tree is SGLang {tree.version}, not the pinned {version}: flags and "
                    f"defaults may differ ({fetch_hint(version)} fetches the pinned one)")
        return SourceInfo(
            configured=True, root=str(tree.root), kind=tree.kind, version=tree.version,
            files=len(tree.sizes), text_files=len(tree.texts),
            python_files=sum(r.endswith(".py") for r in tree.texts),
            flags=len(inv.flags) if inv else 0, indexed_in_s=tree.index_s,
            fetch_command=fetch_command(tree.version or version), note=note)

    @server.tool(annotations=READ_ONLY)
    def list_files(
        path: Path_ = ".",
        glob: Annotated[str | None, Field(max_length=200, description=(
            "e.g. '*_hook.py' or '**/scheduler*.py', relative to path; without it, the "
            "directory's children"))] = None,
        start: Start = 0,
        max_items: Annotated[int, Field(ge=1, le=1000, description="page size")] = 200,
    ) -> file_ops.FileListing:
        """List a directory of the tree, or every file under it that matches a glob."""
        t, _ = need()
        with as_tool_errors():
            return file_ops.list_files(t, path, glob, start, max_items)

    @server.tool(annotations=READ_ONLY)
    def read_file(
        path: Path_,
        start_line: Annotated[int, Field(ge=1, description="1-based first line")] = 1,
        end_line: Annotated[int | None, Field(ge=1, description=(
            "1-based last line, inclusive (at most max_lines are returned)"))] = None,
        max_lines: Annotated[int, Field(ge=1, le=2000, description="page size in lines")] = 400,
        numbered: Annotated[bool, Field(description="prefix lines with their numbers")] = True,
    ) -> file_ops.FileSlice:
        """Read lines of a text file; continue with start_line=next_start_line."""
        t, _ = need()
        with as_tool_errors():
            return file_ops.read_file(t, path, start_line, end_line, max_lines, numbered)

    @server.tool(annotations=READ_ONLY)
    def grep(
        pattern: Annotated[str, Field(min_length=1, max_length=500, description=(
            "regular expression (Python syntax; ^ and $ match at line ends), e.g. "
            r"'def \w+_hook\(' or 'max_running_requests'"))],
        path: Path_ = ".",
        path_glob: Annotated[str, Field(min_length=1, max_length=200, description=(
            "which files under path, e.g. '**/*.py' (default) or '**/*'"))] = "**/*.py",
        ignore_case: bool = False,
        context_lines: Annotated[int, Field(ge=0, le=10, description=(
            "lines of context before and after each hit"))] = 0,
        start: Start = 0,
        max_hits: Annotated[int, Field(ge=1, le=1000, description="page size")] = 100,
    ) -> file_ops.GrepResult:
        """Search the tree with a regex (bounded to 2 s); one hit per line, path then line order."""
        t, _ = need()
        with as_tool_errors():
            return file_ops.grep(t, pattern, path, path_glob, ignore_case, context_lines, start,
                                 max_hits)

    @server.tool(annotations=READ_ONLY)
    def outline(
        path: Path_,
        start: Start = 0,
        max_items: Annotated[int, Field(ge=1, le=2000, description="page size")] = 300,
    ) -> outline_ops.Outline:
        """Classes, functions and methods of a Python module with signatures and line ranges."""
        t, _ = need()
        with as_tool_errors():
            return outline_ops.outline(t, path, start, max_items)

    @server.tool(annotations=READ_ONLY)
    def list_flags(
        name_contains: Annotated[str | None, Field(max_length=100, description=(
            "keep flags whose dest or CLI spelling contains this (case-insensitive, '-' and "
            "'_' alike), e.g. 'hicache'"))] = None,
        namespace: Annotated[str | None, Field(max_length=100, description=(
            "keep flags declared in this namespace Struct, e.g. 'Schedule', 'Memory'"))] = None,
        start: Start = 0,
        max_items: Annotated[int, Field(ge=1, le=600, description="page size")] = 50,
    ) -> FlagPage:
        """The server flags of this SGLang version, read statically from its source.

        Each has its spellings, type, default, choices, help and declaring file:line.
        """
        _, i = need()
        sel = i.flags
        if name_contains:
            key = name_contains.lower().replace("-", "_").strip("_")
            sel = [f for f in sel if key in f.dest.lower()
                   or any(key in s.lower().replace("-", "_") for s in f.flags)]
        if namespace:
            sel = [f for f in sel if (f.namespace or "").lower() == namespace.lower()]
        page = sel[start:start + max_items]
        nxt = start + len(page) if start + len(page) < len(sel) else None
        return FlagPage(version=i.version, total=len(sel), flags=page, next_start=nxt)

    @server.tool(annotations=READ_ONLY)
    def get_flag(flag: Flag) -> FlagDetails:
        """Everything the source declares about one flag (or a ServerArgs field without one).

        Spellings, type, default, choices, help, namespace and the declaration's file:line.
        """
        _, i = need()
        with as_tool_errors():
            dest = i.dest_of(flag)
            return FlagDetails(dest=dest, entries=[f for f in i.flags if f.dest == dest],
                               field=i.fields.get(dest))

    @server.tool(annotations=READ_ONLY)
    def where_used(
        flag: Flag,
        kinds: Annotated[list[analysis.UseKind] | None, Field(description=(
            "kinds of use to return; default all but 'name' and 'comment'"))] = None,
        start: Start = 0,
        max_hits: Annotated[int, Field(ge=1, le=2000, description="page size")] = 200,
        include_tests: IncludeTests = False,
    ) -> analysis.WhereUsed:
        """Every Python line that reads, writes, declares or spells a flag, as file:line + kind.

        counts covers the returned hits (it sums to total); excluded_counts the kinds not asked
        for; tests_excluded the lines in test code.
        """
        t, i = need()
        with as_tool_errors():
            return analysis.where_used(t, i, flag, kinds, start, max_hits, include_tests)

    @server.tool(annotations=READ_ONLY)
    def constraints(flag: Flag, start: Start = 0,
                    max_items: Annotated[int, Field(ge=1, le=500, description="page size")] = 50,
                    include_tests: IncludeTests = False,
                    mentions: Annotated[str | None, Field(
                        description="only checks whose condition, guards, message or function "
                                    "name this value (as a word or a known alias, "
                                    "case-insensitive), e.g. 'fa3' also finds 'FlashAttention "
                                    "v3'", min_length=1, max_length=200)] = None,
                    ) -> analysis.Constraints:
        """Asserts, raises and warnings that involve a flag, with file:line.

        Involve = the flag is in the assert's test, an enclosing if condition, an early-exit
        guard before it (`if c: return`), or the message of a check (not of an accessor or
        deprecation shim). reached_only_if lists the guards that must hold to get there.
        Start-up resolution code (arg_groups/, server_args.py, then engine start-up resolvers)
        comes first.
        """
        t, i = need()
        with as_tool_errors():
            return analysis.constraints(t, i, flag, start, max_items, include_tests, mentions)

    @server.tool(annotations=READ_ONLY)
    def explain_default(flag: Flag, start: Start = 0,
                        max_items: Annotated[int, Field(ge=1, le=500,
                                                        description="page size")] = 50,
                        include_tests: IncludeTests = False,
                        ) -> analysis.DefaultExplanation:
        """Where a flag's default comes from: its declaration and every place that sets it.

        Start-up resolution hooks come first (e.g. where an unset mem_fraction_static is
        computed from GPU memory), then engine start-up resolvers (e.g. the request cap
        computed from the KV pool), then runtime assignments; each with its function, its
        enclosing if conditions and early-exit guards. The summary names the main sites.
        """
        t, i = need()
        with as_tool_errors():
            return analysis.explain_default(t, i, flag, start, max_items, include_tests)

    @server.tool(annotations=READ_ONLY)
    def locate_message(
        message: Annotated[str, Field(min_length=1, max_length=raises.MAX_MESSAGE_CHARS,
                                      description=(
            "the error message or its log line, e.g. \"ValueError: The 'fa3' backend is not "
            "supported on Blackwell GPUs\" (with a traceback, its last line is used)"))],
        exception: Annotated[str | None, Field(max_length=100, pattern=r"^[A-Za-z_][\w.]*$",
                                               description=(
            "exception type when the message does not name it, e.g. 'AssertionError'"))] = None,
        max_sites: Annotated[int, Field(ge=1, le=20, description="sites to return")] = 5,
        include_tests: IncludeTests = False,
    ) -> raises.MessageMatch:
        """The raise or assert site an error message comes from, best first, with its guard.

        f-string, .format and % templates match with wildcards for the formatted parts. Each
        site has file:line, exception type, the condition under which it raises, the flag
        dests and hardware facts (SM predicates, platform) that condition tests, and the same
        as atoms (facts) for building a lesson condition from exactly those fields.
        """
        t, i = need()
        with as_tool_errors():
            return raises.locate_message(t, i, message, exception, max_sites, include_tests)

    return server


def open_tree(tree_path: str | Path | None, version: str = DEFAULT_VERSION,
              cache_dir: Path | None = None) -> SourceTree | None:
    """The tree to serve: ``tree_path``, else the cached tree of ``version``, else None.

    A ``.whl`` path is unpacked into the cache first.

    Raises:
        SourceError: a bad version, a path that is not a source tree or that the OS refuses
            (a component over 255 bytes, permission denied), or an unusable wheel.
    """
    check_version(version)
    cache = cache_dir or default_cache_dir()
    if tree_path is None:
        found = cached_tree(version, cache)
        return SourceTree(found) if found else None
    path = Path(tree_path).expanduser()
    if str(tree_path).startswith("-"):
        raise SourceError(f"tree path {str(tree_path)!r} starts with '-'")
    try:
        is_wheel = path.suffix == ".whl" and path.is_file()
    except OSError as e:  # ENAMETOOLONG, EACCES: Path.is_file() lets these through
        raise SourceError(f"tree path {short_path(str(path))} cannot be read ({e.strerror}); "
                          "pass an SGLang source directory or a .whl file") from e
    if is_wheel:
        wheel_version = path.name.split("-")[1] if path.name.count("-") >= 2 else ""
        return SourceTree(fetch_wheel(wheel_version, cache, wheel=path))
    return SourceTree(path)


def main(tree_path: str | Path | None = None, version: str = DEFAULT_VERSION,
         cache_dir: str | Path | None = None) -> None:
    """Serve an SGLang source tree over stdio until the client disconnects (logs to stderr).

    Args:
        tree_path: an unpacked wheel, a git checkout, the sglang package directory or a .whl
            file; None uses ``<cache>/sglang-VERSION`` if fetched, else serves without a tree
            (every tool then answers with the fetch command).
        version: the pinned SGLang version (for the fetch hint and the cache lookup).
        cache_dir: the wheel cache (default: ``default_cache_dir()``).

    Raises:
        SourceError: a bad version or a tree path that is not an SGLang tree.
    """
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    tree = open_tree(tree_path, version, Path(cache_dir) if cache_dir else None)
    inv = extract_flags(tree) if tree else None
    if tree is None:
        log.warning("no SGLang tree configured; tools will answer with %s",
                    fetch_hint(version))
    else:
        log.info("indexed SGLang %s at %s: %d files, %d flags in %.2f s", tree.version,
                 tree.root, len(tree.sizes), len(inv.flags) if inv else 0,
                 time.perf_counter() - t0)
    build_server(tree, version, inv).run()
