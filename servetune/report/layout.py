"""The winner's launch commands and per-rank memory when its config has a parallel layout.

A PD layout is launched as a prefill and a decode server group plus the router in PD mode; a
server spanning nodes as one process per node (``--nnodes``, ``--node-rank``,
``--dist-init-addr``); every group's memory is one rank's (``domain.layout.fit_groups``).
Configs without a layout keep the report's single launch command (``sections._result``).
"""

from __future__ import annotations

from domain.config import PDLayout, ServingConfig
from domain.errors import ConfigInvalid
from domain.hardware import get_gpu
from domain.layout import fit_groups, has_layout, layout_label, memory_line, server_label
from sandbox.manifests import BOOTSTRAP_PORT, DIST_INIT_PORT
from servetune.report.format import _fence

ENGINE_PORT = 30000    # sglang serve --port default (sglang-knobs.md 7.4)
ROUTER_PORT = 8000     # sglang-router's --port when it shares a host with a server


def _nodes(config: ServingConfig) -> int:
    return config.nnodes(get_gpu(config.gpu).gpus_per_node)


def _node_note(config: ServingConfig) -> list[str]:
    """How to start one server that spans nodes ([] when it fits one node)."""
    n = _nodes(config)
    if n == 1:
        return []
    return [f"One server spans {n} nodes of {get_gpu(config.gpu).gpus_per_node} "
            f"{config.gpu}: run the command on each of them with `--nnodes {n} --node-rank "
            f"<0..{n - 1}> --dist-init-addr <node 0>:{DIST_INIT_PORT}` (the Kubernetes "
            "manifests do this as a LeaderWorkerSet); node 0 serves HTTP.", ""]


def needs_launch_section(config: ServingConfig) -> bool:
    """Whether the report launches ``config`` with :func:`launch_section`.

    True for a parallel layout (``domain.layout.has_layout``) or a server spanning nodes;
    every other config keeps the report's single launch command.
    """
    try:
        return has_layout(config) or _nodes(config) > 1
    except ConfigInvalid:  # an unknown GPU: nothing to say about its nodes
        return has_layout(config)


def launch_section(config: ServingConfig) -> list[str]:
    """Markdown lines: the launch commands of every server group, the router's, the memory.

    Aggregated (one group): the command for ONE replica, and for a server spanning nodes the
    per-node flags. PD: the prefill group's and the decode group's command (one server each),
    then ``python -m sglang_router.launch_router`` with
    :meth:`~domain.config.ServingConfig.pd_router_args` over placeholder hosts. Then one
    memory line per group (:func:`domain.layout.memory_line`).
    """
    out: list[str] = []
    if config.pd is None:
        out += [f"Layout {layout_label(config)}. Launch command for ONE replica:", ""]
        out += _fence(config.launch_command(), "bash")
        out += ["", *_node_note(config)]
    else:
        out += [f"Layout {layout_label(config)}: a prefill and a decode server group and the "
                "router in PD mode. Launch command of ONE server per group:", ""]
        urls: dict[str, list[str]] = {}
        for role, n, server in config.servers():
            cmd = server.launch_command()
            if role == "prefill":  # the port the router names with each prefill URL
                cmd += f" --disaggregation-bootstrap-port {BOOTSTRAP_PORT}"
            out += [f"- {role} ({n} server{'s' * (n != 1)} of {server_label(server)}, "
                    f"{server.gpus_per_server} GPUs each, `--port {ENGINE_PORT}`):", ""]
            out += _fence(cmd, "bash")
            out += ["", *_node_note(server)]
            urls[role] = [f"http://{role.upper()}_{i}:{ENGINE_PORT}" for i in range(n)]
        args = config.pd_router_args(urls["prefill"], urls["decode"], BOOTSTRAP_PORT)
        out += ["- the router in PD mode, in front of both groups (replace the hosts):", ""]
        out += _fence("python -m sglang_router.launch_router " + " ".join(
            [*args, "--host", "0.0.0.0", "--port", str(ROUTER_PORT)]), "bash")
        out.append("")
    try:
        groups = fit_groups(config)
    except ConfigInvalid:
        groups = []
    if groups:
        out += ["Memory per rank (domain.fit; GB = 1e9 bytes):", ""]
        out += [f"- {memory_line(g)}" for g in groups]
    while out and out[-1] == "":
        out.pop()  # the caller puts its own blank line after the section
    return out


def pd_text(pd: PDLayout | None) -> str:
    """A PD layout in a few words (``"unset"`` for None).

    ``"1P1D"``, or with group overrides ``"1P1D (decode attn_dp_size=8, ep_size=8)"``.
    """
    if pd is None:
        return "unset"
    parts = []
    for role, group in (("prefill", pd.prefill), ("decode", pd.decode)):
        set_ = [f"{k}={v}" for k, v in group.model_dump().items()
                if k != "workers" and v is not None]
        if set_:
            parts.append(f"{role} {', '.join(set_)}")
    return pd.label() + (f" ({'; '.join(parts)})" if parts else "")
