"""Refining a balanced split on the real step: a bracketing search over the slow devices' speed.

A calibrated cost model predicts the split (fixed time + rows x time per row, equalised); what the
whole jitted step costs also holds what the model does not see (collectives, launches, cache effects).
Refinement times the real step at a few splits around the prediction and keeps the fastest.

The split is moved by one number, `scale`: the slowest devices (a group of equal speeds) taken as
`scale` times as fast as calibrated (their speed multiplied by it and their fixed time divided by it,
`whalex.refining.scaled_cluster`; every other device kept), so `scale` 1 is the prediction and a
scale below 1 gives the slow devices fewer rows. The step's time is unimodal in the slow devices'
share (one side waits for the slow devices, the other for the fast ones), so a bracketing search
starting at the prediction finds its minimum: the prediction is timed first and kept unless a
timed split beats it.

Timings taken one split after another carry drift (a busy neighbour, a throttling period, a slow
period that holds for seconds) into the comparison, and a few steps per split leave it noisy. So every
split after the prediction is timed in paired rounds beside the prediction (`confirmation_order` with
`point_rounds` rounds: a block of each per round, the order alternating), and what the search compares
is its `paired_ratio`: the median over rounds of its block median over the prediction's in the same
round. Where the rounds disagree so much that the ratio is not clear of what it is compared with (the
best ratio so far; for the confirmation, the prediction's 1), more rounds follow, one at a time, up to
`EXTEND` times as many (`more_rounds`): a quiet machine pays little, a noisy one times longer rather
than move on a coin toss. The rival to the prediction
is read from every split timed: a V (one arm the fast devices' time, the other the slow devices')
fitted to the ratios by least squares, its vertex the split where the arms meet (`vertex`); where no
V fits, the split with the least ratio. The search ends with a confirmation: the prediction and the
rival re-timed in more alternating rounds (`confirmation_order`, after a warm-up step where the rival
was not timed), and the rival is kept only if its median ratio beats the prediction there (`confirmed`).

The search is a generator (`bracket_search`) that yields the scale to time next and receives its
time (the paired ratio; the prediction's 1), so a training step can drive it one point at a time;
`search` runs it over a timing callback. Splits that round to the same placement (`key`) are timed once.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Generator, Hashable, Sequence

import numpy as np
from scipy.optimize import nnls

LO, HI = 0.7, 1.3                      # the bracket on the slow devices' speed, relative to the prediction
REACH = (0.5, 2.0)                     # how far the bracket widens where the fastest split timed is at its edge
POINTS = 9                             # the most distinct splits one search times (the prediction included)
MIN_STEP = 0.01                        # the search stops when its step on the scale is below this
STEPS_PER_POINT = 5                    # the fewest timed steps per split (their median counts)
MAX_STEPS_PER_POINT = 10               # the most, for a short step
POINT_SECONDS = 0.5                    # a split's timed steps last at least this long, within those bounds
WARMUP_STEPS = 1                       # untimed steps per split first (its compile, its first run)
FIRST_WARMUP = 3                       # untimed steps of the first split (the step's own first calls)
CONFIRM_ROUNDS = 4                     # rounds of the confirmation: a block of the prediction and of its rival
CONFIRM_BLOCK = 4                      # steps per block, the first after the switch untimed
MIN_POINT_ROUNDS = 2                   # the fewest paired rounds a split after the prediction is timed in
EXTEND = 4                             # paired rounds extend to this many times their least while undecided
DECIDED_SIGMAS = 2.0                   # a paired ratio is decided this many standard errors from its threshold
LOADED_SIGMAS = 3.0                    # a split timed this many robust sigmas above the fitted V was loaded
LOADED_FLOOR = 0.05                    # ... and at least this far above it, relative


def steps_per_point(seconds: float) -> int:
    """Timed steps per split for a step of `seconds`: as many as last `POINT_SECONDS` (a median of a few
    short steps is a lucky or unlucky draw, not the split's time), between `STEPS_PER_POINT` and
    `MAX_STEPS_PER_POINT`."""
    if not seconds > 0:
        return MAX_STEPS_PER_POINT
    return int(min(max(math.ceil(POINT_SECONDS / seconds), STEPS_PER_POINT), MAX_STEPS_PER_POINT))


def confirm_rounds(per_point: int) -> int:
    """Rounds of the confirmation after splits timed `per_point` steps each: `CONFIRM_ROUNDS` at
    `STEPS_PER_POINT`, more in proportion where a short step timed more (more rounds rather than longer
    blocks, so that drift still falls within a round on both splits alike)."""
    return CONFIRM_ROUNDS * max(per_point, STEPS_PER_POINT) // STEPS_PER_POINT


def point_rounds(per_point: int) -> int:
    """Paired rounds a split after the prediction is timed in, beside the prediction: as many blocks as
    give it `per_point` timed steps (each block's switch step untimed), at least `MIN_POINT_ROUNDS`."""
    return max(MIN_POINT_ROUNDS, per_point // (CONFIRM_BLOCK - 1))


def max_steps(points: int = POINTS, steps_per_point: int = MAX_STEPS_PER_POINT, warmup: int = WARMUP_STEPS,
              rounds: int | None = None, block: int = CONFIRM_BLOCK, first: int = FIRST_WARMUP,
              extend: int = EXTEND) -> int:
    """The most training steps a refinement runs before it settles on a split: the prediction's warm-up
    and timed steps, each later split's warm-up (its compile) and paired rounds beside the prediction,
    and the confirmation's (with the warm-up of a rival the search did not time), every paired timing
    extended to `extend` times its rounds; `rounds` defaults to `confirm_rounds(steps_per_point)`."""
    rounds = confirm_rounds(steps_per_point) if rounds is None else rounds
    paired = 2 * extend * point_rounds(steps_per_point) * block
    return first + steps_per_point + (points - 1) * (warmup + paired) + warmup + 2 * extend * rounds * block


@dataclasses.dataclass(frozen=True)
class ConfirmStep:
    """One step of a confirmation: the split's scale and the round it is timed for (None: untimed, a
    rival's warm-up or a block's first step after the switch)."""

    scale: float
    round: int | None


@dataclasses.dataclass(frozen=True)
class SplitTiming:
    """One split timed on the real step: the slow devices' speed scale, the rows (or units) per
    device it gives, and the median seconds and relative spread of its timed steps."""

    scale: float
    rows: tuple[int, ...]
    seconds: float
    spread: float = 0.0
    steps: int = 0                     # timed steps behind the median
    units: tuple[int, ...] = ()        # a split head's units (classes) per device, where the plan has one
    paired: float | None = None        # its median over paired rounds of seconds / the prediction's (1.0 for it)

    @property
    def relative(self) -> float:
        """What the search compares: the paired ratio where the split was timed beside the prediction,
        else its seconds."""
        return self.seconds if self.paired is None else self.paired


@dataclasses.dataclass(frozen=True)
class Refinement:
    """What a refinement timed, in order, and what it kept: the fastest timed split (the prediction
    unless another split beat it)."""

    points: tuple[SplitTiming, ...]
    slow: tuple[int, ...]              # the devices whose speed the scale multiplies
    steps: int                         # training steps it ran (warm-up steps included)
    kept: float = 1.0                  # the scale of the split kept
    confirmed: tuple[SplitTiming, ...] = ()   # the prediction and its rival re-timed in blocks, all steps pooled
    paired: float = 1.0                # the confirmation's median over rounds of rival / prediction (< 1: rival kept)

    def timing(self, scale: float) -> SplitTiming:
        """A split's timing: from the confirmation where it was re-timed there, else from the search."""
        return next(p for p in (*self.confirmed, *self.points) if p.scale == scale)

    @property
    def predicted(self) -> SplitTiming:
        return self.timing(1.0)

    @property
    def chosen(self) -> SplitTiming:
        return self.timing(self.kept)

    @property
    def gain(self) -> float:
        """The prediction's step time over the chosen split's (1.0: the prediction was the fastest); after a
        confirmation, the paired rounds' ratio."""
        if self.kept == 1.0:
            return 1.0
        if self.confirmed:
            return 1.0 / self.paired
        return self.predicted.seconds / self.chosen.seconds if self.chosen.seconds > 0 else 1.0


def check_bracket(lo: float, hi: float, points: int, reach: tuple[float, float] = REACH) -> None:
    if not (0 < lo < 1 < hi and math.isfinite(hi)):
        raise ValueError(f"a refinement brackets the prediction (scale 1): needs 0 < lo < 1 < hi, "
                         f"got lo={lo}, hi={hi}.")
    if not (0 < reach[0] <= lo and hi <= reach[1] and math.isfinite(reach[1])):
        raise ValueError(f"a refinement's bracket widens within its reach: needs 0 < reach[0] <= lo and "
                         f"hi <= reach[1], got reach={reach}, lo={lo}, hi={hi}.")
    if isinstance(points, bool) or not isinstance(points, int) or points < 3:
        raise ValueError(f"a refinement needs points >= 3 (the prediction and two to bracket it), got {points!r}.")


def bracket_search(lo: float = LO, hi: float = HI, points: int = POINTS, min_step: float = MIN_STEP,
                   key: Callable[[float], Hashable] | None = None,
                   reach: tuple[float, float] = REACH) -> Generator[float, float, float]:
    """Yields scales to time (the prediction 1.0 first), receives each one's time, and returns the
    fastest scale timed.

    A bracketing search around the best split so far: its neighbours `step` either side (within
    [lo, hi]) are timed; the faster neighbour, if either beats it, becomes the best, else the step
    halves, until it is below `min_step` or `points` distinct placements were timed. Where the best is
    at the bracket's edge (the prediction was further off than the bracket), that edge widens by the
    step, within `reach`, so the search can still bracket the fastest split. Scales whose `key` (the
    placement they round to; default the scale itself) was timed already reuse that time without a
    yield, so a placement too coarse to move at a step counts as no better. Where the first step's
    neighbours both round to the prediction's placement (a coarse placement: a pipeline's stage cut),
    the step first widens until a neighbour differs or the bracket's edge is reached."""
    check_bracket(lo, hi, points, reach)
    key = key or (lambda s: s)
    seen: dict = {}

    def cost(s):
        k = key(s)
        if k not in seen:
            if len(seen) >= points:
                return None
            seen[k] = yield s
        return seen[k]

    best, step = 1.0, (hi - lo) / 4
    f_best = yield from cost(best)
    widest = max(1.0 - lo, hi - 1.0)
    while step < widest and all(key(s) == key(best) for s in _neighbours(best, step, lo, hi)):
        step = min(2 * step, widest)          # reach for the nearest placement that differs
    while step >= min_step and f_best is not None:
        lo = max(lo - step, reach[0]) if best <= lo + 1e-9 else lo          # (scales are sums of steps)
        hi = min(hi + step, reach[1]) if best >= hi - 1e-9 else hi
        moved = False
        for s in _neighbours(best, step, lo, hi):
            t = yield from cost(s)
            if t is None:
                return best
            if t < f_best:
                best, f_best, moved = s, t, True
        if not moved:
            step /= 2
    return best


def _neighbours(best: float, step: float, lo: float, hi: float) -> list[float]:
    """The scales `step` either side of `best`, within [lo, hi], in order."""
    return sorted({min(max(best - step, lo), hi), min(max(best + step, lo), hi)} - {best})


def search(cost: Callable[[float], float], lo: float = LO, hi: float = HI, points: int = POINTS,
           key: Callable[[float], Hashable] | None = None, rounds: int = CONFIRM_ROUNDS,
           pair: int = MIN_POINT_ROUNDS, reach: tuple[float, float] = REACH,
           extend: int = EXTEND) -> tuple[float, list[tuple[float, float]]]:
    """Runs `bracket_search`, each split after the prediction timed in `pair` paired rounds beside it
    (0: timed once, its seconds compared), and its confirmation against the `rival` (`rounds` rounds),
    every paired timing extended while undecided (`more_rounds`, up to `extend` times its rounds), over a
    timing callback: (the scale kept, [(scale, seconds) timed, in order]). With `rounds` 0, the search's
    own fastest split is kept."""
    gen = bracket_search(lo, hi, points, key=key, reach=reach)
    timed: list[tuple[float, float]] = []
    found: list[SplitTiming] = []

    def paired(other, least, threshold):
        again: list[tuple[ConfirmStep, float]] = []
        while more_rounds(other, rounds_of(again), threshold, least, extend):
            again += [(c, float(cost(c.scale))) for c in next_round(other, len(rounds_of(again)))]
        timed.extend((c.scale, t) for c, t in again)
        return again

    try:
        s = next(gen)
        while True:
            if s == 1.0 or not pair:
                t = float(cost(s))
                timed.append((s, t))
                found.append(SplitTiming(s, (), t, paired=1.0 if pair else None))
            else:
                again = paired(s, pair, min(p.relative for p in found))
                own = [t for c, t in again if c.scale == s and c.round is not None]
                found.append(SplitTiming(s, (), float(np.median(own)), paired=paired_ratio(s, rounds_of(again))))
            s = gen.send(found[-1].relative)
    except StopIteration as stop:
        best = stop.value
    if rounds == 0:
        return best, timed
    other = rival(found, key)
    if other is None:
        return 1.0, timed
    return confirmed(other, rounds_of(paired(other, rounds, 1.0))), timed


def rival(points: Sequence[SplitTiming], key: Callable[[float], Hashable] | None = None) -> float | None:
    """The scale a confirmation re-times against the prediction: the `vertex` of the V fitted to every
    timed split (`SplitTiming.relative`), or the timed split of the same placement (`key`) where there is
    one; where no V fits, the fastest timed split other than the prediction. None: nothing to confirm
    (nothing else timed, or the fitted vertex is the prediction's placement)."""
    key = key or (lambda s: s)
    others = [p for p in points if p.scale != 1.0]
    if not others:
        return None
    v = vertex([(p.scale, p.relative) for p in points])
    if v is None:
        return min(others, key=lambda p: p.relative).scale
    if key(v) == key(1.0):
        return None
    return next((p.scale for p in others if key(p.scale) == key(v)), v)


def vertex(points: Sequence[tuple[float, float]], grid: int = 241) -> float | None:
    """Where a V fitted to (scale, seconds) points has its vertex: the least squares fit of
    `h + a * max(s - v, 0) + b * max(v - s, 0)` (a, b >= 0: the slow devices bound the step above the
    vertex, the fast ones below) over vertices `v` on a grid with two distinct scales timed on either
    side (an arm through one point would fit any vertex). Every point weighs in, so one lucky timing
    moves the vertex a little rather than deciding it; a time far above the fit (`loaded`: load from
    elsewhere only ever slows a step) is left out and the V fitted again without it, where four distinct
    scales remain. None with fewer than four distinct scales, or where the best fit has no arm on one
    side (the times only fall, or only rise, across the scales)."""
    s, t = (np.asarray(x, np.float64) for x in zip(*points)) if points else (np.zeros(0), np.zeros(0))
    fit = _fit_v(s, t, grid)
    if fit is None:
        return None
    keep = ~loaded(t / fit[1] - 1.0)
    if not keep.all() and len(np.unique(s[keep])) >= 4:
        s, t = s[keep], t[keep]
        fit = _fit_v(s, t, grid) or fit                         # four distinct scales kept: it fits
    v, _, coef = fit
    rise = coef[1:] * (s.max() - s.min()) / t.mean()            # each arm's rise over the scales, relative
    return v if np.all(rise > 1e-6) else None


def _fit_v(s: np.ndarray, t: np.ndarray, grid: int) -> tuple[float, np.ndarray, np.ndarray] | None:
    """The least squares V through (s, t) over vertices on a grid between the second and the second-last
    distinct scale: (its vertex, its time at each point, its coefficients (h, a, b)), or None with fewer
    than four distinct scales."""
    distinct = np.unique(s)
    if len(distinct) < 4:
        return None
    fits = []
    for v in np.linspace(distinct[1], distinct[-2], grid):
        design = np.stack([np.ones_like(s), np.maximum(s - v, 0.0), np.maximum(v - s, 0.0)], axis=1)
        coef, residual = nnls(design, t)
        fits.append((residual, float(v), design @ coef, coef))
    _, v, at, coef = min(fits, key=lambda f: f[0])
    return v, at, coef


def loaded(excess: np.ndarray, sigmas: float = LOADED_SIGMAS, floor: float = LOADED_FLOOR) -> np.ndarray:
    """Which timings stand far above their fit, from each one's relative `excess` (its seconds over the fit's,
    minus 1): more than `sigmas` robust standard deviations of all of them (1.4826 x their median absolute
    value) and more than `floor`, so that a fit of tiny, quiet residuals drops nothing."""
    e = np.asarray(excess, np.float64)
    return (e > sigmas * 1.4826 * np.median(np.abs(e))) & (e > floor)


def confirmation_order(other: float, rounds: int = CONFIRM_ROUNDS, warmup: int = 0,
                       block: int = CONFIRM_BLOCK) -> tuple[ConfirmStep, ...]:
    """The steps a confirmation runs: `warmup` untimed steps of `other` (where the search did not time
    it: its compile), then `rounds` rounds of a block of `block` steps of the prediction and of
    `other`, the order alternating per round (prediction first in even rounds) so that drift within
    a round falls on both alike; each block's first step (the switch) is untimed."""
    if block < 2:
        raise ValueError(f"a confirmation block needs an untimed switch step and a timed one: block >= 2, got {block}.")
    steps = [ConfirmStep(other, None)] * warmup
    for r in range(rounds):
        for s in ((1.0, other) if r % 2 == 0 else (other, 1.0)):
            steps += [ConfirmStep(s, None)] + [ConfirmStep(s, r)] * (block - 1)
    return tuple(steps)


def rounds_of(timed: Sequence[tuple[ConfirmStep, float]]) -> dict[int, dict[float, list[float]]]:
    """A confirmation's timed steps grouped {round: {scale: [seconds]}}."""
    out: dict[int, dict[float, list[float]]] = {}
    for c, t in timed:
        if c.round is not None:
            out.setdefault(c.round, {}).setdefault(c.scale, []).append(t)
    return out


def round_ratios(other: float, rounds: dict[int, dict[float, list[float]]]) -> list[float]:
    """Each round's block median of `other` over the prediction's (rounds where both were timed)."""
    return [float(np.median(r[other]) / np.median(r[1.0])) for r in rounds.values() if r.get(other) and r.get(1.0)]


def paired_ratio(other: float, rounds: dict[int, dict[float, list[float]]]) -> float:
    """The median over rounds of `other`'s block median over the prediction's in the same round."""
    ratios = round_ratios(other, rounds)
    return float(np.median(ratios)) if ratios else 1.0


def decided(ratios: Sequence[float], threshold: float, sigmas: float = DECIDED_SIGMAS) -> bool:
    """Whether the median of per-round `ratios` is more than `sigmas` standard errors from `threshold`
    (the standard error of a median, 1.253 sigma / sqrt(n), its sigma from the median absolute deviation,
    so that one wild round does not hold the timing open)."""
    r = np.asarray(ratios, np.float64)
    if not len(r):
        return False
    med = float(np.median(r))
    se = 1.253 * 1.4826 * float(np.median(np.abs(r - med))) / np.sqrt(len(r))
    return abs(med - threshold) > sigmas * se


def more_rounds(other: float, rounds: dict[int, dict[float, list[float]]], threshold: float, least: int,
                extend: int = EXTEND) -> bool:
    """Whether a paired timing of `other` runs another round: fewer than `least` rounds ran, or its ratio is
    not `decided` against `threshold` and fewer than `extend * least` ran."""
    ratios = round_ratios(other, rounds)
    return len(ratios) < least or (len(ratios) < extend * least and not decided(ratios, threshold))


def next_round(other: float, done: int, block: int = CONFIRM_BLOCK) -> tuple[ConfirmStep, ...]:
    """The steps of a paired timing's round `done` (its rounds so far), alternating as `confirmation_order`'s."""
    return confirmation_order(other, done + 1, block=block)[-2 * block:]


def confirmed(other: float, rounds: dict[int, dict[float, list[float]]]) -> float:
    """The scale kept: `other` if its paired ratio to the prediction (`paired_ratio`) is below 1, else 1.0."""
    return other if paired_ratio(other, rounds) < 1.0 else 1.0


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
