"""SGLang versions at the CLI: `servetune source fetch` writes a version's flag inventory, and an
unknown version is one `error:` line and exit 2 from `run`, `check` and `diagnose --version`."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import yaml
from fixtures.cli import tiny_study, write
from fixtures.cli_runner import invoke

from domain.engines.sglang import flags

UNKNOWN = "0.5.17"  # no inventory ships for it
FETCH = f"`servetune source fetch --version {UNKNOWN}`"

# A tiny SGLang tree of the old layout (0.5.9: a ServerArgs dataclass + add_argument calls).
SERVER_ARGS = '''
import argparse
import dataclasses


@dataclasses.dataclass
class ServerArgs:
    model_path: str
    tp_size: int = 1
    max_running_requests: int = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser):
        parser.add_argument("--model-path", "--model", type=str, required=True)
        parser.add_argument("--tp-size", "--tensor-parallel-size", type=int,
                            default=ServerArgs.tp_size, dest="tp_size")
        parser.add_argument("--max-running-requests", type=int,
                            default=ServerArgs.max_running_requests)
        parser.add_argument("--cuda-graph-bs", type=int, nargs="+")
'''


def one_error_line(r) -> str:
    out = (r.stdout + r.stderr).strip()
    assert r.returncode == 2, out[-2000:]
    assert "Traceback" not in out
    lines = [x for x in out.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), out
    return lines[0]


def test_source_fetch_writes_the_inventory_the_domain_reads(tmp_path, monkeypatch):
    wheel = tmp_path / "sglang-0.5.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("sglang/__init__.py", "")
        zf.writestr("sglang/srt/server_args.py", SERVER_ARGS)
    data = tmp_path / "engines"
    env = {"SERVETUNE_SOURCE_CACHE": str(tmp_path / "cache"), "SERVETUNE_ENGINE_DATA": str(data)}
    r = invoke("source", "fetch", "--version", "0.5.1", "--wheel", str(wheel), tmp=tmp_path,
               env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"flag inventory: {data / 'sglang-0.5.1-flags.json'}" in r.stdout
    assert "rules of 0.5.9 used for 0.5.1" in " ".join(r.stdout.split())
    inv = json.loads((data / "sglang-0.5.1-flags.json").read_text())
    tp = next(f for f in inv["flags"] if f["dest"] == "tp_size")
    assert tp["flags"] == ["--tp-size", "--tensor-parallel-size"] and tp["type"] == "int"
    assert tp["action"] == "StoreAction" and tp["source"] == "sglang/srt/server_args.py:15"
    cli = json.loads((data / "sglang-0.5.1-cli.json").read_text())
    assert cli["nargs"] == {"cuda_graph_bs": "+"} and cli["retired"] == {}  # nothing older
    # the domain reads it once the directory is the user's engine data dir
    monkeypatch.setenv("SERVETUNE_ENGINE_DATA", str(data))
    assert flags.flag_for("tp_size", "0.5.1") == "--tp-size"
    assert flags.flag_for("max_running_requests", "0.5.1") == "--max-running-requests"


def test_check_refuses_an_unknown_version_in_one_line(tmp_path):
    line = one_error_line(invoke("check", "--gpu", "H100", "--gpus", "8", "--version", UNKNOWN,
                                 "--", "sglang", "serve", "--model-path",
                                 "meta-llama/Llama-3.1-8B-Instruct", tmp=tmp_path,
                                 env={"SERVETUNE_ENGINE_DATA": str(tmp_path / "none")}))
    assert f"SGLang {UNKNOWN} has no flag inventory here" in line and FETCH in line


def test_run_refuses_an_unknown_version_in_one_line(tmp_path):
    study = write(tmp_path, "s.yaml", yaml.safe_dump(tiny_study(engine_version=UNKNOWN)))
    line = one_error_line(invoke("run", str(study), tmp=tmp_path,
                                 env={"SERVETUNE_ENGINE_DATA": str(tmp_path / "none")}))
    assert f"engine_version: SGLang {UNKNOWN} has no flag inventory here" in line
    assert FETCH in line and not (tmp_path / "runs").exists()


def test_diagnose_refuses_an_unknown_version_in_one_line(tmp_path):
    log = write(tmp_path, "log.txt", "RuntimeError: boom\n")
    line = one_error_line(invoke("diagnose", "--version", UNKNOWN, str(log), tmp=tmp_path,
                                 env={"SERVETUNE_ENGINE_DATA": str(tmp_path / "none")}))
    assert FETCH in line


def test_a_known_older_version_is_checked_with_its_own_flags(tmp_path):
    r = invoke("check", "--gpu", "H100", "--gpus", "8", "--version", "0.5.19", "--", "sglang",
               "serve", "--model-path", "meta-llama/Llama-3.1-8B-Instruct", "--tp-size", "2",
               "--cuda-graph-max-bs", "64", tmp=tmp_path,
               env={"SERVETUNE_ENGINE_DATA": str(Path(tmp_path, "none"))})
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 0, out
    assert "DEPRECATED_FLAG: --cuda-graph-max-bs is deprecated in SGLang 0.5.19" in out
    assert "fix: use --cuda-graph-max-bs-decode" in out
