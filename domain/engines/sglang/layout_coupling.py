"""SGLang 0.5.23's coupling of the parallel-layout arguments, as the knob catalog applies it.

A study sets layout knobs one at a time or together (:func:`domain.knobs.apply_knobs`); these
are the engine's rules that tie them, so a config the knobs build is one the engine would
resolve to itself (no silent rewrite at launch) and a combination the engine refuses is
refused before any launch with the engine's reason:

- :data:`A2A_EP_SPANNING_BACKENDS`: an all-to-all MoE backend among these makes the engine
  set ``ep_size = tp_size`` (``arg_groups/overrides.py:1578-1592`` the set,
  ``overrides.py:1611-1620 _a2a_ep_size`` the rewrite, called from
  ``arg_groups/moe_hook.py:293 handle_a2a_moe``); ``none`` and ``ascend_tp`` are not in it.
- :func:`layout_violations`: ``tp_size`` divisible by ``attn_dp_size``
  (``arg_groups/parallel_hook.py:326``, a bare assert in ``handle_data_parallelism``),
  ``--dp-size`` and ``--attn-dp-size`` never both above 1 (``parallel_hook.py:287-292``), and
  ``tp_size`` divisible by ``ep_size``
  (``model_executor/model_runner_components/moe_ep_setup.py:150-153``), each naming both
  values;
- :func:`config_refusals`: every other argument check of the engine's resolution that a layout
  trips (``--enable-eplb`` without EP, two-batch overlap without an a2a backend or attention
  DP, experts not splitting over EP, ``moe_dense_tp_size``, ...), as the twin's startup refuses
  them (:func:`domain.engines.sglang.layout_rules.layout_refusal`, :func:`tbo_refusal`,
  :func:`expert_refusal`), in the engine's words with their site.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from domain.config import ServingConfig

# arg_groups/overrides.py:1578-1592 (_A2A_EP_SPANNING_BACKENDS), SGLang 0.5.23
A2A_EP_SPANNING_BACKENDS = frozenset({
    "megamoe", "deepep", "deepep_v2", "mooncake", "nixl", "ascend_fuseep", "flashinfer",
    "flashinfer_megamoe", "mori", "pplx"})


def a2a_spans_ep(backend: str | None) -> bool:
    """Whether ``--moe-a2a-backend backend`` makes the engine set ``ep_size = tp_size``.

    None (the flag unset) is the engine's ``none``: no rewrite.
    """
    return backend in A2A_EP_SPANNING_BACKENDS


def layout_violations(tp_size: int, attn_dp_size: int, dp_size: int,
                      ep_size: int) -> list[str]:
    """The engine's refusals of one server's layout, in its words (empty: the engine takes it).

    Args:
        tp_size: ``--tp-size`` (GPUs of one TP group).
        attn_dp_size: ``--attn-dp-size``.
        dp_size: ``--dp-size`` (full data-parallel copies).
        ep_size: ``--ep-size`` after the a2a rewrite (:data:`A2A_EP_SPANNING_BACKENDS`).

    Returns:
        One line per broken rule, naming the values and the SGLang 0.5.23 site.
    """
    out: list[str] = []
    if tp_size % attn_dp_size:
        out.append(f"attn_dp_size {attn_dp_size} does not divide tp_size {tp_size}: the "
                   "engine asserts 'cfg.tp_size % cfg.attn_dp_size == 0' (SGLang 0.5.23 "
                   "arg_groups/parallel_hook.py:326)")
    if attn_dp_size > 1 and dp_size > 1:
        out.append(f"--dp-size {dp_size} with --attn-dp-size {attn_dp_size}: data-parallel "
                   "replicas combined with attention data parallelism are not supported "
                   "(SGLang 0.5.23 arg_groups/parallel_hook.py:288)")
    if tp_size % ep_size:
        out.append(f"ep_size {ep_size} does not divide tp_size {tp_size}: 'tp_size {tp_size} "
                   f"must be divisible by ep_size {ep_size}' (SGLang 0.5.23 model_executor/"
                   "model_runner_components/moe_ep_setup.py:150)")
    return out


def couple(fields: dict[str, int | str | None]) -> tuple[dict[str, int], list[str]]:
    """The engine's rewrite of one server's layout and its refusals of the result.

    Args:
        fields: ``tp_size``, ``attn_dp_size``, ``dp_size``, ``ep_size`` (ints) and
            ``moe_a2a_backend`` (str or None).

    Returns:
        ``(rewrites, violations)``: ``{"ep_size": tp_size}`` when the a2a backend spans
        expert parallelism (:func:`a2a_spans_ep`), else ``{}``; and
        :func:`layout_violations` of the rewritten layout.
    """
    tp, ep = int(fields["tp_size"] or 1), int(fields["ep_size"] or 1)
    rewrites = {"ep_size": tp} if a2a_spans_ep(
        str(fields["moe_a2a_backend"]) if fields["moe_a2a_backend"] else None) else {}
    ep = rewrites.get("ep_size", ep)
    return rewrites, layout_violations(tp, int(fields["attn_dp_size"] or 1),
                                       int(fields["dp_size"] or 1), ep)


# refusal keys (domain/engines/sglang/refusals.py) that layout_violations already names with
# both values
_NAMED = frozenset({"dp_with_attn_dp", "attn_dp_divides_tp"})


def config_refusals(config: ServingConfig) -> list[str]:
    """The engine's refusals of one server's layout beyond :func:`layout_violations`.

    Each line is ``Exception: message (SGLang 0.5.23 file:line function)``; a bare assert
    shows its source line. Empty when the engine resolves the layout.
    """
    from domain.engines.sglang.layout_rules import expert_refusal, layout_refusal, tbo_refusal
    from domain.engines.sglang.refusals import REFUSALS

    found: list[tuple[str, dict[str, object]]] = []
    lay = layout_refusal(config)
    if lay is not None:
        found.append(lay)
    for check in (tbo_refusal, expert_refusal):
        key = check(config)
        if key is not None:
            found.append((key, {}))
    out = []
    for key, fields in found:
        if key in _NAMED:
            continue
        r = REFUSALS[key]
        text = r.text(**fields) if r.message else f"{r.exception}: {r.code}"
        out.append(f"{text} (SGLang 0.5.23 {r.site} {r.function})")
    return out
