"""`TrainState`: the pytree a whalex step carries from one step to the next."""
from __future__ import annotations

from typing import Any

import jax
from flax import struct


class TrainState(struct.PyTreeNode):
    """Parameters, optimizer state and the step counter, placed per the plan; the model state
    (non-trainable collections: BatchNorm statistics, NNX variables other than nnx.Param), the rng
    key that advances every step, and the dynamic loss scale under amp="fp16"."""

    params: Any
    opt_state: Any
    step: jax.Array
    loss_scale: Any = None       # amp="fp16": whalex.memory.precision.LossScale (scale, finite steps)
    model_state: Any = None      # updated by the step, untouched by the optimizer
    rng: Any = None              # split every step: the loss gets a fresh key
