"""The value domain of each tunable ServingConfig field, for checking lesson conditions.

A lesson's clause must name a real family: it must hold for some valid value of its field and
fail for another, and the values it names must be valid values (see
:meth:`domain.lesson.Lesson.defect`). The domain of a field is read from ServingConfig itself, so
it cannot drift from the schema of record:

- ``Literal`` fields and ``bool``: their members; ``attention_backend`` and
  ``mm_attention_backend`` (``CHOICE_FIELDS``): the choices of the shipped SGLang flag
  inventories (also ``moe_a2a_backend``, ``disaggregation_transfer_backend``, ...,
  ``domain.config.CHOICE_FIELDS``); ``weights``: every checkpoint key of the model catalog;
  ``pd``: its ``"<n>P<m>D"`` names for n, m in 1..4 (a study may give groups with their own
  layout; those are no domain of names).
- ``int``/``float`` fields: the numbers within the field's ``ge``/``gt``/``le``/``lt`` bounds
  (``allow_inf_nan=False``: finite), less what the model's own validators refuse
  (``chunked_prefill_size`` 0).
- ``None`` when the field is optional ("unset"). What unset means decides whether it is a
  family of its own: where the field's description says ``None = off``
  (``speculative_algorithm``: no speculative decoding) it is a real option
  (:attr:`FieldDomain.unset_is_off`), and so is ``pd``'s None (the aggregated layout,
  :data:`UNSET_IS_OFF`); everywhere else it is the engine's default, resolved at
  launch (``mem_fraction_static``, ``max_running_requests``, ``chunked_prefill_size``, ...), so
  "every set value" of such a field names no family: every search sets the knobs it tunes (see
  :meth:`domain.lesson.Clause.problem`).

Numeric domains are infinite, so clause truth is evaluated over *representatives*: the bounds
(just inside an open bound), 0 and +-1, and each value a clause names with its neighbours (the
next integer, or the next float). Every comparison (``eq``, ``ne``, ``in``, ``not_in``, ``lt``,
``le``, ``gt``, ``ge``, ``is_null``, ``not_null``) changes truth only at those points, so a
clause that holds (or fails) on all representatives holds (or fails) on the whole domain, and a
set of clauses over one field has a common solution exactly when one representative satisfies
them all.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import cache, lru_cache
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import ValidationError

from domain.config import CHOICE_FIELDS, ServingConfig
from domain.engines import engine

BIG_INT = 10**18  # stands for "no bound" on an unbounded integer field
BIG_FLOAT = 1e300  # stands for "no bound" on an unbounded float field (finite: no inf/nan)
# Optional fields whose None is a layout of its own, not an engine default: ``pd`` None is the
# aggregated layout (every server prefills and decodes), so "pd is set" names a family.
UNSET_IS_OFF = ("pd",)


@dataclass(frozen=True)
class FieldDomain:
    """The valid values of one ServingConfig field.

    Attributes:
        field: the field name.
        nullable: whether ``None`` (unset) is valid.
        choices: the finite set of non-None values, or None for a numeric range.
        kind: ``int`` or ``float`` for a numeric range (None for a finite set).
        lo: lower bound of a numeric range (None: unbounded); ``lo_open``: excluded.
        hi: upper bound of a numeric range (None: unbounded); ``hi_open``: excluded.
        unset_is_off: ``None`` switches the feature off (a real option, its description says
            ``None = off``) rather than leaving the value to the engine's default.
    """

    field: str
    nullable: bool
    choices: tuple[Any, ...] | None = None
    kind: type | None = None
    lo: float | None = None
    lo_open: bool = False
    hi: float | None = None
    hi_open: bool = False
    unset_is_off: bool = False

    def describe(self) -> str:
        """The domain in words, e.g. ``integers 1..64`` or ``one of 'auto', 'bf16'``."""
        if self.choices is not None:
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        else:
            name = "integers" if self.kind is int else "numbers"

            def num(x: float) -> str:
                return str(int(x)) if self.kind is int else f"{x:g}"

            if self.lo is not None and self.hi is not None and not (self.lo_open or self.hi_open):
                text = f"{name} {num(self.lo)}..{num(self.hi)}"
            else:
                left = "(" if self.lo_open or self.lo is None else "["
                right = ")" if self.hi_open or self.hi is None else "]"
                lo = "-inf" if self.lo is None else num(self.lo)
                hi = "inf" if self.hi is None else num(self.hi)
                text = f"{name} in {left}{lo}, {hi}{right}"
            if self.field == "chunked_prefill_size":
                text += " except 0"
        return text + (", or unset (None)" if self.nullable else "")

    def contains(self, value: Any) -> bool:
        """True if ``value`` is a valid value of the field (type, range, membership)."""
        if value is None:
            return self.nullable
        if self.choices is not None:
            return any(type(value) is type(c) and value == c for c in self.choices)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.kind is int and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        if self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            return False
        if self.hi is not None and (value > self.hi or (self.hi_open and value == self.hi)):
            return False
        return _config_accepts(self.field, value)

    def bound_in_range(self, bound: float) -> bool:
        """True if a comparison bound lies within the field's range, its ends included.

        An open end counts (``mem_fraction_static lt 1.0`` is judged by its truth, not refused
        here); a bound past an end (``lt 5``) is outside the domain, as ``ne 5`` is. Finite
        sets have no range: always True.
        """
        if self.choices is not None:
            return True
        return ((self.lo is None or bound >= self.lo) and (self.hi is None or bound <= self.hi))

    def representatives(self, named: Iterable[Any] = ()) -> list[Any]:
        """Valid values at which a clause naming ``named`` values can change truth.

        Args:
            named: the values the clauses over this field name (bounds, members).

        Returns:
            Distinct valid values of the field (None first when the field is optional).
        """
        out: list[Any] = [None] if self.nullable else []
        if self.choices is not None:
            return out + list(self.choices)
        cands: list[float] = [0, 1, -1]
        lo = -BIG_INT if self.kind is int else -BIG_FLOAT
        hi = BIG_INT if self.kind is int else BIG_FLOAT
        cands += [self.lo if self.lo is not None else lo, self.hi if self.hi is not None else hi]
        for v in named:
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                continue
            cands.append(v)
            if self.kind is int:
                cands += [math.floor(v) - 1, math.floor(v), math.ceil(v), math.ceil(v) + 1]
            else:
                cands += [math.nextafter(v, -math.inf), math.nextafter(v, math.inf)]
        if self.kind is float:  # just inside open bounds
            if self.lo is not None:
                cands.append(math.nextafter(self.lo, math.inf))
            if self.hi is not None:
                cands.append(math.nextafter(self.hi, -math.inf))
        seen: set[float] = set()
        for c in cands:
            c = int(c) if self.kind is int else float(c)
            if c not in seen and self.contains(c):
                seen.add(c)
                out.append(c)
        return out


@lru_cache(maxsize=4096, typed=True)
def _config_accepts(field: str, value: Any) -> bool:
    """Whether a whole ServingConfig accepts ``value`` for ``field`` (its model validators)."""
    try:
        ServingConfig.model_validate({**_base_config(), field: value})
    except ValidationError:
        return False
    return True


@cache
def _base_config() -> dict[str, Any]:
    from domain.hardware import GPUS
    from domain.models import MODELS, get_model

    model = next(iter(MODELS))
    return {"model": model, "gpu": next(iter(GPUS)),
            "weights": next(iter(get_model(model).checkpoints))}


def _bound(metadata: list[Any], *names: str) -> tuple[float | None, bool]:
    for i, name in enumerate(names):
        for m in metadata:
            v = getattr(m, name, None)
            if v is not None:
                return float(v) if not isinstance(v, int) else v, i == 1
    return None, False


@cache
def field_domain(field: str) -> FieldDomain:
    """The domain of ServingConfig field ``field`` (see the module docstring).

    Raises:
        KeyError: ``field`` is not a ServingConfig field.
    """
    info = ServingConfig.model_fields[field]
    ann: Any = info.annotation
    nullable = False
    if get_origin(ann) in (Union, types.UnionType):
        args = [a for a in get_args(ann) if a is not type(None)]
        nullable = len(args) < len(get_args(ann))
        ann = args[0] if len(args) == 1 else ann
    off = nullable and ("None = off" in (info.description or "") or field in UNSET_IS_OFF)
    return replace(_plain_domain(field, ann, info, nullable), unset_is_off=off)


def _plain_domain(field: str, ann: Any, info: Any, nullable: bool) -> FieldDomain:
    """The domain of one field from its (non-None) annotation and bounds."""
    if field == "weights":
        from domain.models import MODELS, get_model
        from domain.quant import PRECISION_KEYS

        # the catalog's keys and every precision a user's model may name (model.checkpoints)
        keys = sorted({k for m in MODELS for k in get_model(m).checkpoints} | set(PRECISION_KEYS))
        return FieldDomain(field, nullable, choices=tuple(keys))
    if field == "pd":  # a PD layout: its "<n>P<m>D" names (group overrides are not a domain)
        return FieldDomain(field, nullable, choices=tuple(
            f"{p}P{d}D" for p in range(1, 5) for d in range(1, 5)))
    if field in CHOICE_FIELDS:
        keys = sorted({str(c) for v in engine("sglang").versions
                       for c in (engine("sglang", v).flag_inventory().get(field) or {})
                       .get("choices") or []})  # a version without the flag adds none
        return FieldDomain(field, nullable, choices=tuple(keys))
    if get_origin(ann) is Literal:
        return FieldDomain(field, nullable, choices=get_args(ann))
    if ann is bool:
        return FieldDomain(field, nullable, choices=(False, True))
    if ann in (int, float):
        lo, lo_open = _bound(info.metadata, "ge", "gt")
        hi, hi_open = _bound(info.metadata, "le", "lt")
        return FieldDomain(field, nullable, kind=ann, lo=lo, lo_open=lo_open, hi=hi,
                           hi_open=hi_open)
    raise KeyError(f"{field}: no domain rule for type {ann!r}")  # pragma: no cover
