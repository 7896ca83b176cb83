"""Interleaved 1F1B trains exactly as one device: the model cut into S x V chunks by auto_parallel,
stage s holding chunks s, s+S, ... in its parameter row, messages around the ring of stages; with SGD
and Adam, a token-masked mean with tied embeddings, and split layers inside the chunks (3D)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import test_auto_parallel as lm_model
import whalex as wh
from conftest import adam, assert_matches
from test_pipeline_3d import SplitMlp
from test_pipeline_optim import _attention, _ln, _mlp, lm_batch, lm_params


def _interleaved(stages, micro, virtual=2):
    return wh.Config(auto_parallel=True, num_task_graph=stages, num_micro_batch=micro, schedule="interleaved",
                     virtual_stages=virtual)


@pytest.mark.parametrize("micro", [8, 16])
def test_interleaved_trains_like_one_device(micro):
    """4 stages x 2 chunks, nested data parallelism 2, Adam (SGD: the masked-mean test)."""
    stages = 4
    loss_fn, params, batch = lm_model.lm(4, batch=2 * micro)
    step, _ = assert_matches(loss_fn, params, batch, steps=2, optimizer=adam(), config=_interleaved(stages, micro),
                             param_tol=1e-4)
    plan, program = step.plan, step.plan.program
    assert plan.schedule.name == "interleaved" and plan.schedule.num_chunks == 2 * stages
    assert program.cut.num_stages == 2 * stages and plan.layout.axis_sizes == (8 // stages, stages)
    assert len(plan.task_graphs) == stages                 # a TaskGraph per stage: its chunks' work
    # stage d holds chunks d and d + S: its row of the [stages, width] buffer has their leaves, one after the other
    rows, cut = program.param_rows, program.cut
    assert rows.stage_params[1] == cut.params[1] + cut.params[stages + 1]
    assert program.param_width == max(sum(s.size for s in slots) for slots in rows.slots)
    text = str(plan.schedule)
    assert f"stage 0 (chunks 0,{stages}):" in text and "2 chunks per stage" in plan.summary()


def _masked_tied_loss(p, b):
    """The 4-stage LM of test_pipeline_optim, un-annotated, its logits reading the input embedding, under a
    token-masked mean (sum of masked token losses over the batch's token count)."""
    x = _mlp(p["b0"], _attention(p["b0"], p["emb"][b["tok"]] + p["pos"]))
    x = _mlp(p["b2"], _mlp(p["b1"], x))
    logits = _ln(x, p["lnf"]) @ p["emb"].T
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])
    return jnp.sum(ce * b["mask"]) / jnp.sum(b["mask"])


def test_interleaved_masked_mean_with_tied_embeddings():
    """2 stages x 2 chunks with SGD (a tied gradient summed twice or once would show)."""
    params, batch = lm_params(), lm_batch()
    mask = jax.random.uniform(jax.random.key(7), batch["y"].shape) < 0.6
    batch["mask"] = mask.at[:3].set(False).astype(jnp.float32)       # some rows have no token at all
    step, _ = assert_matches(_masked_tied_loss, params, batch, steps=2, optimizer=optax.sgd(0.05),
                             config=_interleaved(2, 4), param_tol=1e-4)
    program = step.plan.program
    emb = [k for k, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0]) if path[0].key == "emb"][0]
    holders = [c for c, ps in enumerate(program.cut.params) if emb in ps]
    assert holders[0] == 0 and holders[-1] == 3                       # the first and the last chunk read it


def test_interleaved_3d(monkeypatch):
    monkeypatch.setattr(lm_model, "Mlp", SplitMlp)
    loss_fn, params, batch = lm_model.lm()
    step, _ = assert_matches(loss_fn, params, batch, steps=2, optimizer=adam(), config=_interleaved(2, 2),
                             param_tol=1e-4)
    plan = step.plan
    assert plan.layout.axis_names == ("data", "stage", "model") and plan.layout.axis_sizes == (2, 2, 2)
    assert plan.schedule.num_chunks == 4


def test_interleaved_memory_is_near_1f1bs():
    """Per-device memory of XLA's compiled step (CPU) at 4 stages, 8 micro-batches: a stage's row holds its
    chunks' leaves (as wide as 1F1B's stage row), and the stash pool holds more chunk inputs (10 vs 4)."""
    class Mlp(nn.Module):             # bench/models.py's MLP: 16 x (Dense(64) + ReLU), a Dense head
        @nn.compact
        def __call__(self, x):
            for _ in range(16):
                x = nn.relu(nn.Dense(64)(x))
            return nn.Dense(64)(x)

    k = jax.random.split(jax.random.key(0), 2)
    batch = {"x": jax.random.normal(k[0], (64, 64)), "y": jax.random.normal(k[1], (64, 64))}
    params = Mlp().init(k[0], batch["x"][:1])["params"]

    def loss_fn(p, b):
        return jnp.mean((Mlp().apply({"params": p}, b["x"]) - b["y"]) ** 2)

    plans = {V: wh.plan(loss_fn, params, batch, optax.adam(1e-3),
                        config=wh.Config(auto_parallel=True, num_task_graph=4, num_micro_batch=8,
                                         schedule="interleaved" if V > 1 else "1f1b", virtual_stages=V))
             for V in (1, 2)}
    assert plans[2].program.param_width == plans[1].program.param_width
    assert plans[2].schedule.stash[0] == 10 and plans[1].schedule.stash[0] == 4
    ratio = plans[2].step_memory().total / plans[1].step_memory().total
    assert 1.0 < ratio <= 1.10, ratio


def test_interleaved_refusals():
    """More chunks than the model has layers to cut: the error names the chunk count and the fix."""
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k[0], (8, 8)), "w2": jax.random.normal(k[1], (8, 4))}
    batch = {"x": jax.random.normal(k[2], (16, 8)), "y": jax.random.normal(k[3], (16, 4))}

    def loss_fn(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    with pytest.raises(wh.PlanError, match="virtual_stages=4 = 16 chunks; use fewer virtual_stages"):
        wh.plan(loss_fn, params, batch, optax.sgd(0.1), config=_interleaved(4, 8, virtual=4))


def test_interleaved_chunk_cut_follows_device_speed():
    """On V100s and T4s (planned, not run) each chunk takes its stage's speed: the V100 stage's chunks carry
    more of the model than the T4 stage's."""
    loss_fn, params, batch = lm_model.lm(4)
    cluster = wh.Cluster.abstract(kinds=["V100-32GB"] * 4 + ["T4-16GB"] * 4)
    plan = wh.plan(loss_fn, params, batch, optax.sgd(0.1), config=_interleaved(2, 4), cluster=cluster)
    fast, slow = (t.flops for t in plan.task_graphs)
    assert {plan.cluster.specs[d].name for d in plan.task_graphs[0].devices} == {"V100-32GB"}
    assert fast > 1.5 * slow, (fast, slow)
