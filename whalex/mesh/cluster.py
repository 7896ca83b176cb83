"""`Cluster`: the devices a plan may use and what kind each one is."""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from whalex import _compat as C
from whalex.distributed import maybe_initialize
from whalex.errors import ClusterError
from whalex.mesh.gpu_targets import gpu_target
from whalex.mesh.links import Link
from whalex.mesh.specs import DeviceSpec, lookup, parse_bytes

COMPILERS = ("auto", "replay")


def scaled_speeds(speeds: Sequence[float], scale: float, devices: Sequence[int] | None = None
                  ) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """(the speeds with the slowest devices' (or `devices`', by index) multiplied by `scale`, those devices)."""
    s = np.asarray(speeds, np.float64)
    on = tuple(int(i) for i in (np.flatnonzero(s == s.min()) if devices is None else devices))
    s[list(on)] *= scale
    return tuple(map(float, s)), on


def _kind_list(kinds, where: str, n: int = 8) -> list:
    """`kinds` as a list, one kind per device; a lone kind (a string, a DeviceSpec) is refused with the
    list it was likely meant to be."""
    if isinstance(kinds, (str, DeviceSpec)) or not isinstance(kinds, Iterable):
        one = kinds.name if isinstance(kinds, DeviceSpec) else kinds
        raise ClusterError(f"{where}(kinds={one!r}): kinds is a list with one device kind per device, not "
                           f"{'one kind' if isinstance(kinds, (str, DeviceSpec)) else 'a ' + type(kinds).__name__}; "
                           f"write kinds=[{one!r}] * {n} for {n} such devices, or e.g. "
                           "kinds=['V100-32GB'] * 4 + ['T4-16GB'] * 4.")
    return list(kinds)


@dataclasses.dataclass(frozen=True, init=False)
class Cluster:
    """Device kinds (one per device) and, unless abstract, the `jax.Device`s they map onto.

    `Cluster(kinds=[...])` declares kinds for the first len(kinds) local devices (e.g. simulated
    CPU devices planned as if they were heterogeneous GPUs; execution stays exact).

    Devices sit in nodes (hosts) that share host RAM, what offload may use: `host_memory` (bytes or
    "768GB", per node) and `devices_per_node` declare them; otherwise a real cluster's node is one
    process's devices with this machine's RAM (detected), and an abstract one takes each kind's
    typical node from the spec table (a V100 DGX-1: 512 GB for 8 GPUs).
    """

    specs: tuple[DeviceSpec, ...]
    devices: tuple[Any, ...] | None
    measured: tuple[float, ...] | None = None     # calibrated FLOP/s per device, when measured
    spread: tuple[float, ...] | None = None       # relative spread of each measured speed (0.05: +-5%)
    overhead: tuple[float, ...] | None = None     # measured fixed seconds per step of each device
    calibrated_rows: tuple[int, int] | None = None   # the fewest and most rows a device's step was timed at
    nodes: tuple[tuple[int, ...], ...] = ()       # the devices of each node (host)
    host_memory: tuple[float, ...] = ()           # host RAM of each node, bytes (inf: unknown)
    host_source: str = ""                         # "declared", "detected" or "spec table"
    target: str | None = None     # gpu_topology: the kind whose XLA:GPU target the devices are (compile only)
    compiler: str = "auto"        # abstract: "auto" compiles on its XLA:GPU twin where it can, "replay" never
    compile_devices: tuple[Any, ...] | None = None   # over_abstract_mesh: the topology devices it compiles for
    links: Link | None = None     # calibrated: the link between any two devices (None: the spec table's)
    head_scale: float = 1.0       # calibrated: the slowest devices' speed on a split head's classes over their rows'
    head_devices: tuple[int, ...] | None = None   # the devices head_scale is on (None: the slowest)

    def __init__(self, kinds: Sequence[str] | None = None, devices: Sequence[Any] | None = None,
                 host_memory: float | str | None = None, devices_per_node: int | None = None):
        maybe_initialize()      # join a whalex.launch process group before touching devices
        available = list(devices) if devices is not None else list(jax.devices())
        if kinds is None:
            kinds = [d.device_kind for d in available]
        kinds = _kind_list(kinds, "Cluster", len(available))
        if not kinds:
            raise ClusterError("a Cluster needs at least one device kind.")
        if len(kinds) > len(available):
            raise ClusterError(
                f"Cluster declares {len(kinds)} device kinds but only {len(available)} devices are visible; "
                "declare at most that many, use Cluster.abstract(kinds=...) to plan without devices, or "
                f"simulate more CPU devices with XLA_FLAGS=--xla_force_host_platform_device_count={len(kinds)}.")
        specs = tuple(lookup(k) for k in kinds)
        devs = tuple(available[: len(kinds)])
        if devices_per_node is not None:
            nodes = _chunks(len(specs), [_positive_int(devices_per_node)] * len(specs))
        else:                    # one node per process
            owners = [getattr(d, "process_index", 0) for d in devs]
            nodes = tuple(tuple(i for i, o in enumerate(owners) if o == p) for p in dict.fromkeys(owners))
        detected = detect_host_memory() if host_memory is None else None
        if host_memory is not None:
            ram, source = [parse_bytes(host_memory)] * len(nodes), "declared"
        elif detected:
            ram, source = [detected] * len(nodes), "detected"
        else:
            ram, source = [_node_ram(specs[n[0]]) for n in nodes], "spec table"
        _set(self, specs, devs, None, None, nodes, tuple(ram), source)

    @classmethod
    def detect(cls, host_memory: float | str | None = None, devices_per_node: int | None = None) -> Cluster:
        """Every device `jax.devices()` reports (all processes), kinds read from the devices."""
        maybe_initialize()
        return cls(devices=jax.devices(), host_memory=host_memory, devices_per_node=devices_per_node)

    @classmethod
    def abstract(cls, kinds: Sequence[str], host_memory: float | str | None = None,
                 devices_per_node: int | None = None, compiler: str = "auto") -> Cluster:
        """Kinds only, no devices: enough to plan and lower, not to run. Nodes (host RAM, devices
        per node) are declared, or each kind's typical node from the spec table.

        `compiler`: what judges a plan's memory (`remat="auto"`, `plan.memory_fit()`,
        `plan.step_memory()`). "auto": XLA's GPU compiler, on the cluster's deviceless topology
        (`compile_twin()`), where JAX's CUDA plugin is installed and XLA has a target for the kinds,
        otherwise the replay of the step's jaxpr; "replay": always the replay."""
        obj = object.__new__(cls)
        kinds = _kind_list(kinds, "Cluster.abstract")
        if not kinds:
            raise ClusterError("Cluster.abstract needs at least one device kind.")
        if compiler not in COMPILERS:
            raise ClusterError(f"Cluster.abstract(compiler={compiler!r}): use one of "
                               f"{', '.join(map(repr, COMPILERS))}.")
        specs = tuple(lookup(k) for k in kinds)
        if devices_per_node is not None:
            nodes = _chunks(len(specs), [_positive_int(devices_per_node)] * len(specs))
        else:                    # each kind's typical node; a new kind starts a new node
            nodes = _chunks(len(specs), [s.node_devices for s in specs], kinds=[s.name for s in specs])
        ram, source = _declared_or_typical(host_memory, specs, nodes)
        _set(obj, specs, None, None, None, nodes, ram, source)
        object.__setattr__(obj, "compiler", compiler)
        return obj

    def compile_twin(self) -> Cluster | None:
        """The `Cluster.gpu_topology` of this abstract cluster's kinds and nodes, on which its plans
        compile with XLA's GPU compiler: None where the cluster has devices, says `compiler="replay"`,
        holds a kind XLA has no GPU target for or nodes of unequal size, or JAX's CUDA plugin is not
        installed (or cannot start here)."""
        if not self.is_abstract or self.compiler != "auto" or self.platform != "cuda":
            return None
        per = {len(n) for n in self.nodes}
        if len(per) != 1:
            return None
        try:
            twin = Cluster.gpu_topology(self.kinds, per.pop())
        except ClusterError:
            return None
        return twin._replace(host_memory=self.host_memory, host_source=self.host_source, measured=self.measured,
                             spread=self.spread, overhead=self.overhead, calibrated_rows=self.calibrated_rows,
                             links=self.links, head_scale=self.head_scale, head_devices=self.head_devices)

    @classmethod
    def gpu_topology(cls, kinds: Sequence[str], devices_per_node: int | None = None,
                     host_memory: float | str | None = None, target: str | None = None,
                     target_config: str | None = None) -> Cluster:
        """The devices of an XLA:GPU topology of these kinds, on a machine without GPUs: a plan on it
        lowers and compiles with XLA's GPU compiler (`plan.step_memory()`, `plan.compiled_collectives()`,
        `plan.summary(compiled_memory=True)`) but cannot run. Nodes hold `devices_per_node` GPUs (default
        the first kind's typical node). One program compiles for one kind's target: `target` names it
        (default the first kind); `for_target(kind)` gives the same cluster for another kind, so a
        heterogeneous plan is compiled once per kind it uses. `target_config` is a `GpuTargetConfig`
        text recorded from a real device, used instead of the spec table's description. Needs JAX's CUDA
        plugin (`pip install 'whalex[cuda]'`) and `JAX_PLATFORMS=cpu` where no driver is installed."""
        kinds = _kind_list(kinds, "Cluster.gpu_topology")
        if not kinds:
            raise ClusterError("Cluster.gpu_topology needs at least one device kind.")
        specs = tuple(lookup(k) for k in kinds)
        target_kind = lookup(target if target is not None else specs[0]).name
        if target_kind not in {s.name for s in specs}:
            raise ClusterError(f"Cluster.gpu_topology(target={target!r}): the target is one of the cluster's kinds "
                               f"({', '.join(dict.fromkeys(s.name for s in specs))}).")
        text = target_config if target_config is not None else gpu_target(target_kind).text()
        per = _positive_int(devices_per_node) if devices_per_node is not None else \
            min(specs[0].node_devices, len(specs))
        if len(specs) % per:
            raise ClusterError(f"Cluster.gpu_topology: {len(specs)} devices do not fill nodes of {per}; declare "
                               "devices_per_node as a divisor of the device count.")
        devices = _topology_devices(text, len(specs) // per, per)
        nodes = _chunks(len(specs), [per] * len(specs))
        ram, source = _declared_or_typical(host_memory, specs, nodes)
        obj = object.__new__(cls)
        _set(obj, specs, tuple(devices), None, None, nodes, ram, source)
        object.__setattr__(obj, "target", target_kind)
        return obj

    def for_target(self, kind: str) -> Cluster:
        """This gpu_topology cluster compiled for another of its kinds' XLA:GPU target."""
        if self.target is None:
            raise ClusterError("for_target() is for clusters made by Cluster.gpu_topology(...).")
        per = len(self.nodes[0]) if self.nodes else self.size
        return Cluster.gpu_topology(self.kinds, per, None, kind)._replace(host_memory=self.host_memory,
                                                                          host_source=self.host_source,
                                                                          links=self.links)

    def over_abstract_mesh(self) -> Cluster:
        """This `gpu_topology` cluster with its devices kept for compiling only: plans lower over an
        `AbstractMesh` and compile for these devices through their compile-only client. JAX drops
        `pinned_host` from shardings over a deviceless topology's devices (they address no memory);
        over an abstract mesh the memory kinds stay, so offload plans compile with their host transfers."""
        if self.target is None or self.devices is None:
            raise ClusterError("over_abstract_mesh() is for clusters made by Cluster.gpu_topology(...).")
        return self._replace(devices=None, compile_devices=self.devices)

    def _replace(self, **changes) -> Cluster:
        """A copy with `changes` to its fields (a Cluster has its own constructor, so not
        `dataclasses.replace`)."""
        obj = object.__new__(type(self))
        for f in dataclasses.fields(self):
            object.__setattr__(obj, f.name, changes.get(f.name, getattr(self, f.name)))
        return obj

    @property
    def compile_only(self) -> bool:
        """Whether the devices are a GPU topology whalex compiles for but cannot run on."""
        return self.target is not None

    def with_speeds(self, speeds, spread=None, overhead=None, rows=None) -> Cluster:
        """A copy whose device speeds (FLOP/s) are measured ones instead of the spec table's.

        `spread`: optional relative noise of each speed (0.05 reads +-5%), shown beside the speed in
        `plan.summary()`. `overhead`: optional seconds each device spends per step whatever its load
        (the optimizer update, kernel launches); a balanced plan then equalises overhead + rows x
        time per row instead of splitting in proportion to speed. `rows`: optional (fewest, most) rows
        per device the speeds and fixed times were measured at; `plan.summary()` says when a device's
        share falls outside them (its time extrapolated). `calibrate()` fills all three in.
        """
        speeds = tuple(float(s) for s in speeds)
        if len(speeds) != self.size or not all(math.isfinite(s) and s > 0 for s in speeds):
            raise ClusterError(f"with_speeds needs {self.size} positive speeds, got {speeds}.")
        if spread is not None:
            spread = tuple(float(s) for s in spread)
            if len(spread) != self.size or not all(math.isfinite(s) and s >= 0 for s in spread):
                raise ClusterError(f"with_speeds needs {self.size} non-negative relative spreads (0.05 for +-5%), "
                                   f"got {spread}.")
        if overhead is not None:
            overhead = tuple(float(s) for s in overhead)
            if len(overhead) != self.size or not all(math.isfinite(s) and s >= 0 for s in overhead):
                raise ClusterError(f"with_speeds needs {self.size} non-negative overheads (seconds per step), "
                                   f"got {overhead}.")
        if rows is not None:
            if len(tuple(rows)) != 2 or not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool)
                                                for r in rows) or not 1 <= rows[0] <= rows[1]:
                raise ClusterError(f"with_speeds(rows=...) is the (fewest, most) rows per device the speeds were "
                                   f"measured at, two integers 1 <= fewest <= most, got {rows!r}.")
            rows = (int(rows[0]), int(rows[1]))
        return self._replace(measured=speeds, spread=spread, overhead=overhead, calibrated_rows=rows)

    def with_head_scale(self, scale: float, devices: Sequence[int] | None = None) -> Cluster:
        """A copy whose split heads give the slowest devices (or `devices`, by index) the classes of `scale`
        times their speed (`calibrate` times the head's program at a few splits where the loss has
        `wh.ops.softmax_cross_entropy_head` and the devices differ, and keeps the fastest). Naming the
        devices keeps the scale on them where their rows' speed is changed past another device's."""
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)) or not (
                math.isfinite(scale) and scale > 0):
            raise ClusterError(f"with_head_scale needs a positive number, got {scale!r}.")
        if devices is not None:
            devices = tuple(devices)
            if not devices or not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool)
                                      and 0 <= i < self.size for i in devices):
                raise ClusterError(f"with_head_scale(devices=...) is a non-empty list of device indices in "
                                   f"[0, {self.size}), got {devices!r}.")
            devices = tuple(sorted({int(i) for i in devices}))
        return self._replace(head_scale=float(scale), head_devices=devices)

    @property
    def head_speeds(self) -> tuple[float, ...]:
        """Each device's speed on a split head's classes: its rows' speed, `head_scale` times it on the
        head's devices (`head_devices`, else the slowest)."""
        return scaled_speeds(self.speeds, self.head_scale, self.head_devices)[0]

    def with_links(self, latency: float, bandwidth: float) -> Cluster:
        """A copy whose links between devices are measured ones, the same for every pair: a message of
        n bytes costs `latency + n / bandwidth` seconds (`calibrate()` times them on multi-process
        clusters); otherwise the spec table's, inside a node and between nodes (`whalex.mesh.links`)."""
        if not (math.isfinite(latency) and latency >= 0 and math.isfinite(bandwidth) and bandwidth > 0):
            raise ClusterError(f"with_links needs a non-negative latency (seconds) and a positive bandwidth "
                               f"(bytes/s), got latency={latency!r}, bandwidth={bandwidth!r}.")
        return self._replace(links=Link(float(latency), float(bandwidth), "calibrated"))

    @property
    def host_bytes(self) -> tuple[float, ...]:
        """Host RAM per device: its node's RAM shared evenly by the node's devices."""
        share = [0.0] * self.size
        for node, ram in zip(self.nodes, self.host_memory):
            for d in node:
                share[d] = ram / len(node)
        return tuple(share)

    @property
    def speeds(self) -> tuple[float, ...]:
        """FLOP/s per device: calibrated if measured, else the spec table's FP32 peak."""
        return self.measured if self.measured is not None else tuple(s.fp32_flops for s in self.specs)

    def compute_speeds(self, amp: str | None = None) -> tuple[float, ...]:
        """FLOP/s per device for a step computing in `amp` ("bf16"/"fp16": the spec table's tensor-core
        peak; None: its FP32 peak); calibrated speeds were measured on the step itself and stand as they are."""
        if self.measured is not None or amp not in ("bf16", "fp16"):
            return self.speeds
        return tuple(s.bf16_flops for s in self.specs)

    @property
    def speed_source(self) -> str:
        return "calibrated" if self.measured is not None else "spec table"

    @property
    def size(self) -> int:
        return len(self.specs)

    @property
    def is_abstract(self) -> bool:
        return self.devices is None

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    @property
    def is_heterogeneous(self) -> bool:
        return len(set(self.kinds)) > 1

    @property
    def platform(self) -> str:
        """The platform to lower for: the real one, or 'cuda' for an abstract GPU cluster."""
        if self.devices is not None:
            platform = self.devices[0].platform
            return "cuda" if platform == "gpu" else platform
        return "cpu" if all(s.platform == "cpu" for s in self.specs) else "cuda"

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for k in self.kinds:
            counts[k] = counts.get(k, 0) + 1
        desc = " + ".join(f"{n}x {k}" for k, n in counts.items())
        extra = (", abstract" if self.is_abstract and self.target is None else "") + \
            (", calibrated" if self.measured else "")
        if self.target is not None:
            extra += f", XLA:GPU topology for {self.target}" + (", over an abstract mesh" if self.is_abstract else "")
        return f"Cluster({desc}{extra})"


def _set(obj: Cluster, specs, devices, measured, spread, nodes, host_memory, host_source) -> None:
    for name, value in (("specs", specs), ("devices", devices), ("measured", measured), ("spread", spread),
                        ("nodes", nodes), ("host_memory", host_memory), ("host_source", host_source),
                        ("overhead", None), ("calibrated_rows", None), ("target", None),
                        ("compiler", "auto"), ("compile_devices", None), ("links", None), ("head_scale", 1.0),
                        ("head_devices", None)):
        object.__setattr__(obj, name, value)


def _topology_devices(text: str, hosts: int, per_host: int) -> list:
    try:
        return C.gpu_topology(text, hosts, per_host)
    except NotImplementedError as e:
        raise ClusterError(
            "Cluster.gpu_topology compiles with XLA's GPU compiler, which needs JAX's CUDA plugin: install it with "
            "pip install 'whalex[cuda]' (no GPU or driver needed), and where no driver is installed set "
            "JAX_PLATFORMS=cpu (or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1) before JAX starts; JAX said: " + str(e)) from e
    except RuntimeError as e:
        raise ClusterError(f"XLA could not make a GPU topology of {hosts} x {per_host} devices from the target "
                           f"description: {e}") from e


def _declared_or_typical(host_memory, specs, nodes) -> tuple[tuple[float, ...], str]:
    """Host RAM per node of a cluster without devices to read it from: declared, or each node's
    kind's typical node from the spec table."""
    if host_memory is not None:
        return (parse_bytes(host_memory),) * len(nodes), "declared"
    return tuple(_node_ram(specs[n[0]]) for n in nodes), "spec table"


def _node_ram(spec: DeviceSpec) -> float:
    """A kind's typical node RAM; unknown (a DeviceSpec without one) bounds nothing."""
    return float(spec.node_host_bytes) if spec.node_host_bytes > 0 else float("inf")


def _positive_int(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ClusterError(f"devices_per_node must be a positive integer, got {n!r}.")
    return n


def _chunks(size: int, per: Sequence[int], kinds: Sequence[str] | None = None) -> tuple[tuple[int, ...], ...]:
    """Consecutive devices in nodes of `per[first device]` devices; a new kind starts a new node."""
    nodes: list[list[int]] = []
    for d in range(size):
        if not nodes or len(nodes[-1]) >= per[nodes[-1][0]] or (kinds is not None and kinds[d] != kinds[nodes[-1][0]]):
            nodes.append([])
        nodes[-1].append(d)
    return tuple(tuple(n) for n in nodes)


def detect_host_memory() -> float | None:
    """This machine's physical RAM in bytes (None where the OS does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None
