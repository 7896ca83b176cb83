"""`Config(hardware_aware="refine")`: a Step's first calls time the real jitted step at splits around
the predicted balance and keep the fastest: data-parallel rows, uneven split shards, an auto_parallel
pipeline's stage cut (whatever the cluster's speeds decide).

The search is `whalex.balance.refine.bracket_search` over the slow devices' speed scale; each split is
a whole plan (`build_plan` on the cluster with that speed). The prediction runs `FIRST_WARMUP` untimed
steps (the Step's own first calls) and as many timed ones as `steps_per_point` gives for its median (at
least `STEPS_PER_POINT`: more where the step is short); every later split runs `WARMUP_STEPS` untimed
steps (its compile) and `point_rounds` paired rounds of a block of `CONFIRM_BLOCK` steps beside a block
of the prediction (more, one at a time, while a ratio is undecided: `more_rounds`), and the search
compares their paired ratios. Then the confirmation: `confirm_rounds` such rounds (or more, likewise)
of the prediction and its rival (the vertex of a V fitted to every split's ratio;
`whalex.balance.refine.confirmed` keeps one). Every step trains: only where the rows run changes, so
training equals one device's throughout. In a multi-process run each step's time is the slowest
process's, so every process settles on the same plan.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from whalex.balance.refine import (
    FIRST_WARMUP,
    HI,
    LO,
    POINTS,
    STEPS_PER_POINT,
    WARMUP_STEPS,
    ConfirmStep,
    Refinement,
    SplitTiming,
    bracket_search,
    confirm_rounds,
    confirmation_order,
    confirmed,
    median_spread,
    more_rounds,
    next_round,
    paired_ratio,
    point_rounds,
    rival,
    rounds_of,
    scaled_speeds,
    steps_per_point,
)
from whalex.errors import PlanError
from whalex.plan import Plan


def refinable(plan: Plan) -> bool:
    """Whether `plan` has a balanced split to refine: uneven data-parallel rows, uneven split shards
    (a hybrid's rows and head classes move together), or an auto_parallel pipeline's stage cut on
    devices of different speeds. An even plan has nothing to refine; an annotated pipeline's stages
    are the user's, and a refinement refuses it (PlanError) rather than time one split."""
    if any(r is not None and r.applied for r in (plan.balance, plan.head_balance)):
        return True
    if plan.schedule is not None and len(set(plan.cluster.speeds)) > 1:
        if plan.config.auto_parallel:
            return True
        raise PlanError("Config(hardware_aware='refine') moves a balanced split; this pipeline's stages are the "
                        "annotated scopes, which it does not move. Use Config(hardware_aware=True), or "
                        "auto_parallel=True to let whalex cut the stages (and refine the cut).")
    return False


def placement(plan: Plan) -> tuple:
    """What a refinement moves, as a key: rows per device, a split head's units per device, stage layers."""
    head = () if plan.head_balance is None else tuple(d.rows for d in plan.head_balance.devices)
    return tuple(plan.batch_sizes), head, tuple(map(tuple, plan.stage_layers))


class Refiner:
    """Drives one bracketing search over a Step's calls for one plan (one batch shape)."""

    def __init__(self, base: Plan, make_plan: Callable, clock: Callable[[], float] = time.perf_counter):
        self.base, self.make_plan, self.clock = base, make_plan, clock
        self.plans = {1.0: base}
        self.jitted: dict = {}
        self.search = bracket_search(LO, HI, POINTS, key=lambda s: placement(self.plan_at(s)))
        self.scale = next(self.search)
        self.times: list[float] = []           # the prediction's timed steps
        self.points: list[SplitTiming] = []
        self.steps = 0
        self.per_point: int | None = None      # timed steps per split, set by the first split's median
        self.queue: list[ConfirmStep] = []     # a paired timing's steps still to run, in order
        self.paired: list[tuple[ConfirmStep, float]] = []      # its timed steps so far
        self.confirming = False                # the paired timing under way is the confirmation
        self.timing: tuple[float, int, float] = (1.0, 0, 1.0)  # its split, least rounds and threshold
        self.result: Plan | None = None
        self.slow = scaled_speeds(base.cluster.speeds, 1.0)[1]

    def plan_at(self, scale: float) -> Plan:
        """The plan with the slow devices `scale` times as fast: their speed times it and their fixed
        seconds over it (`scaled_cluster`)."""
        if scale not in self.plans:
            self.plans[scale] = self.make_plan(scaled_cluster(self.base.cluster, scale))
        return self.plans[scale]

    def current(self) -> tuple[Plan, Callable]:
        """The plan to run the next step with, and its jitted step."""
        p = self.plan_at(self.scale)
        if self.scale not in self.jitted:
            self.jitted[self.scale] = p.jitted()
        return p, self.jitted[self.scale]

    def run(self, state, batch, relayout: Callable):
        """One training step of the search: (state, metrics). When the search ends, `result` holds the
        kept plan (its `refinement` filled in)."""
        p, jitted = self.current()
        state = relayout(state, p)
        batch = p.place_batch(batch)
        jax.block_until_ready((state, batch))       # moving the state or the rows is not the step's time
        t0 = self.clock()
        state, metrics = jitted(state, batch)
        jax.block_until_ready((state, metrics))
        seconds = self.clock() - t0
        self.steps += 1
        if self.queue:
            self._queued(seconds)
            return state, metrics
        if self.steps > FIRST_WARMUP:                 # the Step's first calls (compile, warm-up): untimed
            self.times.append(seconds)
        if self.per_point is None and len(self.times) == STEPS_PER_POINT:
            self.per_point = steps_per_point(float(np.median(slowest(self.times))))
        if len(self.times) == self.per_point:
            med, spread = median_spread(slowest(self.times))
            self._record(SplitTiming(1.0, tuple(p.batch_sizes), med, spread, len(self.times), placement(p)[1], 1.0))
        return state, metrics

    def _queued(self, seconds: float) -> None:
        """One step of a paired timing (a split beside the prediction, or the confirmation): untimed (a
        warm-up of a split not timed before, a block's first step) or timed for its round; after a round's
        last, another round where the ratio is still undecided (`more_rounds`), else the split's paired
        ratio goes to the search, or the confirmation decides."""
        step = self.queue.pop(0)
        if step.round is not None:
            self.paired.append((step, seconds))
        if self.queue:
            self.scale = self.queue[0].scale
            return
        seconds_all = slowest([t for _, t in self.paired])       # alike on every process: one decision
        timed = [(c, t) for (c, _), t in zip(self.paired, seconds_all)]
        other, least, threshold = self.timing
        rounds = rounds_of(timed)
        if more_rounds(other, rounds, threshold, least):
            self.queue = list(next_round(other, len(rounds)))
            self.scale = self.queue[0].scale
            return
        self.paired = []
        ratio = paired_ratio(other, rounds)
        pooled = {s: median_spread([t for c, t in timed if c.scale == s]) + (sum(c.scale == s for c, _ in timed),)
                  for s in (1.0, other)}

        def timing(s, paired):
            q = self.plan_at(s)
            return SplitTiming(s, tuple(q.batch_sizes), *pooled[s], placement(q)[1], paired)
        if self.confirming:
            self._finish(confirmed(other, rounds), (timing(1.0, 1.0), timing(other, ratio)), ratio)
        else:
            self._record(timing(other, ratio))

    def _record(self, point: SplitTiming) -> None:
        """A split's timing is in: ask the search for the next split (timed beside the prediction, against
        the best ratio so far), or start the confirmation of the rival (against the prediction)."""
        self.points.append(point)
        per_point = self.per_point or STEPS_PER_POINT
        try:
            self.scale = self.search.send(point.relative)
            self._pair(self.scale, point_rounds(per_point), min(q.relative for q in self.points), WARMUP_STEPS)
        except StopIteration as stop:
            other = rival(self.points, key=lambda s: placement(self.plan_at(s)))
            rounds = confirm_rounds(per_point)
            if other is None or rounds == 0:
                self._finish(1.0 if rounds else stop.value, ())
            else:
                self.confirming = True
                self._pair(other, rounds, 1.0, 0 if any(q.scale == other for q in self.points) else WARMUP_STEPS)

    def _pair(self, other: float, least: int, threshold: float, warmup: int) -> None:
        """Start timing `other` beside the prediction: `warmup` untimed steps, then `least` paired rounds
        (more while its ratio is undecided against `threshold`)."""
        self.timing = (other, least, threshold)
        self.queue = list(confirmation_order(other, least, warmup))
        self.scale = self.queue[0].scale

    def _finish(self, kept: float, confirmations: tuple[SplitTiming, ...], paired: float = 1.0) -> None:
        record = Refinement(tuple(self.points), self.slow, self.steps, kept, confirmations, paired)
        self.result = dataclasses.replace(self.plan_at(kept), refinement=record)
        self.scale = kept


def scaled_cluster(c, scale: float):
    """`c` with its slowest devices `scale` times as fast as calibrated: their speed multiplied by it and
    their fixed seconds per step divided by it, every other device's kept. Scaling the speed alone
    would move few rows where a slow device's fixed time is a large part of its step (a calibration
    that over-estimated that time is what the refinement has to undo)."""
    speeds, slow = scaled_speeds(c.speeds, scale)
    overhead = None if c.overhead is None else tuple(o / scale if i in slow else o for i, o in enumerate(c.overhead))
    return c.with_speeds(speeds, spread=c.spread, overhead=overhead, rows=c.calibrated_rows)


def slowest(times: list[float]) -> list[float]:
    """Each entry's seconds on the slowest process (the same list on every process): what every process decides
    from timings, so that all run the same program next."""
    if jax.process_count() == 1:
        return times
    every = np.asarray(multihost_utils.process_allgather(np.asarray(times, np.float64)))
    return every.reshape(jax.process_count(), -1).max(0).tolist()
