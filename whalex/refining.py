"""`Config(hardware_aware="refine")`: a Step's first calls time the real jitted step at splits around
the predicted balance and keep the fastest: data-parallel rows, uneven split shards, an auto_parallel
pipeline's stage cut (whatever the cluster's speeds decide).

The search is `whalex.balance.refine.sweep` over the slow devices' speed scale, a generator of rounds
of steps; each split is a whole plan (`build_plan` on the cluster with that speed). The Refiner runs a
round's steps one training call at a time, each on its split's plan, and hands the round's seconds
back; the sweep keeps the vertex of the V fitted to its rounds. A hybrid (replicated rows and a split
head's classes) is swept the rows alone, then the classes alone at the rows kept, then, where that
moved the classes, the rows alone once more at the classes kept: their shares were calibrated apart
(the classes' by the head's own program, `Cluster.head_scale`), either can be off on its own, and the
step's time is the rows' part and the head's, each waiting for its slowest device; where the two
parts are not apart (one device's rows and classes share its time), the rows kept at the calibrated
classes are not the rows of the classes kept (sweeps one after the other descend one coordinate at a
time, and the third is that descent's next step). Every step trains: only where the rows run changes,
so training equals one device's throughout. In a multi-process run each step's time is the slowest
process's, so every process settles on the same plan.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from whalex.balance.refine import HI, LO, Refinement, Swept, sweep
from whalex.errors import PlanError
from whalex.mesh.cluster import scaled_speeds
from whalex.plan import Plan


def refinable(plan: Plan) -> bool:
    """Whether `plan` has a balanced split to refine: uneven data-parallel rows, uneven split shards
    (a hybrid's rows, then its head's classes), or an auto_parallel pipeline's stage cut on
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
    """What a refinement moves, as a key: rows per device, a split's units per device (a hybrid's head, or
    the plan's split where the rows are even), stage layers."""
    split = plan.head_balance
    if split is None and plan.balance is not None and not plan.balance.of_batch:
        split = plan.balance
    head = () if split is None else tuple(d.rows for d in split.devices)
    return tuple(plan.batch_sizes), head, tuple(map(tuple, plan.stage_layers))


class Refiner:
    """Drives the sweeps of one plan (one batch shape) over a Step's calls: the split the cluster's speeds
    decide; for a hybrid (replicated rows and a split head's classes), the rows alone, the classes where
    they were, then the classes alone at the rows kept (`_head_sweep`), then the rows again at the classes
    kept where those moved (`_rows_again`): what the rows' calibration and the head's timed program each
    got wrong, each undone on the real step."""

    def __init__(self, base: Plan, make_plan: Callable, clock: Callable[[], float] = time.perf_counter):
        self.base, self.make_plan, self.clock = base, make_plan, clock
        self.steps = 0
        self.result: Plan | None = None
        self.slow = scaled_speeds(base.cluster.speeds, 1.0)[1]
        self.found: list[Refinement] = []    # the records of the sweeps run so far (a hybrid runs up to three)
        self.rows_scale = 1.0                 # the scale the rows' sweep kept, while the later sweeps run
        c = base.cluster
        rows_alone = lambda s: scaled_cluster(c, s).with_head_scale(c.head_scale / s, self.slow)   # noqa: E731
        self._start(base, rows_alone if base.head_balance is not None else lambda s: scaled_cluster(c, s), {})

    def _start(self, prediction: Plan, cluster_at: Callable, jitted: dict) -> None:
        """Begin a sweep whose scale s runs the plan on `cluster_at(s)`, `prediction` its plan at 1."""
        self.cluster_at = cluster_at
        self.plans = {1.0: prediction}
        self.jitted = jitted
        self.sweep = sweep(key=lambda s: placement(self.plan_at(s)))
        self.queue = list(next(self.sweep))    # the round's steps still to run, in order
        self.seconds: list[float] = []         # the round's steps run so far, timed
        self.scale = self.queue[0].scale

    def plan_at(self, scale: float) -> Plan:
        """The plan of the sweep's split at `scale`: in the rows' sweep, the slow devices `scale` times as
        fast (their speed times it and their fixed seconds over it, `scaled_cluster`; a hybrid's classes
        where they were); in the head's, their speed on the classes `scale` times as calibrated."""
        if scale not in self.plans:
            self.plans[scale] = self.make_plan(self.cluster_at(scale))
        return self.plans[scale]

    def current(self) -> tuple[Plan, Callable]:
        """The plan to run the next step with, and its jitted step."""
        p = self.plan_at(self.scale)
        if self.scale not in self.jitted:
            self.jitted[self.scale] = p.jitted()
        return p, self.jitted[self.scale]

    def run(self, state, batch, relayout: Callable):
        """One training step of the sweep: (state, metrics). When the sweep ends, `result` holds the
        kept plan (its `refinement` filled in)."""
        p, jitted = self.current()
        state = relayout(state, p)
        batch = p.place_batch(batch)
        jax.block_until_ready((state, batch))       # moving the state or the rows is not the step's time
        t0 = self.clock()
        state, metrics = jitted(state, batch)
        jax.block_until_ready((state, metrics))
        self.seconds.append(self.clock() - t0)
        self.steps += 1
        self.queue.pop(0)
        if not self.queue:
            self._next_round()
        if self.result is None:
            self.scale = self.queue[0].scale
        return state, metrics

    def _next_round(self) -> None:
        """A round is done: hand its seconds (the slowest process's, alike on every process) to the sweep,
        and queue the next round, or keep the split it found."""
        seconds, self.seconds = slowest(self.seconds), []
        try:
            self.queue = list(self.sweep.send(seconds))
        except StopIteration as stop:
            self._finish(stop.value)

    def _finish(self, found: Swept) -> None:
        """A sweep ended: keep the split found (the plan of a split timed where one has its placement, its
        step compiled already, else the plan at the scale kept); then a hybrid's next sweep, or the result
        (the rows' sweep's record holding the later sweeps', its steps theirs all)."""
        at = placement(self.plan_at(found.kept))
        self.scale = next((s for s in self.jitted if placement(self.plan_at(s)) == at), found.kept)
        kept = self.current()[0]
        self.found.append(self._record(found, kept))
        if len(self.found) == 1:
            self.rows_scale = self.scale
            if self._head_sweep(kept):
                return
        elif len(self.found) == 2 and self._rows_again(kept):
            return
        record = self.found[0]
        if len(self.found) > 1:
            record = dataclasses.replace(record, steps=self.steps, head=self.found[1],
                                         again=self.found[2] if len(self.found) > 2 else None)
        self.result = dataclasses.replace(kept, refinement=record)

    def _record(self, found: Swept, kept: Plan) -> Refinement:
        """What a sweep timed and kept, each split's rows and units named, its steps the sweep's own."""
        def rows(t):
            q = self.plan_at(t.scale)
            return dataclasses.replace(t, rows=tuple(q.batch_sizes), units=placement(q)[1])
        before = sum(f.steps for f in self.found)
        return Refinement(tuple(map(rows, found.points)), self.slow, self.steps - before, found.kept,
                          tuple(kept.batch_sizes), placement(kept)[1], found.gain, found.rounds, found.fitted)

    def _head_sweep(self, kept: Plan) -> bool:
        """Start the head's sweep at `kept`'s rows where the classes move apart from them (a split head of
        a hybrid: `Cluster.head_scale`); False where nothing would move."""
        if self.base.head_balance is None:
            return False
        rows = self.cluster_at(self.scale)
        at = lambda h: rows.with_head_scale(rows.head_scale * h, self.slow)          # noqa: E731
        probe = {h: self.make_plan(at(h)) for h in (LO, HI)}
        if all(placement(p)[1] == placement(kept)[1] for p in probe.values()):
            return False
        self._start(kept, at, {1.0: self.jitted[self.scale]})
        self.plans.update(probe)
        return True

    def _rows_again(self, kept: Plan) -> bool:
        """Start the rows' sweep once more, at the classes the head's sweep kept, where it moved them from
        where the rows' sweep ran; False where it kept them. Its scale s runs the slow devices' rows at s
        times the speed the rows' sweep kept, their speed on the classes the head's sweep kept."""
        if placement(kept)[1] == self.found[0].kept_units:
            return False
        c, rows, head = self.base.cluster, self.rows_scale, self.cluster_at(self.scale).head_scale
        at = lambda s: scaled_cluster(c, rows * s).with_head_scale(head / s, self.slow)   # noqa: E731
        self._start(kept, at, {1.0: self.jitted[self.scale]})
        return True


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
