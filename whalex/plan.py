"""`Plan`: what whalex decided for one model on one cluster, readable and lowerable."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from whalex.balance.profile import DeviceMemory
from whalex.core.comm import Comm
from whalex.core.sharding_plan import Coverage, PatternChoice
from whalex.memory.peak import Peak, compiled_peak
from whalex.mesh.cluster import Cluster
from whalex.mesh.virtual import MeshLayout, VirtualDevice
from whalex.primitives.config import Config
from whalex.view import html as view_html
from whalex.view import sections as view_sections
from whalex.view import text as view_text


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


@dataclasses.dataclass(frozen=True, repr=False)
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
    coverage: tuple[Coverage, ...] = ()       # every parameter a split TaskGraph reads, and its layout
    batch_couplings: Any = dataclasses.field(default=(), repr=False, compare=False)   # lines, or a function of none
    # the step's predicted per-device memory (a Peak), or a function of none finding it (one trace of the step)
    predicted_peak: Any = dataclasses.field(default=None, repr=False, compare=False)
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

    # -- the step's memory: predicted, and XLA's once compiled ------------------------------------
    def predicted_memory(self) -> Peak | None:
        """Predicted per-device memory of the training step as it runs, state donated (a `Peak`:
        arguments, outputs, temporaries, total), from a replay of the step's jaxpr; found when first
        asked (one trace of the step), no compilation, so abstract clusters have it too."""
        if "predicted" not in self._cache:
            p = self.predicted_peak
            self._cache["predicted"] = p() if callable(p) else p
        return self._cache["predicted"]

    @property
    def compiled_step_memory(self) -> Peak | None:
        """XLA's per-device figures for the training step as `wh.parallelize` runs it (arguments,
        outputs less those written into the donated state, temp), once it has been compiled: by its
        first call, or by `step_memory()`. None before."""
        return self._cache.get("step_memory")

    @property
    def step_compiled(self) -> bool:
        """Whether the step has been compiled and its memory analysis kept (`record_step_memory`)."""
        return "step_memory" in self._cache

    def record_step_memory(self, memory_analysis) -> None:
        """Keep XLA's memory analysis of the compiled step (the step records it on its first call;
        None where a backend has none)."""
        self._cache["step_memory"] = compiled_peak(memory_analysis) if memory_analysis is not None else None

    def step_memory(self) -> Peak:
        """XLA's per-device figures for the training step as it runs (state donated), compiling it
        if no step has yet (needs real devices)."""
        if not self.step_compiled:
            if self.cluster.is_abstract:
                raise ValueError("step_memory() compiles the step and needs real devices; on an abstract cluster use "
                                 "plan.predicted_memory().")
            p = self.program
            step = p.jitted(donate=p.optimizer is not None)
            self.record_step_memory(step.trace(*p.abstract_args()).lower(lowering_platforms=(p.platform,))
                                    .compile().memory_analysis())
        return self.compiled_step_memory

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
    def sections(self, compiled_memory: bool = False):
        """What the plan says as titled sections of lines and tables (what summary() and the HTML render)."""
        return view_sections.sections(self, compiled_memory)

    def summary(self, compiled_memory: bool = False) -> str:
        """A readable table of the plan; `compiled_memory=True` adds XLA's per-device memory analysis."""
        return view_text.render(self.sections(compiled_memory))

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        """One line: the cluster, the mesh, the TaskGraphs, the batch (summary() has the rest)."""
        tgs = [f"{t.name}={t.strategy}" for t in self.task_graphs]
        if len(tgs) > 4:
            tgs = tgs[:3] + [f"... {len(tgs) - 3} more"]
        kinds: dict[str, int] = {}
        for k in self.cluster.kinds[: len(self.memory) or None]:
            kinds[k] = kinds.get(k, 0) + 1
        extra = ""
        if self.schedule is not None:
            s = self.schedule
            extra = f", pipeline={s.name} {s.num_stages} stages bubble {s.bubble_fraction:.1%}"
        if self.balance is not None and self.balance.applied:
            extra += f", balanced {self.balance.kind} ({self.balance.predicted_speedup:.2f}x predicted)"
        return (f"<whalex.Plan: {', '.join(f'{n} x {k}' for k, n in kinds.items())}, mesh "
                f"({view_sections.mesh_text(self)}), {', '.join(tgs)}, global batch {self.global_batch}, "
                f"{self.config.num_micro_batch} micro-batch(es){extra}; .summary() or .plot() for more>")

    def plot(self):
        """A matplotlib Figure: devices by kind, loads, predicted time, memory, the pipeline schedule and
        collective traffic (see whalex/view/plot.py)."""
        return _plot_view().plot(self)

    def _repr_html_(self) -> str:
        return view_html.render(self.sections(), pictures=_plot_view().themed_pngs(self),
                                subtitle=view_sections.mesh_text(self))


def _plot_view():
    """whalex.view.plot, imported on first use: it imports matplotlib, which would add 0.55-0.60 s to
    `import whalex` (measured on the 2-core dev machine: import whalex 1.9-2.3 s, then whalex.view.plot
    0.55-0.60 s, matplotlib 3.11), a cost users who never plot should not pay."""
    from whalex.view import plot
    return plot
