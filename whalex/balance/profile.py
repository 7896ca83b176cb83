"""Profiling: FLOPs per TaskGraph from XLA's cost analysis, and per-device memory of a plan.

FLOPs are measured, not counted: each TaskGraph's equations are lowered as a function together
with their backward pass (`jax.vjp`) and `Lowered.cost_analysis()` reports the global FLOPs.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.extend
import numpy as np

from whalex import _compat as C
from whalex.core.interpret import subgraph_functions, subgraph_key


def _flops(lowered) -> float:
    cost = lowered.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def _floating(v) -> bool:
    return jax.numpy.issubdtype(v.aval.dtype, np.floating)     # numpy says False for bfloat16


def _fwd_bwd_flops(fn, avals) -> float:
    """XLA-counted FLOPs of fn's forward and its vjp w.r.t. the floating arguments."""
    fl = [k for k, a in enumerate(avals) if jax.numpy.issubdtype(a.dtype, np.floating)]

    def fb(float_args, other_args):
        def f(*fa):
            args, it, jt = [], iter(fa), iter(other_args)
            for k in range(len(avals)):
                args.append(next(it) if k in fl else next(jt))
            return [o for o in fn(*args) if jax.numpy.issubdtype(o.dtype, np.floating)]
        outs, vjp = jax.vjp(f, *float_args)
        return outs, vjp([jax.numpy.ones_like(o) for o in outs]) if outs and float_args else ()

    sds = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    return _flops(jax.jit(fb).lower([sds[k] for k in fl], [s for k, s in enumerate(sds) if k not in fl]))


def loop_correction(eqn) -> float:
    """FLOPs XLA's cost analysis misses for a `scan`: it counts the loop body once, not `length` times."""
    if eqn.primitive.name != "scan" or eqn.params.get("length", 1) <= 1:
        return 0.0
    body = eqn.params["jaxpr"]
    fn = jax.extend.core.jaxpr_as_fun(body)
    inner = sum(loop_correction(e) for e in body.jaxpr.eqns)
    per_step = _fwd_bwd_flops(fn, [v.aval for v in body.jaxpr.invars]) + inner
    return (eqn.params["length"] - 1) * per_step + inner


@dataclasses.dataclass(frozen=True)
class FlopsCache:
    """Measured FLOPs by `subgraph_key`, shared between calls of `group_flops` on one jaxpr
    (`memo` holds the keys of called jaxprs)."""

    measured: dict = dataclasses.field(default_factory=dict)
    memo: dict = dataclasses.field(default_factory=dict)


def taskgraph_flops(closed: C.ClosedJaxpr, assign: dict, num_taskgraphs: int) -> tuple[float, ...]:
    """Forward + backward FLOPs of each TaskGraph on the global batch (XLA cost analysis, with
    `scan` bodies counted once per iteration)."""
    return group_flops(closed, taskgraph_eqns(closed.jaxpr, assign, num_taskgraphs))


def group_flops(closed: C.ClosedJaxpr, groups, cache: FlopsCache | None = None) -> tuple[float, ...]:
    """Forward + backward FLOPs of each group of top-level equations; groups computing the same
    function (repeated blocks) are measured once, also across calls sharing `cache`."""
    jaxpr = closed.jaxpr
    consts = dict(zip(jaxpr.constvars, closed.consts))
    cache = FlopsCache() if cache is None else cache
    result, measured, memo = [], cache.measured, cache.memo
    for indices, (inputs, outputs, fn) in zip(groups, subgraph_functions(jaxpr, groups)):
        if not indices:
            result.append(0.0)
            continue
        key = subgraph_key(jaxpr, indices, inputs, outputs, consts, memo)
        if key in measured:                 # a repeated block: same function, same FLOPs
            result.append(measured[key])
            continue
        fl_in = [k for k, v in enumerate(inputs) if _floating(v) and v not in consts]
        fl_out = [k for k, v in enumerate(outputs) if _floating(v)]
        other = {k: consts[v] for k, v in enumerate(inputs) if v in consts}

        def fwd_bwd(float_args, other_args, cotangents, fl_in=fl_in, fl_out=fl_out, fn=fn, n=len(inputs),
                    const_args=other):
            def f(*fa):
                args = [None] * n
                for k, a in zip(fl_in, fa):
                    args[k] = a
                it = iter(other_args)
                for k in range(n):
                    if args[k] is None:
                        args[k] = const_args[k] if k in const_args else next(it)
                outs = fn(*args)
                return [outs[k] for k in fl_out]
            outs, vjp = jax.vjp(f, *float_args)
            return outs, vjp(list(cotangents)) if fl_out and float_args else ()

        def sds(v):
            return jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)

        float_args = [sds(inputs[k]) for k in fl_in]
        other_args = [sds(v) for k, v in enumerate(inputs) if k not in fl_in and v not in consts]
        cts = [sds(outputs[k]) for k in fl_out]
        lowered = jax.jit(fwd_bwd).lower(float_args, other_args, cts)
        measured[key] = _flops(lowered) + sum(loop_correction(jaxpr.eqns[i]) for i in indices)
        result.append(measured[key])
    return tuple(result)


def taskgraph_eqns(jaxpr, assign: dict, num_taskgraphs: int) -> list[list[int]]:
    """The top-level equation indices of each TaskGraph `0 .. num_taskgraphs - 1`, in order."""
    groups: list[list[int]] = [[] for _ in range(num_taskgraphs)]
    for i in range(len(jaxpr.eqns)):
        tg = assign[(i,)]
        if tg < num_taskgraphs:
            groups[tg].append(i)
    return groups


@dataclasses.dataclass(frozen=True)
class Share:
    """What one memory optimization did to one component of a device's memory."""

    component: str          # "params", "grads", "optimizer state", "activations"
    before: float
    after: float
    by: str                 # e.g. "zero 1", "offload to pinned_host"


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Bytes one device holds for the training state (from the plan's shardings); offloaded
    state counts in `host`, and `shares` says what each memory optimization saved."""

    device: int
    kind: str
    params: float
    grads: float
    opt_state: float
    capacity: float
    # forward values kept for the backward (model estimate): bytes, or a function of none that finds
    # them (a trace of the whole model's backward, run when `activations` is first read)
    activation_estimate: Any = dataclasses.field(default=0.0, repr=False, compare=False)
    host: float = 0.0            # bytes kept in pinned host memory between steps
    shares: tuple[Share, ...] = ()

    @property
    def activations(self) -> float:
        a = self.activation_estimate
        return float(a() if callable(a) else a)

    @property
    def state(self) -> float:
        return self.params + self.grads + self.opt_state


def spec_shards(spec, axis_sizes: dict) -> int:
    """How many shards a PartitionSpec cuts an array into (product of its mesh axes' sizes)."""
    n = 1
    for entry in spec:
        for a in (entry if isinstance(entry, tuple) else (entry,)):
            if a is not None:
                n *= axis_sizes[a]
    return n


def sharded_bytes(shapes, specs, axis_sizes: dict) -> float:
    """Per-device bytes of a pytree of ShapeDtypeStructs under PartitionSpecs (even shards)."""
    total = 0.0
    for s, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))):
        total += float(np.prod(s.shape, dtype=np.float64)) * np.dtype(s.dtype).itemsize / spec_shards(spec, axis_sizes)
    return total
