"""A lesson store that is briefly unavailable now and then (a study's ``faults``).

:class:`FlakyStore` wraps a :class:`~memory.store.LessonStore`: lesson-store call number ``n``
starts an outage when ``FaultSpec.lessons_fault(n)`` says so (never within
:data:`CALM_CALLS` calls after one: outages are brief and apart, so a retried tool call that
makes several store calls gets through), and the outage refuses that call and the next
``outage_calls - 1`` with :class:`~memory.store.StoreUnavailable` (a tool error
saying the store is temporarily unavailable), as a store behind a restarting server would. The
callers retry such errors (:func:`agents.mcp_tools.call`). Every other attribute is the wrapped
store's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from domain.faults import UNAVAILABLE, FaultSpec
from memory.store import LessonStore, StoreUnavailable

CALLS = frozenset({"query", "list", "add", "get", "forbidding"})
CALM_CALLS = 4  # store calls after an outage that cannot start another (one tool call makes <= 2)


class FlakyStore:
    """``store`` with the outages ``faults`` draws; ``refused`` counts the refused calls."""

    def __init__(self, store: LessonStore, faults: FaultSpec) -> None:
        self._store, self._faults = store, faults
        self._calls = 0
        self._left = 0  # calls the current outage still refuses
        self._calm = 0  # calls after an outage that cannot start another (it was brief)
        self.refused = 0
        self.outages = 0

    def _gate(self) -> None:
        n, self._calls = self._calls, self._calls + 1
        if self._left == 0 and self._calm:
            self._calm -= 1
        elif self._left == 0 and self._faults.lessons_fault(n):
            self._left, self.outages = self._faults.outage_calls, self.outages + 1
            self._calm = CALM_CALLS
        if self._left:
            self._left -= 1
            self.refused += 1
            raise StoreUnavailable(getattr(self._store, "path", "lessons"),
                                   f"{UNAVAILABLE} (connection refused while the store "
                                   "restarts); retry in a moment")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name not in CALLS or not callable(attr):
            return attr
        fn: Callable[..., Any] = attr

        @functools.wraps(fn)
        def gated(*args: Any, **kwargs: Any) -> Any:
            self._gate()
            return fn(*args, **kwargs)

        return gated
