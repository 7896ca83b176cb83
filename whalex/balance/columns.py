"""Algorithm 1 over a class, hidden-unit or head dimension: how many columns each device of a model
axis owns under an uneven `split` (Whale section 3.3.1), as the padded layout the lowering runs."""
from __future__ import annotations

from collections.abc import Sequence

from whalex.balance import cost
from whalex.balance.algorithm import balance
from whalex.columns import UnevenColumns


def plan_columns(classes: int, speeds: Sequence[float], capacities: Sequence[float],
                 bytes_per_column: float, names: Sequence[str], columns_per_unit: int = 1,
                 one_matmul: bool = False):
    """Algorithm 1 over the class dimension: (UnevenColumns, Balance). The unit divides `classes`
    (`cost.split_chunk`: rounding within `cost.SPLIT_ROUNDING` of the ideal), and for blocks that
    loop over it its matmuls are at least MIN_CHUNK_COLUMNS wide. With `one_matmul` (the head runs
    each device's classes as one matmul) the unit is only the split's rounding grain."""
    floor = 1.0 if one_matmul else cost.MIN_CHUNK_COLUMNS
    unit = cost.split_chunk(classes, speeds, columns_per_unit, floor)
    bal = balance(classes // unit, speeds, capacities, [0.0] * len(speeds), [bytes_per_column * unit] * len(speeds),
                  names)
    counts = tuple(u * unit for u in bal.loads)
    return UnevenColumns(counts, max(counts), unit), bal
