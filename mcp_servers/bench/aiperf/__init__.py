"""aiperf adapter: trace conversion, offline tokenizer, ``aiperf profile`` runs, artifact parsing.

aiperf (ai-dynamo/aiperf, Apache-2.0) is the load generator for cluster benchmarks; it is an
optional extra pinned to :data:`AIPERF_VERSION` (``pip install -e ".[aiperf]"``, or that version
in a venv of its own named by ``SERVETUNE_AIPERF``: it pins ``rich~=14.1``, ``pandas~=2.3`` and
more) and always runs as a separate process (locally, or as a Kubernetes Job beside the
engine), never imported. What
this package does, and why, follows the measurements in ``shared/reference/loadgen.md`` (the
"loadgen reference"; sections in brackets):

- :mod:`~mcp_servers.bench.aiperf.trace`: traces -> aiperf's ``mooncake_trace`` JSONL.
- :mod:`~mcp_servers.bench.aiperf.tokenizer`: an offline tokenizer in the Hugging Face cache layout.
- :mod:`~mcp_servers.bench.aiperf.argv`: the ``aiperf profile`` command line.
- :mod:`~mcp_servers.bench.aiperf.artifacts`: aiperf's artifacts -> records and its summary.
- :mod:`~mcp_servers.bench.aiperf.runner`: finding aiperf and running it as a local process.
- :mod:`~mcp_servers.bench.aiperf.common`: the shared constants and :class:`AiperfError`.

The Kubernetes Job that runs aiperf beside the engine is :mod:`sandbox.aiperf_job`.
Every failure is an :class:`AiperfError` whose one-line message names the fix.
"""

from mcp_servers.bench.aiperf.argv import default_workers, profile_argv
from mcp_servers.bench.aiperf.artifacts import AiperfRun, parse_artifacts, read_summary
from mcp_servers.bench.aiperf.common import (
    AIPERF_VERSION,
    CONNECT,
    DISCONNECT,
    ENV_BINARY,
    HTTP_STATUS,
    INSTALL_HINT,
    LOG_FILE,
    STREAM,
    TIMEOUT,
    TRUNCATED,
    AiperfError,
)
from mcp_servers.bench.aiperf.runner import (
    AiperfRunner,
    aiperf_version,
    failure_reason,
    find_aiperf,
    run_process,
)
from mcp_servers.bench.aiperf.tokenizer import TokenizerRef, build_tokenizer, prepare_tokenizer
from mcp_servers.bench.aiperf.trace import (
    AiperfTrace,
    convert_trace,
    read_trace,
    session_id,
    trace_rows,
    write_trace,
)

__all__ = [
    "AIPERF_VERSION", "CONNECT", "DISCONNECT", "ENV_BINARY", "HTTP_STATUS", "INSTALL_HINT",
    "LOG_FILE", "STREAM", "TIMEOUT", "TRUNCATED", "AiperfError", "AiperfRun", "AiperfRunner",
    "AiperfTrace", "TokenizerRef", "aiperf_version", "build_tokenizer", "convert_trace",
    "default_workers", "failure_reason", "find_aiperf", "parse_artifacts", "prepare_tokenizer",
    "profile_argv", "read_summary", "read_trace", "run_process", "session_id", "trace_rows",
    "write_trace",
]
