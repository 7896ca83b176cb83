"""Values in flat buffers: the messages between stages, the stash, the part outputs, and the
gradient accumulator held as segments.

A message carries any stage boundary in one `[width]` row of its `Message.dtype`: float32, where
floats are cast, booleans become 0/1 and integers are bit-cast through int32, so `unpack(pack(...))`
is exact; or, where every boundary value is a 16-bit float of one kind (or a boolean), that dtype, so
a pipeline in mixed precision stashes and sends half the bytes. Part outputs summed over
micro-batches are float32, cast by value (`pack_values`): an integer count adds up.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from whalex.lowering.stage_rows import pad_to


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one value sits in a flat buffer."""

    var: Any
    offset: int
    shape: tuple
    dtype: Any

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def layout(vars_: Sequence[Any]) -> tuple[list[Slot], int]:
    """The slots of `vars_` one after another, and the width they fill."""
    slots, off = [], 0
    for v in vars_:
        slot = Slot(v, off, tuple(v.aval.shape), v.aval.dtype)
        slots.append(slot)
        off += slot.size
    return slots, off


HALF_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Message:
    """The format of every message between stages (and of the stash holding them): `width` entries of
    `dtype`."""

    width: int
    dtype: Any = jnp.float32

    @classmethod
    def of(cls, boundaries: Sequence[Sequence[Any]]) -> Message:
        """The format carrying every boundary's values exactly: as wide as the widest boundary; of a
        16-bit float dtype where every value is of that dtype or boolean, else float32."""
        width = max([layout(b)[1] for b in boundaries] + [1])
        kinds = {jnp.dtype(v.aval.dtype) for b in boundaries for v in b} - {jnp.dtype(jnp.bool_)}
        half = kinds.pop() if len(kinds) == 1 and next(iter(kinds)) in HALF_FLOATS else None
        return cls(width, half if half is not None else jnp.dtype(jnp.float32))

    @property
    def nbytes(self) -> int:
        return self.width * jnp.dtype(self.dtype).itemsize

    def zeros(self, *lead: int):
        """A zero message (`lead`: leading dimensions, a stash's slots)."""
        return jnp.zeros((*lead, self.width), self.dtype)

    def pack(self, values):
        """`values` (in their slots' order) as one message (`to_entries`, zero padded)."""
        parts = [to_entries(jnp.asarray(v), self.dtype).reshape(-1) for v in values]
        flat = jnp.concatenate(parts) if parts else jnp.zeros((0,), self.dtype)
        return pad_to(flat, self.width)


def to_entries(x, dtype=jnp.float32):
    """`x` as entries of a message of `dtype`: floats cast, booleans 0/1, integers bit-cast through
    int32 (float32 messages only: `Message.of`)."""
    if x.dtype == dtype:
        return x
    if jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == jnp.bool_:
        return x.astype(dtype)
    return jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.float32)


def from_entries(x, dtype):
    """The inverse of `to_entries`."""
    if dtype == x.dtype:
        return x
    if jnp.issubdtype(dtype, jnp.floating):
        return x.astype(dtype)
    if dtype == jnp.bool_:
        return x > 0.5
    return jax.lax.bitcast_convert_type(x, jnp.int32).astype(dtype)


def unpack(flat, slots: Sequence[Slot]) -> list:
    """The values of a message, by their slots."""
    return [from_entries(flat[s.offset:s.offset + s.size].reshape(s.shape), s.dtype) for s in slots]


def pack_values(values, width: int):
    """Outputs summed over micro-batches: every value as float32 by value (integers count)."""
    parts = [jnp.asarray(v).astype(jnp.float32).reshape(-1) for v in values]
    flat = jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.float32)
    return pad_to(flat, width)


def unpack_values(flat, slots: Sequence[Slot]) -> list:
    """The inverse of `pack_values`."""
    return [flat[s.offset:s.offset + s.size].reshape(s.shape).astype(s.dtype) for s in slots]


def bounds(widths: Sequence[int], total: int) -> tuple[int, ...]:
    """Segment boundaries of a row of `total` entries cut at every stage's own width `widths`."""
    return tuple(sorted({0, total, *(w for w in widths if 0 < w < total)}))


def add_segments(segs, x, bounds: Sequence[int], axis: int, start: int = 0):
    """The row held as segments (`bounds`) plus `x` on its `x.shape[axis]` entries from `start`, both
    ends on a boundary: each segment is added whole or passed through, so XLA updates it in place and
    a narrow stage's (or chunk's) backward touches only its own width (a prefix update of one wide row
    was a copy of the whole row per backward tick inside the tick's conditional)."""
    end = start + x.shape[axis]
    assert start in bounds and end in bounds, (start, end, bounds)
    return tuple(seg + jax.lax.slice_in_dim(x, a - start, b - start, axis=axis) if start <= a and b <= end else seg
                 for seg, a, b in zip(segs, bounds[:-1], bounds[1:]))


def join_segments(segs):
    """The row from its segments."""
    return jnp.concatenate(segs, axis=-1) if len(segs) > 1 else segs[0]


def tree_switch(index, branches, *operands):
    """`lax.switch(index, branches, *operands)` as a balanced tree of two-way `lax.cond`s. XLA CPU's
    many-way conditional copied a large operand threaded through its branches (the gradient
    accumulator) on every call; through two-way conds, with the accumulator in segments each added
    whole or passed through (`add_segments`), it is updated in place."""
    if len(branches) == 1:
        return branches[0](*operands)
    mid = len(branches) // 2
    return jax.lax.cond(index < mid,
                        lambda *ops: tree_switch(index, branches[:mid], *ops),
                        lambda *ops: tree_switch(index - mid, branches[mid:], *ops), *operands)
