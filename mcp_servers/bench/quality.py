"""Greedy outputs of a fixed prompt set: the real-endpoint half of the quality gate.

:func:`greedy_outputs` asks one OpenAI-compatible server for a non-streamed completion of each
prompt of :data:`PROMPTS` at temperature 0 (greedy, so two configs with the same numerics give
the same tokens) and returns the texts; :func:`domain.quality.compare_outputs` scores a
candidate's against a reference config's. The prompts are fixed (a mix of recall, arithmetic,
code and instruction following, short enough for any context length) so outputs of different
runs and configs stay comparable; their sha256 travels with the result.

A server that names itself simulated (the :data:`domain.quality.SIMULATED_HEADER` response
header, which ``servetune twin serve`` sends and SGLang never does) has no model outputs to
compare: the result is marked ``simulated`` with no outputs, after its first request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import httpx
from pydantic import BaseModel, Field

from domain.quality import SIMULATED_HEADER

PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "List the first ten prime numbers separated by commas:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Translate to German: The weather is nice today.",
    "Explain in one sentence why the sky is blue.",
    "12 multiplied by 13 equals",
    "Write a haiku about a GPU running out of memory.",
    "Q: What is the boiling point of water at sea level in Celsius?\nA:",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "SELECT name FROM users WHERE",
    "The three laws of thermodynamics are",
    "Continue the sequence: 2, 4, 8, 16,",
)
DEFAULT_MAX_TOKENS = 64  # tokens per greedy completion


class GreedyOutputs(BaseModel):
    """One server's greedy completions of a prompt set."""

    endpoint: str
    model: str
    prompts_sha: str = Field(description="sha256 (12 hex) of the prompt set, in order")
    max_tokens: int
    outputs: list[str] = Field(description="completion text per prompt, same order; empty "
                                           "when simulated")
    completion_tokens: list[int] = Field(description="the server's usage count per prompt")
    simulated: str | None = Field(None, description=(
        "what simulates the endpoint (e.g. 'twin': `servetune twin serve`, as --backend local "
        "runs without a GPU), from its x-servetune-simulated header; its outputs are not a "
        "model's, so none are returned and the quality gate is not applicable. Null for a "
        "real server."))


def prompts_sha(prompts: Sequence[str]) -> str:
    """sha256 (12 hex) of ``prompts`` in order."""
    return hashlib.sha256("\x00".join(prompts).encode()).hexdigest()[:12]


async def greedy_outputs(base_url: str, model: str, prompts: Sequence[str] = PROMPTS,
                         max_tokens: int = DEFAULT_MAX_TOKENS,
                         timeout_s: float = 120.0) -> GreedyOutputs:
    """Greedy (temperature 0, seed 0) completions of ``prompts`` from ``base_url``, one by one.

    Stops at the first response that carries the simulated header: the result then has
    ``simulated`` set and no outputs.

    Raises:
        httpx.HTTPError: a request failed (the caller turns it into a tool error).
    """
    outs, counts = [], []
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        for p in prompts:
            r = await client.post(base_url + "/v1/completions", json={
                "model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0,
                "top_p": 1.0, "seed": 0, "stream": False})
            simulated = r.headers.get(SIMULATED_HEADER)
            if simulated:
                return GreedyOutputs(endpoint=base_url, model=model,
                                     prompts_sha=prompts_sha(prompts), max_tokens=max_tokens,
                                     outputs=[], completion_tokens=[],
                                     simulated=simulated[:64])
            r.raise_for_status()
            body = r.json()
            outs.append(str(body["choices"][0].get("text") or ""))
            counts.append(int((body.get("usage") or {}).get("completion_tokens") or 0))
    return GreedyOutputs(endpoint=base_url, model=model, prompts_sha=prompts_sha(prompts),
                         max_tokens=max_tokens, outputs=outs, completion_tokens=counts)
