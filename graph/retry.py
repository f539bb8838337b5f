"""Retry by failure class: launches and benchmarks are tried again only where it can help.

A failed launch is classified from the engine's log (:func:`agents.deployer.classify`), a failed
benchmark from its result (:func:`domain.faults.bench_failure_class`); :data:`domain.faults.RETRY`
says whether another try can cure the class (image pull, readiness timeout, a server that died,
a stalled or garbage benchmark) and whether it needs a fresh deployment. An OOM or an engine
refusal is never retried: it fails the same way again and becomes a lesson.

Every failure is appended to ``events.jsonl`` as a ``failure`` event (key, deployment, try,
class, whether it was retried, the evidence), and retried ones are carried on the trial row
(``Trial.retries``), so the report can list injected faults against classified failures.

Teardown has one owner here: every phase holds its deployment inside :func:`deployment`, which
tears it down however the block ends; :func:`launch` and :func:`measure` tear down only to
deploy the same name again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any

from agents.deployer import Deployer, DeployOutcome
from agents.mcp_tools import ToolCallFailed
from domain.bench import BenchResult
from domain.config import ServingConfig
from domain.faults import bench_failure_class, rule, should_retry
from graph.state import StudyContext


def _note(ctx: StudyContext, key: str, name: str, what: str, attempt: int, cls: str | None,
          evidence: str, retried: bool, stage: str | None = None) -> dict[str, Any]:
    row = {"key": key, "name": name, "what": what, "attempt": attempt,
           "failure_class": cls or "UNKNOWN", "stage": stage, "retried": retried,
           "evidence": evidence[:240]}
    ctx.event("failure", **row)
    return row


@asynccontextmanager
async def deployment(deployer: Deployer, name: str) -> AsyncIterator[None]:
    """Hold deployment ``name`` for the block; it is torn down however the block ends.

    Every phase (search, validation and its retune and quality reference, frontier) launches
    inside such a block, so no path out of a trial leaves a server running. When the block
    raises (an API error, a refused tool call), a teardown the cluster server refuses (e.g.
    nothing was deployed yet) does not hide that error; the run's resume tears down by label
    what is left (:func:`graph.run.tear_down_leftovers`). A cancelled run (SIGINT/SIGTERM) or a
    block closed at loop shutdown tears nothing down here: its MCP sessions may be closed
    already, and the interrupt path tears down this run's deployments by label
    (:func:`graph.run.stop_run`).
    """
    try:
        yield
    except Exception:
        with suppress(ToolCallFailed):
            await deployer.teardown(name)
        raise
    await deployer.teardown(name)


async def launch(ctx: StudyContext, deployer: Deployer, name: str, config: ServingConfig,
                 labels: dict[str, str], key: str,
                 retries: list[dict[str, Any]] | None = None) -> DeployOutcome:
    """``deployer.launch`` until Ready, a class not worth retrying, or the last try.

    Retried failures are appended to ``retries`` (when given).
    """
    attempt = 0
    while True:
        out = await deployer.launch(name, config, labels)
        if out.ready:
            return out
        again = should_retry(out.failure_class, attempt)
        row = _note(ctx, key, name, "deploy", attempt, out.failure_class, out.evidence, again,
                    out.stage)
        if not again:
            return out
        if retries is not None:
            retries.append(row)
        await deployer.teardown(name)
        attempt += 1


async def measure(ctx: StudyContext, deployer: Deployer, name: str, config: ServingConfig,
                  labels: dict[str, str], key: str,
                  run: Callable[[], Awaitable[list[BenchResult]]],
                  retries: list[dict[str, Any]]) -> list[BenchResult]:
    """``run()`` (benchmarks of the Ready deployment ``name``) until valid or not worth retrying.

    A class whose rule says ``redeploy`` (the server died) tears ``name`` down and launches it
    again (:func:`launch`) before the next try; if that launch fails, the invalid runs are
    returned. Retried failures are appended to ``retries``.
    """
    attempt = 0
    while True:
        runs = await run()
        bad = next((b for b in runs if not b.valid), None)
        cls = None if bad is None else bench_failure_class(False, bad.invalid_reason,
                                                           bad.errors_by_class)
        if bad is None or cls is None:
            return runs
        again = should_retry(cls, attempt)
        row = _note(ctx, key, name, "bench", attempt, cls,
                    f"{bad.invalid_reason or ''} first error: {bad.first_error or '-'}", again)
        if not again:
            return runs
        retries.append(row)
        if rule(cls).redeploy:
            await deployer.teardown(name)
            out = await launch(ctx, deployer, name, config, labels, key, retries)
            if not out.ready:
                return runs
        attempt += 1
