"""The tick loop: one `lax.scan` over the schedule's ticks, the same program on every device.

Each tick a device reads its row of the schedule's tables (`Schedule.tables`): whether it runs a
forward (1), a backward (2) or nothing (0), on which micro-batch and model chunk (its stage without
interleaving), which stash slots it reads, and into which slots the messages that arrived last tick
go. Only chunk inputs are stashed (`Schedule.stash`: S slots for 1F1B, M for GPipe); a backward
recomputes its chunk's forward from the stashed input. A chunk's output for the next stage and its
input gradient for the previous one wait in the device's outbox (one per direction; one for both at
2 stages, where one swap carries the messages and a device holds one at a time) until the tick the
schedule sends them (`Schedule.sends`: the latest that still delivers them, so that messages made
at different ticks share one exchange); then they go by `ppermute`, around a ring with interleaved
chunks (the last stage sends to the first). A tick at whose end no message moves (the tables' send_f
and send_b, alike on every device) skips its exchange: the collective sits in a conditional every
device takes the same way; no collective runs inside a branch a device chooses by its own task.
With a split backward (zero bubble) a B also writes what its W needs into a row of the W stash, and
a W (kind 3) reads it and adds the weight gradient. The steps of a tick, in order:
`iteration_inputs`, `run_one_tick`, `accumulate_outputs`, `fill_outbox`, `pass_messages`; `tick`
composes them and `run` scans it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from whalex.lowering.pipeline.axes import STAGE
from whalex.lowering.pipeline.branches import Branches
from whalex.lowering.pipeline.outputs import PartOutputs
from whalex.lowering.pipeline.packing import Message, tree_switch


class LoopState(NamedTuple):
    """What a device carries from one tick to the next."""

    stash: Any         # [slots, width]: chunk inputs received
    grad_stash: Any    # [grad_slots, width]: output gradients received
    grads: tuple       # the gradient accumulator: its rows as segments (`ParamRows.zero_rows`)
    outputs: Any       # the batch-free part outputs combined over micro-batches (the last stage's)
    rows: list         # per-example part outputs, [per_replica, ...] each (the last stage's)
    fwd_in: Any        # [width]: the message that arrived from the previous stage
    bwd_in: Any        # [width]: the gradient that arrived from the next stage
    weight_stash: Any  # [weight_slots, width]: what a split backward's B left for its W (() without)
    outbox: tuple      # [width] each: the messages waiting to leave (forward, back; one for both at 2 stages)


class Task(NamedTuple):
    """A device's work this tick, as its row of the schedule's tables gives it (traced scalars)."""

    kind: Any     # 0 nothing, 1 a forward, 2 a backward (B when split), 3 a split backward's W
    chunk: Any    # the model chunk it runs (its stage without interleaving)
    slot: Any     # the forward stash slot it reads its input message from
    gslot: Any    # the gradient stash slot it reads its output cotangent from
    wslot: Any    # the W stash slot its B writes and its W reads


@dataclasses.dataclass(frozen=True)
class Device:
    """One device inside the step: its place, its stage's parameter rows and its rows of the batch."""

    stage: Any          # its stage index (traced: `axis_index('stage')`)
    replica: Any        # its replica index (traced: `axis_index('data')`)
    params: tuple       # its stage's rows (with its chunks' leaves): flat, and in 3D the model row
    batch: dict         # its rows of the stage batch buffers: {group: [per_replica, width]}
    extra: list         # the loss's inputs after the batch (model state, a key)
    micro: int          # rows per micro-batch
    per_replica: int    # rows per replica

    def micro_rows(self, m) -> dict:
        """Micro-batch m's rows of this device's batch buffers."""
        return {g: jax.lax.dynamic_slice_in_dim(x, m * self.micro, self.micro, 0) for g, x in self.batch.items()}

    def where(self, m) -> tuple:
        """Micro-batch m's rows of the global batch, for the loss contract's whole-batch draws."""
        return ((self.replica * self.per_replica + m * self.micro, self.micro),)


@dataclasses.dataclass(frozen=True)
class TickLoop:
    """The schedule as a scan: its tables and the buffers a tick reads and writes."""

    num_stages: int
    num_micro: int
    slots: int              # forward stash slots
    grad_slots: int         # gradient stash slots
    message: Message        # the messages' format
    outputs: PartOutputs
    tables: dict            # the schedule's tables as arrays, [ticks, stages] each
    virtual_stages: int = 1  # model chunks per stage
    weight_slots: int = 0    # a split backward's W stash slots (0: the backward is not split)
    row_format: Message | None = None   # the W stash rows' format

    @property
    def num_chunks(self) -> int:
        return self.num_stages * self.virtual_stages

    def init_state(self, device: Device, zero_grads: Callable) -> LoopState:
        """Empty stashes, accumulators and messages."""
        msg = self.message
        wstash = self.row_format.zeros(self.weight_slots) if self.weight_slots else ()
        return LoopState(msg.zeros(self.slots), msg.zeros(self.grad_slots),
                         zero_grads(), self.outputs.init(),
                         [jnp.zeros((device.per_replica,) + a.shape[1:], a.dtype) for a in self.outputs.row_avals],
                         msg.zeros(), msg.zeros(), wstash,
                         (msg.zeros(),) if self.num_stages == 2 else (msg.zeros(), msg.zeros()))

    def iteration_inputs(self, state: LoopState, row: dict, device: Device):
        """This tick's work: the messages of last tick stashed, then (state, task, micro-batch, inputs)."""
        s = device.stage
        kind, m = row["kind"][s], row["mb"][s]
        rf, rb = row["recv_f"][s], row["recv_b"][s]
        fslot, bslot = jnp.maximum(rf, 0), jnp.maximum(rb, 0)
        stash = state.stash.at[fslot].set(jnp.where(rf >= 0, state.fwd_in, state.stash[fslot]))
        gstash = state.grad_stash.at[bslot].set(jnp.where(rb >= 0, state.bwd_in, state.grad_stash[bslot]))
        m = jnp.clip(m, 0, self.num_micro - 1)
        inputs = (device.micro_rows(m), device.extra, m)
        task = Task(kind, row["chunk"][s], row["slot"][s], row["gslot"][s], row["wslot"][s])
        return state._replace(stash=stash, grad_stash=gstash), task, m, inputs

    @staticmethod
    def operands(state: LoopState, task: Task, device: Device):
        """(the stage's parameter row, the task's stashed input message, its stashed output cotangent)."""
        return device.params, state.stash[task.slot], state.grad_stash[task.gslot]

    @staticmethod
    def forward_or_idle(task: Task, params, x, inputs, work: Branches):
        """The task's chunk's forward when it is one, else the idle branch: (message on, part outputs,
        per-example outputs)."""
        return tree_switch(jnp.where(task.kind == 1, 1 + task.chunk, 0), work.forward, params, x, inputs)

    def run_one_tick(self, state: LoopState, task: Task, inputs, device: Device, work: Branches):
        """The chunk's forward, backward or nothing: (message on, message back, gradient accumulator,
        part outputs, per-example outputs, W stash). A backward adds into its chunk's own segments of
        the accumulator, which the forward branch passes through. A split backward's tasks are
        conditionals side by side instead, each holding only the state it writes (`split_tick`)."""
        if self.weight_slots:
            return self.split_tick(state, task, inputs, device, work)
        params, x, ct = self.operands(state, task, device)

        def backward(gacc):
            dx, gacc = tree_switch(task.chunk, work.backward, gacc, params, x, ct, inputs)
            return work.zero_message, dx, gacc, work.zero_outputs, self.outputs.no_rows()

        def forward(gacc):         # or idle
            y, outs, routs = self.forward_or_idle(task, params, x, inputs, work)
            return y, work.zero_message, gacc, outs, routs

        return *jax.lax.cond(task.kind == 2, backward, forward, state.grads), state.weight_stash

    def split_tick(self, state: LoopState, task: Task, inputs, device: Device, work: Branches):
        """`run_one_tick` with the backward split: the forward (or idle), each chunk's B and the W each
        their own two-way conditional, side by side, holding only what it writes (the forward nothing,
        a B the message back and the W stash, into whose slot it writes its row in place, W the
        accumulator): a buffer threaded through a conditional nested in another was copied by XLA on
        every tick, and a B's row returned through the chunks' switch was padded to the widest
        chunk's and copied into the stash."""
        kind, c, wslot = task.kind, task.chunk, task.wslot
        params, x, ct = self.operands(state, task, device)
        y, outs, routs = self.forward_or_idle(task, params, x, inputs, work)

        def input_gradient(b):
            return lambda dx, rows: b(rows, wslot, params, x, ct, inputs)

        def weight_gradient(g, rows):
            return tree_switch(c, work.weight, g, params, rows, wslot, inputs)

        dx, wstash = work.zero_message, state.weight_stash
        for k, b in enumerate(work.backward):
            dx, wstash = jax.lax.cond((kind == 2) & (c == k), input_gradient(b), lambda dx, rows: (dx, rows),
                                      dx, wstash)
        gacc = jax.lax.cond(kind == 3, weight_gradient, lambda g, rows: g, state.grads, wstash)
        return y, dx, gacc, outs, routs, wstash

    def accumulate_outputs(self, state: LoopState, task: Task, m, outs, routs, device: Device):
        """The part outputs of the last chunk's forward of micro-batch m combined into the accumulators:
        (batch-free outputs, per-example outputs written at the micro-batch's rows)."""
        done = (task.kind == 1) & (task.chunk == self.num_chunks - 1)
        oacc = jnp.where(done, self.outputs.combine(state.outputs, outs), state.outputs)
        n = device.micro
        racc = [jax.lax.dynamic_update_slice_in_dim(a, jnp.where(done, o, jax.lax.dynamic_slice_in_dim(a, m * n, n, 0)),
                                                    m * n, 0) for a, o in zip(state.rows, routs)]
        return oacc, racc

    def fill_outbox(self, outbox: tuple, task: Task, y, dx) -> tuple:
        """The outbox after this tick: a forward of any chunk but the last puts its output there, a
        backward of any chunk but the first its input gradient; what it held before has left (the
        schedule sends a message before its outbox's next one is made)."""
        made_f = (task.kind == 1) & (task.chunk < self.num_chunks - 1)
        made_b = (task.kind == 2) & (task.chunk > 0)
        if self.num_stages == 2:
            return (jnp.where(made_f, y, jnp.where(made_b, dx, outbox[0])),)
        return jnp.where(made_f, y, outbox[0]), jnp.where(made_b, dx, outbox[1])

    def pass_messages(self, outbox: tuple, send_f, send_b):
        """(the message from the previous stage, the gradient from the next) after one exchange of the
        outboxes; with interleaved chunks around the ring (the last stage's message goes to the first).
        A direction in which nothing moves this tick (`send_f`, `send_b`: the same on every device) is
        not exchanged, and an outbox whose message left before is sent again unread: what arrives is
        stashed only where the next tick's recv tables say (-1: nothing)."""
        S, ring = self.num_stages, self.virtual_stages > 1
        if S == 2:            # one swap: stage 0's message goes forward, 1's back (with chunks, either)
            out = _exchange(send_f | send_b, outbox[0], [(0, 1), (1, 0)])
            return out, out
        if S == 1:
            return outbox
        n = S if ring else S - 1
        return (_exchange(send_f, outbox[0], [(i, (i + 1) % S) for i in range(n)]),
                _exchange(send_b, outbox[1], [((i + 1) % S, i) for i in range(n)]))

    def tick(self, device: Device, work: Branches, state: LoopState, row: dict):
        """One tick: the scan's body."""
        state, task, m, inputs = self.iteration_inputs(state, row, device)
        y, dx, grads, outs, routs, wstash = self.run_one_tick(state, task, inputs, device, work)
        oacc, racc = self.accumulate_outputs(state, task, m, outs, routs, device)
        outbox = self.fill_outbox(state.outbox, task, y, dx)
        fout, bout = self.pass_messages(outbox, row["send_f"][0] > 0, row["send_b"][0] > 0)
        return LoopState(state.stash, state.grad_stash, grads, oacc, racc, fout, bout, wstash, outbox), None

    def run(self, device: Device, work: Branches, zero_grads: Callable) -> LoopState:
        """Every tick of the schedule on this device: the final state."""
        state, _ = jax.lax.scan(lambda st, row: self.tick(device, work, st, row),
                                self.init_state(device, zero_grads), self.tables)
        return state


def _exchange(moves, x, perm):
    """`x` sent along `perm` over the stage axis where `moves` (a value every device holds alike), else
    `x` kept: a tick in which nothing moves pays no collective."""
    return jax.lax.cond(moves, lambda v: jax.lax.ppermute(v, STAGE, perm), lambda v: v, x)
