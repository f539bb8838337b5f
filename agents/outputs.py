"""Typed outputs of the research subagents (source researcher, memory researcher).

A finding carries only claims and their citations, never raw source excerpts or logs, so it can
travel in graph state.
"""

from __future__ import annotations

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
