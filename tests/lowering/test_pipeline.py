"""Pipelines (1F1B, GPipe, balanced 1F1B) and gradient accumulation match single-device training."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import whalex as wh
from conftest import adam, assert_matches, reference_train, rel_err
from whalex.balance.partition import partition

# Non-zero bias init: a zero-initialised bias has a scale of lr*steps, which makes the
# per-leaf relative metric measure float noise instead of the plan.
BIAS = nn.initializers.normal(0.5)


def _compare(loss_fn, params, batch, config, steps=3, cluster=None):
    opt = adam()
    ref_losses, ref_params = reference_train(loss_fn, params, batch, opt, steps)
    step = wh.parallelize(loss_fn, opt, config=config, cluster=cluster)
    state = step.init(params, batch)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    errs = jax.tree.map(rel_err, step.params(state), ref_params)
    # 5e-5: Adam on jax 0.12 reassociates to 1.5e-5 on one 13-layer cut; a wrong plan shows 1e-2 or more
    assert max(jax.tree.leaves(errs)) < 5e-5, errs
    assert max(jax.tree.leaves(jax.tree.map(rel_err, ref_params, params))) > 1e-3   # training moved them
    return step, state


def _plain(seed=0):
    k = jax.random.split(jax.random.key(seed), 6)
    params = {"w1": jax.random.normal(k[0], (16, 32)) / 4, "b1": jax.random.normal(k[3], (32,)),
              "w2": jax.random.normal(k[1], (32, 24)) / 6, "w3": jax.random.normal(k[2], (24, 8)) / 5}
    batch = {"x": jax.random.normal(k[4], (64, 16)), "y": jax.random.normal(k[5], (64, 8))}
    return params, batch


def _two_stage(p, b):
    with wh.replicate(1):
        h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    with wh.replicate(1):
        g = jnp.tanh(h @ p["w2"])
        return jnp.mean((g @ p["w3"] - b["y"]) ** 2)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_two_stage_pipeline_with_nested_dp(schedule):
    params, batch = _plain()
    step, state = _compare(_two_stage, params, batch, wh.Config(num_micro_batch=4, schedule=schedule))
    plan = step.plan
    assert plan.schedule.name == schedule and plan.layout.axis_sizes == (4, 2)      # 4 pipeline replicas
    assert [vd.groups for vd in plan.virtual_devices] == [((0,), (2,), (4,), (6,)), ((1,), (3,), (5,), (7,))]
    # the state is stored in the caller's pytree, each leaf spread over every device; each step gathers
    # a device's stage parameters into its row of the [stages, width] buffer
    w1 = state.params["w1"]
    assert len(w1.sharding.device_set) == 8 and {s.data.size for s in w1.addressable_shards} == {w1.size // 8}
    rows = jax.eval_shape(plan.program.pack_params, state.params)["stages"]
    assert rows.shape == (2, plan.program.param_width) and plan.program.row_specs[0] == P("stage")
    assert "bubble" in plan.summary()


class Embed(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(48, bias_init=BIAS)(x)


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.tanh(nn.Dense(self.width, bias_init=BIAS)(x))


class Head(nn.Module):
    @nn.compact
    def __call__(self, x, skip, y):
        out = nn.Dense(4, bias_init=BIAS)(x) + skip[:, :4]
        return jnp.mean((out - y) ** 2)


class FourStages(nn.Module):
    """Four stages with different functions, widths and layer counts (1, 3, 1, 1+head),
    and a skip connection from stage 0 to stage 3 that must be forwarded through 1 and 2."""

    @nn.compact
    def __call__(self, x, y):
        with wh.replicate(1):
            e = Embed()(x)
        with wh.replicate(1):
            h = Block(32)(e)
            h = Block(32)(h)
            h = Block(24)(h)
        with wh.replicate(1):
            h = Block(40)(h)
        with wh.replicate(1):
            h = Block(16)(h)
            return Head()(h, e, y)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "1f1b-balanced"])
def test_four_stage_pipeline_different_stages_uneven_layers(schedule):
    model = FourStages()
    k = jax.random.split(jax.random.key(1), 3)
    batch = {"x": jax.random.normal(k[0], (32, 12)), "y": jax.random.normal(k[1], (32, 4))}
    params = model.init(k[2], batch["x"], batch["y"])["params"]
    loss_fn = lambda p, b: model.apply({"params": p}, b["x"], b["y"])
    step, _ = _compare(loss_fn, params, batch, wh.Config(num_micro_batch=8, schedule=schedule))
    assert step.plan.layout.axis_sizes == (2, 4)
    assert [len(l) for l in step.plan.stage_layers] == [1, 3, 1, 2]
    assert step.plan.schedule.slots == {"1f1b": 4, "gpipe": 8, "1f1b-balanced": 7}[schedule]


def test_stages_with_replicate_2_fold_into_data_parallelism():
    def loss_fn(p, b):
        with wh.replicate(2):
            h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
        with wh.replicate(2):
            return jnp.mean((jnp.tanh(h @ p["w2"]) @ p["w3"] - b["y"]) ** 2)
    params, batch = _plain(2)
    step, _ = _compare(loss_fn, params, batch, wh.Config(num_micro_batch=2))
    assert step.plan.layout.axis_sizes == (4, 2)


def test_gradient_accumulation_matches_the_large_batch_step():
    params, batch = _plain(3)

    def loss_fn(p, b):
        h = jnp.tanh(jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"])
        return jnp.mean((h @ p["w3"] - b["y"]) ** 2)

    step, _ = _compare(loss_fn, params, batch, wh.Config(num_micro_batch=4))
    assert step.plan.schedule is None and step.plan.global_batch == 64


def test_gradient_accumulation_on_the_collocated_hybrid():
    from support.models import plain_model
    loss_fn, params, batch = plain_model("hybrid", "ctx")
    params = dict(params, b1=params["b1"] + 0.3, b2=params["b2"] + 0.3, bh=params["bh"] + 0.3)
    step, _ = assert_matches(loss_fn, params, batch, steps=3, config=wh.Config(num_micro_batch=2))
    assert step.plan.schedule is None


class Deep(nn.Module):
    @nn.compact
    def __call__(self, x, y):
        x = nn.Dense(32, bias_init=BIAS)(x)
        for _ in range(12):
            x = x + nn.tanh(nn.Dense(32, bias_init=BIAS)(x))
        return jnp.mean((nn.Dense(4, bias_init=BIAS)(x) - y) ** 2)


def deep_model():
    """(loss_fn, params, batch) of `Deep` on a 64-row batch: 14 Dense layers for stage cuts to move."""
    model = Deep()
    k = jax.random.split(jax.random.key(0), 3)
    batch = {"x": jax.random.normal(k[0], (64, 8)), "y": jax.random.normal(k[1], (64, 4))}
    params = model.init(k[2], batch["x"], batch["y"])["params"]
    return (lambda p, b: model.apply({"params": p}, b["x"], b["y"])), params, batch


def test_auto_parallel_balances_flops_and_matches():
    loss_fn, params, batch = deep_model()
    config = wh.Config(num_micro_batch=4, num_task_graph=4, auto_parallel=True)
    step, _ = _compare(loss_fn, params, batch, config)
    flops = [t.flops for t in step.plan.task_graphs]
    assert len(flops) == 4
    assert max(flops) / np.mean(flops) < 1.10 and min(flops) / np.mean(flops) > 0.90, flops
    assert sum(len(l) for l in step.plan.stage_layers) == 14      # 12 blocks + input and output layers


def test_partition_respects_memory():
    flops = [1.0] * 12
    state = [10.0] * 12
    even = partition(flops, state, [0.0] * 12, [1.0] * 4, [1000.0] * 4)
    assert even == [0, 3, 6, 9]
    # stage 1's device can hold only 2 layers: it gets fewer, the others take more
    tight = partition(flops, state, [0.0] * 12, [1.0] * 4, [1000.0, 25.0, 1000.0, 1000.0])
    sizes = np.diff(tight + [12])
    assert sizes[1] <= 2 and sizes.sum() == 12
    with pytest.raises(wh.PlanError, match="fits the devices' memory"):
        partition(flops, state, [0.0] * 12, [1.0] * 4, [15.0] * 4)


def test_auto_parallel_gives_a_small_memory_device_fewer_layers():
    loss_fn, params, batch = deep_model()
    small = wh.DeviceSpec("tiny", 1e12, 1e12, 40_000, 1e11)      # 40 KB: about two blocks with Adam
    big = wh.DeviceSpec("big", 1e12, 1e12, 10**9, 1e11)
    cluster = wh.Cluster(kinds=[big, small, big, big] * 2)
    config = wh.Config(num_micro_batch=4, num_task_graph=4, auto_parallel=True)
    plan = wh.plan(loss_fn, params, batch, adam(), config=config, cluster=cluster)
    free = wh.plan(loss_fn, params, batch, adam(), config=config, cluster=wh.Cluster(kinds=[big] * 8))
    # devices are ordered by memory (section 3.3.2): the two tiny devices hold the last stage
    assert [vd.groups for vd in plan.virtual_devices][-1] == ((1,), (5,))
    tight, loose = plan.task_graphs[-1], free.task_graphs[-1]
    assert len(plan.stage_layers[-1]) < len(free.stage_layers[-1]), (plan.stage_layers, free.stage_layers)
    assert tight.param_bytes * 4 <= small.memory_bytes < loose.param_bytes * 4      # params+grads+Adam


def test_pipeline_errors():
    params, batch = _plain()
    with pytest.raises(wh.PlanError, match="multiple of 16"):          # 4 replicas x 4 micro-batches
        wh.plan(_two_stage, params, {k: v[:40] for k, v in batch.items()}, adam(),
                config=wh.Config(num_micro_batch=4))
    with pytest.raises(wh.PlanError, match="does not divide the global batch"):
        wh.plan(_two_stage, params, {k: v[:63] for k, v in batch.items()}, adam(),
                config=wh.Config(num_micro_batch=4))

    def three(p, b):
        with wh.replicate(1):
            h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
        with wh.replicate(1):
            g = jnp.tanh(h @ p["w2"])
        with wh.replicate(1):
            return jnp.mean((g @ p["w3"] - b["y"]) ** 2)
    with pytest.raises(wh.PlanError, match="3 pipeline stages of 1 device"):
        wh.plan(three, params, batch, adam(), config=wh.Config(num_micro_batch=2))
    with pytest.raises(wh.ConfigError, match="unknown pipeline schedule"):
        wh.Config(num_micro_batch=2, schedule="zero-bubble")

    def mixed(p, b):
        with wh.replicate(1):
            h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
        with wh.replicate(2):
            return jnp.mean((jnp.tanh(h @ p["w2"]) @ p["w3"] - b["y"]) ** 2)
    with pytest.raises(wh.PlanError, match="different device counts"):
        wh.plan(mixed, params, batch, adam(), config=wh.Config(num_micro_batch=2))


def test_split_stage_in_a_pipeline_is_refused_clearly():
    params, batch = _plain()

    def loss_fn(p, b):
        with wh.replicate(1):
            h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
        with wh.split(4):
            return jnp.mean((jnp.tanh(h @ p["w2"]) @ p["w3"] - b["y"]) ** 2)
    with pytest.raises(wh.PlanError, match="split stages inside a pipeline are not supported"):
        wh.plan(loss_fn, params, batch, adam(), config=wh.Config(num_micro_batch=2))


def test_gradient_accumulator_segments_add_each_stage_into_its_own_width():
    """The accumulator is held as segments cut at every stage's width; a stage's backward adds whole
    segments of its own width (in place) and passes the rest through: the sum is a prefix add."""
    from whalex.lowering.pipeline.packing import add_segments as _add_segments, bounds as _bounds
    bounds = _bounds([10, 3, 7, 10, 0], 12)
    assert bounds == (0, 3, 7, 10, 12)
    assert _bounds([5, 5], 5) == (0, 5)
    rng = np.random.default_rng(0)
    want = np.zeros((2, 12), np.float32)
    segs = tuple(jnp.zeros((2, b - a)) for a, b in zip(bounds[:-1], bounds[1:]))
    for w in (10, 3, 7, 3, 12):
        x = rng.standard_normal((2, w)).astype(np.float32)
        want[:, :w] += x
        segs = _add_segments(segs, jnp.asarray(x), bounds, 1)
    assert [s.shape[1] for s in segs] == [3, 4, 3, 2]
    np.testing.assert_allclose(np.concatenate(segs, axis=1), want, rtol=1e-6)
    with pytest.raises(AssertionError):            # a width that is no stage's: not a boundary
        _add_segments(segs, jnp.ones((2, 5)), bounds, 1)


def test_messages_are_half_where_every_boundary_value_is_and_round_trip_exactly():
    """A message between stages is a 16-bit float row where every boundary value is of that dtype (or
    boolean), else float32; `unpack(pack(values))` gives back every value bit for bit."""
    from types import SimpleNamespace

    from whalex.lowering.pipeline.packing import Message, layout, unpack

    def var(shape, dtype):
        return SimpleNamespace(aval=jax.ShapeDtypeStruct(shape, dtype))

    bf16, f16 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
    cases = {(bf16,): bf16, (bf16, jnp.bool_): bf16, (f16,): f16, (bf16, jnp.float32): jnp.float32,
             (bf16, jnp.int32): jnp.float32, (bf16, f16): jnp.float32, (jnp.bool_,): jnp.float32, (): jnp.float32}
    for dtypes, want in cases.items():
        boundaries = [[var((2, 3), d) for d in dtypes], [var((5,), dtypes[0])] if dtypes else []]
        msg = Message.of(boundaries)
        assert msg.dtype == jnp.dtype(want), dtypes
        assert msg.width == max(6 * len(dtypes), 5 if dtypes else 1)
        assert msg.nbytes == msg.width * jnp.dtype(want).itemsize
        slots, _ = layout(boundaries[0])
        rng = np.random.default_rng(0)
        values = [jnp.asarray(rng.standard_normal((2, 3)) * 100).astype(d) if jnp.issubdtype(d, jnp.floating)
                  else jnp.asarray(rng.integers(-2**31, 2**31 - 1, (2, 3)), jnp.int32).astype(d) for d in dtypes]
        flat = msg.pack(values)
        assert flat.shape == (msg.width,) and flat.dtype == msg.dtype
        for got, v in zip(unpack(flat, slots), values):
            assert got.dtype == v.dtype
            np.testing.assert_array_equal(np.asarray(got), np.asarray(v))
