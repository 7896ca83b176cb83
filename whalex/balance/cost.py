"""The cost model behind hardware-aware plans: per-device time and memory as functions of load.

time_i = overhead_i + rows_i * FLOPs per sample / speed_i (the overhead: a calibrated fixed time per
step, zero for spec-table speeds), memory_i = state bytes + rows_i * activation bytes
per sample. Activation bytes per sample are measured from XLA's `memory_analysis` of the
compiled forward+backward at two batch sizes (the slope), not estimated.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from whalex.balance.algorithm import proportional


@dataclasses.dataclass(frozen=True)
class DeviceLoad:
    device: int
    kind: str
    speed: float            # FLOP/s used for planning
    rows: int               # samples per step in the balanced plan
    even_rows: int          # samples per step in the even plan
    memory: float           # predicted bytes at `rows`
    capacity: float
    time: float             # predicted seconds of compute per step at `rows`
    even_time: float
    spread: float | None = None     # relative noise of a calibrated speed (0.05: +-5%)
    overhead: float = 0.0           # calibrated fixed seconds per step, whatever the load
    per_unit: float = 0.0           # predicted seconds per row (or unit) of load: time = overhead + rows x per_unit

    def share(self, total: int) -> float:
        """This device's fraction of the `total` load."""
        return self.rows / total if total else 0.0


@dataclasses.dataclass(frozen=True)
class BalanceReport:
    """What the hardware-aware balance decided, and the even plan it is compared against."""

    source: str             # "spec table" or "calibrated"
    unit: int               # rows per load unit (the balancing granularity)
    devices: tuple[DeviceLoad, ...]
    applied: bool           # False: the even plan runs (homogeneous cluster or hardware_aware=False)
    shifted: int            # units moved by Algorithm 1's memory repair
    flops_per_sample: float
    state_bytes: float
    activation_bytes_per_sample: float
    kind: str = "batch"     # what the load counts: samples, or the classes of a split head
    basis: str = ""         # what the times count beyond rows x FLOPs per row / speed (empty: nothing)

    @property
    def of_batch(self) -> bool:
        """Whether the load is the batch's rows (else a split's units: a head's classes, a layer's columns)."""
        return self.kind.startswith("batch")

    @property
    def even_time(self) -> float:
        return max(d.even_time for d in self.devices)

    @property
    def total(self) -> int:
        """The load shared out: rows of the batch, or units of a split."""
        return sum(d.rows for d in self.devices)

    @property
    def bound(self) -> DeviceLoad:
        """The device whose predicted time bounds the step (the first of equals)."""
        return max(self.devices, key=lambda d: d.time if self.applied else d.even_time)

    @property
    def balanced_time(self) -> float:
        return max(d.time for d in self.devices)

    @property
    def predicted_speedup(self) -> float:
        return self.even_time / self.balanced_time if self.balanced_time > 0 else 1.0


def temp_bytes(fn, *args) -> float:
    """XLA's temp bytes for `fn` compiled on the local default backend."""
    m = jax.jit(fn).lower(*args).compile().memory_analysis()
    return float(getattr(m, "temp_size_in_bytes", 0))


def activation_model(make_fn, rows: tuple[int, int] = (32, 128)) -> tuple[float, float]:
    """(base, bytes per sample): the line through XLA's temp memory of forward+backward at two
    batch sizes (large enough that fixed-size scratch, or a small batch's own code, does not hide the
    per-sample growth: XLA CPU compiles a 16-row step with another buffer layout than a 32-row one)."""
    r1, r2 = rows
    t1 = temp_bytes(*make_fn(r1))
    t2 = temp_bytes(*make_fn(r2))
    per = max(t2 - t1, 0.0) / (r2 - r1)
    return max(t1 - per * r1, 0.0), per


def report(specs, speeds: Sequence[float], rows: Sequence[int], even_rows: Sequence[int], *, source: str,
           unit: int, applied: bool, shifted: int, flops_per_sample: float, state_bytes: float,
           act_base: float, act_per_sample: float, spreads: Sequence[float] | None = None,
           overheads: Sequence[float] | None = None) -> BalanceReport:
    devices = []
    spreads = spreads if spreads is not None else [None] * len(speeds)
    overheads = overheads if overheads is not None else [0.0] * len(speeds)
    for i, (spec, speed, r, e, sp, o) in enumerate(zip(specs, speeds, rows, even_rows, spreads, overheads)):
        devices.append(DeviceLoad(i, spec.name, float(speed), int(r), int(e),
                                  state_bytes + act_base + r * act_per_sample, float(spec.memory_bytes),
                                  o + r * flops_per_sample / speed, o + e * flops_per_sample / speed,
                                  None if sp is None else float(sp), float(o), flops_per_sample / speed))
    return BalanceReport(source, unit, tuple(devices), applied, shifted, flops_per_sample, state_bytes,
                         act_per_sample)


@dataclasses.dataclass(frozen=True)
class SplitCosts:
    """What an uneven split's lowering does beyond its units' FLOPs, per model position: `shared`
    seconds both plans pay (the rest of the step at each device's share, the all-reduces of the
    layer's output and input gradient, a calibrated fixed time), memory traffic only the uneven plan
    pays per padding unit (the optimizer update of stored padding) and per unit of the padded width
    (its weight gradients' buffers, zero-filled every step), and, where the looped units (those
    beyond the `peeled` ones every device runs) recompute their forward, the share of their FLOPs
    that runs again."""

    shared: tuple[float, ...]
    bandwidths: tuple[float, ...]       # bytes/s of memory traffic per position
    per_padding_unit: float             # bytes
    per_width_unit: float               # bytes
    width: int
    basis: str
    peeled: int = 0                     # units every position runs outside the loop
    recompute_share: float = 0.0        # of a looped unit's FLOPs, run again (its forward but the last stage)


def lowered_split(report: BalanceReport, costs: SplitCosts) -> BalanceReport:
    """`report` with each position's times counting what both plans pay, the padded width's traffic
    and the recomputed forward of the looped units."""
    devices = []
    for d, shared, bw in zip(report.devices, costs.shared, costs.bandwidths):
        padded = ((costs.width - d.rows) * costs.per_padding_unit + costs.width * costs.per_width_unit) / bw
        work = report.flops_per_sample / d.speed
        again = max(d.rows - costs.peeled, 0) * costs.recompute_share * work
        devices.append(dataclasses.replace(d, time=float(shared + padded + again + d.rows * work),
                                           even_time=float(shared + d.even_rows * work), overhead=float(shared),
                                           per_unit=float((padded + again) / d.rows + work if d.rows else work)))
    return dataclasses.replace(report, devices=tuple(devices), basis=costs.basis)


ROUNDING = 0.005       # a load grain of at most this fraction of the smallest ideal share: <= 0.5% lost
LEVELS = 6             # remainder chunk sizes below a full chunk (compiled bodies of the loss)


def balance_grain(global_batch: int, smallest_share: float) -> int:
    """Rows per load unit for a speed-proportional split: the largest power of two dividing the batch
    that is at most ROUNDING of the smallest ideal per-device share (1 when none is larger). Rounding
    each device's rows to the grain then moves its step time by at most that fraction."""
    g = 1
    while global_batch % (2 * g) == 0 and 2 * g <= ROUNDING * smallest_share:
        g *= 2
    return g


def speed_grain(global_batch: int, speeds: Sequence[float]) -> int:
    """`balance_grain` for a speed-proportional split of the batch over devices of these speeds."""
    return balance_grain(global_batch, global_batch * min(speeds) / sum(speeds))


def chunk_rows(rows, grain: int) -> int:
    """Rows of a full chunk of the per-device loop: the largest grain * 2**j no more than the smallest
    non-zero load, where each device's remainder then runs as one chunk of its own size (the devices
    have at most LEVELS distinct non-zero remainders: `exact_remainders`); else grain * 2**j with at most
    LEVELS doublings, each device's remainder then running its binary digits. Fewer, larger chunks:
    each chunk's trip adds its gradient's accumulation and its launches to the step."""
    smallest = min(r for r in rows if r > 0)
    c = grain
    while 2 * c <= smallest:
        c *= 2
    return c if exact_remainders(rows, c, grain) else min(c, grain * 2 ** LEVELS)


def exact_remainders(rows, chunk: int, grain: int) -> bool:
    """Whether each device runs its remainder (`rows` % `chunk`) as one chunk of its own size: where the
    devices' non-zero remainders are no more distinct sizes than the binary digits chunk/2, ..., grain
    would compile, and at most LEVELS (a compiled body of the loss per size)."""
    return len({r % chunk for r in rows} - {0}) <= min(LEVELS, (chunk // grain).bit_length() - 1)


SPLIT_ROUNDING = 0.02  # a split's chunk may lengthen the slowest device's share by at most this fraction
MIN_CHUNK_COLUMNS = 128  # a chunk's matmuls at least this wide where the split allows it


def split_chunk(units: int, speeds: Sequence[float], columns_per_unit: int = 1,
                min_columns: float = MIN_CHUNK_COLUMNS) -> int:
    """Units per chunk of an uneven split (classes, hidden units, heads): a divisor of `units` that
    leaves at least one chunk per device. Among the chunks whose matmuls are at least
    `min_columns` wide (`columns_per_unit`: a head's width; 1 for classes and hidden units),
    or all when none is, the largest whose speed-proportional rounding keeps the slowest device's
    time within SPLIT_ROUNDING of the ideal (units / total speed), else the largest of those closest
    to it. A coarse chunk costs balance (32 heads in chunks of 4 give 24/8 for 2.2:1 speeds, 9.6%
    over the ideal 21.9); a narrow one costs matmul efficiency and loop trips over buffers of the
    padded width (docs/parallelism.md#heterogeneous-gpus has the figures)."""
    ideal = units / sum(speeds)
    divisors = [c for c in range(1, units // len(speeds) + 1) if units % c == 0]
    wide = [c for c in divisors if c * columns_per_unit >= min_columns] or divisors

    def slowest(c):
        loads = proportional(units // c, speeds)
        return max(u * c / s for u, s in zip(loads, speeds)) if min(loads) > 0 else float("inf")

    times = {c: slowest(c) for c in wide}
    best = min(times.values())
    if best == float("inf"):                 # a device too slow for a chunk of its own: the finest
        return 1
    return max(c for c, t in times.items() if t <= max((1 + SPLIT_ROUNDING) * ideal, best * (1 + 1e-9)))


def balance_unit(global_batch: int, num_devices: int, per_device: int = 4) -> int:
    """Rows per load unit: the largest divisor of the batch leaving >= per_device units a device."""
    for u in range(global_batch, 0, -1):
        if global_batch % u == 0 and global_batch // u >= per_device * num_devices:
            return u
    return 1
