"""Uneven batches in hybrid plans. On a declared V100x4+T4x4
cluster, the replicate backbone of Whale's Example 2 runs speed-proportional rows, the split head
keeps its layout (even or uneven class shards), and training equals one device."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import whalex as wh
from balance.test_heterogeneous_balance import _head_model
from conftest import HETERO, adam, assert_matches
from support.models import plain_model

APPLIED = "batch of the replicate TaskGraphs (the split head keeps its layout"


def _check_rows(plan, b):
    rows = np.asarray(plan.batch_sizes)
    assert len(set(plan.batch_sizes)) > 1 and rows.sum() == b
    speeds = np.asarray(plan.cluster.speeds)
    assert np.all(np.abs(rows - b * speeds / speeds.sum()) <= plan.balance.unit)   # proportional within the grain
    assert plan.program_kind == "HybridProgram"
    assert APPLIED in plan.summary()


def _token_model(B=40, T=3, C=64, seed=1):
    """A per-token backbone and a token-weighted cross-entropy on padded rows (some all padding)."""
    rng = np.random.default_rng(seed)
    params = {"w1": jnp.asarray(rng.standard_normal((8, 16), np.float32) / 3),
              "b1": jnp.zeros((16,), jnp.float32),
              "wh": jnp.asarray(rng.standard_normal((16, C), np.float32) / 4),
              "bh": jnp.zeros((C,), jnp.float32)}
    mask = (rng.random((B, T)) > 0.3).astype(np.float32)
    mask[[0, 7, 21, 39]] = 0.0                                     # rows that are all padding
    batch = {"x": jnp.asarray(rng.standard_normal((B, T, 8), np.float32)),
             "y": jnp.asarray(rng.integers(0, C, (B, T)).astype(np.int32)), "mask": jnp.asarray(mask)}

    def loss_fn(p, b):
        with wh.replicate(8):
            h = jax.nn.relu(b["x"] @ p["w1"] + p["b1"])
        with wh.split(8):
            ce = optax.softmax_cross_entropy_with_integer_labels(h @ p["wh"] + p["bh"], b["y"])
            return (ce * b["mask"]).sum() / b["mask"].sum()
    return loss_fn, params, batch


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_uneven_rows_with_uneven_column_head(optimizer):
    """Example 2 with wh.ops' head: rows 5:3 on V100:T4, classes 105:55, exact."""
    from support.hlo import collectives, shapes_of
    loss_fn, params, batch = _head_model()
    opt = optax.sgd(0.1) if optimizer == "sgd" else adam()
    step, state = assert_matches(loss_fn, params, batch, steps=4, optimizer=opt, cluster=wh.Cluster(kinds=HETERO))
    plan = step.plan
    _check_rows(plan, 32)
    assert plan.batch_sizes == (5,) * 4 + (3,) * 4
    assert "classes of ['kernel'] (padded to 105)" in plan.balance.kind
    assert [d.rows for d in plan.head_balance.devices] == [105] * 4 + [55] * 4          # the head keeps its shards
    assert "hardware-aware balance of the classes" in plan.summary()
    assert state.stored_params["kernel"].shape == (24, 840) and step.params(state)["kernel"].shape == (24, 640)
    if optimizer == "sgd":
        text = plan.lowered().compile().as_text()
        reduced = shapes_of(text, "all-reduce")
        assert (24, 105) not in reduced and (105, 24) not in reduced and (105,) not in reduced   # head stays sharded
        assert (12, 24) in reduced                                                       # the backbone's gradient
        features = sorted((op, shape) for op, arrays in collectives(text) for _, shape in arrays
                          if len(shape) == 2 and shape[1] == 24 and shape[0] != 12)
        # the bridge: one all-gather of the padded row blocks (8 x 5) forward, the head's input-gradient
        # psum backward; no re-sharding of the features to the even plan's rows and back
        assert features == [("all-gather", (40, 24)), ("all-reduce", (32, 24))]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_uneven_rows_with_even_split_head(optimizer):
    """models.plain_model('hybrid'): optax's cross-entropy under split(8), an even GSPMD head."""
    loss_fn, params, batch = plain_model("hybrid", "ctx")
    opt = optax.sgd(0.1) if optimizer == "sgd" else adam()
    step, _ = assert_matches(loss_fn, params, batch, steps=4, optimizer=opt, cluster=wh.Cluster(kinds=HETERO))
    _check_rows(step.plan, batch["x"].shape[0])
    assert step.plan.balance.kind == APPLIED + ")"


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_uneven_rows_token_weighted_mean_on_padded_rows(optimizer):
    loss_fn, params, batch = _token_model()
    opt = optax.sgd(0.2) if optimizer == "sgd" else adam()
    step, _ = assert_matches(loss_fn, params, batch, steps=4, optimizer=opt, cluster=wh.Cluster(kinds=HETERO))
    _check_rows(step.plan, 40)
    # every device's rows in order, once: the bridge's gather is a permutation of the global batch
    idx = step.plan.program.gather_index()
    assert len(idx) == 40 and len(set(idx.tolist())) == 40


def test_batch_statistics_in_the_backbone_are_refused():
    """A BatchNorm-style statistic in the replicate backbone changes with uneven rows: a PlanError
    naming it and the way out; hardware_aware=False trains (even batch) and matches one device."""
    loss_fn0, params, batch = _head_model()

    def loss_fn(p, b):
        with wh.replicate(8):
            h = b["x"] @ p["w1"]
            h = jnp.tanh((h - h.mean(axis=0)) / (h.std(axis=0) + 1e-3))
        with wh.split(8):
            return wh.ops.softmax_cross_entropy_head(h, p["kernel"], p["bias"], b["y"])

    with pytest.raises(wh.PlanError, match=r"(?s)replicate backbone.*reduce_sum.*hardware_aware=False"):
        wh.plan(loss_fn, params, batch, adam(), cluster=wh.Cluster(kinds=HETERO))
    step, _ = assert_matches(loss_fn, params, batch, steps=2, optimizer=optax.sgd(0.1),
                             config=wh.Config(hardware_aware=False), cluster=wh.Cluster(kinds=HETERO))
    assert len(set(step.plan.batch_sizes)) == 1


def test_options_not_lowered_keep_the_even_batch_and_say_so():
    loss_fn, params, batch = _head_model()
    plan = wh.plan(loss_fn, params, batch, adam(), config=wh.Config(zero_level=1), cluster=wh.Cluster(kinds=HETERO))
    assert len(set(plan.batch_sizes)) == 1 and plan.program_kind == "Program"
    assert "the batch stays even over the replicate TaskGraphs: zero_level=1" in plan.summary()
    plan = wh.plan(loss_fn, params, batch, adam(), config=wh.Config(hardware_aware=False),
                   cluster=wh.Cluster(kinds=HETERO))
    assert "the batch stays even over the replicate TaskGraphs: hardware_aware=False" in plan.summary()
    plan = wh.plan(loss_fn, params, batch, adam())                          # homogeneous: no report
    assert plan.balance is None and len(set(plan.batch_sizes)) == 1


def test_empty_model_state_keeps_the_uneven_rows():
    """An empty model state (what an NNX model with no BatchStat or Rngs hands the loss) reads
    nothing: the backbone still gets uneven rows. A model state with leaves keeps the even batch."""
    loss0, params, batch = _head_model()

    def loss_fn(p, b, model_state):
        scale = model_state.get("scale", 1.0)
        return loss0(p, b) * scale, model_state

    cluster = wh.Cluster(kinds=HETERO)
    plan = wh.plan(loss_fn, params, batch, adam(), cluster=cluster, model_state={})
    _check_rows(plan, 32)
    plan = wh.plan(loss_fn, params, batch, adam(), cluster=cluster, model_state={"scale": jnp.ones(())})
    assert len(set(plan.batch_sizes)) == 1 and plan.program_kind == "Program"
    assert "model_state inputs are not lowered for uneven hybrid rows yet" in plan.summary()


def test_lower_uneven_hybrid_on_an_abstract_cluster():
    """The hybrid program lowers without devices (64 abstract GPUs, half of them T4s)."""
    loss_fn, params, batch = _head_model(C=64 * 10, B=256)

    def loss64(p, b):
        with wh.replicate(64):
            h = jnp.tanh(b["x"] @ p["w1"])
        with wh.split(64):
            return wh.ops.softmax_cross_entropy_head(h, p["kernel"], p["bias"], b["y"])

    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    cluster = wh.Cluster.abstract(kinds=["V100-32GB"] * 32 + ["T4-16GB"] * 32)
    plan = wh.plan(loss64, params, batch, optimizer=optax.adam(1e-3), cluster=cluster)
    _check_rows(plan, 256)
    text = plan.lower()
    assert "mhlo.num_partitions = 64" in text


def test_stored_vjp_rebuilds_the_pullback_from_stored_residuals():
    """The hybrid backbone's backward reads residuals stored by its forward loop: forwarded
    parameters and inputs are not stored, constants (ReLU's zeros) are rebuilt, and the rebuilt
    pullback equals jax.vjp's."""
    from whalex.lowering.stored_vjp import CONST, INPUT, PARAM, STORED, part_vjp

    def fn(p, x):
        h = jax.nn.relu(x[0] @ p[0] + p[1])
        return [jnp.tanh(h @ p[2]) + np.arange(5, dtype=np.float32)]

    k = jax.random.split(jax.random.key(0), 4)
    params = [jax.random.normal(k[0], (3, 4)), jax.random.normal(k[1], (4,)), jax.random.normal(k[2], (4, 5))]
    part = [jax.random.normal(k[3], (6, 3))]
    pv = part_vjp(fn, *[[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in t] for t in (params, part)])
    kinds = {kind for kind, _ in pv.sources}
    assert {PARAM, INPUT, CONST, STORED} <= kinds
    assert all(s.shape[0] == 6 for s in pv.stored)                     # per-row values only
    ct = [jnp.linspace(-1.0, 1.0, 30).reshape(6, 5)]

    @jax.jit
    def both(params, part, ct):
        out, stored = pv.forward(params, part)
        got = pv.backward(params, part, stored, pv.constants(), ct)
        want_out, vjp = jax.vjp(lambda p: fn(p, part), params)
        return out, want_out, got, vjp(ct)[0]

    out, want_out, got, want = both(params, part, ct)
    np.testing.assert_allclose(out[0], want_out[0], rtol=1e-6)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
