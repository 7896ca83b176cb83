"""The stages as branches of a tick: each stage's forward and backward on flat messages, and the idle
branch of a tick with no work.

A forward maps (stage params, stage input, inputs) to (message out, part outputs, per-example outputs);
a backward recomputes the forward from the stashed stage input and maps (gradient rows, stage params,
stage input, output cotangent, inputs) to (message back, gradient rows plus this micro-batch's). The
last stage's backward starts from the cotangent vector of the part outputs (dH/dR, times the loss
scale) instead of a message. `inputs` is (this micro-batch's batch rows, extra leaves, micro-batch).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from whalex import _compat as C
from whalex.jaxpr.capture import Captured
from whalex.jaxpr.interpret import apply_eqn, call_prefixes
from whalex.jaxpr.segments import run_edges
from whalex.lowering.pipeline.cut import StageCut
from whalex.lowering.pipeline.outputs import PartOutputs
from whalex.lowering.pipeline.packing import Message, Slot, from_entries, layout, pack_values, to_entries, unpack
from whalex.lowering.pipeline.rows import ParamRows
from whalex.lowering.pipeline.weights import WeightSplit, weight_grads, weight_split
from whalex.lowering.stage_batch import StageBatchLayout
from whalex.memory.remat import in_order


class ChunkContext(NamedTuple):
    """What a chunk's forward and its W read of the captured loss: its constants, its parameters'
    Vars, the loss's batch Vars, the 3D constraints and their paths."""

    consts: dict
    param_vars: list
    input_vars: list
    constraints: dict
    cpaths: list


def chunk_context(cap: Captured, cut: StageCut, s: int, constraints=None) -> ChunkContext:
    """Chunk `s`'s `ChunkContext`."""
    jaxpr = cap.jaxpr.jaxpr
    constraints = dict(constraints or {})
    return ChunkContext(dict(zip(jaxpr.constvars, cap.jaxpr.consts)), [jaxpr.invars[p] for p in cut.params[s]],
                        list(jaxpr.invars[cap.num_params:]), constraints, [c[0] for c in constraints])


def stage_fn(cap: Captured, cut: StageCut, s: int, constraints=None, layer_cuts: Sequence[int] = (),
             keep: Sequence = ()):
    """f_s(params_s leaves, live_in values, (batch leaves, extra leaves), overrides, taps) -> live_out
    values (the last stage: the part outputs of the loss contract), then, given taps, the values of `keep`; with
    `live_in` and `live_out`. `taps` ({var: value}) are added to those values where they are made
    (zeros, differentiated: a split backward's B reads their cotangents). `layer_cuts` (remat="full"):
    the equations where a layer starts; each layer of the stage then runs under `jax.checkpoint`, in
    order, so that the stage's backward, which recomputes its forward, holds one layer's residuals at a
    time rather than the whole stage's."""
    jaxpr = cap.jaxpr.jaxpr
    consts, param_vars, input_vars, constraints, cpaths = chunk_context(cap, cut, s, constraints)
    live_in, live_out = cut.live_in(s), cut.live_out(s, jaxpr.outvars)
    wanted = list(live_out) + list(keep)
    runs = layer_runs([(i, jaxpr.eqns[i]) for i in cut.eqns[s]], layer_cuts, wanted)

    def fn(params_s, live, inputs, overrides, taps=None):
        if constraints:     # 3D: the message and the batch rows arrive whole on each model device
            live, inputs = whole(live), whole(inputs)
        env = dict(consts)
        env.update(zip(param_vars, params_s))
        env.update((v, x) for v, x in zip(input_vars, inputs) if x is not None)
        env.update(zip(live_in, live))
        prefixes = call_prefixes(list(overrides) + cpaths)

        def run(eqns, reads, writes, tapped, values, added):
            local = dict(zip(reads, values))
            extra = dict(zip(tapped, added))
            for i, eqn in eqns:
                outs = apply_eqn(eqn, (i,), [C.read(local, v) for v in eqn.invars], overrides, prefixes, constraints)
                local.update((v, x + extra[v] if v in extra else x) for v, x in zip(eqn.outvars, outs))
            return [local[v] for v in writes]

        for r in runs:
            tapped = [v for _, e in r.eqns for v in e.outvars if taps and v in taps]
            body = functools.partial(run, r.eqns, r.reads, r.writes, tapped)
            if r.checkpointed:
                body = in_order(jax.checkpoint(body))
            env.update(zip(r.writes, body([env[v] for v in r.reads], [taps[v] for v in tapped])))
        return [C.read(env, v) for v in (wanted if taps is not None else live_out)]

    return fn, live_in, live_out


def weight_fn(cap: Captured, cut: StageCut, s: int, split: WeightSplit, constraints=None):
    """W of chunk s: (params_s leaves, the W stash row's values, overrides, (batch leaves, extra leaves))
    -> the parameters' gradient."""
    consts, param_vars, input_vars, constraints, cpaths = chunk_context(cap, cut, s, constraints)
    indices = list(cut.eqns[s])
    eqns = [cap.jaxpr.jaxpr.eqns[i] for i in indices]
    where = {v: k for k, v in enumerate(input_vars)}

    def fn(params_s, row, overrides, inputs):
        reread = [inputs[where[v]] for v in split.reread]
        if constraints:     # 3D: the row's values are whole on each model device, as the message
            row, reread = whole(row), whole(reread)
        prefixes = call_prefixes(list(overrides) + cpaths)

        def apply(eqn, i, invals):
            return apply_eqn(eqn, (i,), invals, overrides, prefixes, constraints)

        return weight_grads(split, eqns, indices, apply, param_vars, consts, params_s, row, reread)

    return fn


def whole(values: Sequence) -> list:
    """`values` pinned whole over the mesh axes left to GSPMD: sliced from the flat message or batch
    buffer, they are whole there, and a sharding GSPMD carries back from a later constraint would slice
    the buffer across devices (a collective-permute inside a stage's branch, which the other stages
    never reach)."""
    return [jax.lax.with_sharding_constraint(x, P()) if x is not None else None for x in values]


class Run(NamedTuple):
    """A run of a stage's equations evaluated as one function: the values it reads from before it, the
    values it defines that later runs or the stage's outputs read, and whether it is a checkpointed layer."""

    eqns: list
    reads: list
    writes: list
    checkpointed: bool


def layer_runs(eqns: list, layer_cuts: Sequence[int], live_out: Sequence) -> list[Run]:
    """The stage's equations `[(index, eqn)]` cut before each of `layer_cuts` into runs (one run, not
    checkpointed, without cuts; with them, every run checkpointed)."""
    cuts = set(layer_cuts)
    groups: list[list] = []
    for i, eqn in eqns:
        if not groups or (i in cuts and groups[-1]):
            groups.append([])
        groups[-1].append((i, eqn))
    edges = run_edges([[e for _, e in group] for group in groups], live_out)
    return [Run(group, reads, writes, bool(cuts)) for group, (reads, writes) in zip(groups, edges)]


@dataclasses.dataclass(frozen=True)
class Stage:
    """Model chunk `index` (the stage itself without interleaving) as branches of the tick's switch.
    The stage (device) `device` holds it as its chunk `slot`: a block of the stage's parameter row, and
    a backward adds into that block of the gradient accumulator."""

    index: int
    fn: Callable                    # `stage_fn`
    in_slots: tuple[Slot, ...]      # its input message
    out_slots: tuple[Slot, ...]     # its output message (not the last chunk)
    last: bool
    rows: ParamRows
    outputs: PartOutputs
    batch: StageBatchLayout
    message: Message                # the messages' format
    slot: int = 0                   # its place among its device's chunks
    device: int = 0                 # the stage holding it (whose batch leaves it reads)
    split: WeightSplit | None = None    # a split backward (B, then W): what W needs
    weight: Callable | None = None      # `weight_fn`
    eager: Callable | None = None       # `weight_fn` of the weight equations B differentiates itself
    row: tuple[Slot, ...] = ()          # its W stash row's slots

    def stage_inputs(self, inputs) -> list:
        """This stage's batch leaves (None: not held), then the extra leaves."""
        return self.batch.unpack(inputs[0], self.device) + list(inputs[1])

    def forward(self, overrides: Callable, params, x, inputs):
        """(message out, part outputs, per-example outputs) of one micro-batch."""
        outs = self.fn(self.rows.unpack_chunk(self.device, self.slot, params), unpack(x, self.in_slots),
                       self.stage_inputs(inputs), overrides(inputs[2]))
        _, O = self.outputs.slots
        if self.last:
            return self.message.zeros(), pack_values([outs[k] for k in self.outputs.values], O), \
                [outs[k] for k in self.outputs.rows]
        return self.message.pack(outs), jnp.zeros(O, jnp.float32), self.outputs.no_rows()

    def _recompute(self, overrides: Callable, x, inputs, taps=None):
        """(the differentiable part of the stage input, f(dl) -> (the outputs the backward starts from,
        the saved activations of a split backward), their placement back into a message)."""
        live = unpack(x, self.in_slots)
        diff = [k for k, sl in enumerate(self.in_slots) if jnp.issubdtype(sl.dtype, jnp.floating)]
        ovr, ins, values = overrides(inputs[2]), self.stage_inputs(inputs), self.outputs.values

        def f(p, dl, added=()):
            full = list(live)
            for k, v in zip(diff, dl):
                full[k] = v
            outs = self.fn(p, full, ins, ovr, dict(zip(taps or (), added)))
            main = outs[:len(outs) - len(self.split.keep)] if taps is not None else outs
            return ([main[k] for k in values] if self.last else main), outs[len(main):]

        def message_back(dl):
            full = [jnp.zeros(sl.shape, jnp.float32) for sl in self.in_slots]
            for k, g in zip(diff, dl):
                full[k] = g
            return self.message.pack(full)

        return [live[k] for k in diff], f, message_back

    def _cotangents(self, cot, ct, outs) -> list:
        cts = unpack(cot, self.outputs.slots[0]) if self.last else unpack(ct, self.out_slots)
        return [c.astype(o.dtype) if jnp.issubdtype(o.dtype, jnp.floating)
                else np.zeros(o.shape, jax.dtypes.float0) for c, o in zip(cts, outs)]

    def backward(self, overrides: Callable, cot, gacc, params, x, ct, inputs):
        """(message back, `gacc` plus this micro-batch's gradient rows), the forward recomputed from `x`."""
        dl0, f, message_back = self._recompute(overrides, x, inputs)
        p = self.rows.unpack_chunk(self.device, self.slot, params)
        outs, vjp = jax.vjp(lambda p, dl: f(p, dl)[0], p, dl0)
        dp, dl = vjp(self._cotangents(cot, ct, outs))
        return message_back(dl), self.rows.add_chunk_grads(self.device, self.slot, gacc, dp)

    def backward_input(self, overrides: Callable, cot, rows, wslot, params, x, ct, inputs):
        """B of a split backward: (message back, the W stash `rows` with this micro-batch's row written
        into slot `wslot`: the saved activations, the tapped cotangents and the eager equations'
        parameter gradients), the forward recomputed from `x`."""
        split = self.split
        dl0, f, message_back = self._recompute(overrides, x, inputs, split.all_taps)
        p = self.rows.unpack_chunk(self.device, self.slot, params)
        zeros = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in split.all_taps]
        outs, vjp, saved = jax.vjp(lambda dl, added: f(p, dl, added), dl0, zeros, has_aux=True)
        dl, dtaps = vjp(self._cotangents(cot, ct, outs))
        row, eager_row = split.sort_b(saved, dtaps)
        if self.eager is not None:
            dp = self.eager(p, eager_row, overrides(inputs[2]), self.stage_inputs(inputs))
            row += [dp[i] for i in split.eager_params]
        return message_back(dl), write_row(rows, wslot, self.row, whole(row) if self.rows.three_d else row)

    def weight_gradient(self, overrides: Callable, gacc, params, rows, wslot, inputs):
        """W of a split backward: `gacc` plus the weight gradient from slot `wslot` of the W stash."""
        p = self.rows.unpack_chunk(self.device, self.slot, params)
        values = read_row(rows, wslot, self.row)
        dp = list(self.weight(p, values, overrides(inputs[2]), self.stage_inputs(inputs)))
        for i, g in zip(self.split.eager_params, self.split.row_parts(values)[2]):     # B's, of the eager equations
            dp[i] = dp[i] + g.astype(dp[i].dtype)
        return self.rows.add_chunk_grads(self.device, self.slot, gacc, dp)


def write_row(rows, wslot, slots: Sequence[Slot], values):
    """The W stash `rows` with `values` written at their `slots` of row `wslot`, each in place: a chunk
    writes only its own entries (a row packed to the stash's width, as wide as the widest chunk's, was
    a second copy of it, padding included, on every B)."""
    for sl, v in zip(slots, values):
        entries = to_entries(jnp.asarray(v), rows.dtype).reshape(1, sl.size)
        rows = jax.lax.dynamic_update_slice(rows, entries, (wslot, sl.offset))
    return rows


def read_row(rows, wslot, slots: Sequence[Slot]) -> list:
    """The values at `slots` of row `wslot` of the W stash, each sliced on its own (no copy of the row)."""
    return [from_entries(jax.lax.dynamic_slice(rows, (wslot, sl.offset), (1, sl.size)).reshape(sl.shape), sl.dtype)
            for sl in slots]


def idle(message: Message, outputs: PartOutputs, params, x, inputs):
    """The forward branch of a tick with no work: zeros shaped like a forward's results."""
    return message.zeros(), jnp.zeros(outputs.slots[1], jnp.float32), outputs.no_rows()


def chunk_split(cap: Captured, cut: StageCut, c: int) -> WeightSplit:
    """What a split backward's W needs of chunk c (`weights.weight_split`)."""
    jaxpr = cap.jaxpr.jaxpr
    return weight_split([jaxpr.eqns[i] for i in cut.eqns[c]], [jaxpr.invars[p] for p in cut.params[c]],
                        jaxpr.constvars, cut.live_out(c, jaxpr.outvars), jaxpr.invars[cap.num_params:])


def make_stages(cap: Captured, cut: StageCut, constraints: Any, rows: ParamRows, outputs: PartOutputs,
                batch: StageBatchLayout, message: Message, num_stages: int | None = None,
                layer_cuts: Sequence[int] = (), splits: Sequence[WeightSplit] = ()) -> tuple[Stage, ...]:
    """Every chunk of `cut` as a `Stage`: on `num_stages` stages (default: one chunk each), chunk c on
    stage c % S as its chunk c // S; `layer_cuts`: see `stage_fn`; `splits` (one per chunk, for a split
    backward): what its W needs, each chunk's values at their own slots of a W stash row."""
    K = cut.num_stages
    S = num_stages or K
    stages = []
    for c in range(K):
        split = splits[c] if splits else None
        fn, live_in, live_out = stage_fn(cap, cut, c, constraints, layer_cuts, split.keep if split else ())
        weight = eager = None
        if split is not None:
            weight = weight_fn(cap, cut, c, split, constraints)
            eager = None if split.eager is None else weight_fn(cap, cut, c, split.eager, constraints)
        stages.append(Stage(c, fn, tuple(layout(live_in)[0]), tuple(layout(live_out)[0]), c == K - 1,
                            rows, outputs, batch, message, c // S, c % S, split=split, weight=weight, eager=eager,
                            row=tuple(layout(split.row_vars)[0]) if split else ()))
    return tuple(stages)


class Branches(NamedTuple):
    """What a tick may run on a device, for `packing.tree_switch`."""

    forward: list           # forward 0 is idle, forward 1 + c is chunk c's
    backward: list          # chunk c's backward (with a split backward, its B)
    zero_message: Any       # the message a branch that sends none returns
    zero_outputs: Any       # the part outputs a branch that computes none returns
    weight: list = []       # with a split backward: chunk c's W


def branches(stages, overrides: Callable, cot) -> Branches:
    """The branches of one step. `overrides(m)`: the loss contract's overrides of micro-batch m; `cot`:
    the cotangent vector of the part outputs."""
    first = stages[0]
    fwds = [functools.partial(idle, first.message, first.outputs)]
    fwds += [functools.partial(st.forward, overrides) for st in stages]
    zero_outputs = jnp.zeros(first.outputs.slots[1], jnp.float32)
    if first.split is None:
        bwds = [functools.partial(st.backward, overrides, cot) for st in stages]
        return Branches(fwds, bwds, first.message.zeros(), zero_outputs)
    bwds = [functools.partial(st.backward_input, overrides, cot) for st in stages]
    wgts = [functools.partial(st.weight_gradient, overrides) for st in stages]
    return Branches(fwds, bwds, first.message.zeros(), zero_outputs, wgts)
