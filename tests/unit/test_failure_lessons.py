"""A failure becomes a lesson naming its family: the SGLang failure lessons and conditions.

Covers ``domain.engines.sglang.lessons`` (``failure_condition``) and the analyst's
``agents.analyst.failure_lesson`` over failures classified from the twin's startup logs: the
lesson's condition is the narrow family of configs the engine refuses the same way.
"""

from __future__ import annotations

from agents.analyst import failure_lesson
from agents.deployer import DeployOutcome
from domain.config import ServingConfig
from domain.engines.sglang.failures import classify
from domain.engines.sglang.lessons import failure_condition
from domain.twin.startup import start


def test_failure_families_of_the_v1_knobs():
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
    cfg = ServingConfig(model="glm-5", gpu="B200", weights="fp8", tp_size=8,
                        enable_hierarchical_cache=True, hicache_ratio=50.0)
    evidence = ("ValueError: Not enough host memory available. Requesting 2000.00 GB but only "
                "have 160.00 GB free.")
    _, clauses = failure_condition(cfg, "HOST_OOM_HICACHE", evidence)
    ratio = next(c for c in clauses if c.field == "hicache_ratio")
    assert (ratio.op, ratio.value) == ("gt", 4.0)  # 50 x 160 / 2000
    assert all(c.matches(cfg.model_copy(update={"hicache_ratio": 8.0})) for c in clauses)
    assert not all(c.matches(cfg.model_copy(update={"hicache_ratio": 3.0})) for c in clauses)
