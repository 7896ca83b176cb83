"""Remat ("full", a jax.checkpoint_policies name, "auto" under a memory budget) and
activation offload. Every option trains to the plain plan's parameters (rtol 1e-5: recomputation
repeats the same float operations); remat="auto" is checked on XLA's compiled memory, not on a
prediction; communication is never recomputed (the compiled HLO has the same collectives)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import whalex as wh
from conftest import HETERO, adam, assert_matches, reference_train, rel_err, whalex_train
from lowering.test_pipeline import _compare, _plain, _two_stage
from memory.test_mixed_precision import SGD, TOL, moved_err
from support.hlo import collectives
from support.models import flax_model, plain_model
from whalex.precision.amp import AmpLoss

B, D, H, C = 2048, 32, 128, 256


def wide_model():
    """Activations dominate memory: two replicate TaskGraphs of two tanh layers and a split head."""
    ks = jax.random.split(jax.random.key(0), 8)
    params = {"w0": jax.random.normal(ks[0], (D, H)) / D ** .5, "w1": jax.random.normal(ks[1], (H, H)) / H ** .5,
              "w2": jax.random.normal(ks[2], (H, H)) / H ** .5, "w3": jax.random.normal(ks[3], (H, H)) / H ** .5,
              "wh": jax.random.normal(ks[4], (H, C)) / H ** .5, "bh": jax.random.normal(ks[5], (C,)) * .1}
    batch = {"x": jax.random.normal(ks[6], (B, D)), "y": jax.random.randint(ks[7], (B,), 0, C)}

    def loss_fn(p, b):
        with wh.replicate(8):
            h = jnp.tanh(jnp.tanh(b["x"] @ p["w0"]) @ p["w1"])
        with wh.replicate(8):
            h = jnp.tanh(jnp.tanh(h @ p["w2"]) @ p["w3"])
        with wh.split(8):
            return optax.softmax_cross_entropy_with_integer_labels(h @ p["wh"] + p["bh"], b["y"]).mean()

    return loss_fn, params, batch


def used(plan) -> float:
    """Per-device bytes of the compiled step as it runs, state donated: arguments + outputs + temp
    - aliased (XLA memory_analysis; the undonated compile parks gradients in its output buffers)."""
    m = plan.jitted(donate=True).trace(*plan.functions.abstract_args()).lower().compile().memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def collective_operands(plan):
    """Sorted (op, dims) of every collective operand in the compiled step."""
    text = plan.lowered().compile().as_text()
    return sorted((op, tuple(sorted(s))) for op, shapes in collectives(text) for _, s in shapes)


@pytest.mark.parametrize("remat", ["full", "dots_saveable"])
@pytest.mark.parametrize("builder,strategy", [(flax_model, "dp"), (flax_model, "hybrid"), (plain_model, "split")])
def test_remat_trains_to_the_plain_parameters(builder, strategy, remat):
    loss_fn, params, batch = builder(strategy, "ctx")
    step, _ = assert_matches(loss_fn, params, batch, steps=5, config=wh.Config(remat=remat))
    assert f"remat ({remat}): TG0 {remat}" in step.plan.summary()
    text = str(step.plan.functions.traced_step().jaxpr)
    assert "remat2" in text or "checkpoint" in text                          # really rematerialized


def test_full_remat_saves_compiled_memory_and_recomputes_no_communication():
    loss_fn, params, batch = wide_model()
    plain = wh.plan(loss_fn, params, batch, SGD)
    full = wh.plan(loss_fn, params, batch, SGD, config=wh.Config(remat="full"))
    assert plain.compiled_memory()["temp_size_in_bytes"] > 1.1 * full.compiled_memory()["temp_size_in_bytes"]
    # the same collectives, operand for operand: the CE reductions over split classes and the bridge
    # gather into the head are saved (checkpoint_name COMM), not recomputed
    assert collective_operands(full) == collective_operands(plain)


def test_each_remat_segment_finishes_its_backward_before_the_next_starts():
    """`remat.in_order`: a segment's recomputation waits for its cotangent, and its whole gradient
    (inputs and weights) is produced before the previous segment's backward can start: two
    optimization barriers per rematerialized segment beside the checkpoint's own, in the step's
    program (XLA:GPU's scheduler otherwise defers weight-gradient matmuls, keeping every segment's
    recomputed activations live: tests/gpu_compile/test_remat_many_gpus.py)."""
    loss_fn, params, batch = wide_model()
    plan = wh.plan(loss_fn, params, batch, SGD, config=wh.Config(remat="dots_saveable"))
    barriers = plan.lower().count("optimization_barrier")
    segments = sum(level is not None for level in plan.report.remat.levels)
    assert segments == 3 and barriers >= 3 * segments           # the checkpoint's, before and after


def test_remat_auto_fits_a_budget_the_plain_plan_exceeds_and_trains_the_same():
    """remat="auto" decides per layer from what JAX keeps for the backward pass (a figure true on every
    backend), so it fits on CPU a budget of half the no-remat step's state + saved activations."""
    loss_fn, params, batch = wide_model()
    full = wh.plan(loss_fn, params, batch, SGD, config=wh.Config(remat="full")).report.remat
    budget = (full.saved + 0.5 * (full.baseline - full.saved)) + _state(loss_fn, params, batch)
    config = wh.Config(remat="auto", memory_budget=budget)
    plan = wh.plan(loss_fn, params, batch, SGD, config=config)
    r = plan.report.remat
    assert r.state + r.baseline > budget >= r.state + r.saved                  # needed remat, and fits
    assert any(r.segment_levels) and not all(r.segment_levels)                 # some layers, not all
    assert "remat (auto): per layer" in plan.summary() and "budget" in plan.summary()
    _, ref = reference_train(loss_fn, params, batch, SGD, 2)
    _, state, step = whalex_train(loss_fn, params, batch, SGD, 2, config=config)
    assert step.plan.report.remat.segment_levels == r.segment_levels
    assert max(jax.tree.leaves(jax.tree.map(rel_err, step.params(state), ref))) < 1e-5


def _state(loss_fn, params, batch) -> float:
    return max(m.state for m in wh.plan(loss_fn, params, batch, SGD).memory)


def test_remat_auto_keeps_everything_when_the_budget_allows_and_refuses_an_impossible_one():
    loss_fn, params, batch = plain_model("hybrid", "ctx")
    plan = wh.plan(loss_fn, params, batch, adam(), config=wh.Config(remat="auto"))     # the device's memory
    assert not any(plan.report.remat.segment_levels) and plan.report.remat.budget == 16 * 2 ** 30
    with pytest.raises(wh.PlanError, match="cannot fit the step in memory_budget"):
        wh.plan(loss_fn, params, batch, adam(), config=wh.Config(remat="auto", memory_budget=4096))
    abstract = wh.plan(loss_fn, params, batch, adam(), config=wh.Config(remat="auto"),   # no compile needed
                       cluster=wh.Cluster.abstract(["V100-32GB"] * 8))
    assert abstract.report.remat.budget == 32 * 2 ** 30


def test_remat_policy_lowers_on_an_abstract_cluster():
    loss_fn, params, batch = plain_model("hybrid", "ctx")
    plan = wh.plan(loss_fn, params, batch, adam(), config=wh.Config(remat="full"),
                   cluster=wh.Cluster.abstract(["V100-32GB"] * 8))
    assert "optimization_barrier" in plan.lower()                             # jax.checkpoint's fence


def test_pipelines_accept_full_remat_and_refuse_other_policies():
    params, batch = _plain()
    _compare(_two_stage, params, batch, wh.Config(num_micro_batch=4, remat="full"))
    for bad in (wh.Config(num_micro_batch=4, remat="dots_saveable"), wh.Config(num_micro_batch=4, remat="auto"),
                wh.Config(num_micro_batch=4, offload="activations")):
        with pytest.raises(wh.PlanError, match="recomputes each stage's forward from its stashed input"):
            wh.plan(_two_stage, params, batch, adam(), config=bad)


def test_remat_on_uneven_heterogeneous_data_parallelism():
    loss_fn, params, batch = plain_model("dp", "ctx")
    step, _ = assert_matches(loss_fn, params, batch, steps=5, config=wh.Config(remat="full"),
                             cluster=wh.Cluster(kinds=HETERO))
    assert len(set(step.plan.batch_sizes)) > 1


@pytest.mark.parametrize("remat", [None, "full"])
def test_activation_offload_moves_boundary_activations_to_pinned_host(remat):
    loss_fn, params, batch = plain_model("hybrid", "ctx")
    config = wh.Config(offload="activations", remat=remat)
    step, _ = assert_matches(loss_fn, params, batch, steps=5, config=config)
    jaxpr = str(step.plan.functions.traced_step().jaxpr)
    # the backbone's output (batch 32 x hidden 24 on the host) is stored to pinned host memory ...
    assert "MemorySpace.Host" in jaxpr and "f32<host>[32,24]" in jaxpr
    assert "offloaded to pinned_host" in step.plan.summary()
    plain = str(wh.plan(loss_fn, params, batch, adam()).functions.traced_step().jaxpr)
    assert "MemorySpace.Host" not in plain                                      # ... and only with the option


def test_offload_activations_combines_with_offloaded_optimizer_state():
    loss_fn, params, batch = plain_model("dp", "ctx")
    step, state = assert_matches(loss_fn, params, batch, steps=3,
                                 config=wh.Config(offload=("opt_state", "activations"), remat="full"))
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)} == {"pinned_host"}


def test_zero3_with_auto_remat_and_bf16_amp():
    """ZeRO 3 + remat="auto" + amp="bf16" fits its budget (state + what the
    backward pass keeps) and trains like fp32 within bf16's tolerance (see test_amp)."""
    loss_fn, params, batch = wide_model()
    base = wh.Config(zero_level=3, amp="bf16")
    full = wh.plan(loss_fn, params, batch, SGD, config=base.replace(remat="full")).report.remat
    state = max(m.state for m in wh.plan(loss_fn, params, batch, SGD, config=base).memory)
    budget = state + (full.saved + full.baseline) / 2
    config = base.replace(remat="auto", memory_budget=budget)
    plan = wh.plan(loss_fn, params, batch, SGD, config=config)
    r = plan.report.remat
    assert r.state + r.baseline > budget >= r.state + r.saved and any(r.segment_levels)
    assert plan.report.memory_options.zero_level == 3
    _, fp32 = reference_train(loss_fn, params, batch, SGD, 3)
    _, same = reference_train(AmpLoss(loss_fn, "bf16", False), params, batch, SGD, 3)
    _, state, step = whalex_train(loss_fn, params, batch, SGD, 3, config=config)
    got = step.params(state)
    assert moved_err(got, fp32, params) < TOL["bf16"] and moved_err(got, same, params) < TOL["bf16"]
    assert {np.dtype(x.dtype) for x in jax.tree.leaves(state.params)} == {np.dtype("float32")}
