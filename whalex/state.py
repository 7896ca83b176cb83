"""`TrainState`: the pytree a whalex step carries from one step to the next."""
from __future__ import annotations

from typing import Any

import jax
from flax import struct


class TrainState(struct.PyTreeNode):
    """Parameters, optimizer state and the step counter, placed per the plan (and the dynamic
    loss scale under amp="fp16")."""

    params: Any
    opt_state: Any
    step: jax.Array
    loss_scale: Any = None       # amp="fp16": whalex.memory.precision.LossScale (scale, finite steps)
