"""Device specification table: peak FP32/BF16 FLOP/s, memory and bandwidth per GPU kind.

Figures are vendor datasheet peaks (SXM parts where both exist). Whale balances on FP32 FLOP/s
(paper section 3.3); the memory figure is the capacity Algorithm 1 bounds load by.

Each kind also names a typical node: its host RAM and GPUs, what bounds host offload on an abstract
cluster (`Cluster.abstract(kinds, host_memory=..., devices_per_node=...)` overrides it). Sources,
the vendors' system datasheets: DGX-1 (P100, V100) 512 GB for 8 GPUs (a DGX-2 has 1.5 TB for 16
V100-32GB: the same 96 GB per GPU is not the common case, declare it when it is yours); DGX A100
1 TB (40GB) / 2 TB (80GB), DGX H100 and DGX H200 2 TB, all for 8 GPUs; no DGX has T4, A10 or L4 GPUs:
the largest AWS instances of those (g4dn.metal 384 GB / 8 T4, g5.48xlarge 768 GB / 8 A10G,
g6.48xlarge 768 GB / 8 L4). A GB of RAM here is 2**30 bytes, as in the kind names.

The host link (what offload's transfers cross) is each kind's PCIe x16 generation from its datasheet:
3.0 for P100, V100 and T4, 4.0 for A10, L4 and A100, 5.0 for H100 and H200, at the link's nominal
rate each way. The CPU "device" shares the host's RAM: its figure is that RAM's bandwidth.

The links between devices (what a pipeline's messages cross) are each way, per device: inside a node
the SXM parts' NVLink (P100 4 links x 20 GB/s, V100 6 x 25, A100 12 x 25, H100 and H200 18 x 25), the
PCIe parts' host link, the CPU's RAM; between nodes the node's network shared by its GPUs (DGX-1 4 x
100 Gb/s, DGX A100 8 x 200 Gb/s, DGX H100 and H200 8 x 400 Gb/s, the AWS instances above 100 Gb/s,
all for 8 GPUs; a CPU node 10 Gb/s). A message's fixed cost is an order of magnitude, not a datasheet
figure: `calibrate` times the links of a multi-process cluster instead.
"""
from __future__ import annotations

import dataclasses
import re

from whalex.errors import ClusterError

GiB = 1024**3
T = 1e12
PCIE3, PCIE4, PCIE5 = 15.75e9, 31.5e9, 63.0e9     # bytes/s each way over a x16 link
NVLINK = 25e9                                     # bytes/s each way over one NVLink (2.0 and later)
GBIT = 1e9 / 8                                    # bytes/s of one Gb/s
NODE_LATENCY, NETWORK_LATENCY = 10e-6, 25e-6      # seconds a message costs whatever its size, in and between nodes


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    name: str
    fp32_flops: float       # FLOP/s
    bf16_flops: float       # FLOP/s (dense tensor core; FP16 for pre-Ampere parts)
    memory_bytes: int
    bandwidth: float        # bytes/s of device memory
    platform: str = "gpu"
    node_host_bytes: int = 0    # host RAM of a typical node of this kind (0: unknown)
    node_devices: int = 1       # devices in that node
    host_bandwidth: float = 0.0     # bytes/s each way over the host link (0: unknown)
    peer_bandwidth: float = 0.0     # bytes/s each way to another device of its node (0: the host link's)
    network_bandwidth: float = 0.0  # bytes/s each way to a device of another node, its share of the node's


SPECS: dict[str, DeviceSpec] = {s.name: s for s in [
    DeviceSpec("P100-16GB", 10.6 * T, 21.2 * T, 16 * GiB, 732e9, node_host_bytes=512 * GiB, node_devices=8,
               host_bandwidth=PCIE3, peer_bandwidth=4 * 20e9,
               network_bandwidth=4 * 100 * GBIT / 8),
    DeviceSpec("V100-16GB", 15.7 * T, 125 * T, 16 * GiB, 900e9, node_host_bytes=512 * GiB, node_devices=8,
               host_bandwidth=PCIE3, peer_bandwidth=6 * NVLINK,
               network_bandwidth=4 * 100 * GBIT / 8),
    DeviceSpec("V100-32GB", 15.7 * T, 125 * T, 32 * GiB, 900e9, node_host_bytes=512 * GiB, node_devices=8,
               host_bandwidth=PCIE3, peer_bandwidth=6 * NVLINK,
               network_bandwidth=4 * 100 * GBIT / 8),
    DeviceSpec("T4-16GB", 8.1 * T, 65 * T, 16 * GiB, 320e9, node_host_bytes=384 * GiB, node_devices=8,
               host_bandwidth=PCIE3, peer_bandwidth=PCIE3,
               network_bandwidth=100 * GBIT / 8),
    DeviceSpec("A10-24GB", 31.2 * T, 125 * T, 24 * GiB, 600e9, node_host_bytes=768 * GiB, node_devices=8,
               host_bandwidth=PCIE4, peer_bandwidth=PCIE4,
               network_bandwidth=100 * GBIT / 8),
    DeviceSpec("L4-24GB", 30.3 * T, 121 * T, 24 * GiB, 300e9, node_host_bytes=768 * GiB, node_devices=8,
               host_bandwidth=PCIE4, peer_bandwidth=PCIE4,
               network_bandwidth=100 * GBIT / 8),
    DeviceSpec("A100-40GB", 19.5 * T, 312 * T, 40 * GiB, 1555e9, node_host_bytes=1024 * GiB, node_devices=8,
               host_bandwidth=PCIE4, peer_bandwidth=12 * NVLINK,
               network_bandwidth=8 * 200 * GBIT / 8),
    DeviceSpec("A100-80GB", 19.5 * T, 312 * T, 80 * GiB, 2039e9, node_host_bytes=2048 * GiB, node_devices=8,
               host_bandwidth=PCIE4, peer_bandwidth=12 * NVLINK,
               network_bandwidth=8 * 200 * GBIT / 8),
    DeviceSpec("H100-80GB", 67 * T, 989 * T, 80 * GiB, 3350e9, node_host_bytes=2048 * GiB, node_devices=8,
               host_bandwidth=PCIE5, peer_bandwidth=18 * NVLINK,
               network_bandwidth=8 * 400 * GBIT / 8),
    DeviceSpec("H200-141GB", 67 * T, 989 * T, 141 * GiB, 4800e9, node_host_bytes=2048 * GiB, node_devices=8,
               host_bandwidth=PCIE5, peer_bandwidth=18 * NVLINK,
               network_bandwidth=8 * 400 * GBIT / 8),
    DeviceSpec("CPU", 0.1 * T, 0.1 * T, 16 * GiB, 20e9, platform="cpu", node_host_bytes=64 * GiB, node_devices=8,
               host_bandwidth=20e9, peer_bandwidth=20e9,
               network_bandwidth=10 * GBIT),
]}

_UNITS = {"": 1, "B": 1, "KB": 2**10, "KIB": 2**10, "MB": 2**20, "MIB": 2**20, "GB": GiB, "GIB": GiB,
          "TB": 2**40, "TIB": 2**40}


def parse_bytes(value) -> float:
    """Bytes from a number or a string such as "768GB", "1.5 TB" or "512GiB" (GB = 2**30 bytes)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        n = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
        unit = m.group(2).upper() if m else None
        if unit not in _UNITS:
            raise ClusterError(f"cannot read {value!r} as an amount of memory; write it as bytes or as a string "
                               "such as '768GB', '1.5TB' or '512GiB'.")
        n = float(m.group(1)) * _UNITS[unit]
    if n <= 0:
        raise ClusterError(f"an amount of memory must be positive, got {value!r}.")
    return n

# Short names and the spellings `jax.Device.device_kind` reports.
_ALIASES = {
    "P100": "P100-16GB", "TESLA P100": "P100-16GB",
    "V100": "V100-32GB", "V100M32": "V100-32GB", "V100-SXM2-32GB": "V100-32GB",
    "V100-SXM2-16GB": "V100-16GB", "V100M16": "V100-16GB",
    "T4": "T4-16GB", "TESLA T4": "T4-16GB",
    "A10": "A10-24GB", "L4": "L4-24GB",
    "A100": "A100-80GB", "A100-SXM4-40GB": "A100-40GB", "A100-SXM4-80GB": "A100-80GB",
    "A100-PCIE-40GB": "A100-40GB", "A100 80GB PCIE": "A100-80GB",
    "H100": "H100-80GB", "H100 80GB HBM3": "H100-80GB", "H100 PCIE": "H100-80GB",
    "H200": "H200-141GB", "H200 141GB": "H200-141GB",
}


def _norm(name: str) -> str:
    name = re.sub(r"^(NVIDIA|TESLA)\s+", "", name.strip().upper())
    return re.sub(r"\s+", " ", name)


def lookup(kind: str) -> DeviceSpec:
    """The spec for a kind name ("V100-32GB", "T4", or a `device_kind` string), or a DeviceSpec itself."""
    if isinstance(kind, DeviceSpec):
        return kind
    if not isinstance(kind, str):
        raise ClusterError(f"a device kind is a string such as 'V100-32GB', got {kind!r}.")
    key = _norm(kind)
    for name, spec in SPECS.items():
        if key == name.upper():
            return spec
    for alias, name in _ALIASES.items():
        if key == alias.upper():
            return SPECS[name]
    if key.startswith("CPU") or key in ("HOST", "TFRT_CPU"):
        return SPECS["CPU"]
    raise ClusterError(
        f"unknown device kind {kind!r}; known kinds are {', '.join(SPECS)}. "
        "Use one of those names, or add a DeviceSpec to whalex.mesh.specs.SPECS.")
