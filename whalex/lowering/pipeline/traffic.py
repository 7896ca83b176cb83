"""The collectives a pipeline step runs, as the program lowers them (`whalex.lowering.stage_rows`:
the state spread over every device, gathered into stage rows and scattered back; the gradient
sync over replicas; the messages between stages every tick; the split layers' inside the stages),
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
    stage parameters gathered), and the messages to the neighbouring stages every tick. `invars`:
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
        sends = 2 if schedule.virtual_stages > 1 else (s < num_stages - 1) + (s > 0)   # interleaved: the ring
        if sends:
            comms.append(Comm(s, "collective-permute", (STAGE,), ring_bytes(
                "collective-permute", schedule.num_ticks * sends * message_bytes, num_stages),
                              "activations to the next stage, gradients to the previous (every tick)"))
    return tuple(comms)


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
