"""MCP server "servetune-lessons": search, list, add and check lessons in a LessonStore.

Thin wiring only: each tool validates its arguments (pydantic, from the signature), calls the
matching function of :mod:`mcp_servers.lessons.ops` with the store this server was built over,
and turns expected failures into tool errors the model can act on. Logs go to stderr; stdout is
the protocol channel on stdio.
"""

from __future__ import annotations

import logging
import sys
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations
from pydantic import Field

from domain.config import ServingConfig
from domain.lesson import Lesson, Outcome
from domain.provenance import Backend
from mcp_servers.lessons import ops
from mcp_servers.tool_errors import StrictMCPServer, as_tool_errors
from memory.embeddings import EmbeddingKind
from memory.store import LessonStore, StoreUnavailable

log = logging.getLogger(__name__)

SERVER_NAME = "servetune-lessons"
INSTRUCTIONS = (
    "Lessons learned from earlier serving trials: what failed (OOM, crash, invalid flag, "
    "unsupported backend) or helped, for which GPU/model/weights, under which config condition. "
    "Call check_config before launching a config; query_lessons to find what is known about a "
    "symptom; add_lesson to record a new finding; export_skill to carry them into a skill file. "
    "show_lesson gives a lesson's provenance, status and trust; quarantine_lesson sets aside a "
    "lesson a measurement contradicts (it then forbids nothing)."
)
# Catalog keys look like 'B200', 'glm-5', 'fp8': refuse anything else (no leading '-', no spaces).
KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,63}$"

READ_ONLY = ToolAnnotations(readOnlyHint=True, destructiveHint=False, idempotentHint=True,
                            openWorldHint=False)
WRITE_IDEMPOTENT = ToolAnnotations(readOnlyHint=False, destructiveHint=False,
                                   idempotentHint=True, openWorldHint=False)

GpuArg = Annotated[str | None, Field(
    description="GPU catalog key, e.g. 'B200'; keeps lessons for this GPU or for any GPU",
    pattern=KEY_PATTERN)]
ModelArg = Annotated[str | None, Field(
    description="model catalog key, e.g. 'glm-5'; keeps lessons for this model or any model",
    pattern=KEY_PATTERN)]


LessonIdArg = Annotated[str, Field(pattern=r"^L-[0-9a-f]{10}$",
                                   description="the lesson's id, e.g. 'L-3f2a9c01be'")]
ReasonArg = Annotated[str, Field(min_length=3, max_length=2000, description=(
    "why, in words (kept in the lesson's history), e.g. 'tp_size 8 served in run r7'"))]
DESTRUCTIVE = ToolAnnotations(readOnlyHint=False, destructiveHint=True, idempotentHint=True,
                              openWorldHint=False)


def build_server(store: LessonStore, run_id: str | None = None, backend: str | None = None,
                 allow_retract: bool = False) -> MCPServer:
    """An MCP server over ``store`` (held by the server; never a tool argument).

    Args:
        store: the lesson store; the caller keeps ownership (and closes it).
        run_id: recorded on lessons added through ``add_lesson`` that name no run.
        backend: the backend of the run this server serves (twin, local, kubernetes):
            the provenance of lessons added without one, the measurements of
            ``report_served``, and the default backend ``check_config`` prunes for. None
            (a standalone server): the caller names it.
        allow_retract: also register ``retract_lesson`` and ``restore_lesson`` (the
            operator's ``servetune mcp lessons --allow-retract``); without it an agent can
            quarantine a lesson but never erase or revive one.

    Returns:
        The server, with tools query_lessons, list_lessons, add_lesson, check_config,
        export_skill, diagnose_log, show_lesson, quarantine_lesson and report_served (and
        retract_lesson, restore_lesson with ``allow_retract``).
    """
    server = StrictMCPServer(SERVER_NAME, instructions=INSTRUCTIONS)

    @server.tool(annotations=READ_ONLY)
    def query_lessons(
        text: Annotated[str, Field(min_length=1, max_length=2000, description=(
            "what to look for, in words: a symptom, log line or question, e.g. "
            "'fp8 out of memory at weight load'"))],
        k: Annotated[int, Field(ge=1, le=50, description="at most this many hits")] = 5,
        gpu: GpuArg = None,
        model: ModelArg = None,
        quantization: Annotated[str | None, Field(
            description="checkpoint key (ServingConfig.weights), e.g. 'fp8'; keeps lessons for "
                        "these weights or any weights", pattern=KEY_PATTERN)] = None,
    ) -> ops.QueryResult:
        """Search lessons by meaning; best match first, each with a 0..1 similarity score."""
        with as_tool_errors(ValueError, StoreUnavailable):
            return ops.query_lessons(store, text, k=k, gpu=gpu, model=model,
                                     quantization=quantization)

    @server.tool(annotations=READ_ONLY)
    def list_lessons(
        gpu: GpuArg = None,
        model: ModelArg = None,
        outcome: Annotated[Outcome | None, Field(
            description="keep only lessons with this outcome")] = None,
        start: Annotated[int, Field(ge=0, description=(
            "index of the first lesson to return; use next_start of the previous page"))] = 0,
        max_items: Annotated[int, Field(ge=1, le=200, description="page size")] = 50,
    ) -> ops.LessonPage:
        """List stored lessons, oldest first, one page at a time (next_start is null at the end)."""
        with as_tool_errors(ValueError, StoreUnavailable):
            return ops.list_lessons(store, gpu=gpu, model=model, outcome=outcome, start=start,
                                    max_items=max_items)

    @server.tool(annotations=WRITE_IDEMPOTENT)
    def add_lesson(
        lesson: Annotated[Lesson, Field(description=(
            "the finding: scope, condition clauses over ServingConfig fields, outcome, root "
            "cause, fix and evidence; id is computed, any given id is ignored"))],
    ) -> ops.AddResult:
        """Record a lesson. Adding the same finding again merges into the stored lesson."""
        with as_tool_errors(ValueError, StoreUnavailable):
            return ops.add_lesson(store, lesson, run_id=run_id, backend=backend)

    @server.tool(annotations=READ_ONLY)
    def check_config(
        config: Annotated[ServingConfig, Field(description="the serving config to check")],
        on: Annotated[Backend | None, Field(description=(
            "where it will run: twin, local or kubernetes; on a real backend a lesson learned "
            "on the twin counts only when source-verified (default: this server's run's "
            "backend, else every active lesson counts)"))] = None,
    ) -> ops.CheckResult:
        """Check a serving config against stored lessons before launching it.

        Returns allowed=false and the forbidding lessons (with their fixes) when a known failure
        covers this config. Quarantined and retracted lessons forbid nothing.
        """
        with as_tool_errors(ValueError, StoreUnavailable):
            return ops.check_config(store, config, on or backend)

    @server.tool(annotations=READ_ONLY)
    def export_skill(
        name: Annotated[str, Field(pattern=ops.SKILL_NAME_PATTERN, description=(
            "skill name: lowercase letters, digits and '-'"))] = "servetune-lessons",
        gpu: GpuArg = None,
        model: ModelArg = None,
        quantization: Annotated[str | None, Field(
            description="checkpoint key, e.g. 'fp8'", pattern=KEY_PATTERN)] = None,
    ) -> ops.SkillFile:
        """Render the lessons (optionally scoped) as a Claude Code skill file (SKILL.md text).

        Nothing is written: save `content` at `path` in the project (or run
        `servetune lessons export-skill`) so every Claude Code session knows the lessons.
        """
        with as_tool_errors(ValueError, StoreUnavailable):
            return ops.export_skill(store, name=name, gpu=gpu, model=model,
                                    quantization=quantization)

    @server.tool(annotations=READ_ONLY)
    def diagnose_log(
        log: Annotated[str, Field(min_length=1, max_length=ops.MAX_LOG_CHARS, description=(
            "the engine's log as pasted: the lines around the failure (server_args line "
            "included if you have it)"))],
        engine: Annotated[str, Field(description="the engine that wrote it",
                                     pattern=KEY_PATTERN)] = "sglang",
        version: Annotated[str | None, Field(description="engine version, e.g. '0.5.23' "
                                             "(default: the newest shipped)",
                                             pattern=KEY_PATTERN)] = None,
        gpu: Annotated[str | None, Field(description="GPU catalog key, e.g. 'B200' (needed "
                                         "for the lesson)", pattern=KEY_PATTERN)] = None,
        model: Annotated[str | None, Field(description="model catalog key, e.g. 'glm-5' "
                                           "(default: from the log's model_path)",
                                           pattern=KEY_PATTERN)] = None,
    ) -> ops.LogDiagnosis:
        """Diagnose a failed engine log: failure class, phase, evidence line and fix.

        Also the lesson it would teach (returned, not stored: add it with add_lesson). With the
        engine's source tree fetched (servetune source fetch), the evidence is grounded in its
        raise site and the lesson's condition in what that check tests (verified).
        """
        with as_tool_errors(ValueError):
            return ops.diagnose_log(log, engine=engine, version=version, gpu=gpu, model=model)

    _status_tools(server, store, backend, run_id, allow_retract)
    _add_check_command(server, store)
    return server


def _add_check_command(server: MCPServer, store: LessonStore) -> None:
    """Tool ``check_command``: ``servetune check`` of a raw launch command (issue 18, item 7)."""

    @server.tool(annotations=READ_ONLY)
    def check_command(
        command: Annotated[list[str], Field(min_length=1, max_length=512, description=(
            "the launch command as argv, e.g. ['sglang', 'serve', '--model-path', "
            "'zai-org/GLM-5-FP8', '--tp-size', '8'] (or python -m sglang.launch_server ...)"))],
        gpu: Annotated[str, Field(description="GPU catalog key, e.g. 'B200'",
                                  pattern=KEY_PATTERN)],
        gpus: Annotated[int | None, Field(ge=1, le=4096, description=(
            "GPUs the server may use (checks tp x dp against it)"))] = None,
        version: Annotated[str | None, Field(description=(
            "SGLang version whose flags the command is read with; default the pinned one"),
            pattern=KEY_PATTERN)] = None,
    ) -> ops.CommandCheck:
        """Pre-flight a launch command before GPU time is spent (verdict ok | warn | refuse).

        Finds unknown or retired flags, backends the GPU refuses, the memory fit (smallest
        --mem-fraction-static, KV pool, CUDA-graph memory), lints, and the stored lessons that
        forbid it.
        """
        with as_tool_errors(ValueError, StoreUnavailable):
            return ops.check_command(store, command, gpu, gpus=gpus, version=version)


def _status_tools(server: MCPServer, store: LessonStore, backend: str | None,
                  run_id: str | None, allow_retract: bool) -> None:
    """show_lesson, quarantine_lesson, report_served; retract/restore only for the operator."""

    @server.tool(annotations=READ_ONLY)
    def show_lesson(lesson_id: LessonIdArg) -> ops.LessonView:
        """One lesson: provenance, status history, contradicting measurements, trust.

        Provenance is where it was learned: backend, engine and version, image, run, trial and
        evidence lines.
        """
        with as_tool_errors(ValueError, StoreUnavailable):
            return ops.show_lesson(store, lesson_id)

    @server.tool(annotations=WRITE_IDEMPOTENT)
    def quarantine_lesson(lesson_id: LessonIdArg, reason: ReasonArg) -> ops.StatusResult:
        """Quarantine a lesson: it forbids nothing and is not exported; the evidence stays.

        Use when a measurement contradicts it. Only an operator can restore it.
        """
        with as_tool_errors(ValueError, StoreUnavailable):
            return ops.set_status(store, lesson_id, "quarantined", reason, by="agent (mcp)")

    @server.tool(annotations=WRITE_IDEMPOTENT)
    def report_served(
        config: Annotated[ServingConfig, Field(description="a config that ran and served: "
                                               "ready, and benchmarked with a valid result")],
        trial: Annotated[str | None, Field(max_length=300, description=(
            "the trial (ledger key) that measured it"))] = None,
        evidence: Annotated[str, Field(max_length=2000, description=(
            "what it measured, e.g. 'saturation 1234 tok/s/GPU, 0 errors'"))] = "",
        on: Annotated[Backend | None, Field(description=(
            "where it ran (default: this server's run's backend)"))] = None,
    ) -> ops.ServedResult:
        """Record that a config served; every active lesson that forbids it is quarantined.

        A twin measurement does not overrule a lesson learned on a real backend.
        """
        with as_tool_errors(ValueError, StoreUnavailable):
            where = on or backend
            if where is None:
                raise ValueError("name where the config ran: on='twin', 'local' or "
                                 "'kubernetes'")
            return ops.report_served(store, config, where, run_id=run_id,
                                     trial=trial, evidence=evidence)

    if not allow_retract:
        return

    @server.tool(annotations=DESTRUCTIVE)
    def retract_lesson(lesson_id: LessonIdArg, reason: ReasonArg) -> ops.StatusResult:
        """Retract a lesson (operator only): it forbids nothing and is never exported.

        Its evidence and history stay in the store.
        """
        with as_tool_errors(ValueError, StoreUnavailable):
            return ops.set_status(store, lesson_id, "retracted", reason, by="operator (mcp)")

    @server.tool(annotations=DESTRUCTIVE)
    def restore_lesson(lesson_id: LessonIdArg, reason: ReasonArg) -> ops.StatusResult:
        """Make a quarantined or retracted lesson active again (operator only)."""
        with as_tool_errors(ValueError, StoreUnavailable):
            return ops.set_status(store, lesson_id, "active", reason, by="operator (mcp)")


def main(store_path: str, embedding: EmbeddingKind = "auto",
         allow_retract: bool = False) -> None:
    """Serve the lessons in ``store_path`` over stdio until the client disconnects.

    Args:
        store_path: lesson store directory (created if missing).
        embedding: embedding kind for a new store (see ``memory.store.LessonStore``).
        allow_retract: register retract_lesson and restore_lesson (operator's flag).

    Raises:
        StoreUnavailable: if the store cannot be opened.
    """
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    store = LessonStore(store_path, embedding=embedding)
    log.info("serving %d lessons from %s over stdio", store.count(), store.path)
    try:
        build_server(store, allow_retract=allow_retract).run()
    finally:
        store.close()
