"""`Comm`: one collective a plan implies (written by the sharding patterns, ZeRO and the planner,
read by the Plan's views), and `ring_bytes`, the one cost formula they all price it with (the
benchmarks too, from compiled HLO: `result_ring_bytes`)."""
from __future__ import annotations

import dataclasses

Axes = tuple  # tuple[str, ...]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def ring_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes one device sends for a collective over `n` devices with ring algorithms (all-to-all
    direct). `nbytes` is the whole buffer on one device: the summed one (all-reduce), the gathered
    one (all-gather), the one before scattering (reduce-scatter), the exchanged one (all-to-all), the
    message (collective-permute, which sends it once whatever `n`). 0 for a group of one."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; one of {KINDS}")
    if n <= 1:
        return 0.0
    if kind == "collective-permute":
        return float(nbytes)
    return (2.0 if kind == "all-reduce" else 1.0) * (n - 1) / n * nbytes


def result_ring_bytes(kind: str, result_bytes: float, n: int) -> float:
    """`ring_bytes` of a collective known by the bytes of its RESULT, as compiled HLO writes it (a
    reduce-scatter's result is 1/n of its buffer; every other kind's is the whole buffer)."""
    return ring_bytes(kind, result_bytes * n if kind == "reduce-scatter" else result_bytes, n)


@dataclasses.dataclass(frozen=True)
class Comm:
    """One collective the plan implies, with its per-device traffic in bytes (`ring_bytes`)."""

    taskgraph: int
    kind: str            # all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute
    axes: Axes
    bytes: float
    reason: str
