"""The last stage's part outputs (the loss contract's, `whalex.loss.evaluation`), combined over
micro-batches and replicas.

Outputs without the batch dimension sit in one flat float32 accumulator and combine by their kind
(sums, maxima, minima); per-example outputs ("rows") are written at their micro-batch's rows of a
`[per_replica, ...]` buffer each and gathered over the replicas in global batch order.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from whalex.lowering.pipeline.packing import Slot, layout


@dataclasses.dataclass(frozen=True)
class PartOutputs:
    """The part outputs of the captured loss and how each combines over micro-batches."""

    outvars: tuple                  # the captured loss's outputs (the part outputs)
    kinds: tuple[str, ...]          # per output: "sum", "max", "min" or "rows"

    @functools.cached_property
    def rows(self) -> tuple[int, ...]:
        """Outputs (positions) with the batch dimension: per-example aux, gathered by rows."""
        return tuple(k for k, kind in enumerate(self.kinds) if kind == "rows")

    @functools.cached_property
    def values(self) -> tuple[int, ...]:
        """Outputs (positions) without the batch dimension: combined in the flat accumulator."""
        return tuple(k for k, kind in enumerate(self.kinds) if kind != "rows")

    @functools.cached_property
    def slots(self) -> tuple[tuple[Slot, ...], int]:
        """Where the batch-free outputs sit in the accumulator, and its width."""
        slots, width = layout([self.outvars[k] for k in self.values])
        return tuple(slots), max(width, 1)

    @property
    def row_avals(self) -> list:
        return [self.outvars[k].aval for k in self.rows]

    @functools.cached_property
    def masks(self) -> tuple[np.ndarray, np.ndarray]:
        """(is max, is min) per accumulator entry; the others are sums."""
        slots, width = self.slots
        is_max, is_min = np.zeros(width, bool), np.zeros(width, bool)
        for sl, k in zip(slots, self.values):
            is_max[sl.offset:sl.offset + sl.size] = self.kinds[k] == "max"
            is_min[sl.offset:sl.offset + sl.size] = self.kinds[k] == "min"
        return is_max, is_min

    def no_rows(self) -> list:
        """Zero per-example outputs of one micro-batch (what a stage other than the last returns)."""
        return [jnp.zeros(a.shape, a.dtype) for a in self.row_avals]

    def init(self):
        """The empty accumulator: the identity of each entry's kind."""
        is_max, is_min = self.masks
        big = float(np.finfo(np.float32).max)
        return jnp.asarray(np.where(is_max, -big, np.where(is_min, big, 0.0)).astype(np.float32))

    def combine(self, acc, outs):
        """A micro-batch's outputs `outs` combined into `acc` entry by entry (sum, max or min)."""
        is_max, is_min = self.masks
        if not (is_max.any() or is_min.any()):
            return acc + outs
        return jnp.where(is_max, jnp.maximum(acc, outs), jnp.where(is_min, jnp.minimum(acc, outs), acc + outs))

    def across(self, acc, axes):
        """The accumulator combined over the devices of `axes` (sums, maxima, minima)."""
        is_max, is_min = self.masks
        out = jax.lax.psum(jnp.where(is_max | is_min, 0.0, acc), axes)
        if is_max.any():
            out = jnp.where(is_max, jax.lax.pmax(acc, axes), out)
        if is_min.any():
            out = jnp.where(is_min, jax.lax.pmin(acc, axes), out)
        return out

    def assemble(self, values, rows) -> list:
        """Every part output in order, from the batch-free `values` and the per-example `rows`."""
        outputs = [None] * len(self.kinds)
        for k, x in zip(self.values, values):
            outputs[k] = x
        for k, x in zip(self.rows, rows):
            outputs[k] = x
        return outputs
