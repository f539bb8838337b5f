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


def test_the_store_prunes_another_version_with_a_lesson_whose_guard_is_unchanged(
        tmp_path, monkeypatch):
    """A source-verified 0.5.23 lesson forbids a 0.5.19 config once both trees are fetched."""
    from fixtures.pinned_source import pinned_tree_path

    from domain.config import ServingConfig
    from domain.lesson import Clause, Lesson, Scope
    from memory.store import LessonStore

    site = "sglang/srt/managers/tp_worker.py:420"
    pinned = pinned_tree_path()
    cache = tmp_path / "cache"
    (cache / "sglang-0.5.19" / site.rpartition("/")[0]).mkdir(parents=True)
    (cache / "sglang-0.5.23").symlink_to(pinned)
    monkeypatch.setenv("SERVETUNE_SOURCE_CACHE", str(cache))
    lesson = Lesson(title="zero requests", scope=Scope(gpu="H100", engine_version="0.5.23"),
                    condition=[Clause(field="max_running_requests", op="le", value=4)],
                    outcome="crash", root_cause="x", fix="y", evidence="max_running_request "
                    "is zero", verified=True, source_site=site).with_id()
    cfg = ServingConfig(engine_version="0.5.19", model="llama-3.1-8b", gpu="H100",
                        weights="bf16", max_running_requests=2)
    with LessonStore(tmp_path / "lessons", embedding="hashing") as store:
        store.add(lesson)
        assert store.forbidding(cfg) == []  # 0.5.19's tp_worker.py is not there yet
        rel = site.rpartition(":")[0]
        (cache / "sglang-0.5.19" / rel).write_text((pinned / rel).read_text())
        assert [x.id for x in store.forbidding(cfg)] == [lesson.id]
        assert [x.id for x in store.forbidding(cfg.model_copy(
            update={"engine_version": "0.5.23"}))] == [lesson.id]


def test_the_static_parser_reproduces_the_shipped_argparse_dump_of_0_5_23():
    """The parser that built the 0.5.9 and 0.5.19 inventories, on the one tree tests have."""
    from fixtures.pinned_source import pinned_tree_path

    from mcp_servers.source.flags import extract_flags
    from mcp_servers.source.inventory import _entry
    from mcp_servers.source.tree import SourceTree

    mine = [_entry(f) for f in extract_flags(SourceTree(pinned_tree_path())).flags]
    dump = json.loads((flags.DATA_DIR / "sglang-0.5.23-flags.json").read_text())["flags"]
    by = {s: f for f in mine for s in f["flags"]}
    ref = {s: f for f in dump for s in f["flags"]}
    assert set(by) == set(ref) and len(mine) == len(dump) == 531
    runtime = []  # choices computed when SGLang starts (parser plugins, an enum of a call)
    for s, f in ref.items():
        assert by[s]["dest"] == f["dest"], s
        assert by[s]["action"] == f["action"], s
        if f["choices"] and by[s]["choices"] is None:
            runtime.append(s)
        else:
            assert set(map(str, by[s]["choices"] or [])) == set(map(str, f["choices"] or [])), s
    assert sorted(runtime) == ["--kv-canary-real-data", "--reasoning-parser",
                               "--sampling-backend", "--tool-call-parser"]


def test_the_static_parser_reads_0_5_1x_annotated_server_args(tmp_path):
    """0.5.1x declares ``A[T, Arg(...)]`` fields on ServerArgs itself (no arg_groups/fields/)."""
    from mcp_servers.source.flags import extract_flags
    from mcp_servers.source.tree import SourceTree

    src = tmp_path / "sglang" / "srt"
    src.mkdir(parents=True)
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (src / "server_args.py").write_text('''
from typing import Annotated as A, Literal, Optional


class ServerArgs:
    tp_size: A[int, Arg(help="GPUs", aliases=["--tensor-parallel-size"])] = 1
    schedule_policy: A[Literal["fcfs", "lpm"], "the policy"] = "fcfs"
    hidden: int = 3

    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--cuda-graph-max-bs", type=int, dest="cuda_graph_max_bs_decode",
                            action=DeprecatedAliasStoreAction,
                            new_flag="--cuda-graph-max-bs-decode", help="Deprecated alias.")
''')
    inv = {f.dest: f for f in extract_flags(SourceTree(tmp_path)).flags}
    assert inv["tp_size"].flags == ["--tp-size", "--tensor-parallel-size"]
    assert inv["schedule_policy"].choices == ["fcfs", "lpm"]
    assert "hidden" not in inv  # a plain field has no flag
    alias = inv["cuda_graph_max_bs_decode"]
    assert alias.deprecated and alias.new_flag == "--cuda-graph-max-bs-decode"
