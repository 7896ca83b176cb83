"""Automatic pipeline partitioning (Whale's `auto_parallel` + `num_task_graph`, Example 3).

The model is cut into layers (contiguous top-level equations under one Flax module path, or runs
that read a new parameter for plain functions); each layer's forward+backward FLOPs come from
XLA's cost analysis and its memory from its parameter, gradient and optimizer-state bytes plus the
activations its stage stashes. Contiguous layers are split into k stages minimising the slowest
stage's time (FLOPs / device FLOP/s) with every stage under its device's memory.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from whalex import _compat as C
from whalex.balance.profile import taskgraph_flops
from whalex.errors import PlanError
from whalex.primitives.scopes import PREFIX


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    eqns: tuple[int, ...]
    flops: float
    state_bytes: float       # parameters + gradients + optimizer state
    input_bytes: float       # activations entering the layer (stashed per in-flight micro-batch)


def layer_key(eqn) -> str | None:
    parts = [p for p in str(eqn.source_info.name_stack).split("/") if p and not p.startswith(PREFIX)]
    return "/".join(parts[:2]) if len(parts) >= 2 else None


def split_layers(cap) -> list[tuple[str, list[int]]]:
    """Contiguous runs of top-level equations, one per layer."""
    jaxpr = cap.jaxpr.jaxpr
    params = set(jaxpr.invars[: cap.num_params])
    units: list[tuple[str, list[int]]] = []
    seen_keys: set = set()
    for i, eqn in enumerate(jaxpr.eqns):
        key = layer_key(eqn)
        reads_param = any(not isinstance(v, C.Literal) and v in params for v in eqn.invars)
        if key is not None:
            new = not units or (key != units[-1][0] and key not in seen_keys)
        else:
            new = not units or (reads_param and units[-1][0].startswith("op") and
                                any(not isinstance(v, C.Literal) and v in params
                                    for j in units[-1][1] for v in jaxpr.eqns[j].invars))
        if new:
            units.append((key or f"op{i}", [i]))
            if key:
                seen_keys.add(key)
        else:
            units[-1][1].append(i)
    return units


def profile_layers(cap, optimizer=None) -> list[Layer]:
    units = split_layers(cap)
    assign = {(i,): u for u, (_, eqns) in enumerate(units) for i in eqns}
    flops = taskgraph_flops(cap.jaxpr, assign, len(units))
    jaxpr = cap.jaxpr.jaxpr
    param_index = {v: k for k, v in enumerate(jaxpr.invars[: cap.num_params])}
    opt_factor = _optimizer_factor(optimizer, cap)
    produced = {}
    for u, (_, eqns) in enumerate(units):
        for i in eqns:
            for v in jaxpr.eqns[i].outvars:
                produced[v] = u
    layers = []
    for u, (name, eqns) in enumerate(units):
        ps, ins = set(), set()
        for i in eqns:
            for v in jaxpr.eqns[i].invars:
                if isinstance(v, C.Literal):
                    continue
                if v in param_index:
                    ps.add(v)
                elif produced.get(v, u) < u:
                    ins.add(v)
        pbytes = sum(_nbytes(v) for v in ps)
        layers.append(Layer(name, tuple(eqns), flops[u], pbytes * (2 + opt_factor), sum(_nbytes(v) for v in ins)))
    return layers


def _nbytes(v) -> float:
    return float(np.prod(v.aval.shape, dtype=np.float64)) * np.dtype(v.aval.dtype).itemsize


def _optimizer_factor(optimizer, cap) -> float:
    """Optimizer-state bytes per parameter byte (Adam: 2)."""
    if optimizer is None:
        return 0.0
    invars = cap.jaxpr.jaxpr.invars[: cap.num_params]
    shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars]
    state = jax.eval_shape(optimizer.init, shapes)
    sbytes = sum(float(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))
    pbytes = sum(_nbytes(v) for v in invars)
    return sbytes / pbytes if pbytes else 0.0


def partition(flops: Sequence[float], state_bytes: Sequence[float], input_bytes: Sequence[float],
              speeds: Sequence[float], capacities: Sequence[float], micro_batch_in_flight=None) -> list[int]:
    """Split layers 0..n-1 into len(speeds) contiguous non-empty stages.

    Minimises the slowest stage's time sum(flops)/speed, subject to each stage's memory
    (state bytes of its layers + its input activations x micro-batches in flight) fitting its
    device's capacity. Returns the first layer index of each stage. Pure; raises PlanError if no
    split fits.
    """
    n, k = len(flops), len(speeds)
    if k > n:
        raise PlanError(f"num_task_graph={k} stages but the model has only {n} layers to split; use at most {n}.")
    in_flight = micro_batch_in_flight or [k - s for s in range(k)]
    pf = np.concatenate([[0.0], np.cumsum(flops)])
    pm = np.concatenate([[0.0], np.cumsum(state_bytes)])
    inf = float("inf")

    def stage_cost(s, a, b):          # layers a..b-1 on stage s
        mem = pm[b] - pm[a] + input_bytes[a] * in_flight[s]
        if mem > capacities[s]:
            return inf
        return (pf[b] - pf[a]) / speeds[s]

    best = np.full((k + 1, n + 1), inf)
    cut = np.zeros((k + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for s in range(1, k + 1):
        for b in range(s, n - (k - s) + 1):
            for a in range(s - 1, b):
                if best[s - 1, a] == inf:
                    continue
                c = max(best[s - 1, a], stage_cost(s - 1, a, b))
                if c < best[s, b]:
                    best[s, b], cut[s, b] = c, a
    if best[k, n] == inf:
        worst = max(range(n), key=lambda i: state_bytes[i])
        raise PlanError(
            f"no split of the model into {k} stages fits the devices' memory (largest layer needs "
            f"{state_bytes[worst] / 2**30:.2f} GiB of state); use more stages, devices with more memory, or "
            "ZeRO/offload.")
    starts, b = [], n
    for s in range(k, 0, -1):
        a = cut[s, b]
        starts.append(a)
        b = a
    return starts[::-1]


def stage_devices(cluster, num_stages: int, hardware_aware: bool = True) -> list[list[int]]:
    """Device indices per stage (one per pipeline replica).

    Hardware-aware (section 3.3.2): devices sorted by memory, larger first (early stages stash more
    micro-batches), then speed; stage s takes the next `replicas` devices, so every replica gets
    the same mix of kinds. Otherwise Whale's sequential placement: replica r, stage s -> r*S+s.
    """
    k = cluster.size
    dp = k // num_stages
    uniform = len({(s.memory_bytes, sp) for s, sp in zip(cluster.specs, cluster.speeds)}) == 1
    if not hardware_aware or uniform:
        return [[r * num_stages + s for r in range(dp)] for s in range(num_stages)]
    order = sorted(range(k), key=lambda i: (-cluster.specs[i].memory_bytes, -cluster.speeds[i], i))
    return [order[s * dp:(s + 1) * dp] for s in range(num_stages)]


def auto_stages(cap, num_stages: int, cluster, optimizer=None, micro_fraction: float = 1.0,
                in_flight: Sequence[int] | None = None, hardware_aware: bool = True) -> list[int]:
    """Stage index of every top-level equation for `num_stages` balanced stages.

    `micro_fraction` scales the captured (global-batch) activations to one device's micro-batch;
    `in_flight[s]` is how many micro-batches stage s stashes under the schedule.
    """
    if num_stages < 2:
        raise PlanError("auto_parallel needs num_task_graph >= 2 stages; set Config(num_task_graph=k).")
    layers = profile_layers(cap, optimizer)
    placement = stage_devices(cluster, num_stages, hardware_aware)
    speeds = [min(cluster.speeds[i] for i in devs) for devs in placement]
    caps = [min(cluster.specs[i].memory_bytes for i in devs) for devs in placement]
    if not hardware_aware:
        speeds = [1.0] * num_stages
    starts = partition([l.flops for l in layers], [l.state_bytes for l in layers],
                       [l.input_bytes * micro_fraction for l in layers], speeds,
                       [float(c) for c in caps], in_flight)
    stage_of_layer = np.searchsorted(np.asarray(starts), np.arange(len(layers)), side="right") - 1
    out = [0] * len(cap.jaxpr.jaxpr.eqns)
    for l, layer in enumerate(layers):
        for i in layer.eqns:
            out[i] = int(stage_of_layer[l])
    return out
