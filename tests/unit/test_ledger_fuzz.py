"""The ledger's read-modify-writes are transactions: two writers on one file (threads sharing a
connection, or two connections) never hand out the same seq, never fail on a duplicate key, and a
failed write leaves nothing behind.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.config import ServingConfig
from domain.ledger import Ledger
from domain.trial import Trial

CFG = ServingConfig(model="glm-5", gpu="B200", weights="fp8", tp_size=8)


def trial(key: str) -> Trial:
    return Trial(run_id="r", seq=0, key=key, phase="search", status="keep", config=CFG,
                 reason="fuzz")


@settings(max_examples=15, deadline=None, derandomize=True)
@given(keys=st.lists(st.sampled_from([f"search:k{i}" for i in range(12)]), min_size=1,
                     max_size=24))
def test_concurrent_appends_keep_seqs_unique(tmp_path_factory: pytest.TempPathFactory,
                                             keys: list[str]) -> None:
    path = tmp_path_factory.mktemp("ledger") / "ledger.sqlite"
    shared, other = Ledger(path), Ledger(path)
    errors: list[BaseException] = []

    def work(led: Ledger, part: list[str]) -> None:
        try:
            for k in part:
                led.append(trial(k))
                led.update_status(k, "discard", "re-judged")
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(led, keys[i::3]))
               for i, led in enumerate((shared, shared, other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        got = shared.trials()
        assert [t.seq for t in got] == list(range(1, len(set(keys)) + 1))
        assert {t.key for t in got} == set(keys) and {t.status for t in got} == {"discard"}
        assert not shared._db.in_transaction and not other._db.in_transaction
    finally:
        shared.close()
        other.close()


def test_failed_update_rolls_back(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "ledger.sqlite")
    try:
        led.append(trial("search:a"))
        with pytest.raises(KeyError):
            led.update_status("search:missing", "keep")
        assert not led._db.in_transaction
        led.append(trial("search:b"))  # the connection is usable after the failure
        assert [t.seq for t in led.trials()] == [1, 2]
    finally:
        led.close()


def test_rows_carry_the_lints_of_their_config(tmp_path: Path) -> None:
    """The ledger's lint hook fills a row's lints (kept on read back, not refilled on resume);
    the run wires it to the pre-flight lints (graph/search.py:candidate_lints)."""
    from domain.trial import LintNote
    from graph.search import candidate_lints

    def lint(c: ServingConfig) -> list[LintNote]:  # a local finding, as lint_config gives one
        if (c.max_running_requests or 0) > 4 * (c.cuda_graph_max_bs_decode or 10**9):
            return [LintNote(severity="warn", code="MRR_ABOVE_GRAPH_CEILING",
                             message=f"max_running_requests {c.max_running_requests} far above "
                                     f"cuda_graph_max_bs_decode {c.cuda_graph_max_bs_decode}",
                             fix="raise --cuda-graph-max-bs-decode")]
        return []

    led = Ledger(tmp_path / "l.sqlite")
    led.lint = lint
    base = ServingConfig(model="glm-5", gpu="B200", tp_size=8, replicas=1, weights="fp8")
    hot = base.model_copy(update={"max_running_requests": 1024, "cuda_graph_max_bs_decode": 64})
    for i, c in enumerate((base, hot)):
        led.append(Trial(run_id="r", seq=0, key=f"search:{i}", phase="search",
                         status="pruned", config=c, reason="x"))
    led.lint = None
    again = Ledger(tmp_path / "l.sqlite")
    a, b = again.trials()
    assert a.lints == [] and [n.code for n in b.lints] == ["MRR_ABOVE_GRAPH_CEILING"]
    assert "1024 far above cuda_graph_max_bs_decode 64" in b.lints[0].message
    # the run's hook: the pre-flight lints (domain/preflight.py:lint_config) as the row's notes
    hook = candidate_lints(None)  # type: ignore[arg-type]
    assert [n.code for n in hook(hot)] == ["GRAPH_CEILING"] and hook(base) == []
    assert "max_running_requests 1024" in hook(hot)[0].message
    led.close()
    again.close()
