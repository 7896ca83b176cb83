"""`Plan`: what whalex decided for one model on one cluster, readable and lowerable."""
from __future__ import annotations

import dataclasses
from typing import Any

from whalex.jaxpr.capture import Captured
from whalex.jaxpr.hlo import StepCollectives, step_collectives
from whalex.memory import fit
from whalex.memory.accounting import DeviceMemory
from whalex.memory.host_link import HostTraffic, host_traffic
from whalex.memory.peak import Peak, compiled_peak
from whalex.memory.remat import summary_lines
from whalex.mesh.cluster import Cluster
from whalex.mesh.virtual import MeshLayout, VirtualDevice
from whalex.primitives.config import Config
from whalex.records.comm import Comm
from whalex.records.memory_options import MemoryOptions, Precision, RematPlan
from whalex.records.program import StageBuffers, StepProgram, TracedStep
from whalex.records.sharding_plan import Coverage, ExpertCall, PatternChoice
from whalex.view import html as view_html, sections as view_sections, text as view_text


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
    """The parallel plan: TaskGraphs, VirtualDevices, per-device batch sizes, shardings, memory.

    It carries the step program the planner built (`program`, a `whalex.records.program.StepProgram`);
    the api, checkpoints, the view and the benches use the methods below, never the program itself."""

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
    program: StepProgram = dataclasses.field(repr=False, compare=False)
    schedule: Any = None                      # the pipeline Schedule, when the plan is a pipeline
    stage_layers: tuple = ()                  # per stage, the names of the layers it holds
    placement: str = ""                       # which plan places the TaskGraphs (stages or shared devices), and why
    balance: Any = None                       # the hardware-aware BalanceReport, on heterogeneous clusters
    head_balance: Any = None                  # the split head's class shards when `balance` is the batch's (hybrid)
    coverage: tuple[Coverage, ...] = ()       # every parameter a split TaskGraph reads, and its layout
    refinement: Any = None                    # the splits Config(hardware_aware="refine") timed, and the one kept
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

    # -- the step program's records ---------------------------------------------------------------
    @property
    def program_kind(self) -> str:
        """The kind of step program carrying the plan out: Program (GSPMD), UnevenProgram,
        HybridProgram, PipelineProgram."""
        return type(self.program).__name__

    @property
    def captured(self) -> Captured:
        """The loss as the program runs it (traced at the size of its parts: micro-batch, chunk)."""
        return self.program.captured

    @property
    def memory_options(self) -> MemoryOptions:
        """ZeRO level and offloaded state, as the program lays out its state."""
        return self.program.memory_options

    @property
    def remat(self) -> RematPlan | None:
        """What each TaskGraph (or layer) recomputes, and activation offload; None without remat."""
        return self.program.remat

    def host_traffic(self) -> tuple[HostTraffic | None, ...]:
        """Per device: what offload moves over its host link a step, and the least time that takes at the
        device kind's host bandwidth (None on a device whose state and activations all stay on it)."""
        r = self.remat
        acts = r.offloaded if r is not None and r.offloaded else 0.0
        fetches = 3 if self.params_fetched_per_layer else 1
        return tuple(host_traffic(m, spec, acts, fetches) for m, spec in zip(self.memory, self.cluster.specs))

    @property
    def params_fetched_per_layer(self) -> bool:
        """offload="params": whether each layer fetches its parameters (forward, again for the backward)
        rather than the whole tree coming to the device at the start of the step."""
        return self.program.fetch_shardings is not None

    @property
    def precision(self) -> Precision | None:
        """amp and comm_dtype as the program runs them; None in full precision."""
        return self.program.precision

    @property
    def experts(self) -> tuple[ExpertCall, ...]:
        """The MoE calls run expert-parallel."""
        return self.program.experts

    def remat_precision_lines(self) -> list[str]:
        """What the summary says of remat (per TaskGraph or layer), amp and the gradient dtype."""
        p = self.program
        return summary_lines(p.remat, p.precision, p.comm_report())

    def stage_buffers(self) -> StageBuffers | None:
        """A pipeline's per-device buffers (parameter rows, messages, its batch); None otherwise."""
        return self.program.stage_buffers()

    # -- the step -------------------------------------------------------------------------------------
    @property
    def param_shardings(self):
        """Where the stored parameters live (a pytree of shardings)."""
        return self.program.param_shardings

    @property
    def batch_shardings(self):
        """Where the batch the step takes lives (uneven plans: padded per-device blocks)."""
        return self.program.batch_shardings

    def batch_shapes(self):
        """ShapeDtypeStructs of the batch the step takes, as `place_batch` lays it out."""
        return self.program.batch_shapes()

    def value_and_grad(self):
        """(params, batch, extra=()) -> ((loss, aux, new model state), grads) as the step computes them
        (params in the stored layout, the batch placed by `place_batch`)."""
        return self.program.value_and_grad()

    def jitted(self, donate: bool = True):
        """The jitted training step (state, batch) -> (state, metrics), the state donated; without an
        optimizer, (params, batch) -> (loss, grads)."""
        return self.program.jitted(donate)

    def abstract_args(self) -> tuple:
        """ShapeDtypeStructs with shardings for every argument of the jitted step."""
        return self.program.abstract_args()

    def traced_step(self) -> TracedStep:
        """The step as `wh.parallelize` runs it (state donated), traced to a jaxpr: plain data."""
        return self.program.traced_step()

    def prepass(self):
        """The loss contract's pre-pass alone as a jitted program, and a null program of the same
        inputs (plans that run the loss in parts; a PlanError for the others)."""
        return self.program.prepass()

    # -- the state ------------------------------------------------------------------------------------
    @property
    def param_view(self):
        """How `TrainState.params` reads the caller's pytree when the plan stores its own layout (None:
        it stores the caller's)."""
        return self.program.param_view

    def init_state(self, params, model_state=None, rng=None):
        """A fresh `TrainState`: params (copied) placed per the plan, a new optimizer state."""
        return self.program.init_state(params, model_state, rng)

    def caller_state(self, state) -> dict:
        """`state` in the caller's layout (what a checkpoint holds)."""
        return self.program.caller_state(state)

    def caller_targets(self, model_state=None, rng=None) -> dict:
        """Abstract caller-layout state on this plan's mesh, to restore a checkpoint into."""
        return self.program.caller_targets(model_state, rng)

    def place_caller_state(self, tree: dict, rng=None):
        """A `TrainState` of this plan from caller-layout values (a restored checkpoint)."""
        return self.program.place_caller_state(tree, rng)

    def holds(self, state) -> bool:
        """Whether `state` is stored as this plan stores it (what its jitted step accepts as it is)."""
        return self.program.holds(state)

    def adopt_state(self, state):
        """`state`, made by another plan or step of the same parameters, placed per this plan as a
        checkpoint restore would place it (values moved, never recomputed; `state` is copied)."""
        return self.program.adopt_state(state)

    # -- memory -------------------------------------------------------------------------------------
    def memory_fit(self) -> fit.MemoryFit:
        """The per-device footprint from abstract shapes, whether the plan fits, and which of ZeRO,
        remat, bf16 and offload it would need (`whalex.memory.fit`). On a `Cluster.gpu_topology`
        fitting is judged on XLA:GPU's compiled step (compiled once, as `step_memory()`)."""
        n = self.layout.size
        compiled = self.step_memory().total if self.cluster.compile_only else None
        return fit.memory_fit(self.program.state_layout(), self.captured, self.virtual_devices,
                              self.cluster.specs[:n], self.cluster.host_bytes[:n], self.experts, compiled)

    # -- lowering ---------------------------------------------------------------------------
    def lowered(self, donate: bool = False):
        """The `jax.stages.Lowered` training step (works on abstract clusters too); `donate=True`: as
        `wh.parallelize` runs it, the state donated."""
        if not donate:
            return self.program.lower()
        p = self.program
        return p.jitted(donate=True).trace(*p.abstract_args()).lower(lowering_platforms=(p.platform,))

    def lower(self) -> str:
        """The sharded StableHLO text of one training step."""
        return self.lowered().as_text()

    def compiled_memory(self) -> dict:
        """XLA's per-device memory analysis of the compiled step (needs real devices; cached)."""
        if self.cluster.is_abstract:
            raise ValueError("compiled_memory() needs devices; an abstract cluster can only be lowered. Use "
                             "plan.memory for the planned per-device state, plan on Cluster.detect(), or on "
                             "Cluster.gpu_topology(kinds=...) to compile for XLA:GPU without GPUs.")
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
        if no step has yet (needs real devices, or a `Cluster.gpu_topology` for XLA:GPU's figure)."""
        if not self.step_compiled:
            self._compile_step()
        return self.compiled_step_memory

    @property
    def compiled_step_collectives(self) -> StepCollectives | None:
        """`compiled_collectives()` once the step has been compiled by it or by `step_memory()`; None before."""
        return self._cache.get("collectives")

    def compiled_collectives(self) -> StepCollectives:
        """The collectives XLA compiled the step to, per device: how many, the bytes each device sends
        per step, and how many run asynchronously with compute scheduled between start and done
        (compiles the step once; needs real devices or a `Cluster.gpu_topology`)."""
        if "collectives" not in self._cache:
            self._compile_step()
        return self._cache["collectives"]

    def _compile_step(self) -> None:
        if self.cluster.is_abstract:
            raise ValueError("compiling the step needs devices; an abstract cluster can only be lowered: use "
                             "plan.predicted_memory(), or plan on Cluster.gpu_topology(kinds=...) to compile for "
                             "XLA:GPU without GPUs.")
        compiled = self.lowered(donate=True).compile()
        self.record_step_memory(compiled.memory_analysis())
        arms = None
        if self.schedule is not None:     # a pipeline's tick: forward or backward, M of each per device
            share = self.config.num_micro_batch / self.schedule.num_ticks
            arms = (share, share)
        self._cache["collectives"] = step_collectives(compiled.as_text(), self.layout.size, arms)

    @property
    def mesh(self):
        return self.program.mesh

    def place_batch(self, batch):
        """The global batch placed for the step (uneven plans lay rows out per device)."""
        return self.program.place_batch(batch)

    def device_rows(self) -> tuple[tuple[int, int], ...]:
        """The global-batch rows [start, stop) each device trains on in one step."""
        rows = self.program.row_ranges()
        if rows is not None:
            return rows
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
        """Bytes one device sends per step for the plan's collectives: every TaskGraph's where they
        share the devices; a pipeline's device runs its own stage's (`Comm.taskgraph` is the stage),
        so the stage that sends the most."""
        if self.schedule is None:
            return sum(c.bytes for c in self.comms)
        per_stage: dict[int, float] = {}
        for c in self.comms:
            per_stage[c.taskgraph] = per_stage.get(c.taskgraph, 0.0) + c.bytes
        return max(per_stage.values(), default=0.0)

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
    """whalex.view.plot, imported on first use: it imports matplotlib, which would add a quarter to
    the time of `import whalex` (docs/architecture.md#layers-and-data-flow), a cost users who never
    plot should not pay."""
    from whalex.view import plot
    return plot
