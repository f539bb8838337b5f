"""What an injected fault (:mod:`domain.faults`) looks like from outside the twin.

Each fault is shown only through what a real cluster would show -- the engine's log lines, the
kubelet's verdict in the ``servetune:`` line the cluster backends add, failed requests with the
load generator's error classes -- so the classifier reads it exactly as it would read the real
thing (sglang-knobs reference, section 3.2; the local backend's readiness message).

Faults are injected only into a startup that would otherwise be Ready: a config the engine
refuses fails the way it always does.
"""

from __future__ import annotations

import math
from dataclasses import replace

from domain.config import ServingConfig
from domain.engines import engine_for
from domain.faults import BenchFault, DeployFault
from domain.hardware import get_gpu
from domain.metrics import RequestRecord
from domain.twin.startup import Startup

READY_TIMEOUT_S = 600.0  # the local backend's default readiness timeout
DEATH_AT = 0.4  # share of a run's span after which the server dies
STALL_AT = 0.3  # share of a run's span after which the harness stalls
GARBAGE_EVERY = 4  # every 4th completed request of a garbage run is corrupted


def _before(log: list[str], marker: str) -> list[str]:
    """The lines of ``log`` before the first that starts with ``marker`` (all if none)."""
    i = next((i for i, x in enumerate(log) if x.startswith(marker)), len(log))
    return log[:i]


def inject_startup(ok: Startup, fault: DeployFault, config: ServingConfig) -> Startup:
    """The startup of ``config`` when ``fault`` strikes a launch that would be ``ok`` (Ready)."""
    image = engine_for(config).image
    if fault == "oom":  # another tenant holds memory: the shard no longer fits at load
        gib = get_gpu(config.gpu).hbm_bytes / 2**30
        log = _before(ok.log, "Load weight end") + [
            "Traceback (most recent call last):",
            '  File "sglang/srt/model_loader/loader.py", in load_model',
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has "
            f"a total capacity of {gib:.2f} GiB of which 1.02 GiB is free."]
        return Startup(ready=False, phase="load_weights", exit_code=1, log=log)
    if fault == "crash_loop":
        log = ok.log + [
            "Scheduler hit an exception: Traceback (most recent call last):",
            '  File "sglang/srt/managers/scheduler.py", in event_loop_overlap',
            "RuntimeError: CUDA error: an illegal memory access was encountered",
            "Received sigquit from a child process. It usually means the child failed.",
            "servetune: replica 0 container sglang: CrashLoopBackOff (last: Error), exit code 1 "
            "(back-off restarting failed container, 3 restarts)"]
        return Startup(ready=False, phase="serving", exit_code=1, log=log)
    if fault == "image_pull":
        log = [f"servetune: replica 0 has not started: container sglang: ImagePullBackOff "
               f'(Back-off pulling image "{image}": rpc error: code = Unknown desc = failed to '
               "pull and unpack image: dial tcp: i/o timeout)"]
        return Startup(ready=False, phase="startup", exit_code=-1, log=log)
    stalled = _before(ok.log, "Capture ")  # ready_timeout: JIT compilation never finishes
    last = stalled[-1] if stalled else ""
    log = stalled + [f"servetune: replica 0 not ready after {READY_TIMEOUT_S:g} s; last log "
                     f"line: {last}"]
    return Startup(ready=False, phase="startup", exit_code=-1, log=log,
                   startup_s=READY_TIMEOUT_S)


def inject_records(recs: list[RequestRecord], fault: BenchFault) -> list[RequestRecord]:
    """The records a saturation run returns when ``fault`` strikes it.

    - ``server_death``: at 40 % of the run the server dies: requests in flight fail as
      ``disconnect``, later ones as ``connect`` (refused).
    - ``bench_timeout``: at 30 % of the run the harness stalls: every request not finished by
      then fails as ``timeout``.
    - ``bench_garbage``: every 4th completed request has its first token before its send and
      its finish before its first token (the sanity checks of the bench server catch them).
    """
    if not recs:
        return recs
    t0 = min(r.arrival_s for r in recs)
    t1 = max((r.finish_s for r in recs if math.isfinite(r.finish_s)), default=t0)
    out: list[RequestRecord] = []
    if fault == "bench_garbage":
        done = 0
        for r in recs:
            if r.error is None:
                done += 1
                if done % GARBAGE_EVERY == 0:
                    r = replace(r, first_token_s=r.arrival_s - 1.0, finish_s=r.arrival_s - 2.0)
            out.append(r)
        return out
    cut = t0 + (DEATH_AT if fault == "server_death" else STALL_AT) * (t1 - t0)
    for r in recs:
        if r.error is not None or r.finish_s <= cut:
            out.append(r)
        elif fault == "bench_timeout":
            out.append(replace(r, error="timeout: no complete response within the request "
                               "timeout (600 s)", first_token_s=math.nan, finish_s=math.nan))
        elif r.arrival_s <= cut:
            out.append(replace(r, error="disconnect: the connection dropped before data: [DONE] "
                               "(server closed the connection)", first_token_s=math.nan,
                               finish_s=math.nan))
        else:
            out.append(replace(r, error="connect: [Errno 111] Connection refused",
                               first_token_s=math.nan, finish_s=math.nan))
    return out
