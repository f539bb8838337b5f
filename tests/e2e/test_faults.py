"""Fault injection on the twin and retry by failure class.

Units check the seeded draws, the retry rule per class, the twin backend's injection by launch
number, the bench server's sanity checks and the lesson-store outage with the callers' retry
(that each injected startup gets its named class is in unit/test_failure_classifier.py). The
graph run injects 30 % failed launches and 30 % failed benchmarks (plus lesson-store outages)
into a tiny study: it completes, every failure has a named class, exactly the transient ones
are retried, and the report lists injected against classified.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from fixtures.cli import tiny_study, write
from fixtures.configs import serving_config
from fixtures.lesson_invariants import assert_no_contradicted
from mcp import Client

from agents.mcp_tools import TRANSIENT_RETRIES, call
from domain.config import ServingConfig
from domain.engines.sglang.failures import FAILURE_CLASSES
from domain.failures import TAXONOMY
from domain.faults import (
    BENCH_FAULTS,
    DEPLOY_FAULTS,
    EXPECTED_CLASS,
    MAX_ATTEMPTS,
    FaultSpec,
    bench_failure_class,
    draw,
    rule,
    should_retry,
)
from domain.ledger import Ledger
from domain.study import parse_study
from graph.run import run_study
from mcp_servers.bench.ops import BenchService
from mcp_servers.cluster.twin import TwinBackend
from mcp_servers.lessons.outage import FlakyStore
from mcp_servers.lessons.server import build_server as lessons_server
from servetune.faults_report import fault_accounting, read_events
from servetune.report import render_report
from servetune.study_file import load_study

BASE = serving_config()  # GLM-5 FP8, TP8, one replica on B200
FA3 = BASE.model_copy(update={"attention_backend": "fa3"})  # refused on B200 (SM 100)


# ------------------------------------------------------------------------------ draws, spec

def test_draws_are_seeded_and_faults_follow_their_shares():
    assert draw(1, "deploy", "c", 0) == draw(1, "deploy", "c", 0)
    assert draw(1, "deploy", "c", 0) != draw(1, "deploy", "c", 1) != draw(2, "deploy", "c", 1)
    spec = FaultSpec(seed=3, oom=0.1, image_pull=0.2)
    got = [spec.deploy_fault(f"cfg{i}", 0) for i in range(4000)]
    assert abs(got.count("oom") / 4000 - 0.1) < 0.02
    assert abs(got.count("image_pull") / 4000 - 0.2) < 0.025
    assert got.count("crash_loop") == got.count("ready_timeout") == 0
    assert not FaultSpec().active and spec.active
    with pytest.raises(ValueError, match="deploy shares"):
        FaultSpec(oom=0.6, crash_loop=0.5)


def test_a_study_without_faults_keeps_its_digest():
    base = tiny_study()
    a = parse_study(base)
    assert not a.faults.active
    assert parse_study({**base, "faults": {"seed": 5}}).digest() == a.digest()
    assert parse_study({**base, "faults": {"oom": 0.1}}).digest() != a.digest()


def test_retry_rule_per_class():
    for cls in ("IMAGE_PULL", "READY_TIMEOUT", "SERVER_DIED", "BENCH_TIMEOUT",
                "LESSONS_UNAVAILABLE"):
        assert rule(cls).retry and should_retry(cls, 0)
        assert not should_retry(cls, MAX_ATTEMPTS - 1)  # the last try is final
    for cls in ("OOM_WEIGHTS", "CRASH_LOOP", "UNSUPPORTED_BACKEND", "INVALID_COMBINATION",
                "BAD_FLAG", "KV_NO_ROOM", "BENCH_INVALID", "UNKNOWN", None):
        assert not should_retry(cls, 0), cls
    assert rule("SERVER_DIED").redeploy and not rule("BENCH_TIMEOUT").redeploy
    # the policy is the taxonomy's: every class the classifier returns has its one rule there
    for cls in FAILURE_CLASSES:
        assert rule(cls) == TAXONOMY[cls].retry, cls
    assert should_retry("READY_TIMEOUT", 0) and not should_retry("READY_TIMEOUT", 1)  # once


# ------------------------------------------------------------------------------ deploy faults

def test_twin_backend_injects_by_launch_number_and_never_into_a_refused_config():
    spec = FaultSpec(seed=1, image_pull=0.5, oom=0.2)

    def phases(b: TwinBackend, config: ServingConfig) -> list[str]:
        out = []
        for _ in range(14):
            st = b.deploy("trial-x", config, {})
            out.append(f"{st.phase}:{st.failed_stage}:{st.exit_code}")
            b.teardown("trial-x")
        return out

    a, b = TwinBackend(faults=spec), TwinBackend(faults=spec)
    seq = phases(a, BASE)
    assert seq == phases(b, BASE)  # reproducible
    assert a.injected == b.injected and len(a.injected) == sum("Failed" in x for x in seq)
    assert "Failed:startup:None" in seq  # image pull: it never ran, so no exit code
    assert "Failed:load_weights:1" in seq and "Ready:None:None" in seq
    assert [r["attempt"] for r in a.injected] == sorted(r["attempt"] for r in a.injected)
    c = TwinBackend(faults=FaultSpec(seed=1, oom=1.0))
    assert set(phases(c, FA3)) == {"Failed:model_init:1"} and not c.injected
    assert TwinBackend().faults is None  # default: nothing injected


# ------------------------------------------------------------------------------ bench faults

@pytest.mark.parametrize("fault", BENCH_FAULTS)
def test_each_injected_benchmark_is_invalid_and_classified(fault, tmp_path):
    backend = TwinBackend()
    backend.deploy("trial-b", BASE, {})
    bench = BenchService(backend, tmp_path, [], faults=FaultSpec(**{fault: 1.0}))
    r = asyncio.run(bench.saturation("trial-b", 512, 64, 64, 5.0))
    assert not r.valid and bench.injected[0]["fault"] == fault
    assert bench_failure_class(r.valid, r.invalid_reason, r.errors_by_class) == \
        EXPECTED_CLASS[fault], (r.invalid_reason, r.errors_by_class)
    clean = BenchService(backend, tmp_path / "clean", [])
    ok = asyncio.run(clean.saturation("trial-b", 512, 64, 64, 5.0))
    assert ok.valid and not clean.injected
    assert bench_failure_class(ok.valid, ok.invalid_reason, ok.errors_by_class) is None


# ------------------------------------------------------------------------------ lesson store

def test_lesson_store_outage_is_retried_by_the_callers(tmp_path):
    from memory.store import LessonStore

    store = LessonStore(tmp_path / "lessons", embedding="hashing")
    try:
        flaky = FlakyStore(store, FaultSpec(lessons_outage=1.0, outage_calls=2))

        async def go() -> list:
            async with Client(lessons_server(flaky)) as c:  # type: ignore[arg-type]
                before = TRANSIENT_RETRIES["list_lessons"]
                got = await call(c, "list_lessons")
                return [got, TRANSIENT_RETRIES["list_lessons"] - before]

        got, retried = asyncio.run(go())
        assert got is not None and retried == 2 and flaky.refused == 2 and flaky.outages == 1
    finally:
        store.close()


# ------------------------------------------------------------------------------ a study

FAULTS = {"seed": 38, "oom": 0.075, "crash_loop": 0.075, "image_pull": 0.075,
          "ready_timeout": 0.075, "server_death": 0.1, "bench_garbage": 0.1,
          "bench_timeout": 0.1, "lessons_outage": 0.3}


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    from memory.store import LessonStore

    logging.getLogger("servetune").setLevel(logging.ERROR)
    tmp = tmp_path_factory.mktemp("faults")
    study = load_study(write(tmp, "s.yaml", tiny_study(faults=FAULTS)))
    store = LessonStore(tmp / "lessons", embedding="hashing")
    backend = TwinBackend()
    try:
        out = asyncio.run(run_study(study, "faults", tmp / "run", store,
                                    [Path(study.replay.trace).parent], research=False,
                                    backend=backend))
        assert_no_contradicted(tmp / "run", store)
    finally:
        store.close()
    led = Ledger(tmp / "run" / "ledger.sqlite")
    try:
        trials = led.trials()
    finally:
        led.close()
    return study, out, trials, backend, tmp / "run"


def test_the_study_completes_with_every_failure_classified_and_retried_by_its_class(faulty_run):
    study, out, trials, backend, run_dir = faulty_run
    assert out.stop_reason and trials
    events = read_events(run_dir / "events.jsonl")
    failures = [e for e in events if e["kind"] == "failure"]
    acc = fault_accounting(events)
    launches = sum(e.reason == "Created" for e in backend.events())
    injected_deploys = sum(acc["injected"].get(k, 0) for k in DEPLOY_FAULTS)
    assert launches >= 10 and injected_deploys >= 3
    assert set(acc["injected"]) >= {"oom", "crash_loop", "image_pull", "ready_timeout",
                                    "bench_timeout", "bench_garbage", "server_death"}
    assert acc["classified"] == acc["injected"]  # each injected fault got its own class
    assert acc["unknown"] == 0 and all(e["failure_class"] != "UNKNOWN" for e in failures)
    for e in failures:
        assert e["retried"] == should_retry(e["failure_class"], e["attempt"]), e
    retried = [e for e in failures if e["retried"]]
    assert retried and all(rule(e["failure_class"]).retry for e in retried)
    assert not any(e["failure_class"] in ("OOM_WEIGHTS", "CRASH_LOOP") for e in retried)
    lo = acc["lessons"]
    assert lo["refused"] > 0 and lo["retried"] == lo["refused"]
    # retried failures are on the trial rows; a transient class never wrote a lesson
    assert sum(len(t.retries) for t in trials) == len(retried)
    for t in trials:
        if t.failure_class is not None and rule(t.failure_class).retry:
            assert t.status == "failed" and not t.lessons_written


def test_the_report_lists_injected_against_classified(faulty_run):
    study, out, trials, _, run_dir = faulty_run
    acc = fault_accounting(read_events(run_dir / "events.jsonl"))
    path = render_report(run_dir, study, trials, [], run_id="faults", stop_reason="x",
                         elapsed_s=1.0, replay_requests=1, trace_file="t.jsonl")
    text = path.read_text()
    assert "## Injected faults" in text
    n = sum(acc["injected"].values())
    assert f"Injected {n} launch/benchmark faults; {n} were classified" in text
    for kind, k in acc["injected"].items():
        assert f"| {kind} | {k} | {EXPECTED_CLASS[kind]} | {k} |" in text
    assert "| lessons_outage |" in text and "UNKNOWN failures: 0" in text
