"""Fixtures shared by the test modules, and the grouping of tests for pytest-xdist."""

from __future__ import annotations

import os
import tempfile

import pytest

from memory.store import LessonStore

# SGLang versions fetched on this machine (~/.cache/servetune/engines) are no part of a test run:
# every test and the servetune processes it starts see the shipped inventories only, and a test
# that fetches a version writes it here, not into the user's cache.
os.environ["SERVETUNE_ENGINE_DATA"] = tempfile.mkdtemp(prefix="servetune-test-engines-")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the marks into node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Keep the tests that share a module's module- or session-scoped fixture on one worker.

    Such a fixture (a study run several tests only read) is made once per worker that runs one
    of its tests; ``--dist loadgroup`` sends every test of an ``xdist_group`` to one worker.
    """
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        module = item.nodeid.split("::", 1)[0]
        for name in info.names_closure:
            defs = info.name2fixturedefs.get(name)
            if defs and defs[-1].scope in ("module", "session") \
                    and defs[-1].baseid.split("::", 1)[0] == module:
                item.add_marker(pytest.mark.xdist_group(module))
                _suffix_group(item, module)
                break


def _suffix_group(item: pytest.Item, group: str) -> None:
    """Add ``@group`` to the node id, the suffix ``--dist loadgroup`` schedules by.

    pytest-xdist (3.8) adds it by assigning ``item._nodeid``, which pytest 9.2 no longer reads
    (``nodeid`` is ``str(item._id)``): without this every grouped test was spread over the
    workers and each worker made the module's study run again. Only in an xdist worker run
    with ``--dist loadgroup`` (the worker's ``loadgroup`` option).
    """
    if not hasattr(item.config, "workerinput") or not item.config.getvalue("loadgroup"):
        return
    if not hasattr(item, "_id") or "@" in item.nodeid.rsplit("]", 1)[-1]:
        return  # an older pytest (xdist's own hook works there), or already suffixed
    from _pytest.nodeid import coerce_node_id

    item._id = coerce_node_id(f"{item.nodeid}@{group}")


TIERS = ("unit", "integration", "e2e")


@pytest.hookimpl(tryfirst=True)
def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark each test with its tier, the folder under tests/ it is in (``-m unit``)."""
    try:
        parts = item.path.relative_to(item.config.rootpath).parts
    except ValueError:  # a test file outside the rootdir
        return
    if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIERS:
        item.add_marker(parts[1])


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
