"""Twin engine v0: a discrete-event simulation of one SGLang server (one replica) in virtual time.

Mechanics (SGLang 0.5.23 scheduler, ``managers/scheduler.py`` and ``schedule_policy.py``):

- Arrivals enter a FCFS waiting queue.
- Each iteration runs either a prefill (extend) batch or a decode batch; prefill has priority
  whenever a waiting request can be admitted, as in ``get_next_batch_to_run``.
- Admission (``PrefillAdder``) needs a free request slot (running < max_running_requests) and
  enough KV: free tokens minus the decode tokens reserved for running requests
  (remaining output x ``new_token_ratio``) must cover the new prompt plus its own reservation.
  ``new_token_ratio`` starts at 0.7 x schedule_conservativeness, decays linearly to 0.14 x that
  over 600 decode steps and is reset on retraction (SGLang's ``SGLANG_INIT_NEW_TOKEN_RATIO``,
  ``SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR``, ``SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS`` defaults).
- A prefill batch holds at most ``chunked_prefill_size`` new tokens; a longer prompt is split
  into chunks over several iterations (one chunked request at a time).
- Decode batches every running request (continuous batching); if the KV pool cannot hold the
  next token of every request, requests with the fewest generated tokens are retracted to the
  front of the queue and recomputed later (``retract_decode``).
- The first token is produced by the last prefill chunk (TTFT = its end - arrival).

Implementation note: decode iterations are O(1) in the batch size. Every decode step end time
is appended to one array; a request that decoded over steps [a, b) produced its tokens at
those times, so inter-token gaps are read back from that array at the end.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from domain.costmodel import StepCostModel
from domain.metrics import RequestRecord

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
MAX_PREFILL_TOKENS = 16384  # --max-prefill-tokens default (sglang-knobs reference 1.3)


@dataclass(slots=True)
class _Req:
    idx: int
    arrival: float
    input: int
    output: int
    target: int = 0           # tokens to prefill (input, or input + generated after retraction)
    prefilled: int = 0
    generated: int = 0
    first_token: float = math.nan
    finish: float = math.nan
    seg_start: int = -1       # decode index where the current decode segment started
    seg_gen: int = 0          # generated count at seg_start
    epoch: int = 0            # bumps on retraction (lazy heap deletion)
    segments: list[tuple[int, int]] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Resolved per-replica limits the scheduler enforces."""

    kv_tokens: int
    max_running_requests: int
    chunked_prefill_size: int
    context_len: int
    schedule_conservativeness: float = 1.0
    index_topk: int = 0  # DSA attended-token cap (0 = dense)


@dataclass
class EngineStats:
    """Counters of one simulated run (for reports and over-admission detection)."""

    prefill_steps: int = 0
    decode_steps: int = 0
    retractions: int = 0
    max_running: int = 0
    busy_s: float = 0.0
    decode_batch_sum: int = 0

    @property
    def mean_decode_batch(self) -> float:
        """Mean number of sequences per decode step."""
        return self.decode_batch_sum / self.decode_steps if self.decode_steps else 0.0


class TwinEngine:
    """One simulated SGLang replica. Feed arrivals, call :meth:`run`, read records."""

    def __init__(self, cost: StepCostModel, limits: EngineLimits) -> None:
        self.cost, self.lim = cost, limits
        self.stats = EngineStats()

    def run(self, arrivals: Sequence[tuple[float, int, int]] = (), *,
            closed_loop: tuple[int, float, int, int] | None = None,
            max_virtual_s: float = 1e7) -> list[RequestRecord]:
        """Simulate until every request finished; return one record per request.

        Args:
            arrivals: open-loop requests as (arrival_s, input_tokens, output_tokens), sorted.
            closed_loop: (concurrency, duration_s, isl, osl): that many clients each send a new
                request when their previous one finishes, until duration_s; then drain.
            max_virtual_s: safety cap on virtual time (s); unfinished requests get an error.

        Returns:
            RequestRecords in request order (times in virtual seconds).
        """
        lim, cost = self.lim, self.cost
        reqs: list[_Req] = []
        pending = deque(arrivals)
        if closed_loop:
            conc, duration, isl, osl = closed_loop
            for _ in range(conc):
                pending.append((0.0, isl, osl))
        waiting: deque[_Req] = deque()
        running: dict[int, _Req] = {}
        heap: list[tuple[int, int, int]] = []   # (finish decode index, epoch, idx)
        T: list[float] = []                      # decode step end times
        now = 0.0
        kv_running = 0       # KV tokens held by running requests
        kv_prefill = 0       # KV tokens held by the (partially) prefilled chunked request
        rem_out = 0          # sum of remaining output tokens of running requests
        chunked: _Req | None = None
        init_ratio = min(1.0, INIT_NEW_TOKEN_RATIO * lim.schedule_conservativeness)
        min_ratio = init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR
        decay = (init_ratio - min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        ratio = init_ratio
        budget = min(lim.chunked_prefill_size, MAX_PREFILL_TOKENS) \
            if lim.chunked_prefill_size > 0 else MAX_PREFILL_TOKENS
        topk = lim.index_topk

        def finish(r: _Req, t: float) -> None:
            nonlocal kv_running
            r.finish = t
            kv_running -= r.input + r.generated
            if closed_loop and t < closed_loop[1]:
                pending.appendleft((t, closed_loop[2], closed_loop[3]))

        def join_running(r: _Req) -> None:
            nonlocal kv_running, rem_out
            r.seg_start, r.seg_gen = len(T), r.generated
            running[r.idx] = r
            kv_running += r.input + r.generated
            rem_out += r.output - r.generated
            heapq.heappush(heap, (len(T) + r.output - r.generated - 1, r.epoch, r.idx))

        while True:
            while pending and pending[0][0] <= now:
                a, i, o = pending.popleft()
                r = _Req(idx=len(reqs), arrival=a, input=i, output=o, target=i)
                reqs.append(r)
                if i + o > lim.context_len or i + 1 > lim.kv_tokens:
                    r.error = (f"The input ({i} tokens) plus max_new_tokens ({o}) exceeds the "
                               f"KV pool ({lim.kv_tokens}) or context length ({lim.context_len})")
                    r.finish = a
                    continue
                waiting.append(r)
            if now > max_virtual_s:
                for r in reqs:
                    if math.isnan(r.finish):
                        r.error, r.finish = "virtual time cap reached", now
                break
            # ---- try to form a prefill batch ----
            chunks: list[tuple[_Req, int]] = []
            left = budget
            if chunked is not None:
                c = min(chunked.target - chunked.prefilled, left)
                chunks.append((chunked, c))
                left -= c
            n_slots = len(running) + (1 if chunked is not None else 0)
            # KV the chunked request will hold once its prompt is in, plus its decode reservation
            held = (chunked.target + ratio * (chunked.output - chunked.generated)) \
                if chunked is not None else 0.0
            while waiting and left > 0 and n_slots < lim.max_running_requests:
                r = waiting[0]
                free = lim.kv_tokens - kv_running - held - ratio * rem_out
                need = r.target + ratio * (r.output - r.generated)
                if need > free:
                    break
                waiting.popleft()
                c = min(r.target, left)
                chunks.append((r, c))
                left -= c
                n_slots += 1
                held += need
                if c < r.target:
                    chunked = r  # this one continues in the next prefill batch
            if chunks:
                new_tok = sum(c for _, c in chunks)
                attn = 0.0
                index = 0.0
                for r, c in chunks:
                    ctx = r.prefilled + c / 2
                    attn += c * (min(ctx, topk) if topk else ctx)
                    index += c * ctx if topk else 0.0
                dt = cost.prefill_time(new_tok, attn, index)
                now += dt
                self.stats.prefill_steps += 1
                self.stats.busy_s += dt
                for r, c in chunks:
                    r.prefilled += c
                    if r is chunked and r.prefilled < r.target:
                        kv_prefill = r.prefilled
                        continue
                    if r is chunked:
                        chunked, kv_prefill = None, 0
                    # prefill complete: it yields one token
                    r.generated += 1
                    if math.isnan(r.first_token):
                        r.first_token = now
                    if r.generated >= r.output:
                        r.finish = now
                        r.segments.append((len(T), len(T)))
                        if closed_loop and now < closed_loop[1]:
                            pending.appendleft((now, closed_loop[2], closed_loop[3]))
                        continue
                    join_running(r)
                continue
            # ---- decode ----
            if running:
                n = len(running)
                while kv_running + kv_prefill + n > lim.kv_tokens and len(running) > 1:
                    k_now = len(T)
                    victim = min(running.values(),
                                 key=lambda x: (x.seg_gen + k_now - x.seg_start, -x.input))
                    del running[victim.idx]
                    gen_now = victim.seg_gen + (len(T) - victim.seg_start)
                    victim.segments.append((victim.seg_start, len(T)))
                    kv_running -= victim.input + gen_now
                    rem_out -= victim.output - gen_now
                    victim.generated = gen_now
                    victim.epoch += 1
                    victim.target, victim.prefilled = victim.input + gen_now, 0
                    waiting.appendleft(victim)
                    self.stats.retractions += 1
                    ratio = init_ratio
                    n = len(running)
                dt = cost.decode_time(n, kv_running)
                now += dt
                T.append(now)
                self.stats.decode_steps += 1
                self.stats.decode_batch_sum += n
                self.stats.max_running = max(self.stats.max_running, n)
                self.stats.busy_s += dt
                kv_running += n
                rem_out -= n
                ratio = max(min_ratio, ratio - decay)
                k = len(T) - 1
                while heap and heap[0][0] <= k:
                    _, ep, idx = heapq.heappop(heap)
                    done = running.get(idx)
                    if done is None or done.epoch != ep:
                        continue
                    del running[idx]
                    done.generated = done.output
                    done.segments.append((done.seg_start, k + 1))
                    finish(done, now)
                continue
            # ---- idle: jump to the next arrival ----
            if pending:
                now = max(now, pending[0][0])
                continue
            if waiting:  # nothing runs and the head cannot be admitted: it never fits
                r = waiting.popleft()
                r.error, r.finish = "request exceeds the KV pool after reservations", now
                continue
            break
        return self._records(reqs, np.asarray(T))

    @staticmethod
    def _records(reqs: list[_Req], T: np.ndarray) -> list[RequestRecord]:
        out = []
        for r in reqs:
            if r.error is not None:
                out.append(RequestRecord(arrival_s=r.arrival, input_tokens=r.input,
                                         output_tokens=0, error=r.error))
                continue
            times = [np.array([r.first_token])] + [T[a:b] for a, b in r.segments]
            tok = np.concatenate(times)
            out.append(RequestRecord(
                arrival_s=r.arrival, first_token_s=r.first_token, finish_s=r.finish,
                input_tokens=r.input, output_tokens=r.output, itl_s=np.diff(tok)))
        return out
