"""A raw SGLang launch command read the way SGLang's own argparse reads it.

``sglang serve --model-path zai-org/GLM-5-FP8 --tp-size 4`` (also ``python -m
sglang.launch_server ...``) is parsed with an ``argparse`` parser built from the version's flag
inventory (``domain/data/sglang-<version>-flags.json``, dumped from ``ServerArgs.add_cli_args``)
plus what the dump does not record (``domain/data/sglang-<version>-cli.json``: each list flag's
``nargs``, the flags earlier versions had and this one dropped, the deprecated spellings and
their successors). Like SGLang's parser (``server_args.py: prepare_server_args``:
``argparse.ArgumentParser(prog="sglang serve")``) it takes ``--flag value`` and ``--flag=value``,
unambiguous prefixes of a flag, store_true and ``--x/--no-x`` flags, and checks choices and
types; an unknown, ambiguous or retired flag is a refusal. The flags servetune models become a
:class:`~domain.config.ServingConfig`'s fields; every other flag is kept and reported.
"""

from __future__ import annotations

import argparse
import json
import re
from decimal import Decimal
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from domain.engines.sglang.flags import renamed_dest
from domain.engines.sglang.versions import data_path, rules_note
from domain.errors import ConfigInvalid
from domain.preflight import Finding, ParsedCommand

if TYPE_CHECKING:
    from domain.models import ModelArch

# ServingConfig field each modelled SGLang dest sets (dp_size: full data-parallel copies inside
# one server in 0.5.23; the old "--dp-size N --enable-dp-attention" is attention DP, read by
# read_deprecated_dp_attention; sglang-knobs reference, "DP attention spelling changed")
MODELLED = {"tp_size": "tp_size", "dp_size": "dp_size", "kv_cache_dtype": "kv_cache_dtype",
            "mem_fraction_static": "mem_fraction_static",
            "max_running_requests": "max_running_requests",
            "chunked_prefill_size": "chunked_prefill_size",
            "cuda_graph_max_bs_decode": "cuda_graph_max_bs_decode",
            "attention_backend": "attention_backend", "schedule_policy": "schedule_policy",
            "schedule_conservativeness": "schedule_conservativeness",
            "speculative_algorithm": "speculative_algorithm",
            "speculative_num_steps": "speculative_num_steps",
            "speculative_eagle_topk": "speculative_eagle_topk",
            "speculative_num_draft_tokens": "speculative_num_draft_tokens",
            "speculative_adaptive": "speculative_adaptive",
            "disable_radix_cache": "disable_radix_cache",
            "enable_hierarchical_cache": "enable_hierarchical_cache",
            "hicache_ratio": "hicache_ratio", "mm_attention_backend": "mm_attention_backend",
            "context_length": "context_length", "page_size": "page_size",
            "disable_cuda_graph": "disable_cuda_graph",
            "moe_runner_backend": "moe_runner_backend",
            # kept on the config and passed through, but not modelled (PASSED_THROUGH)
            "fp4_gemm_runner_backend": "fp4_gemm_runner_backend",
            "num_continuous_decode_steps": "num_continuous_decode_steps",
            "enable_two_batch_overlap": "enable_two_batch_overlap",
            "enable_single_batch_overlap": "enable_single_batch_overlap",
            # parallel layouts (issue 21)
            "attn_dp_size": "attn_dp_size", "ep_size": "ep_size",
            "moe_a2a_backend": "moe_a2a_backend", "deepep_mode": "deepep_mode",
            "moe_dense_tp_size": "moe_dense_tp_size", "enable_eplb": "enable_eplb",
            "ep_num_redundant_experts": "ep_num_redundant_experts", "pp_size": "pp_size",
            "enable_dp_lm_head": "enable_dp_lm_head",
            "disaggregation_mode": "disaggregation_mode",
            "disaggregation_transfer_backend": "disaggregation_transfer_backend"}
# dests read by the check itself (model lookup, node count, the old attention-DP spelling),
# not config fields; node_rank and dist_init_addr differ per node of one server
READ_BY_CHECK = ("model_path", "quantization", "nnodes", "node_rank", "dist_init_addr",
                 "enable_dp_attention", "prefill_attention_backend",
                 "decode_attention_backend")
# ServingConfig's defaults for flags SGLang writes as their value (--moe-a2a-backend none,
# --deepep-mode auto, --disaggregation-transfer-backend mooncake): the config's None
UNSET_VALUES = {"moe_a2a_backend": "none", "deepep_mode": "auto",
                "disaggregation_transfer_backend": "mooncake"}
_LAUNCH_MODULE = "sglang.launch_server"
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")


class _Refused(Exception):
    """argparse's error, raised instead of printing usage and exiting 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse calls this for every bad argument
        raise _Refused(message)


def _human_readable_int(value: str) -> int:
    """``utils/common.py: human_readable_int`` of SGLang 0.5.23: 4096, 16k, 1Mi, 25.6k."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", value.strip())
    if m is None:
        return int(value.strip())
    number, suffix = m.groups()
    iec = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    if suffix in iec:
        if "." in number:
            raise ValueError(f"decimals are not allowed with {suffix}")
        return int(number) * iec[suffix]
    return int(Decimal(number) * {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[suffix])


def _nullable_str(value: str) -> str | None:
    return None if not value or value == "None" else value


_TYPES: dict[str | None, Any] = {
    "str": str, "int": int, "float": float, "human_readable_int": _human_readable_int,
    "loads": json.loads, "json_list_type": json.loads, "nullable_str": _nullable_str,
    "parse_cuda_graph_backend_arg": str, "parse_cuda_graph_config_arg": str, None: None}
_human_readable_int.__name__ = "human_readable_int"  # argparse names the type in its error


class _Deprecated(argparse.Action):
    """A deprecated spelling SGLang still accepts (``arg_groups/argparse_actions.py``)."""

    def __init__(self, option_strings: list[str], dest: str, const_value: Any = True,
                 **kwargs: Any) -> None:
        self.const_value = const_value
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, self.const_value)
        namespace._deprecated = [*getattr(namespace, "_deprecated", []), option_string]


@cache
def cli_extras(version: str) -> dict[str, Any]:
    """``sglang-<version>-cli.json``: nargs, retired and deprecated flags.

    Shipped in ``domain/data/`` (0.5.23's curated by hand, 0.5.9's and 0.5.19's written by the
    static parser) or written next to a fetched inventory (``mcp_servers/source/inventory.py``).

    Raises:
        ConfigInvalid: no such file for ``version``.
    """
    path = data_path(version, "cli")
    if path is None:
        raise ConfigInvalid([f"SGLang {version}: no command-line data (sglang-{version}-cli.json);"
                             f" fetch it with `servetune source fetch --version {version}`"])
    data: dict[str, Any] = json.loads(path.read_text())
    return data


@cache
def build_parser(version: str) -> _Parser:
    """The argparse parser of ``sglang serve`` at ``version``, from its flag inventory."""
    path = data_path(version)
    if path is None:
        raise ConfigInvalid([f"SGLang {version}: no flag inventory; fetch it with "
                             f"`servetune source fetch --version {version}`"])
    raw = json.loads(path.read_text())["flags"]
    nargs = cli_extras(version)["nargs"]
    parser = _Parser(prog="sglang serve", add_help=False)
    for f in raw:
        kw: dict[str, Any] = {"dest": f["dest"], "default": argparse.SUPPRESS}
        action, names = f["action"], list(f["flags"])
        if action == "StoreTrueAction":
            kw["action"] = "store_true"
        elif action == "BooleanOptionalAction":
            kw["action"] = argparse.BooleanOptionalAction
            names = [n for n in names if not n.startswith("--no-")]
        elif action in ("DeprecatedStoreTrueAction", "DeprecatedAction"):
            kw.update(action=_Deprecated, nargs=0)
        elif action == "DeprecatedStoreConstAction":
            kw.update(action=_Deprecated, choices=f["choices"])
        else:  # StoreAction, LoRAPathAction
            kw["type"] = _TYPES.get(f["type"], str)
            if f["choices"]:
                kw["choices"] = f["choices"]
            if f["dest"] in nargs:
                kw["nargs"] = nargs[f["dest"]]
        parser.add_argument(*names, **kw)
    return parser


def split_program(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(program, flags)`` of a launch command.

    Programs: ``sglang serve``, or ``python -m sglang.launch_server`` with any ``python`` /
    ``python3`` / ``python3.X``, with or without a directory.

    Raises:
        ConfigInvalid: empty, or not an SGLang server launch.
    """
    if not argv:
        raise ConfigInvalid(["command: empty; give the launch command after --, e.g. "
                             "-- sglang serve --model-path zai-org/GLM-5-FP8 --tp-size 8"])
    head = Path(argv[0]).name
    if head == "sglang" and argv[1:2] == ["serve"]:
        return argv[:2], argv[2:]
    if _PYTHON.fullmatch(head) and argv[1:3] == ["-m", _LAUNCH_MODULE]:
        return argv[:3], argv[3:]
    raise ConfigInvalid([f"command: {' '.join(argv[:3])!r} is not an SGLang server launch; "
                         f"give 'sglang serve ...' or 'python -m {_LAUNCH_MODULE} ...'"])


def _resolve_token(parser: _Parser, token: str) -> tuple[str, list[str]]:
    """``(name as written, the flags argparse may take it for)`` of one ``--flag`` token."""
    name = token.split("=", 1)[0]
    opts = parser._option_string_actions
    if name in opts:
        return name, [name]
    return name, sorted(o for o in opts if o.startswith(name) and o.startswith("--"))


def _pre_scan(parser: _Parser, flags: list[str], version: str) -> list[Finding]:
    """Refusals and warnings of the spellings argparse would not report as such."""
    extras = cli_extras(version)
    out: list[Finding] = []
    for token in flags:
        if not token.startswith("--"):
            continue
        name, matches = _resolve_token(parser, token)
        retired = extras["retired"].get(name)
        if retired is not None and matches != [name]:
            succ = retired["successor"]
            fix = (f"use {succ} (SGLang {retired['last_version']} registered {name} as its "
                   "deprecated alias)" if succ else
                   f"drop {name}: SGLang {retired['last_version']} had it and names no successor")
            reading = (f"; argparse would read it as an abbreviation of {matches[0]}"
                       if len(matches) == 1 else "")
            out.append(Finding(severity="warn" if len(matches) == 1 else "refuse",
                               code="RETIRED_FLAG", fix=fix,
                               message=f"{name} was removed in SGLang {retired['removed_in']} "
                                       f"(last in {retired['last_version']}){reading}"))
        elif len(matches) == 1 and matches[0] != name:
            out.append(Finding(severity="warn", code="ABBREVIATED_FLAG",
                               message=f"{name} is read as {matches[0]} (argparse prefix "
                                       "matching)", fix=f"write {matches[0]} in full"))
        dep = extras["deprecated"].get(matches[0] if len(matches) == 1 else name)
        if dep is not None:
            out.append(Finding(severity="warn", code="DEPRECATED_FLAG",
                               message=f"{name} is deprecated in SGLang {version} "
                                       f"({dep['source']})",
                               fix=f"use {dep['successor']}" if dep["successor"] else
                               f"see {name} in sglang serve --help of SGLang {version}: no "
                               "successor flag is recorded"))
    return out


def parse(argv: list[str], version: str, model: str | None = None) -> ParsedCommand:
    """Parse one SGLang launch command with the flag inventory of ``version``.

    ``model``: the registered model the command serves (``check --model-config``); None: the
    catalog model whose checkpoint ``--model-path`` names.

    Returns:
        The parsed command; a flag SGLang would refuse is a ``refuse`` finding (``values``
        then holds nothing), deprecated or abbreviated spellings ``warn``, flags servetune does
        not model ``info``.

    Raises:
        ConfigInvalid: not an SGLang server launch (bad input, not a refusal).
    """
    program, flags = split_program(argv)
    findings: list[Finding] = []
    note = rules_note(version)
    if note is not None:
        findings.append(Finding(severity="info", code="NEAREST_VERSION_RULES", message=note,
                                fix="none needed; the memory fit's derived defaults are the "
                                    "nearest modelled release's"))
    if program[-1] == _LAUNCH_MODULE:
        findings.append(Finding(severity="info", code="LEGACY_ENTRYPOINT",
                                message=f"python -m {_LAUNCH_MODULE} still works in SGLang "
                                        f"{version} but prints a deprecation-style warning",
                                fix="launch with sglang serve --model-path ..."))
    elif flags and not flags[0].startswith("-"):  # cli/serve.py: _normalize_positional_model_path
        flags = ["--model-path", *flags]
    if program[0] == "sglang" and "--model-type" in flags:  # cli/serve.py strips it
        i = flags.index("--model-type")
        flags = flags[:i] + flags[i + 2:]
    parser = build_parser(version)
    findings += _pre_scan(parser, flags, version)
    if any(f.severity == "refuse" for f in findings):
        return ParsedCommand(program=program, version=version, findings=findings)
    try:
        ns = parser.parse_args(flags)
    except _Refused as e:
        findings.append(Finding(severity="refuse", code="BAD_FLAG",
                                message=f"sglang serve: error: {e}",
                                fix="fix the flag: see sglang serve --help of SGLang "
                                    f"{version}, or servetune's flag inventory"))
        return ParsedCommand(program=program, version=version, findings=findings)
    values = {k: v for k, v in vars(ns).items() if not k.startswith("_")}
    for dest in MODELLED:  # a field this version names otherwise (0.5.9: tensor_parallel_size)
        old = renamed_dest(dest, version)
        if old is not None and old in values:
            values[dest] = values.pop(old)
    read_deprecated_dp_attention(values)
    aliases = cli_extras(version)["deprecated_values"]
    for dest in aliases["dests"]:
        if values.get(dest) in aliases["aliases"]:
            new = aliases["aliases"][values[dest]]
            findings.append(Finding(severity="warn", code="DEPRECATED_VALUE",
                                    message=f"--{dest.replace('_', '-')} {values[dest]} is a "
                                            f"deprecated alias ({aliases['source']})",
                                    fix=f"write --{dest.replace('_', '-')} {new}"))
            values[dest] = new
    if "config" in values:
        findings.append(Finding(severity="warn", code="CONFIG_FILE_NOT_READ",
                                message=f"--config {values['config']}: the YAML file's flags are "
                                        "merged by SGLang at launch and are not checked here",
                                fix="pass the flags on the command line to have them checked"))
    from domain.config import PASSED_THROUGH

    unmodelled = sorted((set(values) - set(MODELLED) - set(READ_BY_CHECK) - {"config"})
                        | (set(values) & set(PASSED_THROUGH)))
    if unmodelled:
        findings.append(Finding(severity="info", code="UNMODELLED_FLAGS",
                                message="kept as given, not modelled by servetune's estimate: "
                                        + ", ".join(parser_flag(d, version) for d in unmodelled),
                                fix="none needed; their effect on memory and speed is not "
                                    "in this check"))
    fields, more = config_fields(values, model)
    graphs = not (values.get("disable_cuda_graph") or values.get("disable_decode_cuda_graph")
                  or values.get("cuda_graph_backend_decode") == "disabled")
    return ParsedCommand(program=program, version=version, values=values, fields=fields,
                         findings=findings + more, decode_cuda_graphs=graphs)


def read_deprecated_dp_attention(values: dict[str, Any]) -> None:
    """Read ``--dp-size N --enable-dp-attention`` as ``--attn-dp-size N`` (in place), any version.

    SGLang 0.5.23 ``arg_groups/parallel_hook.py:39-61`` (``handleread_deprecated_dp_attention``):
    with ``--enable-dp-attention`` and no ``--attn-dp-size``, the width moves from ``dp_size``
    to ``attn_dp_size`` and ``dp_size`` counts replicas again (1); next to ``--attn-dp-size``
    the flag adds nothing. Before 0.5.23 (no ``--attn-dp-size``) ``--dp-size`` with the flag was
    the attention-DP width itself (sglang-knobs reference, "DP attention spelling changed").
    """
    if not values.get("enable_dp_attention"):
        return
    if values.get("attn_dp_size", 1) == 1:
        values["attn_dp_size"] = values.get("dp_size", 1)
        values["dp_size"] = 1


def config_fields(values: dict[str, Any], model: str | None = None
                  ) -> tuple[dict[str, Any], list[Finding]]:
    """ServingConfig fields (all but ``gpu``) of parsed flag ``values``, and the findings.

    ``--model-path`` is looked up in servetune's model catalog
    (:func:`domain.models.find_checkpoint`); a model it does not hold is a ``refuse`` finding
    naming the catalog. With ``model`` (a registered model: ``check --model-config``) the
    checkpoint is that model's (:func:`_pinned_checkpoint`). A modelled flag whose value
    servetune cannot represent (a KV dtype or schedule policy beyond ServingConfig's choices)
    is left to the engine default in the estimate, with an ``info`` finding.
    """
    from domain.models import CATALOG, find_checkpoint, load_model

    findings: list[Finding] = []
    path = values.get("model_path")
    if path is None:
        return {}, [Finding(severity="refuse", code="NO_MODEL", message="no --model-path given",
                            fix="add --model-path <HF repo id or local directory>")]
    if model is not None:
        pinned = _pinned_checkpoint(load_model(model), path, values.get("quantization"))
        if isinstance(pinned, Finding):
            return {}, [pinned]
        found: tuple[str, str] | None = pinned
    else:
        found = find_checkpoint(path, values.get("quantization"))
    if found is None:
        known = ", ".join(ck.model_path for n in CATALOG
                          for ck in load_model(n).checkpoints.values())
        return {}, [Finding(severity="refuse", code="UNKNOWN_MODEL",
                            message=f"--model-path {path} is not in servetune's model catalog "
                                    f"({', '.join(CATALOG)}), so its memory cannot be checked",
                            fix=f"use one of the catalog's checkpoints: {known}")]
    model, weights = found
    fields: dict[str, Any] = {"model": model, "weights": weights, "engine": "sglang"}
    for dest, field in MODELLED.items():
        if dest not in values:
            continue
        value = values[dest]
        if dest == "kv_cache_dtype" and value == "bfloat16":
            value = "bf16"
        if UNSET_VALUES.get(dest) == value:
            continue  # the engine's default, the config's None
        literal = field in ("kv_cache_dtype", "schedule_policy", "speculative_algorithm",
                            "deepep_mode", "disaggregation_mode")
        if literal and value not in _literal_values(field):
            findings.append(Finding(severity="info", code="UNMODELLED_VALUE",
                                    message=f"--{dest.replace('_', '-')} {value}: servetune "
                                            "models only "
                                            + ", ".join(map(str, _literal_values(field))),
                                    fix="the memory estimate uses the engine default instead"))
            continue
        fields[field] = value
    return fields, findings


def _pinned_checkpoint(arch: ModelArch, model_path: str, quantization: str | None
                       ) -> tuple[str, str] | Finding:
    """``(model, weights key)`` of ``arch``'s checkpoint the command loads, or the refusal.

    The checkpoint whose ``model_path`` is ``--model-path`` (the whole hub id, or a local
    folder's last part against the id's name, case aside); else the one whose
    ``--quantization`` is the command's; else the model's only checkpoint.
    """
    ckpts = arch.checkpoints
    want = model_path.rstrip("/").casefold()
    paths = {k: c.model_path.rstrip("/").casefold() for k, c in ckpts.items()}
    for hits in ([k for k, p in paths.items() if p == want],
                 [k for k, p in paths.items() if p.rsplit("/", 1)[-1] == want.rsplit("/", 1)[-1]],
                 [k for k, c in ckpts.items()
                  if quantization is not None and c.quantization == quantization]):
        if len(hits) > 1:
            hits = [k for k in hits if ckpts[k].quantization == quantization] or hits
        if hits:
            return arch.name, hits[0]
    if len(ckpts) == 1:
        return arch.name, next(iter(ckpts))
    known = ", ".join(f"{k}: {c.model_path}" for k, c in ckpts.items()) or "none"
    return Finding(severity="refuse", code="UNKNOWN_CHECKPOINT",
                   message=f"--model-path {model_path} is none of the checkpoints of "
                           f"{arch.name} ({known})",
                   fix="give one of them as --model-path, or pass the --quantization of the "
                       "one you mean")


def _literal_values(field: str) -> tuple[Any, ...]:
    """The choices of a ServingConfig ``Literal`` field (None dropped)."""
    from typing import get_args

    from domain.config import ServingConfig

    out: list[Any] = []
    for arg in get_args(ServingConfig.model_fields[field].annotation) or ():
        out += [a for a in (get_args(arg) or (arg,)) if a is not None and a is not type(None)]
    return tuple(out)


def parser_flag(dest: str, version: str) -> str:
    """The first (canonical) flag of ``dest`` in the raw inventory of ``version``."""
    for action in build_parser(version)._actions:
        if action.dest == dest and action.option_strings:
            return action.option_strings[0]
    return "--" + dest.replace("_", "-")
