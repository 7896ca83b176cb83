"""The MoE layer (routing rule, dense equivalence) and expert parallelism under split."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import whalex as wh
from conftest import adam, assert_matches, rel_err
from support.hlo import collectives, shapes_of

D_IN, D, H = 10, 12, 24


# ---------------------------------------------------------------- routing rule and dense reference

def _rule(probs, k, cap):
    """The capacity rule written as loops: choice-major, token order, first come first served."""
    g_, t_, e_ = probs.shape
    expert = np.argsort(-probs, axis=-1, kind="stable")[..., :k]
    keep = np.zeros((g_, t_, k), bool)
    pos = np.zeros((g_, t_, k), int)
    for g in range(g_):
        counts = np.zeros(e_, int)
        for j in range(k):
            for t in range(t_):
                e = expert[g, t, j]
                if counts[e] < cap:
                    keep[g, t, j], pos[g, t, j] = True, counts[e]
                    counts[e] += 1
    return expert, keep, pos


@pytest.mark.parametrize("k", [1, 2])
def test_dropped_tokens_are_exactly_those_the_rule_says(k):
    logits = jax.random.normal(jax.random.key(k), (3, 16, 4)) * 2.0
    cap = wh.moe.capacity(16, 4, k, 0.5)          # tight: many tokens overflow
    r = wh.moe.top_k_gating(logits, k, cap)
    expert, keep, pos = _rule(np.asarray(jax.nn.softmax(logits, -1)), k, cap)
    np.testing.assert_array_equal(np.asarray(r.expert), expert)
    np.testing.assert_array_equal(np.asarray(r.keep), keep)
    np.testing.assert_array_equal(np.asarray(r.position)[keep], pos[keep])
    assert 0 < keep.sum() < keep.size                # some kept, some dropped
    assert np.all(np.asarray(r.gate)[~keep] == 0)


def _dense_reference(layer_params, x, k, activation=jax.nn.gelu):
    """Every expert on every token (a loop over experts), weighted by the top-k gates: no capacity."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), layer_params)
    xs = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    logits = xs @ p["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    gates = np.take_along_axis(probs, top, -1)
    if k > 1:
        gates = gates / gates.sum(-1, keepdims=True)
    y = np.zeros_like(xs)
    for e in range(p["router"].shape[1]):
        out = np.asarray(activation(xs @ p["w_in"][e] + p["b_in"][e])) @ p["w_out"][e] + p["b_out"][e]
        weight = (gates * (top == e)).sum(-1, keepdims=True)
        y += weight * out
    return y.reshape(x.shape)


@pytest.mark.parametrize("k", [1, 2])
def test_dropless_matches_dense_loop_over_experts(k):
    layer = wh.moe.MoE(num_experts=4, hidden=H, k=k, capacity_factor=None, bias_init=nn.initializers.normal(0.1))
    x = jax.random.normal(jax.random.key(0), (3, 8, D))
    params = layer.init(jax.random.key(1), x)["params"]
    y = layer.apply({"params": params}, x)
    assert rel_err(y, _dense_reference(params, x, k)) < 1e-5


def test_capacity_drops_change_the_output_only_for_dropped_tokens():
    x = jax.random.normal(jax.random.key(0), (2, 16, D))
    full = wh.moe.MoE(num_experts=4, hidden=H, k=1, capacity_factor=None)
    tight = wh.moe.MoE(num_experts=4, hidden=H, k=1, capacity_factor=0.5)
    params = full.init(jax.random.key(1), x)["params"]
    y_full, y_tight = full.apply({"params": params}, x), tight.apply({"params": params}, x)
    r = wh.moe.top_k_gating(x.reshape(2, 16, D) @ params["router"], 1, wh.moe.capacity(16, 4, 1, 0.5))
    dropped = ~np.asarray(r.keep[..., 0]).reshape(2, 16)
    assert dropped.any() and (~dropped).any()
    np.testing.assert_allclose(np.asarray(y_tight)[~dropped], np.asarray(y_full)[~dropped], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(y_tight)[dropped], 0.0)


def test_aux_and_z_loss_values():
    logits = jnp.zeros((1, 8, 4))                   # uniform router: balanced, aux = 1, z = log(4)^2
    r = wh.moe.top_k_gating(logits, 1, 8)
    assert abs(float(r.aux_loss) - 1.0) < 1e-6
    assert abs(float(r.z_loss) - np.log(4.0) ** 2) < 1e-5
    skew = jnp.zeros((1, 8, 4)).at[..., 0].set(5.0)   # everything to expert 0: aux near experts
    assert float(wh.moe.top_k_gating(skew, 1, 8).aux_loss) > 3.5


def test_bad_group_size_is_refused():
    layer = wh.moe.MoE(num_experts=4, hidden=H, group_size=5)
    with pytest.raises(ValueError, match="group_size=5 must divide the 8 tokens"):
        layer.init(jax.random.key(0), jnp.zeros((2, 8, D)))


# ---------------------------------------------------------------- expert parallelism (Example 5)

class Block(nn.Module):
    experts: int = 8
    k: int = 2
    split: int | None = 8
    capacity_factor: float | None = 1.0

    @nn.compact
    def __call__(self, x):
        h = nn.tanh(nn.Dense(D)(x))
        moe = wh.moe.MoE(num_experts=self.experts, hidden=H, k=self.k, capacity_factor=self.capacity_factor,
                         expert_parallel=self.split, bias_init=nn.initializers.normal(0.1))
        return nn.Dense(3)(h + moe(h))


def _problem(seed=0, **kw):
    model = Block(**kw)
    kx, ky, kp = jax.random.split(jax.random.key(seed), 3)
    batch = {"x": jax.random.normal(kx, (16, 6, D_IN)), "y": jax.random.normal(ky, (16, 6, 3))}
    params = model.init(kp, batch["x"])["params"]

    def loss_fn(p, b):
        out, upd = model.apply({"params": p}, b["x"], mutable=["moe_losses"])
        losses = wh.moe.moe_losses(upd)
        loss = jnp.mean((out - b["y"]) ** 2) + 0.01 * losses["aux_loss"] + 0.001 * losses["z_loss"]
        return loss, {"aux_loss": losses["aux_loss"], "z_loss": losses["z_loss"], "out": out}

    return loss_fn, params, batch


CASES = {
    "ep8": dict(experts=8, split=8),                       # Example 5: one expert per device
    "ep8_two_per_device": dict(experts=16, split=8),       # experts per device > 1
    "dp2_ep4": dict(experts=8, split=4),                   # hybrid: 2-way DP x 4-way EP, 2 per device
    "top1_drops": dict(experts=8, split=8, k=1, capacity_factor=0.5),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_expert_parallel_matches_single_device(case):
    loss_fn, params, batch = _problem(**CASES[case])
    plan = wh.plan(loss_fn, params, batch, has_aux=True)
    [call] = plan.report.experts
    assert call.experts_per_device == CASES[case]["experts"] // CASES[case]["split"]
    ps = jax.device_put(params, plan.storage.param_shardings)
    placed = plan.place_batch(batch)
    (loss, aux, _), _ = jax.jit(plan.functions.value_and_grad())(ps, placed)
    ref_loss, ref_aux = loss_fn(params, batch)
    assert rel_err(aux["out"], ref_aux["out"]) < 1e-5
    assert abs(float(aux["aux_loss"]) - float(ref_aux["aux_loss"])) < 1e-5 * float(ref_aux["aux_loss"])
    assert abs(float(aux["z_loss"]) - float(ref_aux["z_loss"])) < 1e-5 * float(ref_aux["z_loss"])
    assert abs(float(loss) - float(ref_loss)) < 1e-5 * float(ref_loss)
    _, grads = plan.jitted()(ps, placed)
    ref_grads = jax.grad(lambda p, b: loss_fn(p, b)[0])(params, batch)
    errs = jax.tree.map(rel_err, grads, ref_grads)
    assert max(jax.tree.leaves(errs)) < 1e-5, errs
    # the expert weights are really sharded over the expert devices
    w_in = ps["MoE_0"]["w_in"]
    assert {s.data.shape[0] for s in w_in.addressable_shards} == {call.experts_per_device}


@pytest.mark.parametrize("case,micro", [("ep8", 1), ("dp2_ep4", 1), ("ep8", 2)])
def test_expert_parallel_params_after_three_adam_steps(case, micro):
    loss_fn, params, batch = _problem(**CASES[case])
    assert_matches(loss_fn, params, batch, steps=3, has_aux=True, tol=1e-5,
                   config=wh.Config(num_micro_batch=micro))      # micro > 1: gradient accumulation


def test_example5_written_by_hand_with_the_functional_api():
    """Whale's Example 5 verbatim: default replicate, gating/dispatch outside, experts under split."""
    e, k = 8, 2

    def loss_fn(p, b):
        wh.set_default_strategy(wh.replicate(8))
        x = b["x"].reshape(-1, 6, D)
        cap = wh.moe.capacity(6, e, k, 1.0)
        routing = wh.moe.top_k_gating(x @ p["router"], k, cap)
        dispatched = wh.moe.dispatch(x, routing, e, cap)
        with wh.split(8):
            out = wh.moe.experts(dispatched, p["w_in"], p["b_in"], p["w_out"], p["b_out"])
        y = wh.moe.combine(out, routing)
        return jnp.mean((y - b["y"]) ** 2) + 0.01 * routing.aux_loss

    ks = jax.random.split(jax.random.key(3), 7)
    params = {"router": jax.random.normal(ks[0], (D, e)), "w_in": jax.random.normal(ks[1], (e, D, H)) / 4,
              "b_in": jax.random.normal(ks[2], (e, H)) / 10, "w_out": jax.random.normal(ks[3], (e, H, D)) / 5,
              "b_out": jax.random.normal(ks[4], (e, D)) / 10}
    batch = {"x": jax.random.normal(ks[5], (16, 6 * D)), "y": jax.random.normal(ks[6], (16, 6, D))}
    step, _ = assert_matches(loss_fn, params, batch, steps=3, tol=1e-5)
    assert step.plan.param_specs["['w_in']"] == jax.sharding.PartitionSpec("model")
    assert step.plan.param_specs["['router']"] == jax.sharding.PartitionSpec()


def test_hlo_has_all_to_all_and_no_all_reduce_of_expert_gradients():
    loss_fn, params, batch = _problem(experts=8, split=8)
    step = wh.parallelize(lambda p, b: loss_fn(p, b)[0], adam())
    step.init(params, batch)
    text = step.plan.lowered().compile().as_text()
    ops = [op for op, _ in collectives(text)]
    assert ops.count("all-to-all") >= 4, ops        # dispatch + combine, forward and backward
    reduced = shapes_of(text, "all-reduce")
    # (b_out's full shape [8, D] is the router's transposed, so only its shard is checked)
    expert_shapes = {(8, D, H), (1, D, H), (8, H, D), (1, H, D), (8, H), (1, H), (H,), (1, D)}
    bad = [s for s in reduced if s in {tuple(sorted(x)) for x in expert_shapes}]
    assert not bad, f"expert weight gradients are all-reduced: {bad}"
    assert tuple(sorted((D, 8))) in reduced             # the data-parallel router gradient is synced

    # control: the same layer without split is data parallel, and its expert gradients ARE all-reduced
    loss_dp, params_dp, _ = _problem(experts=8, split=None)
    dp = wh.parallelize(lambda p, b: loss_dp(p, b)[0], adam())
    dp.init(params_dp, batch)
    dp_text = dp.plan.lowered().compile().as_text()
    assert tuple(sorted((8, D, H))) in shapes_of(dp_text, "all-reduce")
    assert "all-to-all" not in [op for op, _ in collectives(dp_text)]


def test_expert_count_not_a_multiple_of_devices_is_refused():
    loss_fn, params, batch = _problem(experts=6, split=8, k=1)
    with pytest.raises(wh.PlanError, match="6 experts, which cannot be spread evenly over the 8 devices"):
        wh.plan(loss_fn, params, batch, has_aux=True)


def test_moe_transformer_example_trains_and_matches_single_device():
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    import moe_transformer as example
    args = example.parse_args(["--steps", "12", "--layers", "2", "--d-model", "32", "--expert-hidden", "32",
                               "--check"])
    out = example.main(args)
    ce = [h["ce"] for h in out["history"]]
    assert ce[-1] < ce[0]                              # it learns
    assert out["max_rel_err"] < 1e-4                   # and equals single-device training
    assert "expert parallelism: TG1 experts over model (8 devices, 2 per device)" in out["step"].plan.summary()


def test_giant_style_plan_on_an_abstract_cluster_memory_and_lowering():
    """Example 5 planned for 64 abstract V100s from shapes only; memory model checked by hand."""
    import optax
    e, n, seq = 128, 64, 32
    model = Block(experts=e, split=n, k=2, capacity_factor=1.25)
    x = jax.ShapeDtypeStruct((n, seq, D_IN), jnp.float32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, seq, D_IN))))["params"]
    batch = {"x": x, "y": jax.ShapeDtypeStruct((n, seq, 3), jnp.float32)}

    def loss_fn(p, b):
        out, upd = model.apply({"params": p}, b["x"], mutable=["moe_losses"])
        return jnp.mean((out - b["y"]) ** 2) + 0.01 * wh.moe.moe_losses(upd)["aux_loss"]

    plan = wh.plan(loss_fn, params, batch, optimizer=optax.adam(1e-3),
                   cluster=wh.Cluster.abstract(kinds=["V100-32GB"] * n))
    [call] = plan.report.experts
    assert call.experts_per_device == e // n
    text = plan.lower()
    assert "all_to_all" in text and f"mhlo.num_partitions = {n}" in text
    fit = plan.memory_fit()
    leaves = jax.tree_util.tree_leaves_with_path(params)
    expert = sum(x.size for p, x in leaves if x.shape[:1] == (e,)) * 4
    rest = sum(x.size for p, x in leaves if x.shape[:1] != (e,)) * 4
    assert abs(fit.plain.params - (expert / n + rest)) < 1
    assert abs(fit.plain.opt_state - 2 * fit.plain.params) < 16      # Adam: mu and nu
    assert fit.plain.activations > 0 and fit.fits and fit.needs == ()
    # the plain footprint is the model's, whatever memory options the plan itself uses
    opts = wh.plan(loss_fn, params, batch, optimizer=optax.adam(1e-3),
                   config=wh.Config(zero_level=1, offload="opt_state"),
                   cluster=wh.Cluster.abstract(kinds=["V100-32GB"] * n))
    assert opts.memory_fit().plain == fit.plain
    # on a (made-up) tiny device the ladder says what it would take
    # on a (made-up) small device the ladder says what it would take; activations dominate here
    small = wh.Cluster.abstract(kinds=[wh.DeviceSpec("tiny", 1e12, 1e12, int(0.6 * fit.plain.device_total), 1e11)] * n)
    tight = wh.plan(loss_fn, params, batch, optimizer=optax.adam(1e-3), cluster=small).memory_fit()
    assert not tight.fits and tight.needs is not None and "remat" in tight.needs
    last = next(s for s in tight.ladder if s.option == tight.needs[-1])
    assert last.fits and last.footprint.device_total <= tight.capacity
