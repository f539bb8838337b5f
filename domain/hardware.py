"""GPU catalog: memory, bandwidth, peak FLOP/s and interconnect, each with its source.

Units: memory in GB (1e9 bytes) as datasheets state it, bandwidth in bytes/s, compute in FLOP/s.
Host-side figures (host memory per node, GPU <-> host link) describe the NVIDIA DGX system built on
each GPU's HGX board; they size the HiCache host tier and its load-back cost.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from domain.errors import ConfigInvalid


class GPU(BaseModel):
    """One GPU type as the cost model and memory fit see it."""

    model_config = ConfigDict(frozen=True)

    name: str
    arch: str = Field(description="SGLang's arch tier: 'sm90' (Hopper) or 'sm100' (Blackwell)")
    sm_major: int = Field(description="CUDA compute capability major number")
    hbm_gb: float = Field(description="usable HBM per GPU, GB (1e9 bytes)")
    hbm_bytes_per_s: float = Field(description="HBM bandwidth, bytes/s")
    flops: dict[str, float] = Field(description="dense peak FLOP/s by compute dtype (bf16/fp8/fp4)")
    link_bytes_per_s: float = Field(description="NVLink bandwidth per direction, bytes/s")
    gpus_per_node: int = Field(8, description="GPUs in one NVLink node (HGX/DGX: 8)")
    host_link_bytes_per_s: float = Field(
        description="GPU <-> host memory bandwidth per GPU and direction, bytes/s (PCIe Gen5 x16 "
        "on HGX/DGX boards; NVLink-C2C on Grace superchips); prices HiCache load-back")
    host_mem_gb_per_node: float = Field(
        description="host (CPU) memory of one node, GB (1e9 bytes), shared by every GPU process "
        "of the node; bounds the HiCache host pool")
    source: str

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
        link_bytes_per_s=900e9,
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
        link_bytes_per_s=450e9,
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
        link_bytes_per_s=450e9,
        host_link_bytes_per_s=PCIE_GEN5_X16_BYTES_PER_S,
        host_mem_gb_per_node=DGX_HOST_MEM_GB,
        source="NVIDIA H100 SXM datasheet (80 GB HBM3, 3.35 TB/s, 989/1979 dense TFLOP/s, PCIe "
               "Gen5 128 GB/s); host memory: NVIDIA DGX H100 datasheet (2 TB)",
    ),
}


def get_gpu(name: str) -> GPU:
    """Return the catalog entry for ``name``.

    Raises:
        ConfigInvalid: for a GPU the catalog does not know, listing the known ones.
    """
    try:
        return GPUS[name]
    except KeyError:
        raise ConfigInvalid([f"gpu: unknown GPU {name!r}; known: {', '.join(GPUS)}"]) from None
