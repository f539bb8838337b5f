"""Typed outputs of the research subagents (source researcher, memory researcher).

A finding carries only claims and their citations, never raw source excerpts or logs, so it can
travel in graph state.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class Claim(BaseModel):
    """One statement about the question, backed by evidence."""

    text: str = Field(min_length=1, description="the claim, one or two sentences")
    evidence: list[str] = Field(
        min_length=1,
        description="citations: 'path/to/file.py:123' (with a short quote) or a lesson id")
    inferred: bool = Field(
        default=False,
        description="true when the claim is the researcher's inference rather than what the "
                    "cited code or lesson states")


class ResearchFindings(BaseModel):
    """A researcher's answer to one scoped question."""

    question: str = Field(description="the question as it was asked")
    answer: str = Field(description="the short answer, in one paragraph")
    claims: list[Claim] = Field(description="the claims the answer rests on")
    unresolved: list[str] = Field(
        default=[], description="what the evidence does not settle (e.g. performance)")


class ResearchQuestion(BaseModel):
    """One scoped question a research subagent answers before a costly launch."""

    id: str = Field(description="stable id within a run, e.g. 'q-attention_backend-fa3-src'")
    kind: Literal["source", "memory"] = Field(
        description="source: the sglang-source server; memory: the lessons server")
    question: str = Field(min_length=1, description="the question in words")
    flag: str | None = Field(None, description="the SGLang flag (dest) it is about, if any")
    value: str | None = Field(None, description="the value the candidate sets, if any")
    gpu: str | None = None
    model: str | None = None
    quantization: str | None = None
    engine_version: str | None = None
    tool_budget: int = Field(8, ge=1, le=50, description="at most this many tool calls")


class PlanChoice(BaseModel):
    """The Claude planner's pick among the screened one-knob candidates."""

    action: Literal["launch", "stop"] = Field(
        description="launch one of the offered candidates, or stop the search")
    candidate: str | None = Field(
        None, description="'knob=value' exactly as offered in context.candidates (launch only)")
    rationale: str = Field(min_length=1, max_length=2000,
                           description="why this candidate (or why stop), with the mechanism")


class ResearchDecision(BaseModel):
    """The planner's decision on a candidate after the research round."""

    decision: Literal["keep", "modify", "drop"] = Field(
        description="keep: launch it; modify: launch `modify_to` instead; drop: launch nothing")
    modify_to: str | None = Field(
        None, description="'knob=value' from context.alternatives (modify only)")
    reason: str = Field(min_length=1, max_length=2000, description="why, in one or two lines")
    evidence: list[str] = Field(
        default=[], description="the claims' citations the decision rests on (file:line or "
                                "lesson id); at least one for modify and drop")
    refused_on_this_gpu: bool = Field(
        False, description="true when the evidence shows the engine refuses the candidate's "
                           "value on this GPU architecture (a lesson is written)")
