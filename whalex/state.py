"""`TrainState`: the pytree a whalex step carries from one step to the next."""
from __future__ import annotations

from typing import Any

import jax
from flax import struct


class TrainState(struct.PyTreeNode):
    """Parameters, optimizer state and the step counter, placed per the plan."""

    params: Any
    opt_state: Any
    step: jax.Array
