"""SIGINT and SIGTERM during a run: cancel the run's task, then stop what the run started.

``timeout``, ``kubectl delete`` and a Job's deadline send SIGTERM; Ctrl-C sends SIGINT. Either
cancels the main task of the event loop (as asyncio does for SIGINT), so the run unwinds through
its MCP sessions and checkpointer in order instead of being cut at whatever line the signal
landed on; the CLI then tears down this run's deployments (:func:`graph.run.stop_run`), prints
one line with the resume command and exits ``128 + signal number`` (130 for SIGINT, 143 for
SIGTERM, the shell's convention).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass
class Interrupt:
    """The signal that stopped a run (None: none did)."""

    signum: int | None = None

    @property
    def exit_code(self) -> int:
        """``128 + signal number`` (130 SIGINT, 143 SIGTERM)."""
        return 128 + (self.signum or signal.SIGINT)


async def until_signal(coro: Coroutine[Any, Any, T], interrupt: Interrupt) -> T:
    """Await ``coro``; the first SIGINT or SIGTERM cancels it and is noted in ``interrupt``.

    Later signals are ignored until the loop is closed (a second Ctrl-C does not cut the
    unwinding).

    Raises:
        asyncio.CancelledError (or what the unwinding raised): after a signal.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def on_signal(signum: int) -> None:
        if interrupt.signum is None:
            interrupt.signum = signum
            task.cancel()

    for s in SIGNALS:  # removed when asyncio.run closes the loop (after its worker threads)
        loop.add_signal_handler(s, on_signal, s)
    return await coro


def join_new_threads(before: set[threading.Thread], timeout_s: float = 30.0) -> None:
    """Wait up to ``timeout_s`` s in all for the threads started since ``before`` to end.

    A cancelled run can leave a worker thread finishing a blocking backend call (a deploy
    that is writing its record); its deployment is only visible to the teardown after it.
    """
    deadline = time.monotonic() + timeout_s
    for t in threading.enumerate():
        if t not in before and t is not threading.current_thread() and not t.daemon:
            t.join(max(0.0, deadline - time.monotonic()))


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """Ignore SIGINT and SIGTERM inside the block (the teardown after an interruption)."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
