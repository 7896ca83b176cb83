"""The collectives a pipeline step runs, as the program lowers them (`whalex.lowering.stage_rows`:
the state spread over every device, gathered into stage rows and scattered back; the gradient
sync over replicas; the messages between stages at the ticks that exchange; the split layers' inside
the stages),
per stage and device."""
from __future__ import annotations

from whalex.lowering.pipeline.axes import DATA, STAGE
from whalex.memory.flat import aval_bytes
from whalex.records.comm import Comm, ring_bytes
from whalex.records.schedules import Schedule


def stage_collectives(schedule: Schedule, invars, zero_level: int, dp: int, grad_bytes: float,
                      message_bytes: int) -> tuple[Comm, ...]:
    """Per stage: the spread state's gather over replicas, its parameter blocks to the stage and its
    gradient blocks back, the gradient sync over replicas (ZeRO: reduce-scatter, and at level 3 the
    stage parameters gathered), and the messages to the neighbouring stages at the ticks that exchange
    them (`Schedule.sends`; at 2 stages one swap, beyond one collective per direction). `invars`:
    the stored parameters' jaxpr variables; `grad_bytes`: the bytes of one stage's row."""
    num_stages = schedule.num_stages
    total = sum(aval_bytes(v.aval) for v in invars)
    comms = []
    for s in range(num_stages):
        comms.append(Comm(s, "all-gather", (DATA,), ring_bytes("all-gather", total, dp) / num_stages,
                          "1/stages of every stored parameter over the replicas"))
        comms.append(Comm(s, "all-to-all", (STAGE,), ring_bytes("all-to-all", grad_bytes, num_stages),
                          "the stage's parameter blocks to it"))
        comms.append(Comm(s, "all-to-all", (STAGE,), ring_bytes("all-to-all", grad_bytes, num_stages),
                          "its gradient blocks back to the spread state (tied parameters summed over their stages)"))
        comms += _replica_sync(s, zero_level, dp, grad_bytes)
        exchanges = _exchanges(schedule, s)
        if exchanges:
            comms.append(Comm(s, "collective-permute", (STAGE,), ring_bytes(
                "collective-permute", exchanges * message_bytes, num_stages),
                              f"activations to the next stage, gradients to the previous ({exchanges} messages sent)"))
    return tuple(comms)


def _exchanges(schedule: Schedule, s: int) -> int:
    """The messages stage `s` sends in a step as the tick loop exchanges them: at 2 stages one per tick
    that swaps; beyond, one per tick that moves messages in a direction it sends in (interleaved: the
    ring, every stage both ways)."""
    S, sends, ring = schedule.num_stages, schedule.sends, schedule.virtual_stages > 1
    if S < 2:
        return 0
    if S == 2:
        return int(sends.any.sum())
    return int(sends.forward.sum()) * (ring or s < S - 1) + int(sends.back.sum()) * (ring or s > 0)


def _replica_sync(s: int, level: int, dp: int, grad_bytes: float) -> list[Comm]:
    """Stage `s`'s gradient sync over `dp` pipeline replicas (none for one), and ZeRO 3's gather."""
    if dp <= 1:
        return []
    if level >= 2:
        out = [Comm(s, "reduce-scatter", (DATA,), ring_bytes("reduce-scatter", grad_bytes, dp),
                    f"gradient sync over replicas (zero {level})")]
    else:
        out = [Comm(s, "all-reduce", (DATA,), ring_bytes("all-reduce", grad_bytes, dp), "gradient sync over replicas")]
    if level >= 3:
        out.append(Comm(s, "all-gather", (DATA,), ring_bytes("all-gather", grad_bytes, dp),
                        f"zero {level}: stage parameters over replicas"))
    return out


def split_layer_collectives(planned, cap, chunk_eqns, num_stages: int, micro_batches: int) -> tuple[Comm, ...]:
    """The split layers' collectives as the stage devices run them: `planned`, the sharding patterns'
    for one micro-batch per split TaskGraph, run every micro-batch, the forward ones twice (the
    backward recomputes the forward); each on the stage of its TaskGraph's first equation (chunk c
    of `chunk_eqns` runs on stage c % num_stages)."""
    stage_of_eqn = {i: c % num_stages for c, eqns in enumerate(chunk_eqns) for i in eqns}
    stage_of_tg: dict = {}
    for i in sorted(stage_of_eqn):
        stage_of_tg.setdefault(cap.assign[(i,)], stage_of_eqn[i])
    return tuple(Comm(stage_of_tg.get(c.taskgraph, 0), c.kind, c.axes,
                      c.bytes * micro_batches * (1 if "(bwd)" in c.reason else 2), f"TG{c.taskgraph} {c.reason}")
                 for c in planned if c.bytes > 0)
