"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend():
    """Async tests (``pytest.mark.anyio``) run on asyncio, the loop the MCP servers use."""
    return "asyncio"
