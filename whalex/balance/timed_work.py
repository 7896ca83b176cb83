"""What a calibration times on each device: a chain of matmuls, or the user's step (the loss, its
gradient and the optimizer update), over the whole batch or in the parts an uneven data-parallel
plan runs a device's rows in, and the FLOPs that make its timings speeds."""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from whalex import _compat as C
from whalex.balance.cost import chunk_rows, speed_grain
from whalex.jaxpr.flops import training_flops


@functools.lru_cache(maxsize=8)
def matmul_work(n: int, chain: int):
    """The default work, jitted once per shape (repeated calibrations reuse the executables)."""
    def f(x):
        for _ in range(chain):
            x = jnp.tanh(x @ x) * 0.5
        return x
    return jax.jit(f), 2.0 * n ** 3 * chain


def step_flops(loss_fn, params, batch) -> float:
    """Forward + backward FLOPs of the loss and its gradient at `batch`, counted from its jaxpr
    (XLA's cost analysis has none on a GPU)."""
    jaxpr, _ = C.open_jaxpr(C.make_jaxpr(loss_fn, params, batch))
    n = len(jax.tree.leaves(params))
    return training_flops(jaxpr, [k < n for k in range(len(jaxpr.invars))],
                          [k == 0 for k in range(len(jaxpr.outvars))])


def in_parts(loss_fn, chunk: int) -> Callable:
    """value_and_grad of `loss_fn` over a batch run as an uneven data-parallel plan runs a device's
    rows: a `fori_loop` over its full `chunk`-row parts, then its remainder as one part (as a plan runs
    it where the devices' remainders are few distinct sizes); values and gradients summed. The work
    of the plan's loop (its per-part launches, its cache footprint), not its loss: what a calibration
    times so that a device's time at its share is the time the plan's step takes there."""
    grad = jax.value_and_grad(loss_fn)

    def run(params, batch):
        n = jax.tree.leaves(batch)[0].shape[0]
        full = n // chunk

        def part(off, size):
            return grad(params, jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, off, size, 0), batch))

        acc = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: part(0, min(chunk, n))))
        if full:
            acc = jax.lax.fori_loop(0, full, lambda k, a: jax.tree.map(jnp.add, a, part(k * chunk, chunk)), acc)
        if n % chunk:
            acc = jax.tree.map(jnp.add, acc, part(full * chunk, n % chunk))
        return acc
    return run


def loss_work(loss_fn, params, optimizer, chunk: int | None = None):
    """The local step to time, its leading arguments, and the FLOPs of the loss and gradient at a
    batch: value_and_grad (over `chunk`-row parts, `in_parts`, when given), then (with an optimizer)
    the update applied, as every device of a data-parallel step runs it."""
    value_and_grad = jax.value_and_grad(loss_fn) if chunk is None else in_parts(loss_fn, chunk)
    grad = jax.jit(value_and_grad)
    flops = functools.partial(step_flops, loss_fn, params)
    if optimizer is None:
        return grad, (params,), flops

    @jax.jit
    def step(params, opt_state, batch):
        loss, g = value_and_grad(params, batch)
        updates, opt_state = optimizer.update(g, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state
    return step, (params, jax.jit(optimizer.init)(params)), flops


def plan_chunk(n: int, speeds: Sequence[float], shares: Sequence[int]) -> int:
    """The rows of a full part of the uneven data-parallel plan that gives `shares` of an `n`-row
    batch to devices of these speeds (`whalex.planner.uneven`: `cost.speed_grain`, then
    `cost.chunk_rows`)."""
    return chunk_rows(shares, speed_grain(n, speeds))
