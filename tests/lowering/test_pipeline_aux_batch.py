"""`has_aux` in pipelines, and each stage device holds only its batch leaves.

A tiny language model on padded sequences (token-weighted cross-entropy, some rows all padding) in
2 and 4 stages, both schedules, SGD and Adam, against single-device training; its aux has
per-example rows (float, int, a batch leaf itself), a ratio of sums, a max over the batch and an
integer count, each equal to the single-device aux of the same parameters."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import whalex as wh
from conftest import adam, rel_err
from loss.test_loss_contract import B, T, lm_batch, lm_hidden, lm_params  # the padded LM and its data

none = contextlib.nullcontext
rep1 = lambda: wh.replicate(1)  # noqa: E731


def lm_loss(scopes, normaliser="targets"):
    """scopes: one context factory per layer (embedding, w1, w2, head + loss + aux)."""

    def loss_fn(p, b):
        h = lm_hidden(scopes, p, b)
        with scopes[3]():
            logits = h @ p["out"]
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"])
            w = (b[normaliser] > 0).astype(jnp.float32)
            loss = (ce * w).sum() / jnp.maximum(w.sum(), 1.0)
            pred = logits.argmax(-1)
            aux = {"per_example": (ce * w).sum(-1),                       # rows, float
                   "pred": pred,                                           # rows, int
                   "weight": b["weight"],                                  # rows: a batch leaf as it is
                   "accuracy": ((pred == b["targets"]) * w).sum() / w.sum(),   # a ratio of sums
                   "max_logit": logits.max(),                              # a max over the batch
                   "correct": (pred == b["targets"]).sum()}                # an integer count
            return loss, aux

    return loss_fn


def reference(loss_fn, params, batch, optimizer, steps):
    """Single-device training: (losses, auxes before each update, final params)."""
    opt_state = optimizer.init(params)

    @jax.jit
    def step(p, o):
        (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(p, batch)
        u, o = optimizer.update(g, o, p)
        return optax.apply_updates(p, u), o, loss, aux

    losses, auxes = [], []
    for _ in range(steps):
        params, opt_state, loss, aux = step(params, opt_state)
        losses.append(float(loss))
        auxes.append(jax.tree.map(np.asarray, aux))
    return losses, auxes, params


def check_aux(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for k in want:
        g, w = np.asarray(got[k]), np.asarray(want[k])
        assert g.shape == w.shape and g.dtype == w.dtype, (k, g.shape, w.shape, g.dtype, w.dtype)
        if np.issubdtype(w.dtype, np.floating):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=k)
        else:
            np.testing.assert_array_equal(g, w, err_msg=k)


OPTS = {"sgd": lambda: optax.sgd(0.5), "adam": lambda: adam(1e-2)}
CASES = [(2, "1f1b", "sgd"), (2, "gpipe", "adam"), (4, "1f1b", "adam"), (4, "gpipe", "sgd")]


def train(stages, schedule, opt, steps=3, normaliser="targets"):
    scopes = (rep1,) * 4 if stages == 4 else (rep1, rep1, none, none)
    loss_fn = lm_loss(scopes, normaliser)
    ref_losses, ref_auxes, ref_params = reference(lm_loss((none,) * 4, normaliser), lm_params(), lm_batch(),
                                                  OPTS[opt](), steps)
    step = wh.parallelize(loss_fn, OPTS[opt](), has_aux=True,
                          config=wh.Config(num_micro_batch=4, schedule=schedule))
    state = step.init(lm_params(), lm_batch())
    losses = []
    for k in range(steps):
        state, metrics = step(state, lm_batch())
        losses.append(float(metrics["loss"]))
        check_aux(metrics["aux"], ref_auxes[k])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    errs = jax.tree.map(rel_err, step.params(state), ref_params)
    assert max(jax.tree.leaves(errs)) < 1e-4, errs
    assert max(jax.tree.leaves(jax.tree.map(rel_err, ref_params, lm_params()))) > 1e-3     # training moved
    return step, state


@pytest.mark.parametrize("stages,schedule,opt", CASES)
def test_pipeline_has_aux_matches_single_device(stages, schedule, opt):
    step, _ = train(stages, schedule, opt)
    assert step.plan.layout.axis_sizes == (8 // stages, stages)
    assert step.plan.program.row_outputs              # per-example aux went through the pipeline


def test_each_stage_device_holds_only_its_batch_leaves():
    step, state = train(4, "1f1b", "sgd", steps=2)
    program = step.plan.program
    layout = program.batch_layout
    names = ["inputs", "targets", "weight"]                  # the batch's leaves, in pytree order
    readers = {n: layout.readers(k) for k, n in enumerate(names)}
    assert readers == {"inputs": (0,), "targets": (3,), "weight": (3,)}, readers
    batch = lm_batch()
    placed = step.plan.place_batch(batch)
    dp, per_replica = 2, B // 2
    for g, buf in placed.buffers.items():
        assert buf.sharding.spec == jax.sharding.PartitionSpec("stage", "data")
        for shard in buf.addressable_shards:
            assert shard.data.shape == (1, per_replica, dict(layout.widths)[g])      # one stage's row only
            s, rows = shard.index[0].start, shard.index[1]
            for sl in layout.stages[s]:
                if sl.group == g:
                    want = np.asarray(batch[names[sl.leaf]])[rows].reshape(per_replica, -1)
                    np.testing.assert_array_equal(np.asarray(shard.data[0, :, sl.offset:sl.offset + sl.width]), want)
    host = step.plan.place_batch(jax.tree.map(np.asarray, batch))        # host leaves: read per device shard
    for g in placed.buffers:
        np.testing.assert_array_equal(np.asarray(host.buffers[g]), np.asarray(placed.buffers[g]))
    state, metrics = step(state, placed)                # the step takes a batch placed by its plan
    ref_losses, _, _ = reference(lm_loss((none,) * 4), lm_params(), batch, OPTS["sgd"](), 3)
    np.testing.assert_allclose(float(metrics["loss"]), ref_losses[2], rtol=1e-5)
    # the compiled step takes the batch in that layout: every device a quarter of what it held
    compiled = program.lower().compile()
    batch_in = jax.tree.leaves(compiled.input_shardings[0][1])
    assert batch_in and all(s.spec == jax.sharding.PartitionSpec("stage", "data") for s in batch_in)
    # int32 row: the widest int stage (T tokens); float32 row: the weight; was the whole batch (2T+1)
    assert layout.device_bytes(dp) == per_replica * (T + 1) * 4 < \
        layout.whole_bytes(dp) == per_replica * (2 * T + 1) * 4
    assert [layout.stage_bytes(s, dp) for s in range(4)] == [per_replica * T * 4, 0, 0, per_replica * (T + 1) * 4]


def test_prepass_leaf_read_by_the_first_stage_reaches_the_last():
    """A normaliser over the inputs (read by stage 0) is computed by the last stage's pre-pass:
    the inputs are held by both, and training stays exact."""
    step, _ = train(2, "1f1b", "sgd", steps=2, normaliser="inputs")
    assert step.plan.program.batch_layout.readers(0) == (0, 1)
