"""aiperf adapter: trace conversion, offline tokenizer, ``aiperf profile`` runs, artifact parsing.

aiperf (ai-dynamo/aiperf, Apache-2.0) is the load generator for cluster benchmarks; it is an
optional extra pinned to :data:`AIPERF_VERSION` (``pip install -e ".[aiperf]"``, or that version
in a venv of its own named by ``SERVETUNE_AIPERF``: it pins ``rich~=14.1``, ``pandas~=2.3`` and
more) and always runs as a separate process (locally, or as a Kubernetes Job beside the
engine), never imported. What
this module does, and why, follows the measurements in ``shared/reference/loadgen.md`` (the
"loadgen reference"; sections in brackets):

- **Traces** (:func:`write_trace`, :func:`convert_trace`): every supported trace (Mooncake,
  Azure, Qwen-Bailian, synthetic; :mod:`domain.workload`) becomes aiperf's ``mooncake_trace``
  JSONL, one row per request: ``timestamp`` (float ms), ``input_length``, ``output_length``,
  ``hash_ids`` (when the trace has them) and a ``session_id`` ``r<row>`` that comes back in
  each per-request record as ``conversation_id``, so records map to rows exactly. Timestamps are
  pre-scaled by the replay's time scale and re-based on the window start in the file: aiperf's
  ``--synthesis-speedup-ratio`` failed on the real Mooncake trace and ``--replay-speedup``
  applies only to ``baseten_trace`` [7]; Azure CSV is not read by that loader [7]. ``hash_ids``
  are cut to ``ceil(input_length / block)`` because aiperf refuses a final block outside
  ``(0, block]`` (``PromptGenerator._build_token_sequence``), and a partial final block whose
  id stands for another size elsewhere loses that id (aiperf materializes an id at one size
  only); the block size (512 Mooncake, 16 Bailian) is passed with ``--isl-block-size``.
- **Schedule**: ``--fixed-schedule --fixed-schedule-start-offset 0`` makes the file's
  timestamps absolute offsets from the phase start, so the idle time before a window's first
  request is kept, as :meth:`domain.workload.Trace.window` keeps it (aiperf 0.13.0 otherwise
  defaults to ``auto_offset``, which shifts the first request to 0).
- **Tokenizer** (:func:`prepare_tokenizer`): aiperf's trace-replay decode workers force
  ``HF_HUB_OFFLINE=1``, under which a tokenizer *directory* fails with ``HFValidationError``;
  the working recipe is a Hugging Face cache layout referred to by a repo id [3]. Without a
  tokenizer of the served model, :func:`build_tokenizer` writes a deterministic word-level
  tokenizer with the ``tokenizers`` library (one word = one token; no training, no hub), so
  prompts are exactly ``input_length`` words.
- **Run** (:func:`profile_argv`, :class:`AiperfRunner`): ``--no-server-metrics
  --no-gpu-telemetry --ui none`` (no scraping, no DCGM probes), explicit ``--workers-max`` from
  the client CPUs (aiperf's own default uses the host's CPU count) [5, 8], ``ignore_eos`` in
  every body [7], ``--use-server-token-count`` (token counts from the server's usage, as the
  built-in HTTP runner does), records export. The process runs in its own session; on a timeout
  or cancellation its process group is terminated, then killed.
- **Kubernetes** (:func:`job_manifest`): a Job manifest dict (pinned image, explicit CPU
  requests = limits, pod-security ``restricted``), applied by the cluster backend (issue 7).
- **Results** (:func:`parse_artifacts`): ``profile_export.jsonl`` back into
  :class:`~domain.metrics.RequestRecord` s (the HTTP runner's clock conventions) plus actual
  send times, and ``profile_export_aiperf.json`` as aiperf's own summary for cross-checks.

Every failure is an :class:`AiperfError` whose one-line message names the fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from domain.metrics import MetricsSummary, Percentiles, RequestRecord, summarize
from domain.workload import Request, load_trace
from mcp_servers.bench.http_runner import count_error_classes
from mcp_servers.bench.prompts import VOCAB
from mcp_servers.cluster.backend import BackendError

AIPERF_VERSION = "0.13.0"
"""The aiperf release this adapter is written and tested against (pyproject extra ``aiperf``)."""
ENV_BINARY = "SERVETUNE_AIPERF"
"""Environment variable naming the ``aiperf`` executable (else ``PATH``, then the venv's bin)."""
INSTALL_HINT = (f'pip install -e ".[aiperf]" (or aiperf=={AIPERF_VERSION} in a venv of its own, '
                f"with {ENV_BINARY}=<venv>/bin/aiperf)")
TOKENIZER_REPO = "servetune/words-v1"
"""Repo id of the tokenizer :func:`build_tokenizer` writes, in the HF cache layout."""
MAX_ERROR_CHARS = 300
RECORDS_FILE = "profile_export.jsonl"
SUMMARY_FILE = "profile_export_aiperf.json"
LOG_FILE = Path("logs") / "aiperf.log"
STARTUP_ALLOWANCE_S = 300.0
"""Seconds added to every run's timeout for aiperf's own start and prompt generation.

Measured on the 2-core development machine: 15-20 s from launch to the first request for a
30-request replay (imports, tokenizer, corpus tokenization, ZMQ services); long prompts add
their decode time.
"""

Mode = Literal["replay", "concurrency", "rate"]

# Error classes of failed requests: the values of the built-in HTTP runner's ``ErrorClass``
# (mcp_servers/bench/http_runner.py), so both runners' results count errors alike.
HTTP_STATUS, TIMEOUT, CONNECT, DISCONNECT, STREAM, TRUNCATED = (
    "http_status", "timeout", "connect", "disconnect", "stream", "truncated")


class AiperfError(BackendError):
    """aiperf is missing, failed, or left unusable artifacts; the message names the fix."""


def _brief(text: object, limit: int = MAX_ERROR_CHARS) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------------------------------------------
# Traces -> aiperf mooncake_trace JSONL


def session_id(row: int) -> str:
    """The ``session_id`` of trace row ``row`` (0-based) in a file written by :func:`write_trace`.

    aiperf echoes it as each record's ``metadata.conversation_id``.
    """
    return f"r{row:06d}"


_SESSION_RE = re.compile(r"^r(\d{6,})$")


@dataclass(frozen=True)
class AiperfTrace:
    """A trace file in aiperf's ``mooncake_trace`` format and the schedule it encodes.

    Attributes:
        path: The JSONL file.
        arrival_s: Scheduled send time of each row, seconds after the phase start (already
            scaled and re-based on the window start).
        input_tokens: Planned prompt length of each row, tokens.
        output_tokens: Planned output length of each row, tokens.
        block_size: Tokens per ``hash_ids`` block (512 Mooncake, 16 Bailian); 0 when the rows
            carry no hash ids (Azure, synthetic), then aiperf samples each prompt on its own.
    """

    path: Path
    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    block_size: int

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def span_s(self) -> float:
        """Seconds from the phase start to the last scheduled send."""
        return float(self.arrival_s[-1]) if len(self.arrival_s) else 0.0


def trace_rows(requests: Sequence[Request]) -> tuple[list[dict[str, Any]], int]:
    """The aiperf ``mooncake_trace`` rows of ``requests`` and their common hash block size.

    Args:
        requests: Requests sorted by ``arrival_s`` (seconds; already windowed and scaled).

    aiperf materializes each hash id once, at one size, and fails the run when a trace uses
    an id at two sizes ("hash_id 2 requested at 16 tokens but was already materialized at 8
    tokens", measured with the Bailian fixture, where a partial final block's id comes back
    as a full block in the next turn). So a row whose *partial* final block carries an id that
    stands for another size elsewhere loses that last id: aiperf then fills the tail with fresh
    tokens (its "prefix only" layout), and the shared full blocks stay shared.

    Returns:
        ``(rows, block_size)``: one dict per request with ``session_id``, ``timestamp`` (ms,
        rounded to 1 µs), ``input_length``, ``output_length`` and, when the request has hash ids,
        ``hash_ids`` cut to ``ceil(input_length / block_size)`` (less a conflicting partial
        tail, above); ``block_size`` is 0 when no request has hash ids.

    Raises:
        AiperfError: for no requests, unsorted arrivals, or requests with different block
            sizes (aiperf takes one ``--isl-block-size`` per run).
    """
    if not requests:
        raise AiperfError("the trace window holds no request; pick a window with requests")
    sizes = {r.block_size for r in requests if r.hash_ids and r.block_size > 0}
    if len(sizes) > 1:
        raise AiperfError(f"requests mix hash block sizes {sorted(sizes)}; aiperf takes one "
                          "block size per run: replay one trace format at a time")
    block = sizes.pop() if sizes else 0
    ids_of = [list(r.hash_ids[:-(-r.input_tokens // block)]) if block and r.hash_ids else []
              for r in requests]
    # Tokens each id stands for: a full block, or the partial final block of its row.
    seen: dict[int, set[int]] = {}
    for r, ids in zip(requests, ids_of, strict=True):
        for k, h in enumerate(ids):
            last = k == len(ids) - 1
            seen.setdefault(h, set()).add(min(block, r.input_tokens - k * block) if last else block)
    rows: list[dict[str, Any]] = []
    previous = -math.inf
    for i, (r, ids) in enumerate(zip(requests, ids_of, strict=True)):
        if r.arrival_s < previous:
            raise AiperfError(f"request {i} arrives at {r.arrival_s} s, before request {i - 1} "
                              f"({previous} s); sort the requests by arrival_s")
        previous = r.arrival_s
        row: dict[str, Any] = {"session_id": session_id(i),
                               "timestamp": round(r.arrival_s * 1000.0, 3),
                               "input_length": r.input_tokens,
                               "output_length": r.output_tokens}
        if ids and len(seen[ids[-1]]) > 1 and r.input_tokens - (len(ids) - 1) * block < block:
            ids = ids[:-1]  # a partial tail whose id also stands for other sizes: unhashed
        if ids:
            row["hash_ids"] = ids
        rows.append(row)
    return rows, block


def write_trace(requests: Sequence[Request], path: str | os.PathLike[str]) -> AiperfTrace:
    """Write ``requests`` as an aiperf ``mooncake_trace`` JSONL file (see :func:`trace_rows`).

    The file is written to a temporary name and renamed, so a reader never sees half of it.

    Args:
        requests: Windowed, scaled requests sorted by arrival (seconds from the window start).
        path: Destination file; its folder is created.

    Raises:
        AiperfError: see :func:`trace_rows`; or the file cannot be written.
    """
    rows, block = trace_rows(requests)
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, separators=(",", ":")) + "\n")
        os.replace(tmp, out)
    except OSError as e:
        raise AiperfError(f"cannot write the aiperf trace {out} ({e.strerror or e}); "
                          "give a writable artifacts folder") from e
    return AiperfTrace(
        path=out,
        arrival_s=np.array([r.arrival_s for r in requests], dtype=float),
        input_tokens=np.array([r.input_tokens for r in requests], dtype=np.int64),
        output_tokens=np.array([r.output_tokens for r in requests], dtype=np.int64),
        block_size=block)


def convert_trace(source: str | os.PathLike[str], out: str | os.PathLike[str], *,
                  format: Literal["auto", "mooncake", "azure", "bailian"] = "auto",
                  start_s: float = 0.0, duration_s: float | None = None,
                  time_scale: float = 1.0) -> AiperfTrace:
    """Convert a window of a Mooncake, Azure or Qwen-Bailian trace file for aiperf.

    The window ``[start_s, start_s + duration_s)`` (trace seconds) is cut with
    :meth:`~domain.workload.Trace.window` (arrivals re-based on ``start_s``, idle lead kept),
    then replayed ``time_scale`` times faster (:meth:`~domain.workload.Trace.scaled`): the
    file's timestamps are ``(arrival - start_s) / time_scale`` in ms, exactly the schedule the
    built-in HTTP runner sends.

    Args:
        source: Trace file (``.jsonl`` Mooncake/Bailian, ``.csv`` Azure).
        out: The aiperf JSONL to write.
        format: Loader to use, or ``"auto"`` (:func:`domain.workload.load_trace`).
        start_s: Window start, trace seconds.
        duration_s: Window length, trace seconds; None for the rest of the trace.
        time_scale: Speed-up factor (2.0 = twice the request rate).

    Raises:
        TraceInvalid: malformed trace; ConfigInvalid: empty window or bad scale;
        AiperfError: the file cannot be written.
    """
    trace = load_trace(source, format)
    if duration_s is None:
        duration_s = max(trace.requests[-1].arrival_s - start_s, 0.0) + 1.0
    return write_trace(trace.window(start_s, duration_s).scaled(time_scale).requests, out)


def read_trace(path: str | os.PathLike[str], block_size: int = 0) -> AiperfTrace:
    """Read back a file written by :func:`write_trace` (e.g. to parse a Kubernetes Job's run).

    ``block_size`` is not stored in the file; pass the one :func:`write_trace` reported if
    the result is used for more than parsing.

    Raises:
        AiperfError: the file is missing, not JSONL, or its rows lack the fields or the
            ``r<row>`` session ids :func:`write_trace` writes.
    """
    p = Path(path)
    arrival: list[float] = []
    n_in: list[int] = []
    n_out: list[int] = []
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise AiperfError(f"cannot read the aiperf trace {p} ({e}); convert the trace again "
                          "with write_trace") from e
    for n, line in enumerate(x for x in lines if x.strip()):
        try:
            row = json.loads(line)
            if row["session_id"] != session_id(n):
                raise ValueError(f"session_id {row['session_id']!r}, expected {session_id(n)!r}")
            arrival.append(float(row["timestamp"]) / 1000.0)
            n_in.append(int(row["input_length"]))
            n_out.append(int(row["output_length"]))
        except (ValueError, KeyError, TypeError) as e:
            raise AiperfError(f"{p} row {n + 1} is not a row write_trace writes ({_brief(e)}); "
                              "convert the trace again with write_trace") from e
    if not arrival:
        raise AiperfError(f"{p} holds no rows; convert the trace again with write_trace")
    return AiperfTrace(path=p, arrival_s=np.array(arrival), input_tokens=np.array(n_in),
                       output_tokens=np.array(n_out), block_size=block_size)


# ---------------------------------------------------------------------------------------------
# Offline tokenizer in the Hugging Face cache layout

# The built-in tokenizer's vocabulary, one word one token: the HTTP runner's prompt words
# (:data:`~mcp_servers.bench.prompts.VOCAB`), more common English words, then the
# most frequent words of aiperf's prompt corpus (the complete works of Shakespeare,
# ``aiperf/dataset/generator/assets/shakespeare.txt``: these 316 words, lower-cased and
# stripped of punctuation as the normalizer does, are 63 % of its 3.0 M words; the whole list
# covers 65 %). Duplicates are dropped in order, so ids never change for a given list.
_WORDS = tuple(dict.fromkeys((*VOCAB, *"""
it he she we you me my your our him them what when
where why how if then so no yes do does did can could should may might must shall say said see
saw make made take took give gave get got go went come came know knew think thought look want
find tell ask seem feel try leave call good new first last long great little own other old big
high different small large next early young important few public bad same able self still ever
never every than such those these some any many much most both each again against before after
between through during without under over into out up down off away sun moon river mountain sea
garden flower stone fire cloud rain snow wind summer winter spring autumn island forest bridge
castle village harbor valley desert ocean planet engine signal memory network packet kernel thread
queue batch tensor layer weight gradient matrix vector scalar buffer socket router switch cluster
the and to of a you my in that is not with me it for his be this your he but have as thou him so
will what her thy all by no do shall if are we thee on our lord now king sir good from o they
she at or well come which more would was then enter their how am love here when let them hath
than one there like man an upon go may make did know say us yet were should must scene had why
see such tis out some give these first who where too can take mine most speak up duke never tell
time much think exeunt doth heart nor queen exit th art before great lady men death hear life
hand away made fair look father sweet true very thus again own cannot eyes god master ay day
pray two richard mistress being old been prince any other night son done poor both leave whose
name till fear though blood could honour down into nothing world noble heaven comes house ever
therefore even still better second part henry against way hast those many stand grace nay myself
dead another call falstaff gentleman brother bear find friend might live head peace daughter off
little lords madam put die young wife keep act caesar none antony word within place friends john
every thine best set eye long hold york himself gods brutus gone since bring face dear fool
aside unto soul whom hamlet full gloucester once dost words show has else indeed servant stay
thats after page tongue about room france faith boy said warwick same please thought theres
forth makes ere without three gentle answer mind hope heard rest hence right rome welcome marry
farewell nature came matter clown woman things power cause sword iago thing messenger back bid
mother whats home shame use end thousand lie does truth
""".split())))
_UNK = "<unk>"
_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", _UNK)
_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% endif %}")
# Files of a tokenizer directory that are copied into the cache (never model weights).
_TOKENIZER_FILES = re.compile(
    r"^(tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|added_tokens\.json|"
    r"vocab\.(json|txt)|merges\.txt|tokenizer\.model|.*\.tiktoken|config\.json|"
    r"generation_config\.json|chat_template\.(jinja|json))$")


def build_tokenizer(out_dir: str | os.PathLike[str]) -> Path:
    """Write the built-in word-level tokenizer (Hugging Face format) to ``out_dir``.

    One whitespace-separated word is one token: a normalizer lower-cases and drops punctuation,
    the pre-tokenizer splits on whitespace only, each of the :data:`_WORDS` has its own id and
    any other word is ``<unk>``; decoding joins tokens with single spaces. aiperf builds every
    prompt (and every ``hash_ids`` block) by drawing a window of token ids from its corpus
    tokenized with this tokenizer and decoding it, so

    - a prompt of N tokens is exactly N whitespace words (vocabulary words, ``<unk>`` for the
      35 % of corpus words outside it, and aiperf's ``<|endoftext|>`` block separators):
      servers that count words (``tests/fixtures/openai_stub.py``) see the trace's input
      lengths exactly, and real BPE servers about N tokens (common words are single tokens; the
      built-in HTTP runner's prompts, ``mcp_servers/bench/prompts.py``, make the same trade);
    - blocks with the same hash id are the same words, so shared prefixes are real prefixes,
      and two different blocks share a first word with probability about 0.12 (measured on the
      corpus), so prefixes are not shared by accident.

    (``--prompt-corpus random``, uniform vocabulary ids, is refused by aiperf 0.13.0 for trace
    loaders, and for synthetic runs it draws consecutive vocabulary windows, so prompts with the
    same random offset are identical; the default text corpus is used for both.)

    Not trained, so the files are the same on every machine (needs only the ``tokenizers``
    library, a dependency of chromadb). Files: ``tokenizer.json``, ``tokenizer_config.json``
    (``PreTrainedTokenizerFast``, no BOS/EOS added, a ChatML chat template),
    ``special_tokens_map.json``. For lengths exact in the served model's tokens, give
    :func:`prepare_tokenizer` that model's tokenizer instead.

    Raises:
        AiperfError: ``tokenizers`` is not installed, or ``out_dir`` is not writable.
    """
    try:
        from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers
    except ImportError as e:  # pragma: no cover - chromadb depends on tokenizers
        raise AiperfError("the `tokenizers` library is missing; install servetune's "
                          "dependencies (pip install -e .)") from e
    out = Path(out_dir)
    vocab = {t: i for i, t in enumerate((*_SPECIALS, *_WORDS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=_UNK))
    tok.normalizer = normalizers.Sequence([normalizers.Lowercase(),
                                           normalizers.Replace(Regex(r"[^\w\s]"), "")])
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in _SPECIALS])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 10_000_000,
              "bos_token": _SPECIALS[0], "eos_token": _SPECIALS[0], "pad_token": _SPECIALS[0],
              "unk_token": _UNK, "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "chat_template": _CHAT_TEMPLATE}
    special = {"bos_token": _SPECIALS[0], "eos_token": _SPECIALS[0], "pad_token": _SPECIALS[0],
               "unk_token": _UNK}
    try:
        out.mkdir(parents=True, exist_ok=True)
        tok.save(str(out / "tokenizer.json"), pretty=False)
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
        (out / "special_tokens_map.json").write_text(json.dumps(special, indent=1,
                                                                sort_keys=True))
    except OSError as e:
        raise AiperfError(f"cannot write the tokenizer to {out} ({e.strerror or e}); give a "
                          "writable cache folder") from e
    return out


@dataclass(frozen=True)
class TokenizerRef:
    """A tokenizer in the Hugging Face cache layout, as aiperf loads it offline.

    Attributes:
        repo_id: What to pass as ``--tokenizer`` (``org/name``).
        revision: The snapshot's 40-hex "commit" (sha1 of the files), also in ``refs/main``.
        cache_dir: The ``HF_HUB_CACHE`` folder holding ``models--org--name/``.
    """

    repo_id: str
    revision: str
    cache_dir: Path

    @property
    def snapshot_dir(self) -> Path:
        """``<cache>/models--org--name/snapshots/<revision>``."""
        return (self.cache_dir / ("models--" + self.repo_id.replace("/", "--")) / "snapshots"
                / self.revision)

    def env(self) -> dict[str, str]:
        """Environment for aiperf: this cache, and no hub access at all (loadgen [3])."""
        return {"HF_HUB_CACHE": str(self.cache_dir), "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1"}


def _repo_id(name: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "tokenizer"
    return f"local/{clean[:80]}"


def prepare_tokenizer(cache_dir: str | os.PathLike[str],
                      source: str | os.PathLike[str] | None = None,
                      repo_id: str | None = None) -> TokenizerRef:
    """Put a tokenizer into the Hugging Face cache layout under ``cache_dir`` (idempotent).

    Layout (what ``huggingface_hub.snapshot_download(local_files_only=True)`` resolves)::

        <cache_dir>/models--<org>--<name>/refs/main          -> "<revision>"
        <cache_dir>/models--<org>--<name>/snapshots/<revision>/tokenizer.json ...

    With ``source`` (a tokenizer directory, e.g. the served model's checkpoint folder), only its
    tokenizer files are copied (``tokenizer.json``, ``tokenizer_config.json``, vocab/merges,
    ``tokenizer.model``, ``config.json``, ...; never weights). Without it, :func:`build_tokenizer`
    writes the deterministic built-in one as :data:`TOKENIZER_REPO`. The revision is the sha1 of
    the files' names and bytes, so the same files land in the same snapshot and a changed
    tokenizer in a new one. Nothing touches the network.

    Args:
        cache_dir: The ``HF_HUB_CACHE`` folder to use for aiperf (created).
        source: Tokenizer directory to copy, or None for the built-in tokenizer.
        repo_id: ``org/name`` to register it under; default :data:`TOKENIZER_REPO`, or
            ``local/<folder name>`` for a ``source``.

    Returns:
        The reference to pass as ``--tokenizer`` with :meth:`TokenizerRef.env`.

    Raises:
        AiperfError: ``source`` has no ``tokenizer.json``/``tokenizer_config.json``/
            ``tokenizer.model``, a malformed ``repo_id``, or the cache is not writable.
    """
    cache = Path(cache_dir).resolve()
    if repo_id is not None and not re.fullmatch(r"[A-Za-z0-9._-]+/[A-Za-z0-9._-]+", repo_id):
        raise AiperfError(f"tokenizer repo id {repo_id!r} must look like 'org/name' (letters, "
                          "digits, '.', '_', '-')")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=cache))
        try:
            if source is None:
                build_tokenizer(staging)
                repo = repo_id or TOKENIZER_REPO
            else:
                src = Path(source)
                files = sorted(p for p in src.iterdir()
                               if p.is_file() and _TOKENIZER_FILES.match(p.name)) \
                    if src.is_dir() else []
                names = {p.name for p in files}
                if not names & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"}:
                    raise AiperfError(f"{src} holds no tokenizer (tokenizer.json, "
                                      "tokenizer_config.json or tokenizer.model); give the "
                                      "served model's tokenizer folder")
                for p in files:
                    shutil.copyfile(p, staging / p.name)
                repo = repo_id or _repo_id(src.resolve().name)
            digest = hashlib.sha1(usedforsecurity=False)
            for p in sorted(staging.iterdir()):
                digest.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
            ref = TokenizerRef(repo_id=repo, revision=digest.hexdigest(), cache_dir=cache)
            snap = ref.snapshot_dir
            if not snap.is_dir():
                snap.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.replace(staging, snap)
                except OSError:
                    if not snap.is_dir():  # not a concurrent writer that won the race
                        raise
            refs = snap.parent.parent / "refs"
            refs.mkdir(exist_ok=True)
            (refs / "main.tmp").write_text(ref.revision)
            os.replace(refs / "main.tmp", refs / "main")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:
        raise AiperfError(f"cannot prepare the tokenizer cache in {cache} ({e.strerror or e}); "
                          "give a writable cache folder") from e
    return ref


# ---------------------------------------------------------------------------------------------
# The aiperf command line


def default_workers(client_cpus: int) -> int:
    """Worker processes of aiperf for ``client_cpus`` dedicated CPUs: ``max(1, 0.75 * cpus - 1)``.

    aiperf's own formula (``--workers-max`` help, 0.13.0), applied to the CPUs the client is
    given rather than to the host's count, which in a container is the node's. On 2 cores that
    is one worker, which the loadgen reference found best (more workers made TTFT worse) [5].
    """
    return max(1, int(client_cpus * 0.75) - 1)


def profile_argv(*, urls: Sequence[str], model: str, tokenizer: str, artifact_dir: str,
                 client_cpus: int, mode: Mode, input_file: str | None = None,
                 block_size: int = 0, concurrency: int | None = None,
                 request_rate: float | None = None,
                 arrival: Literal["poisson", "constant", "gamma"] = "poisson",
                 isl: int | None = None, osl: int | None = None,
                 duration_s: float | None = None, request_count: int | None = None,
                 dataset_entries: int | None = None,
                 endpoint_type: Literal["completions", "chat"] = "completions",
                 request_timeout_s: float = 600.0, seed: int = 0,
                 slo_ttft_ms: float | None = None, workers: int | None = None,
                 prompt_corpus: Literal["sonnet", "coding", "random"] | None = None,
                 aiperf: str = "aiperf") -> list[str]:
    """The ``aiperf profile`` command line for one run (aiperf 0.13.0 flags).

    Modes:

    - ``replay``: ``input_file`` (from :func:`write_trace`) as ``mooncake_trace`` with
      ``--fixed-schedule --fixed-schedule-start-offset 0`` (timestamps = ms after the phase
      start) and ``--isl-block-size block_size`` when the rows carry hash ids.
    - ``concurrency``: ``concurrency`` clients, synthetic ``isl``/``osl`` prompts (stddev 0),
      for ``duration_s`` (then in-flight requests drain for up to ``request_timeout_s``) or
      ``request_count`` requests.
    - ``rate``: open loop at ``request_rate`` req/s with ``arrival`` gaps, same sizing.

    Synthetic prompts come from a pool of ``dataset_entries`` (default: ``request_count``, else
    ``max(1000, 4 * concurrency)``) that aiperf reuses in turn; a server with a prefix cache can
    hit on a reused prompt, so size it above the requests a run sends.

    Always: streaming, ``ignore_eos`` in the body, server-reported token counts, per-request
    records export, no server-metrics scraping, no GPU telemetry, no UI, no plots, explicit
    workers.

    Args:
        urls: Server roots (``http://host:port``), round-robin.
        model: Model name sent in each body.
        tokenizer: ``--tokenizer`` value (a :class:`TokenizerRef` repo id).
        artifact_dir: Where aiperf writes its artifacts.
        client_cpus: CPUs dedicated to the client; sets ``--workers-max`` (see
            :func:`default_workers`) unless ``workers`` is given.
        mode: ``replay``, ``concurrency`` or ``rate``.
        input_file: Trace file (replay).
        block_size: Tokens per hash block in ``input_file``; 0 for none.
        concurrency: Clients in flight (concurrency mode).
        request_rate: Requests per second (rate mode).
        arrival: Inter-arrival distribution (rate mode).
        isl: Input tokens per synthetic request.
        osl: Output tokens per synthetic request.
        duration_s: Seconds of new load (synthetic modes).
        request_count: Requests to send (synthetic modes), instead of or with a duration.
        dataset_entries: Distinct synthetic prompts.
        endpoint_type: ``completions`` (``/v1/completions``) or ``chat``.
        request_timeout_s: A request not finished this long after its send fails.
        seed: ``--random-seed`` (prompts and arrivals are reproducible).
        slo_ttft_ms: Adds aiperf's ``--goodput time_to_first_token:<ms>``.
        workers: Override of ``--workers-max``.
        prompt_corpus: ``--prompt-corpus``; None for aiperf's default text corpus (see
            :func:`build_tokenizer` on why not ``random``).
        aiperf: The executable.

    Raises:
        AiperfError: a mode without its parameters, or parameters out of range.
    """
    problems = []
    if not urls:
        problems.append("at least one server URL")
    if client_cpus < 1:
        problems.append(f"client_cpus >= 1 (got {client_cpus})")
    if mode == "replay":
        if not input_file:
            problems.append("an input_file for a replay")
        if concurrency is not None or request_rate is not None:
            problems.append("no concurrency or request_rate with a replay (the trace times it)")
    elif mode in ("concurrency", "rate"):
        if isl is None or osl is None or isl < 1 or osl < 1:
            problems.append(f"isl and osl >= 1 for a synthetic run (got {isl}, {osl})")
        if duration_s is None and request_count is None:
            problems.append("duration_s or request_count for a synthetic run")
        if duration_s is not None and not duration_s > 0:
            problems.append(f"duration_s > 0 (got {duration_s})")
        if request_count is not None and request_count < 1:
            problems.append(f"request_count >= 1 (got {request_count})")
        if mode == "concurrency" and (concurrency is None or concurrency < 1):
            problems.append(f"concurrency >= 1 in concurrency mode (got {concurrency})")
        if mode == "rate" and (request_rate is None or not request_rate > 0
                               or not math.isfinite(request_rate)):
            problems.append(f"a finite request_rate > 0 in rate mode (got {request_rate})")
    else:
        problems.append(f"mode replay, concurrency or rate (got {mode!r})")
    if problems:
        raise AiperfError("aiperf run needs " + "; ".join(problems))
    argv = [aiperf, "profile", "--model", model, "--tokenizer", tokenizer]
    for u in urls:
        argv += ["--url", u.rstrip("/")]
    argv += ["--endpoint-type", endpoint_type, "--streaming",
             "--extra-inputs", json.dumps({"ignore_eos": True}),
             "--use-server-token-count",
             "--request-timeout-seconds", f"{request_timeout_s:g}",
             "--artifact-dir", artifact_dir, "--export-level", "records",
             "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry", "--no-auto-plot",
             "--random-seed", str(seed),
             "--workers-max", str(workers or default_workers(client_cpus))]
    if mode == "replay":
        assert input_file is not None
        argv += ["--input-file", input_file, "--custom-dataset-type", "mooncake_trace",
                 "--fixed-schedule", "--fixed-schedule-start-offset", "0"]
        if block_size > 0:
            argv += ["--isl-block-size", str(block_size)]
    else:
        assert isl is not None and osl is not None
        entries = dataset_entries or request_count or max(1000, 4 * (concurrency or 1))
        argv += ["--isl", str(isl), "--isl-stddev", "0", "--osl", str(osl),
                 "--osl-stddev", "0", "--num-dataset-entries", str(entries)]
        if mode == "concurrency":
            argv += ["--concurrency", str(concurrency)]
        else:
            argv += ["--request-rate", f"{request_rate:g}", "--arrival-pattern", arrival]
        if duration_s is not None:
            argv += ["--benchmark-duration", f"{duration_s:g}",
                     "--benchmark-grace-period", f"{request_timeout_s:g}"]
        if request_count is not None:
            argv += ["--request-count", str(request_count)]
    if prompt_corpus is not None:
        argv += ["--prompt-corpus", prompt_corpus]
    if slo_ttft_ms is not None:
        argv += ["--goodput", f"time_to_first_token:{slo_ttft_ms:g}"]
    return argv


# ---------------------------------------------------------------------------------------------
# Kubernetes Job beside the engine


def job_manifest(name: str, *, namespace: str, image: str, aiperf_args: Sequence[str],
                 client_cpus: int, memory_gib: float = 4.0, data_claim: str,
                 data_mount: str = "/data", results_mount: str = "/results",
                 hf_cache_subpath: str = "hf-cache",
                 engine_labels: Mapping[str, str] | None = None,
                 topology_key: str = "kubernetes.io/hostname",
                 labels: Mapping[str, str] | None = None,
                 active_deadline_s: int = 7200, ttl_after_finished_s: int = 3600
                 ) -> dict[str, Any]:
    """A Kubernetes ``batch/v1`` Job that runs ``aiperf profile`` beside the engine (rendered only).

    The pod gets ``client_cpus`` dedicated CPUs (requests = limits, integer, so the Guaranteed
    QoS class and, under the static CPU manager policy, exclusive cores: the client's CPU is
    part of the experiment, loadgen [8]) and ``--workers-max`` should match them
    (:func:`profile_argv` with the same ``client_cpus``). One PersistentVolumeClaim
    ``data_claim`` carries the converted trace, the tokenizer cache (``<data>/<hf_cache_subpath>``
    in the HF layout, :func:`prepare_tokenizer`) and, under ``<results_mount>``, the artifacts
    that :func:`parse_artifacts` reads back. ``/tmp`` is a writable emptyDir (aiperf's ZMQ IPC
    sockets). The pod satisfies pod-security ``restricted`` (non-root, no privilege escalation,
    all capabilities dropped, RuntimeDefault seccomp, read-only root filesystem). With
    ``engine_labels`` it prefers the engine pods' ``topology_key`` domain (default: the same
    node, i.e. beside the engine).

    Args:
        name: Job name (DNS-1123 label, at most 63 characters).
        namespace: The sandbox namespace.
        image: Image with ``aiperf==0.13.0`` installed (``aiperf`` on PATH).
        aiperf_args: The command line (:func:`profile_argv` with in-pod paths), starting with
            the executable.
        client_cpus: Dedicated CPUs (>= 1).
        memory_gib: Memory request = limit, GiB.
        data_claim: PersistentVolumeClaim holding trace, tokenizer cache and results.
        data_mount: Where the claim is mounted.
        results_mount: Mount path of the claim's ``results`` sub-path (the artifact dir).
        hf_cache_subpath: Sub-path of the claim with the HF cache (``HF_HUB_CACHE``).
        engine_labels: Labels of the engine pods to run beside; None for no affinity.
        topology_key: Node label defining "beside" (``kubernetes.io/hostname``: same node;
            ``topology.kubernetes.io/zone``: same zone).
        labels: Extra labels (study, trial) on the Job and its pod.
        active_deadline_s: Kubernetes stops the Job after this many seconds.
        ttl_after_finished_s: The finished Job is garbage-collected after this.

    Raises:
        AiperfError: bad name, CPUs or memory, or no command.
    """
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name):
        raise AiperfError(f"job name {name!r} must be a DNS-1123 label (lowercase letters, "
                          "digits, '-', at most 63 characters)")
    if client_cpus < 1 or not memory_gib > 0:
        raise AiperfError(f"the aiperf Job needs client_cpus >= 1 and memory_gib > 0 (got "
                          f"{client_cpus}, {memory_gib})")
    if not aiperf_args:
        raise AiperfError("the aiperf Job needs its command line (profile_argv)")
    all_labels = {"app.kubernetes.io/managed-by": "servetune",
                  "app.kubernetes.io/name": "aiperf",
                  "app.kubernetes.io/component": "loadgen",
                  "app.kubernetes.io/version": AIPERF_VERSION, **(labels or {})}
    resources = {"cpu": str(client_cpus), "memory": f"{int(memory_gib * 1024)}Mi"}
    hf_cache = f"{data_mount.rstrip('/')}/{hf_cache_subpath}"
    env = [{"name": k, "value": v} for k, v in
           TokenizerRef("x/x", "0" * 40, Path(hf_cache)).env().items()]
    env += [{"name": "HOME", "value": "/tmp"}, {"name": "MPLCONFIGDIR", "value": "/tmp"}]
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
                            "fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{
            "name": "aiperf", "image": image, "command": [aiperf_args[0]],
            "args": list(aiperf_args[1:]), "env": env, "workingDir": "/tmp",
            "resources": {"requests": resources, "limits": dict(resources)},
            "securityContext": {"allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]},
                                "readOnlyRootFilesystem": True, "runAsNonRoot": True},
            "volumeMounts": [{"name": "data", "mountPath": data_mount},
                             {"name": "data", "mountPath": results_mount,
                              "subPath": "results"},
                             {"name": "tmp", "mountPath": "/tmp"}],
        }],
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": data_claim}},
                    {"name": "tmp", "emptyDir": {"sizeLimit": "2Gi"}}],
    }
    if engine_labels:
        pod_spec["affinity"] = {"podAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{
                "weight": 100, "podAffinityTerm": {
                    "labelSelector": {"matchLabels": dict(engine_labels)},
                    "topologyKey": topology_key}}]}}
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": all_labels},
        "spec": {"backoffLimit": 0, "activeDeadlineSeconds": active_deadline_s,
                 "ttlSecondsAfterFinished": ttl_after_finished_s,
                 "template": {"metadata": {"labels": all_labels}, "spec": pod_spec}},
    }


# ---------------------------------------------------------------------------------------------
# Artifacts -> records


@dataclass
class AiperfRun:
    """One aiperf run read back: records in send order and how the client kept its schedule.

    Has the attributes of :class:`mcp_servers.bench.http_runner.HttpRun` (``records``,
    ``sent_s``, ``wall_s``, ``stopped_early``, ``error_class``, ``error_counts()``,
    ``cached_tokens``, ``client``, ``t0_mono``), so the bench service stores, classifies and
    summarizes it the same way.

    Attributes:
        records: One per request (replay: trace row order; else by credit issue time). Times
            are seconds on the run clock (0 = aiperf's profiling phase start): ``arrival_s`` =
            scheduled send (replay: the trace time; synthetic: when aiperf's timing service
            issued the request), ``first_token_s`` = send + aiperf's TTFT, ``itl_s`` = aiperf's
            ``inter_chunk_latency`` gaps, ``finish_s`` = last text chunk.
        sent_s: Actual send time of each record (aiperf's ``request_start_ns``), s.
        wall_s: Seconds from the phase start to the last response.
        stopped_early: Why the run is incomplete (cancelled or partial export), or None.
        aiperf_metrics: aiperf's own summary (``profile_export_aiperf.json``): metric tag ->
            ``{"unit", "avg", "p50", "p90", "p99", ...}``; empty when the file is absent.
        clock: How the run clock's zero was found (``phase start`` from aiperf's log, or
            ``least-late credit`` when the log lacks it; the latter hides a constant lateness
            of the timing service, typically < 1 ms).
        artifact_dir: Where the artifacts are.
        argv: The command that ran (empty when only parsed).
        returncode: aiperf's exit status (None when only parsed).
        notes: Things worth reporting (e.g. an exit status 1 with records).
        error_class: Per record, the class of its failure (:data:`HTTP_STATUS`,
            :data:`TIMEOUT`, :data:`CONNECT`, :data:`DISCONNECT`, :data:`STREAM`,
            :data:`TRUNCATED`), None when it succeeded.
        cached_tokens: Per record, prompt tokens the server reported as served from its prefix
            cache (aiperf's ``usage_prompt_cache_read_tokens``); -1 where it reported none.
        client: ``"aiperf"``.
        t0_mono: NaN: aiperf's clock is the wall clock (``time_ns``), not comparable with a
            local process's monotonic timestamps.
    """

    records: list[RequestRecord]
    sent_s: np.ndarray
    wall_s: float
    stopped_early: str | None = None
    aiperf_metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    clock: str = "phase start"
    artifact_dir: Path | None = None
    argv: list[str] = field(default_factory=list)
    returncode: int | None = None
    notes: list[str] = field(default_factory=list)
    error_class: list[str | None] = field(default_factory=list)
    cached_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    client: str = "aiperf"
    t0_mono: float = math.nan

    def error_counts(self) -> dict[str, int]:
        """Failed requests per error class (only classes that occurred)."""
        return count_error_classes(self.error_class)

    @property
    def dispatch_lag_ms(self) -> Percentiles:
        """Actual minus scheduled send time per request, ms."""
        arrivals = np.array([r.arrival_s for r in self.records], dtype=float)
        return Percentiles.of(self.sent_s - arrivals)

    @property
    def client_overhead_ms(self) -> Percentiles:
        """The ``credit_to_start_latency`` aiperf reports (timing service -> worker send), ms."""
        m = self.aiperf_metrics.get("credit_to_start_latency") or {}
        return Percentiles(p50=m.get("p50"), p90=m.get("p90"), p99=m.get("p99"),
                           mean=m.get("avg"))

    def summary(self, gpus: int, slo_ttft_ms: float | None = None,
                slo_tpot_ms: float | None = None) -> MetricsSummary:
        """The project's metrics summary of the records (:func:`domain.metrics.summarize`)."""
        return summarize(self.records, gpus, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)


_UNIT_S = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0}
_PHASE_START = re.compile(r"PhaseRecordsStats\(phase=CreditPhase\.PROFILING\b.*?[(, ]start_ns="
                          r"(\d+)")


def _seconds(metric: Any, what: str, where: str) -> float | list[float] | None:
    """A per-record metric ``{"value": x, "unit": u}`` in seconds (None when absent)."""
    if metric is None:
        return None
    try:
        scale = _UNIT_S[metric["unit"]]
        value = metric["value"]
        if isinstance(value, list):
            return [float(v) * scale for v in value]
        return float(value) * scale
    except (KeyError, TypeError, ValueError) as e:
        raise AiperfError(f"{where}: metric {what} is not {{value, unit}} in a time unit "
                          f"({_brief(metric, 120)}); is this aiperf {AIPERF_VERSION}?") from e


def _count(metric: Any) -> int | None:
    if not isinstance(metric, dict) or not isinstance(metric.get("value"), int | float):
        return None
    return int(metric["value"])


def _error_text(err: Any) -> str:
    if not isinstance(err, dict):
        return _brief(f"aiperf error: {err}")
    code, kind, msg = err.get("code"), err.get("type") or "error", err.get("message") or ""
    head = f"HTTP {code} {kind}" if code else str(kind)
    return _brief(f"{head}: {msg}" if msg else head)


def _error_class(err: Any) -> str:
    """The error class of an aiperf ``error`` object (aiperf 0.13.0 ``ErrorDetails``).

    HTTP errors carry the status as ``code`` and the reason as ``type``; exceptions carry the
    class name as ``type`` (aiohttp's ``ClientConnectorError``, ``ServerDisconnectedError``,
    ``ClientPayloadError``, ``TimeoutError``; aiperf's ``RequestCancellationError`` with code 499
    when its timeout or the run's end cancels a request; ``SSEResponseError``).
    """
    kind = str(err.get("type") or "") if isinstance(err, dict) else ""
    code = err.get("code") if isinstance(err, dict) else None
    if kind == "RequestCancellationError" or "Timeout" in kind:
        return TIMEOUT
    if "Connector" in kind or "ConnectionRefused" in kind:
        return CONNECT
    if "Disconnect" in kind or kind in ("ClientPayloadError", "ClientOSError",
                                        "ConnectionResetError"):
        return DISCONNECT
    if isinstance(code, int) and not isinstance(code, bool) and code != 499:
        return HTTP_STATUS
    return STREAM


def _phase_start_ns(artifact_dir: Path) -> int | None:
    try:
        text = (artifact_dir / LOG_FILE).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    m = _PHASE_START.search(text)
    return int(m.group(1)) if m else None


def read_summary(artifact_dir: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The summary aiperf writes (``profile_export_aiperf.json``): metric tag -> statistics.

    Each value keeps aiperf's keys (``unit``, ``avg``, ``min``, ``max``, ``std``, ``p1`` ...
    ``p99``, ``count``); top-level scalars (``aiperf_version``, ``was_cancelled``,
    ``is_complete``) come under the key ``"run"``. Empty when the file does not exist.

    Raises:
        AiperfError: the file exists but is not a JSON object.
    """
    path = Path(artifact_dir) / SUMMARY_FILE
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
    except (OSError, ValueError) as e:
        raise AiperfError(f"aiperf's summary {path} is unreadable ({_brief(e, 120)}); rerun "
                          "the benchmark") from e
    out: dict[str, dict[str, Any]] = {k: v for k, v in data.items()
                                      if isinstance(v, dict) and "unit" in v}
    out["run"] = {k: v for k, v in data.items() if isinstance(v, str | int | float | bool)}
    return out


def parse_artifacts(artifact_dir: str | os.PathLike[str],
                    trace: AiperfTrace | None = None, *, isl: int | None = None,
                    osl: int | None = None) -> AiperfRun:
    """Read an aiperf artifact folder back into per-request records.

    Records (``profile_export.jsonl``, one JSON object per request: ``metadata`` with
    ``conversation_id``, ``credit_issued_ns``, ``request_start_ns``, ``benchmark_phase``,
    ``was_cancelled``; ``metrics`` with ``time_to_first_token``, ``inter_chunk_latency`` (list),
    ``input_sequence_length``, ``output_sequence_length``, each ``{"value", "unit"}``; an
    ``error`` object ``{code, type, message}`` on failure) become
    :class:`~domain.metrics.RequestRecord` s as the built-in HTTP runner makes them:

    - Clock: 0 = the profiling phase start (``start_ns`` of aiperf's ``PhaseRecordsStats`` log
      line; for a replay aiperf schedules row ``i`` at phase start + ``timestamp_i``). Without
      it: the least-late ``credit_issued_ns - scheduled`` (aiperf's own anchoring for its
      ``replay_sched_lag`` metrics).
    - ``arrival_s``: replay: the row's scheduled time (rows are matched by ``conversation_id``
      = ``r<row>``); synthetic: the credit issue time. ``sent_s``: ``request_start_ns``.
    - TTFT and ITL: aiperf's, measured from the send (so TTFT on our records includes the
      dispatch lag, as for the HTTP runner); ``finish_s`` = first token + sum of gaps.
    - Tokens: ``output_sequence_length`` / ``input_sequence_length`` (server usage under
      ``--use-server-token-count``); the plan's lengths when the server sent none.
    - Errors, classed as the HTTP runner classes them (:func:`_error_class`): aiperf's error
      (``HTTP 503 Service Unavailable: ...``), a cancelled request (timeout), a stream without
      its final usage chunk while other streams had one (disconnect: aiperf 0.13.0 does not
      flag a connection dropped mid-stream; measured against ``tests/fixtures/openai_stub.py
      --disconnect-every``), and a response without any token or with fewer output tokens than
      asked (truncated). A trace row without a record is an error record ("no record", class
      stream), with its send time set to its schedule.
    - Cached prompt tokens: ``usage_prompt_cache_read_tokens`` (SGLang with
      ``--enable-cache-report``), -1 when absent.

    Args:
        artifact_dir: aiperf's ``--artifact-dir``.
        trace: The replayed trace (:func:`write_trace` / :func:`read_trace`); None for a
            synthetic run.
        isl: Planned input tokens of a synthetic run (for failed requests' records).
        osl: Output tokens each synthetic request asked for (fewer = truncated); None: unchecked.

    Raises:
        AiperfError: no records file, a malformed line, a record of another trace, or a
            record without its timestamps.
    """
    adir = Path(artifact_dir)
    path = adir / RECORDS_FILE
    if not path.is_file():
        listed = sorted(p.name for p in adir.iterdir())[:8] if adir.is_dir() else []
        raise AiperfError(f"aiperf wrote no per-request records ({RECORDS_FILE}) in {adir} "
                          f"(holds: {', '.join(listed) or 'nothing'}); see {adir / LOG_FILE} "
                          "and rerun the benchmark")
    raw: list[tuple[int, dict[str, Any]]] = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    if not isinstance(rec, dict) or not isinstance(rec.get("metadata"), dict):
                        raise ValueError("no 'metadata' object")
                except ValueError as e:
                    raise AiperfError(f"{path}:{n} is not an aiperf record ({_brief(e, 120)}); "
                                      "the export is damaged: rerun the benchmark") from e
                if rec["metadata"].get("benchmark_phase", "profiling") == "profiling":
                    raw.append((n, rec))
    except (OSError, UnicodeDecodeError) as e:
        raise AiperfError(f"cannot read {path} ({_brief(e, 120)}); rerun the benchmark") from e

    def ns(n: int, meta: dict[str, Any], key: str) -> int:
        v = meta.get(key)
        if not isinstance(v, int):
            raise AiperfError(f"{path}:{n} has no integer metadata.{key}; is this aiperf "
                              f"{AIPERF_VERSION} output?")
        return v

    rows: list[int] = []
    if trace is not None:
        for n, rec in raw:
            cid = str(rec["metadata"].get("conversation_id"))
            m = _SESSION_RE.match(cid)
            if m is None or int(m.group(1)) >= len(trace):
                raise AiperfError(f"{path}:{n} is for conversation {cid!r}, not a row of "
                                  f"{trace.path.name} ({len(trace)} rows); parse with the trace "
                                  "that was replayed")
            rows.append(int(m.group(1)))
        if len(set(rows)) != len(rows):
            raise AiperfError(f"{path} holds two records for one trace row; parse each run's "
                              "own artifact folder")
    credit = [ns(n, rec["metadata"], "credit_issued_ns") for n, rec in raw]
    start = [ns(n, rec["metadata"], "request_start_ns") for n, rec in raw]
    sched_ns = [int(round(trace.arrival_s[i] * 1e9)) for i in rows] if trace is not None \
        else [0] * len(raw)
    logged = _phase_start_ns(adir)
    least = min((c - s for c, s in zip(credit, sched_ns, strict=True)), default=0)
    if logged is not None and logged <= least + 1_000_000_000:  # this run's phase start
        zero, clock = logged, "phase start"
    else:
        zero, clock = least, "least-late credit"
    any_usage = any("output_sequence_length" in (rec.get("metrics") or {}) for _, rec in raw)

    built: list[tuple[float, float, int | None, RequestRecord, str | None, int]] = []
    last_s = 0.0
    for k, (n, rec) in enumerate(raw):
        meta, metrics = rec["metadata"], rec.get("metrics") or {}
        where = f"{path}:{n}"
        sent = (start[k] - zero) / 1e9
        plan_out: int | None
        if trace is not None:
            row = rows[k]
            arrival = float(trace.arrival_s[row])
            plan_in, plan_out = int(trace.input_tokens[row]), int(trace.output_tokens[row])
        else:
            row, arrival = None, (credit[k] - zero) / 1e9
            plan_in, plan_out = isl or 1, osl
        n_in = _count(metrics.get("input_sequence_length")) or plan_in
        ttft = _seconds(metrics.get("time_to_first_token"), "time_to_first_token", where)
        gaps = _seconds(metrics.get("inter_chunk_latency"), "inter_chunk_latency", where)
        itl = np.asarray(gaps if isinstance(gaps, list) else [], dtype=float)
        n_out = _count(metrics.get("output_sequence_length"))
        chunks = 0 if ttft is None else 1 + len(itl)
        error: str | None = None
        eclass: str | None = None
        if rec.get("error") is not None:
            error, eclass = _error_text(rec["error"]), _error_class(rec["error"])
        elif meta.get("was_cancelled"):
            error = "cancelled by aiperf before the response finished (duration/grace ended)"
            eclass = TIMEOUT
        elif not isinstance(ttft, float):
            error, eclass = "response without any token", TRUNCATED
        elif n_out is None and any_usage:
            error = (f"stream ended without its final usage chunk after {chunks} text chunks "
                     "(connection dropped mid-stream?)")
            eclass = DISCONNECT
        elif n_out is not None and plan_out is not None and n_out < plan_out:
            error = f"truncated output: {n_out} of the {plan_out} tokens asked"
            eclass = TRUNCATED
        cached = _count(metrics.get("usage_prompt_cache_read_tokens"))
        if error is None:
            assert isinstance(ttft, float)
            first = sent + ttft
            finish = first + float(itl.sum())
            r = RequestRecord(arrival_s=arrival, input_tokens=n_in,
                              output_tokens=n_out if n_out is not None else chunks,
                              first_token_s=first, finish_s=finish, itl_s=itl)
            last_s = max(last_s, finish)
        else:
            first = sent + ttft if isinstance(ttft, float) else math.nan
            r = RequestRecord(arrival_s=arrival, input_tokens=n_in, output_tokens=chunks,
                              first_token_s=first, error=error)
        end_ns = meta.get("request_end_ns")
        if isinstance(end_ns, int):
            last_s = max(last_s, (end_ns - zero) / 1e9)
        built.append((credit[k] / 1e9, sent, row, r, eclass, -1 if cached is None else cached))

    if trace is not None:
        by_row = {b[2]: b for b in built}
        ordered = []
        for i in range(len(trace)):
            if i in by_row:
                ordered.append(by_row[i])
            else:
                a = float(trace.arrival_s[i])
                ordered.append((0.0, a, i, RequestRecord(
                    arrival_s=a, input_tokens=int(trace.input_tokens[i]), output_tokens=0,
                    error="aiperf returned no record for this trace row (never sent, or "
                          "dropped by aiperf)"), STREAM, -1))
    else:
        ordered = sorted(built, key=lambda b: (b[0], b[1]))

    ready = _read_ready(adir)
    stopped = None
    if ready.get("was_cancelled"):
        stopped = "aiperf cancelled the run before it finished"
    elif ready.get("partial"):
        stopped = "aiperf exported partial results"
    return AiperfRun(records=[b[3] for b in ordered],
                     sent_s=np.array([b[1] for b in ordered], dtype=float), wall_s=last_s,
                     stopped_early=stopped, aiperf_metrics=read_summary(adir), clock=clock,
                     artifact_dir=adir, error_class=[b[4] for b in ordered],
                     cached_tokens=np.array([b[5] for b in ordered], dtype=np.int64))


def _read_ready(adir: Path) -> dict[str, Any]:
    try:
        data = json.loads((adir / ".aiperf_results_ready.json").read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


# ---------------------------------------------------------------------------------------------
# Running aiperf as a local process


def find_aiperf(binary: str | os.PathLike[str] | None = None) -> str:
    """The ``aiperf`` executable: ``binary``, else ``$SERVETUNE_AIPERF``, ``PATH``, this venv.

    Raises:
        AiperfError: none found (names the install command).
    """
    for candidate in (binary, os.environ.get(ENV_BINARY)):
        if candidate:
            p = shutil.which(str(candidate)) or (str(candidate) if Path(candidate).is_file()
                                                 else None)
            if p is None:
                raise AiperfError(f"aiperf executable {candidate!r} not found; fix "
                                  f"{ENV_BINARY} or install the extra: {INSTALL_HINT}")
            return p
    found = shutil.which("aiperf")
    if found:
        return found
    beside = Path(sys.executable).with_name("aiperf")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    raise AiperfError(f"aiperf is not installed (no `aiperf` on PATH, {ENV_BINARY} unset); "
                      f"install the pinned extra: {INSTALL_HINT}")


def aiperf_version(binary: str, timeout_s: float = 60.0) -> str:
    """The version ``binary --version`` prints.

    Raises:
        AiperfError: it does not run or prints no version.
    """
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=timeout_s, check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise AiperfError(f"cannot run {binary} --version ({_brief(e, 120)}); reinstall: "
                          f"{INSTALL_HINT}") from e
    m = re.search(r"\b(\d+\.\d+\.\d+\S*)", out.stdout + out.stderr)
    if out.returncode != 0 or m is None:
        raise AiperfError(f"{binary} --version failed (exit {out.returncode}: "
                          f"{_brief(out.stderr or out.stdout, 160)}); reinstall: {INSTALL_HINT}")
    return m.group(1)


_BOX = re.compile(r"[\u2500-\u257f\u2580-\u259f]")


def failure_reason(output: str) -> str:
    """One line from aiperf's console output saying why it failed.

    aiperf 0.13.0 prints boxed panels; the first ``Reason:`` (with its continuation lines) or
    validation error is taken, else the last non-empty line.
    """
    lines = [" ".join(_BOX.sub(" ", ln).split()) for ln in output.splitlines()]
    lines = [ln for ln in lines if ln]
    for i, ln in enumerate(lines):
        if ln.startswith("Reason:") or "validation error" in ln:
            parts = [ln]
            for nxt in lines[i + 1:i + 6]:
                if re.match(r"^(•|Cause:|Service:|Operation:|Error:|For further|Log File)",
                            nxt):
                    break
                parts.append(nxt)
            return _brief(" ".join(parts))
    return _brief(lines[-1]) if lines else "no output"


class AiperfRunner:
    """Runs ``aiperf profile`` locally (a subprocess in its own session) and parses its records.

    Args:
        cache_dir: Folder for the HF tokenizer cache (:func:`prepare_tokenizer`).
        binary: The ``aiperf`` executable; default :func:`find_aiperf`.
        tokenizer_source: The served model's tokenizer folder (prompt lengths exact in the
            model's tokens); None for the built-in word-level one (:func:`build_tokenizer`:
            prompts of exactly ``input_length`` words).
        client_cpus: CPUs given to the client (``--workers-max`` follows). Default: the CPUs
            of ``cpu_affinity``, else of this process's affinity mask.
        cpu_affinity: Pin the aiperf processes to these CPUs (Linux ``sched_setaffinity``).
        request_timeout_s: A request not finished this long after its send fails.
        endpoint_type: ``completions`` or ``chat``.
        check_version: Refuse an aiperf other than :data:`AIPERF_VERSION` (checked before the
            first run).
    """

    def __init__(self, cache_dir: str | os.PathLike[str], *,
                 binary: str | os.PathLike[str] | None = None,
                 tokenizer_source: str | os.PathLike[str] | None = None,
                 client_cpus: int | None = None, cpu_affinity: Sequence[int] | None = None,
                 request_timeout_s: float = 600.0,
                 endpoint_type: Literal["completions", "chat"] = "completions",
                 check_version: bool = True) -> None:
        self.binary = find_aiperf(binary)
        self._version_checked = not check_version
        self.cache_dir = Path(cache_dir)
        self.tokenizer_source = tokenizer_source
        self.cpu_affinity = list(cpu_affinity) if cpu_affinity else None
        if client_cpus is None:
            client_cpus = len(self.cpu_affinity) if self.cpu_affinity else \
                len(os.sched_getaffinity(0))
        self.client_cpus = client_cpus
        self.request_timeout_s = request_timeout_s
        self.endpoint_type = endpoint_type
        self._tokenizer: TokenizerRef | None = None

    def tokenizer(self) -> TokenizerRef:
        """The tokenizer in the cache (prepared once per runner)."""
        if self._tokenizer is None:
            self._tokenizer = prepare_tokenizer(self.cache_dir / "hf", self.tokenizer_source)
        return self._tokenizer

    def argv(self, mode: Mode, urls: Sequence[str], model: str, artifact_dir: Path,
             **kw: Any) -> list[str]:
        """:func:`profile_argv` with this runner's executable, tokenizer, CPUs and timeouts."""
        return profile_argv(urls=urls, model=model, tokenizer=self.tokenizer().repo_id,
                            artifact_dir=str(artifact_dir), client_cpus=self.client_cpus,
                            mode=mode, endpoint_type=self.endpoint_type,
                            request_timeout_s=self.request_timeout_s, aiperf=self.binary, **kw)

    async def replay(self, requests: Sequence[Request], urls: Sequence[str], model: str,
                     artifact_dir: str | os.PathLike[str], *, seed: int = 0,
                     slo_ttft_ms: float | None = None) -> AiperfRun:
        """Replay windowed, scaled ``requests`` at their arrival times (open loop).

        Writes ``<artifact_dir>/trace.jsonl``, runs aiperf into ``artifact_dir`` and returns
        the parsed run (records in trace order). Times out after the schedule's span plus
        the request timeout plus :data:`STARTUP_ALLOWANCE_S`.
        """
        adir = Path(artifact_dir)
        trace = write_trace(requests, adir / "trace.jsonl")
        argv = self.argv("replay", urls, model, adir / "aiperf", input_file=str(trace.path),
                         block_size=trace.block_size, seed=seed, slo_ttft_ms=slo_ttft_ms)
        timeout = STARTUP_ALLOWANCE_S + trace.span_s + self.request_timeout_s
        return await self._run(argv, adir / "aiperf", timeout, trace=trace)

    async def synthetic(self, mode: Literal["concurrency", "rate"], urls: Sequence[str],
                        model: str, artifact_dir: str | os.PathLike[str], *, isl: int, osl: int,
                        duration_s: float | None = None, request_count: int | None = None,
                        concurrency: int | None = None, request_rate: float | None = None,
                        arrival: Literal["poisson", "constant", "gamma"] = "poisson",
                        dataset_entries: int | None = None, seed: int = 0) -> AiperfRun:
        """A synthetic closed-loop (``concurrency``) or open-loop (``rate``) run.

        Times out after ``duration_s`` (or, with a request count, count / rate, else the
        request timeout per round of the concurrency) plus the drain plus
        :data:`STARTUP_ALLOWANCE_S`.
        """
        adir = Path(artifact_dir) / "aiperf"
        argv = self.argv(mode, urls, model, adir, isl=isl, osl=osl, duration_s=duration_s,
                         request_count=request_count, concurrency=concurrency,
                         request_rate=request_rate, arrival=arrival,
                         dataset_entries=dataset_entries, seed=seed)
        if duration_s is not None:
            load_s = duration_s
        elif mode == "rate" and request_rate:
            load_s = (request_count or 0) / request_rate
        else:
            load_s = self.request_timeout_s * math.ceil((request_count or 1) / (concurrency or 1))
        timeout = STARTUP_ALLOWANCE_S + load_s + self.request_timeout_s
        return await self._run(argv, adir, timeout, isl=isl, osl=osl)

    async def check_version(self) -> str:
        """The executable's version (``--version``, once per runner; off the event loop).

        Raises:
            AiperfError: it is not :data:`AIPERF_VERSION` (names the install command).
        """
        version = await asyncio.to_thread(aiperf_version, self.binary)
        if version != AIPERF_VERSION:
            raise AiperfError(f"{self.binary} is aiperf {version}; servetune is pinned to "
                              f"{AIPERF_VERSION}: {INSTALL_HINT}")
        self._version_checked = True
        return version

    async def _run(self, argv: list[str], adir: Path, timeout_s: float, *,
                   trace: AiperfTrace | None = None, isl: int | None = None,
                   osl: int | None = None) -> AiperfRun:
        if not self._version_checked:
            await self.check_version()
        if adir.exists():
            shutil.rmtree(adir)  # a stale export must never be read as this run's
        adir.mkdir(parents=True)
        env = {**os.environ, **self.tokenizer().env(), "PYTHONUNBUFFERED": "1"}
        rc, output = await run_process(argv, env=env, timeout_s=timeout_s,
                                       log_path=adir.parent / "aiperf-console.log",
                                       cpu_affinity=self.cpu_affinity)
        if not (adir / RECORDS_FILE).is_file():
            raise AiperfError(f"aiperf failed (exit {rc}): {failure_reason(output)} (full "
                              f"output: {adir.parent / 'aiperf-console.log'})")
        run = parse_artifacts(adir, trace, isl=isl, osl=osl)
        run.argv, run.returncode = argv, rc
        if rc != 0:
            run.notes.append(f"aiperf exited {rc}: {failure_reason(output)}")
        return run


async def run_process(argv: Sequence[str], *, env: Mapping[str, str], timeout_s: float,
                      log_path: Path | None = None,
                      cpu_affinity: Sequence[int] | None = None) -> tuple[int, str]:
    """Run ``argv`` in a new session; return ``(exit status, combined output)``.

    stdout and stderr go to ``log_path`` (or a temporary file) and are returned. After
    ``timeout_s`` seconds, or when the awaiting task is cancelled, the process *group* this
    call started is sent SIGTERM, then SIGKILL 10 s later; after a normal exit, whatever is
    left of the group is killed (aiperf runs several service processes; nothing is killed by
    name).

    Raises:
        AiperfError: the executable cannot start, or the timeout passed (the group was killed).
    """
    preexec = None
    if cpu_affinity:
        cpus = set(cpu_affinity)

        def preexec() -> None:  # runs in the child before exec
            os.sched_setaffinity(0, cpus)

    # Output goes to a file, never a pipe: a pipe held open by a leftover service process
    # would keep a reader waiting after the leader exited.
    log = tempfile.TemporaryFile() if log_path is None else open(log_path, "w+b")
    try:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, env=dict(env), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec)
        except OSError as e:
            raise AiperfError(f"cannot start {argv[0]} ({e.strerror or e}); install the extra: "
                              f"{INSTALL_HINT}") from e
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            await _kill_group(proc)
            raise AiperfError(f"aiperf did not finish within {timeout_s:.0f} s and was stopped; "
                              "replay a shorter window or raise the request timeout") from None
        except BaseException:
            await _kill_group(proc)
            raise
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # service processes that outlived the leader
        log.seek(0)
        text = log.read().decode("utf-8", errors="replace")
    finally:
        log.close()
    assert proc.returncode is not None
    return proc.returncode, text


async def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """Stop the process group ``proc`` leads: SIGTERM, up to 10 s for the leader, then SIGKILL.

    The final SIGKILL reaches service processes that outlived the leader; the group id is the
    leader's pid (``start_new_session``), so only processes this call started are signalled.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(proc.wait()), 10.0)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    await proc.wait()
