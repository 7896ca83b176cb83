"""What the walk adds once every equation is placed: the data-parallel gradient sync, the
parameters stored padded, and the coverage report of every split TaskGraph's parameters."""
from __future__ import annotations

import numpy as np
from jax.sharding import PartitionSpec as P

from whalex import _compat as C
from whalex.planner.patterns import cost
from whalex.planner.patterns.state import Walk
from whalex.records.sharding_plan import Coverage


def gradient_sync(w: Walk) -> None:
    """Data-parallel gradient all-reduce per parameter, over the batch axes of its TaskGraph, in the
    dtype its gradient is summed in (`reduced_itemsizes`)."""
    jaxpr = w.cap.jaxpr.jaxpr
    reduced = reduced_itemsizes(jaxpr, jaxpr.invars[:w.cap.num_params])
    for tg in w.cap.taskgraphs:
        vd = w.vds[tg.index]
        for leaf in tg.params:
            var = jaxpr.invars[leaf]
            spec = w.param_spec.get(leaf) or [None] * len(var.aval.shape)
            split = w.shards(next((a for a in spec if a), ()))
            axes = vd.batch_axes if w.shards(vd.batch_axes) > 1 else ()
            scale = reduced.get(var, np.dtype(var.aval.dtype).itemsize) / np.dtype(var.aval.dtype).itemsize
            w.comm(tg.index, "all-reduce", axes, cost.nbytes(var.aval) * scale / split,
                   f"gradient sync {w.cap.param_paths[leaf]}")


def reduced_itemsizes(jaxpr, params) -> dict:
    """{parameter: bytes per element of its data-parallel gradient sum} for the parameters read only
    through casts to one narrower dtype (mixed precision): the partial sums come out of their users'
    matmuls in that dtype, and XLA's partitioner all-reduces them there, before the transpose of the
    cast. One pass over the equations."""
    wanted = set(params)
    casts: dict = {}
    other = set()
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, C.Literal) and v in wanted:
                if eqn.primitive.name == "convert_element_type":
                    casts.setdefault(v, set()).add(np.dtype(eqn.params["new_dtype"]).itemsize)
                else:
                    other.add(v)
    return {v: next(iter(sizes)) for v, sizes in casts.items()
            if v not in other and len(sizes) == 1 and next(iter(sizes)) < np.dtype(v.aval.dtype).itemsize}


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
