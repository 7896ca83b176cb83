"""Pipelines train exactly with any optax transformation (factored, masked,
multi_transform, global-norm clipping) and with tied parameters (one embedding read by the first
stage's lookup and the last stage's logits), against single-device training of the same model."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import whalex as wh
from conftest import reference_train, rel_err, whalex_train

V, D, T, B = 32, 16, 8, 16          # vocabulary, width, sequence length, global batch


def _ln(x, g):
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.mean((x - m) ** 2, -1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * g


def _attention(p, x):
    """Causal single-head attention, residual."""
    h = _ln(x, p["g1"])
    q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
    a = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(D)
    a = jnp.where(jnp.tril(jnp.ones((T, T), bool)), a, -1e9)
    return x + jnp.einsum("bts,bsd->btd", jax.nn.softmax(a, -1), v) @ p["wo"]


def _mlp(p, x):
    return x + jnp.tanh(_ln(x, p["g2"]) @ p["w1"]) @ p["w2"]


def lm_params(seed=0, tied=True):
    ks = iter(jax.random.split(jax.random.key(seed), 32))
    n = lambda shape, s: s * jax.random.normal(next(ks), shape)  # noqa: E731

    def block(attention):
        p = {"g2": 1 + n((D,), 0.1), "w1": n((D, 2 * D), 0.3), "w2": n((2 * D, D), 0.3)}
        if attention:
            p.update(g1=1 + n((D,), 0.1), wq=n((D, D), 0.3), wk=n((D, D), 0.3), wv=n((D, D), 0.3),
                     wo=n((D, D), 0.3))
        return p

    p = {"emb": n((V, D), 1.0), "pos": n((T, D), 0.3), "b0": block(True), "b1": block(False), "b2": block(False),
         "lnf": 1 + n((D,), 0.1)}
    if not tied:
        p["out"] = n((D, V), 1.0)
    return p


def lm_batch(seed=1):
    tok = jax.random.randint(jax.random.key(seed), (B, T + 1), 0, V)
    return {"tok": tok[:, :-1], "y": tok[:, 1:]}


def lm_loss(p, b):
    """A decoder-only LM in 4 stages (attention and MLP blocks kept few: compile time); the logits read
    the input embedding (`out` when untied)."""
    with wh.replicate(1):
        x = _mlp(p["b0"], _attention(p["b0"], p["emb"][b["tok"]] + p["pos"]))
    with wh.replicate(1):
        x = _mlp(p["b1"], x)
    with wh.replicate(1):
        x = _mlp(p["b2"], x)
    with wh.replicate(1):
        out = p["out"] if "out" in p else p["emb"].T
        logits = _ln(x, p["lnf"]) @ out
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])
        return jnp.mean(jnp.sum(ce, axis=1))


def _check(optimizer, schedule, params=None, steps=3):
    params = lm_params() if params is None else params
    batch = lm_batch()
    ref_losses, ref = reference_train(lm_loss, params, batch, optimizer, steps)
    losses, state, step = whalex_train(lm_loss, params, batch, optimizer, steps,
                                       config=wh.Config(num_micro_batch=4, schedule=schedule))
    assert step.plan.schedule.num_stages == 4 and step.plan.layout.axis_sizes == (2, 4)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    errs = jax.tree.map(rel_err, state.params, ref)
    assert max(jax.tree.leaves(errs)) < 1e-4, errs
    assert max(jax.tree.leaves(jax.tree.map(rel_err, ref, params))) > 1e-3        # training moved them
    return step, state, ref


def _emb_label(p):
    return jax.tree_util.tree_map_with_path(lambda path, _: "emb" if path[0].key == "emb" else "rest", p)


OPTIMIZERS = {
    # min_dim_size_to_factor=8: the tiny matrices are really factored (row and column statistics)
    "adafactor": (lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8), "1f1b"),
    "lamb": (lambda: optax.lamb(1e-2), "gpipe"),
    "lars": (lambda: optax.lars(1.0), "1f1b"),           # per-leaf trust ratios (0.001 * |p| / |g|)
    "multi_transform": (lambda: optax.multi_transform({"emb": optax.adam(3e-2, eps=1e-4),
                                                       "rest": optax.sgd(1e-2)}, _emb_label), "1f1b"),
    "adamw_mask": (lambda: optax.adamw(1e-2, eps=1e-4, weight_decay=0.5,
                                       mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)), "gpipe"),
    "clip_adam": (lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2, eps=1e-4)), "1f1b"),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_any_optax_transformation_trains_a_4_stage_pipeline_exactly(name):
    make, schedule = OPTIMIZERS[name]
    step, state, _ = _check(make(), schedule)
    if name == "clip_adam":        # the clipping really triggered: the gradient's global norm exceeds 1
        norm = optax.tree.norm(jax.jit(jax.grad(lm_loss))(lm_params(), lm_batch()))
        assert float(norm) > 1.0, norm
    if name == "adafactor":        # factored statistics of a caller-shaped leaf, not of a packed buffer
        factored = state.opt_state[0]
        assert factored.v_row["b0"]["w1"].size > 1 and factored.v["b0"]["w1"].shape == (1,)
        assert not factored.v_row["emb"].sharding.is_fully_replicated      # spread like the parameters


def test_tied_embedding_across_the_first_and_last_stage():
    """SGD here (a gradient summed twice or once would show); the optimizer tests above train the same tied
    model with Adam-family updates."""
    params = lm_params()
    step, state, ref = _check(optax.sgd(0.05), "gpipe", params)
    program = step.plan.program
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    emb = next(k for k, path in enumerate(paths) if path[0].key == "emb")
    with_emb = [s for s, ps in enumerate(program.cut.params) if emb in ps]
    assert with_emb == [0, 3]                                            # both stages hold it
    # one copy in the caller's pytree, spread over every device
    assert jax.tree.structure(state.params) == jax.tree.structure(params)
    assert len(state.params["emb"].sharding.device_set) == 8
    # the stage rows computed from it hold identical copies
    rows = jax.device_get(jax.jit(program.pack_params)(state.params)["stages"])
    # the step's explicit all-gather / all-to-all builds the same rows
    np.testing.assert_array_equal(jax.device_get(jax.jit(program.gather_rows())(state.params)["stages"]), rows)
    copies = [rows[s, sl.offset:sl.offset + sl.size] for s in with_emb
              for p, sl in zip(program.cut.params[s], program.param_slots[s]) if p == emb]
    np.testing.assert_array_equal(copies[0], copies[1])
    np.testing.assert_array_equal(copies[0].reshape(V, D), np.asarray(state.params["emb"]))


def test_untied_model_lists_each_leaf_in_one_stage():
    params = lm_params(tied=False)
    plan = wh.plan(lm_loss, params, lm_batch(), optax.sgd(0.05), config=wh.Config(num_micro_batch=4))
    listed = [p for ps in plan.program.cut.params for p in ps]
    assert len(listed) == len(set(listed)) == len(jax.tree.leaves(params))
