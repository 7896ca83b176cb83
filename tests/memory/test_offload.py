"""Optimizer state and parameters offloaded to pinned host memory, alone and with ZeRO 1, train
exactly as one device. `offload="opt_state"` keeps the optimizer state off the device through the
backward pass: the step reads each offloaded leaf only through an `optimization_barrier` shared with
the gradient it updates (or with every gradient), so XLA cannot move it to the device before the
backward pass has made that gradient; what the step does is read from its StableHLO."""
import re

import jax
import optax
import pytest
from jax.sharding import PartitionSpec as P

import whalex as wh
from architectures.test_stock_gpt import loss_fn as gpt_loss, problem as gpt_problem
from conftest import adam, assert_matches
from lowering.test_pipeline import _compare, _plain, _two_stage
from support.models import plain_model

HOST = "pinned_host"


def _kinds(tree) -> set:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


@pytest.mark.parametrize("offload", ["opt_state", "params", ("opt_state", "params")])
def test_offloaded_state_lives_in_pinned_host_memory_and_training_matches(offload):
    loss_fn, params, batch = plain_model("hybrid", "ctx")
    step, state = assert_matches(loss_fn, params, batch, steps=5, config=wh.Config(offload=offload))
    targets = (offload,) if isinstance(offload, str) else offload
    assert _kinds(state.opt_state) == ({HOST} if "opt_state" in targets else {"device"})
    assert _kinds(state.params) == ({HOST} if "params" in targets else {"device"})
    assert state.step.sharding.memory_kind == "device"
    assert "offload to pinned_host" in step.plan.summary()


def test_zero_1_with_offload_matches_and_keeps_the_shards_on_the_host():
    loss_fn, params, batch = plain_model("dp", "ctx")
    step, state = assert_matches(loss_fn, params, batch, steps=5,
                                 config=wh.Config(zero_level=1, offload="opt_state"))
    mu = state.opt_state[0].mu
    assert _kinds(state.opt_state) == {HOST} and _kinds(state.params) == {"device"}
    assert mu["w2"].sharding.spec == P("data")                                   # sharded AND on the host
    assert {s.data.shape for s in mu["w2"].addressable_shards} == {(3, 24)}
    m = step.plan.memory[0]
    assert m.opt_state == 0 and m.host == pytest.approx(2 * 8912 * 4 / 8 + 4)     # Adam moments / 8 + count


def test_zero_3_with_offloaded_params_and_state_matches():
    loss_fn, params, batch = plain_model("dp", "ctx")
    _, state = assert_matches(loss_fn, params, batch, steps=3,
                              config=wh.Config(zero_level=3, offload=("opt_state", "params")))
    assert _kinds(state.params) == {HOST} and state.params["w2"].sharding.spec == P("data")


def test_offload_on_pipeline_and_uneven_plans():
    params, batch = _plain()
    _, state = _compare(_two_stage, params, batch, wh.Config(num_micro_batch=4, zero_level=1, offload="opt_state"))
    assert _kinds(state.opt_state) == {HOST}
    loss_fn, params, batch = plain_model("dp", "ctx")
    step, state = assert_matches(loss_fn, params, batch, steps=3, config=wh.Config(offload="params"),
                                 cluster=wh.Cluster(kinds=["V100-32GB"] * 4 + ["T4-16GB"] * 4))
    assert len(set(step.plan.batch_sizes)) > 1 and _kinds(state.params) == {HOST}


def test_offload_lowers_on_an_abstract_cluster():
    loss_fn, params, batch = plain_model("dp", "ctx")
    plan = wh.plan(loss_fn, params, batch, adam(), config=wh.Config(zero_level=1, offload="opt_state"),
                   cluster=wh.Cluster.abstract(kinds=["V100-32GB"] * 8))
    assert "pinned_host" in plan.lower()


# ------------------------------------------------------- the optimizer state stays off the device until its gradient

def _uses(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if re.search(rf"{re.escape(name)}\b", line) and "func.func" not in line]


@pytest.mark.parametrize("optimizer", [optax.adam(1e-3), optax.sgd(0.1, momentum=0.9)], ids=["adam", "momentum"])
def test_offloaded_state_moves_to_the_device_only_after_its_gradient(optimizer):
    params, batch = gpt_problem()
    text = wh.plan(gpt_loss, params, batch, optimizer, config=wh.Config(offload="opt_state")).lower()
    header = text[text.index("func.func public @main"):].split("{\n", 1)[0]
    host_args = re.findall(r"(%arg\d+): tensor<[^>]*>\s*\{[^}]*memory_kind = \"pinned_host\"", header)
    assert host_args, "the optimizer state should be stored in pinned_host memory"
    for arg in host_args:
        first = _uses(text, arg)[0]
        assert "optimization_barrier" in first, (arg, first)
        operands = first.split("optimization_barrier", 1)[1].split(":")[0]
        assert operands.count("%") >= 2, (arg, first)          # the state leaf and the gradient(s) it waits for
    # the gradients' barrier comes after the loss: every barrier reads values the backward pass made
    first_barrier = text.index("optimization_barrier")
    assert text.index("dot_general") < first_barrier


def test_without_offload_there_is_no_barrier():
    params, batch = gpt_problem()
    text = wh.plan(gpt_loss, params, batch, optax.adam(1e-3)).lower()
    assert "optimization_barrier" not in text and "pinned_host" not in text


@pytest.mark.parametrize("devices", [1, 8])
def test_state_is_fetched_per_leaf_on_one_device_and_after_every_gradient_on_many(devices):
    """On one device each leaf's move waits for its own gradient (it overlaps the rest of the backward
    pass); where gradients are all-reduced, every move waits for every gradient, so that XLA:GPU keeps
    the all-reduces asynchronous instead of finishing each at once for the move that waits on it."""
    params, batch = gpt_problem()
    cluster = wh.Cluster(kinds=[jax.devices()[0].device_kind] * devices)
    text = wh.plan(gpt_loss, params, batch, optax.adam(1e-3), config=wh.Config(offload="opt_state"),
                   cluster=cluster).lower()
    grads = len(jax.tree.leaves(params))
    widths = [line.split("optimization_barrier", 1)[1].split(":")[0].count("%")
              for line in text.splitlines() if "optimization_barrier" in line and "=" in line]
    assert widths
    if devices == 1:              # the moments: the leaf and its gradient (Adam's count: every gradient)
        assert min(widths) == 2 and widths.count(2) >= 2 * grads
    else:
        assert min(widths) == 1 + grads                   # the leaf and every gradient
