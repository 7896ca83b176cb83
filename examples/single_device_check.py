"""`--check` for the examples: train the same model with whalex and on one device, compare, and fail.

    python examples/pipeline_transformer.py --check     # exits 1 with a message when the check fails

The comparison is the one of docs/architecture.md#testing-and-measuring: after a few Adam steps
on the same batches, the largest max |a - b| / max |b| over parameter leaves (whalex vs one
device) must stay within `--check-tol`.
A wrong plan (a missing 1/n, a gradient summed twice) shows up as 1e-2 or more; float
reassociation stays near 1e-6. Adam's eps is 1e-4 here: with eps=1e-8 an element whose true
gradient is ~1e-9 moves by ~lr on reassociation noise alone, which measures the optimizer, not
the plan (measured on the MoE example: 5e-4 with eps=1e-8, 4e-6 with eps=1e-4).
The hidden `--perturb` flag makes the whalex side deliberately wrong (its learning rate doubled), so
tests can see the check fail.
"""
from __future__ import annotations

import sys

import jax
import numpy as np
import optax

import whalex as wh


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def compare(loss_fn, params, batches, lr: float, *, has_aux: bool, perturb: bool = False, **parallelize) -> float:
    """Train with whalex (`wh.parallelize(..., **parallelize)`) and on one device over `batches`;
    the worst relative parameter error over leaves."""
    optimizer = optax.adam(lr, eps=1e-4)
    mine = optax.adam(2 * lr, eps=1e-4) if perturb else optimizer
    step = wh.parallelize(loss_fn, mine, has_aux=has_aux, **parallelize)
    state = step.init(params, batches[0])
    ref_p, ref_o = params, optimizer.init(params)

    @jax.jit
    def ref_step(p, o, b):
        g = jax.grad(loss_fn, has_aux=has_aux)(p, b)
        g = g[0] if has_aux else g
        u, o = optimizer.update(g, o, p)
        return optax.apply_updates(p, u), o

    for b in batches:
        state, _ = step(state, b)
        ref_p, ref_o = ref_step(ref_p, ref_o, b)
    return max(jax.tree.leaves(jax.tree.map(rel_err, step.params(state), ref_p)))


def verdict(worst: float, tol: float, steps: int) -> bool:
    ok = worst <= tol
    print(f"check: after {steps} Adam steps the parameters match single-device training to {worst:.2e} "
          f"(max |a-b| / max |b| over leaves; tolerance {tol:.0e}): {'passed' if ok else 'FAILED'}")
    return ok


def exit_status(result: dict) -> None:
    """End the script: status 1, with the reason on stderr, when its --check failed."""
    if result.get("check_ok") is False:
        sys.exit(f"check failed: whalex's parameters differ from single-device training by "
                 f"{result['max_rel_err']:.2e}, more than the tolerance --check-tol; the plan is wrong.")
