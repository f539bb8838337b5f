"""An offline tokenizer in the Hugging Face cache layout, as aiperf loads it.

- **Tokenizer** (:func:`prepare_tokenizer`): aiperf's trace-replay decode workers force
  ``HF_HUB_OFFLINE=1``, under which a tokenizer *directory* fails with ``HFValidationError``;
  the working recipe is a Hugging Face cache layout referred to by a repo id [3]. Without a
  tokenizer of the served model, :func:`build_tokenizer` writes a deterministic word-level
  tokenizer with the ``tokenizers`` library (one word = one token; no training, no hub), so
  prompts are exactly ``input_length`` words.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mcp_servers.bench.aiperf.common import TOKENIZER_REPO, AiperfError
from mcp_servers.bench.prompts import VOCAB
from sandbox.aiperf_job import hf_offline_env

# ---------------------------------------------------------------------------------------------
# Offline tokenizer in the Hugging Face cache layout

# The built-in tokenizer's vocabulary, one word one token: the HTTP runner's prompt words
# (:data:`~mcp_servers.bench.prompts.VOCAB`), more common English words, then the
# most frequent words of aiperf's prompt corpus (the complete works of Shakespeare,
# ``aiperf/dataset/generator/assets/shakespeare.txt``: these 316 words, lower-cased and
# stripped of punctuation as the normalizer does, are 63 % of its 3.0 M words; the whole list
# covers 65 %). Duplicates are dropped in order, so ids never change for a given list.
_WORDS = tuple(dict.fromkeys((*VOCAB, *"""
it he she we you me my your our him them what when
where why how if then so no yes do does did can could should may might must shall say said see
saw make made take took give gave get got go went come came know knew think thought look want
find tell ask seem feel try leave call good new first last long great little own other old big
high different small large next early young important few public bad same able self still ever
never every than such those these some any many much most both each again against before after
between through during without under over into out up down off away sun moon river mountain sea
garden flower stone fire cloud rain snow wind summer winter spring autumn island forest bridge
castle village harbor valley desert ocean planet engine signal memory network packet kernel thread
queue batch tensor layer weight gradient matrix vector scalar buffer socket router switch cluster
the and to of a you my in that is not with me it for his be this your he but have as thou him so
will what her thy all by no do shall if are we thee on our lord now king sir good from o they
she at or well come which more would was then enter their how am love here when let them hath
than one there like man an upon go may make did know say us yet were should must scene had why
see such tis out some give these first who where too can take mine most speak up duke never tell
time much think exeunt doth heart nor queen exit th art before great lady men death hear life
hand away made fair look father sweet true very thus again own cannot eyes god master ay day
pray two richard mistress being old been prince any other night son done poor both leave whose
name till fear though blood could honour down into nothing world noble heaven comes house ever
therefore even still better second part henry against way hast those many stand grace nay myself
dead another call falstaff gentleman brother bear find friend might live head peace daughter off
little lords madam put die young wife keep act caesar none antony word within place friends john
every thine best set eye long hold york himself gods brutus gone since bring face dear fool
aside unto soul whom hamlet full gloucester once dost words show has else indeed servant stay
thats after page tongue about room france faith boy said warwick same please thought theres
forth makes ere without three gentle answer mind hope heard rest hence right rome welcome marry
farewell nature came matter clown woman things power cause sword iago thing messenger back bid
mother whats home shame use end thousand lie does truth
""".split())))
_UNK = "<unk>"
_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", _UNK)
_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% endif %}")
# Files of a tokenizer directory that are copied into the cache (never model weights).
_TOKENIZER_FILES = re.compile(
    r"^(tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|added_tokens\.json|"
    r"vocab\.(json|txt)|merges\.txt|tokenizer\.model|.*\.tiktoken|config\.json|"
    r"generation_config\.json|chat_template\.(jinja|json))$")


def build_tokenizer(out_dir: str | os.PathLike[str]) -> Path:
    """Write the built-in word-level tokenizer (Hugging Face format) to ``out_dir``.

    One whitespace-separated word is one token: a normalizer lower-cases and drops punctuation,
    the pre-tokenizer splits on whitespace only, each of the :data:`_WORDS` has its own id and
    any other word is ``<unk>``; decoding joins tokens with single spaces. aiperf builds every
    prompt (and every ``hash_ids`` block) by drawing a window of token ids from its corpus
    tokenized with this tokenizer and decoding it, so

    - a prompt of N tokens is exactly N whitespace words (vocabulary words, ``<unk>`` for the
      35 % of corpus words outside it, and aiperf's ``<|endoftext|>`` block separators):
      servers that count words (``tests/fixtures/openai_stub.py``) see the trace's input
      lengths exactly, and real BPE servers about N tokens (common words are single tokens; the
      built-in HTTP runner's prompts, ``mcp_servers/bench/prompts.py``, make the same trade);
    - blocks with the same hash id are the same words, so shared prefixes are real prefixes,
      and two different blocks share a first word with probability about 0.12 (measured on the
      corpus), so prefixes are not shared by accident.

    (``--prompt-corpus random``, uniform vocabulary ids, is refused by aiperf 0.13.0 for trace
    loaders, and for synthetic runs it draws consecutive vocabulary windows, so prompts with the
    same random offset are identical; the default text corpus is used for both.)

    Not trained, so the files are the same on every machine (needs only the ``tokenizers``
    library, a dependency of chromadb). Files: ``tokenizer.json``, ``tokenizer_config.json``
    (``PreTrainedTokenizerFast``, no BOS/EOS added, a ChatML chat template),
    ``special_tokens_map.json``. For lengths exact in the served model's tokens, give
    :func:`prepare_tokenizer` that model's tokenizer instead.

    Raises:
        AiperfError: ``tokenizers`` is not installed, or ``out_dir`` is not writable.
    """
    try:
        from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers
    except ImportError as e:  # pragma: no cover - chromadb depends on tokenizers
        raise AiperfError("the `tokenizers` library is missing; install servetune's "
                          "dependencies (pip install -e .)") from e
    out = Path(out_dir)
    vocab = {t: i for i, t in enumerate((*_SPECIALS, *_WORDS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=_UNK))
    tok.normalizer = normalizers.Sequence([normalizers.Lowercase(),
                                           normalizers.Replace(Regex(r"[^\w\s]"), "")])
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in _SPECIALS])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 10_000_000,
              "bos_token": _SPECIALS[0], "eos_token": _SPECIALS[0], "pad_token": _SPECIALS[0],
              "unk_token": _UNK, "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "chat_template": _CHAT_TEMPLATE}
    special = {"bos_token": _SPECIALS[0], "eos_token": _SPECIALS[0], "pad_token": _SPECIALS[0],
               "unk_token": _UNK}
    try:
        out.mkdir(parents=True, exist_ok=True)
        tok.save(str(out / "tokenizer.json"), pretty=False)
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
        (out / "special_tokens_map.json").write_text(json.dumps(special, indent=1,
                                                                sort_keys=True))
    except OSError as e:
        raise AiperfError(f"cannot write the tokenizer to {out} ({e.strerror or e}); give a "
                          "writable cache folder") from e
    return out


@dataclass(frozen=True)
class TokenizerRef:
    """A tokenizer in the Hugging Face cache layout, as aiperf loads it offline.

    Attributes:
        repo_id: What to pass as ``--tokenizer`` (``org/name``).
        revision: The snapshot's 40-hex "commit" (sha1 of the files), also in ``refs/main``.
        cache_dir: The ``HF_HUB_CACHE`` folder holding ``models--org--name/``.
    """

    repo_id: str
    revision: str
    cache_dir: Path

    @property
    def snapshot_dir(self) -> Path:
        """``<cache>/models--org--name/snapshots/<revision>``."""
        return (self.cache_dir / ("models--" + self.repo_id.replace("/", "--")) / "snapshots"
                / self.revision)

    def env(self) -> dict[str, str]:
        """Environment for aiperf: this cache, and no hub access at all (loadgen [3])."""
        return hf_offline_env(self.cache_dir)


def _repo_id(name: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "tokenizer"
    return f"local/{clean[:80]}"


def prepare_tokenizer(cache_dir: str | os.PathLike[str],
                      source: str | os.PathLike[str] | None = None,
                      repo_id: str | None = None) -> TokenizerRef:
    """Put a tokenizer into the Hugging Face cache layout under ``cache_dir`` (idempotent).

    Layout (what ``huggingface_hub.snapshot_download(local_files_only=True)`` resolves)::

        <cache_dir>/models--<org>--<name>/refs/main          -> "<revision>"
        <cache_dir>/models--<org>--<name>/snapshots/<revision>/tokenizer.json ...

    With ``source`` (a tokenizer directory, e.g. the served model's checkpoint folder), only its
    tokenizer files are copied (``tokenizer.json``, ``tokenizer_config.json``, vocab/merges,
    ``tokenizer.model``, ``config.json``, ...; never weights). Without it, :func:`build_tokenizer`
    writes the deterministic built-in one as :data:`TOKENIZER_REPO`. The revision is the sha1 of
    the files' names and bytes, so the same files land in the same snapshot and a changed
    tokenizer in a new one. Nothing touches the network.

    Args:
        cache_dir: The ``HF_HUB_CACHE`` folder to use for aiperf (created).
        source: Tokenizer directory to copy, or None for the built-in tokenizer.
        repo_id: ``org/name`` to register it under; default :data:`TOKENIZER_REPO`, or
            ``local/<folder name>`` for a ``source``.

    Returns:
        The reference to pass as ``--tokenizer`` with :meth:`TokenizerRef.env`.

    Raises:
        AiperfError: ``source`` has no ``tokenizer.json``/``tokenizer_config.json``/
            ``tokenizer.model``, a malformed ``repo_id``, or the cache is not writable.
    """
    cache = Path(cache_dir).resolve()
    if repo_id is not None and not re.fullmatch(r"[A-Za-z0-9._-]+/[A-Za-z0-9._-]+", repo_id):
        raise AiperfError(f"tokenizer repo id {repo_id!r} must look like 'org/name' (letters, "
                          "digits, '.', '_', '-')")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=cache))
        try:
            if source is None:
                build_tokenizer(staging)
                repo = repo_id or TOKENIZER_REPO
            else:
                src = Path(source)
                files = sorted(p for p in src.iterdir()
                               if p.is_file() and _TOKENIZER_FILES.match(p.name)) \
                    if src.is_dir() else []
                names = {p.name for p in files}
                if not names & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"}:
                    raise AiperfError(f"{src} holds no tokenizer (tokenizer.json, "
                                      "tokenizer_config.json or tokenizer.model); give the "
                                      "served model's tokenizer folder")
                for p in files:
                    shutil.copyfile(p, staging / p.name)
                repo = repo_id or _repo_id(src.resolve().name)
            digest = hashlib.sha1(usedforsecurity=False)
            for p in sorted(staging.iterdir()):
                digest.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
            ref = TokenizerRef(repo_id=repo, revision=digest.hexdigest(), cache_dir=cache)
            snap = ref.snapshot_dir
            if not snap.is_dir():
                snap.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.replace(staging, snap)
                except OSError:
                    if not snap.is_dir():  # not a concurrent writer that won the race
                        raise
            refs = snap.parent.parent / "refs"
            refs.mkdir(exist_ok=True)
            (refs / "main.tmp").write_text(ref.revision)
            os.replace(refs / "main.tmp", refs / "main")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:
        raise AiperfError(f"cannot prepare the tokenizer cache in {cache} ({e.strerror or e}); "
                          "give a writable cache folder") from e
    return ref


