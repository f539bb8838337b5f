"""`servetune run` with Claude brains, end to end over real HTTP: the CLI in a subprocess talks to
the Messages API stand-in (``tests/fixtures/anthropic_stub.py``) through ``ANTHROPIC_BASE_URL``.

A tiny twin study with a small SGLang-like source tree, so every role runs: planner (plan steps
and the research decision), deployer, analyst, and the source and memory researchers. Checked:
the report names Claude and the model and prices each role's tokens; the ledger keeps each
agent's usage; a malformed output is corrected once and counted; a 401 stops the run with one
line and loses no finished trial (and the run resumes); ``--brains claude`` without a key exits
2; the key never reaches a file of the run or the console.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from fixtures.anthropic_process import log_lines, running_stub
from fixtures.cli import ledger_rows, servetune, tiny_study, write
from fixtures.research_tree import build_tree

MODEL = "claude-stub-e2e-1"
KEY = "test-key-servetune-e2e-7f3c"  # not an sk-ant shape: redaction by pattern cannot hide it
ROLES = ("planner", "deployer", "analyst")
USAGE_FIELDS = {"tool_calls", "turns", "input_tokens", "output_tokens", "retries", "seconds"}
LAUNCHED = ("baseline", "keep", "discard", "crash")


def study() -> dict[str, Any]:
    """The tiny CLI study, capped lower: the baseline, fa3 (researched), and a few one-knob
    changes."""
    s = tiny_study(budget={"max_trials": 4, "patience": 3}, finalists=1, sweep_concurrency=[8])
    s["replay"]["duration_s"] = 60
    return s


def _clean(mp: pytest.MonkeyPatch) -> None:
    """No Anthropic or brains settings of this machine leak into the CLI runs."""
    for k in list(os.environ):
        if k.startswith("ANTHROPIC_") or k in ("SERVETUNE_BRAINS", "SERVETUNE_MODEL"):
            mp.delenv(k)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`_clean` for each test. Function-scoped: a module-scoped autouse fixture would put
    every test of the module in one xdist group (tests/conftest.py), on one worker, though
    only the tests reading :func:`normal` share a run."""
    _clean(monkeypatch)


def claude_run(tmp: Path, run_id: str, *flags: str, tree: Path | None = None,
               stub_log: Path | None = None) -> tuple[Any, list[dict[str, Any]]]:
    """`servetune run` of the tiny study with Claude brains against a stub started with
    ``flags``; (completed process, the stub's request log)."""
    tree = tree or build_tree(tmp)
    path = tmp / "tiny.yaml"
    if not path.exists():
        write(tmp, "tiny.yaml", study())
    log = stub_log or tmp / f"stub-{run_id}.jsonl"
    with running_stub(tmp / "stub", *flags, log=log) as url:
        r = servetune("run", str(path), "--run-id", run_id, "--brains", "claude",
                      "--model", MODEL, tmp=tmp,
                      env={"ANTHROPIC_API_KEY": KEY, "ANTHROPIC_BASE_URL": url,
                           "SERVETUNE_SGLANG_SOURCE": str(tree)})
    return r, log_lines(log)


def bodies(run_dir: Path) -> list[dict[str, Any]]:
    db = sqlite3.connect(run_dir / "ledger.sqlite")
    try:
        return [json.loads(b) for (b,) in db.execute("SELECT body FROM trials ORDER BY seq")]
    finally:
        db.close()


def cost_table(report: str) -> dict[str, dict[str, float]]:
    """Role -> column -> number of the report's LLM cost table."""
    m = re.search(r"^## [^\n]*LLM cost[^\n]*\n(.*?)(?=^## |\Z)", report, re.M | re.S)
    assert m, "the report has no LLM cost section"
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in m.group(1).splitlines() if line.startswith("|")]
    assert len(rows) >= 3, m.group(1)
    header, *body = rows
    out: dict[str, dict[str, float]] = {}
    for row in body:
        if set("".join(row)) <= set("-: "):
            continue  # the |---| rule
        role = row[0].strip("* ").lower()
        out[role] = {}
        for col, cell in zip(header[1:], row[1:], strict=False):
            try:
                out[role][col.lower()] = float(cell.replace(",", ""))
            except ValueError:
                pass
    return out


def col(cols: dict[str, float], *words: str) -> float:
    """The column whose name has all ``words`` (e.g. "input", "tok")."""
    (name,) = [c for c in cols if all(w in c for w in words) and "cache" not in c]
    return cols[name]


def no_secret(tmp: Path, run_dir: Path, *procs: Any) -> None:
    """The key is in no file of the run folder or the lesson store, nor on the console."""
    for folder in (run_dir, tmp / "lessons"):
        for p in folder.rglob("*"):
            if p.is_file():
                assert KEY.encode() not in p.read_bytes(), p
    for r in procs:
        assert KEY not in r.stdout and KEY not in r.stderr


@pytest.fixture(scope="module")
def normal(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("claude")
    with pytest.MonkeyPatch.context() as mp:  # made before any test's clean_env
        _clean(mp)
        r, log = claude_run(tmp, "c1")
    return tmp, r, log


@pytest.mark.slow
def test_claude_study_finishes_and_the_report_names_model_and_cost(normal):
    tmp, r, log = normal
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    run_dir = tmp / "runs" / "c1"
    report = (run_dir / "report.md").read_text()
    section = re.search(r"^## [^\n]*LLM cost.*?(?=^## |\Z)", report, re.M | re.S)
    assert section and "Claude" in section.group(0) and MODEL in section.group(0)
    assert "sglang serve --model-path" in report
    # every request reached the stub with the chosen model, and all roles took part
    ok = [e for e in log if e["status"] == 200]
    assert ok and len(ok) == len(log), [e for e in log if e["status"] != 200]
    assert {e["role"] for e in ok} >= {*ROLES, "source_researcher", "memory_researcher"}
    assert {e["kind"] for e in ok if e["role"] == "planner"} >= {"PLAN STEP",
                                                                  "RESEARCH DECISION"}
    table = cost_table(report)
    for role in (*ROLES, "researchers"):
        assert role in table, table
        assert col(table[role], "input", "tok") > 0 and col(table[role], "output", "tok") > 0
    # the counts are the API's usage: each role's (and the total) as the stub answered them
    for role in ("deployer", "analyst"):
        for kind in ("input", "output"):
            assert col(table[role], kind, "tok") == sum(e[f"{kind}_tokens"] for e in ok
                                                        if e["role"] == role), (role, kind)
    total = next(v for k, v in table.items() if "total" in k)
    for kind in ("input", "output"):
        assert col(total, kind, "tok") == sum(e[f"{kind}_tokens"] for e in ok)
    assert col(total, "retries") == 0


@pytest.mark.slow
def test_ledger_rows_carry_each_agents_usage(normal):
    tmp, r, log = normal
    assert r.returncode == 0, r.stderr[-3000:]
    rows = bodies(tmp / "runs" / "c1")
    search = [b for b in rows if b["phase"] == "search"]
    launched = [b for b in search if b["status"] in LAUNCHED]
    assert launched and not [b for b in rows if b["status"] == "failed"]
    seen: set[str] = set()
    for b in launched:
        usage = b["llm_usage"]
        assert {"deployer"} <= set(usage) <= {*ROLES}, (b["seq"], usage)
        if b["status"] != "crash":
            assert "analyst" in usage, b["seq"]
        for role, u in usage.items():
            assert USAGE_FIELDS <= set(u), (role, u)
            assert u["turns"] >= 1 and u["input_tokens"] > 0 and u["output_tokens"] > 0
            assert u["retries"] == 0
        seen |= set(usage)
    assert seen == set(ROLES)
    # deterministic stand-in: the deployer deploys, then (twin: at once Ready/Failed) submits
    deploys = [b["llm_usage"]["deployer"] for b in launched]
    assert all(u["tool_calls"] >= 1 for u in deploys)
    # fa3 on B200 was researched by both researchers through Claude and dropped before launch
    fa3 = [b for b in search if b["changed"] == "attention_backend=fa3"]
    assert fa3 and {b["status"] for b in fa3} == {"pruned"}
    outcomes = fa3[0]["research"]
    assert {o["question"]["kind"] for o in outcomes} == {"source", "memory"}
    assert all(o["status"] == "answered" and o["usage"]["turns"] >= 1 for o in outcomes)
    assert fa3[0]["research_decision"].startswith("dropped")
    assert any(re.fullmatch(r"sglang/srt/arg_groups/attention_hook\.py:\d+", e)
               for o in outcomes for c in o["findings"]["claims"] for e in c["evidence"])


@pytest.mark.slow
def test_no_secret_in_the_run_folder_or_console(normal):
    tmp, r, _ = normal
    no_secret(tmp, tmp / "runs" / "c1", r)


@pytest.mark.slow
def test_malformed_output_is_retried_once_counted_and_the_run_finishes(tmp_path):
    r, log = claude_run(tmp_path, "m1", "--malformed-once")
    assert r.returncode == 0, r.stderr[-3000:]
    bad = [e for e in log if e.get("malformed")]
    assert {e["role"] for e in bad} >= {*ROLES, "source_researcher", "memory_researcher"}
    run_dir = tmp_path / "runs" / "m1"
    rows = bodies(run_dir)
    assert not [b for b in rows if b["status"] == "failed"], "one bad output is corrected"
    retries: dict[str, int] = {}
    for b in rows:
        for role, u in b["llm_usage"].items():
            retries[role] = retries.get(role, 0) + u["retries"]
        for o in b["research"]:
            retries["researchers"] = retries.get("researchers", 0) + o["usage"]["retries"]
    # the first submit of each role (and task kind) was malformed: each was retried once; a
    # planner run that left no row (none here: the run ends on its trial cap) is not counted
    assert retries["deployer"] == 1 and retries["analyst"] == 1
    assert retries["planner"] >= 1 and retries["researchers"] == 2
    table = cost_table((run_dir / "report.md").read_text())
    total = next(v for k, v in table.items() if "total" in k)
    assert col(total, "retries") == sum(1 for _ in bad)
    no_secret(tmp_path, run_dir, r)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["after-first-judge", "in-research"])
def test_401_stops_with_one_line_keeps_finished_trials_and_resumes(tmp_path, normal, where):
    _, _, full_log = normal
    # the same run answers normally up to a point, then every request is a 401: after the
    # baseline's judge, or inside the first research round (whose branches run in parallel)
    roles = {"analyst"} if where == "after-first-judge" else {"source_researcher",
                                                               "memory_researcher"}
    n_ok = next(i for i, e in enumerate(full_log) if e["role"] in roles) + 1
    r, log = claude_run(tmp_path, "a1", "--401-after", str(n_ok))
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    auth = [x for x in lines if re.search(r"authenticat", x, re.I)]
    assert len(auth) == 1 and len(lines) <= 3, r.stderr
    assert log[-1]["status"] == 401 and len([e for e in log if e["status"] == 200]) == n_ok
    run_dir = tmp_path / "runs" / "a1"
    before = ledger_rows(run_dir / "ledger.sqlite")
    assert before and json.loads(before[0][4])["status"] == "baseline"
    assert json.loads(before[0][4])["llm_usage"]["analyst"]["turns"] >= 1
    assert not [b for b in bodies(run_dir) if b["status"] == "failed"]  # an API error is no
    no_secret(tmp_path, run_dir, r)                                     # agent's failure
    # rerun with a working API: the finished trials are kept as they were, the rest runs
    again, _ = claude_run(tmp_path, "a1", stub_log=tmp_path / "stub-a1-resume.jsonl")
    assert again.returncode == 0, again.stderr[-3000:]
    after = ledger_rows(run_dir / "ledger.sqlite")
    assert after[:len(before)] == before and len(after) > len(before)
    assert (run_dir / "report.md").exists()
    # research cut short by the API error was asked again, not kept as failed branches
    research = [o for b in bodies(run_dir) for o in b["research"]]
    assert research and all(o["status"] == "answered" for o in research), [
        o.get("error") for o in research]
    no_secret(tmp_path, run_dir, again)


@pytest.mark.slow
def test_always_401_stops_at_once_with_one_line(tmp_path):
    r, log = claude_run(tmp_path, "u1", "--always-401")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) <= 3 and re.search(r"authenticat", r.stderr, re.I), r.stderr
    assert log and {e["status"] for e in log} == {401}
    assert len(log) == 1  # a 401 is not retried, nor is the study pressed on with
    no_secret(tmp_path, tmp_path / "runs" / "u1", r)


def test_brains_claude_without_a_key_exits_2(tmp_path):
    path = write(tmp_path, "tiny.yaml", study())
    r = servetune("run", str(path), "--brains", "claude", tmp=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stderr.strip().startswith("error:")
    assert "ANTHROPIC_API_KEY" in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 3
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_every_api_call_is_metered_and_the_spend_is_printed(normal):
    tmp, r, log = normal
    run_dir = tmp / "runs" / "c1"
    calls = [json.loads(x) for x in (run_dir / "llm_calls.jsonl").read_text().splitlines()]
    assert len(calls) == len(log)  # one line per Messages API call, as the stub served them
    assert sum(c["input_tokens"] for c in calls) == sum(e["input_tokens"] for e in log)
    assert {c["model"] for c in calls} == {MODEL}
    assert {c["role"] for c in calls} >= {*ROLES, "source_researcher", "memory_researcher"}
    tok = sum(c[k] for c in calls for k in c if k.endswith("_tokens"))
    assert re.search(rf"LLM: {len(calls)} Messages API calls, {tok:,} tokens, est\. USD "
                     r"\d+\.\d\d", r.stdout), r.stdout[-800:]
    report = (run_dir / "report.md").read_text()
    assert f"(`llm_calls.jsonl`): {len(calls)} calls, {tok:,} tokens" in report
    assert "this run calls the paid Messages API (--brains claude)" in r.stdout


@pytest.mark.slow
def test_llm_token_cap_stops_the_search_and_the_rest_makes_no_api_call(tmp_path):
    s = study()
    s["budget"] = {**s["budget"], "max_llm_tokens": 5000}
    write(tmp_path, "tiny.yaml", s)
    r, log = claude_run(tmp_path, "k1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"stopped: LLM tokens budget reached \([\d,]+ of 5,000 tokens\); "
                     r"validation and the frontier run with the deterministic brains",
                     r.stdout.replace("\n", " ")), r.stdout[-1500:]
    rows = bodies(tmp_path / "runs" / "k1")
    later = [b for b in rows if b["phase"] != "search"]
    assert later and all(not b["llm_usage"] for b in later)
    calls = (tmp_path / "runs" / "k1" / "llm_calls.jsonl").read_text().splitlines()
    assert len(calls) == len(log)  # no API call after the cap outside the ledger's view


@pytest.mark.slow
def test_rerendering_a_finished_run_without_a_key_keeps_its_brains(normal):
    tmp, _, _ = normal
    path = tmp / "tiny.yaml"
    r = servetune("run", str(path), "--run-id", "c1", "--brains", "deterministic", tmp=tmp)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "already complete" in r.stdout
    report = (tmp / "runs" / "c1" / "report.md").read_text()
    assert f"model `{MODEL}`" in report and "resumed with other brains" not in report
