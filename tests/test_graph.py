"""The supervisor's resume rules and the ledger it derives its position from."""

from __future__ import annotations

from domain.config import ServingConfig
from domain.ledger import Ledger
from domain.trial import Trial
from graph.run import resume_input


def test_resume_input_cases():
    assert resume_input("r", {}, ()) == {"run_id": "r", "phase": "search"}
    assert resume_input("r", {"phase": "search"}, ("search",)) is None
    # killed between a node's writes and its routing: re-enter at the recorded phase
    assert resume_input("r", {"phase": "validate", "cursor": 1}, ()) == \
        {"run_id": "r", "phase": "validate"}


def test_ledger_append_is_idempotent_and_survives_reopen(tmp_path):
    cfg = ServingConfig(model="glm-5", gpu="B200", tp_size=8, weights="fp8")
    led = Ledger(tmp_path / "ledger.sqlite")
    t = Trial(run_id="r", seq=0, key="search:x", phase="search", status="baseline", config=cfg,
              reason="baseline", objective=123.0)
    first = led.append(t)
    again = led.append(t.model_copy(update={"status": "discard"}))
    assert first.seq == again.seq == 1 and again.status == "baseline"
    led.close()
    led = Ledger(tmp_path / "ledger.sqlite")
    assert [x.key for x in led.trials()] == ["search:x"]
    assert led._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    led.close()
