"""The server arguments an SGLang log states: its ``server_args=...`` line, read back.

SGLang prints its resolved arguments once at startup (0.5.23: ``entrypoints/engine.py:311``,
``server_args={'model_path': ..., 'tp_size': 8, ...}``, the ``resolved_dict()`` of
``server_args.py:316``; earlier versions: ``server_args=ServerArgs(model_path=..., tp_size=8,
...)``); the twin prints the argv (``server_args=--model-path ... --tp-size 8``). Each form is
read into ``{dest: value}`` with the literals it holds; a value that is not a Python literal
(an object's repr) is skipped, never guessed.
"""

from __future__ import annotations

import ast
import re
import shlex
from collections.abc import Sequence
from typing import Any

from domain.engines.sglang.flags import flag_inventory

_LINE = re.compile(r"server_args=(.*)$")


# one ``'key': literal`` or ``key=literal`` pair, for a line whose whole text is no literal
_PAIR = re.compile(r"""(?:'(\w+)': |\b(\w+)=)('[^']*'|"[^"]*"|-?\d[\d.eE+-]*|True|False|None)""")


def _pairs(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in _PAIR.finditer(text):
        try:
            out[m.group(1) or m.group(2)] = ast.literal_eval(m.group(3))
        except (ValueError, SyntaxError):
            continue
    return out


def _dict_form(text: str) -> dict[str, Any]:
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:  # an object's repr inside, or a line cut short
        return _pairs(text)
    out: dict[str, Any] = {}
    if isinstance(node, ast.Dict):
        for k, v in zip(node.keys, node.values, strict=True):
            if isinstance(k, ast.Constant) and isinstance(k.value, str):
                try:
                    out[k.value] = ast.literal_eval(v)
                except ValueError:
                    continue
    elif isinstance(node, ast.Call):
        for kw in node.keywords:
            if kw.arg is None:
                continue
            try:
                out[kw.arg] = ast.literal_eval(kw.value)
            except ValueError:
                continue
    return out


def _argv_form(text: str, version: str) -> dict[str, Any]:
    try:
        words = shlex.split(text)
    except ValueError:
        return {}
    by_flag = {f: (dest, e) for dest, e in flag_inventory(version).items() for f in e["flags"]}
    out: dict[str, Any] = {}
    i = 0
    while i < len(words):
        flag, _, inline = words[i].partition("=")
        i += 1
        if flag not in by_flag:
            continue
        dest, entry = by_flag[flag]
        action = str(entry.get("action") or "")
        if action in ("StoreTrueAction", "StoreFalseAction"):  # argparse's, by class name
            out[dest] = action == "StoreTrueAction"
            continue
        raw = inline or (words[i] if i < len(words) else "")
        i += 0 if inline else 1
        try:
            out[dest] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[dest] = raw
    return out


def _layout(settings: dict[str, Any]) -> dict[str, Any]:
    """The parallel layout read the engine's way, in place (issue 21).

    The old spelling ``dp_size=N, enable_dp_attention=True`` (argv ``--dp-size N
    --enable-dp-attention``; every version before 0.5.23 logs it so) is attention DP:
    ``attn_dp_size`` N, ``dp_size`` 1 (``arg_groups/parallel_hook.py:39-61``; a 0.5.23 resolved
    dict already holds ``attn_dp_size`` and reports the flag set beside it). The values the
    engine logs for its unset defaults (``moe_a2a_backend='none'``, ``deepep_mode='auto'``,
    ``disaggregation_transfer_backend='mooncake'``) are dropped: a config's None.
    """
    from domain.engines.sglang.cmdline import UNSET_VALUES, read_deprecated_dp_attention

    read_deprecated_dp_attention(settings)
    for dest, unset in UNSET_VALUES.items():
        if settings.get(dest) == unset:
            del settings[dest]
    return settings


def logged_settings(log: Sequence[str], version: str) -> dict[str, Any]:
    """``{dest: value}`` of the last ``server_args=`` line of ``log`` ({} when there is none).

    The parallel layout in either spelling (:func:`_layout`).

    Args:
        log: the log lines.
        version: the SGLang version whose flag inventory reads the argv form.
    """
    for line in reversed(log):
        m = _LINE.search(line)
        if m is None:
            continue
        text = m.group(1).strip()
        if text.startswith(("{", "ServerArgs(")):
            return _layout(_dict_form(text))
        return _layout(_argv_form(text, version))
    return {}
