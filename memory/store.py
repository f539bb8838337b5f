"""The persistent lesson store: one ChromaDB collection of :class:`~domain.lesson.Lesson` records.

Each record keeps the whole lesson as JSON in its metadata (the schema of record is the pydantic
model, not chroma's columns) plus flat copies of the fields that ``where`` filters need. The
embedded text is ``Lesson.document()``.

Scope filters mean "lessons that apply to": asking for ``gpu="B200"`` returns lessons scoped to
B200 *and* lessons whose scope leaves the GPU open (``None`` = any GPU). To express "open" in a
store that cannot hold ``None``, each scope field ``f`` is stored as ``f`` when set and as
``any_f=True`` when not.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import chromadb
from chromadb.api.types import Documents, EmbeddingFunction
from chromadb.config import Settings
from chromadb.errors import ChromaError, NotFoundError
from pydantic import ValidationError

from domain.config import ServingConfig
from domain.errors import ServetuneError
from domain.lesson import FORBIDDING, STORED, Lesson
from domain.provenance import Contradiction, Status
from memory.embeddings import KIND_BY_NAME, EmbeddingKind, default_embedding
from memory.markdown import lessons_markdown

log = logging.getLogger(__name__)

__all__ = ["LessonStore", "StoreUnavailable", "UnknownLesson", "lessons_markdown"]

COLLECTION = "lessons"
SCOPE_FIELDS = ("gpu", "model", "quantization", "engine", "engine_version")
EXACT_FIELDS = ("outcome", "failure_class", "source", "run_id")
MAX_EVIDENCE_CHARS = 4000



_warned: set[str] = set()  # ids of defective lessons already logged by this process


def _decode(meta: Any) -> Lesson | None:
    """The lesson stored in ``meta``, or None (logged) if it no longer validates.

    A store written by an older servetune, or edited by hand, may hold a lesson that today's
    schema refuses; skipping it keeps every other lesson readable. A lesson whose condition
    names no family (``Lesson.defect``: true for every config, a value outside its field's
    domain) is kept, so it can be listed and removed, but it forbids nothing. Its text is
    redacted on the way out like every lesson's (domain/redact.py).
    """
    try:
        return Lesson.model_validate_json(str(meta["lesson"]), context=STORED)
    except (ValidationError, KeyError) as e:
        log.warning("skipping an unreadable lesson %s: %s", meta.get("id", "?"),
                    str(e).splitlines()[0])
        return None

class UnknownLesson(ValueError):
    """No lesson with this id is stored (``ValueError``: the lessons server's tool error)."""

    def __init__(self, lesson_id: str, path: Path | str) -> None:
        self.lesson_id = lesson_id
        super().__init__(f"no lesson {lesson_id!r} in {path}; list the ids with "
                         "`servetune lessons list` (or the list_lessons tool)")


class StoreUnavailable(ServetuneError):
    """The lesson store cannot be opened or used.

    Attributes:
        path: The store directory.
        reason: What is wrong and what to do about it.
    """

    def __init__(self, path: Path | str, reason: str) -> None:
        self.path, self.reason = str(path), reason
        super().__init__(f"lesson store {self.path}: {reason}")


def _flat_metadata(lesson: Lesson, seq: int) -> dict[str, Any]:
    meta: dict[str, Any] = {"lesson": lesson.model_dump_json(), "seq": seq,
                            "forbidding": lesson.outcome in FORBIDDING}
    for field in SCOPE_FIELDS:
        value = getattr(lesson.scope, field)
        if value is None:
            meta[f"any_{field}"] = True
        else:
            meta[field] = value
    for field in EXACT_FIELDS:
        value = getattr(lesson, field)
        if value is not None:
            meta[field] = value
    return meta


def _and(clauses: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not clauses:
        return None
    return clauses[0] if len(clauses) == 1 else {"$and": clauses}


def _clauses(**filters: str | None) -> list[dict[str, Any]]:
    """Chroma ``where`` clauses for the given filters (None values are ignored).

    Raises:
        ValueError: for a filter name that is neither a scope nor an exact field.
    """
    clauses: list[dict[str, Any]] = []
    for field, value in filters.items():
        if value is None:
            continue
        if field in SCOPE_FIELDS:
            clauses.append({"$or": [{field: value}, {f"any_{field}": True}]})
        elif field in EXACT_FIELDS:
            clauses.append({field: value})
        else:
            raise ValueError(f"unknown lesson filter {field!r}; use one of "
                             f"{', '.join(SCOPE_FIELDS + EXACT_FIELDS)}")
    return clauses


def _merge(old: Lesson, new: Lesson) -> Lesson:
    """The stored lesson after ``new`` repeats the finding ``old`` already holds (same id).

    The newer wording wins; the first run and trial that found it are kept; distinct evidence is
    appended (capped at MAX_EVIDENCE_CHARS). The first provenance is kept, noting the new run
    among its further runs; the stored status, its history and the contradictions are kept (a
    repeat of a quarantined finding does not make it active again: ``restore`` does). A
    source-verified repeat makes the lesson verified.
    """
    evidence = old.evidence
    if new.evidence.strip() and new.evidence.strip() not in old.evidence:
        evidence = f"{old.evidence}\n---\n{new.evidence}"[:MAX_EVIDENCE_CHARS]
    provenance = old.provenance or new.provenance
    if provenance is not None and old.provenance is not None:
        again = new.provenance.run_id if new.provenance is not None else new.run_id
        provenance = provenance.seen_again(again)
    return new.model_copy(update={
        "id": old.id,
        "run_id": old.run_id or new.run_id,
        "trial_id": old.trial_id or new.trial_id,
        "failure_class": new.failure_class or old.failure_class,
        "evidence": evidence,
        "verified": old.verified or new.verified,
        "source_site": new.source_site if new.verified else (old.source_site or new.source_site),
        "provenance": provenance,
        "status": old.status,
        "history": old.history,
        "contradictions": old.contradictions,
    })


class LessonStore:
    """Lessons in a ChromaDB persistent collection (cosine space) on a local directory.

    Usable as a context manager; :meth:`close` releases the SQLite files.
    """

    def __init__(self, path: Path | str,
                 embedding: EmbeddingKind | EmbeddingFunction[Documents] = "auto") -> None:
        """Open (or create) the store.

        Args:
            path: store directory; created with its parents if missing.
            embedding: ``"auto"`` (reuse the embedding the store was built with, else MiniLM if
                installed, else hashing), ``"minilm"``, ``"hashing"``, or an embedding function.

        Raises:
            StoreUnavailable: the path is a file, the directory cannot be created or read, the
                store is corrupt, or it was built with a different embedding than requested.
        """
        self.path = Path(path).expanduser()
        if self.path.exists() and not self.path.is_dir():
            raise StoreUnavailable(self.path, "the path is a file, not a directory; pass a "
                                   "directory (it is created if missing) or move the file away")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._client = chromadb.PersistentClient(
                path=str(self.path), settings=Settings(anonymized_telemetry=False))
        except (OSError, ChromaError) as e:
            raise StoreUnavailable(self.path, f"cannot open the store ({e}); check the directory's "
                                   "permissions, or point to a fresh directory") from e
        try:
            ef = self._choose_embedding(embedding)
            self._collection = self._client.get_or_create_collection(
                COLLECTION, configuration={"hnsw": {"space": "cosine"}}, embedding_function=ef)
        except StoreUnavailable:
            self._client.close()
            raise
        except (ChromaError, OSError, ValueError) as e:
            self._client.close()
            raise StoreUnavailable(self.path, f"cannot open collection {COLLECTION!r} ({e}); "
                                   "the store may be corrupt: move it away and start afresh") from e
        self.embedding = ef
        log.debug("lesson store %s open (%s, %d lessons)", self.path, ef.name(), self.count())

    def _choose_embedding(
        self, embedding: EmbeddingKind | EmbeddingFunction[Documents]
    ) -> EmbeddingFunction[Documents]:
        try:
            existing = self._client.get_collection(COLLECTION)
        except NotFoundError:
            existing = None
        persisted = existing.configuration.get("embedding_function") if existing else None
        built_with = persisted.name() if persisted is not None else None
        try:
            if embedding == "auto" and built_with in KIND_BY_NAME:
                return default_embedding(KIND_BY_NAME[built_with])
            ef = default_embedding(embedding) if isinstance(embedding, str) else embedding
        except ValueError as e:
            raise StoreUnavailable(self.path, str(e)) from e
        if built_with is not None and built_with != ef.name():
            kind = KIND_BY_NAME.get(built_with, built_with)
            raise StoreUnavailable(self.path, f"it was built with embedding {built_with!r} and "
                                   f"cannot be searched with {ef.name()!r}; open it with "
                                   f"embedding={kind!r} (or 'auto'), or use a fresh directory")
        return ef

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Release the underlying client (idempotent)."""
        self._client.close()

    def __enter__(self) -> LessonStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _guard(self, action: str) -> Iterator[None]:
        try:
            yield
        except ChromaError as e:
            raise StoreUnavailable(self.path, f"{action} failed ({e}); check that the store "
                                   "directory still exists and is writable") from e

    # -- reads -------------------------------------------------------------------------------

    def count(self) -> int:
        """Number of stored lessons."""
        with self._guard("count"):
            return self._collection.count()

    def _fetch(self, where: dict[str, Any] | None = None,
               ids: list[str] | None = None) -> list[tuple[int, Lesson]]:
        with self._guard("read"):
            got = self._collection.get(ids=ids, where=where, include=["metadatas"])
        rows = [(int(m["seq"]), lesson) for m in got["metadatas"] or []
                if (lesson := _decode(m)) is not None]
        rows.sort(key=lambda r: (r[0], r[1].id))
        return rows

    def get(self, lesson_id: str) -> Lesson | None:
        """The lesson with this id, or None."""
        rows = self._fetch(ids=[lesson_id])
        return rows[0][1] if rows else None

    def list(self, *, gpu: str | None = None, model: str | None = None,
             quantization: str | None = None, engine: str | None = None,
             engine_version: str | None = None, outcome: str | None = None,
             failure_class: str | None = None, source: str | None = None,
             run_id: str | None = None, limit: int | None = None,
             offset: int = 0) -> list[Lesson]:
        """Lessons in insertion order, filtered.

        Args:
            gpu: scope filter (GPU catalog key); a lesson matches if its scope names this value
                or leaves the field open. The same holds for the next four.
            model: scope filter, model catalog key.
            quantization: scope filter, checkpoint key (``ServingConfig.weights``).
            engine: scope filter, e.g. ``"sglang"``.
            engine_version: scope filter, e.g. ``"0.5.23"``.
            outcome: exact-match filter, e.g. ``"oom"``.
            failure_class: exact-match filter, e.g. ``"OOM_WEIGHTS"``.
            source: exact-match filter: trial, estimate, research or user.
            run_id: exact-match filter: the run that first found the lesson.
            limit: at most this many lessons (None = all).
            offset: skip this many matching lessons first (for paging).

        Returns:
            The matching lessons, oldest first (ties by id).
        """
        where = _and(_clauses(gpu=gpu, model=model, quantization=quantization, engine=engine,
                              engine_version=engine_version, outcome=outcome,
                              failure_class=failure_class, source=source, run_id=run_id))
        lessons = [lesson for _, lesson in self._fetch(where=where)]
        end = None if limit is None else offset + max(limit, 0)
        return lessons[max(offset, 0):end]

    def query(self, text: str, k: int = 5, **filters: str | None) -> list[tuple[Lesson, float]]:
        """Semantic search.

        Args:
            text: what to look for, in words.
            k: at most this many results.
            **filters: the filters of :meth:`list` (gpu, model, quantization, engine,
                engine_version, outcome, failure_class, source, run_id).

        Returns:
            ``(lesson, score)`` pairs, best first; score is the cosine similarity clipped to
            0..1 (1 = same direction).

        Raises:
            ValueError: for an unknown filter name or k < 1.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        where = _and(_clauses(**filters))
        total = self.count()
        if total == 0:
            return []
        with self._guard("query"):
            got = self._collection.query(query_texts=[text], n_results=min(k, total),
                                         where=where, include=["metadatas", "distances"])
        metas = (got["metadatas"] or [[]])[0]
        dists = (got["distances"] or [[]])[0]
        out = [(lesson, round(min(1.0, max(0.0, 1.0 - float(d))), 4))
               for m, d in zip(metas, dists, strict=True) if (lesson := _decode(m)) is not None]
        out.sort(key=lambda pair: -pair[1])  # stable: chroma's order among equal scores
        return out

    def covering(self, config: ServingConfig) -> list[tuple[int, Lesson]]:
        """``(seq, lesson)`` of every lesson whose family covers ``config``, any status.

        Candidates are narrowed by scope metadata in the store (not by engine version: a
        source-verified lesson of another version covers ``config`` when its guard is unchanged
        in ``config``'s, ``Lesson.carries_to``); the scope and condition are checked with
        ``Lesson.covers``. Oldest first. A lesson whose condition names no family
        (``Lesson.defect``) is ignored, with a warning logged once per lesson.
        """
        where = _and([{"forbidding": True}, *_clauses(
            gpu=config.gpu, model=config.model, quantization=config.weights,
            engine=config.engine)])
        out = []
        for seq, lesson in self._fetch(where=where):
            defect = lesson.defect()
            if defect is not None:
                if lesson.id not in _warned:
                    _warned.add(lesson.id)
                    log.warning("ignoring lesson %s of %s: %s", lesson.id, self.path, defect)
            elif lesson.covers(config):
                out.append((seq, lesson))
        return out

    def forbidding(self, config: ServingConfig, backend: str | None = None) -> list[Lesson]:
        """Every lesson that keeps a study on ``backend`` from launching ``config``.

        Active lessons whose family covers ``config`` (:meth:`covering`), oldest first; on a
        real backend (local, kubernetes) only those that may prune it
        (``Lesson.applies_on``: twin-learned lessons need to be source-verified). Quarantined
        and retracted lessons forbid nothing.
        """
        return [lesson for _, lesson in self.covering(config)
                if lesson.prunes(config, backend)]

    def set_status(self, lesson_id: str, status: Status, reason: str, by: str) -> Lesson:
        """Mark a stored lesson ``status`` (quarantined, retracted, or active again).

        Args:
            lesson_id: the lesson's id.
            status: the new status.
            reason: why (required; kept in the lesson's history).
            by: who or what, e.g. ``operator (cli)``.

        Returns:
            The lesson as stored now (unchanged when it already has ``status``, or when asked
            to quarantine a retracted lesson: only ``active`` undoes a retraction).

        Raises:
            UnknownLesson: no lesson has this id.
            ValueError: an empty reason.
            StoreUnavailable: the store cannot be written.
        """
        rows = self._fetch(ids=[lesson_id])
        if not rows:
            raise UnknownLesson(lesson_id, self.path)
        seq, lesson = rows[0]
        if lesson.status == status or (status == "quarantined" and lesson.status == "retracted"):
            return lesson
        lesson = lesson.with_status(status, reason, by)
        self._write(lesson, seq)
        return lesson

    def contradict(self, config: ServingConfig, measurement: Contradiction) -> list[Lesson]:
        """Record that ``config`` ran and served; quarantine the active lessons it contradicts.

        Each lesson whose family covers ``config`` and against which the measurement weighs
        (``Contradiction.weighs_against``: a twin measurement does not overrule a lesson
        learned on a real backend) gets the measurement among its ``contradictions`` (once
        per run and trial) and, when active, the status ``quarantined``.

        Returns:
            The lessons quarantined by this call (already quarantined ones are not repeated).

        Raises:
            StoreUnavailable: the store cannot be read or written.
        """
        quarantined = []
        for seq, lesson in self.covering(config):
            if not measurement.weighs_against(lesson.provenance):
                continue
            known = {(c.run_id, c.trial) for c in lesson.contradictions}
            if (measurement.run_id, measurement.trial) in known and lesson.status != "active":
                continue
            updated = lesson
            if (measurement.run_id, measurement.trial) not in known:
                updated = lesson.model_copy(
                    update={"contradictions": [*lesson.contradictions, measurement]})
            if updated.status == "active":
                where = " ".join(x for x in (measurement.backend, "run", measurement.run_id,
                                             "trial", measurement.trial) if x)
                updated = updated.with_status(
                    "quarantined", f"contradicted: config {measurement.config_id} ran and "
                    f"served ({where}): {measurement.evidence}".strip().rstrip(":"),
                    by=f"measurement ({measurement.backend})", at=measurement.at)
                quarantined.append(updated)
            self._write(updated, seq)
        return quarantined

    # -- writes ------------------------------------------------------------------------------

    def add(self, lesson: Lesson) -> Lesson:
        """Store a lesson; a lesson with the same id is merged instead of duplicated.

        Args:
            lesson: the lesson; its id is computed with ``with_id()`` when empty.

        Returns:
            The lesson as stored (merged with the earlier one when the id existed: newer wording,
            first run_id/trial_id kept, distinct evidence appended).

        Raises:
            ValueError: the lesson's condition names no family of configs (``Lesson.defect``).
        """
        if (defect := lesson.defect()) is not None:
            raise ValueError(defect)
        if not lesson.id:
            lesson = lesson.with_id()
        rows = self._fetch(ids=[lesson.id])
        if rows:
            seq, old = rows[0]
            lesson = _merge(old, lesson)
        else:
            seq = self.count()
        self._write(lesson, seq)
        return lesson

    def _write(self, lesson: Lesson, seq: int) -> None:
        with self._guard("write"):
            self._collection.upsert(ids=[lesson.id], documents=[lesson.document()],
                                    metadatas=[_flat_metadata(lesson, seq)])

    def add_many(self, lessons: Iterable[Lesson]) -> list[Lesson]:
        """:meth:`add` each lesson in turn; returns the stored lessons."""
        return [self.add(lesson) for lesson in lessons]

    # -- export ------------------------------------------------------------------------------

    def export_markdown(self, lessons: Iterable[Lesson] | None = None) -> str:
        """A SKILL.md-style Markdown document, one section per lesson (all lessons by default)."""
        return lessons_markdown(self.list() if lessons is None else lessons)
