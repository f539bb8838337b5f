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
