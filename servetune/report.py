"""The end-of-run report: ``report.md`` plus PNG plots, written into a run's folder.

Everything shown comes from the ledger's trials, the study and the lessons handed in, plus the
run's ``events.jsonl`` (the backend and the endpoints that said they were simulated, written by
:func:`graph.run.run_study`, named in the report's first lines; injected faults); nothing is
measured here. Units: throughput in output tokens per second (per GPU, or per user = 1 / TPOT),
latencies in milliseconds, durations in seconds. Files are written atomically (temp file in the
same folder, then ``os.replace``) so a reader never sees half a report.
"""

from __future__ import annotations

import json
import math
import os
import sys
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from domain.lesson import Lesson
from domain.metrics import MetricsSummary
from domain.pareto import dominated_by, pareto_front
from domain.study import SLO, Study
from domain.trial import Trial
from servetune.faults_report import faults_section, read_events

SEARCH_PNG = "search.png"
FRONTIER_PNG = "frontier.png"
REPLAY_PNG = "replay_ttft.png"
EVIDENCE_LINES = 12
REASON_CHARS = 240
STATUS_STYLE: dict[str, tuple[str, str]] = {  # status -> (marker, colour)
    "baseline": ("s", "tab:blue"),
    "keep": ("o", "tab:green"),
    "discard": ("o", "tab:gray"),
    "crash": ("x", "tab:red"),
    "failed": ("X", "tab:orange"),
}
ROLES = ("planner", "deployer", "analyst", "researchers")


# ---------------------------------------------------------------- formatting helpers
def _num(v: float | None, digits: int = 1) -> str:
    """``v`` with thousands separators, '' for None, 'n/a' for NaN."""
    if v is None:
        return ""
    if isinstance(v, float) and math.isnan(v):
        return "n/a"
    return f"{v:,.{digits}f}"


def _cell(text: object) -> str:
    """One Markdown table cell: a single line with ``|`` escaped."""
    s = " ".join(str(text).split())
    if len(s) > REASON_CHARS:
        s = s[: REASON_CHARS - 1] + "…"
    return s.replace("|", "\\|")


def _table(header: list[str], rows: Iterable[list[object]]) -> list[str]:
    """Markdown table lines."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def _changed(t: Trial) -> str:
    return t.changed or "baseline"


def _fence(text: str, lang: str = "") -> list[str]:
    """``text`` in a code fence longer than any backtick run inside it."""
    longest, run = 0, 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    fence = "`" * max(3, longest + 1)
    return [fence + lang, text, fence]


def _concurrency(t: Trial) -> int | None:
    """Concurrency of a frontier trial, from its key ``frontier:<config_id>:<c>``."""
    parts = t.key.split(":")
    if len(parts) == 3 and parts[2].isdigit():
        return int(parts[2])
    words = t.reason.split()
    return int(words[-1]) if words and words[-1].isdigit() else None


# ---------------------------------------------------------------- atomic writes
def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temp file next to ``path``, then rename it onto ``path``.

    The temp name is unique per process and call; the file is created by ``write`` itself, so
    it gets the usual umask permissions (``mkstemp`` would leave it owner-only).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _save(fig: Figure, path: Path) -> None:
    """Save ``fig`` as PNG at ``path`` atomically and release it."""
    try:
        fig.tight_layout()
        _write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    finally:
        fig.clear()


def _new_figure(width_in: float, height_in: float) -> Figure:
    """A Figure bound to the Agg canvas (no pyplot, no global figure registry)."""
    fig = Figure(figsize=(width_in, height_in))
    FigureCanvasAgg(fig)
    return fig


# ---------------------------------------------------------------- plots
def plot_search(trials: list[Trial], path: Path) -> bool:
    """Objective (output tok/s/GPU) per launched search trial and the running best.

    Crashes are drawn at 0 tok/s/GPU with an ``x``. Returns False (no file) when no search
    trial was launched.
    """
    launched = [t for t in trials if t.phase == "search" and t.launched]
    if not launched:
        return False
    fig = _new_figure(max(6.0, 0.55 * len(launched) + 2.0), 4.5)
    ax = fig.add_subplot()
    xs = list(range(len(launched)))
    for status, (marker, colour) in STATUS_STYLE.items():
        pts = [(x, t.objective or 0.0) for x, t in zip(xs, launched, strict=True)
               if t.status == status]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=colour,
                       s=60 if status == "crash" else 45, label=status, zorder=3)
    best, running = [], math.nan
    for t in launched:
        if t.status in ("baseline", "keep") and t.objective is not None:
            running = t.objective if math.isnan(running) else max(running, t.objective)
        best.append(running)
    ax.step(xs, best, where="post", color="tab:green", alpha=0.6, label="running best")
    ax.set_xticks(xs, [f"#{t.seq} {_changed(t)}" for t in launched], rotation=45, ha="right",
                  fontsize=8)
    ax.set_ylabel("output tok/s/GPU (saturation)")
    ax.set_ylim(bottom=0)
    ax.set_title("Search: objective per launched trial")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)
    return True


def frontier_points(trials: list[Trial]) -> list[tuple[Trial, int | None]]:
    """Frontier-phase trials with a saturation summary, grouped by config, by concurrency.

    Returns:
        ``(trial, concurrency)`` pairs; configs in first-seen order.
    """
    groups: dict[str, list[Trial]] = {}
    for t in trials:
        if t.phase == "frontier" and t.saturation is not None:
            groups.setdefault(t.config.config_id(), []).append(t)
    out: list[tuple[Trial, int | None]] = []
    for group in groups.values():
        pairs = [(t, _concurrency(t)) for t in group]
        pairs.sort(key=lambda p: (p[1] is None, p[1] or 0, p[0].seq))
        out += pairs
    return out


def _xy(s: MetricsSummary) -> tuple[float, float]:
    return s.tok_s_per_user, s.output_tok_s_per_gpu


def plot_frontier(points: list[tuple[Trial, int | None]], path: Path) -> bool:
    """tok/s/user vs output tok/s/GPU per finalist and concurrency, with the Pareto front.

    Returns False (no file) when there are no frontier points.
    """
    if not points:
        return False
    fig = _new_figure(7.5, 5.0)
    ax = fig.add_subplot()
    groups: dict[str, list[tuple[Trial, int | None]]] = {}
    for t, c in points:
        groups.setdefault(t.config.config_id(), []).append((t, c))
    for group in groups.values():
        first = group[0][0]
        xy = [_xy(t.saturation) for t, _ in group if t.saturation is not None]
        label = f"{_changed(first)} (from #{first.parent_seq})" if first.parent_seq \
            else _changed(first)
        ax.plot([p[0] for p in xy], [p[1] for p in xy], marker="o", label=label)
        for (x, y), (_, c) in zip(xy, group, strict=True):
            if c is not None:
                ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize=7)
    all_xy = [_xy(t.saturation) for t, _ in points if t.saturation is not None]
    front = [all_xy[i] for i in pareto_front(all_xy)]
    beaten = [all_xy[i] for i in dominated_by(all_xy)]
    if beaten:
        ax.scatter([p[0] for p in beaten], [p[1] for p in beaten], marker="x", color="grey",
                   s=40, zorder=3, label=f"dominated ({len(beaten)} of {len(all_xy)})")
    ax.plot([p[0] for p in front], [p[1] for p in front], color="black", linestyle="--",
            linewidth=2, marker="D", markerfacecolor="none", markersize=10, alpha=0.7,
            label="Pareto front")
    ax.set_xlabel("tok/s/user (1 / TPOT)")
    ax.set_ylabel("output tok/s/GPU")
    ax.set_title("Throughput vs per-user speed (concurrency sweep)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)
    return True


def plot_replay_ttft(validated: list[Trial], slo_ms: float, path: Path) -> bool:
    """Bars of replay TTFT p50 and p99 (ms) per finalist, with the SLO as a line.

    Returns False (no file) when no finalist has a replay summary.
    """
    rows = [t for t in validated if t.replay is not None]
    if not rows:
        return False
    fig = _new_figure(max(6.0, 1.2 * len(rows) + 2.0), 4.5)
    ax = fig.add_subplot()
    xs = list(range(len(rows)))
    p50 = [_finite(t.replay.ttft_ms.p50) for t in rows if t.replay is not None]
    p99 = [_finite(t.replay.ttft_ms.p99) for t in rows if t.replay is not None]
    w = 0.38
    ax.bar([x - w / 2 for x in xs], p50, w, label="TTFT p50", color="tab:blue")
    ax.bar([x + w / 2 for x in xs], p99, w, label="TTFT p99", color="tab:orange")
    ax.axhline(slo_ms, color="tab:red", linestyle="--", label=f"SLO p99 {slo_ms:,.0f} ms")
    positive = [v for v in p50 + p99 + [slo_ms] if v > 0]
    if positive and max(positive) / min(positive) > 100:
        ax.set_yscale("log")
    ax.set_xticks(xs, [f"#{t.seq} {_changed(t)}\n{t.status}" for t in rows], fontsize=8)
    ax.set_ylabel("TTFT on the replay (ms)")
    ax.set_title("Finalists on the real trace")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)
    return True


def _finite(v: float) -> float:
    return 0.0 if math.isnan(v) else v


# ---------------------------------------------------------------- public helpers
def summary_rows(trials: list[Trial]) -> list[dict[str, Any]]:
    """Plain rows for the CLI's final table, in the order given.

    Returns:
        One dict per trial: ``seq``, ``status``, ``changed`` ('baseline' when empty),
        ``objective`` (output tok/s/GPU or None) and ``reason`` (one line).
    """
    return [{"seq": t.seq, "status": t.status, "changed": _changed(t),
             "objective": t.objective, "reason": " ".join(t.reason.split())} for t in trials]


def _best_finalist(validated: list[Trial]) -> Trial | None:
    """The replayed finalist with the best objective (same order as the winner pick)."""
    rows = [t for t in validated if t.replay is not None]
    rows.sort(key=Trial.rank_key)
    return rows[0] if rows else None


# ---------------------------------------------------------------- report sections
def _backend_line(events: list[dict[str, Any]]) -> str:
    """Which backend ran the trials and whether their endpoints were simulated.

    From the run's events: the last ``backend`` event (one per start of the run) and every
    ``endpoints`` event (base URL -> what simulates it, for the endpoints whose responses
    carried ``x-servetune-simulated``).
    """
    kinds = [str(e.get("backend")) for e in events if e.get("kind") == "backend"]
    simulated: dict[str, str] = {}
    for e in events:
        if e.get("kind") == "endpoints" and isinstance(e.get("simulated"), dict):
            simulated.update({str(k): str(v) for k, v in e["simulated"].items()})
    if not kinds:
        return ("Backend: not recorded (this run's events do not name it), so whether its "
                "endpoints were simulated is unknown.")
    kind = kinds[-1]
    if kind == "twin":
        return (f"Backend: `{kind}`; endpoints: simulated (the digital twin in virtual time): "
                "every number is the twin's, not a GPU's, and no output is a model's.")
    if simulated:
        by = ", ".join(sorted(set(simulated.values())))
        n = len(simulated)
        return (f"Backend: `{kind}`; endpoints: simulated ({n} of them identified "
                f"{'itself' if n == 1 else 'themselves'} as the {by} server, "
                f"`x-servetune-simulated: {by}`): throughput and "
                "latency are the twin's in real time, not a GPU's, and no output is a model's, "
                "so the quality gate is not applicable.")
    return f"Backend: `{kind}`; endpoints: real (none identified itself as simulated)."


def _summary(study: Study, trials: list[Trial], run_id: str, stop_reason: str,
             elapsed_s: float, backend: str) -> list[str]:
    search = [t for t in trials if t.phase == "search"]
    launched = sum(t.launched for t in search)
    pruned = sum(t.status == "pruned" for t in search)
    crashed = sum(t.status == "crash" for t in search)
    failed = sum(t.status == "failed" for t in search)
    replayed = sum(t.phase == "validate" for t in trials)
    sweep = sum(t.phase == "frontier" and t.status == "sweep" for t in trials)
    unstarted = [t for t in trials if t.phase == "frontier" and t.status != "sweep"]
    return [
        f"# {study.name}: run `{run_id}`", "", backend, "",
        f"Model `{study.model}` on {study.gpu_count} x {study.gpu} with {study.engine} "
        f"{study.engine_version}. Stopped because: {stop_reason or 'not given'}. "
        f"Elapsed: {elapsed_s:,.1f} s. Search trials: {launched} launched, {pruned} pruned "
        f"before launch, {crashed} crashed"
        + (f", {failed} failed (no valid agent output)" if failed else "")
        + f"; {replayed} finalist{'s' if replayed != 1 else ''} replayed on the trace; "
        f"{sweep} frontier points measured"
        + "".join(f"; frontier config {t.changed or 'baseline'} did not start "
                  f"({t.failure_class})" for t in unstarted) + ".", "",
    ]


def _workloads(study: Study, replay_requests: int, trace_file: str) -> list[str]:
    s, r = study.saturation, study.replay
    return [
        "## Workloads", "",
        f"- **Saturation** (search objective): ISL {s.isl:,} tokens, OSL {s.osl:,} tokens, "
        f"concurrency {s.concurrency:,}, duration {s.duration_s:,.1f} s.",
        f"- **Replay** (SLO check): trace `{trace_file}`, window start {r.start_s:,.1f} s, "
        f"length {r.duration_s:,.1f} s, {replay_requests:,} requests, time scale "
        f"{r.time_scale:g}x (arrivals {r.time_scale:g} times as fast as recorded).", "",
    ]


def _numbers(t: Trial, slo_ms: float) -> list[str]:
    out = [f"- replicas: {t.config.replicas} (tp_size {t.config.tp_size} each, "
           f"{t.config.gpus} GPUs)"]
    if t.saturation is not None:
        out.append(f"- Saturation: {_num(t.saturation.output_tok_s_per_gpu)} output tok/s/GPU, "
                   f"{_num(t.saturation.tok_s_per_user)} tok/s/user")
    if t.replay is not None:
        p99 = t.replay.ttft_ms.p99
        ok = SLO(ttft_p99_ms=slo_ms).met(p99, t.replay.errors)
        verdict = "meets" if ok else "misses"
        line = (f"- Replay: TTFT p50 {_num(t.replay.ttft_ms.p50)} ms, p99 {_num(p99)} ms "
                f"({verdict} the SLO of p99 <= {slo_ms:,.0f} ms with every request served); "
                f"{t.replay.completed}/{t.replay.requests} requests completed")
        if t.replay.errors:
            line += f", {t.replay.errors} failed"
        out.append(line)
    return out


def _vs_baseline(t: Trial, trials: list[Trial]) -> list[str]:
    """What the winner changed relative to the baseline, and the gain in tok/s/GPU."""
    base = next((b for b in trials if b.phase == "search" and b.status == "baseline"), None)
    if base is None:
        return []
    a, b = base.config.model_dump(), t.config.model_dump()
    diffs = [f"{k} {a[k] if a[k] is not None else 'unset'} -> "
             f"{b[k] if b[k] is not None else 'unset'}" for k in a if a[k] != b[k]]
    out = [f"- Changes from the baseline (trial #{base.seq}): "
           f"{', '.join(diffs) if diffs else 'none'}"]
    if base.objective and t.objective:
        out.append(f"- Output tok/s/GPU: {_num(base.objective)} -> {_num(t.objective)} "
                   f"({t.objective / base.objective - 1:+.0%})")
    return out


def _result(study: Study, trials: list[Trial]) -> list[str]:
    slo = study.slo.ttft_p99_ms
    validated = [t for t in trials if t.phase == "validate"]
    winner = next((t for t in validated if t.status == "winner"), None)
    out = ["## Result", ""]
    if winner is not None:
        flags = winner.config.set_fields()
        src = f" (search trial #{winner.parent_seq})" if winner.parent_seq else ""
        out += [f"Winner: trial #{winner.seq}{src}, reached by {_changed(winner)}; "
                f"{len(flags)} tuned flag(s) beyond model, TP and quantization. "
                "Launch command for ONE replica:", ""]
        out += _fence(winner.config.launch_command(), "bash")
        q = winner.quality
        gate = [] if q is None else [f"- Quality gate: {q.reason}" if q.status in (
            "not-applicable", "not-needed") else f"- Quality gate: {q.status} ({q.reason})"]
        out += ["", *_numbers(winner, slo), *_vs_baseline(winner, trials), *gate,
                f"- Serve the {winner.config.replicas} replica(s), each on its own "
                f"{winner.config.tp_size} GPUs (add `--base-gpu-id {winner.config.tp_size}` and "
                "`--port 30001` for the second one on the node, and so on), behind the "
                f"{winner.config.router_policy.replace('_', '-')} router: `python -m "
                "sglang_router.launch_router --worker-urls http://HOST:30000 "
                f"http://HOST:30001 ... --policy {winner.config.router_policy}`.", ""]
        return out
    out += [f"No finalist met the SLO (TTFT p99 <= {slo:,.0f} ms on the replay).", ""]
    best = _best_finalist(validated)
    if best is None:
        out += ["No finalist was replayed on the trace.", ""]
        return out
    out += [f"Best finalist by output tok/s/GPU: trial #{best.seq} ({_changed(best)}), "
            f"status {best.status}. Its launch command for ONE replica:", ""]
    out += _fence(best.config.launch_command(), "bash")
    out += ["", *_numbers(best, slo), ""]
    return out


def _gate(t: Trial) -> str:
    """The acceptance cell: gain, its interval and the gate's call (empty without one)."""
    a = t.acceptance
    if a is None:
        return ""
    call = ("accepted" if a.accepted else "rejected") if a.samples == "runs" else "not gated"
    return (f"{a.gain:+.1%} [{a.ci_low:+.1%}, {a.ci_high:+.1%}] {call} "
            f"({a.n_candidate}v{a.n_incumbent} {a.samples})")


def _trials_table(trials: list[Trial]) -> list[str]:
    search = [t for t in trials if t.phase == "search"]
    rows = [[t.seq, t.status, _changed(t), _num(t.objective),
             _num(t.saturation.ttft_ms.p99) if t.saturation else "",
             _pct(t.decode_roofline_share), _gate(t), t.reason] for t in search]
    confidence = next((t.acceptance.confidence for t in search if t.acceptance), 0.95)
    return ["## Trials", "",
            "Decode roofline: the share of the decode roofline the saturation run reached (decode "
            "time at 100% of HBM bandwidth and peak FLOP/s over the measured decode time; with "
            "speculative decoding it can exceed 100%).", "",
            f"Gain vs best [{confidence:.0%} CI]: the acceptance gate's relative tok/s/GPU gain "
            "over the incumbent and its bootstrap interval. Over repeated runs the gate decides "
            "(kept only if the interval's low end exceeds min_improvement); with one run each "
            "the interval rests on time slices of the runs, sees no run-to-run noise, and the "
            "point gain decides (not gated).", "", *_table(
                ["seq", "status", "changed", "tok/s/GPU", "saturation TTFT p99 (ms)",
                 "decode roofline", "gain vs best [CI]", "reason"], rows), ""]


def _pct(v: float | None) -> str:
    return "" if v is None else f"{v:.0%}"


def _finalists_table(trials: list[Trial], has_plot: bool) -> list[str]:
    validated = [t for t in trials if t.phase == "validate"]
    out = ["## Finalists on the real trace", "",
           "Finalists: the best search trial of each layout (tp_size, weights, kv_cache_dtype, "
           "attention_backend), topped up with the next best when there are fewer layouts; the "
           "winner is the best of them by saturation tok/s/GPU whose replay meets the SLO.", ""]
    if not validated:
        return out + ["No finalist was replayed.", ""]
    if has_plot:
        out += [f"![Replay TTFT per finalist]({REPLAY_PNG})", ""]
    rows = []
    for t in validated:
        r = t.replay
        rows.append([t.seq, _changed(t),
                     _num(t.saturation.output_tok_s_per_gpu) if t.saturation else "",
                     _num(r.ttft_ms.p50) if r else "", _num(r.ttft_ms.p99) if r else "",
                     _num(r.itl_ms.p99) if r else "", _pct(t.cache_hit_rate),
                     f"{r.completed}/{r.requests}" if r else "", t.status])
    out += _table(["seq", "changed", "tok/s/GPU (saturation)", "replay TTFT p50 (ms)",
                   "replay TTFT p99 (ms)", "ITL p99 (ms)", "prefix cache hits",
                   "completed/requests", "status"], rows)
    return out + [""]


def _frontier_section(points: list[tuple[Trial, int | None]], has_plot: bool) -> list[str]:
    out = ["## Frontier", ""]
    if not points:
        return out + ["No frontier sweep was measured in this run, so there is no plot.", ""]
    if has_plot:
        out += [f"![tok/s/GPU vs tok/s/user]({FRONTIER_PNG})", ""]
    measured = [(t, c) for t, c in points if t.saturation is not None]
    xy = [_xy(t.saturation) for t, _ in measured if t.saturation is not None]
    front, beaten = set(pareto_front(xy)), dominated_by(xy)
    out += [f"Pareto frontier of output tok/s/GPU vs tok/s/user over every swept point "
            f"(finalists and, where the model has an MTP head, a NEXTN speculative variant of "
            f"the winner): {len(front)} of {len(xy)} points are on it; a dominated point names "
            "a frontier point at least as good on both axes.", ""]

    def label(t: Trial, c: int | None) -> str:
        return (f"#{t.parent_seq} {_changed(t)}" if t.parent_seq else _changed(t)) + (
            f" c={c}" if c is not None else "")
    rows = []
    for i, (t, c) in enumerate(measured):
        s = t.saturation
        assert s is not None
        on = "yes" if i in front else f"no (by {label(*measured[beaten[i]])})"
        rows.append([f"#{t.parent_seq} {_changed(t)}" if t.parent_seq else _changed(t),
                     "" if c is None else c, _num(s.tok_s_per_user), _num(s.output_tok_s_per_gpu),
                     _num(s.ttft_ms.p99), on])
    out += _table(["config", "concurrency", "tok/s/user", "output tok/s/GPU", "TTFT p99 (ms)",
                   "on Pareto front"], rows)
    return out + [""]


def _admission_section(trials: list[Trial]) -> list[str]:
    """Over-admission verdicts of the replays and the admission retuning they led to."""
    validated = [t for t in trials if t.phase == "validate"]
    judged = [t for t in validated if t.admission is not None]
    out = ["## Over-admission on the trace", ""]
    if not judged:
        return out + ["No replay was checked for over-admission.", ""]
    out += ["Read from each replay's own time series (12 bins over the arrivals; verdict on the "
            "second half): over-admission is throughput flat while the queue (sent, no first "
            "token yet) and TTFT keep rising. Where it shows, the validate phase replays "
            "max_running_requests near the measured capacity (decoding requests per replica) "
            "and HiCache where prefixes repeat; a variant is adopted only if it serves every "
            "request at no throughput loss and meets the SLO the finalist missed or lowers TTFT "
            "p99 by more than the study's min_improvement.", ""]
    rows = []
    for t in judged:
        a = t.admission
        assert a is not None
        rows.append([t.seq, _changed(t), "yes" if a.detected else "no",
                     ", ".join(map(str, a.cap_candidates)) if a.detected else "",
                     _num(t.replay.ttft_ms.p99 if t.replay else None), t.status, a.reason])
    return out + _table(["seq", "config", "over-admitted", "caps tried", "replay TTFT p99 (ms)",
                         "status", "evidence"], rows) + [""]


def _quality_section(trials: list[Trial]) -> list[str]:
    """The quality gate of the finalists (outputs vs the reference config)."""
    gated = [t for t in trials if t.phase == "validate" and t.quality is not None]
    out = ["## Quality gate", ""]
    if not gated:
        return out + ["No finalist reached the quality gate.", ""]
    out += ["A finalist that changes numerics relative to the reference (the baseline: weights "
            "checkpoint or KV cache dtype) must reproduce the reference's greedy outputs on a "
            "fixed prompt set (token match rate >= the study's "
            "validation.quality_min_token_match) before it can be the winner. On the twin, "
            "and on an endpoint that identifies itself as simulated (the twin server that "
            "`--backend local` runs without a GPU), there are no real outputs, so the gate is "
            "reported as not applicable, never faked.", ""]
    rows = []
    for t in gated:
        q = t.quality
        assert q is not None
        rows.append([t.seq, _changed(t), t.status, q.status, "; ".join(q.changes) or "none",
                     "" if q.token_match_rate is None else f"{q.token_match_rate:.1%}",
                     q.reason])
    return out + _table(["seq", "config", "status", "gate", "numerics changes",
                         "token match", "reason"], rows) + [""]


def _predicted_section(trials: list[Trial]) -> list[str]:
    rows_t = [t for t in trials if t.phase == "search" and t.launched and t.predicted]
    out = ["## Predicted vs measured", ""]
    if not rows_t:
        return out + ["No launched trial carried a pre-launch estimate.", ""]
    keys: list[str] = []
    for t in rows_t:
        keys += [k for k in t.predicted if k not in keys]
    # the replay TTFT p99 measured when the same config was replayed in validation
    replayed = {t.config.config_id(): t.replay.ttft_ms.p99 for t in trials
                if t.phase == "validate" and t.replay is not None}
    with_replay = "replay_ttft_p99_ms" in keys
    rows = []
    for t in rows_t:
        s = t.saturation
        pred = [_pred(t.predicted.get(k)) for k in keys]
        rows.append([t.seq, _changed(t), *pred,
                     _num(s.output_tok_s) if s else t.status,
                     _num(s.output_tok_s_per_gpu) if s else "",
                     _num(s.tok_s_per_user) if s else ""]
                    + ([_num(replayed.get(t.config.config_id()))] if with_replay else []))
    out += ["Estimates made before launch (per replica; the guided brain's throughput per "
            "GPU and replay TTFT p99 are for the whole pool) next to the measured saturation "
            "decode throughput.", ""]
    out += _table(["seq", "changed", *[f"predicted {k}" for k in keys],
                   "measured output tok/s", "measured tok/s/GPU", "measured tok/s/user"]
                  + (["measured replay TTFT p99 ms (validation)"] if with_replay else []),
                  rows)
    return out + [""]


def _pred(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.2f}"
    return str(v)


def _research_section(trials: list[Trial]) -> list[str]:
    """Questions asked before launches, their cited answers, the decisions and their cost."""
    asked = [t for t in trials if t.research]
    if not asked:
        return []
    avoided = sum(1 for t in asked if t.status == "pruned")  # dropped, or modified to another
    outcomes = [o for t in asked for o in t.research]
    calls = sum(int(o.get("usage", {}).get("tool_calls", 0)) for o in outcomes)
    tokens = sum(int(o.get("usage", {}).get(k, 0) or 0) for o in outcomes
                 for k in ("input_tokens", "output_tokens", "cache_read_tokens",
                           "cache_creation_tokens"))
    seconds = sum(float(o.get("finished_s", 0)) - float(o.get("started_s", 0))
                  for o in outcomes)
    out = ["## Research before launches", "",
           f"{len(outcomes)} questions before {len(asked)} candidate(s), in parallel branches; "
           f"launches avoided: {avoided}. Cost: {calls} tool calls, {tokens:,} LLM tokens, "
           f"{seconds:.1f} s of branch time.", ""]
    for t in asked:
        out += [f"### {_changed(t)} (trial #{t.seq}, {t.status})", "",
                f"Decision: {t.research_decision or 'kept'}", ""]
        for o in t.research:
            q = o.get("question", {})
            span = float(o.get("finished_s", 0)) - float(o.get("started_s", 0))
            out.append(f"- **{q.get('kind', '?')}**: {q.get('question', '')} "
                       f"({o.get('status')}, {span:.2f} s)")
            f = o.get("findings") or {}
            if o.get("status") != "answered":
                out.append(f"  - failed: {o.get('error')}")
                continue
            out.append(f"  - answer: {' '.join(str(f.get('answer', '')).split())}")
            for c in (f.get("claims") or [])[:6]:
                ev = "; ".join(str(e) for e in c.get("evidence", [])[:3])
                out.append(f"  - {' '.join(str(c.get('text', '')).split())} [{ev}]")
            for u in f.get("unresolved") or []:
                out.append(f"  - unresolved: {' '.join(str(u).split())}")
        out.append("")
    return out


USAGE_KEYS = ("turns", "tool_calls", "retries", "input_tokens", "output_tokens",
              "cache_read_tokens", "cache_creation_tokens", "seconds")


def usage_by_role(trials: list[Trial],
                  extra: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, float]]:
    """Summed AgentUsage per role (planner, deployer, analyst, researchers) over a run.

    Args:
        trials: the ledger rows (``llm_usage`` per role; research usage per outcome).
        extra: role -> usage of agent runs that left no row (ledger meta).
    """
    out: dict[str, dict[str, float]] = {}

    def add(role: str, u: dict[str, Any]) -> None:
        row = out.setdefault(role, dict.fromkeys(USAGE_KEYS, 0.0))
        for k in USAGE_KEYS:
            row[k] += float(u.get(k, 0) or 0)

    for t in trials:
        for role, u in t.llm_usage.items():
            add(role, u)
        for o in t.research:
            if o.get("usage", {}).get("turns"):
                add("researchers", o["usage"])
    for role, u in (extra or {}).items():
        add(role, u)
    return out


LLM_CALLS = "llm_calls.jsonl"


def read_llm_calls(path: Path) -> dict[str, float] | None:
    """Totals of a run's ``llm_calls.jsonl`` (one line per Messages API call), or None if absent.

    Returns:
        ``calls`` and the summed ``input_tokens``, ``output_tokens``, ``cache_read_tokens`` and
        ``cache_creation_tokens``; a line that cannot be read (a write cut by a kill) is skipped.
    """
    if not path.is_file():
        return None
    keys = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_creation_tokens")
    out = {"calls": 0.0, **dict.fromkeys(keys, 0.0)}
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
                row = {k: float(rec.get(k, 0) or 0) for k in keys}
            except (ValueError, TypeError, AttributeError):
                continue
            out["calls"] += 1
            for k in keys:
                out[k] += row[k]
    return out


def llm_cost_usd(u: dict[str, float], prices: dict[str, float]) -> float:
    """USD of one usage row at ``prices``.

    ``prices`` are USD per million tokens under the keys input, output, cache_read and
    cache_write; the Messages API counts cache reads and writes apart from ``input_tokens``.
    """
    return (u.get("input_tokens", 0) * prices["input"] + u.get("output_tokens", 0)
            * prices["output"] + u.get("cache_read_tokens", 0) * prices["cache_read"]
            + u.get("cache_creation_tokens", 0) * prices["cache_write"]) / 1e6


def _agents_section(trials: list[Trial], brains: str, extra: dict[str, dict[str, Any]],
                    prices: dict[str, float] | None,
                    billed: dict[str, float] | None) -> list[str]:
    """Who made the decisions and, for Claude agents, what they cost."""
    out = ["## Agents and LLM cost", ""]
    rows = usage_by_role(trials, extra)
    failed = [t for t in trials if t.status == "failed"]
    used = [b for b in brains.split(",") if b]
    models = [b.split(":", 1)[1] for b in used if b.startswith("claude:")]
    if not models and not rows:
        return out + ["Deterministic brains (no `ANTHROPIC_API_KEY`): no LLM call, no cost. "
                      "With a key, `servetune run` runs the planner, deployer, analyst and "
                      "researchers as Claude agents.", ""]
    who = ", ".join(f"`{m}`" for m in models) or "(not recorded)"
    mixed = (" The run was resumed with other brains; each segment's usage is counted."
             if len(used) > 1 else "")
    out += [f"Claude agents, model{'s' if len(models) > 1 else ''} {who}.{mixed} Token counts "
            "are the Messages API's `usage`; "
            "cost is estimated at the configured prices"
            + (f" (USD/MTok: input {prices['input']:g}, output {prices['output']:g}, cache "
               f"read {prices['cache_read']:g}, cache write {prices['cache_write']:g})."
               if prices else "."), "",
            "| role | turns | tool calls | retries | input tok | output tok | cache read tok "
            "| cache write tok | agent s | est. USD |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    total = dict.fromkeys(USAGE_KEYS, 0.0)
    for role in [*ROLES, *sorted(set(rows) - set(ROLES))]:
        u = rows.get(role)
        if u is None:
            continue
        for k in USAGE_KEYS:
            total[k] += u[k]
        usd = f"{llm_cost_usd(u, prices):.4f}" if prices else ""
        out.append(f"| {role} | " + " | ".join(f"{u[k]:,.0f}" for k in USAGE_KEYS[:-1])
                   + f" | {u['seconds']:,.1f} | {usd} |")
    usd = f"{llm_cost_usd(total, prices):.4f}" if prices else ""
    out.append("| **total** | " + " | ".join(f"{total[k]:,.0f}" for k in USAGE_KEYS[:-1])
               + f" | {total['seconds']:,.1f} | {usd} |")
    out.append("")
    out.append("Turns are Messages API calls; agent s is the agents' wall time.")
    if billed is not None:
        tok = sum(billed[k] for k in billed if k.endswith("_tokens"))
        out.append(f"Every API call of the run, including work an interruption cut short "
                   f"(`{LLM_CALLS}`): {billed['calls']:,.0f} calls, {tok:,.0f} tokens"
                   + (f", est. USD {llm_cost_usd(billed, prices):.4f}." if prices else "."))
    out.append("")
    if failed:
        out += [f"{len(failed)} trial(s) failed because an agent gave no valid output:", ""]
        out += [f"- #{t.seq} {_changed(t)}: {' '.join(t.reason.split())[:REASON_CHARS]}"
                for t in failed]
        out.append("")
    return out


def _lessons_section(lessons: list[Lesson]) -> list[str]:
    out = ["## Lessons used or written in this run", ""]
    if not lessons:
        return out + ["None.", ""]
    for les in lessons:
        lines = les.evidence.splitlines()
        evidence = "\n".join(lines[:EVIDENCE_LINES])
        if len(lines) > EVIDENCE_LINES:
            evidence += f"\n... ({len(lines) - EVIDENCE_LINES} more lines)"
        fc = f" ({les.failure_class})" if les.failure_class else ""
        out += [f"### {les.id or '(no id)'}: {' '.join(les.title.split())}", "",
                f"- Outcome: {les.outcome}{fc}",
                f"- Condition: `{les.condition_text()}`",
                f"- Fix: {' '.join(les.fix.split())}", "", "Evidence:", "", *_fence(evidence), ""]
    return out


# ---------------------------------------------------------------- entry point
def render_report(run_dir: Path, study: Study, trials: list[Trial], lessons: list[Lesson], *,
                  run_id: str, stop_reason: str, elapsed_s: float, replay_requests: int,
                  trace_file: str, brains: str = "deterministic",
                  extra_usage: dict[str, dict[str, Any]] | None = None,
                  prices: dict[str, float] | None = None) -> Path:
    """Write ``run_dir/report.md`` and its plots (search, frontier, replay TTFT PNGs).

    The plots are ``search.png``, ``frontier.png`` and ``replay_ttft.png``. A plot with no data
    is not written (a stale one from an earlier render is removed) and the report says so.

    Args:
        run_dir: the run's folder (created if missing).
        study: the study that ran.
        trials: the run's ledger rows, any phase, any order.
        lessons: lessons used (pruning) or written (failures) in this run.
        run_id: the run's id.
        stop_reason: why the search stopped.
        elapsed_s: wall time of the run, s.
        replay_requests: requests in the replayed trace window.
        trace_file: the replayed trace's file name.
        brains: the brains the run used, comma-separated, in order ("deterministic" or
            "claude:<model>"; ledger meta ``brains``).
        extra_usage: role -> usage of agent runs that left no ledger row.
        prices: USD per million tokens (input, output, cache_read, cache_write) for the cost
            estimate; None leaves the cost column empty.

    Returns:
        The path of ``report.md``.
    """
    if "matplotlib.pyplot" not in sys.modules:  # switching under pyplot would close its figures
        matplotlib.use("Agg")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    trials = sorted(trials, key=lambda t: t.seq)
    validated = [t for t in trials if t.phase == "validate"]
    points = frontier_points(trials)

    plots = {
        SEARCH_PNG: plot_search(trials, run_dir / SEARCH_PNG),
        FRONTIER_PNG: plot_frontier(points, run_dir / FRONTIER_PNG),
        REPLAY_PNG: plot_replay_ttft(validated, study.slo.ttft_p99_ms, run_dir / REPLAY_PNG),
    }
    for name, written in plots.items():
        if not written:
            (run_dir / name).unlink(missing_ok=True)

    lines = _summary(study, trials, run_id, stop_reason, elapsed_s,
                     _backend_line(read_events(run_dir / "events.jsonl")))
    lines += _workloads(study, replay_requests, trace_file)
    lines += _result(study, trials)
    lines += _trials_table(trials)
    if plots[SEARCH_PNG]:
        lines += [f"![Objective per search trial]({SEARCH_PNG})", ""]
    else:
        lines += ["No search trial was launched, so there is no search plot.", ""]
    lines += _finalists_table(trials, plots[REPLAY_PNG])
    lines += _admission_section(trials)
    lines += _quality_section(trials)
    lines += _frontier_section(points, plots[FRONTIER_PNG])
    lines += _predicted_section(trials)
    lines += _research_section(trials)
    lines += _agents_section(trials, brains, extra_usage or {}, prices,
                             read_llm_calls(run_dir / LLM_CALLS))
    lines += faults_section(study, run_dir / "events.jsonl")
    lines += _lessons_section(lessons)

    path = run_dir / "report.md"
    text = "\n".join(lines).rstrip("\n") + "\n"
    _write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return path
