"""Inputs a new user gets wrong each get a whalex error naming the argument (down to
the leaf) and the fix, raised before anything is placed or donated; a TrainState from another step of
the same parameters is re-laid out to this step's plan, exactly; launcher argument errors exit 2."""
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import whalex as wh
from conftest import HETERO, adam, reference_train, rel_err
from models import data, plain_model, plain_params
from test_checkpoint import _dp4
from test_launch import HERE, child_env

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


# -------------------------------------------------------------------------------- the launcher

@pytest.mark.parametrize("args,message", [
    (["-n", "0", "x.py"], "-n/--nproc must be >= 1"),
    (["-n", "2", "--restarts", "-1", "{script}"], "--restarts must be >= 0"),
    (["-n", "2", "--min-processes", "3", "{script}"], r"--min-processes must be in \[1, 2\]"),
    (["-n", "2", "--timeout", "0", "{script}"], "--timeout must be > 0"),
    (["-n", "2", "missing.py"], "script 'missing.py' not found"),
], ids=["n0", "restarts", "min-processes", "timeout", "script"])
def test_launcher_argument_errors_exit_2_with_usage(args, message, tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    argv = [a.format(script=script) for a in args]
    r = subprocess.run([sys.executable, "-m", "whalex.launch", *argv], env=child_env(1), cwd=HERE,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "usage: python -m whalex.launch" in r.stderr and "Traceback" not in r.stderr
    assert __import__("re").search(message, r.stderr), r.stderr
    assert "ran" not in r.stdout                                 # no process was started


def test_launch_function_raises_a_config_error():
    from whalex.launch import launch
    with pytest.raises(wh.ConfigError, match="-n/--nproc must be >= 1"):
        launch(0, [sys.executable, "-c", "pass"])


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
