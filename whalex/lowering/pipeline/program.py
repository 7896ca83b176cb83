"""`PipelineProgram`: the pipelined training step, composed from the package's parts.

It holds what the planner decided (the stage cut, the schedule, the mesh, the memory and precision
records) and builds from it the parameter rows (`rows`), their storage (`storage`), the batch layout
(`whalex.lowering.stage_batch`), the part outputs (`outputs`), the stages (`branches`) and the tick
loop (`ticks`, `body`); `Emitter` turns `value_and_grad` into one jitted step.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from whalex import _compat as C
from whalex.jaxpr.capture import Captured
from whalex.loss import evaluation as parts_lib
from whalex.loss.evaluation import PartLoss
from whalex.lowering import stage_batch, stage_rows
from whalex.lowering.emit import Emitter
from whalex.lowering.pipeline.axes import DATA, STAGE
from whalex.lowering.pipeline.body import PipelineBody
from whalex.lowering.pipeline.branches import chunk_split, make_stages
from whalex.lowering.pipeline.cut import StageCut
from whalex.lowering.pipeline.outputs import PartOutputs
from whalex.lowering.pipeline.packing import Message
from whalex.lowering.pipeline.rows import ParamRows
from whalex.lowering.pipeline.storage import SpreadStorage
from whalex.lowering.pipeline.ticks import TickLoop
from whalex.lowering.pipeline.traffic import split_layer_collectives, stage_collectives
from whalex.memory import zero as zero_lib
from whalex.memory.opt_state_specs import opt_state_specs
from whalex.precision.loss_scale import unscale
from whalex.records.comm import Comm
from whalex.records.memory_options import MemoryOptions, Precision
from whalex.records.program import StageBuffers, step_program
from whalex.records.schedules import Schedule


@step_program
@dataclasses.dataclass(frozen=True)
class PipelineProgram(Emitter):
    """The pipelined training step: packed stage parameters, schedule tables and the mesh."""

    captured: Captured           # traced at micro-batch size
    cut: StageCut
    schedule: Schedule
    mesh: Any
    optimizer: optax.GradientTransformation | None
    platform: str
    global_batch: int
    data_parallel: int
    memory: MemoryOptions | None = None     # ZeRO level, offload
    precision: Precision | None = None      # amp, comm_dtype
    remat: None = None           # always None: stages recompute their forward from the stashed input
    parts: PartLoss | None = None           # the loss contract over micro-batches
    model_parallel: int = 1      # split TaskGraphs inside the stages: devices of the `model` mesh axis
    model_dims: tuple = ()       # per parameter leaf: its dimension split over `model` (None: whole)
    constraints: Any = None      # the split layers' sharding constraints ((path, "in"|"out", pos) -> spec)
    model_comms: tuple = ()      # the split layers' collectives over `model` as planned for one micro-batch
    head_comms: tuple = ()       # the loss head's collectives over `model` (its rows split), per step, per stage
    layer_cuts: tuple = ()       # remat="full": the equations where a layer starts, checkpointed in each stage

    # -- the parameter rows (`rows.ParamRows`) -------------------------------------------------
    @property
    def virtual_stages(self) -> int:
        """Model chunks per stage (interleaved schedules; 1: the cut's stages are the stages)."""
        return self.schedule.virtual_stages

    @functools.cached_property
    def device_eqns(self) -> tuple[tuple[int, ...], ...]:
        """The equations each stage (device) runs: those of its chunks."""
        return tuple(tuple(sorted(i for c in self.schedule.chunks_of(d) for i in self.cut.eqns[c]))
                     for d in range(self.schedule.num_stages))

    @functools.cached_property
    def param_rows(self) -> ParamRows:
        zero = self.memory_options.zero_level and self.data_parallel > 1    # ZeRO splits the row over replicas
        invars = self.captured.jaxpr.jaxpr.invars[: self.captured.num_params]
        if self.cut.num_stages != self.schedule.num_chunks:
            raise ValueError(f"a cut into {self.cut.num_stages} chunks for a schedule of {self.schedule.num_chunks}")
        if self.virtual_stages == 1:
            params, counts = self.cut.params, ()
        else:              # a stage's row: its chunks' leaves one chunk after another
            chunks = [self.schedule.chunks_of(d) for d in range(self.schedule.num_stages)]
            params = tuple(tuple(p for c in cs for p in self.cut.params[c]) for cs in chunks)
            counts = tuple(tuple(len(self.cut.params[c]) for c in cs) for cs in chunks)
        return ParamRows(params, tuple(invars), self.model_dims, self.model_parallel, self.data_parallel if zero else 1,
                         counts)

    @property
    def param_dtype(self):
        return self.param_rows.dtype

    @property
    def three_d(self) -> bool:
        """Split TaskGraphs inside the stages: a ('data', 'stage', 'model') mesh."""
        return self.param_rows.three_d

    def model_dim(self, leaf: int):
        return self.param_rows.model_dim(leaf)

    @property
    def param_slots(self):
        return self.param_rows.slots

    @property
    def model_slots(self):
        return self.param_rows.model_slots

    @property
    def param_width(self) -> int:
        return self.param_rows.width

    @property
    def model_width(self) -> int:
        return self.param_rows.model_width

    def unpack_stage(self, s: int, rows):
        return self.param_rows.unpack_stage(s, rows)

    def pack_params(self, params):
        """The caller's parameters in the `[stages, width]` rows, in plain jnp: what `gather_rows`
        computes with explicit collectives inside the step, and its definition (tests compare them)."""
        return self.param_rows.pack(jax.tree.leaves(params))

    def pack_rows(self, params):
        """3D: `pack_params` with the model row (`ParamRows.pack_3d`)."""
        return self.param_rows.pack_3d(jax.tree.leaves(params), self.mesh)

    @functools.cached_property
    def message(self) -> Message:
        """The messages' format: every stage boundary fits one."""
        return Message.of(self.cut.boundaries)

    @property
    def message_width(self) -> int:
        return self.message.width

    @functools.cached_property
    def weight_splits(self) -> tuple:
        """With a split backward (zero bubble), what each chunk's W needs (`weights.WeightSplit`)."""
        if not self.schedule.split_backward:
            return ()
        return tuple(chunk_split(self.captured, self.cut, c) for c in range(self.cut.num_stages))

    @functools.cached_property
    def row_format(self) -> Message | None:
        """The W stash rows' format: every chunk's row fits one (None without a split backward)."""
        return Message.of([s.row_vars for s in self.weight_splits]) if self.weight_splits else None

    # -- the stored parameters (`storage.SpreadStorage`) -----------------------------------------
    @functools.cached_property
    def storage(self) -> SpreadStorage:
        invars = self.captured.jaxpr.jaxpr.invars[: self.captured.num_params]
        shapes = tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars)
        return SpreadStorage(self.param_rows, self.mesh, shapes, self.captured.params_tree, self.data_parallel)

    def param_shapes(self):
        """The stored parameters: the caller's pytree."""
        return jax.tree.unflatten(self.captured.params_tree, list(self.storage.shapes))

    def param_spec_list(self):
        return self.storage.spec_list()

    def gather_rows(self):
        return self.storage.gather()

    def scatter_grads(self):
        return self.storage.scatter()

    def gather_rows_3d(self):
        return self.storage.gather_3d()

    def scatter_grads_3d(self):
        return self.storage.scatter_3d()

    @functools.cached_property
    def param_shardings(self):
        return self._param_named(self.param_spec_list())

    def opt_state_spec_tree(self, param_specs):
        """Parts shaped like the parameters follow `param_specs`; every other leaf (adafactor's factored
        statistics, masked or multi_transform inner states) is spread by its own shape too."""
        specs, shapes = opt_state_specs(self.optimizer, self.param_shapes(), param_specs)
        axes = self.storage.axes
        spread = lambda s, x: stage_rows.spread(x.shape, self.mesh.size, axes) if s == P() else s  # noqa: E731
        return jax.tree.map(spread, specs, shapes, is_leaf=lambda x: isinstance(x, P))

    @functools.cached_property
    def row_specs(self) -> tuple[P, P]:
        """The packed rows' spec, and with ZeRO (levels 2 and 3) the same split over `data` too:
        the stage gradient is reduce-scattered over the replicas, the stage row gathered in the body."""
        opts = self.memory_options
        if opts.zero_level == 0 or opts.zero_axes is None:
            return P(STAGE), P(STAGE)
        shape = (self.schedule.num_stages, self.param_width)
        return P(STAGE), zero_lib.shard_spec(P(STAGE), shape, (DATA,), dict(self.mesh.shape))

    # -- the batch (`whalex.lowering.stage_batch`) -------------------------------------------------
    @functools.cached_property
    def prepass_leaves(self) -> tuple[int, ...]:
        """Batch leaves the loss contract's pre-pass reads (its data-only reductions, e.g. a token count)."""
        jp = self.parts.part.jaxpr.jaxpr
        outs = [o for r in self.parts.sem.reductions if not r.params for o in jp.eqns[r.index].outvars]
        eqns = parts_lib.cone(jp, outs)
        n = self.captured.num_params
        batch = {v: k for k, v in enumerate(jp.invars[n:n + len(self.captured.batch_vars)])}
        return tuple(sorted({batch[v] for i in eqns for v in jp.eqns[i].invars
                             if not isinstance(v, C.Literal) and v in batch}))

    @functools.cached_property
    def batch_layout(self) -> stage_batch.StageBatchLayout:
        """The batch leaves each stage holds: those its equations read; the last stage also runs the
        pre-pass, so it holds the leaves the pre-pass reads."""
        cap = self.captured
        reads = stage_batch.stage_reads(cap.jaxpr.jaxpr, cap.num_params, len(cap.batch_vars), self.device_eqns,
                                        self.prepass_leaves)
        return stage_batch.make_layout(reads, [v.aval for v in cap.batch_vars], self.global_batch)

    @functools.cached_property
    def batch_shardings(self):
        return self.batch_layout.shardings(self.mesh, STAGE, DATA)

    def batch_shapes(self):
        return self.batch_layout.shapes()

    @functools.cached_property
    def _batch_packer(self):
        return jax.jit(self.batch_layout.pack, out_shardings=self.batch_shardings.buffers)

    def place_batch(self, batch):
        """The caller's batch pytree in the stage layout (each stage device: only its leaves)."""
        return stage_batch.place(self.batch_layout, batch, self.batch_shardings, self.captured.batch_tree,
                                 self._batch_packer)

    def stage_buffers(self) -> StageBuffers:
        """The per-device buffers: parameter row and message widths, the batch each device holds."""
        layout, dp, S = self.batch_layout, self.data_parallel, self.schedule.num_stages
        return StageBuffers(self.param_width, self.message_width, self.message.nbytes, layout.device_bytes(dp),
                            layout.whole_bytes(dp), tuple(layout.stage_bytes(s, dp) for s in range(S)),
                            tuple(tuple(sl.leaf for sl in layout.stages[s]) for s in range(S)),
                            self.row_format.nbytes if self.row_format else 0, bool(self.head_comms))

    def collectives(self) -> tuple[Comm, ...]:
        """Per stage, the collectives this step runs: stage rows gathered and scattered, the gradient
        sync over replicas, the messages every tick, the split layers' over `model` (`traffic`), the loss
        head's over `model`."""
        grad_bytes = self.param_width * np.dtype(self.param_dtype).itemsize
        invars = self.captured.jaxpr.jaxpr.invars[: self.captured.num_params]
        rows = stage_collectives(self.schedule, invars, self.memory_options.zero_level, self.data_parallel,
                                 grad_bytes, self.message.nbytes)
        return rows + split_layer_collectives(self.model_comms, self.captured, self.cut.eqns, self.schedule.num_stages,
                                              self.schedule.num_micro_batch) + tuple(self.head_comms)

    # -- the part outputs (`outputs.PartOutputs`) ------------------------------------------------
    @functools.cached_property
    def part_outputs(self) -> PartOutputs:
        kinds = tuple(k or "sum" for k in self.parts.part_outputs()[1])
        return PartOutputs(tuple(self.captured.jaxpr.jaxpr.outvars), kinds)

    @property
    def row_outputs(self) -> tuple[int, ...]:
        """Part outputs (positions) with the batch dimension: per-example aux, gathered by rows."""
        return self.part_outputs.rows

    # -- the step ------------------------------------------------------------------------------
    def body(self) -> PipelineBody:
        """One device's step (`body.PipelineBody`), with the schedule's tables as arrays."""
        S, M, dp = self.schedule.num_stages, self.schedule.num_micro_batch, self.data_parallel
        tables = {k: jnp.asarray(v) for k, v in self.schedule.tables().items()}
        loop = TickLoop(S, M, self.schedule.stash[0], self.schedule.grad_stash[0], self.message,
                        self.part_outputs, tables, self.virtual_stages, self.schedule.weight_stash[0], self.row_format)
        stages = make_stages(self.captured, self.cut, self.constraints, self.param_rows, self.part_outputs,
                             self.batch_layout, self.message, S, self.layer_cuts, self.weight_splits)
        n = self.captured.num_params
        return PipelineBody(loop, stages, self.param_rows, self.parts, n,
                            tuple(v.aval for v in self.captured.jaxpr.jaxpr.invars[:n]),
                            tuple(v.aval for v in self.captured.batch_vars), self.batch_layout,
                            self.global_batch // (dp * M), self.global_batch // dp, self.memory_options.zero_level,
                            self.row_specs, self.precision)

    def loss_and_grads(self):
        """(stage rows, stage batch, extra[, loss scale]) -> (the loss's outputs, the stage gradient rows
        summed over the replicas): `body` in a `shard_map`, `stage` and `data` manual."""
        level, zspec = self.memory_options.zero_level, self.row_specs[1]
        rows_in = {"stages": zspec if level >= 3 else P(STAGE)}
        rows_out = {"stages": zspec if level >= 2 else P(STAGE)}
        manual = {}
        if self.three_d:              # `model` stays an auto axis: GSPMD shards the split layers inside a stage
            rows_in["model"] = rows_out["model"] = P(STAGE)
            manual = {"axis_names": frozenset({STAGE, DATA})}
        scaled = self.precision is not None and self.precision.scaled
        in_specs = (rows_in, self.batch_layout.specs(STAGE, DATA), P()) + ((P(),) if scaled else ())
        return jax.shard_map(self.body().step, mesh=self.mesh, in_specs=in_specs, out_specs=(P(), rows_out),
                             check_vma=False, **manual)

    # -- what the emitter needs -------------------------------------------------------------------
    @property
    def has_aux(self) -> bool:
        return self.parts.whole.has_aux

    def value_and_grad(self):
        loss_and_grads = self.loss_and_grads()
        cap = self.parts.whole
        if self.three_d:
            gather, scatter = self.gather_rows_3d(), self.scatter_grads_3d()
        else:
            gather, scatter = self.gather_rows(), self.scatter_grads()

        def vg(params, batch, extra=(), scale=None):
            args = (gather(params), batch.buffers, list(extra)) + ((scale,) if scale is not None else ())
            outs, grad_rows = loss_and_grads(*args)
            grads = scatter(grad_rows)
            if scale is not None:
                grads = unscale(grads, scale)
            value, aux, new_state = cap.split_outputs(outs)
            return (value, aux, new_state), grads

        return vg
