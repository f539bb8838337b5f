"""GPU catalog: memory, bandwidth, peak FLOP/s and interconnect, each with its source.

Units: memory in GB (1e9 bytes) as datasheets state it, bandwidth in bytes/s per direction,
compute in dense FLOP/s, board power in W. Host-side figures (host memory per node, GPU <-> host
link) describe the server the catalog assumes for each GPU (the NVIDIA DGX system on an HGX
board); they size the HiCache host tier and its load-back cost.

The shipped entries are data, ``data/gpus/catalog.json`` (sources and licenses in
``data/gpus/README.md``); each goes through :func:`gpu_from_spec`, the validator a user's GPU
(inline in a study or in a file) goes through too. :data:`GPUS` is the registry: lookups are
case-insensitive and take ``-``, ``_``, ``.`` and spaces alike (``get_gpu("rtx_pro_6000")``),
and see GPUs made known by :func:`register_gpu`; iterating it lists the shipped catalog only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from domain.errors import ConfigInvalid

GPUS_DIR = Path(__file__).resolve().parent.parent / "data" / "gpus"
CATALOG_FILE = GPUS_DIR / "catalog.json"

# Bounds a spec is checked against: each is well above the largest shipping part (the catalog's
# own maxima are quoted) and far below the impossible (10 TB of HBM, an exaFLOP/s GPU).
MAX_HBM_GB = 1024.0  # B300/GB300: 288 GB HBM3e (NVIDIA HGX B300 / GB300 NVL72 datasheets)
MAX_HBM_BYTES_PER_S = 30e12  # GB200/GB300: 8 TB/s (NVIDIA GB200/GB300 NVL72 datasheets)
MAX_FLOPS = 100e15  # GB300: 15 PFLOP/s dense FP4 (aiconfigurator-core 0.12.0 systems/gb300.yaml)
MAX_NVLINK_BYTES_PER_S = 5e12  # NVLink 5: 900 GB/s per direction (1.8 TB/s bidirectional)
MAX_NET_BYTES_PER_S = 1e12  # a 1.6 Tb/s NIC per GPU is 200 GB/s; ConnectX-8 is 800 Gb/s
MAX_HOST_LINK_BYTES_PER_S = 2e12  # NVLink-C2C: 900 GB/s bidirectional (Grace superchips)
MAX_HOST_MEM_GB = 100_000.0  # a 16-socket host holds ~32 TB
MAX_TDP_W = 3000.0  # B300: 1,100 W; GB300: 1,400 W per GPU (aiconfigurator system files)

FLOP_DTYPES = ("bf16", "fp16", "fp8", "fp4", "int8", "tf32")


def _flop_dtype(name: str) -> str:
    if name not in FLOP_DTYPES:
        raise ValueError(f"unknown dtype; known: {', '.join(FLOP_DTYPES)}")
    return name


FlopDtype = Annotated[str, AfterValidator(_flop_dtype)]
_Rate = Annotated[float, Field(gt=0, le=MAX_FLOPS, allow_inf_nan=False)]

# PCIe bandwidth per lane and direction, bytes/s: Gen3 0.985 GB/s, Gen4 1.969 GB/s, Gen5
# 3.938 GB/s, Gen6 7.563 GB/s (PCI-SIG PCIe 3.0-6.0 base specifications: 8/16/32/64 GT/s,
# 128b/130b coding up to Gen5, FLIT mode at Gen6); Gen1/2 at 0.25/0.5 GB/s, Gen7 twice Gen6.
PCIE_BYTES_PER_S_PER_LANE = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9,
                             6: 7.563e9, 7: 15.125e9}
# First compute capability with FP8 tensor cores (Ada, SM 8.9); below it SGLang runs an fp8
# checkpoint weight-only through Marlin, computing in bf16:
# sglang/srt/layers/quantization/fp8_utils.py:2794-2798 (can_auto_enable_marlin_fp8:
# 80 <= sm < 89) as used by fp8.py:514-518 (0.5.23).
FP8_TENSOR_CORE_SM = (8, 9)


class Interconnect(BaseModel):
    """How the GPUs of one node reach each other, and how a node reaches the next.

    ``kind`` ``nvlink``: every GPU of the NVLink domain talks to every other through NVSwitch at
    ``nvlink_bytes_per_s``; ``pcie``: GPUs talk over PCIe (``pcie_gen`` x ``pcie_lanes``) through
    the host's root complexes, peer-to-peer when ``p2p`` (else staged through host memory), the
    node's GPUs split evenly over ``numa_nodes`` NUMA nodes whose hop runs at
    ``cross_numa_bytes_per_s``. Bandwidths are bytes/s per GPU and direction.

    Raises (on construction, as pydantic ``ValidationError``): an NVLink node without NVLink
    bandwidth, a PCIe node with NVLink bandwidth or an NVLink domain, GPUs that do not split
    evenly over the NUMA nodes.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["nvlink", "pcie"]
    gpus_per_node: int = Field(8, ge=1, le=1024, description="GPUs of one host (server)")
    nvlink_bytes_per_s: float = Field(0.0, ge=0, le=MAX_NVLINK_BYTES_PER_S, allow_inf_nan=False,
                                      description=("NVLink bandwidth per GPU and direction, "
                                                   "bytes/s (0 on a PCIe node)"))
    nvlink_domain: int | None = Field(None, ge=1, le=1024, description=(
        "GPUs one NVLink/NVSwitch domain joins (GB200 NVL72: 72, over 18 hosts of 4); None: "
        "the host's gpus_per_node"))
    pcie_gen: int = Field(5, ge=1, le=7, description="PCIe generation of the GPU's link")
    pcie_lanes: int = Field(16, ge=1, le=32, description="PCIe lanes of the GPU's link")
    p2p: bool = Field(True, description="PCIe peer-to-peer between GPUs (False: staged "
                      "through host memory)")
    numa_nodes: int = Field(1, ge=1, le=16, description="NUMA nodes the host's GPUs are "
                            "split over evenly (0-3 and 4-7 on a two-socket host: 2)")
    cross_numa_bytes_per_s: float | None = Field(
        None, gt=0, le=MAX_NET_BYTES_PER_S, allow_inf_nan=False, description=(
            "GPU-to-GPU bandwidth across the NUMA hop (socket interconnect), bytes/s per "
            "direction; None: as the PCIe link"))
    nic_bytes_per_s: float = Field(50e9, gt=0, le=MAX_NET_BYTES_PER_S, allow_inf_nan=False,
                                   description=("scale-out network bandwidth per GPU and "
                                                "direction, bytes/s (400 Gb/s NIC per GPU "
                                                "= 50e9)"))

    @model_validator(mode="after")
    def _consistent(self) -> Interconnect:
        if self.kind == "nvlink" and self.nvlink_bytes_per_s <= 0:
            raise ValueError("kind nvlink needs nvlink_bytes_per_s > 0 (bytes/s per GPU and "
                             "direction; NVLink 4: 450e9)")
        if self.kind == "pcie" and (self.nvlink_bytes_per_s or self.nvlink_domain):
            raise ValueError("kind pcie: nvlink_bytes_per_s and nvlink_domain are for kind "
                             "nvlink (a PCIe node has no NVSwitch)")
        if self.gpus_per_node % self.numa_nodes:
            raise ValueError(f"gpus_per_node {self.gpus_per_node} does not split evenly over "
                             f"numa_nodes {self.numa_nodes}")
        return self

    @property
    def domain_size(self) -> int:
        """GPUs reachable over the fast intra-node (or NVLink-domain) link."""
        return self.nvlink_domain or self.gpus_per_node

    @property
    def pcie_bytes_per_s(self) -> float:
        """PCIe bandwidth of one GPU's link per direction, bytes/s.

        Per-lane rates and their source: :data:`PCIE_BYTES_PER_S_PER_LANE`.
        """
        return PCIE_BYTES_PER_S_PER_LANE[self.pcie_gen] * self.pcie_lanes

    @property
    def link_bytes_per_s(self) -> float:
        """GPU-to-GPU bandwidth inside the node per direction, bytes/s (NVLink, else PCIe)."""
        return self.nvlink_bytes_per_s if self.kind == "nvlink" else self.pcie_bytes_per_s


class DataSource(BaseModel):
    """Where a catalog entry's numbers come from: a document's name and its URL."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    url: str = Field(pattern=r"^https?://\S+$")


class GPU(BaseModel):
    """One GPU type as the cost model and memory fit see it.

    Build a user's GPU with :func:`gpu_from_spec` (it derives ``arch`` and the host link and
    turns every problem into one line); constructing ``GPU(...)`` directly checks the same
    bounds but raises pydantic's ``ValidationError``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[^\x00-\x1f]+$")
    arch: str = Field(pattern=r"^sm\d{2,3}$", description=(
        "SGLang's arch tier, 'sm' + the compute capability: 'sm90' (Hopper), 'sm100' "
        "(B200/GB200), 'sm103' (B300/GB300), 'sm120' (RTX PRO 6000, RTX 5090), 'sm89' (Ada)"))
    sm_major: int = Field(ge=7, le=12, description="CUDA compute capability major number")
    sm_minor: int = Field(0, ge=0, le=9, description="CUDA compute capability minor number "
                          "(L40S: 8.9 -> 9; B300: 10.3 -> 3)")
    hbm_gb: float = Field(gt=0, le=MAX_HBM_GB, allow_inf_nan=False,
                          description="usable HBM (or GDDR) per GPU, GB (1e9 bytes)")
    hbm_bytes_per_s: float = Field(gt=0, le=MAX_HBM_BYTES_PER_S, allow_inf_nan=False,
                                   description="HBM bandwidth, bytes/s")
    flops: dict[FlopDtype, _Rate] = Field(description=(
        "dense peak FLOP/s by compute dtype (bf16 required; fp8 on SM 8.9+, fp4 on Blackwell). "
        "On SM < 8.9 (no FP8 tensor cores) gpu_from_spec sets fp8 to the bf16 rate: SGLang runs "
        "fp8 weights weight-only through Marlin there (see FP8_TENSOR_CORE_SM)"))
    interconnect: Interconnect = Field(description="the node's GPU-to-GPU links and NIC")
    host_link_bytes_per_s: float = Field(
        gt=0, le=MAX_HOST_LINK_BYTES_PER_S, allow_inf_nan=False,
        description="GPU <-> host memory bandwidth per GPU and direction, bytes/s (PCIe Gen5 x16 "
        "on HGX/DGX boards; NVLink-C2C on Grace superchips); prices HiCache load-back")
    host_mem_gb_per_node: float = Field(
        gt=0, le=MAX_HOST_MEM_GB, allow_inf_nan=False,
        description="host (CPU) memory of one node, GB (1e9 bytes), shared by every GPU process "
        "of the node; bounds the HiCache host pool")
    tdp_w: float | None = Field(None, gt=0, le=MAX_TDP_W, allow_inf_nan=False,
                                description="board power (TDP / max power), W")
    source: str = Field(min_length=1, description="where the numbers come from, in words")
    sources: tuple[DataSource, ...] = Field((), description="the documents (name + URL)")
    aliases: tuple[str, ...] = Field((), description="other names get_gpu accepts")

    @field_validator("flops")
    @classmethod
    def _bf16(cls, v: dict[str, float]) -> dict[str, float]:
        if "bf16" not in v:
            raise ValueError("needs a 'bf16' rate (dense FLOP/s); the cost model prices bf16 "
                             "attention and activations with it")
        return v

    @property
    def link_bytes_per_s(self) -> float:
        """GPU-to-GPU bandwidth inside the node per direction, bytes/s."""
        return self.interconnect.link_bytes_per_s

    @property
    def gpus_per_node(self) -> int:
        """GPUs of one host."""
        return self.interconnect.gpus_per_node

    @property
    def fp8_native(self) -> bool:
        """Whether the GPU has FP8 tensor cores (SM 8.9+; see :data:`FP8_TENSOR_CORE_SM`)."""
        return (self.sm_major, self.sm_minor) >= FP8_TENSOR_CORE_SM

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


# What each field is, quoted after a bound it breaks (the line then says how to fix it).
_WHY = {
    "name": "the GPU's name as studies and the ledger write it",
    "sm_major": "the CUDA compute capability major: 7 (Volta/Turing) to 12 (RTX PRO 6000, "
                "RTX 5090); nvidia-smi --query-gpu=compute_cap",
    "sm_minor": "the CUDA compute capability minor, 0-9 (L40S 8.9, B300 10.3)",
    "arch": "'sm' + major and minor (sm89, sm120); leave it out and it is derived",
    "hbm_gb": "GB per GPU (1e9 bytes); the most any GPU carries is 288 GB (B300, GB300)",
    "hbm_bytes_per_s": "bytes/s (1.792e12 for 1.792 TB/s); the fastest GPU has 8 TB/s "
                       "(GB200, GB300)",
    "flops": "dense FLOP/s (989e12 for 989 TFLOP/s); the most of any GPU is 15e15 (GB300 fp4); "
             "dtypes: bf16, fp16, fp8, fp4, int8, tf32",
    "host_link_bytes_per_s": "GPU <-> host bytes/s per direction (PCIe Gen5 x16: 63e9)",
    "host_mem_gb_per_node": "host memory of one server, GB",
    "tdp_w": "board power, W (RTX PRO 6000: 600)",
    "interconnect.nvlink_bytes_per_s": "NVLink bytes/s per GPU and direction (NVLink 5: 900e9)",
    "interconnect.nic_bytes_per_s": "scale-out NIC bytes/s per GPU and direction "
                                    "(400 Gb/s = 50e9)",
    "interconnect.cross_numa_bytes_per_s": "GPU-to-GPU bytes/s across the NUMA hop",
    "interconnect.kind": "nvlink (NVLink/NVSwitch) or pcie",
}
_REQUIRED = ("name", "sm_major", "hbm_gb", "hbm_bytes_per_s", "flops", "interconnect",
             "host_mem_gb_per_node")


_OPS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<",
        "less_than_equal": "<="}


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else repr(value)


def _lines(err: ValidationError, prefix: str) -> list[str]:
    """One line per pydantic error: the field's dotted path, its value, what is wrong."""
    out = []
    for e in err.errors(include_url=False):
        loc = [str(p) for p in e["loc"] if p != "[key]"]
        path = ".".join(loc) or "spec"
        why = _WHY.get(path) or _WHY.get(loc[0] if loc else "", "")
        kind = e["type"]
        if kind == "missing":
            line = f"{path}: missing (required)" + (f"; {why}" if why else "")
        elif kind == "extra_forbidden":
            known = (Interconnect if loc[:1] == ["interconnect"] else GPU).model_fields
            line = f"{path}: unknown key; known: {', '.join(known)}"
        elif kind == "value_error":
            line = f"{path}: {e['msg'].removeprefix('Value error, ')}"
        else:
            bound = next(iter(e.get("ctx", {}).values()), None)
            msg = (f"must be {_OPS[kind]} {_fmt(float(bound))}"
                   if kind in _OPS and isinstance(bound, int | float)
                   else e["msg"].replace("Input should be", "must be"))
            line = f"{path} = {_fmt(e.get('input'))}: {msg}" + (f"; {why}" if why else "")
        out.append(prefix + line)
    return out


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def gpu_from_spec(spec: Mapping[str, Any], source: str) -> GPU:
    """Build a :class:`GPU` from a user's spec (a mapping as a study or a YAML/JSON file gives).

    Keys are :class:`GPU`'s fields, in its units: ``name``, ``sm_major`` [, ``sm_minor``],
    ``hbm_gb`` (GB), ``hbm_bytes_per_s``, ``flops`` {dtype: dense FLOP/s, bf16 required},
    ``interconnect`` (:class:`Interconnect`'s fields, ``kind`` required),
    ``host_mem_gb_per_node`` (GB) required; ``host_link_bytes_per_s`` (default: the
    interconnect's PCIe link), ``tdp_w``, ``source``, ``sources``, ``aliases`` optional; ``arch``
    is derived from the SM (``sm`` + major*10 + minor). On SM < 8.9 a missing ``flops.fp8``
    is the bf16 rate (Marlin weight-only fp8, :data:`FP8_TENSOR_CORE_SM`); on SM 8.9+ it is
    required. ``source`` names where the spec came from (a file path, "study.yaml: gpu") and
    prefixes every message; it is the GPU's ``source`` unless the spec gives one.

    Raises:
        ConfigInvalid: one line per problem, each naming the field: a missing required field,
            an unknown key, a number out of bounds (negative bandwidth, 10 TB of HBM, FLOP/s
            beyond any GPU, sm_major outside 7-12), an ``arch`` that contradicts the SM.
    """
    prefix = f"gpu ({source}): "
    if not isinstance(spec, Mapping):
        raise ConfigInvalid([f"{prefix}a GPU spec is a mapping of fields ({', '.join(_REQUIRED)}"
                             f", ...), got {type(spec).__name__}"])
    data: dict[str, Any] = dict(spec)
    problems: list[str] = []
    major, minor = _int(data.get("sm_major")), _int(data.get("sm_minor", 0))
    derived = f"sm{major * 10 + minor}" if major is not None and minor is not None else None
    if "arch" in data and derived is not None and data["arch"] != derived:
        problems.append(f"{prefix}arch = {data['arch']!r}: SM {major}.{minor} is {derived!r}; "
                        "leave arch out and it is derived")
    data.setdefault("arch", derived)
    flops = data.get("flops")
    if isinstance(flops, Mapping) and "bf16" in flops and "fp8" not in flops and derived:
        if (major, minor) < FP8_TENSOR_CORE_SM:
            data["flops"] = {**flops, "fp8": flops["bf16"]}
        else:
            problems.append(f"{prefix}flops.fp8: missing; SM {major}.{minor} has FP8 tensor "
                            "cores: give its dense FP8 FLOP/s")
    ic = data.get("interconnect")
    if "host_link_bytes_per_s" not in data and isinstance(ic, Mapping):
        gen, lanes = _int(ic.get("pcie_gen", 5)), _int(ic.get("pcie_lanes", 16))
        if gen in PCIE_BYTES_PER_S_PER_LANE and lanes is not None:
            data["host_link_bytes_per_s"] = PCIE_BYTES_PER_S_PER_LANE[gen] * lanes
    data.setdefault("source", f"user spec ({source})")
    derived_keys = {k for k in ("arch", "host_link_bytes_per_s") if k not in spec}
    try:
        gpu = GPU.model_validate(data)
    except ValidationError as e:
        problems += [line for line, err in zip(_lines(e, prefix), e.errors(), strict=True)
                     if not (err["loc"] and err["loc"][0] in derived_keys)]
        if not problems:  # only a derived field failed: its inputs are reported
            problems = _lines(e, prefix)
    if problems:
        raise ConfigInvalid(problems)
    return gpu


def gpu_spec(gpu: GPU) -> dict[str, Any]:
    """The spec :func:`gpu_from_spec` rebuilds ``gpu`` from (JSON-ready; round-trips)."""
    return gpu.model_dump(mode="json")


def _key(name: str) -> str:
    """Lookup key: lower case, each run of ``-``, ``_``, ``.``, spaces one ``-``.

    "RTX PRO 6000" and "rtx_pro_6000" are both ``rtx-pro-6000``; "-B200" stays "-b200" (not B200).
    """
    return re.sub(r"[-_. ]+", "-", name.lower())


class GpuCatalog(MutableMapping[str, GPU]):
    """The GPU registry: the shipped catalog plus the GPUs :func:`register_gpu` made known.

    ``catalog[name]`` and ``name in catalog`` are case-insensitive and accept an entry's aliases;
    a registered GPU shadows a shipped one of the same name. Iteration, ``len`` and ``keys``
    cover the shipped catalog only (a study's own GPU never joins another's grid). Item
    assignment replaces a shipped entry (tests patch one this way).
    """

    def __init__(self, shipped: Mapping[str, GPU],
                 registered: dict[str, GPU] | None = None) -> None:
        self._shipped = dict(shipped)
        self._registered = {} if registered is None else registered
        self._index()

    def _index(self) -> None:
        """Lookup key -> shipped name, over names and aliases (the first entry wins)."""
        self._keys: dict[str, str] = {}
        for canon, gpu in self._shipped.items():
            for alias in (canon, *gpu.aliases):
                self._keys.setdefault(_key(alias), canon)

    def resolve(self, name: str) -> str | None:
        """The canonical name ``name`` refers to, or None.

        Exact names first (registered, then shipped), then the lookup key (:func:`_key`: case
        ignored, ``-``, ``_``, ``.`` and spaces alike) against names and aliases, registered
        first.
        """
        if name in self._registered or name in self._shipped:
            return name
        k = _key(name)
        for canon, gpu in self._registered.items():
            if k and (k == _key(canon) or any(k == _key(a) for a in gpu.aliases)):
                return canon
        return self._keys.get(k) if k else None

    def __getitem__(self, name: str) -> GPU:
        if not isinstance(name, str) or (canon := self.resolve(name)) is None:
            raise KeyError(name)
        return self._registered.get(canon) or self._shipped[canon]

    def __setitem__(self, name: str, gpu: GPU) -> None:
        self._shipped[name] = gpu
        self._index()

    def __delitem__(self, name: str) -> None:
        del self._shipped[name]
        self._index()

    def __iter__(self) -> Iterator[str]:
        return iter(self._shipped)

    def __len__(self) -> int:
        return len(self._shipped)

    def register(self, gpu: GPU) -> GPU:
        """Make ``gpu`` known under ``gpu.name`` (see :func:`register_gpu`)."""
        self._registered[gpu.name] = gpu
        return gpu

    def unregister(self, name: str) -> None:
        """Forget a registered GPU (a shipped one stays); no error if none."""
        self._registered.pop(name, None)


def load_catalog(path: Path = CATALOG_FILE) -> dict[str, GPU]:
    """Read the shipped catalog file.

    The file is ``{"gpus": [spec, ...]}``, each spec as :func:`gpu_from_spec` takes it, with its
    ``sources``.

    Raises:
        ConfigInvalid: an entry that does not validate (a broken data file), or two entries of
            one name.
    """
    doc = json.loads(path.read_text())
    out: dict[str, GPU] = {}
    for i, spec in enumerate(doc["gpus"]):
        gpu = gpu_from_spec(spec, f"{path.name} entry {i}")
        if gpu.name in out:
            raise ConfigInvalid([f"{path.name}: GPU {gpu.name!r} listed twice"])
        out[gpu.name] = gpu
    return out


# The registered GPUs by name (main's seam; tests patch it with monkeypatch.setitem).
_REGISTERED: dict[str, GPU] = {}
GPUS = GpuCatalog(load_catalog(), registered=_REGISTERED)


def register_gpu(gpu: GPU) -> GPU:
    """Make ``gpu`` (a user's spec) known to :func:`get_gpu` under ``gpu.name`` in this process.

    A shipped entry of the same name is shadowed. Returns ``gpu``.
    """
    return GPUS.register(gpu)


def is_shipped_spec(name: str) -> bool:
    """Whether ``name`` is a shipped catalog GPU that no user spec shadows with other numbers.

    Constants fitted for a shipped GPU (``domain.calibration``) hold for that GPU only: a user
    spec registered under its name (an SM 12 PCIe card called "B200") is uncalibrated.
    """
    canon = GPUS.resolve(name)
    shipped = GPUS._shipped.get(canon) if canon else None
    mine = _REGISTERED.get(canon) if canon else None
    return shipped is not None and (mine is None or mine == shipped)


def unregister_gpu(name: str) -> None:
    """Forget the GPU :func:`register_gpu` made known under ``name`` (tests clean up with it)."""
    GPUS.unregister(name)


def canonical_gpu_name(name: str) -> str:
    """The catalog's spelling of ``name``: "h200" -> "H200", "rtx_pro_6000" -> "RTX-PRO-6000".

    Raises:
        ConfigInvalid: for a GPU neither the catalog nor a registered spec knows.
    """
    canon = GPUS.resolve(name)
    if canon is None:
        raise ConfigInvalid([f"gpu: unknown GPU {name!r}; known: {', '.join(GPUS)} (or give "
                             "the GPU's spec: docs/catalog.md#gpus)"])
    return canon


def get_gpu(name: str) -> GPU:
    """Return the GPU ``name`` names.

    Case-insensitive; a GPU registered by :func:`register_gpu` first, then the shipped catalog.

    Raises:
        ConfigInvalid: for a GPU the catalog does not know, listing the known ones.
    """
    return GPUS[canonical_gpu_name(name)]
