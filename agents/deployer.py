"""Deployer agent.

Job: launch one candidate through the cluster server, wait until it is Ready
or Failed, diagnose a failure from the engine's own log (:meth:`domain.engines.Engine.diagnose`),
and always tear it down afterwards.

Two brains with one interface (``launch``, ``teardown``): :class:`Deployer` (deterministic, no
API key) and :class:`ClaudeDeployer` (prompt ``agents/prompts/deployer.md``), whose report is
checked against the cluster's own status before the graph believes it. Output: a
:class:`DeployOutcome`.
"""

from __future__ import annotations

from typing import Any

import anyio
from mcp import Client
from pydantic import BaseModel, Field

from agents.claude import AgentFailure, ClaudeAgent, ClaudeSetup, context_block
from agents.mcp_tools import ToolCallFailed, call
from domain.config import ServingConfig
from domain.engines import engine_for, failure_classes
from domain.usage import AgentUsage

RUN_ID_LABEL = "servetune/run-id"  # the run a deployment belongs to (graph/run.py's leftovers)


class DeployOutcome(BaseModel):
    """What happened to one launch."""

    name: str
    ready: bool
    failure_class: str | None = None
    evidence: str = ""
    stage: str | None = None
    log_tail: list[str] = []
    startup_s: float = 0.0


class Deployer:
    """Deterministic deployer brain over the cluster MCP server."""

    def __init__(self, cluster: Client, poll_s: float = 2.0) -> None:
        """Deployer over ``cluster``; ``poll_s`` is the wait between status polls (s)."""
        self.cluster = cluster
        self.poll_s = poll_s

    async def launch(self, name: str, config: ServingConfig,
                     labels: dict[str, str]) -> DeployOutcome:
        """Deploy ``config`` as ``name`` with ``labels`` and wait for Ready or Failed.

        A deployment left under that name by a killed process of the same run (the same
        ``servetune/run-id`` label) is torn down first (adopting nothing of unknown state);
        another run's is never touched (the deploy then fails: the name is taken).
        """
        existing = await call(self.cluster, "list_deployments")
        if any(d["name"] == name and d["phase"] != "Terminated" and
               (d.get("labels") or {}).get(RUN_ID_LABEL) == labels.get(RUN_ID_LABEL)
               for d in existing):
            await call(self.cluster, "tear_down", {"name": name})
        st = await call(self.cluster, "deploy", {"name": name, "labels": labels,
                                                 "config": config.model_dump(mode="json")})
        # The twin answers at once; a real backend is polled until it leaves Pending.
        while st["phase"] not in ("Ready", "Failed", "Terminated"):
            await anyio.sleep(self.poll_s)
            st = await call(self.cluster, "get_status", {"name": name})
        if st["phase"] == "Ready":
            return DeployOutcome(name=name, ready=True, startup_s=st["startup_s"])
        page = await call(self.cluster, "get_logs", {"name": name, "tail": 40})
        lines = page["lines"]
        # the status message last: it holds what no log line says (a readiness timeout)
        d = engine_for(config).diagnose(
            lines + ([st["message"]] if st.get("message") else []))
        # the backend's failed stage when it names one, else the phase the log reached
        return DeployOutcome(name=name, ready=False, failure_class=d.failure_class,
                             evidence=d.evidence, stage=st.get("failed_stage") or d.phase,
                             log_tail=lines[-12:])

    async def teardown(self, name: str) -> None:
        """Tear down ``name`` (idempotent)."""
        await call(self.cluster, "tear_down", {"name": name})


FAILURE_CLASSES = failure_classes()  # every engine's classes, UNKNOWN last


class DeployReport(BaseModel):
    """What the Claude deployer submits about one launch."""

    name: str = Field(description="the deployment name given in the task")
    ready: bool = Field(description="true only when get_status says phase Ready")
    failure_class: str | None = Field(
        None, description=f"for a failed startup, one of: {', '.join(FAILURE_CLASSES)}")
    evidence: str = Field("", max_length=2000,
                          description="the engine log line that shows the failure, quoted")
    stage: str | None = Field(None, description="failed_stage from get_status, if any")
    startup_s: float = Field(0.0, ge=0, description="startup_s from get_status (s)")


class ClaudeDeployer(Deployer):
    """Claude brain: the deployer prompt drives the cluster tools for one named deployment.

    The deployment name, the config and the namespace are fixed arguments the model cannot
    change (they are not in its tool schemas), so it can only act on the trial it was given.
    Its report is checked against ``get_status``: a claimed Ready that is not, a missing
    failure class or a still-Pending deployment is rejected (one corrective retry). ``usage``
    accumulates the cost of every run; ``teardown`` stays in code.
    """

    TOOLS = ("deploy", "get_status", "get_logs", "get_events", "tear_down", "list_deployments")

    def __init__(self, cluster: Client, lessons: Client, claude: ClaudeSetup,
                 namespace: str) -> None:
        """Deployer over ``cluster`` (and ``lessons`` for check_config) in ``namespace``."""
        super().__init__(cluster)
        self.lessons, self.claude, self.namespace = lessons, claude, namespace
        self.usage = AgentUsage()

    async def launch(self, name: str, config: ServingConfig,
                     labels: dict[str, str]) -> DeployOutcome:
        """Have Claude deploy ``config`` as ``name`` and report Ready or the failure.

        Raises:
            AgentOutputInvalid, AgentBudgetExceeded: no valid report (the caller tears the
                deployment down and records the trial as failed).
        """
        cfg = config.model_dump(mode="json")
        ns: dict[str, Any] = {"namespace": self.namespace}
        fixed: dict[str, dict[str, Any]] = {"deploy": {"name": name, "config": cfg,
                                                       "labels": labels, **ns},
                 "list_deployments": ns,
                 **{t: {"name": name, **ns} for t in ("get_status", "get_logs", "get_events",
                                                      "tear_down")}}
        agent: ClaudeAgent[DeployReport] = ClaudeAgent(
            "deployer", self.claude.client, {"cluster": self.cluster, "lessons": self.lessons},
            {"cluster": list(self.TOOLS), "lessons": ["check_config"]}, DeployReport,
            model=self.claude.model, budget=self.claude.budget, meter=self.claude.meter,
            fixed_args={"cluster": fixed, "lessons": {"check_config": {"config": cfg}}})
        phase: dict[str, Any] = {}

        async def check(out: DeployReport) -> str | None:
            if out.name != name:
                return f"name must be {name!r}, the deployment of this task"
            try:
                st = await call(self.cluster, "get_status", {"name": name})
            except ToolCallFailed:
                return f"{name} was never deployed: call deploy first"
            phase.update(st)
            if st["phase"] == "Pending":
                return f"{name} is still Pending: poll get_status until Ready or Failed"
            if out.ready != (st["phase"] == "Ready"):
                return f"ready={out.ready} contradicts get_status phase {st['phase']}"
            if not out.ready and out.failure_class not in FAILURE_CLASSES:
                return (f"failure_class {out.failure_class!r} must be one of "
                        f"{', '.join(FAILURE_CLASSES)}")
            return None

        task = (f"DEPLOY {name}: launch this config and report Ready or why it failed.\n"
                + context_block({"name": name, "config": config.model_dump(
                    mode="json", exclude_none=True)}))
        try:
            report, usage = await agent.run(task, check)
        except AgentFailure as e:
            self.usage = self.usage.plus(e.usage)
            raise
        self.usage = self.usage.plus(usage)
        if report.ready:
            return DeployOutcome(name=name, ready=True,
                                 startup_s=float(phase.get("startup_s") or report.startup_s))
        page = await call(self.cluster, "get_logs", {"name": name, "tail": 40})
        return DeployOutcome(name=name, ready=False, failure_class=report.failure_class,
                             evidence=report.evidence, log_tail=page["lines"][-12:],
                             stage=report.stage or phase.get("failed_stage"))
