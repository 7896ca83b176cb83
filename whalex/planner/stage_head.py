"""The loss head of a 3D pipeline: the last stage's operations after its last split layer, their rows
split over `model`.

Inside a 3D stage the operations outside `split` scopes are replicated over the `model` devices of a
replica, so both would compute the whole head (a vocabulary projection and its loss) on every row of
the micro-batch, and hold its logits twice over. Split over `model` by rows instead, the head runs as
data parallelism inside the replica: each model device takes 1/mp of the micro-batch's rows, the
loss's sums and the head's weight gradients are summed over `model` (GSPMD inserts the all-reduces),
and the head's input gradient is gathered for the split layers' backward. The constraints name only
`model` (inside the stage's `shard_map`, `data` and `stage` are manual).
"""
from __future__ import annotations

import numpy as np
from jax.sharding import PartitionSpec as P

from whalex import _compat as C
from whalex.jaxpr.batch_dependence import analyse
from whalex.lowering.pipeline import MODEL
from whalex.memory.flat import aval_bytes
from whalex.records.comm import Comm, ring_bytes


def head_equations(cap, last_chunk: list[int]) -> list[int]:
    """The top-level equations of the last chunk after its last split equation (all of them when the
    chunk has none)."""
    split = [i for i in last_chunk if cap.taskgraphs[cap.assign[(i,)]].strategy.kind == "split"]
    after = max(split, default=-1)
    return [i for i in last_chunk if i > after]


def head_rows(cap, head: list[int], mp: int, micro: int) -> dict:
    """Constraints (path, "in", position) -> P(MODEL) on every floating operand of a head equation that
    leads with the micro-batch's rows (integer ones, labels, follow); none when `mp` does not divide
    the rows."""
    if mp <= 1 or micro % mp:
        return {}
    jaxpr = cap.jaxpr.jaxpr
    dep = analyse(jaxpr, range(cap.num_params, len(jaxpr.invars)))
    out = {}
    for i in head:
        for pos, v in enumerate(jaxpr.eqns[i].invars):
            if isinstance(v, C.Var) and dep.batch_major(v, micro) and _floating(v):
                out[((i,), "in", pos)] = P(MODEL)
    return out


def head_collectives(cap, head: list[int], mp: int, micro_batches: int, stage: int) -> tuple[Comm, ...]:
    """The collectives the row split adds on `stage` (the last) per step, each micro-batch: the head's
    floating inputs from before it gathered over `model` three times (its forward, the backward's
    recomputed forward and its input gradient), and its parameters' gradients summed over `model`."""
    jaxpr = cap.jaxpr.jaxpr
    inside = {v for i in head for v in jaxpr.eqns[i].outvars}
    params = set(jaxpr.invars[:cap.num_params])
    batch = set(cap.batch_vars)
    reads = {v for i in head for v in jaxpr.eqns[i].invars if isinstance(v, C.Var)}
    entering = [v for v in reads if v not in inside and v not in params and v not in batch and _floating(v)]
    grads = [v for v in reads if v in params]
    m = micro_batches
    return (Comm(stage, "all-gather", (MODEL,), 3 * m * ring_bytes("all-gather", _nbytes(entering), mp),
                 "loss head: its input gathered over model (forward, recomputed forward, input gradient)"),
            Comm(stage, "all-reduce", (MODEL,), m * ring_bytes("all-reduce", _nbytes(grads), mp),
                 "loss head: its parameters' gradients summed over model (rows split)"))


def _floating(v) -> bool:
    return np.issubdtype(v.aval.dtype, np.floating)


def _nbytes(vs) -> float:
    return sum(aval_bytes(v.aval) for v in vs)
