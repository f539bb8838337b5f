"""The twin's startup refusals applied to every backend flag of a raw launch command.

The rules themselves are :func:`domain.engines.sglang.startup.attention_backend_refusal`'s
(called, not copied; each names its 0.5.23 site in ``refusals.py:REFUSALS``): SGLang 0.5.23
checks ``--attention-backend`` and, with the same kernels, the phase backends
``--prefill-attention-backend`` / ``--decode-attention-backend`` and the speculative draft's
``--speculative-draft-attention-backend``; ``--moe-runner-backend`` by
:func:`domain.engines.sglang.startup.moe_runner_refusal` (trtllm-gen MoE kernels: SM100 only).
"""

from __future__ import annotations

from typing import Any

from domain.config import ServingConfig

# argparse dests of the attention-backend flags (SGLang 0.5.23 flag inventory)
BACKEND_DESTS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend",
                 "speculative_draft_attention_backend")


def backend_refusals(config: ServingConfig, values: dict[str, Any]) -> list[tuple[str, str]]:
    """``(flag, engine message)`` for each attention-backend / MoE-runner flag the GPU refuses.

    ``values``: parsed flags (dest -> value); ``attention_backend`` is read from ``config``.
    """
    from domain.engines.sglang.refusals import REFUSALS
    from domain.engines.sglang.startup import (
        attention_backend_refusal,
        mm_backend_refusal,
        moe_runner_refusal,
        refusal_fields,
    )

    out = []
    fields = refusal_fields(config)
    for dest in BACKEND_DESTS:
        value = config.attention_backend if dest == "attention_backend" else values.get(dest)
        if not value:
            continue
        key = attention_backend_refusal(config.model_copy(update={"attention_backend": value}))
        if key is not None:
            out.append(("--" + dest.replace("_", "-"), f"--{dest.replace('_', '-')} {value}: "
                        + REFUSALS[key].text(**fields)))
    key = moe_runner_refusal(config)
    if key is not None:
        out.append(("--moe-runner-backend", REFUSALS[key].text(**fields)))
    if mm_backend_refusal(config) is not None:
        out.append(("--mm-attention-backend", "--mm-attention-backend fa3: "
                    + REFUSALS["mm_fa3_blackwell"].text()))
    return out
