"""Issue 27, Build 2: offload="params" per layer (ZeRO-Offload style). Parameters stay in pinned host
memory; each layer fetches its own for its forward pass and again for its backward pass, so no
device copy of a parameter is kept from one to the other, and training equals one device."""
import collections

import jax
import optax
import pytest

import whalex as wh
from conftest import adam, assert_matches
from test_gpt import LAYERS, loss_fn, problem
from whalex import _compat as C


def _host_moves(jaxpr, where="step") -> collections.Counter:
    """Host-to-device moves of the traced step, by the primitive they sit in ('step': the top level,
    which after differentiation holds the forward pass and the update; 'remat2': a checkpoint's
    recomputation in the backward pass)."""
    out = collections.Counter()
    for e in jaxpr.eqns:
        if e.primitive.name == "device_put":
            out[where] += sum("host" in str(v.aval) for v in e.invars)
        for sub in C.sub_jaxprs(e):
            out += _host_moves(C.open_jaxpr(sub)[0], e.primitive.name)
    return out


@pytest.mark.parametrize("optimizer", [optax.sgd(0.5), adam()], ids=["sgd", "adam"])
def test_params_offloaded_per_layer_train_as_one_device(optimizer):
    params, batch = problem()
    step, state = assert_matches(loss_fn, params, batch, steps=3, optimizer=optimizer, tol=1e-4,
                                 config=wh.Config(offload="params"))
    assert step.plan.params_fetched_per_layer
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.stored_params)} == {"pinned_host"}
    assert "fetched per layer" in step.plan.summary()


def test_no_device_copy_of_a_parameter_is_kept_for_the_backward_pass():
    """What JAX keeps for the backward pass: the host arrays (arguments), never a fetched copy; the
    backward pass fetches each layer's weights again (inside its checkpoint's recomputation)."""
    params, batch = problem()
    plan = wh.plan(loss_fn, params, batch, optax.sgd(0.1), config=wh.Config(offload="params"))
    loss = plan.program.loss()
    zeros = jax.tree.map(jax.numpy.zeros_like, params)
    saved = C.saved_residuals(lambda d, h, b: loss(d, (b, [], h))[0], zeros, params, batch)
    fetched = [src for _, src in saved if any(f"output of {p}" in src for p in C.FETCH_PRIMITIVES)]
    assert not fetched, fetched
    assert any("from the argument h" in src for _, src in saved)       # the host arrays are what is kept
    moves = _host_moves(C.open_jaxpr(plan.traced_step().jaxpr)[0])
    leaves = len(jax.tree.leaves(params))
    kernels = sum("kernel" in jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(params))
    assert moves["step"] == 2 * leaves                   # each leaf: its layer's forward, the update
    assert moves["remat2"] == kernels                    # each kernel again for its layer's backward (dx = dy W^T;
    assert kernels >= 6 * LAYERS                         # a bias's or a table's backward does not read it)
    assert plan.host_traffic()[0].to_device == pytest.approx(3 * plan.host_traffic()[0].to_host)


def test_params_offloaded_per_layer_under_remat_full():
    params, batch = problem()
    step, _ = assert_matches(loss_fn, params, batch, steps=2, optimizer=adam(), tol=1e-4,
                             config=wh.Config(offload="params", remat="full"))
    assert step.plan.params_fetched_per_layer


def test_micro_batches_fetch_the_whole_tree_and_say_so():
    params, batch = problem()
    plan = wh.plan(loss_fn, params, batch, optax.sgd(0.1), config=wh.Config(offload="params", num_micro_batch=2))
    assert not plan.params_fetched_per_layer and "fetched whole at the start of the step" in plan.summary()


def test_params_per_layer_with_zero_1_and_offloaded_optimizer_state():
    params, batch = problem()
    step, state = assert_matches(loss_fn, params, batch, steps=2, optimizer=adam(), tol=1e-4,
                                 config=wh.Config(zero_level=1, offload=("opt_state", "params")))
    assert step.plan.params_fetched_per_layer
    assert {x.sharding.memory_kind for x in jax.tree.leaves((state.stored_params, state.opt_state))
            if hasattr(x, "sharding") and x.ndim} == {"pinned_host"}
