"""Whale's Algorithm 1 (section 3.3.1): memory-constrained load balancing, as a pure function.

Loads start proportional to device capacity (FLOP/s), or, where devices also spend a fixed time
per step whatever their load (a calibrated `overhead`: the optimizer update, launches), such that
every device's predicted time `overhead + load * work / speed` is as equal as integers allow. While
some device is over its memory and some device has room, the load of the most memory-overloaded
device is shifted to the free device with the lowest predicted time, as much as it can take without
going over. Loads are integers (units of `unit` samples, or columns), so the global total is
kept exactly.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from whalex.errors import PlanError


@dataclasses.dataclass(frozen=True)
class Balance:
    """Per-device loads (integer units) and the utilisations Algorithm 1 reasons with."""

    loads: tuple[int, ...]
    mem_utils: tuple[float, ...]        # memory used / capacity
    flop_utils: tuple[float, ...]       # load / speed, normalised so the even share on the mean speed is 1
    shifted: int                        # units moved by the memory repair

    @property
    def time(self) -> float:
        """Predicted step time, relative: the slowest device's load / speed."""
        return max(self.flop_utils)


def proportional(total: int, weights: Sequence[float], offsets: Sequence[float] | None = None) -> list[int]:
    """Integers summing to `total` that make the largest `offsets[i] + load[i] / weights[i]` (the step
    time when weights are speeds in units per second and offsets fixed seconds) as small as integers
    allow. Without offsets the loads are proportional to the weights.

    The real-valued optimum fills every device to one level T (a device whose offset is above T gets
    nothing); its floors are taken, then each unit left goes to the device whose time stays smallest
    with it; ties go to the lower index."""
    w = np.asarray(weights, dtype=np.float64)
    off = np.zeros_like(w) if offsets is None else np.asarray(offsets, dtype=np.float64)
    if total < 0 or np.any(w < 0) or w.sum() <= 0:
        raise ValueError("proportional() needs a non-negative total and positive weights")
    if off.shape != w.shape or not np.all(np.isfinite(off)) or np.any(off < 0):
        raise ValueError(f"proportional() needs one finite non-negative offset per weight, got {offsets}")
    level = _level(total, w, off)
    out = np.floor(np.maximum(level - off, 0.0) * w + 1e-9).astype(int)
    while out.sum() > total:                      # float slack at the floors: take back from the slowest-to-finish
        out[int(np.argmax(np.where(out > 0, off + out / np.where(w > 0, w, np.inf), -np.inf)))] -= 1
    with np.errstate(divide="ignore"):
        for _ in range(total - int(out.sum())):
            out[int(np.argmin(np.where(w > 0, off + (out + 1) / w, np.inf)))] += 1
    return out.tolist()


def _level(total: int, w: np.ndarray, off: np.ndarray) -> float:
    """The time T with sum_i max(0, T - off_i) * w_i == total (devices join in order of offset)."""
    order = np.argsort(off, kind="stable")
    acc_w = acc_wo = 0.0
    level = float(off[order[0]])
    for j, i in enumerate(order):
        if w[i] <= 0:
            continue
        acc_w += w[i]
        acc_wo += w[i] * off[i]
        level = (total + acc_wo) / acc_w
        nxt = off[order[j + 1]] if j + 1 < len(order) else np.inf
        if level <= nxt:
            break
    return level


def balance(total: int, speeds: Sequence[float], capacities: Sequence[float], fixed: Sequence[float],
            per_unit: Sequence[float], names: Sequence[str] | None = None, *,
            overheads: Sequence[float] | None = None, work_per_unit: float = 1.0) -> Balance:
    """Algorithm 1: `total` units over devices with `speeds`, under memory `capacities`.

    Device i uses fixed[i] + load[i] * per_unit[i] bytes and, with `overheads` (seconds per step),
    takes overheads[i] + load[i] * work_per_unit / speeds[i] seconds. Raises PlanError naming the
    device and the shortfall when no shift can bring every device under its memory.
    """
    n = len(speeds)
    if not (len(capacities) == len(fixed) == len(per_unit) == n) or n == 0:
        raise ValueError("speeds, capacities, fixed and per_unit need one entry per device")
    names = list(names) if names is not None else [f"device {i}" for i in range(n)]
    speeds = np.asarray(speeds, dtype=np.float64)
    cap = np.asarray(capacities, dtype=np.float64)
    fixed = np.asarray(fixed, dtype=np.float64)
    per = np.asarray(per_unit, dtype=np.float64)
    if overheads is not None and not work_per_unit > 0:
        raise ValueError(f"balance() with overheads needs the work of one unit (FLOPs), got {work_per_unit}")
    over = np.zeros(n) if overheads is None else np.asarray(overheads, dtype=np.float64)
    rate = speeds / (work_per_unit if overheads is not None else 1.0)      # units per second
    loads = np.asarray(proportional(total, rate, over))
    for i in range(n):
        if fixed[i] > cap[i]:
            raise PlanError(
                f"{names[i]} needs {_gib(fixed[i] - cap[i])} more memory than it has ({_gib(cap[i])}) before "
                "holding any batch: the model state alone does not fit. Use a split or pipeline plan, ZeRO or "
                "offload, or leave this device out.")
    loads, shifted = _shift(total, loads, rate, over, cap, fixed, per, names)
    flop = loads / speeds * speeds.mean() * n / max(total, 1)
    peaks = tuple(float((fixed[i] + loads[i] * per[i]) / cap[i]) for i in range(n))
    return Balance(tuple(int(x) for x in loads), peaks, tuple(float(x) for x in flop), shifted)


def _shift(total: int, loads: np.ndarray, rate, over, cap, fixed, per, names) -> tuple[np.ndarray, int]:
    """(the loads after moving units off every device over its memory onto the device that would
    finish first and has room, the units moved); PlanError naming the worst device when no shift fits."""
    loads = loads.copy()
    n = len(loads)

    def mem(i):
        return fixed[i] + loads[i] * per[i]

    def room(i):                      # units device i can still take
        if per[i] <= 0:
            return total
        return int(np.floor((cap[i] - mem(i)) / per[i] + 1e-9))

    oom = [i for i in range(n) if mem(i) > cap[i]]
    free = [i for i in range(n) if mem(i) <= cap[i]]
    shifted = 0
    while oom and free:
        peak = max(oom, key=lambda i: mem(i) / cap[i])
        valley = min(free, key=lambda i: (over[i] + loads[i] / rate[i], mem(i) / cap[i]))
        need = int(np.ceil((mem(peak) - cap[peak]) / per[peak] - 1e-9))
        move = min(need, room(valley), int(loads[peak]))
        if move > 0:
            loads[peak] -= move
            loads[valley] += move
            shifted += move
            if mem(peak) <= cap[peak]:
                oom.remove(peak)
            if room(valley) <= 0:
                free.remove(valley)
        else:
            free.remove(valley)
    if oom:
        worst = max(oom, key=lambda i: mem(i) - cap[i])
        short = sum(mem(i) - cap[i] for i in oom)
        raise PlanError(
            f"the cluster cannot hold this batch: {names[worst]} is {_gib(mem(worst) - cap[worst])} over its "
            f"{_gib(cap[worst])} and the other devices have no room left (total shortfall {_gib(short)}). Use a "
            "smaller global batch, more devices, or a memory optimization (remat, ZeRO, offload).")
    return loads, shifted


def even(total: int, n: int) -> list[int]:
    return proportional(total, [1.0] * n)


def _gib(x: float) -> str:
    if abs(x) >= 2**27:
        return f"{x / 2**30:.2f} GiB"
    if abs(x) >= 2**17:
        return f"{x / 2**20:.2f} MiB"
    return f"{x:.0f} B"
