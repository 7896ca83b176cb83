"""Messages wait in their senders' outboxes to share exchanges (`whalex.records.messages`,
`Schedule.sends`): each leaves inside its window, no outbox holds two, the exchanges are the fewest,
and the tables the tick loop scans deliver every task the message it reads."""
import itertools

import pytest

from whalex.records.messages import Message, outbox_windows
from whalex.records.schedules import make_schedule, sending_ticks

GRID = [(n, S, M, 1) for n in ("gpipe", "1f1b", "1f1b-balanced", "zb-h1", "zb-h2") for S, M in
        ((2, 3), (2, 8), (3, 5), (4, 8), (4, 16))] + [("interleaved", S, M, 2) for S, M in ((2, 4), (2, 8), (4, 8))]


def _messages(sched):
    """(key, sender, forward, produced, needed) of every message, read off the ticks."""
    when, K = sched.when(), sched.num_chunks
    out = []
    for task, t in when.items():
        c, m = task.chunk, task.microbatch
        if task.kind == "F" and c + 1 < K:
            out.append((("F", c, m), task.stage, True, t, next(u for x, u in when.items()
                                                               if (x.kind, x.chunk, x.microbatch) == ("F", c + 1, m))))
        if task.kind == "B" and c > 0:
            out.append((("B", c, m), task.stage, False, t, next(u for x, u in when.items()
                                                                if (x.kind, x.chunk, x.microbatch) == ("B", c - 1, m))))
    return out


@pytest.mark.parametrize("name, S, M, V", GRID)
def test_each_message_leaves_in_time_and_its_outbox_holds_one(name, S, M, V):
    sched = make_schedule(name, S, M, V)
    sends = sched.sends
    msgs = _messages(sched)
    assert len(sends.at) == len(msgs)
    boxes: dict = {}
    for key, sender, forward, made, needed in msgs:
        t = sends.at[key]
        assert made <= t < needed, (key, made, t, needed)
        assert (sends.forward if forward else sends.back)[t]
        boxes.setdefault((sender,) if S == 2 else (sender, forward), []).append((made, t))
    for held in boxes.values():                          # the next message is made after this one left
        held.sort()
        assert all(t < nxt for (_, t), (nxt, _) in zip(held, held[1:]))
    # never more exchanges than sending each message as it is made
    assert sends.any.sum() <= sending_ticks(sched.chunk_kinds()).sum()


@pytest.mark.parametrize("name, S, M", [("1f1b", 2, 3), ("zb-h1", 2, 3), ("1f1b-balanced", 3, 3), ("gpipe", 2, 3)])
def test_the_exchanges_are_the_fewest_that_deliver_every_message(name, S, M):
    """Against every set of exchange ticks: none smaller sends each message inside its window."""
    sched = make_schedule(name, S, M)
    msgs = [Message(k, (s,) if S == 2 else (s, f), f, a, b) for k, s, f, a, b in _messages(sched)]
    windows = outbox_windows(msgs)
    best = next(n for n in range(sched.num_ticks + 1) for pick in itertools.combinations(range(sched.num_ticks), n)
                if all(any(a <= p <= b for p in pick) for a, b in windows))
    assert sched.sends.any.sum() == best


def test_coalescing_cuts_the_exchanges_of_1f1b_class_schedules():
    """(exchanges with each message sent as it is made, with messages waiting in their outboxes)."""
    counts = {(n, S): (int(sending_ticks(make_schedule(n, S, 8).chunk_kinds()).sum()),
                       int(make_schedule(n, S, 8).sends.any.sum()))
              for n, S in (("1f1b-balanced", 2), ("1f1b-balanced", 4), ("zb-h1", 2), ("zb-h1", 4), ("gpipe", 4))}
    assert counts == {("1f1b-balanced", 2): (16, 9), ("1f1b-balanced", 4): (20, 13), ("zb-h1", 2): (16, 10),
                      ("zb-h1", 4): (23, 16), ("gpipe", 4): (20, 20)}     # GPipe's forwards each feed the next tick


@pytest.mark.parametrize("name, S, M, V", GRID)
def test_the_tables_deliver_each_task_its_message(name, S, M, V):
    """The tick loop replayed on labels: outboxes filled as `TickLoop.fill_outbox` does, exchanged where
    send_f / send_b say (one swap at 2 stages), stashed where recv_f / recv_b say; every forward
    and backward then reads its own micro-batch's message from its slot."""
    sched = make_schedule(name, S, M, V)
    t = sched.tables()
    K = sched.num_chunks
    stash = [[None] * sched.stash[0] for _ in range(S)]
    gstash = [[None] * sched.grad_stash[0] for _ in range(S)]
    box = [[None, None] for _ in range(S)]
    fin, bin_ = [None] * S, [None] * S
    for tick in range(sched.num_ticks):
        for s in range(S):
            if t["recv_f"][tick, s] >= 0:
                stash[s][t["recv_f"][tick, s]] = fin[s]
            if t["recv_b"][tick, s] >= 0:
                gstash[s][t["recv_b"][tick, s]] = bin_[s]
        for s in range(S):
            kind, c, m = t["kind"][tick, s], t["chunk"][tick, s], t["mb"][tick, s]
            if kind == 1 and c > 0:
                assert stash[s][t["slot"][tick, s]] == ("F", c - 1, m), (tick, s)
            if kind == 2 and c < K - 1:
                assert gstash[s][t["gslot"][tick, s]] == ("B", c + 1, m), (tick, s)
            if kind == 1 and c < K - 1:
                box[s][0] = ("F", c, m)
            if kind == 2 and c > 0:
                box[s][0 if S == 2 else 1] = ("B", c, m)
        f, b = t["send_f"][tick, 0], t["send_b"][tick, 0]
        if S == 2 and (f or b):
            fin = bin_ = [box[1][0], box[0][0]]
        elif S > 2:
            ring = V > 1
            if f:
                fin = [box[(s - 1) % S][0] if ring or s > 0 else fin[s] for s in range(S)]
            if b:
                bin_ = [box[(s + 1) % S][1] if ring or s < S - 1 else bin_[s] for s in range(S)]
