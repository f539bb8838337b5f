"""All-reduce time over a node's real topology, as SGLang 0.5.23 runs it (custom kernel or NCCL).

Which implementation SGLang picks for one tensor-parallel all-reduce of ``nbytes`` over ``n``
GPUs (pinned source ``sglang-0.5.23/sglang/srt/distributed/``):

- **Custom all-reduce v2** (the CUDA default, ``SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2`` = True,
  ``environ.py:1532``; dispatched at ``device_communicators/custom_all_reduce.py:387-395``) when
  every GPU of the group is NVLink-connected to every other (``custom_all_reduce_v2.py:582-597``:
  ``full_nvlink is True``; across hosts only inside one NVLink clique, line 589-590), for
  ``nbytes`` <= 16 MiB (``SGLANG_CUSTOM_ALL_REDUCE_V2_MAX_SIZE_KB`` = 16384, ``environ.py:1535``).
- **Legacy custom all-reduce** on GPUs without NVLink only for a group of TWO GPUs with working
  PCIe peer-to-peer: more than two PCIe-only GPUs disable it (``custom_all_reduce_utils.py:
  492-498``), no P2P disables it (lines 504-510); its world sizes are 2, 4, 6, 8 and its buffer
  8 MiB (``custom_all_reduce.py:41-42``, used at lines 270-274 ``world_size == 2 or
  full_nvlink``: ``inp_size <= max_size``).
- **NCCL** otherwise (``parallel_state.py:754-762``). FlashInfer's PCIe-IPC all-reduce
  (``device_communicators/pcie_ipc_ar.py``) is opt-in (``SGLANG_ENABLE_PCIE_IPC_ALLREDUCE`` =
  False, ``environ.py:1539``) and not modelled.

Time of one all-reduce: ``min_k (a_k + 2 (n-1)/n x nbytes / (e_k x link))`` over two protocol
lines ``k`` (NCCL's LL / Simple, or the custom kernel's one-shot / two-shot), with latencies
``a_k`` and bus efficiencies ``e_k`` fitted per system, backend and GPU count on the
aiconfigurator-core 0.12.0 wheel's measured tables (Apache-2.0) by
``benchmarks/allreduce_fit.py`` into ``domain/data/allreduce-fit.json`` (errors per table
there). ``link`` is the slowest link of the ring on the target node (:func:`ring_link_bytes_per_s`):
NVLink; or the PCIe link, the NUMA hop when the group spans the host's NUMA nodes (GPUs are
placed in order, ``numa_nodes`` equal blocks), half the PCIe link without P2P (staged through
host memory: each byte crosses PCIe twice); and the NIC when the group spans hosts outside
one NVLink domain (ring over the slowest link, Patarasuk & Yuan, JPDC 2009). A GPU whose name
matches a fitted system uses that system's constants, any other GPU its topology kind's medians.
Loading needs only the standard library.
"""

from __future__ import annotations

import json
import math
import re
from functools import cache
from pathlib import Path
from typing import Any, Literal

from domain.hardware import GPU, Interconnect

FIT_PATH = Path(__file__).resolve().parent / "data" / "allreduce-fit.json"
Backend = Literal["custom", "nccl"]

V2_MAX_BYTES = 16 * 1024 * 1024  # environ.py:1535 SGLANG_CUSTOM_ALL_REDUCE_V2_MAX_SIZE_KB * 1024
V1_MAX_BYTES = 8192 * 1024       # custom_all_reduce.py:42 _MAX_CAR_SIZE
V1_WORLD_SIZES = (2, 4, 6, 8)    # custom_all_reduce.py:41 _SUPPORTED_WORLD_SIZES
V2_MAX_WORLD = 16                # configs/custom_all_reduce_v2.py:333 range(2, 17) (sm90/sm100
                                 # tables list 2..8; beyond that the default table applies)


@cache
def _fit(path: Path = FIT_PATH) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def spans_numa(n: int, ic: Interconnect) -> bool:
    """Whether a group of the first ``n`` GPUs of a host crosses a NUMA boundary."""
    return ic.numa_nodes > 1 and n > ic.gpus_per_node // ic.numa_nodes


def ring_link_bytes_per_s(n: int, ic: Interconnect) -> float:
    """The slowest link of a ring over ``n`` GPUs on ``ic``, bytes/s per GPU and direction.

    NVLink inside the NVLink domain; PCIe (halved without P2P), capped by the cross-NUMA hop
    when the group spans NUMA nodes; capped by the NIC when the group leaves the host (or the
    NVLink domain).
    """
    if ic.kind == "nvlink":
        link = ic.nvlink_bytes_per_s
        inside = n <= ic.domain_size
    else:
        link = ic.pcie_bytes_per_s if ic.p2p else ic.pcie_bytes_per_s / 2
        if spans_numa(n, ic) and ic.cross_numa_bytes_per_s is not None:
            link = min(link, ic.cross_numa_bytes_per_s)
        inside = n <= ic.gpus_per_node
    return link if inside else min(link, ic.nic_bytes_per_s)


def backend_for(nbytes: float, n: int, ic: Interconnect, custom_allowed: bool = True) -> Backend:
    """The implementation SGLang 0.5.23 runs for this all-reduce (module docstring: the rules).

    Args:
        nbytes: bytes of the tensor reduced (tokens x hidden x 2 for bf16 activations).
        n: GPUs in the group (TP size).
        ic: the node's interconnect.
        custom_allowed: False with ``--disable-custom-all-reduce``.
    """
    if not custom_allowed or n < 2 or int(nbytes) % 16:
        return "nccl"
    if ic.kind == "nvlink" and n <= ic.domain_size and n <= V2_MAX_WORLD:
        return "custom" if nbytes <= V2_MAX_BYTES else "nccl"
    in_host = n <= ic.gpus_per_node
    if ic.kind == "pcie" and in_host and n == 2 and ic.p2p:
        return "custom" if nbytes <= V1_MAX_BYTES else "nccl"
    return "nccl"


def _interp(table: dict[str, Any], n: int) -> tuple[list[float], list[float]]:
    """Latencies and bus efficiencies at ``n`` GPUs, linear in ``n`` between fitted counts.

    Below the smallest fitted count: its constants. Past the largest: latencies extrapolate
    with the last segment's slope (one more hop per GPU in a ring), efficiencies stay.
    """
    ns = sorted(int(k) for k in table)
    if n <= ns[0] or len(ns) == 1:
        p = table[str(ns[0] if n <= ns[0] else ns[-1])]
        return list(p["latency_s"]), list(p["bus_eff"])
    if n >= ns[-1]:
        lo, hi, w = ns[-2], ns[-1], (n - ns[-2]) / (ns[-1] - ns[-2])
    else:
        hi = min(k for k in ns if k >= n)
        lo = max(k for k in ns if k < hi)
        w = (n - lo) / (hi - lo)
    pl, ph = table[str(lo)], table[str(hi)]
    lat = [max(x + w * (y - x), 0.0)
           for x, y in zip(pl["latency_s"], ph["latency_s"], strict=True)]
    eff = ph["bus_eff"] if n >= ns[-1] else [
        x + w * (y - x) for x, y in zip(pl["bus_eff"], ph["bus_eff"], strict=True)]
    return lat, list(eff)


def _constants(gpu_name: str, kind: str, backend: Backend, n: int
               ) -> tuple[list[float], list[float]]:
    data = _fit()
    key = _norm(gpu_name)
    for system in data["systems"].values():
        if system["kind"] == kind and backend in system and key in map(_norm, system["gpus"]):
            return _interp(system[backend], n)
    topo = data["topology"][kind]
    return _interp(topo[backend] if backend in topo else topo["nccl"], n)


def allreduce_seconds(nbytes: float, n: int, gpu: GPU, custom_allowed: bool = True,
                      ideal: bool = False) -> float:
    """Seconds of one all-reduce of ``nbytes`` over ``n`` GPUs of type ``gpu`` on its node.

    Args:
        nbytes: bytes reduced (bf16 activations: tokens x hidden x 2).
        n: GPUs in the group; 0.0 for ``n`` <= 1 or ``nbytes`` <= 0.
        gpu: the GPU (its ``interconnect`` gives the ring's slowest link).
        custom_allowed: False with ``--disable-custom-all-reduce``.
        ideal: the bus traffic at the slowest link's peak, no latency (the roofline's term).
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    ic = gpu.interconnect
    link = ring_link_bytes_per_s(n, ic)
    bus = 2 * (n - 1) / n * nbytes
    if ideal:
        return bus / link
    backend = backend_for(nbytes, n, ic, custom_allowed)
    lat, eff = _constants(gpu.name, ic.kind, backend, n)
    return min(a + bus / (e * link) for a, e in zip(lat, eff, strict=True))


def fit_source() -> dict[str, Any]:
    """The fit's data source, date and command (for docs and reports)."""
    data = _fit()
    return {k: data[k] for k in ("data_source", "date", "command")}


def _host_of(gpu: int, ic: Interconnect) -> int:
    return gpu // ic.gpus_per_node


def p2p_link_bytes_per_s(src_first: int, dst_first: int, width: int, ic: Interconnect) -> float:
    """Slowest link between GPU ``src_first + r`` and ``dst_first + r`` over ``r < width``.

    Pipeline stages send rank to rank (stage ``s``'s TP rank ``r`` to stage ``s+1``'s rank
    ``r``); GPUs are placed in order (stage-major, as SGLang numbers them: ``gpu_id = base +
    (pp_rank % pp_per_node) x tp_per_node + tp_rank x step``, SGLang 0.5.23
    ``weight_cache/protocol.py:276-297`` ``compute_local_gpu_id``, used by
    ``entrypoints/engine.py:786-802``). Per pair: NVLink inside one NVLink domain; on a PCIe
    host the PCIe link (halved without P2P), capped by the NUMA hop when the two GPUs sit on
    different NUMA nodes; the NIC between hosts (outside one NVLink domain). Bytes/s per
    direction.
    """
    per_numa = max(1, ic.gpus_per_node // ic.numa_nodes)
    slowest = math.inf
    for r in range(max(1, width)):
        a, b = src_first + r, dst_first + r
        if ic.kind == "nvlink":
            same = a // ic.domain_size == b // ic.domain_size
            link = ic.nvlink_bytes_per_s if same else min(ic.nvlink_bytes_per_s,
                                                           ic.nic_bytes_per_s)
        else:
            link = ic.pcie_bytes_per_s if ic.p2p else ic.pcie_bytes_per_s / 2
            if _host_of(a, ic) != _host_of(b, ic):
                link = min(link, ic.nic_bytes_per_s)
            elif (a // per_numa != b // per_numa and ic.cross_numa_bytes_per_s is not None):
                link = min(link, ic.cross_numa_bytes_per_s)
        slowest = min(slowest, link)
    return slowest


def a2a_link_shares(ep: int, ic: Interconnect) -> tuple[tuple[float, float], tuple[float, float]]:
    """How an all-to-all over ``ep`` GPUs splits its off-rank bytes: ((share, link), (share, link)).

    Of the ``ep - 1`` peers of a GPU, ``g - 1`` share its node (``g = min(ep, NVLink domain)``,
    or the host's GPUs on a PCIe node) and reach it over NVLink / the PCIe ring link
    (:func:`ring_link_bytes_per_s`, NUMA hop included); the other ``ep - g`` over the NIC
    (DeepEP's internode kernels: NVLink forwarding inside the node, RDMA across). Uniform
    routing sends each peer an equal share. Links in bytes/s per GPU and direction.
    """
    if ep <= 1:
        return (0.0, 1.0), (0.0, 1.0)
    local = min(ep, ic.domain_size if ic.kind == "nvlink" else ic.gpus_per_node)
    intra_link = ring_link_bytes_per_s(local, ic) if local > 1 else ic.nic_bytes_per_s
    intra = (local - 1) / (ep - 1)
    return (intra, intra_link), (1.0 - intra, ic.nic_bytes_per_s)
