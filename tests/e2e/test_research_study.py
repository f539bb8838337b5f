"""A twin study whose candidate is research-worthy, run as a user runs it: the report shows the
parallel questions, their cited answers, the decision they changed and the launch avoided.
"""

from __future__ import annotations

import json
import re
import sqlite3

from fixtures.cli import servetune, tiny_study, write
from fixtures.research_tree import build_tree


def test_research_drops_fa3_on_b200_before_launch_and_the_report_says_why(tmp_path):
    tree = build_tree(tmp_path)  # a small SGLang-like tree with the fa3 SM check
    study = write(tmp_path, "tiny.yaml", tiny_study())
    r = servetune("run", str(study), "--run-id", "r1", tmp=tmp_path,
                  env={"SERVETUNE_SGLANG_SOURCE": str(tree)})
    assert r.returncode == 0, r.stderr
    assert f"research: SGLang 0.5.23 source at {tree}" in r.stdout.replace("\n", "")
    db = sqlite3.connect(tmp_path / "runs" / "r1" / "ledger.sqlite")
    bodies = [json.loads(b) for (b,) in db.execute("SELECT body FROM trials ORDER BY seq")]
    db.close()
    fa3 = [b for b in bodies if b["changed"] == "attention_backend=fa3"]
    # never launched: the first fa3 candidate is dropped by research, writing a lesson that
    # prunes every later fa3 candidate without asking again
    assert {b["status"] for b in fa3} == {"pruned"}
    assert fa3[0]["reason"].startswith("research: B200 is SM 100, outside what the source")
    lesson = fa3[0]["lessons_written"][0]
    assert lesson["source"] == "research"
    assert all(b["lesson_ids"] == [lesson["id"]] and not b["research"] for b in fa3[1:])
    outcomes = fa3[0]["research"]
    assert {o["question"]["kind"] for o in outcomes} == {"source", "memory"}
    assert all(o["status"] == "answered" for o in outcomes)
    a, b = outcomes  # the two branches ran at the same time
    assert a["started_s"] < b["finished_s"] and b["started_s"] < a["finished_s"]
    report = (tmp_path / "runs" / "r1" / "report.md").read_text()
    section = report.split("## Research before launches")[1].split("\n## ")[0]
    assert "launches avoided: 1" in section
    assert "### attention_backend=fa3" in section and "Decision: dropped: B200 is SM 100" in section
    assert "sglang/srt/arg_groups/attention_hook.py:" in section  # a file:line citation
    # the lesson prunes fa3 in the next run without asking again (a shorter study whose one
    # candidate is fa3, so no ranking of the twin's estimates decides whether it is reached)
    short = write(tmp_path, "short.yaml", tiny_study(
        knobs={"attention_backend": ["unset", "fa3"]}, finalists=1, sweep_concurrency=[8],
        budget={"max_trials": 2, "patience": 1}))
    again = servetune("run", str(short), "--run-id", "r2", tmp=tmp_path,
                      env={"SERVETUNE_SGLANG_SOURCE": str(tree)})
    assert again.returncode == 0, again.stderr
    assert "pruned attention_backend=fa3 (forbidden by lesson" in again.stdout
    db = sqlite3.connect(tmp_path / "runs" / "r2" / "ledger.sqlite")
    rows = [json.loads(b) for (b,) in db.execute("SELECT body FROM trials ORDER BY seq")]
    db.close()
    fa3 = [b for b in rows if b["changed"] == "attention_backend=fa3"]
    assert fa3 and all(b["status"] == "pruned" and not b["research"]
                       and b["lesson_ids"] == [lesson["id"]] for b in fa3)


def test_study_caps_stop_the_search_and_say_which(tmp_path):
    tree = build_tree(tmp_path)
    budget = {"max_trials": 8, "patience": 4, "max_gpu_hours": 0.03,
              "max_research_questions": 0}
    study = write(tmp_path, "capped.yaml", tiny_study(budget=budget))
    r = servetune("run", str(study), "--run-id", "c1", tmp=tmp_path,
                  env={"SERVETUNE_SGLANG_SOURCE": str(tree)})
    assert r.returncode == 0, r.stderr
    assert re.search(r"stopped: GPU-hours budget reached \(0\.\d\d of 0\.03 GPU-hours\)",
                     r.stdout), r.stdout[-800:]
    report = (tmp_path / "runs" / "c1" / "report.md").read_text()
    assert "## Research before launches" not in report  # no question allowed
    db = sqlite3.connect(tmp_path / "runs" / "c1" / "ledger.sqlite")
    bodies = [json.loads(b) for (b,) in db.execute(
        "SELECT body FROM trials WHERE phase='search' ORDER BY seq")]
    db.close()
    # a launch that crashed (fa3 on B200: no research allowed to drop it first) ran no
    # benchmark and costs no GPU-hours; nor does a pruned candidate
    assert all(b["saturation"] is None for b in bodies if b["status"] in ("crash", "pruned"))
    # GPUs x benchmark seconds x runs of the search rows that ran a benchmark (as
    # domain/usage.py:spent counts them): the cap was crossed by the last benchmark, not before
    ran = [b for b in bodies if b["saturation"] is not None]
    assert ran[-1]["seq"] == bodies[-1]["seq"]  # the search stopped right after that benchmark
    hours = [b["config"]["tp_size"] * b["config"]["replicas"] * b["saturation"]["duration_s"]
             / 3600 * max(1, len(b["objective_runs"])) for b in ran]
    assert sum(hours) >= 0.03 > sum(hours[:-1])
