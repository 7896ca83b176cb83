"""Expert parallelism: the experts call as a `shard_map` with all-to-all dispatch and combine.

Each device holds E/n experts (the weights' leading dim split over the expert axes) and its own
groups of tokens. The dispatched buffer [G_local, E, C, d] is exchanged with one all-to-all so that
each device receives, from every device of its expert group, the slots of its own experts
([n * G_local, E/n, C, d]); after the feed-forward a second all-to-all sends the outputs back.
The backward pass is the transposed all-to-alls; expert weight gradients stay on their device
(summed only over the data axes that replicate them), never all-reduced over the expert axes.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec as P

from whalex.moe.dispatch import feed_forward


def _spec(axes: Sequence[str]) -> P:
    axes = tuple(axes)
    return P(axes[0] if len(axes) == 1 else axes) if axes else P()


def expert_parallel(mesh, token_axes: Sequence[str], expert_axes: Sequence[str], activation: str):
    """fn(buf, w_in, b_in, w_out, b_out) -> out, with buf's groups sharded over `token_axes`
    (which must include `expert_axes`) and experts over `expert_axes`."""
    expert_axes = tuple(expert_axes)
    name = expert_axes[0] if len(expert_axes) == 1 else expert_axes
    tokens, experts_ = _spec(token_axes), _spec(expert_axes)

    def local(buf, w_in, b_in, w_out, b_out):
        buf = jax.lax.all_to_all(buf, name, split_axis=1, concat_axis=0, tiled=True)
        out = feed_forward(buf, w_in, b_in, w_out, b_out, activation)
        return jax.lax.all_to_all(out, name, split_axis=0, concat_axis=1, tiled=True)

    return jax.shard_map(local, mesh=mesh, in_specs=(tokens, experts_, experts_, experts_, experts_),
                         out_specs=tokens, check_vma=True)


def expert_overrides(calls, mesh) -> dict:
    """The planner's ExpertCalls -> their expert-parallel shard_maps, as the evaluator's overrides
    (path -> function of the call's inputs); calls with the same axes and activation share one
    function (so their blocks can be evaluated once)."""
    fns: dict = {}

    def override(call):
        key = (call.token_axes, call.expert_axes, call.activation)
        if key not in fns:
            fn = expert_parallel(mesh, *key)
            fns[key] = lambda *args: [fn(*args)]
        return fns[key]

    return {call.path: override(call) for call in calls}
