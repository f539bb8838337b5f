"""Speculative decoding as SGLang 0.5.23 resolves it, and how many tokens a verify step yields.

Resolution follows ``python/sglang/srt/arg_groups/speculative_hook.py`` (servetune's sglang-knobs
reference, sections 1.10 and 2.6), in the engine's order:

1. ``handle_speculative_decoding``: ``NEXTN`` is an alias of ``EAGLE``. With
   ``--speculative-adaptive`` the adaptive check runs first (``_maybe_disable_adaptive``): a topk
   other than 1 switches adaptive off with the warning
   ``speculative_adaptive disabled: speculative_eagle_topk=K (only topk=1 is supported). Falling
   back to static speculative params.``; otherwise ``_init_adaptive_speculative_params`` sets
   topk 1, steps = the middle of the union of the candidate steps ([0, 1, 3, 5, 7] -> 3) when
   unset, refuses explicit steps outside that union, and forces draft tokens = steps + 1.
2. ``_handle_eagle_family``: ``max_running_requests`` unset -> 48 (warning ``Max running requests
   is reset to 48 for speculative decoding. ...``); with steps unset (and not adaptive) a bare
   ``assert`` requires topk and draft tokens unset too, then ``_auto_choose_speculative_params``
   gives (3, 1, 4) for DeepSeek/GLM-class (and most) models, (5, 4, 8) for Llama and Grok;
   ``trtllm_mha`` refuses topk > 1; topk == 1 forces draft tokens = steps + 1 (warning); and
   ``topk > 1`` with a page size above 1 is refused outside flashinfer/fa3/triton. Steps set with
   topk unset reaches ``None > 1`` there: a ``TypeError`` at startup.

Acceptance model. A chain draft (topk 1) of ``k`` tokens, each accepted with probability
``alpha`` given its predecessors were, yields ``(1 - alpha^(k+1)) / (1 - alpha)`` tokens per
verify step, the bonus token included (Leviathan, Kalman and Matias, "Fast Inference from
Transformers via Speculative Decoding", ICML 2023, eq. 1 with a constant acceptance rate).
``alpha`` comes per model family from ``domain/data/spec-acceptance.json``
(:func:`accept_rate`): for GLM-5 (``GlmMoeDsaForCausalLM``) it is solved from the 3.48 tokens
per verify step SGLang's GLM-5 cookbook measured with EAGLE (3, 1, 4) at concurrency 1
(alpha = 0.909); for DeepSeek-V3/V3.2 it is 0.85, the low end of the 85-90 % second-token
acceptance of the DeepSeek-V3 Technical Report (arXiv:2412.19437, sec. 5.4.3); other families
with an MTP head fall back to that 0.85. The same rate holds for every chained step and every
batch size: no source found shows acceptance falling with batch at a fixed draft shape (the
file's note).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scipy.optimize import brentq

from domain.errors import InvalidCombination

if TYPE_CHECKING:
    from domain.config import ServingConfig
    from domain.models import ModelArch

# DeepSeek-V3 Technical Report (arXiv:2412.19437) sec. 5.4.3: "the acceptance rate of the second
# token prediction ranges between 85% and 90%" -- per-draft-token acceptance of an MTP head; the
# fallback for a family without an entry in ACCEPTANCE_PATH.
MTP_ACCEPT_RATE = 0.85
ACCEPTANCE_PATH = Path(__file__).resolve().parent / "data" / "spec-acceptance.json"
# speculative_hook.py: the max_running_requests default once any speculative algorithm is on.
SPEC_MAX_RUNNING_REQUESTS = 48
MRR_RESET_WARNING = ("Max running requests is reset to 48 for speculative decoding. You can "
                     "override this by explicitly setting --max-running-requests.")
DRAFT_TOKENS_WARNING = ("speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 "
                        "when speculative_eagle_topk == 1")
# speculative_hook.py: backends that implement topk > 1 trees over paged KV.
PAGE_TREE_SPEC_BACKENDS = ("flashinfer", "fa3", "triton")
# adaptive_spec_params.py DEFAULT_ADAPTIVE_CONFIG (0.5.23): batch-size bucket (lower bound) ->
# (candidate steps, up_hysteresis, down_hysteresis). Slots share ema_alpha 0.2, warm-up 10
# batches and update_interval 5, which only shape the transient.
ADAPTIVE_BUCKETS: tuple[tuple[int, tuple[int, ...], float, float], ...] = (
    (1, (1, 3, 5, 7), 0.0, -0.25),
    (8, (0, 1, 3), 0.0, 0.0),
    (32, (0, 1), 0.0, 0.0),
    (64, (0,), 0.0, 0.0),
)
# resolve_candidate_steps_from_config: the union of every bucket's candidate steps.
ADAPTIVE_UNION: tuple[int, ...] = tuple(sorted({s for _, c, _, _ in ADAPTIVE_BUCKETS for s in c}))
_HOOK = "sglang/srt/arg_groups/speculative_hook.py"
# _auto_choose_speculative_params: architectures that default to (5, 4, 8); all others (3, 1, 4).
_WIDE_TREE_ARCHS = ("LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM")


@dataclass(frozen=True)
class SpecParams:
    """Speculative decoding as the engine runs it after resolution.

    Attributes:
        algorithm: resolved algorithm, ``EAGLE`` (also for ``NEXTN``) or ``EAGLE3``.
        num_steps: draft steps per verify (for adaptive: the starting depth, 3 by default).
        topk: draft branching factor per step (1 = a chain).
        draft_tokens: tokens verified per request and step (steps + 1 for a chain).
        adaptive: adaptive depth is on (it survived ``_maybe_disable_adaptive``).
        accept_rate: per-draft-token acceptance ``alpha`` of this model's draft head (0.0 when
            the checkpoint ships none: the server then fails to build its draft worker).
    """

    algorithm: str
    num_steps: int
    topk: int
    draft_tokens: int
    adaptive: bool
    accept_rate: float


@dataclass(frozen=True)
class SpecResolution:
    """``resolve_speculative`` plus the warning lines the engine logs while resolving."""

    params: SpecParams | None
    log: tuple[str, ...]


def hf_architecture(model: ModelArch) -> str:
    """The Hugging Face ``architectures[0]`` of ``model`` (what SGLang's hooks key on).

    Uses ``ModelArch.architecture`` when the catalog carries it, else infers it from the
    catalog name (``llama*`` -> LlamaForCausalLM; others do not change any rule modelled here).
    """
    arch: Any = getattr(model, "architecture", None)
    if isinstance(arch, str) and arch:
        return arch
    return "LlamaForCausalLM" if model.name.lower().startswith("llama") else model.name


def auto_params(model: ModelArch) -> tuple[int, int, int]:
    """``(num_steps, eagle_topk, num_draft_tokens)`` when all three are unset.

    Source: ``speculative_hook.py: _auto_choose_speculative_params`` -- (5, 4, 8) for Llama and
    Grok, (3, 1, 4) for DeepSeek, GLM, GPT-OSS, MiMo and every other architecture.
    """
    return (5, 4, 8) if hf_architecture(model) in _WIDE_TREE_ARCHS else (3, 1, 4)


def chain_rate(accept_len: float, steps: int) -> float:
    """Per-draft-token rate ``alpha`` of a chain of ``steps`` whose mean accept length is given.

    Solves ``sum_{i=0..steps} alpha^i = accept_len`` (the chain formula of
    :func:`accept_length`) with :func:`scipy.optimize.brentq` on [0, 1].

    Raises:
        ValueError: if ``accept_len`` is outside [1, steps + 1].
    """
    if not 1.0 <= accept_len <= steps + 1:
        raise ValueError(f"accept length {accept_len} is outside [1, {steps + 1}] for a "
                         f"{steps}-step chain")
    if accept_len >= steps + 1:
        return 1.0
    if accept_len <= 1.0:
        return 0.0
    return float(brentq(lambda a: sum(a ** i for i in range(steps + 1)) - accept_len, 0.0, 1.0))


@cache
def _acceptance(path: Path = ACCEPTANCE_PATH) -> dict[str, float]:
    """HF architecture -> per-draft-token acceptance rate, from ``spec-acceptance.json``."""
    data: dict[str, Any] = json.loads(path.read_text())
    rates: dict[str, float] = {}
    for fam in data["families"]:
        if "accept_rate" in fam:
            rate = float(fam["accept_rate"])
        else:
            rate = chain_rate(float(fam["accept_length"]), int(fam["steps"]))
        for arch in fam["architectures"]:
            rates[arch] = rate
    return rates


def accept_rate(model: ModelArch) -> float:
    """Per-draft-token acceptance ``alpha`` of ``model``'s MTP/NextN draft head.

    The family's entry in ``domain/data/spec-acceptance.json`` (keyed by
    :func:`hf_architecture`), else :data:`MTP_ACCEPT_RATE`. Constant in batch size (see the
    module docstring).
    """
    return _acceptance().get(hf_architecture(model), MTP_ACCEPT_RATE)


def resolve_speculative_logged(config: ServingConfig) -> SpecResolution:
    """Resolve the speculative fields of ``config`` like SGLang 0.5.23, with its warning lines.

    Returns:
        ``SpecResolution(None, ())`` when ``speculative_algorithm`` is unset.

    Raises:
        InvalidCombination: carrying the engine's exception and message for combinations the
            resolution pipeline refuses (the server exits before loading weights):
            ``AssertionError`` (bare) for a partial triple with steps unset; ``TypeError:
            '>' not supported between instances of 'NoneType' and 'int'`` for steps set and
            topk unset; ``ValueError: trtllm_mha backend only supports topk = 1 ...``;
            ``ValueError: speculative_eagle_topk > 1 with page_size > 1 is only supported on
            ...``; ``ValueError: --speculative-num-steps=N is not in the adaptive config
            candidate_steps [...]``; and, as the twin's stand-in for a later crash of the draft
            worker, ``TypeError`` for topk > 1 with draft tokens unset.
    """
    from domain.fit import resolve_attention_backend  # local: fit imports this module
    from domain.hardware import get_gpu
    from domain.models import get_model

    if config.speculative_algorithm is None:
        return SpecResolution(None, ())
    model, gpu = get_model(config.model), get_gpu(config.gpu)
    log: list[str] = []
    algorithm = "EAGLE3" if config.speculative_algorithm == "EAGLE3" else "EAGLE"
    steps = config.speculative_num_steps
    topk = config.speculative_eagle_topk
    draft = config.speculative_num_draft_tokens
    adaptive = config.speculative_adaptive
    if adaptive:  # handle_speculative_decoding, before the algorithm's own handler
        if topk is not None and topk != 1:
            log.append(f"speculative_adaptive disabled: speculative_eagle_topk={topk} (only "
                       "topk=1 is supported). Falling back to static speculative params.")
            adaptive = False
        else:
            topk = 1
            if steps is None:
                steps = ADAPTIVE_UNION[len(ADAPTIVE_UNION) // 2]
            if steps not in ADAPTIVE_UNION:
                raise InvalidCombination(
                    "ValueError", f"--speculative-num-steps={steps} is not in the adaptive "
                    f"config candidate_steps {list(ADAPTIVE_UNION)}. Pass one of those values.",
                    (_HOOK, "_init_adaptive_speculative_params"), "spec_adaptive_steps")
            draft = steps + 1
    if config.max_running_requests is None:  # _handle_eagle_family
        log.append(MRR_RESET_WARNING)
    if not adaptive and steps is None:
        if topk is not None or draft is not None:
            raise InvalidCombination("AssertionError", "", (_HOOK, "_handle_eagle_family"),
                                     "spec_partial_triple")
        steps, topk, draft = auto_params(model)
    assert steps is not None  # set by the adaptive init or the auto defaults above
    none_gt = "'>' not supported between instances of 'NoneType' and 'int'"
    backend, page_size = resolve_attention_backend(config, model, gpu)
    if backend == "trtllm_mha":
        if topk is None:
            raise InvalidCombination("TypeError", none_gt, (_HOOK, "_handle_eagle_family"),
                                     "spec_trtllm_mha_topk_none")
        if topk > 1:
            raise InvalidCombination(
                "ValueError", "trtllm_mha backend only supports topk = 1 for speculative "
                "decoding.", (_HOOK, "_handle_eagle_family"), "spec_trtllm_mha_topk")
    if topk == 1 and draft != steps + 1:
        log.append(DRAFT_TOKENS_WARNING)
        draft = steps + 1
    if topk is None:
        raise InvalidCombination("TypeError", none_gt, (_HOOK, "_handle_eagle_family"),
                                 "spec_topk_none")
    if topk > 1 and page_size > 1 and backend not in PAGE_TREE_SPEC_BACKENDS:
        raise InvalidCombination(
            "ValueError", f"speculative_eagle_topk > 1 with page_size > 1 is only supported on "
            f"{PAGE_TREE_SPEC_BACKENDS}; got attention_backend={backend!r}. Use page_size == 1 "
            "or one of those backends.", (_HOOK, "_handle_eagle_family"), "spec_page_tree")
    if draft is None:
        # The hook lets it pass; the EAGLE worker then does arithmetic on None while sizing its
        # buffers. The twin refuses it here, with that TypeError.
        raise InvalidCombination(
            "TypeError", "unsupported operand type(s) for *: 'int' and 'NoneType'",
            ("sglang/srt/speculative/eagle_worker_v2.py", "__init__"), "spec_draft_tokens_none")
    alpha = accept_rate(model) if model.mtp_layers else 0.0
    return SpecResolution(SpecParams(algorithm=algorithm, num_steps=steps, topk=topk,
                                     draft_tokens=draft, adaptive=adaptive, accept_rate=alpha),
                          tuple(log))


def resolve_speculative(config: ServingConfig) -> SpecParams | None:
    """The speculative parameters SGLang 0.5.23 runs ``config`` with; None when off.

    Raises:
        InvalidCombination: see :func:`resolve_speculative_logged`.
    """
    return resolve_speculative_logged(config).params


def spec_capture_sizes(max_bs: int) -> list[int]:
    """Decode CUDA-graph batch sizes captured with speculative decoding, up to ``max_bs``.

    Source: ``cuda_graph_hook.py: generate_decode_cuda_graph_batch_sizes`` (sglang-knobs
    reference 2.3): 1..8, even numbers to 32, step 4 to 64, step 8 to 256, step 16 beyond.
    """
    sizes = list(range(1, 9)) + list(range(10, 33, 2)) + list(range(36, 65, 4)) \
        + list(range(72, 257, 8)) + list(range(272, max(max_bs, 272) + 1, 16))
    return [s for s in sizes if s <= max_bs]


def _padded_batch(batch: int) -> int:
    """``AdaptiveSpeculativeParams._pad_to_cuda_graph_bs``: round up to a captured size.

    Padding only decides the bucket, and every size >= 64 lands in the last bucket, so the
    capture list up to 64 is enough.
    """
    for s in spec_capture_sizes(64):
        if s >= batch:
            return s
    return batch


def _bucket(batch: int) -> tuple[tuple[int, ...], float, float]:
    """Candidate steps and hysteresis of the slot serving ``batch`` (largest bound <= it)."""
    padded = _padded_batch(max(1, batch))
    chosen = ADAPTIVE_BUCKETS[0]
    for entry in ADAPTIVE_BUCKETS:
        if entry[0] <= padded:
            chosen = entry
    return chosen[1], chosen[2], chosen[3]


def expected_accepted_drafts(steps: int, alpha: float) -> float:
    """Expected accepted draft tokens of a ``steps``-long chain: sum of alpha^i, i = 1..steps."""
    return sum(alpha ** i for i in range(1, steps + 1))


def _recompute(cands: tuple[int, ...], up: float, down: float, cur: int, ema: float) -> int:
    """One ``AdaptiveStepSlot._recompute_params`` decision from ``cur`` at EMA ``ema``."""
    idx = cands.index(cur)
    if cur == 0:  # after a no-drafting interval the slot probes the next positive step
        return cands[min(idx + 1, len(cands) - 1)]
    start = idx
    while idx > 0:
        prev = cands[idx - 1]
        if ema <= (0.5 if prev == 0 else prev - 0.5) + down:
            idx -= 1
        else:
            break
    if idx == start:
        while idx < len(cands) - 1 and ema > cands[idx] - 0.5 + up:
            idx += 1
    return cands[idx]


def adaptive_steps(batch: int, alpha: float, initial_steps: int = 3) -> int:
    """Draft steps adaptive speculation settles on for ``batch`` at constant acceptance ``alpha``.

    Reading of ``adaptive_spec_params.py`` (``AdaptiveStepSlot``): each batch-size slot keeps an
    EMA of accepted drafts per request; every 5 batches (after 10 warm-up batches) it drops to the
    previous candidate ``p`` when ``ema <= p - 0.5 + down`` (``0.5 + down`` when ``p`` is 0), else
    rises past the current candidate ``c`` while ``ema > c - 0.5 + up``; at 0 steps it does not
    update the EMA and probes the next candidate. With a constant ``alpha`` the EMA at ``k``
    steps converges to ``sum alpha^i`` (i = 1..k), so the slot walks candidate to candidate
    until a step satisfies both thresholds; that step is returned. A slot that instead
    alternates between 0 and a probe (each every 5 batches) is reported at the lower step
    (drafting off). A slot starts at ``initial_steps`` if it is one of its candidates, else at
    its middle candidate.

    Args:
        batch: running requests in the decode batch.
        alpha: per-draft-token acceptance rate.
        initial_steps: ``speculative_num_steps`` after resolution (3 by default).
    """
    cands, up, down = _bucket(batch)
    cur = initial_steps if initial_steps in cands else cands[len(cands) // 2]
    seen: list[int] = []
    while cur not in seen:
        seen.append(cur)
        nxt = _recompute(cands, up, down, cur, expected_accepted_drafts(cur, alpha))
        if nxt == cur:
            return cur
        cur = nxt
    return min(seen[seen.index(cur):])


def steps_for_batch(params: SpecParams, batch: int) -> int:
    """Draft steps run at decode batch size ``batch``: adaptive's choice, else ``num_steps``."""
    if params.adaptive:
        return adaptive_steps(batch, params.accept_rate, params.num_steps)
    return params.num_steps


def draft_tokens_for_batch(params: SpecParams, batch: int) -> int:
    """Tokens verified per request at ``batch`` (adaptive: steps + 1; 1 = plain decode)."""
    if params.adaptive:
        return steps_for_batch(params, batch) + 1
    return params.draft_tokens


def accept_length(params: SpecParams, batch: int) -> float:
    """Expected tokens one verify step emits per request (accepted drafts + the bonus), >= 1.

    Chain (topk 1) of ``k = steps_for_batch(params, batch)`` steps: ``(1 - a^(k+1)) / (1 - a)``
    (Leviathan et al., ICML 2023), ``k + 1`` when ``a`` is 1.

    Tree (topk > 1), the twin's approximation: a level with all ``topk`` children drafted is
    passed with probability ``b = 1 - (1 - a)^topk`` (any of the independent candidates
    matches). The ``draft_tokens - 1`` drafted nodes pay for ``L = min(k, (draft_tokens - 1) //
    topk)`` such full levels; the remaining nodes extend the most likely path as a chain (each
    level passed with ``a``), up to depth ``D = min(k, L + draft_tokens - 1 - L x topk)``. The
    expected length is ``1 + sum_{i<=D} prod_{j<=i} p_j``, at most ``draft_tokens``.
    """
    a = params.accept_rate
    k = steps_for_batch(params, batch)
    if params.topk <= 1:
        if a >= 1.0:
            return float(k + 1)
        return (1 - a ** (k + 1)) / (1 - a)
    nodes = params.draft_tokens - 1
    full = min(k, nodes // params.topk)
    depth = min(k, full + nodes - full * params.topk)
    b = 1 - (1 - a) ** params.topk
    total, reach = 1.0, 1.0
    for level in range(1, depth + 1):
        reach *= b if level <= full else a
        total += reach
    return min(total, float(params.draft_tokens))
