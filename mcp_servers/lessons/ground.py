"""Source grounding for ``servetune diagnose`` and ``diagnose_log``: a log line's raise site.

With an engine source tree (``--source PATH``, else the cached tree of the version when it has
been fetched: ``servetune source fetch``), the evidence line's message is looked up in the tree
(:func:`mcp_servers.source.raises.locate_message`: f-string, ``.format`` and ``%`` templates
included). The best site becomes the diagnosis's ``source``; the flags its guard tests become
its ``flags`` and ``verified`` is set; the guard's facts go to the lesson builder
(:func:`domain.diagnosis.diagnose_log`). A message no site carries keeps the taxonomy's rule.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from domain.diagnosis import Ground
from domain.errors import ServetuneError
from domain.failures import Diagnosis
from domain.grounding import GuardFacts

# a log line's prefix: SGLang's "[2026-01-01 10:00:00 TP0] " (and a Ray actor's "(pid=1) ")
_PREFIX = re.compile(r"^\s*(\(\w+ pid=\d+[^)]*\)\s*)?(\[[^\]]*\]\s*)?")
MIN_LITERAL_CHARS = 12  # a site must match this much fixed message text (a bare assert: none)


def source_ground(source: Path | None, version: str) -> tuple[Ground | None, str]:
    """The grounding hook over ``source`` (None: the version's cached tree), and a note.

    Returns:
        (hook, note): hook None when no tree is at hand (the note says why); the note names
        the tree otherwise.

    Raises:
        ServetuneError: ``source`` is not a source tree or wheel (``SourceError``).
    """
    from mcp_servers.source.flags import extract_flags
    from mcp_servers.source.raises import locate_message
    from mcp_servers.source.server import open_tree
    from mcp_servers.source.tree import SourceError

    tree = open_tree(source, version)
    if tree is None:
        return None, (f"no SGLang {version} source tree (fetch it with `servetune source "
                      "fetch`, or give --source): the lesson's condition is the taxonomy's "
                      "rule, unverified")
    inv = extract_flags(tree)

    def ground(d: Diagnosis, lines: Sequence[str]) -> tuple[Diagnosis, GuardFacts | None]:
        message = _PREFIX.sub("", d.evidence).strip()
        if not message or d.failure_class in _NOT_RAISED_BY_ENGINE:
            return d, None
        try:
            found = locate_message(tree, inv, message, max_sites=1)
        except SourceError:
            return d, None
        site = found.sites[0] if found.sites else None
        if site is None or site.literal_chars < MIN_LITERAL_CHARS:
            return d, None
        flags = ["--" + f.replace("_", "-") for f in site.flags]
        return d.model_copy(update={"source": site.site, "flags": flags or d.flags,
                                    "verified": bool(site.flags)}), site.facts

    return ground, f"source: {tree.root}"


_HOOKS: dict[str, tuple[Ground | None, str]] = {}
# classes whose evidence line no raise site of the engine holds: argparse's own refusal
# (Python's argparse prints it), a log that stopped (its last line is no error at all)
_NOT_RAISED_BY_ENGINE = ("BAD_FLAG", "READY_TIMEOUT")


def cached_ground(version: str) -> tuple[Ground | None, str]:
    """:func:`source_ground` over the version's cached tree, opened once per process.

    A tree that cannot be opened gives no hook (the note says why), never an error.
    """
    if version not in _HOOKS:
        try:
            _HOOKS[version] = source_ground(None, version)
        except ServetuneError as e:
            _HOOKS[version] = None, f"source tree unusable: {e}"
    return _HOOKS[version]
