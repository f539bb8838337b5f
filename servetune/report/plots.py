"""The report's PNG plots: objective per search trial, the frontier, replay TTFT.

Figures are bound to the Agg canvas (no pyplot); each PNG is written atomically.
"""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from domain.metrics import MetricsSummary
from domain.pareto import dominated_by, pareto_front
from domain.trial import Trial
from servetune.report.format import _changed, _concurrency, _write_atomic

SEARCH_PNG = "search.png"


FRONTIER_PNG = "frontier.png"


REPLAY_PNG = "replay_ttft.png"


STATUS_STYLE: dict[str, tuple[str, str]] = {  # status -> (marker, colour)
    "baseline": ("s", "tab:blue"),
    "keep": ("o", "tab:green"),
    "discard": ("o", "tab:gray"),
    "crash": ("x", "tab:red"),
    "failed": ("X", "tab:orange"),
}


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
