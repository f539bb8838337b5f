"""The one secret redactor: replaces secret-shaped strings with ``[REDACTED:<kind>]``.

Used wherever text from a model, a user or an engine log is stored or shown: lesson text
(:class:`~domain.lesson.Lesson` fields, so every way in and every stored lesson read back),
ledger rows (:class:`~domain.trial.Trial` reasons, log tails, retries), the cluster server's
``get_status``/``get_logs``/``get_events`` answers and the cluster record files.

Patterns, in the order they apply (the key formats their vendors document). A vendor token may
follow ``_`` (``MY_hf_...``), where a regex word boundary sees none.

- ``anthropic-key``: ``sk-ant-<kind><NN>-`` + base64url, e.g. ``sk-ant-api03-...``,
  ``sk-ant-admin01-...`` (Anthropic console, "API keys").
- ``openai-key``: ``sk-proj-``/``sk-svcacct-``/``sk-admin-`` + base64url, and the legacy
  ``sk-`` + 32 or more letters and digits (OpenAI platform, "API keys" / "Project API keys").
- ``huggingface-token``: ``hf_`` + 30 or more letters and digits (Hugging Face Hub, "User
  access tokens"; they are 34 today).
- ``aws-access-key-id``: ``AKIA``/``ASIA``/``ABIA``/``ACCA`` + 16 upper-case letters or digits
  (AWS IAM, "Access key ID format"); ``aws-secret-key``: 40 base64 characters after an
  ``aws_secret_access_key``-like name or right after an access key id (the pair as AWS prints it).
- ``github-token``: ``ghp_``/``gho_``/``ghu_``/``ghs_``/``ghr_`` + 36 or more letters and
  digits, and fine-grained ``github_pat_`` + 22 + ``_`` + 59 (GitHub docs, "About
  authentication: token formats").
- ``slack-token``: ``xox[abposr]-`` + digits, letters and dashes (Slack API, "Token types").
- ``google-api-key``: ``AIza`` + 35 base64url characters (Google Cloud, "API keys").
- ``jwt``: three base64url parts, the first two starting ``eyJ`` (``{"``), RFC 7519.
- ``private-key``: a PEM ``-----BEGIN ... PRIVATE KEY-----`` block to its END line, or to the
  end of the text when cut (RFC 7468).
- ``bearer-token``: the credential after ``Bearer`` (RFC 6750).
- ``authorization``: the credentials of an ``Authorization:`` (or ``Proxy-Authorization:``)
  header in any other scheme, e.g. ``Basic <base64>``, ``token <t>``, ``Digest ...``
  (RFC 9110 11.6.2; ``token`` is GitHub's scheme).
- ``url-password``: the password of a URL's userinfo, ``scheme://user:[REDACTED]@host``;
  the user and host are kept (RFC 3986 3.2.1).
- ``secret``: the value of a secret-ish name after ``=``, ``:`` or ``=>``, quoted or not
  (``name=v``, ``"name": "v"``, ``name => v``). The names: ``password``, ``passwd``,
  ``passphrase``, ``token``, ``secret``, ``secret_key``, ``private_key``, ``credential(s)``,
  ``api_key``/``apikey``, ``access_key``, with any prefix, separated (``hf_token``,
  ``DB_PASSWORD``) or glued on (``PGPASSWORD``, camelCase ``apiToken``/``accessToken``/
  ``clientSecret``), and ``pwd`` after a separated prefix only (``MYSQL_PWD``; the shell's
  ``PWD``/``OLDPWD`` are directories). The name must end there: ``max_total_tokens``,
  ``num_tokens``, ``tokenizer_path``, ``skip_tokenizer_init`` are no secret names. Also the
  argument of a ``--...api-key``/``--...token``/``--...password``/``--...passphrase``/
  ``--...secret`` command-line flag. Values that cannot be secrets are kept:
  ``None``/``null``/``True``/``False``, numbers (``#token: 1234`` in SGLang's batch lines) and
  empty values.

Ordinary log text is left alone: SHA digests, commit hashes, model paths, SGLang's
``ServerArgs(...)`` dump (``api_key=None``, ``tokenizer_path=...``, ``max_prefill_tokens=...``)
and its batch statistics, URLs without a password. Redaction is idempotent (a redacted text
comes back unchanged) and linear in the text's length (name and scheme patterns start only at
the beginning of an identifier).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BeforeValidator

MARK = "[REDACTED:{kind}]"

_B64URL = r"[A-Za-z0-9_\-]"
_START = r"(?<![A-Za-z0-9])"  # a token may follow "_" (MY_hf_...), where \b sees no boundary
_NAMES = (r"(?:password|passwd|passphrase|token|secret(?:[_.\-]?key)?|private[_.\-]?key"
          r"|credentials?|api[_-]?key|apikey|access[_-]?key)")
_KEEP = re.compile(r"(?i)(?:none|null|nil|true|false|-?\d+(?:\.\d+)?|\[REDACTED(?::[a-z-]+)?\])")

_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("private-key", re.compile(
        r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----"
        r"(?:.*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY-----|.*\Z)", re.DOTALL)),
    ("anthropic-key", re.compile(rf"{_START}sk-ant-[a-z]+\d{{2}}-{_B64URL}{{20,}}")),
    ("openai-key", re.compile(rf"{_START}sk-(?:proj|svcacct|admin)-{_B64URL}{{20,}}"
                              rf"|{_START}sk-[A-Za-z0-9]{{32,}}\b")),
    ("huggingface-token", re.compile(rf"{_START}hf_[A-Za-z0-9]{{30,}}\b")),
    ("github-token", re.compile(rf"{_START}gh[pousr]_[A-Za-z0-9]{{36,}}\b"
                                rf"|{_START}github_pat_[A-Za-z0-9]{{22}}_[A-Za-z0-9]{{59}}\b")),
    ("slack-token", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}")),
    ("google-api-key", re.compile(rf"\bAIza{_B64URL}{{35}}(?!{_B64URL})")),
    ("jwt", re.compile(rf"\beyJ{_B64URL}{{8,}}\.eyJ{_B64URL}{{8,}}\.{_B64URL}*")),
)
# An AWS secret key: named, or right after its access key id (``AKIA...:secret``).
_AWS_ID = re.compile(r"\b(?:AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}\b")
_AWS_NAMED_SECRET = re.compile(
    r"(?i)(aws_?secret_?access_?key|aws_?secret_?key|secret_?access_?key)"
    r"([\"']?\s*[:=]\s*[\"']?)([A-Za-z0-9/+=]{40})(?![A-Za-z0-9/+=])")
_AWS_PAIR_SECRET = re.compile(
    r"(\[REDACTED:aws-access-key-id\][\"']?\s*[:,/|;\s]\s*[\"']?)([A-Za-z0-9/+=]{40})"
    r"(?![A-Za-z0-9/+=])")
_BEARER = re.compile(r"(?i)\b(bearer\s+)([A-Za-z0-9._~+/\-]{8,}=*)")
# The credentials of an Authorization header in any scheme (Basic, token, Digest, ...).
_AUTHORIZATION = re.compile(
    r"(?i)\b((?:proxy-)?authorization[\"']?[ \t]*[:=][ \t]*[\"']?"
    r"(?:[A-Za-z][A-Za-z0-9_\-]*[ \t]+)?)"
    r"([^\s\"',;]+)")
# The password of a URL's userinfo (scheme://user:password@host), RFC 3986 3.2.1.
_URL_PASSWORD = re.compile(
    r"(?i)(?<![a-z0-9+.\-])([a-z][a-z0-9+.\-]{0,31}://[^\s:/@\[\]]+:)([^\s/@]+)(@)")
# name[=:]value: a quoted value, or an unquoted run up to a space, comma, semicolon, & or quote.
_NAMED = re.compile(
    rf"(?i)(?<![A-Za-z0-9_.\-])((?:[A-Za-z0-9]+[_.\-])*[A-Za-z0-9]*?{_NAMES}"
    r"|(?:[A-Za-z0-9]+[_.\-])+pwd)"
    r"((?:[\"']\s*)?\s*(?:=>|[:=](?!>))\s*)"
    r"(\"[^\"\n]*\"|'[^'\n]*'|[^\s,;&\"'()\[\]{}]+)")
_FLAG = re.compile(r"(?i)(--(?:[a-z0-9]+-)*(?:password|passphrase|token|secret|api-key))(\s+|=)"
                   r"([^\s\"']+|\"[^\"]*\"|'[^']*')")


def _mark(kind: str) -> str:
    return MARK.format(kind=kind)


def _value_sub(kind: str) -> Callable[[re.Match[str]], str]:
    def sub(m: re.Match[str]) -> str:
        value = m.group(3)
        quote = value[0] if value[:1] in ("'", '"') else ""
        inner = value[1:-1] if quote else value
        if not inner.strip() or _KEEP.fullmatch(inner.strip()):
            return m.group(0)
        return f"{m.group(1)}{m.group(2)}{quote}{_mark(kind)}{quote}"
    return sub


def _kept_or(kind: str, tail: int = 0) -> Callable[[re.Match[str]], str]:
    """A substitution: group 2 becomes the mark and group ``tail`` (if any) stays after it.

    Group 2 is kept when it cannot be a secret: a mark already, or (outside a URL) ``_KEEP``.
    """
    def sub(m: re.Match[str]) -> str:
        value = m.group(2)
        if value.startswith("[REDACTED") or (not tail and _KEEP.fullmatch(value)):
            return m.group(0)
        return m.group(1) + _mark(kind) + (m.group(tail) if tail else "")
    return sub


def redact(text: str) -> str:
    """``text`` with every secret-shaped string replaced by ``[REDACTED:<kind>]``.

    Args:
        text: any text (a log line, a lesson's evidence, several lines).

    Returns:
        The text, unchanged apart from the secrets (see the module docstring for the kinds).
    """
    if not text:
        return text
    for kind, pattern in _PATTERNS:
        text = pattern.sub(_mark(kind), text)
    text = _AWS_ID.sub(_mark("aws-access-key-id"), text)
    text = _AWS_NAMED_SECRET.sub(lambda m: f"{m.group(1)}{m.group(2)}{_mark('aws-secret-key')}",
                                 text)
    text = _AWS_PAIR_SECRET.sub(lambda m: f"{m.group(1)}{_mark('aws-secret-key')}", text)
    text = _BEARER.sub(lambda m: m.group(1) + _mark("bearer-token"), text)
    text = _AUTHORIZATION.sub(_kept_or("authorization"), text)
    text = _URL_PASSWORD.sub(_kept_or("url-password", tail=3), text)
    text = _NAMED.sub(_value_sub("secret"), text)
    return _FLAG.sub(_value_sub("secret"), text)


def redact_any(value: Any) -> Any:
    """:func:`redact` applied to every string in ``value`` (dicts, lists, tuples); keys too.

    Anything else (numbers, None, models) comes back as it is.
    """
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redact_any(k): redact_any(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact_any(v) for v in value)
    return value


# A str field that is stored redacted: pydantic runs this before the field's own constraints.
RedactedStr = Annotated[str, BeforeValidator(redact_any)]
