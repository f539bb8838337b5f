"""``servetune twin serve``: the twin engine in real time behind an OpenAI-compatible server.

Three layers, each against what can be computed without the server:

- the engine's incremental read-back (``TwinEngine.progress``) equals its final records;
- the real-time driver (``RealtimeTwin``) polled on a simulated clock reproduces the offline
  simulation of the same arrivals exactly, with or without late polls;
- the HTTP server (a subprocess on 127.0.0.1, port 0, ``--speedup 4``) streams tokens whose
  client-measured times match the offline simulation of the same request, queues beyond the
  admission cap (seen in ``/metrics``), refuses over-long requests with SGLang's 400 body, and
  is what the cluster server's local backend starts without a GPU.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from fixtures.step_cost import StepCost
from typer.testing import CliRunner

from domain.config import ServingConfig
from domain.twin.cluster import simulate_open_loop
from domain.twin.engine import EngineLimits, TwinEngine
from domain.twin.prefix_cache import PathIndex, PrefixCache
from domain.twin.realtime import BLOCK_TOKENS, RealtimeTwin, block_hashes
from domain.twin.startup import start
from servetune.cli import app

REPO = Path(__file__).resolve().parents[2]
SPEEDUP = 4.0
# Llama-3.1-70B FP8 on one H200: TTFT ~0.14 s, ITL ~24 ms at low load (slow enough that the
# timing at 4x is several milliseconds per token); 2 replicas with an admission cap of 4 each.
CONFIG = dict(model="llama-3.1-70b", gpu="H200", tp_size=1, weights="fp8", replicas=2,
              router_policy="cache_aware", max_running_requests=4)


def cfg(**over) -> ServingConfig:
    return ServingConfig(**{**CONFIG, **over})


def fit_of(config: ServingConfig):
    boot = start(config)
    assert boot.ready, boot.reason
    return boot.fit


def offline_times(config: ServingConfig, requests) -> list[np.ndarray]:
    """Every request's token times (virtual s) from the offline replay of ``requests``."""
    recs, _ = simulate_open_loop(config, fit_of(config), requests)
    return [np.concatenate([[r.first_token_s], r.first_token_s + np.cumsum(r.itl_s)])
            for r in recs]


# ---------------------------------------------------------------- engine read-back
def small_engine(**kw) -> TwinEngine:
    lim = EngineLimits(**{**dict(kv_tokens=10_000, max_running_requests=64,
                                 chunked_prefill_size=8, context_len=100_000), **kw})
    return TwinEngine(StepCost(), lim, PrefixCache(PathIndex()) if lim.radix_cache else None)


def test_progress_reads_back_the_records_token_times_retractions_included():
    # pool 30: two 10+10 requests are admitted, one is retracted and recomputed (chunked
    # prefill of 8 tokens per step on the way)
    eng = small_engine(kv_tokens=30, radix_cache=False, schedule_conservativeness=0.1)
    for a in (0.0, 0.0, 3.0):
        eng.submit(a, 10, 10)
    partial: list[list[float]] = [[], [], []]
    while eng.busy:  # read incrementally, as the driver does, one virtual second at a time
        eng.advance(eng.now + 1.0)
        for i in range(3):
            partial[i] += eng.progress(i, len(partial[i])).token_times
    assert eng.stats.retractions >= 1
    for i, r in enumerate(eng.records()):
        t = np.array(partial[i])
        assert len(t) == r.output_tokens == 10
        assert t[0] == r.first_token_s and t[-1] == r.finish_s
        assert np.diff(t) == pytest.approx(r.itl_s)
        assert eng.progress(i).token_times == partial[i]  # all at once = piece by piece


def test_progress_with_speculative_chunks(monkeypatch):
    import domain.twin.engine as en
    from domain.speculative import SpecParams
    monkeypatch.setattr(en, "accept_length", lambda params, batch: 2.0)
    monkeypatch.setattr(en, "steps_for_batch", lambda params, batch: 3)
    monkeypatch.setattr(en, "draft_tokens_for_batch", lambda params, batch: 4)
    eng = small_engine(spec=SpecParams(algorithm="EAGLE", num_steps=3, topk=1,
                                       draft_tokens=4, adaptive=False, accept_rate=0.5))
    eng.submit(0.0, 8, 7)
    eng.advance(math.inf)
    # prefill 0.8 s -> token 1; each 2 s step emits 2 tokens; the last step only 1 is needed
    assert eng.progress(0).token_times == pytest.approx([0.8, 2.8, 2.8, 4.8, 4.8, 6.8, 6.8])
    assert eng.progress(0, 5).token_times == pytest.approx([6.8, 6.8])


def test_abort_frees_the_slot_for_the_queue():
    eng = small_engine(max_running_requests=1, chunked_prefill_size=-1)
    eng.submit(0.0, 10, 100)
    eng.submit(0.0, 10, 5)
    eng.advance(3.0)  # A: prefill 1 s, decoding; B queued behind the cap
    assert (eng.load().running, eng.load().queued) == (1, 1)
    assert eng.abort(0) and not eng.abort(0)
    eng.advance(math.inf)
    a, b = eng.records()
    assert a.error == "aborted by the client"
    # B is admitted at the first iteration after the abort (t = 3): prefill 1 s, 4 decodes
    assert (b.first_token_s, b.finish_s) == pytest.approx((4.0, 8.0))
    assert eng.load().used_kv_tokens == 0 and not eng.busy


def test_abort_mid_chunked_prefill_releases_its_cache_locks():
    eng = small_engine(chunked_prefill_size=4)
    idx = eng.cache.index
    eng.submit(0.0, 8, 1, idx.path([1, 2]), 4)      # puts blocks 1, 2 in the cache
    eng.advance(math.inf)
    eng.submit(5.0, 20, 3, idx.path([1, 2, 3, 4, 5]), 4)  # 8 cached, 12 new: 3 chunks
    eng.advance(5.1)  # first chunk of 4 tokens runs 5.0 -> 5.4
    assert eng.load().running == 1 and eng.load().used_kv_tokens == 12  # 8 locked + 4 new
    assert eng.abort(1)
    assert eng.load().used_kv_tokens == 0 and not eng.busy
    assert eng.cache.evictable_tokens == eng.cache.device_tokens == 8  # nothing stays locked
    eng.submit(6.0, 8, 1, idx.path([1, 2]), 4)
    eng.advance(math.inf)
    assert eng.records()[2].error is None and eng.records()[1].error == "aborted by the client"


# ---------------------------------------------------------------- the real-time driver
def test_block_hashes_name_prefixes():
    a = [f"w{i}" for i in range(40)]
    b = a[:32] + ["x"] * 8
    ha, hb = block_hashes(a), block_hashes(b)
    assert len(ha) == 40 // BLOCK_TOKENS == 2
    assert ha == hb  # the differing words are in the partial third block
    assert block_hashes(["x"] + a[1:])[1] != ha[1]  # same block after another prefix
    assert block_hashes(list(range(20))) == block_hashes(list(range(20)))


def _workload(n: int = 40, seed: int = 1):
    """Poisson arrivals at 8 req/s, half of them sharing a 256-token system prompt."""
    rng = random.Random(seed)
    system = [f"s{i}" for i in range(256)]
    t, reqs = 0.0, []
    for i in range(n):
        t += rng.expovariate(8.0)
        words = (system if i % 2 else []) + [f"u{i}-{j}" for j in range(rng.randint(50, 900))]
        reqs.append((t, len(words), rng.randint(5, 60), block_hashes(words), BLOCK_TOKENS))
    return reqs


def _drive(twin: RealtimeTwin, reqs, lateness_s: float, seed: int = 0):
    """Poll ``twin`` as the server does (at next_wake, ``lateness_s`` late at most) while
    submitting ``reqs`` at their arrival times; returns token times and release lateness."""
    rng = random.Random(seed)
    rids, late = [], []
    due = {}
    k = 0
    while k < len(reqs) or twin.in_flight:
        wake = twin.next_wake() + rng.uniform(0, lateness_s)
        if k < len(reqs) and reqs[k][0] <= wake:
            a, n_in, n_out, hashes, _ = reqs[k]
            rids.append(twin.submit(a, n_in, n_out, hashes))
            k += 1
            continue
        for u in twin.poll(wake):
            assert u.error is None
            due[u.rid] = u.due
            late.append(wake)
    times = []
    for rid in rids:
        i, idx = twin._where[rid]
        times.append(np.array(twin.engines[i].progress(idx).token_times))
        assert due[rid] == len(times[-1])
    return times, late


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_realtime_driver_reproduces_the_offline_replay_exactly(policy):
    config = cfg(router_policy=policy)
    reqs = _workload()
    want = offline_times(config, reqs)
    for lateness in (0.0, 0.002):  # polls on time, or up to 2 ms late (a busy event loop)
        twin = RealtimeTwin(config, fit_of(config))
        got, _ = _drive(twin, reqs, lateness)
        err = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want, strict=True))
        assert err < 1e-9, (policy, lateness, err)
        hits = sum(load.cached_tokens for load in twin.loads())
        assert hits > 0  # the shared system prompt is served from the cache


@pytest.mark.parametrize("over", [
    dict(model="deepseek-v3", tp_size=8, attn_dp_size=8, ep_size=8, moe_a2a_backend="deepep",
         replicas=1, max_running_requests=None),
    dict(tp_size=1, dp_size=2, replicas=1, load_balance_method="total_requests"),
    dict(tp_size=2, attn_dp_size=2, load_balance_method="total_tokens"),
], ids=["attn-dp8-lockstep", "dp2-total-requests", "2x-attn-dp2-total-tokens"])
def test_realtime_driver_serves_schedulers_behind_the_dp_controller_exactly(over):
    # a replica of several schedulers: its tokenizer, the DP controller and the ranks
    # (domain/twin/dp.py) served online give the offline replay's token times
    config = cfg(**over)
    reqs = _workload()
    want = offline_times(config, reqs)
    for lateness in (0.0, 0.002):
        twin = RealtimeTwin(config, fit_of(config))
        got, _ = _drive(twin, reqs, lateness)
        err = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want, strict=True))
        assert err < 1e-9, (over, lateness, err)
        assert sum(load.cached_tokens for load in twin.loads()) > 0


def test_refusals_are_sglangs_messages():
    twin = RealtimeTwin(cfg(), fit_of(cfg()))
    ctx = twin.limits.context_len  # 131072 for Llama 3.1
    assert twin.refusal(ctx, 1) == (f"The input ({ctx} tokens) is longer than the model's "
                                    f"context length ({ctx} tokens).")
    assert twin.refusal(100, ctx).startswith(
        f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
        f"You requested a total of {ctx + 100} tokens: 100 tokens from the input messages and "
        f"{ctx} tokens for the completion.")
    assert twin.refusal(100, 100) is None


# ---------------------------------------------------------------- the HTTP server
def _start_server(tmp: Path, config: dict, *extra: str) -> tuple[subprocess.Popen, str]:
    cfg_file = tmp / "config.json"
    cfg_file.write_text(json.dumps(config))
    port_file = tmp / "port"
    log = open(tmp / "server.log", "wb")  # noqa: SIM115 - closed by the fixture
    proc = subprocess.Popen([sys.executable, "-m", "servetune.cli", "twin", "serve",
                             "--config", str(cfg_file), "--host", "127.0.0.1", "--port", "0",
                             "--port-file", str(port_file), *extra],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    log.close()
    deadline = time.monotonic() + 30
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError((tmp / "server.log").read_text())
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{int(port_file.read_text())}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("twin")
    proc, url = _start_server(tmp, CONFIG, "--speedup", str(SPEEDUP), "--record")
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            yield client, tmp
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:  # uvicorn shuts down, then re-raises the signal
            assert proc.wait(timeout=10) in (0, -signal.SIGTERM)
        finally:
            if proc.poll() is None:
                proc.kill()


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def sse(client: httpx.Client, path: str, body: dict) -> tuple[list[dict], list[float], float]:
    """POST a streamed request; (chunks, arrival time of each chunk, send time)."""
    chunks, at = [], []
    t0 = time.perf_counter()
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            at.append(time.perf_counter())
            chunks.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return chunks, at, t0


def metrics(client: httpx.Client) -> dict[str, float]:
    """Samples of /metrics summed over replicas (dp_rank), by metric name."""
    out: dict[str, float] = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            out[name] = out.get(name, 0.0) + value
    return out


def test_models_and_health(server):
    client, _ = server
    assert client.get("/health").status_code == 200
    m = client.get("/v1/models").json()
    from domain.models import get_model
    assert m["data"][0]["id"] == get_model("llama-3.1-70b").checkpoint("fp8").model_path
    assert m["data"][0]["max_model_len"] == 131072


def test_every_response_says_it_is_simulated(server):
    # a real SGLang never sends this header: the bench reads it to mark outputs simulated
    client, _ = server
    responses = {
        "health": client.get("/health"), "models": client.get("/v1/models"),
        "metrics": client.get("/metrics"), "not-found": client.get("/no-such-route"),
        "completion": client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 1}),
        "chat": client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        "refused": client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**7}),
        "bad-json": client.post("/v1/completions", content=b"{"),
    }
    with client.stream("POST", "/v1/completions", json={"prompt": "a", "max_tokens": 1,
                                                       "stream": True}) as r:
        r.read()
        responses["stream"] = r
    assert {k: r.headers.get("x-servetune-simulated") for k, r in responses.items()} == {
        k: "twin" for k in responses}
    assert responses["refused"].status_code == 400


def raw_stream(base_url: str, body: dict) -> tuple[list[float], bytes]:
    """POST a streamed completion over a bare socket (no client library in the timing):
    the arrival time of every token event (relative to the send) and the whole response."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps({**body, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port))) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        s.sendall(head + data)
        buf, at = b"", []
        while b"data: [DONE]" not in buf:
            chunk = s.recv(1 << 16)
            assert chunk, buf
            at += [time.perf_counter() - t0] * chunk.count(b"data: {")
            buf += chunk
    return at, buf


def test_token_times_match_the_offline_simulation(server):
    client, _ = server
    base = str(client.base_url)
    n_in, n_out = 600, 30
    raw_stream(base, {"prompt": words(n_in, "warm-"), "max_tokens": 2})  # first-request costs
    rows = []  # per request: TTFT error, |token time - schedule| p50 and max, mean ITLs (ms)
    for k in range(3):
        prompt = words(n_in, f"t{k}-")
        at, _ = raw_stream(base, {"prompt": prompt, "max_tokens": n_out})
        got = np.array(at[:n_out]) * 1e3
        # the same request alone on an idle replica, offline (virtual s -> wall ms at 4x)
        (want,) = offline_times(cfg(), [(0.0, n_in, n_out, block_hashes(prompt.split()),
                                         BLOCK_TOKENS)])
        want = want / SPEEDUP * 1e3
        # each token vs the schedule, shifted by the request's typical lag, so that one token
        # held back by a preempted server counts once, not for every token after it
        lag = got - want
        sched = np.abs(lag - np.median(lag))
        rows.append((got[0] - want[0], np.median(sched), sched.max(),
                     np.diff(got).mean(), np.diff(want).mean()))
    print(f"\nTTFT offline {want[0]:.2f} ms; per request: TTFT error, |token - schedule| "
          "p50 / max, mean ITL client / offline (ms): "
          + "; ".join(" ".join(f"{x:.2f}" for x in r) for r in rows))
    # TTFT error: request parsing, loopback HTTP and the event loop's timer (about 1 ms).
    # The best of three is held tightly, every one loosely: on a busy 2-core machine another
    # process can preempt the server for a few milliseconds.
    best = min(rows, key=lambda r: abs(r[0]))
    assert -1 < best[0] < 3 and best[1] < 1.0  # tokens leave up to EMIT_AHEAD_S early
    assert all(abs(r[0]) < 15 and r[1] < 5 for r in rows)
    assert all(abs(r[3] - r[4]) < 0.5 for r in rows)  # no drift: mean ITL within 0.5 ms


def test_record_gives_the_known_token_times_of_each_request(server):
    client, _ = server
    base = str(client.base_url)
    n_in, n_out = 400, 12
    client.get("/twin/timing")  # clear what earlier tests left
    prompt = words(n_in, "rec-")
    t_send = time.perf_counter()
    raw_stream(base, {"prompt": prompt, "max_tokens": n_out})
    t_done = time.perf_counter()
    rows = client.get("/twin/timing").json()["requests"]
    assert len(rows) == 1
    (r,) = rows
    assert r["tokens"] == n_out and r["finished"]
    # the twin's own TTFT and mean ITL: those of the offline simulation (wall ms at 4x)
    (want,) = offline_times(cfg(), [(0.0, n_in, n_out, block_hashes(prompt.split()),
                                     BLOCK_TOKENS)])
    want = want / SPEEDUP * 1e3
    model_ttft = (r["first_due"] - r["recv"]) * 1e3
    assert model_ttft == pytest.approx(want[0], abs=0.05)
    assert (r["last_due"] - r["first_due"]) * 1e3 == pytest.approx(want[-1] - want[0], abs=0.05)
    # one clock for both processes: the server got the request after the send, wrote the first
    # chunk near its due time (it may leave up to EMIT_AHEAD_S early), before the client was done
    assert t_send < r["recv"] < r["first"] < r["last"] < t_done
    assert abs(r["first"] - r["first_due"]) < 0.005


def test_builtin_runner_measures_the_twins_known_ttft_and_itl(server):
    """Fidelity of the built-in runner (aiohttp) against the twin's own token times."""
    import asyncio

    from mcp_servers.bench.http import HttpRunner, arrival_schedule
    from mcp_servers.bench.prompts import SyntheticPrompts, rate_plan

    client, _ = server
    isl, osl = 300, 16
    client.get("/twin/timing")
    plan = rate_plan(arrival_schedule(8.0, duration_s=2.5, process="constant"),
                     SyntheticPrompts("m", isl, osl), isl, osl)
    run = asyncio.run(HttpRunner([str(client.base_url)], client="aiohttp").open_loop(plan))
    rows = client.get("/twin/timing").json()["requests"]
    assert len(rows) == len(run.records) == len(plan)
    assert all(r.error is None for r in run.records)
    assert sorted(r.output_tokens for r in run.records) == sorted(x["tokens"] for x in rows)
    # the twin's TTFT and ITL (its engine's token times) vs what the runner measured (ms)
    known_ttft = np.mean([x["first_due"] - x["recv"] for x in rows]) * 1e3
    known_itl = np.mean([(x["last_due"] - x["first_due"]) / (x["tokens"] - 1)
                         for x in rows]) * 1e3
    ttft = np.mean([r.ttft_s for r in run.records]) * 1e3
    itl = np.mean(np.concatenate([r.itl_s for r in run.records])) * 1e3
    print(f"\nTTFT runner {ttft:.2f} / twin {known_ttft:.2f} ms; "
          f"ITL {itl:.3f} / {known_itl:.3f} ms")
    # loopback + event loops on a busy 2-core machine: well under the TTFT itself (the bound is
    # loose; benchmarks/loadgen_fidelity.py measures the bias)
    assert known_ttft > 5 and -1 < ttft - known_ttft < 10
    assert abs(itl - known_itl) < 1.0


def test_streamed_completion_with_usage(server):
    client, _ = server
    n_in, n_out = 50, 6
    chunks, _, _ = sse(client, "/v1/completions",
                       {"model": "any", "prompt": words(n_in, "u"), "max_tokens": n_out,
                        "stream_options": {"include_usage": True}})
    assert chunks[-1] == "[DONE]"
    usage = chunks[-2]
    assert usage["choices"] == [] and usage["object"] == "text_completion"
    assert usage["usage"]["prompt_tokens"] == n_in
    assert usage["usage"]["completion_tokens"] == n_out
    tokens = chunks[:-2]
    assert len(tokens) == n_out
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * (n_out - 1) \
        + ["length"]
    assert len("".join(c["choices"][0]["text"] for c in tokens).split()) == n_out


def test_streamed_chat_and_plain_responses_carry_usage(server):
    client, _ = server
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello twin server"}]}]
    chunks, _, _ = sse(client, "/v1/chat/completions",
                       {"messages": msgs, "max_tokens": 3,
                        "stream_options": {"include_usage": True}})
    deltas = [c["choices"][0]["delta"] for c in chunks[:3]]
    assert deltas[0]["role"] == "assistant" and all(d["content"] for d in deltas)
    assert chunks[2]["object"] == "chat.completion.chunk"
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert chunks[3]["usage"]["prompt_tokens"] == 5 and chunks[3]["usage"]["total_tokens"] == 8
    # without include_usage: tokens then [DONE] only
    chunks, _, _ = sse(client, "/v1/completions", {"prompt": "a b", "max_tokens": 2})
    assert len(chunks) == 3 and chunks[-1] == "[DONE]"
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4}).json()
    assert r["object"] == "chat.completion"
    assert len(r["choices"][0]["message"]["content"].split()) == 4
    assert r["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}).json()
    assert r["usage"]["prompt_tokens"] == 3 and r["choices"][0]["finish_reason"] == "length"


def test_over_the_context_limit_is_refused_like_sglang(server):
    client, _ = server
    r = client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 131072})
    assert r.status_code == 400
    assert r.json() == {"object": "error", "code": 400, "type": "BadRequestError", "param": None,
                        "message": r.json()["message"]}
    assert "exceeds the model's maximum context length of 131072 tokens" in r.json()["message"]
    for body in ({"prompt": "a", "max_tokens": 0}, {"prompt": ["a", "b"]}, {"nope": 1}):
        assert client.post("/v1/completions", json=body).status_code == 400
    assert client.post("/v1/completions", content=b"{not json").status_code == 400


def test_shared_prefixes_hit_the_prefix_cache(server):
    client, _ = server
    system = words(320, "sys")
    cached = []
    for q in ("first question here", "second one"):
        r = client.post("/v1/completions", json={"prompt": f"{system} {q}", "max_tokens": 2})
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    # the cache-aware router sends the second to the same replica: 320 words = 20 blocks
    assert cached == [0, 320]


def test_a_burst_beyond_the_admission_cap_queues(server):
    client, _ = server
    before = metrics(client)
    n, out = 16, 40  # 2 replicas x cap 4 = 8 running, 8 queued at the peak
    seen: list[dict[str, float]] = []
    done = threading.Event()

    def watch() -> None:
        with httpx.Client(base_url=str(client.base_url), timeout=10) as c:
            while not done.is_set():
                seen.append(metrics(c))
                time.sleep(0.01)

    def one(i: int, results: list) -> None:
        with httpx.Client(base_url=str(client.base_url), timeout=30) as c:
            results.append(sse(c, "/v1/completions", {"prompt": words(300, f"b{i}-"),
                                                      "max_tokens": out})[0])

    results: list = []
    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=one, args=(i, results)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    after = metrics(client)
    assert len(results) == n and all(len(r) == out + 1 for r in results)
    peak_q = max(s["sglang:num_queue_reqs"] for s in seen)
    peak_r = max(s["sglang:num_running_reqs"] for s in seen)
    print(f"burst of {n}: peak running {peak_r:g}, peak queued {peak_q:g}")
    assert peak_r == 8 and peak_q > 0
    assert max(s["sglang:token_usage"] for s in seen) > 0
    assert after["sglang:num_running_reqs"] == after["sglang:num_queue_reqs"] == 0
    # SGLang's retraction counter and gauge are served (no retraction in a burst this small)
    assert after["sglang:num_retracted_requests_total"] == after["sglang:num_retracted_reqs"] == 0
    assert after["sglang:num_requests_total"] - before["sglang:num_requests_total"] == n
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] \
        == n * out
    assert after["sglang:prompt_tokens_total"] - before["sglang:prompt_tokens_total"] == n * 300


def test_a_disconnect_aborts_the_request(server):
    client, _ = server
    with client.stream("POST", "/v1/completions",
                       json={"prompt": "long one", "max_tokens": 5000, "stream": True}) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the connection already
        assert next(lines).startswith("data: {")
        assert metrics(client)["sglang:num_running_reqs"] == 1
    deadline = time.monotonic() + 5  # 5000 tokens would take ~30 s at 4x
    while metrics(client)["sglang:num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metrics(client)["sglang:num_running_reqs"] == 0


def test_a_disconnect_aborts_a_non_streamed_request(server):
    client, _ = server
    base = str(client.base_url)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 5000 tokens
        httpx.post(base + "/v1/chat/completions", timeout=0.5, json={
            "messages": [{"role": "user", "content": "long one"}], "max_tokens": 5000})
    deadline = time.monotonic() + 5
    while metrics(client)["sglang:num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metrics(client)["sglang:num_running_reqs"] == 0


# ---------------------------------------------------------------- the CLI and the local backend
def test_cli_refuses_bad_configs_in_one_line(tmp_path):
    runner = CliRunner()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**CONFIG, "gpu": "Z900"}))
    r = runner.invoke(app, ["twin", "serve", "--config", str(bad), "--port", "0"])
    assert r.exit_code == 2 and "gpu 'Z900' is not in the GPU catalog" in r.output
    assert len(r.output.strip().splitlines()) == 1
    (tmp_path / "x.yaml").write_text("model: [")
    r = runner.invoke(app, ["twin", "serve", "--config", str(tmp_path / "x.yaml")])
    assert r.exit_code == 2 and "cannot read a JSON or YAML ServingConfig" in r.output
    r = runner.invoke(app, ["twin", "serve", "--config", str(bad), "--study", str(bad)])
    assert r.exit_code == 2 and "not both" in r.output
    # a config the engine refuses at startup: its log and exit code, as sglang serve's
    fa3 = tmp_path / "fa3.yaml"
    fa3.write_text("model: glm-5\ngpu: B200\ntp_size: 8\nweights: fp8\n"
                   "attention_backend: fa3\n")
    r = runner.invoke(app, ["twin", "serve", "--config", str(fa3), "--port", "0"])
    assert r.exit_code == 1
    assert "FlashAttention v3 Backend requires SM>=80 and SM<=90" in r.output.splitlines()[-1]


def test_the_local_backend_starts_the_twin_without_a_gpu(tmp_path):
    from mcp_servers.cluster import ops
    from mcp_servers.cluster.backend import make_backend
    from mcp_servers.cluster.local import TWIN_SERVE_COMMAND, gpu_present

    if gpu_present():
        pytest.skip("a GPU is present: the local backend defaults to sglang serve")
    backend = make_backend("local", "twin-test", tmp_path)
    assert backend.command == TWIN_SERVE_COMMAND
    st = ops.deploy(backend, "t", cfg(replicas=2), wait_s=30)
    try:
        assert st.phase == "Ready", st.message
        assert len(st.endpoints) == 2
        for url in st.endpoints:  # one replica per process
            with httpx.Client(base_url=url, timeout=10) as c:
                r = c.post("/v1/completions", json={"prompt": "hi there", "max_tokens": 2})
                assert r.json()["usage"]["completion_tokens"] == 2
                assert "dp_rank" not in c.get("/metrics").text
        assert any("fired up" in x.text for x in backend.logs("t", replica=0))
    finally:
        backend.teardown("t")
