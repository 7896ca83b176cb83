"""Uneven data parallelism (Whale section 3.3.1): on a heterogeneous cluster, Algorithm 1 gives
each device a number of samples proportional to its speed under its memory; the planner hands
the counts to `UnevenProgram`, or keeps the even GSPMD plan (with the report) when they are even
or `hardware_aware=False`."""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from whalex.balance import cost
from whalex.balance.algorithm import balance, even
from whalex.balance.profile import taskgraph_flops
from whalex.core.interpret import make_evaluator
from whalex.lowering.uneven import DATA, UnevenProgram
from whalex.memory import MemoryOptions, account, plan_memory, residual_bytes
from whalex.memory.remat import configure as configure_memory
from whalex.mesh.virtual import MeshLayout, VirtualDevice
from whalex.plan import Plan
from whalex.planner.common import Request, loss_parts, taskgraph_infos


def balance_data_parallel(req: Request, full):
    """Algorithm 1 over a data-parallel model: (report, uneven Plan or None for the even plan)."""
    config, cluster, optimizer = req.config, req.cluster, req.optimizer
    k, b = cluster.size, full.global_batch
    hetero = len(set(cluster.speeds)) > 1 or len({s.memory_bytes for s in cluster.specs}) > 1
    if not hetero:
        return None, None
    unit = cost.balance_unit(b, k)
    captures = {}

    def cap_at(rows):
        if rows not in captures:
            captures[rows] = req.capture(rows)
        return captures[rows]

    def make(rows):
        c = cap_at(rows)
        ev = make_evaluator(c.jaxpr, {}, None)
        n = c.num_params

        def f(*leaves):
            return jax.value_and_grad(lambda ps: ev(*ps, *leaves[n:])[0])(list(leaves[:n]))
        return (f, *[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in c.jaxpr.jaxpr.invars])

    cap_u = cap_at(unit)
    unit_flops = taskgraph_flops(cap_u.jaxpr, cap_u.assign, len(cap_u.taskgraphs))
    flops_per_sample = sum(unit_flops) / unit
    act_base, act_per = cost.activation_model(make)
    invars = cap_u.jaxpr.jaxpr.invars[: cap_u.num_params]
    shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars]
    p_bytes = sum(float(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in shapes)
    o_bytes = 0.0
    if optimizer is not None:
        o_bytes = sum(float(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                      for x in jax.tree.leaves(jax.eval_shape(optimizer.init, shapes)))
    mem = MemoryOptions.from_config(config, ((DATA,),) * cap_u.num_params)
    state = sum(account(p_bytes, o_bytes, p_bytes / k, o_bytes / k, mem)[:3])   # ZeRO: ~1/k of a sharded part
    units = b // unit
    names = [f"device {i} ({s.name})" for i, s in enumerate(cluster.specs)]
    bal = balance(units, cluster.speeds, [float(s.memory_bytes) for s in cluster.specs],
                  [state + act_base] * k, [act_per * unit] * k, names)
    rows = [u * unit for u in bal.loads]
    even_rows = [u * unit for u in even(units, k)] if b % k else [b // k] * k
    applied = config.hardware_aware and len(set(rows)) > 1
    report = cost.report(cluster.specs, cluster.speeds, rows, even_rows,
                         source=cluster.speed_source, unit=unit, applied=applied, shifted=bal.shifted,
                         flops_per_sample=flops_per_sample, state_bytes=state, act_base=act_base,
                         act_per_sample=act_per, spreads=cluster.spread)
    if not applied:
        return report, None
    layout = MeshLayout((DATA,), (k,))
    mesh = layout.build(cluster.devices)
    parts = loss_parts(cap_u, full, config, "uneven per-device chunks")
    program = UnevenProgram(cap_u, mesh, optimizer, cluster.platform, tuple(bal.loads), unit, b, mem, parts=parts)
    program = configure_memory(program, config, cluster, [(DATA,)] * len(cap_u.taskgraphs))
    scale = b / unit
    flops = [f * scale for f in unit_flops]
    vds = tuple(VirtualDevice(t.index, t.strategy, k, (tuple(range(k)),), (), (DATA,)) for t in cap_u.taskgraphs)
    infos = taskgraph_infos(cap_u, vds, flops, [0.0] * len(vds))
    memory = plan_memory(program, cluster.specs, residual_bytes(cap_u.jaxpr, cap_u.num_params))  # one chunk live
    plan = Plan(cluster=cluster, config=config, layout=layout, task_graphs=tuple(infos), virtual_devices=vds,
                batch_sizes=tuple(rows), global_batch=b, param_specs={p: P() for p in cap_u.param_paths},
                patterns=(), comms=(), memory=memory, program=program, balance=report,
                batch_couplings=tuple(parts.sem.lines()))
    return report, plan
