"""Zero bubble (ZB-H1): the backward split into B (the input gradient) and W (the weight gradient), W run
where a stage would idle. The schedule as validated data, its lockstep utilisation from the tick table
the program runs, what B saves for W, and training exactly as one device: SGD and Adam at 4 stages with 8
and 16 micro-batches, a token-masked mean with tied embeddings, split layers inside the stages (3D) and
per-layer remat (model state and dropout: tests/api/test_model_state.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import planner.test_auto_parallel as lm_model
import whalex as wh
from conftest import adam, assert_matches
from lowering.test_interleaved import _masked_tied_loss, memory_problem, plan_on_v100s_and_t4s
from lowering.test_pipeline_3d import SplitMlp, check_checkpoint
from lowering.test_pipeline_optim import lm_batch, lm_params
from whalex.lowering.pipeline.weights import weight_split
from whalex.records.schedules import BWD, FWD, WGT, Schedule, Task, lockstep_time, make_schedule, sending_ticks


def _zb(stages, micro, **kw):
    return wh.Config(auto_parallel=True, num_task_graph=stages, num_micro_batch=micro, schedule="zb-h1", **kw)


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
@pytest.mark.parametrize("S, M", [(1, 3), (2, 3), (2, 8), (3, 5), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_schedule_is_valid_data(S, M, name):
    sched = make_schedule(name, S, M)
    assert sched.split_backward and len(sched.when()) == 3 * S * M
    when = sched.when()
    for s in range(S):
        for m in range(M):
            assert when[Task(s, m, "F")] < when[Task(s, m, "B")] < when[Task(s, m, "W")]
    # a stage holds as many stage inputs as under 1f1b-balanced (2S-1 slots), and zb-h1 at most S pending
    # W's, zb-h2 2S
    assert sched.stash[0] == make_schedule("1f1b-balanced", S, M).stash[0] <= 2 * S - 1
    size, at = sched.weight_stash
    assert 1 <= size <= S * (2 if name == "zb-h2" else 1) and all(0 <= k < size for k in at.values())
    # the W stash slot a B writes is the one its W reads, and no other B writes it in between
    t = sched.tables()
    for s in range(S):
        for m in range(M):
            b, w = when[Task(s, m, "B")], when[Task(s, m, "W")]
            assert t["wslot"][b, s] == t["wslot"][w, s]
            assert not any(t["kind"][u, s] == BWD and t["wslot"][u, s] == t["wslot"][b, s] for u in range(b + 1, w))
    # a tick never pairs a forward with a B: forward ticks and B ticks alternate, W fills
    assert not any({FWD, BWD} <= set(row) for row in t["kind"].tolist())
    with pytest.raises(ValueError, match="before its B"):
        bad = [list(row) for row in sched.ticks]
        s0 = [k for k, row in enumerate(bad) if row[0] == Task(0, 0, "W")][0]
        b0 = [k for k, row in enumerate(bad) if row[0] == Task(0, 0, "B")][0]
        bad[s0][0], bad[b0][0] = bad[b0][0], bad[s0][0]
        Schedule(name, S, M, tuple(tuple(r) for r in bad))


def test_zero_bubble_utilisation_from_the_programs_tick_table():
    """Forward 1, backward 2 split as B = W = 1, S=4, M=8: at least 0.85 (1F1B: 0.600)."""
    zb, one = make_schedule("zb-h1", 4, 8), make_schedule("1f1b", 4, 8)
    kinds = zb.tables()["kind"]
    assert set(np.unique(kinds)) == {0, FWD, BWD, WGT}
    cost = np.where(kinds == FWD, 1.0, np.where(kinds == BWD, 1.0, np.where(kinds == WGT, 1.0, 0.0)))
    util = 8 * 3 / cost.max(axis=1).sum()
    assert util == pytest.approx(zb.utilisation(1, 2)) and util >= 0.85, util
    assert zb.utilisation(1, 2) > one.utilisation(1, 2) + 0.25
    # with whalex's recomputing backward (B = 2, W = 1) it is still the fastest in lockstep here, and zb-h2,
    # deferring up to 2S W's, faster still
    for name in ("1f1b", "gpipe", "1f1b-balanced"):
        assert zb.utilisation(1, 3) > make_schedule(name, 4, 8).utilisation(1, 3), name
    assert make_schedule("zb-h2", 4, 8).utilisation(1, 3) > zb.utilisation(1, 3) + 0.05
    assert zb.lockstep_time(1, 3) == pytest.approx(lockstep_time(kinds, 1, 3))
    # W costs `weight` and B the rest: with every task costing the same (W = B = F), each tick that moves
    # a message waits for its costliest task, and the ticks between run on
    cost = np.where(kinds == FWD, 1, np.where(kinds == BWD, 2.5, np.where(kinds == WGT, 0.5, 0)))
    assert lockstep_time(kinds, 1, 3, 0.5) <= cost.max(axis=1).sum()
    assert lockstep_time(kinds, 1, 2, 1) == pytest.approx(zb.num_ticks - (~sending_ticks(kinds)).sum()
                                                          + sum(_silent_runs(kinds, sending_ticks(kinds))))
    assert zb.lockstep_time(1, 2, 1) == pytest.approx(zb.num_ticks - (~zb.sends.any).sum()
                                                      + sum(_silent_runs(kinds, zb.sends.any)))
    assert make_schedule("zb-h1", 4, 16).utilisation(1, 2) >= 0.9


def test_zero_bubble_picture_and_refusals():
    text = str(make_schedule("zb-h1", 2, 4))
    assert text.startswith("zb-h1 schedule: 2 stages, 4 micro-batches") and "W0" in text
    with pytest.raises(wh.ConfigError, match="schedule='interleaved'"):
        make_schedule("zb-h1", 2, 4, 2)
    assert wh.Config(auto_parallel=True, num_task_graph=2, schedule="zb-h1").schedule == "zb-h1"
    assert wh.Config({"pipeline.schedule": "zb-h2"}).schedule == "zb-h2"


def test_what_b_saves_for_w():
    """A Dense layer's W needs its input and one cotangent: its bias add takes none of the input, and
    the matmul before it shares the add's cotangent. A scale (elementwise, on a parameter smaller than
    its cotangent) is differentiated in B: the row holds its gradient, not its input and cotangent."""
    def layer(p, x):
        h = jnp.tanh(x @ p["w"] + p["b"])
        return h * p["g"]

    p = {"b": jnp.zeros(8), "g": jnp.ones(8), "w": jnp.ones((4, 8))}
    closed = jax.make_jaxpr(layer)(p, jnp.ones((2, 4)))
    jp = closed.jaxpr
    split = weight_split(jp.eqns, jp.invars[:3], jp.constvars, jp.outvars)
    names = [jp.eqns[k].primitive.name for k in split.weight_eqns]
    assert names == ["dot_general", "add"], names
    x = jp.invars[3]
    tanh_out = [e for e in jp.eqns if e.primitive.name == "tanh"][0].outvars[0]
    assert split.saved == (x,)                                 # the matmul's input
    dot, add = (jp.eqns[k] for k in split.weight_eqns[:2])
    assert split.tap_of[dot.outvars[0]] is add.outvars[0] and split.taps == (add.outvars[0],)
    # the scale: B taps its output and keeps its input, and the row holds g's gradient (8 < 2 x 8)
    assert [jp.eqns[k].primitive.name for k in split.eager.weight_eqns] == ["mul"]
    assert split.eager.saved == (tanh_out,) and split.eager.taps == (jp.outvars[0],)
    assert split.eager_params == (1,) and split.row_vars == (x, add.outvars[0], jp.invars[1])
    assert split.keep == (x, tanh_out) and split.all_taps == (add.outvars[0], jp.outvars[0])
    # given the step's inputs, a batch leaf is read again by W rather than saved
    reread = weight_split(jp.eqns, jp.invars[:3], jp.constvars, jp.outvars, jp.invars[3:])
    assert reread.saved == () and reread.reread == (x,) and reread.eager.saved == (tanh_out,)
    # a scale as large as its cotangent stays W's
    wide = jax.make_jaxpr(layer)({**p, "g": jnp.ones((2, 8))}, jnp.ones((2, 4))).jaxpr
    assert weight_split(wide.eqns, wide.invars[:3], wide.constvars, wide.outvars).eager is None


def test_zero_bubble_trains_like_one_device_with_sgd():
    loss_fn, params, batch = lm_model.lm(4, batch=16)
    step, _ = assert_matches(loss_fn, params, batch, steps=2, optimizer=optax.sgd(0.5), config=_zb(4, 8),
                             param_tol=1e-4)
    plan = step.plan
    assert plan.schedule.name == "zb-h1" and plan.schedule.split_backward
    assert plan.program.row_format is not None and len(plan.program.weight_splits) == 4
    assert all(s.eager is not None for s in plan.program.weight_splits)     # LayerNorms' gradients taken in B
    from whalex.view.format import fmt_bytes
    row = plan.report.stage_buffers().weight_row_bytes
    assert row == plan.program.row_format.nbytes > 0
    assert f"up to {plan.schedule.weight_stash[0]} rows of {fmt_bytes(row)} per stage" in plan.summary()


def test_zero_bubble_16_micro_batches_with_adam():
    loss_fn, params, batch = lm_model.lm(4, batch=32)
    assert_matches(loss_fn, params, batch, steps=2, optimizer=adam(), config=_zb(4, 16), param_tol=1e-4)


def test_zero_bubble_masked_mean_with_tied_embeddings():
    """2 stages with SGD and 4 with Adam: a tied gradient summed twice or once would show."""
    params, batch = lm_params(), lm_batch()
    mask = jax.random.uniform(jax.random.key(7), batch["y"].shape) < 0.6
    batch["mask"] = mask.at[:3].set(False).astype(jnp.float32)       # some rows have no token at all
    assert_matches(_masked_tied_loss, params, batch, steps=2, optimizer=optax.sgd(0.05), config=_zb(2, 4),
                   param_tol=1e-4)
    assert_matches(_masked_tied_loss, params, batch, steps=2, optimizer=adam(), config=_zb(4, 8), param_tol=1e-4)


@pytest.mark.parametrize("opt, remat", [("adam", None), ("sgd", "full")])
def test_zero_bubble_3d(monkeypatch, opt, remat, tmp_path):
    """data 2 x stage 2 x model 2, Adam (its checkpoint restored under data parallelism); SGD with each
    layer checkpointed inside the stages."""
    monkeypatch.setattr(lm_model, "Mlp", SplitMlp)
    loss_fn, params, batch = lm_model.lm()
    step, state = assert_matches(loss_fn, params, batch, steps=2, param_tol=1e-4,
                                 optimizer=adam() if opt == "adam" else optax.sgd(0.5), config=_zb(2, 2, remat=remat))
    assert step.plan.layout.axis_names == ("data", "stage", "model") and step.plan.layout.axis_sizes == (2, 2, 2)
    assert bool(step.plan.program.layer_cuts) == (remat == "full")
    if opt == "adam":
        check_checkpoint(step, state, loss_fn, params, batch, tmp_path)


def test_zero_bubble_stage_cut_follows_device_speed():
    """The stages are cut for zb-h1's lockstep time: the V100 stage carries more of the model than the T4
    stage."""
    plan = plan_on_v100s_and_t4s(_zb(2, 4))
    assert plan.schedule.split_backward and "backward split into B and W" in plan.summary()


def test_zero_bubble_memory_is_near_1f1bs():
    """Per-device memory of XLA's compiled step (CPU) at 4 stages, 8 micro-batches, on the model of the
    interleaved memory test: zb-h1 holds 1f1b-balanced's stage inputs (7 vs 1F1B's 4) and at most 4 W
    stash rows (each layer's input and output cotangent), zb-h2 up to 8. The rows are what a
    recomputing 1F1B never holds, so the ratio grows with the activations' share of the memory; here
    it is at most 1.10."""
    loss_fn, params, batch = memory_problem()
    plans = {n: wh.plan(loss_fn, params, batch, optax.adam(1e-3),
                        config=wh.Config(auto_parallel=True, num_task_graph=4, num_micro_batch=8, schedule=n))
             for n in ("1f1b", "zb-h1", "zb-h2")}
    zb = plans["zb-h1"]
    assert zb.schedule.weight_stash[0] == 4 and zb.schedule.stash[0] == 7
    assert zb.program.param_width == plans["1f1b"].program.param_width
    base = plans["1f1b"].step_memory().total
    ratios = {n: plans[n].step_memory().total / base for n in ("zb-h1", "zb-h2")}
    assert 1.0 < ratios["zb-h1"] <= 1.10 and ratios["zb-h1"] < ratios["zb-h2"], ratios
    # the W stash and the three more stage inputs are the difference, to within 2%
    rows = 4 * zb.program.row_format.nbytes + 3 * zb.program.message.nbytes
    extra = zb.step_memory().total - base
    assert rows <= extra <= 1.02 * rows + 0.02 * base, (rows, extra)


def _silent_runs(kinds, sends):
    """Per run of ticks that move no message (`sends`; with the moving tick that ends it, if any), the
    most tasks one stage runs in it, less the moving tick's one counted already: with unit costs, what
    the run adds beyond that tick."""
    out, run = [], np.zeros(kinds.shape[1])
    for t in range(len(kinds)):
        run += kinds[t] > 0
        if sends[t] or t == len(kinds) - 1:
            out.append(run.max() - (1 if sends[t] else 0))
            run = np.zeros(kinds.shape[1])
    return out
