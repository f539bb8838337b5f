"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from memory.store import LessonStore


@pytest.fixture
def anyio_backend():
    """Async tests (``pytest.mark.anyio``) run on asyncio, the loop the MCP servers use."""
    return "asyncio"


@pytest.fixture
def store(tmp_path):
    """An empty lesson store on disk (hashing embedding), closed after the test.

    Modules that need a pre-filled store define their own ``store`` fixture.
    """
    s = LessonStore(tmp_path / "lessons", embedding="hashing")
    try:
        yield s
    finally:
        s.close()
