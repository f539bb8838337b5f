"""What the sandbox's Role grants: the one list the Role manifest and the policy guard share.

The cluster server's Kubernetes backend uses exactly these resources in its own namespace:
Deployments (SGLang replicas, the router), Services, ConfigMaps (study spec), Jobs (the runner,
aiperf beside the engine), and reads Pods, their logs and Events to classify failures.
LeaderWorkerSets (a replica spanning nodes) and ResourceClaims (DRA GPU/NIC alignment) are
granted only when those options are enabled. Never Secrets, ``pods/exec``, or anything
cluster-wide (the Role is namespaced, so no ClusterRole is rendered).
"""

from __future__ import annotations

from dataclasses import dataclass

READ = ("get", "list", "watch")
WRITE = ("get", "list", "watch", "create", "update", "patch", "delete")


@dataclass(frozen=True)
class Grant:
    """One Role rule: a resource of an API group and the verbs allowed on it.

    Attributes:
        group: API group ('' for core/v1).
        resource: plural resource name ('pods/log' for a subresource).
        kind: the object kind a manifest of this resource carries ('' for subresources).
        verbs: allowed verbs.
    """

    group: str
    resource: str
    kind: str
    verbs: tuple[str, ...]


BASE_GRANTS: tuple[Grant, ...] = (
    Grant("apps", "deployments", "Deployment", WRITE),
    Grant("", "services", "Service", WRITE),
    Grant("", "configmaps", "ConfigMap", WRITE),
    Grant("batch", "jobs", "Job", WRITE),
    Grant("", "pods", "Pod", READ),
    Grant("", "pods/log", "", ("get",)),
    Grant("", "events", "Event", READ),
    Grant("events.k8s.io", "events", "Event", READ),
)
LWS_GRANT = Grant("leaderworkerset.x-k8s.io", "leaderworkersets", "LeaderWorkerSet", WRITE)
DRA_GRANTS: tuple[Grant, ...] = (
    Grant("resource.k8s.io", "resourceclaims", "ResourceClaim", WRITE),
    Grant("resource.k8s.io", "resourceclaimtemplates", "ResourceClaimTemplate", WRITE),
)


def grants(lws: bool = False, dra: bool = False) -> list[Grant]:
    """The Role's grants, with LeaderWorkerSets (``lws``) and ResourceClaims (``dra``) on demand."""
    out = list(BASE_GRANTS)
    if lws:
        out.append(LWS_GRANT)
    if dra:
        out.extend(DRA_GRANTS)
    return out


def writable_kinds(lws: bool = False, dra: bool = False) -> set[tuple[str, str]]:
    """(API group, kind) pairs the backend may apply under this Role."""
    return {(g.group, g.kind) for g in grants(lws, dra) if g.kind and "patch" in g.verbs}


def role_rules(lws: bool = False, dra: bool = False) -> list[dict[str, object]]:
    """The Role's ``rules`` (one rule per group and verb set, resources sorted)."""
    merged: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for g in grants(lws, dra):
        merged.setdefault((g.group, g.verbs), []).append(g.resource)
    return [{"apiGroups": [group], "resources": sorted(res), "verbs": list(verbs)}
            for (group, verbs), res in merged.items()]
