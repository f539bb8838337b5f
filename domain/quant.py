"""Stored bytes per parameter of a checkpoint, read from its quantization config.

Two sources, both local files (the hub is never contacted):

* ``quantization_config`` inside a Hugging Face ``config.json`` (``quant_method`` fp8, mxfp4, awq,
  gptq, compressed-tensors, modelopt);
* a ModelOpt ``hf_quant_config.json`` beside it (``quantization.quant_algo`` FP8 / NVFP4).

A precision *key* names a checkpoint's format in a study's ``checkpoints:`` mapping and in the
catalog (:data:`PRECISION_KEYS`). Each format gives the bytes one quantized linear weight takes,
scales and zero points included, and the SGLang 0.5.23 ``--quantization`` value that loads it
(a choice of ``domain/data/sglang-0.5.23-flags.json``). Modules a config leaves unquantized
(``modules_to_not_convert`` / ``exclude_modules`` / ``ignore``) stay bf16, per module: a model
enumerates its linear modules by their checkpoint names (:meth:`domain.models.ModelArch.modules`)
and :func:`group_bytes` averages each parameter group's bytes over them.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from domain.errors import ConfigInvalid

BF16 = 2.0
"""bytes of a bf16 value."""


def fp8_block_bytes(block: tuple[int, int] = (128, 128)) -> float:
    """Bytes per parameter of FP8 block-wise weights.

    1 byte per value + one fp32 ``weight_scale_inv`` per ``block`` (e.g. the
    ``weight_block_size: [128, 128]`` of DeepSeek-V3's quantization_config).
    """
    return 1 + 4 / (block[0] * block[1])


def nvfp4_bytes(group: int = 16) -> float:
    """Bytes per parameter of NVFP4 weights.

    ModelOpt: a 4-bit e2m1 value + one fp8 e4m3 scale per ``group`` values
    (``group_size: 16`` in hf_quant_config.json); the per-tensor fp32 scale is negligible.
    """
    return 0.5 + 1 / group


def mxfp4_bytes(group: int = 32) -> float:
    """Bytes per parameter of MXFP4 weights.

    OCP microscaling, gpt-oss ``quant_method: mxfp4``: a 4-bit e2m1 value + one e8m0
    (1-byte) scale per 32 values (OCP MX spec v1.0, sec. 5).
    """
    return 0.5 + 1 / group


def int4_bytes(group: int, *, scale_bytes: float = 2.0, zero_point: bool = True) -> float:
    """Bytes per parameter of weight-only int4 weights.

    AWQ, GPTQ, compressed-tensors pack-quantized: 4 bits per value, one
    fp16/bf16 scale per ``group`` values and, when asymmetric, a packed 4-bit zero per group
    (AutoAWQ ``qzeros``; GPTQ stores ``qzeros`` even when symmetric). GPTQ's ``g_idx`` (one
    int32 per input row) is under 0.1 % of a matrix and not counted.
    """
    return 0.5 + scale_bytes / group + (0.5 / group if zero_point else 0.0)


ComputeDtype = Literal["bf16", "fp8", "fp4"]


class QuantScheme(BaseModel):
    """How a checkpoint stores its linear weights.

    ``bytes_per_param`` is for a quantized linear; modules matching ``exclude`` (and embeddings
    and ``lm_head``, which no format here quantizes unless listed) are bf16. ``pattern_style``
    says how ``exclude`` matches a module name: ``modelopt`` (fnmatch, ModelOpt's
    ``exclude_modules``), ``hf`` (a dotted component sequence, HF ``modules_to_not_convert``),
    ``compressed-tensors`` (``re:`` regex or exact name, its ``ignore`` list).
    """

    model_config = ConfigDict(frozen=True)

    key: str
    bytes_per_param: float
    quantization: str | None
    compute_dtype: ComputeDtype
    exclude: tuple[str, ...] = ()
    pattern_style: Literal["modelopt", "hf", "compressed-tensors"] = "hf"
    kv_cache_dtype: str | None = None
    source: str = ""

    def excluded(self, module: str) -> bool:
        """Whether ``module`` (a checkpoint module name) stays bf16 under this scheme."""
        return _excluded(self.exclude, self.pattern_style, module)


# key -> (bytes of a quantized linear, SGLang 0.5.23 --quantization, GEMM dtype, what it is)
PRECISION_KEYS: dict[str, tuple[float, str | None, ComputeDtype, str]] = {
    "bf16": (BF16, None, "bf16", "unquantized bf16 release"),
    "fp8": (fp8_block_bytes(), "fp8", "fp8", "FP8 e4m3 block-wise 128x128, fp32 scales "
            "(DeepSeek/Qwen/GLM native FP8 releases)"),
    "fp8-tensor": (1.0, "modelopt_fp8", "fp8", "FP8 per-tensor (ModelOpt FP8)"),
    "nvfp4": (nvfp4_bytes(), "modelopt_fp4", "fp4", "NVFP4 group 16, fp8 scales (ModelOpt)"),
    "mxfp4": (mxfp4_bytes(), "mxfp4", "bf16", "MXFP4 group 32, e8m0 scales (gpt-oss)"),
    "int4-awq": (int4_bytes(128), "awq", "bf16", "AWQ int4 group 128, fp16 scales + zeros"),
    "int4-gptq": (int4_bytes(128), "gptq", "bf16", "GPTQ int4 group 128, fp16 scales + zeros"),
    "w4a16": (int4_bytes(32, zero_point=False), "compressed-tensors", "bf16",
              "compressed-tensors pack-quantized int4 group 32 symmetric, bf16 scales "
              "(Kimi-K2-Thinking)"),
}
"""Accepted checkpoint keys. mxfp4 and int4 formats are weight-only: the GEMMs run in bf16
activations (SGLang dequantizes or runs mixed-input kernels), hence compute dtype bf16."""


def scheme_for_key(key: str, source: str = "") -> QuantScheme:
    """The default scheme of precision ``key`` (no quantization config read).

    Raises:
        ConfigInvalid: ``key`` is not in :data:`PRECISION_KEYS` (the line names the known keys).
    """
    if key not in PRECISION_KEYS:
        raise ConfigInvalid([f"checkpoints: unknown weights key {key!r}; known: "
                             f"{', '.join(PRECISION_KEYS)}"])
    b, q, dt, what = PRECISION_KEYS[key]
    return QuantScheme(key=key, bytes_per_param=b, quantization=q, compute_dtype=dt,
                       source=source or f"{key}: {what} (default for the key)")


def scheme_from_quantization_config(qc: Mapping[str, Any], source: str) -> QuantScheme:
    """Scheme of a config.json ``quantization_config``.

    Raises:
        ConfigInvalid: an unknown ``quant_method`` or an int4 config without its bit width.
    """
    method = str(qc.get("quant_method", "")).lower()
    skip = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block:
            return QuantScheme(key="fp8", bytes_per_param=fp8_block_bytes((block[0], block[1])),
                               quantization="fp8", compute_dtype="fp8", exclude=skip,
                               source=source)
        return QuantScheme(key="fp8-tensor", bytes_per_param=1.0, quantization="fp8",
                           compute_dtype="fp8", exclude=skip, source=source)
    if method == "mxfp4":
        return QuantScheme(key="mxfp4", bytes_per_param=mxfp4_bytes(), quantization="mxfp4",
                           compute_dtype="bf16", exclude=skip, source=source)
    if method in ("awq", "gptq"):
        if qc.get("bits", 4) != 4:
            raise ConfigInvalid([f"{source}: quantization_config.bits {qc.get('bits')} "
                                 f"(only 4-bit {method} is modelled)"])
        group = int(qc.get("group_size", 128))
        zero = bool(qc.get("zero_point", True)) if method == "awq" else True
        return QuantScheme(key=f"int4-{method}", bytes_per_param=int4_bytes(group,
                           zero_point=zero), quantization=method, compute_dtype="bf16",
                           exclude=skip, source=source)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, source)
    if method == "modelopt":
        return _modelopt(qc, source)
    raise ConfigInvalid([f"{source}: quantization_config.quant_method {method!r} is not "
                         f"modelled (known: fp8, mxfp4, awq, gptq, compressed-tensors, modelopt)"])


def _compressed_tensors(qc: Mapping[str, Any], source: str) -> QuantScheme:
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ConfigInvalid([f"{source}: quantization_config.config_groups missing"])
    weights = next(iter(groups.values())).get("weights") or {}
    bits, kind = weights.get("num_bits"), weights.get("type", "int")
    ignore = tuple(qc.get("ignore") or ())
    if kind == "float" and bits == 8:
        return QuantScheme(key="fp8-tensor", bytes_per_param=1.0,
                           quantization="compressed-tensors", compute_dtype="fp8",
                           exclude=ignore, pattern_style="compressed-tensors", source=source)
    if kind == "int" and bits == 4:
        group = int(weights.get("group_size") or 128)
        return QuantScheme(key="w4a16", bytes_per_param=int4_bytes(
                               group, zero_point=not weights.get("symmetric", True)),
                           quantization="compressed-tensors", compute_dtype="bf16",
                           exclude=ignore, pattern_style="compressed-tensors", source=source)
    raise ConfigInvalid([f"{source}: compressed-tensors weights {kind}{bits} not modelled "
                         f"(known: int4 pack-quantized, float8)"])


def _modelopt(q: Mapping[str, Any], source: str) -> QuantScheme:
    algo = str(q.get("quant_algo", "")).upper()
    exclude = tuple(q.get("exclude_modules") or q.get("ignore") or ())
    kv = q.get("kv_cache_quant_algo")
    kv_dtype = "fp8_e4m3" if str(kv).upper() == "FP8" else None
    if algo == "NVFP4":
        return QuantScheme(key="nvfp4", bytes_per_param=nvfp4_bytes(int(q.get("group_size", 16))),
                           quantization="modelopt_fp4", compute_dtype="fp4", exclude=exclude,
                           pattern_style="modelopt", kv_cache_dtype=kv_dtype, source=source)
    if algo == "FP8":
        return QuantScheme(key="fp8-tensor", bytes_per_param=1.0, quantization="modelopt_fp8",
                           compute_dtype="fp8", exclude=exclude, pattern_style="modelopt",
                           kv_cache_dtype=kv_dtype, source=source)
    raise ConfigInvalid([f"{source}: ModelOpt quant_algo {algo!r} is not modelled "
                         f"(known: NVFP4, FP8)"])


def scheme_from_hf_quant_config(doc: Mapping[str, Any], source: str) -> QuantScheme:
    """Scheme of a ModelOpt ``hf_quant_config.json`` (``{"quantization": {...}}``).

    Raises:
        ConfigInvalid: no ``quantization`` block or an unknown ``quant_algo``.
    """
    q = doc.get("quantization")
    if not isinstance(q, Mapping):
        raise ConfigInvalid([f"{source}: missing key 'quantization'"])
    return _modelopt(q, source)


def read_scheme(cfg: Mapping[str, Any], directory: Path | None, source: str) \
        -> QuantScheme | None:
    """The checkpoint's own scheme, or None for an unquantized checkpoint.

    ``hf_quant_config.json`` in ``directory`` first (ModelOpt
    checkpoints carry both it and a derived quantization_config), else the config's
    ``quantization_config``; None for an unquantized checkpoint.

    Raises:
        ConfigInvalid: an unreadable hf_quant_config.json or an unmodelled format.
    """
    if directory is not None and (directory / "hf_quant_config.json").is_file():
        p = directory / "hf_quant_config.json"
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise ConfigInvalid([f"{p}: cannot read it ({e})"]) from None
        return scheme_from_hf_quant_config(doc, str(p))
    qc = cfg.get("quantization_config")
    if isinstance(qc, Mapping):
        return scheme_from_quantization_config(qc, f"{source} quantization_config")
    return None


@lru_cache(maxsize=4096)
def _regex(pat: str) -> re.Pattern[str]:
    return re.compile(pat)


def _excluded(patterns: tuple[str, ...], style: str, module: str) -> bool:
    for pat in patterns:
        if style == "compressed-tensors":
            if pat.startswith("re:"):
                if _regex(pat[3:]).fullmatch(module) or _regex(pat[3:]).search(module):
                    return True
            elif pat == module or module.endswith("." + pat):
                return True
        elif style == "modelopt":
            if fnmatch.fnmatchcase(module, pat) or fnmatch.fnmatchcase(module, pat + ".*"):
                return True
        else:  # hf: the pattern is a run of whole dotted components of the name
            if any(fnmatch.fnmatchcase(module, form.format(pat))
                   for form in ("{}", "{}.*", "*.{}", "*.{}.*")):
                return True
    return False


Module = tuple[str, str, int]
"""(checkpoint module name, parameter group, parameters)."""


def group_bytes(modules: Iterable[Module], scheme: QuantScheme) -> dict[str, float]:
    """Mean stored bytes per parameter of each group over ``modules`` under ``scheme``.

    Embedding tables (``embed_tokens``) and ``lm_head`` are never quantized by these formats
    (ModelOpt and the fp8/mxfp4/int4 releases here all keep them bf16, listed or not); every
    other linear is unless excluded. A group with no parameters gets bf16.
    """
    num: dict[str, float] = {}
    den: dict[str, int] = {}
    for name, group, params in modules:
        bf16 = ("embed_tokens" in name or name == "lm_head" or scheme.key == "bf16"
                or (scheme.key != "bf16" and scheme.excluded(name)))
        num[group] = num.get(group, 0.0) + params * (BF16 if bf16 else scheme.bytes_per_param)
        den[group] = den.get(group, 0) + params
    return {g: (num[g] / den[g] if den[g] else BF16) for g in num}
