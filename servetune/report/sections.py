"""The report's sections about the trials, from the summary to predicted-vs-measured numbers.

Summary, workloads, result, the trials and finalists tables, admission, quality, frontier and
the estimator's predictions beside what was measured.

Units: throughput in output tokens per second (per GPU, or per user = 1 / TPOT), latencies in
milliseconds, durations in seconds.
"""

from __future__ import annotations

from typing import Any

from agents.analyst import ceiling_point
from domain.calibration import calibration_line
from domain.config import ServingConfig
from domain.layout import has_layout, server_label
from domain.metrics import GRAPH_CEILING_ITL_RATIO, graph_ceiling
from domain.pareto import dominated_by, pareto_front
from domain.study import SLO, Study
from domain.trial import Trial
from servetune.report.format import (
    _changed,
    _concurrency,
    _fence,
    _lint_codes,
    _num,
    _pct,
    _retractions,
    _table,
)
from servetune.report.layout import launch_section, needs_launch_section, pd_text
from servetune.report.plots import FRONTIER_PNG, REPLAY_PNG, _xy


def _best_finalist(validated: list[Trial]) -> Trial | None:
    """The replayed finalist with the best objective (same order as the winner pick)."""
    rows = [t for t in validated if t.replay is not None]
    rows.sort(key=Trial.rank_key)
    return rows[0] if rows else None


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
        f"# {study.name}: run `{run_id}`", "", backend, "", *_version_note(study),
        f"Model `{study.model}` on {study.gpu_count} x {study.gpu} with {study.engine} "
        f"{study.engine_version}. Stopped because: {stop_reason or 'not given'}. "
        f"Elapsed: {elapsed_s:,.1f} s. Search trials: {launched} launched, {pruned} pruned "
        f"before launch, {crashed} crashed"
        + (f", {failed} failed (no valid agent output)" if failed else "")
        + f"; {replayed} finalist{'s' if replayed != 1 else ''} replayed on the trace; "
        f"{sweep} frontier points measured"
        + "".join(f"; frontier config {t.changed or 'baseline'} did not start "
                  f"({t.failure_class})" for t in unstarted) + ".", "",
        f"GPU `{study.gpu}`: {calibration_line(study.gpu)}.", "",
    ]


def _version_note(study: Study) -> list[str]:
    """The warning line when the engine version runs with another version's default rules."""
    from domain.engines import engine

    note = engine(study.engine, study.engine_version).rules_note()
    return [f"**Warning**: {note}.", ""] if note else []


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


def _serve_line(config: ServingConfig) -> str:
    """How to serve the winner's servers side by side, and what fronts them."""
    if config.pd is not None:
        return (f"- Serve every prefill and decode server on its own GPUs ({config.gpus} GPUs "
                "in all), clients sending requests to the PD router above.")
    g = config.gpus_per_server
    return (f"- Serve the {config.replicas} replica(s), each on its own {g} GPUs (add "
            f"`--base-gpu-id {g}` and `--port 30001` for the second one on the node, and so "
            "on), " + _router_line(config))


def _numbers(t: Trial, slo_ms: float) -> list[str]:
    if t.config.pd is not None:
        out = ["- servers: " + ", ".join(
            f"{n} {role} ({server_label(c)}, {c.gpus_per_server} GPUs each)"
            for role, n, c in t.config.servers()) + f"; {t.config.gpus} GPUs"]
    elif has_layout(t.config):
        out = [f"- replicas: {t.config.replicas} ({server_label(t.config)}, "
               f"{t.config.gpus_per_server} GPUs each, {t.config.gpus} GPUs)"]
    else:
        out = [f"- replicas: {t.config.replicas} (tp_size {t.config.tp_size} each, "
               f"{t.config.gpus} GPUs)"]
    if t.saturation is not None:
        out.append(f"- Saturation: {_num(t.saturation.output_tok_s_per_gpu)} output tok/s/GPU, "
                   f"{_num(t.saturation.tok_s_per_user)} tok/s/user")
    if t.decode_allreduce_share is not None:
        out.append(f"- All-reduce {_pct(t.decode_allreduce_share)} of decode step time at "
                   f"saturation (TP {t.config.tp_size})")
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
    a["pd"], b["pd"] = pd_text(base.config.pd), pd_text(t.config.pd)  # not a nested dict
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
        out += _commands(winner.config, f"Winner: trial #{winner.seq}{src}, reached by "
                         f"{_changed(winner)}; {len(flags)} tuned flag(s) beyond model, TP and "
                         "quantization", "Launch command")
        q = winner.quality
        gate = [] if q is None else [f"- Quality gate: {q.reason}" if q.status in (
            "not-applicable", "not-needed") else f"- Quality gate: {q.status} ({q.reason})"]
        out += ["", *_numbers(winner, slo), *_vs_baseline(winner, trials), *gate,
                *_not_modelled(winner), _serve_line(winner.config), ""]
        return out
    out += [f"No finalist met the SLO (TTFT p99 <= {slo:,.0f} ms on the replay).", ""]
    best = _best_finalist(validated)
    if best is None:
        out += ["No finalist was replayed on the trace.", ""]
        return out
    out += _commands(best.config, f"Best finalist by output tok/s/GPU: trial #{best.seq} "
                     f"({_changed(best)}), status {best.status}", "Its launch command")
    out += ["", *_numbers(best, slo), *_not_modelled(best), ""]
    return out



def _commands(config: ServingConfig, lead: str, one: str) -> list[str]:
    """``lead`` and the config's commands (report lines).

    A layout gets its launch section (per group, the router); otherwise ``one`` "for ONE
    replica" and that replica's command line.
    """
    if needs_launch_section(config):
        return [f"{lead}.", "", *launch_section(config)]
    return [f"{lead}. {one} for ONE replica:", "", *_fence(config.launch_command(), "bash")]

def _not_modelled(t: Trial) -> list[str]:
    """A line naming the set flags the twin passes through without modelling them."""
    from domain.config import PASSED_THROUGH

    set_ = t.config.set_fields()
    names = [f"{k}={set_[k]}" for k in PASSED_THROUGH if k in set_]
    return [f"- Not modelled (passed through to the command as given; the twin's numbers do "
            f"not include their effect): {', '.join(names)}"] if names else []


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
             _pct(t.decode_roofline_share), _pct(t.decode_allreduce_share),
             _retractions(t.saturation), _gate(t),
             _lint_codes(t), t.reason] for t in search]
    confidence = next((t.acceptance.confidence for t in search if t.acceptance), 0.95)
    return ["## Trials", "",
            "Decode roofline: the share of the decode roofline the saturation run reached (decode "
            "time at 100% of HBM bandwidth and peak FLOP/s over the measured decode time; with "
            "speculative decoding it can exceed 100%).", "",
            "Decode all-reduce: the share of the saturation run's decode step time spent in the "
            "tensor-parallel all-reduces (two per layer, over the node's NVLink, PCIe, NUMA hop "
            "or NIC; the twin's interconnect model).", "",
            f"Gain vs best [{confidence:.0%} CI]: the acceptance gate's relative tok/s/GPU gain "
            "over the incumbent and its bootstrap interval. Over repeated runs the gate decides "
            "(kept only if the interval's low end exceeds min_improvement); with one run each "
            "the interval rests on time slices of the runs, sees no run-to-run noise, and the "
            "point gain decides (not gated).", "", RETRACTIONS_NOTE, "",
            "Lints: the pre-flight lints the config trips (codes; see Lints below).", "",
            *_table(["seq", "status", "changed", "tok/s/GPU", "saturation TTFT p99 (ms)",
                     "decode roofline", "decode all-reduce", "retractions", "gain vs best [CI]",
                     "lints", "reason"], rows), ""]


RETRACTIONS_NOTE = (
    "Retractions: running requests the engine pushed back to its queue during the run because "
    "decode ran out of KV cache (each is recomputed later, costing its prefill again): the "
    "twin's scheduler count, or the server's `sglang:num_retracted_requests_total` difference "
    "around the run; n/a when the server exposes no such counter.")


def _lints_section(trials: list[Trial]) -> list[str]:
    """Each distinct config's pre-flight lints (severity, code, message, fix), once per config."""
    out = ["## Lints", ""]
    seen: dict[str, Trial] = {}
    for t in trials:
        if t.lints:
            seen.setdefault(t.config.config_id(), t)
    if not seen:
        return out + ["No ledgered config tripped a pre-flight lint.", ""]
    out += ["The pre-flight lints (`servetune check`) of every ledgered config that trips one, "
            "listed once per config with the first row that carries it.", ""]
    rows = [[t.seq, t.phase, _changed(t), n.severity, n.code, n.message, n.fix]
            for t in seen.values() for n in t.lints]
    return out + _table(["seq", "phase", "config", "severity", "code", "message", "fix"],
                        rows) + [""]


def _finalists_table(trials: list[Trial], has_plot: bool) -> list[str]:
    validated = [t for t in trials if t.phase == "validate"]
    out = ["## Finalists on the real trace", "",
           "Finalists: the best search trial of each layout (tp_size, weights, kv_cache_dtype, "
           "attention_backend and the parallel layout: pp_size, dp_size, attn_dp_size, ep_size, "
           "pd), topped up with the next best when there are fewer layouts; the "
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
                     _retractions(r), f"{r.completed}/{r.requests}" if r else "", t.status])
    out += _table(["seq", "changed", "tok/s/GPU (saturation)", "replay TTFT p50 (ms)",
                   "replay TTFT p99 (ms)", "ITL p99 (ms)", "prefix cache hits",
                   "replay retractions", "completed/requests", "status"], rows)
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
                     _num(s.ttft_ms.p99), _retractions(s), on])
    out += _table(["config", "concurrency", "tok/s/user", "output tok/s/GPU", "TTFT p99 (ms)",
                   "retractions", "on Pareto front"], rows)
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


def _ceiling_section(trials: list[Trial]) -> list[str]:
    """Where decode ran eagerly past the CUDA-graph ceiling, with the ITL below and above it.

    Search trials carry the analyst's cause (:attr:`Trial.graph_ceiling`); each frontier
    config's sweep is judged here over its points (:func:`domain.metrics.graph_ceiling`).
    """
    out = ["## CUDA-graph ceiling", ""]
    rows = [[f"#{t.seq} {_changed(t)}", g.ceiling, f"{_num(g.itl_below_ms)} at {g.batch_below:.0f}"
             f" ({g.below})", f"{_num(g.itl_above_ms)} at {g.batch_above:.0f} ({g.above})",
             f"{g.ratio:.1f}x"] for t in trials if (g := t.graph_ceiling) is not None]
    sweeps: dict[str, list[Trial]] = {}
    for t in trials:
        if t.phase == "frontier" and t.saturation is not None:
            sweeps.setdefault(t.config.config_id(), []).append(t)
    for points in sweeps.values():
        t0 = points[0]
        pts = [p for t in points if t.saturation is not None
               and (p := ceiling_point(t.config, t.saturation, _concurrency(t) or 1,
                                       f"c={_concurrency(t)}")) is not None]
        g = graph_ceiling(pts)
        if g is not None:
            rows.append([f"frontier {_changed(t0)}", g.ceiling,
                         f"{_num(g.itl_below_ms)} at {g.batch_below:.0f} ({g.below})",
                         f"{_num(g.itl_above_ms)} at {g.batch_above:.0f} ({g.above})",
                         f"{g.ratio:.1f}x"])
    if not rows:
        return out + ["No run decoded past its CUDA-graph ceiling with ITL roughly doubled.", ""]
    out += ["SGLang runs a decode batch larger than `cuda_graph_max_bs_decode` eagerly (no CUDA "
            "graph); where the median ITL of such a run is at least "
            f"{GRAPH_RATIO_TEXT} a comparable in-graph run's, the ceiling is the cause: raise "
            "`--cuda-graph-max-bs-decode` to the running batch (it costs graph memory) or cap "
            "`--max-running-requests` at the ceiling. Batch: running decode requests per "
            "replica.", ""]
    return out + _table(["run", "cuda_graph_max_bs_decode", "ITL p50 ms in graph (batch)",
                         "ITL p50 ms eager (batch)", "ratio"], rows) + [""]


GRAPH_RATIO_TEXT = f"{GRAPH_CEILING_ITL_RATIO:g}x"


def _router_line(config: ServingConfig) -> str:
    """How the winner's replicas are fronted: the router command, or the Kubernetes Service."""
    args = config.router_args(["http://HOST:30000", "http://HOST:30001", "..."])
    if args is None:
        return ("behind a Kubernetes Service (kube-proxy spreads connections over the pods, "
                "no router).")
    return (f"behind the {config.router_policy.replace('_', '-')} router: `python -m "
            f"sglang_router.launch_router {' '.join(args)}`.")
