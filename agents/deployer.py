"""Deployer agent.

Job: launch one candidate through the cluster server, wait until it is Ready
or Failed, classify a failure from the engine's own log, and always tear it down afterwards.

The Claude brain (its prompt in ``agents/prompts/``) comes with the Claude-agents issue. Output: a
:class:`DeployOutcome`. The deterministic brain below needs no API key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import anyio
from mcp import Client
from pydantic import BaseModel

from agents.mcp_tools import call
from domain.config import ServingConfig


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
    ("INVALID_COMBINATION",
     r"(?<![\w.])(ValueError|AssertionError|NotImplementedError|TypeError)(: |$)", False,
     "the engine's argument resolution rejected a flag combination (a bare AssertionError is "
     "speculative_hook's all-three-or-none assert)"),
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
        """Deploy ``config`` as ``name`` and wait for Ready or Failed.

        Any deployment left under that name by a killed run is torn down first (adopting
        nothing of unknown state).
        """
        existing = await call(self.cluster, "list_deployments")
        if any(d["name"] == name and d["phase"] != "Terminated" for d in existing):
            await call(self.cluster, "tear_down", {"name": name})
        st = await call(self.cluster, "deploy", {"name": name,
                                                 "config": config.model_dump(mode="json")})
        # The twin answers at once; a real backend is polled until it leaves Pending.
        while st["phase"] not in ("Ready", "Failed", "Terminated"):
            await anyio.sleep(self.poll_s)
            st = await call(self.cluster, "get_status", {"name": name})
        if st["phase"] == "Ready":
            return DeployOutcome(name=name, ready=True, startup_s=st["startup_s"])
        page = await call(self.cluster, "get_logs", {"name": name, "tail": 40})
        lines = page["lines"]
        cls, evidence = classify(lines)
        return DeployOutcome(name=name, ready=False, failure_class=cls, evidence=evidence,
                             stage=st.get("failed_stage"), log_tail=lines[-12:])

    async def teardown(self, name: str) -> None:
        """Tear down ``name`` (idempotent)."""
        await call(self.cluster, "tear_down", {"name": name})
