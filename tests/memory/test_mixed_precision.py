"""Mixed precision (amp bf16/fp16 with dynamic loss scaling) and half-precision
gradient communication (comm_dtype), on replicate, hybrid (split head), pipeline and uneven plans.

Tolerances. A half-precision run cannot match fp32 to 1e-5: every activation and gradient is
rounded to the half dtype's mantissa, unit roundoff u = 2**-8 for bf16 (8 significant bits) and
2**-11 for fp16. These tests train with SGD, whose step is lr * gradient, so the distance the
parameters move carries the gradient's relative error, a few u; Adam instead turns the rounding of
near-zero gradients into lr-sized steps (measured: 8.7e-2 on a zero-initialised bias). Parameters
are compared by the distance they moved, |(p - p0) - (ref - p0)| / |ref - p0| per leaf, against
tol = 8u (bf16 3.1e-2, fp16 3.9e-3). Measured worst cases over the four models below: bf16 1.5e-2,
fp16 9.4e-4, bf16 gradient all-reduce 1.8e-3; the single-device reference doing the same casts is
as far from fp32 (bf16 1.5e-2), so what is left is rounding, not the plan. A wrong plan (a missing
1/n, a gradient summed twice) moves the parameters by a multiple of the right distance: error >= 1.
"""
import glob
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import whalex as wh
from conftest import HETERO, reference_train, rel_err, whalex_train
from lowering.test_pipeline import _plain, _two_stage
from support.hlo import collectives
from support.models import flax_model, plain_model
from whalex.precision.amp import AmpLoss
from whalex.precision.loss_scale import INITIAL_SCALE, LossScale

TOL = {"bf16": 8 * 2.0 ** -8, "fp16": 8 * 2.0 ** -11}
SGD = optax.sgd(0.1)


def moved_err(got, ref, start) -> float:
    """Worst leaf error of the distance trained: max|(got-start)-(ref-start)| / max|ref-start|."""
    errs = jax.tree.map(lambda g, r, s: rel_err(np.asarray(g) - np.asarray(s), np.asarray(r) - np.asarray(s)),
                        got, ref, start)
    return max(jax.tree.leaves(errs))


def check_half(loss_fn, params, batch, dtype, steps=5, **kw):
    """Train with whalex under `Config(amp=dtype)` (or kw's config) and compare with fp32 and with
    the same casts on one device, both within 8u of the distance moved."""
    config = kw.pop("config", wh.Config(amp=dtype))
    _, fp32 = reference_train(loss_fn, params, batch, SGD, steps)
    same_losses, same = reference_train(AmpLoss(loss_fn, dtype, False), params, batch, SGD, steps)
    losses, state, step = whalex_train(loss_fn, params, batch, SGD, steps, config=config, **kw)
    got = step.params(state)
    assert moved_err(got, same, params) < TOL[dtype]
    assert moved_err(got, fp32, params) < TOL[dtype]
    np.testing.assert_allclose(losses, same_losses, rtol=TOL[dtype])
    assert max(jax.tree.leaves(jax.tree.map(rel_err, fp32, params))) > 1e-3        # training moved them
    return step, state


def float_dtypes(tree) -> set:
    return {str(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


# ------------------------------------------------------------------------------------------ amp
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
@pytest.mark.parametrize("builder,strategy", [(flax_model, "dp"), (flax_model, "hybrid"), (plain_model, "hybrid")])
def test_amp_trains_like_fp32_with_fp32_master_weights(builder, strategy, amp):
    loss_fn, params, batch = builder(strategy, "ctx")
    step, state = check_half(loss_fn, params, batch, amp)
    assert float_dtypes(state.params) == {"float32"} and float_dtypes(state.opt_state) <= {"float32"}
    plan = step.plan
    half = {"bf16": "bfloat16", "fp16": "float16"}[amp]
    dots = [e for e in plan.report.captured.jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and {str(e.outvars[0].aval.dtype) for e in dots} == {half}       # compute is half precision
    # the casts joined the TaskGraphs that read each value: same TaskGraphs as the fp32 plan
    plain = wh.plan(loss_fn, params, batch, SGD)
    assert [(t.strategy, t.num_params) for t in plan.task_graphs] == \
        [(t.strategy, t.num_params) for t in plain.task_graphs]
    for t, f in zip(plan.task_graphs, plain.task_graphs):          # FLOPs are counted for half dtypes too
        assert t.flops == pytest.approx(f.flops, rel=0.05)
    assert f"amp {amp}" in plan.summary()


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_pipeline_with_nested_data_parallelism(amp):
    params, batch = _plain()
    step, _ = check_half(_two_stage, params, batch, amp, config=wh.Config(amp=amp, num_micro_batch=4))
    assert step.plan.schedule is not None and step.plan.layout.axis_sizes == (4, 2)
    buffers = step.plan.report.stage_buffers()        # the boundary is half: so are the messages
    assert buffers.message_bytes == 2 * buffers.message_width


def test_amp_on_uneven_heterogeneous_data_parallelism():
    loss_fn, params, batch = plain_model("dp", "ctx")
    step, _ = check_half(loss_fn, params, batch, "fp16", cluster=wh.Cluster(kinds=HETERO))
    assert len(set(step.plan.batch_sizes)) > 1                     # really the uneven program


def test_amp_uneven_split_head_sees_the_parameter_behind_the_cast():
    from balance.test_heterogeneous_balance import _head_model
    loss_fn, params, batch = _head_model()
    step, state = check_half(loss_fn, params, batch, "bf16", cluster=wh.Cluster(kinds=HETERO))
    assert step.plan.balance is not None and step.plan.balance.kind.startswith("classes")
    assert state.stored_params["kernel"].shape == (24, 840)                 # stored padded, uneven class shards


# ------------------------------------------------------------------------------------------ loss scaling
def _overflow_batch(batch):
    return {**batch, "x": batch["x"].at[0, 0].set(1e5)}          # > 65504: inf once cast to fp16


@pytest.mark.parametrize("strategy", ["dp", "hybrid"])
def test_fp16_overflow_skips_the_step_halves_the_scale_and_it_grows_back(strategy):
    loss_fn, params, batch = plain_model(strategy, "ctx")
    step = wh.parallelize(loss_fn, SGD, config=wh.Config(amp="fp16", loss_scale_period=2))
    state = step.init(params, batch)
    assert float(state.loss_scale.scale) == INITIAL_SCALE

    state, m = step(state, batch)                                  # a finite step: trains, scale kept
    assert bool(m["grads_finite"]) and float(state.loss_scale.scale) == INITIAL_SCALE
    assert int(state.loss_scale.good_steps) == 1
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))

    state, m = step(state, _overflow_batch(batch))                 # overflow: skipped, scale halved
    assert not bool(m["grads_finite"])
    after = jax.tree.map(np.asarray, (state.params, state.opt_state))
    jax.tree.map(np.testing.assert_array_equal, after, before)     # params and optimizer state unchanged
    assert float(state.loss_scale.scale) == INITIAL_SCALE / 2 and int(state.loss_scale.good_steps) == 0
    assert float(m["loss_scale"]) == INITIAL_SCALE                 # the scale that step used

    state, m = step(state, batch)                                  # 1 finite step: not yet
    assert float(state.loss_scale.scale) == INITIAL_SCALE / 2
    assert max(jax.tree.leaves(jax.tree.map(rel_err, state.params, before[0]))) > 0   # trains again
    state, m = step(state, batch)                                  # period 2 reached: doubled back
    assert float(state.loss_scale.scale) == INITIAL_SCALE and int(state.loss_scale.good_steps) == 0


def test_fp16_gradient_overflow_with_a_finite_loss_is_skipped():
    """A scale so large that the backward pass overflows fp16 while the forward is finite."""
    loss_fn, params, batch = plain_model("dp", "ctx")
    step = wh.parallelize(loss_fn, SGD, config=wh.Config(amp="fp16"))
    state = step.init(params, batch)
    big = jax.device_put(LossScale(jnp.float32(2.0 ** 40), jnp.int32(0)), state.step.sharding)
    before = jax.tree.map(np.asarray, state.params)
    state, m = step(state.replace(loss_scale=big), batch)
    assert np.isfinite(float(m["loss"])) and not bool(m["grads_finite"])
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), before)
    assert float(state.loss_scale.scale) == 2.0 ** 39


def test_fp16_pipeline_skips_an_overflowing_step():
    params, batch = _plain()
    step = wh.parallelize(_two_stage, SGD, config=wh.Config(amp="fp16", num_micro_batch=4))
    state = step.init(params, batch)
    before = jax.tree.map(np.asarray, state.params)
    state, m = step(state, _overflow_batch(batch))
    assert not bool(m["grads_finite"]) and float(state.loss_scale.scale) == INITIAL_SCALE / 2
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), before)


# ------------------------------------------------------------------------------------------ comm dtype
def partitioned_hlo(lowered) -> str:
    """The HLO right after XLA's SPMD partitioner, where the collectives are created. XLA's CPU
    backend then promotes bf16/fp16 all-reduces to fp32 (all-reduce-promotion: no half-precision
    reductions on CPU), so the final CPU HLO cannot show the dtype a GPU would send."""
    with tempfile.TemporaryDirectory() as d:
        lowered.compile(compiler_options={"xla_dump_to": d, "xla_dump_hlo_pass_re": "spmd-partitioning",
                                          "xla_dump_hlo_as_text": True})
        files = sorted(glob.glob(os.path.join(d, "*after_spmd-partitioning*")))
        assert files, "XLA wrote no HLO after the SPMD partitioner"
        with open(files[-1]) as f:
            return f.read()


def all_reduce_operands(text: str):
    """[(dtype, dims sorted)] of every all-reduce operand result."""
    return [(d, tuple(sorted(s))) for op, shapes in collectives(text) if op == "all-reduce" for d, s in shapes]


def grad_shapes(params) -> set:
    return {tuple(sorted(np.shape(x))) for x in jax.tree.leaves(params) if np.ndim(x)}


@pytest.mark.parametrize("comm", ["bf16", "fp16"])
@pytest.mark.parametrize("builder,strategy", [(flax_model, "dp"), (plain_model, "hybrid")])
def test_comm_dtype_trains_like_fp32(builder, strategy, comm):
    loss_fn, params, batch = builder(strategy, "ctx")
    _, fp32 = reference_train(loss_fn, params, batch, SGD, 5)
    _, state, step = whalex_train(loss_fn, params, batch, SGD, 5, config=wh.Config(comm_dtype=comm))
    assert moved_err(step.params(state), fp32, params) < TOL[comm]
    assert float_dtypes(state.params) == {"float32"}


def nested_hybrid():
    """Backbone replicate(8), head split(4): mesh data=2 x model=4, the head's gradients are
    all-reduced over 'data' (nested data parallelism) inside a partially manual shard_map."""
    from support.models import _backbone, _head, data, plain_params

    def loss_fn(p, b):
        with wh.replicate(8):
            h = _backbone(p, b["x"])
        with wh.split(4):
            return _head(p, h, b["y"])

    return loss_fn, plain_params(), data()


@pytest.mark.parametrize("strategy", ["dp", "hybrid", "nested"])
def test_gradient_all_reduces_are_bf16_in_the_partitioned_hlo(strategy):
    loss_fn, params, batch = nested_hybrid() if strategy == "nested" else plain_model(strategy, "ctx")
    base = all_reduce_operands(partitioned_hlo(wh.plan(loss_fn, params, batch, SGD).lowered()))
    plan = wh.plan(loss_fn, params, batch, SGD, config=wh.Config(comm_dtype="bf16"))
    half = all_reduce_operands(partitioned_hlo(plan.lowered()))
    shards = {tuple(sorted(sh.shard_shape(np.shape(x)))) for x, sh in                # per-device gradient shapes
              zip(jax.tree.leaves(params), jax.tree.leaves(plan.storage.param_shardings)) if np.ndim(x)}
    synced = {s for d, s in base if s in shards}                             # gradients all-reduced in fp32
    assert synced and {d for d, s in base if s in synced} == {"f32"}
    assert {s for d, s in half if d == "bf16"} == synced                      # now all in bf16 ...
    assert not [s for d, s in half if d == "f32" and s in synced]             # ... and no fp32 one is left
    line = [ln for ln in plan.summary().splitlines() if ln.startswith("gradient all-reduce in bf16")]
    done = line[0].split(";")[0]
    assert "TG0" in done and ("TG1" in done) == (strategy != "hybrid")      # hybrid: the head is split 8 ways
    if strategy == "nested":
        _, fp32 = reference_train(loss_fn, params, batch, SGD, 3)
        _, state, step = whalex_train(loss_fn, params, batch, SGD, 3, config=wh.Config(comm_dtype="bf16"))
        assert moved_err(step.params(state), fp32, params) < TOL["bf16"]


def test_xla_already_buckets_the_gradient_all_reduces():
    """XLA's all-reduce combiner fuses the per-parameter all-reduces into one: nothing to bucket."""
    loss_fn, params, batch = flax_model("dp", "ctx")
    for config in (wh.Config(), wh.Config(comm_dtype="bf16")):
        text = wh.plan(loss_fn, params, batch, SGD, config=config).lowered().compile().as_text()
        ops = [shapes for op, shapes in collectives(text) if op == "all-reduce"]
        grads = [s for shapes in ops for _, s in shapes if tuple(sorted(s)) in grad_shapes(params)]
        assert len(grads) == len(jax.tree.leaves(params)) == 6
        assert len(ops) <= 2 < len(grads)                 # 6 gradients (+ the loss) in at most 2 all-reduces


def test_comm_dtype_pipeline_and_uneven_psum_in_bf16():
    params, batch = _plain()
    plan = wh.plan(_two_stage, params, batch, SGD, config=wh.Config(comm_dtype="bf16", num_micro_batch=4))
    ops = all_reduce_operands(partitioned_hlo(plan.lowered()))
    width = plan.report.stage_buffers().param_width
    assert ("bf16", (width,)) in ops and ("f32", (width,)) not in ops           # the stage gradient row
    _, fp32 = reference_train(_two_stage, params, batch, SGD, 3)
    _, state, step = whalex_train(_two_stage, params, batch, SGD, 3,
                                  config=wh.Config(comm_dtype="bf16", num_micro_batch=4))
    assert moved_err(step.params(state), fp32, params) < TOL["bf16"]

    loss_fn, params, batch = plain_model("dp", "ctx")
    _, fp32 = reference_train(loss_fn, params, batch, SGD, 3)
    _, state, step = whalex_train(loss_fn, params, batch, SGD, 3, config=wh.Config(comm_dtype="bf16"),
                                  cluster=wh.Cluster(kinds=HETERO))
    assert len(set(step.plan.batch_sizes)) > 1
    assert moved_err(step.params(state), fp32, params) < TOL["bf16"]
    ops = all_reduce_operands(partitioned_hlo(step.plan.lowered()))
    n = sum(x.size for x in jax.tree.leaves(params))
    assert ("bf16", (n,)) in ops and ("f32", (n,)) not in ops          # one fused gradient buffer, in bf16
    assert not [s for d, s in ops if d == "f32" and s in grad_shapes(params)]
