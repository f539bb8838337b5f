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


def test_big_regressions_are_not_retried_from_later_incumbents():
    from graph.search import _losers

    cfg = ServingConfig(model="glm-5", gpu="B200", tp_size=8, weights="fp8")

    def t(seq, status, changed, objective, parent=None):
        return Trial(run_id="r", seq=seq, key=f"k{seq}", phase="search", status=status,
                     config=cfg, changed=changed, parent_seq=parent, reason="",
                     objective=objective)

    trials = [t(1, "baseline", "", 1000.0), t(2, "discard", "chunked_prefill_size=1", 7.0, 1),
              t(3, "discard", "max_running_requests=128", 700.0, 1),
              t(4, "keep", "weights=nvfp4", 1500.0, 1)]
    losers = _losers(trials, share=0.5)
    assert set(losers) == {"chunked_prefill_size=1"}  # lost 99 %; the 30 % loss is retried
    assert losers["chunked_prefill_size=1"].startswith("chunked_prefill_size=1 cost 99% ")


def test_the_graph_draws_the_loop_and_docs_hold_its_picture():
    from pathlib import Path

    from graph.supervisor import build_graph

    g = build_graph().compile().get_graph()
    edges = {(e.source, e.target) for e in g.edges}
    loop = ["plan", "prune", "research", "deploy", "benchmark", "decide", "record", "plan"]
    assert set(zip(loop, loop[1:], strict=False)) <= edges
    assert {("plan", "validate"), ("validate", "frontier"), ("frontier", "__end__")} <= edges
    doc = Path(__file__).resolve().parents[2] / "docs" / "architecture-graph.mmd"
    assert doc.read_text() == g.draw_mermaid()  # regenerate the file when the graph changes
