"""What a data-parallel step costs a device beyond its own loss, gradient and update: placing its block
of the batch from the host, launching the step, and the gradient all-reduce's local work when it is
the last device to reach it (the step's critical path when it bounds the step).

A calibration times each device's own work alone; in the step, a device whose host is slower (or
busier) places and launches later, and a device that reaches the all-reduce last does its part of it
with no slack, where a device that waited has done its sends before. `time_extras` times, per device
`who`, one global program in interleaved rounds, three ways: `who` alone runs a fixed chain of matmuls
(the others idle); the same with every device's block of the step's rows placed from the host before
the call; and that with a buffer the size of the gradients all-reduced after the work. Their
differences are `who`'s extra seconds per step for the placement and for the all-reduce.

A balanced plan moves a device's arrival, not the all-reduce: what a device does once its peers' data
reaches it (the reduction, the second phase) follows the last arrival whichever device that is, and
only its leading part (its first sends) is done early by a device given fewer rows. So the balance
adds to a device's fixed time its placement and `REDUCE_LEAD` of its all-reduce extra (`step_extra`),
beyond the least-paying device's.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = "extras"
REDUCE_LEAD = 0.5    # of a device's all-reduce extra, the part a plan can move before its peers arrive
WORK = (512, 8)      # the work before the all-reduce, `chain` tanh(x @ x) of (n, n): long enough that a
                    # device sharing its core (a CPU quota, busy neighbours) reaches its steady pace


def _programs(devices: tuple, elements: int):
    """(with_reduce, work_only) jitted over `devices`: (who, x, grads, blocks) -> per-device output."""
    mesh = Mesh(np.array(devices), (AXIS,))
    chain = WORK[1]

    def work(x):
        for _ in range(chain):
            x = jnp.tanh(x @ x) * 0.5
        return x

    def body(reduce, who, x, grads, *blocks):
        y = jax.lax.cond(jax.lax.axis_index(AXIS) == who[0], work, lambda v: v, x)
        touched = sum((b.reshape(-1)[:1].astype(jnp.float32) for b in blocks), jnp.zeros((1,), jnp.float32))
        g = grads + y[0, :1] + touched
        return jax.lax.psum(g, AXIS) if reduce else g

    def program(reduce, k):
        specs = (P(), P(), P(AXIS)) + (P(AXIS),) * k
        return jax.jit(jax.shard_map(functools.partial(body, reduce), mesh=mesh, in_specs=specs,
                                     out_specs=P(AXIS), check_vma=False))
    return mesh, program


def gradient_elements(params) -> int:
    """The float32 elements of a buffer as large (in bytes) as the parameters' gradients."""
    def nbytes(x):              # from the leaf's dtype: a device array is not copied to the host for it
        return int(np.size(x)) * np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype).itemsize
    return max(1, sum(nbytes(x) for x in jax.tree.leaves(params)) // 4)


def time_extras(devices: Sequence, params, batch, block: int, repeats: int) -> np.ndarray:
    """Per device of `devices` (every process's, in the cluster's order), [k, 2]: the median extra seconds
    of a step with `block` rows of `batch` placed on every device from the host over the same work
    without, and of one in which it is also the last to reach the all-reduce over the placement alone
    (`repeats` interleaved rounds). Every process calls it; one that holds none of `devices` only joins
    the barriers."""
    devices = tuple(devices)
    k = len(devices)
    mine = np.asarray([d.process_index == jax.process_index() for d in devices])
    runs = _runs(devices, params, batch, block) if mine.any() else None
    times = np.zeros((repeats, k, 3))
    sync = multihost_utils.sync_global_devices if jax.process_count() > 1 else (lambda name: None)
    for r in range(repeats):
        for i in np.roll(np.arange(k), -r):
            for j in range(3):
                sync(f"whalex extras {r} {i} {j}")
                if runs is not None:
                    t0 = time.perf_counter()
                    jax.block_until_ready(runs[j](i))
                    times[r, i, j] = time.perf_counter() - t0
    extra = np.stack([np.median(times[..., 1] - times[..., 2], axis=0),        # the placement
                      np.median(times[..., 0] - times[..., 1], axis=0)], axis=1)     # the all-reduce, last
    extra = np.where(mine[:, None], extra, 0.0)
    if jax.process_count() > 1:
        extra = np.asarray(multihost_utils.process_allgather(extra)).reshape(jax.process_count(), k, 2).sum(0)
    return extra


def _runs(devices: tuple, params, batch, block: int) -> tuple:
    """(placed and all-reduced, placed, control): each `run(who)` launches one step of its program,
    compiled and warmed up."""
    elements = gradient_elements(params)
    mesh, program = _programs(devices, elements)
    host = [np.asarray(x[:block]) for x in jax.tree.leaves(batch)]     # only the block's rows to the host
    reduce_fn, work_fn = program(True, len(host)), program(False, len(host))
    rep, shard, k = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS)), len(devices)
    x = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((WORK[0],) * 2), jnp.float32)
                       / WORK[0] ** 0.5, rep)
    grads = jax.make_array_from_callback((k * elements,), shard, lambda idx: np.zeros(elements, np.float32))

    def place():                    # every device's block from the host, as the step places its batch
        return [jax.make_array_from_callback((k * len(h), *h.shape[1:]), shard, lambda idx, h=h: np.array(h))
                for h in host]
    placed = place()
    whos = [jax.device_put(np.asarray([i], np.int32), rep) for i in range(k)]
    runs = (lambda i: reduce_fn(whos[i], x, grads, *place()), lambda i: work_fn(whos[i], x, grads, *place()),
            lambda i: work_fn(whos[i], x, grads, *placed))
    for run in runs:
        jax.block_until_ready(run(0))                       # compile and warm up
    return runs


def beyond_least(extras: Sequence[float] | np.ndarray, groups: Sequence[Sequence[int]]) -> np.ndarray:
    """Each device's extra seconds beyond the least-paying device's (never negative), every member of a
    group of alike devices given the group's median: what a balanced plan adds to its fixed time."""
    e = np.asarray(extras, np.float64).copy()
    for g in groups:
        e[list(g)] = np.median(e[list(g)])
    return np.maximum(e - e.min(), 0.0)


def with_extras(devices: Sequence, params, batch, speeds, overheads, groups, repeats: int) -> np.ndarray:
    """Fixed times (None: none measured) with each device's `step_extra` beyond the least-paying device's
    added, its block the largest share a balanced plan would give by speed."""
    n = jax.tree.leaves(batch)[0].shape[0]
    block = int(np.ceil(n * np.max(speeds) / np.sum(speeds)))
    fixed = np.zeros(len(devices)) if overheads is None else np.asarray(overheads, np.float64)
    return fixed + beyond_least(step_extra(time_extras(devices, params, batch, block, repeats)), groups)


def step_extra(extras) -> np.ndarray:
    """Per device, from `time_extras`' [placement, all-reduce] seconds: what moves its arrival at the
    all-reduce, the placement and the all-reduce's leading part (`REDUCE_LEAD`)."""
    e = np.asarray(extras, np.float64)
    return e[:, 0] + REDUCE_LEAD * e[:, 1]
