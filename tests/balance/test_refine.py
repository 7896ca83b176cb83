"""Refining a balanced split on the real step: the search over a synthetic cost, and a Step that
refines while it trains exactly as one device."""
import dataclasses

import numpy as np
import pytest

from whalex.balance.algorithm import proportional
from whalex.balance.refine import (
    CONFIRM_BLOCK,
    CONFIRM_ROUNDS,
    EXTEND,
    FIRST_WARMUP,
    HI,
    LO,
    MAX_STEPS_PER_POINT,
    MIN_POINT_ROUNDS,
    POINT_SECONDS,
    POINTS,
    REACH,
    STEPS_PER_POINT,
    ConfirmStep,
    SplitTiming,
    bracket_search,
    confirm_rounds,
    confirmation_order,
    confirmed,
    decided,
    loaded,
    max_steps,
    more_rounds,
    next_round,
    paired_ratio,
    point_rounds,
    rival,
    round_ratios,
    rounds_of,
    scaled_speeds,
    search,
    steps_per_point,
    vertex,
)

BATCH = 4096


def _synthetic(speeds, fixed, predicted_speeds):
    """A step whose device i takes fixed[i] + rows_i / speeds[i] seconds, the split made by a model
    that knows only `predicted_speeds` (no fixed time), its slow device's speed scaled: (cost of a
    scale, rows of a scale, the true optimum's step time)."""
    def rows(scale):
        return tuple(proportional(BATCH, scaled_speeds(predicted_speeds, scale)[0]))

    def cost(scale):
        return max(f + r / s for f, r, s in zip(fixed, rows(scale), speeds))
    best = max(f + r / s for f, r, s in zip(fixed, proportional(BATCH, speeds, fixed), speeds))
    return cost, rows, best


@pytest.mark.parametrize("fixed", [(0.0, 0.15), (0.25, 0.0), (0.0, 0.0)])
def test_the_search_finds_the_fastest_split_when_fixed_time_differs_per_device(fixed):
    # 3:1 speeds; the model that made the split saw no fixed time, the real step has some on one device
    cost, rows, best = _synthetic((3000.0, 1000.0), fixed, (3.0, 1.0))
    calls = []
    scale, timed = search(lambda s: calls.append(s) or cost(s), key=rows)
    assert calls[0] == 1.0                                             # the prediction is timed first, then
    blocks = [calls[i:i + CONFIRM_BLOCK] for i in range(1, len(calls), CONFIRM_BLOCK)]
    assert all(len(b) == CONFIRM_BLOCK and len(set(b)) == 1 for b in blocks)    # blocks of one split each,
    pairs = [(a[0], b[0]) for a, b in zip(blocks[::2], blocks[1::2])]            # each beside the prediction
    assert len(blocks) % 2 == 0 and all((a == 1.0) != (b == 1.0) for a, b in pairs)
    searched = [s for p in pairs for s in p if s != 1.0]
    confirming = CONFIRM_ROUNDS if len(searched) > len({rows(s) for s in searched}) else 0
    per_split = searched[:len(searched) - confirming]
    assert len(per_split) == MIN_POINT_ROUNDS * len({rows(s) for s in per_split})   # each split's rounds
    assert len({rows(s) for s in per_split}) <= POINTS - 1                          # in budget
    if confirming:                                                     # then the prediction and its rival
        assert len({rows(s) for s in searched[-confirming:]}) == 1
    assert cost(scale) <= 1.01 * best                                  # within 1% of the true optimum
    assert cost(scale) <= cost(1.0)                                    # never slower than the prediction
    if fixed == (0.0, 0.0):                                            # the model was right: kept
        assert scale == 1.0
    else:                                                              # the slow side's fixed time moves rows away
        assert (scale < 1.0) == (fixed[1] > fixed[0])


def test_noise_cannot_make_the_kept_split_slower_than_the_best_timed():
    cost, rows, best = _synthetic((3000.0, 1000.0), (0.0, 0.15), (3.0, 1.0))
    rng = np.random.default_rng(0)
    noisy = {}

    def timed(s):
        noisy[s] = cost(s) * (1 + 0.02 * rng.standard_normal())
        return noisy[s]
    scale, _ = search(timed, key=rows, rounds=0, pair=0)           # the search alone, one timing per split
    assert noisy[scale] == min(noisy.values())
    assert cost(scale) <= 1.05 * best


@pytest.mark.parametrize("off", [0.6, 1.6])
def test_the_bracket_widens_where_the_prediction_was_further_off_than_it(off):
    # the model saw the slow device `off` times as fast as it is: the fastest split lies at scale
    # 1 / off, beyond x0.7-x1.3; the bracket widens at the edge the search reached, within REACH
    cost, rows, best = _synthetic((3000.0, 1000.0), (0.0, 0.0), (3.0, off))
    scale, timed = search(cost, key=rows)
    assert cost(scale) <= 1.01 * best and not LO <= scale <= HI
    assert all(REACH[0] <= s <= REACH[1] for s, _ in timed)
    narrow, _ = search(cost, key=rows, reach=(LO, HI))                # held to the first bracket: its edge
    assert min(abs(narrow - LO), abs(narrow - HI)) < 1e-9 and cost(narrow) > 1.05 * best


def test_a_coarse_placement_widens_the_first_step_until_a_neighbour_differs():
    # a stage cut: 12 layers, the split moves only past x0.8 and x1.2; the optimum is the cut below
    cuts = lambda s: 3 if s < 0.8 else (5 if s > 1.2 else 4)      # noqa: E731  layers on the slow stage
    cost = lambda s: {3: 0.9, 4: 1.0, 5: 1.2}[cuts(s)]              # noqa: E731
    scale, timed = search(cost, key=cuts, rounds=0, pair=0)
    assert cuts(scale) == 3 and {cuts(s) for s, _ in timed} == {3, 4, 5}
    assert len(timed) == 3                                             # each placement timed once


def test_the_confirmation_keeps_the_prediction_when_a_noisy_search_moved_to_a_slower_split():
    # the prediction is the optimum; one lucky timing of a far split makes the search move there
    cost, rows, best = _synthetic((3000.0, 1000.0), (0.0, 0.0), (3.0, 1.0))
    rng = np.random.default_rng(1)
    lucky = {"left": 1}

    def timed(s):
        if s < 0.9 and lucky["left"]:
            lucky["left"] -= 1
            return 0.5 * cost(s)
        return cost(s) * (1 + 0.01 * rng.standard_normal())
    assert search(timed, key=rows, rounds=0, pair=0)[0] < 0.9          # one timing per split: the lucky one kept
    lucky["left"] = 1
    scale, timed_all = search(timed, key=rows)
    assert scale == 1.0 and cost(scale) == best                        # the paired blocks keep the prediction
    block_steps = 2 * CONFIRM_BLOCK                                    # a round: a block of each
    assert len(timed_all) <= 1 + EXTEND * ((POINTS - 1) * MIN_POINT_ROUNDS + CONFIRM_ROUNDS) * block_steps


def test_the_confirmation_moves_to_the_rival_when_the_search_was_unlucky_on_it():
    # the real optimum is below 1; its one search timing was unlucky, the confirmation re-times it
    cost, rows, best = _synthetic((3000.0, 1000.0), (0.0, 0.15), (3.0, 1.0))
    points = [SplitTiming(1.0, rows(1.0), cost(1.0)), SplitTiming(0.85, rows(0.85), 1.3 * cost(0.85)),
              SplitTiming(1.15, rows(1.15), 1.5 * cost(1.15))]
    other = rival(points)                                              # three splits: no V to fit, the fastest
    assert other == 0.85
    order = confirmation_order(other)
    assert [c.scale for c in order[:CONFIRM_BLOCK + 1]] == [1.0] * CONFIRM_BLOCK + [0.85]
    assert len(order) == 2 * CONFIRM_ROUNDS * CONFIRM_BLOCK
    kept = confirmed(0.85, rounds_of([(c, cost(c.scale)) for c in order]))
    assert kept == 0.85 and cost(0.85) < cost(1.0)
    tie = rounds_of([(c, 1.0) for c in order])
    assert confirmed(0.85, tie) == 1.0 and paired_ratio(0.85, tie) == 1.0   # a tie keeps the prediction
    assert confirmation_order(0.85, 2, warmup=1, block=2) == (              # an untimed rival warms up; each
        ConfirmStep(0.85, None), ConfirmStep(1.0, None), ConfirmStep(1.0, 0),  # block's switch step is untimed
        ConfirmStep(0.85, None), ConfirmStep(0.85, 0), ConfirmStep(0.85, None), ConfirmStep(0.85, 1),
        ConfirmStep(1.0, None), ConfirmStep(1.0, 1))
    with pytest.raises(ValueError, match="block >= 2"):
        confirmation_order(0.85, block=1)


def test_an_undecided_paired_timing_runs_more_rounds_and_a_clear_one_does_not():
    def rounds(ratios):
        return {r: {1.0: [1.0], 0.9: [x]} for r, x in enumerate(ratios)}
    assert round_ratios(0.9, rounds([0.95, 0.97])) == [0.95, 0.97]
    assert not more_rounds(0.9, rounds([0.95, 0.96, 0.95]), 1.0, 3)           # clear of 1: done at the least
    assert more_rounds(0.9, rounds([0.95, 0.96]), 1.0, 3)                      # fewer than the least
    assert more_rounds(0.9, rounds([0.9, 1.1, 0.98]), 1.0, 3)                  # within its noise of 1
    assert not more_rounds(0.9, rounds([0.9, 1.1, 0.98] * 4), 1.0, 3)          # ... until EXTEND x the least
    assert more_rounds(0.9, rounds([0.9, 1.1, 0.98] * 2), 1.0, 3, extend=3)
    assert decided([0.97] * 3, 0.98) and not decided([], 1.0)                  # no spread: any gap decides
    assert [c.round for c in next_round(0.9, 2)] == [None, 2, 2, 2] * 2        # the third round, alternating
    assert [c.scale for c in next_round(0.9, 1)][::CONFIRM_BLOCK] == [0.9, 1.0]


def test_extended_rounds_land_nearer_the_fastest_split_than_fixed_ones_on_a_noisy_step():
    # a step 3:1 with fixed time the model did not see, each timed step 8% noisy (normal, in log): over the
    # same 150 noise draws, extending the undecided paired timings lands within 3% of the optimum more often
    cost, rows, best = _synthetic((3000.0, 1000.0), (0.0, 0.15), (3.0, 1.0))
    landed = {1: 0, EXTEND: 0}
    steps = {1: [], EXTEND: []}
    for seed in range(150):
        for extend in landed:
            rng = np.random.default_rng(seed)
            kept, timed = search(lambda s, rng=rng: cost(s) * np.exp(0.08 * rng.standard_normal()), key=rows,
                                 pair=point_rounds(MAX_STEPS_PER_POINT), rounds=confirm_rounds(MAX_STEPS_PER_POINT),
                                 extend=extend)
            landed[extend] += cost(kept) <= 1.03 * best
            steps[extend].append(len(timed))
    assert landed[EXTEND] > landed[1] + 10
    assert max(steps[EXTEND]) <= max_steps() and np.median(steps[1]) < np.median(steps[EXTEND])


def test_the_paired_rounds_see_through_drift_and_switch_costs():
    # the rival is 3% faster; the machine slows 40% over the confirmation, and the first step after each
    # switch costs double: paired rounds with the switch untimed keep the rival, pooled times need not
    order = confirmation_order(0.9, rounds=4, block=4)
    cost = {1.0: 1.0, 0.9: 0.97}
    timed, last = [], None
    for i, c in enumerate(order):
        t = cost[c.scale] * (1 + 0.4 * i / len(order)) * (2.0 if c.scale != last else 1.0)
        timed.append((c, t))
        last = c.scale
    rounds = rounds_of(timed)
    assert confirmed(0.9, rounds) == 0.9 and abs(paired_ratio(0.9, rounds) - 0.97) < 0.02
    assert all(len(r[s]) == CONFIRM_BLOCK - 1 for r in rounds.values() for s in (1.0, 0.9))


def test_the_fitted_vertex_is_where_the_arms_meet_and_needs_two_scales_each_side():
    v = lambda s: 1.0 + 2.0 * max(s - 0.9, 0) + 0.5 * max(0.9 - s, 0)   # noqa: E731  vertex at 0.9
    scales = (1.0, 0.85, 1.15, 0.775, 0.925, 1.3, 0.7)
    assert abs(vertex([(s, v(s)) for s in scales]) - 0.9) < 0.005
    assert vertex([(s, v(s)) for s in (1.0, 0.85, 1.15)]) is None          # an arm through one point fits anywhere
    assert vertex([(s, 2.0 - s) for s in scales]) is None                  # only falling: no vertex to read
    assert vertex([(s, 1.0) for s in scales]) is None                      # flat
    lucky = [(s, v(s) * (0.9 if s == 0.775 else 1.0)) for s in scales]    # one lucky timing moves it a little
    assert abs(vertex(lucky) - 0.9) < 0.05 and min(lucky, key=lambda p: p[1])[0] == 0.775


def test_a_split_timed_far_above_the_v_is_left_out_of_the_fit():
    v = lambda s: 1.0 + 2.0 * max(s - 1.15, 0) + 0.5 * max(1.15 - s, 0)   # noqa: E731  vertex at 1.15
    scales = (1.0, 0.85, 1.15, 1.3, 1.075, 1.225, 1.1875, 1.2625, 1.20625)
    quiet = [(s, v(s) * (1 + 0.01 * (-1) ** i)) for i, s in enumerate(scales)]
    assert abs(vertex(quiet) - 1.15) < 0.03
    hit = [(s, t * (1.5 if s == 1.1875 else 1.0)) for s, t in quiet]       # a burst of load on one split
    assert abs(vertex(hit) - 1.15) < 0.03
    assert not loaded(np.array([0.004, -0.003, 0.02, 0.001])).any()       # far in sigmas, but under 5%: kept
    assert list(loaded(np.array([0.01, -0.01, 0.02, -0.02, 0.5]))) == [False] * 4 + [True]
    # a refinement timed on the emulated cluster (the MLP sweep under a CPU quota near 2:1, seconds per
    # split): one split hit by load put the vertex on the prediction, so nothing was confirmed
    timed = [(1.0, 0.04330), (0.85, 0.04775), (1.15, 0.04309), (1.3, 0.04882), (1.075, 0.04314),
             (1.225, 0.03943), (1.1875, 0.06695), (1.2625, 0.04706), (1.20625, 0.04469)]
    assert vertex(timed) > 1.1 and rival([SplitTiming(s, (), t) for s, t in timed]) is not None


def test_a_short_step_is_timed_for_more_steps_per_split():
    assert steps_per_point(1.0) == STEPS_PER_POINT and steps_per_point(0.0) == MAX_STEPS_PER_POINT
    assert steps_per_point(0.045) == min(MAX_STEPS_PER_POINT, int(np.ceil(POINT_SECONDS / 0.045)))
    assert STEPS_PER_POINT < steps_per_point(0.045) and steps_per_point(1e-4) == MAX_STEPS_PER_POINT
    # a short step's confirmation runs more rounds in proportion, never fewer than the long step's
    assert confirm_rounds(STEPS_PER_POINT) == CONFIRM_ROUNDS
    assert confirm_rounds(2 * STEPS_PER_POINT) == 2 * CONFIRM_ROUNDS
    assert max_steps(steps_per_point=STEPS_PER_POINT) < max_steps()
    # each later split beside the prediction: as many timed steps as the prediction's, in whole blocks
    assert point_rounds(STEPS_PER_POINT) == MIN_POINT_ROUNDS
    assert point_rounds(MAX_STEPS_PER_POINT) == MAX_STEPS_PER_POINT // (CONFIRM_BLOCK - 1) > MIN_POINT_ROUNDS


@pytest.mark.parametrize("seconds", [0.3, 0.01])
def test_the_refiner_converges_on_a_synthetic_step_with_fixed_time_on_the_slow_device(seconds):
    # the Refiner driven step by step, its clock the synthetic step's time (3:1 speeds, the slow device
    # has fixed time the model does not know): it settles within max_steps() on a split within 1% of the
    # optimum, and times every split for as many steps as the first split's median asks
    from whalex.refining import Refiner
    cost, rows, best = _synthetic((3000.0, 1000.0), (0.0, 0.15), (3.0, 1.0))
    unit = seconds / cost(1.0)
    ref = Refiner(_FakePlan(_FakeCluster((3.0, 1.0)), rows(1.0)), lambda c: _FakePlan(c, rows(c.speeds[1])),
                  clock=_StepClock(lambda: unit * cost(ref.scale)))
    state = 0.0
    while ref.result is None:
        state, _ = ref.run(state, None, lambda st, p: st)
        assert ref.steps <= max_steps()
    r = ref.result.refinement
    per_point = steps_per_point(seconds)
    assert r.points[0].steps == per_point == (5 if seconds > 0.1 else 10) and r.points[0].paired == 1.0
    assert {p.steps for p in r.points[1:]} == {point_rounds(per_point) * (CONFIRM_BLOCK - 1)}
    assert all(p.paired == pytest.approx(cost(p.scale) / cost(1.0)) for p in r.points)
    assert cost(r.kept) <= 1.01 * best and r.kept < 1.0 and ref.result.batch_sizes == rows(r.kept)
    assert all(c.steps == confirm_rounds(per_point) * (CONFIRM_BLOCK - 1) for c in r.confirmed)


@pytest.mark.parametrize("phase", [0, 13, 27, 41])
def test_the_refiner_sees_through_slow_periods_that_hold_for_many_steps(phase):
    # the machine runs 30% slower for 40 steps in every 80 (a neighbour's burst, a throttling period),
    # longer than a split's timing: each split timed beside the prediction, in paired rounds, still
    # settles within 1% of the optimum and never on a split slower than the prediction
    from whalex.refining import Refiner
    cost, rows, best = _synthetic((3000.0, 1000.0), (0.0, 0.15), (3.0, 1.0))
    unit = 0.01 / cost(1.0)
    slowed = lambda: 1.3 if (ref.steps + phase) // 40 % 2 else 1.0            # noqa: E731
    ref = Refiner(_FakePlan(_FakeCluster((3.0, 1.0)), rows(1.0)), lambda c: _FakePlan(c, rows(c.speeds[1])),
                  clock=_StepClock(lambda: unit * cost(ref.scale) * slowed()))
    state = 0.0
    while ref.result is None:
        state, _ = ref.run(state, None, lambda st, p: st)
    r = ref.result.refinement
    assert cost(r.kept) <= 1.01 * best and cost(r.kept) < cost(1.0) and r.steps <= max_steps()


@pytest.mark.parametrize("scaled_fixed", [True, False])
def test_the_refiner_moves_rows_where_the_slow_device_fixed_time_was_over_estimated(scaled_fixed):
    # the calibration over-estimated the slow device's fixed time twelvefold (it was timed in a slow
    # period): each split makes the slow device `scale` times as fast, fixed time included, so the bracket
    # reaches the rows it should have; scaling its speed alone moves few rows per step of the scale
    from whalex import refining
    speeds, true_fixed = (3000.0, 1000.0), (0.0, 0.05)

    def rows_of(c):
        return tuple(proportional(BATCH, c.speeds, c.overhead))

    def cost(r):
        return max(f + n / v for f, n, v in zip(true_fixed, r, speeds))
    best = cost(proportional(BATCH, speeds, true_fixed))
    base = _FakeCluster(speeds, overhead=(0.0, 0.6))
    scaled = refining.scaled_cluster if scaled_fixed else (
        lambda c, s: c.with_speeds(refining.scaled_speeds(c.speeds, s)[0], overhead=c.overhead))
    assert scaled(base, 1.3).overhead == ((0.0, 0.6 / 1.3) if scaled_fixed else (0.0, 0.6))
    unit = 0.01 / cost(rows_of(base))
    ref = refining.Refiner(_FakePlan(base, rows_of(base)), lambda c: _FakePlan(c, rows_of(c)),
                           clock=_StepClock(lambda: unit * cost(ref.plan_at(ref.scale).batch_sizes)))
    if not scaled_fixed:                                               # the speed-only split, for contrast
        ref.plan_at = lambda s: ref.plans.setdefault(s, _FakePlan(scaled(base, s), rows_of(scaled(base, s))))
    state = 0.0
    while ref.result is None:
        state, _ = ref.run(state, None, lambda st, p: st)
    kept = ref.result.batch_sizes
    assert cost(rows_of(base)) > 1.1 * best                            # the prediction: 13% slower
    assert (cost(kept) <= 1.01 * best) == scaled_fixed


class _StepClock:
    """A clock that advances by the step's seconds between each start and stop reading."""

    def __init__(self, seconds):
        self.seconds, self.now, self.calls = seconds, 0.0, 0

    def __call__(self):
        self.calls += 1
        if self.calls % 2 == 0:
            self.now += self.seconds()
        return self.now


@dataclasses.dataclass(frozen=True)
class _FakeCluster:
    speeds: tuple
    spread: tuple = ()
    overhead: tuple | None = None
    calibrated_rows: tuple | None = None

    def with_speeds(self, speeds, spread=(), overhead=None, rows=None):
        return _FakeCluster(tuple(speeds), spread, overhead, rows)


@dataclasses.dataclass(frozen=True)
class _FakePlan:
    """What a Refiner reads of a plan: its cluster, rows, placement and jitted step."""

    cluster: _FakeCluster
    batch_sizes: tuple
    head_balance: None = None
    stage_layers: tuple = ()
    refinement: object = None

    def jitted(self):
        return lambda state, batch: (state, {})

    def place_batch(self, batch):
        return batch


def test_the_fitted_rival_lands_nearer_the_fastest_split_than_the_least_timed():
    # a noisy step (2% per step, medians of STEPS_PER_POINT): the V read from every split against the least of them
    rng = np.random.default_rng(0)
    excess = {"vertex": [], "least": []}
    for fixed in [(0.0, 0.15), (0.0, 0.3), (0.25, 0.0)]:
        cost, rows, best = _synthetic((3000.0, 1000.0), fixed, (3.0, 1.0))
        for _ in range(100):
            timed, gen = [], bracket_search(key=rows)
            try:
                s = next(gen)
                while True:
                    noisy = [cost(s) * (1 + 0.02 * rng.standard_normal()) for _ in range(STEPS_PER_POINT)]
                    timed.append(SplitTiming(s, rows(s), float(np.median(noisy))))
                    s = gen.send(timed[-1].seconds)
            except StopIteration:
                pass
            fitted = rival(timed, key=rows)
            excess["vertex"].append(cost(1.0 if fitted is None else fitted) / best - 1)
            excess["least"].append(cost(min(timed, key=lambda p: p.seconds).scale) / best - 1)
    assert np.median(excess["vertex"]) < 0.01 and np.mean(excess["vertex"]) < np.mean(excess["least"])


def test_the_search_is_a_generator_a_step_can_drive_and_its_cost_is_bounded():
    gen = bracket_search()
    s, n = next(gen), 0
    assert s == 1.0
    try:
        while True:
            n += 1
            assert LO <= s <= HI
            s = gen.send(abs(s - 0.9))
    except StopIteration as stop:
        assert abs(stop.value - 0.9) < 0.05
    confirming = 2 * EXTEND * confirm_rounds(MAX_STEPS_PER_POINT) * CONFIRM_BLOCK   # each undecided timing extended
    paired = 1 + 2 * EXTEND * point_rounds(MAX_STEPS_PER_POINT) * CONFIRM_BLOCK    # a later split's compile, rounds
    assert n <= POINTS
    assert max_steps() == FIRST_WARMUP + MAX_STEPS_PER_POINT + (POINTS - 1) * paired + 1 + confirming


def test_bad_brackets_are_clear_errors():
    with pytest.raises(ValueError, match="0 < lo < 1 < hi"):
        next(bracket_search(1.1, 1.3))
    with pytest.raises(ValueError, match="points >= 3"):
        next(bracket_search(points=2))
    with pytest.raises(ValueError, match="widens within its reach"):
        next(bracket_search(0.7, 1.3, reach=(0.8, 2.0)))


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_a_refining_step_trains_exactly_as_one_device_and_keeps_its_fastest_timed_split(opt):
    import optax

    import whalex as wh
    from conftest import HETERO, adam, assert_each_step_matches
    from support.models import plain_model
    loss_fn, params, batch = plain_model("dp", "ctx")
    optimizer = optax.sgd(0.1) if opt == "sgd" else adam()
    step, _ = assert_each_step_matches(loss_fn, params, batch, max_steps() + 2, optimizer, tol=1e-4,
                                       config=wh.Config(hardware_aware="refine"), cluster=wh.Cluster(kinds=HETERO))
    r = step.plan.refinement
    assert r is not None and r.steps <= max_steps()                    # settled within the stated budget
    assert STEPS_PER_POINT <= r.points[0].steps <= MAX_STEPS_PER_POINT and r.points[0].paired == 1.0
    least = point_rounds(r.points[0].steps) * (CONFIRM_BLOCK - 1)      # each split's paired rounds, extended
    assert all(p.steps % (CONFIRM_BLOCK - 1) == 0 and least <= p.steps <= EXTEND * least for p in r.points[1:])
    assert len({p.rows for p in r.points}) == len(r.points) >= 2       # it moved the split, each placement once
    assert r.predicted.rows == wh.plan(loss_fn, params, batch, optimizer, cluster=wh.Cluster(kinds=HETERO)).batch_sizes
    fitted = vertex([(p.scale, p.paired) for p in r.points])          # the search's paired ratios
    if r.confirmed:                                                    # then re-timed the prediction and its rival
        a, b = r.confirmed
        least = min((p for p in r.points if p.scale != 1.0), key=lambda p: p.paired).scale
        assert a.scale == 1.0 and b.scale == (least if fitted is None else b.scale)
        assert fitted is None or b.scale == fitted or b.scale in {p.scale for p in r.points}
        rounds = confirm_rounds(r.points[0].steps) * (CONFIRM_BLOCK - 1)
        assert a.steps == b.steps and rounds <= a.steps <= EXTEND * rounds and r.kept in (1.0, b.scale)
        assert r.kept == (b.scale if r.paired < 1.0 else 1.0)          # decided by the paired rounds
        assert r.gain == (1.0 / r.paired if r.kept != 1.0 else 1.0)
    else:                                                              # the V's vertex is the prediction's split
        assert fitted is not None and r.kept == 1.0
    assert step.plan.batch_sizes == r.chosen.rows
    assert r.slow == (4, 5, 6, 7)                                      # the T4s' speed was scaled
    text = step.plan.summary()
    assert "refined on the real step" in text and f"{r.steps} steps" in text
    assert ("confirmed in paired blocks" in text) == bool(r.confirmed)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_a_refining_step_trains_a_masked_mean_on_padded_rows_exactly_as_one_device(opt):
    """The splits a refinement moves through give each device other rows, padded ones among them: the
    masked mean's numerator and denominator are summed over every device at each split alike."""
    import optax

    import whalex as wh
    from conftest import HETERO, adam, assert_each_step_matches
    from support.models import masked_mlp
    loss_fn, params, batch = masked_mlp(96, seed=3)
    optimizer = optax.sgd(0.1) if opt == "sgd" else adam()
    step, _ = assert_each_step_matches(loss_fn, params, batch, max_steps() + 2, optimizer, tol=1e-4,
                                       config=wh.Config(hardware_aware="refine"), cluster=wh.Cluster(kinds=HETERO))
    r = step.plan.refinement
    assert r is not None and r.steps <= max_steps() and len({p.rows for p in r.points}) >= 2
    assert step.plan.batch_sizes == r.chosen.rows


def test_a_refining_split_head_trains_exactly_as_one_device():
    # Whale's Example 2 on a declared V100+T4 cluster: the backbone's rows and the head's classes move together
    import optax

    import whalex as wh
    from balance.test_heterogeneous_balance import _head_model
    from conftest import HETERO, assert_each_step_matches
    loss_fn, params, batch = _head_model()
    step, _ = assert_each_step_matches(loss_fn, params, batch, max_steps() + 2, optax.sgd(0.1), tol=1e-4,
                                       config=wh.Config(hardware_aware="refine"), cluster=wh.Cluster(kinds=HETERO))
    r = step.plan.refinement
    assert r is not None and r.steps <= max_steps() and len(r.points) >= 2
    assert step.plan.head_balance.applied and step.plan.batch_sizes == r.chosen.rows
    assert r.chosen.units == tuple(d.rows for d in step.plan.head_balance.devices)
    assert "(head " in step.plan.summary()


def test_a_refining_auto_parallel_pipeline_moves_its_stage_cut_and_trains_exactly_as_one_device():
    import optax

    import whalex as wh
    from conftest import HETERO, assert_each_step_matches
    from lowering.test_pipeline import deep_model
    loss_fn, params, batch = deep_model()
    config = wh.Config(num_micro_batch=4, num_task_graph=2, auto_parallel=True, hardware_aware="refine")
    step, _ = assert_each_step_matches(loss_fn, params, batch, max_steps() + 2, optax.sgd(0.01), tol=1e-4,
                                       config=config, cluster=wh.Cluster(kinds=HETERO))
    r = step.plan.refinement
    assert r is not None and r.steps <= max_steps() and len(r.points) >= 2 and step.plan.schedule is not None
    assert not r.confirmed or r.kept == (r.confirmed[1].scale if r.paired < 1.0 else 1.0)


def test_refine_is_refused_on_annotated_stages_and_bad_values_are_clear_errors():

    import whalex as wh
    from conftest import HETERO, adam
    from lowering.test_pipeline import _plain, _two_stage
    params, batch = _plain()
    step = wh.parallelize(_two_stage, adam(), config=wh.Config(hardware_aware="refine", num_micro_batch=4),
                          cluster=wh.Cluster(kinds=HETERO))
    with pytest.raises(wh.PlanError, match=r"annotated scopes.*hardware_aware=True.*auto_parallel=True"):
        step.init(params, batch)
    for bad in ("Refine", 1, None):
        with pytest.raises(wh.ConfigError, match=r"hardware_aware must be True.*'refine'"):
            wh.Config(hardware_aware=bad)
    assert wh.Config({"cluster.hardware_aware": "refine"}).hardware_aware == "refine"
