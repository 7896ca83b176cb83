"""`wh.CheckpointManager`: plan-independent checkpoints on orbax-checkpoint.

One layout on disk for every plan, the caller's: a pytree

    {"params": <the caller's params pytree>, "opt_state": <optax state of those params>,
     "step": int32, "model_state": ..., "rng": <key data>, "loss_scale": ...}   (last three if present)

Pipeline stage buffers, padded uneven split heads and their optimizer moments are converted back to
the caller's pytree before saving (`Plan.caller_state`); ZeRO shards and offloaded arrays are
just global arrays, which orbax writes as such. Restoring plans like `step.init`, builds the
caller-layout abstract target with shardings on THIS plan's mesh (orbax's own
`to_shape_dtype_struct` would keep the saving mesh), restores into it, and converts to this plan's
storage layout (`plan.storage.place_caller_state`). So a checkpoint saved under any plan or cluster
restores under any other, and plain orbax reads it without whalex.
"""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

from whalex.api import Step
from whalex.errors import PlanError
from whalex.state import TrainState

__all__ = ["CheckpointManager"]


def _check_step(method: str, step, rest: str) -> None:
    """`step` is the whalex Step: refuse orbax's argument order (a step number first) by name."""
    if isinstance(step, Step):
        return
    if isinstance(step, int):            # orbax's CheckpointManager.save(step_number, ...)
        got = f"the step number {step}" + (" (orbax's order); whalex saves at state.step, so no number is passed"
                                           if method == "save" else f"; pass it as at={step}")
    else:
        got = f"a {type(step).__name__}"
    raise PlanError(f"manager.{method}(step, {rest}) takes the whalex Step first (step = wh.parallelize(...)), "
                    f"got {got}. Call manager.{method}(step, {rest}).")


class CheckpointManager:
    """Save and restore whalex training states, whatever plan saved or restores them.

        with wh.CheckpointManager(directory, max_to_keep=3) as manager:
            state = manager.restore(step, params, batch) if manager.latest_step() is not None \\
                else step.init(params, batch)
            ...
            manager.save(step, state)          # asynchronous; every process calls it

    `save_interval_steps`: saves at other steps are skipped (orbax's policy)."""

    def __init__(self, directory, max_to_keep: int | None = 3, save_interval_steps: int = 1):
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, save_interval_steps=save_interval_steps,
                                               create=True, enable_async_checkpointing=True)
        self.directory = os.path.abspath(os.fspath(directory))
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                               item_handlers=ocp.StandardCheckpointHandler())

    # -- saving --------------------------------------------------------------------------------
    def save(self, step: Step, state: TrainState, force: bool = False) -> bool:
        """Save `state` (at `state.step`) in the caller's layout; returns whether a save was started.
        Asynchronous: the arrays are copied before it returns, the files written in the background."""
        _check_step("save", step, "state")
        if not isinstance(state, TrainState):
            raise PlanError("manager.save(step, state) takes the wh.TrainState the step returned.")
        tree = step.plan.caller_state(state)
        at = int(jax.device_get(state.step.addressable_data(0)))     # replicated: every process reads its own copy
        return self._manager.save(at, args=ocp.args.StandardSave(tree), force=force)

    # -- restoring ------------------------------------------------------------------------------
    def restore(self, step: Step, params, example_batch, at: int | None = None, model_state=None,
                rng=None) -> TrainState:
        """The state saved at step `at` (default: the latest), placed per `step`'s plan for these shapes,
        as `step.init(params, example_batch, model_state=..., rng=...)` would place a fresh one.

        `params` (arrays, jax.ShapeDtypeStructs, or an NNX module) and `model_state` / `rng` only give
        the structure, shapes and dtypes; their values are not used."""
        _check_step("restore", step, "params, example_batch, at=None")
        at = self.latest_step() if at is None else at
        if at is None:
            raise PlanError(f"no checkpoint in {self.directory}; start with step.init(params, batch).")
        plan, params, model_state = step._prepare(params, example_batch, model_state, rng)
        target = plan.storage.caller_targets(model_state, rng)
        metadata = self._manager.item_metadata(at)
        saved = set(metadata.keys())
        missing = {"model_state", "rng"} & (set(target) - saved)
        if missing:
            raise PlanError(f"the checkpoint at step {at} has no {sorted(missing)}; restore without "
                            f"{' / '.join(sorted(missing))}= (the step it was saved from did not carry it).")
        extra = {"model_state", "rng"} & (saved - set(target))
        if extra:
            raise PlanError(f"the checkpoint at step {at} holds {sorted(extra)}; pass an example "
                            f"{' / '.join(sorted(extra))}= to restore (as to step.init).")
        if "loss_scale" in saved:            # amp="fp16" saved it; a plan without a loss scale drops it
            target["loss_scale"] = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target["step"].sharding),
                dict(metadata["loss_scale"]))
        tree = self._manager.restore(at, args=ocp.args.StandardRestore(target))
        return step._adopt(plan.storage.place_caller_state(tree, rng), params, example_batch)

    # -- bookkeeping ----------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def wait_until_finished(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

