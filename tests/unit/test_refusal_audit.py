"""The twin's startup refusals, audited against the guards of the pinned SGLang 0.5.23 source.

Every row of ``domain/engines/sglang/refusals.py:REFUSALS`` names the engine statement it
reproduces (``file:line``). ``test_site_is_the_engine_statement`` proves each row against the
tree: that line holds the recorded code, in the recorded function, raising the recorded
exception with a message the twin's text matches. The other tests read each refusal's guard
from the tree (``fixtures/guards.py``: the ``if``/``assert`` conditions on the way to the
statement, parsed with ``ast`` and evaluated over bound values, never transcribed) and check it
over a grid of configs against the twin's verdict: the twin refuses with that site's traceback
exactly when the guard holds and no refusal the engine reaches earlier fired first. Facts the
twin does not model are bound explicitly and named in each test's docstring.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections import ChainMap
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from fixtures import guards
from fixtures.gpu_grid import GRID_GPUS, GRID_MODELS
from fixtures.pinned_source import pinned_tree  # noqa: F401

from domain.config import ServingConfig
from domain.engines import engine
from domain.engines.sglang.failures import classify
from domain.engines.sglang.refusals import (
    CUDA_GRAPH_CAPTURE_FAILED_LINES,
    REFUSAL_SITES,
    REFUSALS,
    TP_ATTENTION_CLASS,
    TRACE_ROOT,
)
from domain.fit import (
    CONTEXT_OVERHEAD_BYTES,
    KV_BYTES,
    resolve_attention_backend,
    resolve_kv_dtype,
    resolve_max_running_requests,
)
from domain.hardware import get_gpu
from domain.models import CATALOG, get_model
from domain.twin.startup import Startup, start

ORDER = list(REFUSALS)
_FRAME = re.compile(r'  File "' + re.escape(TRACE_ROOT) + r'(.+?)", line (\d+), in (\w+)$')
_BY_SITE = {site: key for key, site in REFUSAL_SITES.items()}


def twin_key(s: Startup) -> str | None:
    """The refusal key of a failed twin startup: its last traceback frame's site; None if up."""
    if s.ready:
        return None
    if s.phase == "parse":
        return "argparse"
    frames = [m for m in map(_FRAME.match, s.log) if m]
    assert frames, s.log[-4:]
    return _BY_SITE[f"{frames[-1].group(1)}:{frames[-1].group(2)}"]


def before(a: str | None, b: str) -> bool:
    """Refusal ``a`` is reached before ``b`` (REFUSALS is in the engine's order)."""
    return a is not None and ORDER.index(a) < ORDER.index(b)


def check(key: str, verdicts: Iterable[tuple[Any, bool, Startup]]) -> int:
    """Assert for each ``(label, guard holds, twin startup)``: the twin refuses with ``key``
    exactly when the guard holds, unless a refusal the engine reaches first refused.

    Returns:
        the number of grid points checked, and fails unless the guard held at one of them at
        least and failed at another.
    """
    n, held, free = 0, 0, 0
    for label, holds, s in verdicts:
        got = twin_key(s)
        n += 1
        if holds:
            held += 1
            assert got == key or before(got, key), (label, key, got, s.log[-3:])
        else:
            free += 1
            assert got != key, (label, key, s.log[-3:])
    assert held and free, (key, held, free)
    return n


def cfg(**kw: Any) -> ServingConfig:
    base: dict[str, Any] = dict(model="glm-5", gpu="B200", tp_size=8, replicas=1, weights="fp8")
    base.update(kw)
    return ServingConfig(**base)


def lightest(model: str) -> str:
    """The checkpoint with the fewest bytes (the one least likely to run out of memory)."""
    m = get_model(model)
    return min(m.checkpoints, key=m.weight_bytes)


def sm_majors(root: Path, probe: str) -> list[int]:
    """``device_capability_majors`` of an SM probe of ``utils/common.py``, read from its AST."""
    value = guards._module_value(guards.parse(root, "sglang/srt/utils/common.py"), probe)
    part = value.args[0] if isinstance(value, ast.Call) and value.args else value
    for kw in getattr(part, "keywords", []):
        if kw.arg == "device_capability_majors":
            return list(ast.literal_eval(kw.value))
    raise LookupError(probe)


def guard_of(root: Path, key: str) -> guards.Site:
    r = REFUSALS[key]
    return guards.site(root, r.file, r.line)


@cache
def flag_defaults() -> dict[str, Any]:
    """Every 0.5.23 flag at its default, by the names the hooks read it under (``cfg.X``,
    ``view.X``, ``server_args.X``): the flags a twin config leaves unset, from the pinned flag
    inventory (``domain/data/sglang-0.5.23-flags.json``, extracted from the same tree)."""
    inv = engine("sglang").flag_inventory()
    return {f"{p}.{dest}": entry["default"] for dest, entry in inv.items()
            for p in ("cfg", "view", "server_args")}


def holds(root: Path, key: str, env: dict[str, Any]) -> bool:
    """The guard of refusal ``key`` evaluated with ``env`` over the flag defaults."""
    s = guard_of(root, key)
    return bool(guards.evaluate(s.guard, ChainMap(env, flag_defaults()), s))


# ----------------------------------------------------------------------------- every site
@pytest.mark.parametrize("key", ORDER)
def test_site_is_the_engine_statement(pinned_tree, key):  # noqa: F811
    """The recorded line holds the recorded code in the recorded function; its exception and
    message template match the twin's (stand-ins and engine-external errors: the code only)."""
    r = REFUSALS[key]
    assert guards.source_line(pinned_tree, r.file, r.line) == r.code
    s = guard_of(pinned_tree, key)
    assert s.function.name == r.function
    if r.stand_in or key in ("argparse", "multi_node_device_ordinal", "oom_weights"):
        return  # not a raise of the engine's own (argparse, CUDA, torch) or no refusal at all
    if s.expr is not None:  # a comparison that raises TypeError on None
        assert r.exception == "TypeError" and isinstance(s.expr, ast.Compare)
        return
    exc, msg = guards.raised(s)
    assert exc == r.exception
    text = r.message
    if key == "graph_capture_oom":  # the {e} and CUDA_GRAPH_CAPTURE_FAILED_MSG fields
        text += "\n" + "\n".join(CUDA_GRAPH_CAPTURE_FAILED_LINES) + "\n"
        const = guards.module_literal(
            pinned_tree, "sglang/srt/model_executor/runner_backend_utils/__init__.py",
            "CUDA_GRAPH_CAPTURE_FAILED_MSG")
        assert const == "\n".join(CUDA_GRAPH_CAPTURE_FAILED_LINES) + "\n"
    sample = re.sub(r"\{[^}]*\}", "X", text)  # the twin's template with its fields filled
    assert re.fullmatch(guards.message_regex(msg, s), sample, re.DOTALL), (key, sample)


def test_every_refusal_site_is_distinct():
    assert len(set(REFUSAL_SITES.values())) == len(REFUSAL_SITES)


# ----------------------------------------------------------------------------- parse
def test_argparse_refuses_an_attention_backend_outside_the_source_choices(pinned_tree):  # noqa: F811
    """``--attention-backend`` takes ``choices=ATTENTION_BACKEND_CHOICES`` (fields/exec_.py),
    the list literal of ``arg_groups/choices.py``; argparse (``server_args.py:696``) exits 2 for
    any other value. Grid: every choice read from the tree and ten values outside it, on every
    GPU. (Plugins may extend the list at run time; the twin models none.)"""
    fields = guards.parse(pinned_tree, "sglang/srt/arg_groups/fields/exec_.py")
    assert "choices=ATTENTION_BACKEND_CHOICES" in ast.unparse(fields).replace(" ", "")
    choices = guards.module_literal(pinned_tree, "sglang/srt/arg_groups/choices.py",
                                    "ATTENTION_BACKEND_CHOICES")
    bogus = ["fa2", "flash", "FA3", "trtllm", "sdpa", "xformers", "mla", "", "none", "auto"]
    grid = [(v, g) for v in choices + bogus for g in GRID_GPUS]
    n = check("argparse", ((v, v not in choices,
                            start(ServingConfig.model_construct(**{
                                **cfg(gpu=g).model_dump(), "attention_backend": v})))
                           for v, g in grid))
    assert n == len(grid)
    s = start(ServingConfig.model_construct(**{**cfg().model_dump(), "attention_backend": "fa2"}))
    assert s.log[-1].startswith("sglang serve: error: argument --attention-backend: invalid "
                                "choice: 'fa2' (choose from '")
    assert (s.exit_code, classify(s.log)[0]) == (2, "BAD_FLAG")


# ----------------------------------------------------------------------------- resolve
def test_hicache_with_radix_disabled(pinned_tree):  # noqa: F811
    """``kv_cache_hook.py:394``: ``enable_hierarchical_cache and disable_radix_cache``.
    Grid: both flags x the grid's models x GPUs (tests/fixtures/gpu_grid.py)."""
    grid = itertools.product([False, True], [False, True], GRID_MODELS, GRID_GPUS)
    n = check("hicache_without_radix", (
        ((h, d, m, g), holds(pinned_tree, "hicache_without_radix",
                             {"cfg.enable_hierarchical_cache": h, "cfg.disable_radix_cache": d}),
         start(cfg(model=m, gpu=g, weights=lightest(m), enable_hierarchical_cache=h,
                   disable_radix_cache=d)))
        for h, d, m, g in grid))
    assert n == 4 * len(GRID_MODELS) * len(GRID_GPUS)


def test_schedule_conservativeness_must_be_non_negative(pinned_tree):  # noqa: F811
    """``validation_hook.py:314`` asserts ``cfg.schedule_conservativeness >= 0``. Grid: nine
    values around 0 x three models. (Unset, the engine's default is 1.0: bound here.)"""
    values = [None, -5.0, -1.0, -0.1, -1e-9, 0.0, 0.3, 1.0, 2.5]
    grid = list(itertools.product(values, ["glm-5", "llama-3.1-8b", "qwen3-235b-a22b"]))
    check("schedule_conservativeness", (
        ((v, m), holds(pinned_tree, "schedule_conservativeness",
                       {"cfg.schedule_conservativeness": 1.0 if v is None else v}),
         start(cfg(model=m, weights=lightest(m), schedule_conservativeness=v)))
        for v, m in grid))


# speculative: the hook's state at each site, resolved the way the hook resolves it
SPEC_KEYS = ["spec_adaptive_steps", "spec_partial_triple", "spec_trtllm_mha_topk_none",
             "spec_trtllm_mha_topk", "spec_topk_none", "spec_page_tree"]
SPEC_MODELS = ["glm-5", "deepseek-v3", "qwen3-235b-a22b", "llama-3.1-8b"]
SPEC_BACKENDS = [None, "trtllm_mha", "flashinfer", "fa3", "triton", "trtllm_mla", "flashmla"]
_HOOK = "sglang/srt/arg_groups/speculative_hook.py"
_ADAPTIVE = "sglang/srt/speculative/adaptive_spec_params.py"


def _spec_walk(root: Path, c: ServingConfig) -> tuple[str | None, dict[str, Any]]:
    """The first speculative refusal the hook's guards reach for ``c`` (None: none), and the
    hook's state (source text -> value) where it stopped.

    The values each guard reads are the hook's state at that line: the adaptive candidates
    (``DEFAULT_ADAPTIVE_CONFIG``, read from the tree), its disable rule
    (``adaptive_unsupported_reason``'s topk branch, evaluated from the tree; attention DP,
    multi-layer EAGLE and platform workers are not modelled: bound False/None), the auto
    triple (``_auto_choose_speculative_params``, evaluated from the tree on the model's HF
    architecture), the draft-token fix-up of line 1262 (evaluated), and the attention backend
    and page size the twin resolves (``overrides.py``'s auto-selection is the twin's,
    ``domain/fit.py:resolve_attention_backend``; prefill/decode backends are not separate).
    """
    model, gpu = get_model(c.model), get_gpu(c.gpu)
    backend, page = resolve_attention_backend(c, model, gpu)
    steps, topk, draft = c.speculative_num_steps, c.speculative_eagle_topk, \
        c.speculative_num_draft_tokens
    algo = "EAGLE" if c.speculative_algorithm in ("EAGLE", "NEXTN") else c.speculative_algorithm
    adaptive = c.speculative_adaptive
    base = ChainMap({"cfg.speculative_algorithm": algo}, flag_defaults())
    if adaptive:
        reason = guards.site(root, _ADAPTIVE, 75)  # the topk branch of the disable rule
        assert "speculative_eagle_topk" in ast.unparse(reason.stmt)
        if guards.evaluate(reason.stmt.test, ChainMap({"cfg.speculative_eagle_topk": topk}, base),
                           reason):
            adaptive = False
    if adaptive:
        table = guards.module_literal(root, _ADAPTIVE, "DEFAULT_ADAPTIVE_CONFIG")
        cands = sorted({s for e in table.values() for s in e["candidate_steps"]})
        topk = 1 if topk is None else topk
        steps = cands[len(cands) // 2] if steps is None else steps
        if holds(root, "spec_adaptive_steps", {"cfg.speculative_num_steps": steps,
                                               "candidate_steps": cands}):
            return "spec_adaptive_steps", {}
        draft = steps + 1
    env = {"cfg.speculative_adaptive": adaptive, "cfg.speculative_num_steps": steps,
           "cfg.speculative_eagle_topk": topk, "cfg.speculative_num_draft_tokens": draft}
    if holds(root, "spec_partial_triple", env):
        return "spec_partial_triple", env
    if not adaptive and steps is None:
        steps, topk, draft = guards.returned(
            root, _HOOK, "_auto_choose_speculative_params",
            ChainMap({"model_arch": model.architecture}, base))
    env = {"cfg.speculative_num_steps": steps, "cfg.speculative_eagle_topk": topk,
           "cfg.speculative_num_draft_tokens": draft,
           "attention_backends_of(resolved_view(server_args))": (backend, backend),
           "view.page_size": page, "view.attention_backend": backend}
    trt = guard_of(root, "spec_trtllm_mha_topk_none")
    if guards.evaluate(trt.guard, ChainMap(env, base), trt):
        try:
            guards.evaluate(trt.expr, ChainMap(env, base), trt)
        except TypeError:
            return "spec_trtllm_mha_topk_none", env
        if holds(root, "spec_trtllm_mha_topk", env):
            return "spec_trtllm_mha_topk", env
    fix = _draft_fixup(root)  # topk == 1 forces draft = steps + 1
    if guards.evaluate(fix.stmt.test, ChainMap(env, base), fix):  # steps is set by now: no None + 1
        env["cfg.speculative_num_draft_tokens"] = steps + 1
    cmp = guard_of(root, "spec_topk_none")
    try:
        guards.evaluate(cmp.expr, ChainMap(env, base), cmp)
    except TypeError:
        return "spec_topk_none", env
    if holds(root, "spec_page_tree", env):
        return "spec_page_tree", env
    return None, env


@cache
def _draft_fixup(root: Path) -> guards.Site:
    """The ``if`` of ``_handle_eagle_family`` that forces draft tokens to steps + 1 (topk 1)."""
    fn = guards.function(root, _HOOK, "_handle_eagle_family")
    hit = [n for n in ast.walk(fn) if isinstance(n, ast.If) and "speculative_num_draft_tokens "
           "!= cfg.speculative_num_steps + 1" in ast.unparse(n.test)]
    assert len(hit) == 1
    return guards.site(root, _HOOK, hit[0].lineno)


@cache
def _spec_grid() -> list[ServingConfig]:
    out = []
    for m, g, b, steps, topk, draft, adaptive in itertools.product(
            SPEC_MODELS, ["B200", "H200"], SPEC_BACKENDS, [None, 1, 2, 3], [None, 1, 2, 4],
            [None, 2, 4, 8], [False, True]):
        out.append(cfg(model=m, gpu=g, weights=lightest(m), attention_backend=b,
                       speculative_algorithm="NEXTN", speculative_num_steps=steps,
                       speculative_eagle_topk=topk, speculative_num_draft_tokens=draft,
                       speculative_adaptive=adaptive))
    return out


@cache
def _spec_results(root: Path) -> list[tuple[dict[str, Any], str | None, dict[str, Any], Startup]]:
    """Per grid config: its fields, the hook's first refusal and state, the twin's startup."""
    out = []
    for c in _spec_grid():
        stopped, state = _spec_walk(root, c)
        out.append((c.model_dump(exclude_defaults=True), stopped, state, start(c)))
    return out


@pytest.mark.parametrize("key", SPEC_KEYS)
def test_speculative_refusal(pinned_tree, key):  # noqa: F811
    """Each speculative refusal of ``speculative_hook.py`` (lines 1160, 1177, 1178, 1274, 1278,
    1417), its guard evaluated at the hook's state (:func:`_spec_walk`). Grid: 4 models x 2 GPUs
    x 7 attention backends x steps {unset, 1, 2, 3} x topk {unset, 1, 2, 4} x draft tokens
    {unset, 2, 4, 8} x adaptive on/off = 7,168 configs."""
    rows = _spec_results(pinned_tree)
    n = check(key, ((label, stopped == key, s) for label, stopped, _, s in rows))
    assert n == 7168


def test_draft_tokens_unset_is_the_twins_stand_in(pinned_tree):  # noqa: F811
    """0.5.23's hook has no refusal for topk > 1 with ``--speculative-num-draft-tokens`` unset:
    no raise or assert on the EAGLE/NEXTN path of ``speculative_hook.py`` whose guard can be
    evaluated holds for steps 3, topk 2, draft unset on flashinfer (page 1). The twin refuses
    such configs (``REFUSALS['spec_draft_tokens_none'].stand_in``) exactly when the hook's own
    guards let them through with draft tokens still unset."""
    eagle = ("handle_speculative_decoding", "_handle_eagle_family", "_maybe_disable_adaptive",
             "_init_adaptive_speculative_params")  # the EAGLE/NEXTN path through the hook
    env = {**flag_defaults(), "cfg.speculative_algorithm": "EAGLE",
           "cfg.speculative_num_steps": 3, "cfg.speculative_eagle_topk": 2,
           "cfg.speculative_num_draft_tokens": None, "view.page_size": 1,
           "view.attention_backend": "flashinfer",
           "attention_backends_of(resolved_view(server_args))": ("flashinfer", "flashinfer")}
    evaluated = 0
    for n in (n for f in eagle for n in ast.walk(guards.function(pinned_tree, _HOOK, f))):
        if isinstance(n, (ast.Raise, ast.Assert)):
            s = guards.site(pinned_tree, _HOOK, n.lineno)
            try:
                fired = guards.evaluate(s.guard, env, s)
            except (guards.Unbound, TypeError, KeyError):
                continue  # reads a platform or model fact: not a draft-token check
            evaluated += 1
            assert not fired, n.lineno
    assert evaluated >= 5
    rows = [(label, stopped is None and state.get("cfg.speculative_num_draft_tokens") is None, s)
            for label, stopped, state, s in _spec_results(pinned_tree)]
    check("spec_draft_tokens_none", rows)


def test_mla_backends_off_their_gpus(pinned_tree, with_sm80):  # noqa: F811
    """``overrides.py:1211`` (trtllm_mla needs ``get_platform().is_blackwell``) and ``:1245``
    (cutedsl_mla needs ``is_sm100``), post-process passes of argument resolution. The probes'
    SM majors are read from ``utils/common.py``; ``decode_attention_backend`` and
    ``prefill_attention_backend`` are not modelled (unset: bound None). Grid: 9 backends x 4
    GPUs of the grid (SM 8.0 to 12.0) x the grid's models, both refusals."""
    blackwell = sm_majors(pinned_tree, "is_blackwell_supported")
    sm100 = sm_majors(pinned_tree, "is_sm100_supported")
    for key in ("backend_trtllm_mla_sm", "backend_cutedsl_sm"):
        rows = []
        for b, g, m in itertools.product(SPEC_BACKENDS + ["cutedsl_mla", "fa4"], with_sm80,
                                         GRID_MODELS):
            c = cfg(model=m, gpu=g, weights=lightest(m), attention_backend=b)
            backend = resolve_attention_backend(c, get_model(m), get_gpu(g))[0]
            sm = get_gpu(g).sm_major
            env = {"view.attention_backend": backend, "view.decode_attention_backend": None,
                   "view.prefill_attention_backend": None,
                   "get_platform().is_blackwell": sm in blackwell,
                   "get_platform().is_sm100": sm in sm100}
            rows.append(((b, g, m), holds(pinned_tree, key, env), start(c)))
        check(key, rows)


# ----------------------------------------------------------------------------- init_distributed
def test_multi_node_device_ordinal(pinned_tree):  # noqa: F811
    """Rank ``tp_rank`` of a one-node launch runs on ``gpu_id`` (``entrypoints/engine.py:935``,
    its expression evaluated from the tree with ``_calculate_rank_ranges``' assignments:
    ``nnodes`` 1, ``pp_size`` 1, ``base_gpu_id`` 0, ``gpu_id_step`` 1, the servetune defaults).
    CUDA refuses an ordinal at or above the node's GPU count -- a device fact, bound from the
    GPU catalog. Grid: tp_size 1..16 x the grid's GPUs x 2 models, launched with ``--nnodes 1``
    (a pasted command without ``--nnodes``; a config's own argv adds ``--nnodes`` when it spans
    nodes, test_layout_refusals.py)."""
    rel = "sglang/srt/entrypoints/engine.py"
    ranges = guards.function(pinned_tree, rel, "_calculate_rank_ranges")
    s = guard_of(pinned_tree, "multi_node_device_ordinal")
    assert isinstance(s.stmt, ast.Assign)
    rows = []
    for tp, g, m in itertools.product(range(1, 17), GRID_GPUS, ["glm-5", "llama-3.1-8b"]):
        env: dict[str, Any] = {"parallel.nnodes": 1, "parallel.pp_size": 1,
                               "parallel.tp_size": tp, "node_rank": 0}
        for st in ranges.body:  # the function's straight-line assignments, in order
            if isinstance(st, ast.Assign) and isinstance(st.targets[0], ast.Name) \
                    and st.targets[0].id != "parallel":  # get_parallel(): bound by attribute
                env[st.targets[0].id] = guards.evaluate(st.value, env)
        worst = max(guards.evaluate(s.stmt.value, {
            "get_device().base_gpu_id": 0, "get_device().gpu_id_step": 1, "pp_rank": 0,
            "tp_rank": rank, "pp_size_per_node": env["pp_size_per_node"],
            "tp_size_per_node": env["tp_size_per_node"]}) for rank in env["tp_rank_range"])
        invalid = worst >= get_gpu(g).gpus_per_node
        c = ServingConfig.model_construct(**{**cfg(model=m, gpu=g, weights=lightest(m),
                                                   tp_size=1).model_dump(), "tp_size": tp})
        rows.append(((tp, g, m), invalid, engine("sglang").start(c, nnodes=1)))
    check("multi_node_device_ordinal", rows)


# ----------------------------------------------------------------------------- model_init
@pytest.fixture
def synthetic_heads(monkeypatch):
    """Catalog models plus, per GQA attention class, two synthetic copies of its first catalog
    model: 48 query heads with 12 KV heads and with 3 (no catalog model reaches the KV asserts
    on one node: 8 or 4 KV heads split or replicate at every TP that splits the query heads)."""
    import domain.models as dm

    real = dm.load_model
    extra: dict[str, Any] = {}
    for m in CATALOG:
        arch = real(m)
        if arch.attention != "gqa" or any(e.architecture == arch.architecture
                                          for e in extra.values()):
            continue
        for kv in (12, 3):
            extra[f"{m}-48h-{kv}kv"] = arch.model_copy(update={"name": f"{m}-48h-{kv}kv",
                                                               "heads": 48, "kv_heads": kv})
    monkeypatch.setattr(dm, "load_model", lambda name: extra[name] if name in extra
                        else real(name))
    for name in extra:
        monkeypatch.setitem(dm.MODELS, name, lambda n=name: extra[n])
    return list(CATALOG) + list(extra)


@pytest.mark.parametrize("key", [k for k in ORDER if k.startswith("tp_")])
def test_tensor_parallel_attention_asserts(pinned_tree, key, synthetic_heads):  # noqa: F811
    """The attention layer's asserts (``llama.py:183/189/193``, ``qwen3.py:166/172/176``,
    ``qwen3_moe.py:506/512/516``, ``deepseek_v2.py:2057``), their ``if total_num_kv_heads >=
    tp_size`` branch included, evaluated with the model's config.json heads. ``attn_tp_size``
    is ``tp_size`` (no attention DP or context parallelism in the twin). Grid: tp_size 1..8 x
    every catalog model with this attention class (and its synthetic 48-head copies with 12
    and 3 KV heads) x the grid's GPUs. Qwen3-235B-A22B (4 KV heads) at TP8: 8 % 4 == 0,
    replicated -- it starts."""
    cls = key.split(".", 1)[1]
    models = [m for m in synthetic_heads
              if TP_ATTENTION_CLASS[get_model(m).architecture] == cls]
    assert models
    rows = []
    for tp, m, g in itertools.product(range(1, 9), models, GRID_GPUS):
        model = get_model(m)
        env = {"self.total_num_heads": model.heads, "num_heads": model.heads,
               "self.total_num_kv_heads": model.kv_heads, "tp_size": tp, "attn_tp_size": tp,
               "self.attn_tp_size": tp, "self.kv_tp_size": tp}
        rows.append(((tp, m, g), holds(pinned_tree, key, env),
                     start(cfg(model=m, gpu=g, weights=lightest(m), tp_size=tp))))
    check(key, rows)


def _never(key: str, rows: list[tuple[Any, bool, Startup]]) -> None:
    """A guard no catalog model trips on one node (e.g. 8 KV heads at TP <= 8): the twin never
    refuses with it either."""
    assert all(twin_key(s) != key for _, _, s in rows), key


def test_qwen3_235b_tp8_fp8_starts_with_replicated_kv_heads():
    """The issue's case: Qwen3-235B-A22B FP8 TP8 on 8x H200 and 8x B200 starts; each GPU holds
    max(1, 4 // 8) = 1 KV head, so a token costs 94 layers x (K, V) x 128 x 2 B per GPU."""
    for g in ("H200", "B200"):
        s = start(cfg(model="qwen3-235b-a22b", gpu=g, weights="fp8", tp_size=8))
        assert s.ready, s.log[-4:]
        assert s.fit is not None and s.fit.kv_bytes_per_token == 94 * 2 * 1 * 128 * 2
        # TP4 still holds 1 head per GPU (4 // 4), TP2 holds 2: twice the bytes per token
        for tp, heads in ((4, 1), (2, 2)):
            st = start(cfg(model="qwen3-235b-a22b", gpu=g, weights="fp8", tp_size=tp))
            assert st.fit is not None
            assert st.fit.kv_bytes_per_token == heads * s.fit.kv_bytes_per_token


@pytest.fixture
def with_sm80():
    """The grid's catalog GPUs (tests/fixtures/gpu_grid.py): one per compute capability the
    catalog holds -- SM 8.0 (A100), 8.6 (A10G), 8.9 (L40S), 9.0, 10.0, 10.3 (B300) and 12.0
    (RTX PRO 6000) -- where fa3's, trtllm_mha's and the MoE runners' rules differ."""
    return list(GRID_GPUS)


@pytest.mark.parametrize("key", ["backend_fa3_sm", "backend_trtllm_mla_model",
                                 "backend_cutedsl_model", "backend_trtllm_mha_model"])
def test_attention_backend_refusals(pinned_tree, key, with_sm80):  # noqa: F811
    """``attention_registry.py:243`` (fa3: ``(major == 8 and not use_mla) or major == 9``,
    under ``not _is_musa``), ``:97``/``:121`` (trtllm_mla/cutedsl_mla need an MLA model),
    ``:280`` (trtllm_mha a non-MLA one). ``runner.use_mla_backend`` is the model's attention
    (MLA or DSA), ``get_device_capability()`` the GPU's (major, minor); MUSA is off. Grid: 9
    backends x the grid's GPUs (SM 8.0 to 12.0) x the grid's models."""
    rows = []
    for b, g, m in itertools.product(SPEC_BACKENDS + ["cutedsl_mla", "fa4"], with_sm80,
                                     GRID_MODELS):
        model, gpu = get_model(m), get_gpu(g)
        c = cfg(model=m, gpu=g, weights=lightest(m), attention_backend=b)
        backend = resolve_attention_backend(c, model, gpu)[0]
        s = guard_of(pinned_tree, key)  # @register_attention_backend("<name>") names it
        built = ast.literal_eval(s.function.decorator_list[0].args[0])
        env = {"runner.use_mla_backend": model.attention != "gqa", "is_musa()": False,
               "get_device_capability()": (gpu.sm_major, gpu.sm_minor)}
        rows.append(((b, g, m), backend == built and holds(pinned_tree, key, env), start(c)))
    check(key, rows)


def test_trtllm_mha_off_its_kernels_is_the_twins_stand_in(pinned_tree, with_sm80):  # noqa: F811
    """trtllm_mha has kernels for SM90/SM120 (XQA and fmha_v2: ``is_xqa_impl`` at
    ``trtllm_mha_backend.py:258``, read from the tree: ``is_sm90 or is_sm120``) and SM100
    (trtllm-gen, the other branch; majors of the probes from ``utils/common.py``). No 0.5.23
    statement refuses it elsewhere: the twin's stand-in refuses a GQA model on any other SM
    (after ``attention_registry.py:280`` has refused MLA models). Grid: 4 backends x the grid's
    GPUs x models."""
    s = guard_of(pinned_tree, "backend_trtllm_mha_sm")
    assert ast.unparse(s.stmt.value) == "get_platform().is_sm90 or get_platform().is_sm120"
    kernels = {*sm_majors(pinned_tree, "is_sm90_supported"),
               *sm_majors(pinned_tree, "is_sm120_supported"),
               *sm_majors(pinned_tree, "is_sm100_supported")}
    assert kernels == {9, 10, 12}
    rows = []
    for b, g, m in itertools.product([None, "trtllm_mha", "flashinfer", "triton"], with_sm80,
                                     GRID_MODELS):
        model, gpu = get_model(m), get_gpu(g)
        c = cfg(model=m, gpu=g, weights=lightest(m), attention_backend=b)
        backend = resolve_attention_backend(c, model, gpu)[0]
        refused = backend == "trtllm_mha" and model.attention == "gqa" \
            and gpu.sm_major not in kernels
        rows.append(((b, g, m), refused, start(c)))
    check("backend_trtllm_mha_sm", rows)


def test_trtllm_gen_moe_runner_off_sm100_is_the_twins_stand_in(pinned_tree, with_sm80):  # noqa: F811,E501
    """The MoE runners on trtllm-gen kernels (``flashinfer_trtllm``, ``..._routed``,
    ``experimental_sgl_trtllm``) run on ``is_sm100`` GPUs only: the ``if`` at
    ``overrides.py:1513`` moves NVFP4 MoE off them on ``is_sm120 or is_sm110`` and logs why
    ("trtllm-gen MoE kernels are SM100-only", read from the tree). 0.5.23 has no refusing
    statement for an explicit one: the twin's stand-in refuses it on a MoE model off SM 10;
    dense models build no MoE runner. Grid: 5 runners x the grid's GPUs x models."""
    s = guard_of(pinned_tree, "moe_trtllm_gen_sm")
    assert "get_platform().is_sm120 or get_platform().is_sm110" in ast.unparse(s.stmt.test)
    said = " ".join(str(n.value) for n in ast.walk(s.stmt) if isinstance(n, ast.Constant))
    assert "trtllm-gen MoE kernels are SM100-only" in said
    sm100 = sm_majors(pinned_tree, "is_sm100_supported")
    trtllm_gen = ("flashinfer_trtllm", "flashinfer_trtllm_routed", "experimental_sgl_trtllm")
    rows = []
    for r, g, m in itertools.product([None, "auto", "flashinfer_cutlass", *trtllm_gen],
                                     with_sm80, GRID_MODELS):
        model, gpu = get_model(m), get_gpu(g)
        c = cfg(model=m, gpu=g, weights=lightest(m), moe_runner_backend=r)
        refused = r in trtllm_gen and model.n_routed_experts > 0 and gpu.sm_major not in sm100
        rows.append(((r, g, m), refused, start(c)))
    check("moe_trtllm_gen_sm", rows)
    hit = next(st for (r, g, m), refused, st in rows if refused)
    assert classify(hit.log)[0] == "UNSUPPORTED_BACKEND"


def test_context_length_above_the_models(pinned_tree):  # noqa: F811
    """``configs/model_config.py:1314``: ``context_length is not None and context_length >
    derived_context_len`` unless ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN`` (or CI) --
    environment the twin does not set (bound False). ``derived_context_len`` is the model's
    ``max_position_embeddings`` (the twin's ``context_len``). Grid: 7 context lengths around
    each model's x 7 models."""
    rows = []
    for m in GRID_MODELS:
        derived = get_model(m).context_len
        for v in (None, 2, 4096, derived - 1, derived, derived + 1, 2 * derived):
            env = {"context_length": v, "derived_context_len": derived, "is_in_ci()": False,
                   "envs.SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN.get()": False}
            rows.append(((m, v), holds(pinned_tree, "context_length_too_long", env),
                         start(cfg(model=m, weights=lightest(m), context_length=v))))
    check("context_length_too_long", rows)
    hit = next(st for _, h, st in rows if h)
    assert classify(hit.log)[0] == "INVALID_COMBINATION"


# Architectures whose model override picks the attention backend by facts the twin does not
# model (the Mamba radix-cache strategy, model_overrides/qwen3_5.py:17-50; speculation on
# Blackwell, nemotron_h.py:123-148): the twin applies the general rule to them, unaudited.
UNMODELLED_ATTENTION_OVERRIDES = ("Qwen3NextForCausalLM", "Qwen3_5MoeForConditionalGeneration",
                                  "Qwen3_5ForConditionalGeneration", "NemotronHForCausalLM")


def test_auto_attention_backend_is_the_sources(pinned_tree, with_sm80):  # noqa: F811
    """The twin's auto-selection (``--attention-backend`` unset) equals what 0.5.23's code
    returns, evaluated from the tree: ``get_default_attn_backend``
    (``arg_groups/model_override_base.py:277``, with ``is_no_spec_infer_or_topk_one`` of
    ``utils/common.py``) for every model the DeepSeek-family override leaves unset, and the
    override's own assignments (``model_overrides/deepseek_v2.py:103``: DSA -> ``dsa``;
    ``:185``: DeepSeek-V3 on ``is_sm100`` -> ``trtllm_mla``), and gpt-oss's
    (``model_overrides/gpt_oss.py:31/33/44``); the hybrid models of
    :data:`UNMODELLED_ATTENTION_OVERRIDES` are left out. Bound: CUDA (not HIP, MPS or an
    out-of-tree platform), FlashInfer installed, no attention sinks and no Whisper in the
    catalog, K and V head dims from the model (asymmetric when ``qk_head_dim != head_dim``),
    the platform probes' majors read from
    ``utils/common.py``. Grid: 7 models x 7 GPUs x 4 speculative settings x page size
    {unset, 16}."""
    rel = "sglang/srt/arg_groups/model_override_base.py"
    hopper = sm_majors(pinned_tree, "is_hopper_with_cuda_12_3")
    sm100 = sm_majors(pinned_tree, "is_sm100_supported")
    ds = "sglang/srt/arg_groups/model_overrides/deepseek_v2.py"
    dsa_site, v3_site = guards.site(pinned_tree, ds, 103), guards.site(pinned_tree, ds, 185)
    assert ast.unparse(dsa_site.stmt.value) == "'dsa'"
    assert ast.unparse(v3_site.stmt.value) == "'trtllm_mla'"
    oss = [guards.site(pinned_tree, "sglang/srt/arg_groups/model_overrides/gpt_oss.py", n)
           for n in (31, 33, 44)]  # trtllm_mha / fa3 / triton assignments of its override
    sm90 = sm_majors(pinned_tree, "is_sm90_supported")
    specs = [(None, None), ("NEXTN", None), ("NEXTN", 1), ("NEXTN", 2)]
    n, seen = 0, set()
    for m, g, (algo, topk), page in itertools.product(GRID_MODELS, with_sm80, specs, [None, 16]):
        model, gpu = get_model(m), get_gpu(g)
        if algo and not model.mtp_layers:
            continue
        c = cfg(model=m, gpu=g, weights=lightest(m), speculative_algorithm=algo,
                speculative_eagle_topk=topk, page_size=page,
                speculative_num_steps=3 if topk else None,
                speculative_num_draft_tokens=(4 if topk == 1 else 8) if topk else None)
        got = resolve_attention_backend(c, model, gpu)[0]
        seen.add(got)
        dsa = model.attention == "dsa"
        over = {"is_deepseek_dsa(hf_config)": dsa, "is_attention_backend_not_set(cfg)": True,
                "get_platform().is_sm100": gpu.sm_major in sm100, "cfg.attention_backend": None,
                "cfg.prefill_attention_backend": None, "cfg.decode_attention_backend": None,
                "get_platform().is_npu": False, "get_platform().is_xpu": False}
        if guards.evaluate(dsa_site.guard, over, dsa_site):
            assert got == "dsa", (m, g)
            n += 1
            continue
        if model.architecture == "DeepseekV3ForCausalLM" and \
                guards.evaluate(v3_site.guard, over, v3_site):
            assert got == "trtllm_mla", (m, g)
            n += 1
            continue
        if model.architecture in UNMODELLED_ATTENTION_OVERRIDES:
            continue
        if model.architecture == "GptOssForCausalLM":
            env_oss = {**over, "get_platform().is_sm90": gpu.sm_major in sm90, "is_cpu()": False,
                       "get_platform().has_amx": False, "get_platform().is_hip": False,
                       "is_mps()": False, "use_mlx()": False}
            hit = next(s for s in oss if guards.evaluate(s.guard, env_oss, s))
            assert got == ast.literal_eval(hit.stmt.value), (m, g)
            n += 1
            continue
        topk_one = guards.returned(pinned_tree, "sglang/srt/utils/common.py",
                                   "is_no_spec_infer_or_topk_one",
                                   {"cfg.speculative_eagle_topk": topk, "cfg.page_size": page})
        env = {"current_platform.is_out_of_tree()": False,
               "model_config.hf_config.architectures": [model.architecture],
               "use_mla_backend": model.attention != "gqa",
               "get_platform().is_hopper_with_cuda_12_3": gpu.sm_major in hopper,
               "is_no_spec_infer_or_topk_one(resolved_view(server_args))": topk_one,
               "get_platform().is_sm100": gpu.sm_major in sm100,
               "cfg.speculative_algorithm": algo and "EAGLE", "cfg.speculative_eagle_topk": topk,
               "_forces_eagle_topk_one(cfg.speculative_algorithm)": False,
               "model_config.has_asymmetric_kv": model.attention == "gqa"
               and model.qk_head_dim != model.head_dim, "get_platform().is_hip": False,
               "is_mps()": False, "get_platform().has_flashinfer": True,
               "model_config.has_attention_sinks": False}
        assert got == guards.returned(pinned_tree, rel, "get_default_attn_backend", env), \
            (m, g, algo, topk, page)
        n += 1
    assert n >= 224  # 7 models x 7 GPUs on main; models without an MTP layer skip speculation
    assert {"dsa", "trtllm_mla", "fa3", "trtllm_mha", "flashinfer", "triton"} <= seen


def test_vision_fa3_on_blackwell(pinned_tree, with_sm80, monkeypatch):  # noqa: F811
    """``layers/attention/vision.py:1331``: ``backend == 'fa3' and get_platform().is_blackwell``
    as the vision encoder is built (SM majors of ``is_blackwell_supported`` from the tree;
    ``backend`` is ``--mm-attention-backend`` when given, ``override_backend`` at line 1301).
    A model without a vision tower builds no encoder. Grid: 4 values x 7 GPUs x a text model
    and a synthetic multimodal copy of it (``vision_params`` set: the catalog on main ships
    none)."""
    import domain.models as dm

    real = dm.load_model
    vl = real("qwen3-32b").model_copy(update={"name": "qwen3-32b-vl",
                                              "vision_params": 600_000_000})
    monkeypatch.setattr(dm, "load_model", lambda n: vl if n == vl.name else real(n))
    monkeypatch.setitem(dm.MODELS, vl.name, lambda: vl)
    blackwell = sm_majors(pinned_tree, "is_blackwell_supported")
    rows = []
    for v, g, m in itertools.product([None, "fa3", "fa4", "triton_attn"], with_sm80,
                                     ["qwen3-32b", vl.name]):
        c = cfg(model=m, gpu=g, weights="fp8", tp_size=8, mm_attention_backend=v)
        env = {"backend": v, "get_platform().is_blackwell": get_gpu(g).sm_major in blackwell}
        vision = m == vl.name and v is not None
        rows.append(((v, g, m), vision and holds(pinned_tree, "mm_fa3_blackwell", env),
                     start(c)))
    check("mm_fa3_blackwell", rows)


def test_no_draft_model_is_the_twins_stand_in(pinned_tree):  # noqa: F811
    """0.5.23 gives the draft worker the target's own checkpoint only for the architectures
    listed at ``speculative_hook.py:1121`` (read from the tree); for others the draft path stays
    unset (no refusal: the draft worker then loads the target, which has no MTP layer -- the
    twin's NO_DRAFT_MODEL stand-in). Grid: 7 models x 2 GPUs, NEXTN with auto parameters."""
    s = guards.site(pinned_tree, _HOOK, 1138)
    listed = guards.evaluate(s.path[-1].comparators[0], {}, s)  # the `model_arch in [...]` list
    rows = []
    for m, g in itertools.product(GRID_MODELS, ["B200", "H200"]):
        arch = get_model(m).architecture
        if arch in listed and not get_model(m).mtp_layers:
            continue  # e.g. Kimi-K2 (DeepseekV3ForCausalLM, no NextN layer): the draft path is
            # set to the target, whose missing NextN weights fail later, not at this guard
        c = cfg(model=m, gpu=g, weights=lightest(m), speculative_algorithm="NEXTN")
        rows.append(((m, g), arch not in listed, start(c)))
    check("no_draft_model", rows)


# ----------------------------------------------------------------------------- memory
def _fractions() -> list[float]:
    return [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99]


def _memory_grid() -> Iterable[tuple[str, str, int, float]]:
    yield from itertools.product(GRID_MODELS, GRID_GPUS, [1, 2, 4, 8], _fractions())


def test_oom_weights_is_cudas_verdict():
    """Weights OOM (``model_loader/loader.py:1014``, the model's parameters allocated as it is
    built) is CUDA's allocator refusing, not a guard of the engine's source: the twin's fit
    arithmetic (shard + CUDA context > HBM) decides it. Checked here: the twin's traceback at
    that site and its class, over the memory grid."""
    rows = []
    for m, g, tp, f in _memory_grid():
        c = cfg(model=m, gpu=g, weights=lightest(m), tp_size=tp, mem_fraction_static=f)
        shard = get_model(m).weight_bytes(lightest(m)) / tp
        rows.append(((m, g, tp), shard + CONTEXT_OVERHEAD_BYTES > get_gpu(g).hbm_bytes, start(c)))
    check("oom_weights", rows)
    assert all(classify(s.log)[0] == "OOM_WEIGHTS" for _, h, s in rows if twin_key(s) ==
               "oom_weights")


@pytest.mark.parametrize("key", ["kv_no_room", "kv_zero_requests", "kv_pool_too_small"])
def test_kv_pool_refusals(pinned_tree, key):  # noqa: F811
    """``pool_configurator.py:95-99`` (``max_total_num_tokens <= 0``), ``tp_worker.py:420``
    (``max_running_requests > 0``) and ``:421-425`` (``max_req_len = min(context_len - 1,
    tokens - 1) > 0``, its assignment evaluated from the tree). The token count and
    ``max_running_requests`` are the twin's profile of the pool (``f x M - weights`` over KV
    bytes per token; ``resolve_max_num_reqs``' ``min(..., tokens // 2)``): bound from the
    twin's arithmetic, which is not this audit's subject. Grid: 7 models x 3 GPUs x TP
    {1, 2, 4, 8} x 13 mem fractions, plus pools of 0..8 tokens."""
    rows = []
    points = [(m, g, tp, f, None) for m, g, tp, f in _memory_grid()]
    points += [("glm-5", "B200", 8, None, t + 0.5) for t in range(-1, 9)]
    for m, g, tp, f, tokens in points:
        model, gpu = get_model(m), get_gpu(g)
        w = model.weight_bytes(lightest(m)) / tp
        c0 = cfg(model=m, gpu=g, weights=lightest(m), tp_size=tp)
        per = model.kv_bytes_per_token(KV_BYTES[resolve_kv_dtype(c0, model, gpu)], tp)
        if tokens is not None:
            f = (w + tokens * per) / gpu.hbm_bytes
        c = cfg(model=m, gpu=g, weights=lightest(m), tp_size=tp, mem_fraction_static=f)
        n_tok = int((f * gpu.hbm_bytes - w) // per) if f * gpu.hbm_bytes > w else 0
        mrr = resolve_max_running_requests(None, max(n_tok, 0), model.context_len, False)
        env = {"self.max_total_num_tokens": n_tok,
               "self.model_runner.max_running_requests": mrr,
               "self.model_config.context_len": model.context_len,
               "self.model_runner.effective_logical_max_total_num_tokens": n_tok}
        rows.append(((m, g, tp, f), holds(pinned_tree, key, env), start(c)))
    if key == "kv_pool_too_small":  # unreachable: tokens // 2 requests trips line 420 first
        _never(key, rows)
        assert all(holds(pinned_tree, "kv_zero_requests", {
            "self.model_runner.max_running_requests": resolve_max_running_requests(
                None, t, 40960, False)}) for t in (0, 1))
        return
    check(key, rows)


def test_graph_capture_oom_is_cudas_verdict(pinned_tree):  # noqa: F811
    """Decode CUDA-graph capture (``decode_cuda_graph_runner.py:602``) refuses when the
    capture's ``RuntimeError`` (CUDA out of memory) reaches its ``except RuntimeError`` -- a
    memory fact, decided by the twin's fit arithmetic, not a guard of the source. Checked: the
    raise sits in that handler, and the twin's traceback is at that site with its class."""
    s = guard_of(pinned_tree, "graph_capture_oom")
    tries = [n for n in ast.walk(s.function) if isinstance(n, ast.Try)
             and any(h.lineno <= s.stmt.lineno <= (h.end_lineno or 0) for h in n.handlers)]
    assert tries and ast.unparse(tries[0].handlers[0].type) == "RuntimeError"
    hit = start(cfg(mem_fraction_static=0.99))
    assert twin_key(hit) == "graph_capture_oom"
    assert classify(hit.log)[0] == "GRAPH_CAPTURE_OOM"


def test_hicache_host_pool_does_not_fit(pinned_tree):  # noqa: F811
    """``pool_host/base.py:252``: ``requested_bytes > available_bytes`` with ``available_bytes
    = host_memory_budget_bytes(requested_bytes)``, whose ``free // ranks_per_host()`` (lines
    104-108, and ``HICACHE_HOST_MEMORY_RESERVE_BYTES``) are evaluated from the tree. Bound: the
    node's host memory (GPU catalog; no cgroup limit, no budget scope), ranks per host =
    ``min(gpus_per_node, tp_size x replicas)``, the pool's tokens and bytes per token (the
    twin's ``hicache_ratio x`` device tokens). Grid: 7 HiCache ratios x TP {2, 4, 8} x
    replicas {1, 2} x 3 models x 2 GPUs."""
    rel = "sglang/srt/mem_cache/pool_host/base.py"
    budget = guards.function(pinned_tree, rel, "host_memory_budget_bytes")
    ret = max((n for n in ast.walk(budget) if isinstance(n, ast.Return)), key=lambda n: n.lineno)
    free_site = guards.site(pinned_tree, rel, ret.lineno)
    # reached with no budget scope open (the engine's startup path opens none)
    assert guards.evaluate(free_site.guard, {"_host_memory_budget.get()": None}, free_site)
    rows = []
    for ratio, tp, rep, m, g in itertools.product([0.5, 1.0, 2.0, 4.0, 5.0, 8.0, 12.0],
                                                   [2, 4, 8], [1, 2], ["glm-5", "deepseek-v3",
                                                                       "qwen3-235b-a22b"],
                                                   ["B200", "H200"]):
        gpu = get_gpu(g)
        if tp * rep > gpu.gpus_per_node:
            continue
        c = cfg(model=m, gpu=g, weights=lightest(m), tp_size=tp, replicas=rep,
                enable_hierarchical_cache=True, hicache_ratio=ratio, mem_fraction_static=0.85)
        s = start(c)
        if s.fit is None and twin_key(s) != "hicache_host_oom":
            rows.append(((ratio, tp, rep, m, g), False, s))  # failed before the host pool
            continue
        fit = s.fit if s.fit is not None else _fit(c)
        available = guards.evaluate(ret.value, {
            "available_host_memory_bytes(allow_cgroup_fallback=not auto_size)":
                gpu.host_mem_bytes_per_node,
            "ranks_per_host()": min(gpu.gpus_per_node, tp * rep)}, free_site)
        env = {"requested_bytes": fit.host_kv_tokens * fit.kv_bytes_per_token,
               "available_bytes": available}
        rows.append(((ratio, tp, rep, m, g), holds(pinned_tree, "hicache_host_oom", env), s))
    check("hicache_host_oom", rows)


def _fit(c: ServingConfig):
    from domain.fit import fit
    return fit(c)


def test_the_twin_page_lists_every_refusal_site():
    """docs/twin.md's startup-refusals table names every row's file and line."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "twin.md").read_text()
    section = text[text.index("## Startup refusals"):text.index("## Calibration")]
    missing = [key for key, r in REFUSALS.items()
               if Path(r.file).name not in section or f":{r.line}" not in section]
    assert not missing, missing


# ----------------------------------------------------------------------------- layouts (issue 21)
LAYOUT_KEYS = ["pd_prefill_fake", "dp_with_attn_dp", "attn_dp_divides_tp",
               "dp_lm_head_without_attn_dp", "eplb_without_ep", "nnodes_divide_tp",
               "pp_spec_eagle_only", "pp_spec_prefill_only", "multi_node_dp", "moe_dense_tp",
               "tbo_without_attn_dp", "ep_divides_experts"]


def _layout_env(c: ServingConfig, nnodes: int) -> dict[str, Any]:
    """What the layout guards read, as the resolution pipeline holds it at each site.

    Bound, not modelled: attention DP is enabled when ``attn_dp_size`` > 1 (no elastic-EP
    joiner); the a2a backend's ``ep_size = tp_size`` (``overrides.py:1611``) is resolved before
    ``handle_eplb_and_dispatch`` and the expert layout; PP turns the overlap scheduler off
    (``overrides.py:1624``) before ``check_pipeline_parallel_compat``; NEXTN is EAGLE by
    ``check_server_args``; ``SGLANG_ENABLE_PP_SPEC`` unset; no elastic EP
    (``initial_ep_size`` None); a MoE model has an expert-location config.
    """
    from domain.fit import resolved_ep_size

    model = get_model(c.model)
    a2a = c.moe_a2a_backend or "none"
    spec = "EAGLE" if c.speculative_algorithm == "NEXTN" else c.speculative_algorithm
    dp_on = c.attn_dp_size > 1
    ep = resolved_ep_size(c)
    env: dict[str, Any] = {
        "cfg.attn_dp_size": c.attn_dp_size, "cfg.dp_size": c.dp_size, "cfg.tp_size": c.tp_size,
        "cfg.pp_size": c.pp_size, "cfg.nnodes": nnodes, "cfg.moe_dense_tp_size":
        c.moe_dense_tp_size, "cfg.enable_two_batch_overlap": c.enable_two_batch_overlap,
        "cfg.moe_a2a_backend": a2a, "resolved_view(server_args).moe_a2a_backend": a2a,
        "attn_dp_enabled_of(resolved_view(server_args))": dp_on,
        "attn_dp_enabled_of(cfg)": dp_on, "attn_dp_enabled_of(view)": dp_on,
        "view.enable_dp_lm_head": c.enable_dp_lm_head and c.schedulers > 1,
        "cfg.speculative_algorithm": spec, "cfg.disable_overlap_schedule": c.pp_size > 1,
        "cfg.speculative_algorithm.upper()": spec.upper() if spec else None,
        "envs.SGLANG_ENABLE_PP_SPEC.get()": False,
        "cfg.disaggregation_mode": c.disaggregation_mode,
        "cfg.disaggregation_transfer_backend": c.disaggregation_transfer_backend or "mooncake",
        "cfg.enable_eplb": c.enable_eplb, "resolved_view(server_args).ep_size": ep,
        "model_config_for_expert_location": object() if model.n_routed_experts else None,
        "initial_ep_size": None, "ep_size": ep,
        "num_physical_experts": model.n_routed_experts + c.ep_num_redundant_experts}
    return env


@pytest.mark.parametrize("key", LAYOUT_KEYS)
def test_layout_refusal(pinned_tree, key):  # noqa: F811
    """Each layout site's guard from the tree (its ``if``/``assert`` path) against the twin's
    verdict, over attention DP x dp copies x TP x PP x the layout knobs on DeepSeek-V3 (MoE)
    and Llama 3.1 8B (dense), H200 (8 GPUs a node). Bindings: :func:`_layout_env`."""
    grid = itertools.product(
        ["deepseek-v3", "llama-3.1-8b"], [(8, 1), (4, 2), (9, 1), (16, 1)], [1, 2, 3, 8],
        [1, 2], [None, 1, 2], [False, True], [None, "NEXTN", "EAGLE3"],
        [("null", None), ("prefill", "fake"), ("prefill", None)], [False, True], [0, 3],
        [False, True])
    rows = []
    for (m, (tp, pp), adp, dp, dense, tbo, spec, (role, xfer), eplb, red, head) in grid:
        if (adp > 1) + (dp > 1) + (dense is not None) + tbo + (spec is not None) \
                + (role != "null") + eplb + (red > 0) + head > 2:
            continue  # at most two knobs off their default at once
        c = ServingConfig.model_construct(**{**cfg(model=m, gpu="H200", weights=lightest(m),
                                                   tp_size=8).model_dump(),
                                             "tp_size": tp, "pp_size": pp, "attn_dp_size": adp,
                                             "dp_size": dp, "moe_dense_tp_size": dense,
                                             "enable_two_batch_overlap": tbo,
                                             "speculative_algorithm": spec,
                                             "disaggregation_mode": role,
                                             "disaggregation_transfer_backend": xfer,
                                             "enable_eplb": eplb, "ep_size": 8 if red else 1,
                                             "ep_num_redundant_experts": red,
                                             "enable_dp_lm_head": head})
        nodes = c.nnodes(get_gpu("H200").gpus_per_node)
        label = (m, tp, pp, adp, dp, dense, tbo, spec, role, xfer, eplb, red, head)
        rows.append((label, holds(pinned_tree, key, _layout_env(c, nodes)), start(c)))
    check(key, rows)
