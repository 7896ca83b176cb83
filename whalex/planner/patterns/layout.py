"""How one value is laid out while the patterns are matched: `Info` (mesh axes per dimension, and
whether the value is batch-major), and its PartitionSpec."""
from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from whalex.records.comm import Axes


@dataclasses.dataclass(frozen=True)
class Info:
    """ShardingInfo of one value: mesh axes per dimension, and whether it is batch-major."""

    spec: tuple
    batch: bool

    def split_dims(self, axes: Axes) -> list[int]:
        return [d for d, a in enumerate(self.spec) if a == axes]


def unsplit(ndim: int) -> tuple:
    """The spec of a value whole on every device."""
    return (None,) * ndim


def to_spec(spec: tuple) -> P:
    """An Info's spec as a PartitionSpec (one axis by name, several as a tuple, trailing Nones dropped)."""
    out = []
    for a in spec:
        out.append(None if not a else (a[0] if len(a) == 1 else tuple(a)))
    while out and out[-1] is None:
        out.pop()
    return P(*out)
