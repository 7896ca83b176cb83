"""A step program's state in the caller's layout (what checkpoints hold) and back, and a state made by
another plan or step re-laid out for this one: the half of `whalex.lowering.emit.Emitter` that
converts states rather than running steps.

The caller's layout is the parameter pytree as the user wrote it (no packing, padding or ZeRO shards)
with the optimizer state's per-parameter subtrees in the same form."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from whalex.errors import PlanError
from whalex.memory import offload
from whalex.memory.opt_state_specs import param_tree_test
from whalex.state import ParamView, TrainState

if TYPE_CHECKING:
    import optax


def map_param_trees(tree, param_shapes, fn: Callable):
    """`fn` applied to every subtree of `tree` laid out like `param_shapes` (same structure and leaf
    shapes: the per-parameter subtrees of an optax state, e.g. Adam's mu and nu); the rest unchanged.
    The same test as `opt_state_specs` uses to shard those subtrees like the parameters."""
    is_param_tree = param_tree_test(param_shapes)
    return jax.tree.map(lambda x: fn(x) if is_param_tree(x) else x, tree, is_leaf=is_param_tree)

def _relayout(opt_state, expected):
    """`opt_state` (per-parameter subtrees converted) in the structure of `expected`, or a PlanError."""
    if not param_tree_test(expected)(opt_state):
        raise PlanError("this plan stores the parameters in its own layout (padded uneven shards) and the "
                        "optimizer state has parts that are not per-parameter subtrees "
                        "(e.g. adafactor's factored statistics), so it has no plan-independent form; checkpoint "
                        "under a plan without packing, or use a per-parameter optimizer (adam, sgd, ...).")
    return jax.tree.unflatten(jax.tree.structure(expected), jax.tree.leaves(opt_state))

def _placed_as(array, sharding) -> bool:
    have = getattr(array, "sharding", None)
    return have is not None and (have == sharding or have.is_equivalent_to(sharding, array.ndim))


def _caller_tree(state: TrainState) -> dict:
    """A state's values in the caller's layout, as a checkpoint holds them (`Emitter.caller_state`), read
    through the state's own parameter view: its per-parameter optimizer subtrees are unpacked like the
    parameters. Offloaded leaves are brought to device memory first."""
    state = jax.tree.map(lambda a: jax.device_put(a, offload.on_device(a.sharding))
                         if getattr(getattr(a, "sharding", None), "memory_kind", None) not in (None, offload.DEVICE)
                         else a, state)
    params, opt_state = state.stored_params, state.opt_state
    if state.view is not None:
        stored = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
        params, opt_state = state.view.unpack(params), map_param_trees(opt_state, stored, state.view.unpack)
    return _caller_fields(state, params, opt_state)


def _caller_fields(state: TrainState, params, opt_state) -> dict:
    """What a checkpoint holds of `state`, given its parameters and optimizer state in the caller's
    layout: {'params', 'opt_state', 'step'} and 'model_state' / 'rng' (key data) / 'loss_scale' (by
    name: scale, good_steps) where present."""
    out = {"params": params, "opt_state": opt_state, "step": state.step}
    if state.model_state is not None:
        out["model_state"] = state.model_state
    if state.rng is not None:
        rng = state.rng
        out["rng"] = jax.random.key_data(rng) if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng
    if state.loss_scale is not None:
        out["loss_scale"] = {f.name: getattr(state.loss_scale, f.name) for f in dataclasses.fields(state.loss_scale)}
    return out


def _check_same(name: str, given, target) -> None:
    """A PlanError naming what of `given` (a state's field in the caller's layout) differs from this plan's
    `target` (presence, leaf count, the first leaf's shape or dtype): another optimizer or other inputs."""
    fix = ("; use the step that made this state, or start this one from its parameters: "
           "step.init(state.params, batch)")
    if given is None and target is None:
        return
    if given is None or target is None:
        has, wants = ("no", "one") if given is None else ("one", "no")
        raise PlanError(f"this state was made by another step: it has {has} {name} and this step's plan has {wants}"
                        + fix + ".")
    flat, tree = jax.tree_util.tree_flatten_with_path(target)
    leaves = jax.tree.leaves(given)
    if len(leaves) != len(flat):
        raise PlanError(f"this state was made by another step: its {name} has {len(leaves)} arrays and this step's "
                        f"plan expects {len(flat)} ({'another optimizer' if name == 'opt_state' else 'other ' + name})"
                        + fix + ".")
    for (path, t), leaf in zip(flat, leaves):
        if np.shape(leaf) != t.shape or leaf.dtype != t.dtype:
            raise PlanError(f"this state was made by another step: its {name}{jax.tree_util.keystr(path)} is "
                            f"{leaf.dtype}{list(np.shape(leaf))} and this step's plan expects {t.dtype}{list(t.shape)}"
                            + fix + ".")

class CallerLayout:
    """Conversions between a program's stored state and the caller's layout. A mixin of `Emitter`: it
    uses the program's `state_shardings()`, `compute_shardings()`, `abstract_args()`, `param_shapes()`,
    `prepare_params` / `unpack_params` / `param_layout()`, `param_view`, `optimizer` and `_loss_scale`."""

    if TYPE_CHECKING:                      # what `Emitter` and the program classes provide
        mesh: Any
        optimizer: optax.GradientTransformation | None
        param_view: ParamView | None
        def state_shardings(self) -> TrainState: ...
        def compute_shardings(self) -> TrainState: ...
        def abstract_args(self) -> tuple: ...
        def param_shapes(self) -> Any: ...
        def prepare_params(self, params) -> Any: ...
        def unpack_params(self, params) -> Any: ...
        def param_layout(self) -> str | None: ...
        def _loss_scale(self, leaf: Callable) -> Any: ...

    # -- a state made by another plan or step -------------------------------------------------------
    @functools.cached_property
    def _state_sharding_tree(self):
        """(tree structure, leaf shardings) of the state as this plan stores it between steps."""
        leaves, tree = jax.tree.flatten(self.state_shardings())
        return tree, leaves

    def holds(self, state: TrainState) -> bool:
        """Whether `state` is stored as this plan stores it: its parameter view, its structure and every
        leaf on this plan's sharding (what the jitted step accepts as it is)."""
        tree, shardings = self._state_sharding_tree
        leaves, given = jax.tree.flatten(state)
        if state.view is not self.param_view or given != tree:
            return False
        return all(_placed_as(a, s) for a, s in zip(leaves, shardings))

    def adopt_state(self, state: TrainState) -> TrainState:
        """`state`, made by another plan or step of the same parameters (another mesh, sharding, ZeRO level
        or parameter layout), placed per this plan as a checkpoint restore would place it: read in the
        caller's layout, moved onto this plan's mesh, converted to its storage. Values are moved, never
        recomputed, so training goes on exactly; `state` itself is copied, not aliased (the step donates
        what it is given, and the other step's state stays usable)."""
        expected = self.abstract_args()[0]
        for name in ("model_state", "rng"):
            _check_same(name, getattr(state, name), getattr(expected, name))
        tree = _caller_tree(state)
        targets = self.caller_targets(state.model_state, state.rng)
        for name in ("params", "opt_state"):
            _check_same(name, tree[name], targets[name])
        shardings = jax.tree.map(lambda t: t.sharding, targets)
        if "loss_scale" in tree:                 # amp="fp16": replicated scalars, like the step counter
            shardings["loss_scale"] = jax.tree.map(lambda _: shardings["step"], tree["loss_scale"])
        placed = jax.device_put({k: tree[k] for k in shardings}, shardings)
        # copied: a device_put onto another set of devices reuses the source's buffers on the devices both
        # meshes share (even with may_alias=False), and the step would then donate the other step's arrays
        placed = jax.tree.map(lambda a: jnp.array(a, copy=True), placed)
        return self.place_caller_state(placed, rng=state.rng)

    # -- the caller's layout (checkpoints): no packing, padding or ZeRO shards --------------------------
    def caller_param_shapes(self):
        """ShapeDtypeStructs of the caller's parameter pytree."""
        return jax.eval_shape(self.unpack_params, self.param_shapes())

    def _caller_opt_state(self, opt_state):
        caller = map_param_trees(opt_state, self.param_shapes(), self.unpack_params)
        return _relayout(caller, jax.eval_shape(self.optimizer.init, self.caller_param_shapes()))

    @functools.cached_property
    def _to_caller(self):
        """jitted (stored params, opt_state) -> the caller's layout."""
        return jax.jit(lambda p, o: (self.unpack_params(p), self._caller_opt_state(o)))

    @functools.cached_property
    def _from_caller(self):
        """jitted (caller params, opt_state) -> this plan's storage layout, in compute shardings."""
        caller_params = self.caller_param_shapes()
        storage_opt = jax.eval_shape(self.optimizer.init, self.param_shapes())
        compute = self.compute_shardings()

        def convert(p, o):
            return self.prepare_params(p), _relayout(map_param_trees(o, caller_params, self.prepare_params),
                                                     storage_opt)

        return jax.jit(convert, out_shardings=(compute.stored_params, compute.opt_state))

    def caller_state(self, state: TrainState) -> dict:
        """The state in the caller's layout, what a checkpoint holds: {'params', 'opt_state', 'step'} and
        'model_state' / 'rng' (key data) / 'loss_scale' where present. Internal layouts (padded
        uneven heads) are undone; ZeRO shards and offloaded arrays are just placed arrays."""
        params, opt_state = state.stored_params, state.opt_state
        if self.param_layout() is not None:
            compute = self.compute_shardings()           # undo the layout in device memory (offload: fetch)
            params, opt_state = jax.device_put((params, opt_state), (compute.stored_params, compute.opt_state))
            params, opt_state = self._to_caller(params, opt_state)
        return _caller_fields(state, params, opt_state)

    def caller_targets(self, model_state=None, rng=None) -> dict:
        """Abstract caller-layout state (ShapeDtypeStructs with shardings on THIS plan's mesh) to restore
        a checkpoint into: leaves stored as the caller has them keep this plan's compute sharding, leaves
        that this plan re-lays out (packed, padded) arrive replicated and are converted by `place_caller_state`."""
        compute = self.compute_shardings()
        rep = NamedSharding(self.mesh, P())

        def target(caller, storage, shardings):
            leaves = jax.tree.leaves(caller)
            shards = [rep] * len(leaves)
            if jax.tree.structure(caller) == jax.tree.structure(storage):   # keep the sharding of unchanged leaves
                shards = [sh if np.shape(s) == np.shape(c) else rep
                          for c, s, sh in zip(leaves, jax.tree.leaves(storage), jax.tree.leaves(shardings))]
            return jax.tree.unflatten(jax.tree.structure(caller), [
                jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=sh) for c, sh in zip(leaves, shards)])

        params = self.caller_param_shapes()
        storage_opt = jax.eval_shape(self.optimizer.init, self.param_shapes())
        out = {"params": target(params, self.param_shapes(), compute.stored_params),
               "opt_state": target(jax.eval_shape(self.optimizer.init, params), storage_opt, compute.opt_state),
               "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)}
        sds = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=rep)  # noqa: E731
        if model_state is not None:
            out["model_state"] = jax.tree.map(sds, model_state)
        if rng is not None:
            out["rng"] = sds(jax.eval_shape(jax.random.key_data, rng)
                             if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng)
        return out

    def place_caller_state(self, tree: dict, rng=None) -> TrainState:
        """A TrainState of this plan from caller-layout values (a restored checkpoint): converted to this
        plan's storage layout (packed, padded) and placed per its state shardings (ZeRO, offload).
        `rng`: an example key, to re-wrap key data as a typed key of its implementation."""
        shardings = self.state_shardings()
        params, opt_state = tree["params"], tree["opt_state"]
        if self.param_layout() is not None:
            params, opt_state = self._from_caller(params, opt_state)
        else:
            opt_state = _relayout(opt_state, jax.eval_shape(self.optimizer.init, self.param_shapes()))
        params = jax.device_put(params, shardings.stored_params)
        opt_state = jax.device_put(opt_state, shardings.opt_state)
        model_state = tree.get("model_state")
        if model_state is not None:
            model_state = jax.device_put(model_state, shardings.model_state)
        key = tree.get("rng")
        if key is not None:
            if rng is not None and jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
                key = jax.random.wrap_key_data(key, impl=jax.random.key_impl(rng))
            key = jax.device_put(key, shardings.rng)
        scale = self._loss_scale(lambda x: x)
        if scale is not None:
            saved = tree.get("loss_scale")
            scale = jax.tree.map(lambda x: jax.device_put(x, shardings.step),
                                 type(scale)(**saved) if saved is not None else scale)
        return TrainState(stored_params=params, opt_state=opt_state, step=jax.device_put(tree["step"], shardings.step),
                          loss_scale=scale, model_state=model_state, rng=key, view=self.param_view)
