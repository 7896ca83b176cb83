"""Hardware-aware balance on a declared heterogeneous cluster (8 simulated devices)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import whalex as wh
from conftest import HETERO, adam, assert_matches
from support.models import flax_model, masked_mlp, plain_model


@pytest.mark.parametrize("builder", [plain_model, flax_model])
def test_balanced_data_parallel_matches_single_device(builder):
    loss_fn, params, batch = builder("dp", "ctx")
    cluster = wh.Cluster(kinds=HETERO)
    step, _ = assert_matches(loss_fn, params, batch, steps=5, cluster=cluster)
    plan = step.plan
    rows = np.array(plan.batch_sizes)
    assert rows.sum() == batch["x"].shape[0]                           # the global batch is unchanged
    speeds = np.array(cluster.speeds)
    ideal = rows.sum() * speeds / speeds.sum()
    assert np.all(np.abs(rows - ideal) <= plan.balance.unit)           # proportional within one unit
    assert rows[0] > rows[-1]
    assert plan.balance.applied and plan.balance.source == "spec table"
    assert plan.balance.predicted_speedup > 1.2
    assert "hardware-aware balance of the batch (applied" in plan.summary()


def test_even_plan_when_hardware_aware_is_off():
    loss_fn, params, batch = plain_model("dp", "ctx")
    plan = wh.plan(loss_fn, params, batch, adam(), config=wh.Config(hardware_aware=False),
                   cluster=wh.Cluster(kinds=HETERO))
    assert plan.batch_sizes == (4,) * 8 and not plan.balance.applied
    assert plan.balance.predicted_speedup > 1.2           # what balancing would have given


def test_every_sample_counts_exactly_once():
    """grad of mean(onehot @ w) is 1/B on every sample's coordinate: dropped -> 0, doubled -> 2/B.
    Padding rows are NaN on the host side of the check: if one were read, the result would be NaN."""
    B = 40
    params = {"w": jnp.zeros(B)}
    batch = {"onehot": jnp.eye(B)}

    def loss_fn(p, b):
        return jnp.mean(b["onehot"] @ p["w"])

    cluster = wh.Cluster(kinds=HETERO)
    plan = wh.plan(loss_fn, params, batch, None, cluster=cluster)
    assert len(set(plan.batch_sizes)) > 1 and sum(plan.batch_sizes) == B
    block = max(plan.batch_sizes)                                      # each device's padded block of rows
    x = np.full((len(plan.batch_sizes) * block, B), np.nan, np.float32)  # poison every padding row
    for i, (a, b) in enumerate(plan.device_rows()):
        x[i * block:i * block + (b - a)] = np.asarray(batch["onehot"])[a:b]
    assert x.shape == plan.storage.batch_shapes()["onehot"].shape
    placed = jax.device_put({"onehot": x}, plan.storage.batch_shardings)
    loss, grads = plan.jitted()(jax.device_put(params, plan.storage.param_shardings), placed)
    np.testing.assert_allclose(np.asarray(grads["w"]), np.full(B, 1.0 / B), rtol=1e-6)
    assert np.isfinite(float(loss))
    # and the rows each device owns tile the batch exactly once
    ranges = plan.device_rows()
    assert ranges[0][0] == 0 and ranges[-1][1] == B
    assert all(r0[1] == r1[0] for r0, r1 in zip(ranges, ranges[1:]))
    assert plan.local_rows(0) == [(0, B)]


@pytest.mark.parametrize("model", ["rows", "hybrid"])
def test_each_device_block_is_built_from_its_own_rows(model):
    # the placed batch is the padded layout of the host batch, each device's block built on its own
    # (and padding zeros), for uneven rows and for a hybrid's backbone rows
    loss_fn, params, batch = plain_model("dp", "ctx") if model == "rows" else _head_model()
    plan = wh.plan(loss_fn, params, batch, None, cluster=wh.Cluster(kinds=HETERO))
    storage = plan.storage
    assert len(set(plan.batch_sizes)) > 1
    host = jax.tree.map(np.asarray, batch)
    padded = storage.pad_batch(host)
    placed = plan.place_batch(host)
    for key in host:
        assert placed[key].sharding == storage.batch_shardings[key]
        np.testing.assert_array_equal(np.asarray(placed[key]), padded[key])
        block = max(plan.batch_sizes)
        for d, (a, b) in enumerate(plan.device_rows()):
            np.testing.assert_array_equal(padded[key][d * block:d * block + b - a], host[key][a:b])
            assert not np.any(padded[key][d * block + b - a:(d + 1) * block])
    with pytest.raises(wh.PlanError, match="planned for a global batch"):
        plan.place_batch(jax.tree.map(lambda x: x[:-1], host))


def test_calibrated_speeds_are_used_and_reported():
    from whalex.balance.calibrate import calibrate
    loss_fn, params, batch = plain_model("dp", "ctx")
    measured = calibrate(wh.Cluster.detect(), size=128, chain=2, repeats=3)
    assert measured.speed_source == "calibrated" and len(measured.speeds) == 8
    # pretend half the devices measured 3x slower: the plan follows the measurement
    cluster = measured.with_speeds([3.0] * 4 + [1.0] * 4)
    step, _ = assert_matches(loss_fn, params, batch, steps=3, cluster=cluster)
    assert step.plan.balance.source == "calibrated"
    assert step.plan.batch_sizes[:4] == (6,) * 4 and step.plan.batch_sizes[4:] == (2,) * 4


def test_memory_bound_moves_batch_off_a_small_device():
    loss_fn, params, batch = plain_model("dp", "ctx")
    tiny = wh.DeviceSpec("fast-but-tiny", 100e12, 100e12, 165_000, 1e12)
    cluster = wh.Cluster(kinds=[tiny] + ["V100-32GB"] * 7)
    plan = wh.plan(loss_fn, params, batch, adam(), cluster=cluster)
    r = plan.balance
    assert r.shifted > 0 and r.devices[0].memory <= r.devices[0].capacity
    assert plan.batch_sizes[0] < 32 * 100 / (100 + 7 * 15.7) - 1       # less than its compute share
    with pytest.raises(wh.PlanError, match="model state alone does not fit"):
        wh.plan(loss_fn, params, batch, adam(),
                cluster=wh.Cluster(kinds=[wh.DeviceSpec("t", 1e12, 1e12, 1000, 1e9)] + ["V100-32GB"] * 7))


def _head_model(C=640, B=32):
    D = 24
    k = jax.random.split(jax.random.key(0), 5)
    params = {"w1": jax.random.normal(k[0], (12, D)) / 3, "kernel": jax.random.normal(k[1], (D, C)) / 5,
              "bias": jax.random.normal(k[2], (C,))}
    batch = {"x": jax.random.normal(k[3], (B, 12)), "y": jax.random.randint(k[4], (B,), 0, C)}

    def loss_fn(p, b):
        with wh.replicate(8):
            h = jnp.tanh(b["x"] @ p["w1"])
        with wh.split(8):
            return wh.ops.softmax_cross_entropy_head(h, p["kernel"], p["bias"], b["y"])
    return loss_fn, params, batch


def test_uneven_split_head_matches_single_device():
    loss_fn, params, batch = _head_model()
    # the op is exactly optax's cross-entropy of the dense layer outside whalex
    import optax
    ref = optax.softmax_cross_entropy_with_integer_labels(
        jnp.tanh(batch["x"] @ params["w1"]) @ params["kernel"] + params["bias"], batch["y"]).mean()
    np.testing.assert_allclose(loss_fn(params, batch), ref, rtol=1e-6)

    step, state = assert_matches(loss_fn, params, batch, steps=5, cluster=wh.Cluster(kinds=HETERO))
    r = step.plan.head_balance           # a hybrid: plan.balance is the batch's (tests/lowering/test_uneven_hybrid.py)
    assert r.kind.startswith("classes") and r.applied
    counts = [d.rows for d in r.devices]
    assert sum(counts) == 640 and counts[:4] == [105] * 4 and counts[4:] == [55] * 4     # 15.7 : 8.1
    kernel = state.stored_params["kernel"]              # stored padded: one even buffer per device
    assert kernel.shape == (24, 840) and {s.data.shape for s in kernel.addressable_shards} == {(24, 105)}
    assert step.params(state)["kernel"].shape == (24, 640)
    # the gradient of the split head is never all-reduced, logits never gathered
    from support.hlo import shapes_of
    text = step.plan.lowered().compile().as_text()
    assert (24, 105) not in shapes_of(text, "all-reduce") and (105, 24) not in shapes_of(text, "all-reduce")
    assert not any(640 in s or 840 in s for s in shapes_of(text, "all-gather"))


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_split_head_runs_each_devices_classes_as_one_matmul(opt):
    """A fine split of the classes costs no loop: each device runs one matmul per direction at its
    own class count (a switch over the distinct counts), and trains as one device does."""
    import optax

    from whalex.balance.columns import plan_columns
    speeds = [2.05] * 4 + [1.0] * 4
    cols, _ = plan_columns(2048, speeds, [1e12] * 8, 1.0, [str(i) for i in range(8)], one_matmul=True)
    ideal = 2048 / sum(speeds)
    assert max(c / s for c, s in zip(cols.counts, speeds)) <= 1.02 * ideal           # the split's rounding
    assert len(set(cols.counts)) == 2 and min(cols.counts) % cols.chunk == 0

    text = _assert_dense_head(cols, rows=16, features=24)
    assert "conditional" in text and " while(" not in text

    loss_fn, params, batch = _head_model(C=2048, B=16)
    cluster = wh.Cluster.detect().with_speeds([s * 1e9 for s in speeds])
    step, _ = assert_matches(loss_fn, params, batch, steps=3, cluster=cluster,
                             optimizer=optax.sgd(0.5) if opt == "sgd" else adam())
    assert [d.rows for d in step.plan.head_balance.devices] == list(cols.counts)


@pytest.mark.parametrize("counts", [(0, 16), (16, 0), (10, 6), (8, 8)])
def test_uneven_head_is_the_dense_head_at_any_counts(counts):
    """Loss and gradients of the head equal optax's over the dense layer, a device with no classes
    included."""
    from whalex.columns import UnevenColumns
    _assert_dense_head(UnevenColumns(counts, max(counts), 2), rows=8, features=5)


def _assert_dense_head(cols, rows: int, features: int) -> str:
    """Assert that the uneven head over `cols` (one device per count) has optax's loss and gradients
    over the dense layer; -> its jitted gradient's compiled HLO text."""
    import optax
    from jax.sharding import Mesh

    from whalex.columns import uneven_head
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(rows, features)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(features, cols.classes)) * 0.1, jnp.float32)
    b = jnp.asarray(rng.normal(size=(cols.classes,)), jnp.float32)
    y = jnp.asarray(rng.integers(0, cols.classes, rows), jnp.int32)
    head = uneven_head(Mesh(np.array(jax.devices()[:len(cols.counts)]), ("model",)), "model", (), cols, rows)
    step = jax.jit(jax.value_and_grad(lambda x, w, b: head(x, w, b, y), argnums=(0, 1, 2)))
    padded = (x, cols.pad(w, 1), cols.pad(b, 0))
    loss, (dx, dw, db) = step(*padded)
    dense = lambda x, w, b: optax.softmax_cross_entropy_with_integer_labels(x @ w + b, y).mean()  # noqa: E731
    ref_loss, ref = jax.value_and_grad(dense, argnums=(0, 1, 2))(x, w, b)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, r in zip((dx, cols.unpad(dw, 1), cols.unpad(db, 0)), ref):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-7)
    return step.lower(*padded).compile().as_text()


def test_even_split_head_on_a_homogeneous_cluster_uses_plain_sharding():
    loss_fn, params, batch = _head_model()
    step, state = assert_matches(loss_fn, params, batch, steps=3)
    assert step.plan.balance is None and state.params["kernel"].shape == (24, 640)


def test_memory_model_predicts_xla_memory_analysis():
    """The per-device activation model (a line through XLA's temp bytes at 32 and 128 rows)
    predicts the compiled temp memory at another batch size."""
    from whalex.balance.cost import activation_model, temp_bytes
    from whalex.jaxpr.capture import capture
    from whalex.jaxpr.interpret import make_evaluator
    from whalex.planner.common import micro_batch
    loss_fn, params, batch = plain_model("dp", "ctx")

    def make(rows):
        c = capture(loss_fn, params, micro_batch(batch, rows))
        ev, n = make_evaluator(c.jaxpr, {}, None), c.num_params

        def f(*leaves):
            return jax.value_and_grad(lambda ps: ev(*ps, *leaves[n:])[0])(list(leaves[:n]))
        return (f, *[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in c.jaxpr.jaxpr.invars])

    base, per = activation_model(make)
    assert per > 0
    for rows in (40, 128):
        predicted = base + rows * per
        assert abs(predicted - temp_bytes(*make(rows))) / temp_bytes(*make(rows)) < 0.10


# ---- loads at a fine grain (full chunks plus binary remainder chunks) ----------------

@pytest.mark.parametrize("ratio", [2.0, 3.0, 15.7 / 8.1, 1.3])
@pytest.mark.parametrize("devices", [2, 8])
def test_rounding_to_the_grain_costs_under_one_percent_at_any_batch(ratio, devices):
    """With >= 64 rows per device, the step time of the rounded split is within 1% of the ideal
    proportional one (max over devices of rows_i / speed_i against B / sum(speeds))."""
    from whalex.balance import cost
    from whalex.balance.algorithm import proportional
    speeds = np.array([ratio] * (devices // 2) + [1.0] * (devices - devices // 2))
    for b in [64 * devices, 100 * devices + 3, 2048, 4096, 4116, 6000, 8192, 12345]:
        if b < 64 * devices:
            continue
        grain = cost.balance_grain(b, b * speeds.min() / speeds.sum())
        rows = np.array(proportional(b // grain, speeds)) * grain
        assert rows.sum() == b
        assert (rows / speeds).max() / (b / speeds.sum()) < 1.01, (b, grain, rows)


@pytest.mark.parametrize("b", [4096])
def test_power_of_two_batch_follows_a_two_to_one_split(b):
    """A 2:1 cluster at a power-of-two batch: rows follow the speeds to the grain (the old divisor
    unit gave 5:3 at 4096), the parts cover every row once, the gradient is one all-reduce operand,
    and training equals one device (SGD)."""
    import optax

    from support.hlo import shapes_of
    loss_fn, params, batch = masked_mlp(b)
    cluster = wh.Cluster(devices=jax.devices()[:2]).with_speeds([2e12, 1e12])
    step, _ = assert_matches(loss_fn, params, batch, steps=2, optimizer=optax.sgd(0.5), tol=1e-4, cluster=cluster)
    program, rows = step.plan.program, step.plan.batch_sizes
    assert abs(rows[0] / rows[1] - 2.0) < 0.01 and sum(rows) == b
    assert any(any(bits) for bits in program.remainder_bits)           # remainder chunks run
    ranges = program.part_ranges()
    assert [a for a, _ in ranges] == list(np.cumsum([0] + [n for _, n in ranges])[:-1])  # contiguous, once each
    assert sum(n for _, n in ranges) == b and program.parts.num_parts == len(ranges)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    text = step.plan.lowered().compile().as_text()
    assert (n_params,) in shapes_of(text, "all-reduce")                 # one fused gradient buffer


def test_each_device_runs_its_remainder_as_one_chunk_where_the_remainders_are_few():
    """The uneven program's remainders: a device's rows past its full chunks run as one chunk of their
    own size where the devices' remainders are no more distinct sizes than the binary digits would
    compile; else each binary digit runs. The parts cover every row once either way."""
    from whalex.balance.cost import exact_remainders
    from whalex.lowering.uneven import UnevenProgram

    assert exact_remainders((824, 200), 128, 1) and not exact_remainders((5, 6, 7, 8), 4, 1)
    exact = UnevenProgram(None, None, None, "cpu", (824, 200), 128, 1024, grain=1, exact_remainders=True)
    assert exact.exact_remainders and exact.sizes == (72, 56)
    assert exact.part_sizes(0) == (128,) * 6 + (56,) and exact.part_sizes(1) == (128, 72)
    binary = UnevenProgram(None, None, None, "cpu", (5, 6, 7, 8), 4, 26, grain=1)   # 3 remainders, 2 digits
    assert not binary.exact_remainders and binary.sizes == (2, 1)
    assert [binary.part_sizes(d) for d in range(4)] == [(4, 1), (4, 2), (4, 2, 1), (4, 4)]
    for program in (exact, binary):
        ranges = program.part_ranges()
        assert [a for a, _ in ranges] == list(np.cumsum([0] + [n for _, n in ranges])[:-1])
        assert sum(n for _, n in ranges) == program.global_batch


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_split_with_odd_remainders_trains_as_one_device(optimizer):
    """Rows 11:5 of a 96-row batch (66/30 in 16-row chunks): full chunks, then one remainder chunk per
    device of its own size (2 and 14, where binary digits would run 2, and 8 + 4 + 2), the masked mean
    equal to one device's."""
    import optax

    loss_fn, params, batch = masked_mlp(96, seed=3)
    cluster = wh.Cluster(devices=jax.devices()[:2]).with_speeds([11e12, 5e12])
    opt = optax.sgd(0.5) if optimizer == "sgd" else adam()
    step, _ = assert_matches(loss_fn, params, batch, steps=3, optimizer=opt, tol=1e-4, cluster=cluster)
    program = step.plan.program
    assert step.plan.batch_sizes == (66, 30) and program.chunk == 16 and program.sizes == (14, 2)
    assert program.remainder_bits == ((False, True), (True, False))       # one remainder chunk each
    assert sum(n for _, n in program.part_ranges()) == 96
