"""The rows of a calibration batch: which counts of them calibrate times, and the batch resized to the
step's rows. Pure functions of a batch pytree whose leaves share a leading (row) dimension."""
from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np


def check_global_batch(global_batch, loss_fn, batch) -> None:
    """Refuse a `global_batch` that is no row count, or a batch whose rows cannot be repeated to it."""
    if loss_fn is None:
        raise ValueError("calibrate(..., global_batch=) sizes the user's step: pass loss_fn, params and a batch "
                         "with it.")
    if isinstance(global_batch, bool) or not isinstance(global_batch, (int, np.integer)) or global_batch < 2:
        raise ValueError(f"calibrate's global_batch is the rows the training step runs (an int >= 2), "
                         f"got {global_batch!r}.")
    if batch_rows(batch) is None:
        rows = sorted({str(np.shape(x)[:1]) for x in jax.tree.leaves(batch)})
        raise ValueError("calibrate(..., global_batch=) repeats the batch's rows up to the step's, so every batch "
                         f"leaf needs the same leading dimension; got {rows}. Pass a batch of the step's size "
                         "instead.")


def micro_part(num_micro_batch, loss_fn, batch) -> int | None:
    """The rows of one micro-batch, the part a pipeline's stage runs the step's rows in (and its
    calibration times them in), or None without `num_micro_batch`."""
    if num_micro_batch is None:
        return None
    if loss_fn is None:
        raise ValueError("calibrate(..., num_micro_batch=) times the user's step at a micro-batch's rows: pass "
                         "loss_fn, params and a batch with it.")
    n = batch_rows(batch)
    if isinstance(num_micro_batch, bool) or not isinstance(num_micro_batch, (int, np.integer)) \
            or num_micro_batch < 1 or n is None or n // num_micro_batch < 2:
        raise ValueError(f"calibrate's num_micro_batch is how many micro-batches the batch's rows ({n}) make per "
                         f"stage device, each of at least 2 rows (an int from 1 to {(n or 2) // 2}), got "
                         f"{num_micro_batch!r}. Pass the batch the step trains on, or global_batch=.")
    return n // int(num_micro_batch)


def batch_rows(batch) -> int | None:
    """The leading dimension every leaf of `batch` shares, or None where they differ (or one is a scalar)."""
    rows = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(batch)}
    return next(iter(rows)) if len(rows) == 1 else None


def resized(batch, global_batch: int | None):
    """The batch's rows repeated (or cut) to `global_batch` rows: a step's time depends on its shapes, not
    on its values, so a smaller calibration batch can time the step's own row counts."""
    n = batch_rows(batch)
    if global_batch is None or n == global_batch:
        return batch
    index = np.arange(int(global_batch)) % n
    return jax.tree.map(lambda x: np.take(np.asarray(x), index, axis=0), batch)


def fractions(batch, counts: Sequence[int] | None = None):
    """(row counts, the batches' leading rows at each) for `counts` (default a quarter, half and all of
    the batch's rows), when every leaf has the same leading dimension >= 2 (a quarter only from 4 rows
    up). A slow device's share lies at a quarter of the rows at 3:1 speeds; three counts fit the line
    through where the loads lie, rather than extrapolate it from two."""
    n = batch_rows(batch)
    if n is None or n < 2:
        return None
    counts = tuple(sorted({int(k) for k in (counts or (n // 4, n // 2, n)) if 0 < k <= n}))
    if len(counts) < 2:
        return None
    return counts, [jax.tree.map(lambda x, k=k: x[:k], batch) for k in counts]
