"""What every part of the aiperf adapter shares: the pinned version, file names, the error.

Every failure is an :class:`AiperfError` whose one-line message names the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from mcp_servers.cluster.backend import BackendError
from sandbox.aiperf_job import AIPERF_VERSION

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


def brief(text: object, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` on one line (whitespace collapsed), cut to ``limit`` characters with ``...``."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


