"""Host offload of training state: arrays stored in `pinned_host` memory between steps.

The state shardings of an offloaded subtree carry `memory_kind="pinned_host"`; inside the step
the arrays are moved to device memory for the computation (`fetch`), and the jit's output
shardings move the new values back to the host. On CPU both kinds are host memory, so the moves
cost nothing there: tests check placement, not speed.

Parameters offloaded per layer (ZeRO-Offload style) are moved where a layer reads them
(`fetch_leaf`), inside the layer's checkpoint, whose policy (`not_fetched`) recomputes the move:
each layer's parameters are on the device while it runs forward and again while it runs backward,
not in between. The gradient is taken with respect to a zero `delta` added on the device, so it is
device-resident as the update wants; differentiating the host array itself would put the gradient
on the host.
"""
from __future__ import annotations

import jax
from jax.sharding import NamedSharding

from whalex import _compat as C

HOST = "pinned_host"
DEVICE = "device"


def _map(shardings, kind: str):
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings,
                        is_leaf=lambda x: isinstance(x, NamedSharding))


def on_host(shardings):
    """The same shardings in pinned host memory."""
    return _map(shardings, HOST)


def on_device(shardings):
    """The same shardings in device memory."""
    return _map(shardings, DEVICE)


def fetch(tree, shardings):
    """Inside a jitted step: `tree` (stored on the host) moved to device memory, same layout."""
    return jax.device_put(tree, on_device(shardings))


def fetch_leaf(host, delta, sharding):
    """Inside a layer's checkpoint: the host-stored parameter `host` in device memory (`sharding`'s
    layout), plus `delta` (zeros on the device: the gradient is taken with respect to it). The sum
    is JAX's `add_any`, which `not_fetched` recognises (XLA drops the zeros)."""
    return C.add_any(jax.device_put(host, sharding.with_memory_kind(DEVICE)), delta)


def not_fetched(prim, *args, **params) -> bool:
    """A checkpoint policy's veto: False for a fetch's moves and sums (recompute them: the
    parameter is fetched again for the backward pass), True for everything else."""
    return prim.name not in C.FETCH_PRIMITIVES


def derived_types(eqns, params: set, consts: set) -> frozenset:
    """The (shape, dtype) types of the parameters `params` and of the values `eqns` compute from them
    (and constants) alone: what a layer's checkpoint should recompute from the fetched parameters,
    not keep. A policy sees types, not values, so a type that any other value of the layer has (an
    activation, a sub-computation's value) is left out: that value is kept as usual."""
    derived, other = set(params), set()
    for eqn in eqns:
        ins = [v for v in eqn.invars if not isinstance(v, C.Literal)]
        if any(v in derived for v in ins) and all(v in derived or v in consts for v in ins):
            derived.update(eqn.outvars)
        else:
            other.update(v for v in ins if v not in derived and v not in consts)
            other.update(eqn.outvars)
            other.update(v for sub in C.sub_jaxprs(eqn) for v in _values(C.open_jaxpr(sub)[0]))
    kind = lambda v: (tuple(v.aval.shape), v.aval.dtype)          # noqa: E731
    return frozenset({kind(v) for v in derived} - {kind(v) for v in other})


def _values(jaxpr) -> set:
    out = set(jaxpr.invars) | set(jaxpr.outvars)
    for eqn in jaxpr.eqns:
        out.update(eqn.outvars)
        for sub in C.sub_jaxprs(eqn):
            out |= _values(C.open_jaxpr(sub)[0])
    return {v for v in out if not isinstance(v, C.Literal) and hasattr(v, "aval")}


def from_fetched(avals, derived: frozenset) -> bool:
    """Whether an equation with these input types computes from fetched parameters alone: every
    input that is not a scalar has a type in `derived` (`derived_types`)."""
    arrays = [a for a in avals if getattr(a, "shape", ())]
    return bool(arrays) and all((tuple(a.shape), a.dtype) in derived for a in arrays)


def fetch_per_leaf(devices: int) -> bool:
    """Whether offloaded state is fetched leaf by leaf as gradients are made (one device), or once every
    gradient is (gradients all-reduced over `devices` > 1: see `fetch_when_ready`)."""
    return devices == 1


def fetch_when_ready(opt_state, shardings, grads, per_leaf: bool = True):
    """Inside a jitted step: the offloaded optimizer state moved to device memory leaf by leaf, each
    leaf once the gradient it updates is computed (the leaf whose key path ends with that gradient's
    path and has its shape; any other leaf once every gradient is), or with `per_leaf=False` once
    every gradient is.

    Each move reads an `optimization_barrier` shared with its gradient, so XLA cannot start it before
    the backward pass has made that gradient: the state does not sit in device memory through the
    backward pass. Per leaf, the moves of the last layers' state overlap the backward of the first;
    where gradients are all-reduced across devices, a move waiting on one gradient makes XLA:GPU finish
    that all-reduce at once, with nothing to hide it, so there every move waits on every gradient and
    overlaps the update of the leaves before it instead."""
    grad_leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
    by_path = {tuple(path): g for path, g in grad_leaves}
    flat, tree = jax.tree_util.tree_flatten_with_path(opt_state)
    targets = jax.tree.leaves(on_device(shardings))
    gate = [g for _, g in grad_leaves]
    out = []
    for (path, leaf), target in zip(flat, targets):
        grad = _matching_grad(tuple(path), leaf, by_path) if per_leaf else None
        ready = jax.lax.optimization_barrier((leaf, grad if grad is not None else gate))[0]
        out.append(jax.device_put(ready, target))
    return jax.tree.unflatten(jax.tree.structure(opt_state), out)


def _matching_grad(path: tuple, leaf, by_path: dict):
    """The gradient whose key path is a suffix of `path` and whose shape is the leaf's, or None."""
    for k in range(len(path)):
        g = by_path.get(path[k:])
        if g is not None and getattr(g, "shape", None) == getattr(leaf, "shape", None):
            return g
    return None
