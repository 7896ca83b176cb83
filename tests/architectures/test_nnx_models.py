"""Flax NNX models after public architectures (tests/support/public_models: nnx_llama, nnx_vit, nnx_t5,
nnx_resnet) trained through whalex's NNX path under the suite's plan kinds, against plain NNX
training on one device: the same losses, nnx.Params and BatchNorm statistics. BatchNorm's statistics couple the samples,
so plans that evaluate the loss in parts refuse the ResNet by name."""
import functools

import jax
import numpy as np
import pytest
from flax import nnx

import whalex as wh
from conftest import rel_err
from support.public_models import annotate, nnx_llama, nnx_resnet, nnx_t5, nnx_vit, plans
from support.public_models.plans import PLANS, Plan

FAMILIES = {"llama": nnx_llama.problem, "vit": nnx_vit.problem, "t5": nnx_t5.problem, "resnet": nnx_resnet.problem}
STEPS = 2


@functools.cache
def reference(family, batch, optimizer):
    """Plain NNX on one device (annotations are inert there): (losses, pure Params, pure BatchStats)."""
    make_model, loss_fn, data = FAMILIES[family](batch=batch)
    model = make_model()
    opt = nnx.Optimizer(model, plans.optimizer(optimizer), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, b):
        loss, grads = nnx.value_and_grad(loss_fn)(model, b)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, data)) for _ in range(STEPS)]
    return losses, _pure(model, nnx.Param), _pure(model, nnx.BatchStat)


def _pure(model, kind):
    return jax.device_get(nnx.to_pure_dict(nnx.state(model, kind)))


def _train(family, p):
    make_model, loss_fn, data = FAMILIES[family](batch=p.batch, where=p.where)
    step = wh.parallelize(loss_fn, p.make_optimizer(), config=p.config, cluster=p.cluster())
    state = step.init(make_model(), data)
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, data)
        losses.append(float(metrics["loss"]))
    return step, step.model(state), losses


def _assert_close(got, want):
    errs = jax.tree.map(rel_err, got, want)
    assert not jax.tree.leaves(errs) or max(jax.tree.leaves(errs)) < 1e-4, errs


MATRIX = [("llama", "split"), ("llama", "1f1b"), ("llama", "3d"), ("llama", "hetero"), ("llama", "hetero hybrid"),
          ("llama", "zero 3"), ("llama", "remat full"), ("vit", "split"), ("vit", "gpipe"), ("vit", "hetero"),
          ("t5", "hybrid"), ("t5", "micro-batches"), ("resnet", "hybrid"), ("resnet", "zero 1")]


@pytest.mark.parametrize("family,plan", MATRIX)
def test_nnx_model_trains_as_one_device(family, plan):
    p = PLANS[plan]
    ref_losses, ref_params, ref_stats = reference(family, p.batch, p.optimizer)
    step, trained, losses = _train(family, p)
    assert step.plan.program_kind == p.program
    if p.hetero:                        # rows in proportion to speed (an NNX model's empty model state included)
        sizes = step.plan.batch_sizes
        assert sizes[0] > sizes[-1] > 0 and sum(sizes) == p.batch
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_close(_pure(trained, nnx.Param), ref_params)
    _assert_close(_pure(trained, nnx.BatchStat), ref_stats)
    initial = _pure(FAMILIES[family](batch=p.batch)[0](), nnx.Param)
    assert max(jax.tree.leaves(jax.tree.map(rel_err, ref_params, initial))) > 1e-3    # training moved them


IN_PARTS = {"pipeline": Plan(annotate.none, wh.Config(auto_parallel=True, num_task_graph=2, num_micro_batch=2), 8,
                             "sgd", "PipelineProgram"),
            "hetero": PLANS["hetero"], "micro-batches": PLANS["micro-batches"]}


@pytest.mark.parametrize("plan", list(IN_PARTS))
def test_nnx_resnet_in_parts_is_refused_by_its_batchnorm(plan):
    p = IN_PARTS[plan]
    make_model, loss_fn, data = nnx_resnet.problem(batch=p.batch, where=p.where)
    step = wh.parallelize(loss_fn, p.make_optimizer(), config=p.config, cluster=p.cluster())
    with pytest.raises(wh.PlanError, match=r"(?s)BatchNorm.*statistic.*batch_coupling='per_part'"):
        step.init(make_model(), data)
