"""Stored benchmark runs: per-request records (``.npz``) and results (``.json``), paged.

Pages serve the ``get_records`` and ``list_runs`` tools.

Layout of ``<artifacts>/<bench_id>.npz`` (twin and HTTP runs alike; times in seconds on the
run's clock): ``arrival_s`` (scheduled send), ``sent_s`` (actual send; = arrival for the twin),
``first_token_s``, ``finish_s`` (NaN on error), ``input_tokens``, ``output_tokens`` (the
server's usage when it sent one), ``ok``, ``error`` (text, "" when ok), ``error_class`` (HTTP
runs: http_status, timeout, connect, disconnect, stream, truncated; "" when ok),
``cached_tokens`` (HTTP runs: the server's ``prompt_tokens_details.cached_tokens``, -1 when not
reported), and every inter-token gap flattened into ``itl_s`` with request ``i``'s gaps at
``itl_s[itl_offsets[i]:itl_offsets[i+1]]``. ``<bench_id>.json`` holds the
run's result (summary, workload, target).
"""

from __future__ import annotations

import json
import math
import os
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from pydantic import BaseModel, Field

from domain.metrics import RequestRecord
from mcp_servers.cluster.backend import BackendError

BENCH_ID_RE = re.compile(r"^[a-z0-9][-a-z0-9]{0,120}$")
MAX_PAGE = 1000


class RecordRow(BaseModel):
    """One request of a stored run (latencies in ms; None where the request failed)."""

    index: int
    arrival_s: float = Field(description="scheduled send time, s from the run start")
    sent_s: float = Field(description="actual send time, s from the run start")
    dispatch_lag_ms: float = Field(description="actual send minus scheduled send, ms")
    ttft_ms: float | None
    e2e_ms: float | None
    input_tokens: int
    output_tokens: int
    itl_mean_ms: float | None
    itl_max_ms: float | None
    itl_ms: list[float] | None = Field(None, description="every gap, only with include_itl")
    error: str | None = None
    error_class: str | None = Field(None, description="http_status, timeout, connect, "
                                                      "disconnect, stream or truncated")
    cached_tokens: int | None = Field(None, description="prompt tokens the server served from "
                                                        "its prefix cache, when reported")


class RecordPage(BaseModel):
    """A page of per-request records; continue with ``start=next_start``."""

    bench_id: str
    total: int
    start: int
    next_start: int | None
    records: list[RecordRow]


class RunInfo(BaseModel):
    """One stored run."""

    bench_id: str
    kind: str
    target: str
    description: str
    requests: int
    errors: int
    output_tok_s: float
    valid: bool = Field(True, description="false: too many failed requests (not scored)")
    flags: int = Field(0, description="measurement flags in the result (dispatch lag, cache)")
    created: float = Field(description="epoch s")


class RunList(BaseModel):
    """Stored runs, newest first; continue with ``start=next_start``."""

    total: int
    start: int
    next_start: int | None
    runs: list[RunInfo]
    skipped_files: list[str] = Field(default_factory=list, description=(
        "result files in the records folder that could not be read (damaged or foreign)"))


def _ms(x: float) -> float | None:
    return None if math.isnan(x) else x * 1e3


def store(artifacts: Path, bench_id: str, records: Sequence[RequestRecord],
          sent_s: np.ndarray | None, result_json: str, *,
          error_class: Sequence[str | None] | None = None,
          cached_tokens: np.ndarray | None = None) -> str:
    """Write the records and the result of run ``bench_id``; return the ``.npz`` path.

    ``error_class`` and ``cached_tokens`` (HTTP runs) are per record, as in
    :class:`~mcp_servers.bench.http.HttpRun`.
    """
    artifacts.mkdir(parents=True, exist_ok=True)
    itl = [r.itl_s for r in records]
    arrival = np.array([r.arrival_s for r in records], dtype=float)
    path = artifacts / f"{bench_id}.npz"
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(
        tmp, arrival_s=arrival, sent_s=arrival if sent_s is None else sent_s,
        first_token_s=np.array([r.first_token_s for r in records], dtype=float),
        finish_s=np.array([r.finish_s for r in records], dtype=float),
        input_tokens=np.array([r.input_tokens for r in records], dtype=np.int64),
        output_tokens=np.array([r.output_tokens for r in records], dtype=np.int64),
        ok=np.array([r.error is None for r in records], dtype=bool),
        error=np.array([r.error or "" for r in records], dtype=str),
        error_class=np.array([c or "" for c in error_class] if error_class is not None
                             else ["" for _ in records], dtype=str),
        cached_tokens=(np.asarray(cached_tokens, dtype=np.int64) if cached_tokens is not None
                       else np.full(len(records), -1, dtype=np.int64)),
        itl_offsets=np.cumsum([0] + [len(x) for x in itl]),
        itl_s=np.concatenate(itl) if itl else np.zeros(0))
    tmp.replace(path)
    meta = artifacts / f"{bench_id}.json"
    tmp_meta = meta.with_suffix(".tmp.json")
    tmp_meta.write_text(result_json)
    os.replace(tmp_meta, meta)
    return str(path)


def _path(artifacts: Path, bench_id: str) -> Path:
    if not BENCH_ID_RE.match(bench_id):
        raise BackendError(f"bench_id {bench_id!r} is not a run id (lowercase letters, digits "
                           "and '-'); take it from a run result or list_runs")
    root = artifacts.resolve()
    path = (root / f"{bench_id}.npz").resolve()
    if not path.is_relative_to(root) or not path.is_file():
        raise BackendError(f"no stored run {bench_id!r}; call list_runs to see the stored ones")
    return path


def page(artifacts: Path, bench_id: str, start: int = 0, max_items: int = 100,
         include_itl: bool = False) -> RecordPage:
    """Records ``start .. start+max_items`` of run ``bench_id``.

    Raises:
        BackendError: malformed or unknown ``bench_id``.
    """
    max_items = max(1, min(max_items, MAX_PAGE))
    path = _path(artifacts, bench_id)
    try:
        return _page(path, bench_id, start, max_items, include_itl)
    except (OSError, ValueError, KeyError, IndexError, zipfile.BadZipFile) as e:
        raise BackendError(f"the records of run {bench_id!r} ({path.name}) are damaged or "
                           f"incomplete ({type(e).__name__}: {e}); rerun the benchmark") from e


def _page(path: Path, bench_id: str, start: int, max_items: int,
          include_itl: bool) -> RecordPage:
    with np.load(path, allow_pickle=False) as z:
        arrival = z["arrival_s"]
        n = len(arrival)
        sent = z["sent_s"] if "sent_s" in z.files else arrival
        errors = z["error"] if "error" in z.files else None
        classes = z["error_class"] if "error_class" in z.files else None
        cached = z["cached_tokens"] if "cached_tokens" in z.files else None
        ok, first, finish = z["ok"], z["first_token_s"], z["finish_s"]
        n_in, n_out, offs, itl = z["input_tokens"], z["output_tokens"], z["itl_offsets"], z["itl_s"]
        rows = []
        for i in range(start, min(start + max_items, n)):
            gaps = itl[offs[i]:offs[i + 1]]
            good = bool(ok[i])
            err = None if good else (str(errors[i]) if errors is not None else "failed")
            cls = str(classes[i]) if classes is not None and not good else None
            hit = int(cached[i]) if cached is not None and cached[i] >= 0 else None
            rows.append(RecordRow(
                index=i, arrival_s=float(arrival[i]), sent_s=float(sent[i]),
                dispatch_lag_ms=float(sent[i] - arrival[i]) * 1e3,
                ttft_ms=_ms(float(first[i] - arrival[i])) if good else None,
                e2e_ms=_ms(float(finish[i] - arrival[i])) if good else None,
                input_tokens=int(n_in[i]), output_tokens=int(n_out[i]),
                itl_mean_ms=float(gaps.mean()) * 1e3 if len(gaps) else None,
                itl_max_ms=float(gaps.max()) * 1e3 if len(gaps) else None,
                itl_ms=[float(g) * 1e3 for g in gaps] if include_itl else None, error=err,
                error_class=cls or None, cached_tokens=hit))
    nxt = start + max_items if start + max_items < n else None
    return RecordPage(bench_id=bench_id, total=n, start=start, next_start=nxt, records=rows)


def runs(artifacts: Path, start: int = 0, max_items: int = 100) -> RunList:
    """The stored runs under ``artifacts``, newest first."""
    max_items = max(1, min(max_items, MAX_PAGE))
    metas = sorted(artifacts.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True) \
        if artifacts.is_dir() else []
    metas = [p for p in metas if not p.name.endswith(".tmp.json")]
    out, damaged = [], []
    for p in metas:
        try:
            r = json.loads(p.read_text())
            wl, s = r["workload"], r["summary"]
            out.append(RunInfo(bench_id=r["bench_id"], kind=wl["kind"],
                               target=r.get("endpoint") or r.get("deployment") or "",
                               description=wl["description"], requests=s["requests"],
                               errors=s["errors"], output_tok_s=s["output_tok_s"],
                               valid=bool(r.get("valid", True)),
                               flags=len(r.get("flags") or []), created=p.stat().st_mtime))
        except (OSError, ValueError, KeyError, TypeError):
            damaged.append(p.name)  # a foreign or damaged file: not a run
    nxt = start + max_items if start + max_items < len(out) else None
    return RunList(total=len(out), start=start, next_start=nxt,
                   runs=out[start:start + max_items], skipped_files=damaged)
