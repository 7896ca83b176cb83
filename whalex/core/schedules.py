"""Pipeline schedules as plain data: which micro-batch each stage runs forward or backward per tick.

A schedule is built by simulating stages that each follow a fixed task order ("1f1b":
PipeDream-flush, backward-first; "gpipe": all forwards then all backwards) under the pipeline's
dependencies: F(s, m) after F(s-1, m), B(s, m) after B(s+1, m) and after F(s, m), each message
arriving one tick after it is sent. The result is validated at construction and is everything the
runtime needs: it executes `ticks` in lockstep inside one jitted program.

Lockstep ticks last their costliest task, so 1F1B, whose steady state pairs one stage's backward
with its neighbour's forward, idles the forward's stage. "1f1b-balanced" keeps 1F1B's order but
alternates forward ticks and backward ticks, so no tick mixes kinds: it runs as fast as GPipe in
lockstep while a stage holds at most 2(S-1-s)+1 micro-batches instead of GPipe's M.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from whalex.errors import ConfigError
from whalex.primitives.config import SCHEDULES

IDLE, FWD, BWD = 0, 1, 2
# task costs in units of a stage's forward: a backward without recompute costs two forwards; whalex's
# backward task recomputes its forward from the stashed stage input first, so it costs three
UNIT_COSTS = (1.0, 2.0)
RECOMPUTE_COSTS = (1.0, 3.0)


@dataclasses.dataclass(frozen=True, order=True)
class Task:
    stage: int
    microbatch: int
    kind: str            # "F" or "B"

    def __post_init__(self):
        if self.kind not in ("F", "B"):
            raise ValueError(f"Task.kind must be 'F' or 'B', got {self.kind!r}")


def stage_order(name: str, num_stages: int, num_micro_batch: int, stage: int) -> list[Task]:
    """The order in which one stage runs its tasks."""
    S, M, s = num_stages, num_micro_batch, stage
    if name == "gpipe":
        return [Task(s, m, "F") for m in range(M)] + [Task(s, m, "B") for m in range(M)]
    if name == "1f1b":
        warmup = min(S - s - 1, M)
        order = [Task(s, m, "F") for m in range(warmup)]
        f, b = warmup, 0
        while b < M:
            if f < M:
                order.append(Task(s, f, "F"))
                f += 1
            order.append(Task(s, b, "B"))
            b += 1
        return order
    raise ConfigError(f"unknown pipeline schedule {name!r}; use one of {SCHEDULES}.")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """ticks[t][s] is the Task stage s runs at tick t, or None when it idles."""

    name: str
    num_stages: int
    num_micro_batch: int
    ticks: tuple[tuple[Task | None, ...], ...]

    def __post_init__(self):
        self.validate()

    def __str__(self) -> str:
        """The picture: one row per stage, one column per tick (F3: forward of micro-batch 3, B3: its
        backward, ..: idle), under a one-line header."""
        head = (f"{self.name} schedule: {self.num_stages} stages, {self.num_micro_batch} micro-batches, "
                f"{self.num_ticks} ticks, bubble {self.bubble_fraction:.1%}, lockstep utilisation "
                f"{self.utilisation(*RECOMPUTE_COSTS):.1%}")
        return head + "\n" + render(self)

    def __repr__(self) -> str:
        return (f"Schedule({self.name!r}, stages={self.num_stages}, micro_batches={self.num_micro_batch}, "
                f"ticks={self.num_ticks}, bubble={self.bubble_fraction:.1%})")

    # -- derived facts -----------------------------------------------------------------------
    @property
    def num_ticks(self) -> int:
        return len(self.ticks)

    def when(self) -> dict[Task, int]:
        return {task: t for t, row in enumerate(self.ticks) for task in row if task is not None}

    @property
    def bubble_fraction(self) -> float:
        """Idle stage-ticks over all stage-ticks (forward and backward counted as one tick each)."""
        busy = 2 * self.num_stages * self.num_micro_batch
        return 1.0 - busy / (self.num_ticks * self.num_stages)

    def lockstep_time(self, forward=UNIT_COSTS[0], backward=UNIT_COSTS[1]) -> float:
        """Time of one step run in lockstep ticks (each tick lasts its costliest task), with a
        forward and a backward costing `forward` and `backward` (a number, or one per stage)."""
        return lockstep_time(self.tables()["kind"], forward, backward)

    def utilisation(self, forward=UNIT_COSTS[0], backward=UNIT_COSTS[1]) -> float:
        """Useful work over stages x lockstep time: what the stages really do, where
        `1 - bubble_fraction` counts every task as one tick."""
        f, b = _per_stage(forward, self.num_stages), _per_stage(backward, self.num_stages)
        work = self.num_micro_batch * float((f + b).sum())
        return work / (self.num_stages * self.lockstep_time(f, b))

    def live(self, stage: int) -> list[set[int]]:
        """Per tick, the micro-batches whose activations stage `stage` holds (arrived, not yet backward)."""
        when = self.when()
        out = []
        for t in range(self.num_ticks):
            held = set()
            for m in range(self.num_micro_batch):
                start = when[Task(stage, m, "F")] if stage == 0 else when[Task(stage - 1, m, "F")] + 1
                if start <= t <= when[Task(stage, m, "B")]:
                    held.add(m)
            out.append(held)
        return out

    def live_grads(self, stage: int) -> list[set[int]]:
        """Per tick, the micro-batches whose incoming gradient stage `stage` holds (arrived, not used)."""
        if stage == self.num_stages - 1:
            return [set() for _ in range(self.num_ticks)]
        when = self.when()
        out = []
        for t in range(self.num_ticks):
            out.append({m for m in range(self.num_micro_batch)
                        if when[Task(stage + 1, m, "B")] + 1 <= t <= when[Task(stage, m, "B")]})
        return out

    def max_in_flight(self, stage: int) -> int:
        return max((len(h) for h in self.live(stage)), default=0)

    @property
    def slots(self) -> int:
        """Buffer slots per stage so that micro-batch m can live in slot m % slots without clashing."""
        need = max(self.max_in_flight(s) for s in range(self.num_stages))
        for slots in range(max(need, 1), self.num_micro_batch + 1):
            if all(len({m % slots for m in held}) == len(held)
                   for s in range(self.num_stages) for held in self.live(s)):
                return slots
        return self.num_micro_batch

    @property
    def grad_slots(self) -> int:
        """Gradient buffer slots per stage (usually 1: a gradient is consumed the tick it arrives)."""
        lives = [held for s in range(self.num_stages) for held in self.live_grads(s)]
        need = max((len(h) for h in lives), default=0)
        for slots in range(max(need, 1), self.num_micro_batch + 1):
            if all(len({m % slots for m in held}) == len(held) for held in lives):
                return slots
        return self.num_micro_batch

    def tables(self) -> dict[str, np.ndarray]:
        """int32 [ticks, stages] arrays: kind (0 idle, 1 F, 2 B), micro-batch, and what arrives."""
        T, S = self.num_ticks, self.num_stages
        kind = np.zeros((T, S), np.int32)
        mb = np.zeros((T, S), np.int32)
        recv_f = np.full((T, S), -1, np.int32)
        recv_b = np.full((T, S), -1, np.int32)
        for t, row in enumerate(self.ticks):
            for s, task in enumerate(row):
                if task is None:
                    continue
                kind[t, s] = FWD if task.kind == "F" else BWD
                mb[t, s] = task.microbatch
                if t + 1 < T:
                    if task.kind == "F" and s + 1 < S:
                        recv_f[t + 1, s + 1] = task.microbatch
                    if task.kind == "B" and s > 0:
                        recv_b[t + 1, s - 1] = task.microbatch
        return {"kind": kind, "mb": mb, "recv_f": recv_f, "recv_b": recv_b}

    # -- validation --------------------------------------------------------------------------
    def validate(self) -> None:
        S, M = self.num_stages, self.num_micro_batch
        seen: dict[Task, int] = {}
        for t, row in enumerate(self.ticks):
            if len(row) != S:
                raise ValueError(f"tick {t} has {len(row)} entries for {S} stages")
            for s, task in enumerate(row):
                if task is None:
                    continue
                if task.stage != s or not 0 <= task.microbatch < M:
                    raise ValueError(f"tick {t}: {task} is not a task of stage {s} with {M} micro-batches")
                if task in seen:
                    raise ValueError(f"{task} runs twice (ticks {seen[task]} and {t})")
                seen[task] = t
        expected = {Task(s, m, k) for s in range(S) for m in range(M) for k in "FB"}
        if set(seen) != expected:
            raise ValueError(f"schedule misses tasks: {sorted(expected - set(seen))[:4]}")
        for (s, m, k), t in ((astuple(task), t) for task, t in seen.items()):
            if k == "F" and s > 0 and not seen[Task(s - 1, m, "F")] < t:
                raise ValueError(f"F(stage {s}, mb {m}) at tick {t} runs before its input arrives")
            if k == "B":
                if not seen[Task(s, m, "F")] < t:
                    raise ValueError(f"B(stage {s}, mb {m}) at tick {t} runs before its forward")
                if s < S - 1 and not seen[Task(s + 1, m, "B")] < t:
                    raise ValueError(f"B(stage {s}, mb {m}) at tick {t} runs before its gradient arrives")


def _per_stage(cost, num_stages: int) -> np.ndarray:
    c = np.broadcast_to(np.asarray(cost, np.float64), (num_stages,))
    if not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ValueError(f"task costs must be finite and non-negative, got {cost!r}")
    return c


def lockstep_time(kinds, forward, backward) -> float:
    """Time of a tick table (`kinds[t, s]`: IDLE, FWD or BWD, as `Schedule.tables()["kind"]`) run in
    lockstep: every tick ends on a ppermute, so it lasts as long as its costliest task. `forward`
    and `backward`: a task's cost, one number or one per stage."""
    kinds = np.asarray(kinds)
    f, b = _per_stage(forward, kinds.shape[1]), _per_stage(backward, kinds.shape[1])
    cost = np.where(kinds == FWD, f, np.where(kinds == BWD, b, 0.0))
    return float(cost.max(axis=1).sum()) if cost.size else 0.0


def astuple(task: Task):
    return task.stage, task.microbatch, task.kind


def make_schedule(name: str, num_stages: int, num_micro_batch: int) -> Schedule:
    """Simulate the stages' task orders under the pipeline's dependencies, one task per tick."""
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; use one of {SCHEDULES}.")
    if num_stages < 1 or num_micro_batch < 1:
        raise ConfigError("a pipeline needs at least one stage and one micro-batch.")
    S, M = num_stages, num_micro_batch
    if name == "1f1b-balanced":
        return Schedule(name, S, M, _alternating_ticks(S, M))
    orders = [stage_order(name, S, M, s) for s in range(S)]
    pos = [0] * S
    done: dict[Task, int] = {}
    ticks: list[tuple[Task | None, ...]] = []
    while any(pos[s] < len(orders[s]) for s in range(S)):
        t = len(ticks)
        row: list[Task | None] = []
        for s in range(S):
            task = orders[s][pos[s]] if pos[s] < len(orders[s]) else None
            if task is not None and _ready(task, done, t, S):
                row.append(task)
            else:
                row.append(None)
        for s, task in enumerate(row):
            if task is not None:
                done[task] = t
                pos[s] += 1
        if all(task is None for task in row):
            raise RuntimeError(f"schedule {name} deadlocked at tick {t}")   # cannot happen for valid orders
        ticks.append(tuple(row))
    return Schedule(name, S, M, tuple(ticks))


def _alternating_ticks(S: int, M: int) -> tuple:
    """Forward ticks and backward ticks in turn (a kind with nothing ready anywhere is skipped): at a
    forward tick each stage runs its next forward if its input has arrived and it holds fewer than
    2(S-1-s)+1 micro-batches, the round trip of a message through the later stages in such ticks;
    at a backward tick its next backward if the gradient has arrived."""
    done: dict[Task, int] = {}
    nf, nb, ticks, kind = [0] * S, [0] * S, [], "F"

    def ready(k: str, t: int) -> list:
        row: list[Task | None] = []
        for s in range(S):
            if k == "F":
                task = Task(s, nf[s], "F") if nf[s] < M and nf[s] - nb[s] < 2 * (S - 1 - s) + 1 else None
            else:
                task = Task(s, nb[s], "B") if nb[s] < M else None
            row.append(task if task is not None and _ready(task, done, t, S) else None)
        return row

    while min(nb) < M:
        t = len(ticks)
        row = ready(kind, t)
        if all(task is None for task in row):
            kind = "B" if kind == "F" else "F"
            row = ready(kind, t)
        if all(task is None for task in row):
            raise RuntimeError(f"1f1b-balanced deadlocked at tick {t}")      # cannot happen
        for task in row:
            if task is not None:
                done[task] = t
                (nf if task.kind == "F" else nb)[task.stage] += 1
        ticks.append(tuple(row))
        kind = "B" if kind == "F" else "F"
    return tuple(ticks)


def _ready(task: Task, done: dict, t: int, S: int) -> bool:
    s, m = task.stage, task.microbatch
    if task.kind == "F":
        return s == 0 or done.get(Task(s - 1, m, "F"), t) < t
    if done.get(Task(s, m, "F"), t) >= t:
        return False
    return s == S - 1 or done.get(Task(s + 1, m, "B"), t) < t


def render(schedule: Schedule) -> str:
    """A text picture: one row per stage, one column per tick."""
    rows = []
    for s in range(schedule.num_stages):
        cells = [(f"{r[s].kind}{r[s].microbatch}" if r[s] else "..") for r in schedule.ticks]
        rows.append(f"stage {s}: " + " ".join(f"{c:>3}" for c in cells))
    return "\n".join(rows)
