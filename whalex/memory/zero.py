"""ZeRO (Rajbhandari et al., SC'20) as functions from PartitionSpecs to PartitionSpecs.

Level 1 shards the optimizer state over the data-parallel devices of its parameter, level 2 also
the reduced gradients, level 3 also the stored parameters. A ZeRO spec is the plan's spec with
the data-parallel mesh axes added on one dimension that is not split yet and that their degree
divides; a leaf with no such dimension stays as planned.

GSPMD programs only need the specs (XLA's partitioner inserts the collectives). Programs written
with `shard_map` use `scatter_sum` and `gather` for the explicit reduce-scatter and all-gather.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from whalex.records.comm import Comm, ring_bytes


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def used_axes(spec: P) -> set[str]:
    return {a for entry in spec for a in _axes(entry)}


def shard_spec(spec: P, shape: Sequence[int], dp_axes: Sequence[str], axis_sizes: Mapping[str, int]) -> P:
    """`spec` additionally sharded over `dp_axes` (those of size > 1 it does not use yet), on the
    first dimension that is not split and whose size their degree divides; else `spec` itself."""
    taken = used_axes(spec)
    axes = tuple(a for a in dp_axes if axis_sizes[a] > 1 and a not in taken)
    degree = int(np.prod([axis_sizes[a] for a in axes])) if axes else 1
    if degree == 1:
        return spec
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for d, (entry, size) in enumerate(zip(entries, shape)):
        if entry is None and size % degree == 0 and size > 0:
            entries[d] = axes[0] if len(axes) == 1 else axes
            while entries and entries[-1] is None:
                entries.pop()
            return P(*entries)
    return spec


def zero_dim(spec: P, zspec: P) -> int | None:
    """The dimension ZeRO sharded (where `zspec` differs from `spec`), or None."""
    a, b = list(spec), list(zspec)
    n = max(len(a), len(b))
    a += [None] * (n - len(a))
    b += [None] * (n - len(b))
    for d, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return d
    return None


def degree(spec: P, zspec: P, axis_sizes: Mapping[str, int]) -> int:
    """How many ways ZeRO divides the leaf (1 when it could not shard it)."""
    d = zero_dim(spec, zspec)
    if d is None:
        return 1
    return int(np.prod([axis_sizes[a] for a in _axes(list(zspec)[d])]))


def shard_specs(specs: Sequence[P], shapes: Sequence, dp_axes: Sequence[Sequence[str]],
                axis_sizes: Mapping[str, int]) -> list[P]:
    """`shard_spec` for every leaf (shapes: anything with `.shape`)."""
    return [shard_spec(s, np.shape(x) if not hasattr(x, "shape") else x.shape, a, axis_sizes)
            for s, x, a in zip(specs, shapes, dp_axes)]


def data_parallel_axes(param_taskgraphs: Sequence[Sequence[int]], batch_axes: Sequence[Sequence[str]],
                       axis_sizes: Mapping[str, int]) -> list[tuple[str, ...]]:
    """Per parameter leaf: the mesh axes (size > 1) over which every TaskGraph that reads it divides
    its batch, i.e. the devices holding identical copies of its gradient."""
    out = []
    for tgs in param_taskgraphs:
        common: list[str] | None = None
        for t in tgs:
            axes = [a for a in batch_axes[t] if axis_sizes[a] > 1]
            common = axes if common is None else [a for a in common if a in axes]
        out.append(tuple(common or ()))
    return out


def comms(planned: Sequence, level: int, sharded: Mapping[str, tuple[float, int, tuple]],
          taskgraph_of: Mapping[str, int]):
    """The plan's collectives under ZeRO. `sharded[path] = (bytes per device as planned, ZeRO
    degree, axes)` for each leaf ZeRO divides. Level >= 2 turns its gradient all-reduce into a
    reduce-scatter; every level all-gathers the parameter over its ZeRO axes once a step (after
    the sharded update for 1 and 2, before its use for 3)."""
    out = []
    for c in planned:
        path = c.reason[len("gradient sync "):] if c.reason.startswith("gradient sync ") else None
        if path in sharded and level >= 2 and c.kind == "all-reduce":
            c = dataclasses.replace(c, kind="reduce-scatter", bytes=c.bytes / 2, reason=f"{c.reason} (zero {level})")
        out.append(c)
    for path, (nbytes, n, axes) in sharded.items():
        when = "new parameters after the sharded update" if level < 3 else "parameters before their use"
        out.append(Comm(taskgraph_of[path], "all-gather", tuple(axes), ring_bytes("all-gather", nbytes, n),
                        f"zero {level}: {when} {path}"))
    return tuple(out)


# -- explicit collectives, inside shard_map ----------------------------------------------------

def scatter_sum(grads: Sequence, specs: Sequence[P], zspecs: Sequence[P], axis: str) -> list:
    """Sum local gradients over `axis`: a reduce-scatter to the ZeRO shard where the leaf has one,
    an all-reduce where it has none."""
    out = []
    for g, s, z in zip(grads, specs, zspecs):
        d = zero_dim(s, z)
        out.append(jax.lax.psum(g, axis) if d is None else
                   jax.lax.psum_scatter(g, axis, scatter_dimension=d, tiled=True))
    return out


def gather(params: Sequence, specs: Sequence[P], zspecs: Sequence[P], axis: str) -> list:
    """All-gather ZeRO-3 parameter shards over `axis` to the planned layout (its transpose under
    `jax.grad` is the reduce-scatter)."""
    out = []
    for p, s, z in zip(params, specs, zspecs):
        d = zero_dim(s, z)
        out.append(p if d is None else jax.lax.all_gather(p, axis, axis=d, tiled=True))
    return out
