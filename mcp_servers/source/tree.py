"""An SGLang source tree on disk, read but never imported: confined paths, index, globs, caches.

A tree is an unpacked wheel (a directory holding ``sglang/``), a git checkout (holding
``python/sglang/``) or the ``sglang`` package directory itself. Every path a caller gives is
relative to the directory that holds the ``sglang`` package and must resolve inside it, so ``..``
and symlinks that lead out of the tree are refused. The text of every file (up to
:data:`MAX_TEXT_BYTES`) is read once when the tree is opened, so searches do not touch the disk;
the tree is a snapshot of that moment.
"""

from __future__ import annotations

import ast
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import regex

from domain.errors import ServetuneError
from domain.trace_paths import MAX_NAME_BYTES, long_name_bytes

MAX_TEXT_BYTES = 2_000_000  # larger files are listed and readable but not searched
MAX_READ_BYTES = 16_000_000  # read_file refuses larger files
MAX_LINE_CHARS = 2_000  # longer lines are cut in read_file and grep output
MAX_PATTERN_CHARS = 500
AST_CACHE_CHARS = 4_000_000  # source size of the parsed modules kept (an AST is ~30x its text)
MEMO_ENTRIES = 64  # analysis results kept per tree
GREP_BUDGET_S = 2.0  # wall-clock budget of one grep call over every file it searches
GLOB_BUDGET_S = 1.0  # wall-clock budget for matching one glob against every path
_BINARY_PROBE = 8192
T = TypeVar("T")


class SourceError(ServetuneError):
    """An anticipated failure of a source-tree operation; the message says what to do next."""


def _detect_root(path: Path) -> tuple[Path, str | None, str]:
    """(dir holding the sglang package, scope prefix or None, kind) for a user-given path."""
    if (path / "sglang").is_dir():
        return path, None, "wheel or package parent"
    if (path / "python" / "sglang").is_dir():
        return path / "python", None, "git checkout"
    if path.name == "sglang" and (path / "__init__.py").is_file():
        return path.parent, "sglang", "package dir"
    raise SourceError(f"{path} is not an SGLang source tree: expected a directory holding sglang/ "
                      "(an unpacked wheel), python/sglang/ (a git checkout) or the sglang package "
                      "itself. Run `servetune source fetch --version VERSION` to get one.")


def _detect_version(root: Path) -> str | None:
    """The SGLang version from the dist-info name, sglang/_version.py or pyproject.toml."""
    for d in sorted(root.glob("sglang-*.dist-info")):
        return d.name[len("sglang-"):-len(".dist-info")]
    pat = re.compile(r"""^(?:__version__|version)\s*(?::\s*str\s*)?=.*?['"]([^'"]+)['"]""", re.M)
    for name in ("sglang/_version.py", "sglang/version.py", "pyproject.toml"):
        f = root / name
        if f.is_file():
            m = pat.search(f.read_text(encoding="utf-8", errors="replace"))
            if m:
                return m.group(1)
    return None


def check_relative(path: str, what: str = "path") -> str:
    """Refuse a user path that is absolute, option-like or climbs with '..'.

    Returns:
        The path in POSIX form without a leading './' ('.' for the root).

    Raises:
        SourceError: the path is empty-looking, starts with '-', is absolute, holds a NUL byte
            or a '..' component, or has a component longer than 255 bytes in UTF-8
            (``NAME_MAX``: no file can have that name).
    """
    if path.startswith("-"):
        raise SourceError(f"{what} {path!r} starts with '-'; give a path relative to the tree "
                          "root, e.g. 'sglang/srt/server_args.py'")
    if "\0" in path or "\\" in path:
        raise SourceError(f"{what} {path!r} holds a NUL byte or backslash; use '/' separators")
    p = PurePosixPath(path)
    if p.is_absolute() or re.match(r"^[A-Za-z]:", path):
        raise SourceError(f"{what} {path!r} is absolute; give a path relative to the tree root "
                          "(list_files('.') shows the top level)")
    if ".." in p.parts:
        raise SourceError(f"{what} {path!r} climbs out with '..'; paths stay inside the tree")
    size = long_name_bytes(path)
    if size is not None:
        raise SourceError(f"{what} {short_path(path)!r} has a component of {size} bytes; file "
                          f"names are at most {MAX_NAME_BYTES} bytes, so nothing has that name: "
                          "call list_files on its parent directory to see what exists")
    return str(p)


def short_path(path: str, limit: int = 120) -> str:
    """``path`` cut to ``limit`` characters with '...' in the middle, for error messages."""
    if len(path) <= limit:
        return path
    half = (limit - 3) // 2
    return path[:half] + "..." + path[-half:]


def os_refusal(path: str, e: OSError) -> SourceError:
    """The tool error for an OS error met while looking up user path ``path``.

    Covers what the file system itself refuses: permission denied (EACCES), a symlink cycle
    (ELOOP), a file used as a directory (ENOTDIR), a name or path too long (ENAMETOOLONG).
    """
    reason = e.strerror or type(e).__name__
    return SourceError(f"path {short_path(path)!r} cannot be read ({reason}); pick another path "
                       "(list_files on its parent directory shows what exists)")


def glob_regex(glob: str) -> regex.Pattern[str]:
    """Compile a path glob: ``**/`` is any number of directories, ``*`` and ``?`` stay in one.

    ``[...]`` classes pass through. Match it with :func:`match_glob` (time-bounded).

    Raises:
        SourceError: an option-like, absolute or escaping glob, or one over 200 characters.
    """
    check_relative(glob, "glob")
    if len(glob) > 200:
        raise SourceError("glob longer than 200 characters; narrow it to a directory and a suffix")
    while "**/**/" in glob:
        glob = glob.replace("**/**/", "**/")
    out, i = [], 0
    while i < len(glob):
        c = glob[i]
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = glob.find("]", i + 1)
            if j < 0:
                out.append(re.escape(c))
                i += 1
            else:
                body = glob[i + 1:j].replace("\\", "\\\\")
                out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
                i = j + 1
        else:
            out.append(re.escape(c))
            i += 1
    try:
        return regex.compile("".join(out) + r"\Z")
    except regex.error as e:
        raise SourceError(f"bad glob {glob!r}: {e}") from e


def match_glob(paths: list[str], glob: str, strip: int = 0,
               budget_s: float = GLOB_BUDGET_S) -> list[str]:
    """The ``paths`` whose part after the first ``strip`` characters matches ``glob``.

    Raises:
        SourceError: a bad glob, or matching ran past ``budget_s`` seconds (a glob with many
            ``*`` can backtrack for a long time).
    """
    rx = glob_regex(glob)
    deadline = time.perf_counter() + budget_s
    try:
        return [p for p in paths
                if rx.match(p, strip, timeout=max(deadline - time.perf_counter(), 1e-3))]
    except TimeoutError as e:
        raise SourceError(f"matching glob {glob!r} took longer than {budget_s:g} s; use fewer "
                          "'*' wildcards") from e


class SourceTree:
    """A read-only, path-confined view of an SGLang source tree, with file texts in memory.

    Attributes:
        root: resolved directory that holds the ``sglang`` package; every path is relative to it.
        kind: how the tree was given ('wheel or package parent', 'git checkout', 'package dir').
        version: the SGLang version found in the tree, or None.
        sizes: size in bytes of every regular file inside the tree, by relative path (sorted).
        texts: decoded text of every non-binary file up to 2 MB, by relative path.
        index_s: seconds it took to index the tree.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Open and index the tree at ``path`` (reads every text file once: ~0.5 s for a wheel).

        Raises:
            SourceError: ``path`` is missing, not an SGLang tree, or refused by the OS (a
                component over 255 bytes, permission denied).
        """
        given = Path(path).expanduser()
        try:
            is_dir = given.is_dir()
        except OSError as e:  # ENAMETOOLONG, EACCES: Path.is_dir() lets these through
            raise SourceError(f"source tree {short_path(str(given))} cannot be read "
                              f"({e.strerror}); pass the directory that `servetune source "
                              "fetch --version VERSION` prints") from e
        if not is_dir:
            raise SourceError(f"source tree {given} does not exist or is not a directory; run "
                              "`servetune source fetch --version VERSION` and pass the path it "
                              "prints")
        root, self._scope, self.kind = _detect_root(given.resolve())
        self.root = root.resolve()
        self.version = _detect_version(self.root)
        self.sizes: dict[str, int] = {}
        self.texts: dict[str, str] = {}
        self._asts: OrderedDict[str, ast.Module | None] = OrderedDict()
        self._ast_chars = 0
        self._memo: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.RLock()  # tools run in worker threads; caches are shared
        t0 = time.perf_counter()
        self._index()
        self.index_s = round(time.perf_counter() - t0, 3)

    def _inside(self, p: Path) -> bool:
        if not p.is_relative_to(self.root):
            return False
        if self._scope is None:
            return True
        rel = p.relative_to(self.root)
        return not rel.parts or rel.parts[0] == self._scope

    def _index(self) -> None:
        start = self.root / self._scope if self._scope else self.root
        found: dict[str, int] = {}
        for dirpath, dirnames, filenames in os.walk(start, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in filenames:
                p = Path(dirpath, name)
                try:
                    if p.is_symlink() and not self._inside(p.resolve()):
                        continue  # a link out of the tree: not part of it
                    st = p.stat()
                except (OSError, RuntimeError):  # dangling link, or a cycle (3.11: RuntimeError)
                    continue
                if not p.is_file():
                    continue  # a FIFO, socket or device: reading it could block
                rel = p.relative_to(self.root).as_posix()
                found[rel] = st.st_size
                if st.st_size <= MAX_TEXT_BYTES:
                    try:
                        data = p.read_bytes()
                    except OSError:  # unreadable (permissions): listed, not searched
                        continue
                    if b"\0" not in data[:_BINARY_PROBE]:
                        self.texts[rel] = data.decode("utf-8", errors="replace")
        self.sizes = dict(sorted(found.items()))

    # -- paths ------------------------------------------------------------------------------

    def resolve(self, path: str) -> Path:
        """The absolute path of ``path`` after refusing anything that leaves the tree.

        Raises:
            SourceError: option-like, absolute or '..' path, a component over 255 bytes, one
                that resolves (through a symlink) outside the tree, that does not exist, or
                whose lookup the OS refuses (permission denied, a symlink cycle).
        """
        rel = check_relative(path)
        try:
            p = (self.root / rel).resolve()
        except (OSError, RuntimeError) as e:  # a symlink cycle (3.11 raises RuntimeError)
            raise SourceError(f"path {path!r} cannot be resolved ({e}); it is a symlink cycle "
                              "or unreadable: call list_files on its parent directory") from e
        if not self._inside(p):
            raise SourceError(f"path {path!r} leads outside the source tree (through a symlink or "
                              "otherwise); only files under the tree root can be read")
        try:
            exists = p.exists()
        except OSError as e:  # EACCES, ENAMETOOLONG: Path.exists() lets these through
            raise os_refusal(path, e) from e
        if not exists:
            raise SourceError(f"no such file or directory: {path!r}; call list_files on its parent "
                              "directory to see what exists")
        return p

    def relpath(self, path: str) -> str:
        """The canonical relative path ('.' for the root) of a user path, checked by resolve."""
        p = self.resolve(path)
        rel = p.relative_to(self.root).as_posix()
        return "." if rel in ("", ".") else rel

    def files_under(self, path: str, glob: str | None = None) -> list[str]:
        """Relative paths of the indexed files under directory ``path`` (sorted).

        ``glob`` is matched against the path relative to ``path``.
        """
        base = self.relpath(path)
        prefix = "" if base == "." else base + "/"
        if prefix and not (self.root / base).is_dir():
            name = PurePosixPath(base).name
            return [base] if glob is None or match_glob([name], glob) else []
        under = [f for f in self.sizes if f.startswith(prefix)]
        return match_glob(under, glob, len(prefix)) if glob else under

    def text(self, rel: str) -> str:
        """The decoded text of indexed file ``rel`` (read now if it was too large to index).

        Raises:
            SourceError: the file is binary or larger than 16 MB.
        """
        if rel in self.texts:
            return self.texts[rel]
        p = self.resolve(rel)
        try:
            if p.is_dir():
                raise SourceError(f"{rel!r} is a directory; call list_files on it")
            if not p.is_file():
                raise SourceError(f"{rel!r} is not a regular file (a FIFO, socket or device); "
                                  "only files can be read")
            if p.stat().st_size > MAX_READ_BYTES:
                raise SourceError(f"{rel!r} is larger than 16 MB; grep it for what you need "
                                  "instead")
            data = p.read_bytes()
        except OSError as e:
            raise os_refusal(rel, e) from e
        if b"\0" in data[:_BINARY_PROBE]:
            raise SourceError(f"{rel!r} is a binary file (e.g. a compiled extension); only text "
                              "files can be read")
        return data.decode("utf-8", errors="replace")

    def parse(self, rel: str) -> ast.Module | None:
        """The parsed module of indexed text file ``rel`` (cached), or None if it does not parse."""
        with self._lock:
            if rel in self._asts:
                self._asts.move_to_end(rel)
                return self._asts[rel]
            text = self.texts.get(rel)
            try:
                mod = ast.parse(text, filename=rel) if text is not None else None
            except (SyntaxError, ValueError):
                mod = None
            self._asts[rel] = mod
            self._ast_chars += len(text or "")
            while self._ast_chars > AST_CACHE_CHARS and len(self._asts) > 1:
                old, _ = self._asts.popitem(last=False)
                self._ast_chars -= len(self.texts.get(old) or "")
            return mod

    def memo(self, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()``, remembered under ``key`` for this tree (the tree never changes).

        Calls are serialised, so concurrent tool calls compute each key once.
        """
        with self._lock:
            if key in self._memo:
                self._memo.move_to_end(key)
                return self._memo[key]  # type: ignore[no-any-return]
            value = compute()
            self._memo[key] = value
            if len(self._memo) > MEMO_ENTRIES:
                self._memo.popitem(last=False)
            return value


def split_lines(text: str) -> list[str]:
    """Lines of ``text`` split at newlines only (as ``ast`` and grep count them), CR dropped."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [x[:-1] if x.endswith("\r") else x for x in lines]
