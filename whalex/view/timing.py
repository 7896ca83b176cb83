"""Measured beside predicted: the plan's predicted step time, and a helper that times real steps.

    timing, state = time_steps(step, state, batch, steps=5)
    print(timing)        # measured ... ms per step (median of 5, ± ...%); predicted ... ms ...
    timing               # in a notebook: a small table

The prediction is the plan's cost model of compute and a pipeline's exchanges: on a heterogeneous plan the balance
report's per-device time (fixed time + rows x FLOPs per row / speed), otherwise each device's even
share of the plan's FLOPs (counted from the jaxpr) over its speed (the spec table's peak FP32 FLOP/s,
its bf16 tensor-core peak under amp, or calibrated speeds); a pipeline's as its ticks run in lockstep,
each as long as its costliest task, with the messages' exchanges between stages over the links
(`whalex.mesh.links`). Other collectives, launches and memory traffic are not in it, so measured /
predicted says how far a real step is from that bound.
"""
from __future__ import annotations

import dataclasses
import html
import statistics
import time

import jax
import numpy as np

from whalex.mesh.links import exchange_seconds, stage_pairs
from whalex.records import schedules
from whalex.view.format import fmt_pct, fmt_time


@dataclasses.dataclass(frozen=True)
class Prediction:
    device_times: tuple[float, ...]     # predicted seconds of compute per step, per device
    basis: str                          # what the model counts
    even_times: tuple[float, ...] | None = None   # the same under the even plan, when a balance was made

    @property
    def step_time(self) -> float:
        """The step waits for the slowest device."""
        return max(self.device_times, default=0.0)


def predict(plan) -> Prediction:
    """Per-device predicted compute time of one step, from the plan's own cost model, at the speed of
    the precision the step computes in (`Config.amp`)."""
    used = len(plan.memory) or None                                   # the devices the plan uses
    fp32 = plan.cluster.speeds[:used]
    speeds = plan.cluster.compute_speeds(plan.config.amp)[:used]
    precision = f" ({plan.config.amp} peak)" if speeds != fp32 else ""
    reports = [r for r in (plan.balance, plan.head_balance) if r is not None]
    if reports and len({len(r.devices) for r in reports}) == 1:
        times = [0.0] * len(reports[0].devices)
        even = [0.0] * len(reports[0].devices)
        for r in reports:                   # hybrid: the batch's report counts the backbone, the head's the head
            for i, d in enumerate(r.devices):
                scale = fp32[i] / speeds[i] if i < len(speeds) else 1.0   # the reports count at FP32 speed
                times[i] += d.overhead + ((d.time if r.applied else d.even_time) - d.overhead) * scale
                even[i] += d.overhead + (d.even_time - d.overhead) * scale
        return Prediction(tuple(times), "balance cost model: fixed time + load x FLOPs per unit / device speed"
                          + precision, tuple(even) if any(r.applied for r in reports) else None)
    if plan.schedule is not None and len(plan.task_graphs) == plan.schedule.num_stages:
        return _lockstep(plan, speeds, precision)
    flops = sum(t.flops for t in plan.task_graphs) / max(len(speeds), 1)
    return Prediction(tuple(flops / s for s in speeds), "even share of the plan's FLOPs / device speed" + precision)


def _lockstep(plan, speeds, precision: str) -> Prediction:
    """A pipeline's step: its ticks in lockstep, each as long as its costliest task, a stage's task
    timed on its slowest device (a forward a third of the stage's FLOPs per micro-batch; a backward,
    which recomputes the forward first, all of them), and each tick that moves messages their exchange
    over the slowest link between neighbouring stages (`exchange`)."""
    s = plan.schedule
    fwd, bwd = schedules.RECOMPUTE_COSTS
    per = [t.flops / (max(t.nested_dp, 1) * s.num_micro_batch * max(t.device_count, 1))
           / min(speeds[d] for d in t.devices) for t in plan.task_graphs]
    seconds, link_source = exchange(plan)
    step = s.lockstep_time([p * fwd / bwd for p in per], per, exchange=seconds)
    moving = seconds[seconds > 0]
    basis = (f"pipeline ticks in lockstep, each as long as its costliest task (stage FLOPs / device speed"
             f"{precision}), and {len(moving)} exchanges of messages between stages"
             + (f", {fmt_time(float(moving.mean()))} each on average ({link_source} links)" if len(moving) else "")
             + f"; utilisation {fmt_pct(s.utilisation(*schedules.RECOMPUTE_COSTS))}, "
             f"bubble {fmt_pct(s.bubble_fraction)}")
    return Prediction(tuple(step for _ in speeds), basis)


def exchange(plan) -> tuple[np.ndarray, str]:
    """(seconds of each tick's exchange, 0 where no message moves; where its links' figures come from):
    each stage's message over the slowest link to its neighbour, as the ticks run it: at 2 stages one
    swap, otherwise one collective per direction in which a message moves."""
    s, buffers = plan.schedule, plan.report.stage_buffers()
    forward, back = s.sends.forward, s.sends.back
    if buffers is None or s.num_stages < 2:
        return np.zeros(len(forward)), "no"
    pairs = stage_pairs([t.devices for t in plan.task_graphs], ring=s.virtual_stages > 1)
    one, two = (exchange_seconds(plan.cluster, pairs, buffers.message_bytes, k) for k in (1, 2))
    both = forward & back if s.num_stages > 2 else np.zeros_like(forward)
    seconds = np.where(both, two, np.where(forward | back, one, 0.0))
    return seconds, "calibrated" if plan.cluster.links is not None else "spec-table"


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """Measured seconds per step beside the plan's predicted compute time."""

    times: tuple[float, ...]
    predicted: float
    basis: str

    @property
    def measured(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> float:
        """Relative spread of the measurements: (max - min) / 2 / median."""
        return (max(self.times) - min(self.times)) / 2 / self.measured if self.measured > 0 else 0.0

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted if self.predicted > 0 else float("inf")

    def rows(self) -> list[tuple[str, str, str]]:
        return [("measured", fmt_time(self.measured), f"median of {len(self.times)} steps, ±{fmt_pct(self.spread)}"),
                ("predicted", fmt_time(self.predicted), self.basis),
                ("measured / predicted", f"{self.ratio:.2f}x", "above 1: time the compute model does not count")]

    def __str__(self) -> str:
        return "; ".join(f"{k} {v} ({why})" for k, v, why in self.rows())

    def _repr_html_(self) -> str:
        body = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th>"
                       f"<td style='text-align:right;font-variant-numeric:tabular-nums'>{html.escape(v)}</td>"
                       f"<td>{html.escape(why)}</td></tr>" for k, v, why in self.rows())
        return f"<table><caption>whalex step time</caption><tbody>{body}</tbody></table>"


def time_steps(step, state, batch, steps: int = 5, warmup: int = 1):
    """Run `warmup` then `steps` training steps of `step` on `batch`, timing each to completion.

    Returns `(StepTiming, state)`: the steps train, and the step donates its state, so go on with
    the returned state. The first call of a new step compiles it: `warmup` keeps that out.
    """
    if steps < 1:
        raise ValueError(f"time_steps needs steps >= 1, got {steps}.")
    for _ in range(warmup):
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    p = predict(step.plan)
    return StepTiming(tuple(times), p.step_time, p.basis), state
