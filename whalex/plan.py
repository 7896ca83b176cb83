"""`Plan`: what whalex decided for one model on one cluster, readable and lowerable."""
from __future__ import annotations

import dataclasses
import html
from typing import Any

import jax

from whalex.balance.profile import DeviceMemory
from whalex.core.comm import Comm
from whalex.lowering.patterns import PatternChoice
from whalex.memory.remat import summary_lines
from whalex.mesh.cluster import Cluster
from whalex.mesh.virtual import MeshLayout, VirtualDevice
from whalex.primitives.config import Config


@dataclasses.dataclass(frozen=True)
class TaskGraphInfo:
    """One TaskGraph as planned."""

    index: int
    strategy: str            # e.g. "split(8)"
    annotated: bool
    device_count: int        # devices per replica
    devices: tuple[int, ...] # the first replica's devices
    nested_dp: int
    num_eqns: int
    num_params: int          # parameter elements it reads
    param_bytes: float
    flops: float             # forward + backward FLOPs on the global batch (XLA cost analysis)
    comm_bytes: float        # predicted per-device collective traffic per step

    @property
    def name(self) -> str:
        return f"TG{self.index}"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _fmt_flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


def _fmt_speed(speed: float, spread: float | None = None) -> str:
    return f"{_fmt_flops(speed)}/s" + ("" if spread is None else f" ± {_fmt_pct(spread)}")


def _fmt_pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def speed_lines(cluster: Cluster) -> list[str]:
    """Calibrated speeds, one line per group of devices that the noise made equal: the common
    speed, and the spread (or range of spreads) of the members' measurements."""
    if cluster.measured is None:
        return []
    groups: dict[float, list[int]] = {}
    for i, s in enumerate(cluster.measured):
        groups.setdefault(s, []).append(i)
    lines = ["calibrated speeds " + ("(median over timing rounds ± relative spread; speeds equal within the noise "
                                     "are merged):" if cluster.spread is not None else "(given without a spread):")]
    for speed, ids in sorted(groups.items(), key=lambda g: -g[0]):
        text = f"  {_fmt_speed(speed)} on device{'s' if len(ids) > 1 else ''} {_devices(tuple(ids))}"
        if cluster.spread is not None:
            lo, hi = min(cluster.spread[i] for i in ids), max(cluster.spread[i] for i in ids)
            text += f", spread ± {_fmt_pct(lo)}" + (f" to {_fmt_pct(hi)}" if hi > lo else "")
        if cluster.overhead is not None:
            text += f", fixed {_fmt_time(cluster.overhead[ids[0]])} per step"
        lines.append(text)
    return lines


@dataclasses.dataclass(frozen=True)
class Plan:
    """The parallel plan: TaskGraphs, VirtualDevices, per-device batch sizes, shardings, memory."""

    cluster: Cluster
    config: Config
    layout: MeshLayout
    task_graphs: tuple[TaskGraphInfo, ...]
    virtual_devices: tuple[VirtualDevice, ...]
    batch_sizes: tuple[int, ...]
    global_batch: int
    param_specs: dict           # parameter path -> PartitionSpec
    patterns: tuple[PatternChoice, ...]
    comms: tuple[Comm, ...]
    memory: tuple[DeviceMemory, ...]
    program: Any = dataclasses.field(repr=False, compare=False)
    schedule: Any = None                      # the pipeline Schedule, when the plan is a pipeline
    stage_layers: tuple = ()                  # per stage, the names of the layers it holds
    balance: Any = None                       # the hardware-aware BalanceReport, on heterogeneous clusters
    head_balance: Any = None                  # the split head's class shards when `balance` is the batch's (hybrid)
    batch_couplings: Any = dataclasses.field(default=(), repr=False, compare=False)   # lines, or a function of none
    _cache: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def couplings(self) -> tuple[str, ...]:
        """How the plan computes each batch reduction of the loss (the loss contract), one line each."""
        if "couplings" not in self._cache:
            c = self.batch_couplings
            self._cache["couplings"] = tuple(c() if callable(c) else c)
        return self._cache["couplings"]

    # -- lowering ---------------------------------------------------------------------------
    def lowered(self):
        """The `jax.stages.Lowered` training step (works on abstract clusters too)."""
        return self.program.lower()

    def lower(self) -> str:
        """The sharded StableHLO text of one training step."""
        return self.lowered().as_text()

    def compiled_memory(self) -> dict:
        """XLA's per-device memory analysis of the compiled step (needs real devices; cached)."""
        if self.cluster.is_abstract:
            raise ValueError("compiled_memory() needs real devices; an abstract cluster can only be lowered. "
                             "Use plan.memory for the planned per-device state, or plan on Cluster.detect().")
        if "memory" not in self._cache:
            m = self.lowered().compile().memory_analysis()
            self._cache["memory"] = {k: getattr(m, k) for k in (
                "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                "alias_size_in_bytes", "generated_code_size_in_bytes") if hasattr(m, k)}
        return dict(self._cache["memory"])

    @property
    def mesh(self):
        return self.program.mesh

    def place_batch(self, batch):
        """The global batch placed for the step (uneven plans lay rows out per device)."""
        if hasattr(self.program, "place_batch"):
            return self.program.place_batch(batch)
        return jax.device_put(batch, self.program.batch_shardings)

    def device_rows(self) -> tuple[tuple[int, int], ...]:
        """The global-batch rows [start, stop) each device trains on in one step."""
        if hasattr(self.program, "row_ranges"):
            return self.program.row_ranges()
        starts = [0]
        for r in self.batch_sizes:
            starts.append(starts[-1] + r)
        return tuple(zip(starts[:-1], starts[1:]))

    def local_rows(self, process_index: int) -> list[tuple[int, int]]:
        """The slices of the global batch whose rows the devices of `process_index` train on."""
        devices = self.cluster.devices
        if devices is None:
            raise ValueError("local_rows needs a cluster with devices.")
        out: list[tuple[int, int]] = []
        for d, (a, b) in zip(devices, self.device_rows()):
            if d.process_index == process_index and b > a:
                if out and out[-1][1] == a:
                    out[-1] = (out[-1][0], b)
                else:
                    out.append((a, b))
        return out

    @property
    def predicted_comm_bytes(self) -> float:
        return sum(c.bytes for c in self.comms)

    # -- rendering --------------------------------------------------------------------------
    def _rows(self):
        tg_rows = [[t.name, t.strategy + ("" if t.annotated else " (default)"), str(t.device_count),
                    _devices(t.devices), str(t.nested_dp), f"{t.num_params:,}", _fmt_flops(t.flops),
                    _fmt_bytes(t.comm_bytes)] for t in self.task_graphs]
        pat_rows = [[f"TG{p.taskgraph}", p.unit, p.param, p.pattern,
                     ", ".join(f"{k}={_fmt_bytes(v)}" for k, v in p.costs)] for p in self.patterns]
        mem_rows = []
        groups: dict = {}
        for m, b in zip(self.memory, self.batch_sizes):
            key = (m.kind, b, round(m.params), round(m.opt_state))
            groups.setdefault(key, []).append(m)
        for (kind, b, _, _), ms in groups.items():
            m = ms[0]
            mem_rows.append([_devices(tuple(x.device for x in ms)), kind, str(b), _fmt_bytes(m.params),
                             _fmt_bytes(m.grads), _fmt_bytes(m.opt_state), _fmt_bytes(m.activations),
                             _fmt_bytes(m.host), _fmt_bytes(m.capacity)])
        return tg_rows, pat_rows, mem_rows

    def _memory_lines(self) -> list[str]:
        """Each memory optimization's share of the per-device memory (from the plan's shardings)."""
        shares = self.memory[0].shares if self.memory else ()
        lines = []
        if shares:
            lines.append("memory optimizations, per device:")
            width = max(len(x.component) for x in shares)
            lines += [f"  {x.component:<{width}}  {_fmt_bytes(x.before)} -> {_fmt_bytes(x.after)} ({x.by})"
                      for x in shares]
        lines += self._host_lines()
        level = self.config.zero_level
        if level and not any(x.by.startswith("zero") for x in shares):
            why = ("the pipeline already stores parameters and optimizer state spread over every device"
                   if self.schedule is not None else
                   "no parameter has a data-parallel axis of more than one device and a dimension it divides")
            lines.append(f"zero {level}: nothing to shard ({why})")
        return lines

    def _host_lines(self) -> list[str]:
        """Host RAM per node and device (what offload may use), and whether the offloaded state fits it."""
        c = self.cluster
        if not c.nodes:
            return []
        used = len(self.memory)
        share = c.host_bytes[:used]
        if min(share) == float("inf"):
            return ["host memory: unknown (a device kind without a typical node; nothing bounds offload)"]
        nodes = {(len(n), ram) for n, ram in zip(c.nodes, c.host_memory) if n[0] < used}
        desc = ", ".join(f"{_fmt_bytes(ram)} per node of {k} device{'s' if k > 1 else ''}" for k, ram in sorted(nodes))
        lines = [f"host memory ({c.host_source}): {desc}; {_fmt_bytes(min(share))} per device"]
        worst = max(range(used), key=lambda d: self.memory[d].host - share[d])
        host = self.memory[worst].host
        if host > share[worst]:
            lines.append(f"  does not fit: host memory is the limit (offload keeps {_fmt_bytes(host)} per device on the "
                         f"host, which holds {_fmt_bytes(share[worst])} per device)")
        elif host > 0:
            lines.append(f"  offload keeps {_fmt_bytes(host)} per device on the host: fits")
        return lines

    def summary(self, compiled_memory: bool = False) -> str:
        """A readable table of the plan; `compiled_memory=True` adds XLA's per-device memory analysis."""
        tg_rows, pat_rows, mem_rows = self._rows()
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.layout.axis_names, self.layout.axis_sizes))
        lines = [f"whalex plan: {self.cluster!r}, mesh ({mesh}), global batch {self.global_batch}, "
                 f"{self.config.num_micro_batch} micro-batch(es)"]
        lines += _table(["TaskGraph", "strategy", "devices/replica", "devices", "nested DP", "params",
                         "FLOPs (fwd+bwd)", "comm/device"], tg_rows)
        lines += speed_lines(self.cluster)
        if self.schedule is not None:
            s = self.schedule
            reps = self.layout.axis_sizes[0]
            lines.append(f"pipeline: {s.num_stages} stages x {reps} replica{'s' if reps > 1 else ''}, schedule "
                         f"{s.name}, {s.num_micro_batch} micro-batches, {s.num_ticks} ticks, bubble "
                         f"{s.bubble_fraction:.1%}, {s.slots} stashed micro-batch(es) per stage")
            for k, layers in enumerate(self.stage_layers):
                if layers:
                    lines.append(f"  stage {k}: {len(layers)} layer{'s' if len(layers) > 1 else ''} "
                                 f"({', '.join(layers)})")
        for r in (self.balance, self.head_balance):
            if r is None:
                continue
            lines.append(f"hardware-aware balance of the {r.kind} ({'applied' if r.applied else 'not applied: even plan'}; "
                         f"speeds from the {r.source}; unit {r.unit}; Algorithm 1 moved {r.shifted} units "
                         "for memory):")
            rows = [[str(d.device), d.kind, _fmt_speed(d.speed, d.spread), str(d.even_rows), str(d.rows),
                     _fmt_time(d.time), _fmt_bytes(d.memory), _fmt_bytes(d.capacity)] for d in r.devices]
            lines += _table(["device", "kind", "capacity", "even", "balanced", "predicted time",
                             "predicted memory", "memory"], rows)
            lines.append(f"  predicted step compute: even {_fmt_time(r.even_time)}, balanced "
                         f"{_fmt_time(r.balanced_time)} ({r.predicted_speedup:.2f}x)")
        for e in getattr(getattr(self.program, "sharding", None), "experts", ()):
            a2a = sum(c.bytes for c in self.comms if c.taskgraph == e.taskgraph and c.kind == "all-to-all")
            n = self.layout.axis_size(e.expert_axes)
            lines.append(f"expert parallelism: TG{e.taskgraph} experts over {'x'.join(e.expert_axes)} ({n} devices, "
                         f"{e.experts_per_device} per device), tokens over {'x'.join(e.token_axes)}; all-to-all "
                         f"dispatch and combine, {_fmt_bytes(a2a)} per step and device")
        if self.couplings:
            lines.append("batch couplings of the loss (reductions over the batch, and how this plan computes them):")
            lines += [f"  {c}" for c in self.couplings]
        if pat_rows:
            lines.append("sharding patterns (least communication wins):")
            lines += _table(["TaskGraph", "unit", "parameter", "pattern", "candidate costs"], pat_rows)
        lines.append("per device:")
        lines += _table(MEMORY_COLUMNS, mem_rows)
        lines += self._memory_lines()
        lines.append(f"predicted collective traffic per step and device: {_fmt_bytes(self.predicted_comm_bytes)}")
        lines += summary_lines(self.program)             # remat per TaskGraph, amp, comm dtype
        if compiled_memory or "memory" in self._cache:
            m = self.compiled_memory()
            lines.append("XLA memory analysis per device: " + ", ".join(
                f"{k.replace('_size_in_bytes', '')} {_fmt_bytes(v)}" for k, v in m.items()))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        tg_rows, pat_rows, mem_rows = self._rows()

        def table(head, rows):
            h = "".join(f"<th>{html.escape(c)}</th>" for c in head)
            b = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
            return f"<table><thead><tr>{h}</tr></thead><tbody>{b}</tbody></table>"

        parts = [f"<div><b>whalex plan</b> &mdash; {html.escape(repr(self.cluster))}, global batch "
                 f"{self.global_batch}</div>",
                 table(["TaskGraph", "strategy", "devices/replica", "devices", "nested DP", "params",
                        "FLOPs (fwd+bwd)", "comm/device"], tg_rows)]
        if pat_rows:
            parts.append(table(["TaskGraph", "unit", "parameter", "pattern", "candidate costs"], pat_rows))
        parts.append(table(MEMORY_COLUMNS, mem_rows))
        return "\n".join(parts)


MEMORY_COLUMNS = ["devices", "kind", "batch", "params", "grads", "opt state", "activations", "host", "capacity"]


def _fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.2f} us"


def _devices(ids: tuple[int, ...]) -> str:
    if len(ids) > 1 and list(ids) == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def _table(head, rows) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)] if rows else [len(h) for h in head]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    return ["  " + fmt.format(*head), "  " + "  ".join("-" * w for w in widths)] + \
        ["  " + fmt.format(*r) for r in rows]
