"""Measured device speeds: a short timed run on every device (and every process).

One peak FLOP/s per device kind mispredicts real steps (attention vs matmul, memory-bound
layers, a busy neighbour), so whalex can time the actual work: by default a chain of FP32
matmuls, or the user's own loss and gradient on a batch.

Timings are noisy, so a calibration a user can trust:
- it times in interleaved rounds (device 0, 1, ..., n-1, then again), so that load from
  elsewhere on the machine hits every device alike instead of whichever device was being timed;
- it keeps, per device, the median speed over the rounds and its relative spread (a robust
  standard deviation: the interquartile range / 1.349, over the median; unlike the median
  absolute deviation it also sees two-valued timings, as when a busy core slows every other run);
- it merges speeds that differ by less than the noise (`group_speeds`): identical devices then get
  exactly equal speeds and the even plan, instead of a random uneven plan built on noise;
- a split must show twice: when devices differ, they are timed again and each keeps the faster of
  its two medians, so a device slowed by a burst of load during one measurement rejoins its peers;
- it splits a user step's time into fixed seconds and seconds per row only where the per-row time
  stands above the noise on every device (`resolved`); otherwise, with a warning, it counts the
  whole time as work, the same way on every device, rather than mixing two estimates.

In a multi-process run each process times its own devices; medians and spreads are all-gathered
and grouped alike on every process, so every process plans alike.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import time
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

from whalex.balance.algorithm import proportional
from whalex.balance.batch_rows import check_global_batch, fractions, micro_part, resized
from whalex.balance.head_timing import split_heads, time_head
from whalex.balance.link_timing import time_links
from whalex.balance.step_timing import with_extras
from whalex.balance.timed_work import loss_work, matmul_work, plan_chunk
from whalex.mesh.cluster import Cluster

IQR_TO_STD = 1.349           # the interquartile range of a normal sample, in units of its sigma
MIN_REPEATS = 3              # fewer rounds give no spread to speak of


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Per device: the median measured speed (FLOP/s, or work/s for a user loss), its spread, and, for a
    user loss timed at several batch sizes, the fixed seconds per step that do not grow with the rows."""

    speeds: tuple[float, ...]
    spreads: tuple[float, ...]          # relative: 0.05 reads +-5%
    overheads: tuple[float, ...] | None = None
    # the whole step's speed at the batch's rows and its spread: which devices are alike is decided on
    # these (one timing, far less noisy than a slope, which is a difference of two timings)
    step_speeds: tuple[float, ...] | None = None
    step_spreads: tuple[float, ...] | None = None


def time_rounds(devices: Sequence, fn, args, repeats: int, sync: Callable[[str], None] | None = None) -> np.ndarray:
    """Seconds of `fn(*args)` per (round, device): every device warmed up, then `repeats` rounds
    that each time every device once, in turn, so that outside load hits all devices alike; each
    round starts one device later than the last, so that load recurring with the rounds' period
    does not fall on the same device every round.
    `args` may be a list of argument tuples: then each round times each of them on each device, and
    the result is shaped (round, device, argument set); or a list with one such list per device (each
    device its own sets, as many on every device). `sync(name)`, where given, runs before each timing
    (a barrier of every process, so that their devices are timed together, as a step runs them)."""
    per_device = isinstance(args, list) and bool(args) and isinstance(args[0], list)
    many = isinstance(args, list)
    sets = args if per_device else [args if many else [args]] * len(devices)
    placed = [[jax.device_put(a, d) for a in own] for d, own in zip(devices, sets)]
    for own in placed:
        for a in own:
            jax.block_until_ready(fn(*a))               # compile and warm up
    times = np.zeros((repeats, len(devices), len(placed[0]) if placed else 0))
    with _no_gc():
        for r in range(repeats):
            for i in np.roll(np.arange(len(placed)), -r):
                for j, a in enumerate(placed[i]):
                    if sync is not None:
                        sync(f"whalex calibrate {r} {j}")
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(*a))
                    times[r, i, j] = time.perf_counter() - t0
    return times if many else times[:, :, 0]


@contextlib.contextmanager
def _no_gc():
    """Python's garbage collector off while timing (as `timeit` does): a collection of a large heap
    (a notebook's, a test session's) inside one device's timing would make that device look slower
    than its identical peers. (Seen once in the test suite, cause not pinned down: one of 8 identical
    CPU devices calibrated at 1/8 of the others' speed over 3 rounds.)"""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def affine(rows, times: np.ndarray, work_per_row: float) -> tuple[Measurement, np.ndarray]:
    """Speeds and fixed times from (round, device, size) timings at two or more row counts: `rows`
    (size,), the same counts on every device, or (device, size), each device's own.

    Per device, the least-squares line through the median seconds at each row count gives seconds
    per row (the slope) and fixed seconds (the intercept, at least 0); speed = work per row / slope.
    Medians first, then the fit: one slow round at any size would move that round's line a long
    way. The spread is that of the per-round slopes (what one round would say). A slope that noise
    made non-positive counts the whole time as work (no fixed part), and so does a line whose
    intercept is negative: the time grew faster than the rows (a step whose data no longer fits the
    caches at the larger counts), where the slope would overstate the time per row at the batch's
    rows. Also returns the per-round fixed seconds."""
    x, t = np.asarray(rows, np.float64), np.asarray(times, np.float64)

    def line(t):                                                        # (..., size) -> (slope, fixed)
        slope = _slopes(x, t)
        fixed = t.mean(-1) - slope * x.mean(-1)
        ok = (slope > 0) & (fixed >= 0)
        return np.where(ok, slope, t[..., -1] / x[..., -1]), np.where(ok, fixed, 0.0)

    slope, fixed = line(t)
    mslope, mfixed = line(np.median(t, axis=0))                         # (device, size)
    spreads = summarize(work_per_row / slope).spreads
    return Measurement(tuple(map(float, work_per_row / mslope)), spreads, tuple(map(float, mfixed))), fixed


def _slopes(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Least-squares seconds per row of timings `t` (..., size) at row counts `x` ((size,) or, per
    device, (device, size))."""
    dx = x - x.mean(-1, keepdims=True)
    return ((t - t.mean(-1, keepdims=True)) * dx).sum(-1) / (dx * dx).sum(-1)


def resolved(rows, times: np.ndarray) -> np.ndarray:
    """Per device: whether the per-row time stands above the noise, i.e. the rounds' fitted slopes
    are positive in at least three rounds of four (their first quartile is positive). A tiny step
    whose time is nearly all fixed fails this: its slope is noise of either sign."""
    return np.percentile(_slopes(np.asarray(rows, np.float64), np.asarray(times, np.float64)), 25, axis=0) > 0


def summarize(samples) -> Measurement:
    """Median and relative spread (IQR / 1.349 / median) per column of (round, device) speeds."""
    samples = np.asarray(samples, np.float64)
    if samples.ndim != 2 or samples.shape[0] < 1 or not np.all(samples > 0):
        raise ValueError(f"summarize needs positive speeds shaped (rounds, devices), got shape {samples.shape}.")
    med = np.median(samples, axis=0)
    q1, q3 = np.percentile(samples, [25, 75], axis=0)
    return Measurement(tuple(map(float, med)), tuple(map(float, (q3 - q1) / IQR_TO_STD / med)))


def group_speeds(speeds: Sequence[float], spreads: Sequence[float], tolerance: float = 0.1) -> tuple[float, ...]:
    """Speeds that differ by less than the noise, made equal: each member of a `speed_groups` group
    takes the group's median."""
    out = np.asarray(speeds, np.float64).copy()
    for g in speed_groups(speeds, spreads, tolerance):
        out[g] = np.median(out[g])
    return tuple(map(float, out))


def speed_groups(speeds: Sequence[float], spreads: Sequence[float], tolerance: float = 0.1) -> list[list[int]]:
    """The devices whose speeds differ by less than the noise, in groups (indices).

    Sorted speeds a <= b next to each other are the same when (b - a) / a <= max(tolerance,
    noise_a + noise_b): their +-noise bands overlap, or they are within the floor `tolerance`.
    Runs of such neighbours form a group, and `group_speeds` gives every member the group's median. Identical
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
    return [sorted(int(i) for i in g) for g in groups]


def _groups(m: Measurement, tolerance: float) -> list[list[int]]:
    """`speed_groups` of a measurement: with a split into fixed and per-row time, devices are alike
    when their whole steps at the batch's rows are (one timing, far less noisy than a slope)."""
    if m.step_speeds is not None:
        return speed_groups(m.step_speeds, m.step_spreads, tolerance)
    return speed_groups(m.speeds, m.spreads, tolerance)


def faster(a: Measurement, b: Measurement) -> Measurement:
    """Per device, every field of whichever of two measurements timed it faster (its whole step, when
    measured, else its speed): the better of two medians, as `timeit` keeps the best of its repeats,
    since load from elsewhere only ever slows a device down."""
    if (a.overheads is None) != (b.overheads is None):      # one split off a fixed time, one could not:
        a, b = _whole(a), _whole(b)                         # both count the whole step as work
    key_a, key_b = (a.step_speeds, b.step_speeds) if a.step_speeds is not None else (a.speeds, b.speeds)
    pick = [y > x for x, y in zip(key_a, key_b)]
    fields = {}
    for f in dataclasses.fields(Measurement):
        va, vb = getattr(a, f.name), getattr(b, f.name)
        fields[f.name] = None if va is None else tuple(y if p else x for x, y, p in zip(va, vb, pick))
    return Measurement(**fields)


def _whole(m: Measurement) -> Measurement:
    """The measurement with the whole step's time counted as work (no fixed time), as `measure`
    returns it when the per-row time is below the noise."""
    return m if m.step_speeds is None else Measurement(m.step_speeds, m.step_spreads)


def _check(size: int, chain: int, repeats: int, tolerance: float, loss_fn, params, batch, optimizer,
           global_batch=None) -> None:
    if repeats < MIN_REPEATS:
        raise ValueError(f"calibrate needs repeats >= {MIN_REPEATS} timing rounds to measure a spread, got {repeats}.")
    if loss_fn is None and (size < 1 or chain < 1):
        raise ValueError(f"calibrate's matmul work needs size >= 1 and chain >= 1, got size={size}, chain={chain}.")
    if not tolerance >= 0:
        raise ValueError(f"tolerance is a relative gap (0.1 for 10%) and cannot be negative, got {tolerance}.")
    if loss_fn is not None and (params is None or batch is None):
        raise ValueError("calibrate(cluster, loss_fn, params, batch) times the loss on a batch: pass params "
                         "and batch with loss_fn (or no loss_fn for the matmul work).")
    if optimizer is not None and loss_fn is None:
        raise ValueError("calibrate(..., optimizer=) times the user's step (loss, gradient and update): pass loss_fn, "
                         "params and a batch with it.")
    if optimizer is not None and not isinstance(optimizer, optax.GradientTransformation):
        raise ValueError(f"calibrate's optimizer must be an optax.GradientTransformation, "
                         f"got {type(optimizer).__name__}.")
    if global_batch is not None:
        check_global_batch(global_batch, loss_fn, batch)


def _own(shares: Sequence[int], n: int) -> tuple[tuple[int, int, int], ...]:
    """Per device, three row counts around its own share of an `n`-row batch (a little beyond each
    side, at least two of them distinct)."""
    out = []
    for share in shares:
        k = min(max(int(share), 1), n)
        lo, hi = max(1, min(int(0.8 * k), k - 1)), min(n, max(int(np.ceil(1.25 * k)), k + 1))
        out.append((lo, k, hi))
    return tuple(out)


def _row_work(flops: Callable, counts: Sequence[int], parts: Sequence) -> float:
    """The work (FLOPs, by `flops`) of one row of the step, between its first and last batch `parts`
    of `counts` rows: the unit of every speed a calibration measures."""
    return max(flops(parts[-1]) - flops(parts[0]), 0.0) / (counts[-1] - counts[0]) or 1.0


def _shares(batch, per_row: float, speeds, overheads) -> list[int]:
    """The rows per device a balanced plan gives for these speeds (work/s) and fixed seconds."""
    n = jax.tree.leaves(batch)[0].shape[0]
    return proportional(n, [s / per_row for s in speeds], overheads)


def _fixed_at_own_shares(again, batch, per_row, speeds, overheads, groups):
    """(speeds, fixed seconds, rows timed per device) with every device timed again around the share the balanced
    plan gives it, all devices together (`measure(own_rows=...)`): each then runs about as long as the
    others while timed, as in the step, rather than alone once the faster ones are done; and each runs
    its rows in the parts the uneven plan would run them in (`plan_chunk`), since a device's time per
    row differs between one pass over its share and the plan's loop of parts (a fast device's large
    share leaves the caches in one pass, not in parts). The per-row time stays the wide fit's (a slope
    over a narrow range of rows is noise); the fixed time is what makes the line meet the step's time
    at the device's own rows, and where that would take a negative fixed time (the parts run faster
    per row than the wide fit's passes), the line through that time and no fixed time. Where the
    narrow range resolves no slope, the line meets the step's time at the largest of its rows.
    The timing runs twice and each device keeps the faster (`faster`), as the wide measurement does: a
    device sharing its core can keep a slower pace through a whole timing than it keeps in the step."""
    n = jax.tree.leaves(batch)[0].shape[0]
    shares = _shares(batch, per_row, speeds, overheads)
    own = _own(shares, n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = faster(*(again(own_rows=own, chunk=plan_chunk(n, speeds, shares)) for _ in range(2)))
    if m.overheads is None:                     # no slope over the narrow range: the whole step at the top
        x = np.asarray([r[-1] for r in own], np.float64)
        at = x * per_row / np.asarray(m.speeds)
    else:                                       # where each device's line is pinned
        x = np.mean(np.asarray(own, np.float64), axis=1)
        at = np.asarray(m.overheads) + x * per_row / np.asarray(m.speeds)
    fixed = at - x * per_row / speeds
    speeds = np.where(fixed < 0, x * per_row / at, speeds)          # faster per row there: no fixed time
    fixed = np.maximum(fixed, 0.0)
    for g in groups:
        fixed[g], speeds[g] = np.median(fixed[g]), np.median(speeds[g])
    return speeds, fixed, own


def _inside(own: Sequence[Sequence[int]], shares: Sequence[int]) -> bool:
    """Whether every device's share lies within the rows it was timed at."""
    return all(r[0] <= k <= r[-1] for r, k in zip(own, shares))


def _grouped(m: Measurement, groups) -> tuple[np.ndarray, np.ndarray | None]:
    """(speeds, fixed times or None) of a measurement, each group's members given the group's medians."""
    speeds, overheads = np.asarray(m.speeds), None if m.overheads is None else np.asarray(m.overheads)
    for g in groups:
        speeds[g] = np.median(speeds[g])
        if overheads is not None:
            overheads[g] = np.median(overheads[g])
    return speeds, overheads


def measure(cluster: Cluster, loss_fn: Callable | None = None, params=None, batch=None, *, optimizer=None,
            size: int = 384, chain: int = 4, repeats: int = 7, rows: Sequence[int] | None = None,
            own_rows: Sequence[Sequence[int]] | None = None, chunk: int | None = None) -> Measurement:
    """Median speed and relative spread of every device of `cluster`, over `repeats` interleaved
    rounds (all processes' devices, all-gathered). No grouping: see `calibrate`.

    With a loss, each round times the user's step (value_and_grad; with `optimizer`, also its update)
    at a quarter, half and all of the batch's rows: the fitted line's slope is the speed, its
    intercept the device's fixed seconds per step (`Measurement.overheads`); `rows` times other
    counts of the batch's rows instead, and `own_rows` each device at its own counts (as many on
    each). Processes with as many devices each time them together (a barrier before each timing)."""
    if cluster.is_abstract or cluster.compile_only:
        raise ValueError("calibrate() needs real devices; an abstract cluster (or a gpu_topology one) has none "
                         "to time.")
    _check(size, chain, repeats, 0.0, loss_fn, params, batch, optimizer)
    mine = [i for i, d in enumerate(cluster.devices) if d.process_index == jax.process_index()]
    devices = [cluster.devices[i] for i in mine]
    sized = fractions(batch, rows) if loss_fn is not None else None
    sync = None
    if jax.process_count() > 1:
        # one collective while every process is here: on CPU, the first collective sets up Gloo's
        # context and gives up after 30 s, and a slow device's timings end far later than a fast one's
        multihost_utils.sync_global_devices("whalex calibrate")
        counts = np.bincount([d.process_index for d in cluster.devices], minlength=jax.process_count())
        sync = multihost_utils.sync_global_devices if len(set(counts.tolist())) == 1 else None
    table = None                                        # (quantity, device) rows, this process's columns
    if loss_fn is not None and sized is not None:
        table = _timed_affine(devices, mine, loss_fn, params, batch, optimizer, sized, own_rows, repeats, sync, chunk)
    elif loss_fn is not None and mine:
        fn, lead, flops = loss_work(loss_fn, params, optimizer)
        m = summarize((flops(batch) or 1.0) / time_rounds(devices, fn, (*lead, batch), repeats, sync=sync))
        table = [m.speeds, m.spreads]
    elif mine:
        fn, work = matmul_work(size, chain)
        args = (jnp.asarray(np.random.default_rng(0).standard_normal((size, size)), jnp.float32) / size ** 0.5,)
        m = summarize(work / time_rounds(devices, fn, args, repeats, sync=sync))
        table = [m.speeds, m.spreads]
    full = np.zeros((6 if sized is not None else 2, cluster.size))   # zero where another process times
    if table is not None:
        full[:, mine] = table
    if jax.process_count() > 1:
        full = np.asarray(multihost_utils.process_allgather(full)).reshape(jax.process_count(), len(full), -1).sum(0)
    if sized is None:
        return Measurement(tuple(map(float, full[0])), tuple(map(float, full[1])))
    if np.all(full[5] > 0):
        return Measurement(*(tuple(map(float, r)) for r in (*full[:3], full[3], full[4])))
    timed = sized[0] if own_rows is None else sorted({k for r in own_rows for k in r})
    warnings.warn(f"calibrate: at {', '.join(map(str, timed))} rows the step took about as long either way on "
                  f"{int(np.sum(full[5] == 0))} of {cluster.size} devices (its time is nearly all fixed, or the "
                  "timings are noisy), so the per-row time and the fixed time cannot be told apart; every "
                  "device's whole step time counts as work instead (no fixed time). Pass a larger batch to "
                  "calibrate to measure the fixed time.", stacklevel=3)
    return Measurement(tuple(map(float, full[3])), tuple(map(float, full[4])))


def _timed_affine(devices, mine, loss_fn, params, batch, optimizer, sized, own_rows, repeats, sync,
                  chunk=None) -> list | None:
    """This process's columns of `measure`'s table for a user step timed at several row counts (the
    shared counts of `sized`, or each device's `own_rows`): fitted speeds, spreads and fixed times,
    then the whole step's speed at the largest count and its spread, and whether the slope resolved."""
    if not mine:
        return None
    fn, lead, flops = loss_work(loss_fn, params, optimizer, chunk)
    rows, parts = sized
    per_row = _row_work(flops, rows, parts)
    if own_rows is None:
        x = np.asarray(rows, np.float64)
        t = time_rounds(devices, fn, [(*lead, b) for b in parts], repeats, sync=sync)
    else:
        x = np.asarray([own_rows[i] for i in mine], np.float64)
        sets = [[(*lead, jax.tree.map(lambda v, k=int(k): v[:k], batch)) for k in own_rows[i]] for i in mine]
        t = time_rounds(devices, fn, sets, repeats, sync=sync)
    split, total = affine(x, t, per_row)[0], summarize(per_row * x[..., -1] / t[..., -1])
    return [split.speeds, split.spreads, split.overheads, total.speeds, total.spreads, resolved(x, t)]


def _fitted(again, loss_fn, params, batch, optimizer, micro, m, groups):
    """Each group's speed and fixed time from the measurement `m`, set at the devices' own shares
    where they differ and no pipeline's micro-batch was timed (once more around the shares that sets,
    where they left the rows timed: a fixed time read at a share's rows, not extrapolated far from
    them), and the batch's rows they were timed between (None without a loss)."""
    speeds, overheads = _grouped(m, groups)
    sized = fractions(batch) if loss_fn is not None else None
    counts = None if sized is None else (micro, micro) if micro is not None else sized[0]
    if overheads is not None and len(groups) > 1 and micro is None:
        per_row = _row_work(loss_work(loss_fn, params, optimizer)[2], counts, fractions(batch, counts)[1])
        speeds, overheads, own = _fixed_at_own_shares(again, batch, per_row, speeds, overheads, groups)
        if not _inside(own, _shares(batch, per_row, speeds, overheads)):     # the pin moved a share off its rows
            speeds, overheads, own = _fixed_at_own_shares(again, batch, per_row, speeds, overheads, groups)
        counts = (min(r[0] for r in own), max(r[-1] for r in own))
    rows = None if counts is None else (counts[0] if overheads is not None else counts[-1], counts[-1])
    return speeds, overheads, rows


def calibrate(cluster: Cluster, loss_fn: Callable | None = None, params=None, batch=None, *, optimizer=None,
              size: int = 384, chain: int = 4, repeats: int = 7, tolerance: float = 0.1,
              links: bool | None = None, global_batch: int | None = None, extras: bool | None = None,
              num_micro_batch: int | None = None, head: bool | None = None) -> Cluster:
    """The cluster with measured speeds (FLOP/s, or relative work/s for a user loss) and their spreads.

    With `loss_fn`, `params` and a `batch`, times the user's step on each device (value_and_grad,
    and the update of `optimizer` when given) at a quarter, half and all of the batch's rows: speeds
    from the time per row, and each device's fixed time per step (`Cluster.overhead`), which a
    balanced plan adds to every device's predicted time. Without a loss, a chain of `size`x`size`
    matmuls. Speeds equal within the noise (or within `tolerance`, relative) are merged by
    `group_speeds`, and so are the fixed times of the merged devices, so identical devices give the
    even plan; with a split into fixed and per-row time, devices are alike when their whole steps at
    the batch's rows are.

    A split must show twice: where the first measurement finds more than one group, each device keeps
    the faster of two measurements' medians (`faster`): a device slowed once by load rejoins its peers.

    Pass the batch the step will train on (or one as large): the fixed and per-row times are fitted
    between a quarter of its rows and all of them, where the plan's loads lie. When the devices
    differ, every device is timed once more at counts around the share a balanced plan would give it
    (`measure(own_rows=...)`), all devices together and in the parts the uneven plan runs its rows in,
    and its fixed time (or, where that would be negative, its speed) is set so that its line meets
    that timing (`_fixed_at_own_shares`): each device then runs about as long as the others while
    timed, as in the step, and nothing is extrapolated; where the shares those lines give leave the rows
    timed, every device is timed once more around them. The rows timed are kept (`Cluster.calibrated_rows`,
    which `plan.summary()` checks shares against); `global_batch` repeats a smaller batch's rows up to it.
    `extras`: when the devices differ, also time what a step costs each device beyond its own work
    (`step_timing`: its block placed, the launch, the all-reduce's local work when it comes last), added
    to its fixed time; None (the default) where the cluster spans processes. The rest of the whole
    step (the update, without `optimizer`) a refinement measures: `Config(hardware_aware="refine")`.
    `num_micro_batch`: the step is a pipeline's, whose stages each run one micro-batch of the batch's
    rows / `num_micro_batch` at a time (pass the plan's micro-batches times its data-parallel replicas
    per stage): each device runs the rows in micro-batches in one call, as a stage runs a step (a device
    sharing its core timed at its pace over a step); `extras` then defaults to off.
    `head`: unless False, where the devices differ and the loss has `wh.ops.softmax_cross_entropy_head`,
    also time that head's program (`head_timing`) at class splits around the rows' speeds: the fastest
    is kept as a scale on the slowest devices' speed (`Cluster.head_scale`) for the classes.
    `links`: also time a message between neighbouring devices (`link_timing.time_links`: its fixed
    seconds and bytes/s, on `Cluster.links`), what a pipeline's predicted exchanges then cost instead
    of the spec table's links. None (the default) times them where the cluster spans processes.
    """
    _check(size, chain, repeats, tolerance, loss_fn, params, batch, optimizer, global_batch)
    batch = resized(batch, global_batch)
    micro = micro_part(num_micro_batch, loss_fn, batch)
    again = functools.partial(measure, cluster, loss_fn, params, batch, optimizer=optimizer, size=size,
                              chain=chain, repeats=repeats, chunk=micro)
    first = again()
    m = first if len(_groups(first, tolerance)) < 2 else faster(first, again())
    groups = _groups(m, tolerance)
    speeds, overheads, rows = _fitted(again, loss_fn, params, batch, optimizer, micro, m, groups)
    if loss_fn is not None and len(groups) > 1 and (extras or extras is None and micro is None
                                                    and jax.process_count() > 1):
        overheads = with_extras(cluster.devices, params, batch, speeds, overheads, groups, repeats)
    out = cluster.with_speeds(speeds, spread=m.spreads, overhead=overheads, rows=rows)
    if loss_fn is not None and len(groups) > 1 and head is not False:
        out = _with_head(out, loss_fn, params, batch, repeats)
    if cluster.size > 1 and (links or links is None and jax.process_count() > 1):
        out = out.with_links(*time_links(cluster.devices, repeats))
    return out


def _with_head(cluster: Cluster, loss_fn, params, batch, repeats: int) -> Cluster:
    """The cluster with the head scale its loss's split head runs fastest at (the first head: a loss
    has one in practice), unchanged without one."""
    heads = split_heads(loss_fn, params, batch)
    if not heads:
        return cluster
    return cluster.with_head_scale(time_head(cluster.devices, heads[0], cluster.speeds, repeats)[0])
