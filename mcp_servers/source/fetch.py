"""Fetch an SGLang wheel once and unpack it into a cache, for the source server to read.

``pip download sglang==VERSION --no-deps --only-binary=:all:`` fetches only the wheel (about
40 MB; nothing is installed and no dependency is resolved); the wheel is a zip of the whole Python
tree, unpacked (about 130 MB) into ``<cache>/sglang-VERSION/``. Unpacking goes to a temporary
directory renamed into place, so a killed fetch never leaves a half tree behind.
"""

from __future__ import annotations

import re
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from mcp_servers.source.tree import SourceError, short_path

# PEP 440 release with optional pre/post/dev parts; nothing option-like or with spaces.
VERSION_RE = re.compile(r"^\d+(\.\d+){0,3}((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?$")
PIP_TIMEOUT_S = 600

Runner = Callable[..., "subprocess.CompletedProcess[Any]"]


def check_version(version: str) -> str:
    """Return ``version`` if it is a plain PEP 440 version such as '0.5.23' or '0.5.0rc1'.

    Raises:
        SourceError: anything else (e.g. '-i http://evil', '0.5; rm', 'latest').
    """
    if not VERSION_RE.match(version):
        raise SourceError(f"version {version!r} is not a release number such as '0.5.23' (digits "
                          "and dots, optionally rcN/.postN/.devN)")
    return version


def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The wheel cache directory (it need not exist yet).

    ``$SERVETUNE_SOURCE_CACHE``, else ``$XDG_CACHE_HOME/servetune/sglang``, else
    ``~/.cache/servetune/sglang``.

    Args:
        env: environment to read (default ``os.environ``; the CLI edge passes it).
    """
    from domain.engines import source_cache_dir

    return source_cache_dir(env)


def _unusable(what: str, path: Path, e: OSError, fix: str) -> SourceError:
    """The error for a path the OS refuses (a component over 255 bytes, permission denied)."""
    return SourceError(f"{what} {short_path(str(path))} cannot be used ({e.strerror}); {fix}")


CACHE_FIX = "set SERVETUNE_SOURCE_CACHE to a writable directory with a shorter path"


def cached_tree(version: str, cache_dir: Path) -> Path | None:
    """``cache_dir/sglang-VERSION`` if a fetched tree is there, else None.

    Raises:
        SourceError: a bad version, or a cache path the OS refuses (ENAMETOOLONG, EACCES).
    """
    target = cache_dir / f"sglang-{check_version(version)}"
    try:
        return target if (target / "sglang").is_dir() else None
    except OSError as e:  # Path.is_dir() lets ENAMETOOLONG and EACCES through
        raise _unusable("source cache", cache_dir, e, CACHE_FIX) from e


def unpack_wheel(wheel: Path, dest: Path) -> Path:
    """Unpack ``wheel`` into the new directory ``dest`` (atomically: temp dir + rename).

    Returns:
        ``dest``, which then holds ``sglang/`` and the dist-info directory.

    Raises:
        SourceError: not a zip, no ``sglang/`` package inside, or a member whose name is
            absolute or climbs out with '..' (nothing is written then).
    """
    if not zipfile.is_zipfile(wheel):
        raise SourceError(f"{wheel} is not a wheel (zip) file")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        with zipfile.ZipFile(wheel) as zf:
            infos = zf.infolist()
            for info in infos:
                name = PurePosixPath(info.filename)
                if name.is_absolute() or ".." in name.parts or "\\" in info.filename \
                        or re.match(r"^[A-Za-z]:", info.filename):
                    raise SourceError(f"{wheel.name} holds a member that escapes the tree: "
                                      f"{info.filename!r}; refusing to unpack it")
            if not any(i.filename.startswith("sglang/") for i in infos):
                raise SourceError(f"{wheel.name} holds no sglang/ package; is it an SGLang wheel?")
            for info in infos:
                mode = info.external_attr >> 16
                if stat.S_ISLNK(mode):
                    continue  # wheels hold no links; never create one
                zf.extract(info, staging)
        try:
            staging.rename(dest)
        except OSError:
            if not (dest / "sglang").is_dir():  # not a concurrent fetch that won the race
                raise
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dest


def pip_download_argv(version: str, dest: Path) -> list[str]:
    """The pip command that downloads only the SGLang wheel of ``version`` into ``dest``."""
    return [sys.executable, "-m", "pip", "download", f"sglang=={check_version(version)}",
            "--no-deps", "--only-binary=:all:", "--dest", str(dest), "--quiet"]


def fetch_wheel(version: str, cache_dir: Path | None = None, wheel: Path | None = None,
                run: Runner = subprocess.run, env: Mapping[str, str] | None = None) -> Path:
    """Download (once) and unpack the SGLang wheel of ``version``; return the tree root.

    Args:
        version: e.g. '0.5.23' (checked against :data:`VERSION_RE`).
        cache_dir: the cache (default :func:`default_cache_dir`).
        wheel: an already-downloaded wheel to unpack instead of running pip.
        run: ``subprocess.run`` or a stand-in (tests).
        env: environment for :func:`default_cache_dir`.

    Returns:
        ``cache_dir/sglang-VERSION``, the directory holding ``sglang/`` (unchanged if present).

    Raises:
        SourceError: bad version, pip failure (its last output lines are in the message), no
            wheel of that version, a wheel that cannot be unpacked safely, or a wheel or cache
            path the OS refuses (a component over 255 bytes, permission denied).
    """
    check_version(version)
    try:
        wheel_missing = wheel is not None and not wheel.is_file()
    except OSError as e:  # Path.is_file() lets ENAMETOOLONG and EACCES through
        assert wheel is not None
        raise _unusable("wheel", wheel, e, "pass the path of a downloaded sglang wheel") from e
    if wheel_missing:
        raise SourceError(f"wheel {wheel} does not exist; download it with `pip download "
                          f"sglang=={version} --no-deps` or leave out --wheel")
    cache_dir = cache_dir or default_cache_dir(env)
    done = cached_tree(version, cache_dir)
    if done is not None:
        return done
    target = cache_dir / f"sglang-{version}"
    if wheel is not None:
        if not wheel.name.startswith(f"sglang-{version}-"):
            raise SourceError(f"{wheel.name} is not the sglang {version} wheel (expected a file "
                              f"named sglang-{version}-*.whl)")
        return unpack_wheel(wheel, target)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unusable("source cache", cache_dir, e, CACHE_FIX) from e
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache_dir) as tmp:
        argv = pip_download_argv(version, Path(tmp))
        try:
            proc = run(argv, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SourceError(f"could not run pip ({e}); download the wheel yourself and pass it "
                              "with --wheel") from e
        if proc.returncode != 0:
            tail = "\n".join(((proc.stderr or "") + (proc.stdout or "")).strip()
                             .splitlines()[-5:])
            raise SourceError(f"pip download of sglang=={version} failed (exit "
                              f"{proc.returncode}): {tail}\nCheck the version exists on PyPI and "
                              "the network is reachable, or pass a downloaded wheel with --wheel")
        found: Sequence[Path] = sorted(Path(tmp).glob(f"sglang-{version}-*.whl"))
        if not found:
            raise SourceError(f"pip produced no sglang-{version}-*.whl wheel (only an sdist?); "
                              "download a wheel yourself and pass it with --wheel")
        return unpack_wheel(found[0], target)
