"""XLA:GPU target descriptions per device kind: what the GPU compiler needs to compile for a GPU it
cannot see (a `GpuTargetConfig` text proto), so a plan compiles for 8 to hundreds of GPUs on a
machine without one.

The figures are the vendors' datasheet values (SM count, compute capability, shared memory, L2,
boost clock) and the device memory CUDA reports for the part, or, where a part was at hand, what
that device reported (`from_cuda_properties`). A description recorded from a real device can be
given instead: `Cluster.gpu_topology(..., target_config=from_cuda_properties(props).text())`.
"""
from __future__ import annotations

import dataclasses

from whalex.errors import ClusterError
from whalex.mesh.specs import DeviceSpec, lookup


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One GPU kind as XLA:GPU's compiler describes it."""

    description: str                  # the device_kind string the part reports
    compute_capability: tuple[int, int]
    sm_count: int
    fpus_per_core: int
    threads_per_core: int
    shared_memory_per_core: int       # bytes
    shared_memory_per_block_optin: int
    l2_bytes: int
    clock_ghz: float
    memory_bytes: int                 # device memory as CUDA reports it
    bandwidth: float                  # bytes/s of device memory
    dnn_version: tuple[int, int] = (9, 8)
    cuda_runtime: tuple[int, int] = (12, 9)

    def text(self) -> str:
        """The `GpuTargetConfig` text proto XLA:GPU's deviceless compiler reads."""
        major, minor = self.compute_capability
        cc = f"major: {major}" + (f" minor: {minor}" if minor else "")
        return "\n".join([
            "gpu_device_info {",
            "  threads_per_block_limit: 1024",
            "  threads_per_warp: 32",
            "  shared_memory_per_block: 49152",
            f"  shared_memory_per_core: {self.shared_memory_per_core}",
            f"  threads_per_core_limit: {self.threads_per_core}",
            f"  core_count: {self.sm_count}",
            f"  fpus_per_core: {self.fpus_per_core}",
            "  block_dim_limit_x: 2147483647",
            "  block_dim_limit_y: 65535",
            "  block_dim_limit_z: 65535",
            f"  memory_bandwidth: {int(self.bandwidth)}",
            f"  l2_cache_size: {self.l2_bytes}",
            f"  clock_rate_ghz: {self.clock_ghz}",
            f"  device_memory_size: {self.memory_bytes}",
            f"  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}",
            f"  cuda_compute_capability {{ {cc} }}",
            "  registers_per_core_limit: 65536",
            "  registers_per_block_limit: 65536",
            "}",
            'platform_name: "CUDA"',
            f"dnn_version_info {{ major: {self.dnn_version[0]} minor: {self.dnn_version[1]} }}",
            f"runtime_version {{ major: {self.cuda_runtime[0]} minor: {self.cuda_runtime[1]} patch: 0 }}",
            f'device_description_str: "{self.description}"',
        ]) + "\n"


KiB, MiB = 1024, 1024**2

TARGETS: dict[str, GpuTarget] = {
    "V100-16GB": GpuTarget("Tesla V100-SXM2-16GB", (7, 0), 80, 64, 2048, 96 * KiB, 96 * KiB, 6 * MiB, 1.53,
                           16 * 1024 * MiB, 900e9),
    "V100-32GB": GpuTarget("Tesla V100-SXM2-32GB", (7, 0), 80, 64, 2048, 96 * KiB, 96 * KiB, 6 * MiB, 1.53,
                           32 * 1024 * MiB, 900e9),
    "T4-16GB": GpuTarget("Tesla T4", (7, 5), 40, 64, 1024, 64 * KiB, 64 * KiB, 4 * MiB, 1.59, 15360 * MiB, 320e9),
    "A10-24GB": GpuTarget("NVIDIA A10", (8, 6), 72, 128, 1536, 100 * KiB, 99 * KiB, 6 * MiB, 1.695,
                          23028 * MiB, 600e9),
    "L4-24GB": GpuTarget("NVIDIA L4", (8, 9), 58, 128, 1536, 100 * KiB, 99 * KiB, 48 * MiB, 2.04, 23034 * MiB, 300e9),
    "A100-40GB": GpuTarget("NVIDIA A100-SXM4-40GB", (8, 0), 108, 64, 2048, 164 * KiB, 163 * KiB, 40 * MiB, 1.41,
                           40 * 1024 * MiB, 1555e9),
    "A100-80GB": GpuTarget("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 2048, 164 * KiB, 163 * KiB, 40 * MiB, 1.41,
                           80 * 1024 * MiB, 2039e9),
    "H100-80GB": GpuTarget("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 2048, 228 * KiB, 227 * KiB, 50 * MiB, 1.98,
                           84929347584, 3352320000000),
    "H200-141GB": GpuTarget("NVIDIA H200", (9, 0), 132, 128, 2048, 228 * KiB, 227 * KiB, 60 * MiB, 1.98,
                            150109880320, 4814304000000),           # recorded from a real H200 SXM
}


def fpus_per_core(compute_capability: tuple[int, int]) -> int:
    """FP32 units per SM of a compute capability, as XLA:GPU counts them for its cost model."""
    major, minor = compute_capability
    return 128 if major >= 9 or (major == 8 and minor > 0) else 64


def from_cuda_properties(props: dict, dnn_version: tuple[int, int] = (9, 8),
                         cuda_runtime: tuple[int, int] = (12, 9)) -> GpuTarget:
    """The XLA:GPU target of one real GPU from its CUDA device properties (`cudaDeviceProp`'s names, as
    CuPy's `cupy.cuda.runtime.getDeviceProperties` returns them; `clockRate` and `memoryClockRate` in kHz),
    computed as XLA:GPU describes a device it runs on: what to give the deviceless compiler for exactly
    that GPU (`Cluster.gpu_topology(..., target_config=from_cuda_properties(p).text())`); `dnn_version`
    and `cuda_runtime`: the cuDNN and CUDA runtime the device's JAX runs with."""
    missing = [k for k in _CUDA_PROPERTIES if k not in props]
    if missing:
        raise ClusterError(f"from_cuda_properties: the CUDA properties lack {', '.join(missing)}; pass the dict "
                           "cupy.cuda.runtime.getDeviceProperties(i) returns, with clockRate and memoryClockRate "
                           "(kHz) read by cudaDeviceGetAttribute where the runtime's struct no longer holds them.")
    cc = (int(props["major"]), int(props["minor"]))
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return GpuTarget(
        description=name, compute_capability=cc, sm_count=int(props["multiProcessorCount"]),
        fpus_per_core=fpus_per_core(cc), threads_per_core=int(props["maxThreadsPerMultiProcessor"]),
        shared_memory_per_core=int(props["sharedMemPerMultiprocessor"]),
        shared_memory_per_block_optin=int(props["sharedMemPerBlockOptin"]), l2_bytes=int(props["l2CacheSize"]),
        clock_ghz=int(props["clockRate"]) / 1e6, memory_bytes=int(props["totalGlobalMem"]),
        bandwidth=2.0 * int(props["memoryClockRate"]) * 1e3 * int(props["memoryBusWidth"]) / 8,
        dnn_version=dnn_version, cuda_runtime=cuda_runtime)


_CUDA_PROPERTIES = ("name", "major", "minor", "multiProcessorCount", "maxThreadsPerMultiProcessor",
                    "sharedMemPerMultiprocessor", "sharedMemPerBlockOptin", "l2CacheSize", "clockRate",
                    "totalGlobalMem", "memoryClockRate", "memoryBusWidth")


def differences(a: GpuTarget, b: GpuTarget) -> dict:
    """{field: (a's, b's)} for the fields two target descriptions disagree on."""
    return {f.name: (getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(GpuTarget)
            if getattr(a, f.name) != getattr(b, f.name)}


def gpu_target(kind: str | DeviceSpec) -> GpuTarget:
    """The XLA:GPU target of a device kind (a name the spec table knows, or a DeviceSpec)."""
    spec = lookup(kind)
    if spec.name not in TARGETS:
        raise ClusterError(
            f"no XLA:GPU target description for {spec.name}; whalex has one for {', '.join(TARGETS)}. Record "
            "the real device's (the GpuTargetConfig text) and pass it as "
            "Cluster.gpu_topology(..., target_config=TEXT).")
    return TARGETS[spec.name]
