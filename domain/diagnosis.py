"""Diagnose a pasted engine log: its failure class, phase, evidence, fix and the lesson it teaches.

What ``servetune diagnose`` and the lessons MCP tool ``diagnose_log`` share (engine-neutral;
the engine reads its own log through :meth:`domain.engines.Engine.diagnose` and
:meth:`~domain.engines.Engine.logged_settings`):

1. the engine's diagnosis of the log (:class:`domain.failures.Diagnosis`);
2. the config the log ran, when one can be formed: the GPU and model given by the caller, the
   fields the log's ``server_args`` line states (its ``model_path`` also names the model and
   checkpoint when the catalog ships it);
3. the lesson the diagnosis teaches for that config (the taxonomy's rule), or why none can be
   formed (a transient class, no config, a refused setting servetune's config has no field for).

Source grounding is the caller's ``ground`` hook, given when a source tree is at hand: it
finds the message's raise or assert site and the facts of its guard
(:class:`domain.grounding.GuardFacts`). The diagnosis then names that site, and the flags the
guard tests (``verified``); the lesson's condition is built from exactly those facts
(:func:`domain.grounding.grounded_condition`), never from other fields of the failed config.
Where the guard gives no condition (it tests only hardware, the model or a value the config
cannot express), or without a source tree, the condition is the taxonomy's rule and the lesson
is unverified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from domain.config import ServingConfig
from domain.engines import Engine, engine
from domain.errors import ConfigInvalid
from domain.failures import TAXONOMY, Diagnosis, NoLesson
from domain.grounding import GuardFacts, NotGrounded, grounded_condition
from domain.lesson import Lesson
from domain.provenance import Provenance, evidence_lines, now_iso

# the hook that grounds a diagnosis in a source tree: the diagnosis with its site and the flags
# its guard tests, and the guard's facts (None: no site matched the message)
Ground = Callable[[Diagnosis, Sequence[str]], tuple[Diagnosis, GuardFacts | None]]

# ServingConfig fields a log's server_args cannot state (servetune's own, or the scope's)
_NOT_LOGGED = ("engine", "engine_version", "model", "gpu", "weights", "replicas", "router_policy",
               "router_cache_threshold", "router_balance_abs_threshold",
               "router_balance_rel_threshold")
JSON_KEYS = ("class", "phase", "evidence", "source", "flags", "retry", "fix", "lesson")


class DiagnosisReport(BaseModel):
    """A diagnosis with the config it was read against and the lesson it would write."""

    diagnosis: Diagnosis
    config: ServingConfig | None = None
    config_problem: str | None = None  # why no config could be formed
    lesson: Lesson | None = None
    no_lesson: str | None = None  # why no lesson is formed

    def as_json(self) -> dict[str, Any]:
        """The ``--json`` object: exactly the keys of :data:`JSON_KEYS`."""
        d = self.diagnosis
        return {"class": d.failure_class, "phase": d.phase, "evidence": d.evidence,
                "source": d.source, "flags": list(d.flags), "retry": d.retry, "fix": d.fix,
                "lesson": None if self.lesson is None else self.lesson.model_dump(mode="json")}


def _checkpoint_of(model_path: str) -> tuple[str, str] | None:
    """(model, weights) of the catalog checkpoint whose --model-path is ``model_path``."""
    from domain.models import MODELS, get_model

    want = model_path.rstrip("/").lower()
    for name in MODELS:
        for key, ckpt in get_model(name).checkpoints.items():
            path = ckpt.model_path.lower()
            if want == path or want.endswith("/" + path.split("/")[-1]):
                return name, key
    return None


def config_from_log(eng: Engine, log: Sequence[str], gpu: str | None, model: str | None,
                    weights: str | None = None) -> tuple[ServingConfig | None, str | None]:
    """The config ``log`` ran (None and why when it cannot be formed).

    ``gpu`` must be given (a log seldom names the GPU); ``model`` and ``weights`` default to the
    catalog checkpoint whose ``--model-path`` the log's server_args name. A logged value the
    config refuses (e.g. a flag value outside servetune's knob domain) is left out.
    """
    settings = eng.logged_settings(log)
    found = _checkpoint_of(str(settings["model_path"])) if settings.get("model_path") else None
    if model is None and found is not None:
        model = found[0]
    if gpu is None or model is None:
        missing = " and ".join(x for x, v in (("--gpu", gpu), ("--model", model)) if v is None)
        return None, (f"no config: give {missing} (the log's server_args name no catalog "
                      "checkpoint)" if model is None else f"no config: give {missing}")
    if weights is None:
        from domain.models import get_model

        ckpts = list(get_model(model).checkpoints)
        if found is not None and found[0] == model:
            weights = found[1]
        elif len(ckpts) == 1:
            weights = ckpts[0]
        else:
            return None, (f"no config: model {model} has the checkpoints {', '.join(ckpts)} "
                          "and the log's model_path names none; give --weights")
    kw: dict[str, Any] = {k: v for k, v in settings.items() if k in ServingConfig.model_fields
                          and k not in _NOT_LOGGED and v is not None}
    base: dict[str, Any] = {"engine": eng.name, "engine_version": eng.version, "gpu": gpu,
                            "model": model, "weights": weights}
    for _ in range(len(kw) + 1):
        try:
            return ServingConfig(**base, **kw), None
        except ValidationError as e:
            bad = {str(err["loc"][0]) for err in e.errors() if err["loc"]}
            if not bad & set(kw):
                return None, f"no config: {e.errors()[0]['msg']}"
            for k in bad & set(kw):
                kw.pop(k)
    return None, "no config: the logged settings do not form one"


def diagnose_log(lines: Sequence[str], engine_name: str = "sglang", version: str | None = None,
                 gpu: str | None = None, model: str | None = None, weights: str | None = None,
                 ground: Ground | None = None) -> DiagnosisReport:
    """Diagnose ``lines`` and form the lesson it teaches (module docstring).

    Raises:
        ValueError: an empty log, or an engine or version servetune does not know (naming the
            supported ones).
        ConfigInvalid: a GPU or model outside the catalogs (naming them).
    """
    if not any(x.strip() for x in lines):
        raise ValueError("the log is empty: paste the engine's output (the lines around the "
                         "failure)")
    eng = engine(engine_name, version)
    if gpu is not None:
        from domain.hardware import get_gpu

        get_gpu(gpu)
    if model is not None:
        from domain.models import MODELS

        if model not in MODELS:
            raise ConfigInvalid([f"model: unknown model {model!r}; known: {', '.join(MODELS)}"])
    # a line longer than any engine message is cut, and control bytes are shown as U+FFFD,
    # so a pasted binary or a runaway line cannot flood the evidence or the lesson
    lines = [_printable(x[:MAX_LINE_CHARS]) for x in lines]
    d = eng.diagnose(lines)
    if d.failure_class == "UNKNOWN":  # nothing known failed: nothing to learn
        served = d.phase == "serving"
        return DiagnosisReport(diagnosis=d, no_lesson=(
            "no lesson: no known failure in the log" + (
                " (the server reached serving; a healthy log teaches nothing)" if served
                else "")))
    facts = None
    if ground is not None:
        d, facts = ground(d, lines)
    config, problem = config_from_log(eng, lines, gpu, model, weights)
    report = DiagnosisReport(diagnosis=d, config=config, config_problem=problem)
    if config is None:
        return report.model_copy(update={"no_lesson": f"the lesson cannot be formed: {problem}"})
    grounded = _grounded(eng, config, d, facts, lines) if facts is not None else None
    if grounded is not None:
        return report.model_copy(update={"lesson": grounded})
    unstated = _unstated_flags(d) if facts is not None else []
    if unstated:  # the taxonomy's rule would forbid configs on which the check is false
        return report.model_copy(update={"no_lesson": (
            f"the lesson cannot be formed: the engine check at {d.source} tests "
            f"{', '.join(unstated)}, which servetune's config has no field for, so no "
            "condition can name it")})
    try:  # the taxonomy's rule: an unverified condition, whatever the diagnosis found
        lesson = eng.diagnosis_lesson(config, d.model_copy(update={"verified": False}),
                                      list(lines))
    except NoLesson as e:
        return report.model_copy(update={"no_lesson": f"the lesson cannot be formed: {e}"})
    if not d.verified:  # the flags are the ones the taxonomy's condition tests
        flags = [_flag(c.field) for c in lesson.condition if c.field != "weights"]
        d = d.model_copy(update={"flags": list(dict.fromkeys(flags))})
    return report.model_copy(update={"diagnosis": d, "lesson": lesson})


MAX_LINE_CHARS = 2000  # longer than any SGLang 0.5.23 error line with its traceback prefix


def _printable(line: str) -> str:
    """``line`` with control characters other than tab replaced by U+FFFD."""
    if line.isprintable():
        return line
    return "".join(c if c.isprintable() or c == "\t" else "\ufffd" for c in line)


def _unstated_flags(d: Diagnosis) -> list[str]:
    """The flags a verified diagnosis's guard tests that no ServingConfig field states."""
    if not d.verified:
        return []
    return [f for f in d.flags
            if f.lstrip("-").replace("-", "_") not in ServingConfig.model_fields]


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _grounded(eng: Engine, config: ServingConfig, d: Diagnosis, facts: GuardFacts,
              lines: Sequence[str]) -> Lesson | None:
    """The lesson whose condition is exactly the guard's atoms the config satisfies.

    None when the guard gives no condition for the config, or the class teaches no lesson.
    """
    fc = TAXONOMY.get(d.failure_class)
    if fc is None or fc.outcome is None:
        return None
    try:
        scope, clauses = grounded_condition(config, facts)
    except NotGrounded:
        return None
    if not clauses:  # only hardware or the model: a forbidding lesson needs a clause
        return None
    when = " AND ".join(c.text() for c in clauses)
    try:
        return Lesson(
            title=f"{eng.label} {eng.version} refuses {when} ({facts.site})"[:300],
            scope=scope, condition=clauses, outcome=fc.outcome, failure_class=d.failure_class,
            root_cause=f"{eng.label} {eng.version} raises {facts.exception} at {facts.site} "
                       f"when {facts.guard}: {d.evidence}",
            fix=d.fix, evidence="\n".join(list(lines)[-6:]), source="user", verified=True,
            source_site=facts.site, provenance=Provenance(
                backend="user", engine=eng.name, engine_version=eng.version,
                evidence=evidence_lines("\n".join(list(lines)[-6:])),
                learned_at=now_iso())).with_id()
    except ValueError:  # the condition names no family (Lesson.defect)
        return None
