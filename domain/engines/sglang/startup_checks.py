"""The twin's startup refusals applied to every backend flag of a raw launch command.

The rules themselves are :func:`domain.engines.sglang.startup._backend_refusal`'s (called, not
copied): SGLang 0.5.23 checks ``--attention-backend`` and, with the same kernels, the phase
backends ``--prefill-attention-backend`` / ``--decode-attention-backend`` and the speculative
draft's ``--speculative-draft-attention-backend``.
"""

from __future__ import annotations

from typing import Any

from domain.config import ServingConfig
from domain.hardware import get_gpu
from domain.models import get_model

# argparse dests of the attention-backend flags (SGLang 0.5.23 flag inventory)
BACKEND_DESTS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend",
                 "speculative_draft_attention_backend")


def backend_refusals(config: ServingConfig, values: dict[str, Any]) -> list[tuple[str, str]]:
    """``(flag, engine message)`` for each attention-backend flag ``config``'s GPU refuses.

    ``values``: parsed flags (dest -> value); ``attention_backend`` is read from ``config``.
    """
    from domain.engines.sglang.startup import _backend_refusal

    sm, attention = get_gpu(config.gpu).sm_major, get_model(config.model).attention
    out = []
    for dest in BACKEND_DESTS:
        value = config.attention_backend if dest == "attention_backend" else values.get(dest)
        if not value:
            continue
        msg = _backend_refusal(config.model_copy(update={"attention_backend": value}), sm,
                               attention)
        if msg is not None:
            out.append(("--" + dest.replace("_", "-"), f"--{dest.replace('_', '-')} {value}: "
                        + msg))
    return out
