"""A twin study whose HiCache host OOM writes a lesson covering a ratio that already served.

Issue 18: "A host-memory OOM at HiCache ratio 4 on TP8 wrote a lesson forbidding ratios above
0.32 at TP8, right after ratio 2 had run fine in the same study." On the twin, GLM-5 FP8 TP8 on
8x B200 serves HiCache ratio 2; ratio 8 runs out of host memory on the seventh of the node's
eight GPU processes ("Requesting 478.01 GB but only have 77.24 GB free"), and the lesson rule
that scales the ratio by free/requested puts the limit near 1.3, which covers ratio 2. The run
must quarantine that lesson at once and say so; the shared runner then checks that no lesson
of the run forbids a config it measured serving (fixtures/lesson_invariants.py).
"""

from __future__ import annotations

import json

import pytest
from fixtures.cli import ledger_rows, run_deterministic, tiny_study, write
from fixtures.lesson_invariants import contradicted_lessons

from domain.config import ServingConfig
from memory.store import LessonStore

pytestmark = pytest.mark.slow


def test_hicache_host_oom_lesson_covering_a_served_ratio_is_quarantined(tmp_path):
    base = tiny_study()["baseline"]
    study = tiny_study(
        baseline={**base, "enable_hierarchical_cache": True, "hicache_ratio": 2.0},
        knobs={"hicache_ratio": [2.0, 8.0]}, finalists=1, sweep_concurrency=[8],
        budget={"max_trials": 3, "patience": 2})
    r = run_deterministic(tmp_path, write(tmp_path, "s.yaml", study), "hc1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(body) for *_, body in ledger_rows(tmp_path / "runs" / "hc1" /
                                                         "ledger.sqlite")]
    served = [t for t in rows if t["status"] == "baseline"]
    oom = [t for t in rows if t["failure_class"] == "HOST_OOM_HICACHE"]
    assert served and served[0]["config"]["hicache_ratio"] == 2.0
    assert oom and oom[0]["config"]["hicache_ratio"] == 8.0, [
        (t["status"], t["changed"], t["failure_class"]) for t in rows]
    written = oom[0]["lessons_written"]
    assert written and written[0]["provenance"]["backend"] == "twin"
    assert written[0]["provenance"]["image"].startswith("lmsysorg/sglang")
    assert written[0]["provenance"]["run_id"] == "hc1"
    ratio2 = ServingConfig.model_validate(served[0]["config"])
    with LessonStore(tmp_path / "lessons") as store:
        lesson = store.get(written[0]["id"])
    assert lesson is not None
    if lesson.covers(ratio2):  # the lesson rule of today: the limit lies below 2
        assert lesson.status == "quarantined", lesson.condition_text()
        assert not lesson.forbids(ratio2) and not lesson.trusted
        assert lesson.contradictions[0].trial == served[0]["key"]
        assert "contradicted" in lesson.history[-1].reason
        assert lesson.history[-1].by == "measurement (twin)"
        assert f"quarantined lesson {lesson.id}" in r.stdout
        events = [json.loads(x) for x in (tmp_path / "runs" / "hc1" / "events.jsonl")
                  .read_text().splitlines()]
        assert [e["id"] for e in events if e["kind"] == "lesson-quarantined"] == [lesson.id]
        report = (tmp_path / "runs" / "hc1" / "report.md").read_text()
        assert "## Quarantined lessons" in report and f"| `{lesson.id}` |" in report
    else:  # a lesson rule that keeps to the failing ratio's family: nothing to quarantine
        assert lesson.status == "active"
    assert contradicted_lessons(tmp_path / "runs" / "hc1", tmp_path / "lessons") == []
