"""SGLang versions (domain/engines/sglang/versions.py, flags.py, carry.py): which versions exist,
their flag inventories, renamed and removed flags, the derived-default rules per version and
whether a source-verified lesson carries from one version to another."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fixtures.cli import tiny_study
from fixtures.pinned_source import pinned_tree_path

from domain.config import ServingConfig
from domain.engines import engine
from domain.engines.sglang import carry, flags, versions
from domain.engines.sglang.cmdline import parse
from domain.errors import ConfigInvalid, UnknownFlag
from domain.fit import (
    default_chunked_prefill,
    default_decode_graph_bs,
    default_mem_fraction,
    fit,
    prefill_capture_sizes,
    resolve_max_running_requests,
)
from domain.hardware import get_gpu
from domain.lesson import Clause, Lesson, Scope
from domain.models import get_model
from domain.study import parse_study
from mcp_servers.source.inventory import cli_data, retired_flags

DATA = versions.DATA_DIR
UNKNOWN = "0.5.17"  # no inventory ships for it, and the tests never fetch one


def entries(version: str) -> list[dict]:
    return json.loads((DATA / f"sglang-{version}-flags.json").read_text())["flags"]


def config(version: str, **over) -> ServingConfig:
    return ServingConfig(engine_version=version, model="llama-3.1-8b", gpu="H100",
                         weights="bf16", **over)


@pytest.fixture
def engine_data(tmp_path, monkeypatch) -> Path:
    """An empty user engine data dir, so no inventory fetched on this machine is seen."""
    monkeypatch.setenv("SERVETUNE_ENGINE_DATA", str(tmp_path / "engines"))
    return tmp_path / "engines"


# ------------------------------------------------------------------ which versions exist


def test_three_versions_ship_with_their_inventories_and_cli_data():
    assert {"0.5.9", "0.5.19", "0.5.23"} <= set(versions.available())
    assert versions.available()[:3] == ("0.5.9", "0.5.19", "0.5.23")  # release order
    # flag counts of the argparse parsers of the wheels (servetune's shared reference)
    assert [len(entries(v)) for v in ("0.5.9", "0.5.19", "0.5.23")] == [331, 503, 531]
    for v in ("0.5.9", "0.5.19", "0.5.23"):
        assert versions.data_path(v, "cli") is not None
        assert "static parse" in json.loads((DATA / f"sglang-{v}-flags.json").read_text()
                                            )["source"] or v == "0.5.23"


def test_an_unknown_version_is_one_line_naming_the_fetch_command(engine_data):
    with pytest.raises(ValueError) as e:
        config(UNKNOWN)
    msg = str(e.value)
    assert f"SGLang {UNKNOWN} has no flag inventory here (have: 0.5.9, 0.5.19, 0.5.23" in msg
    assert f"`servetune source fetch --version {UNKNOWN}`" in msg
    with pytest.raises(UnknownFlag, match="servetune source fetch --version 0.5.17"):
        flags.flag_inventory(UNKNOWN)


def test_a_fetched_inventory_makes_a_version_usable_with_the_nearest_rules(engine_data):
    engine_data.mkdir()
    for kind in ("flags", "cli"):  # what `servetune source fetch --version 0.5.18` writes
        shutil.copy(DATA / f"sglang-0.5.19-{kind}.json", engine_data / f"sglang-0.5.18-{kind}.json")
    assert "0.5.18" in versions.available()
    c = config("0.5.18", cuda_graph_max_bs_decode=64)
    assert engine("sglang", "0.5.18").argv(c)[-2:] == ["--cuda-graph-max-bs-decode", "64"]
    note = engine("sglang", "0.5.18").rules_note()
    assert note is not None and note.startswith(
        "SGLang derived defaults: rules of 0.5.19 used for 0.5.18")
    assert engine("sglang", "0.5.19").rules_note() is None
    found = parse(["sglang", "serve", "--model-path", "x"], "0.5.18").findings
    assert [f.message for f in found if f.code == "NEAREST_VERSION_RULES"] == [note]


@pytest.mark.parametrize(("version", "rules"), [
    ("0.5.9", "0.5.9"), ("0.5.19", "0.5.19"), ("0.5.23", "0.5.23"), (None, "0.5.23"),
    ("0.5.17", "0.5.19"), ("0.5.14", "0.5.19"),  # a tie goes to the newer
    ("0.5.12", "0.5.9"), ("0.5.2", "0.5.9"), ("0.5.30", "0.5.23"), ("0.5.23.post1", "0.5.23"),
    ("0.6.1", "0.5.23"), ("0.4.0", "0.5.9"),
])
def test_nearest_modelled_version(version, rules):
    assert versions.rules_version(version) == rules
    assert versions.is_exact(version) == (rules == (version or "0.5.23"))


# ------------------------------------------------------------------ derived defaults


def test_memory_tiers_per_version_as_each_wheel_states_them():
    old, new = versions.RULES["0.5.9"], versions.RULES["0.5.23"]
    assert versions.RULES["0.5.19"].chunked_tiers == old.chunked_tiers
    # 32 GiB (RTX 5090): 0.5.9 / 0.5.19 2k chunks and decode graphs 24 / 80; 0.5.23 4k, 48 / 160
    assert (old.chunked_prefill(32), old.decode_graph_bs(32, 1), old.decode_graph_bs(32, 4)) == \
        (2048, 24, 80)
    assert (new.chunked_prefill(32), new.decode_graph_bs(32, 1), new.decode_graph_bs(32, 4)) == \
        (4096, 48, 160)
    for r in (old, new):  # the other tiers agree
        assert [r.chunked_prefill(g) for g in (16, 40, 80, 141, 180)] == \
            [2048, 4096, 8192, 8192, 16384]
        assert [r.decode_graph_bs(g, 8) for g in (16, 40, 80, 141, 180)] == [8, 160, 512, 512, 512]
        assert all(":" in s for s in r.source.values())  # file:line of every rule


def test_fit_reads_the_tiers_of_the_config_version():
    rtx = get_gpu("H100").model_copy(update={"hbm_gb": 32e9 / 1e9 * 1.0})  # 29.8 GiB
    assert default_chunked_prefill(rtx, "0.5.9") == 2048
    assert default_chunked_prefill(rtx) == default_chunked_prefill(rtx, "0.5.23") == 4096
    assert default_decode_graph_bs(rtx, 1, "0.5.19") == 24
    assert default_decode_graph_bs(rtx, 1) == 48


def test_mem_fraction_reserve_per_version_hand_computed():
    llama, h100 = get_model("llama-3.1-8b"), get_gpu("H100")
    m = h100.hbm_mib
    # 0.5.9: 512 + 1.5 x 8192 + 1/8 x 1024 + 2 x 256, no prefill-graph term (server_args.py:1020)
    base = 512 + 1.5 * 8192 + 128 + 512
    assert default_mem_fraction(llama, h100, 1, 8192, 256, "0.5.9") == round((m - base) / m, 3)
    # 0.5.19 and 0.5.23: + 8 MiB per captured prefill size (58 for 8192 tokens)
    assert len(prefill_capture_sizes(8192)) == 58
    for v in ("0.5.19", "0.5.23"):
        assert default_mem_fraction(llama, h100, 1, 8192, 256, v) == \
            round((m - base - 8 * 58) / m, 3)
    # 0.5.9 EAGLE-like speculation reserves 2 GiB more, STANDALONE 6 GiB, NGRAM nothing
    for alg, extra in (("EAGLE", 2048), ("STANDALONE", 6144), ("NGRAM", 0)):
        assert default_mem_fraction(llama, h100, 1, 8192, 256, "0.5.9", alg) == \
            round((m - base - extra) / m, 3)
    assert default_mem_fraction(llama, h100, 1, 8192, 256, "0.5.23", "EAGLE") == \
        default_mem_fraction(llama, h100, 1, 8192, 256, "0.5.23")


def test_explicit_max_running_requests_per_version():
    # 0.5.9 takes it as given (model_runner.py:593-600), 0.5.19 bounds it by the pool
    # (kv_cache_configurator.py:2115), 0.5.23 also raises 0 to 1
    assert resolve_max_running_requests(5000, 3000, 131_072, False, "0.5.9") == 5000
    assert resolve_max_running_requests(5000, 3000, 131_072, False, "0.5.19") == 1500
    assert resolve_max_running_requests(0, 3000, 131_072, False, "0.5.19") == 0
    assert resolve_max_running_requests(0, 3000, 131_072, False, "0.5.23") == 1
    for v in ("0.5.9", "0.5.19", "0.5.23"):  # unset: the same estimate in all three
        assert resolve_max_running_requests(None, 400_000, 32_768, False, v) == 4096


def test_only_0_5_23_lowers_the_default_graph_batch_to_max_running_requests():
    new, old = fit(config("0.5.23", max_running_requests=64)), \
        fit(config("0.5.19", max_running_requests=64))
    assert new.cuda_graph_max_bs_decode == old.cuda_graph_max_bs_decode == 64  # captured
    m = get_gpu("H100").hbm_mib
    # the reserve: 2 x 64 in 0.5.23 (memory_hook.py:182-188), 2 x 256 in 0.5.19
    assert round(old.mem_fraction_static - new.mem_fraction_static, 3) == \
        round(-2 * (256 - 64) / m, 3)


# ------------------------------------------------------------------ flags across versions


def test_renamed_flags_are_spelled_the_version_s_way():
    assert engine("sglang", "0.5.9").argv(config("0.5.9", cuda_graph_max_bs_decode=64))[4:] == \
        ["--tp-size", "1", "--cuda-graph-max-bs", "64"]
    assert flags.renamed_dest("tp_size", "0.5.9") == "tensor_parallel_size"
    assert flags.renamed_dest("cuda_graph_max_bs_decode", "0.5.9") == "cuda_graph_max_bs"
    assert flags.renamed_dest("tp_size", "0.5.23") is None
    # 0.5.19's deprecated alias never hides the flag it stands for
    assert flags.flag_for("cuda_graph_max_bs_decode", "0.5.19") == "--cuda-graph-max-bs-decode"


def test_a_knob_the_version_lacks_is_one_line_naming_where_it_exists():
    line = (r"speculative_adaptive: SGLang 0\.5\.9 has no such flag "
            r"\(--speculative-adaptive exists in 0\.5\.19, 0\.5\.23\)")
    with pytest.raises(ValueError, match=line):
        config("0.5.9", speculative_algorithm="NEXTN", speculative_adaptive=True)
    with pytest.raises(ConfigInvalid) as e:
        parse_study(tiny_study(engine_version="0.5.9",
                               knobs={"speculative": ["off", "nextn_adaptive"]})).validate_space()
    assert e.value.violations == [
        "knobs.speculative: 'nextn_adaptive' is invalid: speculative_adaptive: SGLang 0.5.9 has "
        "no such flag (--speculative-adaptive exists in 0.5.19, 0.5.23)"]


def test_a_flag_removed_after_0_5_23_names_its_successor_or_says_drop_it(engine_data):
    """A fetched 0.5.30 that renamed --hicache-ratio and dropped --enable-hierarchical-cache."""
    new = [dict(f) for f in entries("0.5.23") if f["dest"] != "enable_hierarchical_cache"]
    for f in new:
        if f["dest"] == "hicache_ratio":
            f["flags"] = ["--hicache-size-ratio"]
    older = {v: entries(v) for v in ("0.5.9", "0.5.19", "0.5.23")}
    engine_data.mkdir()
    (engine_data / "sglang-0.5.30-flags.json").write_text(json.dumps({"flags": new}))
    (engine_data / "sglang-0.5.30-cli.json").write_text(
        json.dumps(cli_data("0.5.30", new, older, "test")))
    cfg = config("0.5.30", hicache_ratio=2.0)
    assert engine("sglang", "0.5.30").argv(cfg)[-2:] == ["--hicache-size-ratio", "2.0"]
    with pytest.raises(ValueError, match=r"enable_hierarchical_cache: --enable-hierarchical-cache "
                                         r"was removed in SGLang 0\.5\.30 \(last in 0\.5\.23\); "
                                         r"it names no successor; drop it"):
        config("0.5.30", enable_hierarchical_cache=True)
    found = parse(["sglang", "serve", "--model-path", "x", "--hicache-ratio", "2"],
                  "0.5.30").findings
    assert [(f.code, f.fix) for f in found if f.code == "RETIRED_FLAG"] == [
        ("RETIRED_FLAG", "use --hicache-size-ratio (SGLang 0.5.23 registered --hicache-ratio as "
                         "its deprecated alias)")]


def test_generated_retired_flags_match_the_curated_0_5_23_data():
    """The 0.5.23 cli data was written by hand; the generator rebuilds it from the inventories."""
    curated = json.loads((DATA / "sglang-0.5.23-cli.json").read_text())["retired"]
    built = retired_flags("0.5.23", entries("0.5.23"),
                          {"0.5.9": entries("0.5.9"), "0.5.19": entries("0.5.19")})
    assert built == curated
    assert len(built) == 49
    assert built["--cuda-graph-max-bs"]["successor"] == "--cuda-graph-max-bs-decode"


def test_check_reads_a_0_5_9_and_a_0_5_19_command_with_their_spellings():
    p = parse(["sglang", "serve", "--model-path", "meta-llama/Llama-3.1-8B-Instruct",
               "--tp-size", "2", "--cuda-graph-max-bs", "64"], "0.5.9")
    assert p.fields["tp_size"] == 2 and p.fields["cuda_graph_max_bs_decode"] == 64
    assert not [f for f in p.findings if f.severity == "refuse"]
    dep = [f for f in parse(["sglang", "serve", "--model-path", "x", "--cuda-graph-max-bs", "64"],
                            "0.5.19").findings if f.code == "DEPRECATED_FLAG"]
    assert [f.fix for f in dep] == ["use --cuda-graph-max-bs-decode"]  # its new_flag=
    gone = [f for f in parse(["sglang", "serve", "--model-path", "x", "--cuda-graph-max-bs", "64"],
                             "0.5.23").findings if f.code == "RETIRED_FLAG"]
    assert gone[0].severity == "refuse" and "--cuda-graph-max-bs-decode" in gone[0].fix


# ------------------------------------------------------------------ lessons across versions

SITE = "sglang/srt/managers/tp_worker.py:420"  # assert ... max_running_requests > 0 (0.5.23)


def verified_lesson(**extra) -> Lesson:
    return Lesson(title="zero requests", scope=Scope(gpu="H100", engine_version="0.5.23"),
                  condition=[Clause(field="max_running_requests", op="le", value=4)],
                  outcome="crash", root_cause="x", fix="y", evidence="max_running_request is "
                  "zero", verified=True, source_site=SITE, **extra).with_id()


def two_trees(tmp: Path, pinned: Path, edit) -> None:
    """``tmp/sglang-0.5.23`` -> the pinned tree; ``tmp/sglang-0.5.19`` holds its tp_worker.py
    shifted down three lines (and changed by ``edit``)."""
    (tmp / "sglang-0.5.23").symlink_to(pinned)
    rel = SITE.rpartition(":")[0]
    dest = tmp / "sglang-0.5.19" / rel
    dest.parent.mkdir(parents=True)
    dest.write_text("\n\n\n" + edit((pinned / rel).read_text()))


@pytest.fixture(scope="module")
def pinned() -> Path:
    return pinned_tree_path()


def test_a_verified_lesson_carries_when_its_guard_is_unchanged(tmp_path, monkeypatch, pinned):
    monkeypatch.setenv("SERVETUNE_SOURCE_CACHE", str(tmp_path))
    two_trees(tmp_path, pinned, lambda text: text)
    assert carry.guard_at(pinned, SITE) == \
        "assert self.model_runner.max_running_requests > 0"
    les = verified_lesson()
    ok, why = les.carries_to("0.5.19")
    assert ok and why == "guard unchanged at sglang/srt/managers/tp_worker.py:423 in SGLang 0.5.19"
    assert les.matches(config("0.5.19", max_running_requests=2))
    assert not les.matches(config("0.5.19", max_running_requests=8))
    ok, why = les.carries_to("0.5.9")  # no 0.5.9 tree under tmp_path
    assert not ok and "`servetune source fetch --version 0.5.9`" in why
    assert not les.matches(config("0.5.9", max_running_requests=2))


def test_a_changed_guard_or_an_unverified_lesson_does_not_carry(tmp_path, monkeypatch, pinned):
    monkeypatch.setenv("SERVETUNE_SOURCE_CACHE", str(tmp_path))
    two_trees(tmp_path, pinned,
              lambda t: t.replace("max_running_requests > 0", "max_running_requests >= 0"))
    ok, why = verified_lesson().carries_to("0.5.19")
    assert not ok and "changed or is gone in SGLang 0.5.19" in why
    plain = verified_lesson().model_copy(update={"verified": False})
    assert plain.carries_to("0.5.19") == (False, "learned on sglang 0.5.23 and not "
                                                 "source-verified: it applies to that version only")
    assert plain.carries_to("0.5.23")[0]


def test_the_lesson_tree_cache_is_the_source_fetch_cache(monkeypatch, tmp_path):
    from domain.engines import source_cache_dir
    from mcp_servers.source.fetch import default_cache_dir

    for env in ({}, {"XDG_CACHE_HOME": str(tmp_path)}, {"SERVETUNE_SOURCE_CACHE": "/x/y"}):
        assert source_cache_dir(env) == default_cache_dir(env)


def test_report_and_lessons_show_say_which_rules_and_versions_apply(engine_data, tmp_path,
                                                                     monkeypatch):
    from servetune.cli_lessons import _versions_lines
    from servetune.report.sections import _version_note

    engine_data.mkdir()
    for kind in ("flags", "cli"):
        shutil.copy(DATA / f"sglang-0.5.19-{kind}.json", engine_data / f"sglang-0.5.16-{kind}.json")
    assert _version_note(parse_study(tiny_study())) == []
    note = _version_note(parse_study(tiny_study(engine_version="0.5.16")))
    assert note[0].startswith("**Warning**: SGLang derived defaults: rules of 0.5.19 used for "
                              "0.5.16 (modelled: 0.5.9, 0.5.19, 0.5.23)")
    monkeypatch.setenv("SERVETUNE_SOURCE_CACHE", str(tmp_path / "no-trees"))
    lines = _versions_lines(verified_lesson())
    assert lines[0] == "  versions:    learned on 0.5.23"
    assert "    0.5.9: does not apply: the guard cannot be compared without the source of " \
           "SGLang 0.5.23 and 0.5.9: run `servetune source fetch --version 0.5.23`; " \
           "`servetune source fetch --version 0.5.9`" in lines
