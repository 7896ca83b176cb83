"""Plan-independent checkpoints (wh.CheckpointManager on orbax-checkpoint).

(a) same plan: save at step N, restore into a new Step, train M more == N+M uninterrupted, bit for bit;
(b) across plans: saved under A, restored under B, training goes on and matches single-device training;
(c) plain orbax (no whalex) reads the caller's pytree from a checkpoint a pipeline saved.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import whalex as wh
from api.test_model_state import problem
from conftest import HETERO, adam, reference_train, rel_err
from lowering.test_pipeline import _plain, _two_stage
from moe.test_moe import D_IN, Block
from support.models import _backbone, _ce, data, plain_model, plain_params

N, M = 2, 2            # steps before the checkpoint, steps after it


def _train(step, state, batch, steps):
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(np.asarray(metrics["loss"]))
    return state, losses


def _host(tree):
    return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree.leaves(tree)]


def _assert_equal(a, b):
    la, lb = _host(a), _host(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


# ------------------------------------------------------------------- (a) same plan, bit-exact

def _same_plan(directory, make_step, params, batch, model_state=None, rng=None):
    step = make_step()
    state = step.init(params, batch, model_state=model_state, rng=rng)
    state, _ = _train(step, state, batch, N)
    with wh.CheckpointManager(directory) as manager:
        manager.save(step, state)                 # asynchronous; the next step donates `state`
        state, losses = _train(step, state, batch, M)
        manager.wait_until_finished()
        assert manager.latest_step() == N
        step2 = make_step()
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        resumed = manager.restore(step2, abstract, batch, model_state=model_state, rng=rng)
    assert int(resumed.step) == N
    resumed, losses2 = _train(step2, resumed, batch, M)
    np.testing.assert_array_equal(losses2, losses)
    _assert_equal(step2.params(resumed), step.params(state))
    _assert_equal(resumed.opt_state, state.opt_state)
    _assert_equal((resumed.step, resumed.model_state, resumed.rng), (state.step, state.model_state, state.rng))
    return step, state, resumed


def _plain_dp(config=None, cluster=None):
    loss_fn, params, batch = plain_model("dp", "ctx")
    return (lambda: wh.parallelize(loss_fn, adam(), config=config, cluster=cluster)), params, batch


def _hybrid(cluster=None):
    loss_fn, params, batch = plain_model("hybrid", "ctx")
    return (lambda: wh.parallelize(loss_fn, adam(), cluster=cluster)), params, batch


def _moe_ep():
    """tests/moe/test_moe.py's expert-parallel block (8 experts over 8 devices, top-2) with its loss and
    has_aux=True; parameters drawn by numpy from the shapes (running flax's init compiles for seconds)."""
    model = Block(experts=8, split=8)
    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.standard_normal((16, 6, D_IN), np.float32)),
             "y": jnp.asarray(rng.standard_normal((16, 6, 3), np.float32))}
    shapes = jax.eval_shape(model.init, jax.random.key(0), batch["x"])["params"]
    params = jax.tree.map(lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape, np.float32)), shapes)

    def loss_fn(p, b):
        out, upd = model.apply({"params": p}, b["x"], mutable=["moe_losses"])
        losses = wh.moe.moe_losses(upd)
        loss = jnp.mean((out - b["y"]) ** 2) + 0.01 * losses["aux_loss"] + 0.001 * losses["z_loss"]
        return loss, {"aux_loss": losses["aux_loss"], "z_loss": losses["z_loss"]}

    return (lambda: wh.parallelize(loss_fn, adam(), has_aux=True)), params, batch


def _pipeline():
    params, batch = _plain()
    return (lambda: wh.parallelize(_two_stage, adam(), config=wh.Config(num_micro_batch=4))), params, batch


SAME = {
    "dp": lambda: _plain_dp(),
    "hybrid": lambda: _hybrid(),
    "pipeline_1f1b": _pipeline,
    "hetero": lambda: _hybrid(wh.Cluster(kinds=HETERO)),
    "zero1": lambda: _plain_dp(wh.Config(zero_level=1)),
    "zero2": lambda: _plain_dp(wh.Config(zero_level=2)),
    "zero3": lambda: _plain_dp(wh.Config(zero_level=3)),
    "moe_expert_parallel": _moe_ep,
    "offload_opt_state": lambda: _plain_dp(wh.Config(offload="opt_state")),
    "amp_fp16_loss_scale": lambda: _plain_dp(wh.Config(amp="fp16")),
}


@pytest.mark.parametrize("plan", list(SAME))
def test_same_plan_round_trip_is_bit_exact(plan, tmp_path):
    make_step, params, batch = SAME[plan]()
    step, state, resumed = _same_plan(tmp_path / "ckpt", make_step, params, batch)
    jax.tree.map(lambda a, b: a.sharding.is_equivalent_to(b.sharding, a.ndim) or pytest.fail(plan),
                 (resumed.params, resumed.opt_state), (state.params, state.opt_state))   # ZeRO shards, experts
    if plan in ("zero1", "zero2"):                # the optimizer state comes back as this device's shard
        assert not all(x.sharding.is_fully_replicated for x in jax.tree.leaves(resumed.opt_state) if x.ndim)
    if plan == "moe_expert_parallel":             # one expert per device, as the step stores it
        assert {s.data.shape[0] for s in resumed.params["MoE_0"]["w_in"].addressable_shards} == {1}
    if plan == "offload_opt_state":
        assert {x.sharding.memory_kind for x in jax.tree.leaves(resumed.opt_state)} == {"pinned_host"}
    if plan == "amp_fp16_loss_scale":
        _assert_equal(resumed.loss_scale, state.loss_scale)


def test_same_plan_round_trip_with_batchnorm_state_and_dropout_rng(tmp_path):
    loss_fn, params, model_state, batch = problem(dropout=0.1)
    make_step = lambda: wh.parallelize(loss_fn, adam())  # noqa: E731
    _same_plan(tmp_path / "ckpt", make_step, params, batch, model_state=model_state, rng=jax.random.key(7))


# ------------------------------------------------------------------- (b) across plans

def _dp4(p, b):                      # no annotation: data parallel over the cluster's 4 devices
    return _ce(_backbone(p, b["x"]) @ p["wh"] + p["bh"], b["y"])


def _pipe2(p, b):
    with wh.replicate(1):
        h = _backbone(p, b["x"])
    with wh.replicate(1):
        return _ce(h @ p["wh"] + p["bh"], b["y"])


def _pipe4(p, b):
    with wh.replicate(1):
        h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    with wh.replicate(1):
        h = jnp.tanh(h @ p["w2"] + p["b2"])
    with wh.replicate(1):
        logits = h @ p["wh"]
    with wh.replicate(1):
        return _ce(logits + p["bh"], b["y"])


@functools.cache
def _cross_step(name):
    """Steps with one model (models.plain_params) under different plans, one Step per plan (compiled once)."""
    pipe = wh.Config(num_micro_batch=4)
    return {
        "dp8": lambda: wh.parallelize(plain_model("dp", "ctx")[0], adam()),
        "dp4": lambda: wh.parallelize(_dp4, adam(), cluster=wh.Cluster(devices=jax.devices()[:4])),
        "hybrid": lambda: wh.parallelize(plain_model("hybrid", "ctx")[0], adam()),
        "pipe2x4": lambda: wh.parallelize(_pipe2, adam(), config=pipe),
        "pipe4x2": lambda: wh.parallelize(_pipe4, adam(), config=pipe),
        "hetero": lambda: wh.parallelize(plain_model("hybrid", "ctx")[0], adam(), cluster=wh.Cluster(kinds=HETERO)),
        "zero3": lambda: wh.parallelize(plain_model("dp", "ctx")[0], adam(), config=wh.Config(zero_level=3)),
    }[name]()


class Saved:
    """Checkpoints at step N, one per saving plan, made on first use and shared by the tests."""

    def __init__(self, root):
        self.root, self.dirs, self.params = root, {}, {}

    def __call__(self, plan):
        if plan not in self.dirs:
            step = _cross_step(plan)
            state, _ = _train(step, step.init(plain_params(), data()), data(), N)
            with wh.CheckpointManager(self.root / plan) as manager:
                manager.save(step, state)
            self.dirs[plan], self.params[plan] = self.root / plan, jax.device_get(step.params(state))
        return self.dirs[plan]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return Saved(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def reference():
    losses, params = reference_train(_dp4, plain_params(), data(), adam(), N + M)
    return losses, params


CROSS = ["dp8", "dp4", "hybrid", "pipe2x4", "pipe4x2", "hetero", "zero3"]
PAIRS = [(a, b) for a in CROSS for b in CROSS if a != b]          # every ordered pair: 42


@pytest.mark.parametrize("saved_under,restored_under", PAIRS)
def test_saved_under_one_plan_restores_and_trains_under_another(saved_under, restored_under, saved, reference):
    directory = saved(saved_under)
    step = _cross_step(restored_under)
    with wh.CheckpointManager(directory) as manager:
        state = manager.restore(step, plain_params(), data())
    assert int(state.step) == N
    _assert_equal(step.params(state), saved.params[saved_under])     # the saved values, whatever the layout
    state, losses = _train(step, state, data(), M)
    ref_losses, ref_params = reference
    np.testing.assert_allclose(np.array(losses, np.float64), ref_losses[N:], rtol=1e-5)
    errs = jax.tree.map(rel_err, step.params(state), ref_params)
    assert max(jax.tree.leaves(errs)) < 1e-4, errs


# ------------------------------------------------------------------- (c) plain orbax reads it

def test_plain_orbax_reads_the_callers_pytree(saved):
    directory = saved("pipe2x4")                 # a pipeline: packed into stage rows while computing
    manager = ocp.CheckpointManager(directory)
    tree = manager.restore(manager.latest_step())
    manager.close()
    params = plain_params()
    assert set(tree) == {"params", "opt_state", "step"}
    assert {k: v.shape for k, v in tree["params"].items()} == {k: v.shape for k, v in params.items()}
    adam_state = tree["opt_state"][0]
    assert {k: v.shape for k, v in adam_state["mu"].items()} == {k: v.shape for k, v in params.items()}
    assert int(tree["step"]) == N and int(adam_state["count"]) == N
    for k, v in tree["params"].items():
        np.testing.assert_array_equal(v, saved.params["pipe2x4"][k])


def test_restore_without_a_checkpoint_is_a_clear_error(tmp_path):
    step = _cross_step("dp8")
    with wh.CheckpointManager(tmp_path / "empty") as manager:
        assert manager.latest_step() is None
        with pytest.raises(wh.PlanError, match="no checkpoint"):
            manager.restore(step, plain_params(), data())


def test_nnx_module_round_trip_is_bit_exact(tmp_path):
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(12, 16, rngs=rngs)
            self.bn = nnx.BatchNorm(16, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.l2 = nnx.Linear(16, 5, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))

    def loss_fn(model, b):
        return optax.softmax_cross_entropy_with_integer_labels(model(b["x"]), b["y"] % 5).mean()

    def model():
        m = Net(nnx.Rngs(0, dropout=1))
        m.train()
        return m

    batch = data()
    make_step = lambda: wh.parallelize(loss_fn, adam())  # noqa: E731
    step = make_step()
    state, _ = _train(step, step.init(model(), batch), batch, N)
    with wh.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(step, state)
        state, losses = _train(step, state, batch, M)
        manager.wait_until_finished()
        step2 = make_step()
        resumed = manager.restore(step2, model(), batch)          # the module gives the structure
    resumed, losses2 = _train(step2, resumed, batch, M)
    np.testing.assert_array_equal(losses2, losses)
    _assert_equal(step2.params(resumed), step.params(state))
    _assert_equal(resumed.model_state, state.model_state)         # BatchStat and the RngKey/RngCount streams
    assert isinstance(step2.model(resumed), Net)


def test_a_pipeline_checkpoints_a_factored_optimizer_state(tmp_path):
    """A pipeline stores adafactor's factored statistics of the caller's leaves: saved as they are, restored
    under a data-parallel plan, and training goes on as uninterrupted single-device training."""
    opt = optax.adafactor(1e-2, min_dim_size_to_factor=8)
    pipe = wh.parallelize(_pipe2, opt, config=wh.Config(num_micro_batch=4))
    state, _ = _train(pipe, pipe.init(plain_params(), data()), data(), N)
    dp = wh.parallelize(plain_model("dp", "ctx")[0], opt)
    with wh.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(pipe, state)
        manager.wait_until_finished()
        restored = manager.restore(dp, plain_params(), data())
    _assert_equal(dp.params(restored), pipe.params(state))
    restored, losses = _train(dp, restored, data(), M)
    ref_losses, ref_params = reference_train(_dp4, plain_params(), data(), opt, N + M)
    np.testing.assert_allclose(np.array(losses, np.float64), ref_losses[N:], rtol=1e-5)
    assert max(jax.tree.leaves(jax.tree.map(rel_err, dp.params(restored), ref_params))) < 1e-4
