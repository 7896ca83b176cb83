"""Flax NNX adapter: turn an `nnx.Module` and a `loss_fn(model, batch)` into whalex's functional form.

whalex's step is functional: `loss(params, batch, model_state=ms) -> (loss, new_ms)`. An NNX model
is an object graph whose `nnx.Param`s are trained and whose other variables (`nnx.BatchStat`, the
`RngKey`/`RngCount` of its `nnx.Rngs` streams, any custom `nnx.Variable`) are model state. This
module is the bridge, and nothing else:

    nm, params, model_state = NnxModel.split(model)      # model in the mode it trains in (model.train())
    loss = nm.wrap(loss_fn, has_aux=False)              # loss(params, batch, *, model_state)
    loss(params, batch, model_state=ms)                 # -> (loss, new_ms) | (loss, (new_ms, aux))
    model = nm.module(params, model_state)              # back to an nnx.Module

`params` and `model_state` are plain nested dicts of arrays (the `nnx.to_pure_dict` layout: module
attribute names, integer keys for list entries), so everything downstream (optax, jit, capture,
sharding, checkpoints) sees ordinary pytrees. `NnxModel` is static: the graph definition (module
classes, static attributes such as `deterministic` / `use_running_average`, hence the train/eval
mode at split time) and the tree structures; it is hashable and holds no arrays.

Randomness: NNX draws dropout keys from the model's own `nnx.Rngs` streams, `fold_in(key, count)`
then `count += 1`. Both live in `model_state` (`RngKey`: a typed key array, unchanged by a call;
`RngCount`: uint32, one increment per draw), so threading `model_state` from one step to the next
advances the randomness exactly as eager NNX does; no separate `rng` is needed.

Facts measured on jax 0.10.2 / flax 0.12.8 (tests/api/test_nnx.py):
- `nnx.merge(graphdef, params, rest)` with States whose Variable objects were made outside the
  `jax.grad` trace (closed over, or passed as a non-differentiated argument, which `jax.grad` does
  not re-flatten) raises `TraceContextError: Cannot mutate BatchStat from a different trace level`;
  `copy=True` fixes it (docs/architecture.md#jax-and-xla-facts-the-code-relies-on). The adapter
  rebuilds its States from plain dicts inside the trace, so it would not hit this, and merges with
  `copy=True` anyway.
- The returned model state has the input's tree structure and dtypes: `RngCount` stays uint32,
  `RngKey` stays a `key<fry>` typed key array. A variable the call stored in another dtype is cast
  back (a `jit`/`while_loop` carry must keep its type); a variable removed or reshaped is an error;
  variables the call creates (`sow`'s `nnx.Intermediate`) are not model state and are dropped.
- Typed key arrays (`RngKey`) pass through `jax.jit`, `jax.value_and_grad(has_aux=True)` outputs,
  `jax.make_jaxpr` + equation-by-equation evaluation, `jax.shard_map` (replicated, and after
  `lax.pcast(..., to='varying')`), `fori_loop` carries, `jnp.where`/`jnp.stack`, `device_put` with a
  `NamedSharding`, `Lowered.cost_analysis()` and orbax save/restore. What fails is NumPy:
  `np.asarray(key)` raises TypeError (use `jax.random.key_data`), so host-side code that pads or
  copies model state with NumPy must skip or unwrap key leaves (`is_key` below). Their dtype is
  neither floating nor integer for `jnp.issubdtype`; `jnp.zeros(shape, key_dtype)` works.
- Dropout masks have the shape of the activations they are drawn for. Whole-batch (GSPMD)
  evaluation reproduces single-device dropout bit for bit (`jax_threefry_partitionable` is on by
  default, so a sharded draw equals the unsharded one); plans that evaluate the loss in parts
  replace each draw by the part's rows of the whole-batch draw (whalex/loss/analysis.py), and the
  `RngCount` update is computed once from the whole-batch head, so they match too.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["NnxModel", "is_module", "is_key"]


def is_module(x: Any) -> bool:
    """Whether `x` is a Flax NNX module (an object `step.init` takes in place of params)."""
    return isinstance(x, nnx.Module)


def is_key(x: Any) -> bool:
    """Whether `x` is a typed PRNG key array (an `RngKey` leaf of an NNX model state)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


# The part of the model that is trained; everything else is model state.
_PARAM = nnx.Param
_REST = ...


@dataclasses.dataclass(frozen=True)
class NnxModel:
    """The static half of a split NNX model: its graph definition and the layout of its state.

    Build it with `NnxModel.split(model)`. `params_def`/`state_def` are the tree structures of the
    `nnx.State`s (with their Variable nodes); `params_tree`/`state_tree` those of the plain dicts
    whalex carries. Both list the same leaves in the same order (checked at split).
    """

    graphdef: Any
    params_def: Any
    state_def: Any
    params_tree: Any
    state_tree: Any

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def split(cls, model: nnx.Module) -> tuple[NnxModel, Any, Any]:
        """`(NnxModel, params, model_state)`: `nnx.Param`s are params, all other variables state.

        Split the model in the mode it should train in (`model.train()`): static attributes such as
        `Dropout.deterministic` and `BatchNorm.use_running_average` are part of the graph definition.
        """
        if not is_module(model):
            raise TypeError(f"NnxModel.split takes an nnx.Module, got {type(model).__name__}.")
        graphdef, params, rest = nnx.split(model, _PARAM, _REST)
        pure_params, params_tree = _to_pure(params)
        pure_state, state_tree = _to_pure(rest)
        nm = cls(graphdef, jax.tree.structure(params), jax.tree.structure(rest), params_tree, state_tree)
        return nm, pure_params, pure_state

    # -- the functional loss -----------------------------------------------------------------------
    def wrap(self, loss_fn: Callable, has_aux: bool = False) -> Callable:
        """The functional loss whalex's step trains: `loss(params, batch, *, model_state)`.

        It rebuilds the model from `params` and `model_state`, calls `loss_fn(model, batch)`
        (returning `loss`, or `(loss, aux)` with `has_aux=True`), and returns `(loss, new_state)`
        or `(loss, (new_state, aux))`, `new_state` laid out exactly as `model_state`.
        Pure: nothing outside the call is read or changed, so it works under `jax.grad`/`jit`.
        """
        def loss(params, batch, *, model_state):
            model = self.module(params, model_state)
            out = loss_fn(model, batch)
            new_state = self._state_after(model, model_state)
            if has_aux:
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise TypeError("with has_aux=True the NNX loss_fn(model, batch) must return "
                                    f"(loss, aux); got {type(out).__name__}.")
                value, aux = out
                return value, (new_state, aux)
            return out, new_state

        loss.__name__ = getattr(loss_fn, "__name__", "loss")
        loss.__qualname__ = getattr(loss_fn, "__qualname__", loss.__name__)
        loss.__doc__ = getattr(loss_fn, "__doc__", None)
        return loss

    # -- back to a module --------------------------------------------------------------------------
    def module(self, params, model_state) -> nnx.Module:
        """A fresh `nnx.Module` holding `params` and `model_state` (what `step.model(state)` returns).

        `copy=True`: the module owns new Variable objects, so updating its BatchStats inside a
        `jax.grad` trace is allowed and nothing is shared with earlier calls. The module has the
        static attributes (train/eval mode) of the model that was split; `.eval()` it to evaluate.
        """
        p = self._to_state(params, self.params_tree, self.params_def, "params")
        s = self._to_state(model_state, self.state_tree, self.state_def, "model_state")
        return nnx.merge(self.graphdef, p, s, copy=True)

    # -- helpers -----------------------------------------------------------------------------------
    @staticmethod
    def _to_state(pure, tree, state_def, what):
        leaves, got = jax.tree.flatten(pure)
        if got != tree:
            raise ValueError(f"NnxModel: {what} has the structure {got}, but the model was split with "
                             f"{tree}; pass the pytree NnxModel.split returned (or one of the same shape).")
        return jax.tree.unflatten(state_def, leaves)

    def _state_after(self, model, model_state):
        """The model's non-Param variables after the call, laid out (and typed) as `model_state`."""
        _, _, rest = nnx.split(model, _PARAM, _REST)
        if jax.tree.structure(rest) == self.state_def:
            new = jax.tree.unflatten(self.state_tree, jax.tree.leaves(rest))
        else:
            new = _reshape_like(nnx.to_pure_dict(rest), model_state)
        return jax.tree.map(_like, new, model_state)


def _to_pure(state: nnx.State):
    """A plain nested dict of the State's values, and its tree structure; same leaves, same order."""
    pure = nnx.to_pure_dict(state)
    a, b = jax.tree.leaves(state), jax.tree.leaves(pure)
    if len(a) != len(b) or any(x is not y for x, y in zip(a, b)):   # pragma: no cover - layout guard
        raise ValueError("NnxModel: this NNX State does not flatten leaf-for-leaf to a plain dict "
                         "(a Variable with several leaves?); whalex cannot carry it.")
    return pure, jax.tree.structure(pure)


def _reshape_like(new: dict, old):
    """Pick `old`'s paths out of `new`: variables created during the call are dropped."""
    def pick(path, _):
        node = new
        for k in path:
            key = k.key if hasattr(k, "key") else k.idx
            if not isinstance(node, dict) or key not in node:
                raise ValueError(f"NnxModel: the model variable at {jax.tree_util.keystr(path)} "
                                 "disappeared during loss_fn; model state must keep its layout.")
            node = node[key]
        return node
    return jax.tree.map_with_path(pick, old)


def _like(new, old):
    """`new` with `old`'s dtype; shapes must agree."""
    if jnp.shape(new) != jnp.shape(old):
        raise ValueError(f"NnxModel: a model variable changed shape during loss_fn "
                         f"({jnp.shape(old)} -> {jnp.shape(new)}); model state must keep its layout.")
    dtype = getattr(old, "dtype", None)
    if dtype is not None and getattr(new, "dtype", None) != dtype and not is_key(old):
        return jnp.asarray(new).astype(dtype)
    return new
