"""Zero-bubble pipeline ticks (ZB-H1 and ZB-H2, after Qi et al., "Zero Bubble Pipeline Parallelism", ICLR
2024) for a program that runs its ticks in lockstep.

The backward is split into B, the input gradient the previous stage waits for, and W, the weight
gradient nothing waits for. Ticks alternate between forward ticks and B ticks as in "1f1b-balanced",
so no tick pairs a forward with a B (which costs more); a stage with no task of the tick's kind runs
one of its pending W's instead, which costs no more than either, so the W's fill what would be
bubbles. Stage s holds at most 2(S-1-s)+1 stage inputs, as "1f1b-balanced", and at most `pending`
W's, whose inputs wait in a stash: at the cap it runs a W before its next B. When no stage has a
forward or a B ready, the tick runs W's only. The cap trades memory for time: ZB-H1 defers at most S
W's per stage, ZB-H2 2S, and more deferred W's fill more of the bubble.
"""
from __future__ import annotations


def zb_ticks(num_stages: int, num_micro_batch: int, pending: int) -> list[list]:
    """Rows of (kind, micro-batch) per stage, or None where a stage idles; kind "F", "B" or "W".
    `pending`: the most W's a stage defers."""
    S, M, cap = num_stages, num_micro_batch, pending
    state = _Progress(S, M)
    ticks, kind = [], "F"
    while min(state.nw) < M:
        row = state.ready(kind, cap)
        if not any(row):
            kind = "B" if kind == "F" else "F"
            row = state.ready(kind, cap)
        if not any(row):
            row = state.ready("W", cap)
        row = [task or state.ready_one(s, "W", cap) for s, task in enumerate(row)]
        if not any(row):
            raise RuntimeError(f"zero-bubble ticks deadlocked at tick {len(ticks)}")    # cannot happen
        state.run(row)
        ticks.append(row)
        kind = "B" if kind == "F" else "F"
    return ticks


class _Progress:
    """Per stage, how many forwards, B's and W's have run, and when each forward and B ran."""

    def __init__(self, S: int, M: int):
        self.S, self.M, self.t = S, M, 0
        self.nf, self.nb, self.nw = [0] * S, [0] * S, [0] * S
        self.done: dict = {}

    def ready_one(self, s: int, kind: str, cap: int):
        """Stage s's next task of `kind` if it can run at this tick, else None."""
        S, t, done = self.S, self.t, self.done
        nf, nb, nw = self.nf[s], self.nb[s], self.nw[s]
        if kind == "F":
            ok = nf < self.M and nf - nb < 2 * (S - 1 - s) + 1 and (s == 0 or done.get(("F", s - 1, nf), t) < t)
            return ("F", nf) if ok else None
        if kind == "B":
            ok = (nb < nf and nb - nw < cap and done[("F", s, nb)] < t
                  and (s == S - 1 or done.get(("B", s + 1, nb), t) < t))
            return ("B", nb) if ok else None
        return ("W", nw) if nw < nb and done[("B", s, nw)] < t else None

    def ready(self, kind: str, cap: int) -> list:
        return [self.ready_one(s, kind, cap) for s in range(self.S)]

    def run(self, row: list) -> None:
        for s, task in enumerate(row):
            if task is None:
                continue
            kind, m = task
            self.done[(kind, s, m)] = self.t
            counts = {"F": self.nf, "B": self.nb, "W": self.nw}[kind]
            counts[s] += 1
        self.t += 1
