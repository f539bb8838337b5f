"""Parallel layouts in words, and the memory of every server group of a config.

``layout_label`` names a config's layout the way the report, the cluster server and lessons
show it ("TP8 DP-attn8 EP8", "TP4xPP2", "2x TP8", "1P1D TP4"); ``fit_groups`` fits one server of
every group (the PD layout's prefill and decode groups, or the aggregated replicas) and
``memory_line`` says what one rank holds. Engine-neutral: it reads only ``ServingConfig`` and
``domain.fit``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from domain import fit as fitmod
from domain.config import LAYOUT_FIELDS, ServingConfig
from domain.errors import DoesNotFit
from domain.fit import FitReport


def has_layout(config: ServingConfig) -> bool:
    """Whether any parallel-layout field (``LAYOUT_FIELDS``) is off its default.

    TP alone and replicas are not a layout in this sense: every config has them, and the
    report names them as it always did.
    """
    fields = ServingConfig.model_fields
    return any(getattr(config, name) != fields[name].default for name in LAYOUT_FIELDS)


def server_label(config: ServingConfig) -> str:
    """One server's layout: ``"TP8"``, ``"TP4xPP2"``, ``"DP2xTP4"``, ``"TP8 DP-attn8 EP8"``.

    TP x PP (x DP copies in front) is the GPU grid of the server; attention DP and EP, which
    live inside the TP group, follow as words. Fields at their default are left out.
    """
    grid = f"TP{config.tp_size}" + (f"xPP{config.pp_size}" if config.pp_size > 1 else "")
    if config.dp_size > 1:
        grid = f"DP{config.dp_size}x{grid}"
    words = [grid]
    if config.attn_dp_size > 1:
        words.append(f"DP-attn{config.attn_dp_size}")
    if config.ep_size > 1:
        words.append(f"EP{config.ep_size}")
    return " ".join(words)


def layout_label(config: ServingConfig) -> str:
    """The whole config's layout: ``"TP8"``, ``"2x TP4xPP2"``, ``"1P1D TP4"``.

    Aggregated: the server's layout (:func:`server_label`) after ``"<replicas>x "`` when there
    are several replicas. PD: ``"<n>P<m>D"`` and the servers' layout, once when both groups
    share it, else ``"P <prefill layout> / D <decode layout>"``.
    """
    if config.pd is None:
        one = server_label(config)
        return one if config.replicas == 1 else f"{config.replicas}x {one}"
    pre, dec = (server_label(config.pd_worker(r)) for r in ("prefill", "decode"))
    shape = config.pd.label()
    return f"{shape} {pre}" if pre == dec else f"{shape} P {pre} / D {dec}"


@dataclass(frozen=True)
class GroupFit:
    """One server group of a config and the memory fit of one of its servers.

    Attributes:
        role: ``"server"`` (aggregated replicas), ``"prefill"`` or ``"decode"``.
        servers: servers in the group.
        config: one server's config (``ServingConfig.servers()``).
        report: its fit (None when it does not fit).
        error: why it does not fit ('' when it does).
    """

    role: str
    servers: int
    config: ServingConfig
    report: FitReport | None
    error: str = ""


def fit_groups(config: ServingConfig) -> list[GroupFit]:
    """Fit one server of every group of ``config`` (``ServingConfig.servers()`` order).

    Uses ``domain.fit.fit_servers`` where it exists (one report per group), else
    ``domain.fit.fit`` of each group's server config. A group that does not fit gets
    ``report=None`` and the ``DoesNotFit`` message; nothing is raised for it.

    Raises:
        ConfigInvalid: unknown model, GPU or checkpoint (from ``domain.fit``).
    """
    fit_servers: Any = getattr(fitmod, "fit_servers", None)
    if fit_servers is not None:
        try:
            return [GroupFit(role, n, c, rep) for role, n, c, rep in fit_servers(config)]
        except DoesNotFit:
            pass  # fall back to one group at a time, to say which group does not fit
    out: list[GroupFit] = []
    for role, n, server in config.servers():
        try:
            out.append(GroupFit(role, n, server, fitmod.fit(server)))
        except DoesNotFit as e:
            out.append(GroupFit(role, n, server, None, str(e)))
    return out


def memory_line(group: GroupFit) -> str:
    """What one rank of a group's server holds, in one line (GB = 1e9 bytes).

    Weights and KV pool are per GPU (``FitReport``: weight shard incl. draft layers, pool at
    ``mem_fraction_static``); KV tokens and ``max_running_requests`` are per scheduler (one
    attention-DP rank or DP copy; the ``domain.fit`` contract), with the server's scheduler
    count (``ServingConfig.schedulers``).
    """
    c, rep = group.config, group.report
    head = (f"{group.role} ({group.servers} server{'s' * (group.servers != 1)} of "
            f"{server_label(c)}, {c.gpus_per_server} GPUs each, {c.schedulers} "
            f"scheduler{'s' * (c.schedulers != 1)} per server)")
    if rep is None:
        return f"{head}: {group.error}"
    weights = rep.weight_bytes_per_gpu + rep.draft_weight_bytes_per_gpu
    return (f"{head}: weights {weights / 1e9:,.1f} GB and KV pool {rep.kv_pool_gb:,.1f} GB "
            f"per GPU ({rep.kv_dtype} KV); {rep.kv_tokens:,} KV tokens and "
            f"max_running_requests {rep.max_running_requests:,} per scheduler")
