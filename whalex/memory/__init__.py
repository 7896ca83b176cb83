"""Memory optimizations of the training state and their accounting: ZeRO, remat, precision, host
offload, and the predicted per-device peak.

`MemoryOptions` (a plain record, defined in `whalex.records.memory_options`) is what a program needs from
`wh.Config` to lay out and update its state; `plan_memory` turns a program's `StateLayout` (its
stored shapes, specs and options, never the program) into per-device bytes with each
optimization's share.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.extend.core import jaxpr_as_fun

from whalex.memory import zero
from whalex.memory.accounting import DeviceMemory, Share, sharded_bytes
from whalex.memory.opt_state_specs import opt_state_specs
from whalex.records.memory_options import MemoryOptions
from whalex.records.program import StateLayout

OFFLOADED = "offload to pinned_host"     # the `Share.by` of state kept in host memory between steps


def account(params: float, opt_state: float, params_zero: float, opt_zero: float, options: MemoryOptions,
            activations: float = 0.0):
    """Per-device bytes (params, grads, opt_state, host, shares) from the planned bytes without
    and with ZeRO sharding. `shares` lists (component, before, after, by) for each optimization
    that changed a component; offloaded state counts as host memory, not device memory."""
    level = options.zero_level
    shares = []
    p, g, o = params, params, opt_state
    if level >= 1 and opt_zero < o:
        shares.append(Share("optimizer state", o, opt_zero, "zero 1"))
        o = opt_zero
    if level >= 2 and params_zero < g:
        shares.append(Share("grads", g, params_zero, "zero 2"))
        g = params_zero
    if level >= 3 and params_zero < p:
        shares.append(Share("params", p, params_zero, "zero 3"))
        p = params_zero
    host = 0.0
    if options.offloads("opt_state") and o > 0:
        shares.append(Share("optimizer state", o, 0.0, OFFLOADED))
        host, o = host + o, 0.0
    if options.offloads("params") and p > 0:
        shares.append(Share("params", p, 0.0, OFFLOADED))
        host, p = host + p, 0.0
    return p, g, o, host, tuple(shares)


def residual_bytes(closed, num_params: int) -> float:
    """Bytes of the forward values the backward keeps (the vjp's residuals, minus the inputs) for
    one evaluation of the captured loss: the model's activation memory, found by tracing only."""
    avals = [v.aval for v in closed.jaxpr.invars]
    return vjp_residual_bytes(lambda *args: jaxpr_as_fun(closed)(*args)[0], avals, range(num_params))


def vjp_residual_bytes(fn, avals, diff) -> float:
    """Bytes of what `jax.vjp` of `fn(*args)` with respect to the floating args at positions `diff`
    keeps for the backward pass, besides the args themselves (traced with `jax.eval_shape`)."""
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    floating = [k for k in diff if jax.numpy.issubdtype(avals[k].dtype, jax.numpy.floating)]

    def residuals(*args):
        def f(*ps):
            full = list(args)
            for k, p in zip(floating, ps):
                full[k] = p
            return fn(*full)
        _, vjp = jax.vjp(f, *[args[k] for k in floating])
        inputs = {id(a) for a in args}
        return [r for r in jax.tree.leaves(vjp) if id(r) not in inputs]

    out = jax.eval_shape(residuals, *avals)
    return float(sum(np.prod(r.shape, dtype=np.float64) * np.dtype(r.dtype).itemsize for r in out))


def plan_memory(state: StateLayout, device_specs, activations=0.0):
    """`DeviceMemory` for every device of a plan whose program stores its state as `state`: bytes
    from its shardings without and with its memory options; `activations` is one number, one per
    device, or a function of none giving one number (called once, when a device's activations are
    first read)."""
    sizes = dict(state.axis_sizes)
    shapes = state.param_shapes
    specs, zspecs = list(state.param_specs), list(state.zero_specs)
    tree = lambda ss: jax.tree.unflatten(jax.tree.structure(shapes), list(ss))  # noqa: E731
    p, pz = sharded_bytes(shapes, tree(specs), sizes), sharded_bytes(shapes, tree(zspecs), sizes)
    o = oz = 0.0
    if state.optimizer is not None:
        ospecs, oshapes = opt_state_specs(state.optimizer, shapes, specs)
        o = sharded_bytes(oshapes, ospecs, sizes)
        ospecs, _ = opt_state_specs(state.optimizer, shapes, zspecs)
        oz = sharded_bytes(oshapes, ospecs, sizes)
    params, grads, opt, host, shares = account(p, o, pz, oz, state.memory)
    if callable(activations):
        activations = functools.cache(activations)          # one trace shared by every device
    acts = activations if isinstance(activations, (list, tuple)) else [activations] * len(device_specs)
    return tuple(DeviceMemory(i, s.name, params, grads, opt, float(s.memory_bytes), a if callable(a) else float(a),
                              host, shares)
                 for i, (s, a) in enumerate(zip(device_specs, acts)))


def with_peak(memory, peak) -> tuple:
    """`memory` whose activations are the rest of the predicted per-device peak: what the step holds
    at its peak beside params, gradients and optimizer state (activations, the batch, temporaries).
    `peak` is a function of none giving the step's `Peak` (called when activations are first read)."""
    return tuple(dataclasses.replace(d, activation_estimate=functools.partial(_rest, peak, d.state)) for d in memory)


def _rest(peak, state: float) -> float:
    return max(peak().total - state, 0.0)


def zero_sharded(state: StateLayout, paths) -> dict:
    """path -> (bytes per device as planned, ZeRO degree, ZeRO axes) for each stored leaf ZeRO
    divides."""
    sizes = dict(state.axis_sizes)
    out = {}
    for path, shape, spec, zspec in zip(paths, jax.tree.leaves(state.param_shapes), state.param_specs,
                                        state.zero_specs):
        n = zero.degree(spec, zspec, sizes)
        if n > 1:
            d = zero.zero_dim(spec, zspec)
            entry = list(zspec)[d]
            axes = tuple(entry) if isinstance(entry, tuple) else (entry,)
            out[path] = (sharded_bytes([shape], [spec], sizes), n, axes)
    return out
