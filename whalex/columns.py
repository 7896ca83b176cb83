"""Uneven columns: a class (or hidden-unit, head) dimension split unevenly over a model axis, and the
split classification head's program over it (Whale section 3.3.1, intra-TaskGraph balance for split).

Device i of the model axis owns `counts[i]` columns, stored padded to a common `width` so a weight is
one evenly sharded buffer `[features, devices * width]`. The head runs in `shard_map`: each device
runs one matmul at its own class count (a `lax.switch` branch per distinct count, so per-device work
is its real shard and no collective runs inside a branch), then the softmax statistics are combined
with `pmax`/`psum` over the model axis, never gathering logits. A `custom_vjp` gives the backward pass
the same shape: the weight and input gradients at the device's count, then one `psum`.

Below both the lowering, which runs the head in the step, and balance, which times the same program
at candidate class splits (`whalex.balance.head_timing`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

NEG = -1e30


@dataclasses.dataclass(frozen=True)
class UnevenColumns:
    """How the class (or hidden-unit, head) dimension is laid out: real columns per device, padded to
    `width`. Counts are multiples of `chunk`: the head runs each device's count as one matmul, uneven
    blocks loop over it in chunks."""

    counts: tuple[int, ...]
    width: int
    chunk: int

    def __post_init__(self):
        if any(c % self.chunk for c in self.counts):
            raise ValueError(f"uneven columns {self.counts} do not split into chunks of {self.chunk}")

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.counts)[:-1]]))

    @property
    def classes(self) -> int:
        return int(sum(self.counts))

    @property
    def common(self) -> int:
        """Units every device runs, in whole chunks (the smallest count)."""
        return min(self.counts) // self.chunk * self.chunk

    def padded_index(self) -> np.ndarray:
        """For each logical class, its column in the padded layout."""
        return np.concatenate([i * self.width + np.arange(c) for i, c in enumerate(self.counts)])

    def pad(self, x, axis: int):
        """Logical [.., classes, ..] -> padded [.., devices*width, ..] (padding zeros)."""
        x = jnp.asarray(x)
        shape = list(x.shape)
        shape[axis] = len(self.counts) * self.width
        out = jnp.zeros(shape, x.dtype)
        idx = [slice(None)] * x.ndim
        idx[axis] = self.padded_index()
        return out.at[tuple(idx)].set(x)

    def unpad(self, x, axis: int):
        return jnp.take(x, jnp.asarray(self.padded_index()), axis=axis)


def uneven_head(mesh, model_axis: str, batch_axes: tuple, layout: UnevenColumns, global_batch: int):
    """f(x, kernel_padded, bias_padded, labels) -> mean softmax cross-entropy, uneven over `model_axis`."""
    counts = jnp.asarray(layout.counts, jnp.int32)
    offsets = jnp.asarray(layout.offsets, jnp.int32)
    bspec = batch_axes if batch_axes else None
    mx = model_axis
    local_fwd = _head_forward(counts, offsets, layout, mx, batch_axes, float(global_batch))
    local_bwd = _head_backward(counts, offsets, layout, mx, batch_axes, float(global_batch))
    fwd_map = jax.shard_map(local_fwd, mesh=mesh, in_specs=(P(bspec), P(None, mx), P(mx), P(bspec)),
                            out_specs=(P(), P(bspec, mx), P(bspec)), check_vma=False)
    bwd_map = jax.shard_map(local_bwd, mesh=mesh,
                            in_specs=(P(bspec), P(None, mx), P(bspec), P(bspec, mx), P(bspec), P()),
                            out_specs=(P(bspec), P(None, mx), P(mx)), check_vma=False)

    @jax.custom_vjp
    def head(x, w, b, y):
        return fwd_map(x, w, b, y)[0]

    def fwd(x, w, b, y):
        loss, logits, lse = fwd_map(x, w, b, y)
        return loss, (x, w, y, logits, lse)

    def bwd(res, g):
        x, w, y, logits, lse = res
        dx, dw, db = bwd_map(x, w, y, logits, lse, g)
        return dx, dw, db, None

    head.defvjp(fwd, bwd)
    return head


def by_count(layout: UnevenColumns, i, branch, *operands):
    """branch(count, *operands) on device `i` at its own class count: one `lax.switch` branch per
    distinct count, each a dense computation of static width, so a device's work is its real shard
    with no loop trips, slices or writes per chunk."""
    distinct = sorted(set(layout.counts))
    if len(distinct) == 1:
        return branch(distinct[0], *operands)
    which = jnp.asarray([distinct.index(c) for c in layout.counts], jnp.int32)[i]
    return jax.lax.switch(which, [functools.partial(branch, c) for c in distinct], *operands)


def pad_last(a, width: int, value: float = 0.0):
    """`a` padded along its last axis to `width` with `value`."""
    return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, width - a.shape[-1])], constant_values=value)


def _head_forward(counts, offsets, layout: UnevenColumns, mx: str, batch_axes: tuple, total: float):
    """One device's forward of the uneven head: its logits, their row maxima and the labels' logits
    at its own class count, the softmax statistics combined over `mx`, every elementwise pass at
    that count too -> (mean loss, logits padded to the width, log-sum-exp)."""
    width = layout.width

    def own_logits(c, x, w, b, label):
        rows = x.shape[0]
        if c == 0:
            return jnp.full((rows, width), NEG, x.dtype), jnp.full((rows,), NEG, x.dtype), jnp.zeros((rows,), x.dtype)
        z = x @ w[:, :c] + b[:c]
        picked = jnp.take_along_axis(z, jnp.clip(label, 0, c - 1)[:, None], axis=1)[:, 0]
        return pad_last(z, width, NEG), jnp.max(z, axis=1), picked

    def own_sum(c, logits, m):
        return jnp.sum(jnp.exp(logits[:, :c] - m[:, None]), axis=1)

    def local_fwd(x, w, b, y):
        i = jax.lax.axis_index(mx)
        local = y - offsets[i]
        own = (local >= 0) & (local < counts[i])
        logits, row_max, picked = by_count(layout, i, own_logits, x, w, b, local)
        m = jax.lax.pmax(row_max, mx)
        lse = m + jnp.log(jax.lax.psum(by_count(layout, i, own_sum, logits, m), mx))
        zy = jax.lax.psum(jnp.where(own, picked, 0.0), mx)
        loss = jnp.sum(lse - zy)
        if batch_axes:
            loss = jax.lax.psum(loss, batch_axes)
        return loss / total, logits, lse

    return local_fwd


def _head_backward(counts, offsets, layout: UnevenColumns, mx: str, batch_axes: tuple, total: float):
    """One device's backward of the uneven head: the logits' cotangent and the weight, bias and input
    gradients at its own class count, the input gradient summed over `mx` -> (dx, dw, db)."""
    width = layout.width

    def own_grads(c, x, w, logits, lse, label, scale):
        if c == 0:
            return jnp.zeros_like(w), jnp.zeros_like(x), jnp.zeros((width,), x.dtype)
        p = jnp.exp(logits[:, :c] - lse[:, None]) - jax.nn.one_hot(label, c, dtype=x.dtype)
        d = p * scale
        return pad_last(x.T @ d, width), d @ w[:, :c].T, pad_last(jnp.sum(d, axis=0), width)

    def local_bwd(x, w, y, logits, lse, g):
        i = jax.lax.axis_index(mx)
        local = y - offsets[i]
        label = jnp.where((local >= 0) & (local < counts[i]), local, -1)     # -1: another device's class
        dw, dx, db = by_count(layout, i, own_grads, x, w, logits, lse, label, g / total)
        dx = jax.lax.psum(dx, mx)                          # partial sums over classes
        if batch_axes:
            dw, db = jax.lax.psum((dw, db), batch_axes)
        return dx, dw, db

    return local_bwd
