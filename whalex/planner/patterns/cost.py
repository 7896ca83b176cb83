"""The patterns' cost model: bytes of a value within one model group, and what each candidate
pattern of a matmul or an embedding sends per device (`whalex.records.comm.ring_bytes`)."""
from __future__ import annotations

import numpy as np

from whalex.records.comm import ring_bytes

INF = float("inf")


def nbytes(aval) -> float:
    return float(np.prod(aval.shape, dtype=np.float64)) * np.dtype(aval.dtype).itemsize


def group_bytes(aval, info, shards) -> float:
    """Bytes of a value within one model group (the batch shard of this replica); `shards(axes)`
    is the number of devices along mesh axes."""
    div = shards(info.spec[0]) if info.batch and info.spec and info.spec[0] else 1
    return nbytes(aval) / div


def laid_out_bytes(aval, spec, shards) -> float:
    """Bytes one device holds of a value laid out by `spec` (axes per dimension, None for whole)."""
    return nbytes(aval) / float(np.prod([shards(a) for a in spec if a]))


def matmul_costs(x_bytes: float, y_bytes: float, n: int, column: bool, row: bool,
                 x_split_c: bool, x_on_row: bool) -> dict[str, float]:
    """Bytes per device of SP1 column and SP2 row (inf where the pattern cannot apply). Column:
    the input gradient all-reduced, or, for an input split on a contracting dim, the input gathered
    and its gradient reduce-scattered. Row: the partial sums all-reduced, plus the input gathered
    when it is not already split on the row dim."""
    if x_split_c:
        col_cost = ring_bytes("all-gather", x_bytes, n) + ring_bytes("reduce-scatter", x_bytes, n)
    else:
        col_cost = ring_bytes("all-reduce", x_bytes, n)
    row_cost = ring_bytes("all-reduce", y_bytes, n) + (0.0 if x_on_row else ring_bytes("all-gather", x_bytes, n))
    return {"column": col_cost if column else INF, "row": row_cost if row else INF}


def embedding_costs(table: tuple[int, int], y_bytes: float, n: int) -> dict[str, float]:
    """Bytes per device of a hidden split (none) and a vocabulary split (the masked lookups all-reduced)."""
    return {"column": 0.0 if table[1] >= n else INF,
            "row": ring_bytes("all-reduce", y_bytes, n) if table[0] >= n else INF}
