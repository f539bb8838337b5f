"""Lesson provenance, status and trust (domain/provenance.py, domain/lesson.py): the rules."""

from __future__ import annotations

import pytest

from domain.config import ServingConfig
from domain.lesson import STORED, Clause, Lesson, Scope
from domain.provenance import Contradiction, Provenance

TP8 = ServingConfig(model="glm-5", gpu="B200", weights="fp8", tp_size=8)
TP4 = TP8.model_copy(update={"tp_size": 4})


def lesson(backend: str | None = "twin", **extra: object) -> Lesson:
    prov = None if backend is None else Provenance(backend=backend, engine="sglang",
                                                   engine_version="0.5.23", run_id="r1",
                                                   trial="search:abc")
    return Lesson(title="tp 8 crashes on B200", scope=Scope(gpu="B200", model="glm-5"),
                  condition=[Clause(field="tp_size", op="eq", value=8)], outcome="crash",
                  root_cause="x", fix="y", evidence="RuntimeError: boom",
                  provenance=prov, **extra).with_id()


def test_the_id_hashes_the_finding_only_not_provenance_or_status():
    a, b = lesson("twin"), lesson("kubernetes")
    q = b.with_status("quarantined", "served in r2", by="operator (cli)")
    assert a.id == b.id == q.id


def test_an_old_stored_lesson_without_provenance_still_loads_and_is_untrusted():
    old = lesson(None).model_dump(mode="json")
    for key in ("provenance", "status", "history", "contradictions"):
        old.pop(key)
    back = Lesson.model_validate(old, context=STORED)
    assert back.status == "active" and back.provenance is None and back.forbids(TP8)
    assert back.trust() == (False, "unknown provenance (stored before provenance was "
                                   "recorded), not source-verified")
    assert not back.applies_on("kubernetes") and back.applies_on("twin")


@pytest.mark.parametrize("backend, verified, trusted, prunes_real", [
    ("twin", False, False, False),
    ("twin", True, True, True),
    ("local", False, True, True),
    ("kubernetes", False, True, True),
    ("estimate", False, False, True),
    ("research", False, False, True),
    (None, False, False, False),
    (None, True, True, True),
])
def test_trust_and_pruning_by_backend(backend, verified, trusted, prunes_real):
    x = lesson(backend, verified=verified, source_site="sglang/srt/server_args.py:1")
    assert x.trusted is trusted
    assert x.prunes(TP8, "twin") and x.prunes(TP8, None)  # a twin study heeds every lesson
    assert x.prunes(TP8, "local") is prunes_real and x.prunes(TP8, "kubernetes") is prunes_real
    assert not x.prunes(TP4, "twin")


def test_quarantined_and_retracted_lessons_forbid_nothing_and_restore_revives():
    x = lesson("local")
    for status in ("quarantined", "retracted"):
        y = x.with_status(status, "wrong", by="operator (cli)")
        assert y.covers(TP8) and not y.forbids(TP8) and not y.prunes(TP8, "twin")
        assert y.trust() == (False, f"{status}: wrong")
        back = y.with_status("active", "checked again", by="operator (cli)")
        assert back.forbids(TP8) and [h.status for h in back.history] == [status, "active"]
    with pytest.raises(ValueError, match="a reason is required"):
        x.with_status("retracted", "  ", by="operator (cli)")


def test_a_contradicted_real_lesson_is_no_longer_trusted_even_when_restored():
    c = Contradiction(backend="local", run_id="r2", trial="search:def", config_id="abc")
    x = lesson("local").model_copy(update={"contradictions": [c]})
    assert x.trust() == (False, "learned on local but contradicted by 1 measurement(s)")
    assert lesson("local", verified=True).model_copy(
        update={"contradictions": [c]}).trusted  # source-verified stays trusted


def test_which_measurements_weigh_against_which_lessons():
    twin = Contradiction(backend="twin", config_id="abc")
    real = Contradiction(backend="kubernetes", config_id="abc")
    assert twin.weighs_against(Provenance(backend="twin"))
    assert twin.weighs_against(None) and twin.weighs_against(Provenance(backend="estimate"))
    assert not twin.weighs_against(Provenance(backend="local"))  # the twin cannot overrule
    assert real.weighs_against(Provenance(backend="local"))
    assert real.weighs_against(Provenance(backend="twin"))


def test_provenance_notes_further_runs_once():
    p = Provenance(backend="twin", run_id="r1")
    assert p.seen_again("r1") is p and p.seen_again(None) is p
    q = p.seen_again("r2").seen_again("r2").seen_again("r3")
    assert q.runs == ["r2", "r3"]
    assert q.text() == "twin, run r1, seen again in 2 run(s)"


def test_provenance_text_is_redacted():
    token = "hf_" + "a" * 34
    p = Provenance(backend="local", image=f"registry/{token}", evidence=[f"token {token}"])
    assert token not in p.model_dump_json()
