"""SGLang's resolved settings: what the engine actually runs a config with.

Two configs whose resolved settings are equal differ only in flags SGLang resolves to the same
value; the planner launches only one of them (:meth:`agents.planner.Planner.screened`).
"""

from __future__ import annotations

from typing import Any

from domain.config import ServingConfig
from domain.engines.sglang.arch import resolved_backends
from domain.errors import ConfigInvalid, DoesNotFit, InvalidCombination
from domain.fit import fit, resolved_ep_size
from domain.speculative import resolve_speculative

# ServingConfig fields whose effect the engine resolves (a default, ``auto`` or a value clamped
# by the KV pool); :func:`resolved_settings` compares their resolved values, not the flags.
RESOLVED_FIELDS = ("attention_backend", "kv_cache_dtype", "mem_fraction_static",
                   "max_running_requests", "chunked_prefill_size", "cuda_graph_max_bs_decode",
                   "hicache_ratio", "schedule_conservativeness", "speculative_algorithm",
                   "speculative_num_steps", "speculative_eagle_topk",
                   "speculative_num_draft_tokens", "speculative_adaptive", "page_size",
                   "context_length", "moe_runner_backend",
                   # layouts (issue 21): an a2a backend sets ep_size = tp_size; unset
                   # backends/modes are the engine's none / auto / mooncake
                   "ep_size", "moe_a2a_backend", "deepep_mode",
                   "disaggregation_transfer_backend")


def resolved_settings(config: ServingConfig) -> tuple[Any, ...] | None:
    """What the engine actually runs ``config`` with, as a hashable signature; None if unknown.

    Two configs with equal signatures differ only in flags the engine resolves to the same
    value, e.g. ``--attention-backend fa3`` on a Hopper GPU where ``auto`` already picks fa3,
    ``--max-running-requests`` or ``--chunked-prefill-size`` equal to the defaults the engine
    derives, or ``--kv-cache-dtype`` equal to what ``auto`` resolves to. The resolved values are
    the memory-fit estimate's (:func:`domain.fit.fit`: backend and page size, KV dtype, static
    fraction, pool tokens, request slots, prefill chunk, decode graph batch, speculative
    parameters, HiCache host pool, context length), the MoE runner the GPU's SM rules pick
    (``domain/engines/sglang/arch.py``) and the resolved EP layout (an a2a backend's
    ``ep_size = tp_size``, :func:`domain.fit.resolved_ep_size`; an unset a2a backend, DeepEP
    mode or transfer backend is the engine's none / auto / mooncake); every other field is
    compared as given. None (never
    equal to anything) when the estimate rules the config out or the engine would refuse its
    speculative flags: such a config fails at startup however it is spelled, and the failure is
    the lesson.
    """
    try:
        rep = fit(config)
        spec = resolve_speculative(config)
    except (DoesNotFit, InvalidCombination, ConfigInvalid):
        return None
    raw = config.model_dump(mode="json", exclude=set(RESOLVED_FIELDS))
    return (tuple(sorted(raw.items())),
            rep.attention_backend, rep.page_size, rep.kv_dtype, rep.mem_fraction_static,
            rep.kv_tokens, rep.max_running_requests, rep.chunked_prefill_size,
            config.chunked_prefill_size == -1,  # no chunking is a mode, not a chunk size
            rep.cuda_graph_max_bs_decode, rep.host_kv_tokens, round(rep.hicache_ratio, 6),
            1.0 if config.schedule_conservativeness is None
            else config.schedule_conservativeness, repr(spec), rep.context_len,
            resolved_backends(config).get("moe_runner_backend", ""),
            resolved_ep_size(config), config.moe_a2a_backend or "none",
            config.deepep_mode or "auto", config.disaggregation_transfer_backend or "mooncake")
