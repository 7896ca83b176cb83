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

"interleaved" (Megatron's interleaved 1F1B) cuts the model into S x V chunks, stage (device) s
holding chunks s, s+S, ..., s+(V-1)S; a micro-batch runs through chunks 0..SV-1, so a message goes
from stage s to s+1 and from the last stage back to the first for its next chunk. Each stage runs
warm-up forwards over its chunks, then one forward and one backward in turn, then the remaining
backwards; its tasks are a chunk's, so the bubble shrinks about V times. Tasks carry their chunk;
with V = 1 every chunk is its stage and the tasks are the other schedules'.

"zb-h1" and "zb-h2" (zero bubble, `zero_bubble`) split the backward into B, the input gradient, and W,
the weight gradient, and run the W's where a stage would idle; their tasks are "F", "B" and "W". A stage
defers at most S W's under zb-h1 and 2S under zb-h2, whose bubble is smaller.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from whalex.errors import ConfigError
from whalex.primitives.config import SCHEDULES
from whalex.records.lockstep import (  # noqa: F401 (the kind codes and the cost model, re-exported)
    BWD,
    FWD,
    IDLE,
    WGT,
    TickTable,
    lockstep_time,
    per_stage as _per_stage,
    sending_ticks,
)
from whalex.records.messages import Sends, pipeline_messages, plan_sends
from whalex.records.schedule_picture import render
from whalex.records.zero_bubble import zb_ticks

KIND_CODES = {"F": FWD, "B": BWD, "W": WGT}
# task costs in units of a stage's forward: a backward without recompute costs two forwards; whalex's
# backward task recomputes its forward from the stashed stage input first, so it costs three. A split
# backward's W (the weight gradient) costs about a forward, and its B the rest
UNIT_COSTS = (1.0, 2.0)
RECOMPUTE_COSTS = (1.0, 3.0)


@dataclasses.dataclass(frozen=True, order=True)
class Task:
    """Stage (device position) `stage` runs `kind` of `microbatch` through model chunk `chunk`
    (default: the stage's own, the only chunk of a schedule without virtual stages). `kind`: "F", "B"
    (the backward; with a split backward, its input gradient) or "W" (a split backward's weight gradient)."""

    stage: int
    microbatch: int
    kind: str            # "F", "B" or "W"
    chunk: int | None = None

    def __post_init__(self):
        if self.kind not in KIND_CODES:
            raise ValueError(f"Task.kind must be 'F', 'B' or 'W', got {self.kind!r}")
        if self.chunk is None:
            object.__setattr__(self, "chunk", self.stage)


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


def interleaved_order(num_stages: int, num_micro_batch: int, virtual_stages: int, stage: int) -> list[Task]:
    """Megatron's interleaved 1F1B order of one stage: forwards take micro-batches in groups of S
    (the last group may be smaller), each group through the stage's chunks in turn (backwards
    through them in reverse); 2(S-1-s) + (V-1)S warm-up forwards (S-1-s with V = 1, which is
    1F1B), then a forward and a backward in turn, then the remaining backwards."""
    S, M, V, s = num_stages, num_micro_batch, virtual_stages, stage

    def tasks(kind: str) -> list[Task]:
        out = []
        for start in range(0, M, S):
            group = range(start, min(start + S, M))
            for v in (range(V) if kind == "F" else reversed(range(V))):
                out += [Task(s, m, kind, v * S + s) for m in group]
        return out

    fwd, bwd = tasks("F"), tasks("B")
    warmup = min((S - 1 - s) * 2 + (V - 1) * S if V > 1 else S - 1 - s, V * M)
    order = fwd[:warmup]
    for k in range(V * M - warmup):
        order += [fwd[warmup + k], bwd[k]]
    return order + bwd[V * M - warmup:]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """ticks[t][s] is the Task stage s runs at tick t, or None when it idles. With `virtual_stages`
    V > 1 the model is cut into S x V chunks, stage s holding chunks s, s+S, ...: chunk c's slot on
    its stage is c // S."""

    name: str
    num_stages: int
    num_micro_batch: int
    ticks: tuple[tuple[Task | None, ...], ...]
    virtual_stages: int = 1

    def __post_init__(self):
        self.validate()

    def __str__(self) -> str:
        """The picture: one row per stage, one column per tick (F3: forward of micro-batch 3, B3: its
        backward, W3: its weight gradient, ..: idle), under a one-line header."""
        chunks = f", {self.virtual_stages} chunks per stage" if self.virtual_stages > 1 else ""
        head = (f"{self.name} schedule: {self.num_stages} stages{chunks}, {self.num_micro_batch} micro-batches, "
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

    @functools.cached_property
    def split_backward(self) -> bool:
        """Whether the backward runs as two tasks, B (input gradient) and W (weight gradient)."""
        return any(task is not None and task.kind == "W" for row in self.ticks for task in row)

    @property
    def num_chunks(self) -> int:
        """Model chunks: S x V (the stages themselves without virtual stages)."""
        return self.num_stages * self.virtual_stages

    def chunks_of(self, stage: int) -> tuple[int, ...]:
        """The chunks stage `stage` holds, by their slot: s, s+S, ..."""
        return tuple(v * self.num_stages + stage for v in range(self.virtual_stages))

    def when(self) -> dict[Task, int]:
        return {task: t for t, row in enumerate(self.ticks) for task in row if task is not None}

    @property
    def bubble_fraction(self) -> float:
        """Idle stage-ticks over all stage-ticks (every task counted as one tick)."""
        busy = (3 if self.split_backward else 2) * self.num_chunks * self.num_micro_batch
        return 1.0 - busy / (self.num_ticks * self.num_stages)

    def chunk_costs(self, cost) -> np.ndarray:
        """A task's cost per chunk from `cost`: one per chunk, or a stage's (one number, or one per
        stage) shared evenly by its V chunks."""
        c = np.asarray(cost, np.float64)
        if c.ndim == 1 and c.shape[0] == self.num_chunks:
            return _per_stage(c, self.num_chunks)
        per = _per_stage(c, self.num_stages) / self.virtual_stages
        return np.asarray([per[k % self.num_stages] for k in range(self.num_chunks)])

    def chunk_kinds(self) -> np.ndarray:
        """int32 [ticks, chunks]: what each chunk runs at each tick (0 idle, 1 F, 2 B, 3 W); a stage runs
        one of its chunks per tick, so a tick's costliest chunk is its costliest stage. Without
        virtual stages it is `tables()["kind"]`."""
        kinds = np.zeros((self.num_ticks, self.num_chunks), np.int32)
        for t, row in enumerate(self.ticks):
            for task in row:
                if task is not None:
                    kinds[t, task.chunk] = KIND_CODES[task.kind]
        return kinds

    @functools.cached_property
    def sends(self) -> Sends:
        """Where the messages move (`messages.plan_sends`): each chunk output and input gradient leaves
        at the latest tick that still delivers it, so that exchanges coalesce. A device keeps one
        outbox per direction, or one for both at 2 stages, where one swap carries the messages."""
        return plan_sends(pipeline_messages(self.when(), self.num_stages, self.num_chunks), self.num_ticks)

    @functools.cached_property
    def tick_table(self) -> TickTable:
        """What the cost model reads: `chunk_kinds()` and the ticks that exchange (`sends.any`)."""
        return TickTable(self.chunk_kinds(), self.sends.any, self.num_stages)

    def lockstep_time(self, forward=UNIT_COSTS[0], backward=UNIT_COSTS[1], weight=None, exchange=0.0) -> float:
        """Time of one step run in lockstep ticks (each tick lasts its costliest task), with a
        forward and a backward costing `forward` and `backward` (`chunk_costs`: a number or one
        per stage, a stage's cost shared by its chunks, or one per chunk); a split backward's W
        costs `weight` (default: a forward) and its B the rest; each tick that moves a message
        (`sends`) costs `exchange` more."""
        w = None if weight is None else self.chunk_costs(weight)
        return self.tick_table.time(self.chunk_costs(forward), self.chunk_costs(backward), w, exchange)

    def utilisation(self, forward=UNIT_COSTS[0], backward=UNIT_COSTS[1], weight=None) -> float:
        """Useful work over stages x lockstep time: what the stages really do, where
        `1 - bubble_fraction` counts every task as one tick."""
        f, b = self.chunk_costs(forward), self.chunk_costs(backward)
        work = self.num_micro_batch * float((f + b).sum())
        return work / (self.num_stages * self.lockstep_time(f, b, weight))

    def live_chunk(self, chunk: int) -> list[set[int]]:
        """Per tick, the micro-batches whose input to chunk `chunk` its stage holds (arrived, or
        read from the batch for chunk 0, and not yet backward)."""
        when, S = self.when(), self.num_stages
        spans = [((when[Task(0, m, "F", 0)] if chunk == 0 else when[Task((chunk - 1) % S, m, "F", chunk - 1)] + 1),
                  when[Task(chunk % S, m, "B", chunk)]) for m in range(self.num_micro_batch)]
        return [{m for m, (start, end) in enumerate(spans) if start <= t <= end} for t in range(self.num_ticks)]

    def live_grads_chunk(self, chunk: int) -> list[set[int]]:
        """Per tick, the micro-batches whose output gradient chunk `chunk` holds (arrived, not used)."""
        if chunk == self.num_chunks - 1:
            return [set() for _ in range(self.num_ticks)]
        when, S = self.when(), self.num_stages
        spans = [(when[Task((chunk + 1) % S, m, "B", chunk + 1)] + 1, when[Task(chunk % S, m, "B", chunk)])
                 for m in range(self.num_micro_batch)]
        return [{m for m, (start, end) in enumerate(spans) if start <= t <= end} for t in range(self.num_ticks)]

    def live(self, stage: int) -> list[set]:
        """Per tick, what stage `stage` holds: micro-batches (arrived, not yet backward); with
        virtual stages, (chunk, micro-batch) pairs."""
        return self._held(stage, self.live_chunk)

    def live_grads(self, stage: int) -> list[set]:
        """Per tick, the incoming gradients stage `stage` holds, as `live` counts them."""
        return self._held(stage, self.live_grads_chunk)

    def _held(self, stage: int, per_chunk) -> list[set]:
        if self.virtual_stages == 1:
            return per_chunk(stage)
        lives = [per_chunk(c) for c in self.chunks_of(stage)]
        return [{(c, m) for c, held in zip(self.chunks_of(stage), row) for m in held} for row in zip(*lives)]

    def max_in_flight(self, stage: int) -> int:
        """The most stage inputs stage `stage` holds at once (with virtual stages, chunk inputs)."""
        return max((len(h) for h in self.live(stage)), default=0)

    def chunk_in_flight(self, chunk: int) -> int:
        """The most micro-batches whose input to chunk `chunk` is held at once."""
        return max((len(h) for h in self.live_chunk(chunk)), default=0)

    @property
    def slots(self) -> int:
        """Buffer slots per chunk so that micro-batch m can live in slot m % slots without clashing."""
        return _modular_slots([self.live_chunk(c) for c in range(self.num_chunks)], self.num_micro_batch)

    @property
    def grad_slots(self) -> int:
        """Gradient buffer slots per chunk (usually 1: a gradient is consumed the tick it arrives)."""
        return _modular_slots([self.live_grads_chunk(c) for c in range(self.num_chunks)], self.num_micro_batch)

    @functools.cached_property
    def stash(self) -> tuple[int, dict]:
        """(slots of a stage's input stash, {(chunk, micro-batch): slot}). Without virtual stages
        micro-batch m sits in slot m % slots; with them each stage's stash is one pool, an input
        taking the lowest slot free from its arrival to its backward (chunk 0 reads the batch)."""
        when, S = self.when(), self.num_stages
        if self.virtual_stages == 1:
            slots = self.slots
            return slots, {(c, m): m % slots for c in range(S) for m in range(self.num_micro_batch)}
        spans = {(c, m): (when[Task((c - 1) % S, m, "F", c - 1)] + 1, when[Task(c % S, m, "B", c)])
                 for c in range(1, self.num_chunks) for m in range(self.num_micro_batch)}
        return _pool(spans, S)

    @functools.cached_property
    def grad_stash(self) -> tuple[int, dict]:
        """(slots of a stage's output-gradient stash, {(chunk, micro-batch): slot}), as `stash`."""
        when, S = self.when(), self.num_stages
        if self.virtual_stages == 1:
            g = self.grad_slots
            return g, {(c, m): m % g for c in range(S) for m in range(self.num_micro_batch)}
        spans = {(c, m): (when[Task((c + 1) % S, m, "B", c + 1)] + 1, when[Task(c % S, m, "B", c)])
                 for c in range(self.num_chunks - 1) for m in range(self.num_micro_batch)}
        return _pool(spans, S)

    @functools.cached_property
    def weight_stash(self) -> tuple[int, dict]:
        """(slots of a stage's stash of W inputs, {(chunk, micro-batch): slot}): what a split backward's
        B leaves for its W, held from the B to the W (no slots without a split backward)."""
        if not self.split_backward:
            return 0, {}
        when, S = self.when(), self.num_stages
        spans = {(c, m): (when[Task(c % S, m, "B", c)], when[Task(c % S, m, "W", c)])
                 for c in range(self.num_chunks) for m in range(self.num_micro_batch)}
        return _pool(spans, S)

    def tables(self) -> dict[str, np.ndarray]:
        """int32 [ticks, stages] arrays: kind (0 idle, 1 F, 2 B, 3 W), micro-batch, chunk, the stash
        slots the task reads (slot: its input, gslot: its output gradient; `stash`, `grad_stash`),
        the W stash slot a split backward's B writes and its W reads (wslot; `weight_stash`), and the
        slots that what arrives goes to (recv_f, recv_b; -1: nothing), and whether any message goes
        forward (send_f) or back (send_b) at the tick's end (1 in every stage's column: all devices
        agree whether the tick exchanges; `sends`: a message may wait in its sender's outbox). Messages
        go to the next chunk's stage, s+1 or (from the last stage, with virtual stages) 0; gradients
        back."""
        T, S, K = self.num_ticks, self.num_stages, self.num_chunks
        (_, at), (_, gat), (_, wat) = self.stash, self.grad_stash, self.weight_stash
        sends = self.sends
        kind, mb, chunk, slot, gslot, wslot = (np.zeros((T, S), np.int32) for _ in range(6))
        recv_f = np.full((T, S), -1, np.int32)
        recv_b = np.full((T, S), -1, np.int32)
        for t, row in enumerate(self.ticks):
            for s, task in enumerate(row):
                if task is None:
                    continue
                m, c = task.microbatch, task.chunk
                kind[t, s] = KIND_CODES[task.kind]
                mb[t, s], chunk[t, s] = m, c
                slot[t, s], gslot[t, s], wslot[t, s] = at.get((c, m), 0), gat.get((c, m), 0), wat.get((c, m), 0)
                if task.kind == "F" and c + 1 < K:
                    recv_f[sends.at[("F", c, m)] + 1, (s + 1) % S] = at[(c + 1, m)]
                if task.kind == "B" and c > 0:
                    recv_b[sends.at[("B", c, m)] + 1, (s - 1) % S] = gat[(c - 1, m)]
        send_f, send_b = (np.repeat(m[:, None], S, 1).astype(np.int32) for m in (sends.forward, sends.back))
        return {"kind": kind, "mb": mb, "chunk": chunk, "slot": slot, "gslot": gslot, "wslot": wslot,
                "recv_f": recv_f, "recv_b": recv_b, "send_f": send_f, "send_b": send_b}

    # -- validation --------------------------------------------------------------------------
    def validate(self) -> None:
        S, M, V = self.num_stages, self.num_micro_batch, self.virtual_stages
        if not isinstance(V, int) or V < 1:
            raise ValueError(f"virtual_stages must be a positive integer, got {V!r}")
        K = S * V
        seen: dict[Task, int] = {}
        for t, row in enumerate(self.ticks):
            if len(row) != S:
                raise ValueError(f"tick {t} has {len(row)} entries for {S} stages")
            for s, task in enumerate(row):
                if task is None:
                    continue
                if task.stage != s or not 0 <= task.microbatch < M or task.chunk % S != s or not 0 <= task.chunk < K:
                    raise ValueError(f"tick {t}: {task} is not a task of stage {s} with {M} micro-batches and "
                                     f"{V} chunk(s) per stage")
                if task in seen:
                    raise ValueError(f"{task} runs twice (ticks {seen[task]} and {t})")
                seen[task] = t
        expected = {Task(c % S, m, k, c) for c in range(K) for m in range(M)
                    for k in ("FBW" if self.split_backward else "FB")}
        if set(seen) != expected:
            raise ValueError(f"schedule misses tasks: {sorted(expected - set(seen))[:4]}")
        for task, t in seen.items():
            c, m = task.chunk, task.microbatch
            if task.kind == "F" and c > 0 and not seen[Task((c - 1) % S, m, "F", c - 1)] < t:
                raise ValueError(f"F(chunk {c}, mb {m}) at tick {t} runs before its input arrives")
            if task.kind == "W" and not seen[Task(c % S, m, "B", c)] < t:
                raise ValueError(f"W(chunk {c}, mb {m}) at tick {t} runs before its B")
            if task.kind == "B":
                if not seen[Task(c % S, m, "F", c)] < t:
                    raise ValueError(f"B(chunk {c}, mb {m}) at tick {t} runs before its forward")
                if c < K - 1 and not seen[Task((c + 1) % S, m, "B", c + 1)] < t:
                    raise ValueError(f"B(chunk {c}, mb {m}) at tick {t} runs before its gradient arrives")


def _pool(spans: dict, S: int) -> tuple[int, dict]:
    """Slots for values held over inclusive tick spans {(chunk, micro-batch): (first, last)}, each
    stage (chunk % S) a pool: in order of arrival, a value takes the lowest slot free since before
    its first tick. Interval graphs colour optimally this way: the pool is the most held at once."""
    at, size = {}, 1
    for s in range(S):
        free_after: list[int] = []          # per slot: the last tick of its current value
        for key in sorted((k for k in spans if k[0] % S == s), key=lambda k: (spans[k], k)):
            first, last = spans[key]
            k = next((i for i, end in enumerate(free_after) if end < first), len(free_after))
            if k == len(free_after):
                free_after.append(last)
            else:
                free_after[k] = last
            at[key] = k
        size = max(size, len(free_after))
    return size, at


def _modular_slots(lives: list[list[set[int]]], num_micro_batch: int) -> int:
    """The fewest slots k such that micro-batch m in slot m % k never clashes within one of `lives`
    (each a per-tick list of held micro-batches)."""
    rows = [held for life in lives for held in life]
    need = max((len(h) for h in rows), default=0)
    for slots in range(max(need, 1), num_micro_batch + 1):
        if all(len({m % slots for m in held}) == len(held) for held in rows):
            return slots
    return num_micro_batch


def make_schedule(name: str, num_stages: int, num_micro_batch: int, virtual_stages: int = 1) -> Schedule:
    """Simulate the stages' task orders under the pipeline's dependencies, one task per tick."""
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; use one of {SCHEDULES}.")
    if num_stages < 1 or num_micro_batch < 1:
        raise ConfigError("a pipeline needs at least one stage and one micro-batch.")
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ConfigError(f"virtual_stages must be a positive integer, got {virtual_stages!r}.")
    if virtual_stages > 1 and name != "interleaved":
        raise ConfigError(f"virtual_stages={virtual_stages} needs schedule='interleaved' (schedule {name!r} runs "
                          "one chunk per stage).")
    if name.startswith("zb-"):
        rows = zb_ticks(num_stages, num_micro_batch, num_stages * (2 if name == "zb-h2" else 1))
        return Schedule(name, num_stages, num_micro_batch,
                        tuple(tuple(c and Task(s, c[1], c[0]) for s, c in enumerate(row)) for row in rows))
    S, M, V = num_stages, num_micro_batch, virtual_stages
    if name == "1f1b-balanced" or name == "interleaved" and V > 1:
        return Schedule(name, S, M, _alternating_ticks(S, M, V), V)
    orders = [(interleaved_order(S, M, V, s) if name == "interleaved" else stage_order(name, S, M, s))
              for s in range(S)]
    pos = [0] * S
    done: dict[Task, int] = {}
    ticks: list[tuple[Task | None, ...]] = []
    while any(pos[s] < len(orders[s]) for s in range(S)):
        t = len(ticks)
        row: list[Task | None] = []
        for s in range(S):
            task = orders[s][pos[s]] if pos[s] < len(orders[s]) else None
            if task is not None and _ready(task, done, t, S, S * V):
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
    return Schedule(name, S, M, tuple(ticks), V)


def _alternating_ticks(S: int, M: int, V: int = 1) -> tuple:
    """Forward ticks and backward ticks in turn (a kind with nothing ready anywhere is skipped): at a
    forward tick each stage runs its next forward if its input has arrived and it holds fewer than
    `_cap` of its inputs, the round trip of a message through the later stages in such ticks; at a
    backward tick its next backward if the gradient has arrived. Without virtual stages the tasks
    go in micro-batch order; with them in `interleaved_order`'s."""
    done: dict[Task, int] = {}
    K = S * V
    orders = [interleaved_order(S, M, V, s) if V > 1 else stage_order("1f1b", S, M, s) for s in range(S)]
    fwd = [[t for t in order if t.kind == "F"] for order in orders]
    bwd = [[t for t in order if t.kind == "B"] for order in orders]
    nf, nb, ticks, kind = [0] * S, [0] * S, [], "F"

    def ready(k: str, t: int) -> list:
        row: list[Task | None] = []
        for s in range(S):
            if k == "F":
                task = fwd[s][nf[s]] if nf[s] < V * M and nf[s] - nb[s] < _cap(S, V, s) else None
            else:
                task = bwd[s][nb[s]] if nb[s] < V * M else None
            row.append(task if task is not None and _ready(task, done, t, S, K) else None)
        return row

    while min(nb) < V * M:
        t = len(ticks)
        row = ready(kind, t)
        if all(task is None for task in row):
            kind = "B" if kind == "F" else "F"
            row = ready(kind, t)
        if all(task is None for task in row):
            raise RuntimeError(f"alternating ticks deadlocked at tick {t}")      # cannot happen
        for task in row:
            if task is not None:
                done[task] = t
                (nf if task.kind == "F" else nb)[task.stage] += 1
        ticks.append(tuple(row))
        kind = "B" if kind == "F" else "F"
    return tuple(ticks)


def _cap(S: int, V: int, s: int) -> int:
    """The stage inputs stage s may hold in alternating ticks: 2(S-1-s)+1 micro-batches; with virtual
    stages Megatron's warm-up forwards, 2(S-1-s) + (V-1)S, plus one (fewer deadlock)."""
    return 2 * (S - 1 - s) + 1 + (V - 1) * S


def _ready(task: Task, done: dict, t: int, S: int, K: int) -> bool:
    """Whether `task`'s input (a forward) or output gradient and forward (a backward) is there at
    tick t, with K chunks on S stages."""
    c, m = task.chunk, task.microbatch
    if task.kind == "F":
        return c == 0 or done.get(Task((c - 1) % S, m, "F", c - 1), t) < t
    if done.get(Task(c % S, m, "F", c), t) >= t:
        return False
    return c == K - 1 or done.get(Task((c + 1) % S, m, "B", c + 1), t) < t
