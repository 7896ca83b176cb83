"""Schedules as data, checked without devices."""
import pytest

import whalex as wh
from whalex.records.schedules import Schedule, Task, make_schedule, render, stage_order


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("S", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 8, 9])
def test_schedule_dependencies(name, S, M):
    sched = make_schedule(name, S, M)
    when = sched.when()
    assert len(when) == 2 * S * M
    for s in range(S):
        for m in range(M):
            assert when[Task(s, m, "F")] < when[Task(s, m, "B")]               # forward before backward
            if s > 0:
                assert when[Task(s - 1, m, "F")] < when[Task(s, m, "F")]       # activation arrives first
            if s < S - 1:
                assert when[Task(s + 1, m, "B")] < when[Task(s, m, "B")]       # gradient arrives first
    assert sched.bubble_fraction == pytest.approx((S - 1) / (M + S - 1))
    # slots make m % slots collision-free at every tick, for every stage
    for s in range(S):
        for held in sched.live(s):
            assert len({m % sched.slots for m in held}) == len(held)
        for held in sched.live_grads(s):
            assert len({m % sched.grad_slots for m in held}) == len(held)
    assert sched.grad_slots == 1


@pytest.mark.parametrize("S", [2, 3, 4, 6])
@pytest.mark.parametrize("M", [1, 4, 8, 16, 32])
def test_1f1b_holds_at_most_S_micro_batches(S, M):
    one = make_schedule("1f1b", S, M)
    gpipe = make_schedule("gpipe", S, M)
    assert one.max_in_flight(0) <= S and one.slots <= S
    assert one.max_in_flight(0) == min(S, M)
    assert gpipe.max_in_flight(0) == M and gpipe.slots == M


def test_1f1b_is_backward_first():
    order = stage_order("1f1b", 4, 8, 0)
    kinds = "".join(t.kind for t in order)
    assert kinds.startswith("FFFFB") and kinds.endswith("BBBB")
    assert kinds[4:12] == "BFBFBFBF"


def test_invalid_schedules_are_rejected():
    good = make_schedule("gpipe", 2, 2)
    ticks = list(good.ticks)
    swapped = [ticks[0], ticks[2], ticks[1]] + ticks[3:]        # a stage-1 task before its input
    with pytest.raises(ValueError):
        Schedule("bad", 2, 2, tuple(swapped))
    with pytest.raises(ValueError, match="misses"):
        Schedule("bad", 2, 2, tuple(ticks[:-1]))
    with pytest.raises(wh.ConfigError, match="unknown pipeline schedule"):
        make_schedule("zigzag", 2, 2)
    with pytest.raises(wh.ConfigError, match="unknown pipeline schedule"):
        wh.Config(schedule="zigzag")


def test_render():
    text = render(make_schedule("1f1b", 2, 2))
    assert text.splitlines()[0].split()[2:] == ["F0", "F1", "..", "B0", "..", "B1"]


@pytest.mark.parametrize("name, S, M, V", [("1f1b", 2, 8, 1), ("zb-h1", 2, 8, 1), ("zb-h1", 4, 8, 1),
                                           ("gpipe", 4, 8, 1), ("interleaved", 4, 8, 2)])
def test_a_tick_exchanges_only_where_a_message_moves(name, S, M, V):
    """send_f / send_b: a tick sends forward (back) exactly when some stage receives at the next tick;
    every stage's column says the same, and the last tick sends nothing."""
    t = make_schedule(name, S, M, V).tables()
    for key, recv in (("send_f", "recv_f"), ("send_b", "recv_b")):
        moves = (t[recv][1:] >= 0).any(axis=1)
        assert (t[key] == t[key][:, :1]).all()
        assert list(t[key][:-1, 0]) == [int(x) for x in moves] and t[key][-1, 0] == 0


def test_split_and_one_f_one_b_schedules_have_silent_ticks():
    """With 2 stages, 1F1B's ticks where stage 0 runs a backward and stage 1 a forward move nothing, and
    zero bubble's W ticks add ticks without messages: those skip the exchange. Messages wait in their
    outboxes to share an exchange, so 1F1B and its balanced form move messages at 9 ticks of 18, zero
    bubble at 10 of 25; GPipe's forwards each feed the next tick and cannot wait."""
    def silent(name):
        t = make_schedule(name, 2, 8).tables()
        return int(((t["send_f"][:, 0] | t["send_b"][:, 0]) == 0).sum())
    assert silent("1f1b") == 9 and silent("1f1b-balanced") == 9 and silent("zb-h1") == 15 and silent("gpipe") == 2
