"""`TrainState`: the pytree a whalex step carries from one step to the next."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax


@dataclasses.dataclass(frozen=True, eq=False)
class ParamView:
    """How a plan that stores the parameters in its own layout (padded uneven shards) reads and writes
    them as the caller's pytree. Compared by identity: a state carries its plan's view as static pytree
    data, so jit caches and sharding trees match it exactly."""

    unpack: Callable     # stored layout -> the caller's pytree
    pack: Callable       # the caller's pytree -> stored layout, placed per the plan
    layout: str          # what the storage is, for messages ("padded uneven shards", ...)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["stored_params", "opt_state", "step", "loss_scale", "model_state", "rng"],
                   meta_fields=["view"])
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Parameters, optimizer state and the step counter, placed per the plan; the model state
    (non-trainable collections: BatchNorm statistics, NNX variables other than nnx.Param), the rng
    key that advances every step, and the dynamic loss scale under amp="fp16".

    `params` reads as the caller's pytree under every plan. A plan with its own parameter layout
    keeps them in `stored_params` and unpacks on read (one jitted call; `view` says how);
    `state.replace(params=tree)` packs a caller pytree back."""

    stored_params: Any           # the parameters as the step takes them (padded where `view` is set)
    opt_state: Any
    step: Any                    # a jax.Array; a sharding or a ShapeDtypeStruct in the plan's trees of those
    loss_scale: Any = None       # amp="fp16": whalex.precision.loss_scale.LossScale (scale, finite steps)
    model_state: Any = None      # updated by the step, untouched by the optimizer
    rng: Any = None              # split every step: the loss gets a fresh key
    view: ParamView | None = None

    @property
    def params(self):
        """The parameters as the caller's pytree, whatever the plan stores."""
        return self.stored_params if self.view is None else self.view.unpack(self.stored_params)

    def replace(self, **updates) -> TrainState:
        """`dataclasses.replace`; `params=` takes the caller's pytree (packed per `view`)."""
        if "params" in updates:
            params = updates.pop("params")
            updates["stored_params"] = params if self.view is None else self.view.pack(params)
        return dataclasses.replace(self, **updates)
