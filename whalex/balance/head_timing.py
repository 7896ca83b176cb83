"""What a calibration times for a split head's class split: the head's program itself, on every
device at once, at a few class splits around the rows' speeds; the split it runs fastest at is kept
as a scale on the slowest devices' speed (`Cluster.head_scale`), which the planner's class split
applies.

A split head (`wh.ops.softmax_cross_entropy_head`) runs on the whole batch's rows on every device,
each device its own classes, and meets the others three times (the logits' maxima, the softmax sums
and the input gradient): work a device's rows do not time (wider matmuls, the logits padded to the
widest share, the collectives' local work at the device's own pace). Timing each device's part alone
does not see where it waits, so the program is timed whole, as the step runs it, and a V fitted to
its times (`refine.vertex`) gives the split where neither side waits."""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from whalex import _compat as C
from whalex.balance.columns import plan_columns
from whalex.balance.refine import vertex
from whalex.columns import UnevenColumns, uneven_head
from whalex.mesh.cluster import scaled_speeds
from whalex.records.call_names import HEAD_NAME

AXIS = "head"
SCALES = (0.4, 0.55, 0.7, 0.85, 1.0, 1.15)     # the slowest devices' speed on the classes, relative to their rows'
MAX_ROUNDS = 27                                # the rounds timed, where they fit in SECONDS
SECONDS = 60.0                                 # the most the rounds last: a long program times fewer


@dataclasses.dataclass(frozen=True)
class HeadShape:
    """A `wh.ops.softmax_cross_entropy_head` call of the loss: its input's rows and features, its
    classes and the input's dtype."""

    rows: int
    features: int
    classes: int
    dtype: str


def split_heads(loss_fn, params, batch) -> tuple[HeadShape, ...]:
    """The loss's top-level softmax cross-entropy heads (the calls a split head shards by class)."""
    jaxpr, _ = C.open_jaxpr(C.make_jaxpr(loss_fn, params, batch))
    heads = []
    for eqn in jaxpr.eqns:
        if C.is_call(eqn) and str(eqn.params.get("name", "")) == HEAD_NAME:
            x, w = eqn.invars[0].aval, eqn.invars[1].aval
            if len(x.shape) == 2 and len(w.shape) == 2:
                heads.append(HeadShape(int(x.shape[0]), int(x.shape[1]), int(w.shape[1]), str(x.dtype)))
    return tuple(dict.fromkeys(heads))


def class_counts(classes: int, speeds: Sequence[float]) -> tuple[int, ...]:
    """Classes per device as the planner's class split gives them at `speeds` (memory not binding)."""
    n = len(speeds)
    return plan_columns(classes, speeds, [float("inf")] * n, 0.0, [str(i) for i in range(n)], one_matmul=True)[0].counts


def _program(devices: tuple, counts: tuple[int, ...], rows: int):
    """The split head the step runs (`whalex.columns.uneven_head`) over `devices`, device i at counts[i]
    classes of a padded [features, devices x width] kernel, with its gradients: (x, w, b, y) -> (loss,
    (dx, dw, db)), the loss the mean over `rows`."""
    mesh = Mesh(np.array(devices), (AXIS,))
    head = uneven_head(mesh, AXIS, (), UnevenColumns(counts, max(counts), 1), rows)
    return mesh, jax.jit(jax.value_and_grad(head, argnums=(0, 1, 2)))


def _arguments(mesh, head: HeadShape, width: int, n: int) -> tuple:
    rng = np.random.default_rng(0)
    host = (rng.standard_normal((head.rows, head.features)).astype(head.dtype) / head.features ** 0.5,
            (rng.standard_normal((head.features, n * width)) / 8).astype(head.dtype),
            np.zeros((n * width,), head.dtype), rng.integers(0, head.classes, head.rows).astype(np.int32))
    specs = (P(), P(None, AXIS), P(AXIS), P())
    return tuple(jax.make_array_from_callback(h.shape, NamedSharding(mesh, s), lambda idx, h=h: h[idx])
                 for h, s in zip(host, specs))


def drift_free_medians(times: np.ndarray) -> np.ndarray:
    """Per column of [rounds, splits] seconds, its median after each round is divided by the round's
    mean (so a round that ran slower throughout shifts no split), in seconds of the whole table's mean."""
    return np.median(times / times.mean(axis=1, keepdims=True), axis=0) * times.mean()


def rounds_for(round_seconds: float, repeats: int, seconds: float = SECONDS, most: int = MAX_ROUNDS) -> int:
    """How many rounds to time, given how long one round takes: `most`, or as many as fit in `seconds`
    where fewer do, at least `repeats`. Where a slow device shares its core, a split's time wanders
    by the scheduler's slices as much as neighbouring splits differ, so a few rounds leave the split
    kept to chance (a long program's too: its splits differ by as little); a program whose rounds
    do not fit wanders less by the slices, relative to its time."""
    fit = math.floor(seconds / round_seconds) if round_seconds > 0 else most
    return int(max(min(fit, most), repeats))


def counts_at(classes: int, speeds: Sequence[float], scale: float) -> tuple[int, ...]:
    """Classes per device with the slowest devices' speed on the classes `scale` times their rows'."""
    return class_counts(classes, scaled_speeds(speeds, scale)[0])


def distinct_splits(classes: int, speeds: Sequence[float], scales: Sequence[float]) -> dict[float, tuple[int, ...]]:
    """{scale: classes per device} for the first of `scales` (on the slowest devices' speed) to give each
    distinct class split: scales whose splits round alike are one program, timed once."""
    splits = {}
    for s in scales:
        counts = counts_at(classes, speeds, s)
        if counts not in splits.values():
            splits[float(s)] = counts
    return splits


def head_rounds(devices: Sequence, head: HeadShape, speeds: Sequence[float], repeats: int,
                scales: Sequence[float] = SCALES, seconds: float = SECONDS) -> tuple[tuple[float, ...], np.ndarray]:
    """(the scales timed, seconds [rounds, scales]): every distinct class split of `scales` compiled
    and run twice, then `rounds_for` rounds (the second runs' longest round on any process) timing
    each split once in turn, every other round in reverse (every process calls them in the same
    order and as often)."""
    devices, runs = tuple(devices), {}
    for s, counts in distinct_splits(head.classes, speeds, scales).items():
        mesh, fn = _program(devices, counts, head.rows)
        args = _arguments(mesh, head, max(counts), len(devices))
        jax.block_until_ready(fn(*args))                    # compile and warm up
        runs[s] = functools.partial(fn, *args)
    t0 = time.perf_counter()
    for run in runs.values():
        jax.block_until_ready(run())
    once = np.asarray([time.perf_counter() - t0])
    if jax.process_count() > 1:                             # one count for every process
        once = np.asarray(multihost_utils.process_allgather(once))
    rounds = rounds_for(float(np.max(once)), repeats, seconds)
    times = np.zeros((rounds, len(runs)))
    for r in range(rounds):
        order = list(enumerate(runs.values()))
        for j, run in order if r % 2 == 0 else order[::-1]:    # drift within a round falls on both ends alike
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            times[r, j] = time.perf_counter() - t0
    return tuple(runs), times


def kept_scale(scales: Sequence[float], times: np.ndarray) -> tuple[float, list[tuple[float, float]]]:
    """(the scale kept, [(scale, median seconds)]) from `head_rounds`' table: the medians taken free
    of drift (`drift_free_medians`) and averaged over processes (one decision for every process), then
    `decided`."""
    seconds = drift_free_medians(times)
    if jax.process_count() > 1:
        seconds = np.asarray(multihost_utils.process_allgather(seconds)).reshape(jax.process_count(), -1).mean(0)
    return decided(scales, seconds)


def decided(scales: Sequence[float], seconds: Sequence[float]) -> tuple[float, list[tuple[float, float]]]:
    """(the scale kept, [(scale, median seconds)]): the vertex of the V fitted to each scale's median
    seconds, or the fastest timed where no V fits."""
    timed = [(float(s), float(t)) for s, t in zip(scales, seconds)]
    v = vertex(timed)
    return (float(v) if v is not None else min(timed, key=lambda p: p[1])[0]), timed


def time_head(devices: Sequence, head: HeadShape, speeds: Sequence[float], repeats: int,
              scales: Sequence[float] = SCALES, seconds: float = SECONDS) -> tuple[float, list[tuple[float, float]]]:
    """(the scale on the slowest devices' speed whose class split the head's program runs fastest,
    [(scale, median seconds)] timed): `head_rounds`, then `kept_scale`."""
    return kept_scale(*head_rounds(devices, head, speeds, repeats, scales, seconds))
