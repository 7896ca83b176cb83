"""Measured device speeds: a short timed run on every device (and every process).

One peak FLOP/s per device kind mispredicts real steps (attention vs matmul, memory-bound
layers, a busy neighbour), so whalex can time the actual work: by default a chain of FP32
matmuls, or the user's own loss and gradient on a small batch.

Timings are noisy, so a calibration a user can trust does three things:
- it times in interleaved rounds (device 0, 1, ..., n-1, then again), so that load from
  elsewhere on the machine hits every device alike instead of whichever device was being timed;
- it keeps, per device, the median speed over the rounds and its relative spread (a robust
  standard deviation: the interquartile range / 1.349, over the median; unlike the median
  absolute deviation it also sees two-valued timings, as when a busy core slows every other run);
- it merges speeds that differ by less than the noise (`group_speeds`): identical devices then get
  exactly equal speeds and the even plan, instead of a random uneven plan built on noise.

In a multi-process run each process times its own devices; medians and spreads are all-gathered
and grouped alike on every process, so every process plans alike.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from whalex.mesh.cluster import Cluster

IQR_TO_STD = 1.349           # the interquartile range of a normal sample, in units of its sigma
MIN_REPEATS = 3              # fewer rounds give no spread to speak of


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Per device: the median measured speed (FLOP/s, or work/s for a user loss) and its spread."""

    speeds: tuple[float, ...]
    spreads: tuple[float, ...]          # relative: 0.05 reads +-5%


@functools.lru_cache(maxsize=8)
def _matmul_work(n: int, chain: int):
    """The default work, jitted once per shape (repeated calibrations reuse the executables)."""
    def f(x):
        for _ in range(chain):
            x = jnp.tanh(x @ x) * 0.5
        return x
    return jax.jit(f), 2.0 * n ** 3 * chain


def _loss_work(loss_fn, params, batch):
    fn = jax.jit(jax.value_and_grad(loss_fn))
    cost = fn.lower(params, batch).cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return fn, float((cost or {}).get("flops", 1.0)) or 1.0


def time_rounds(devices: Sequence, fn, args, repeats: int) -> np.ndarray:
    """Seconds of `fn(*args)` per (round, device): every device warmed up, then `repeats` rounds
    that each time every device once, in turn, so that outside load hits all devices alike."""
    placed = [jax.device_put(args, d) for d in devices]
    for a in placed:
        jax.block_until_ready(fn(*a))                   # compile and warm up
    times = np.zeros((repeats, len(devices)))
    for r in range(repeats):
        for i, a in enumerate(placed):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            times[r, i] = time.perf_counter() - t0
    return times


def summarize(samples) -> Measurement:
    """Median and relative spread (IQR / 1.349 / median) per column of (round, device) speeds."""
    samples = np.asarray(samples, np.float64)
    if samples.ndim != 2 or samples.shape[0] < 1 or not np.all(samples > 0):
        raise ValueError(f"summarize needs positive speeds shaped (rounds, devices), got shape {samples.shape}.")
    med = np.median(samples, axis=0)
    q1, q3 = np.percentile(samples, [25, 75], axis=0)
    return Measurement(tuple(map(float, med)), tuple(map(float, (q3 - q1) / IQR_TO_STD / med)))


def group_speeds(speeds: Sequence[float], spreads: Sequence[float], tolerance: float = 0.1) -> tuple[float, ...]:
    """Speeds that differ by less than the noise, made equal.

    Sorted speeds a <= b next to each other are the same when (b - a) / a <= max(tolerance,
    noise_a + noise_b): their +-noise bands overlap, or they are within the floor `tolerance`.
    Runs of such neighbours form a group, and every member takes the group's median. Identical
    devices so get exactly equal speeds (the even plan); a device 2x slower than the others stays
    apart unless the noise is as large as the gap. A device's noise is its spread, but at least
    the median spread of all devices (the machine's noise level): a spread from a few rounds is
    itself noisy, and a device that happened to measure quietly should not split from its peers.
    """
    s = np.asarray(speeds, np.float64)
    e = np.asarray(spreads, np.float64)
    if s.ndim != 1 or e.shape != s.shape or s.size == 0:
        raise ValueError(f"group_speeds needs one spread per speed, got {s.size} speeds and {e.size} spreads.")
    if not (np.all(np.isfinite(s)) and np.all(s > 0) and np.all(np.isfinite(e)) and np.all(e >= 0)):
        raise ValueError(f"group_speeds needs positive speeds and non-negative spreads, got {s} and {e}.")
    if not tolerance >= 0:
        raise ValueError(f"tolerance is a relative gap (0.1 for 10%) and cannot be negative, got {tolerance}.")
    e = np.maximum(e, np.median(e))
    order = np.argsort(s, kind="stable")
    groups = [[order[0]]]
    for a, b in zip(order, order[1:]):
        if (s[b] - s[a]) / s[a] <= max(tolerance, e[a] + e[b]):
            groups[-1].append(b)
        else:
            groups.append([b])
    out = s.copy()
    for g in groups:
        out[g] = np.median(s[g])
    return tuple(map(float, out))


def _check(size: int, chain: int, repeats: int, tolerance: float, loss_fn, params, batch) -> None:
    if repeats < MIN_REPEATS:
        raise ValueError(f"calibrate needs repeats >= {MIN_REPEATS} timing rounds to measure a spread, got {repeats}.")
    if loss_fn is None and (size < 1 or chain < 1):
        raise ValueError(f"calibrate's matmul work needs size >= 1 and chain >= 1, got size={size}, chain={chain}.")
    if not tolerance >= 0:
        raise ValueError(f"tolerance is a relative gap (0.1 for 10%) and cannot be negative, got {tolerance}.")
    if loss_fn is not None and (params is None or batch is None):
        raise ValueError("calibrate(cluster, loss_fn, params, batch) times the loss on a small batch: pass params "
                         "and batch with loss_fn (or no loss_fn for the matmul work).")


def measure(cluster: Cluster, loss_fn: Callable | None = None, params=None, batch=None, *,
            size: int = 384, chain: int = 4, repeats: int = 7) -> Measurement:
    """Median speed and relative spread of every device of `cluster`, over `repeats` interleaved
    rounds (all processes' devices, all-gathered). No grouping: see `calibrate`."""
    if cluster.is_abstract:
        raise ValueError("calibrate() needs real devices; an abstract cluster has none to time.")
    _check(size, chain, repeats, 0.0, loss_fn, params, batch)
    if loss_fn is not None:
        fn, work = _loss_work(loss_fn, params, batch)
        args = (params, batch)
    else:
        fn, work = _matmul_work(size, chain)
        args = (jnp.asarray(np.random.default_rng(0).standard_normal((size, size)), jnp.float32) / size ** 0.5,)
    mine = [i for i, d in enumerate(cluster.devices) if d.process_index == jax.process_index()]
    local = summarize(work / time_rounds([cluster.devices[i] for i in mine], fn, args, repeats)) if mine \
        else Measurement((), ())                        # this process owns none of the cluster's devices
    both = np.zeros((2, cluster.size))                  # speeds, spreads; zero where another process times
    both[:, mine] = [local.speeds, local.spreads]
    if jax.process_count() > 1:
        both = np.asarray(multihost_utils.process_allgather(both)).reshape(jax.process_count(), 2, -1).sum(0)
    return Measurement(tuple(map(float, both[0])), tuple(map(float, both[1])))


def calibrate(cluster: Cluster, loss_fn: Callable | None = None, params=None, batch=None, *,
              size: int = 384, chain: int = 4, repeats: int = 7, tolerance: float = 0.1) -> Cluster:
    """The cluster with measured speeds (FLOP/s, or relative work/s for a user loss) and their spreads.

    With `loss_fn`, `params` and a small `batch`, times `value_and_grad(loss_fn)` on each device;
    else a chain of `size`x`size` matmuls. Speeds equal within the noise (or within `tolerance`,
    relative) are merged by `group_speeds`, so identical devices give the even plan.
    """
    _check(size, chain, repeats, tolerance, loss_fn, params, batch)
    m = measure(cluster, loss_fn, params, batch, size=size, chain=chain, repeats=repeats)
    return cluster.with_speeds(group_speeds(m.speeds, m.spreads, tolerance), spread=m.spreads)
