"""Interleaved 1F1B: the model cut into S x V chunks, stage s holding chunks s, s+S, ...; the schedule
as validated data, its lockstep utilisation from the tick table the program runs, and the Config."""
import numpy as np
import pytest

import whalex as wh
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
