"""`state.params` reads as the caller's pytree under every plan; plans with their
own storage (padded uneven head shards) unpack on read and pack on replace. Pipelines store the
caller's pytree itself (spread over every device) and pack stage rows inside the step."""
import jax
import numpy as np
import optax
import pytest

import whalex as wh
from balance.test_heterogeneous_balance import _head_model
from conftest import HETERO, reference_train, rel_err
from lowering.test_pipeline import _plain, _two_stage

SGD = optax.sgd(0.05)


def _shapes(tree):
    return jax.tree.map(lambda x: (np.shape(x), np.dtype(x.dtype)), tree)


def _train(step, state, batches):
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


@pytest.mark.parametrize("config", [wh.Config(num_micro_batch=4), wh.Config(num_micro_batch=4, zero_level=3)],
                         ids=["pipeline", "pipeline-zero3"])
def test_pipeline_params_read_as_the_callers_pytree(config):
    params, batch = _plain()
    step = wh.parallelize(_two_stage, SGD, config=config)
    state = step.init(params, batch)
    assert state.view is None                  # stored as the caller's pytree, spread over every device
    assert jax.tree.structure(state.params) == jax.tree.structure(params)
    assert _shapes(state.params) == _shapes(params)
    jax.tree.map(np.testing.assert_array_equal, state.params, params)       # unpacking is exact
    state, _ = _train(step, state, [batch] * 2)
    _, ref = reference_train(_two_stage, params, batch, SGD, 2)
    assert max(jax.tree.leaves(jax.tree.map(rel_err, state.params, ref))) < 1e-5
    # the view reads inside jax transformations too
    norm = jax.jit(lambda s: optax.tree.norm(s.params))(state)
    np.testing.assert_allclose(norm, optax.tree.norm(ref), rtol=1e-5)


def test_replace_params_packs_a_callers_pytree_and_training_goes_on_from_it():
    params, batch = _plain()
    step = wh.parallelize(_two_stage, SGD, config=wh.Config(num_micro_batch=4))
    state = step.init(params, batch)
    other, _ = _plain(seed=1)
    state = state.replace(params=other)               # e.g. weights loaded from elsewhere
    assert state.view is None
    jax.tree.map(np.testing.assert_array_equal, state.params, other)
    state, losses = _train(step, state, [batch] * 2)
    ref_losses, ref = reference_train(_two_stage, other, batch, SGD, 2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max(jax.tree.leaves(jax.tree.map(rel_err, state.params, ref))) < 1e-5


def test_padded_uneven_head_reads_unpadded_and_a_new_batch_size_relays_out_the_state():
    """A heterogeneous split head is stored padded per device; `state.params` hides that, and a batch of
    another size re-plans and carries params and Adam state over to the new plan's layout."""
    loss_fn, params, batch = _head_model()
    opt = optax.adam(1e-2)
    step = wh.parallelize(loss_fn, opt, cluster=wh.Cluster(kinds=HETERO))
    state = step.init(params, batch)
    assert state.stored_params["kernel"].shape == (24, 840) and state.view.layout == "padded uneven shards"
    assert _shapes(state.params) == _shapes(params)
    jax.tree.map(np.testing.assert_array_equal, state.params, params)
    half = jax.tree.map(lambda x: x[:16], batch)
    state, losses = _train(step, state, [batch, half, batch])

    def reference(p, o, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    p, o, ref_losses = params, opt.init(params), []
    for b in [batch, half, batch]:
        p, o, loss = reference(p, o, b)
        ref_losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max(jax.tree.leaves(jax.tree.map(rel_err, state.params, p))) < 1e-5


def test_a_state_from_another_step_is_relaid_out():
    """A padded state made by another step (its own ParamView) is unpacked through that view and packed
    into this step's layout: training goes on exactly as under the step that made it."""
    loss_fn, params, batch = _head_model()
    cluster = wh.Cluster(kinds=HETERO)
    maker = wh.parallelize(loss_fn, SGD, cluster=cluster)
    state, _ = _train(maker, maker.init(params, batch), [batch])
    step = wh.parallelize(loss_fn, SGD, cluster=cluster)
    step.init(params, batch)
    assert state.view is not step.plan.storage.param_view
    moved, losses = _train(step, state, [batch] * 2)
    assert moved.view is step.plan.storage.param_view
    kept, ref_losses = _train(maker, state, [batch] * 2)      # the other step's state was copied, not consumed
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert max(jax.tree.leaves(jax.tree.map(rel_err, moved.params, kept.params))) < 1e-6
