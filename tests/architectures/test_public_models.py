"""Models after public architectures (tests/public_models: Llama, ViT, ResNet) under every plan kind:
each trains exactly as one device, or is refused with a named whalex error (BatchNorm statistics on
plans that evaluate the loss in parts)."""
import jax
import numpy as np
import optax
import pytest

import whalex as wh
from conftest import HETERO, assert_matches, rel_err
from support.public_models import llama, resnet, vit

B = 16

# plan kind -> (parallelize keywords, the program kind it builds)
PLANS = {
    "data parallel": (dict(), "Program"),
    "uneven data parallel": (dict(cluster=wh.Cluster(kinds=HETERO)), "UnevenProgram"),
    "gradient accumulation": (dict(config=wh.Config(num_micro_batch=2)), "Program"),
    "zero 2": (dict(config=wh.Config(zero_level=2)), "UnevenProgram"),
    "pipeline": (dict(config=wh.Config(auto_parallel=True, num_task_graph=2, num_micro_batch=4)), "PipelineProgram"),
}
MODELS = {"llama": llama.problem, "vit": vit.problem}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("model", list(MODELS))
def test_public_model_trains_as_one_device(model, plan):
    loss_fn, params, batch = MODELS[model](batch=B)
    kwargs, kind = PLANS[plan]
    kwargs = {"cluster": wh.Cluster.detect(), **kwargs}
    step, _ = assert_matches(loss_fn, params, batch, steps=2, optimizer=optax.sgd(0.3), **kwargs)
    assert step.plan.program_kind == kind


def _resnet_reference(loss_fn, params, state, batch, optimizer, steps):
    opt_state = optimizer.init(params)

    @jax.jit
    def step(p, o, ms):
        (loss, ms), g = jax.value_and_grad(lambda p, ms: loss_fn(p, batch, model_state=ms), has_aux=True)(p, ms)
        u, o = optimizer.update(g, o, p)
        return optax.apply_updates(p, u), o, ms, loss

    losses = []
    for _ in range(steps):
        params, opt_state, state, loss = step(params, opt_state, state)
        losses.append(float(loss))
    return losses, params, state


WHOLE_BATCH = ("data parallel", "zero 2")       # plans that compute BatchNorm's statistics over the whole batch


@pytest.mark.parametrize("plan", list(PLANS))
def test_resnet_trains_as_one_device_or_names_its_batchnorm(plan):
    loss_fn, params, state, batch = resnet.problem(batch=B)
    kwargs, _ = PLANS[plan]
    kwargs = {"cluster": wh.Cluster.detect(), **kwargs}
    opt = optax.sgd(0.3)
    if plan not in WHOLE_BATCH:
        with pytest.raises(wh.PlanError, match=r"(?s)BatchNorm.*statistic.*batch_coupling='per_part'"):
            wh.plan(loss_fn, params, batch, opt, model_state=state, **kwargs)
        return
    ref_losses, ref_params, ref_state = _resnet_reference(loss_fn, params, state, batch, opt, 2)
    step = wh.parallelize(loss_fn, opt, **kwargs)
    st = step.init(params, batch, model_state=state)
    losses = []
    for _ in range(2):
        st, metrics = step(st, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max(jax.tree.leaves(jax.tree.map(rel_err, step.params(st), ref_params))) < 1e-4
    assert max(jax.tree.leaves(jax.tree.map(rel_err, st.model_state, ref_state))) < 1e-4


def test_convolution_gradients_under_gradient_accumulation():
    """A convolution's kernel gradient kept per data shard (under vmap) is a feature-grouped
    convolution that XLA's SPMD partitioner computes wrongly on sharded operands; the plan sums the
    gradients once per micro-batch instead, and says why."""
    rng = np.random.default_rng(0)
    batch = {"x": jax.numpy.asarray(rng.standard_normal((B, 8, 8, 3)), np.float32),
             "y": jax.numpy.asarray(rng.standard_normal((B, 4, 4, 5)), np.float32)}
    params = {"k": jax.numpy.asarray(rng.standard_normal((2, 2, 3, 5)) * 0.3, np.float32)}

    def loss_fn(p, b):
        h = jax.lax.conv_general_dilated(b["x"], p["k"], (2, 2), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jax.numpy.mean((h - b["y"]) ** 2)

    plan = wh.plan(loss_fn, params, batch, None, config=wh.Config(num_micro_batch=2))
    _, grads = plan.jitted()(jax.device_put(params, plan.param_shardings), jax.device_put(batch, plan.batch_shardings))
    assert rel_err(grads["k"], jax.grad(loss_fn)(params, batch)["k"]) < 1e-5
    assert any("once per micro-batch" in line and "convolution" in line for line in plan.couplings)
