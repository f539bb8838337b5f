"""Running aiperf as a local process (:class:`AiperfRunner`, :func:`run_process`).

:func:`find_aiperf` finds the pinned executable (``SERVETUNE_AIPERF``, ``PATH``, the venv's bin)
and checks its version; :class:`AiperfRunner` writes the trace and tokenizer, runs
``aiperf profile`` (:func:`~mcp_servers.bench.aiperf.argv.profile_argv`) and parses its
artifacts. The process runs in its own session; on a timeout or cancellation its process group
is terminated, then killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from domain.workload import Request
from mcp_servers.bench.aiperf.argv import profile_argv
from mcp_servers.bench.aiperf.artifacts import AiperfRun, parse_artifacts
from mcp_servers.bench.aiperf.common import (
    AIPERF_VERSION,
    ENV_BINARY,
    INSTALL_HINT,
    RECORDS_FILE,
    STARTUP_ALLOWANCE_S,
    AiperfError,
    Mode,
    brief,
)
from mcp_servers.bench.aiperf.tokenizer import TokenizerRef, prepare_tokenizer
from mcp_servers.bench.aiperf.trace import AiperfTrace, write_trace

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
        raise AiperfError(f"cannot run {binary} --version ({brief(e, 120)}); reinstall: "
                          f"{INSTALL_HINT}") from e
    m = re.search(r"\b(\d+\.\d+\.\d+\S*)", out.stdout + out.stderr)
    if out.returncode != 0 or m is None:
        raise AiperfError(f"{binary} --version failed (exit {out.returncode}: "
                          f"{brief(out.stderr or out.stdout, 160)}); reinstall: {INSTALL_HINT}")
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
            return brief(" ".join(parts))
    return brief(lines[-1]) if lines else "no output"


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
