"""Interleaved 1F1B: the model cut into S x V chunks, stage s holding chunks s, s+S, ...; the schedule
as validated data, its lockstep utilisation from the tick table the program runs, and the Config. It
trains exactly as one device: chunks cut by auto_parallel, each stage's chunks in its parameter row,
messages around the ring of stages; with SGD and Adam, a token-masked mean with tied embeddings, and
split layers inside the chunks (3D)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import planner.test_auto_parallel as lm_model
import whalex as wh
from conftest import adam, assert_matches
from lowering.test_pipeline_3d import SplitMlp
from lowering.test_pipeline_optim import _attention, _ln, _mlp, lm_batch, lm_params
from whalex.records.schedules import FWD, Schedule, Task, interleaved_order, lockstep_time, make_schedule, stage_order


@pytest.mark.parametrize("S, M, V", [(2, 4, 2), (2, 3, 2), (3, 5, 2), (4, 8, 2), (4, 16, 2), (4, 8, 3), (2, 8, 4)])
def test_interleaved_schedule_is_valid_data(S, M, V):
    sched = make_schedule("interleaved", S, M, V)
    assert sched.num_chunks == S * V and sched.virtual_stages == V
    when = sched.when()
    assert len(when) == 2 * S * V * M
    for task, t in when.items():
        assert task.chunk % S == task.stage                   # stage s holds chunks s, s+S, ...
        c, m = task.chunk, task.microbatch
        if task.kind == "F" and c > 0:                        # the previous chunk's stage sent it: s-1, or S-1 -> 0
            assert when[Task((c - 1) % S, m, "F", c - 1)] < t
        if task.kind == "B":
            assert when[Task(c % S, m, "F", c)] < t
            if c < S * V - 1:
                assert when[Task((c + 1) % S, m, "B", c + 1)] < t
    # the stash pools never hold two values in one slot at once
    tables = sched.tables()
    for size, at in (sched.stash, sched.grad_stash):
        assert 1 <= size and all(0 <= k < size for k in at.values())
    # what arrives is what a later task of that stage reads from the same slot
    kinds, chunk, slot = tables["kind"], tables["chunk"], tables["slot"]
    for t in range(sched.num_ticks):
        for s in range(S):
            if kinds[t, s] and chunk[t, s] > 0:
                got = [u for u in range(t + 1) if tables["recv_f"][u, s] == slot[t, s]]
                assert got, (t, s)
    # a tick that pairs unlike kinds never happens: forward ticks and backward ticks alternate
    assert not any(set(row[row > 0]) == {1, 2} for row in kinds)
    with pytest.raises(ValueError):                            # a chunk on the wrong stage is refused
        Schedule("bad", S, M, ((Task(0, 0, "F", 1),) + (None,) * (S - 1),) + sched.ticks, V)


def test_interleaved_utilisation_from_the_programs_tick_table():
    one = make_schedule("1f1b", 4, 8)
    inter = make_schedule("interleaved", 4, 8, 2)
    # recomputed from the [ticks, stages] table the tick loop scans: a chunk's task costs half a stage's
    t = inter.tables()
    cost = np.where(t["kind"] == FWD, 0.5, np.where(t["kind"] == 2, 1.0, 0.0))
    util = 8 * 4 * 3 / (4 * cost.max(axis=1).sum())
    assert util == pytest.approx(inter.utilisation(1, 2)) and util >= 0.80, util
    assert inter.utilisation(1, 2) > one.utilisation(1, 2) + 0.2         # 1F1B: 0.600
    assert inter.lockstep_time(1, 2) == pytest.approx(lockstep_time(inter.chunk_kinds(), 0.5, 1.0))
    assert inter.bubble_fraction < make_schedule("gpipe", 4, 8).bubble_fraction
    # V = 1 is 1F1B's tasks
    assert [interleaved_order(4, 8, 1, s) for s in range(4)] == [stage_order("1f1b", 4, 8, s) for s in range(4)]


def test_interleaved_picture_shows_chunks():
    text = str(make_schedule("interleaved", 2, 4, 2))
    assert "2 chunks per stage" in text.splitlines()[0]
    assert text.splitlines()[1].startswith("stage 0 (chunks 0,2):")
    assert text.splitlines()[1].split()[4:6] == ["F0c0", "F1c0"]
    assert "F0c3" in text.splitlines()[2]


def test_virtual_stages_config():
    cfg = wh.Config(auto_parallel=True, num_task_graph=2, schedule="interleaved", virtual_stages=2)
    assert cfg.virtual_stages == 2 and wh.Config({"pipeline.virtual_stages": 1}).virtual_stages == 1
    with pytest.raises(wh.ConfigError, match="virtual_stages=2 .* only applies with schedule='interleaved'"):
        wh.Config(auto_parallel=True, num_task_graph=2, virtual_stages=2)
    with pytest.raises(wh.ConfigError, match="virtual_stages >= 2"):
        wh.Config(auto_parallel=True, num_task_graph=2, schedule="interleaved")
    with pytest.raises(wh.ConfigError, match="needs auto_parallel=True"):
        wh.Config(num_micro_batch=4, schedule="interleaved", virtual_stages=2)
    with pytest.raises(wh.ConfigError, match="virtual_stages"):
        wh.Config(virtual_stages=0)
    with pytest.raises(wh.ConfigError, match="schedule='interleaved'"):
        make_schedule("1f1b", 2, 4, 2)


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


class Mlp(nn.Module):             # bench/models.py's MLP: 16 x (Dense(64) + ReLU), a Dense head
    @nn.compact
    def __call__(self, x):
        for _ in range(16):
            x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(64)(x)


def memory_problem():
    """The model the memory tests compare schedules on: `Mlp`, MSE, a batch of 64 rows."""
    k = jax.random.split(jax.random.key(0), 2)
    batch = {"x": jax.random.normal(k[0], (64, 64)), "y": jax.random.normal(k[1], (64, 64))}
    params = Mlp().init(k[0], batch["x"][:1])["params"]

    def loss_fn(p, b):
        return jnp.mean((Mlp().apply({"params": p}, b["x"]) - b["y"]) ** 2)

    return loss_fn, params, batch


def test_interleaved_memory_is_near_1f1bs():
    """Per-device memory of XLA's compiled step (CPU) at 4 stages, 8 micro-batches: a stage's row holds its
    chunks' leaves (as wide as 1F1B's stage row), and the stash pool holds more chunk inputs (10 vs 4)."""
    loss_fn, params, batch = memory_problem()
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


def plan_on_v100s_and_t4s(config):
    """A 2-stage plan of the 4-block LM on 4 V100s and 4 T4s (planned, not run), checked to give the V100
    stage more than 1.5x the T4 stage's FLOPs."""
    loss_fn, params, batch = lm_model.lm(4)
    cluster = wh.Cluster.abstract(kinds=["V100-32GB"] * 4 + ["T4-16GB"] * 4)
    plan = wh.plan(loss_fn, params, batch, optax.sgd(0.1), config=config, cluster=cluster)
    fast, slow = (t.flops for t in plan.task_graphs)
    assert {plan.cluster.specs[d].name for d in plan.task_graphs[0].devices} == {"V100-32GB"}
    assert fast > 1.5 * slow, (fast, slow)
    return plan


def test_interleaved_chunk_cut_follows_device_speed():
    """Each chunk takes its stage's speed: the V100 stage's chunks carry more of the model than the T4
    stage's."""
    plan_on_v100s_and_t4s(_interleaved(2, 4))
