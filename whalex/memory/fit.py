"""Will the plan fit, and what would make it fit: a per-device memory model from abstract shapes.

Everything here works from shapes and shardings only (`jax.eval_shape`, no allocation, no
compilation), so it answers for clusters that are not there (`wh.Cluster.abstract`):

- params, grads, optimizer state per device: each leaf's bytes under its PartitionSpec.
- activations per device: the residuals the backward pass keeps, measured as the leaves of each
  TaskGraph's `jax.vjp` closure (batch-major ones, divided over the devices that share the batch).
- the options, applied cumulatively in the order of what they cost: ZeRO 1/2/3 (shard the optimizer
  state, gradients, parameters of *replicated* leaves over their replicas), remat (keep only
  TaskGraph inputs, recompute one TaskGraph at a time), bf16 activations (amp), offload of the
  optimizer state, the parameters, then the gradients (streamed out as they are produced, as
  ZeRO-Offload does) to host memory. The first prefix that fits is the need (options that save
  less than 1% of the device's memory are left out of it).
- host memory bounds offload: what a step keeps on the host must fit the device's share of its
  node's RAM (`Cluster.host_bytes`: declared, detected, or the kind's typical node). A ladder that
  fits the devices only by offloading more than the hosts hold does not fit, and `limit` says
  host memory is what is short.

It is a model, not a measurement: XLA may fuse away or add temporaries. On the 8-device example the
activation estimate is compared against XLA's compiled temp memory in `bench/moe_plan.py`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from whalex.jaxpr.capture import Captured, taskgraph_eqns
from whalex.jaxpr.interpret import subgraph_functions, subgraph_key
from whalex.memory.accounting import sharded_bytes, spec_shards
from whalex.memory.opt_state_specs import opt_state_specs
from whalex.records.program import StateLayout
from whalex.records.sharding_plan import ExpertCall


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Per-device bytes of one training step's state and activations."""

    params: float
    grads: float
    opt_state: float
    activations: float
    host: float = 0.0          # bytes kept in host memory (offload)

    @property
    def device_total(self) -> float:
        return self.params + self.grads + self.opt_state + self.activations


@dataclasses.dataclass(frozen=True)
class FitStep:
    """The footprint after applying `option` (and every option before it)."""

    option: str
    footprint: Footprint
    fits: bool
    limit: str | None = None        # what it does not fit: "device memory", "host memory" (or both)


@dataclasses.dataclass(frozen=True)
class MemoryFit:
    """The plain footprint, the capacities (device memory, host memory per device), and the ladder
    of options tried."""

    capacity: float
    plain: Footprint
    ladder: tuple[FitStep, ...]
    replicated_fraction: float      # share of per-device parameter bytes that ZeRO could shard
    replicas: int                   # data-parallel replicas of the replicated leaves
    host_capacity: float = float("inf")     # host RAM per device (its share of its node's)
    compiled: float | None = None   # XLA's per-device bytes of the plan as it is, where it compiles

    @property
    def offset(self) -> float:
        """What XLA's figure adds to the model's (the ladder is judged on the model plus this)."""
        return 0.0 if self.compiled is None else self.compiled - self.plain.device_total

    @property
    def fits(self) -> bool:
        return self.plain.device_total + self.offset <= self.capacity

    @property
    def needs(self) -> tuple[str, ...] | None:
        """The options needed to fit (empty if it fits as is), or None if nothing here is enough."""
        if self.fits:
            return ()
        prev = self.plain.device_total
        chosen = []
        for step in self.ladder:
            if prev - step.footprint.device_total >= 0.01 * self.capacity:   # skip options that barely help
                chosen.append(step.option)
            prev = step.footprint.device_total
            if step.fits:
                return tuple(chosen)
        return None

    @property
    def limit(self) -> str | None:
        """What is short when nothing here fits: "host memory" when some options fit the devices only
        by offloading more than the hosts hold, else "device memory"; None when it fits."""
        if self.needs is not None:
            return None
        return "host memory" if any(s.limit == "host memory" for s in self.ladder) else "device memory"

    def verdict(self) -> str:
        """One line: fits, fits with which options, or what is short and by how much."""
        if self.compiled is not None:
            return f"{self._verdict()} (judged on XLA's compiled step, {self.compiled / 2.0 ** 30:.2f} GiB per device)"
        return self._verdict()

    def _verdict(self) -> str:
        gib = 2.0 ** 30
        if self.fits:
            return "fits"
        if self.needs is not None:
            return "fits with " + " + ".join(self.needs)
        if self.limit == "host memory":
            step = next(s for s in self.ladder if s.limit == "host memory")
            return (f"does not fit: host memory is the limit ({step.option}: {step.footprint.host / gib:.1f} GiB "
                    f"per device on the host, which holds {self.host_capacity / gib:.1f} GiB per device)")
        last = self.ladder[-1].footprint if self.ladder else self.plain
        total = last.device_total + self.offset
        return (f"does not fit: device memory is the limit (every option applied: {total / gib:.1f} "
                f"GiB per device, capacity {self.capacity / gib:.1f} GiB)")


def _bytes(shape, dtype) -> float:
    return float(np.prod(shape, dtype=np.float64)) * np.dtype(dtype).itemsize


def taskgraph_residuals(cap, divisors: Sequence[int]) -> tuple[list[float], list[float]]:
    """Per-device bytes (residuals, batch-major inputs) of each TaskGraph's backward pass."""
    jaxpr = cap.jaxpr.jaxpr
    consts = set(jaxpr.constvars)
    b = cap.global_batch
    param_shapes = {(tuple(v.aval.shape), v.aval.dtype) for v in jaxpr.invars[: cap.num_params]}

    def major(s):     # batch-major values that are not parameters
        return len(s.shape) > 0 and s.shape[0] % b == 0 and (tuple(s.shape), s.dtype) not in param_shapes

    residuals, inputs_, traced, memo = [], [], {}, {}
    groups = taskgraph_eqns(jaxpr, cap.assign, len(cap.taskgraphs))
    for tg, idx, (inputs, outputs, fn) in zip(cap.taskgraphs, groups, subgraph_functions(jaxpr, groups)):
        if not idx:
            residuals.append(0.0)
            inputs_.append(0.0)
            continue
        key = subgraph_key(jaxpr, idx, inputs, outputs, consts, memo)
        if key not in traced:             # a repeated block keeps what its twin keeps
            traced[key] = _closure(inputs, fn, consts)
        closure, float_avals = traced[key]
        div = divisors[tg.index]
        residuals.append(sum(_bytes(s.shape, s.dtype) for s in closure if major(s)) / div)
        inputs_.append(sum(_bytes(a.shape, a.dtype) for a in float_avals if major(a)) / div)
    return residuals, inputs_


def _closure(inputs, fn, consts) -> tuple[list, list]:
    """The leaves of fn's vjp closure w.r.t. its floating inputs, and those inputs (abstract)."""
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in inputs if v not in consts]
    floating = [jax.numpy.issubdtype(a.dtype, jax.numpy.floating) for a in avals]

    def f(*fa):
        it = iter(fa)
        args = [next(it) if fl else jax.numpy.zeros(a.shape, a.dtype) for a, fl in zip(avals, floating)]
        return [o for o in fn(*args) if jax.numpy.issubdtype(o.dtype, jax.numpy.floating)]

    float_avals = [a for a, fl in zip(avals, floating) if fl]
    closure = jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], *float_avals)
    return jax.tree.leaves(closure), float_avals


def memory_fit(state: StateLayout, cap: Captured, virtual_devices: Sequence, device_specs: Sequence,
               host_bytes: Sequence[float], experts: Sequence[ExpertCall] = (),
               compiled: float | None = None) -> MemoryFit:
    """The per-device footprint of a plan and the options that would make it fit, from plain
    records: the state as its program stores it (`state`), the capture it runs, its VirtualDevices,
    and the spec and host bytes of each of its devices (`Plan.memory_fit` hands them over). With
    `compiled` (XLA's bytes for the plan as it is), fitting is judged on XLA's figure: each option's
    saving from the model, applied to it."""
    sizes = dict(state.axis_sizes)
    n = len(device_specs)
    leaves = [v.aval for v in cap.jaxpr.jaxpr.invars[: cap.num_params]]
    specs = list(state.param_specs)
    per_dev = [_bytes(a.shape, a.dtype) / spec_shards(s, sizes) for a, s in zip(leaves, specs)]
    replicas = [n // spec_shards(s, sizes) for s in specs]
    params = sum(per_dev)
    # The plain optimizer state under the plan's specs (plan.memory already applies zero/offload).
    opt_state = 0.0
    if state.optimizer is not None:
        ospecs, oshapes = opt_state_specs(state.optimizer, state.param_shapes, specs)
        opt_state = sharded_bytes(oshapes, ospecs, sizes)
    opt_ratio = opt_state / params if params else 0.0    # e.g. 2.0 for Adam
    rep_params = sum(p for p, r in zip(per_dev, replicas) if r > 1)
    sharded_params = sum(p / r for p, r in zip(per_dev, replicas) if r > 1)
    expert_tgs = {c.taskgraph for c in experts}
    divisors = []
    for vd in virtual_devices:
        full = vd.strategy.kind == "replicate" or vd.taskgraph in expert_tgs
        divisors.append(n if full else max(1, n // vd.device_count))
    residuals, boundary = taskgraph_residuals(cap, divisors)
    plain = Footprint(params, params, opt_state, sum(residuals))
    cap_bytes = float(min(s.memory_bytes for s in device_specs))
    host_bytes = float(min(host_bytes))

    steps, cur = [], plain
    saved_p = rep_params - sharded_params
    offset = 0.0 if compiled is None else compiled - plain.device_total

    def add(option, **changes):
        nonlocal cur
        cur = dataclasses.replace(cur, **changes)
        short = [what for what, need, have in (("device memory", cur.device_total + offset, cap_bytes),
                                               ("host memory", cur.host, host_bytes)) if need > have]
        steps.append(FitStep(option, cur, not short, " and ".join(short) or None))

    if saved_p > 0:
        add("zero 1", opt_state=cur.opt_state - opt_ratio * saved_p)
        add("zero 2", grads=cur.grads - saved_p)
        add("zero 3", params=cur.params - saved_p)
    add("remat", activations=sum(boundary) + max(residuals, default=0.0))
    add("amp bf16 activations", activations=cur.activations / 2)
    add("offload opt_state", opt_state=0.0, host=cur.host + cur.opt_state)
    add("offload params", params=0.0, host=cur.host + cur.params)
    add("offload grads", grads=0.0, host=cur.host + cur.grads)
    rep = max(replicas) if replicas else 1
    return MemoryFit(cap_bytes, plain, tuple(steps), rep_params / params if params else 0.0, rep, host_bytes,
                     compiled)
