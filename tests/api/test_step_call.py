"""The fast path of `Step.__call__` (the state the step just returned, a batch like
the last one) runs what the full path would run and skips no check that matters."""
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import whalex as wh
from conftest import reference_train
from lowering.test_pipeline import _plain, _two_stage
from support.models import data, plain_params
from whalex.distributed import place_global

SGD = optax.sgd(0.05)


def _loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["wh"] + p["bh"], b["y"]).mean()


def _step():
    step = wh.parallelize(_loss, SGD)
    return step, step.init(plain_params(), data())


def test_fast_path_trains_like_one_device_with_host_and_placed_batches():
    step, state = _step()
    batch = data()
    placed = step.plan.place_batch(batch)
    losses = []
    for b in [batch, placed, placed, batch]:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    ref_losses, ref = reference_train(_loss, plain_params(), batch, SGD, 4)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_new_batch_shape_or_dtype_is_noticed_after_fast_calls():
    step, state = _step()
    for _ in range(2):
        state, _ = step(state, data())
    first = step.plan
    for batch in [data(batch=16), {"x": data()["x"].astype(jnp.bfloat16), "y": data()["y"]}]:
        params = jax.device_get(state.params)
        state, m = step(state, batch)
        assert step.plan is not first and sum(step.plan.batch_sizes) == len(batch["y"])
        np.testing.assert_allclose(float(m["loss"]), float(_loss(params, batch)), rtol=1e-4)
        state, _ = step(state, data())            # back to the first shapes: the first plan again
        assert step.plan is first


def test_a_pipeline_refuses_a_new_batch_shape_after_fast_calls():
    params, batch = _plain()
    step = wh.parallelize(_two_stage, SGD, config=wh.Config(num_micro_batch=4))
    state = step.init(params, batch)
    for _ in range(2):
        state, _ = step(state, batch)
    with pytest.raises(wh.PlanError, match="batch shapes differ from the ones this pipeline was planned for"):
        step(state, jax.tree.map(lambda x: x[:32], batch))


def test_a_donated_state_is_refused_on_every_path():
    step, s0 = _step()
    batch = data()
    s1, _ = step(s0, batch)
    s2, _ = step(s1, batch)                      # the fast path
    for consumed in [s0, s1, s1.replace(params=plain_params())]:   # replace: fresh params, consumed rest
        with pytest.raises(wh.PlanError, match=r"consumed by an earlier step.*state, metrics = step\(state, batch\)"):
            step(consumed, batch)
    other = wh.parallelize(_loss, SGD)           # the same plan: it takes this step's states
    other.init(plain_params(), batch)
    other(s2, batch)                             # consumes the state `step` returned last
    with pytest.raises(wh.PlanError, match="consumed by an earlier step"):
        step(s2, batch)


def test_the_step_holds_its_last_state_weakly():
    step, state = _step()
    state, _ = step(state, data())
    ref = weakref.ref(state)
    del state
    gc.collect()
    assert ref() is None


def test_place_global_passes_placed_arrays_through():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    x = jax.device_put(np.arange(32.0).reshape(16, 2), rows)
    out = place_global({"x": x, "y": x, "z": np.ones(16)}, {"x": rows, "y": rep, "z": rows})
    assert out["x"] is x
    assert out["y"].sharding == rep and out["z"].sharding == rows
    np.testing.assert_array_equal(out["y"], x)
