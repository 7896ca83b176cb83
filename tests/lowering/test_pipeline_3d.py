"""Pipeline x tensor x data (3D) parallelism. `wh.split(2)` inside the stages of an
auto_parallel pipeline gives a ('data', 'stage', 'model') mesh: the stages are manual inside one
shard_map, the split layers are sharded over `model` by the same sharding patterns as a GSPMD plan
(Megatron's column-then-row MLP falls out), each model device holds its block of the split weights,
and training equals one device, with SGD and Adam, both schedules, with and without nested data
parallelism."""
import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import planner.test_auto_parallel as lm_model
import whalex as wh
from conftest import adam, assert_matches

WIDTH = lm_model.WIDTH


class SplitMlp(nn.Module):
    """The block's MLP under wh.split(2): Megatron's tensor-parallel MLP."""

    @nn.compact
    def __call__(self, x):
        with wh.split(2):
            return nn.Dense(WIDTH, name="down")(nn.gelu(nn.Dense(4 * WIDTH, name="up")(x)))


@pytest.fixture
def split_lm(monkeypatch):
    """test_auto_parallel's TransformerLM (4 blocks under decoder/) with a split MLP in every block."""
    monkeypatch.setattr(lm_model, "Mlp", SplitMlp)
    return lm_model.lm()


@pytest.mark.parametrize("stages,schedule,opt", [(2, "1f1b", "sgd"), (2, "gpipe", "adam"), (4, "1f1b", "adam")])
def test_split_inside_stages_trains_like_one_device(split_lm, stages, schedule, opt, tmp_path):
    loss_fn, params, batch = split_lm
    config = wh.Config(auto_parallel=True, num_task_graph=stages, num_micro_batch=2, schedule=schedule)
    opt = optax.sgd(0.5) if opt == "sgd" else adam()
    # (GPipe with Adam also saves a checkpoint and restores it under data parallelism, see below)
    # losses rtol 1e-5, parameters max-relative 1e-4 (Adam scales the reassociation noise of a
    # row-parallel bias gradient summed in another order: measured 1.9e-5)
    step, state = assert_matches(loss_fn, params, batch, steps=2, optimizer=opt, config=config, param_tol=1e-4)
    plan = step.plan
    dp = 8 // (stages * 2)
    assert plan.layout.axis_names == ("data", "stage", "model") and plan.layout.axis_sizes == (dp, stages, 2)
    # Megatron's layout falls out of the least-communication rule: the up projection column-split,
    # the down projection row-split (its partial sums all-reduced), in every block
    chosen = {c.param: c.pattern for c in plan.patterns}
    for i in range(4):
        assert chosen[f"['decoder']['block_{i}']['mlp']['up']['kernel']"] == "SP1 column", chosen
        assert chosen[f"['decoder']['block_{i}']['mlp']['down']['kernel']"] == "SP2 row", chosen
    assert f"mesh (data={dp} x stage={stages} x model=2)" in plan.summary()
    if schedule == "gpipe":                     # the Adam run
        check_checkpoint(step, state, loss_fn, params, batch, tmp_path)


def check_checkpoint(three_d, state, loss_fn, params, batch, tmp_path):
    """The 3D storage (model blocks spread over stage and data) saves the caller's pytree: restored under
    plain data parallelism, the parameters and Adam's moments are the 3D plan's, bit for bit."""
    dp = wh.parallelize(loss_fn, adam())
    with wh.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(three_d, state)
        manager.wait_until_finished()
        restored = manager.restore(dp, params, batch)
    for a, b in zip(jax.tree.leaves(dp.params(restored)), jax.tree.leaves(three_d.params(state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moments = lambda s: [x for x in jax.tree.leaves(s) if getattr(x, "ndim", 0) >= 1]   # noqa: E731
    for a, b in zip(moments(restored.opt_state), moments(state.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_each_model_device_holds_its_block_of_the_split_weights(split_lm):
    loss_fn, params, batch = split_lm
    config = wh.Config(auto_parallel=True, num_task_graph=2, num_micro_batch=2)
    plan = wh.plan(loss_fn, params, batch, optimizer=optax.sgd(0.1), config=config)
    program = plan.program
    split = [p for p, d in enumerate(program.model_dims) if d is not None]
    leaves = jax.tree.leaves(params)
    names = [program.captured.param_paths[p] for p in split]
    # per block: both kernels, and the up projection's bias (it follows the column split); the down
    # projection's bias is added after the all-reduce and stays whole, as in Megatron
    assert len(split) == 12 and all("mlp" in n for n in names), names
    assert sum("['up']['bias']" in n for n in names) == 4 and not any("['down']['bias']" in n for n in names)
    # a stage's [model, width] row holds half of its split leaves per model device
    for s, ps in enumerate(program.cut.params):
        size = sum(leaves[p].size for p in ps if program.model_dim(p) is not None)
        assert sum(sl.size for sl, _ in program.model_slots[s]) * 2 == size
    rows = program.pack_rows(params)
    assert rows["model"].shape == (2, 2, program.model_width)
    # the rows reassemble the caller's leaves exactly
    for s, ps in enumerate(program.cut.params):
        with jax.set_mesh(program.mesh):            # its `model` constraint names the plan's mesh axis
            got = program.unpack_stage(s, (rows["stages"][s], rows["model"][s]))
        for p, x in zip(ps, got):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(leaves[p]))


def test_split_degrees_inside_a_pipeline_must_agree_and_divide(monkeypatch):
    class Mixed(nn.Module):
        @nn.compact
        def __call__(self, x):
            with wh.split(2):
                h = nn.gelu(nn.Dense(4 * WIDTH)(x))
            with wh.split(4):
                return nn.Dense(WIDTH)(h)

    monkeypatch.setattr(lm_model, "Mlp", Mixed)
    loss_fn, params, batch = lm_model.lm(num_blocks=2, batch=8)
    config = wh.Config(auto_parallel=True, num_task_graph=2, num_micro_batch=2)
    with pytest.raises(wh.PlanError, match="the same explicit n"):
        wh.plan(loss_fn, params, batch, config=config)

    class Three(nn.Module):
        @nn.compact
        def __call__(self, x):
            with wh.split(3):
                return nn.Dense(WIDTH)(nn.gelu(nn.Dense(3 * WIDTH)(x)))

    monkeypatch.setattr(lm_model, "Mlp", Three)
    loss_fn, params, batch = lm_model.lm(num_blocks=2, batch=8)
    with pytest.raises(wh.PlanError, match=r"split\(3\)"):
        wh.plan(loss_fn, params, batch, config=config)



def test_padding_a_split_dimension_inside_a_stage_is_refused_by_name(monkeypatch):
    """A (7, 5) kernel under split(2) inside a pipeline stage would be stored padded; pipelines do not
    build padded storage, so wh.plan names the parameter, its dimension and the split degree."""
    class Odd(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(7)(x)
            with wh.split(2):
                h = nn.gelu(nn.Dense(5, name="odd")(h))
            return nn.Dense(WIDTH)(h)

    monkeypatch.setattr(lm_model, "Mlp", Odd)
    loss_fn, params, batch = lm_model.lm(num_blocks=2, batch=8)
    config = wh.Config(auto_parallel=True, num_task_graph=2, num_micro_batch=2)
    with pytest.raises(wh.PlanError, match=r"split\(2\) inside a pipeline stage would pad "
                                           r".*\['odd'\]\['(kernel|bias)'\].*which 2 does not divide"):
        wh.plan(loss_fn, params, batch, config=config)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_remat_full_checkpoints_each_layer_inside_the_stages(split_lm, opt):
    """remat="full" on a pipeline: each layer inside a stage runs under `jax.checkpoint`, so the stage's
    backward (which recomputes the stage's forward) holds one block's residuals at a time; training
    still equals one device, 3D (data 2 x stage 2 x model 2) as well."""
    loss_fn, params, batch = split_lm
    base = dict(auto_parallel=True, num_task_graph=2, num_micro_batch=2)
    opt = optax.sgd(0.5) if opt == "sgd" else adam()
    step, _ = assert_matches(loss_fn, params, batch, steps=2, optimizer=opt, param_tol=1e-4,
                             config=wh.Config(**base, remat="full"))
    plain = wh.plan(loss_fn, params, batch, opt, config=wh.Config(**base))
    assert step.plan.program.layer_cuts and not plain.program.layer_cuts
    assert step.plan.layout.axis_sizes == (2, 2, 2)
    assert step.plan.lower().count("optimization_barrier") > plain.lower().count("optimization_barrier")


def test_the_loss_head_runs_its_rows_over_model(split_lm):
    """The last stage's operations after its last split layer (the final LayerNorm, the vocabulary head
    and the loss) take their operands' micro-batch rows split over `model`, so the two model devices of
    a replica each compute half the head instead of all of it twice; the plan reports the gathers and
    the head's gradient sums this adds, on the last stage. (Training equal to one device: above.)"""
    from jax.sharding import PartitionSpec as P

    from whalex.planner.stage_head import head_equations, head_rows
    loss_fn, params, batch = split_lm
    plan = wh.plan(loss_fn, params, batch, optimizer=optax.sgd(0.1),
                   config=wh.Config(auto_parallel=True, num_task_graph=2, num_micro_batch=2))
    program = plan.program
    cap = program.captured
    split = [i for i, e in enumerate(cap.jaxpr.jaxpr.eqns) if cap.taskgraphs[cap.assign[(i,)]].strategy.kind == "split"]
    rows = {k[0][0] for k, spec in program.constraints.items() if k[1] == "in" and spec == P("model")}
    assert rows and min(rows) > max(split) and rows <= set(program.cut.eqns[-1]), (rows, max(split))
    names = {cap.jaxpr.jaxpr.eqns[i].primitive.name for i in rows}
    assert "dot_general" in names, names                  # the vocabulary projection
    head = [c for c in program.collectives() if c.reason.startswith("loss head")]
    assert {c.kind for c in head} == {"all-gather", "all-reduce"}
    assert all(c.taskgraph == 1 and c.bytes > 0 for c in head)
    assert "loss head (the last stage after its last split layer): its rows split over model" in plan.summary()
    # rows that do not divide over `model` stay whole (the plan is what it was without the split)
    assert head_rows(cap, head_equations(cap, list(program.cut.eqns[-1])), 2, 3) == {}
