"""Measured device speeds: a short timed run on every device (and every process).

One peak FLOP/s per device kind mispredicts real steps (attention vs matmul, memory-bound
layers, a busy neighbour), so whalex can time the actual work: by default a chain of FP32
matmuls, or the user's own loss and gradient on a small batch. In a multi-process run each
process times its own devices and the results are all-gathered, so every process plans alike.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from whalex.mesh.cluster import Cluster


def _matmul_work(n: int, chain: int):
    def f(x):
        for _ in range(chain):
            x = jnp.tanh(x @ x) * 0.5
        return x
    return jax.jit(f), 2.0 * n ** 3 * chain


def time_on(device, fn, args, repeats: int) -> float:
    args = jax.device_put(args, device)
    jax.block_until_ready(fn(*args))                     # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate(cluster: Cluster, loss_fn: Callable | None = None, params=None, batch=None, *,
              size: int = 384, chain: int = 4, repeats: int = 7) -> Cluster:
    """The cluster with measured speeds (FLOP/s, or relative work/s for a user loss).

    With `loss_fn`, `params` and a small `batch`, times `value_and_grad(loss_fn)` on each device;
    else a chain of `size`x`size` matmuls.
    """
    if cluster.is_abstract:
        raise ValueError("calibrate() needs real devices; an abstract cluster has none to time.")
    if loss_fn is not None:
        fn = jax.jit(jax.value_and_grad(loss_fn))
        args = (params, batch)
        cost = fn.lower(*args).cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        work = float((cost or {}).get("flops", 1.0)) or 1.0
    else:
        fn, work = _matmul_work(size, chain)
        args = (jnp.asarray(np.random.default_rng(0).standard_normal((size, size)), jnp.float32) / size ** 0.5,)
    local = {}
    for i, d in enumerate(cluster.devices):
        if d.process_index == jax.process_index():
            local[i] = work / time_on(d, fn, args, repeats)
    speeds = np.zeros(cluster.size)
    for i, s in local.items():
        speeds[i] = s
    if jax.process_count() > 1:
        speeds = np.asarray(multihost_utils.process_allgather(speeds)).reshape(jax.process_count(), -1).sum(0)
    return cluster.with_speeds(speeds)
