"""Uneven data parallelism (Whale section 3.3.1): on a heterogeneous cluster, Algorithm 1 gives
each device a number of samples proportional to its speed under its memory; the planner hands
the counts to `UnevenProgram`, or keeps the even GSPMD plan (with the report) when they are even
or `hardware_aware=False`."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from whalex.balance import cost
from whalex.balance.algorithm import balance, even
from whalex.balance.profile import taskgraph_flops
from whalex.errors import PlanError
from whalex.jaxpr.interpret import make_evaluator
from whalex.lowering.uneven import DATA, UnevenProgram
from whalex.memory import MemoryOptions, account
from whalex.mesh.virtual import MeshLayout, VirtualDevice
from whalex.planner.assemble import Work, assemble, taskgraph_rows
from whalex.planner.common import Request, configure_memory, loss_parts
from whalex.records.lazy import Lazy

WAY_OUT = ("wh.Config(hardware_aware=False) (an even batch: the whole batch in one program), or a larger global "
           "batch (larger per-device chunks)")


@dataclasses.dataclass(frozen=True)
class _Costs:
    """What Algorithm 1 weighs per device, from a probe trace: the work per sample, the activation
    bytes (fixed and per sample), the stored state's bytes, and the memory options behind them."""

    flops_per_sample: float
    act_base: float
    act_per: float
    state: float
    mem: MemoryOptions


def balance_data_parallel(req: Request, full):
    """Algorithm 1 over a data-parallel model: (report, uneven Plan or None for the even plan).

    Loads are counted in a fine grain of rows (`cost.speed_grain`), so the split follows the speeds
    at any batch size; the program runs full chunks plus a remainder chunk (`UnevenProgram`).
    A loss whose batch reductions differ between part sizes falls back to one chunk size, a divisor
    of the batch (`cost.balance_unit`)."""
    config, cluster = req.config, req.cluster
    k, b = cluster.size, full.global_batch
    hetero = len(set(cluster.speeds)) > 1 or len({s.memory_bytes for s in cluster.specs}) > 1
    if not hetero:
        return None, None
    captures = {}

    def cap_at(rows):
        if rows not in captures:
            captures[rows] = req.capture(rows)
        return captures[rows]

    # decide: Algorithm 1's rows from the per-device costs
    probe = cap_at(min(b, 64))
    costs = _costs(req, probe, cap_at)
    unit = cost.speed_grain(b, cluster.speeds)
    bal, rows = _split(cluster, b, unit, costs)
    applied = config.hardware_aware and len(set(rows)) > 1
    program = None
    if applied:                # build: the uneven program (one chunk size where part sizes disagree)
        mesh = MeshLayout((DATA,), (k,)).build(cluster.devices)
        try:
            program = _program(req, full, cap_at, mesh, rows, unit, costs.mem)
        except PlanError:
            unit = cost.balance_unit(b, k)
            bal, rows = _split(cluster, b, unit, costs)
            applied = len(set(rows)) > 1
            if applied:
                program = _program(req, full, cap_at, mesh, rows, unit, costs.mem, one_size=True)
    # report: the balance, applied or not; assemble: the uneven plan, or none (the even plan)
    report = cost.report(cluster.specs, cluster.speeds, rows, even(b, k),
                         source=cluster.speed_source, unit=unit, applied=applied, shifted=bal.shifted,
                         flops_per_sample=costs.flops_per_sample, state_bytes=costs.state, act_base=costs.act_base,
                         act_per_sample=costs.act_per, spreads=cluster.spread,
                         overheads=cluster.overhead)
    if not applied or program is None:
        return report, None
    return report, _plan(req, program, probe, rows, b, report)


def _costs(req: Request, probe, cap_at) -> _Costs:
    """The per-device costs Algorithm 1 weighs: flops per sample from `probe`, the activation model
    from compiled gradients at two sizes, the parameter and optimizer state (ZeRO: about 1/k of a
    sharded part)."""
    config, k = req.config, req.cluster.size

    def make(rows):
        c = cap_at(rows)
        ev = make_evaluator(c.jaxpr, {}, None)
        n = c.num_params

        def f(*leaves):
            return jax.value_and_grad(lambda ps: ev(*ps, *leaves[n:])[0])(list(leaves[:n]))
        return (f, *[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in c.jaxpr.jaxpr.invars])

    probe_flops = taskgraph_flops(probe.jaxpr, probe.assign, len(probe.taskgraphs), probe.num_params)
    act_base, act_per = cost.activation_model(make)
    invars = probe.jaxpr.jaxpr.invars[: probe.num_params]
    shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars]
    p_bytes = sum(float(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in shapes)
    o_bytes = 0.0
    if req.optimizer is not None:
        o_bytes = sum(float(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                      for x in jax.tree.leaves(jax.eval_shape(req.optimizer.init, shapes)))
    mem = MemoryOptions.from_config(config, ((DATA,),) * probe.num_params)
    state = sum(account(p_bytes, o_bytes, p_bytes / k, o_bytes / k, mem)[:3])
    return _Costs(sum(probe_flops) / probe.global_batch, act_base, act_per, state, mem)


def _split(cluster, b: int, unit: int, costs: _Costs):
    """(Algorithm 1's balance of the batch in units of `unit` rows, the rows per device)."""
    k = cluster.size
    names = [f"device {i} ({s.name})" for i, s in enumerate(cluster.specs)]
    bal = balance(b // unit, cluster.speeds, [float(s.memory_bytes) for s in cluster.specs],
                  [costs.state + costs.act_base] * k, [costs.act_per * unit] * k, names,
                  overheads=cluster.overhead, work_per_unit=unit * costs.flops_per_sample)
    return bal, [u * unit for u in bal.loads]


def _plan(req: Request, program: UnevenProgram, probe, rows, b: int, report):
    """The uneven Plan: every TaskGraph replicated over the `data` axis, `rows` samples per device."""
    k = req.cluster.size
    cap = program.captured
    vds = tuple(VirtualDevice(t.index, t.strategy, k, (tuple(range(k)),), (), (DATA,)) for t in cap.taskgraphs)
    return assemble(req, program, MeshLayout((DATA,), (k,)), vds, taskgraph_rows(cap),
                    Work(probe, probe.assign, b / probe.global_batch), batch_sizes=rows, global_batch=b,
                    param_specs={p: P() for p in cap.param_paths}, balance=report,
                    batch_couplings=Lazy.of(tuple(program.parts.sem.lines())))


def _program(req: Request, full, cap_at, mesh, rows, unit, mem, one_size=False) -> UnevenProgram:
    """The uneven program for `rows` per device: full chunks and remainder chunks down to `unit`
    rows (`one_size`: chunks of `unit` rows only), with the loss contract at every part size it runs
    (PlanError where they disagree)."""
    config, cluster = req.config, req.cluster
    chunk = unit if one_size else cost.chunk_rows(rows, unit)
    cap = cap_at(chunk)
    program = UnevenProgram(cap, mesh, req.optimizer, cluster.platform, tuple(rows), chunk, full.global_batch, mem,
                            grain=unit, exact_remainders=cost.exact_remainders(rows, chunk, unit))
    context = "uneven per-device chunks"
    used = [s for j, s in enumerate(program.sizes) if any(bits[j] for bits in program.remainder_bits)]
    parts = loss_parts(cap, full, config, context, WAY_OUT).with_variants(
        [loss_parts(cap_at(s), full, config, context, WAY_OUT) for s in used], len(program.part_ranges()))
    program = dataclasses.replace(program, parts=parts)
    return configure_memory(program, config, cluster, [(DATA,)] * len(cap.taskgraphs))
