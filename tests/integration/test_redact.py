"""Secrets never leave through lessons or engine logs (issue 16, D3): one redactor
(domain/redact.py), used on the way in (add_lesson, the analyst's lessons, ledger rows, cluster
record files) and on the way out (lessons list/query/export-skill, report, get_status/get_logs/
get_events), so a lesson stored before this fix is shown redacted too.

Every key below is made up in the documented shape of its vendor; none is real.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fixtures.lessons import seed_raw, temp_store
from mcp import Client

from domain.config import ServingConfig
from domain.lesson import Lesson
from domain.trial import Trial
from mcp_servers.cluster.backend import Event, LogLine
from mcp_servers.cluster.server import build_server as cluster_server
from mcp_servers.cluster.store import RecordStore
from mcp_servers.cluster.twin import TwinBackend
from mcp_servers.lessons.server import build_server as lessons_server
from memory.store import LessonStore

pytestmark = pytest.mark.anyio

ANTHROPIC = ("sk-ant-api03-" + "Zq8Xw2Lm4Np6Rt0Vb3Cd5Fg7Hj9Kl1Mn3Op5Qr7St9Uv1Wx3Yz5Ab7Cd9Ef1Gh3Ij5"
             "Kl7Mn9Op1Qr3St5Uv7Wx9Yz1Ab3Cd5E-fG7_hAA")
OPENAI = ("sk-proj-" + "Tq3Lw9Xe2Rb7Yn4Kd8Vs1Mc6Hp0Jf5Ga2Zu7Oi3Ek9Wy4Bt1Nx8Qr6Lm2Pv5Cj0Ds7Fh3"
          "Gk9_Tz4-Ua1Ib")
OPENAI_LEGACY = "sk-" + "Ab3Cd5Ef7Gh9Ij1Kl3MnT3BlbkFJOp5Qr7St9Uv1Wx3Yz5Ab7C"
HF = "hf_" + "QwErTyUiOpAsDfGhJkLzXcVbNmQwErTyUi"
AWS_ID = "AKIA" + "Z3X9Q2LMN4P7RT8W"
AWS_SECRET = "r7Tq2/Lw9Xe+Rb7Yn4Kd8Vs1Mc6Hp0Jf5Ga2Zu7O"  # 40
GITHUB = "ghp_" + "Xy7Zw3Vu1Ts9Rq5Po3Nm1Lk7Ji5Hg3Fe1Dc9Ba7"
GITHUB_PAT = ("github_pat_" + "11ABCDEFG0aBcDeFgHiJkL_"
              + "MnOpQrStUvWxYz0123456789AbCdEfGhIjKlMnOpQrStUvWxYz012345678")  # 22 _ 59
SLACK = "xoxb-" + "2837465019-4938271650392-Qw7Er9Ty1Ui3Op5As7Df9Gh"
GOOGLE = "AIza" + "SyB7Xq2Lm9Nw4Rt6Vb1Cd3Fg5Hj8Kl0Mn2O"  # 4 + 35
JWT = ("eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiJzZXJ2ZXR1bmUiLCJpYXQiOjE3MDAwMDAwMDB9."
       "Xq2Lm9Nw4Rt6Vb1Cd3Fg5Hj8Kl0Mn2OpQr4St6Uv8")
PEM = ("-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEAq7Xq2Lm9Nw4Rt6Vb1Cd3Fg5Hj8Kl0Mn2Op\n"
       "Qr4St6Uv8Wx0Yz2Ab4Cd6Ef8Gh0Ij2Kl4Mn6Op8Qr0St2Uv4Wx6Yz8Ab0Cd2Ef4Gh6\n"
       "-----END RSA PRIVATE KEY-----")
BEARER = "Bq7Tz2Lw9Xe4Rb8Yn1Kd5Vs3"
PASSWORD = "hunter2-Orchid!"
TOKEN = "t0k3n-Vb1Cd3Fg5Hj8"

# (family, text holding a secret, the secret)
FAMILIES = [
    pytest.param(f"ANTHROPIC_API_KEY={ANTHROPIC}", ANTHROPIC, id="anthropic"),
    pytest.param(f"using key {ANTHROPIC} for the brain", ANTHROPIC, id="anthropic-bare"),
    pytest.param(f"openai key {OPENAI} refused", OPENAI, id="openai-project"),
    pytest.param(f"OPENAI_API_KEY: {OPENAI_LEGACY}", OPENAI_LEGACY, id="openai-legacy"),
    pytest.param(f"huggingface-cli login --token {HF}", HF, id="huggingface"),
    pytest.param(f"401 for https://huggingface.co/api/models ({HF})", HF, id="huggingface-bare"),
    pytest.param(f"aws_access_key_id={AWS_ID}", AWS_ID, id="aws-key-id"),
    pytest.param(f"aws_secret_access_key = {AWS_SECRET}", AWS_SECRET, id="aws-secret"),
    pytest.param(f'"AWS_SECRET_ACCESS_KEY": "{AWS_SECRET}"', AWS_SECRET, id="aws-secret-json"),
    pytest.param(f"credentials {AWS_ID}:{AWS_SECRET}", AWS_SECRET, id="aws-pair"),
    pytest.param(f"git clone https://{GITHUB}@github.com/sgl-project/sglang", GITHUB,
                 id="github-classic"),
    pytest.param(f"GH_TOKEN {GITHUB_PAT}", GITHUB_PAT, id="github-fine-grained"),
    pytest.param(f"slack webhook auth {SLACK} ok", SLACK, id="slack"),
    pytest.param(f"https://generativelanguage.googleapis.com/v1/models?key={GOOGLE}", GOOGLE,
                 id="google"),
    pytest.param(f"session cookie {JWT}; path=/", JWT, id="jwt"),
    pytest.param(f"loaded key:\n{PEM}\nserver starting", "MIIEowIBAAKCAQEA", id="pem"),
    pytest.param("-----BEGIN OPENSSH PRIVATE KEY----- b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAA",
                 "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAA", id="pem-truncated"),
    pytest.param(f"Authorization: Bearer {BEARER}", BEARER, id="bearer"),
    pytest.param(f"db url with password={PASSWORD} failed", PASSWORD, id="password"),
    pytest.param(f"GET /metrics?token={TOKEN}&x=1", TOKEN, id="token-query"),
    pytest.param(f'{{"hf_token": "{TOKEN}", "x": 1}}', TOKEN, id="token-json"),
    pytest.param(f"ServerArgs(model_path='m', api_key='{TOKEN}', port=30000)", TOKEN,
                 id="sglang-api-key"),
    pytest.param(f"sglang serve --model-path m --api-key {TOKEN} --port 30000", TOKEN,
                 id="api-key-flag"),
    # fresh-user retest of D3: names glued to a prefix or with a suffix, camelCase, other
    # Authorization schemes, URL credentials, a token after "_", "=>"
    pytest.param(f"export PGPASSWORD={PASSWORD}; psql", PASSWORD, id="pgpassword"),
    pytest.param(f"MYSQL_PWD={PASSWORD} mysql -u root", PASSWORD, id="mysql-pwd"),
    pytest.param(f"SECRET_KEY={TOKEN} in the env", TOKEN, id="secret-key"),
    pytest.param(f"config private_key={TOKEN} loaded", TOKEN, id="private-key-name"),
    pytest.param(f"passphrase={PASSWORD}", PASSWORD, id="passphrase"),
    pytest.param(f"credentials={TOKEN}", TOKEN, id="credentials"),
    pytest.param(f"apiToken: {TOKEN}", TOKEN, id="camel-api-token"),
    pytest.param(f"accessToken={TOKEN}&x=1", TOKEN, id="camel-access-token"),
    pytest.param(f'{{"accessToken":"{TOKEN}","expires":3600}}', TOKEN, id="json-access-token"),
    pytest.param("Authorization: Basic dXNlcjpwYXNzd29yZDEyMw==", "dXNlcjpwYXNzd29yZDEyMw",
                 id="basic-auth"),
    pytest.param(f"Authorization: token {TOKEN}", TOKEN, id="token-auth"),
    pytest.param(f"fetch https://alice:{PASSWORD}@registry.example.com/v2/ failed", PASSWORD,
                 id="url-userinfo"),
    pytest.param(f"MY_{HF} set", HF, id="huggingface-after-underscore"),
    pytest.param(f"token => {TOKEN}", TOKEN, id="fat-arrow"),
]

# Lines an SGLang log really holds: nothing in them may change.
INTACT = [
    "[2026-03-01 10:00:01] server_args=ServerArgs(model_path='zai-org/GLM-5-FP8', "
    "tokenizer_path='zai-org/GLM-5-FP8', tokenizer_mode='auto', skip_tokenizer_init=False, "
    "api_key=None, admin_api_key=None, served_model_name='zai-org/GLM-5-FP8', "
    "max_prefill_tokens=16384, speculative_num_draft_tokens=None, hf_chat_template_name=None, "
    "kv_cache_dtype='fp8_e4m3', mem_fraction_static=0.85, tp_size=8, random_seed=874215)",
    "[2026-03-01 10:00:40 TP0] Decode batch. #running-req: 32, #token: 61440, token usage: "
    "0.41, cuda graph: True, gen throughput (token/s): 5123.45, #queue-req: 0",
    "[2026-03-01 10:00:39 TP0] Prefill batch. #new-seq: 1, #new-token: 512, #cached-token: 0, "
    "token usage: 0.00, #running-req: 0, #queue-req: 0",
    "[2026-03-01 10:00:12 TP0] Load weight end. type=GlmMoeDsaForCausalLM, dtype=torch.bfloat16, "
    "avail mem=23.45 GB, mem usage=162.30 GB.",
    "[2026-03-01 10:00:20 TP0] Capture cuda graph bs [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]",
    "Downloading shards: sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    "commit 3f2a9c1d4b5e6f708192a3b4c5d6e7f8091a2b3c of sgl-project/sglang (task-manager ok)",
    "INFO:     127.0.0.1:53422 - \"POST /generate HTTP/1.1\" 200 OK",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 178.35 GiB of which 1.02 GiB is free.",
    "sglang serve --model-path zai-org/GLM-5-FP8 --tp-size 8 --speculative-num-draft-tokens 4 "
    "--enable-hierarchical-cache --hicache-ratio 2.0",
    "hf_transfer is not installed; set HF_HUB_ENABLE_HF_TRANSFER=0",
    "AKIA is a prefix; the_token=None and password= (empty) and token: 1234",
    # names that hold "token" or "key" but no secret (SGLang's ServerArgs dump, batch lines)
    "ServerArgs(max_total_tokens=1048576, tokenizer_path='zai-org/GLM-5-FP8', "
    "tokenizer_worker_num=1, skip_tokenizer_init=False, enable_tokenizer_batch_encode=False, "
    "num_reserved_decode_tokens=512, max_prefill_tokens=16384, cuda_graph_max_bs=256)",
    "num_tokens=512 new_tokens: 128 #token: 61440 total_tokens => 2048 token usage: 0.41",
    "tokenizer=zai-org/GLM-5-FP8 tokenizers: loaded, detokenizer ready",
    "PWD=runs/r1 OLDPWD=. HOME=~",
    "GET http://127.0.0.1:30000/v1/models and https://huggingface.co/zai-org/GLM-5-FP8/resolve/"
    "main/config.json",
    "Basic block sizes: 64; authorization check skipped (no api key given)",
]


@pytest.mark.parametrize(("text", "secret"), FAMILIES)
def test_each_secret_family_is_redacted(text, secret):
    from domain.redact import redact

    out = redact(text)
    assert secret not in out, out
    assert "[REDACTED" in out
    assert redact(out) == out  # idempotent: a stored, redacted text stays as it is


@pytest.mark.parametrize("line", INTACT, ids=[f"line-{i}" for i in range(len(INTACT))])
def test_ordinary_log_lines_stay_intact(line):
    from domain.redact import redact

    assert redact(line) == line


def test_redact_keeps_the_text_around_the_secret():
    from domain.redact import redact

    out = redact(f"before {HF} after\nnext line password={PASSWORD} end")
    assert out.startswith("before [REDACTED") and out.endswith(" end")
    assert "after\nnext line password=[REDACTED" in out


# -- lessons ------------------------------------------------------------------------------------

SECRET_TEXT = f"key {ANTHROPIC} and {AWS_ID} / aws_secret_access_key={AWS_SECRET}"
ALL_SECRETS = (ANTHROPIC, AWS_ID, AWS_SECRET, OPENAI, HF)


def secret_lesson() -> dict[str, Any]:
    return {"title": f"fa3 refused with HF token {HF}", "scope": {"gpu": "B200"},
            "condition": [{"field": "attention_backend", "op": "eq", "value": "fa3"}],
            "outcome": "unsupported", "failure_class": "UNSUPPORTED_BACKEND",
            "root_cause": f"startup failed; env had OPENAI_API_KEY={OPENAI}",
            "fix": f"do not pass {SECRET_TEXT}", "evidence": f"log: {SECRET_TEXT}",
            "provenance": {"backend": "kubernetes", "image": f"registry/sglang:{HF}",
                           "evidence": [f"log: {SECRET_TEXT}"], "run_id": OPENAI}}


def leaks(text: str) -> list[str]:
    return [s for s in ALL_SECRETS if s in text]


@pytest.fixture
def store(tmp_path):
    yield from temp_store(tmp_path)


async def test_add_lesson_stores_secrets_redacted(store):
    async with Client(lessons_server(store)) as client:
        r = await client.call_tool("add_lesson", {"lesson": secret_lesson()})
        listed = await client.call_tool("list_lessons", {})
    assert not r.is_error, r.content[0].text
    assert leaks(json.dumps(r.structured_content)) == []
    assert leaks(json.dumps(listed.structured_content)) == []
    stored = store.get(r.structured_content["lesson"]["id"])
    assert stored is not None and leaks(stored.model_dump_json()) == []
    assert "[REDACTED" in stored.evidence and "fa3 refused" in stored.title
    raw = store._collection.get(ids=[stored.id], include=["metadatas", "documents"])
    assert leaks(json.dumps(raw)) == []


async def test_add_lesson_redacts_run_and_trial_ids(store):
    data = secret_lesson() | {"run_id": AWS_ID, "trial_id": JWT,
                              "root_cause": f"PGPASSWORD={PASSWORD} and MYSQL_PWD={PASSWORD}",
                              "evidence": f"Authorization: Basic dXNlcjpwYXNzd29yZDEyMw== "
                                          f"https://alice:{PASSWORD}@db.example.com/"}
    async with Client(lessons_server(store)) as client:
        r = await client.call_tool("add_lesson", {"lesson": data})
        listed = await client.call_tool("list_lessons", {})
        found = await client.call_tool("query_lessons", {"text": "fa3 refused"})
    assert not r.is_error, r.content[0].text
    for answer in (r, listed, found):
        text = json.dumps(answer.structured_content)
        for secret in (AWS_ID, JWT, PASSWORD, "dXNlcjpwYXNzd29yZDEyMw"):
            assert secret not in text, text
    lesson = r.structured_content["lesson"]
    assert lesson["run_id"].startswith("[REDACTED") and lesson["trial_id"].startswith("[REDACTED")
    assert "alice:" in lesson["evidence"] and "@db.example.com/" in lesson["evidence"]


async def test_stored_unredacted_lesson_is_shown_redacted(store):
    lid = seed_raw(store, secret_lesson())
    assert leaks(json.dumps(store._collection.get(ids=[lid], include=["metadatas"]))) != []
    async with Client(lessons_server(store)) as client:
        for tool, args in (("list_lessons", {}), ("query_lessons", {"text": "fa3 refused"}),
                           ("export_skill", {}),
                           ("check_config", {"config": {"model": "glm-5", "gpu": "B200",
                                                        "weights": "fp8",
                                                        "attention_backend": "fa3"}})):
            r = await client.call_tool(tool, args)
            assert not r.is_error, (tool, r.content[0].text)
            assert leaks(json.dumps(r.structured_content)) == [], tool
    assert leaks(store.export_markdown()) == []


def cli(*args: str, tmp: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, SERVETUNE_LESSONS_DIR=str(tmp / "lessons"), COLUMNS="400")
    return subprocess.run([sys.executable, "-m", "servetune.cli", *args], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_lessons_list_query_and_skill_are_redacted(tmp_path):
    with LessonStore(tmp_path / "lessons", embedding="hashing") as s:
        lid = seed_raw(s, secret_lesson())
    listed = cli("lessons", "list", tmp=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert lid in listed.stdout and leaks(listed.stdout + listed.stderr) == []
    query = cli("lessons", "query", "fa3 refused", tmp=tmp_path)
    assert query.returncode == 0, query.stderr
    assert lid in query.stdout and leaks(query.stdout + query.stderr) == []
    skill = cli("lessons", "export-skill", "--out", "SKILL.md", tmp=tmp_path)
    assert skill.returncode == 0, skill.stderr
    text = (tmp_path / "SKILL.md").read_text()
    assert lid in text and "[REDACTED" in text and leaks(text) == []


def test_ledger_rows_hold_no_secrets(tmp_path):
    from domain.ledger import Ledger

    cfg = ServingConfig(model="glm-5", gpu="B200", weights="fp8", tp_size=8)
    lesson = Lesson.model_validate(secret_lesson())
    trial = Trial(run_id="r", seq=1, key="search:x", phase="search", status="crash", config=cfg,
                  reason=f"crashed: {SECRET_TEXT}", log_tail=[f"env {OPENAI}", SECRET_TEXT],
                  lessons_written=[lesson],
                  retries=[{"what": "deploy", "evidence": f"Bearer {BEARER}"}])
    led = Ledger(tmp_path / "ledger.sqlite")
    try:
        led.append(trial)
    finally:
        led.close()
    db = sqlite3.connect(tmp_path / "ledger.sqlite")
    try:
        dump = "\n".join(str(row) for row in db.execute("SELECT * FROM trials"))
    finally:
        db.close()
    assert leaks(dump) == [] and BEARER not in dump and "[REDACTED" in dump


def test_ledger_status_update_holds_no_secrets(tmp_path):
    """update_status writes a new reason (validation's verdicts): redacted in column and body."""
    from domain.ledger import Ledger

    cfg = ServingConfig(model="glm-5", gpu="B200", weights="fp8", tp_size=8)
    led = Ledger(tmp_path / "ledger.sqlite")
    try:
        led.append(Trial(run_id="r", seq=1, key="search:x", phase="search", status="keep",
                         config=cfg, reason="kept"))
        led.update_status("search:x", "discard", reason=f"replay failed: {SECRET_TEXT}")
    finally:
        led.close()
    db = sqlite3.connect(tmp_path / "ledger.sqlite")
    try:
        dump = "\n".join(str(row) for row in db.execute("SELECT reason, body FROM trials"))
    finally:
        db.close()
    assert leaks(dump) == [] and "[REDACTED" in dump


def test_cli_lessons_query_prints_brackets_as_text(tmp_path):
    """A lesson's words are never Rich markup in `lessons query` (as in `lessons list`)."""
    data = secret_lesson()
    data["title"] = "[kv_cache_dtype=fp8_e4m3] refused on [bold]B200[/bold]"
    with LessonStore(tmp_path / "lessons", embedding="hashing") as s:
        seed_raw(s, data)
    query = cli("lessons", "query", "fa3 refused", tmp=tmp_path)
    assert query.returncode == 0, query.stderr
    assert data["title"] in query.stdout


def test_report_lessons_section_is_redacted():
    from servetune.report.agents import _lessons_section

    text = "\n".join(_lessons_section([Lesson.model_validate(secret_lesson())]))
    assert leaks(text) == [] and "[REDACTED" in text


# -- cluster server -----------------------------------------------------------------------------

class LeakyTwin(TwinBackend):
    """The twin, with an engine that prints a token into its log (as a misconfigured launch
    script would)."""

    def logs(self, name: str, replica: int | None = None) -> list[LogLine]:
        lines = super().logs(name, replica)
        return [*lines, LogLine(t=lines[-1].t, text=f"HF_TOKEN={HF} login ok"),
                LogLine(t=lines[-1].t, text=f"Authorization: Bearer {BEARER}")]

    def events(self, name: str | None = None) -> list[Event]:
        evs = super().events(name)
        return [*evs, Event(t=evs[-1].t, type="Warning", reason="Failed", object="d1",
                            message=f"exited: {SECRET_TEXT}")]

    def status(self, name: str):  # noqa: ANN201
        st = super().status(name)
        return st.model_copy(update={"message": f"last line: api_key='{TOKEN}' {GITHUB}"})


async def test_cluster_logs_events_and_status_are_redacted():
    backend = LeakyTwin("team-a")
    cfg = {"model": "glm-5", "gpu": "B200", "tp_size": 8, "weights": "nvfp4"}
    async with Client(cluster_server(backend)) as c:
        assert not (await c.call_tool("deploy", {"name": "d1", "config": cfg})).is_error
        logs = await c.call_tool("get_logs", {"name": "d1", "tail": 5})
        events = await c.call_tool("get_events", {"name": "d1"})
        status = await c.call_tool("get_status", {"name": "d1"})
    for r in (logs, events, status):
        assert not r.is_error, r.content[0].text
        dump = json.dumps(r.structured_content)
        assert leaks(dump) == [] and BEARER not in dump and TOKEN not in dump \
            and GITHUB not in dump, dump
    assert logs.structured_content["lines"][-2] == (
        "HF_TOKEN=[REDACTED:huggingface-token] login ok")


def test_record_store_files_hold_no_secrets(tmp_path):
    store = RecordStore(tmp_path / "state")
    store.write("d1", {"name": "d1", "events": [{"message": f"replica 0 exited: {SECRET_TEXT}"}],
                       "config": {"model": "glm-5"}, "note": f"Bearer {BEARER}"})
    text = (tmp_path / "state" / "d1.json").read_text()
    assert leaks(text) == [] and BEARER not in text and "[REDACTED" in text
    rec = store.read("d1")
    assert rec is not None and rec["config"] == {"model": "glm-5"} and rec["name"] == "d1"


@pytest.mark.parametrize("text", [
    pytest.param("x." * 30_000 + "password: x", id="dotted-name"),
    pytest.param("x." * 30_000 + "://alice:pw@host/", id="dotted-scheme"),
    pytest.param("a_" * 50_000 + "token=x", id="underscored-name"),
])
def test_redaction_of_a_long_identifier_takes_linear_time(text):
    """A 60 KB run of ``x.x.x...`` took 60 s before (the name pattern retried every start)."""
    import time

    from domain.redact import redact

    start = time.perf_counter()
    redact(text)
    assert time.perf_counter() - start < 2.0
