"""`Plan`: what whalex decided for one model on one cluster, readable and lowerable."""
from __future__ import annotations

import dataclasses

from whalex.balance.cost import BalanceReport
from whalex.balance.refine import Refinement
from whalex.jaxpr.compiled import compile_step, lower_step
from whalex.jaxpr.hlo import HostCopies, StepCollectives, host_copies, step_collectives
from whalex.memory import fit
from whalex.memory.accounting import DeviceMemory
from whalex.memory.host_link import HostTraffic, host_traffic
from whalex.memory.peak import Peak, compiled_peak
from whalex.mesh.cluster import Cluster
from whalex.mesh.virtual import MeshLayout, VirtualDevice
from whalex.primitives.config import Config
from whalex.records.comm import Comm
from whalex.records.lazy import Lazy
from whalex.records.program import ProgramReport, ProgramState, ProgramStep, StepProgram
from whalex.records.schedules import Schedule
from whalex.records.sharding_plan import Coverage, PatternChoice
from whalex.view import html as view_html, sections as view_sections, text as view_text


class CompiledStep:
    """What XLA compiled for a plan's step, kept once found: the one mutable part of a Plan, kept
    apart from its frozen fields. Compiling is deterministic, so this is a memo of facts, never a
    decision: the api fills it on the step's first call (`keep_step`), `plan.step_memory()`,
    `plan.compiled_collectives()` and `plan.compiled_memory()` when first asked, and the summary
    shows what it holds."""

    __slots__ = ("memory", "step", "step_memory", "collectives", "host_copies")

    def __init__(self) -> None:
        self.memory: dict | None = None                   # compiled_memory(): the step, state not donated
        self.step = False                                 # the step as it runs has been compiled
        self.step_memory: Peak | None = None              # its memory analysis (None: the backend has none)
        self.collectives: StepCollectives | None = None   # its collectives (found by compiling here only)
        self.host_copies: HostCopies | None = None        # its transfers to and from host memory (likewise)

    def keep_step(self, memory_analysis) -> None:
        """Keep XLA's memory analysis of the step as it runs (None where a backend has none)."""
        self.step_memory = compiled_peak(memory_analysis) if memory_analysis is not None else None
        self.step = True


def _no_couplings() -> Lazy[tuple[str, ...]]:
    return Lazy.of(())


def _no_peak() -> Lazy[Peak | None]:
    return Lazy.of(None)


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

    It carries the step program the planner built (`program`, a `whalex.records.program.StepProgram`)
    and hands it out by reader, each part typed by its protocol: `storage` (the state's layout and
    placement), `functions` (the step's functions) and `report` (the records it was built with). The
    api, checkpoints, the view and the benches read those, never `program` itself."""

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
    schedule: Schedule | None = None          # the pipeline schedule, when the plan is a pipeline
    stage_layers: tuple = ()                  # per stage, the names of the layers it holds
    placement: str = ""                       # which plan places the TaskGraphs (stages or shared devices), and why
    balance: BalanceReport | None = None      # the hardware-aware balance, on heterogeneous clusters
    head_balance: BalanceReport | None = None   # the split head's class shards when `balance` is the batch's (hybrid)
    coverage: tuple[Coverage, ...] = ()       # every parameter a split TaskGraph reads, and its layout
    refinement: Refinement | None = None      # the splits Config(hardware_aware="refine") timed, and the one kept
    # the loss contract's lines, and the step's predicted per-device memory (one trace of the step):
    # found when first read
    batch_couplings: Lazy[tuple[str, ...]] = dataclasses.field(default_factory=_no_couplings, repr=False,
                                                                compare=False)
    predicted_peak: Lazy[Peak | None] = dataclasses.field(default_factory=_no_peak, repr=False, compare=False)
    compiled: CompiledStep = dataclasses.field(default_factory=CompiledStep, repr=False, compare=False)

    @property
    def couplings(self) -> tuple[str, ...]:
        """How the plan computes each batch reduction of the loss (the loss contract), one line each."""
        return self.batch_couplings.value

    # -- the step program, by reader ----------------------------------------------------------------
    @property
    def storage(self) -> ProgramState:
        """How the step stores and places the state and the batch: shapes, shardings, the caller's
        layout (`param_view`), fresh, checkpointed and adopted states, the state layout memory reads."""
        return self.program

    @property
    def functions(self) -> ProgramStep:
        """The step's functions: `value_and_grad`, the train and gradient steps, `jitted`, abstract
        arguments, `lower`, the loss contract's pre-pass, the step traced to a jaxpr."""
        return self.program

    @property
    def report(self) -> ProgramReport:
        """The records the program was built with and runs: the loss as captured, mesh, optimizer,
        memory options, precision, remat, the loss contract's parts, experts, a pipeline's buffers,
        the comm_dtype report and the collectives its step runs."""
        return self.program

    @property
    def program_kind(self) -> str:
        """The kind of step program carrying the plan out: Program (GSPMD), UnevenProgram,
        HybridProgram, PipelineProgram."""
        return type(self.program).__name__

    def host_traffic(self) -> tuple[HostTraffic | None, ...]:
        """Per device: what offload moves over its host link a step, and the least time that takes at the
        device kind's host bandwidth (None on a device whose state and activations all stay on it)."""
        r = self.report.remat
        acts = r.offloaded if r is not None and r.offloaded else 0.0
        fetches = 3 if self.params_fetched_per_layer else 1
        return tuple(host_traffic(m, spec, acts, fetches) for m, spec in zip(self.memory, self.cluster.specs))

    @property
    def params_fetched_per_layer(self) -> bool:
        """offload="params": whether each layer fetches its parameters (forward, again for the backward)
        rather than the whole tree coming to the device at the start of the step."""
        return self.storage.fetch_shardings is not None

    # -- the documented conveniences: the step without a Step ---------------------------------------
    def jitted(self, donate: bool = True):
        """The jitted training step (state, batch) -> (state, metrics), the state donated; without an
        optimizer, (params, batch) -> (loss, grads)."""
        return self.functions.jitted(donate)

    def init_state(self, params, model_state=None, rng=None):
        """A fresh `TrainState`: params (copied) placed per the plan, a new optimizer state."""
        return self.storage.init_state(params, model_state, rng)

    def caller_state(self, state) -> dict:
        """`state` in the caller's layout (what a checkpoint holds)."""
        return self.storage.caller_state(state)

    def place_batch(self, batch):
        """The global batch placed for the step (uneven plans lay rows out per device)."""
        return self.storage.place_batch(batch)

    # -- memory -------------------------------------------------------------------------------------
    def memory_fit(self) -> fit.MemoryFit:
        """The per-device footprint from abstract shapes, whether the plan fits, and which of ZeRO,
        remat, bf16 and offload it would need (`whalex.memory.fit`). On a `Cluster.gpu_topology`
        fitting is judged on XLA:GPU's compiled step (compiled once, as `step_memory()`)."""
        n = self.layout.size
        compiled = self.step_memory().total if self.cluster.compile_only else None
        return fit.memory_fit(self.storage.state_layout(), self.report.captured, self.virtual_devices,
                              self.cluster.specs[:n], self.cluster.host_bytes[:n], self.report.experts, compiled)

    # -- lowering ---------------------------------------------------------------------------
    def lowered(self, donate: bool = False):
        """The `jax.stages.Lowered` training step (works on abstract clusters too); `donate=True`: as
        `wh.parallelize` runs it, the state donated."""
        return lower_step(self.functions, self.report.platform) if donate else self.functions.lower()

    def lower(self) -> str:
        """The sharded StableHLO text of one training step."""
        return self.lowered().as_text()

    def compiled_memory(self) -> dict:
        """XLA's per-device memory analysis of the compiled step (needs real devices; kept)."""
        if self.cluster.is_abstract:
            raise ValueError("compiled_memory() needs devices; an abstract cluster can only be lowered. Use "
                             "plan.memory for the planned per-device state, plan on Cluster.detect(), or on "
                             "Cluster.gpu_topology(kinds=...) to compile for XLA:GPU without GPUs.")
        if self.compiled.memory is None:
            m = self.lowered().compile().memory_analysis()
            self.compiled.memory = {k: getattr(m, k) for k in (
                "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                "alias_size_in_bytes", "generated_code_size_in_bytes") if hasattr(m, k)}
        return dict(self.compiled.memory)

    # -- the step's memory: predicted, and XLA's once compiled ------------------------------------
    def predicted_memory(self) -> Peak | None:
        """Predicted per-device memory of the training step as it runs, state donated (a `Peak`:
        arguments, outputs, temporaries, total), from a replay of the step's jaxpr; found when first
        asked (one trace of the step), no compilation, so abstract clusters have it too."""
        return self.predicted_peak.value

    @property
    def compiled_step_memory(self) -> Peak | None:
        """XLA's per-device figures for the training step as `wh.parallelize` runs it (arguments,
        outputs less those written into the donated state, temp), once it has been compiled: by its
        first call, or by `step_memory()`. None before."""
        return self.compiled.step_memory

    def step_memory(self) -> Peak:
        """XLA's per-device figures for the training step as it runs (state donated), compiling it
        if no step has yet (needs real devices, or a `Cluster.gpu_topology` for XLA:GPU's figure)."""
        if not self.compiled.step:
            self._compile_step()
        return self.compiled.step_memory

    @property
    def compiled_step_collectives(self) -> StepCollectives | None:
        """`compiled_collectives()` once the step has been compiled by it or by `step_memory()`; None before."""
        return self.compiled.collectives

    def compiled_collectives(self) -> StepCollectives:
        """The collectives XLA compiled the step to, per device: how many, the bytes each device sends
        per step, and how many run asynchronously with compute scheduled between start and done
        (compiles the step once; needs real devices or a `Cluster.gpu_topology`)."""
        found = self.compiled.collectives
        return found if found is not None else self._compile_step()

    def compiled_host_copies(self) -> HostCopies:
        """The transfers between device and host memory XLA compiled the step to (offload), per device:
        how many, their bytes, and how many have compute scheduled between start and done (compiles
        the step once, as `compiled_collectives()`)."""
        if self.compiled.host_copies is None:
            self._compile_step()
        return self.compiled.host_copies

    def _compile_step(self) -> StepCollectives:
        """Compile the step as it runs and keep XLA's memory analysis, collectives and host copies."""
        if self.cluster.is_abstract and not self.cluster.compile_only:
            raise ValueError("compiling the step needs devices; an abstract cluster can only be lowered: use "
                             "plan.predicted_memory(), plan on Cluster.gpu_topology(kinds=...) to compile for "
                             "XLA:GPU without GPUs, or install JAX's CUDA plugin (pip install 'whalex[cuda]') so "
                             "that an abstract cluster of GPU kinds plans on its XLA:GPU twin.")
        devices = self.cluster.compile_devices
        memory, text = compile_step(self.functions, self.report.platform,
                                    None if devices is None else devices[: self.layout.size])
        self.compiled.keep_step(memory)
        arms = None
        if self.schedule is not None:     # a pipeline's tick: forward or backward, M of each per device
            share = self.config.num_micro_batch / self.schedule.num_ticks
            arms = (share, share)
        found = step_collectives(text, self.layout.size, arms)
        self.compiled.collectives, self.compiled.host_copies = found, host_copies(text)
        return found

    def device_rows(self) -> tuple[tuple[int, int], ...]:
        """The global-batch rows [start, stop) each device trains on in one step."""
        rows = self.storage.row_ranges()
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
