"""Mixed precision (`Config.amp`) as a transform of the loss: its floating parameters and batch leaves
cast to bf16/fp16 and the loss cast back to fp32 (`AmpLoss`); the state keeps fp32 master weights and
optimizer state, and gradients arrive in fp32 (the transpose of the cast). Re-binding an fp32 jaxpr at
bf16 would not work (equations carry dtypes in their params), so the cast is traced, not rewritten.

The traced casts lead the captured jaxpr; `sink_casts` moves each next to its value's first use so it
belongs to the TaskGraph (and pipeline stage) that reads it: a transform of the capture, applied by the
planner to an `AmpLoss`'s capture.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from whalex import _compat as C
from whalex.jaxpr import capture as capture_mod
from whalex.records.memory_options import HALF


class AmpLoss:
    """`loss_fn` with its floating inputs cast to a half dtype and the loss returned in fp32."""

    def __init__(self, loss_fn: Callable, amp: str, has_aux: bool):
        self.loss_fn, self.dtype, self.has_aux = loss_fn, HALF[amp], has_aux

    def __call__(self, params, batch, **kwargs):
        out = self.loss_fn(cast(params, self.dtype), cast(batch, self.dtype), **kwargs)
        if "model_state" in kwargs:          # (loss, new state) or (loss, (new state, aux)): state keeps its dtypes
            loss, rest = out
            like = kwargs["model_state"]
            keep = lambda new: jax.tree.map(lambda x, y: jnp.asarray(x).astype(y.dtype), new, like)  # noqa: E731
            rest = (keep(rest[0]), rest[1]) if self.has_aux else keep(rest)
            return jnp.asarray(loss).astype(jnp.float32), rest
        if self.has_aux:
            loss, aux = out
            return jnp.asarray(loss).astype(jnp.float32), aux
        return jnp.asarray(out).astype(jnp.float32)


def amp_loss(loss_fn: Callable, amp: str | None, has_aux: bool) -> Callable:
    return loss_fn if amp is None else AmpLoss(loss_fn, amp, has_aux)


def cast(tree, dtype):
    """Floating leaves of `tree` in `dtype`; other leaves unchanged."""
    return jax.tree.map(lambda x: jnp.asarray(x).astype(dtype)
                        if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating) else x, tree)


def _is_cast(eqn) -> bool:
    return eqn.primitive.name == "convert_element_type" and capture_mod.scope_of(eqn) is None


def sink_casts(cap):
    """Move the leading input casts next to their first consumer (with its source info, so they
    join its TaskGraph), retag the final loss cast with its producer's, and regroup."""
    jaxpr = cap.jaxpr.jaxpr
    inputs = set(jaxpr.invars)
    eqns = list(jaxpr.eqns)
    lead = 0
    while lead < len(eqns) and _is_cast(eqns[lead]) and eqns[lead].invars[0] in inputs:
        lead += 1
    pending = {e.outvars[0]: e for e in eqns[:lead]}
    loss = jaxpr.outvars[0]
    producer: dict = {}
    moved = []
    for eqn in eqns[lead:]:
        for v in eqn.invars:
            if not isinstance(v, C.Literal) and v in pending:
                moved.append(pending.pop(v).replace(source_info=eqn.source_info))
        if eqn.outvars[0] is loss and _is_cast(eqn) and eqn.invars[0] in producer:    # AmpLoss's fp32 cast
            eqn = eqn.replace(source_info=producer[eqn.invars[0]].source_info)
        moved.append(eqn)
        for v in eqn.outvars:
            producer[v] = eqn
    returned = [v for v in jaxpr.outvars if not isinstance(v, C.Literal) and v in pending]
    moved = [pending.pop(v) for v in returned] + moved        # an input returned as it is
    new = jaxpr.replace(eqns=moved)
    taskgraphs, assign = capture_mod.group_taskgraphs(new, cap.num_params, cap.default)
    return dataclasses.replace(cap, jaxpr=C.ClosedJaxpr(new, cap.jaxpr.consts), taskgraphs=taskgraphs,
                               assign=assign)
