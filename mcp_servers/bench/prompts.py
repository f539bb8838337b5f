"""Prompts for HTTP benchmarks, built offline and before a run's clock starts.

**Tokens.** A prompt is a sequence of *words* from a tokenizer's word list, joined by single
spaces, where every word is exactly one token both at the start of a text and after a space. For
tokenizers that split text at spaces before merging (byte-level BPE as in GPT-2/Llama-3/Qwen,
SentencePiece/Metaspace as in Llama-2, WordPiece as in BERT) such a text of N words is exactly N
tokens plus the tokens the tokenizer adds to every text (a BOS, or BERT's [CLS]/[SEP]), so the
input length in tokens is exact. Two tokenizers, both offline (no hub access):

- :class:`WordTokenizer` (default): a fixed list of ~300 common English words. Exact for servers
  that count whitespace-separated words (the test stub, the twin server). For a real model's
  tokenizer every one of these words is a single token in the usual BPE vocabularies (with a
  leading space), so ISL is right to within the few tokens the server adds (BOS, chat
  template) -- the approximation when the model's tokenizer is not given.
- :class:`HFTokenizer`: a local ``tokenizer.json`` (Hugging Face ``tokenizers``) or a WordPiece
  ``vocab.txt`` (the project ships BERT-uncased's as ``memory/vocab.txt``). Its word list keeps
  only candidates that encode to one token alone and after a space, and a sample text is checked
  to encode to exactly its word count (else it is refused): with the served model's tokenizer the
  ISL is exact, BOS included. Requests go to ``/v1/completions``, so no chat template is added.

**Synthetic (saturation / fixed-rate) prompts** (:class:`SyntheticPrompts`): a per-request tag of
a few words (the request number in base ``len(words)``, so no two requests share a first token
and a radix cache gets no hits) and one shared random body.

**Trace prompts** (:class:`BlockPrompts`): one deterministic word block per hash id
(``block_size`` words, seeded by the id), concatenated in the request's hash order and cut to the
request's length. Requests that share leading hash ids therefore share exactly that prefix, as in
the trace (the technique aiperf uses for Mooncake replays; loadgen reference section 6).
:func:`expected_prefix_hits` gives the cached tokens an unbounded prefix cache would report for
them, the yardstick for a replay's achieved hit rate.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from domain.workload import Request
from mcp_servers.bench.http import PlannedRequest

# Common lowercase words that are single tokens (with a leading space) in the usual BPE
# vocabularies; no word contains JSON-special characters.
VOCAB: tuple[str, ...] = tuple("""
the of and to in is was for on that with as by at from his her are which this be or an had not
but were have they one their all has been its who more would will there time story model server
token cache prefix request latency throughput people year way day man thing woman life child
world school state family student group country problem hand part place case week company system
program question work government number night point home water room mother area money month lot
right study book eye job word business issue side kind head house service friend father power
hour game line end member law car city community name president team minute idea kid body
information back parent face others level office door health person art war history party result
change morning reason research girl guy moment air teacher force education foot boy age policy
process music market sense nation plan college interest death experience effect use class control
care field development role effort rate heart drug show leader light voice wife police mind price
report decision son view relationship town road arm difference value building action season
society tax director position player record paper space ground form event official matter center
couple site project activity star table need court oil situation cost industry figure street image
phone data picture practice piece land product doctor wall patient worker news test movie north
love support technology step baby computer type attention film tree source organization hair
window evidence population truth song energy""".split())
SHIPPED_WORDPIECE = Path(__file__).resolve().parents[2] / "memory" / "vocab.txt"
MAX_CANDIDATES = 8192
TAG_CAPACITY = 10_000_000  # distinct request tags a synthetic run can have


class PromptTokenizer(Protocol):
    """What prompt building needs from a tokenizer.

    Attributes:
        name: for reports (``words`` or the tokenizer file).
        words: words that are exactly one token each, alone and after a space.
        added_tokens: tokens the server adds to every prompt (BOS, [CLS]/[SEP]).
    """

    name: str
    words: tuple[str, ...]
    added_tokens: int

    def count(self, text: str) -> int:
        """Tokens of ``text`` as the server counts them, added tokens included."""
        ...


class WordTokenizer:
    """Whitespace words from :data:`VOCAB`: one word = one token, nothing added."""

    name = "words"
    added_tokens = 0

    def __init__(self, words: Sequence[str] = VOCAB) -> None:
        self.words = tuple(words)

    def count(self, text: str) -> int:
        """Whitespace-separated words of ``text``."""
        return len(text.split())


class HFTokenizer:
    """A local Hugging Face ``tokenizers`` tokenizer (no hub access).

    Args:
        path: a ``tokenizer.json``, a WordPiece ``vocab.txt`` (lower-cased, as BERT-uncased), or a
            folder holding either.
        sample_words: words of the exactness check.

    Raises:
        ValueError: a path that holds no tokenizer, a tokenizer with fewer than 2 one-token words,
            or one that does not tokenize space-separated words independently.
        ImportError: ``tokenizers`` is not installed (it comes with chromadb).
    """

    def __init__(self, path: str | Path, sample_words: int = 2000) -> None:
        import tokenizers

        p = Path(path)
        if p.is_dir():
            p = next((p / n for n in ("tokenizer.json", "vocab.txt") if (p / n).is_file()), p)
        if p.name.endswith(".json") and p.is_file():
            tok: Any = tokenizers.Tokenizer.from_file(str(p))
        elif p.name.endswith(".txt") and p.is_file():
            tok = tokenizers.BertWordPieceTokenizer(str(p), lowercase=True)
        else:
            raise ValueError(f"no tokenizer at {path} (want tokenizer.json or vocab.txt)")
        self._tok = tok
        self.name = str(p)
        self.added_tokens = (len(tok.encode("the", add_special_tokens=True).ids)
                             - len(tok.encode("the", add_special_tokens=False).ids))
        self.words = self._one_token_words()
        if len(self.words) < 2:
            raise ValueError(f"tokenizer {p} has fewer than 2 words that are one token each")
        rng = np.random.default_rng(0)
        sample = " ".join(self.words[i] for i in rng.integers(0, len(self.words), sample_words))
        got = len(tok.encode(sample, add_special_tokens=False).ids)
        if got != sample_words:
            raise ValueError(f"tokenizer {p} does not tokenize space-separated words one token "
                             f"each ({sample_words} words gave {got} tokens); prompts cannot "
                             "have exact token lengths with it")

    def _one_token_words(self) -> tuple[str, ...]:
        vocab = self._tok.get_vocab()
        cands = list(VOCAB)
        for token_id in sorted(vocab.values()):
            w = self._tok.decode([token_id]).strip()
            if 2 <= len(w) <= 12 and w.isascii() and w.isalpha() and w.islower():
                cands.append(w)
            if len(cands) >= MAX_CANDIDATES:
                break
        out = []
        for w in dict.fromkeys(cands):
            if (len(self._tok.encode(w, add_special_tokens=False).ids) == 1
                    and len(self._tok.encode("a " + w, add_special_tokens=False).ids)
                    == 1 + len(self._tok.encode("a", add_special_tokens=False).ids)):
                out.append(w)
        return tuple(out)

    def count(self, text: str) -> int:
        """Tokens of ``text`` with the tokenizer's added tokens."""
        return len(self._tok.encode(text, add_special_tokens=True).ids)


def words_for(tokens: int, tokenizer: PromptTokenizer) -> int:
    """Words of a prompt that the server counts as ``tokens`` tokens (at least 1)."""
    return max(1, tokens - tokenizer.added_tokens)


def completion_body(model: str, prompt: str, max_tokens: int) -> bytes:
    """JSON body of a streaming ``/v1/completions`` request that generates ``max_tokens``.

    ``ignore_eos`` (SGLang, vLLM) makes the server produce exactly ``max_tokens`` tokens;
    ``stream_options.include_usage`` asks for a final usage chunk with the token counts.
    """
    return json.dumps({
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }).encode()


def synthetic_template(isl: int, seed: int = 0) -> tuple[str, str]:
    """A prompt of ``isl`` words as ``(marker, text)``: replace ``marker`` by a request number.

    Kept for callers of the first version; :class:`SyntheticPrompts` builds exact-length bodies.
    """
    rng = np.random.default_rng([seed, isl])
    marker = "@@REQ@@"
    return marker, " ".join([marker, *(VOCAB[i] for i in rng.integers(0, len(VOCAB), isl - 1))])


class SyntheticPrompts:
    """Request bodies of ``isl`` tokens and ``osl`` output tokens, each with its own first words.

    Args:
        model: the ``model`` field of every request.
        isl: prompt tokens as the server counts them (``tokenizer``'s added tokens included).
        osl: output tokens asked (``max_tokens``).
        tokenizer: defaults to :class:`WordTokenizer`.
        seed: seed of the shared body.
    """

    MARKER = "@@REQ@@"

    def __init__(self, model: str, isl: int, osl: int,
                 tokenizer: PromptTokenizer | None = None, seed: int = 0) -> None:
        tok = tokenizer or WordTokenizer()
        self.words = np.array(tok.words)
        n = words_for(isl, tok)
        base = len(self.words)
        tag = 1
        while base ** tag < TAG_CAPACITY and tag < n:
            tag += 1
        self.tag_words = min(tag, n)
        rng = np.random.default_rng([seed, isl])
        body = list(self.words[rng.integers(0, base, n - self.tag_words)])
        self.text = " ".join([self.MARKER, *body])
        self._pre, self._post = completion_body(model, self.text, osl).split(
            self.MARKER.encode())

    def tag(self, i: int) -> str:
        """The first words of request ``i``: ``i`` in base ``len(words)``, ``tag_words`` digits."""
        base = len(self.words)
        digits = []
        for _ in range(self.tag_words):
            i, d = divmod(i, base)
            digits.append(self.words[d])
        return " ".join(digits)

    def body(self, i: int) -> bytes:
        """The JSON body of request ``i``."""
        return self._pre + self.tag(i).encode() + self._post

    def prompt(self, i: int) -> str:
        """The prompt text of request ``i``."""
        return self.text.replace(self.MARKER, self.tag(i), 1)


class BlockPrompts:
    """Prompts from prefix hash ids: one deterministic word block per id, cached.

    Args:
        seed: varies every block (two runs with the same seed send the same prompts).
        tokenizer: whose one-token words make the blocks (default :class:`WordTokenizer`).
    """

    def __init__(self, seed: int = 0, tokenizer: PromptTokenizer | None = None) -> None:
        self.seed = seed
        self.tokenizer = tokenizer or WordTokenizer()
        self._words = np.array(self.tokenizer.words)
        self._blocks: dict[tuple[int, int], list[str]] = {}

    def _draw(self, rng: np.random.Generator, n: int) -> list[str]:
        return list(self._words[rng.integers(0, len(self._words), n)])

    def _block(self, hash_id: int, size: int) -> list[str]:
        key = (hash_id, size)
        words = self._blocks.get(key)
        if words is None:
            rng = np.random.default_rng([self.seed, size, hash_id % 2**63])
            words = self._blocks[key] = self._draw(rng, size)
        return words

    def prompt(self, hash_ids: Sequence[int], block_size: int, input_tokens: int,
               request_index: int) -> str:
        """The prompt of one request: its hash blocks in order, cut to ``input_tokens`` tokens.

        Blocks are words (one token each); the tokenizer's added tokens (BOS) count towards
        ``input_tokens``. Without hash ids (or when they cover fewer words than needed) the rest
        is random words seeded by ``request_index`` (not shared with any other request).
        """
        n = words_for(input_tokens, self.tokenizer)
        words: list[str] = []
        if block_size > 0:
            for h in hash_ids:
                if len(words) >= n:
                    break
                words += self._block(h, block_size)
        if len(words) < n:
            rng = np.random.default_rng([self.seed, 1 << 32, request_index])
            words += self._draw(rng, n - len(words))
        return " ".join(words[:n])


def replay_plan(requests: Sequence[Request], model: str, seed: int = 0,
                tokenizer: PromptTokenizer | None = None) -> list[PlannedRequest]:
    """Request bodies of a (windowed, scaled) trace, in order: prompts from its hash blocks."""
    blocks = BlockPrompts(seed, tokenizer)
    return [PlannedRequest(r.arrival_s, completion_body(
                model, blocks.prompt(r.hash_ids, r.block_size, r.input_tokens, i),
                r.output_tokens), r.input_tokens, r.output_tokens)
            for i, r in enumerate(requests)]


def rate_plan(arrivals: np.ndarray, prompts: SyntheticPrompts, isl: int,
              osl: int) -> list[PlannedRequest]:
    """Synthetic requests sent at ``arrivals`` (s on the run clock), bodies built now."""
    return [PlannedRequest(float(t), prompts.body(i), isl, osl) for i, t in enumerate(arrivals)]


def expected_prefix_hits(requests: Sequence[Request]) -> np.ndarray:
    """Prompt tokens of each request an unbounded prefix cache would serve, in order.

    For the prompts :class:`BlockPrompts` builds: request ``r`` shares with an earlier request
    ``q`` its first ``d`` blocks when their first ``d`` hash ids agree, so the common prefix is
    ``d * block_size`` tokens, or the shorter prompt when one of them ends inside block ``d``.
    The hit is the longest common prefix with any earlier request, at most ``input_tokens - 1``
    (the engine computes at least the last prompt token; SGLang's radix cache does). Requests
    without hash ids hit nothing. A real engine evicts, so it reaches at most this. Where the
    random words right after a shared block happen to agree (about 1 in ``len(words)``), a
    token-level cache finds a word or two more.
    """
    root: dict[int, Any] = {}
    hits = np.zeros(len(requests), dtype=np.int64)
    for k, r in enumerate(requests):
        if not r.hash_ids or r.block_size <= 0:
            continue
        n, b = r.input_tokens, r.block_size
        ids = r.hash_ids[:-(-n // b)]
        node, hit = root, 0
        path: list[dict[int, Any]] = []
        for d, h in enumerate(ids, start=1):
            nxt = node.get(h)
            if nxt is None:
                nxt = node[h] = {"max": 0, "kids": {}}
            else:
                hit = max(hit, min(d * b, nxt["max"], n))
            path.append(nxt)
            node = nxt["kids"]
        for nd in path:
            nd["max"] = max(nd["max"], n)
        hits[k] = min(hit, n - 1)
    return hits


def expected_hit_rate(requests: Sequence[Request]) -> float | None:
    """Share of prompt tokens an unbounded prefix cache would serve; None without hash ids."""
    if not any(r.hash_ids and r.block_size > 0 for r in requests):
        return None
    total = sum(r.input_tokens for r in requests)
    return float(expected_prefix_hits(requests).sum()) / total if total else None
