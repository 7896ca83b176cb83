"""A pipeline's step time as its ticks run: devices wait for each other where a tick's messages move,
so a backward beside a forward in such a tick makes the forward's stage wait; between those ticks each
device runs on. The schedules report it, and the plan's predicted step time, summary and view use it."""
import numpy as np
import optax
import pytest

import whalex as wh
from planner.test_auto_parallel import lm
from whalex.balance.partition import FORWARD_SHARE, lockstep_time as partition_lockstep
from whalex.mesh.specs import NETWORK_LATENCY, SPECS
from whalex.records.schedules import RECOMPUTE_COSTS, TickTable, lockstep_time, make_schedule, sending_ticks
from whalex.view.timing import exchange, predict


def _by_hand(sched, f, b, exchange=0.0) -> float:
    """Each device's clock runs through its tasks; at a tick where a message moves, every clock waits
    for the latest and the exchange."""
    f, b = np.broadcast_to(f, (sched.num_stages,)), np.broadcast_to(b, (sched.num_stages,))
    clocks = np.zeros(sched.num_stages)
    split = any(x is not None and x.kind == "W" for row in sched.ticks for x in row)     # W costs a forward
    cost = {"F": f, "W": f, "B": b - f if split else b}
    for t, row in enumerate(sched.ticks):
        for s, task in enumerate(row):
            if task is not None:
                clocks[s] += cost[task.kind][s]
        if sched.sends.any[t]:
            clocks[:] = clocks.max() + exchange
    return float(clocks.max())


@pytest.mark.parametrize("S, M, one_f_one_b, gpipe", [(2, 8, 0.889, 0.889), (4, 8, 0.600, 0.727),
                                                       (4, 16, 0.667, 0.842), (4, 32, 0.706, 0.914),
                                                       (8, 16, 0.571, 0.696)])
def test_lockstep_utilisation_with_a_backward_of_two_forwards(S, M, one_f_one_b, gpipe):
    a, g = make_schedule("1f1b", S, M), make_schedule("gpipe", S, M)
    assert a.utilisation(1, 2) == pytest.approx(one_f_one_b, abs=5e-4)
    assert g.utilisation(1, 2) == pytest.approx(gpipe, abs=5e-4)
    # GPipe's ticks never mix kinds, so its utilisation is 1 - bubble; 1F1B's mixes them and is lower,
    # except with 2 stages, where its mixed ticks move no message and the devices run on
    assert g.utilisation(1, 2) == pytest.approx(1 - g.bubble_fraction)
    if S > 2:
        assert a.utilisation(1, 2) < 1 - a.bubble_fraction - 0.05
    assert a.utilisation(1, 1) == pytest.approx(1 - a.bubble_fraction)    # equal costs: the bubble is all


def test_lockstep_time_with_a_cost_per_stage():
    rng = np.random.default_rng(0)
    for name in ("1f1b", "gpipe"):
        sched = make_schedule(name, 3, 5)
        f, b = rng.uniform(0.5, 2, 3), rng.uniform(1, 4, 3)
        assert sched.lockstep_time(f, b) == pytest.approx(_by_hand(sched, f, b))
        kinds = sched.tables()["kind"]
        assert lockstep_time(kinds, f, b, sends=sched.sends.any) == pytest.approx(_by_hand(sched, f, b))
        # sent as they are made, the messages would exchange at every tick that makes one: never faster
        assert lockstep_time(kinds, f, b) >= sched.lockstep_time(f, b) - 1e-12
        # the heterogeneous stage cut prices a cut the same way (a backward recomputes its forward)
        per = rng.uniform(1, 3, 3)
        assert partition_lockstep(per, np.ones(3), sched.tick_table) == \
            pytest.approx(sched.lockstep_time(per * FORWARD_SHARE, per))
    with pytest.raises(ValueError, match="finite and non-negative"):
        make_schedule("1f1b", 2, 2).lockstep_time(-1.0, 2.0)


def test_a_tick_table_carries_the_kinds_and_the_exchanges_together():
    sched = make_schedule("zb-h1", 2, 8)
    table = sched.tick_table
    assert np.array_equal(table.kinds, sched.chunk_kinds()) and np.array_equal(table.sends, sched.sends.any)
    assert table.time(1, 3, exchange=0.5) == pytest.approx(sched.lockstep_time(1, 3, exchange=0.5))
    # each message sent as made: the older model, which exchanges at more ticks and is never faster
    made = TickTable.sent_as_made(table.kinds, 2)
    assert np.array_equal(made.sends, sending_ticks(table.kinds)) and made.sends.sum() > table.sends.sum()
    assert made.time(1, 3, exchange=0.5) == pytest.approx(lockstep_time(table.kinds, 1, 3, exchange=0.5))
    assert made.time(1, 3, exchange=0.5) > table.time(1, 3, exchange=0.5)
    with pytest.raises(ValueError, match="one send flag per tick"):
        TickTable(table.kinds, table.sends[:-1], 2)


@pytest.mark.parametrize("name, S, M", [("1f1b", 2, 8), ("1f1b", 4, 8), ("zb-h1", 2, 8), ("gpipe", 3, 5)])
def test_devices_wait_only_where_messages_move(name, S, M):
    """Between ticks that move a message each device runs its own tasks back to back: with 2 stages
    1F1B's backward-beside-forward ticks move nothing, so it runs at GPipe's speed; each moving tick
    adds the exchange."""
    sched = make_schedule(name, S, M)
    f, b = np.linspace(1, 2, S), np.linspace(2, 5, S)
    assert sched.lockstep_time(f, b, exchange=0.3) == pytest.approx(_by_hand(sched, f, b, 0.3))
    t = sched.tables()
    moving = int(((t["send_f"][:, 0] | t["send_b"][:, 0]) > 0).sum())
    assert sched.lockstep_time(f, b, exchange=0.3) == pytest.approx(sched.lockstep_time(f, b) + 0.3 * moving)
    per_tick = np.arange(sched.num_ticks) * 0.01                         # one exchange per tick: only moving ones count
    assert sched.lockstep_time(f, b, exchange=per_tick) == pytest.approx(
        sched.lockstep_time(f, b) + per_tick[sched.sends.any].sum())


def test_a_pipeline_plans_step_time_is_its_lockstep_time():
    loss_fn, params, batch = lm(4)
    cluster = wh.Cluster.abstract(kinds=["V100-32GB"] * 2 + ["T4-16GB"] * 2)
    plan = wh.plan(loss_fn, params, batch, optax.sgd(0.1), cluster=cluster,
                   config=wh.Config(auto_parallel=True, num_task_graph=2, num_micro_batch=4, schedule="1f1b"))
    s = plan.schedule
    speeds = plan.cluster.compute_speeds(None)
    per = [t.flops / (t.nested_dp * s.num_micro_batch * t.device_count) / min(speeds[d] for d in t.devices)
           for t in plan.task_graphs]
    # each moving tick swaps one message between the V100 node and the T4 node: the T4 end's network
    message = plan.report.stage_buffers().message_bytes
    x = NETWORK_LATENCY + message / SPECS["T4-16GB"].network_bandwidth
    seconds, source = exchange(plan)
    moving = s.sends.any
    assert source == "spec-table" and np.allclose(seconds[moving], x, rtol=1e-12) and not seconds[~moving].any()
    want = _by_hand(s, [p / 3 for p in per], per, x)
    assert RECOMPUTE_COSTS == (1.0, 3.0)
    got = predict(plan)
    assert got.step_time == pytest.approx(want, rel=1e-9)
    # more than the bubble alone predicts: a tick with a backward beside a forward lasts the backward
    assert got.step_time > sum(per) * s.num_micro_batch / len(per) / (1 - s.bubble_fraction) * 0.999
    assert "lockstep" in got.basis and "spec-table links" in got.basis
    text = plan.summary()
    assert f"lockstep utilisation {s.utilisation(*RECOMPUTE_COSTS):.1%}" in text
    assert "ticks move messages between stages" in text and "spec-table links" in text


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_a_slow_calibrated_link_adds_its_exchange_at_every_moving_tick(name):
    loss_fn, params, batch = lm(4)
    cluster = wh.Cluster.abstract(kinds=["H100-80GB"] * 2)
    config = wh.Config(auto_parallel=True, num_task_graph=2, num_micro_batch=8, schedule=name)
    fast = wh.plan(loss_fn, params, batch, optax.sgd(0.1), cluster=cluster, config=config)
    slow = wh.plan(loss_fn, params, batch, optax.sgd(0.1), cluster=cluster.with_links(2e-3, 1e8), config=config)
    x = 2e-3 + slow.report.stage_buffers().message_bytes / 1e8
    seconds, source = exchange(slow)
    moving = int(slow.schedule.sends.any.sum())
    assert source == "calibrated" and seconds[seconds > 0] == pytest.approx([x] * moving, rel=1e-12)
    # messages wait in their outboxes to share exchanges: 9 of 1F1B's 10 moving ticks are left, 10 of zb-h1's 16
    assert moving == (9 if name == "1f1b" else 10) and moving < int(sending_ticks(slow.schedule.chunk_kinds()).sum())
    compute = predict(fast).step_time - exchange(fast)[0].sum()
    assert predict(slow).step_time == pytest.approx(compute + x * moving, rel=1e-9)
    assert "calibrated links" in slow.summary()


def test_beyond_two_stages_a_tick_pays_one_collective_per_direction_its_messages_move():
    loss_fn, params, batch = lm(4)
    cluster = wh.Cluster.abstract(kinds=["H100-80GB"] * 4).with_links(1e-3, 1e9)
    plan = wh.plan(loss_fn, params, batch, optax.sgd(0.1), cluster=cluster,
                   config=wh.Config(auto_parallel=True, num_task_graph=4, num_micro_batch=8, schedule="1f1b"))
    forward, back = plan.schedule.sends.forward, plan.schedule.sends.back
    assert (forward & back).any() and (forward ^ back).any()
    nbytes = plan.report.stage_buffers().message_bytes / 1e9
    want = np.where(forward & back, 2e-3 + nbytes, np.where(forward | back, 1e-3 + nbytes, 0.0))
    assert exchange(plan)[0] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("S, M", [(2, 8), (4, 8), (4, 16), (8, 16)])
def test_balanced_1f1b_never_pairs_a_backward_with_a_forward(S, M):
    b, a, g = (make_schedule(n, S, M) for n in ("1f1b-balanced", "1f1b", "gpipe"))
    kinds = b.tables()["kind"]                         # the table the tick loop scans
    assert all(len(set(row) - {0}) == 1 for row in kinds)
    assert lockstep_time(kinds, 1, 2) == pytest.approx(g.lockstep_time(1, 2))     # GPipe's speed
    assert b.utilisation(1, 2) > a.utilisation(1, 2) + 0.1 or S == 2 and b.utilisation(1, 2) == a.utilisation(1, 2)
    assert b.utilisation(1, 3) == pytest.approx(b.utilisation(1, 2))             # any backward cost
    for s in range(S):
        assert b.max_in_flight(s) <= 2 * (S - 1 - s) + 2 and b.max_in_flight(0) <= 2 * S - 1


def test_a_balanced_pipeline_plan_runs_its_table_at_072_or_more():
    loss_fn, params, batch = lm(4, batch=32)
    plan = wh.plan(loss_fn, params, batch, optax.sgd(0.1), cluster=wh.Cluster.abstract(kinds=["H100-80GB"] * 8),
                   config=wh.Config(auto_parallel=True, num_task_graph=4, num_micro_batch=8, schedule="1f1b-balanced"))
    kinds = plan.program.schedule.tables()["kind"]
    S, M = kinds.shape[1], plan.schedule.num_micro_batch
    assert (S, M) == (4, 8)
    assert M * S * 3 / (S * lockstep_time(kinds, 1, 2)) >= 0.72
