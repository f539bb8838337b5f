"""The quality gate: a winner that changes numerics must reproduce the reference's outputs.

What changes numerics relative to a reference config (:func:`numerics_changes`):

- the weights checkpoint (another quantization: ``fp8`` -> ``nvfp4`` ...);
- the KV cache dtype (``bf16`` -> ``fp8_e4m3`` ...; ``None`` is the engine's ``auto``, compared
  as written because ``auto`` resolves per model and GPU);
- lossy speculative decoding: SGLang's ``--speculative-accept-threshold-single/acc`` accept
  draft tokens the target would not have chosen. ServingConfig has no such field: the
  speculative bundles it can express (NEXTN/EAGLE with greedy verification) are lossless, so
  speculative decoding alone does not trigger the gate.

The check (on real endpoints only): greedy completions (temperature 0) of a fixed prompt set
from the candidate and from the reference, compared position by position as whitespace tokens
(:func:`token_match_rate`). On the twin there are no real outputs, and the gate says so
(``not-applicable``) instead of pretending; the same holds for an HTTP endpoint that identifies
itself as simulated (``servetune twin serve``, which ``--backend local`` starts without a GPU,
sends :data:`SIMULATED_HEADER` on every response).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, Field

from domain.config import ServingConfig

GateStatus = Literal["not-needed", "not-applicable", "pass", "fail"]
TWIN_NOT_APPLICABLE = "not applicable (twin: no real outputs)"
SIMULATED_NOT_APPLICABLE = "not applicable (simulated endpoint)"
# The response header by which a simulated server names itself (value: what simulates it, e.g.
# "twin"). servetune's own name: SGLang (or any other real server) never sends it.
SIMULATED_HEADER = "x-servetune-simulated"


class QualityGate(BaseModel):
    """The quality gate's decision on one config."""

    status: GateStatus
    reason: str
    changes: list[str] = Field(default_factory=list,
                               description="what changes numerics vs the reference")
    reference_config_id: str | None = None
    token_match_rate: float | None = Field(None, description="matched / compared positions")
    min_token_match: float | None = None
    prompts: int | None = None

    @property
    def blocks(self) -> bool:
        """True when the config may not be reported as the winner."""
        return self.status == "fail"


def numerics_changes(config: ServingConfig, reference: ServingConfig) -> list[str]:
    """What in ``config`` changes the numerics relative to ``reference`` (empty: nothing)."""
    out = []
    if config.weights != reference.weights:
        out.append(f"weights {reference.weights} -> {config.weights}")
    if config.kv_cache_dtype != reference.kv_cache_dtype:
        out.append(f"kv_cache_dtype {reference.kv_cache_dtype or 'auto'} -> "
                   f"{config.kv_cache_dtype or 'auto'}")
    return out


def token_match_rate(candidate: Sequence[str], reference: Sequence[str]) -> tuple[int, int]:
    """(matching positions, compared positions) of two greedy outputs, as whitespace tokens.

    Positions run up to the longer output, so a shorter output counts its missing tokens as
    mismatches.
    """
    n = max(len(candidate), len(reference))
    return sum(x == y for x, y in zip(candidate, reference, strict=False)), n


def compare_outputs(candidate: Sequence[str], reference: Sequence[str],
                    min_token_match: float) -> tuple[float, bool]:
    """Token match rate over a prompt set of greedy completions, and whether it passes.

    Args:
        candidate: one completion text per prompt from the candidate config.
        reference: the reference config's completions of the same prompts, same order.
        min_token_match: the study's ``validation.quality_min_token_match``.

    Raises:
        ValueError: the two lists differ in length or are empty.
    """
    if len(candidate) != len(reference) or not reference:
        raise ValueError("compare the same non-empty prompt set")
    hit = total = 0
    for c, r in zip(candidate, reference, strict=True):
        h, n = token_match_rate(c.split(), r.split())
        hit, total = hit + h, total + n
    rate = hit / total if total else 1.0
    return rate, rate >= min_token_match
