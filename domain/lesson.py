"""Lessons: what a failure (or an estimate) taught, with a machine-checkable condition.

A lesson's *family* is the set of configs its condition matches inside its scope; the planner asks
``lesson.forbids(config)`` before launching anything, so one failure prunes its whole family.

Longer than 500 lines on purpose: a lesson's scope, its clauses and the matching rules
(:meth:`Lesson.forbids`) share one value model, layout fields (``pd`` by name) included;
split apart, a clause's comparison and the condition text could drift.
"""

from __future__ import annotations

import hashlib
import json
import math
from functools import cache, lru_cache
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from domain.config import ServingConfig
from domain.knob_domain import field_domain
from domain.provenance import (
    REAL_BACKENDS,
    Contradiction,
    Provenance,
    Status,
    StatusChange,
    now_iso,
)
from domain.redact import RedactedStr

Outcome = Literal["oom", "does-not-fit", "crash", "invalid-flag", "unsupported", "slo-miss",
                  "improvement", "regression"]
# Outcomes that mean "a config of this family cannot run"; the others only inform.
FORBIDDING = frozenset({"oom", "does-not-fit", "crash", "invalid-flag", "unsupported"})

Op = Literal["eq", "ne", "in", "not_in", "lt", "le", "gt", "ge", "is_null", "not_null"]


# Fields a lesson's condition may test: the tunable knobs (scope covers the rest).
KNOB_FIELDS = tuple(f for f in ServingConfig.model_fields
                    if f not in ("engine", "engine_version", "model", "gpu"))


@cache
def _field_adapter(name: str) -> TypeAdapter[Any]:
    return TypeAdapter(ServingConfig.model_fields[name].annotation or Any)


# Validation context for lessons read back from a store: a clause or condition that names no
# family (see Lesson.defect) is kept, marked and ignored instead of refused, so the store stays
# readable. Everywhere else (add_lesson, the analyst, the planner) such a lesson is refused.
STORED: dict[str, Any] = {"stored": True}


def _stored(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("stored"))


def _freeze(value: Any) -> Any:
    return tuple(_freeze(v) for v in value) if isinstance(value, list | tuple) else value


def _thaw(value: Any) -> Any:
    return [_thaw(v) for v in value] if isinstance(value, tuple) else value


@lru_cache(maxsize=4096, typed=True)
def _clause_problem(field: str, op: Op, frozen: Any) -> str | None:
    clause = Clause.model_construct(field=field, op=op, value=_thaw(frozen))
    dom = field_domain(field)
    if op in ("eq", "ne", "in", "not_in"):
        for v in (clause.value if op in ("in", "not_in") else [clause.value]):
            if not dom.contains(v):
                return (f"clause {clause.text()}: {v!r} is not in the domain of {field} "
                        f"({dom.describe()})")
    if op in ("lt", "le", "gt", "ge") and not dom.bound_in_range(clause.value):
        return (f"clause {clause.text()}: bound {clause.value!r} lies outside the domain of "
                f"{field} ({dom.describe()})")
    named = clause.value if op in ("in", "not_in") else [clause.value]
    reps = dom.representatives(named)
    truth = [clause.holds(v) for v in reps]
    if all(truth):
        return (f"clause {clause.text()} holds for every valid config ({field} takes "
                f"{dom.describe()}); name a narrower condition")
    if not any(truth):
        return (f"clause {clause.text()} holds for no config ({field} takes "
                f"{dom.describe()}); it would never match")
    if _set_only(field, op, frozen):
        return None  # "the knob is set": judged with the rest of the condition
    if _default_unset(field) and all(clause.holds(v) for v in reps if v is not None):
        return (f"clause {clause.text()} holds for every set value of {field} "
                f"({dom.describe()}), so it only says the knob is set, and every search sets "
                f"the knobs it tunes; name a narrower condition")
    return None


def _default_unset(field: str) -> bool:
    """Whether ``field`` is optional and unset means the engine's default (not "off")."""
    dom = field_domain(field)
    return dom.nullable and not dom.unset_is_off


@lru_cache(maxsize=4096, typed=True)
def _set_only(field: str, op: Op, frozen: Any) -> bool:
    """Whether a clause only says "this engine-default knob is set".

    Such a clause (``not_null``, ``ne None``, ``not_in [None]``) is true for every set value
    and false when unset.
    """
    if not _default_unset(field) or op not in ("not_null", "ne", "not_in"):
        return False
    clause = Clause.model_construct(field=field, op=op, value=_thaw(frozen))
    named = clause.value if op == "not_in" else [clause.value]
    return all(clause.holds(v) == (v is not None)
               for v in field_domain(field).representatives(named))


@lru_cache(maxsize=4096, typed=True)
def _condition_problem(frozen: tuple[tuple[str, Op, Any], ...]) -> str | None:
    clauses = [Clause.model_construct(field=f, op=o, value=_thaw(v)) for f, o, v in frozen]
    for c in clauses:
        if (problem := c.problem()) is not None:
            return problem
    if clauses and all(_set_only(c.field, c.op, _freeze(c.value)) for c in clauses):
        text = " AND ".join(c.text() for c in clauses)
        fields = ", ".join(dict.fromkeys(c.field for c in clauses))
        return (f"the condition {text} holds for every set value of {fields}: unset is the "
                "engine's default, and every search sets the knobs it tunes, so it would "
                "forbid every config of a study that tunes them; add a clause that narrows "
                "the family")
    for field in dict.fromkeys(c.field for c in clauses):
        mine = [c for c in clauses if c.field == field]
        named = [v for c in mine for v in (c.value if c.op in ("in", "not_in") else [c.value])]
        if len(mine) > 1 and not any(all(c.holds(v) for c in mine)
                                     for v in field_domain(field).representatives(named)):
            text = " AND ".join(c.text() for c in clauses)
            return (f"no config satisfies the condition {text}: its clauses on {field} "
                    "contradict each other")
    return None


def config_value(config: ServingConfig, field: str) -> Any:
    """The value of ``config.field`` a clause compares.

    The field's own value, except ``pd``: a PD layout compares as its ``"<n>P<m>D"`` name
    (the values its domain lists, :mod:`domain.knob_domain`), and a layout whose groups
    override fields as that name plus ``"+"`` and the overrides, which equals no name: a
    clause ``pd == '1P1D'`` covers the plain 1P1D layout only, ``pd is set`` every PD layout.
    A clause value given as a PD layout (validated from ``"1P1D"``) compares the same way.
    """
    value = getattr(config, field)
    return _pd_name(value) if field == "pd" else value


def _pd_name(value: Any) -> Any:
    from domain.config import PDLayout

    if not isinstance(value, PDLayout):
        return value
    extra = [f"{role}.{k}={v}" for role, group in (("prefill", value.prefill),
                                                   ("decode", value.decode))
             for k, v in group.model_dump().items() if k != "workers" and v is not None]
    return value.label() + ("+" + ",".join(extra) if extra else "")


LAYOUT_GE = ("attn_dp_size", "ep_num_redundant_experts")
"""Layout fields whose larger values need more memory per GPU with the rest fixed: attention
weights are replicated on every attention-DP rank (SGLang 0.5.23 ``layers/dp_attention.py``:
each rank's attention TP group is tp_size // attn_dp_size wide) and redundant experts are
extra expert copies (``--ep-num-redundant-experts``, sglang-knobs reference 1.8)."""
LAYOUT_LE = ("pp_size",)
"""Layout fields whose smaller values need more weight memory per GPU: PP stages split the
layers, so each GPU holds about 1 / pp_size of them (sglang-knobs reference 1.1)."""


def layout_clauses(config: ServingConfig, weights: bool = False) -> list[Clause]:
    """Clauses that keep a lesson's family inside ``config``'s parallel layout.

    Each layout field (``LAYOUT_FIELDS``) off its default is pinned: ``==`` its value (a PD
    layout by its name, or ``pd is set`` when its groups override fields; see
    :func:`config_value`). A failure of a DP-attention/EP config so forbids that family only:
    a DeepEP OOM at ``ep_size 8`` says nothing of TP8 without EP. Fields at their default add
    no clause, so the lessons of configs without a layout are unchanged.

    With ``weights`` (a weight-shard family: more weight per GPU fails too), the monotone
    fields widen the family instead: ``attn_dp_size >= a`` (:data:`LAYOUT_GE`), ``pp_size <= p``
    (:data:`LAYOUT_LE`, also at the default: a weight OOM at PP1 says nothing of PP2, which
    halves the layers per GPU), ``dp_size`` (full copies: the same weight per GPU) adds none,
    and a bound true for the whole domain is left out.
    """
    from domain.config import LAYOUT_FIELDS

    out: list[Clause] = []
    for name in LAYOUT_FIELDS:
        value = getattr(config, name)
        default = ServingConfig.model_fields[name].default
        dom = field_domain(name)
        if weights and name in LAYOUT_LE:
            if value < (dom.hi or math.inf):
                out.append(Clause(field=name, op="le", value=value))
            continue
        if value == default or (weights and name == "dp_size"):
            continue
        if weights and name in LAYOUT_GE:
            if value > (dom.lo or 0):
                out.append(Clause(field=name, op="ge", value=value))
            continue
        if name == "pd":
            pd_name = _pd_name(value)
            out.append(Clause(field="pd", op="eq", value=pd_name) if dom.contains(pd_name)
                       else Clause(field="pd", op="not_null"))
            continue
        out.append(Clause(field=name, op="eq", value=value))
    return out


def compare(op: str, v: Any, value: Any) -> bool:
    """Whether ``v`` stands in relation ``op`` to ``value`` (an order op with ``v`` None: False).

    Raises:
        TypeError: the values cannot be compared (e.g. ``"a" < 1``); callers decide what a
            clash means.
    """
    match op:
        case "eq":
            return bool(v == value)
        case "ne":
            return bool(v != value)
        case "in":
            return v in value
        case "not_in":
            return v not in value
        case "is_null":
            return v is None
        case "not_null":
            return v is not None
    if v is None:
        return False
    return bool({"lt": v < value, "le": v <= value, "gt": v > value, "ge": v >= value}[op])


class Clause(BaseModel):
    """One test over a ServingConfig field, e.g. ``tp_size le 4``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    field: str = Field(description="a ServingConfig field name")
    op: Op
    value: Any = None

    @model_validator(mode="after")
    def _valid(self, info: ValidationInfo) -> Clause:
        if self.field not in KNOB_FIELDS:
            raise ValueError(f"clause field {self.field!r} is not a knob of ServingConfig; "
                             f"known: {', '.join(KNOB_FIELDS)} (gpu, model, weights and engine "
                             "version belong in the lesson's scope)")
        if self.op in ("lt", "le", "gt", "ge") and (
                isinstance(self.value, bool) or not isinstance(self.value, int | float)
                or not math.isfinite(self.value)):
            raise ValueError(f"clause {self.field} {self.op}: value must be a finite number, "
                             f"not {self.value!r}")
        if self.op in ("in", "not_in") and not isinstance(self.value, list | tuple):
            raise ValueError(f"clause {self.field} {self.op}: value must be a list")
        if self.op in ("eq", "ne", "in", "not_in"):
            values = self.value if self.op in ("in", "not_in") else [self.value]
            adapter = _field_adapter(self.field)
            for v in values:
                try:
                    adapter.validate_python(v, strict=True)
                except ValidationError as e:
                    raise ValueError(f"clause {self.field} {self.op}: {v!r} is not a valid "
                                     f"{self.field} value") from e
        problem = self.problem()
        if problem is not None and not _stored(info):
            raise ValueError(problem)
        return self

    def problem(self) -> str | None:
        """Why this clause names no family, or None if it does.

        A clause must hold for some valid value of its field and fail for another (see
        :mod:`domain.knob_domain`), each value it compares for equality or membership must
        be a valid value of the field, and a comparison bound (``lt``/``le``/``gt``/``ge``)
        must lie within the field's range (``mem_fraction_static lt 5`` is refused as
        ``ne 5`` is).

        Unset (None) never satisfies a comparison (:meth:`holds` compares the raw config
        value, not the default the engine resolves at launch). On an optional field whose
        None is the engine's default (every optional knob but ``speculative_algorithm``,
        whose None means "off"; see :attr:`~domain.knob_domain.FieldDomain.unset_is_off`), a
        clause true for every *set* value (``mem_fraction_static gt 0``,
        ``max_running_requests le 65536``) therefore only says "the knob is set", and every
        search sets the knobs it tunes: it is refused. ``not_null`` on such a field is kept
        as a clause (``speculative_num_steps not_null AND speculative_eagle_topk is_null`` is
        a real family), but a condition made only of such clauses is a :meth:`Lesson.defect`.
        ``speculative_algorithm not_null`` ("any speculative decoding") is a real family.
        """
        return _clause_problem(self.field, self.op, _freeze(self.value))

    def holds(self, v: Any) -> bool:
        """True if a field value ``v`` satisfies this clause (False on a type clash)."""
        try:
            return compare(self.op, v, self.value)
        except TypeError:
            return False

    def matches(self, config: ServingConfig) -> bool:
        """True if ``config`` satisfies this clause (False for unknown fields or type clashes).

        The config's value is :func:`config_value` (a PD layout compares as its name).
        """
        if self.field not in ServingConfig.model_fields:
            return False
        return self.holds(config_value(config, self.field))

    def text(self) -> str:
        """Human-readable form, e.g. ``tp_size <= 4``."""
        sym = {"eq": "==", "ne": "!=", "in": "in", "not_in": "not in", "lt": "<", "le": "<=",
               "gt": ">", "ge": ">="}
        if self.op in ("is_null", "not_null"):
            return f"{self.field} is {'unset' if self.op == 'is_null' else 'set'}"
        return f"{self.field} {sym[self.op]} {self.value!r}"


class Scope(BaseModel):
    """Where a lesson applies. ``None`` fields match anything."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: str | None = None
    model: str | None = None
    quantization: str | None = Field(None, description="checkpoint key, e.g. 'fp8'")
    engine: str | None = "sglang"
    engine_version: str | None = None
    sm_major: int | None = Field(None, ge=1, le=99, description=(
        "CUDA compute-capability major of the GPU (domain/hardware.py GPU.sm_major: 10 for "
        "B200, 9 for H100/H200); set when the engine check tests the hardware, instead of "
        "naming one GPU"))

    @model_validator(mode="after")
    def _known(self, info: ValidationInfo) -> Scope:
        from domain.engines import ENGINES, engine
        from domain.hardware import GPUS
        from domain.models import MODELS, get_model

        # GPUS and MODELS hold the GPUs and models a study registered; a stored lesson may name
        # one this process has not (a study's own config.json): kept, it matches no config
        stored = _stored(info)
        if self.gpu is not None and not stored and self.gpu not in GPUS:
            raise ValueError(f"scope.gpu {self.gpu!r} is not in the GPU catalog: "
                             f"{', '.join(GPUS)}")
        if self.model is not None and not stored and self.model not in MODELS:
            raise ValueError(f"scope.model {self.model!r} is not in the model catalog: "
                             f"{', '.join(MODELS)}")
        if self.quantization is not None and not stored:
            known = sorted({k for m in MODELS for k in get_model(m).checkpoints})
            if self.quantization not in known:
                raise ValueError(f"scope.quantization {self.quantization!r}: known "
                                 f"checkpoints are {', '.join(known)}")
        if self.engine is not None and self.engine not in ENGINES:
            raise ValueError(f"scope.engine must be {' or '.join(map(repr, ENGINES))} or null")
        versions = engine(self.engine or "sglang").versions
        if self.engine_version is not None and self.engine_version not in versions:
            raise ValueError(f"scope.engine_version {self.engine_version!r}: supported "
                             f"{', '.join(versions)}")
        return self

    def matches(self, config: ServingConfig) -> bool:
        """True if ``config`` lies in this scope."""
        pairs = ((self.gpu, config.gpu), (self.model, config.model),
                 (self.quantization, config.weights), (self.engine, config.engine),
                 (self.engine_version, config.engine_version))
        if self.sm_major is not None:
            from domain.hardware import get_gpu

            if get_gpu(config.gpu).sm_major != self.sm_major:
                return False
        return all(want is None or want == have for want, have in pairs)


class Lesson(BaseModel):
    """A lesson learned from a trial (or from the memory-fit estimate before any launch)."""

    model_config = ConfigDict(extra="forbid")

    # Text and id fields are redacted (domain/redact.py) whenever a lesson is validated: when it
    # is made (add_lesson, the analyst, the planner) and when a stored one is read back. (Scope's
    # fields and clause values are checked against the catalogs and knob domains instead.)
    id: RedactedStr = Field("", description="content hash; filled by with_id()")
    title: RedactedStr = Field(min_length=3, max_length=300)
    scope: Scope
    condition: list[Clause] = Field(description="all clauses must hold (conjunction)")
    outcome: Outcome
    failure_class: RedactedStr | None = Field(None, description="e.g. OOM_WEIGHTS, "
                                              "INVALID_BACKEND")
    root_cause: RedactedStr = Field(max_length=5_000)
    fix: RedactedStr = Field(max_length=2_000)
    evidence: RedactedStr = Field(max_length=20_000,
                          description="log lines, arithmetic, or metrics that prove it")
    source: Literal["trial", "estimate", "research", "user"] = "trial"
    run_id: RedactedStr | None = None
    trial_id: RedactedStr | None = None
    verified: bool = Field(False, description="the condition was read from the guard of the "
                           "engine's raise/assert site (source_site) in the pinned source tree; "
                           "False: built from the failure taxonomy's rule alone (unverified)")
    source_site: RedactedStr | None = Field(None, max_length=300, description="file:line of "
                                            "the engine check the failure came from, e.g. "
                                            "'sglang/srt/layers/attention/vision.py:1331'")
    # provenance and trust (domain/provenance.py); None on lessons stored before issue 18
    provenance: Provenance | None = Field(None, description="where it was learned: backend, "
                                          "engine and version, image, run, trial, evidence")
    status: Status = Field("active", description="active | quarantined | retracted; only an "
                           "active lesson forbids anything")
    history: list[StatusChange] = Field(default_factory=list, description="every status "
                                        "change, oldest first")
    contradictions: list[Contradiction] = Field(
        default_factory=list, description="measurements where a config it forbids ran and "
        "served, oldest first")

    @model_validator(mode="after")
    def _not_universal(self, info: ValidationInfo) -> Lesson:
        if self.outcome in FORBIDDING and not self.condition:
            raise ValueError("a lesson that forbids configs needs at least one condition clause; "
                             "an empty condition would forbid every config in its scope")
        defect = self.defect()
        if defect is not None and not _stored(info):
            raise ValueError(defect)
        return self

    def defect(self) -> str | None:
        """Why this lesson's condition names no family of configs, or None if it does.

        A condition names a family when each clause holds for some valid value of its field
        and fails for another (see :meth:`Clause.problem` for optional knobs), every value it
        compares is a valid value of its field, the clauses over one field can hold together,
        and it says more than "these engine-default knobs are set" (``not_null`` alone). A
        lesson with a defect is refused when made; one read back from a store (validated with
        the ``STORED`` context) is kept but never forbids anything.
        """
        return _condition_problem(tuple((c.field, c.op, _freeze(c.value))
                                        for c in self.condition))

    def with_id(self) -> Lesson:
        """A copy whose id hashes scope + condition + outcome (same finding => same id)."""
        scope = self.scope.model_dump()
        if scope["sm_major"] is None:
            del scope["sm_major"]  # lessons made before Scope.sm_major keep their ids
        key = json.dumps({"scope": scope, "outcome": self.outcome,
                          "condition": [c.model_dump(mode="json") for c in self.condition]},
                         sort_keys=True, default=str)
        return self.model_copy(update={"id": "L-" + hashlib.sha256(key.encode()).hexdigest()[:10]})

    def matches(self, config: ServingConfig) -> bool:
        """True if ``config`` is in this lesson's family (scope and every clause hold).

        A source-verified lesson scoped to another engine version also matches when its guard
        is unchanged in ``config``'s version (:meth:`carries_to`).
        """
        scope = self.scope
        if scope.engine_version not in (None, config.engine_version) \
                and self.carries_to(config.engine_version)[0]:
            scope = scope.model_copy(update={"engine_version": None})
        return scope.matches(config) and all(c.matches(config) for c in self.condition)

    def carries_to(self, version: str) -> tuple[bool, str]:
        """Whether this lesson applies to engine ``version``, and why (``lessons show``).

        Its own version (or none in the scope): yes. Another: only when source-verified and the
        guard at ``source_site`` is unchanged in that version's fetched tree
        (:meth:`domain.engines.Engine.lesson_carries`; without the tree, no, naming the fetch
        command).
        """
        learned = self.scope.engine_version
        if learned in (None, version):
            return True, "the version it was learned on" if learned else "any version"
        if not (self.verified and self.source_site):
            return False, (f"learned on {self.scope.engine} {learned} and not source-verified: "
                           "it applies to that version only")
        from domain.engines import engine

        return engine(self.scope.engine or "sglang", version).lesson_carries(
            str(self.source_site), learned)

    def covers(self, config: ServingConfig) -> bool:
        """True if ``config`` is in the family this lesson says cannot run, whatever its status.

        A failure outcome, no :meth:`defect`, and a :meth:`match <matches>`.
        """
        return self.outcome in FORBIDDING and self.defect() is None and self.matches(config)

    def forbids(self, config: ServingConfig) -> bool:
        """True if the lesson says ``config`` cannot run: it is active and :meth:`covers` it.

        A lesson with a :meth:`defect` (read back from a store), a quarantined and a retracted
        lesson forbid nothing.
        """
        return self.status == "active" and self.covers(config)

    def applies_on(self, backend: str | None) -> bool:
        """Whether this lesson may prune a study on ``backend`` (twin, local, kubernetes).

        A twin study (or None: unknown) heeds every lesson; a real-backend study only lessons
        that are source-verified or were not learned on the twin (unknown provenance counts as
        the twin). See :mod:`domain.provenance`.
        """
        if backend not in REAL_BACKENDS or self.verified:
            return True
        return self.provenance is not None and self.provenance.backend != "twin"

    def prunes(self, config: ServingConfig, backend: str | None = None) -> bool:
        """True if this lesson keeps a study on ``backend`` from launching ``config``."""
        return self.forbids(config) and self.applies_on(backend)

    def trust(self) -> tuple[bool, str]:
        """``(trusted, why)``: whether this lesson is trusted, and why or why not.

        Trusted = active and (source-verified, or learned on a real backend and never
        contradicted). Only trusted lessons are exported to the skill.
        """
        if self.status != "active":
            last = self.history[-1].reason if self.history else "no reason recorded"
            return False, f"{self.status}: {last}"
        if self.verified:
            return True, f"source-verified ({self.source_site or 'site not recorded'})"
        p = self.provenance
        if p is None:
            return False, "unknown provenance (stored before provenance was recorded), " \
                          "not source-verified"
        if not p.real:
            return False, f"learned on {p.backend}, not source-verified"
        if self.contradictions:
            return False, (f"learned on {p.backend} but contradicted by "
                           f"{len(self.contradictions)} measurement(s)")
        return True, f"learned on {p.backend}, never contradicted"

    @property
    def trusted(self) -> bool:
        """See :meth:`trust`."""
        return self.trust()[0]

    def with_status(self, status: Status, reason: str, by: str,
                    at: str | None = None) -> Lesson:
        """A copy with ``status``, the change appended to :attr:`history`.

        Args:
            status: the new status.
            reason: why, in words (required: the history must say).
            by: who or what changed it, e.g. ``operator (cli)``.
            at: ISO 8601 UTC time (default now).

        Raises:
            ValueError: an empty reason.
        """
        if not reason.strip():
            raise ValueError(f"a reason is required to mark lesson {self.id} {status}")
        change = StatusChange(status=status, reason=reason.strip(), by=by, at=at or now_iso())
        return self.model_copy(update={"status": status, "history": [*self.history, change]})

    def condition_text(self) -> str:
        """The condition as ``a AND b`` text."""
        return " AND ".join(c.text() for c in self.condition) or "(always)"

    def document(self) -> str:
        """The text that is embedded for semantic search."""
        s = self.scope
        gpu = s.gpu or (f"SM {s.sm_major}.x GPUs" if s.sm_major else "any GPU")
        return (f"{self.title}. Outcome: {self.outcome} ({self.failure_class or '-'}). "
                f"Scope: {gpu}, {s.model or 'any model'}, "
                f"weights {s.quantization or 'any'}, {s.engine} {s.engine_version or ''}. "
                f"When: {self.condition_text()}. Cause: {self.root_cause} Fix: {self.fix} "
                f"Evidence: {self.evidence}")
