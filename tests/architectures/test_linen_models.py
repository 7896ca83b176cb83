"""Linen models after public architectures (tests/support/public_models) train exactly as one device.

Under the plans that need no annotations (data parallel, uneven, gradient accumulation, ZeRO 2, an
auto_parallel pipeline) the Llama, the ViT and the ResNet train as one device, or are refused with a
named whalex error (BatchNorm statistics on plans that evaluate the loss in parts). Under the plan
kinds that annotate them (split, Whale's hybrid, 1F1B and GPipe pipelines, 3D) and the plan options
(heterogeneous balance, ZeRO 1 and 3, remat, micro-batches), the Llama-style decoder and the T5-style
encoder-decoder train, each at the smallest batch the plan accepts, against single-device training
with SGD and Adam; a padded batch's token-weighted loss throughout; a checkpoint saved under one
plan and restored under another; T5's dropout in a pipeline."""
import functools

import jax
import numpy as np
import optax
import pytest

import whalex as wh
from conftest import HETERO, adam, assert_matches, reference_train, rel_err, whalex_train
from support.public_models import llama, resnet, t5, vit
from support.public_models.plans import PLANS, optimizer

B = 16

# plan kind -> (parallelize keywords, the program kind it builds)
UNANNOTATED_PLANS = {
    "data parallel": (dict(), "Program"),
    "uneven data parallel": (dict(cluster=wh.Cluster(kinds=HETERO)), "UnevenProgram"),
    "gradient accumulation": (dict(config=wh.Config(num_micro_batch=2)), "Program"),
    "zero 2": (dict(config=wh.Config(zero_level=2)), "UnevenProgram"),
    "pipeline": (dict(config=wh.Config(auto_parallel=True, num_task_graph=2, num_micro_batch=4)), "PipelineProgram"),
}
UNANNOTATED_MODELS = {"llama": llama.problem, "vit": vit.problem}


@pytest.mark.parametrize("plan", list(UNANNOTATED_PLANS))
@pytest.mark.parametrize("model", list(UNANNOTATED_MODELS))
def test_public_model_trains_as_one_device(model, plan):
    loss_fn, params, batch = UNANNOTATED_MODELS[model](batch=B)
    kwargs, kind = UNANNOTATED_PLANS[plan]
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


@pytest.mark.parametrize("plan", list(UNANNOTATED_PLANS))
def test_resnet_trains_as_one_device_or_names_its_batchnorm(plan):
    loss_fn, params, state, batch = resnet.problem(batch=B)
    kwargs, _ = UNANNOTATED_PLANS[plan]
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
    storage = plan.storage
    placed = jax.device_put(params, storage.param_shardings), jax.device_put(batch, storage.batch_shardings)
    _, grads = plan.jitted()(*placed)
    assert rel_err(grads["k"], jax.grad(loss_fn)(params, batch)["k"]) < 1e-5
    assert any("once per micro-batch" in line and "convolution" in line for line in plan.couplings)


# ---------------------------------------------------------------- the plans that annotate the models

MODELS = {"llama": llama.problem, "t5": t5.problem}
OTHER = {"sgd": "adam", "adam": "sgd"}


@functools.cache
def reference(model, batch, opt, steps):
    """Single-device training of the un-annotated model (annotations are inert outside whalex, so
    one reference serves every plan): (losses, params, initial params)."""
    loss_fn, params, data = MODELS[model](batch=batch)
    return reference_train(loss_fn, params, data, optimizer(opt), steps) + (params,)


# the unannotated plans above train the Llama under the same programs already (uneven data parallel on
# declared kinds, gradient accumulation)
COVERED = {("llama", "hetero"), ("llama", "micro-batches")}


@pytest.mark.parametrize("model,plan", [(m, p) for m in MODELS for p in PLANS if (m, p) not in COVERED])
def test_plan_trains_as_one_device(model, plan):
    p = PLANS[plan]
    opt = p.optimizer if model == "llama" else OTHER[p.optimizer]     # each plan with SGD and with Adam
    ref_losses, ref_params, initial = reference(model, p.batch, opt, 2)
    loss_fn, params, data = MODELS[model](batch=p.batch, where=p.where)
    losses, state, step = whalex_train(loss_fn, params, data, optimizer(opt), 2, config=p.config,
                                       cluster=p.cluster())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    errs = jax.tree.map(rel_err, step.params(state), ref_params)
    assert max(jax.tree.leaves(errs)) < 1e-4, errs
    assert max(jax.tree.leaves(jax.tree.map(rel_err, ref_params, initial))) > 1e-3     # training moved them
    assert step.plan.program_kind == p.program
    if plan in ("split", "hybrid", "3d", "hetero hybrid"):
        assert any("split" in t.strategy for t in step.plan.task_graphs)
    if p.hetero:
        sizes = step.plan.batch_sizes
        assert sizes[0] > sizes[-1] > 0 and sum(sizes) == p.batch


@pytest.mark.parametrize("model,saved_under,restored_under", [("t5", "zero 1", "split"), ("llama", "gpipe", "hybrid")])
def test_checkpoint_saved_under_one_plan_trains_on_under_another(model, saved_under, restored_under, tmp_path):
    """Two Adam steps under one plan, saved; restored under another plan (its own annotations and
    layout), two more steps: equal to four steps on one device, optimizer state included."""
    first, then = PLANS[saved_under], PLANS[restored_under]
    batch = max(first.batch, then.batch)
    loss_a, params, data = MODELS[model](batch=batch, where=first.where)
    loss_b = MODELS[model](batch=batch, where=then.where)[0]
    ref_losses, ref_params, _ = reference(model, batch, "adam", 4)
    step = wh.parallelize(loss_a, adam(), config=first.config, cluster=first.cluster())
    state = step.init(params, data)
    for _ in range(2):
        state, _ = step(state, data)
    with wh.CheckpointManager(tmp_path) as manager:
        manager.save(step, state)
        manager.wait_until_finished()
        step = wh.parallelize(loss_b, adam(), config=then.config, cluster=then.cluster())
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        state = manager.restore(step, abstract, data)
    assert int(state.step) == 2 and step.plan.program_kind == then.program
    losses = []
    for _ in range(2):
        state, metrics = step(state, data)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses[2:], rtol=1e-5)
    errs = jax.tree.map(rel_err, step.params(state), ref_params)
    assert max(jax.tree.leaves(errs)) < 1e-4, errs


def test_zero_inside_a_3d_pipeline_is_refused_by_name():
    """ZeRO's shards are not built for pipelines with split TaskGraphs inside the stages: refused
    at planning time, naming both ways out."""
    p = PLANS["3d"]
    loss_fn, params, data = t5.problem(batch=p.batch, where=p.where)
    config = wh.Config(auto_parallel=True, num_task_graph=2, num_micro_batch=2, zero_level=1)
    with pytest.raises(wh.PlanError, match=r"ZeRO and offload are not built for pipelines with split TaskGraphs.*"
                                           r"drop Config\(zero=...\)/offload, or the split annotations"):
        wh.plan(loss_fn, params, data, adam(), config=config)


def test_dropout_in_a_pipeline_draws_one_devices_masks():
    """T5's dropout under 1F1B (one-row micro-batches on 4 pipeline replicas): each part draws its
    rows of the whole-batch masks, so training equals one device given the same keys."""
    p = PLANS["1f1b"]
    loss_fn, params, data = t5.problem(batch=p.batch, where=p.where, dropout=0.2)
    opt, key = optimizer("sgd"), jax.random.key(5)
    ref_params, opt_state, ref_losses = params, opt.init(params), []

    @jax.jit
    def ref_step(params, opt_state, key):
        loss, grads = jax.value_and_grad(t5.problem(batch=p.batch, dropout=0.2)[0])(params, data, key)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = key
    for _ in range(2):
        rng, k = jax.random.split(rng)                # the key a whalex step hands the loss
        ref_params, opt_state, loss = ref_step(ref_params, opt_state, k)
        ref_losses.append(float(loss))
    step = wh.parallelize(loss_fn, opt, config=p.config)
    state = step.init(params, data, rng=key)
    losses = []
    for _ in range(2):
        state, metrics = step(state, data)
        losses.append(float(metrics["loss"]))
    assert step.plan.program_kind == "PipelineProgram"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    errs = jax.tree.map(rel_err, step.params(state), ref_params)
    assert max(jax.tree.leaves(errs)) < 1e-4, errs
    nodrop = reference("t5", p.batch, "sgd", 2)[0]
    assert abs(losses[0] - nodrop[0]) > 1e-4          # the masks changed the loss
