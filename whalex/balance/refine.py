"""Refining a balanced split on the real step: an interleaved sweep over the slow devices' speed scale.

A calibrated cost model predicts the split (fixed time + rows x time per row, equalised); what the
whole jitted step costs also holds what the model does not see (collectives, launches, cache effects).
Refinement times the real step at splits around the prediction and keeps the fastest.

The split is moved by one number, `scale`: the slowest devices (a group of equal speeds) taken as
`scale` times as fast as calibrated (their speed multiplied by it and their fixed time divided by it,
`whalex.refining.scaled_cluster`; every other device kept), so `scale` 1 is the prediction and a
scale below 1 gives the slow devices fewer rows. The step's time is a V in the scale (one side waits
for the slow devices, the other for the fast ones); the fastest split is its vertex.

A sweep times `POINTS` splits evenly over the bracket, the prediction among them, in rounds: each round
runs a block of `BLOCK` steps of every split (the block's first step, the switch, untimed), the order
reversing round by round. Each block's median over the round's median block is what the split costs in
that round: drift (a busy neighbour, a throttling period, a slow period that holds for seconds) moves a
whole round alike and divides out, and every split is timed in every round, none through the
prediction's timings. A V fitted by least squares to all the rounds' points gives the split kept, its
vertex (`vertex`; a time far above the fit, load from elsewhere, left out); where no V fits, the split
with the least median where it beat the prediction in more rounds than chance gives (`beats`, a sign
test; else the prediction: a flat step's least median is noise, and chasing it widens the bracket and
moves the split for nothing); where the vertex falls between two timed splits whose placements are
neighbours (a coarse placement), the faster of the two (`snapped`). The rounds stop early, from `MIN_ROUNDS` on,
once the V's of the even and of the odd rounds put the vertex within `SETTLED` of each other
(`settled`): a quiet machine pays little, a noisy one runs up to `sweep_rounds`. Where the split kept is
near the sweep's edge (the times only fall toward it, or the vertex is within a quarter of a split of
the last split a V can reach: the prediction was further off than the bracket), one more sweep runs from
there to the bracket's `REACH` (`widened`) and decides in the first one's place, re-timing at their own
scales the placements the first one ran.

The sweep is a generator (`sweep`) that yields one round's steps (`TimedStep`s) and receives their
seconds, so a training step can drive it a step at a time and every process decides from the same
seconds; `search` runs it over a timing callback. Splits that round to the same placement (`key`: a
pipeline's stage cut moves in whole layers) are timed once.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Generator, Hashable, Sequence

import numpy as np
from scipy.optimize import nnls
from scipy.stats import binomtest

LO, HI = 0.7, 1.3                      # the bracket on the slow devices' speed, relative to the prediction
REACH = (0.5, 2.0)                     # how far a sweep widens where the split kept is at the bracket's edge
POINTS = 7                             # the splits a sweep times, evenly over its bracket
BLOCK = 3                              # steps of a split per round, the first (the switch) untimed
MIN_ROUNDS = 9                         # rounds a sweep runs before it may settle
MAX_ROUNDS = 27                        # the most rounds of a sweep, for a short step (`sweep_rounds`)
SETTLE_EVERY = 3                       # a sweep checks whether it settled after every this many rounds
SETTLED = 0.01                         # ... where the even and the odd rounds' vertices are this close
STEPS_PER_POINT = 5                    # the prediction's first timed steps: how long the step is
MAX_STEPS_PER_POINT = 10               # a short step's timed steps per split, for the rounds' budget
POINT_SECONDS = 0.5                    # a split's timed steps last at least this long, within those bounds
WARMUP_STEPS = 1                       # untimed steps of a split the first time it runs (its compile)
FIRST_WARMUP = 3                       # untimed steps of the prediction first (the step's own first calls)
LOADED_SIGMAS = 3.0                    # a split timed this many robust sigmas above the fitted V was loaded
LOADED_FLOOR = 0.05                    # ... and at least this far above it, relative
SIGNIFICANT = 0.05                     # a split kept where no V fits beats the prediction at this sign test level


def steps_per_point(seconds: float) -> int:
    """Timed steps per split for a step of `seconds`: as many as last `POINT_SECONDS` (a median of a few
    short steps is a lucky or unlucky draw, not the split's time), between `STEPS_PER_POINT` and
    `MAX_STEPS_PER_POINT`."""
    if not seconds > 0:
        return MAX_STEPS_PER_POINT
    return int(min(max(math.ceil(POINT_SECONDS / seconds), STEPS_PER_POINT), MAX_STEPS_PER_POINT))


def sweep_rounds(per_point: int) -> int:
    """The most rounds of a sweep for a step timed `per_point` steps per split (`steps_per_point`):
    `MAX_ROUNDS` for a short step, fewer in proportion for a long one, at least `MIN_ROUNDS`."""
    return max(MIN_ROUNDS, MAX_ROUNDS * per_point // MAX_STEPS_PER_POINT)


def max_steps(steps_per_point: int = MAX_STEPS_PER_POINT, points: int = POINTS, block: int = BLOCK,
              warmup: int = WARMUP_STEPS, first: int = FIRST_WARMUP, head: bool = False) -> int:
    """The most training steps a refinement runs before it settles on a split: the prediction's warm-up and
    first timed steps, then two sweeps (the first and its widening) of `sweep_rounds` rounds over `points`
    splits and the prediction, each split's warm-up (its compile) the first time it runs; three times that
    with `head` (a hybrid's split head: its classes swept at the rows kept, then its rows at the classes
    kept)."""
    per_sweep = sweep_rounds(steps_per_point) * (points + 1) * block + (points + 1) * warmup
    return (3 if head else 1) * (first + STEPS_PER_POINT + 2 * per_sweep)


@dataclasses.dataclass(frozen=True)
class TimedStep:
    """One step of a sweep: the split's scale and the round it is timed for (None: untimed, a split's
    warm-up or a block's first step after the switch; -1: the prediction's first timed steps)."""

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
    paired: float | None = None        # its median over rounds of its block over the prediction's (1.0 for it)

    @property
    def relative(self) -> float:
        """Its time relative to the prediction's: the paired ratio where it was timed in rounds beside
        the prediction, else its seconds."""
        return self.seconds if self.paired is None else self.paired


@dataclasses.dataclass(frozen=True)
class Swept:
    """What a sweep (and its widening) found: the scale kept, the prediction's time over the kept split's
    (by the fitted V, or by their paired ratios where none fits), every split timed (the last sweep's
    timing where two timed it), and the rounds the deciding sweep ran."""

    kept: float
    gain: float
    points: tuple[SplitTiming, ...]
    rounds: int
    fitted: bool                       # the split kept is a fitted V's vertex (else the least median)


@dataclasses.dataclass(frozen=True)
class Refinement:
    """What a refinement timed and what it kept: the vertex of the V fitted to the splits' rounds (a
    split it may not have timed itself), or the timed split with the least median where no V fits."""

    points: tuple[SplitTiming, ...]
    slow: tuple[int, ...]              # the devices whose speed the scale multiplies
    steps: int                         # training steps it ran (warm-up steps included)
    kept: float = 1.0                  # the scale of the split kept
    kept_rows: tuple[int, ...] = ()    # its rows per device
    kept_units: tuple[int, ...] = ()   # its split head's units per device, where the plan has one
    gain: float = 1.0                  # the prediction's step time over the kept split's, as the sweep saw it
    rounds: int = 0                    # rounds of the sweep that decided
    fitted: bool = False               # kept is a fitted V's vertex
    head: Refinement | None = None     # a hybrid's split head swept alone at the rows kept (its scale on the
                                       # slow devices' speed on the classes); `steps` then counts every sweep
    again: Refinement | None = None    # a hybrid's rows swept once more at the classes the head's sweep kept,
                                       # where it moved them (its scale on the rows kept)

    def timing(self, scale: float) -> SplitTiming | None:
        """A split's timing, None where it was not timed (a fitted vertex between the splits timed)."""
        return next((p for p in self.points if p.scale == scale), None)

    @property
    def predicted(self) -> SplitTiming:
        return self.timing(1.0)

    @property
    def own_steps(self) -> int:
        """The steps of this sweep alone (a hybrid's rows' record counts its later sweeps' too)."""
        return self.steps - sum(r.steps for r in (self.head, self.again) if r is not None)


def check_bracket(lo: float, hi: float, points: int, reach: tuple[float, float] = REACH) -> None:
    if not (0 < lo < 1 < hi and math.isfinite(hi)):
        raise ValueError(f"a refinement brackets the prediction (scale 1): needs 0 < lo < 1 < hi, "
                         f"got lo={lo}, hi={hi}.")
    if not (0 < reach[0] <= lo and hi <= reach[1] and math.isfinite(reach[1])):
        raise ValueError(f"a refinement's bracket widens within its reach: needs 0 < reach[0] <= lo and "
                         f"hi <= reach[1], got reach={reach}, lo={lo}, hi={hi}.")
    if isinstance(points, bool) or not isinstance(points, int) or points < 3:
        raise ValueError(f"a refinement needs points >= 3 (the prediction and two to bracket it), got {points!r}.")


def sweep_scales(lo: float, hi: float, points: int, key: Callable[[float], Hashable],
                 reach: tuple[float, float] = REACH, known: Sequence[float] = ()) -> tuple[float, ...]:
    """The splits a sweep over [lo, hi] times, in order: `points` scales evenly over it and the prediction,
    one per placement (`key`; the prediction's own at 1.0, a `known` scale's (one an earlier sweep ran,
    its plan built and compiled) where it has the same). Where fewer than three placements differ (a
    coarse placement: a pipeline's stage cut), the bracket widens about 1, within `reach`, until three do."""
    while True:
        grid = sorted({round(float(s), 9) for s in np.linspace(lo, hi, points)} | {1.0}, key=lambda s: s != 1.0)
        seen: dict = {}
        for s in grid:                                    # the prediction first: it owns its placement
            seen.setdefault(key(s), s)
        wider = (max(reach[0], 1 - 2 * (1 - lo)), min(reach[1], 1 + 2 * (hi - 1)))
        if len(seen) >= 3 or wider == (lo, hi) or lo >= 1 or hi <= 1:
            owner = {key(q): q for q in known}
            return tuple(sorted(owner.get(k, s) for k, s in seen.items()))
        lo, hi = wider


def round_steps(scales: Sequence[float], r: int, block: int = BLOCK, warm: Sequence[float] = (),
                warmup: int = WARMUP_STEPS) -> tuple[TimedStep, ...]:
    """Round `r` of a sweep: a block of `block` steps of each split, in order (reversed in odd rounds, so
    that drift within a round falls on both ends alike), each block's first step untimed; a split not in
    `warm` (run before) first runs `warmup` untimed steps (its compile)."""
    if block < 2:
        raise ValueError(f"a sweep's block needs an untimed switch step and a timed one: block >= 2, got {block}.")
    steps: list[TimedStep] = []
    for s in (scales if r % 2 == 0 else scales[::-1]):
        steps += [TimedStep(s, None)] * ((warmup if s not in warm else 0) + 1) + [TimedStep(s, r)] * (block - 1)
    return tuple(steps)


def round_table(timed: Sequence[tuple[TimedStep, float]]) -> dict[int, dict[float, list[float]]]:
    """A sweep's timed steps grouped {round: {scale: [seconds]}}."""
    out: dict[int, dict[float, list[float]]] = {}
    for c, t in timed:
        if c.round is not None and c.round >= 0:
            out.setdefault(c.round, {}).setdefault(c.scale, []).append(t)
    return out


def normalized(table: dict[int, dict[float, list[float]]]) -> list[tuple[float, float]]:
    """(scale, its block median over the round's median block) for every split of every round: what each
    split costs in each round, drift divided out."""
    out = []
    for r in table.values():
        med = {s: float(np.median(t)) for s, t in r.items()}
        mid = float(np.median(list(med.values())))
        out += [(s, m / mid) for s, m in med.items()] if mid > 0 else []
    return out


def paired_ratios(table: dict[int, dict[float, list[float]]]) -> dict[float, float]:
    """{scale: the median over rounds of its block median over the prediction's in the same round}."""
    ratios: dict[float, list[float]] = {}
    for r in table.values():
        if r.get(1.0):
            base = float(np.median(r[1.0]))
            for s, t in r.items():
                ratios.setdefault(s, []).append(float(np.median(t)) / base)
    return {s: float(np.median(v)) for s, v in ratios.items()}


def decide(table: dict[int, dict[float, list[float]]], key: Callable[[float], Hashable] | None = None
           ) -> tuple[float, float, bool]:
    """(the scale kept, the prediction's time over its time, whether it is a fitted vertex): the vertex of
    the V fitted to the rounds' `normalized` points, `snapped` (given the placements' `key`) where it falls
    between two neighbouring placements; where no V fits, the split of the least median where it `beats`
    the prediction round by round, else the prediction (a flat step: the least of its medians is noise)."""
    points = normalized(table)
    fit = fit_v(points)
    if fit is not None and fit.vertex is not None:
        return (key is not None and snapped(fit.vertex, table, key)) or (fit.vertex, fit(1.0) / fit(fit.vertex), True)
    least = least_median(points)
    return least if least is not None and beats(table, least[0]) else (1.0, 1.0, False)


def beats(table: dict[int, dict[float, list[float]]], scale: float, level: float = SIGNIFICANT) -> bool:
    """Whether the split at `scale` ran faster than the prediction in more of the rounds that timed both
    than chance would give: a one-sided sign test at `level` on its block medians against the
    prediction's (ties left out). True for the prediction itself."""
    if scale == 1.0:
        return True
    wins = losses = 0
    for r in table.values():
        if r.get(scale) and r.get(1.0):
            a, b = float(np.median(r[scale])), float(np.median(r[1.0]))
            wins, losses = wins + (a < b), losses + (a > b)
    return wins + losses > 0 and binomtest(wins, wins + losses, 0.5, alternative="greater").pvalue <= level


def least_median(points: Sequence[tuple[float, float]], among: Sequence[float] | None = None
                 ) -> tuple[float, float, bool] | None:
    """(the split of the least median among `among` (every split of `points` where None; the prediction on
    a tie), the prediction's time over its time, False); None without points."""
    scales = sorted({s for s, _ in points}) if among is None else among
    med = {s: float(np.median([t for q, t in points if q == s])) for s in {q for q, _ in points}}
    if not med:
        return None
    best = min(scales, key=lambda s: (med[s], s != 1.0))
    return best, med.get(1.0, med[best]) / med[best], False


def adjacent(key: Callable[[float], Hashable], a: float, b: float, tol: float = 1e-3) -> bool:
    """Whether no placement lies between the placements at scales a < b (`key`, monotone in the scale):
    bisecting for where the placement changes meets only those two."""
    ka, kb = key(a), key(b)
    while b - a > tol:
        mid = (a + b) / 2
        km = key(mid)
        if km == ka:
            a = mid
        elif km == kb:
            b = mid
        else:
            return False
    return True


def snapped(kept: float, table: dict[int, dict[float, list[float]]], key: Callable[[float], Hashable]
            ) -> tuple[float, float, bool] | None:
    """Where a fitted vertex lies between two timed splits of adjacent placements (a coarse placement: a
    pipeline's stage cut, every placement near it timed), the faster of the two by their medians (the V
    interpolates only where a placement between them was not timed; its vertex can fall on the wrong
    side of the change): (scale, the prediction's time over its time, False); else None."""
    points = normalized(table)
    scales = sorted({s for s, _ in points})
    i = int(np.searchsorted(scales, kept, side="right")) - 1
    if i < 0 or i + 1 >= len(scales) or not adjacent(key, scales[i], scales[i + 1]):
        return None
    return least_median(points, scales[i:i + 2])


def settled(table: dict[int, dict[float, list[float]]], least: int = MIN_ROUNDS, every: int = SETTLE_EVERY,
            tol: float = SETTLED) -> bool:
    """Whether a sweep can stop: at least `least` rounds, a multiple of `every`, and the V's fitted to its
    even and to its odd rounds put their vertices within `tol` of each other."""
    n = len(table)
    if n < least or n % every:
        return False
    rounds = list(table.values())
    halves = [normalized(dict(enumerate(rounds[i::2]))) for i in (0, 1)]
    v = [vertex(h) for h in halves]
    return None not in v and abs(v[0] - v[1]) < tol


def widened(kept: float, scales: Sequence[float], reach: tuple[float, float] = REACH) -> tuple[float, float] | None:
    """The bracket of a widening sweep where the split kept is near the sweep's edge away from the
    prediction, within a quarter of a split of the last split a fitted vertex can reach (the one before the
    edge: a V needs two splits on either side, so the fastest split beyond it is fitted short of where it is),
    and the reach goes further: from two splits inside that edge to the reach; else None."""
    if len(scales) < 3:
        return None
    if kept <= scales[1] + (min(scales[2], 1.0) - scales[1]) / 4 and scales[1] < 1.0 and scales[0] > reach[0]:
        return reach[0], scales[2]
    if kept >= scales[-2] - (scales[-2] - max(scales[-3], 1.0)) / 4 and scales[-2] > 1.0 and scales[-1] < reach[1]:
        return scales[-3], reach[1]
    return None


def sweep(key: Callable[[float], Hashable] | None = None, lo: float = LO, hi: float = HI, points: int = POINTS,
          reach: tuple[float, float] = REACH, block: int = BLOCK, rounds: int | None = None,
          least: int = MIN_ROUNDS) -> Generator[tuple[TimedStep, ...], Sequence[float], Swept]:
    """Yields steps to run (the prediction's first, then a sweep's rounds), receives their seconds, and
    returns what it found (`Swept`).

    The prediction runs `FIRST_WARMUP` untimed steps and `STEPS_PER_POINT` timed ones; their median sets the
    rounds (`sweep_rounds`, or `rounds`). Then a sweep over [lo, hi] (`sweep_scales`) runs its rounds until
    it `settled` (after `least`) or ran them all, and `decide`s; where the split kept is near its edge, one
    widening sweep (`widened`) runs and decides in its place."""
    check_bracket(lo, hi, points, reach)
    key = key or (lambda s: s)
    first = (TimedStep(1.0, None),) * FIRST_WARMUP + (TimedStep(1.0, -1),) * STEPS_PER_POINT
    seconds = yield first
    if rounds is None:
        rounds = sweep_rounds(steps_per_point(float(np.median(list(seconds)[FIRST_WARMUP:]))))
    warm, found, bracket = {1.0}, {}, (lo, hi)
    for _ in range(2):
        scales = sweep_scales(*bracket, points, key, reach, known=found)
        timed: list[tuple[TimedStep, float]] = []
        for r in range(rounds):
            steps = round_steps(scales, r, block, warm)
            warm |= set(scales)
            timed += zip(steps, (yield steps))
            if settled(round_table(timed), least):
                break
        table = round_table(timed)
        kept, gain, fitted = decide(table, key)
        ratios = paired_ratios(table)
        for s in scales:                                  # one timing per placement: the last sweep's
            times = [t for c, t in timed if c.scale == s and c.round is not None]
            found[s] = SplitTiming(s, (), *median_spread(times), len(times), paired=ratios.get(s))
        bracket = widened(kept, scales, reach)
        if bracket is None:
            break
    return Swept(kept, gain, tuple(found[s] for s in sorted(found)), len(table), fitted)


def search(cost: Callable[[float], float], key: Callable[[float], Hashable] | None = None,
           **options) -> tuple[Swept, list[tuple[float, float]]]:
    """Runs `sweep` over a timing callback (one call a step): (what it found, [(scale, seconds)] of every
    step, in order). `options` are `sweep`'s."""
    gen = sweep(key, **options)
    timed: list[tuple[float, float]] = []
    try:
        steps = next(gen)
        while True:
            seconds = [float(cost(c.scale)) for c in steps]
            timed += [(c.scale, t) for c, t in zip(steps, seconds)]
            steps = gen.send(seconds)
    except StopIteration as stop:
        return stop.value, timed


@dataclasses.dataclass(frozen=True)
class VFit:
    """A V `h + a * max(s - vertex, 0) + b * max(vertex - s, 0)` fitted to (scale, time) points; `vertex`
    None where the fit has no arm on one side (the times only fall, or only rise, across the scales)."""

    at: float                          # the vertex on the grid of the fit
    h: float
    a: float
    b: float
    vertex: float | None

    def __call__(self, s: float) -> float:
        return self.h + self.a * max(s - self.at, 0.0) + self.b * max(self.at - s, 0.0)


def fit_v(points: Sequence[tuple[float, float]], grid: int = 241) -> VFit | None:
    """The least squares V through (scale, time) points (a, b >= 0: the slow devices bound the step above
    the vertex, the fast ones below) over vertices on a grid with two distinct scales timed on either side
    (an arm through one point would fit any vertex). Every point weighs in, so one lucky timing moves the
    vertex a little rather than deciding it; a time far above the fit (`loaded`: load from elsewhere only
    ever slows a step) is left out and the V fitted again without it, where four distinct scales remain.
    None with fewer than four distinct scales."""
    s, t = (np.asarray(x, np.float64) for x in zip(*points)) if points else (np.zeros(0), np.zeros(0))
    fit = _fit_v(s, t, grid)
    if fit is None:
        return None
    keep = ~loaded(t / fit[1] - 1.0)
    if not keep.all() and len(np.unique(s[keep])) >= 4:
        s, t = s[keep], t[keep]
        fit = _fit_v(s, t, grid) or fit                         # four distinct scales kept: it fits
    v, _, (h, a, b) = fit
    rise = np.array([a, b]) * (s.max() - s.min()) / t.mean()    # each arm's rise over the scales, relative
    return VFit(v, float(h), float(a), float(b), v if np.all(rise > 1e-6) else None)


def vertex(points: Sequence[tuple[float, float]], grid: int = 241) -> float | None:
    """Where a V fitted to (scale, time) points has its vertex (`fit_v`); None where no V fits."""
    fit = fit_v(points, grid)
    return None if fit is None else fit.vertex


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


def median_spread(times: Sequence[float]) -> tuple[float, float]:
    """Median seconds of a split's timed steps and their relative spread ((max - min) / 2 / median)."""
    t = np.asarray(times, np.float64)
    if not len(t):
        return 0.0, 0.0
    med = float(np.median(t))
    return med, float((t.max() - t.min()) / 2 / med) if med > 0 else 0.0
