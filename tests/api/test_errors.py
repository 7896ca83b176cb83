"""Each bad input in docs/errors.md raises the documented error, and loses nothing. Inputs a new user
gets wrong each get a whalex error naming the argument (down to the leaf) and the fix, raised before
anything is placed or donated; a TrainState from another step of the same parameters is re-laid out
to this step's plan, exactly."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import whalex as wh
from api.test_checkpoint import _dp4
from conftest import HETERO, adam, reference_train, rel_err
from support.models import data, plain_model, plain_params


def _plan(loss_fn, params=None, batch=None, **kw):
    return wh.plan(loss_fn, params if params is not None else plain_params(),
                   batch if batch is not None else data(), adam(), **kw)


def _head(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["wh"] + p["bh"], b["y"]).mean()


def test_unknown_config_key():
    with pytest.raises(wh.ConfigError, match="unknown config key 'num_microbatch'"):
        wh.Config(num_microbatch=4)
    with pytest.raises(wh.ConfigError, match="unknown config key 'pipeline.num_micro_batches'"):
        wh.Config({"pipeline.num_micro_batches": 4})


def test_dotted_keys_are_accepted():
    assert wh.Config({"pipeline.num_micro_batch": 8}).num_micro_batch == 8


def test_bad_config_values():
    with pytest.raises(wh.ConfigError, match="unknown pipeline schedule"):
        wh.Config(schedule="zigzag")
    with pytest.raises(wh.ConfigError, match="num_micro_batch must be a positive integer"):
        wh.Config(num_micro_batch=0)
    with pytest.raises(wh.ConfigError, match="unknown amp"):
        wh.Config(amp="int8")
    with pytest.raises(wh.ConfigError, match="unknown remat"):
        wh.Config(remat="sometimes")
    with pytest.raises(wh.ConfigError, match="unknown offload"):
        wh.Config(offload="gpu")
    assert wh.Config(offload="opt_state").offload == ("opt_state",)


def test_device_count_larger_than_cluster():
    def loss_fn(p, b):
        with wh.split(16):
            return _head(p, b)
    with pytest.raises(wh.PlanError, match=r"asks for 16 devices but the cluster has 8"):
        _plan(loss_fn)


def test_device_count_not_dividing_cluster():
    def loss_fn(p, b):
        with wh.replicate(3):
            return _head(p, b)
    with pytest.raises(wh.PlanError, match="does not divide the cluster's 8"):
        _plan(loss_fn)


def test_split_counts_that_do_not_divide_each_other():
    def loss_fn(p, b):
        with wh.replicate(12):
            x = b["x"] * 2
        with wh.split(4):
            h = jnp.tanh(x @ p["w1"])
        with wh.split(6):
            return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] @ p["wh"], b["y"]).mean()
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), plain_params())
    batch = {"x": jax.ShapeDtypeStruct((48, 12), jnp.float32), "y": jax.ShapeDtypeStruct((48,), jnp.int32)}
    with pytest.raises(wh.PlanError, match="do not divide each other"):
        _plan(loss_fn, params, batch, cluster=wh.Cluster.abstract(["A100-80GB"] * 12))


def test_nested_scopes():
    def loss_fn(p, b):
        with wh.replicate(8):
            with wh.split(8):
                return _head(p, b)
    with pytest.raises(wh.ScopeError, match="nested inside wh.replicate"):
        _plan(loss_fn)
    with pytest.raises(wh.ScopeError):      # the same model under plain JAX: same error
        jax.jit(loss_fn)(plain_params(), data())


def test_decorated_function_called_inside_another_scope():
    head = wh.split(8)(_head)

    def loss_fn(p, b):
        with wh.replicate(8):
            return head(p, b)
    with pytest.raises(wh.ScopeError, match="may not nest or overlap"):
        _plan(loss_fn)


def test_bad_device_count_value():
    for bad in (0, -2, 2.5, "4"):
        with pytest.raises(wh.ScopeError, match="device_count must be a positive integer"):
            wh.split(bad)


def test_batch_not_divisible_by_data_parallel_degree():
    loss_fn, params, _ = plain_model("dp", "ctx")
    with pytest.raises(wh.PlanError, match="global batch of 30 cannot be divided over the 8"):
        _plan(loss_fn, params, data(batch=30))


def test_batch_leaves_disagree():
    loss_fn, params, batch = plain_model("dp", "ctx")
    batch["y"] = batch["y"][:16]
    with pytest.raises(wh.PlanError, match="disagree on the leading"):
        _plan(loss_fn, params, batch)


def test_unknown_device_kind():
    with pytest.raises(wh.ClusterError, match="unknown device kind 'V200'"):
        wh.Cluster(kinds=["V200"] * 8)


def test_more_kinds_than_devices():
    with pytest.raises(wh.ClusterError, match="only 8 devices are visible"):
        wh.Cluster(kinds=["V100-32GB"] * 16)


def test_loss_not_scalar():
    def loss_fn(p, b):
        return optax.softmax_cross_entropy_with_integer_labels(
            jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] @ p["wh"], b["y"])
    with pytest.raises(wh.PlanError, match="scalar floating-point loss"):
        _plan(loss_fn)


def test_aux_without_has_aux():
    def loss_fn(p, b):
        return _head(p, b), {"n": 1.0}
    with pytest.raises(wh.PlanError, match="pass has_aux=True"):
        _plan(loss_fn)


def test_not_an_optax_optimizer():
    with pytest.raises(wh.PlanError, match="optax.GradientTransformation"):
        wh.parallelize(_head, optimizer=lambda g: g)


def test_plan_before_init():
    step = wh.parallelize(_head, adam())
    with pytest.raises(wh.PlanError, match="call step.init"):
        _ = step.plan


def test_micro_batches_that_do_not_divide_over_replicas():
    # 32 samples in 8 micro-batches of 4 cannot be divided over 8 data-parallel replicas
    with pytest.raises(wh.PlanError, match="num_micro_batch=8"):
        _plan(_head, config=wh.Config(num_micro_batch=8))


def test_abstract_cluster_cannot_train():
    step = wh.parallelize(_head, adam(), cluster=wh.Cluster.abstract(["V100-32GB"] * 8, compiler="replay"))
    with pytest.raises(wh.PlanError, match="abstract cluster can plan and lower but not run"):
        step.init(plain_params(), data())


def test_bad_default_strategy():
    with pytest.raises(wh.ScopeError, match="set_default_strategy takes"):
        wh.set_default_strategy("replicate")


def test_errors_lose_nothing():
    """A failing init leaves the caller's params intact and usable."""
    params, batch = plain_params(), data(batch=30)
    before = jax.tree.map(np.asarray, params)
    step = wh.parallelize(_head, adam())
    with pytest.raises(wh.PlanError):
        step.init(params, batch)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_all_errors_are_value_errors():
    for cls in (wh.ConfigError, wh.ScopeError, wh.ClusterError, wh.PlanError):
        assert issubclass(cls, ValueError)


def test_reusing_a_donated_state():
    """Re-running `step(state, batch)` on a state an earlier step consumed raises before the jitted
    call (which would crash the process on the donated buffers)."""
    step = wh.parallelize(_head, adam())
    state = step.init(plain_params(), data())
    new, _ = step(state, data())
    with pytest.raises(wh.PlanError, match=r"consumed by an earlier step.*state, metrics = step\(state, batch\)"):
        step(state, data())
    step(new, data())                    # the returned state is the one to use


def test_default_strategy_inside_a_trace_leaves_the_process_default():
    import flax.linen as nn

    from whalex.primitives.config import DEFAULTS

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            wh.set_default_strategy(wh.replicate(8))         # model code, as in Whale's Example 5
            return nn.Dense(3)(x)

    before = DEFAULTS.strategy
    x = data()["x"]
    try:
        variables = Net().init(jax.random.key(0), x)         # eager Flax init
        jax.jit(Net().init)(jax.random.key(0), x)            # a jitted init
        jax.jit(Net().apply)(variables, x)
        jax.jit(lambda v: (wh.set_default_strategy(wh.split(8)), v * 2)[1])(x)
        jax.grad(lambda v: (wh.set_default_strategy(wh.split(8)), v.sum())[1])(x)
        assert DEFAULTS.strategy == before
        # another model on fewer devices is still planned (a leaked replicate(8) would refuse it)
        plan = _plan(_head, cluster=wh.Cluster(devices=jax.devices()[:4]))
        assert [t.device_count for t in plan.task_graphs] == [4]
        wh.set_default_strategy(wh.replicate(4))              # at top level it still sets the default
        assert DEFAULTS.strategy == wh.replicate(4).strategy
    finally:
        DEFAULTS.strategy = before


def test_options_that_would_be_ignored():
    with pytest.raises(wh.ConfigError, match=r"num_task_graph=4 only applies with auto_parallel=True"):
        wh.Config(num_task_graph=4)
    with pytest.raises(wh.ConfigError, match=r"num_task_graph=2 only applies with auto_parallel=True"):
        wh.Config({"pipeline.num_stages": 2})
    with pytest.raises(wh.ConfigError, match=r"memory_budget=1024 only applies with remat='auto'"):
        wh.Config(memory_budget=1024)
    with pytest.raises(wh.ConfigError, match=r"memory_budget=1024 only applies with remat='auto'.*remat='full'"):
        wh.Config(remat="full", memory_budget=1024)
    with pytest.raises(wh.ConfigError, match=r"loss_scale_period=10 only applies with amp='fp16'"):
        wh.Config(loss_scale_period=10)
    with pytest.raises(wh.ConfigError, match=r"loss_scale_period=10 only applies with amp='fp16'.*amp='bf16'"):
        wh.Config(amp="bf16", loss_scale_period=10)
    # the same options where they apply
    assert wh.Config(auto_parallel=True, num_task_graph=4).num_task_graph == 4
    assert wh.Config(remat="auto", memory_budget=1024).memory_budget == 1024
    assert wh.Config(amp="fp16", loss_scale_period=10).loss_scale_period == 10
    with pytest.raises(wh.ConfigError, match="memory_budget"):
        wh.Config(remat="auto", memory_budget=1024).replace(remat="full")


def test_collective_written_for_pmap():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.BatchNorm(use_running_average=False, axis_name="batch")(nn.Dense(4)(x))
            return nn.Dense(3)(x)

    batch = {"x": data()["x"], "y": data()["y"] % 3}
    variables = Net().init(jax.random.key(0), batch["x"])

    def loss_fn(p, b):
        out, _ = Net().apply({"params": p, "batch_stats": variables["batch_stats"]}, b["x"],
                             mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(out, b["y"]).mean()

    fix = r"axis name 'batch'.*whole batch.*synchronised.*Drop axis_name='batch'"
    with pytest.raises(wh.PlanError, match=fix):
        _plan(loss_fn, variables["params"], batch)

    def pmean_loss(p, b):
        return jax.lax.pmean(_head(p, b), "batch")
    with pytest.raises(wh.PlanError, match=fix):
        _plan(pmean_loss)


# ----------------------------------------------------------------------------------- inputs a new user gets wrong

SGD = optax.sgd(0.05)


def _loss(p, b):
    return _dp4(p, b)


def _train(step, state, steps):
    losses = []
    for _ in range(steps):
        state, m = step(state, data())
        losses.append(float(m["loss"]))
    return state, losses


@pytest.fixture(scope="module")
def dp_step():
    """A data-parallel step (shared: compiled once)."""
    return wh.parallelize(_loss, SGD)


def _state(step):
    """A state `step` trained once."""
    return _train(step, step.init(plain_params(), data()), 1)[0]


def _still_trains(step, state):
    """`state` was neither donated nor altered by a refused call: its own step runs on it."""
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    state, m = step(state, data())
    assert np.isfinite(float(m["loss"]))
    return state


# ----------------------------------------------------------------------------------- the batch

def test_batch_leaf_given_as_a_python_list(dp_step):
    step = dp_step
    state = _state(step)
    batch = dict(data(), x=np.asarray(data()["x"]).tolist())
    match = r"batch\['x'\] is a Python list of numbers, not an array.*np\.asarray\(batch\['x'\]\)"
    with pytest.raises(wh.PlanError, match=match):
        wh.plan(_loss, plain_params(), batch, SGD)
    with pytest.raises(wh.PlanError, match=match):
        wh.parallelize(_loss, SGD).init(plain_params(), batch)
    with pytest.raises(wh.PlanError, match=match):
        step(state, batch)
    _still_trains(step, state)


def test_scalar_and_mismatched_batch_leaves_are_named():
    with pytest.raises(wh.PlanError, match=r"batch\['w'\] is a scalar \(shape \(\)\).*closure"):
        wh.plan(_loss, plain_params(), dict(data(), w=jnp.float32(2.0)), SGD)
    with pytest.raises(wh.PlanError, match=r"batch\['w'\] is a Python float, not an array"):
        wh.plan(_loss, plain_params(), dict(data(), w=2.0), SGD)
    with pytest.raises(wh.PlanError, match=r"batch\['t'\] is an array of dtype <U5, not an array of numbers"):
        wh.plan(_loss, plain_params(), dict(data(), t=np.array(["token"] * 32)), SGD)
    with pytest.raises(wh.PlanError, match=r"batch\['x'\] has 32, batch\['y'\] has 30"):
        wh.plan(_loss, plain_params(), dict(data(), y=data()["y"][:30]), SGD)


# ---------------------------------------------------------------------------------- the outputs

def test_aux_that_is_not_an_array():
    def with_str(p, b):
        return _loss(p, b), "epoch 3"

    def with_nested(p, b):
        return _loss(p, b), {"acc": jnp.float32(0.5), "note": object()}

    with pytest.raises(wh.PlanError, match=r"returned aux = 'epoch 3' \(type str\), not an array.*metrics\['aux'\]"):
        wh.parallelize(with_str, SGD, has_aux=True).init(plain_params(), data())
    with pytest.raises(wh.PlanError, match=r"returned aux\['note'\] = <object .*\(type object\), not an array"):
        wh.plan(with_nested, plain_params(), data(), SGD, has_aux=True)


# ------------------------------------------------------------------------------- the parameters

def _with_counter(used: bool):
    def loss_fn(p, b):
        loss = _loss(p, b)
        return loss * (1.0 + 0.0 * p["count"]) if used else loss
    return loss_fn, dict(plain_params(), count=jnp.zeros((), jnp.int32))


@pytest.mark.parametrize("used", [False, True], ids=["unused", "used"])
def test_integer_leaf_in_params(used):
    loss_fn, params = _with_counter(used)
    step = wh.parallelize(loss_fn, SGD)
    with pytest.raises(wh.PlanError, match=r"params\['count'\] has dtype int32.*no gradient.*model_state="):
        step.init(params, data())
    with pytest.raises(wh.PlanError, match="call step.init"):   # nothing was planned or placed
        _ = step.plan


def test_an_integer_counter_in_model_state_trains_as_on_one_device():
    """The fix the integer-leaf error names: the counter as model state, params trained exactly."""
    def loss_fn(p, b, model_state):
        return _loss(p, b), {"count": model_state["count"] + 1}

    step = wh.parallelize(loss_fn, SGD)
    state = step.init(plain_params(), data(), model_state={"count": jnp.zeros((), jnp.int32)})
    for _ in range(3):
        state, _ = step(state, data())
    assert int(state.model_state["count"]) == 3
    _, ref = reference_train(_loss, plain_params(), data(), SGD, 3)
    assert max(jax.tree.leaves(jax.tree.map(rel_err, step.params(state), ref))) < 1e-5


def test_shape_dtype_structs_to_init():
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), plain_params())
    step = wh.parallelize(_loss, SGD)
    with pytest.raises(wh.PlanError, match=r"jax\.ShapeDtypeStruct at params\['b1'\].*needs arrays.*"
                                           r"restore\(step, params, batch\), which takes ShapeDtypeStructs"):
        step.init(abstract, data())
    with pytest.raises(wh.PlanError, match="call step.init"):
        _ = step.plan
    assert wh.plan(_loss, abstract, data(), SGD).task_graphs      # planning from shapes stays allowed


# ---------------------------------------------------------------------------------- the cluster

def test_cluster_kinds_given_as_one_string():
    with pytest.raises(wh.ClusterError, match=r"kinds is a list with one device kind per device, not one kind; "
                                              r"write kinds=\['V100-32GB'\] \* 8"):
        wh.Cluster(kinds="V100-32GB")
    with pytest.raises(wh.ClusterError, match=r"Cluster\.abstract\(kinds='T4'\): kinds is a list"):
        wh.Cluster.abstract(kinds="T4")


# ------------------------------------------------------------------------------ the checkpoints

def test_orbax_argument_order_to_the_checkpoint_manager(dp_step, tmp_path):
    step = dp_step
    state = _state(step)
    with wh.CheckpointManager(tmp_path) as manager:
        with pytest.raises(wh.PlanError, match=r"manager\.save\(step, state\) takes the whalex Step first.*"
                                               r"got the step number 3 \(orbax's order\)"):
            manager.save(3, state)
        with pytest.raises(wh.PlanError, match=r"got a TrainState"):
            manager.save(state, step)
        with pytest.raises(wh.PlanError, match=r"manager\.restore\(step, .*got the step number 3; pass it as at=3"):
            manager.restore(3, plain_params(), data())
        assert manager.latest_step() is None                    # nothing was saved
    _still_trains(step, state)


# ------------------------------------------------------------------- a state from another step

def _steps():
    return {
        "split": lambda opt: wh.parallelize(plain_model("split", "ctx")[0], opt),
        "dp8": lambda opt: wh.parallelize(plain_model("dp", "ctx")[0], opt),
        "hetero": lambda opt: wh.parallelize(plain_model("hybrid", "ctx")[0], opt, cluster=wh.Cluster(kinds=HETERO)),
        "dp4-zero3": lambda opt: wh.parallelize(_dp4, opt, config=wh.Config(zero_level=3),
                                                cluster=wh.Cluster(devices=jax.devices()[:4])),
    }


@pytest.mark.parametrize("made_by,run_by", [("split", "dp8"), ("dp8", "hetero"), ("hetero", "dp4-zero3")],
                         ids=["split-to-dp", "dp-to-padded-uneven-head", "padded-to-zero3-on-4-devices"])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_a_state_from_another_step_is_relaid_out_and_trains_as_one_device(made_by, run_by, opt):
    """2 steps under one plan, then 3 under another step of the same parameters (another mesh, layout,
    ZeRO level or device set): the same losses and parameters as 5 steps on one device. The first
    step's state is copied, not consumed, and still trains under its own step."""
    optimizer = SGD if opt == "sgd" else adam()
    first, second = _steps()[made_by](optimizer), _steps()[run_by](optimizer)
    state, losses = _train(first, first.init(plain_params(), data()), 2)
    second.init(plain_params(), data())
    moved, more = _train(second, state, 3)
    assert int(moved.step) == 5
    ref_losses, ref_params = reference_train(_dp4, plain_params(), data(), optimizer, 5)
    np.testing.assert_allclose(losses + more, ref_losses, rtol=1e-5)
    errs = jax.tree.map(rel_err, second.params(moved), ref_params)
    assert max(jax.tree.leaves(errs)) < 1e-5, errs
    _still_trains(first, state)


def test_a_state_of_another_optimizer_is_refused_and_kept(dp_step):
    step = dp_step                                     # SGD: no optimizer state at all
    state = _state(step)
    other = wh.parallelize(plain_model("split", "ctx")[0], adam())
    other.init(plain_params(), data())
    with pytest.raises(wh.PlanError, match=r"made by another step: its opt_state has 0 arrays and this step's "
                                           r"plan expects 13 \(another optimizer\).*step\.init\(state\.params"):
        other(state, data())
    _still_trains(step, state)


def test_a_state_without_the_model_state_this_step_carries_is_refused(dp_step):
    step = dp_step
    state = _state(step)

    def loss_fn(p, b, model_state):
        return _loss(p, b), model_state

    other = wh.parallelize(loss_fn, SGD)
    other.init(plain_params(), data(), model_state={"seen": jnp.zeros(())})
    with pytest.raises(wh.PlanError, match="made by another step: it has no model_state and this step's plan has one"):
        other(state, data())
    _still_trains(step, state)
