"""When a pipeline's messages move: each waits in its sender's outbox until the latest tick that still
delivers it in time, so that messages produced at different ticks share one exchange.

Devices wait for each other only at ticks whose end exchanges messages (`lockstep.lockstep_time`), so
every exchange saved lets the stages run on together for longer. A message (a chunk's output going
forward, or its input gradient going back) is produced at the end of its task's tick and must arrive
before the tick of the task that reads it: it may leave at the end of any tick in between. A device
keeps one message per outbox (one per direction, or one for both where two stages swap), so a message
also leaves before its outbox's next message is produced. The fewest exchange ticks that send every
message inside its window is a minimum stabbing of intervals: taken in order of their last tick, an
interval not yet stabbed is stabbed at that tick. Each message then leaves at the first exchange
tick inside its window.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Message:
    """One message of a step: `key` names it ((kind, chunk, micro-batch) of the task producing it),
    `outbox` the sender's buffer that holds it, `produced` the tick at whose end it exists and
    `needed` the tick of the task that reads it."""

    key: tuple
    outbox: tuple
    forward: bool
    produced: int
    needed: int


@dataclasses.dataclass(frozen=True)
class Sends:
    """Where a schedule's messages move: `at[key]` the tick at whose end message `key` leaves, and per
    tick whether some message moves forward (`forward`) or back (`back`) at its end."""

    at: dict
    forward: np.ndarray
    back: np.ndarray

    @property
    def any(self) -> np.ndarray:
        """Per tick, whether the devices exchange at its end."""
        return self.forward | self.back


def pipeline_messages(when: dict, num_stages: int, num_chunks: int) -> list[Message]:
    """The messages of a pipeline schedule whose tasks (stage, micro-batch, kind, chunk) run at the
    ticks `when` gives: each forward's output to the next chunk's forward and each backward's input
    gradient to the previous chunk's backward, in a per-direction outbox of its stage (one for both at
    2 stages)."""
    at = {(task.kind, task.chunk, task.microbatch): t for task, t in when.items()}
    out = []
    for task, t in when.items():
        c, m = task.chunk, task.microbatch
        if task.kind == "F" and c + 1 < num_chunks:
            reader, forward = ("F", c + 1, m), True
        elif task.kind == "B" and c > 0:
            reader, forward = ("B", c - 1, m), False
        else:
            continue
        box = (task.stage,) if num_stages == 2 else (task.stage, forward)
        out.append(Message((task.kind, c, m), box, forward, t, at[reader]))
    return out


def outbox_windows(messages: list[Message]) -> list[tuple[int, int]]:
    """Each message's window of ticks at whose end it may leave: from its production to the tick
    before its reader, and before its outbox's next message is produced."""
    by_box: dict[tuple, list[Message]] = {}
    for msg in messages:
        by_box.setdefault(msg.outbox, []).append(msg)
    last = {}
    for box in by_box.values():
        box.sort(key=lambda m: m.produced)
        for msg, nxt in zip(box, box[1:] + [None]):
            if nxt is not None and nxt.produced == msg.produced:
                raise ValueError(f"messages {msg.key} and {nxt.key} fill outbox {msg.outbox} at tick {msg.produced}")
            last[msg.key] = msg.needed - 1 if nxt is None else min(msg.needed - 1, nxt.produced - 1)
    windows = [(m.produced, last[m.key]) for m in messages]
    for m, (a, b) in zip(messages, windows):
        if b < a:
            raise ValueError(f"message {m.key} produced at tick {a} is read at tick {m.needed}: no tick to send it")
    return windows


def plan_sends(messages: list[Message], num_ticks: int) -> Sends:
    """The fewest exchange ticks that send every message inside its window (`outbox_windows`), each
    message leaving at the first of them in its window."""
    windows = outbox_windows(messages)
    ticks: list[int] = []
    for a, b in sorted(windows, key=lambda w: (w[1], w[0])):
        if not ticks or ticks[-1] < a:        # taken by last tick, an unstabbed window starts after
            ticks.append(b)                   # the latest exchange so far
    chosen = np.asarray(ticks, np.int64)      # ascending: each is a later window's last tick
    at, forward, back = {}, np.zeros(num_ticks, bool), np.zeros(num_ticks, bool)
    for m, (a, _) in zip(messages, windows):
        t = int(chosen[np.searchsorted(chosen, a)])   # inside the window: some exchange tick stabs it
        at[m.key] = t
        (forward if m.forward else back)[t] = True
    return Sends(at, forward, back)
