"""Both matmul patterns, the embedding patterns, chosen by communication cost."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import whalex as wh
from conftest import adam, assert_matches, rel_err
from support.models import plain_model


@pytest.mark.parametrize("how", ["scope", "config"])
def test_forcing_each_matmul_pattern_gives_equal_results(how):
    loss_fn, params, batch = plain_model("hybrid", "ctx")
    results = {}
    for pattern in ("column", "row"):
        if how == "scope":
            def forced(p, b, pattern=pattern):
                with wh.replicate(8):
                    h = jnp.tanh(jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"])
                with wh.split(8, pattern=pattern):
                    return optax.softmax_cross_entropy_with_integer_labels(h @ p["wh"] + p["bh"], b["y"]).mean()
            step, state = assert_matches(forced, params, batch, steps=3)
        else:
            step, state = assert_matches(loss_fn, params, batch, steps=3,
                                         config=wh.Config(matmul_pattern=pattern))
        spec = step.plan.param_specs["['wh']"]
        assert spec == (P(None, "model") if pattern == "column" else P("model")), spec
        chosen = [c for c in step.plan.patterns if c.param == "['wh']"]
        assert chosen and chosen[0].pattern == ("SP1 column" if pattern == "column" else "SP2 row")
        results[pattern] = state.params
    for a, b in zip(jax.tree.leaves(results["column"]), jax.tree.leaves(results["row"])):
        assert rel_err(a, b) < 1e-5


def test_auto_picks_column_for_a_wide_head():
    loss_fn, params, batch = plain_model("hybrid", "ctx")
    plan = wh.plan(loss_fn, params, batch, adam())
    (choice,) = [c for c in plan.patterns if c.param == "['wh']"]
    costs = dict(choice.costs)
    assert choice.pattern == "SP1 column" and costs["column"] < costs["row"]


def test_auto_picks_column_then_row_for_a_split_mlp():
    """Megatron's MLP falls out of the cost rule: the second matmul's input is already split."""
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k[0], (16, 64)) / 4, "w2": jax.random.normal(k[1], (64, 16)) / 8}
    batch = {"x": jax.random.normal(k[2], (32, 16)), "t": jnp.ones((32, 16))}

    def loss_fn(p, b):
        with wh.split(8):
            y = jax.nn.gelu(b["x"] @ p["w1"]) @ p["w2"]
        return jnp.mean((y - b["t"]) ** 2)

    step, _ = assert_matches(loss_fn, params, batch, steps=3)
    assert step.plan.param_specs["['w1']"] == P(None, "model")
    assert step.plan.param_specs["['w2']"] == P("model")
    patterns = {c.param: c.pattern for c in step.plan.patterns}
    assert patterns == {"['w1']": "SP1 column", "['w2']": "SP2 row"}
    # no bridge between the two: the column output feeds the row input unchanged
    assert not any("bridge" in c.reason for c in step.plan.comms if c.taskgraph == 0)


class EmbedLM(nn.Module):
    vocab: int = 96

    @nn.compact
    def __call__(self, tokens, targets):
        with wh.split(8):
            e = nn.Embed(self.vocab, 32)(tokens)
        with wh.replicate(8):
            h = nn.tanh(nn.Dense(32)(e))
            logits = nn.Dense(self.vocab)(h)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@pytest.mark.parametrize("pattern,spec", [("auto", P(None, "model")), ("row", P("model"))])
def test_embedding_patterns_match_single_device(pattern, spec):
    model = EmbedLM()
    k = jax.random.split(jax.random.key(3), 2)
    batch = {"tokens": jax.random.randint(k[0], (16, 8), 0, 96), "targets": jax.random.randint(k[1], (16, 8), 0, 96)}
    params = model.init(jax.random.key(0), batch["tokens"], batch["targets"])["params"]
    loss_fn = lambda p, b: model.apply({"params": p}, b["tokens"], b["targets"])
    step, state = assert_matches(loss_fn, params, batch, steps=3, config=wh.Config(matmul_pattern=pattern))
    assert step.plan.param_specs["['Embed_0']['embedding']"] == spec
    table = state.params["Embed_0"]["embedding"]
    assert {s.data.size for s in table.addressable_shards} == {table.size // 8}
