"""Estimate before you run: steady-state throughput and replay latency of a config, no simulation.

The planner's prior (``agents.guided_brain.GuidedPlanner``): for every config of a study's knob
space, what the saturation run should give (output tok/s/GPU) and how the replayed trace should
load it (utilization, TTFT p99), from closed-form steady state over the step-time model of
:mod:`domain.costmodel` (roofline per step; its sources are cited there) and the memory fit of
:mod:`domain.fit`. It counts the prefill and decode steps a request takes at a fixed batch, as
NVIDIA aiconfigurator's aggregated-serving estimate does, plus classic queueing; it is not the
twin's discrete-event run: no admission waves, no retraction, no prefix-cache eviction, no
burstiness beyond a mean rate. Use it to rank candidates, never as a measurement. For scale,
servetune's estimators reference measured aiconfigurator at 32 % mean absolute TPOT error and
its (zero-queue) TTFT about 2x too low; this estimate's TTFT includes queueing.

Steady state of one replica at a running batch ``B`` (sequences decoding at once) for requests
of ``isl`` input tokens (a share ``h`` of them prefix-cache hits) and ``osl`` output tokens:

- one request's prefill costs ``T_pre``: its ``isl x (1 - h)`` new tokens in chunks of at most
  ``chunked_prefill_size`` (several short prompts share one chunk; the attention pairs count
  the cached context, capped at ``index_topk`` keys per query for DSA models),
  ``StepCostModel.prefill_time`` per chunk;
- a decode (or speculative verify + draft) step of ``B`` sequences at mean context
  ``isl + osl / 2`` costs ``T_dec`` and emits ``a`` tokens per sequence (``a`` the speculative
  accept length, :func:`domain.speculative.accept_length`, else 1);
- ``B`` requests finish every ``B x T_pre + ((osl - 1) / a) x T_dec`` seconds (the prefill
  yields the first token): output ``B x osl`` tokens in that time.

``B`` is ``min(clients per replica, max_running_requests, KV tokens / (isl + osl))``: the
admission cap, and the pool holding every admitted request's prompt and its whole output. The
engine itself admits against the prompt plus the remaining output times ``new_token_ratio``
(0.7 x ``schedule_conservativeness`` at first, decaying; SGLang ``schedule_policy.py``), so
this ignores ``schedule_conservativeness`` and is conservative where the ratio has decayed.

The replay: mean arrival rate ``lambda`` of the trace window against the pool's capacity
``mu`` (requests/s at its largest batch, the same formula at the trace's mean lengths);
utilization ``rho = lambda / mu``; infinite TTFT at ``rho >= 1`` or a prefill load
``rho_p = lambda_replica x T_pre >= 1`` (the queue grows without bound). Below both, TTFT p99
is the sum of

- the prefill of the p99 prompt by uncached tokens (:attr:`ReplayProfile.new_p99`, on top of
  its cached history) and one decode step (a new request waits for the step in flight);
- the p99 wait for the prefill server, an M/M/1 queue at ``rho_p``: ``T_pre ln(100 rho_p) /
  (1 - rho_p)`` (Kleinrock, "Queueing Systems" vol. 1, 1975; SGLang runs a waiting prefill
  before the next decode step, so prefill is one server);
- the p99 wait for a running-request slot, an M/M/c queue with ``c = B`` slots and service
  one request's E2E (Halfin & Whitt's many-server approximation of Erlang C, Operations
  Research 29(3), 1981): negligible until ``rho`` nears 1, then dominant.

Layouts: the fit and the step costs are per scheduler (one attention-DP rank or dp copy of a
server; every rank assumed to run the same batch, the MoE seeing the gathered one), so a pool
of ``replicas`` servers runs ``replicas x config.schedulers`` copies of the steady state above,
each with its share of the clients and arrivals. Attention-DP ranks step together
(``domain/twin/dp.py``), so in the replay a rank's decode also waits for its peers' prefills:
with each rank prefilling a share ``u`` of the time independently, some rank prefills
``1 - (1 - u)^ranks`` of it. The twin prices a shared prefill step as the mean tokens per rank
with the prompt's attention (``T_peer``, shorter than the prompt's own ``T_pre``), in which the
stalled rank still runs one decode step (``T_dec``), so the rank loses ``excess x T_peer / T_pre
x (1 - T_dec / T_peer)`` of its time; the loss is added to its utilization and stretches its
decode steps (saturation keeps one rank's own prefills: there the ranks' prefills coincide).
A PD layout (``config.pd``) is a prefill pool and a decode pool, each fitted and costed as its
own servers, joined by the KV transfer (:func:`transfer_time`): its throughput is the smaller
pool's capacity and its TTFT adds the transfer and the wait for a decode slot
(:func:`_estimate_pd`).

On the search benchmark's GLM-5 scenario the best config is predicted at 6.1 s TTFT p99
against 7.0 s on the twin; over its six scenarios the SLO verdict is right for 58-97 % of the
configs that start (``benchmarks/search_efficiency.py`` prints the estimate's accuracy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from domain.config import ServingConfig
from domain.costmodel import StepCostModel, build_cost_model
from domain.errors import ConfigInvalid, DoesNotFit, InvalidCombination
from domain.fit import FitReport, fit
from domain.speculative import accept_length, draft_tokens_for_batch, steps_for_batch
from domain.study import SaturationSpec
from domain.workload import Trace


@dataclass(frozen=True, slots=True)
class ReplayProfile:
    """What the estimate needs of a replayed trace window (after its time scaling).

    Units: requests/s, tokens. ``reuse_share`` is the share of prompt tokens whose prefix block
    occurred earlier in the window (an unbounded prefix cache's hit rate; 0 without block
    hashes); ``new_p99`` the 99th percentile of each request's uncached tokens under that
    cache (in a conversation trace the longest prompts carry the most cached history, so it
    is far below ``isl_p99 x (1 - reuse_share)``). ``rate_req_s`` is 0 when the window has no
    length (one arrival instant and no ``duration_s``).
    """

    rate_req_s: float
    isl_mean: float
    isl_p99: float
    osl_mean: float
    reuse_share: float
    requests: int
    new_p99: float = 0.0  # p99 over requests of their uncached prompt tokens
    cached_at_p99: float = 0.0  # mean cached tokens of the requests at or above that p99

    @classmethod
    def of(cls, window: Trace, duration_s: float | None = None) -> ReplayProfile:
        """Profile of ``window`` (a study's replay window, already scaled).

        Args:
            window: the replayed requests.
            duration_s: the window's length in replay seconds (the study's ``duration_s /
                time_scale``); None: the span of the arrivals (a rate of 0 when every request
                arrives at once).
        """
        reqs = window.requests
        isl = np.fromiter((r.input_tokens for r in reqs), float, len(reqs))
        osl = np.fromiter((r.output_tokens for r in reqs), float, len(reqs))
        span = duration_s if duration_s else reqs[-1].arrival_s - reqs[0].arrival_s
        seen: set[int] = set()
        hits = np.zeros(len(reqs))
        for k, r in enumerate(reqs):
            if not r.hash_ids or not r.block_size:
                continue
            for i, h in enumerate(r.hash_ids):
                if h not in seen or i * r.block_size >= r.input_tokens:
                    break  # a prefix cache matches up to the first new block only
                hits[k] += min(r.block_size, r.input_tokens - i * r.block_size)
            seen.update(r.hash_ids)
        new = isl - hits
        new_p99 = float(np.percentile(new, 99))
        top = new >= new_p99
        return cls(rate_req_s=len(reqs) / span if span > 0 else 0.0,
                   isl_mean=float(isl.mean()), isl_p99=float(np.percentile(isl, 99)),
                   osl_mean=float(osl.mean()),
                   reuse_share=min(1.0, float(hits.sum()) / float(isl.sum())),
                   requests=len(reqs), new_p99=new_p99,
                   cached_at_p99=float(hits[top].mean()) if top.any() else 0.0)


@dataclass(frozen=True, slots=True)
class Estimate:
    """The prior for one config (see the module docstring for the formulas).

    Units: tok/s per GPU, requests/s, ms. ``fits`` is False when the memory fit rules the
    config out or the engine would refuse it (every number is then 0, TTFT infinite).
    """

    fits: bool
    batch: float  # running sequences per scheduler in the saturation run (PD: per decode one)
    output_tok_s_per_gpu: float  # saturation run
    capacity_req_s: float = 0.0  # whole pool, at the replay's mean lengths
    utilization: float = math.inf  # replay rate / capacity
    ttft_p99_ms: float = math.inf  # on the replay
    why: str = ""
    transfer_ms: float = 0.0  # PD: the p99 prompt's KV transfer inside ttft_p99_ms (0 otherwise)

    def slo_ratio(self, slo_ttft_p99_ms: float) -> float:
        """Predicted TTFT p99 over the SLO (<= 1: predicted to meet it)."""
        return self.ttft_p99_ms / slo_ttft_p99_ms


def _pairs(cost: StepCostModel, tokens: float, context: float) -> tuple[float, float]:
    """(attention, DSA indexer) query-key pairs of ``tokens`` new tokens at mean ``context``.

    DSA attends at most ``index_topk`` keys per query while its indexer scores the whole
    context (as the twin's prefill step counts them); dense attention attends everything.
    """
    if cost.topk:
        return tokens * min(context, cost.topk), tokens * context
    return tokens * context, 0.0


def _prefill_per_request(cost: StepCostModel, isl: float, hit: float, chunk: int,
                         cached: float | None = None) -> float:
    """Seconds of prefill one request of ``isl`` tokens (``hit`` share cached) costs.

    Chunks of ``chunk`` new tokens (``chunk <= 0``: one chunk); prompts shorter than a chunk
    share one (the step's cost is split between them). ``cached`` (tokens) replaces
    ``isl x hit`` when given.
    """
    cached = isl * hit if cached is None else cached
    new = max(1.0, isl - cached)
    if chunk <= 0 or new <= chunk:
        k = max(1, int(chunk // new)) if chunk > 0 else 1
        n = k * new
        attn, index = _pairs(cost, k * new, cached + new / 2)
        return cost.prefill_time(int(n), attn, index) / k
    total, done = 0.0, cached
    left = new
    while left > 0:
        c = min(chunk, left)
        attn, index = _pairs(cost, c, done + c / 2)
        total += cost.prefill_time(int(c), attn, index)
        done += c
        left -= c
    return total


def _decode_step(cost: StepCostModel, rep: FitReport, batch: int,
                 context: float) -> tuple[float, float]:
    """(seconds, tokens per sequence) of one decode step of ``batch`` sequences."""
    ctx = int(batch * context)
    spec = rep.speculative
    if spec is not None and steps_for_batch(spec, batch) > 0:
        steps = steps_for_batch(spec, batch)
        draft = draft_tokens_for_batch(spec, batch)
        dt = (cost.verify_time(batch, draft, ctx)
              + cost.draft_time(batch, steps, spec.topk, ctx, draft))
        return dt, accept_length(spec, batch)
    return cost.decode_time(batch, ctx), 1.0


def _throughput(cost: StepCostModel, rep: FitReport, batch: float, isl: float, osl: float,
                hit: float, outside_s: float = 0.0,
                lockstep: int = 1) -> tuple[float, float, float]:
    """(output tok/s, requests/s, T_pre s) of one replica at a running ``batch``.

    ``outside_s``: seconds per request a closed-loop client spends outside the engine's steps
    (the TTFT path: tokenize + ``request_fixed_s``, ``domain/twin/engine.py``), added to the
    cycle; 0 for an open-loop capacity. ``lockstep``: ranks whose prefills stall this one's
    decode (attention DP, see :func:`estimate`); 1 otherwise.
    """
    b = max(1, int(round(batch)))
    t_pre = _prefill_per_request(cost, isl, hit, rep.chunked_prefill_size)
    t_dec, acc = _decode_step(cost, rep, b, isl + osl / 2)
    cycle = lockstep * b * t_pre + max(osl - 1, 0.0) / acc * t_dec + outside_s
    if cycle <= 0:
        return 0.0, 0.0, t_pre
    return b * osl / cycle, b / cycle, t_pre


def _batch(rep: FitReport, clients: float, isl: float, osl: float) -> float:
    return max(0.0, min(clients, rep.max_running_requests, rep.kv_tokens / (isl + osl)))


def _p99_exp_wait(rho: float, service_s: float) -> float:
    """p99 wait of an M/M/1 queue in seconds: ``S ln(100 rho) / (1 - rho)``.

    0 below 1 % load, inf at or above full load.
    """
    if rho >= 1:
        return math.inf
    if rho <= 0.01:
        return 0.0
    return service_s * math.log(100 * rho) / (1 - rho)


def _p99_slot_wait(rho: float, slots: float, e2e_s: float) -> float:
    """p99 wait for a free running-request slot: an M/M/c queue with ``c = slots``, seconds.

    The probability of waiting is Halfin & Whitt's many-server approximation of Erlang C,
    ``1 / (1 + beta Phi(beta) / phi(beta))`` with ``beta = (1 - rho) sqrt(c)`` (Operations
    Research 29(3), 1981); a wait is exponential with rate ``c (1 - rho) / E2E``.
    """
    if rho >= 1:
        return math.inf
    c = max(1.0, slots)
    beta = (1 - rho) * math.sqrt(c)
    if beta > 6:  # P(wait) < 1e-8
        return 0.0
    from scipy.stats import norm  # here: scipy.stats takes about 1 s to import

    p_wait = 1.0 / (1.0 + beta * float(norm.cdf(beta)) / float(norm.pdf(beta)))
    if p_wait <= 0.01:
        return 0.0
    return math.log(100 * p_wait) * e2e_s / (c * (1 - rho))


def _not_fit(why: str, batch: float = 0.0) -> Estimate:
    return Estimate(fits=False, batch=batch, output_tok_s_per_gpu=0.0, why=why[:300])


def _first_prefill(cost: StepCostModel, rep: FitReport, r: ReplayProfile) -> float:
    """Seconds of the prefill of the replay's p99 prompt by uncached tokens."""
    if r.new_p99 > 0:  # the p99 prompt by uncached tokens, on top of its cached history
        return _prefill_per_request(cost, r.new_p99 + r.cached_at_p99, 0.0,
                                    rep.chunked_prefill_size, cached=r.cached_at_p99)
    return _prefill_per_request(cost, r.isl_p99, r.reuse_share, rep.chunked_prefill_size)


def estimate(config: ServingConfig, saturation: SaturationSpec,
             replay: ReplayProfile | None = None) -> Estimate:
    """Steady-state prior of ``config`` for a study's saturation run and replay.

    The step costs and the memory fit are per scheduler (one attention-DP rank or dp copy:
    :func:`domain.fit.fit` gives its KV pool and cap, :func:`domain.costmodel.build_cost_model`
    its step times, every rank assumed to run the same batch); the pool has ``replicas x
    config.schedulers`` of them, each taking an equal share of the clients and of the replay's
    arrivals. A PD layout (``config.pd``) is :func:`_estimate_pd`.

    Args:
        config: the candidate.
        saturation: the study's closed-loop run (ISL, OSL, concurrency over the whole pool;
            the router and the engine's DP controller spread clients evenly over the
            schedulers).
        replay: the replayed window's profile; None leaves the replay fields at their
            "unknown" values (capacity 0, utilization and TTFT infinite).

    Returns:
        An :class:`Estimate`; ``fits`` False (with ``why``) when the memory fit or the
        engine's argument checks rule the config out. Never raises for a config of a valid
        study.

    Raises:
        ConfigInvalid: an unknown model or GPU (not a candidate of any valid study).
    """
    if config.pd is not None:
        return _estimate_pd(config, saturation, replay)
    try:
        rep = fit(config)
    except (DoesNotFit, InvalidCombination) as e:
        return _not_fit(str(e))
    cost = build_cost_model(config, rep)
    s = saturation
    n = config.replicas * config.schedulers  # schedulers of the pool
    batch = _batch(rep, s.concurrency / n, s.isl, s.osl)
    if batch < 1:
        return _not_fit("the KV pool holds less than one request of the saturation run", batch)
    tok_s, _, _ = _throughput(cost, rep, batch, s.isl, s.osl, 0.0,
                              cost.tokenize_time(s.isl) + cost.request_fixed_s)
    sat = tok_s * n / config.gpus
    if replay is None:
        return Estimate(fits=True, batch=batch, output_tok_s_per_gpu=sat)
    r = replay
    b_max = _batch(rep, math.inf, r.isl_mean, r.osl_mean)
    if b_max < 1:
        return Estimate(fits=True, batch=batch, output_tok_s_per_gpu=sat,
                        why="the KV pool holds less than one mean request of the replay")
    _, req_s, t_pre = _throughput(cost, rep, b_max, r.isl_mean, r.osl_mean, r.reuse_share)
    lam = r.rate_req_s / n  # arrivals per scheduler
    rho_p = lam * t_pre  # its own prefills' share of its time
    # attention-DP ranks step together (domain/twin/dp.py): a peer's prefill stalls this
    # rank's decode. With the ranks' prefills independent, some rank prefills a share
    # 1 - (1 - rho_p)^ranks of the time (rho_p for one rank), and decode runs only in the rest
    stall = 1.0 - (1.0 - min(rho_p, 1.0)) ** config.attn_dp_size - min(rho_p, 1.0)
    if stall > 0:
        # a peer's prefill step is priced as the mean tokens per rank with that prompt's
        # attention (domain/twin/dp.py), and the stalled rank still runs one decode step in it
        ranks = config.attn_dp_size
        new = max(1.0, r.isl_mean * (1 - r.reuse_share))
        attn, index = _pairs(cost, new, r.isl_mean * r.reuse_share + new / 2)
        t_peer = cost.prefill_time(max(1, int(new / ranks)), attn, index)
        t_step, _ = _decode_step(cost, rep, max(1, int(round(b_max))),
                                 r.isl_mean + r.osl_mean / 2)
        stall *= max(0.0, 1.0 - t_step / t_peer) * min(1.0, t_peer / t_pre) \
            if t_pre > 0 and t_peer > 0 else 0.0
    mu = req_s * n
    if stall > 0:  # the pool's rate at which the stalled ranks would be full
        mu = r.rate_req_s / (lam / req_s + stall)
    rho = r.rate_req_s / mu if mu > 0 else math.inf
    # the decode batch a request meets on arrival: the load's share of the largest batch
    b_load = max(1, int(round(min(rho, 1.0) * b_max)))
    t_dec, acc = _decode_step(cost, rep, b_load, r.isl_mean + r.osl_mean / 2)
    if stall > 0:
        t_dec /= max(1e-9, 1.0 - stall)  # the peers' prefills in between
    first = _first_prefill(cost, rep, r)
    if rho >= 1 or rho_p >= 1:
        ttft = math.inf
    else:
        e2e = t_pre + max(r.osl_mean - 1, 0.0) / acc * t_dec  # slot-seconds per request
        # + the TTFT path outside the GPU (domain/twin/engine.py): tokenize, fixed latency
        ttft = (first + t_dec + _p99_exp_wait(rho_p, t_pre)
                + _p99_slot_wait(rho, b_max, e2e)
                + cost.tokenize_time(r.isl_p99) + cost.request_fixed_s) * 1000
    return Estimate(fits=True, batch=batch, output_tok_s_per_gpu=sat, capacity_req_s=mu,
                    utilization=rho, ttft_p99_ms=ttft)


def transfer_time(config: ServingConfig, prefill: tuple[ServingConfig, FitReport],
                  decode: tuple[ServingConfig, FitReport], tokens: float) -> float:
    """Seconds to move ``tokens`` prompt tokens of KV from a prefill to a decode server.

    The twin's transfer on an idle link (:func:`domain.twin.pd.transfer_link`): every prefill
    GPU holding the request sends its share over its own NIC at ``Efficiency.pd_transfer_eta``
    of ``Interconnect.nic_bytes_per_s``, plus ``pd_transfer_latency_s`` per request; no queue
    on the link (the estimate's queueing is the prefill's M/M/1 wait).

    Args:
        config: the PD config (its ``disaggregation_transfer_backend``).
        prefill: one prefill server's config and memory fit.
        decode: one decode server's config and memory fit.
        tokens: prompt tokens whose KV moves (cached ones too: the decode server holds none).
    """
    from domain.twin.pd import transfer_link  # the twin's link, imported when a PD is priced

    link = transfer_link(config, prefill[0], prefill[1], decode[0], decode[1])
    return link.seconds(int(round(max(tokens, 0.0))))


def _estimate_pd(config: ServingConfig, saturation: SaturationSpec,
                 replay: ReplayProfile | None) -> Estimate:
    """The prior of a PD layout: a prefill pool, the KV transfer, a decode pool.

    Each group is fitted and costed per scheduler as its own server (``config.pd_worker``);
    ``n_p`` prefill and ``n_d`` decode schedulers (workers x ``schedulers``). Saturation: the
    pool completes ``min(n_p / T_pre, n_d x B / T_dec_req, C / cycle)`` requests/s, the prefill
    capacity, the decode capacity at the decode batch ``B`` (``_batch`` of the decode fit at
    ``C / n_d`` clients) with ``T_dec_req = (osl - 1) / a x T_dec`` and the closed loop of ``C``
    clients whose cycle is prefill + transfer (:func:`transfer_time`) + first decode step +
    decode + the path outside the GPU; output ``osl`` tokens each, over every GPU of the
    layout. Replay: the capacity ``mu`` is the smaller pool's at the trace's mean lengths;
    TTFT p99 is the p99 prompt's prefill, the M/M/1 wait for a prefill scheduler, its KV
    transfer, one decode step and the wait for a decode slot (an M/M/c queue of ``B_max``
    slots per decode scheduler, as for an aggregated server), plus tokenize and the fixed
    latency; ``transfer_ms`` is the transfer's share.
    """
    roles: dict[str, tuple[int, ServingConfig, FitReport, StepCostModel]] = {}
    for role, count, worker in config.servers():
        try:
            rep = fit(worker)
        except (DoesNotFit, InvalidCombination) as e:
            return _not_fit(f"{role} servers: {e}")
        roles[role] = (count * worker.schedulers, worker, rep, build_cost_model(worker, rep))
    n_p, pw, rep_p, cost_p = roles["prefill"]
    n_d, dw, rep_d, cost_d = roles["decode"]

    def move(tokens: float) -> float:
        return transfer_time(config, (pw, rep_p), (dw, rep_d), tokens)

    s = saturation
    batch = _batch(rep_d, s.concurrency / n_d, s.isl, s.osl)
    if batch < 1:
        return _not_fit("the decode KV pool holds less than one request of the saturation run",
                        batch)
    b = max(1, int(round(batch)))
    t_pre = _prefill_per_request(cost_p, s.isl, 0.0, rep_p.chunked_prefill_size)
    t_dec, acc = _decode_step(cost_d, rep_d, b, s.isl + s.osl / 2)
    dec_req = max(s.osl - 1, 0.0) / acc * t_dec
    cycle = (t_pre + move(s.isl) + t_dec + dec_req
             + cost_p.tokenize_time(s.isl) + cost_p.request_fixed_s)
    x = min(n_p / t_pre if t_pre > 0 else math.inf,
            n_d * b / dec_req if dec_req > 0 else math.inf, s.concurrency / cycle)
    sat = x * s.osl / config.gpus
    if replay is None:
        return Estimate(fits=True, batch=batch, output_tok_s_per_gpu=sat)
    r = replay
    b_max = _batch(rep_d, math.inf, r.isl_mean, r.osl_mean)
    if b_max < 1:
        return Estimate(fits=True, batch=batch, output_tok_s_per_gpu=sat,
                        why="the decode KV pool holds less than one mean request of the replay")
    t_pre = _prefill_per_request(cost_p, r.isl_mean, r.reuse_share, rep_p.chunked_prefill_size)
    bm = max(1, int(round(b_max)))
    t_dec_max, acc = _decode_step(cost_d, rep_d, bm, r.isl_mean + r.osl_mean / 2)
    dec_e2e = max(r.osl_mean - 1, 0.0) / acc * t_dec_max
    cap_p = n_p / t_pre if t_pre > 0 else math.inf
    cap_d = n_d * b_max / dec_e2e if dec_e2e > 0 else math.inf
    mu = min(cap_p, cap_d)
    rho = r.rate_req_s / mu if mu > 0 else math.inf
    rho_p = r.rate_req_s / n_p * t_pre
    rho_d = r.rate_req_s / cap_d if math.isfinite(cap_d) else 0.0
    b_load = max(1, int(round(min(rho_d, 1.0) * b_max)))
    t_dec, _ = _decode_step(cost_d, rep_d, b_load, r.isl_mean + r.osl_mean / 2)
    moved = move(r.isl_p99)
    if rho >= 1 or rho_p >= 1:
        ttft = math.inf
    else:
        ttft = (_first_prefill(cost_p, rep_p, r) + _p99_exp_wait(rho_p, t_pre) + moved + t_dec
                + _p99_slot_wait(rho_d, b_max, dec_e2e + t_dec)
                + cost_p.tokenize_time(r.isl_p99) + cost_p.request_fixed_s) * 1000
    return Estimate(fits=True, batch=batch, output_tok_s_per_gpu=sat, capacity_req_s=mu,
                    utilization=rho, ttft_p99_ms=ttft, transfer_ms=moved * 1000)


def safe_estimate(config: ServingConfig, saturation: SaturationSpec,
                  replay: ReplayProfile | None = None) -> Estimate:
    """:func:`estimate`, with an unknown model or GPU as a config that does not fit."""
    try:
        return estimate(config, saturation, replay)
    except ConfigInvalid as e:
        return Estimate(fits=False, batch=0.0, output_tok_s_per_gpu=0.0, why=str(e)[:300])
