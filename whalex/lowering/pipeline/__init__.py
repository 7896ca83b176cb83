"""Pipeline parallelism in one SPMD program (Whale sections 3.1.2 and 4).

Stages are TaskGraphs in order. The captured loss (traced at micro-batch size) is cut into stages by
the planner (`whalex.planner.stage_cut` gives a `StageCut`); this package carries the cut out, in
modules of one job each:

- `cut`: the `StageCut` record: equations, parameters and boundary values per stage.
- `packing`: values in flat buffers (messages and the stash in the `Message` format, outputs in
  float32) and the gradient accumulator's segments; `tree_switch`, the stage switch as two-way conds.
- `rows`: each stage's parameters as rows (`ParamRows`), and their gradients.
- `storage`: the caller's parameters spread over every device between steps, and the collectives that
  gather them into the rows and scatter the gradients back (`SpreadStorage`).
- `outputs`: the loss contract's part outputs combined over micro-batches and replicas.
- `branches`: each stage's forward and backward as branches of a tick.
- `ticks`: the tick loop, one named function per step of a tick.
- `body`: one device's step inside `shard_map`: stage parameters, pre-pass, loop, reductions.
- `program`: `PipelineProgram`, which composes them and is what the planner builds.

The parameters and the optimizer state are stored in the caller's pytree, each leaf spread over every
device, and the optax update runs there under GSPMD. While computing, a device holds only its stage's
weights (one row of a `[stages, width]` buffer sharded over `stage`) and only the batch leaves its
stage reads (`whalex.lowering.stage_batch`). Inside `shard_map`, a `lax.scan` over the schedule's
ticks runs on every device its stage's forward or backward, then passes activations and gradients to
the neighbouring stages. Gradients are summed over micro-batches in the loop and over replicas after
it. The last stage returns the loss contract's part outputs for each micro-batch
(`whalex.loss.evaluation`), combined by their kind, so loss, aux and gradients equal the whole-batch
ones.
"""
from whalex.lowering.pipeline.axes import DATA, MODEL, STAGE
from whalex.lowering.pipeline.cut import StageCut
from whalex.lowering.pipeline.packing import Slot
from whalex.lowering.pipeline.program import PipelineProgram

__all__ = ["DATA", "MODEL", "STAGE", "PipelineProgram", "Slot", "StageCut"]
