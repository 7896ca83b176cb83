"""Refining a balanced split on the real step: a bracketing search over the slow devices' speed.

A calibrated cost model predicts the split (fixed time + rows x time per row, equalised); what the
whole jitted step costs also holds what the model does not see (collectives, launches, cache effects).
Refinement times the real step at a few splits around the prediction and keeps the fastest.

The split is moved by one number, `scale`: the speed of the slowest devices (a group of equal speeds)
multiplied by it, every other speed and every fixed time kept, so `scale` 1 is the prediction and a
scale below 1 gives the slow devices fewer rows. The search is a golden-section search over
[lo, hi] (the step's time is unimodal in the slow devices' share: one side waits for the slow
devices, the other for the fast ones) plus the prediction itself, timed first: the prediction is
kept unless a timed split beat it.

The search is a generator (`golden_search`) that yields the scale to time next and receives its
seconds, so a training step can drive it one point at a time; `search` runs it over a timing
callback. Splits that round to the same placement (`key`) are timed once.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Generator, Hashable, Sequence

import numpy as np

GOLDEN = (math.sqrt(5) - 1) / 2        # 0.618...: the golden section's shrink per point
LO, HI = 0.7, 1.3                      # the bracket on the slow devices' speed, relative to the prediction
POINTS = 8                             # the most distinct splits one search times (the prediction included)
STEPS_PER_POINT = 3                    # timed steps per split (their median counts)
WARMUP_STEPS = 1                       # untimed steps per split first (its compile, its first run)


def max_steps(points: int = POINTS, steps_per_point: int = STEPS_PER_POINT, warmup: int = WARMUP_STEPS) -> int:
    """The most training steps a refinement runs before it settles on a split."""
    return points * (steps_per_point + warmup)


@dataclasses.dataclass(frozen=True)
class SplitTiming:
    """One split timed on the real step: the slow devices' speed scale, the rows (or units) per
    device it gives, and the median seconds and relative spread of its timed steps."""

    scale: float
    rows: tuple[int, ...]
    seconds: float
    spread: float = 0.0
    steps: int = 0                     # timed steps behind the median


@dataclasses.dataclass(frozen=True)
class Refinement:
    """What a refinement timed, in order, and what it kept: the fastest timed split (the prediction
    unless another split beat it)."""

    points: tuple[SplitTiming, ...]
    slow: tuple[int, ...]              # the devices whose speed the scale multiplies
    steps: int                         # training steps it ran (warm-up steps included)

    @property
    def predicted(self) -> SplitTiming:
        return next(p for p in self.points if p.scale == 1.0)

    @property
    def chosen(self) -> SplitTiming:
        return min(self.points, key=lambda p: (p.seconds, abs(p.scale - 1.0)))

    @property
    def gain(self) -> float:
        """The prediction's step time over the chosen split's (1.0: the prediction was the fastest)."""
        return self.predicted.seconds / self.chosen.seconds if self.chosen.seconds > 0 else 1.0


def check_bracket(lo: float, hi: float, points: int) -> None:
    if not (0 < lo < 1 < hi and math.isfinite(hi)):
        raise ValueError(f"a refinement brackets the prediction (scale 1): needs 0 < lo < 1 < hi, got lo={lo}, hi={hi}.")
    if isinstance(points, bool) or not isinstance(points, int) or points < 3:
        raise ValueError(f"a refinement needs points >= 3 (the prediction and two to bracket it), got {points!r}.")


def golden_search(lo: float = LO, hi: float = HI, points: int = POINTS,
                  key: Callable[[float], Hashable] | None = None) -> Generator[float, float, float]:
    """Yields scales to time (the prediction 1.0 first), receives each one's seconds, and returns the
    fastest scale timed. At most `points` distinct placements are yielded: scales whose `key` (the
    placement they round to; default the scale itself) was timed already reuse that time without a
    yield, and the golden section stops when its next point would repeat the two it holds."""
    check_bracket(lo, hi, points)
    key = key or (lambda s: s)
    seen: dict = {}
    best: list = [1.0, math.inf]

    def cost(s):
        k = key(s)
        if k not in seen:
            if len(seen) >= points:
                return None
            seen[k] = yield s
        t = seen[k]
        if t < best[1] or (t == best[1] and abs(s - 1.0) < abs(best[0] - 1.0)):
            best[:] = [s, t]
        return t

    yield from cost(1.0)
    a, b = lo, hi
    c, d = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
    fc = yield from cost(c)
    fd = yield from cost(d)
    while fc is not None and fd is not None:
        if key(c) == key(d):                 # both interior points round to one placement: nothing left to split
            break
        if fc <= fd:                         # the minimum lies in [a, d]
            b, d, fd = d, c, fc
            c = b - GOLDEN * (b - a)
            fc = yield from cost(c)
        else:                                # in [c, b]
            a, c, fc = c, d, fd
            d = a + GOLDEN * (b - a)
            fd = yield from cost(d)
    return best[0]


def search(cost: Callable[[float], float], lo: float = LO, hi: float = HI, points: int = POINTS,
           key: Callable[[float], Hashable] | None = None) -> tuple[float, list[tuple[float, float]]]:
    """Runs `golden_search` over a timing callback: (the fastest scale, [(scale, seconds) timed, in order])."""
    gen = golden_search(lo, hi, points, key)
    timed = []
    try:
        s = next(gen)
        while True:
            t = float(cost(s))
            timed.append((s, t))
            s = gen.send(t)
    except StopIteration as stop:
        return stop.value, timed


def scaled_speeds(speeds: Sequence[float], scale: float) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """(the speeds with the slowest devices' multiplied by `scale`, those devices)."""
    s = np.asarray(speeds, np.float64)
    slow = tuple(int(i) for i in np.flatnonzero(s == s.min()))
    s[list(slow)] *= scale
    return tuple(map(float, s)), slow


def median_spread(times: Sequence[float]) -> tuple[float, float]:
    """Median seconds of a split's timed steps and their relative spread ((max - min) / 2 / median)."""
    t = np.asarray(times, np.float64)
    med = float(np.median(t))
    return med, float((t.max() - t.min()) / 2 / med) if med > 0 else 0.0
