"""GPU catalog: memory, bandwidth, peak FLOP/s and interconnect, each with its source.

Units: memory in GB (1e9 bytes) as datasheets state it, bandwidth in bytes/s, compute in FLOP/s.
Host-side figures (host memory per node, GPU <-> host link) describe the NVIDIA DGX system built on
each GPU's HGX board; they size the HiCache host tier and its load-back cost.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from domain.errors import ConfigInvalid

_REGISTERED: dict[str, GPU] = {}


class Interconnect(BaseModel):
    """How the GPUs of one node reach each other, and how a node reaches the next.

    ``kind`` ``nvlink``: every GPU of the NVLink domain talks to every other through NVSwitch at
    ``nvlink_bytes_per_s``; ``pcie``: GPUs talk over PCIe (``pcie_gen`` x ``pcie_lanes``) through
    the host's root complexes, peer-to-peer when ``p2p`` (else staged through host memory), the
    node's GPUs split evenly over ``numa_nodes`` NUMA nodes whose hop runs at
    ``cross_numa_bytes_per_s``. Bandwidths are bytes/s per GPU and direction.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["nvlink", "pcie"]
    gpus_per_node: int = Field(8, ge=1, le=1024, description="GPUs of one host (server)")
    nvlink_bytes_per_s: float = Field(0.0, ge=0, description=(
        "NVLink bandwidth per GPU and direction, bytes/s (0 on a PCIe node)"))
    nvlink_domain: int | None = Field(None, ge=1, le=1024, description=(
        "GPUs one NVLink/NVSwitch domain joins (GB200 NVL72: 72, over 18 hosts of 4); None: "
        "the host's gpus_per_node"))
    pcie_gen: int = Field(5, ge=1, le=7, description="PCIe generation of the GPU's link")
    pcie_lanes: int = Field(16, ge=1, le=32, description="PCIe lanes of the GPU's link")
    p2p: bool = Field(True, description="PCIe peer-to-peer between GPUs (False: staged "
                      "through host memory)")
    numa_nodes: int = Field(1, ge=1, le=16, description="NUMA nodes the host's GPUs are "
                            "split over evenly (0-3 and 4-7 on a two-socket host: 2)")
    cross_numa_bytes_per_s: float | None = Field(None, gt=0, description=(
        "GPU-to-GPU bandwidth across the NUMA hop (socket interconnect), bytes/s per "
        "direction; None: as the PCIe link"))
    nic_bytes_per_s: float = Field(50e9, gt=0, description=(
        "scale-out network bandwidth per GPU and direction, bytes/s (400 Gb/s NIC per GPU "
        "= 50e9)"))

    @property
    def domain_size(self) -> int:
        """GPUs reachable over the fast intra-node (or NVLink-domain) link."""
        return self.nvlink_domain or self.gpus_per_node

    @property
    def pcie_bytes_per_s(self) -> float:
        """PCIe bandwidth of one GPU's link per direction, bytes/s.

        Per lane and direction: Gen3 0.985 GB/s, Gen4 1.969 GB/s, Gen5 3.938 GB/s, Gen6
        7.563 GB/s (PCI-SIG PCIe 3.0-6.0 base specifications: 8/16/32/64 GT/s, 128b/130b
        coding up to Gen5, FLIT mode at Gen6); Gen1/2 at 0.25/0.5 GB/s.
        """
        per_lane = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9,
                    7: 15.125e9}[self.pcie_gen]
        return per_lane * self.pcie_lanes

    @property
    def link_bytes_per_s(self) -> float:
        """GPU-to-GPU bandwidth inside the node per direction, bytes/s (NVLink, else PCIe)."""
        return self.nvlink_bytes_per_s if self.kind == "nvlink" else self.pcie_bytes_per_s


class GPU(BaseModel):
    """One GPU type as the cost model and memory fit see it."""

    model_config = ConfigDict(frozen=True)

    name: str
    arch: str = Field(description="SGLang's arch tier: 'sm90' (Hopper) or 'sm100' (Blackwell)")
    sm_major: int = Field(description="CUDA compute capability major number")
    sm_minor: int = Field(0, ge=0, le=9, description="CUDA compute capability minor number "
                          "(L40S: 8.9 -> 9; B300: 10.3 -> 3)")
    hbm_gb: float = Field(description="usable HBM per GPU, GB (1e9 bytes)")
    hbm_bytes_per_s: float = Field(description="HBM bandwidth, bytes/s")
    flops: dict[str, float] = Field(description="dense peak FLOP/s by compute dtype (bf16/fp8/fp4)")
    interconnect: Interconnect = Field(description="the node's GPU-to-GPU links and NIC")
    host_link_bytes_per_s: float = Field(
        description="GPU <-> host memory bandwidth per GPU and direction, bytes/s (PCIe Gen5 x16 "
        "on HGX/DGX boards; NVLink-C2C on Grace superchips); prices HiCache load-back")
    host_mem_gb_per_node: float = Field(
        description="host (CPU) memory of one node, GB (1e9 bytes), shared by every GPU process "
        "of the node; bounds the HiCache host pool")
    source: str

    @property
    def link_bytes_per_s(self) -> float:
        """GPU-to-GPU bandwidth inside the node per direction, bytes/s."""
        return self.interconnect.link_bytes_per_s

    @property
    def gpus_per_node(self) -> int:
        """GPUs of one host."""
        return self.interconnect.gpus_per_node

    @property
    def hbm_bytes(self) -> float:
        """Usable HBM per GPU in bytes."""
        return self.hbm_gb * 1e9

    @property
    def host_mem_bytes_per_node(self) -> float:
        """Host memory of one node in bytes."""
        return self.host_mem_gb_per_node * 1e9

    @property
    def hbm_mib(self) -> float:
        """Usable HBM per GPU in MiB, the unit SGLang's memory heuristics read from nvidia-smi."""
        return self.hbm_bytes / 2**20


# PCIe 5.0 x16: 32 GT/s per lane x 16 lanes with 128b/130b coding = 63 GB/s per direction, which
# NVIDIA datasheets round to "PCIe Gen5: 128 GB/s" bidirectional (H100/H200 SXM datasheets); every
# GPU of an HGX/DGX H100, H200 or B200 board reaches the host through its own Gen5 x16 link.
PCIE_GEN5_X16_BYTES_PER_S = 64e9
# NVIDIA DGX H100/H200 and DGX B200 datasheets: "System memory 2 TB" (B200: configurable to 4 TB).
# HGX boards in other vendors' servers vary; the twin takes the DGX configuration.
DGX_HOST_MEM_GB = 2000.0

GPUS: dict[str, GPU] = {
    "B200": GPU(
        name="B200",
        arch="sm100",
        sm_major=10,
        hbm_gb=180.0,
        hbm_bytes_per_s=7.7e12,
        flops={"bf16": 2250e12, "fp8": 4500e12, "fp4": 9000e12},
        interconnect=Interconnect(kind="nvlink", nvlink_bytes_per_s=900e9),
        host_link_bytes_per_s=PCIE_GEN5_X16_BYTES_PER_S,
        host_mem_gb_per_node=DGX_HOST_MEM_GB,
        source=(
            "NVIDIA HGX B200 datasheet: 8x B200 with 1,440 GB HBM3e in total = 180 GB usable per "
            "GPU; dense TFLOP/s, 7.7 TB/s and NVLink 5 900 GB/s per direction as tabulated in "
            "servetune's estimators reference (aiconfigurator system files); host: PCIe Gen5 "
            "x16 per GPU and 2 TB system memory (NVIDIA DGX B200 datasheet)"
        ),
    ),
    "H200": GPU(
        name="H200",
        arch="sm90",
        sm_major=9,
        hbm_gb=141.0,
        hbm_bytes_per_s=4.8e12,
        flops={"bf16": 989e12, "fp8": 1979e12},
        interconnect=Interconnect(kind="nvlink", nvlink_bytes_per_s=450e9),
        host_link_bytes_per_s=PCIE_GEN5_X16_BYTES_PER_S,
        host_mem_gb_per_node=DGX_HOST_MEM_GB,
        source="NVIDIA H200 SXM datasheet (141 GB HBM3e, 4.8 TB/s, 989/1979 dense TFLOP/s, PCIe "
               "Gen5 128 GB/s); host memory: NVIDIA DGX H200 datasheet (2 TB)",
    ),
    "H100": GPU(
        name="H100",
        arch="sm90",
        sm_major=9,
        hbm_gb=80.0,
        hbm_bytes_per_s=3.35e12,
        flops={"bf16": 989e12, "fp8": 1979e12},
        interconnect=Interconnect(kind="nvlink", nvlink_bytes_per_s=450e9),
        host_link_bytes_per_s=PCIE_GEN5_X16_BYTES_PER_S,
        host_mem_gb_per_node=DGX_HOST_MEM_GB,
        source="NVIDIA H100 SXM datasheet (80 GB HBM3, 3.35 TB/s, 989/1979 dense TFLOP/s, PCIe "
               "Gen5 128 GB/s); host memory: NVIDIA DGX H100 datasheet (2 TB)",
    ),
}


def register_gpu(gpu: GPU) -> GPU:
    """Make ``gpu`` (a user's spec) known to :func:`get_gpu` under ``gpu.name`` in this process.

    A shipped entry of the same name is shadowed. Returns ``gpu``.
    """
    _REGISTERED[gpu.name] = gpu
    return gpu


def get_gpu(name: str) -> GPU:
    """Return the catalog entry for ``name`` (a GPU registered by :func:`register_gpu` first).

    Raises:
        ConfigInvalid: for a GPU the catalog does not know, listing the known ones.
    """
    if name in _REGISTERED:
        return _REGISTERED[name]
    try:
        return GPUS[name]
    except KeyError:
        raise ConfigInvalid([f"gpu: unknown GPU {name!r}; known: {', '.join(GPUS)}"]) from None
