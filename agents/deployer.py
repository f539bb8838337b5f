"""Deployer agent.

Job: launch one candidate through the cluster server, wait until it is Ready
or Failed, classify a failure from the engine's own log, and always tear it down afterwards.

Two brains with one interface (``launch``, ``teardown``): :class:`Deployer` (deterministic, no
API key) and :class:`ClaudeDeployer` (prompt ``agents/prompts/deployer.md``), whose report is
checked against the cluster's own status before the graph believes it. Output: a
:class:`DeployOutcome`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import anyio
from mcp import Client
from pydantic import BaseModel, Field

from agents.claude import AgentFailure, ClaudeAgent, ClaudeSetup, context_block
from agents.mcp_tools import ToolCallFailed, call
from domain.config import ServingConfig
from domain.usage import AgentUsage

RUN_ID_LABEL = "servetune/run-id"  # the run a deployment belongs to (graph/run.py's leftovers)


@dataclass(frozen=True)
class FailurePattern:
    """One row of the classifier table (servetune's sglang-knobs reference, section 3.2)."""

    failure_class: str
    regex: re.Pattern[str]
    retryable: bool
    meaning: str


FAILURE_PATTERNS: tuple[FailurePattern, ...] = tuple(FailurePattern(c, re.compile(r), rt, m)
                                                     for c, r, rt, m in (
    ("BAD_FLAG", r"error: (ambiguous option|unrecognized arguments|argument --[\w-]+)", False,
     "argparse refused a flag or value for this SGLang version"),
    ("UNSUPPORTED_BACKEND",
     r"(FlashAttention v3 Backend requires SM>=80 and SM<=90|backend is only supported on)",
     False, "the attention backend cannot run on this GPU architecture"),
    ("BACKEND_MODEL_MISMATCH", r"backend can only be used with (MLA|non-MLA) models", False,
     "the attention backend does not support this model's attention type"),
    ("OOM_WEIGHTS", r"(torch\.)?OutOfMemoryError: CUDA out of memory|CUDA error: out of memory",
     False, "the weight shard does not fit in GPU memory"),
    ("KV_NO_ROOM", r"Loaded weights leave no GPU memory for the KV cache|Not enough memory\. "
     r"Please try to increase --mem-fraction-static|max_running_request is zero|Memory pool "
     r"size is too small", False,
     "weights leave no (or too small a) KV cache under mem_fraction_static"),
    ("HOST_OOM_HICACHE", r"Not enough host memory available\. Requesting .* GB but only have "
     r".* GB free", False, "the HiCache host pool does not fit in the node's host memory"),
    ("HICACHE_HOST_TOO_SMALL", r"The host memory should be larger than the device memory",
     False, "hicache_ratio must make the host pool larger than the device KV pool"),
    ("NO_DRAFT_MODEL", r"has no MTP/NextN draft layer", False,
     "speculative decoding on a model whose checkpoint ships no draft head"),
    ("GRAPH_CAPTURE_OOM", r"Capture cuda graph failed", False,
     "too little memory outside the static pool for CUDA-graph capture"),
    ("TP_DIVISIBILITY", r"AssertionError: \d+ is not divisible by \d+", False,
     "attention heads or MLP sizes do not split evenly over tp_size"),
    ("MULTI_NODE_REQUIRED", r"invalid device ordinal", False,
     "tp_size needs more GPUs than one node has"),
    # cluster-level failures (the kubelet's verdict in the backends' ``servetune:`` lines, the
    # engine's child-crash lines); retryable as domain.faults.RETRY says
    ("IMAGE_PULL", r"ImagePullBackOff|ErrImagePull|failed to pull (and unpack )?image", True,
     "the node could not pull the image (registry or network)"),
    ("READY_TIMEOUT", r"not ready after [\d.]+ s", True,
     "the server did not turn Ready within the readiness timeout"),
    # the engine's own refusal outranks the kubelet's generic verdict on the same crash
    ("INVALID_COMBINATION",
     r"(?<![\w.])(ValueError|AssertionError|NotImplementedError|TypeError)(: |$)", False,
     "the engine's argument resolution rejected a flag combination (a bare AssertionError is "
     "speculative_hook's all-three-or-none assert)"),
    ("CRASH_LOOP", r"CrashLoopBackOff|Scheduler hit an exception|Received sigquit from a child "
     r"process", False, "the server crashed after it started, and again after each restart"),
))


def classify(log: list[str]) -> tuple[str, str]:
    """Failure class and the evidence line of a failed startup log.

    OOM rows are checked before the generic INVALID_COMBINATION row, so the first match in
    table order wins; the evidence is the first log line that matched.

    Returns:
        (failure_class, evidence line); ("UNKNOWN", last line) if nothing matched.
    """
    for p in FAILURE_PATTERNS:
        for line in log:
            if p.regex.search(line):
                return p.failure_class, line
    return "UNKNOWN", log[-1] if log else ""


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
        cls, evidence = classify(lines + ([st["message"]] if st.get("message") else []))
        return DeployOutcome(name=name, ready=False, failure_class=cls, evidence=evidence,
                             stage=st.get("failed_stage"), log_tail=lines[-12:])

    async def teardown(self, name: str) -> None:
        """Tear down ``name`` (idempotent)."""
        await call(self.cluster, "tear_down", {"name": name})


FAILURE_CLASSES = tuple(p.failure_class for p in FAILURE_PATTERNS) + ("UNKNOWN",)


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
