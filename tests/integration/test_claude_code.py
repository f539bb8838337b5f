"""What a Claude Code user gets: `.mcp.json` starts the four servers over stdio, every tool the
`.claude/agents/` subagents name exists on the server they name, and the CLI around them
(`servetune mcp tools`, `servetune source fetch`, `servetune lessons export-skill`) works.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import anyio
import pytest
import yaml
from fixtures import warm_cli
from fixtures.cli_runner import invoke
from mcp import Client, StdioServerParameters

pytestmark = pytest.mark.anyio
REPO = Path(__file__).resolve().parents[2]
VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")



def expand(text: str, env: dict[str, str]) -> str:
    """Claude Code's `${VAR}` / `${VAR:-default}` expansion in .mcp.json."""
    return VAR.sub(lambda m: env.get(m.group(1), m.group(2) or ""), text)


def isolated_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVETUNE_")}
    env.update(SERVETUNE_STATE_DIR=str(tmp_path / "state"),
               SERVETUNE_LESSONS_DIR=str(tmp_path / "lessons"), SERVETUNE_EMBEDDING="hashing",
               SERVETUNE_SOURCE_CACHE=str(tmp_path / "no-source-yet"),
               SERVETUNE_ENGINE_DATA=str(tmp_path / "engines"))
    return env


def mcp_config() -> dict[str, dict]:
    return json.loads((REPO / ".mcp.json").read_text())["mcpServers"]


def agents() -> dict[str, dict]:
    out = {}
    for path in sorted((REPO / ".claude" / "agents").glob("*.md")):
        front = yaml.safe_load(path.read_text().split("---\n")[1])
        out[path.stem] = front
    return out


@pytest.fixture(scope="module")
def server_tools(tmp_path_factory) -> dict[str, set[str]]:
    """Tools of each .mcp.json server, listed over stdio as Claude Code starts them."""
    tmp = tmp_path_factory.mktemp("claude")
    env = isolated_env(tmp)

    async def list_all() -> dict[str, set[str]]:
        found = {}
        for name, spec in mcp_config().items():
            command = expand(spec["command"], {})
            args = [expand(a, {}) for a in spec["args"]]
            assert command == ".venv/bin/servetune", command  # the README's install location
            params = StdioServerParameters(command=sys.executable, cwd=str(tmp), env=env,
                                           args=["-m", "servetune.cli", *args])
            with anyio.fail_after(60):
                async with Client(params) as client:
                    found[name] = {t.name for t in (await client.list_tools()).tools}
        return found

    return anyio.run(list_all)


def test_mcp_json_registers_the_four_servers_and_each_lists_its_tools(server_tools):
    assert set(server_tools) == {"servetune-cluster", "servetune-bench", "servetune-lessons",
                                 "sglang-source"}
    assert {"deploy", "get_status", "get_logs", "get_events", "tear_down",
            "list_deployments"} <= server_tools["servetune-cluster"]
    assert {"run_saturation", "run_replay", "run_sweep"} <= server_tools["servetune-bench"]
    assert {"check_config", "query_lessons", "export_skill"} <= server_tools["servetune-lessons"]
    assert {"where_used", "constraints", "explain_default"} <= server_tools["sglang-source"]


def test_subagents_name_only_tools_that_exist(server_tools):
    found = agents()
    assert {"planner", "source-researcher", "deployer", "analyst"} <= set(found)
    for stem, front in found.items():
        assert front["name"].startswith("servetune-") and len(front["description"]) > 40, stem
        tools = [t.strip() for t in front["tools"].split(",")]
        mcp_tools = [t for t in tools if t.startswith("mcp__")]
        assert mcp_tools, f"{stem} uses no servetune server"
        for t in mcp_tools:
            _, server, tool = t.split("__", 2)
            assert tool in server_tools[server], f"{stem}: {t} does not exist"
    # each specialist only gets what its job needs
    assert not any("tear_down" in t or "deploy" in t for t in found["planner"]["tools"].split(","))
    assert not any("cluster" in t for t in found["analyst"]["tools"].split(","))


def run_cli(tmp_path: Path, *args: str, plain: bool = False
            ) -> subprocess.CompletedProcess[str]:
    """``servetune ARGS`` in a process of its own, forked from the warm CLI interpreter
    (fixtures/warm_cli.py), with :func:`isolated_env`'s settings on a 200-column terminal;
    ``plain``: a ``python -m servetune.cli`` subprocess, the command's real entry point."""
    env = {**isolated_env(tmp_path), "COLUMNS": warm_cli.COLUMNS}
    if plain:
        return subprocess.run([sys.executable, "-m", "servetune.cli", *args], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=120)
    return warm_cli.run(list(args), cwd=tmp_path, env=env, timeout=120)


def refusal(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A command that refuses its arguments, in this process (fixtures/cli_runner.py), with
    :func:`isolated_env`'s settings (and none of this machine's other SERVETUNE_ ones)."""
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("SERVETUNE_")}
    env.update({k: v for k, v in isolated_env(tmp_path).items() if k.startswith("SERVETUNE_")})
    return invoke(*args, tmp=tmp_path, env=env)


def test_mcp_tools_command_lists_a_server(tmp_path):
    r = run_cli(tmp_path, "mcp", "tools", "lessons", plain=True)
    assert r.returncode == 0, r.stderr
    tools = ("query_lessons", "list_lessons", "add_lesson", "check_config", "export_skill",
             "show_lesson", "quarantine_lesson", "report_served", "check_command",
             "diagnose_log")
    listed = re.search(r"servetune mcp lessons: (\d+) tools", r.stdout)
    assert listed and int(listed.group(1)) >= len(tools), r.stdout
    assert all(t in r.stdout for t in tools), r.stdout
    assert "retract_lesson" not in r.stdout  # only with the operator's --allow-retract
    bad = run_cli(tmp_path, "mcp", "tools", "kubectl")
    assert bad.returncode == 2 and "unknown server 'kubectl'" in bad.stderr


def test_source_fetch_unpacks_a_wheel_and_refuses_option_like_versions(tmp_path):
    wheel = tmp_path / "sglang-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("sglang/__init__.py", "")
        z.writestr("sglang/srt/server_args.py",  # the least tree fetch builds an inventory of
                   "class ServerArgs:\n    tp_size: int = 1\n\n"
                   "def add_cli_args(parser):\n"
                   "    parser.add_argument('--tp-size', type=int, default=1)\n")
    r = run_cli(tmp_path, "source", "fetch", "--version", "0.0.1", "--wheel", str(wheel),
                plain=True)
    assert r.returncode == 0, r.stderr
    root = tmp_path / "no-source-yet" / "sglang-0.0.1"
    assert (root / "sglang" / "srt" / "server_args.py").is_file()
    assert str(root) in r.stdout.replace("\n", "")
    bad = refusal(tmp_path, "source", "fetch", "--version", "--index-url=http://evil")
    assert bad.returncode == 2 and "not a release number" in bad.stderr


def test_lessons_export_skill_writes_a_skill_file(tmp_path):
    r = run_cli(tmp_path, "lessons", "export-skill")
    assert r.returncode == 0, r.stderr
    skill = tmp_path / ".claude" / "skills" / "servetune-lessons" / "SKILL.md"
    front = yaml.safe_load(skill.read_text().split("---\n")[1])
    assert front["name"] == "servetune-lessons"
    assert "No lessons are stored yet" in skill.read_text()
    bad = refusal(tmp_path, "lessons", "export-skill", "--name", "Bad Name")
    assert bad.returncode == 2 and "skill name" in bad.stderr


@pytest.mark.parametrize("args, needle", [
    (["mcp", "cluster", "--backend", "kubectl"], "unknown cluster backend 'kubectl'"),
    (["mcp", "cluster", "--namespace", "Kube_System"], "not a valid DNS-1123 label"),
    (["mcp", "cluster", "--backend", "local", "--visible-devices", "0,,1"], "no empty entries"),
    (["mcp", "cluster", "--backend", "local", "--command", "python s.py --port {prot}"],
     "{prot}"),
    (["mcp", "bench", "--trace-dir", "/no/such/folder"], "no such folder"),
], ids=["backend", "namespace", "devices", "placeholder", "trace-dir"])
def test_server_options_are_checked_before_serving(tmp_path, args, needle):
    r = refusal(tmp_path, *args)
    assert r.returncode == 2 and needle in r.stderr, (r.returncode, r.stderr[-500:])
    assert "Traceback" not in r.stderr
