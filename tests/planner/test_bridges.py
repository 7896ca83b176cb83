"""Bridge layers (section 3.2.3): a gather where layouts differ, fused away where they agree."""
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import whalex as wh
from conftest import assert_matches
from support.models import plain_model


def test_replicate_to_split_bridge_gathers_the_batch():
    loss_fn, params, batch = plain_model("hybrid", "ctx")
    step, _ = assert_matches(loss_fn, params, batch, steps=2)
    bridges = [c for c in step.plan.comms if "bridge" in c.reason]
    assert len(bridges) == 1
    (b,) = bridges
    assert b.taskgraph == 1 and b.kind == "all-gather" and b.axes == ("model",)


def test_split_to_split_bridge_is_fused():
    """Two split scopes in a row: the first's column-split output feeds the second unchanged."""
    k = jax.random.split(jax.random.key(1), 3)
    params = {"w1": jax.random.normal(k[0], (16, 64)) / 4, "w2": jax.random.normal(k[1], (64, 16)) / 8}
    batch = {"x": jax.random.normal(k[2], (32, 16))}

    def loss_fn(p, b):
        with wh.split(8):
            h = jnp.tanh(b["x"] @ p["w1"])
        with wh.split(8):
            y = h @ p["w2"]
        return jnp.mean(y ** 2)

    step, _ = assert_matches(loss_fn, params, batch, steps=3)
    assert [t.strategy for t in step.plan.task_graphs][:2] == ["split(8)", "split(8)"]
    into_second = [c for c in step.plan.comms if c.taskgraph == 1 and "bridge" in c.reason]
    assert into_second == []
    assert step.plan.param_specs["['w2']"] == P("model")       # SP2: its input is already split


def test_split_to_replicate_bridge():
    """A split TaskGraph's output consumed by a replicated one is gathered for it, and still exact."""
    k = jax.random.split(jax.random.key(2), 3)
    params = {"w1": jax.random.normal(k[0], (16, 64)) / 4, "w2": jax.random.normal(k[1], (64, 8)) / 8}
    batch = {"x": jax.random.normal(k[2], (32, 16))}

    def loss_fn(p, b):
        with wh.split(8):
            h = jnp.tanh(b["x"] @ p["w1"])
        with wh.replicate(8):
            return jnp.mean((h @ p["w2"]) ** 2)

    step, _ = assert_matches(loss_fn, params, batch, steps=3)
    assert any(c.taskgraph == 1 and "bridge" in c.reason for c in step.plan.comms)
