"""The step program's contract, and the plain records it hands to the layers below lowering.

A step program is what lowering builds from the planner's decisions and a `Plan` carries. Its
contract is split by who reads it: `ProgramState` (the parameters and batch with their shardings,
the state in its storage layout and in the caller's: the api and checkpoints), `ProgramStep` (the
loss-and-gradient function and the one jitted training step around it: the api, lowering, timing)
and `ProgramReport` (the records it was built with and the collectives its step runs: the Plan's
views, and the planner, which reads those collectives as its predicted traffic rather than deriving
them again). `StepProgram` is all three. Every program class (`whalex.lowering.step.Program`,
`uneven`, `uneven_hybrid`, `pipeline.program`) is declared with `@step_program`, which holds it to
`StepProgram`: statically (the decorator's parameter is typed with the protocol) and when its
module is imported (every member present). The planner, the Plan and the api read programs only
through this contract; the Plan hands out each part typed by its protocol.

Memory and balance never receive a program: the planner hands them records made from it,
`StateLayout` (the stored state's shapes, specs, optimizer and memory options) and `TracedStep`
(one step traced to a jaxpr with its abstract arguments), so nothing below lowering calls back up.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from jax.sharding import PartitionSpec as P

from whalex.records.comm import Comm
from whalex.records.memory_options import MemoryOptions, Precision, RematPlan
from whalex.records.sharding_plan import ExpertCall
from whalex.state import ParamView, TrainState

if TYPE_CHECKING:                 # types only: the record layer sits below the jaxpr and loss layers
    from whalex.jaxpr.capture import Captured
    from whalex.loss.evaluation import PartLoss


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """The training state as a program stores it, as plain data: what `whalex.memory` accounts
    and `whalex.memory.fit` sizes (never the program itself)."""

    param_shapes: Any                  # pytree of ShapeDtypeStructs: the stored parameters
    param_specs: tuple[P, ...]         # per stored leaf: its planned PartitionSpec
    zero_specs: tuple[P, ...]          # per stored leaf: that spec sharded over its data-parallel axes by ZeRO
    optimizer: Any                     # optax.GradientTransformation, or None (a loss-and-gradient plan)
    memory: MemoryOptions
    axis_sizes: dict                   # mesh axis name -> devices
    platform: str


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """One training step traced, as plain data: the closed jaxpr of the step `wh.parallelize`
    runs, the abstract arguments it was traced at (ShapeDtypeStructs with shardings), how many
    leading argument leaves are donated and written back as its first outputs, the mesh axis
    sizes and the platform (what `whalex.memory.peak.traced_peak` replays)."""

    jaxpr: Any                         # jax.extend.core.ClosedJaxpr
    args: tuple
    donated: int
    axis_sizes: dict
    platform: str


@dataclasses.dataclass(frozen=True)
class StageBuffers:
    """A pipeline's per-device buffers (what the benches report beside XLA's figures)."""

    param_width: int                              # elements of one stage's parameter row
    message_width: int                            # elements of one message between stages
    message_bytes: int                            # bytes of one message (its dtype's width)
    batch_bytes: int                              # the batch a device holds: its stage's leaves
    whole_batch_bytes: int                        # the replica's whole batch, for comparison
    stage_batch_bytes: tuple[int, ...]            # per stage: the batch bytes it reads
    stage_batch_leaves: tuple[tuple[int, ...], ...]   # per stage: the batch leaves it holds
    weight_row_bytes: int = 0                     # a split backward's W stash row (0: not split)
    head_rows_split: bool = False                 # a 3D pipeline's loss head runs its rows split over `model`


@runtime_checkable
class ProgramState(Protocol):
    """How a program stores and places the state and the batch: what the api, checkpoints and the
    memory accounting read."""

    # -- the parameters --------------------------------------------------------------------------
    def param_shapes(self) -> Any: ...                   # ShapeDtypeStructs of the stored parameters
    def param_spec_list(self) -> list: ...               # per stored leaf: its PartitionSpec
    def zero_specs(self) -> list: ...                    # the same, sharded by ZeRO
    @property
    def param_shardings(self) -> Any: ...
    @property
    def param_view(self) -> ParamView | None: ...       # the caller's pytree over a storage layout of its own
    @property
    def fetch_shardings(self) -> tuple | None: ...      # offload="params" per layer; None: fetched whole

    # -- the batch -------------------------------------------------------------------------------
    @property
    def batch_shardings(self) -> Any: ...
    def batch_shapes(self) -> Any: ...                   # ShapeDtypeStructs of the batch the step takes
    def place_batch(self, batch) -> Any: ...             # the caller's global batch in that layout
    def row_ranges(self) -> tuple[tuple[int, int], ...] | None: ...   # per device [start, stop); None: even

    # -- the state -------------------------------------------------------------------------------
    def init_state(self, params, model_state=None, rng=None) -> TrainState: ...
    def caller_state(self, state: TrainState) -> dict: ...
    def caller_targets(self, model_state=None, rng=None) -> dict: ...
    def place_caller_state(self, tree: dict, rng=None) -> TrainState: ...
    def holds(self, state: TrainState) -> bool: ...        # stored as this program stores it
    def adopt_state(self, state: TrainState) -> TrainState: ...   # another plan's state, re-laid out
    def state_layout(self) -> StateLayout: ...           # the stored state as a plain record, for memory


@runtime_checkable
class ProgramStep(Protocol):
    """The step's functions: what the api runs and what is lowered, traced and timed."""

    # (params, batch, extra[, scale]) -> ((loss, aux, state), grads)
    def value_and_grad(self) -> Callable: ...
    def train_step(self) -> Callable: ...                # (state, batch) -> (state, metrics)
    def grad_step(self) -> Callable: ...                 # (params, batch) -> (loss, grads): no optimizer
    def jitted(self, donate: bool = True) -> Any: ...    # the jitted step with the plan's shardings
    def abstract_args(self) -> tuple: ...                # ShapeDtypeStructs with shardings of its arguments
    def lower(self) -> Any: ...                          # jax.stages.Lowered, state not donated
    def prepass(self) -> tuple[Callable, Callable]: ...  # the loss contract's pre-pass alone, and a null program
    def traced_step(self) -> TracedStep: ...             # the step traced to a jaxpr, for memory's replay


@runtime_checkable
class ProgramReport(Protocol):
    """What the program was built with and what it runs, as records: what the Plan's views, its
    summary and the planner's traffic prediction read."""

    @property
    def captured(self) -> Captured: ...                  # the loss as traced (at the size the program runs)
    @property
    def mesh(self) -> Any: ...                           # jax.sharding.Mesh or AbstractMesh
    @property
    def optimizer(self) -> Any: ...                      # optax.GradientTransformation | None
    @property
    def platform(self) -> str: ...
    @property
    def memory_options(self) -> MemoryOptions: ...       # ZeRO level, offload
    @property
    def precision(self) -> Precision | None: ...        # amp, comm_dtype, loss scaling
    @property
    def remat(self) -> RematPlan | None: ...            # remat per TaskGraph and layer, activation offload
    @property
    def parts(self) -> PartLoss | None: ...             # the loss contract over parts of the batch
    @property
    def experts(self) -> tuple[ExpertCall, ...]: ...    # MoE calls run expert-parallel
    @property
    def has_aux(self) -> bool: ...
    def stage_buffers(self) -> StageBuffers | None: ...  # a pipeline's buffers; None for other programs
    def comm_report(self) -> dict | None: ...            # comm_dtype: per TaskGraph (axes, why not); None: none
    # the collectives one step runs as the program lowers it, per device: the GSPMD program's sharding
    # patterns over its micro-batch loop and ZeRO, a pipeline's stage rows, replica sync and messages;
    # () where the program reports none (the planner's prediction stands)
    def collectives(self) -> tuple[Comm, ...]: ...


@runtime_checkable
class StepProgram(ProgramState, ProgramStep, ProgramReport, Protocol):
    """A step program: its state layout and placement, its step functions and its reports. A Plan
    holds one and hands out each part typed by its reader (`plan.storage`, `plan.functions`,
    `plan.report`)."""


PARTS = (ProgramState, ProgramStep, ProgramReport)
MEMBERS = tuple(sorted({name for part in PARTS for name in vars(part) if not name.startswith("_")}))

_Program = TypeVar("_Program", bound=StepProgram)


def step_program(cls: type[_Program]) -> type[_Program]:
    """Declare `cls` a step program: the type checker holds it to `StepProgram` (the parameter's
    type), and a member it lacks is a TypeError when its module is imported."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    missing = [m for m in MEMBERS if m not in fields and not hasattr(cls, m)]
    if missing:
        raise TypeError(f"{cls.__name__} is declared a step program but lacks {missing} (whalex.records.program)")
    return cls
