"""Prefill/decode (PD) disaggregation in the twin: a prefill pool, a KV transfer, a decode pool.

A config with ``pd`` runs its prefill servers (``--disaggregation-mode prefill``) and decode
servers (``--disaggregation-mode decode``) behind sglang-router in PD mode; every server is a
:class:`~domain.twin.engine.TwinEngine` in a PD role (:meth:`TwinEngine.set_role`), each with
the cost model and limits of its own group's worker config (:meth:`ServingConfig.servers`).
One request's life (SGLang 0.5.23, ``srt/disaggregation/decode.py`` and ``prefill.py``, module
docstrings and the functions cited):

1. **Routing.** The router picks a prefill and a decode server for it, each pool with the
   config's ``router_policy`` (sglang-router 0.3.2 ``router_args.py:244-271``: ``--policy`` is
   used for both pools unless ``--prefill-policy`` / ``--decode-policy`` override it; the twin's
   round_robin, power_of_two and cache_aware are those of :class:`~domain.twin.cluster.Router`,
   over each pool's in-flight counts). It sends the request to both servers at once.
2. **Decode preallocation.** The decode server's prealloc queue (FIFO; its first request that
   does not fit blocks the rest) reserves a request slot and the prompt's KV before anything is
   transferred (``DecodePreallocQueue.pop_preallocated``, the budget in
   :meth:`TwinEngine.prealloc_fits`). Slots: ``max_running_requests`` plus
   ``--disaggregation-decode-extra-slots`` (:func:`decode_extra_slots`).
3. **Prefill.** The prefill server's bootstrap queue holds the request until that handshake
   (``PrefillBootstrapQueue.pop_bootstrapped``, ``prefill.py:497-558``: with the default
   ``optimistic_prefill_attempts`` 0 it prefills only after the decode side preallocated), so
   the twin submits it to the prefill server when the decode server preallocates it (its
   tokenizer then runs). The prefill server admits and prefills it as an aggregated server
   does (chunked prefill, radix cache, ``max_new_tokens`` set to 1: ``prefill.py:478-482``)
   and produces the first token; the request keeps its KV and its slot until the transfer
   ends (:meth:`TwinEngine.release_held`).
4. **Transfer.** Each prefill chunk's KV leaves when the chunk is computed (the cached prefix
   with the first; :meth:`TwinEngine.kv_sent_since`): every GPU holding the request (the
   attention TP group times the PP stages) sends its share over its own NIC at
   ``pd_transfer_eta`` of ``gpu.interconnect.nic_bytes_per_s`` (:class:`TransferLink`);
   a chunk goes when both the sending scheduler's NICs and the receiving one's are free (each
   side is one FIFO link: several prefill servers feeding one decode server share its NICs), and
   each request adds ``pd_transfer_latency_s`` after its last chunk. ``RequestRecord.
   transfer_s`` is the time from the prefill's end to the KV on the decode server (what is left
   of the link queue and wire, plus the latency).
5. **Decode.** The request joins the decode server's running batch at its next iteration
   boundary (up to ``max_running_requests`` running), its first token is streamed then, and
   its remaining output tokens are decoded there; the radix cache is off on decode servers
   (``arg_groups/pd_disaggregation_hook.py:96-123``, unless
   ``--disaggregation-decode-enable-radix-cache``).

So TTFT = tokenizer + preallocation wait + prefill queue + prefill + transfer + the wait for
the decode server's next iteration (at most one decode step) + ``request_fixed_s`` (the
decode server's pipeline delay: the client's stream comes from the decode server).

Transfer backends: ``mooncake`` (the default), ``nixl``, ``mori`` and ``ascend`` move the KV by
RDMA at the rates above; ``mooncake_tcp`` (mooncake forced onto TCP, ``MC_FORCE_TCP=1``:
``pd_disaggregation_hook.py:27-45``) is :data:`MOONCAKE_TCP_SLOWDOWN` times slower; ``fake``
moves nothing (SGLang's synthetic decode benchmark backend; SGLang refuses it on a prefill
server, ``pd_disaggregation_hook.py:144-147``, the twin then charges no transfer).

The servers are simulated in one event loop in virtual time (:class:`PDSimulation`): arrivals,
transfer ends, prefill iterations (one at a time) and, while a decode server's prealloc queue
waits on its memory or a closed loop needs its finishes, its decode iterations one at a time;
otherwise a decode server is advanced lazily to the next event that concerns it.

Longer than 500 lines on purpose: one event loop carries a request through preallocation,
prefill, the transfer links and decode; its states are shared by every stage, so the stages
cannot be split into modules without passing that state around.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from domain import fit as fit_module
from domain.calibration import efficiency
from domain.config import ServingConfig
from domain.costmodel import build_cost_model
from domain.fit import FitReport
from domain.hardware import get_gpu
from domain.metrics import RequestRecord
from domain.speculative import accept_length
from domain.twin.budget import CHECK_EVERY, ComputeBudget, SimCost
from domain.twin.cluster import (
    PROGRESS_EVERY,
    ROUTER_SEED,
    ReplicaStats,
    Router,
    SimProgress,
    _batch,
    _chunk,
    _stats,
    engine_limits,
)
from domain.twin.engine import EngineLimits, TwinEngine, new_cache
from domain.twin.prefix_cache import PathIndex

# --num-reserved-decode-tokens default (SGLang 0.5.23 arg_groups/fields/disagg.py:109-112)
NUM_RESERVED_DECODE_TOKENS = 512
# pd_disaggregation_hook.py:127-143: with --max-running-requests set and at most this many
# requests per DP rank, a decode server gets 2x that many extra slots, else none
EXTRA_SLOTS_MAX_BATCH = 32
# kvcache-ai/Mooncake README (Transfer Engine): 190 GB/s on 8 x 400 Gbps RoCE "~4.6x TCP"
# (87 GB/s on 4 x 200 Gbps, ~2.4x TCP); the twin's H200/B200 nodes have 8 x 400 Gbps NICs
MOONCAKE_TCP_SLOWDOWN = 4.6
RDMA_BACKENDS = ("mooncake", "nixl", "mori", "ascend")
TRANSFER_BACKENDS = (*RDMA_BACKENDS, "mooncake_tcp", "fake")
_STEP = 1e-9  # virtual s past an engine's clock: advance it by one iteration


def decode_extra_slots(worker: ServingConfig) -> int:
    """``--disaggregation-decode-extra-slots`` a decode server resolves to (its default).

    SGLang 0.5.23 ``arg_groups/pd_disaggregation_hook.py:127-143``: 0, or twice the per-rank
    batch when ``--max-running-requests`` is set and ``max_running_requests // DP ranks`` is at
    most :data:`EXTRA_SLOTS_MAX_BATCH` (32).
    """
    if worker.max_running_requests is None:
        return 0
    per_rank = max(1, worker.max_running_requests // max(1, worker.schedulers))
    return 2 * per_rank if per_rank <= EXTRA_SLOTS_MAX_BATCH else 0


@dataclass(frozen=True, slots=True)
class TransferLink:
    """The KV transfer between a prefill and a decode scheduler.

    Attributes:
        sender_bytes_per_token: KV bytes per prompt token on each GPU of the prefill side that
            holds the request (``FitReport.kv_bytes_per_token`` of the prefill worker).
        receiver_bytes_per_token: the same on the decode side.
        gpus: GPUs holding one request's KV on the prefill side (attention TP x PP stages).
        nic_bytes_per_s: NIC bandwidth per GPU and direction, bytes/s.
        eta: share of it a transfer reaches (``Efficiency.pd_transfer_eta``).
        latency_s: fixed seconds per request (``Efficiency.pd_transfer_latency_s``).
        slowdown: divides the rate (``mooncake_tcp``: :data:`MOONCAKE_TCP_SLOWDOWN`).
        moves_kv: False for the ``fake`` backend (no transfer, no latency).
    """

    sender_bytes_per_token: float
    receiver_bytes_per_token: float
    gpus: int
    nic_bytes_per_s: float
    eta: float
    latency_s: float
    slowdown: float = 1.0
    moves_kv: bool = True

    def bytes(self, tokens: int) -> float:
        """KV bytes one prompt of ``tokens`` tokens moves (all layers, all its GPUs)."""
        return tokens * self.sender_bytes_per_token * self.gpus if self.moves_kv else 0.0

    def wire_seconds(self, tokens: int) -> float:
        """Seconds the link is busy with one prompt: each GPU's share over its own NIC.

        ``tokens x max(sender, receiver bytes per token and GPU) x slowdown / (NIC x eta)``:
        the GPUs send in parallel, and the side whose GPUs hold more of it bounds the rate.
        """
        if not self.moves_kv:
            return 0.0
        per_gpu = tokens * max(self.sender_bytes_per_token, self.receiver_bytes_per_token)
        return per_gpu * self.slowdown / (self.nic_bytes_per_s * self.eta)

    def seconds(self, tokens: int) -> float:
        """Transfer seconds of one prompt on an idle link: wire + fixed latency."""
        return self.wire_seconds(tokens) + (self.latency_s if self.moves_kv else 0.0)


def transfer_link(config: ServingConfig, prefill: ServingConfig, prefill_report: FitReport,
                  decode: ServingConfig, decode_report: FitReport) -> TransferLink:
    """The :class:`TransferLink` between the prefill and decode workers of ``config``.

    Raises:
        ValueError: an unknown ``disaggregation_transfer_backend``.
        ConfigInvalid: unknown GPU.
    """
    backend = config.disaggregation_transfer_backend or "mooncake"
    if backend not in TRANSFER_BACKENDS:
        raise ValueError(f"unknown disaggregation_transfer_backend {backend!r}: "
                         f"{', '.join(TRANSFER_BACKENDS)}")
    gpu = get_gpu(config.gpu)
    eff = efficiency(gpu.name)
    return TransferLink(
        sender_bytes_per_token=prefill_report.kv_bytes_per_token,
        receiver_bytes_per_token=decode_report.kv_bytes_per_token,
        gpus=prefill.attn_tp_size * prefill.pp_size,
        nic_bytes_per_s=gpu.interconnect.nic_bytes_per_s, eta=eff.pd_transfer_eta,
        latency_s=eff.pd_transfer_latency_s,
        slowdown=MOONCAKE_TCP_SLOWDOWN if backend == "mooncake_tcp" else 1.0,
        moves_kv=backend != "fake")


def fit_servers(config: ServingConfig) -> list[tuple[str, int, ServingConfig, FitReport]]:
    """``(role, count, worker config, memory report)`` of every server group of ``config``.

    ``domain.fit.fit_servers`` where it exists, else :func:`domain.fit.fit` of each group's
    worker config (:meth:`ServingConfig.servers`).
    """
    shared = getattr(fit_module, "fit_servers", None)
    if shared is not None:
        out: list[tuple[str, int, ServingConfig, FitReport]] = shared(config)
        return out
    return [(role, n, worker, fit_module.fit(worker)) for role, n, worker in config.servers()]


def decode_limits(worker: ServingConfig, report: FitReport) -> EngineLimits:
    """The scheduler limits of one decode server: its own, radix cache off.

    ``pd_disaggregation_hook.py:96-123``: a decode server runs with ``disable_radix_cache``
    unless ``--disaggregation-decode-enable-radix-cache`` (not modelled).
    """
    return replace(engine_limits(worker, report), radix_cache=False)


@dataclass(slots=True)
class _Flight:
    """One request through the layout (indices into the engines and their records)."""

    arrival: float
    inp: int
    out: int
    path: list[int]
    block: int
    p: int = -1              # prefill scheduler
    p_idx: int = -1          # its index there
    d: int = -1              # decode scheduler
    d_idx: int = -1
    transfer_s: float = 0.0
    prealloc_s: float = math.nan    # the decode server reserved its slot and KV
    prefill_end_s: float = math.nan  # its prefill produced the first token
    kv_sent_s: float = 0.0          # its last KV chunk left the link
    error: str | None = None


@dataclass(frozen=True, slots=True)
class TTFTParts:
    """Where one request's time to first token went (seconds; they sum to its TTFT).

    Attributes:
        prealloc_wait_s: arrival to the decode server's preallocation (its prealloc queue).
        prefill_s: preallocation to the end of its prefill (tokenizer, the prefill server's
            queue, the prefill itself).
        transfer_s: its KV transfer (queue on the link, wire, fixed latency).
        decode_wait_s: KV on the decode server to the first token streamed (the wait for its
            next iteration, plus the pipeline delay ``request_fixed_s``).
    """

    prealloc_wait_s: float
    prefill_s: float
    transfer_s: float
    decode_wait_s: float


@dataclass(slots=True)
class _Pool:
    """The schedulers of one role: engines and the server each belongs to."""

    engines: list[TwinEngine]
    server: list[int]                       # server index of each engine
    ranks: list[list[int]]                  # engine indices of each server
    rr: list[int] = field(default_factory=list)  # DP controller round robin per server

    def pick_rank(self, server: int) -> int:
        """The engine of ``server`` that gets the next request (round robin over its ranks)."""
        ranks = self.ranks[server]
        if len(ranks) == 1:
            return ranks[0]
        if not self.rr:
            self.rr = [0] * len(self.ranks)
        k = ranks[self.rr[server] % len(ranks)]
        self.rr[server] += 1
        return k


class PDSimulation:
    """The event loop of one PD layout (see the module docstring).

    Args:
        prefill: one engine per prefill scheduler, each :meth:`TwinEngine.set_role`
            ``"prefill"``.
        decode: one engine per decode scheduler, role ``"decode"``.
        link: the transfer between them.
        prefill_router: picks a prefill server per request.
        decode_router: picks a decode server per request.
        prefill_servers: server index of each prefill engine (default: one engine a server).
        decode_servers: server index of each decode engine.
        budget: compute budget checked in the loop (None: unbounded).
    """

    def __init__(self, prefill: Sequence[TwinEngine], decode: Sequence[TwinEngine],
                 link: TransferLink, prefill_router: Router, decode_router: Router,
                 prefill_servers: Sequence[int] | None = None,
                 decode_servers: Sequence[int] | None = None,
                 budget: ComputeBudget | None = None) -> None:
        self.P = _pool(prefill, prefill_servers)
        self.D = _pool(decode, decode_servers)
        self.link, self.rp, self.rd, self.budget = link, prefill_router, decode_router, budget
        self.flights: list[_Flight] = []
        self._arrivals: list[tuple[float, int]] = []     # heap of (arrival s, flight)
        self._transfers: list[tuple[float, int]] = []    # heap of (KV on decode s, flight)
        self._queue: list[deque[int]] = [deque() for _ in decode]  # prealloc queues
        self._p_map: list[list[int]] = [[] for _ in prefill]        # engine idx -> flight
        self._d_map: list[list[int]] = [[] for _ in decode]
        self._p_seen = [0] * len(prefill)
        self._p_kv_seen = [0] * len(prefill)
        self._d_seen = [0] * len(decode)
        self._p_last = [0.0] * len(prefill)   # latest submission per prefill engine
        self._link_free = [0.0] * len(prefill)   # each prefill scheduler's NICs (sending)
        self._recv_free = [0.0] * len(decode)    # each decode scheduler's NICs (receiving)
        self._p_sent = [0] * len(self.P.ranks)   # requests routed per prefill server
        self._p_done = [0] * len(self.P.ranks)   # of those, transferred or failed
        self._d_sent = [0] * len(self.D.ranks)
        self._closed: tuple[float, int, int, int] | None = None  # duration, isl, osl, cap
        self.issued = 0

    # ------------------------------------------------------------------ workloads
    def add(self, arrival_s: float, input_tokens: int, output_tokens: int,
            path: Sequence[int] = (), block_tokens: int = 0) -> int:
        """Queue one request arriving at ``arrival_s``; returns its index in :meth:`records`."""
        fid = len(self.flights)
        self.flights.append(_Flight(arrival_s, input_tokens, output_tokens,
                                    list(path) if block_tokens else [], block_tokens))
        heapq.heappush(self._arrivals, (arrival_s, fid))
        self.issued += 1
        return fid

    def closed_loop(self, concurrency: int, duration_s: float, isl: int, osl: int,
                    max_requests: int = 0) -> None:
        """``concurrency`` clients, each sending its next request when it saw the last token.

        New requests are sent until ``duration_s`` virtual seconds or ``max_requests`` requests
        in all (0 = no cap).
        """
        self._closed = (duration_s, isl, osl, max_requests)
        for _ in range(concurrency):
            self.add(0.0, isl, osl)

    # ------------------------------------------------------------------ the loop
    def run(self, progress: SimProgress | None = None) -> None:
        """Simulate until every request finished or failed.

        Raises:
            ComputeBudgetExceeded: the budget ran out or was cancelled.
        """
        P, D = self.P.engines, self.D.engines
        closed = self._closed is not None
        n = 0
        while True:
            n += 1
            if self.budget is not None and not n % CHECK_EVERY:
                self.budget.check()
            ta = self._arrivals[0][0] if self._arrivals else math.inf
            tt = self._transfers[0][0] if self._transfers else math.inf
            tp, ip = math.inf, -1
            for k, e in enumerate(P):
                t = e.next_event_s
                if t < tp:
                    tp, ip = t, k
            td, jd = math.inf, -1
            for k, e in enumerate(D):  # a decode step is an event only when one waits on it
                if closed or self._queue[k]:
                    t = e.next_event_s
                    if t < td:
                        td, jd = t, k
            t = min(ta, tt, tp, td)
            if t == math.inf:
                break
            if tt == t:
                self._transfer_done()
            elif ta == t:
                self._arrive()
                if progress is not None and not len(self.flights) % PROGRESS_EVERY:
                    progress(len(self.flights), len(self.flights) + len(D))
            elif tp == t:
                self._step_prefill(ip)
            else:
                self._step_decode(jd)
        for k, e in enumerate(D):
            e.advance(math.inf)
            if progress is not None:
                progress(len(self.flights) + k + 1, len(self.flights) + len(D))

    def _arrive(self) -> None:
        t, fid = heapq.heappop(self._arrivals)
        f = self.flights[fid]
        rp, rd = self.rp, self.rd
        loads_p: Sequence[int] = self._p_sent
        loads_d: Sequence[int] = self._d_sent
        if rp.needs_load:
            loads_p = [s - d for s, d in zip(self._p_sent, self._p_done, strict=True)]
        if rd.needs_load:
            loads_d = []
            for s, ranks in enumerate(self.D.ranks):
                done = 0
                for k in ranks:
                    self.D.engines[k].advance(t)
                    done += self.D.engines[k].finished_by(t)
                loads_d.append(self._d_sent[s] - done)
        ps = rp.pick(f.path, f.block, f.inp, loads_p)
        ds = rd.pick(f.path, f.block, f.inp, loads_d)
        self._p_sent[ps] += 1
        self._d_sent[ds] += 1
        f.p, f.d = self.P.pick_rank(ps), self.D.pick_rank(ds)
        pl, dl = self.P.engines[f.p].lim, self.D.engines[f.d].lim
        reserved = self.D.engines[f.d].pd_reserved_tokens
        if f.inp + 1 > pl.kv_tokens or f.inp + 1 > pl.context_len:
            f.error = (f"The input ({f.inp} tokens) exceeds the prefill server's KV pool "
                       f"({pl.kv_tokens}) or context length ({pl.context_len})")
        elif f.inp + f.out > dl.context_len or f.inp + max(reserved, f.out) > dl.kv_tokens:
            f.error = (f"The input ({f.inp} tokens) plus max_new_tokens ({f.out}) exceeds the "
                       f"decode server's KV pool ({dl.kv_tokens}, {reserved} reserved decode "
                       f"tokens) or context length ({dl.context_len})")
        if f.error is not None:
            self._p_done[ps] += 1
            return
        self.D.engines[f.d].advance(t)
        self._queue[f.d].append(fid)
        self._try_prealloc(f.d, t)

    def _try_prealloc(self, d: int, t: float) -> None:
        """Preallocate the head of decode scheduler ``d``'s queue while it fits (FIFO)."""
        e, q = self.D.engines[d], self._queue[d]
        while q:
            fid = q[0]
            f = self.flights[fid]
            if not e.prealloc_fits(f.inp, f.out):
                return
            q.popleft()
            at = max(t, e.now)
            f.prealloc_s = at
            f.d_idx = e.preallocate(at, f.inp, f.out)
            self._d_map[d].append(fid)
            # the prefill server's bootstrap queue hands it to its waiting queue now
            pe = self.P.engines[f.p]
            at = max(at, self._p_last[f.p])
            self._p_last[f.p] = at
            f.p_idx = pe.submit(at, f.inp, 1, f.path, f.block if f.path else 0)
            self._p_map[f.p].append(fid)

    def _step_prefill(self, k: int) -> None:
        e = self.P.engines[k]
        e.advance(e.next_event_s + _STEP)
        link, p_map, flights = self.link, self._p_map[k], self.flights
        sent = e.kv_sent_since(self._p_kv_seen[k])
        self._p_kv_seen[k] += len(sent)
        recv = self._recv_free
        for at, idx, tokens in sent:  # each chunk's KV queues on both ends' NICs
            f = flights[p_map[idx]]
            end = max(at, self._link_free[k], recv[f.d]) + link.wire_seconds(tokens)
            f.kv_sent_s = self._link_free[k] = recv[f.d] = end
        new = e.ended_since(self._p_seen[k])
        self._p_seen[k] += len(new)
        for idx, end in new:
            fid = self._p_map[k][idx]
            f = self.flights[fid]
            err = e.progress(idx, 1 << 30).error
            if err is not None:
                f.error = err
                self._p_done[self.P.server[k]] += 1
                self.D.engines[f.d].release_held(f.d_idx, end)
                continue
            f.prefill_end_s = end
            done = max(end, f.kv_sent_s) + (link.latency_s if link.moves_kv else 0.0)
            f.transfer_s = done - end
            heapq.heappush(self._transfers, (done, fid))

    def _transfer_done(self) -> None:
        t, fid = heapq.heappop(self._transfers)
        f = self.flights[fid]
        self.P.engines[f.p].release_held(f.p_idx, t)
        self._p_done[self.P.server[f.p]] += 1
        e = self.D.engines[f.d]
        e.advance(t)
        e.join_prefilled(f.d_idx, t)
        self._try_prealloc(f.d, t)

    def _step_decode(self, d: int) -> None:
        e = self.D.engines[d]
        e.advance(e.next_event_s + _STEP)
        if self._closed is not None:
            duration, isl, osl, cap = self._closed
            new = e.ended_since(self._d_seen[d])
            self._d_seen[d] += len(new)
            for _, seen in new:
                if seen < duration and (not cap or self.issued < cap):
                    self.add(seen, isl, osl)
        self._try_prealloc(d, e.now)

    # ------------------------------------------------------------------ results
    def records(self) -> list[RequestRecord]:
        """One record per request, in the order they were added (virtual seconds).

        Times are the client's: arrival at the router, first token and finish as streamed by
        the decode server; ``transfer_s`` is the KV transfer inside the TTFT.
        """
        per = [e.records() for e in self.D.engines]
        out = []
        for f in self.flights:
            if f.error is None and f.d_idx >= 0:
                r = per[f.d][f.d_idx]
                if r.error is None:
                    out.append(RequestRecord(
                        arrival_s=f.arrival, input_tokens=f.inp, output_tokens=f.out,
                        first_token_s=r.first_token_s, finish_s=r.finish_s, itl_s=r.itl_s,
                        transfer_s=f.transfer_s))
                    continue
                f.error = r.error
            out.append(RequestRecord(arrival_s=f.arrival, input_tokens=f.inp, output_tokens=0,
                                     error=f.error or "request did not finish"))
        return out

    def ttft_parts(self, records: Sequence[RequestRecord]) -> list[TTFTParts | None]:
        """The :class:`TTFTParts` of each request of :meth:`records` (None where it failed)."""
        out: list[TTFTParts | None] = []
        for f, r in zip(self.flights, records, strict=True):
            if r.error is not None:
                out.append(None)
                continue
            kv_at = f.prefill_end_s + f.transfer_s
            out.append(TTFTParts(f.prealloc_s - f.arrival, f.prefill_end_s - f.prealloc_s,
                                 f.transfer_s, r.first_token_s - kv_at))
        return out

    def stats(self) -> list[ReplicaStats]:
        """One ReplicaStats per scheduler: the prefill ones, then the decode ones.

        ``replica`` is the server's index within its role, ``requests`` what its engine saw.
        """
        out = []
        for role, pool, sent in (("prefill", self.P, self._p_map),
                                 ("decode", self.D, self._d_map)):
            for k, e in enumerate(pool.engines):
                s = _stats(pool.server[k], len(sent[k]), e.stats)
                out.append(s.model_copy(update={"role": role}))
        return out


def _pool(engines: Sequence[TwinEngine], servers: Sequence[int] | None) -> _Pool:
    srv = list(servers) if servers is not None else list(range(len(engines)))
    ranks: list[list[int]] = [[] for _ in range(max(srv) + 1)] if srv else []
    for k, s in enumerate(srv):
        ranks[s].append(k)
    return _Pool(list(engines), srv, ranks)


# ---------------------------------------------------------------------------- building a run
@dataclass(frozen=True, slots=True)
class _Group:
    count: int
    worker: ServingConfig
    report: FitReport
    limits: EngineLimits


def _groups(config: ServingConfig) -> tuple[_Group, _Group]:
    by_role = {role: (n, worker, rep) for role, n, worker, rep in fit_servers(config)}
    np_, pw, pr = by_role["prefill"]
    nd, dw, dr = by_role["decode"]
    return (_Group(np_, pw, pr, engine_limits(pw, pr)),
            _Group(nd, dw, dr, decode_limits(dw, dr)))


def build(config: ServingConfig, budget: ComputeBudget | None = None,
          router_seed: int = ROUTER_SEED) -> PDSimulation:
    """The :class:`PDSimulation` of a PD ``config``: every server fitted and engined.

    Each server runs ``worker.schedulers`` engines (its attention-DP ranks / dp copies, each
    with its own queue, KV pool and cap; round robin over them); prefill servers share one
    prefix-path index (their radix caches are their own).

    Raises:
        ValueError: ``config.pd`` is None, or an unknown transfer backend.
    """
    if config.pd is None:
        raise ValueError("not a PD layout: pd is None")
    pg, dg = _groups(config)
    index = PathIndex()
    p_cost, d_cost = build_cost_model(pg.worker, pg.report), build_cost_model(dg.worker,
                                                                             dg.report)
    prefill, p_srv = [], []
    for s in range(pg.count):
        for _ in range(pg.worker.schedulers):
            e = TwinEngine(p_cost, pg.limits, new_cache(pg.limits, index), budget)
            e.set_role("prefill")
            prefill.append(e)
            p_srv.append(s)
    decode, d_srv = [], []
    extra = decode_extra_slots(dg.worker)
    for s in range(dg.count):
        for _ in range(dg.worker.schedulers):
            e = TwinEngine(d_cost, dg.limits, None, budget)
            e.set_role("decode", extra_slots=extra,
                       reserved_decode_tokens=NUM_RESERVED_DECODE_TOKENS)
            decode.append(e)
            d_srv.append(s)
    link = transfer_link(config, pg.worker, pg.report, dg.worker, dg.report)
    policy = config.router_policy
    rp = Router(policy, pg.count, config.router_cache_threshold,
                config.router_balance_abs_threshold, config.router_balance_rel_threshold,
                router_seed)
    rd = Router(policy, dg.count, config.router_cache_threshold,
                config.router_balance_abs_threshold, config.router_balance_rel_threshold,
                router_seed + 1)
    return PDSimulation(prefill, decode, link, rp, rd, p_srv, d_srv, budget)


def simulate_open_loop(config: ServingConfig, report: FitReport, requests: Sequence[Any],
                       progress: SimProgress | None = None,
                       budget: ComputeBudget | None = None,
                       ) -> tuple[list[RequestRecord], list[ReplicaStats]]:
    """:func:`domain.twin.cluster.simulate_open_loop` for a PD config (same arguments).

    ``report`` is not used: every server group is fitted on its own worker config
    (:func:`fit_servers`). Requests carrying prefix blocks reuse the prefill servers' radix
    caches (the decode servers have none).

    Returns:
        Records in the order of ``requests`` (``transfer_s`` set) and one ReplicaStats per
        scheduler (``role`` prefill or decode).

    Raises:
        ComputeBudgetExceeded: ``budget`` ran out or was cancelled.
    """
    del report
    sim = replay(config, requests, progress, budget)
    return sim.records(), sim.stats()


def replay(config: ServingConfig, requests: Sequence[Any], progress: SimProgress | None = None,
           budget: ComputeBudget | None = None) -> PDSimulation:
    """The :class:`PDSimulation` of ``requests`` on a PD ``config``, run to the end.

    Its :meth:`~PDSimulation.records`, :meth:`~PDSimulation.stats` and
    :meth:`~PDSimulation.ttft_parts` are what :func:`simulate_open_loop` returns and more.

    Raises:
        ComputeBudgetExceeded: ``budget`` ran out or was cancelled.
    """
    sim = build(config, budget)
    index = next((e.cache.index for e in sim.P.engines if e.cache is not None), PathIndex())
    for req in requests:
        hashes, block = (req[3], req[4]) if len(req) > 3 else ((), 0)
        path = index.path(hashes) if block else []
        sim.add(req[0], req[1], req[2], path, block if path else 0)
    sim.run(progress)
    return sim


def simulate_closed_loop(config: ServingConfig, report: FitReport, concurrency: int,
                         duration_s: float, isl: int, osl: int, max_requests: int = 0,
                         progress: SimProgress | None = None,
                         budget: ComputeBudget | None = None, router_seed: int = ROUTER_SEED,
                         ) -> tuple[list[RequestRecord], list[ReplicaStats]]:
    """:func:`domain.twin.cluster.simulate_closed_loop` for a PD config (same arguments).

    Every client sends its next request when the decode server streamed its last token; the
    requests are routed as they are sent. ``report`` is not used (:func:`simulate_open_loop`).

    Raises:
        ValueError: if concurrency < 1.
        ComputeBudgetExceeded: ``budget`` ran out or was cancelled.
    """
    del report
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    sim = build(config, budget, router_seed)
    sim.closed_loop(concurrency, duration_s, isl, osl, max_requests)
    sim.run(None)
    if progress is not None:
        progress(1, 1)
    return sim.records(), sim.stats()


def _decode_steps(lim: EngineLimits, batch: int, out_tokens: float) -> float:
    per_step = batch * (accept_length(lim.spec, batch) if lim.spec is not None else 1.0)
    return out_tokens / per_step


def estimate_open_loop(config: ServingConfig, requests: Sequence[Any]) -> SimCost:
    """The work of :func:`simulate_open_loop` on ``requests``, estimated in O(requests).

    Prefill steps (prompt tokens in chunks over the prefill schedulers) plus decode steps at
    the largest batch the decode schedulers' slots and KV pools hold (a lower estimate); each
    request is recorded by two engines.
    """
    pg, dg = _groups(config)
    n = len(requests)
    fit_in = fit_out = fits = 0
    for req in requests:
        inp, out = req[1], req[2]
        if inp + out <= dg.limits.context_len and inp + 1 <= pg.limits.kv_tokens \
                and inp + max(out, NUM_RESERVED_DECODE_TOKENS) <= dg.limits.kv_tokens:
            fit_in += inp
            fit_out += out
            fits += 1
    if not fits:
        return SimCost(0, n, 0)
    ranks = max(1, dg.count * dg.worker.schedulers)
    b = _batch(dg.limits, fits / ranks, (fit_in + fit_out / 2) / fits)
    steps = fit_in / _chunk(pg.limits) + fits + _decode_steps(dg.limits, b, fit_out)
    return SimCost(steps, 2 * n, fit_out)


def estimate_closed_loop(config: ServingConfig, concurrency: int, duration_s: float, isl: int,
                         osl: int, max_requests: int = 0) -> SimCost:
    """The work of :func:`simulate_closed_loop`, estimated in O(1).

    Each decode scheduler keeps a batch of its clients (as its slots and KV pool allow) busy
    for ``duration_s`` at its cost model's step time; every request also costs its prefill
    chunks; the closed loop visits every decode step (windows of one step).
    """
    pg, dg = _groups(config)
    if isl + osl > dg.limits.context_len or isl + 1 > pg.limits.kv_tokens:
        return SimCost(0, concurrency, 0)
    ranks = max(1, dg.count * dg.worker.schedulers)
    share = concurrency / ranks
    ctx = isl + osl / 2
    b = _batch(dg.limits, share, ctx)
    cost = build_cost_model(dg.worker, dg.report)
    round_s = max(osl * cost.decode_time(b, int(b * ctx)), 1e-9)
    n = ranks * (share + b * duration_s / round_s)
    if max_requests:
        n = min(n, max(concurrency, max_requests))
    steps = n * isl / _chunk(pg.limits) + n + 2 * _decode_steps(dg.limits, b, n * osl)
    return SimCost(steps, 2 * n, n * osl)
