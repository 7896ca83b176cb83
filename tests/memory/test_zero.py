"""ZeRO levels 1/2/3 on replicate, hybrid, pipeline and heterogeneous plans."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import whalex as wh
from conftest import HETERO, adam, assert_matches
from lowering.test_pipeline import _compare, _plain, _two_stage
from support.hlo import collectives
from support.models import plain_model
from whalex.memory import zero

SIZES = {"data": 8, "model": 2, "one": 1}


def test_shard_spec_is_a_pure_function_of_specs():
    assert zero.shard_spec(P(), (12, 24), ("data",), SIZES) == P(None, "data")     # 12 % 8: next dimension
    assert zero.shard_spec(P(), (16, 24), ("data",), SIZES) == P("data")
    assert zero.shard_spec(P(None, "model"), (16, 4), ("data",), SIZES) == P("data", "model")
    assert zero.shard_spec(P(), (16,), ("data", "model"), SIZES) == P(("data", "model"))
    assert zero.shard_spec(P(), (12, 6), ("data",), SIZES) == P()                  # no dimension divides
    assert zero.shard_spec(P("data"), (16,), ("data",), SIZES) == P("data")        # axis already used
    assert zero.shard_spec(P(), (16,), ("one",), SIZES) == P()                     # degree 1
    assert zero.zero_dim(P(None, "model"), P("data", "model")) == 0
    assert zero.degree(P(), P(None, "data"), SIZES) == 8
    assert zero.data_parallel_axes([[0], [0, 1], []], [("data", "model"), ("model",)], SIZES) == \
        [("data", "model"), ("model",), ()]


def _shard_bytes(tree) -> int:
    """Bytes one device holds of a pytree of placed arrays."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def _opt_bytes(state) -> int:
    mu, nu = state.opt_state[0].mu, state.opt_state[0].nu
    return _shard_bytes(mu) + _shard_bytes(nu)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_replicate_plan_matches_single_device(level):
    loss_fn, params, batch = plain_model("dp", "ctx")
    step, state = assert_matches(loss_fn, params, batch, steps=5, config=wh.Config(zero_level=level))
    full = sum(x.nbytes for x in jax.tree.leaves(params))
    assert _opt_bytes(state) * 8 == 2 * full                       # every leaf of this model divides by 8
    assert _shard_bytes(state.params) * (8 if level == 3 else 1) == full
    assert state.opt_state[0].mu["w1"].sharding.spec == P(None, "data")
    assert step.plan.memory[0].opt_state == pytest.approx(2 * full / 8 + 4)     # + Adam's count
    assert f"(zero {level})" in step.plan.summary()


@pytest.mark.parametrize("level", [1, 2, 3])
def test_hybrid_plan_shards_the_backbone_over_its_batch_axis(level):
    """Backbone replicate(8) has its batch on mesh axis `model`; the split head has no data axis."""
    loss_fn, params, batch = plain_model("hybrid", "ctx")
    step, state = assert_matches(loss_fn, params, batch, steps=5, config=wh.Config(zero_level=level))
    mu = state.opt_state[0].mu
    assert mu["w2"].sharding.spec == P("model") and mu["wh"].sharding.spec == P(None, "model")
    assert state.params["w2"].sharding.spec == (P("model") if level == 3 else P())


@pytest.mark.parametrize("level", [1, 2, 3])
def test_pipeline_plan_matches_single_device(level):
    """2 stages x 4 replicas: the state is spread over every device already; levels 2 and 3 also split
    the packed stage rows over `data` (padded to a multiple of 4) while computing."""
    params, batch = _plain()
    step, state = _compare(_two_stage, params, batch, wh.Config(num_micro_batch=4, zero_level=level))
    mu = state.opt_state[0].mu["w2"]
    assert {s.data.size for s in mu.addressable_shards} == {mu.size // 8}
    assert step.plan.report.stage_buffers().param_width % 4 == 0
    assert step.plan.program.row_specs == (P("stage"), P("stage", "data"))   # the row split at levels 2 and 3


@pytest.mark.parametrize("level", [1, 2, 3])
def test_heterogeneous_uneven_plan_matches_single_device(level):
    loss_fn, params, batch = plain_model("dp", "ctx")
    step, state = assert_matches(loss_fn, params, batch, steps=5, config=wh.Config(zero_level=level),
                                 cluster=wh.Cluster(kinds=HETERO))
    assert len(set(step.plan.batch_sizes)) > 1                      # really the uneven program
    assert state.opt_state[0].mu["wh"].sharding.spec == P("data")


def _one_taskgraph(p, b):
    h = jnp.tanh(jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"])
    return jnp.mean((h @ p["w3"] - b["y"]) ** 2)


def test_gradient_accumulation_with_zero_matches():
    step, _ = _compare(_one_taskgraph, *_plain(3), wh.Config(zero_level=2, num_micro_batch=4))
    assert step.plan.schedule is None
    loss_fn, params, batch = plain_model("hybrid", "ctx")
    params = dict(params, b1=params["b1"] + 0.3, b2=params["b2"] + 0.3, bh=params["bh"] + 0.3)
    assert_matches(loss_fn, params, batch, steps=3, config=wh.Config(zero_level=3, num_micro_batch=2))


def _ops(plan) -> dict:
    counts: dict = {}
    for op, _ in collectives(plan.lowered().compile().as_text()):
        counts[op] = counts.get(op, 0) + 1
    return counts


def test_hlo_reduce_scatters_gradients_at_zero_2_and_3():
    loss_fn, params, batch = plain_model("dp", "ctx")
    plans = {lv: wh.plan(loss_fn, params, batch, adam(), config=wh.Config(zero_level=lv)) for lv in (0, 1, 2, 3)}
    ops = {lv: _ops(p) for lv, p in plans.items()}
    assert "reduce-scatter" not in ops[0] and "reduce-scatter" not in ops[1]
    assert ops[2]["reduce-scatter"] == 6 and ops[3]["reduce-scatter"] == 6       # one per parameter leaf
    assert ops[1]["all-gather"] == 6                                              # new params after the update
    pipe = wh.plan(_two_stage, *_plain(), adam(), config=wh.Config(num_micro_batch=4, zero_level=2))
    assert _ops(pipe).get("reduce-scatter", 0) >= 1                               # the packed stage gradient
    het = wh.plan(loss_fn, params, batch, adam(), config=wh.Config(zero_level=3), cluster=wh.Cluster(kinds=HETERO))
    assert _ops(het).get("reduce-scatter") == 6


def test_compiled_memory_shows_the_per_device_saving():
    """XLA's memory analysis: ZeRO 1 removes 7/8 of the optimizer state from each device's
    arguments, ZeRO 3 also 7/8 of the parameters; ZeRO 2's reduce-scatter shrinks the temporaries."""
    loss_fn, params, batch = plain_model("dp", "ctx")
    full = sum(x.nbytes for x in jax.tree.leaves(params))
    mem = {lv: wh.plan(loss_fn, params, batch, adam(), config=wh.Config(zero_level=lv)).compiled_memory()
           for lv in (0, 1, 2, 3)}
    arg = {lv: m["argument_size_in_bytes"] for lv, m in mem.items()}
    assert arg[0] - arg[1] == 2 * full * 7 // 8
    assert arg[1] == arg[2] and arg[2] - arg[3] == full * 7 // 8
    assert mem[2]["temp_size_in_bytes"] < 0.5 * mem[1]["temp_size_in_bytes"]


def test_summary_reports_when_zero_has_nothing_to_shard():
    """A pipeline with one replica has no data-parallel axis: said in the summary, not ignored silently."""
    params, batch = _plain()
    plan = wh.plan(_two_stage, params, batch, adam(), config=wh.Config(num_micro_batch=4, zero_level=1),
                   cluster=wh.Cluster(kinds=["CPU"] * 2))
    assert "zero 1: nothing to shard" in plan.summary()
