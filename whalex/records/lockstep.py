"""The cost model of a pipeline's tick table as the tick loop runs it: every device runs one task per
tick, and devices wait for each other where a tick's messages move."""
from __future__ import annotations

import dataclasses

import numpy as np

IDLE, FWD, BWD, WGT = 0, 1, 2, 3         # a tick table's task kinds (`Schedule.tables()["kind"]`)


def per_stage(cost, num_stages: int) -> np.ndarray:
    """`cost` (a number or one per stage) as one float per stage; finite and non-negative."""
    c = np.broadcast_to(np.asarray(cost, np.float64), (num_stages,))
    if not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ValueError(f"task costs must be finite and non-negative, got {cost!r}")
    return c


def lockstep_time(kinds, forward, backward, weight=None, exchange=0.0, num_stages: int | None = None,
                  sends=None) -> float:
    """Time of a tick table (`kinds[t, c]`: IDLE, FWD, BWD or WGT per chunk in pipeline order, chunk c
    on stage c % `num_stages` (default: one chunk per stage), as `Schedule.chunk_kinds()`) run as the
    tick loop runs it. Devices wait for each other only where messages move (`sends`: per tick, whether
    the devices exchange at its end; default `sending_ticks`, each message sent as it is made): the
    ticks up to and including such a tick last as long as the stage whose tasks in them cost most,
    plus `exchange` (seconds: one number, or one per tick). Where every tick moves a message, each
    tick lasts its costliest task.
    `forward` and `backward`: a task's cost, one number or one per chunk; where the backward is
    split, W costs `weight` (default: a forward) and B the rest of the backward."""
    kinds = np.asarray(kinds)
    f, b = per_stage(forward, kinds.shape[1]), per_stage(backward, kinds.shape[1])
    w = f if weight is None else per_stage(weight, kinds.shape[1])
    if (kinds == WGT).any():
        b = np.maximum(b - w, 0.0)
    cost = np.where(kinds == FWD, f, np.where(kinds == BWD, b, np.where(kinds == WGT, w, 0.0)))
    if not cost.size:
        return 0.0
    S = num_stages or kinds.shape[1]
    stage = np.stack([cost[:, s::S].sum(axis=1) for s in range(S)], axis=1)      # [tick, stage]
    sends = sending_ticks(kinds) if sends is None else np.asarray(sends, bool)
    group = np.concatenate([[0], np.cumsum(sends)[:-1]])                       # a group ends on a send
    per_group = np.zeros((group[-1] + 1, S))
    np.add.at(per_group, group, stage)
    moves = np.broadcast_to(np.asarray(exchange, np.float64), sends.shape)
    return float(per_group.max(axis=1).sum() + moves[sends].sum())


def sending_ticks(kinds) -> np.ndarray:
    """Per tick of a chunk kind table (as `lockstep_time` takes), whether a message is made at its end
    (a forward of any chunk but the last, or a backward of any chunk but the first) before the last
    tick: where the devices would exchange if each message left the tick that makes it
    (`Schedule.sends` lets messages wait, so that exchanges coalesce)."""
    kinds = np.asarray(kinds)
    made = (kinds[:, :-1] == FWD).any(axis=1) | (kinds[:, 1:] == BWD).any(axis=1)
    return made & (np.arange(len(kinds)) < len(kinds) - 1)


@dataclasses.dataclass(frozen=True, eq=False)
class TickTable:
    """What a pipeline's cost model reads of its schedule: per tick and chunk the task kind, per tick
    whether the devices exchange messages at its end, and how many stages hold the chunks."""

    kinds: np.ndarray       # [tick, chunk]: IDLE, FWD, BWD or WGT, as `Schedule.chunk_kinds()`
    sends: np.ndarray       # [tick] bool: the devices exchange at the tick's end (`Schedule.sends.any`)
    num_stages: int         # chunk c runs on stage c % num_stages

    def __post_init__(self):
        kinds, sends = np.asarray(self.kinds), np.asarray(self.sends, bool)
        if kinds.ndim != 2 or sends.shape != (kinds.shape[0],) or not 0 < self.num_stages <= max(kinds.shape[1], 1):
            raise ValueError(f"a tick table needs kinds [tick, chunk], one send flag per tick and 1 to chunks "
                             f"stages; got kinds {kinds.shape}, sends {sends.shape}, {self.num_stages} stages")
        object.__setattr__(self, "kinds", kinds)
        object.__setattr__(self, "sends", sends)

    @classmethod
    def sent_as_made(cls, kinds, num_stages: int | None = None) -> TickTable:
        """The table with each message sent at the end of the tick that makes it (`sending_ticks`)."""
        kinds = np.asarray(kinds)
        return cls(kinds, sending_ticks(kinds), num_stages or kinds.shape[1])

    def time(self, forward, backward, weight=None, exchange=0.0) -> float:
        """`lockstep_time` of this table: tasks costing `forward`, `backward` and `weight` (per chunk),
        and `exchange` seconds for each tick that exchanges."""
        return lockstep_time(self.kinds, forward, backward, weight, exchange, self.num_stages, self.sends)
