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
    from graph.supervisor import _losers

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


def test_failure_families_of_the_v1_knobs():
    from domain.config import ServingConfig
    from domain.engines.sglang.lessons import failure_condition

    base = dict(model="glm-5", gpu="B200", weights="fp8")
    spec = ServingConfig(**base, tp_size=4, speculative_algorithm="NEXTN")
    _, clauses = failure_condition(spec, "OOM_WEIGHTS")
    plain = ServingConfig(**base, tp_size=4)
    # the draft layer may be what overflowed: plain configs stay allowed
    assert all(c.matches(spec) for c in clauses)
    assert not all(c.matches(plain) for c in clauses)
    hic = ServingConfig(**base, tp_size=8, enable_hierarchical_cache=True, hicache_ratio=5.0)
    _, clauses = failure_condition(hic, "HOST_OOM_HICACHE")
    bigger = hic.model_copy(update={"hicache_ratio": 8.0})
    smaller = hic.model_copy(update={"hicache_ratio": 3.0})
    assert all(c.matches(bigger) for c in clauses)
    assert not all(c.matches(smaller) for c in clauses)


def test_invalid_combination_lessons_name_the_family_from_the_engine_message():
    from agents.analyst import failure_lesson
    from agents.deployer import DeployOutcome
    from domain.config import ServingConfig
    from domain.engines.sglang.failures import classify
    from domain.twin.startup import start

    base = dict(model="glm-5", gpu="B200", weights="fp8", tp_size=8)
    cases = {
        "hicache+radix-off": ServingConfig(**base, enable_hierarchical_cache=True,
                                           disable_radix_cache=True),
        "partial triple": ServingConfig(**base, speculative_algorithm="NEXTN",
                                        speculative_eagle_topk=1),
        "negative conservativeness": ServingConfig(**base, schedule_conservativeness=-1.0),
    }
    for name, cfg in cases.items():
        s = start(cfg)
        assert not s.ready, name
        cls, evidence = classify(s.log)
        assert cls == "INVALID_COMBINATION", (name, s.log[-3:])
        lesson = failure_lesson(cfg, DeployOutcome(name="x", ready=False, failure_class=cls,
                                                   evidence=evidence, stage=s.phase,
                                                   log_tail=s.log), "run", "k")
        # the family is narrow: a few clauses about the conflicting knobs, not the whole config
        assert len(lesson.condition) <= 3, (name, [c.text() for c in lesson.condition])
        assert lesson.scope.gpu is None and lesson.scope.model is None
        assert lesson.forbids(cfg)
        assert not lesson.forbids(ServingConfig(**base)), name
        assert "refuses" in lesson.title
    spec = failure_lesson(cases["partial triple"], DeployOutcome(
        name="x", ready=False, failure_class="INVALID_COMBINATION", evidence="AssertionError",
        stage="resolve"), "run", "k")
    assert "all of --speculative-num-steps" in spec.fix


def test_host_oom_lesson_uses_the_engine_arithmetic_for_the_ratio_limit():
    from domain.config import ServingConfig
    from domain.engines.sglang.lessons import failure_condition

    cfg = ServingConfig(model="glm-5", gpu="B200", weights="fp8", tp_size=8,
                        enable_hierarchical_cache=True, hicache_ratio=50.0)
    evidence = ("ValueError: Not enough host memory available. Requesting 2000.00 GB but only "
                "have 160.00 GB free.")
    _, clauses = failure_condition(cfg, "HOST_OOM_HICACHE", evidence)
    ratio = next(c for c in clauses if c.field == "hicache_ratio")
    assert (ratio.op, ratio.value) == ("gt", 4.0)  # 50 x 160 / 2000
    assert all(c.matches(cfg.model_copy(update={"hicache_ratio": 8.0})) for c in clauses)
    assert not all(c.matches(cfg.model_copy(update={"hicache_ratio": 3.0})) for c in clauses)


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
