"""Pieces every servetune pod shares: the ``restricted`` security contexts, names and labels.

The Pod Security Standard ``restricted`` (kubernetes.io/docs/concepts/security/
pod-security-standards/) requires runAsNonRoot, allowPrivilegeEscalation false, every
capability dropped and a RuntimeDefault (or Localhost) seccomp profile; servetune pods also pin
uid/gid 1000, the non-root user of servetune's image (``sandbox/Dockerfile``).
"""

from __future__ import annotations

import re
from typing import Any

RUN_AS = 1000
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
DEPLOYMENT_LABEL = "servetune.io/deployment"
COMPONENT_LABEL = "servetune.io/component"
STUDY_LABEL = "servetune.io/study"
TRIAL_LABEL = "servetune.io/trial"
# k8s.io/apimachinery/pkg/util/validation: DNS-1123 label; label key prefix/name and value
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
LABEL_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def pod_security() -> dict[str, Any]:
    """The pod-level securityContext of the ``restricted`` profile, uid/gid 1000."""
    return {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security() -> dict[str, Any]:
    """The container-level securityContext of the ``restricted`` profile."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True, "runAsUser": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"}}


def check_name(name: str, limit: int = 63, what: str = "name") -> str:
    """``name`` if it is a DNS-1123 label of at most ``limit`` characters.

    Raises:
        ValueError: saying what a valid name looks like.
    """
    if not isinstance(name, str) or len(name) > limit or not DNS_LABEL.fullmatch(name):
        raise ValueError(f"{what} {name!r}: use lowercase letters, digits and '-', starting and "
                         f"ending with a letter or digit, at most {limit} characters "
                         "(a DNS-1123 label)")
    return name


# namespaces a sandbox must never take over: the cluster's own (kube-system holds DNS, whose
# traffic a sandbox NetworkPolicy would cut) and the default namespace other workloads share
RESERVED_NAMESPACES = frozenset({"default", "kube-system", "kube-public", "kube-node-lease"})
# an image reference: [registry[:port]/]path[:tag][@digest] (distribution/reference grammar,
# lowercase path components; kept simple: no spaces, no leading '-')
IMAGE_REF = re.compile(r"[a-z0-9][a-z0-9._-]*(?::[0-9]+)?(?:/[a-z0-9][a-z0-9._/-]*)*"
                       r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[a-f0-9]{64})?")


def check_subdomain(name: str, what: str = "name") -> str:
    """``name`` if it is a DNS-1123 subdomain: the names of Secrets, PVCs, StorageClasses.

    Lowercase letters, digits, '-' and '.', starting and ending with a letter or digit, at most
    253 characters (k8s.io/apimachinery/pkg/util/validation ``IsDNS1123Subdomain``).

    Raises:
        ValueError: saying what a valid name looks like.
    """
    if not isinstance(name, str) or len(name) > 253 or not LABEL_PREFIX.fullmatch(name):
        raise ValueError(f"{what} {name!r}: use lowercase letters, digits, '-' and '.', "
                         "starting and ending with a letter or digit, at most 253 characters "
                         "(a DNS-1123 subdomain)")
    return name


def check_quantity(value: str, what: str = "quantity") -> str:
    """``value`` if it is a positive Kubernetes quantity (``20Gi``, ``500m``, ``1.5Ti``).

    Parsed by the Kubernetes client's ``kubernetes.utils.parse_quantity``.

    Raises:
        ValueError: not a quantity, or zero or negative.
    """
    from kubernetes.utils import parse_quantity  # the client is heavy: load it when needed

    try:
        q = parse_quantity(value) if isinstance(value, str) and value == value.strip() else None
        ok = q is not None and q.is_finite() and q > 0  # Decimal; "Infinity" parses too
    except (ValueError, TypeError, ArithmeticError):
        ok = False
    if not ok:
        raise ValueError(f"{what} {value!r}: give a positive Kubernetes quantity such as 20Gi, "
                         "500Mi or 2")
    return value


def check_namespace(namespace: str, what: str = "namespace") -> str:
    """``namespace`` if it is a DNS-1123 label and not a system or shared namespace.

    Raises:
        ValueError: a bad name, or ``default`` / ``kube-*`` (a sandbox relabels its namespace
            and cuts its traffic to the namespace itself).
    """
    check_name(namespace, what=what)
    if namespace in RESERVED_NAMESPACES or namespace.startswith("kube-"):
        raise ValueError(f"{what} {namespace!r} is a system or shared namespace; servetune "
                         "works in a namespace of its own (e.g. servetune-<team>)")
    return namespace


def check_image(image: str, what: str = "image") -> str:
    """``image`` if it is a container image reference (``registry/path:tag`` or ``@sha256:``).

    Raises:
        ValueError: empty or malformed.
    """
    if not isinstance(image, str) or not IMAGE_REF.fullmatch(image):
        raise ValueError(f"{what} {image!r}: give an image reference such as "
                         "ghcr.io/servetune/servetune:0.1.0 or lmsysorg/sglang:v0.5.23")
    return image


def label_value(text: str) -> str:
    """``text`` made a valid label value: other characters become '-', at most 63, trimmed."""
    out = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:63]
    return out.strip("-_.")


def check_labels(labels: dict[str, str], deployment: str) -> dict[str, str]:
    """``labels`` plus ``servetune.io/deployment=<deployment>``, each key and value checked.

    Raises:
        ValueError: an invalid key or value, or a deployment label naming another deployment.
    """
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if (len(name) > 63 or not LABEL_NAME.fullmatch(name)
                or (prefix and (len(prefix) > 253 or not LABEL_PREFIX.fullmatch(prefix)))):
            raise ValueError(f"label key {key!r} is not a valid Kubernetes label key")
        if not isinstance(value, str) or len(value) > 63 or (
                value and not LABEL_NAME.fullmatch(value)):
            raise ValueError(f"label {key}={value!r}: a value is at most 63 letters, digits, "
                             "'-', '_' or '.', starting and ending with a letter or digit")
    if labels.get(DEPLOYMENT_LABEL, deployment) != deployment:
        raise ValueError(f"label {DEPLOYMENT_LABEL}={labels[DEPLOYMENT_LABEL]!r} names another "
                         f"deployment than {deployment!r}")
    return {**labels, DEPLOYMENT_LABEL: deployment}
