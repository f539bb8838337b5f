"""Prompts for HTTP benchmarks, built before a run's clock starts.

Prompts are words from a fixed list of common English words, joined by single spaces, so a
prompt of N words is about N tokens for a BPE tokenizer and exactly N "tokens" for servers that
count whitespace words (the test stub). Issue 6 replaces this with a real tokenizer.

- Synthetic (saturation) prompts: one shared random body behind a per-request number, so no two
  requests share a first token and a radix (prefix) cache gets no hits.
- Trace prompts: one deterministic word block per hash id (``block_size`` words, seeded by the
  id), concatenated in the request's hash order and cut to ``input_tokens`` words. Requests that
  share leading hash ids therefore share exactly that prefix, as in the trace (the technique
  aiperf uses for Mooncake replays; loadgen reference section 6).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from domain.workload import Request
from mcp_servers.bench.http_runner import PlannedRequest

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
_VOCAB = np.array(VOCAB)


def _words(rng: np.random.Generator, n: int) -> list[str]:
    return list(_VOCAB[rng.integers(0, len(_VOCAB), n)])


def synthetic_template(isl: int, seed: int = 0) -> tuple[str, str]:
    """A prompt of ``isl`` words as ``(marker, text)``: replace ``marker`` by a request number.

    The number is the first word, so every request has its own first token.
    """
    rng = np.random.default_rng([seed, isl])
    marker = "@@REQ@@"
    return marker, " ".join([marker, *_words(rng, isl - 1)])


class BlockPrompts:
    """Prompts from prefix hash ids: one deterministic word block per id, cached.

    Args:
        seed: varies every block (two runs with the same seed send the same prompts).
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._blocks: dict[tuple[int, int], list[str]] = {}

    def _block(self, hash_id: int, size: int) -> list[str]:
        key = (hash_id, size)
        words = self._blocks.get(key)
        if words is None:
            rng = np.random.default_rng([self.seed, size, hash_id % 2**63])
            words = self._blocks[key] = _words(rng, size)
        return words

    def prompt(self, hash_ids: Sequence[int], block_size: int, input_tokens: int,
               request_index: int) -> str:
        """The prompt of one request: its hash blocks in order, cut to ``input_tokens`` words.

        Without hash ids (or when they cover fewer words than ``input_tokens``) the rest is
        random words seeded by ``request_index`` (not shared with any other request).
        """
        words: list[str] = []
        if block_size > 0:
            for h in hash_ids:
                if len(words) >= input_tokens:
                    break
                words += self._block(h, block_size)
        if len(words) < input_tokens:
            rng = np.random.default_rng([self.seed, 1 << 32, request_index])
            words += _words(rng, input_tokens - len(words))
        return " ".join(words[:input_tokens])


def completion_body(model: str, prompt: str, max_tokens: int) -> bytes:
    """JSON body of a streaming ``/v1/completions`` request that generates ``max_tokens``.

    ``ignore_eos`` (SGLang, vLLM) makes the server produce exactly ``max_tokens`` tokens;
    ``stream_options.include_usage`` asks for a final usage chunk with the token counts.
    """
    return json.dumps({
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }).encode()


def replay_plan(requests: Sequence[Request], model: str, seed: int = 0) -> list[PlannedRequest]:
    """Request bodies of a (windowed, scaled) trace, in order: prompts from its hash blocks."""
    blocks = BlockPrompts(seed)
    return [PlannedRequest(r.arrival_s, completion_body(
                model, blocks.prompt(r.hash_ids, r.block_size, r.input_tokens, i),
                r.output_tokens), r.input_tokens, r.output_tokens)
            for i, r in enumerate(requests)]
