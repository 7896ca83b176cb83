"""Plans in parts of any size: a part's trace differs from the whole batch's only by identities JAX
leaves out (a mask broadcast to `(batch,) + shape` at one row), which whalex aligns; a real difference
is refused with the first differing equation of each trace, its line and both sizes."""
import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import whalex as wh
from conftest import HETERO, adam, assert_matches
from whalex.jaxpr.batch_dependence import traces_alike
from whalex.jaxpr.capture import capture
from whalex.loss.align import align, difference

S, D, V, B = 8, 16, 32, 16


class CausalSelfAttention(nn.Module):
    """Hugging Face Flax Llama's masking: the causal mask broadcast to `(batch_size,) + shape[1:]`
    (an identity at one row, which JAX then leaves out of the trace) and combined with the padding mask."""

    heads: int = 2

    @nn.compact
    def __call__(self, x, attention_mask):
        batch_size, seq = x.shape[:2]
        causal_mask = nn.make_causal_mask(jnp.ones((1, seq), bool), dtype=bool)
        causal_mask = jnp.broadcast_to(causal_mask, (batch_size,) + causal_mask.shape[1:])
        attention_mask = jnp.broadcast_to(jnp.expand_dims(attention_mask, axis=(-3, -2)), causal_mask.shape)
        mask = nn.combine_masks(attention_mask, causal_mask)
        bias = jax.lax.select(mask > 0, jnp.zeros(mask.shape, x.dtype), jnp.full(mask.shape, -1e9, x.dtype))
        qkv = nn.DenseGeneral((3, self.heads, D // self.heads), use_bias=False)(x)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        out = nn.dot_product_attention(q, k, v, bias=bias)
        return nn.DenseGeneral(D, axis=(-2, -1), use_bias=False)(out)


class TinyLlama(nn.Module):
    @nn.compact
    def __call__(self, ids, attention_mask):
        x = nn.Embed(V, D)(ids)
        x = x + CausalSelfAttention()(nn.RMSNorm()(x), attention_mask)
        x = x + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(nn.RMSNorm()(x))))
        return nn.Dense(V)(nn.RMSNorm()(x))


def _llama(batch=B):
    model = TinyLlama()
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, V, (batch, S)), jnp.int32)
    mask = jnp.asarray(np.arange(S)[None, :] < rng.integers(S // 2, S + 1, (batch, 1)), jnp.int32)
    data = {"ids": ids, "mask": mask, "y": jnp.roll(ids, -1, axis=1)}
    params = model.init(jax.random.key(1), ids, mask)["params"]

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["ids"], b["mask"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])
        return (ce * b["mask"]).sum() / b["mask"].sum()
    return loss_fn, params, data


def _optimizer(name):
    return optax.sgd(0.5) if name == "sgd" else adam()


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_broadcast_mask_on_uneven_rows_of_one_sample(opt):
    """V100 x 4 + T4 x 4, hardware_aware=True, batch 16: the T4s take one row each."""
    loss_fn, params, batch = _llama()
    step, _ = assert_matches(loss_fn, params, batch, steps=3, optimizer=_optimizer(opt),
                             cluster=wh.Cluster(kinds=HETERO))
    plan = step.plan
    assert plan.program_kind == "UnevenProgram" and 1 in plan.batch_sizes and sum(plan.batch_sizes) == B


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_broadcast_mask_in_a_pipeline_of_one_sample_micro_batches(opt):
    """auto_parallel, 2 stages x 4 pipeline replicas, 4 micro-batches at batch 16: one row each."""
    loss_fn, params, batch = _llama()
    config = wh.Config(auto_parallel=True, num_task_graph=2, num_micro_batch=4)
    step, _ = assert_matches(loss_fn, params, batch, steps=3, optimizer=_optimizer(opt), config=config,
                             cluster=wh.Cluster.detect())
    plan = step.plan
    assert plan.program_kind == "PipelineProgram" and plan.report.captured.global_batch == 1
    assert len(plan.task_graphs) == 2


def test_broadcast_mask_under_gradient_accumulation_of_one_sample():
    loss_fn, params, batch = _llama()
    step, _ = assert_matches(loss_fn, params, batch, steps=2, optimizer=optax.sgd(0.5),
                             config=wh.Config(num_micro_batch=B), cluster=wh.Cluster(kinds=["V100-32GB"]))
    assert step.plan.report.captured.global_batch == 1


def _abstract(batch):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((1,) + x.shape[1:], x.dtype), batch)


def test_aligned_part_has_the_whole_equations_and_the_same_values():
    loss_fn, params, batch = _llama()
    whole = capture(loss_fn, params, batch)
    raw = capture(loss_fn, params, _abstract(batch))
    assert not traces_alike(raw.jaxpr.jaxpr, whole.jaxpr.jaxpr)       # JAX left the identity broadcast out
    part = align(raw, whole)
    jp, jg = part.jaxpr.jaxpr, whole.jaxpr.jaxpr
    assert traces_alike(jp, jg) and difference(part, whole) is None
    assert [part.assign[(i,)] for i in range(len(jp.eqns))] == [whole.assign[(i,)] for i in range(len(jg.eqns))]
    added = len(jp.eqns) - len(raw.jaxpr.jaxpr.eqns)
    assert added >= 1
    one = jax.tree.map(lambda x: x[:1], batch)
    leaves = jax.tree.leaves(params) + jax.tree.leaves(one)
    got = jax.core.eval_jaxpr(jp, part.jaxpr.consts, *leaves)
    want = jax.core.eval_jaxpr(raw.jaxpr.jaxpr, raw.jaxpr.consts, *leaves)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


def test_a_left_out_broadcast_is_told_from_another_broadcast_of_the_same_value():
    """The left-out `(b, 1, S, S)` broadcast is matched as an identity, not paired with the
    `(b, H, S, S)` one that follows it; a scope around it keeps its TaskGraph."""
    params = {"w": jnp.ones((S, S))}

    def loss_fn(p, b):
        m = jnp.tril(jnp.ones((1, 1, S, S)))
        with wh.replicate(8):
            first = jnp.broadcast_to(m, (b["x"].shape[0], 1, S, S))
        second = jnp.broadcast_to(m, (b["x"].shape[0], 3, S, S))
        h = b["x"][:, None] @ p["w"]
        return jnp.mean(h * first) + jnp.mean(h * second)

    whole = capture(loss_fn, params, {"x": jnp.ones((B, S, S))})
    part = align(capture(loss_fn, params, {"x": jax.ShapeDtypeStruct((1, S, S), jnp.float32)}), whole)
    assert traces_alike(part.jaxpr.jaxpr, whole.jaxpr.jaxpr)
    tg = [part.taskgraphs[part.assign[(i,)]].annotated for i in range(len(part.jaxpr.jaxpr.eqns))]
    assert tg == [whole.taskgraphs[whole.assign[(i,)]].annotated for i in range(len(whole.jaxpr.jaxpr.eqns))]
    assert any(tg)
    step, _ = assert_matches(loss_fn, params, {"x": jax.random.normal(jax.random.key(0), (B, S, S))}, steps=2,
                             optimizer=optax.sgd(0.1), cluster=wh.Cluster(kinds=HETERO))
    assert 1 in step.plan.batch_sizes


def _branching(p, b):
    h = b["x"] @ p["w"]
    if h.shape[0] > 1:                                     # a real difference: only with 2 rows or more
        h = jnp.tanh(h)
    return jnp.mean((h - b["y"]) ** 2)


_TANH_LINE = inspect.getsourcelines(_branching)[1] + 3


@pytest.mark.parametrize("kind", ["uneven", "pipeline", "micro-batches"])
def test_a_real_batch_size_branch_names_the_equation_its_line_and_both_sizes(kind):
    params = {"w": jnp.ones((4, 2))}
    batch = {"x": jnp.ones((B, 4)), "y": jnp.ones((B, 2))}
    kwargs, way_out = {
        "uneven": (dict(cluster=wh.Cluster(kinds=HETERO)), "wh.Config(hardware_aware=False)"),
        "pipeline": (dict(config=wh.Config(auto_parallel=True, num_task_graph=2, num_micro_batch=4),
                          cluster=wh.Cluster.detect()), "a global batch of 32"),
        "micro-batches": (dict(config=wh.Config(num_micro_batch=B), cluster=wh.Cluster(kinds=["V100-32GB"])),
                          "num_micro_batch=1"),
    }[kind]
    with pytest.raises(wh.PlanError) as err:
        wh.plan(_branching, params, batch, optax.sgd(0.1), **kwargs)
    msg = str(err.value)
    assert "traces differently at 1 and 16 samples" in msg
    assert f"`tanh` at {__file__}:{_TANH_LINE} (_branching): `h = jnp.tanh(h)`" in msg, msg   # equation, line
    assert "in the trace at 16 samples, where the trace at 1 has `sub`" in msg
    assert way_out in msg and "Python branch" not in msg
    # the same loss trains where its parts trace like the whole batch
    if kind == "micro-batches":
        wh.plan(_branching, params, batch, optax.sgd(0.1), config=wh.Config(num_micro_batch=4),
                cluster=wh.Cluster(kinds=["V100-32GB"]))
