"""What the walk adds once every equation is placed: the data-parallel gradient sync, the
parameters stored padded, and the coverage report of every split TaskGraph's parameters."""
from __future__ import annotations

import numpy as np
from jax.sharding import PartitionSpec as P

from whalex.core.sharding_plan import Coverage
from whalex.planner.patterns import cost
from whalex.planner.patterns.state import Walk


def gradient_sync(w: Walk) -> None:
    """Data-parallel gradient all-reduce per parameter, over the batch axes of its TaskGraph, in the
    dtype its gradient is summed in (`reduced_itemsize`)."""
    jaxpr = w.cap.jaxpr.jaxpr
    for tg in w.cap.taskgraphs:
        vd = w.vds[tg.index]
        for leaf in tg.params:
            var = jaxpr.invars[leaf]
            spec = w.param_spec.get(leaf) or [None] * len(var.aval.shape)
            split = w.shards(next((a for a in spec if a), ()))
            axes = vd.batch_axes if w.shards(vd.batch_axes) > 1 else ()
            scale = reduced_itemsize(jaxpr, var) / np.dtype(var.aval.dtype).itemsize
            w.comm(tg.index, "all-reduce", axes, cost.nbytes(var.aval) * scale / split,
                   f"gradient sync {w.cap.param_paths[leaf]}")


def reduced_itemsize(jaxpr, var) -> int:
    """Bytes per element of a parameter's data-parallel gradient sum: a parameter read only through
    casts to one narrower dtype (mixed precision) has its gradient summed in that dtype (the partial
    sums come out of its users' matmuls in it; XLA's partitioner all-reduces them there, before the
    transpose of the cast)."""
    itemsize = np.dtype(var.aval.dtype).itemsize
    casts = set()
    for eqn in jaxpr.eqns:
        if any(v is var for v in eqn.invars):
            if eqn.primitive.name != "convert_element_type":
                return itemsize
            casts.add(np.dtype(eqn.params["new_dtype"]).itemsize)
    return min(casts) if len(casts) == 1 and min(casts) < itemsize else itemsize


def padding(w: Walk) -> tuple[tuple[int, int, int], ...]:
    """(leaf, dim, devices) for every split dimension the device count does not divide."""
    out = []
    for leaf, spec in sorted(w.param_spec.items()):
        shape = w.cap.jaxpr.jaxpr.invars[leaf].aval.shape
        for d, a in enumerate(spec):
            if a and shape[d] % w.shards(a):
                out.append((leaf, d, w.shards(a)))
    return tuple(out)


def coverage(w: Walk, specs) -> tuple[Coverage, ...]:
    """Every parameter a split TaskGraph reads, its layout, and why a matrix was left whole or padded."""
    out = []
    for tg in w.cap.taskgraphs:
        vd = w.vds[tg.index]
        if not vd.model_axes:
            continue
        for leaf in tg.params:
            shape = tuple(w.cap.jaxpr.jaxpr.invars[leaf].aval.shape)
            note = ""
            if specs[leaf] == P() and len(shape) >= 2:
                note = w.unmatched.get(leaf, (None, w.readers.get(leaf, "")))[1]
            for d, a in enumerate(w.param_spec.get(leaf, ())):
                k = w.shards(a) if a else 1
                if shape[d] % k:
                    note = f"dim {d} padded {shape[d]} -> {-(-shape[d] // k) * k} ({k} does not divide {shape[d]})"
            out.append(Coverage(tg.index, vd.strategy.label(), w.cap.param_paths[leaf], shape, specs[leaf], note))
    return tuple(out)
