"""Published serving points mapped to twin scenarios, from each row's own fields.

A published-points file (``shared/reference/published-points.json``; schema: ``{"points": [row,
...]}``, each row with ``engine``, ``model``, ``gpu``, ``quantization``, ``kv_cache_dtype``,
``gpu_count``, ``parallelism``, ``workload``, ``load``, ``flags`` and ``metrics``) is read row by
row; every row becomes either a :class:`Scenario` the twin runs or a :class:`Skip` naming the
exact reason it cannot. No row id appears in this module: a file with every id renamed maps to
the same scenarios (``tests/unit/test_published_points.py``).

How a row maps (first failing step is the skip reason; structural reasons are all listed):

- parallelism: ``tp`` must be one number (``parallelism.tp`` or the launch's ``--tp-size``);
  ``ep`` is ``--ep-size``, ``dp_attention`` N ``--attn-dp-size`` N (a row with DP attention or
  EP but no ``tp`` runs DEP N: TP = its width), ``pp`` ``--pp-size``; with DP attention and EP
  and no backend named, ``--moe-a2a-backend deepep``; ``dp`` and ``replicas`` multiply into
  replicas (``--dp-size`` without DP attention is full replicas in SGLang 0.5.23); a
  multi-node server is one server (``--nnodes``);
- PD disaggregation: a row that measured one phase (``phase_measured`` decode or prefill) is one
  server of that phase (its GPUs: ``{phase}_ranks``, ``ranks_per_{phase}_instance``,
  ``gpus_per_{phase}_instance`` or ``{phase}_nodes`` x 8) at its saturated step: the decode
  batch per scheduler (``load.decode_batch_per_gpu`` or ``load.decode_batch`` per rank) at
  ``kv_length_per_seq`` tokens of context, or prefill steps of ``isl``-token prompts; its
  metric is that phase's throughput per GPU (:data:`PHASE_KEYS`). A PD row without a measured
  phase is skipped (the whole deployment is not stated);
- model: the text before any parenthesis, looked up by hub id (``domain.models.find_checkpoint``:
  ``zai-org/GLM-5-FP8`` -> glm-5 fp8, a bare ``GLM-5-NVFP4`` by the hub id's last part), else by
  the catalog entry's ``release`` name with the checkpoint the quantization text names
  (``GLM-5`` + "FP8" -> glm-5 fp8); :data:`SAME_ARCHITECTURE` renames a release the catalog holds
  under its twin's name;
- GPU: the longest run of leading words of the GPU text that ``domain.hardware`` knows by name or
  alias ("RTX PRO 6000 Blackwell (SM120, ...)" -> RTX-PRO-6000, "H200 SXM 141GB" -> H200);
- flags (SGLang rows only): the ``--flag value`` pairs of ``flags.launch`` and every ``--flag`` key
  of ``flags``, read by servetune's SGLang 0.5.23 parser (``Engine.parse_command``: speculative
  decoding, ``--mem-fraction-static``, ``--disable-cuda-graph``, ``--kv-cache-dtype``, ...);
  older releases' flags as their successors (:data:`LEGACY_FLAGS`), a value's parenthesised
  aside dropped, "N x num_<count>" as N x ``parallelism.<count>``;
  a ``cuda_graph`` note saying "disabled" is ``--disable-cuda-graph``; other engines' flags are
  their own and not mapped;
- metrics: tok/s/GPU (measured output tok/s over the row's GPUs, else its stated per-GPU figure),
  TPOT and TTFT means (ms); a row with neither throughput nor TPOT is skipped;
- load: ``load.concurrency`` (a closed loop of that many clients; over replicas evenly), else an
  offline mode (every request queued at t = 0: ``workload.num_requests``/``num_prompts``, else
  "N requests at Ik/Ok" in the dataset text, else :data:`OFFLINE_STAND_IN`);
- lengths: the measured means when the dataset draws lengths (bench_serving random, ShareGPT),
  the fixed ``isl``/``osl`` otherwise; a row that states its concurrency and throughput but no
  lengths runs :data:`STAND_IN_LENGTHS` and says so in its line.
"""

from __future__ import annotations

import builtins
import io
import json
import math
import re
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from domain.config import ServingConfig
from domain.engines import engine
from domain.hardware import GPUS
from domain.models import CATALOG, find_checkpoint, load_model

# The metrics compared, in print order.
METRICS = ("tok/s/GPU", "TPOT ms", "TTFT ms", "prefill tok/s/GPU")
# The engine whose rows make the headline median (the twin simulates SGLang); rows of other
# engines are scored and printed beside it.
TWIN_ENGINE = "SGLang"
# The SGLang release whose flag inventory reads the rows' flags (the twin's release).
FLAG_VERSION = "0.5.23"
# Lengths of a row that states neither ISL/OSL nor a dataset: sglang.bench_serving's default
# dataset is ShareGPT (``--dataset-name`` default ``sharegpt``: shared/reference/sglang-knobs.md
# "bench_serving"), and 297 / 192 are the mean input / output tokens bench_serving reported for
# 1,000 ShareGPT_Vicuna_unfiltered prompts in the SGLang cookbook's GPT-OSS speed benchmark
# (docs.sglang.io/cookbook/autoregressive/OpenAI/GPT-OSS, section 5).
STAND_IN_LENGTHS = (297, 192)
# Offline rows that state no request count run this many; any count is capped at OFFLINE_MAX
# (simulation size: the throughput of an offline run is its steady state once the queue is a
# few batches deep, which 1,000 requests of any length the catalog GPUs hold are).
OFFLINE_STAND_IN = 1000
OFFLINE_MAX = 2000
# Releases the catalog holds under another release of the same architecture: Llama-3.3-70B has
# Llama-3.1-70B's shapes (hidden 8192, FFN 28672, 80 layers, 64 / 8 KV heads, vocab 128256, RoPE
# theta 5e5, 131072 positions: the model card of meta-llama/Llama-3.3-70B-Instruct against
# data/models/meta-llama--Meta-Llama-3.1-70B_config.json).
# DeepSeek-V3-0324 is a post-training update of DeepSeek-V3 with its config shapes (671B MoE, 61
# layers, MLA, 256 routed experts: the model card of deepseek-ai/DeepSeek-V3-0324 against
# data/models/deepseek-ai--DeepSeek-V3_config.json); "DeepSeek-V3/R1" names the one architecture
# of V3 and R1, whose fp8 and nvfp4 checkpoints the catalog holds as DeepSeek-R1-0528.
SAME_ARCHITECTURE = {"llama-3.3-70b-instruct": "Llama-3.1-70B-Instruct",
                     "deepseek-v3-0324": "DeepSeek-V3", "deepseek-v3/r1": "DeepSeek-R1-0528"}
# Quantization words -> the catalog's weights keys (first word found in the text wins).
QUANT_WORDS = (("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"), ("w4a16", "w4a16"), ("fp4", "nvfp4"),
               ("fp8", "fp8"), ("bf16", "bf16"))
# Metric keys of the schema: output throughput over all the row's GPUs / per GPU; means.
TOTAL_THROUGHPUT_KEYS = ("output_tok_s", "output_tok_s_total")
PER_GPU_THROUGHPUT_KEYS = ("output_tok_s_per_gpu",)
# A PD row's measured phase: its throughput per GPU of that phase (tok/s/GPU: output tokens of
# the decode servers; prefill tok/s/GPU: input tokens of the prefill servers).
PHASE_KEYS = {"decode": ("tok/s/GPU", "decode_output_tok_s_per_gpu"),
              "prefill": ("prefill tok/s/GPU", "prefill_input_tok_s_per_gpu")}
# GPUs per node of a row that counts its phase in nodes (8-GPU HGX / DGX nodes: P-row texts
# say "NVLink in node", and both H100 and H200 HGX boards hold 8)
GPUS_PER_NODE = 8
MEAN_KEYS = {"TPOT ms": "tpot_ms_mean", "TTFT ms": "ttft_ms_mean"}
# Flag values that mean "left at the engine default".
UNSET = ("unset", "default", "none")


@dataclass(frozen=True)
class Scenario:
    """One row the twin can express: a config, a load and the measured metrics.

    ``conc``: closed-loop clients per replica (None: offline, ``requests`` queued at t = 0);
    ``isl``/``osl``: tokens per request; ``measured``: metric name (:data:`METRICS`) -> value
    (tok/s per GPU, ms); ``notes``: how the row was read where it needed a choice.
    ``phase``: for a PD row that measured one phase alone ("decode" or "prefill"), ``config``
    is one server of that phase (``disaggregation_mode``) and the prediction is its saturated
    step: decode ``batch`` requests per scheduler at ``ctx`` tokens of context each (None:
    as many as its KV pool and request cap hold), or prefill steps of ``isl``-token prompts.
    """

    id: str
    engine: str
    config: ServingConfig
    conc: int | None
    requests: int
    isl: int
    osl: int
    measured: dict[str, float]
    notes: tuple[str, ...] = ()
    phase: str | None = None
    batch: int | None = None
    ctx: int = 0


@dataclass(frozen=True)
class Skip:
    """A row the twin cannot express, and why."""

    id: str
    engine: str
    reason: str


@dataclass(frozen=True)
class Score:
    """One metric of one scored row: predicted, measured, absolute error in %."""

    id: str
    engine: str
    metric: str
    predicted: float
    measured: float

    @property
    def error_pct(self) -> float:
        """|predicted / measured - 1| x 100."""
        return abs(self.predicted / self.measured - 1) * 100


@dataclass
class Evaluation:
    """Scores of a file's scenarios, the rows skipped, and those the twin could not run."""

    scores: list[Score] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)
    failed: list[Skip] = field(default_factory=list)
    notes: dict[str, tuple[str, ...]] = field(default_factory=dict)


class _Unmappable(Exception):
    """A row field the twin cannot express (the message is the skip reason)."""


# ---------------------------------------------------------------------------- fit guard
_FITTING = 0
_SEEN: set[Path] = set()  # every file read_points read (resolved), refused inside a fit
_NAME = re.compile(r"published[-_]points.*\.json$")
F = TypeVar("F", bound=Callable[..., Any])


class PublishedReadDuringFit(RuntimeError):
    """A published-points file was to be read while a fit runs (fits use measured rows only)."""


def _published_path(file: Any) -> bool:
    """Whether ``file`` (an ``open`` argument) names a published-points file."""
    if not isinstance(file, (str, Path)):
        return False  # a file descriptor
    path = Path(file)
    return bool(_NAME.search(path.name)) or path.resolve() in _SEEN


@contextmanager
def fitting() -> Iterator[None]:
    """While inside, reading a published-points file raises :class:`PublishedReadDuringFit`.

    :func:`read_points` refuses, and so does ``open`` (``builtins.open`` and ``io.open``, which
    ``pathlib`` uses) of a file named ``published-points*.json`` or read by :func:`read_points`
    before.
    """
    global _FITTING
    real_open = io.open

    def guarded(file: Any, *args: Any, **kwargs: Any) -> Any:
        if _published_path(file):
            raise PublishedReadDuringFit(f"{file}: published points are never read during a fit")
        return real_open(file, *args, **kwargs)

    outer = _FITTING == 0
    _FITTING += 1
    if outer:
        builtins.open = io.open = guarded
    try:
        yield
    finally:
        _FITTING -= 1
        if outer:
            builtins.open = io.open = real_open


def no_published_reads(fn: F) -> F:
    """Decorate a fit entry point: no published-points file can be read during its call."""
    @wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        with fitting():
            return fn(*args, **kwargs)
    return inner  # type: ignore[return-value]


def read_points(path: Path) -> list[dict[str, Any]]:
    """The rows of a published-points file.

    Raises:
        PublishedReadDuringFit: inside :func:`fitting` (a fit never sees published points).
        SystemExit: the file is missing or not ``{"points": [...]}``.
    """
    if _FITTING:
        raise PublishedReadDuringFit(f"{path}: published points are never read during a fit")
    _SEEN.add(Path(path).resolve())
    try:
        points = json.loads(Path(path).read_text())["points"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--published {path}: not a published-points file (expected "
                         f"{{\"points\": [...]}}: {type(e).__name__}: {e})") from None
    if not isinstance(points, list):
        raise SystemExit(f"--published {path}: 'points' is not a list")
    return points


# ---------------------------------------------------------------------------- field readers
def _strip(text: str) -> str:
    """``text`` without parenthesised asides, trimmed."""
    prev = None
    while prev != text:
        prev, text = text, re.sub(r"\([^()]*\)", " ", text)
    return " ".join(text.split())


def engine_name(row: Mapping[str, Any]) -> str:
    """The engine's name: the first word of ``engine`` ("TensorRT-LLM (PyTorch ...)" -> ...)."""
    words = str(row.get("engine") or "unknown").split()
    return words[0] if words else "unknown"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _int(value: Any) -> int | None:
    v = _number(value)
    return int(v) if v is not None and v == int(v) else None


def quant_key(text: str) -> str | None:
    """The weights key the quantization text names first ("NVFP4 MoE + FP8 attn" -> nvfp4)."""
    low = text.lower()
    hits = [(m.start(), key) for word, key in QUANT_WORDS
            for m in [re.search(rf"(?<![a-z0-9]){word}(?![a-z0-9])", low)] if m]
    return min(hits)[1] if hits else None


def catalog_checkpoint(model_text: str, quant_text: str) -> tuple[str, str, str | None]:
    """``(catalog model, weights key, note)`` of a row's model and quantization texts.

    Raises:
        _Unmappable: no catalog model, or no checkpoint of it matching the quantization.
    """
    name = _strip(model_text)
    words = name.split()
    qkey = quant_key(quant_text)
    note = None
    for cand in dict.fromkeys([name, *words[:1]]):
        low = cand.casefold()
        for old, new in SAME_ARCHITECTURE.items():
            if old in low:
                i = low.index(old)
                cand = cand[:i] + new + cand[i + len(old):]
                note = f"run as {new} (same architecture)"
        hit = find_checkpoint(cand, qkey)
        if hit is not None:
            if note is not None and qkey is not None and hit[1] != qkey \
                    and qkey in load_model(hit[0]).checkpoints:
                return hit[0], qkey, note  # a renamed release: the quantization text picks
            return hit[0], hit[1], note
        for key, entry in CATALOG.items():
            if str(entry.get("release", "")).casefold() == cand.casefold():
                ckpts = load_model(key).checkpoints
                if qkey in ckpts:
                    return key, qkey, note
                raise _Unmappable(f"quantization {quant_text!r} names no checkpoint of {key} "
                                  f"({', '.join(ckpts)})")
    raise _Unmappable(f"model {model_text!r} not in the catalog")


def catalog_gpu(text: str) -> str:
    """The catalog GPU of a row's GPU text: its longest leading run of words the catalog knows.

    Raises:
        _Unmappable: no leading words name a catalog GPU.
    """
    words = [w for w in re.split(r"[\s_-]+", _strip(text)) if w]
    for n in range(len(words), 0, -1):
        canon = GPUS.resolve(" ".join(words[:n]))
        if canon is not None:
            return canon
    raise _Unmappable(f"gpu {text!r} not in the GPU catalog")


def kv_dtype(text: Any) -> str:
    """``--kv-cache-dtype`` of a row's ``kv_cache_dtype`` text ("auto (bf16)" -> auto)."""
    low = str(text or "").lower().strip()
    if low.startswith("auto"):
        return "auto"
    if re.search(r"(?<![a-z0-9])fp8", low):
        return "fp8_e4m3"
    if re.search(r"(?<![a-z0-9])bf16", low):
        return "bf16"
    return "auto"  # "not stated": the engine default


def _int_or_ranks(value: Any, ranks: int) -> int | None:
    """An int, or ``ranks`` for a text saying "all ... ranks" (e.g. "all decode ranks")."""
    if isinstance(value, str) and re.fullmatch(r"all\b.*\branks?", value.strip().lower()):
        return ranks
    return _int(value)


def _phase_gpus(par: Mapping[str, Any], phase: str) -> int | None:
    """GPUs of the measured phase's server: ``{phase}_ranks``, ``ranks_per_{phase}_instance``,
    ``gpus_per_{phase}_instance``, or ``{phase}_nodes`` x :data:`GPUS_PER_NODE`."""
    for key in (f"{phase}_ranks", f"ranks_per_{phase}_instance", f"gpus_per_{phase}_instance"):
        if _int(par.get(key)):
            return _int(par.get(key))
    nodes = _int(par.get(f"{phase}_nodes"))
    return nodes * GPUS_PER_NODE if nodes else None


def _layout(row: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """Layout fields of the row's server (``tp_size``, ``attn_dp_size``, ``ep_size``,
    ``pp_size`` and, for a PD row, ``phase``), from ``parallelism`` and the launch flags.

    DP attention N (``dp_attention``, or ``--enable-dp-attention`` with ``--dp-size N``) is
    ``--attn-dp-size N``; a row naming DP attention and EP but no TP runs TP = its width
    (DEP N: ``--tp-size N --attn-dp-size N --ep-size N``). A PD row must say which phase it
    measured; its server is one of that phase (GPUs: :func:`_phase_gpus`).

    Raises:
        _Unmappable: a layout value that is not one number, or PD without a measured phase.
    """
    par = row.get("parallelism") or {}
    out: dict[str, Any] = {}
    phase = None
    if par.get("pd_disaggregation"):
        phase = str(par.get("phase_measured", "")).lower()
        if phase not in PHASE_KEYS:
            raise _Unmappable("pd_disaggregation without a measured phase (phase_measured "
                              "decode or prefill): the whole PD deployment is not stated")
        out["phase"] = phase
    width = _phase_gpus(par, phase) if phase else None
    ep = max(_int(par.get("ep")) or 1, _int(values.get("ep_size")) or 1)
    if par.get("ep") is not None and _int(par.get("ep")) is None:
        raise _Unmappable(f"parallelism ep {par.get('ep')!r} is not one number")
    dpa_raw = par.get("dp_attention")
    dpa = _int_or_ranks(dpa_raw, width or ep)
    if dpa_raw is not None and dpa_raw is not False and dpa is None:
        raise _Unmappable(f"dp_attention {dpa_raw!r} is not one number")
    if values.get("enable_dp_attention") or any(
            v for k, v in values.items() if k == "attn_dp_size" and v and v > 1):
        dpa = max(dpa or 1, _int(values.get("attn_dp_size")) or _int(values.get("dp_size"))
                  or width or ep)
    pp = max(_int(par.get("pp")) or 1, _int(values.get("pp_size")) or 1)
    if dpa and dpa > 1:
        out["attn_dp_size"] = dpa
    if ep > 1:
        out["ep_size"] = ep
    if pp > 1:
        out["pp_size"] = pp
    if width:
        out["tp_size"] = width // pp
    elif par.get("tp") is None and values.get("tp_size") is None and (dpa or ep) > 1:
        out["tp_size"] = max(dpa or 1, ep)  # DEP N
    return out


# Flags of SGLang releases before the parser's, as their 0.5.23 successors: v0.4's
# --enable-deepep-moe became --moe-a2a-backend deepep (sglang-knobs reference 1.9: the
# all-to-all backend choice), --cuda-graph-bs (last in 0.5.19: domain/data/sglang-0.5.19-flags.json)
# is --cuda-graph-bs-decode in 0.5.23 (domain/data/sglang-0.5.23-flags.json).
LEGACY_FLAGS = {"--enable-deepep-moe": ["--moe-a2a-backend", "deepep"],
                "--cuda-graph-bs": ["--cuda-graph-bs-decode"]}
# A flag value "2048 x num_decode_nodes": a number times a ``parallelism`` count.
_PER_UNIT = re.compile(r"(\d+)\s*x\s*num_(\w+)")


def _flag_tokens(row: Mapping[str, Any]) -> list[str]:
    """SGLang argv of the row: ``--flag value`` pairs of the launch text, then flag keys.

    A key's value keeps its text without parenthesised asides ("low_latency (decode)" ->
    low_latency); "N x num_<count>" is N times ``parallelism.<count>``.

    Raises:
        _Unmappable: a flag key whose value is prose, or a speculative-decoding note.
    """
    flags = row.get("flags") or {}
    launch = _strip(str(flags.get("launch", ""))).split(";")[0]
    tokens: list[str] = []
    given: set[str] = set()
    for m in re.finditer(r"(--[A-Za-z0-9][A-Za-z0-9-]*)(?:[ =](?!-)(\S+))?", launch):
        flag, value = m.group(1), m.group(2)
        if flag in ("--model", "--model-path"):
            continue
        given.add(flag)
        tokens += [flag] if value is None else [flag, value]
    for key, value in flags.items():
        if key in LEGACY_FLAGS and key not in given:
            new = LEGACY_FLAGS[key]
            if value is True:
                tokens += new if len(new) > 1 else []
                continue
            if len(new) == 1:
                key = new[0]
        if key.startswith("--") and key not in given:
            if value is True:
                tokens.append(key)
            elif value is False or value is None or str(value).lower() in UNSET:
                continue
            elif isinstance(value, str) and (m := _PER_UNIT.fullmatch(value.strip())):
                per = _int((row.get("parallelism") or {}).get(m.group(2)))
                if per is None:
                    raise _Unmappable(f"flag {key} {value!r}: parallelism {m.group(2)} is not "
                                      "stated")
                tokens += [key, str(int(m.group(1)) * per)]
            elif isinstance(value, (int, float)) or (isinstance(value, str)
                                                     and len(_strip(value).split()) == 1):
                tokens += [key, _strip(str(value))]
            else:
                raise _Unmappable(f"flag {key} {str(value)[:40]!r} is not one value")
        elif key == "cuda_graph" and "disabled" in str(value).lower() \
                and "--disable-cuda-graph" not in given:
            tokens.append("--disable-cuda-graph")
        elif key == "speculative":
            raise _Unmappable(f"flags speculative {str(value)[:40]!r}: the draft shape is not "
                              "stated as flags")
    return tokens


def measured_metrics(row: Mapping[str, Any], gpus: int, phase: str | None = None
                     ) -> dict[str, float]:
    """Metric name -> measured value of a row (tok/s per ``gpus`` GPUs, ms).

    ``phase`` (a PD row that measured one phase): that phase's per-GPU throughput
    (:data:`PHASE_KEYS`) and the means; other throughputs of the deployment are left out.
    """
    metrics = row.get("metrics") or {}

    def value(key: str) -> float | None:
        m = metrics.get(key)
        v = _number(m.get("value")) if isinstance(m, Mapping) else None
        return v if v is not None and v > 0 else None

    out: dict[str, float] = {}
    if phase is not None:
        name, key = PHASE_KEYS[phase]
        if (v := value(key)) is not None:
            out[name] = v
        for name, key in MEAN_KEYS.items():
            if (v := value(key)) is not None:
                out[name] = v
        return out
    total = next((v for k in TOTAL_THROUGHPUT_KEYS if (v := value(k)) is not None), None)
    per_gpu = next((v for k in PER_GPU_THROUGHPUT_KEYS if (v := value(k)) is not None), None)
    if total is not None:
        out["tok/s/GPU"] = total / gpus
    elif per_gpu is not None:
        out["tok/s/GPU"] = per_gpu
    for name, key in MEAN_KEYS.items():
        if (v := value(key)) is not None:
            out[name] = v
    return out


def _lengths(row: Mapping[str, Any], stand_in_ok: bool) -> tuple[int, int, str | None]:
    """``(isl, osl, note)`` of a row's workload.

    Raises:
        _Unmappable: the row states no lengths and may not run the stand-in.
    """
    wl = row.get("workload") or {}
    dataset = str(wl.get("dataset", "")).lower()
    fixed = "fixed" in dataset or "stdev 0" in dataset
    isl, osl = _int(wl.get("isl")), _int(wl.get("osl"))
    mi, mo = _number(wl.get("measured_mean_input")), _number(wl.get("measured_mean_output"))
    if mi is not None and mo is not None and not (fixed and isl and osl):
        return round(mi), round(mo), None
    if isl and osl:
        drawn = not fixed and ("random" in dataset or "sharegpt" in dataset)
        return isl, osl, ("lengths drawn, their means not stated: the stated ISL/OSL run fixed"
                          if drawn else None)
    if stand_in_ok and (not dataset or "not stated" in dataset):
        i, o = STAND_IN_LENGTHS
        return i, o, (f"ISL/OSL not stated: stand-in bench_serving default ShareGPT means "
                      f"{i}/{o}")
    raise _Unmappable("ISL/OSL not stated")


def _offline_requests(row: Mapping[str, Any], isl: int, osl: int) -> tuple[int, str | None]:
    """Requests an offline row queues at t = 0 (capped at :data:`OFFLINE_MAX`), and a note."""
    wl = row.get("workload") or {}
    n = _int(wl.get("num_requests")) or _int(wl.get("num_prompts"))
    if n is None:
        text = str(wl.get("dataset", ""))
        for m in re.finditer(r"([\d,]+) (?:requests? )?at (\d+)k/(\d+)k", text):
            if (int(m.group(2)), int(m.group(3))) == (round(isl / 1000), round(osl / 1000)):
                n = int(m.group(1).replace(",", ""))
    note = None
    if n is None:
        n, note = OFFLINE_STAND_IN, (f"offline, request count not stated: {OFFLINE_STAND_IN} "
                                     "queued at t=0")
    if n > OFFLINE_MAX:
        n, note = OFFLINE_MAX, f"offline: {OFFLINE_MAX} of {n} requests queued at t=0"
    return n, note


def map_row(row: Mapping[str, Any]) -> Scenario | Skip:
    """The twin scenario of one published row, or the reason it is skipped.

    A row that is not an object, or whose fields have the wrong shape (e.g. ``"load": "x"``),
    is skipped as malformed with the Python error, so one bad row never stops the benchmark.
    """
    if not isinstance(row, Mapping):
        return Skip("?", "?", f"malformed row: not an object ({type(row).__name__})")
    rid = str(row.get("id", "?"))
    try:
        eng = engine_name(row)
    except (AttributeError, TypeError, ValueError) as e:
        return Skip(rid, "?", f"malformed row: {type(e).__name__}: {e}")
    try:
        return _map(row, rid, eng)
    except _Unmappable as e:
        return Skip(rid, eng, str(e))
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        return Skip(rid, eng, f"malformed row: {type(e).__name__}: {e}")


def _map(row: Mapping[str, Any], rid: str, eng: str) -> Scenario:
    sglang = eng == TWIN_ENGINE
    tokens: list[str] = []
    token_err: _Unmappable | None = None
    values: dict[str, Any] = {}
    if sglang:
        try:
            tokens = _flag_tokens(row)
        except _Unmappable as e:
            token_err = e
    if tokens and token_err is None:  # parallelism flags count before the model is known
        values = engine("sglang", FLAG_VERSION).parse_command(
            ["sglang", "serve", *tokens]).values
    lay = _layout(row, values)
    phase = lay.pop("phase", None)
    model, weights, model_note = catalog_checkpoint(str(row.get("model", "")),
                                                    str(row.get("quantization", "")))
    gpu = catalog_gpu(str(row.get("gpu", "")))
    notes = [model_note] if model_note else []
    par = row.get("parallelism") or {}
    tp = _int(par.get("tp"))
    if par.get("tp") is not None and tp is None:
        raise _Unmappable(f"parallelism tp {par.get('tp')!r} is not one number")
    launch_tp = _int(values.get("tp_size"))
    if tp is not None and launch_tp is not None and launch_tp != tp:
        raise _Unmappable(f"parallelism tp {tp} but the launch says --tp-size {launch_tp}")
    if phase is not None:  # one server of the measured phase: its width is the layout's
        if "tp_size" not in lay:
            raise _Unmappable(f"pd_disaggregation: the {phase} servers' GPUs are not stated")
        tp = lay.pop("tp_size")
    tp = tp or launch_tp or lay.pop("tp_size", None) or 1
    lay.pop("tp_size", None)
    pp = lay.get("pp_size", 1)
    reps = par.get("replicas", 1)
    if _int(reps) is None:
        raise _Unmappable(f"parallelism replicas {reps!r} is not one number")
    replicas = (_int(reps) or 1) * (_int(par.get("dp")) or 1)
    if "attn_dp_size" not in lay:  # --dp-size without DP attention: full copies
        replicas *= _int(values.get("dp_size")) or 1
    count = _int(row.get("gpu_count"))
    if count is not None and count != tp * pp * replicas:
        raise _Unmappable(f"gpu_count {count} but tp x pp x replicas = {tp * pp * replicas}")
    measured = measured_metrics(row, tp * pp * replicas, phase)
    if phase is not None:
        return _phase_scenario(row, rid, eng, phase, model, weights, gpu, tp, lay, tokens,
                               token_err, measured, notes)
    if "tok/s/GPU" not in measured and "TPOT ms" not in measured:
        raise _Unmappable("no throughput or TPOT metric (metrics: "
                          + ", ".join(row.get("metrics") or {}) + ")")
    load = row.get("load") or {}
    conc = load.get("concurrency")
    mode = str(load.get("mode", "")).lower()
    offline = "offline" in mode or "all requests queued" in mode
    if conc is not None and _int(conc) is None:
        raise _Unmappable(f"load concurrency {conc!r} is not one number")
    rate = _number(load.get("request_rate"))
    if conc is None and not offline:
        if rate is not None and math.isfinite(rate):
            raise _Unmappable(f"load request_rate {rate:g}/s without concurrency: open-loop "
                              "arrivals are not mapped yet")
        raise _Unmappable("load: neither a concurrency nor an offline mode is stated")
    isl, osl, len_note = _lengths(row, stand_in_ok=conc is not None
                                  and "tok/s/GPU" in measured)
    notes += [len_note] if len_note else []
    if token_err is not None:
        raise token_err
    fields = _sglang_fields(model, weights, tokens) if sglang else {}
    config = _config(row, model, gpu, weights, tp, replicas, fields, lay, notes)
    requests, clients = 0, None
    if conc is not None:
        c = int(conc)
        if c % replicas:
            raise _Unmappable(f"concurrency {c} does not split evenly over {replicas} replicas")
        clients = c // replicas
        if offline:
            notes.append(f"offline with at most {c} in flight: a closed loop of {c}")
    else:
        requests, req_note = _offline_requests(row, isl, osl)
        notes.append(req_note or f"offline: {requests} requests queued at t=0")
    if not sglang:
        notes.append(f"SGLang twin; {eng} flags not mapped")
    return Scenario(id=rid, engine=eng, config=config, conc=clients, requests=requests,
                    isl=isl, osl=osl, measured=measured, notes=tuple(notes))


def _sglang_fields(model: str, weights: str, tokens: list[str]) -> dict[str, Any]:
    """Config fields of the row's SGLang flags (:data:`FLAG_VERSION`'s parser).

    Raises:
        _Unmappable: the parser refuses a flag.
    """
    hub = load_model(model).checkpoints[weights].model_path
    parsed = engine("sglang", FLAG_VERSION).parse_command(
        ["sglang", "serve", "--model-path", hub, *tokens])
    refused = [f.message for f in parsed.findings if f.severity == "refuse"]
    if refused:
        raise _Unmappable(f"flags refused by SGLang {FLAG_VERSION}'s parser: {refused[0]}")
    return {k: v for k, v in parsed.fields.items()
            if k not in ("model", "weights", "tp_size", "replicas", "dp_size")}


def _config(row: Mapping[str, Any], model: str, gpu: str, weights: str, tp: int,
            replicas: int, fields: dict[str, Any], lay: Mapping[str, Any],
            notes: list[str]) -> ServingConfig:
    """The row's ServingConfig: flags' fields, then the layout's (``lay`` wins).

    DP attention with EP and no ``--moe-a2a-backend`` given runs DeepEP (SGLang's recipes for
    DP attention + EP, sglang-knobs reference 1.9; the rows' own deployments name DeepEP).

    Raises:
        _Unmappable: the config refuses the fields.
    """
    fields = {**fields, **lay}
    fields.setdefault("kv_cache_dtype", kv_dtype(row.get("kv_cache_dtype")))
    if fields.get("attn_dp_size", 1) > 1 and fields.get("ep_size", 1) > 1 \
            and fields.get("moe_a2a_backend") in (None, "none"):
        fields["moe_a2a_backend"] = "deepep"
        notes.append("DP attention + EP: --moe-a2a-backend deepep")
    try:
        return ServingConfig(model=model, gpu=gpu, weights=weights, tp_size=tp,
                             replicas=replicas, **fields)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise _Unmappable(f"config: {where}: {err['msg']}"[:160]) from None
    except (ValueError, TypeError) as e:
        raise _Unmappable(f"config: {str(e).splitlines()[-1][:120]}") from None


def _phase_scenario(row: Mapping[str, Any], rid: str, eng: str, phase: str, model: str,
                    weights: str, gpu: str, tp: int, lay: dict[str, Any], tokens: list[str],
                    token_err: _Unmappable | None, measured: dict[str, float],
                    notes: list[str]) -> Scenario:
    """A PD row that measured one phase: one server of that phase at its saturated step.

    Decode: ``load.decode_batch_per_gpu`` (per GPU: x GPUs / schedulers per scheduler) or
    ``load.decode_batch`` (per rank; a unit the row does not state is read per rank, noted),
    else the server's own limit; context ``kv_length_per_seq`` (load or workload), else
    ``isl + osl / 2``. Prefill: ``isl``-token prompts.

    Raises:
        _Unmappable: no metric of the phase, no ISL, or a flag/config refusal.
    """
    key = PHASE_KEYS[phase][0]
    if key not in measured:
        raise _Unmappable(f"pd_disaggregation phase {phase}: no {PHASE_KEYS[phase][1]} metric "
                          "(metrics: " + ", ".join(row.get("metrics") or {}) + ")")
    wl, load = row.get("workload") or {}, row.get("load") or {}
    isl, osl = _int(wl.get("isl")), _int(wl.get("osl"))
    if not isl:
        raise _Unmappable("ISL/OSL not stated")
    if token_err is not None:
        raise token_err
    fields = _sglang_fields(model, weights, tokens) if eng == TWIN_ENGINE else {}
    fields["disaggregation_mode"] = phase
    config = _config(row, model, gpu, weights, tp, 1, fields, lay, notes)
    ctx = _int(load.get("kv_length_per_seq")) or _int(wl.get("kv_length_per_seq")) \
        or isl + (osl or 0) // 2
    batch = None
    if phase == "decode":
        per_gpu, per = _int(load.get("decode_batch_per_gpu")), _int(load.get("decode_batch"))
        if per_gpu:
            batch = max(1, per_gpu * config.gpus_per_server // config.schedulers)
        elif per:
            batch = per
            unit = str(load.get("decode_batch_unit", "")).lower()
            if "not stated" in unit:
                notes.append(f"decode batch {per}: unit not stated, read per rank")
        else:
            notes.append("decode batch not stated: the server's KV pool and request cap")
    notes.append(f"{phase} phase alone: one {config.gpus_per_server}-GPU "
                 f"{phase} server's saturated step")
    if eng != TWIN_ENGINE:
        notes.append(f"SGLang twin; {eng} flags not mapped")
    return Scenario(id=rid, engine=eng, config=config, conc=None, requests=0, isl=isl,
                    osl=osl or 1, measured=measured, notes=tuple(notes), phase=phase,
                    batch=batch, ctx=ctx)


def load(path: Path) -> list[Scenario | Skip]:
    """Every row of a published-points file, mapped (:func:`map_row`), in file order."""
    return [map_row(r) for r in read_points(path)]


# ---------------------------------------------------------------------------- scoring
# metric -> predicted value (and optionally "note": how the twin ran it), or why it failed
Prediction = Mapping[str, Any] | str


def evaluate(mapped: Sequence[Scenario | Skip],
             predict: Callable[[Scenario], Prediction]) -> Evaluation:
    """Score each scenario's measured metrics against ``predict``'s numbers."""
    ev = Evaluation()
    for item in mapped:
        if isinstance(item, Skip):
            ev.skipped.append(item)
            continue
        pred = predict(item)
        if isinstance(pred, str):
            ev.failed.append(Skip(item.id, item.engine, f"twin cannot run it: {pred}"))
            continue
        ev.notes[item.id] = item.notes + ((str(pred["note"]),) if "note" in pred else ())
        for metric in METRICS:
            meas, p = item.measured.get(metric), pred.get(metric)
            if meas is not None and p is not None and math.isfinite(p):
                ev.scores.append(Score(item.id, item.engine, metric, p, meas))
    return ev


def summary(scores: Sequence[Score], engine_: str = TWIN_ENGINE
            ) -> dict[str, tuple[int, float, float]]:
    """Metric -> (rows, median, mean absolute % error) over ``engine_``'s scores."""
    out = {}
    for metric in METRICS:
        errs = [s.error_pct for s in scores if s.metric == metric and s.engine == engine_]
        if errs:
            out[metric] = (len(errs), statistics.median(errs), statistics.fmean(errs))
    return out


def report(ev: Evaluation, baseline: Evaluation | None = None) -> list[str]:
    """The printed lines: one per row and metric, the summaries, the skipped rows."""
    lines = [f"  {'id':<6} {'engine':<13} {'metric':<10} {'predicted':>10} {'measured':>10} "
             f"{'error':>7}"]
    seen = set()
    for s in ev.scores:
        note = ""
        if s.id not in seen:
            seen.add(s.id)
            note = ("  -- " + "; ".join(ev.notes[s.id])) if ev.notes.get(s.id) else ""
        lines.append(f"  {s.id:<6} {s.engine:<13} {s.metric:<10} {s.predicted:>10.1f} "
                     f"{s.measured:>10.1f} {s.error_pct:>6.0f}%{note}")
    base = summary(baseline.scores) if baseline is not None else {}
    for metric, (n, med, mean) in summary(ev.scores).items():
        extra = f" (uncalibrated: median {base[metric][1]:.1f} %)" if metric in base else ""
        lines.append(f"  {TWIN_ENGINE} {metric}: median abs error {med:.1f} %, mean "
                     f"{mean:.1f} % over {n} rows{extra}")
    others = sorted({s.engine for s in ev.scores} - {TWIN_ENGINE})
    for eng in others:
        for metric, (n, med, _) in summary(ev.scores, eng).items():
            lines.append(f"  beside, not in the median: {eng} {metric}: median {med:.1f} % "
                         f"over {n} rows")
    for sk in ev.failed + ev.skipped:
        lines.append(f"  skipped {sk.id} ({sk.engine}): {sk.reason}")
    return lines
