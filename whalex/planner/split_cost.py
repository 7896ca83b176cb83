"""The balance report of an uneven split, counting what its lowering does (`lowering/uneven_split.py`):
besides each position's units x FLOPs per unit / speed, the time both plans pay (the rest of the
step at each device's even share, the all-reduces of the layer's output and of its input gradient
over the model axis, a calibrated fixed time), the memory traffic only the uneven plan pays (the
optimizer update of the stored padding and the zero-filled gradient buffers of the padded width, at
each device's memory bandwidth scaled by its measured speed) and, where the looped blocks recompute
their forward (CPU), what each unit beyond those every device runs computes again (its stages but
the last, whose output the backward pass does not read)."""
from __future__ import annotations

import jax
import numpy as np

from whalex import _compat as C
from whalex.balance.cost import BalanceReport, SplitCosts, lowered_split
from whalex.balance.profile import taskgraph_flops
from whalex.lowering.uneven_split import UnevenCall, recomputed_flops_per_unit
from whalex.records.comm import ring_bytes

_WEIGHTS = {"head": slice(1, 3), "mlp": slice(1, 4), "attention": slice(1, 8)}


def _state_ratio(optimizer, params) -> float:
    """Optimizer-state elements per parameter element (Adam: 2, SGD: 0)."""
    if optimizer is None:
        return 0.0
    state = jax.eval_shape(optimizer.init, params)
    size = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree)   # noqa: E731
                            if jax.numpy.issubdtype(x.dtype, jax.numpy.floating))
    return size(state) / max(size(params), 1)


def _rest_flops(cap, calls) -> float:
    """Training FLOPs of the step outside the uneven calls."""
    jaxpr, _ = C.open_jaxpr(cap.jaxpr)
    inside = {c.path[0] for c in calls}
    assign = {(i,): int(i in inside) for i in range(len(jaxpr.eqns))}
    return taskgraph_flops(cap.jaxpr, assign, 2, cap.num_params)[0]


def split_costs(report: BalanceReport, calls: tuple[UnevenCall, ...], cap, cluster, optimizer,
                axis_sizes: dict) -> SplitCosts:
    """The SplitCosts of the first call (the one `report` describes) on its model positions."""
    call = calls[0]
    eqn = C.open_jaxpr(cap.jaxpr)[0].eqns[call.path[0]]
    rows_split = int(np.prod([axis_sizes[a] for a in call.batch_axes])) if call.batch_axes else 1
    x = eqn.invars[0].aval
    x_local = jax.ShapeDtypeStruct((x.shape[0] // rows_split,) + tuple(x.shape[1:]), x.dtype)
    weights = [v.aval for v in eqn.invars[_WEIGHTS[call.kind]]]
    dims = call.dims or (1, 0)
    itemsize = np.dtype(weights[0].dtype).itemsize
    per_unit = sum(np.prod(w.shape) / w.shape[d] for w, d in zip(weights, dims)) * itemsize
    params = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
              for v in C.open_jaxpr(cap.jaxpr)[0].invars[:cap.num_params]]
    passes = 3.0 + 2.0 * _state_ratio(optimizer, params)           # read p and g, write p; read+write each state
    n = len(report.devices)
    y = eqn.outvars[0].aval
    y_local = 0.0 if call.kind == "head" else float(np.prod(y.shape)) * np.dtype(y.dtype).itemsize / rows_split
    reduced = ring_bytes("all-reduce", y_local + float(np.prod(x_local.shape)) * np.dtype(x.dtype).itemsize, n)
    specs = {s.name: s for s in cluster.specs}
    links = [specs[d.kind].host_bandwidth for d in report.devices]
    comm = reduced / min(links) if all(links) else 0.0
    rest = _rest_flops(cap, calls) / cluster.size
    fixed = cluster.overhead if getattr(cluster, "overhead", None) is not None else None
    shared, bandwidths = [], []
    for d in report.devices:
        spec = specs[d.kind]
        bandwidths.append(spec.bandwidth * min(1.0, d.speed / spec.fp32_flops))
        shared.append(rest / d.speed + comm + (max(fixed) if fixed else 0.0))
    cols = call.columns
    looped = call.recompute and cols.width > cols.common
    x_whole = jax.ShapeDtypeStruct(x.shape, x.dtype)                # flops_per_sample counts the whole batch
    again = recomputed_flops_per_unit(call, x_whole, weights) / report.flops_per_sample if looped else 0.0
    return SplitCosts(tuple(shared), tuple(bandwidths), per_unit * passes, per_unit, cols.width,
                      "units x FLOPs per unit / speed; the rest of the step and the all-reduces both plans pay"
                      + (" and the calibrated fixed time" if fixed else "")
                      + "; the padded width's update and zero-filled gradients at memory bandwidth"
                      + ("; the looped units' recomputed forward" if again else ""), cols.common, again)


def lowered_split_report(report: BalanceReport | None, calls, cap, cluster, optimizer, axis_sizes: dict):
    """`report` counting what the uneven lowering does (None stays None)."""
    if report is None or not calls:
        return report
    return lowered_split(report, split_costs(report, tuple(calls), cap, cluster, optimizer, axis_sizes))
