"""The twin's router against the pinned sglang-router 0.3.2 in front of twin servers.

Three ``servetune twin serve --record`` servers (subprocesses on 127.0.0.1) sit behind the real
router (``python -m sglang_router.launch_router --policy cache_aware``, a subprocess stopped by
its PID). Request sequences go through the router and through the twin's
:class:`~domain.twin.cluster.Router` with the same prompts and the same in-flight counts;
each request's worker is read back from the servers' ``/twin/timing`` rows, where every
request of a sequence has its own prompt length. The twin's replica i is the router's i-th
worker in ``GET /workers`` (the order its ties fall in). Sequences (the issue's three):

- 64 unique synthetic prompts (the bench's :class:`SyntheticPrompts`) sent one at a time, each
  kept in flight (its first token read) before the next is sent; and 16 sent one at a time,
  each finished before the next (the least-loaded tie: all to the first worker);
- 8 prefix groups x 16 (:class:`BlockPrompts`: three shared blocks of 16 words, then one of
  the request's own), one at a time, kept in flight, group after group;
- 32 synthetic prompts sent at once (the router sees them in an order of its own, so per-worker
  counts are compared).

At least 95 % of the assignments must agree. Skipped only when ``sglang_router`` is not
importable (install the ``router`` extra).
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from domain.twin.cluster import Router
from domain.twin.prefix_cache import PathIndex
from mcp_servers.bench.prompts import BlockPrompts, SyntheticPrompts, completion_body

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                       reason="sglang_router is not importable: pip install -e '.[router]'"),
    pytest.mark.xdist_group("router_fidelity"),
]

REPO = Path(__file__).resolve().parents[2]
CONFIG = dict(model="llama-3.1-8b", gpu="H100", tp_size=1, weights="bf16", replicas=1)
WORKERS = 3
OSL = 8000  # output tokens: every request stays in flight until the sequence is sent
SPEEDUP = 5  # the twin servers' virtual seconds per wall second (first tokens come sooner)
AGREE = 0.95


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _twin(tmp: Path, i: int) -> tuple[subprocess.Popen[bytes], Path]:
    cfg = tmp / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    port_file = tmp / f"port{i}"
    with open(tmp / f"twin{i}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "servetune.cli", "twin", "serve",
                                 "--config", str(cfg), "--host", "127.0.0.1", "--port", "0",
                                 "--port-file", str(port_file), "--record",
                                 "--speedup", str(SPEEDUP)],
                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    return proc, port_file


def _router(tmp: Path, urls: list[str], deadline: float, *flags: str
            ) -> tuple[subprocess.Popen[bytes], int, list[str]]:
    """Start the real router in front of ``urls``: (process, port, workers in its order)."""
    port = _free_port()
    log_path = tmp / f"router{port}.log"
    with open(log_path, "wb") as log:
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
             "--port", str(port), "--worker-urls", *urls, "--policy", "cache_aware",
             # its metrics listener (default 0.0.0.0:29000) on a free local port
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
             "--log-level", "warn", *flags], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    order: list[str] = []
    try:
        while len(order) < len(urls):
            assert router.poll() is None and time.monotonic() < deadline, \
                log_path.read_text()[-2000:]
            try:
                ws = httpx.get(f"{base}/workers", timeout=2).json()["workers"]
                order = [w["url"] for w in ws if w["is_healthy"]]
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.1)
    except BaseException:
        _stop(router)
        raise
    return router, port, order


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[int, list[str], Path, list[str]]]:
    """(router port, worker URLs in the router's order, a temp dir, worker URLs as started)."""
    tmp = tmp_path_factory.mktemp("router")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        files = []
        for i in range(WORKERS):
            proc, port_file = _twin(tmp, i)
            procs.append(proc)
            files.append(port_file)
        deadline = time.monotonic() + 60
        while not all(f.exists() for f in files):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, \
                "twin server did not start"
            time.sleep(0.05)
        urls = [f"http://127.0.0.1:{int(f.read_text())}" for f in files]
        router, port, order = _router(tmp, urls, deadline)
        procs.append(router)
        for u in order:  # clear the health checks' rows
            httpx.get(f"{u}/twin/timing", timeout=5)
        yield port, order, tmp, urls
    finally:
        for p in reversed(procs):
            _stop(p)


def _send(port: int, bodies: list[bytes], hold: bool) -> None:
    """Send ``bodies`` to the router; ``hold``: one at a time, each in flight (its first chunk
    read, the rest read on) before the next; else all at once. The streams are cut at the end
    (the servers abort the requests)."""
    conns: list[http.client.HTTPConnection] = []
    lock = threading.Lock()

    def one(body: bytes, started: threading.Event) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        with lock:
            conns.append(conn)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.readline()
            started.set()
            while r.read(4096):
                pass
        except (OSError, http.client.HTTPException):
            pass  # cut by the caller
        finally:
            started.set()

    threads = []
    for b in bodies:
        ev = threading.Event()
        t = threading.Thread(target=one, args=(b, ev), daemon=True)
        t.start()
        threads.append((t, ev))
        if hold:
            assert ev.wait(30)
    for _, ev in threads:
        assert ev.wait(30)
    time.sleep(0.2)
    with lock:
        for conn in conns:
            if conn.sock is not None:
                conn.sock.shutdown(socket.SHUT_RDWR)
    for t, _ in threads:
        t.join(30)


def _where(order: list[str], n: int) -> dict[int, int]:
    """Prompt length -> router worker index, from the servers' timing rows (n requests)."""
    got: dict[int, int] = {}
    deadline = time.monotonic() + 30
    while len(got) < n and time.monotonic() < deadline:
        for i, u in enumerate(order):
            for row in httpx.get(f"{u}/twin/timing", timeout=5).json()["requests"]:
                got[int(row["prompt_tokens"])] = i
        time.sleep(0.05)
    return got


def _agreement(real: list[int], twin: list[int]) -> float:
    return sum(a == b for a, b in zip(real, twin, strict=True)) / len(real)


def test_unique_prompts_one_at_a_time_go_where_the_real_router_sends_them(fleet):
    port, order = fleet[:2]
    n = 64
    # prompt i has 64 + i tokens (its id in the timing rows); its own tag, a shared body
    prompts = [SyntheticPrompts("m", 64 + i, OSL, seed=1) for i in range(n)]
    _send(port, [p.body(i) for i, p in enumerate(prompts)], hold=True)
    got = _where(order, n)
    real = [got.get(64 + i, -1) for i in range(n)]
    router, loads, twin = Router("cache_aware", WORKERS), [0] * WORKERS, []
    for i in range(n):  # every earlier request is still in flight
        w = router.pick((), 0, 64 + i, loads)
        loads[w] += 1
        twin.append(w)
    print(f"unique prompts one at a time: {_agreement(real, twin):.1%} agree")
    assert _agreement(real, twin) >= AGREE, (real, twin)


def test_unique_prompts_each_finished_before_the_next_all_go_to_the_first_worker(fleet):
    """No request in flight when the next is routed: every load is 0, the least-loaded tie
    goes to the first worker every time (the older router's smallest tree would alternate)."""
    port, order = fleet[:2]
    n = 16
    prompts = [SyntheticPrompts("m", 64 + i, 4, seed=4) for i in range(n)]
    for i, p in enumerate(prompts):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", p.body(i), {"Content-Type": "application/json"})
        assert conn.getresponse().read()
        conn.close()
    got = _where(order, n)
    real = [got.get(64 + i, -1) for i in range(n)]
    router = Router("cache_aware", WORKERS)
    twin = [router.pick((), 0, 64 + i, [0] * WORKERS) for i in range(n)]
    print(f"unique prompts, each finished first: {_agreement(real, twin):.1%} agree")
    assert _agreement(real, twin) >= AGREE, (real, twin)


def test_prefix_groups_stick_to_the_worker_the_real_router_picks(fleet):
    port, order = fleet[:2]
    groups, per, block = 8, 16, 16
    blocks, index = BlockPrompts(seed=2), PathIndex()
    router, loads = Router("cache_aware", WORKERS), [0] * WORKERS
    bodies, twin, lengths = [], [], []
    for g in range(groups):
        for k in range(per):
            hashes = [1000 + g, 2000 + g, 3000 + g, 10_000 + per * g + k]
            isl = 64 + per * g + k  # unique; the three shared blocks are > 0.3 of it
            text = blocks.prompt(hashes, block, isl, per * g + k)
            bodies.append(completion_body("m", text, OSL))
            lengths.append(isl)
            w = router.pick(index.path(hashes), block, isl, loads)
            loads[w] += 1
            twin.append(w)
    _send(port, bodies, hold=True)
    got = _where(order, len(bodies))
    real = [got.get(isl, -1) for isl in lengths]
    print(f"8 prefix groups x 16: {_agreement(real, twin):.1%} agree")
    assert _agreement(real, twin) >= AGREE, (real, twin)
    assert len(set(twin[:per])) == 1  # a group stays on its worker (cache hits)


def test_concurrent_prompts_split_as_the_real_router_splits_them(fleet):
    port, order = fleet[:2]
    n = 32
    prompts = [SyntheticPrompts("m", 64 + i, OSL, seed=3) for i in range(n)]
    _send(port, [p.body(i) for i, p in enumerate(prompts)], hold=False)
    got = _where(order, n)
    real = [sum(1 for w in got.values() if w == i) for i in range(WORKERS)]
    router, loads = Router("cache_aware", WORKERS), [0] * WORKERS
    for i in range(n):  # the router counts each request in flight as it routes it
        loads[router.pick((), 0, 64 + i, loads)] += 1
    matched = sum(min(a, b) for a, b in zip(real, loads, strict=True)) / n
    print(f"32 concurrent: {matched:.1%} of per-worker counts agree ({real} vs {loads})")
    assert matched >= AGREE, (real, loads)


def test_an_imbalanced_fleet_sends_a_prefix_group_to_the_least_loaded_worker(fleet):
    """One prefix group of 24 behind a router with ``--balance-abs-threshold 8``: the group
    sticks to its worker until it holds 9 more requests than the least loaded, then requests
    go to the least-loaded one (measured: 100 % agree with 3 workers, 91.7 % with 2). Past
    that point the real tree may pick either worker on a node both now hold (a DashMap
    order, and character matches inside the last block the twin does not see), so the bound
    is lower than the issue's three sequences'."""
    _, _, tmp, urls = fleet
    router, port, order = _router(tmp, urls, time.monotonic() + 30,
                                  "--balance-abs-threshold", "8")
    try:
        for u in order:
            httpx.get(f"{u}/twin/timing", timeout=5)
        n, block = 24, 16
        blocks, index = BlockPrompts(seed=5), PathIndex()
        twin_router = Router("cache_aware", WORKERS, balance_abs_threshold=8)
        loads, bodies, twin = [0] * WORKERS, [], []
        for k in range(n):
            hashes = [5000, 5001, 5002, 50_000 + k]
            text = blocks.prompt(hashes, block, 64 + k, k)
            bodies.append(completion_body("m", text, OSL))
            w = twin_router.pick(index.path(hashes), block, 64 + k, loads)
            loads[w] += 1
            twin.append(w)
        _send(port, bodies, hold=True)
        got = _where(order, n)
    finally:
        _stop(router)
    real = [got.get(64 + k, -1) for k in range(n)]
    print(f"imbalanced prefix group (abs 8): {_agreement(real, twin):.1%} agree "
          f"(real {real}, twin {twin})")
    assert real[:10] == twin[:10] == [0] * 9 + [1]  # 9 - 0 > 8 and 9 > 1.5 x 0
    assert _agreement(real, twin) >= 0.75, (real, twin)
