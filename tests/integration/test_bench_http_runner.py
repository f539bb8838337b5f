"""The built-in HTTP runner (issue 6): dispatch modes, error classes, validity and flags, prompts.

Against ``tests/fixtures/openai_stub.py`` started here on 127.0.0.1 (stopped by its PID), with
its fault and cache-report options. Timing bounds catch scheduling errors, not fidelity (that is
``benchmarks/loadgen_fidelity.py``): they hold on a loaded 2-core machine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
from fixtures.stub_process import running_stub
from mcp import Client

from domain.bench import Quality
from domain.config import ServingConfig
from domain.traces import load_mooncake
from domain.workload import Request
from mcp_servers.bench.http import HttpRunner, arrival_schedule
from mcp_servers.bench.ops import BenchService
from mcp_servers.bench.prompts import (
    SHIPPED_WORDPIECE,
    BlockPrompts,
    HFTokenizer,
    SyntheticPrompts,
    WordTokenizer,
    expected_hit_rate,
    expected_prefix_hits,
    rate_plan,
    replay_plan,
)
from mcp_servers.bench.server import build_server as bench_server
from mcp_servers.cluster.twin import TwinBackend

pytestmark = pytest.mark.anyio
REPO = Path(__file__).resolve().parents[2]
LOCAL = ["http://127.0.0.1"]
LAX = Quality(max_dispatch_lag_p99_ms=1000)  # no lag flag from a loaded test machine



@contextmanager
def stub(*args: str) -> Iterator[str]:
    """A stub (TTFT 20 ms, ITL 5 ms) with extra options; its base URL; stopped by PID."""
    with running_stub(*args) as url:
        yield url


def mooncake_file(path: Path) -> Path:
    """40 requests, one every 25 ms; all share block 7, odd ones also block 8."""
    rows = []
    for i in range(40):
        n_in = 300 + 37 * i
        k = -(-n_in // 512)
        ids = ([7, 8][:1 + i % 2] + [1000 + 10 * i + j for j in range(k)])[:k]
        rows.append({"timestamp": 25 * i, "input_length": n_in, "output_length": 4 + i % 3,
                     "hash_ids": ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------- schedules

def test_arrival_schedule_constant_and_poisson():
    c = arrival_schedule(20, duration_s=1.0, process="constant")
    assert len(c) == 20 and c[0] == 0 and np.allclose(np.diff(c), 0.05)
    assert len(arrival_schedule(20, count=7, process="constant")) == 7
    p = arrival_schedule(200, duration_s=50, seed=3)
    assert (p == arrival_schedule(200, duration_s=50, seed=3)).all()  # seeded
    assert not np.array_equal(p[:50], arrival_schedule(200, duration_s=50, seed=4)[:50])
    assert p[0] == 0 and (np.diff(p) > 0).all() and p[-1] < 50
    assert abs(len(p) / 50 - 200) < 10  # mean rate (sd of the count ~ 1.4 req/s here)
    gaps = np.diff(p)
    assert abs(gaps.std() / gaps.mean() - 1) < 0.1  # exponential: cv = 1
    with pytest.raises(ValueError):
        arrival_schedule(0, duration_s=1)
    with pytest.raises(ValueError):
        arrival_schedule(1)


# --------------------------------------------------------------------------- dispatch modes

@pytest.mark.parametrize("client, engine", [("aiohttp", "asyncio"), ("httpx", "threads")])
async def test_open_loop_fixed_rate_and_closed_loop_against_stub(client, engine):
    with stub("--keep-alive", "--engine", engine) as url:
        runner = HttpRunner([url], client=client)
        prompts = SyntheticPrompts("stub-model", 24, 6)
        times = arrival_schedule(40, duration_s=1.0, process="constant")
        run = await runner.open_loop(rate_plan(times, prompts, 24, 6))
        assert len(run.records) == 40 and run.error_counts() == {}
        assert [r.arrival_s for r in run.records] == pytest.approx(list(times))
        lag = run.sent_s - times
        assert (lag >= 0).all() and np.median(lag) < 0.02
        for r in run.records:
            assert (r.input_tokens, r.output_tokens, len(r.itl_s)) == (24, 6, 5)
            # chunks that arrive in one socket read share a timestamp (a gap of 0)
            assert 0.02 <= r.ttft_s < 0.5 and (r.itl_s >= 0).all()
            assert r.itl_s.sum() == pytest.approx(r.finish_s - r.first_token_s)
        assert (run.cached_tokens == -1).all()  # the stub reports none by default
        closed = await runner.closed_loop(prompts.body, 24, concurrency=3, duration_s=0.5,
                                          max_requests=1000, osl=6)
        assert closed.error_counts() == {} and len(closed.records) >= 6
        # closed loop: a client sends its next request when its previous one finished
        assert (closed.sent_s - np.array([r.arrival_s for r in closed.records]) < 0.05).all()


async def test_run_rate_tool_over_http_and_on_the_twin(tmp_path):
    backend = TwinBackend()
    backend.deploy("d1", ServingConfig(model="glm-5", gpu="B200", tp_size=8, weights="nvfp4",
                                       kv_cache_dtype="fp8_e4m3"), {})
    svc = BenchService(backend, tmp_path / "rec", [], LOCAL, quality=LAX)
    with stub() as url:
        async with Client(bench_server(svc)) as b:
            args = {"isl": 16, "osl": 4, "request_rate": 30, "duration_s": 1.0, "seed": 5}
            r = await b.call_tool("run_rate", {**args, "endpoint": url})
            assert not r.is_error, r.content
            res = r.structured_content
            twin = (await b.call_tool("run_rate", {**args, "deployment": "d1"})
                    ).structured_content
            page = (await b.call_tool("get_records", {"bench_id": res["bench_id"]})
                    ).structured_content
    s = res["summary"]
    want = arrival_schedule(30, duration_s=1.0, process="poisson", seed=5)
    assert res["workload"]["kind"] == "rate" and s["requests"] == len(want) == s["completed"]
    assert res["valid"] and res["flags"] == [] and res["errors_by_class"] == {}
    assert res["client"] == "aiohttp" and res["workload"]["tokenizer"] == "words"
    assert s["input_tokens"] == 16 * s["requests"]  # exact ISL: the stub counts words
    assert [x["arrival_s"] for x in page["records"]] == pytest.approx(list(want))
    assert all(x["sent_s"] >= x["arrival_s"] for x in page["records"])
    assert twin["target"] == "twin" and twin["summary"]["requests"] == len(want)
    assert twin["workload"]["arrival"] == "poisson" and twin["valid"]


async def test_an_oversized_rate_run_is_refused_at_once(tmp_path):
    svc = BenchService(TwinBackend(), tmp_path / "rec", [], LOCAL, quality=LAX)
    async with Client(bench_server(svc)) as b:
        t0 = time.monotonic()
        r = await b.call_tool("run_rate", {"endpoint": "http://127.0.0.1:9", "isl": 16,
                                           "osl": 4, "request_rate": 100_000,
                                           "duration_s": 3600})
    assert r.is_error and "a run takes at most" in r.content[0].text
    assert time.monotonic() - t0 < 5  # no 360-million-entry schedule drawn first


# --------------------------------------------------------------------------- error classes

@pytest.mark.parametrize("engine", ["threads", "asyncio"])
async def test_error_classes_are_counted_and_a_run_is_invalid(tmp_path, engine):
    # faults by the stub's POST count: 503 every 5th, hang every 7th, disconnect every 9th,
    # truncation every 11th (the first option that matches wins)
    n = 60
    expect = {"http_status": 0, "timeout": 0, "disconnect": 0, "truncated": 0}
    for k in range(1, n + 1):
        for name, every in (("http_status", 5), ("timeout", 7), ("disconnect", 9),
                            ("truncated", 11)):
            if k % every == 0:
                expect[name] += 1
                break
    with stub("--keep-alive", "--engine", engine, "--http-error-every", "5", "--hang-every", "7",
              "--hang-s", "3", "--disconnect-every", "9", "--truncate-every", "11") as url:
        svc = BenchService(TwinBackend(), tmp_path / "rec", [], LOCAL, request_timeout_s=0.8,
                           quality=LAX)
        async with Client(bench_server(svc)) as b:
            # constant 60 req/s: POSTs arrive in order, one every 17 ms
            r = await b.call_tool("run_rate", {"endpoint": url, "isl": 8, "osl": 8,
                                               "request_rate": 60, "duration_s": 1.0,
                                               "arrival": "constant"})
            res = r.structured_content
            page = (await b.call_tool("get_records", {"bench_id": res["bench_id"]})
                    ).structured_content
            lenient = (await b.call_tool("run_rate", {
                "endpoint": url, "isl": 8, "osl": 8, "request_rate": 10, "duration_s": 0.5,
                "arrival": "constant", "max_error_share": 1.0})).structured_content
    assert res["errors_by_class"] == expect
    failed = sum(expect.values())
    assert res["summary"]["errors"] == failed and res["error_share"] == pytest.approx(failed / n)
    assert res["valid"] is False and "not scored" in res["invalid_reason"]
    assert "http_status 12" in res["invalid_reason"]
    classes = [x["error_class"] for x in page["records"]]
    assert classes.count("truncated") == expect["truncated"]
    trunc = next(x for x in page["records"] if x["error_class"] == "truncated")
    assert "truncated output: 4 of 8 tokens" in trunc["error"] and trunc["output_tokens"] == 4
    cut = next(x for x in page["records"] if x["error_class"] == "disconnect")
    assert "after 4 text chunks" in cut["error"]
    assert all(x["error_class"] is None for x in page["records"] if x["error"] is None)
    assert lenient["valid"] is True and lenient["invalid_reason"] is None


# --------------------------------------------------------------------------- flags

async def test_replay_prefix_cache_check_and_lag_flag(tmp_path):
    mooncake_file(tmp_path / "mc.jsonl")
    reqs = load_mooncake(tmp_path / "mc.jsonl").requests
    expected = expected_hit_rate(reqs)
    assert expected is not None and 0.2 < expected < 0.9
    args = {"trace": "mc.jsonl", "format": "mooncake", "start_s": 0, "duration_s": 10,
            "time_scale": 4.0}
    with stub("--cached-tokens", "prefix", "--record") as good, \
            stub("--cached-tokens", "zero") as cold:
        svc = BenchService(TwinBackend(), tmp_path / "rec", [tmp_path], LOCAL, quality=LAX)
        async with Client(bench_server(svc)) as b:
            ok = (await b.call_tool("run_replay", {**args, "endpoint": good})).structured_content
            bad = (await b.call_tool("run_replay", {**args, "endpoint": cold})
                   ).structured_content
            laggy = (await b.call_tool("run_replay", {**args, "endpoint": good,
                                                      "max_dispatch_lag_p99_ms": 0.0001})
                     ).structured_content
            page = (await b.call_tool("get_records", {"bench_id": ok["bench_id"]})
                    ).structured_content
        served = httpx.get(good + "/stub/timing", timeout=5, trust_env=False).json()["requests"]
    pc = ok["prefix_cache"]
    # what the bench expects: the trace's hash ids in trace order
    assert pc["source"] == "usage" and pc["expected_hit_rate"] == pytest.approx(expected)
    # what the stub's unbounded word-prefix cache serves depends on the order it saw the
    # prompts: its threads may take two requests sent 6 ms apart either way round (on a loaded
    # machine they do, and a request then hits the shorter prompt of its neighbour: 36-74
    # tokens off). The expectation is the same hash-id model over the requests in the order the
    # stub's cache saw them (the first len(reqs) lookups are the `ok` run's; prompt lengths are
    # unique per request), to a word or two where the random words after a shared block agree.
    n_in = {r.input_tokens: i for i, r in enumerate(reqs)}
    assert len(n_in) == len(reqs)
    seen = [n_in[x["n_in"]] for x in sorted(served, key=lambda x: x["cache_seq"])
            if x["cache_seq"] < len(reqs)]
    assert sorted(seen) == list(range(len(reqs)))
    want = np.zeros(len(reqs), dtype=np.int64)
    want[seen] = expected_prefix_hits([reqs[i] for i in seen])
    recs = sorted(page["records"], key=lambda x: x["index"])
    got = np.array([x["cached_tokens"] for x in recs])
    assert [x["input_tokens"] for x in recs] == [r.input_tokens for r in reqs]
    assert (np.abs(got - want) <= 3).all(), (got - want, seen)
    # the bench's achieved rate is the reported hits over the prompt tokens
    total = sum(r.input_tokens for r in reqs)
    assert pc["achieved_hit_rate"] == pytest.approx(got.sum() / total)
    assert pc["achieved_hit_rate"] == pytest.approx(want.sum() / total, abs=0.002)
    assert ok["flags"] == [] and ok["valid"]
    assert bad["prefix_cache"]["achieved_hit_rate"] == 0 and bad["valid"]
    assert len(bad["flags"]) == 1 and bad["flags"][0].startswith("prefix-cache hit rate 0.0%")
    assert any(f.startswith("dispatch lag p99") for f in laggy["flags"])
    assert laggy["valid"]  # a flag is not an invalid run


async def test_prefix_cache_check_from_metrics_counters(tmp_path):
    """Without cached_tokens in usage the /metrics counters over the run are used."""
    mooncake_file(tmp_path / "mc.jsonl")
    with stub() as url:
        svc = BenchService(TwinBackend(), tmp_path / "rec", [tmp_path], LOCAL, quality=LAX)
        res = await svc.replay(None, "mc.jsonl", "mooncake", 0, 10, 4.0, endpoint=url)
    pc = res.prefix_cache
    assert pc is not None and pc.source == "metrics" and pc.achieved_hit_rate == 0.0
    assert res.flags and "from metrics" in res.flags[0]


async def test_retractions_come_from_the_servers_counter_around_each_run(tmp_path):
    """A saturation run and a replay report the retraction counter's difference around them;
    a server without the counter gives None (n/a in the report), never 0."""
    mooncake_file(tmp_path / "mc.jsonl")
    with stub("--retract-every", "5") as url, stub() as bare:
        svc = BenchService(TwinBackend(), tmp_path / "rec", [tmp_path], LOCAL, quality=LAX)
        warm = await svc.saturation(None, 64, 8, 4, 0.5, endpoint=url)
        sat = await svc.saturation(None, 64, 8, 4, 0.5, endpoint=url)
        rep = await svc.replay(None, "mc.jsonl", "mooncake", 0, 10, 4.0, endpoint=url)
        none = await svc.saturation(None, 64, 8, 4, 0.5, endpoint=bare)
    served = [warm.summary.completed, sat.summary.completed, rep.summary.completed]
    counts = [warm.summary.retractions, sat.summary.retractions, rep.summary.retractions]
    assert all(c is not None for c in counts)
    # the stub counts one per 5 served since start; each run sees only its own share
    assert sum(counts) == sum(served) // 5 and 0 < sat.summary.retractions <= served[1] // 5 + 1
    assert none.summary.retractions is None and none.valid


# --------------------------------------------------------------------------- prompts, tokens

def test_expected_prefix_hits_match_the_prompts(tmp_path):
    reqs = load_mooncake(mooncake_file(tmp_path / "mc.jsonl")).requests
    prompts = [json.loads(p.body)["prompt"].split(" ") for p in replay_plan(reqs, "m")]
    hits = expected_prefix_hits(reqs)
    for i, a in enumerate(prompts):  # brute force: longest common word prefix with any earlier
        best = 0
        for b in prompts[:i]:
            k = 0
            while k < min(len(a), len(b)) and a[k] == b[k]:
                k += 1
            best = max(best, k)
        # equal but where random words right after a shared block happen to agree (p ~ 1/300)
        assert 0 <= min(best, len(a) - 1) - hits[i] <= 3, i
    assert expected_hit_rate([Request(arrival_s=0, input_tokens=5, output_tokens=1)]) is None


def _bpe_tokenizer(path: Path, pre_tokenize: bool = True) -> Path:
    """A small byte-level BPE tokenizer trained here (offline, < 1 s), saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(0)
    words = np.array(WordTokenizer().words[:120])
    corpus = [" ".join(words[rng.integers(0, len(words), 40)]) for _ in range(400)]
    tok = Tokenizer(models.BPE())
    if pre_tokenize:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=1200, special_tokens=["<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path


def test_prompts_have_exact_token_lengths(tmp_path):
    bert = HFTokenizer(SHIPPED_WORDPIECE)  # the BERT-uncased vocabulary the project ships
    assert bert.added_tokens == 2 and len(bert.words) > 5000  # [CLS] ... [SEP]
    bpe = HFTokenizer(_bpe_tokenizer(tmp_path / "tokenizer.json"))
    assert bpe.added_tokens == 0 and len(bpe.words) >= 50
    reqs = load_mooncake(mooncake_file(tmp_path / "mc.jsonl")).requests
    for tok in (WordTokenizer(), bert, bpe):
        for isl in (1 + tok.added_tokens, 7, 64, 513):
            sp = SyntheticPrompts("m", isl, 4, tok)
            texts = {sp.prompt(i) for i in (0, 1, 999, 123_457)}
            assert len(texts) == 4 or isl < 7  # each request its own first words
            assert all(tok.count(t) == isl for t in texts), (tok.name, isl)
            assert json.loads(sp.body(999))["prompt"] == sp.prompt(999)
        blocks = BlockPrompts(0, tok)
        got = [tok.count(blocks.prompt(r.hash_ids, r.block_size, r.input_tokens, i))
               for i, r in enumerate(reqs[:12])]
        assert got == [r.input_tokens for r in reqs[:12]], tok.name
    with pytest.raises(ValueError, match="one token each"):
        HFTokenizer(_bpe_tokenizer(tmp_path / "merged.json", pre_tokenize=False))
    with pytest.raises(ValueError, match="no tokenizer"):
        HFTokenizer(tmp_path / "nothing-here")
