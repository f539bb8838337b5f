"""Source-grounded lesson conditions: what an engine check tests, and the lesson built from it.

A raise or assert site of the engine's source (found from the error message by
``mcp_servers/source/raises.py:locate_message``) raises when its *guard* holds: the enclosing
``if`` tests (and early exits passed before it), or the negated ``assert`` test. The guard is
read into :class:`GuardFacts`: a disjunction of conjunctions of atoms, each atom one thing the
guard tests:

* :class:`FlagAtom`: a server argument (a flag dest, e.g. ``mm_attention_backend``) compared
  with a literal, tested for truth, or compared with something that is not a literal.
* :class:`SmAtom`: the GPU's CUDA compute-capability major (``sm_major``: 10 for B200,
  9 for H100/H200; ``is_blackwell()`` is ``sm_major in [10, 11, 12]`` in SGLang 0.5.23,
  ``sglang/srt/utils/common.py:297``).
* :class:`PlatformAtom`: the device platform (``is_cuda()``, ``is_hip()``, ...).
* :class:`ModelAtom`: a property of the model (its HF config, MLA or not, ...); its value
  is not known here, so it decides nothing, and a lesson that needs it names the model.
* :class:`OpaqueAtom`: anything else (a function argument, a loop variable, a call result).

:func:`grounded_condition` builds a lesson's scope and condition from exactly the atoms of one
conjunction that the failing config satisfies, never from other fields of that config: the
lesson then forbids the failing config and every config that differs from it only in fields
the check does not test, and no config on which the guard is false.

Engine-neutral: flag dests are the engine's own names, which are ServingConfig's field names.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from domain.config import ServingConfig
from domain.errors import ServetuneError
from domain.hardware import get_gpu
from domain.lesson import Clause, Scope, compare

CmpOp = Literal["eq", "ne", "in", "not_in", "lt", "le", "gt", "ge", "is_null", "not_null"]
FlagOp = Literal["eq", "ne", "in", "not_in", "lt", "le", "gt", "ge", "is_null", "not_null",
                 "truthy", "falsy", "compared"]
# Every GPU of the catalog (domain/hardware.py) is an NVIDIA GPU, so a CUDA device.
CATALOG_PLATFORM = "cuda"


class NotGrounded(ServetuneError):
    """The guard cannot be turned into a lesson condition for this config.

    The message says why (no conjunction holds for the config, or the one that holds tests
    something a ServingConfig cannot express); callers fall back to the failure taxonomy's
    rule and mark the lesson unverified.
    """


class FlagAtom(BaseModel):
    """A server argument the guard tests."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["flag"] = "flag"
    dest: str = Field(description="flag dest, e.g. 'mm_attention_backend'")
    op: FlagOp = Field(description="eq..not_null compare with `value`; truthy/falsy: `if x` / "
                                   "`if not x`; compared: compared with a non-literal (the "
                                   "failing config's value is used)")
    value: Any = Field(None, description="the literal compared with (a list for in/not_in)")
    default: Any = Field(None, description="the flag's declared default (see default_known)")
    default_known: bool = Field(False, description="the default is a literal, not computed")
    text: str = Field(description="the comparison as written in the source")
    via: str | None = Field(None, description="the local assignment followed, e.g. "
                                              "'backend = override_backend (line 1301)'")

    def holds(self, v: Any) -> bool | None:
        """Whether value ``v`` of the flag satisfies the atom (None: cannot tell)."""
        match self.op:
            case "truthy":
                return bool(v)
            case "falsy":
                return not v
            case "compared":
                return None
        try:
            return compare(self.op, v, self.value)
        except TypeError:
            return None


class SmAtom(BaseModel):
    """The GPU's compute-capability major: ``sm_major <op> value``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["sm"] = "sm"
    op: CmpOp
    value: Any = Field(description="an int, or a list of ints for in/not_in")
    text: str
    source: str | None = Field(None, description="where the predicate is defined, e.g. "
                                                 "'sglang/srt/utils/common.py:297'")

    def holds(self, sm_major: int) -> bool:
        """Whether a GPU of compute-capability major ``sm_major`` satisfies the atom."""
        probe = FlagAtom(dest="sm_major", op=self.op, value=self.value, text=self.text)
        return bool(probe.holds(sm_major))


class PlatformAtom(BaseModel):
    """The device platform: holds when ``(platform == CATALOG_PLATFORM) == value``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["platform"] = "platform"
    platform: str = Field(description="cuda, cuda_alike, hip, npu, xpu, musa, mps, cpu, ...")
    value: bool = True
    text: str

    def holds(self) -> bool:
        """Whether the catalog's GPUs (all NVIDIA, CUDA) satisfy the atom."""
        cuda = self.platform in ("cuda", "cuda_alike")
        return cuda == self.value


class ModelAtom(BaseModel):
    """A property of the model the guard tests (holds for the failing model, by assumption)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["model"] = "model"
    text: str


class OpaqueAtom(BaseModel):
    """Something the guard tests that is neither a flag, the hardware nor the model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["opaque"] = "opaque"
    text: str


Atom = Annotated[FlagAtom | SmAtom | PlatformAtom | ModelAtom | OpaqueAtom,
                 Field(discriminator="kind")]


class GuardFacts(BaseModel):
    """What the guard of one raise/assert site tests, as a disjunction of conjunctions."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    site: str = Field(description="file:line of the raise or assert, e.g. "
                                  "'sglang/srt/layers/attention/vision.py:1331'")
    exception: str = Field(description="exception type raised, e.g. 'ValueError'")
    guard: str = Field(description="the raise's condition as source text ('True' when it "
                                   "raises unconditionally)")
    disjuncts: list[list[Atom]] = Field(description="the site raises when every atom of one "
                                                    "inner list holds")
    truncated: bool = Field(False, description="the guard had too many disjuncts; only the "
                                               "first ones are kept")

    @property
    def flags(self) -> list[str]:
        """The flag dests the guard tests, in first-seen order."""
        return list(dict.fromkeys(a.dest for d in self.disjuncts for a in d
                                  if isinstance(a, FlagAtom)))

    @property
    def hardware(self) -> list[str]:
        """The hardware facts the guard tests, as source text."""
        return list(dict.fromkeys(a.text for d in self.disjuncts for a in d
                                  if isinstance(a, SmAtom | PlatformAtom)))

    @property
    def tests_model(self) -> bool:
        """Whether the guard tests a property of the model."""
        return any(isinstance(a, ModelAtom) for d in self.disjuncts for a in d)


def _value(config: ServingConfig, atom: FlagAtom) -> tuple[bool, Any]:
    """(known, value) of the atom's flag in ``config``: its field, else the flag's default.

    A field left unset (None) whose default the engine computes or resolves at start-up
    (``default_known`` False, e.g. ``--page-size``: the attention backend's page) is unknown.
    """
    if atom.dest in ServingConfig.model_fields:
        v = getattr(config, atom.dest)
        if v is None and not atom.default_known:
            return False, None
        return True, v
    return atom.default_known, atom.default


def _atom_holds(config: ServingConfig, atom: Atom) -> bool | None:
    if isinstance(atom, FlagAtom):
        known, v = _value(config, atom)
        return atom.holds(v) if known else None
    if isinstance(atom, SmAtom):
        return atom.holds(get_gpu(config.gpu).sm_major)
    if isinstance(atom, PlatformAtom):
        return atom.holds()
    return None  # a model property or an opaque value: the config does not say


def _clause(config: ServingConfig, atom: FlagAtom) -> Clause | None:
    """The clause for one flag atom (None: the field is not a knob; its default is fixed)."""
    from domain.lesson import KNOB_FIELDS

    if atom.dest not in KNOB_FIELDS:
        return None
    v = getattr(config, atom.dest)
    exact = Clause(field=atom.dest, op="is_null") if v is None else None
    tries: list[dict[str, Any]] = []
    if atom.op in ("truthy", "falsy") and isinstance(v, bool):
        tries.append({"op": "eq", "value": v})
    elif atom.op not in ("truthy", "falsy", "compared"):
        tries.append({"op": atom.op, "value": atom.value})
    tries.append({"op": "eq", "value": v})
    for kw in tries:
        if kw["value"] is None and kw["op"] == "eq":
            if exact is not None:
                return exact
            continue
        try:
            return Clause(field=atom.dest, **kw)
        except (ValidationError, ValueError):
            continue  # e.g. a bound outside the knob's domain: the failing value is narrower
    if exact is not None:
        return exact
    raise NotGrounded(f"no lesson clause can express {atom.text} for {atom.dest}={v!r}")


def _forceable(config: ServingConfig, atom: Atom) -> bool:
    """Whether the lesson pins the atom's inputs.

    True for a model property (the scope names the model) and for a comparison of a flag the
    config states (or that sits at a literal default): not for a field left unset whose value
    the engine resolves at start-up (:func:`_value`).
    """
    if isinstance(atom, ModelAtom):
        return True
    return isinstance(atom, FlagAtom) and atom.op == "compared" and _value(config, atom)[0]


def _build(config: ServingConfig, conj: list[Atom]) -> tuple[Scope, list[Clause]]:
    clauses: list[Clause] = []
    for a in conj:
        if isinstance(a, FlagAtom) and (c := _clause(config, a)) is not None \
                and c not in clauses:
            clauses.append(c)
    sm = get_gpu(config.gpu).sm_major if any(isinstance(a, SmAtom) for a in conj) else None
    model = any(isinstance(a, ModelAtom) for a in conj)
    scope = Scope(engine=config.engine, engine_version=config.engine_version, sm_major=sm,
                  model=config.model if model else None,
                  quantization=config.weights if model else None)
    return scope, clauses


def grounded_condition(config: ServingConfig, facts: GuardFacts) -> tuple[Scope, list[Clause]]:
    """The lesson scope and condition for ``config`` failing at the site of ``facts``.

    Picks the first conjunction of the guard whose every atom the config satisfies (flag atoms
    read the config's field, or the flag's declared default for a flag ServingConfig does not
    hold; SM atoms the GPU's ``sm_major``); when none is decided true but exactly one is not
    false, that one held (the config failed at this site), its model properties and the
    comparisons of its flags with non-literals included. Exactly its atoms become the lesson:

    * a flag compared with a literal gives that clause (``mm_attention_backend eq 'fa3'``);
      a truth test or a comparison with a non-literal gives ``field eq <failing value>``; a
      clause the knob's domain refuses is narrowed to ``eq <failing value>``;
    * a flag that is not a ServingConfig knob is at its default in every config, so it adds
      no clause;
    * an SM atom sets ``scope.sm_major`` to the GPU's; a model atom sets ``scope.model`` (and
      the checkpoint); platform atoms hold on every catalog GPU and add nothing;
    * the scope keeps the engine and its version; it names no GPU (the SM stands for it).

    Returns:
        (scope, clauses); clauses may be empty when the guard tests only hardware or the model.

    Raises:
        NotGrounded: no conjunction holds for the config, or the one that holds tests a
            function argument or another value the config cannot express (an opaque atom).
    """
    truths = [[_atom_holds(config, a) for a in conj] for conj in facts.disjuncts]
    open_ = [i for i, t in enumerate(truths) if False not in t]
    chosen = next((i for i in open_ if all(t is True for t in truths[i])), None)
    reasons: list[str] = []
    if chosen is None and len(open_) == 1 and not facts.truncated:
        # The config failed here, so some conjunction held, and every other one is false for
        # it: this one held, its comparisons with non-literals included.
        i = open_[0]
        if all(t is True or _forceable(config, a) for a, t in zip(facts.disjuncts[i],
                                                                   truths[i], strict=True)):
            chosen = i
    if chosen is not None:
        return _build(config, facts.disjuncts[chosen])
    for i in open_:
        unknown = [a.text for a, t in zip(facts.disjuncts[i], truths[i], strict=True)
                   if t is None]
        reasons.append(f"it tests {'; '.join(unknown)}, which the config does not state")
    why = "; ".join(reasons) if reasons else "no branch of the guard holds for this config"
    raise NotGrounded(f"the guard of {facts.site} ({facts.guard}) gives no condition for this "
                      f"config: {why}")
