"""File operations on a source tree: list a directory, read lines, grep with a time budget.

Plain functions over a :class:`~mcp_servers.source.tree.SourceTree` returning pydantic models
(the tools' structured output); refused paths and patterns raise
:class:`~mcp_servers.source.tree.SourceError` with what to do next.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time

import regex
from pydantic import BaseModel, Field

from mcp_servers.source.tree import (
    GREP_BUDGET_S,
    MAX_LINE_CHARS,
    MAX_PATTERN_CHARS,
    SourceError,
    SourceTree,
    split_lines,
)


class FileEntry(BaseModel):
    """One file or directory of the tree."""

    path: str = Field(description="path relative to the tree root, e.g. 'sglang/srt/server_args.py'"
                                  "; directories end with '/'")
    kind: str = Field(description="'file' or 'dir'")
    size: int | None = Field(default=None, description="file size in bytes (null for dirs)")


class FileListing(BaseModel):
    """A page of directory entries or glob matches, sorted by path."""

    path: str
    glob: str | None
    entries: list[FileEntry]
    total: int = Field(description="entries over all pages")
    next_start: int | None = Field(description="pass as start for the next page; null at the end")


class FileSlice(BaseModel):
    """A range of lines of one file."""

    path: str
    start_line: int = Field(description="1-based number of the first line returned")
    end_line: int = Field(description="1-based number of the last line returned (inclusive)")
    total_lines: int
    text: str = Field(description="the lines; with numbered=true each starts with its number")
    next_start_line: int | None = Field(description="pass as start_line to read on; null at EOF")


class GrepHit(BaseModel):
    """One matching line."""

    path: str
    line: int = Field(description="1-based line number of the match start")
    text: str = Field(description="the line (cut at 2,000 characters)")
    before: list[str] = Field(default_factory=list, description="context lines before")
    after: list[str] = Field(default_factory=list, description="context lines after")


class GrepResult(BaseModel):
    """Matching lines in path order, one hit per line."""

    pattern: str
    hits: list[GrepHit]
    files_searched: int
    files_skipped: int = Field(description="files under the glob not searched: binary or larger "
                                           "than 2 MB")
    next_start: int | None = Field(description="pass as start for more hits; null when done")
    elapsed_s: float


def list_files(tree: SourceTree, path: str = ".", glob: str | None = None, start: int = 0,
               max_items: int = 200) -> FileListing:
    """List the children of directory ``path``, or with ``glob`` every matching file below it.

    Args:
        tree: the source tree.
        path: a directory relative to the tree root ('.' for the root).
        glob: e.g. '*_hook.py' or '**/scheduler*.py', matched against paths relative to ``path``;
            without it, the immediate children (directories first, with a trailing '/').
        start: index of the first entry of the page.
        max_items: page size (>= 1).

    Raises:
        SourceError: a refused path or glob, or a path that is not a directory.
    """
    base = tree.relpath(path)
    if not (tree.root / base).is_dir():
        raise SourceError(f"{path!r} is a file; use read_file or outline on it")
    prefix = "" if base == "." else base + "/"
    entries: list[FileEntry]
    if glob:
        entries = [FileEntry(path=f, kind="file", size=tree.sizes[f])
                   for f in tree.files_under(base, glob)]
    else:
        dirs: dict[str, None] = {}
        files: list[FileEntry] = []
        for f in tree.sizes:
            if not f.startswith(prefix):
                continue
            head, sep, _ = f[len(prefix):].partition("/")
            if sep:
                dirs[prefix + head + "/"] = None
            else:
                files.append(FileEntry(path=f, kind="file", size=tree.sizes[f]))
        entries = [FileEntry(path=d, kind="dir") for d in dirs] + files
    page = entries[start:start + max(1, max_items)]
    nxt = start + len(page) if start + len(page) < len(entries) else None
    return FileListing(path=base, glob=glob, entries=page, total=len(entries), next_start=nxt)


def read_file(tree: SourceTree, path: str, start_line: int = 1, end_line: int | None = None,
              max_lines: int = 400, numbered: bool = True) -> FileSlice:
    """Lines ``start_line``..``end_line`` of a text file, at most ``max_lines`` of them.

    Args:
        tree: the source tree.
        path: file path relative to the tree root.
        start_line: 1-based first line.
        end_line: 1-based last line (inclusive); None reads ``max_lines`` lines.
        max_lines: page size; continue with ``next_start_line``.
        numbered: prefix each line with its number (for citing file:line).

    Raises:
        SourceError: a refused path, a directory, a binary or >16 MB file, or start_line past EOF.
    """
    rel = tree.relpath(path)
    lines = split_lines(tree.text(rel))
    total = len(lines)
    if start_line > max(total, 1):
        raise SourceError(f"{rel} has {total} lines; start_line {start_line} is past the end")
    last = start_line + max(1, max_lines) - 1
    if end_line is not None:
        if end_line < start_line:
            raise SourceError(f"end_line {end_line} is before start_line {start_line}")
        last = min(last, end_line)
    last = min(last, total)
    out = []
    for n in range(start_line, last + 1):
        line = lines[n - 1]
        if len(line) > MAX_LINE_CHARS:
            line = line[:MAX_LINE_CHARS] + f" ... [{len(line) - MAX_LINE_CHARS} more chars]"
        out.append(f"{n:>6}  {line}" if numbered else line)
    nxt = last + 1 if last < total else None
    return FileSlice(path=rel, start_line=start_line, end_line=last, total_lines=total,
                     text="\n".join(out), next_start_line=nxt)


# Compiling a counted repetition unrolls it: (x{1000}){1000} takes 0.45 s and 275 MB with the
# regex module (measured here), x{1000000000} exhausts memory before any time budget applies.
MAX_EXPANDED_ATOMS = 20_000
MAX_RESULT_CHARS = 200_000  # text of one grep page (hits + context); the page ends early beyond
_COUNT = regex.compile(r"\{(\d*)(?:,(\d*))?\}")


def expanded_size(pattern: str) -> int:
    """Upper estimate of the items a regex compiles to once counted repetitions are unrolled.

    Each literal, escape or character class counts 1; a group counts the sum of its items; a
    ``{m}``, ``{m,}`` or ``{m,n}`` after an item multiplies that item by its largest bound.
    Alternation is counted as a sum (an over-estimate). Malformed patterns are left to the
    compiler's error.

    Args:
        pattern: the regex text.

    Returns:
        The estimate (>= 0), e.g. 1,000,000 for ``(x{1000}){1000}``.
    """
    stack: list[int] = [0]
    last = 0  # size of the item a quantifier would apply to
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            last, i = 1, i + 2
        elif c == "[":
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            j += pattern[j:j + 1] == "]"
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            last, i = 1, j + 1
        elif c == "(":
            stack.append(0)
            last, i = 0, i + 1
            continue
        elif c == ")":
            last = stack.pop() if len(stack) > 1 else 0
            i += 1
        elif c == "{" and (m := _COUNT.match(pattern, i)) and (m.group(1) or m.group(2)):
            bound = max(int(m.group(1) or 0), int(m.group(2) or 0))
            stack[-1] += last * (bound - 1)
            last = last * bound
            i = m.end()
            continue
        elif c in "|*+?":
            i += 1
            continue
        else:
            last, i = 1, i + 1
        stack[-1] += last
    return sum(stack)


COMPILE_MEMORY_BYTES = 1 << 30  # address space of the trial compile (1 GiB)
COMPILE_TIMEOUT_S = 2.0


@functools.lru_cache(maxsize=512)
def _compile_refusal(pattern: str, flags: int) -> str | None:
    """Why compiling ``pattern`` here would be unsafe, from a trial compile in a child process.

    ``expanded_size`` reads the pattern's own syntax, which inline flags (``(?x)`` verbose
    whitespace) and comments can disguise; the trial compile runs the real compiler under a
    1 GiB address-space limit and a 2 s timeout, so a pattern that unrolls into gigabytes kills
    only the child (stopped by its PID on timeout). A syntax error is left to the caller's
    compile, which reports it. Verdicts are cached per pattern.

    Returns:
        None when it compiles within the limits or is merely invalid; else the reason.
    """
    # The pattern travels as JSON on stdin: argv cannot carry a NUL byte or a lone surrogate.
    code = ("import json, resource, sys; resource.setrlimit(resource.RLIMIT_AS, "
            "(int(sys.argv[2]),) * 2); import regex; "
            "regex.compile(json.loads(sys.stdin.read()), int(sys.argv[1]))")
    try:
        r = subprocess.run([sys.executable, "-c", code, str(int(flags)),
                            str(COMPILE_MEMORY_BYTES)], input=json.dumps(pattern),
                           capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S,
                           check=False)
    except subprocess.TimeoutExpired:
        return f"compiling it takes longer than {COMPILE_TIMEOUT_S:g} s"
    if r.returncode != 0 and "MemoryError" in r.stderr:
        return f"compiling it needs more than {COMPILE_MEMORY_BYTES >> 30} GiB"
    return None


def compile_pattern(pattern: str, ignore_case: bool = False) -> regex.Pattern[str]:
    """Compile a user regex (``regex`` module syntax, MULTILINE).

    Raises:
        SourceError: empty, longer than 500 characters, repeating beyond
            ``MAX_EXPANDED_ATOMS`` once unrolled, too big or slow to compile (trial compile),
            or invalid.
    """
    if not pattern:
        raise SourceError("pattern is empty; give a regular expression, e.g. 'def __init__'")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise SourceError(f"pattern is longer than {MAX_PATTERN_CHARS} characters; search for a "
                          "distinctive part of it")
    size = expanded_size(pattern)
    if size > MAX_EXPANDED_ATOMS:
        raise SourceError(f"pattern {pattern!r} repeats too much: its counted repetitions "
                          f"({{m,n}}) expand to about {size:,} items, above the limit of "
                          f"{MAX_EXPANDED_ATOMS:,} (compiling it could exhaust memory); use + "
                          "or * instead of large counts")
    flags = regex.MULTILINE | (regex.IGNORECASE if ignore_case else 0)
    refused = _compile_refusal(pattern, flags)
    if refused:
        raise SourceError(f"pattern {pattern!r} is refused: {refused}; use + or * instead of "
                          "large counted repetitions")
    try:
        return regex.compile(pattern, flags)
    except regex.error as e:
        raise SourceError(f"invalid regular expression {pattern!r}: {e}; escape literal "
                          "characters such as ( [ . * with a backslash") from e


def _cut(line: str) -> str:
    line = line.rstrip("\r")
    return line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS] + " ..."


def grep(tree: SourceTree, pattern: str, path: str = ".", path_glob: str = "**/*.py",
         ignore_case: bool = False, context_lines: int = 0, start: int = 0, max_hits: int = 100,
         budget_s: float = GREP_BUDGET_S) -> GrepResult:
    """Search file texts for a regex; one hit per matching line, in path then line order.

    Args:
        tree: the source tree.
        pattern: a regular expression (Python/``regex`` syntax; ``^``/``$`` match at lines).
        path: directory (or file) to search under, relative to the tree root.
        path_glob: which files under ``path``, e.g. '**/*.py' (default) or '**/*'.
        ignore_case: case-insensitive matching.
        context_lines: lines of context before and after each hit (0..10).
        start: number of hits to skip (paging; pass next_start).
        max_hits: page size; a page also ends once its text reaches 200,000 characters.
        budget_s: wall-clock limit for the whole search in seconds.

    Raises:
        SourceError: bad pattern, path or glob, or the search ran past ``budget_s`` (a pattern
            with nested quantifiers such as '(a+)+$' backtracks catastrophically).
    """
    t0 = time.perf_counter()
    rx = compile_pattern(pattern, ignore_case)
    candidates = tree.files_under(path, path_glob)
    context_lines = max(0, min(context_lines, 10))
    want = start + max(1, max_hits)
    hits: list[GrepHit] = []
    searched = skipped = chars = 0
    more = False
    deadline = t0 + budget_s
    for rel in candidates:
        text = tree.texts.get(rel)
        if text is None:
            skipped += 1
            continue
        searched += 1
        split: list[str] | None = None
        last_line, line_no, scan = -1, 1, 0
        try:
            if time.perf_counter() > deadline:  # the budget covers the whole call
                raise TimeoutError
            for m in rx.finditer(text, timeout=max(deadline - time.perf_counter(), 1e-3)):
                pos = m.start()
                line_no += text.count("\n", scan, pos)
                scan = pos
                if line_no == last_line:
                    continue
                last_line = line_no
                if len(hits) >= want:
                    more = True
                    break
                if len(hits) < start:
                    hits.append(GrepHit(path=rel, line=line_no, text=""))
                    continue
                lo = text.rfind("\n", 0, pos) + 1
                hi = text.find("\n", pos)
                hit = GrepHit(path=rel, line=line_no, text=_cut(text[lo:None if hi < 0 else hi]))
                if context_lines:
                    split = split if split is not None else split_lines(text)
                    i = line_no - 1
                    hit.before = [_cut(x) for x in split[max(0, i - context_lines):i]]
                    hit.after = [_cut(x) for x in split[i + 1:i + 1 + context_lines]]
                hits.append(hit)
                chars += len(json.dumps([hit.text, hit.before, hit.after]))  # as sent
                if chars >= MAX_RESULT_CHARS:  # a page a chat client can take; page on
                    want = len(hits)
        except TimeoutError as e:
            if len(hits) < start:  # a deep page: an earlier page of it completed
                raise SourceError(
                    f"page start={start} of {pattern!r} lies past what a {budget_s:g} s search "
                    f"reaches (each page re-scans from the first file; {len(hits)} hits counted "
                    f"by {rel}); narrow path or path_glob, or search for something more "
                    "specific") from e
            raise SourceError(
                f"the search for {pattern!r} ran past its {budget_s:g} s budget (in {rel}, after "
                f"{searched} of {len(candidates)} files); simplify the pattern (nested quantifiers "
                "like '(a+)+' backtrack catastrophically) or narrow path/path_glob") from e
        if more:
            break
    return GrepResult(pattern=pattern, hits=hits[start:], files_searched=searched,
                      files_skipped=skipped, next_start=want if more else None,
                      elapsed_s=round(time.perf_counter() - t0, 4))
