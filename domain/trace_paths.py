"""Path checks for files the user names: a file or folder name no file system can hold.

Used by the trace loaders (:func:`check_trace_path`), the study-file reader and the source-tree
reader, so every one refuses an over-long name with the same one-line message.
"""

from __future__ import annotations

import os

from domain.errors import TraceInvalid

# Longest file or folder name, bytes: NAME_MAX of Linux file systems (ext4, xfs, btrfs, tmpfs) and
# the limit of APFS; a longer path component fails every system call with ENAMETOOLONG.
MAX_NAME_BYTES = 255


def long_name_bytes(path: str | os.PathLike[str]) -> int | None:
    """The UTF-8 length of the first file or folder name in ``path`` over the name limit.

    No file can have a name over ``MAX_NAME_BYTES`` (255) bytes: every system call on such a
    path fails with ENAMETOOLONG. Returns None when every name fits.
    """
    for part in os.fspath(path).replace(os.sep, "/").split("/"):
        n = len(part.encode("utf-8", "surrogateescape"))
        if n > MAX_NAME_BYTES:
            return n
    return None


def long_name_message(n: int, what: str) -> str:
    """The one-line refusal of a path with a ``n``-byte name (``what``: "trace", "study")."""
    return (f"a file or folder name in the path is {n} bytes long, more than the "
            f"{MAX_NAME_BYTES} bytes a file system allows; give the {what}'s real path")


def check_trace_path(path: str | os.PathLike[str]) -> None:
    """Refuse a trace path none of whose files can exist: a component over the name limit.

    Raises:
        TraceInvalid: a file or folder name in ``path`` is longer than ``MAX_NAME_BYTES`` (255)
            bytes in UTF-8.
    """
    n = long_name_bytes(path)
    if n is not None:
        raise TraceInvalid(f"{os.fspath(path)[:60]}...", long_name_message(n, "trace"))
