"""Each bad input in docs/errors.md raises the documented error, and loses nothing."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import whalex as wh
from conftest import adam
from models import data, plain_model, plain_params


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
    step = wh.parallelize(_head, adam(), cluster=wh.Cluster.abstract(["V100-32GB"] * 8))
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
