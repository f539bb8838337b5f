"""The report's "Injected faults" section: what a study's ``faults`` injected vs classified.

Both sides come from ``events.jsonl``: ``injected`` events (written by :func:`graph.run.run_study`
from the twin backend, the bench server and the lesson-store wrapper) and ``failure`` events
(written by :mod:`graph.retry` for every failed launch or benchmark, with its class and whether
it was retried). An injected fault counts as classified when a failure of its deployment carries
the class it must get (:data:`domain.faults.EXPECTED_CLASS`); failures nobody injected are the
twin's own (configs the engine refuses or that do not fit).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from domain.faults import EXPECTED_CLASS, rule
from domain.study import Study


def read_events(path: Path) -> list[dict[str, Any]]:
    """The events of ``events.jsonl``.

    A line that is not a JSON object is skipped: not UTF-8, not JSON (a killed run's
    half-written line), an integer over Python's digit limit, or nested too deep to parse.
    """
    out: list[dict[str, Any]] = []
    if not path.is_file():
        return out
    with path.open("rb") as f:
        for raw in f:
            try:
                ev = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError):
                continue
            if isinstance(ev, dict):
                out.append(ev)
    return out


def fault_accounting(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Injected faults per kind, classified failures per class and how they were matched.

    Returns:
        ``injected`` (kind -> n), ``classified`` (kind -> injected faults whose deployment
        failed with the expected class), ``failures`` (class -> n), ``retried`` (class -> n),
        ``lessons`` (the lesson-store outage event or None), ``unknown`` (failures classed
        UNKNOWN).
    """
    injected: Counter[str] = Counter()
    by_name: Counter[tuple[str, str]] = Counter()  # (deployment, expected class) -> injected
    lessons = None
    for ev in events:
        if ev.get("kind") != "injected":
            continue
        if ev.get("what") == "lessons":
            lessons = ev
            continue
        kind = str(ev.get("fault"))
        injected[kind] += 1
        name = str(ev.get("name") or ev.get("deployment") or "")
        by_name[(name, EXPECTED_CLASS.get(kind, "?"))] += 1
    failures: Counter[str] = Counter()
    retried: Counter[str] = Counter()
    seen: Counter[tuple[str, str]] = Counter()
    for ev in events:
        if ev.get("kind") != "failure":
            continue
        cls = str(ev.get("failure_class"))
        failures[cls] += 1
        retried[cls] += bool(ev.get("retried"))
        seen[(str(ev.get("name")), cls)] += 1
    classified: Counter[str] = Counter()
    for (name, cls), n in by_name.items():
        kind = next(k for k, c in EXPECTED_CLASS.items() if c == cls)
        classified[kind] += min(n, seen[(name, cls)])
    return {"injected": dict(injected), "classified": dict(classified),
            "failures": dict(failures), "retried": dict(retried), "lessons": lessons,
            "unknown": failures.get("UNKNOWN", 0)}


def faults_section(study: Study, events_path: Path) -> list[str]:
    """The report lines (none when the study injects nothing)."""
    if not study.faults.active:
        return []
    acc = fault_accounting(read_events(events_path))
    inj, cl = acc["injected"], acc["classified"]
    f = study.faults
    shares = ", ".join(f"{k} {getattr(f, k):.0%}" for k in EXPECTED_CLASS
                       if getattr(f, k) > 0)
    lines = ["## Injected faults", "",
             f"The study's `faults` (seed {f.seed}: {shares}) made the twin fail on purpose. "
             "Each fault is visible only as a cluster shows it (engine log lines, the kubelet's "
             "verdict, failed requests), and was classified from that alone.", "",
             "| fault | injected | classified as | classified | retried by rule |",
             "|---|---|---|---|---|"]
    for kind, cls in EXPECTED_CLASS.items():
        if kind == "lessons_outage" or not inj.get(kind):
            continue
        r = rule(cls)
        lines.append(f"| {kind} | {inj[kind]} | {cls} | {cl.get(kind, 0)} | "
                     f"{'yes' if r.retry else 'no'}: {r.why} |")
    lo = acc["lessons"]
    if lo is not None:
        lines.append(f"| lessons_outage | {lo.get('outages', 0)} outages, {lo.get('refused', 0)} "
                     f"calls refused | LESSONS_UNAVAILABLE | {lo.get('retried', 0)} calls "
                     f"retried | yes: {rule('LESSONS_UNAVAILABLE').why} |")
    total_inj = sum(inj.values())
    total_cl = sum(cl.values())
    lines += ["", f"Injected {total_inj} launch/benchmark faults; {total_cl} were classified "
              f"into the class they must get, {total_inj - total_cl} were not.", "",
              "| failure class | failures | retried |", "|---|---|---|"]
    for cls, n in sorted(acc["failures"].items()):
        lines.append(f"| {cls} | {n} | {acc['retried'].get(cls, 0)} |")
    lines += ["", "Failures outside the injected ones are the twin's own (a config the engine "
              "refuses or that does not fit); UNKNOWN failures: "
              f"{acc['unknown']}.", ""]
    return lines
