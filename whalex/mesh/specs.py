"""Device specification table: peak FP32/BF16 FLOP/s, memory and bandwidth per GPU kind.

Figures are vendor datasheet peaks (SXM parts where both exist). Whale balances on FP32 FLOP/s
(paper section 3.3); the memory figure is the capacity Algorithm 1 bounds load by.
"""
from __future__ import annotations

import dataclasses
import re

from whalex.errors import ClusterError

GiB = 1024**3
T = 1e12


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    name: str
    fp32_flops: float       # FLOP/s
    bf16_flops: float       # FLOP/s (dense tensor core; FP16 for pre-Ampere parts)
    memory_bytes: int
    bandwidth: float        # bytes/s of device memory
    platform: str = "gpu"


SPECS: dict[str, DeviceSpec] = {s.name: s for s in [
    DeviceSpec("P100-16GB", 10.6 * T, 21.2 * T, 16 * GiB, 732e9),
    DeviceSpec("V100-16GB", 15.7 * T, 125 * T, 16 * GiB, 900e9),
    DeviceSpec("V100-32GB", 15.7 * T, 125 * T, 32 * GiB, 900e9),
    DeviceSpec("T4-16GB", 8.1 * T, 65 * T, 16 * GiB, 320e9),
    DeviceSpec("A10-24GB", 31.2 * T, 125 * T, 24 * GiB, 600e9),
    DeviceSpec("L4-24GB", 30.3 * T, 121 * T, 24 * GiB, 300e9),
    DeviceSpec("A100-40GB", 19.5 * T, 312 * T, 40 * GiB, 1555e9),
    DeviceSpec("A100-80GB", 19.5 * T, 312 * T, 80 * GiB, 2039e9),
    DeviceSpec("H100-80GB", 67 * T, 989 * T, 80 * GiB, 3350e9),
    DeviceSpec("H200-141GB", 67 * T, 989 * T, 141 * GiB, 4800e9),
    DeviceSpec("CPU", 0.1 * T, 0.1 * T, 16 * GiB, 20e9, platform="cpu"),
]}

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
