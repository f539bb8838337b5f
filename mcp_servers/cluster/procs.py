"""Linux process facts for the local backend, read from ``/proc`` (no psutil).

A PID alone does not name a process: once it exits, the kernel may hand the number to another
one. The local backend therefore records each server's start time (field 22 of
``/proc/PID/stat``, clock ticks since boot) and signals a process group only while the PID still
has that start time and leads its own group. Source: proc(5), ``/proc/[pid]/stat``.

A group can outlive its leader (a shell that backgrounds a helper and execs the server, the
server then killed): the kernel keeps the group id allocated while any member lives, so it is
not handed to a new process, but a group id alone does not prove whose group it is. Each server
is therefore started with a token in its environment (:data:`TOKEN_ENV`, inherited by every
process it starts); a group whose leader has exited is signalled only if one of its members
carries the token in ``/proc/PID/environ`` (its environment as exec'd). A member that dropped
its environment (``env -i``) or left the group (``setsid``) is out of reach.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

StopOutcome = Literal["foreign", "unproven", "exited", "terminated", "killed"]
# Environment variable carrying a server's token (see the module docstring).
TOKEN_ENV = "SERVETUNE_REPLICA_TOKEN"


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/PID/stat`` the backend needs."""

    pid: int
    state: str  # R running, S sleeping, D disk, Z zombie, X dead, T stopped, ...
    pgid: int
    start_ticks: int  # clock ticks after boot


def proc_stat(pid: int) -> ProcStat | None:
    """``/proc/PID/stat`` of ``pid``, or None if no such process exists."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm (field 2) is in parentheses and may itself contain spaces or ')'.
    rest = raw[raw.rindex(")") + 2:].split()
    return ProcStat(pid=pid, state=rest[0], pgid=int(rest[2]), start_ticks=int(rest[19]))


def is_our_leader(pid: int, start_ticks: int) -> bool:
    """True if ``pid`` is still the group leader started at ``start_ticks`` (zombie or not)."""
    st = proc_stat(pid)
    return st is not None and st.start_ticks == start_ticks and st.pgid == pid


def running(pid: int, start_ticks: int) -> bool:
    """True if ``pid`` is the process started at ``start_ticks`` and has not exited."""
    st = proc_stat(pid)
    return st is not None and st.start_ticks == start_ticks and st.state not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """PIDs of the live (non-zombie) processes in process group ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = proc_stat(int(entry))
            if st is not None and st.pgid == pgid and st.state not in ("Z", "X"):
                members.append(st.pid)
    return members


def carries_token(pid: int, token: str) -> bool:
    """True if ``pid`` was exec'd with ``TOKEN_ENV=token`` (False if unreadable or absent)."""
    if not token:
        return False
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:  # gone, or another user's process
        return False
    return f"{TOKEN_ENV}={token}".encode() in env.split(b"\0")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free on ``host`` now (bound to port 0, then released).

    All sockets stay open until every port is chosen, so the ports differ; another program may
    still take one before the server binds it (a rare, visible failure: the server exits).
    """
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def stop_groups(leaders: list[tuple[int, int, str]], grace_s: float,
                reap: Callable[[], None] = lambda: None) -> dict[int, StopOutcome]:
    """Stop the process group of each ``(pid, start_ticks, token)`` leader (SIGTERM, SIGKILL).

    SIGKILL goes to what is left after ``grace_s`` seconds. A group is signalled while its
    leader PID still has the recorded start time and leads the group (a zombie leader counts:
    its PID cannot be reused yet), or, once the leader has exited, while a member of the group
    carries the leader's ``token`` (:func:`carries_token`; an empty token proves nothing).
    ``reap`` is called while waiting, so the caller can collect the exit status of its own
    children.

    Returns:
        per leader PID: ``foreign`` (the PID is another process now: not signalled),
        ``unproven`` (the leader has exited, its group lives on without the token: not
        signalled), ``exited`` (nothing left to signal), ``terminated`` (gone after SIGTERM)
        or ``killed`` (SIGKILL was needed).
    """
    out: dict[int, StopOutcome] = {}
    for pid, ticks, token in leaders:
        if proc_stat(pid) is None:  # the leader has exited (and was reaped)
            members = group_members(pid)
            if not members:
                out[pid] = "exited"
                continue
            if not any(carries_token(m, token) for m in members):
                out[pid] = "unproven"
                continue
        elif not is_our_leader(pid, ticks):
            out[pid] = "foreign"
            continue
        if not group_members(pid):
            out[pid] = "exited"
        else:
            try:
                os.killpg(pid, signal.SIGTERM)
                out[pid] = "terminated"
            except ProcessLookupError:
                out[pid] = "exited"
    signalled = [pid for pid, o in out.items() if o == "terminated"]
    if not _wait_empty(signalled, grace_s, reap):
        for pid in signalled:
            if group_members(pid):  # members left: the group (so its id) is still ours
                try:
                    os.killpg(pid, signal.SIGKILL)
                    out[pid] = "killed"
                except ProcessLookupError:
                    pass
        _wait_empty(signalled, 5.0, reap)
    _wait_reaped(signalled, REAP_WAIT_S, reap)
    return out


# How long a stopped leader may take from leaving its group's live members (state ``X``, still
# exiting) to the zombie a parent can reap (``Z``): the kernel's exit path, well under a second
# on a loaded host; bounded so a leader another process must reap cannot hold the teardown.
REAP_WAIT_S = 2.0


def _wait_reaped(leaders: list[int], timeout_s: float, reap: Callable[[], None]) -> None:
    """Call ``reap`` until every leader in ``leaders`` is gone from /proc (or ``timeout_s``).

    A leader seen exiting (``X``) is not yet a zombie, so one ``reap`` at that moment finds
    nothing to collect and the zombie would outlive the teardown.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        reap()
        if all(proc_stat(p) is None for p in leaders) or time.monotonic() >= deadline:
            return
        time.sleep(0.01)


def _wait_empty(groups: list[int], timeout_s: float, reap: Callable[[], None]) -> bool:
    """Wait until ``groups`` have no live member; True if they emptied in time."""
    deadline = time.monotonic() + timeout_s
    while True:
        reap()
        if not any(group_members(g) for g in groups):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
