"""Offline validation of rendered manifests, as strict as the API server's schema checks.

Built-in kinds are checked by ``kubernetes-validate`` in strict mode (unknown fields are errors)
against the JSON schemas of the target Kubernetes release. Custom resources are checked with
``jsonschema`` against the ``openAPIV3Schema`` their publisher ships in its CRD (files in
``sandbox/schemas/``, provenance in its README), and the pod templates they embed (a
LeaderWorkerSet's leader and worker templates) as the target release's PodTemplateSpec through
``kubernetes-validate``. A kind neither knows is an error: an object
whose schema is unknown is an object nobody checked.

Two rules the API server enforces outside the schemas are checked as well: object names must be
DNS names (RFC 1123), and a Deployment's selector must match its pod template's labels.
"""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
from kubernetes_validate.utils import all_versions

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"
# (apiVersion, kind) -> schema file in SCHEMA_DIR (see its README for the source of each)
CUSTOM_SCHEMAS: dict[tuple[str, str], str] = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset-v1.json",
}
K8S_VERSION_RE = re.compile(r"v?(1)\.(\d{1,3})(?:\.\d+)?")
# RFC 1123 label (Namespace, Service names) and subdomain (every other name), as
# k8s.io/apimachinery/pkg/util/validation defines them
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_NAMED_KINDS = ("Namespace", "Service")


def supported_versions() -> list[str]:
    """Kubernetes minor releases (``'1.33'``) whose schemas ship in kubernetes-validate 1.37.0."""
    return sorted({".".join(v.split(".")[:2]) for v in all_versions()}, key=minor)


def minor(k8s_version: str) -> int:
    """The minor number of a Kubernetes version: ``'1.33'`` -> 33 (``'v1.33.2'`` too).

    Raises:
        ValueError: not a ``1.N`` version.
    """
    m = K8S_VERSION_RE.fullmatch(k8s_version.strip())
    if not m:
        raise ValueError(f"Kubernetes version {k8s_version!r}: give MAJOR.MINOR, e.g. 1.33")
    return int(m.group(2))


def check_k8s_version(k8s_version: str) -> str:
    """``k8s_version`` as ``'1.N'`` if kubernetes-validate has schemas for it.

    Raises:
        ValueError: malformed, or outside the releases kubernetes-validate ships (named).
    """
    n = minor(k8s_version)
    known = supported_versions()
    if f"1.{n}" not in known:
        raise ValueError(f"Kubernetes version {k8s_version!r} has no schemas here; supported: "
                         f"{known[0]} to {known[-1]}")
    return f"1.{n}"


def validate(objs: list[dict[str, Any]], k8s_version: str = "1.33") -> list[str]:
    """Check every object against the schema of its kind for Kubernetes ``k8s_version``.

    Args:
        objs: manifests as plain dicts (what ``yaml.safe_load`` gives).
        k8s_version: target release, ``'1.33'``.

    Returns:
        One line per problem, ``'<Kind>/<name>: <field path>: <message>'``; empty when all pass.
        kubernetes-validate stops at the first schema error of an object, so an object yields
        at most one schema line (plus name/selector lines).

    Raises:
        ValueError: ``k8s_version`` malformed or unsupported.
    """
    version = check_k8s_version(k8s_version)
    errors: list[str] = []
    for i, obj in enumerate(objs):
        if not isinstance(obj, dict) or not obj.get("apiVersion") or not obj.get("kind"):
            errors.append(f"object #{i}: not a Kubernetes object (needs apiVersion and kind)")
            continue
        where = f"{obj['kind']}/{(obj.get('metadata') or {}).get('name', '?')}"
        errors += [f"{where}: {e}" for e in _schema_errors(obj, version)]
        errors += [f"{where}: {e}" for e in _server_rules(obj)]
    return errors


def _schema_errors(obj: dict[str, Any], version: str) -> list[str]:
    key = (obj["apiVersion"], obj["kind"])
    if key in CUSTOM_SCHEMAS:
        return _custom_errors(obj, CUSTOM_SCHEMAS[key], version)
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{_path(e.absolute_path)}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError:
        return [f"unknown kind {obj['kind']} of apiVersion {obj['apiVersion']} for Kubernetes "
                f"{version}: neither a built-in kind of that release nor a custom resource "
                f"with a schema in sandbox/schemas ({', '.join(k for _, k in CUSTOM_SCHEMAS)})"]
    return []


def _custom_errors(obj: dict[str, Any], schema_file: str, version: str) -> list[str]:
    validator = jsonschema.Draft7Validator(_strict_crd_schema(schema_file))
    found = [f"{_path(e.absolute_path)}: {e.message}"
             for e in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))]
    # The CRD declares metadata as a bare object; the API server checks it as ObjectMeta.
    shell = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj.get("metadata") or {}}
    try:
        kubernetes_validate.validate(shell, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        found.append(f"{_path(e.absolute_path)}: {e.message}")
    # Pod templates inside the custom resource are also checked as the target release's own
    # PodTemplateSpec (the CRD embeds the schema of the release it was generated against).
    for where, template in _embedded_pod_templates(obj):
        holder = {"apiVersion": "v1", "kind": "PodTemplate",
                  "metadata": {"name": "check"}, "template": template}
        try:
            kubernetes_validate.validate(holder, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            inner = list(e.absolute_path)[1:]  # drop the holder's "template"
            found.append(f"{where}{'.' + _path(inner) if inner else ''}: {e.message}")
    return found


def _embedded_pod_templates(obj: dict[str, Any]) -> list[tuple[str, Any]]:
    """(path, PodTemplateSpec) of the pod templates a custom resource embeds.

    LeaderWorkerSet: ``spec.leaderWorkerTemplate.leaderTemplate`` and ``workerTemplate``
    (leaderworkerset.x-k8s.io/v1 API, kubernetes-sigs/lws ``api/leaderworkerset/v1``).
    """
    if obj.get("kind") != "LeaderWorkerSet":
        return []
    spec = obj.get("spec")
    lwt = spec.get("leaderWorkerTemplate") if isinstance(spec, dict) else None
    if not isinstance(lwt, dict):
        return []
    base = "spec.leaderWorkerTemplate"
    return [(f"{base}.{key}", lwt[key]) for key in ("leaderTemplate", "workerTemplate")
            if isinstance(lwt.get(key), dict)]


@cache
def _strict_crd_schema(schema_file: str) -> dict[str, Any]:
    """The CRD's structural schema with unknown fields refused, as strict field validation does.

    An object schema with ``properties`` and neither ``additionalProperties`` nor
    ``x-kubernetes-preserve-unknown-fields`` gets ``additionalProperties: false`` (the API
    server drops such fields, or refuses them with ``fieldValidation=Strict``, kubectl's
    default since 1.27).
    """
    data = json.loads((SCHEMA_DIR / schema_file).read_text())
    schema = copy.deepcopy(data["openAPIV3Schema"])

    def close(node: Any) -> None:
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


def _server_rules(obj: dict[str, Any]) -> list[str]:
    found: list[str] = []
    name = (obj.get("metadata") or {}).get("name")
    if isinstance(name, str):
        label = obj["kind"] in LABEL_NAMED_KINDS
        pattern, limit = (DNS_LABEL, 63) if label else (DNS_SUBDOMAIN, 253)
        if len(name) > limit or not pattern.fullmatch(name):
            found.append(f"metadata.name: {name!r} is not a DNS-1123 "
                         f"{'label' if label else 'subdomain'} (lowercase letters, digits and "
                         f"'-', at most {limit} characters)")
    if obj["kind"] == "Deployment":
        spec = obj.get("spec") or {}
        want = (spec.get("selector") or {}).get("matchLabels") or {}
        have = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
        if any(have.get(k) != v for k, v in want.items()):
            found.append("spec.selector: does not match the template's labels "
                         "(spec.template.metadata.labels)")
    return found


def _path(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(object)"
