"""GPU catalog: memory, bandwidth, peak FLOP/s and interconnect, each with its source.

Units: memory in GB (1e9 bytes) as datasheets state it, bandwidth in bytes/s, compute in FLOP/s.
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
    source: str

    @property
    def hbm_bytes(self) -> float:
        """Usable HBM per GPU in bytes."""
        return self.hbm_gb * 1e9

    @property
    def hbm_mib(self) -> float:
        """Usable HBM per GPU in MiB, the unit SGLang's memory heuristics read from nvidia-smi."""
        return self.hbm_bytes / 2**20


GPUS: dict[str, GPU] = {
    "B200": GPU(
        name="B200",
        arch="sm100",
        sm_major=10,
        hbm_gb=180.0,
        hbm_bytes_per_s=7.7e12,
        flops={"bf16": 2250e12, "fp8": 4500e12, "fp4": 9000e12},
        link_bytes_per_s=900e9,
        source=(
            "NVIDIA HGX B200 datasheet: 8x B200 with 1,440 GB HBM3e in total = 180 GB usable per "
            "GPU; dense TFLOP/s, 7.7 TB/s and NVLink 5 900 GB/s per direction as tabulated in "
            "servetune's estimators reference (aiconfigurator system files)"
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
        source="NVIDIA H200 SXM datasheet (141 GB HBM3e, 4.8 TB/s, 989/1979 dense TFLOP/s)",
    ),
    "H100": GPU(
        name="H100",
        arch="sm90",
        sm_major=9,
        hbm_gb=80.0,
        hbm_bytes_per_s=3.35e12,
        flops={"bf16": 989e12, "fp8": 1979e12},
        link_bytes_per_s=450e9,
        source="NVIDIA H100 SXM datasheet (80 GB HBM3, 3.35 TB/s, 989/1979 dense TFLOP/s)",
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
