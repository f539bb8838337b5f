"""What research decides before a launch (domain/research.py) and the lesson a research drop
writes (domain/lesson_builders.research_lesson): pure rules, no researcher, no server."""

from __future__ import annotations

from domain.config import ServingConfig
from domain.lesson_builders import research_lesson
from domain.research import RESEARCH_FLAGS, research_change, research_verdict

FA3_CLAIM = "fa3: FlashAttention v3 Backend requires SM>=80 and SM<=90"


def cfg(gpu: str = "B200", **over) -> ServingConfig:
    return ServingConfig(gpu=gpu, model="llama-3.1-8b", weights="bf16", tp_size=1, **over)


def outcome(text: str, kind: str = "source", value: str = "fa3",
            status: str = "answered") -> dict:
    return {"status": status, "question": {"kind": kind, "value": value},
            "findings": {"claims": [{"text": text, "evidence": ["server_args.py:10", "x:2",
                                                                "y:3"]}]}}


def test_research_change_picks_the_first_research_worthy_change_not_seen():
    assert set(RESEARCH_FLAGS) >= {"attention_backend", "tp_size", "kv_cache_dtype"}
    assert research_change("router_policy=cache_aware, tp_size=2") == "tp_size=2"
    assert research_change("tp_size=2, kv_cache_dtype=fp8_e4m3", {"tp_size=2, x=1"}) == \
        "kv_cache_dtype=fp8_e4m3"
    assert research_change("router_policy=cache_aware") is None
    assert research_change("tp_size=2", {"tp_size=2"}) is None


def test_a_source_claim_whose_sm_range_excludes_the_gpu_drops_the_candidate():
    why = research_verdict([outcome(FA3_CLAIM)], cfg(attention_backend="fa3"))
    assert why is not None and why.startswith("B200 is SM 100, outside what the source")
    assert "[server_args.py:10; x:2]" in why  # two pieces of evidence at most
    # the same claim on a Hopper GPU (SM 90) holds: launch
    assert research_verdict([outcome(FA3_CLAIM)], cfg("H100", attention_backend="fa3")) is None


def test_claims_that_say_nothing_of_this_value_or_are_unanswered_keep_the_candidate():
    c = cfg(attention_backend="fa3")
    assert research_verdict([], c) is None
    assert research_verdict([outcome(FA3_CLAIM, status="failed")], c) is None
    assert research_verdict([outcome(FA3_CLAIM, kind="memory")], c) is None
    assert research_verdict([outcome(FA3_CLAIM, value="flashinfer")], c) is None
    assert research_verdict([outcome("fa3 is the default on Hopper")], c) is None
    # a claim with no value to match applies to the question's flag whatever it says
    assert research_verdict([outcome("requires sm == 90", value="")], c) is not None


def test_the_research_lesson_forbids_the_value_on_this_gpu_for_every_model():
    c = cfg(attention_backend="fa3")
    lesson = research_lesson(c, "attention_backend=fa3, tp_size=1", FA3_CLAIM, "r")
    assert lesson.outcome == "unsupported" and lesson.failure_class == "UNSUPPORTED_BACKEND"
    assert lesson.source == "research" and lesson.run_id == "r" and lesson.id
    assert lesson.title == ("--attention-backend fa3 refused on B200 (SM 100), per the SGLang "
                            "source")
    assert lesson.forbids(c) and lesson.forbids(c.model_copy(update={"model": "qwen3-32b"}))
    assert not lesson.forbids(c.model_copy(update={"attention_backend": "flashinfer"}))
    # a knob that names another field (speculative sets speculative_algorithm)
    spec = research_lesson(cfg(speculative_algorithm="EAGLE"), "speculative=EAGLE", "x", "r")
    assert spec.failure_class == "INVALID_COMBINATION"
    assert [c.field for c in spec.condition] == ["speculative_algorithm"]
