"""Sharding patterns (Whale section 3.2.2) and bridges (3.2.3): from TaskGraphs to layouts.

Walking the captured equations in order, each value carries a ShardingInfo: for every dimension
the mesh axes it is split over (or None). Inside a `split` TaskGraph, ShardingUnits that read a
parameter are matched against patterns, and the pattern with the least communication wins:

- matmul SP1 (column): weight split on its output dim, input whole -> output split, no forward
  communication, input gradient all-reduced in the backward pass.
- matmul SP2 (row): weight split on its contraction dim, input split on the same dim -> partial
  sums all-reduced in the forward pass, input gradient stays local.
- embedding: table split on the hidden dim (no communication) or on the vocabulary (masked lookup,
  all-reduce).
Softmax cross-entropy and argmax over a split class dimension follow from the reduction rule:
local max/sum/argmax, then an all-reduce of the per-example result, never a gather of the logits.

A value that crosses from one TaskGraph to another whose layout differs gets a bridge: a sharding
constraint that gathers it to the consumer's layout. When the layouts agree (same batch axes,
same split axes) the bridge is fused away. The result is data: parameter and batch
PartitionSpecs plus the constraints the lowering inserts; XLA's SPMD partitioner then emits the
collectives, so the maths is that of the unannotated model by construction.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
from jax.sharding import PartitionSpec as P

from whalex import _compat as C
from whalex.core.capture import Captured, passed_origin
from whalex.core.comm import Axes, Comm
from whalex.core.names import parse_call_name
from whalex.errors import PlanError
from whalex.mesh.virtual import MeshLayout, VirtualDevice

ELEMENTWISE = frozenset("""
add sub mul div max min neg exp exp2 log log1p expm1 tanh logistic sin cos tan sqrt rsqrt cbrt pow
integer_pow abs sign select_n convert_element_type erf erfc erf_inv stop_gradient is_finite eq ne lt le
gt ge and or not xor square clamp nextafter rem floor ceil round copy copy_p atan2 reduce_precision
imag real conj sinh cosh asinh acosh atanh asin acos atan
""".split())
REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin".split())
OPAQUE_CALLS = frozenset(C.OPAQUE_CALL_PRIMITIVES)


@dataclasses.dataclass(frozen=True)
class PatternChoice:
    """Which sharding pattern a ShardingUnit got, and what each candidate would have cost."""

    taskgraph: int
    unit: str            # matmul | embedding
    param: str
    pattern: str
    costs: tuple[tuple[str, float], ...]


@dataclasses.dataclass(frozen=True)
class Coverage:
    """One parameter a split TaskGraph reads, and the layout it got; `note` says why a parameter
    was left whole (no sharding pattern matched the operation that reads it)."""

    taskgraph: int
    strategy: str            # "split(4)"
    param: str
    shape: tuple[int, ...]
    spec: P
    note: str = ""

    @property
    def left_whole(self) -> bool:
        """A matrix (or larger) the split leaves whole on every device: compute and memory not divided."""
        return self.spec == P() and len(self.shape) >= 2


@dataclasses.dataclass(frozen=True)
class ExpertCall:
    """An MoE experts call run expert-parallel: groups over `token_axes`, experts over `expert_axes`."""

    path: tuple
    taskgraph: int
    activation: str
    token_axes: Axes
    expert_axes: Axes
    experts_per_device: int


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    param_specs: tuple[P, ...]
    batch_specs: tuple[P, ...]
    constraints: dict          # (path, "in" | "out", position) -> PartitionSpec
    choices: tuple[PatternChoice, ...]
    comms: tuple[Comm, ...]
    experts: tuple[ExpertCall, ...] = ()
    coverage: tuple[Coverage, ...] = ()
    padding: tuple[tuple[int, int, int], ...] = ()   # (leaf, dim, devices): stored padded to a multiple of devices

    def comm_bytes(self, taskgraph: int | None = None) -> float:
        return sum(c.bytes for c in self.comms if taskgraph is None or c.taskgraph == taskgraph)


@dataclasses.dataclass(frozen=True)
class Info:
    """ShardingInfo of one value: mesh axes per dimension, and whether it is batch-major."""

    spec: tuple
    batch: bool

    def split_dims(self, axes: Axes) -> list[int]:
        return [d for d, a in enumerate(self.spec) if a == axes]


def _unsplit(ndim: int) -> tuple:
    return (None,) * ndim


def _nbytes(aval) -> float:
    return float(np.prod(aval.shape, dtype=np.float64)) * np.dtype(aval.dtype).itemsize


def _ring(kind: str, size: float, n: int) -> float:
    """Per-device bytes sent for a collective over `size` bytes per device (ring; all-to-all direct)."""
    if n <= 1:
        return 0.0
    return (2.0 if kind == "all-reduce" else 1.0) * (n - 1) / n * size


def _choose(candidates: list[int], shape, n: int, skip_last: bool) -> int | None:
    """`_prefer` among the dimensions `n` divides; failing those, among the dimensions of at least
    `n` elements, which the plan stores padded to a multiple of `n` (None: no dimension can split)."""
    even = _prefer([d for d in candidates if shape[d] % n == 0], shape, skip_last)
    return even if even is not None else _prefer([d for d in candidates if shape[d] >= n], shape, skip_last)


def _prefer(candidates: list[int], shape, skip_last: bool) -> int | None:
    """The dimension to split among `candidates`: not the innermost one when there are several
    (split heads, not head_dim: the score contraction stays local), then the largest (3 < heads in
    a fused (3, heads, head_dim) kernel), then the first."""
    if not candidates:
        return None
    inner = max(candidates) if skip_last and len(candidates) > 1 else None
    return min(candidates, key=lambda d: (d == inner, -shape[d], d))


def _reshape_groups(in_shape, out_shape) -> list[tuple[list[int], list[int]]]:
    """The reshape as groups (input dims, output dims) of equal element count, size-1 dims left out."""
    ins = [d for d, k in enumerate(in_shape) if k != 1]
    outs = [d for d, k in enumerate(out_shape) if k != 1]
    groups, a, b = [], 0, 0
    while a < len(ins) and b < len(outs):
        gi, go = [ins[a]], [outs[b]]
        pi, po = in_shape[ins[a]], out_shape[outs[b]]
        a, b = a + 1, b + 1
        while pi != po:
            if pi < po and a < len(ins):
                gi.append(ins[a])
                pi, a = pi * in_shape[ins[a]], a + 1
            elif po < pi and b < len(outs):
                go.append(outs[b])
                po, b = po * out_shape[outs[b]], b + 1
            else:
                return [(ins, [])]             # not a plain regrouping: nothing survives
        groups.append((gi, go))
    return groups


def to_spec(spec: tuple) -> P:
    out = []
    for a in spec:
        out.append(None if not a else (a[0] if len(a) == 1 else tuple(a)))
    while out and out[-1] is None:
        out.pop()
    return P(*out)


class _Planner:
    def __init__(self, cap: Captured, vds: Sequence[VirtualDevice], layout: MeshLayout, matmul_pattern: str):
        self.cap, self.vds, self.layout = cap, vds, layout
        self.matmul_pattern = matmul_pattern
        self.info: dict = {}          # (frame, var) -> Info
        self.producer: dict = {}      # (frame, var) -> TaskGraph index, or -1 for a batch input
        self.origin: dict = {}        # (frame, var) -> (param leaf, dims)
        self.param_spec: dict[int, list] = {}
        self.constraints: dict = {}
        self.choices: list[PatternChoice] = []
        self.comms: list[Comm] = []
        self.experts: list[ExpertCall] = []
        self.unmatched: dict[int, tuple[int, str]] = {}   # leaf -> (TaskGraph, why no pattern matched it)
        self.readers: dict[int, str] = {}                   # leaf -> the first split-scope operation reading it
        self.made_at: dict = {}                             # (frame, var) -> (equation path, output position)
        self.b = cap.global_batch

    # -- helpers ---------------------------------------------------------------------------
    def batch_spec(self, vd: VirtualDevice, aval) -> tuple:
        spec = list(_unsplit(len(aval.shape)))
        if aval.shape and aval.shape[0] % self.b == 0:
            spec[0] = vd.batch_axes
        return tuple(spec)

    def shards(self, axes) -> int:
        return self.layout.axis_size(axes) if axes else 1

    def group_bytes(self, aval, info: Info, vd: VirtualDevice) -> float:
        """Bytes of a value within one model group (the batch shard of this replica)."""
        div = self.shards(info.spec[0]) if info.batch and info.spec and info.spec[0] else 1
        return _nbytes(aval) / div

    def comm(self, tg, kind, axes, nbytes, reason):
        n = self.shards(axes)
        if n > 1 and nbytes > 0:
            self.comms.append(Comm(tg, kind, tuple(axes), _ring(kind, nbytes, n), reason))

    def read(self, frame, v) -> Info:
        if isinstance(v, C.Literal):
            return Info(_unsplit(np.ndim(v.val)), False)
        return self.info.get((frame, v), Info(_unsplit(len(v.aval.shape)), False))

    def param_of(self, frame, v):
        if isinstance(v, C.Literal):
            return None
        return self.origin.get((frame, v))

    def decide_param(self, leaf: int, dim: int, axes: Axes) -> bool:
        if leaf in self.param_spec:
            return False
        spec = [None] * len(self.cap.jaxpr.jaxpr.invars[leaf].aval.shape)
        spec[dim] = axes
        self.param_spec[leaf] = spec
        return True

    # -- the walk --------------------------------------------------------------------------
    def run(self) -> ShardingPlan:
        jaxpr = self.cap.jaxpr.jaxpr
        n = self.cap.num_params
        for i, v in enumerate(jaxpr.invars[:n]):
            self.origin[((), v)] = (i, tuple(range(len(v.aval.shape))))
        first_use = self._first_consumers(jaxpr)
        batch_specs = []
        for v in self.cap.batch_vars:
            tg = first_use.get(v, 0)
            vd = self.vds[tg]
            spec = self.batch_spec(vd, v.aval)
            dp = self.shards(vd.batch_axes)
            if self.b % dp:
                raise PlanError(
                    f"the global batch of {self.b} cannot be divided over the {dp} data-parallel replicas of "
                    f"{self.cap.taskgraphs[tg].name} (wh.{vd.strategy.label()}); use a batch size that is a "
                    f"multiple of {dp}.")
            self.info[((), v)] = Info(spec, True)
            self.producer[((), v)] = -1
            batch_specs.append(to_spec(spec))
        for vd in self.vds:
            dp = self.shards(vd.batch_axes)
            if self.b % dp:
                raise PlanError(
                    f"the global batch of {self.b} cannot be divided over the {dp} data-parallel replicas of "
                    f"TG{vd.taskgraph} (wh.{vd.strategy.label()}); use a batch size that is a multiple of {dp}.")
        self.walk(jaxpr, ())
        self._gradient_sync()
        specs = []
        for i, v in enumerate(jaxpr.invars[:n]):
            spec = self.param_spec.get(i)
            specs.append(to_spec(tuple(spec)) if spec else P())
        return ShardingPlan(tuple(specs), tuple(batch_specs), self.constraints, tuple(self.choices),
                            tuple(self.comms), tuple(self.experts), self._coverage(specs), self._padding())

    def _padding(self) -> tuple[tuple[int, int, int], ...]:
        """(leaf, dim, devices) for every split dimension the device count does not divide."""
        out = []
        for leaf, spec in sorted(self.param_spec.items()):
            shape = self.cap.jaxpr.jaxpr.invars[leaf].aval.shape
            for d, a in enumerate(spec):
                if a and shape[d] % self.shards(a):
                    out.append((leaf, d, self.shards(a)))
        return tuple(out)

    def _coverage(self, specs) -> tuple[Coverage, ...]:
        out = []
        for tg in self.cap.taskgraphs:
            vd = self.vds[tg.index]
            if not vd.model_axes:
                continue
            for leaf in tg.params:
                shape = tuple(self.cap.jaxpr.jaxpr.invars[leaf].aval.shape)
                note = ""
                if specs[leaf] == P() and len(shape) >= 2:
                    note = self.unmatched.get(leaf, (None, self.readers.get(leaf, "")))[1]
                for d, a in enumerate(self.param_spec.get(leaf, ())):
                    k = self.shards(a) if a else 1
                    if shape[d] % k:
                        note = f"dim {d} padded {shape[d]} -> {-(-shape[d] // k) * k} ({k} does not divide {shape[d]})"
                out.append(Coverage(tg.index, vd.strategy.label(), self.cap.param_paths[leaf], shape, specs[leaf], note))
        return tuple(out)

    def _first_consumers(self, jaxpr) -> dict:
        first: dict = {}
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.invars:
                if not isinstance(v, C.Literal) and v not in first:
                    first[v] = self._deep_tg((i,), eqn, v)
        return first

    def _deep_tg(self, path, eqn, v):
        """The TaskGraph that really consumes `v` through `eqn` (looking into calls)."""
        if C.is_call(eqn):
            sub, _ = C.call_jaxpr(eqn)
            idx = [k for k, x in enumerate(eqn.invars) if x is v]
            if idx:
                inner = sub.invars[idx[0]]
                for j, e in enumerate(sub.eqns):
                    if any(x is inner for x in e.invars):
                        return self._deep_tg(path + (j,), e, inner)
        return self.cap.assign[path]

    def walk(self, jaxpr, frame):
        for i, eqn in enumerate(jaxpr.eqns):
            path = frame + (i,)
            tg = self.cap.assign[path]
            vd = self.vds[tg]
            activation = parse_call_name(str(eqn.params.get("name", ""))) if C.is_call(eqn) else None
            if activation is not None and vd.model_axes:
                outs = self.expert_parallel(path, frame, eqn, tg, vd, activation)
                for v, info in zip(eqn.outvars, outs):
                    self.info[(frame, v)] = info
                    self.producer[(frame, v)] = tg
                continue
            ins = [self.bridge(path, pos, frame, v, tg, vd) for pos, v in enumerate(eqn.invars)]
            if C.is_call(eqn):
                sub, _ = C.call_jaxpr(eqn)
                for iv, v, info in zip(sub.invars, eqn.invars, ins):
                    self.info[(path, iv)] = info
                    self.producer[(path, iv)] = tg
                    o = self.param_of(frame, v)
                    if o is not None:
                        self.origin[(path, iv)] = o
                self.walk(sub, path)
                outs = [self.read(path, v) for v in sub.outvars]
            else:
                passed = passed_origin(eqn, {v: self.origin[(frame, v)] for v in eqn.invars
                                             if not isinstance(v, C.Literal) and (frame, v) in self.origin})
                if passed is not None:
                    self.origin[(frame, eqn.outvars[0])] = passed
                if vd.model_axes:
                    outs = self.split_rule(path, frame, eqn, ins, tg, vd)
                else:
                    outs = self.replicate_rule(eqn, ins, vd)
            for k, (v, info) in enumerate(zip(eqn.outvars, outs)):
                self.info[(frame, v)] = info
                self.producer[(frame, v)] = tg
                self.made_at[(frame, v)] = (path, k)

    # -- bridges ---------------------------------------------------------------------------
    def bridge(self, path, pos, frame, v, tg, vd) -> Info:
        info = self.read(frame, v)
        if isinstance(v, C.Literal) or self.param_of(frame, v) is not None:
            return info
        if self.producer.get((frame, v), tg) == tg:
            return info
        aval = v.aval
        if info.batch:
            want = list(self.batch_spec(vd, aval))
            for d, a in enumerate(info.spec):       # fuse: keep a split on this TaskGraph's own axes
                if d > 0 and a and a == vd.model_axes:
                    want[d] = a
        else:
            want = list(_unsplit(len(aval.shape)))
        want = tuple(want)
        if want == info.spec:
            return info
        size = self.group_bytes(aval, info, vd)
        for d, (have, need) in enumerate(zip(info.spec, want)):
            if have and have != need:
                gathered = tuple(a for a in have if not need or a not in need)
                self.comm(tg, "all-gather", gathered, size, f"bridge into TG{tg}: gather dim {d}")
        self.constraints[(path, "in", pos)] = to_spec(want)
        made = self.made_at.get((frame, v))
        if made is not None:            # the producer keeps its own layout up to the bridge
            self.constraints.setdefault((made[0], "out", made[1]), to_spec(info.spec))
        return Info(want, info.batch)

    # -- experts (MoE) ----------------------------------------------------------------------
    def expert_parallel(self, path, frame, eqn, tg, vd, activation) -> list[Info]:
        """Whale's Example 5: experts split over the model axes, tokens stay data parallel.

        The dispatched buffer [G, E, C, d] keeps its groups sharded over every axis of the replica
        (no bridge gather); the call becomes an all-to-all / local experts / all-to-all shard_map.
        """
        buf, weights = eqn.invars[0], eqn.invars[1:]
        ma = vd.model_axes
        n = self.shards(ma)
        g, e = buf.aval.shape[:2]
        if e % n:
            raise PlanError(
                f"the MoE layer has {e} experts, which cannot be spread evenly over the {n} devices of "
                f"{self.cap.taskgraphs[tg].name} (wh.{vd.strategy.label()}); use a number of experts that is a "
                f"multiple of {n}, or a split degree that divides {e}.")
        token_axes = tuple(a for a in self.layout.axis_names if a in ma or (a in vd.batch_axes and self.shards((a,)) > 1))
        shards = self.shards(token_axes)
        if g % self.b or g % shards:
            raise PlanError(
                f"the MoE layer routes {g} token groups, which do not divide over the {shards} devices that "
                f"hold tokens (global batch {self.b}); use a batch size that is a multiple of {shards}.")
        info = self.read(frame, buf)
        want = (token_axes,) + _unsplit(len(buf.aval.shape) - 1)
        if info.spec != want:
            self.constraints[(path, "in", 0)] = to_spec(want)
        for w in weights:
            o = self.param_of(frame, w)
            if o is None:
                raise PlanError("the MoE experts' weights must be parameters of the model (leaves of params), "
                                "so that whalex can shard them over the expert devices.")
            leaf, dims = o
            if dims[0] is None or not self.decide_param(leaf, dims[0], ma):
                spec = self.param_spec.get(leaf)
                if spec is None or spec[dims[0]] != ma:
                    raise PlanError(f"MoE expert weight {self.cap.param_paths[leaf]} is also used outside the "
                                    "experts with another layout; give the experts their own parameters.")
        local = _nbytes(buf.aval) / shards
        for what in ("dispatch", "combine", "dispatch (bwd)", "combine (bwd)"):
            self.comm(tg, "all-to-all", ma, local, f"MoE {what}")
        self.experts.append(ExpertCall(path, tg, activation, token_axes, ma, e // n))
        return [Info(want, True)]

    # -- replicate -------------------------------------------------------------------------
    def replicate_rule(self, eqn, ins, vd):
        batch = any(i.batch for i in ins)
        return [Info(self.batch_spec(vd, v.aval) if batch else _unsplit(len(v.aval.shape)), batch)
                for v in eqn.outvars]

    # -- split -----------------------------------------------------------------------------
    _PASSING = frozenset(("reshape", "transpose", "broadcast_in_dim", "squeeze", "convert_element_type", "copy"))

    def split_rule(self, path, frame, eqn, ins, tg, vd):
        name = eqn.primitive.name
        batch = any(i.batch for i in ins)
        outs = eqn.outvars
        for v in eqn.invars:
            o = self.param_of(frame, v)
            if o is not None and name not in self._PASSING:
                self.readers.setdefault(o[0], f"read by {name}, which no sharding pattern splits")
        if name == "dot_general":
            res = self.matmul(path, frame, eqn, ins, tg, vd)
            if res is not None:
                return [res]
            for v in eqn.invars:
                o = self.param_of(frame, v)
                if o is not None:
                    self.unmatched.setdefault(o[0], (tg, "dot_general with dimension_numbers "
                                                     f"{eqn.params['dimension_numbers']} not matched"))
        if name == "gather":
            res = self.embedding(path, frame, eqn, ins, tg, vd)
            if res is not None:
                return [res]
        if name in ELEMENTWISE:
            return [self.elementwise(frame, eqn, ins, vd, batch)]
        if name == "broadcast_in_dim":
            spec = [None] * len(outs[0].aval.shape)
            for d_in, d_out in enumerate(eqn.params["broadcast_dimensions"]):
                if eqn.invars[0].aval.shape[d_in] == outs[0].aval.shape[d_out]:
                    spec[d_out] = ins[0].spec[d_in]
            return [Info(tuple(spec), batch)]
        if name == "transpose":
            perm = eqn.params["permutation"]
            return [Info(tuple(ins[0].spec[p] for p in perm), batch)]
        if name == "squeeze":
            drop = set(d % len(ins[0].spec) for d in eqn.params["dimensions"])
            return [Info(tuple(a for d, a in enumerate(ins[0].spec) if d not in drop), batch)]
        if name == "reshape":
            return [self.reshape(eqn, ins[0], tg, vd, batch)]
        if name in ("slice", "dynamic_slice"):
            return [self.keep_whole_dims(tg, vd, eqn.invars[0], ins[0], outs[0].aval.shape, batch, name)]
        if name == "split":
            return [self.keep_whole_dims(tg, vd, eqn.invars[0], ins[0], v.aval.shape, batch, name) for v in outs]
        if name == "concatenate":
            return [self.concatenate(eqn, ins, tg, vd, batch)]
        if name in REDUCTIONS:
            axes = set(eqn.params["axes"])
            spec = ins[0].spec
            reduced = [spec[d] for d in axes if spec[d]]
            out_aval = outs[0].aval
            info = Info(tuple(a for d, a in enumerate(spec) if d not in axes), batch)
            for a in reduced:
                self.comm(tg, "all-reduce", a, self.group_bytes(out_aval, info, vd),
                          f"{name} over a split dimension")
            return [Info(tuple(a if a not in reduced else None for a in info.spec), batch)]
        if name in OPAQUE_CALLS or name in ("dot_general", "gather"):
            if name == "dot_general":
                return [self.generic_dot(path, eqn, ins, tg, vd, batch)]
            first = next((i for i in ins if any(i.spec[1:]) or i.batch), ins[0] if ins else None)
            result = []
            for v in outs:
                if first is not None and len(first.spec) == len(v.aval.shape) and \
                        eqn.invars and v.aval.shape == eqn.invars[ins.index(first)].aval.shape:
                    result.append(Info(first.spec, batch))
                else:
                    result.append(Info(self.batch_spec(vd, v.aval) if batch else _unsplit(len(v.aval.shape)), batch))
            return result
        # Any other operation needs whole tensors along split dims.
        for v, info in zip(eqn.invars, ins):
            for a in info.spec[1:]:
                if a:
                    self.comm(tg, "all-gather", a, self.group_bytes(v.aval, info, vd),
                              f"{name} needs the whole tensor")
        return [Info(self.batch_spec(vd, v.aval) if batch else _unsplit(len(v.aval.shape)), batch) for v in outs]

    def elementwise(self, frame, eqn, ins, vd, batch) -> Info:
        ndim = len(eqn.outvars[0].aval.shape)
        spec = [None] * ndim
        for info in ins:
            if len(info.spec) == ndim:
                for d, a in enumerate(info.spec):
                    if spec[d] is None and a:
                        spec[d] = a
        # A parameter combined with a split value (a bias) is split the same way.
        for v in eqn.invars:
            o = self.param_of(frame, v)
            if o is None or len(v.aval.shape) != ndim:
                continue
            leaf, dims = o
            for d, a in enumerate(spec):
                if a == vd.model_axes and dims[d] is not None and v.aval.shape[d] == eqn.outvars[0].aval.shape[d]:
                    self.decide_param(leaf, dims[d], a)
        return Info(tuple(spec), batch)

    def keep_whole_dims(self, tg, vd, var, info: Info, out_shape, batch, name) -> Info:
        """slice / dynamic_slice / split: a split dimension the op keeps whole stays split (q, k and v
        sliced out of a fused (..., 3, heads, head_dim) tensor keep their heads split); a split
        dimension the op cuts is gathered first."""
        spec = []
        for d, a in enumerate(info.spec):
            if a and out_shape[d] != var.aval.shape[d]:
                self.comm(tg, "all-gather", a, self.group_bytes(var.aval, info, vd), f"{name} of a split dim")
                a = None
            spec.append(a)
        return Info(tuple(spec), batch and out_shape[0] == var.aval.shape[0])

    def concatenate(self, eqn, ins, tg, vd, batch) -> Info:
        """Concatenation along a whole dimension keeps the other dimensions' splits (rotary halves
        joined on head_dim keep the heads split)."""
        axis = eqn.params["dimension"]
        spec = [None] * len(eqn.outvars[0].aval.shape)
        for v, info in zip(eqn.invars, ins):
            for d, a in enumerate(info.spec):
                if a and d == axis:
                    self.comm(tg, "all-gather", a, self.group_bytes(v.aval, info, vd), "concatenate along a split dim")
                elif a and spec[d] is None:
                    spec[d] = a
        return Info(tuple(spec), batch)

    def reshape(self, eqn, info: Info, tg, vd, batch) -> Info:
        """A split dimension survives a reshape when it is the major dimension of the group of input
        dimensions that becomes a group of output dimensions, and the group's major output dimension
        divides over the same devices: blocks of the one are then blocks of the other (heads
        [B, L, H, Dh] -> [B, L, KV, G, Dh] stay split on KV; [B, L, KV, G, Dh] -> [B, L, H, Dh] on H).
        Any other split dimension is gathered first."""
        in_shape, out_shape = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
        spec = [None] * len(out_shape)
        for gi, go in _reshape_groups(in_shape, out_shape):
            for d in gi:
                a = info.spec[d]
                if not a:
                    continue
                if d == gi[0] and go and out_shape[go[0]] % self.shards(a) == 0 and \
                        (d > 0 or not batch or out_shape[go[0]] % self.b == 0):
                    spec[go[0]] = a
                else:
                    self.comm(tg, "all-gather", a, self.group_bytes(eqn.invars[0].aval, info, vd),
                              "reshape of a split dim")
        return Info(tuple(spec), batch)

    def generic_dot(self, path, eqn, ins, tg, vd, batch) -> Info:
        """A product of two activations (attention's scores and context): batch dims keep their
        splits (heads stay split), a contraction over a split dim is all-reduced. When the result is
        split over this TaskGraph's own axes its layout is pinned, operands and result, so that
        XLA keeps the heads where the projections put them."""
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = ins
        out_spec = [lhs.spec[d] for d in lb]
        out_spec += [lhs.spec[d] for d in range(len(lhs.spec)) if d not in lc and d not in lb]
        out_spec += [rhs.spec[d] for d in range(len(rhs.spec)) if d not in rc and d not in rb]
        partial = [lhs.spec[a] for a, b in zip(lc, rc) if lhs.spec[a] and lhs.spec[a] == rhs.spec[b]]
        info = Info(tuple(out_spec), batch)
        for a in partial:
            self.comm(tg, "all-reduce", a, self.group_bytes(eqn.outvars[0].aval, info, vd), "contraction over a split dim")
        seen, clean = set(), []
        for a in out_spec:          # one mesh axis may shard only one dimension
            clean.append(a if a and a not in seen else None)
            if a:
                seen.add(a)
        if vd.model_axes and vd.model_axes in clean and not partial:
            for pos, info in enumerate(ins):
                self.constraints[(path, "in", pos)] = to_spec(info.spec)
            self.constraints[(path, "out", 0)] = to_spec(tuple(clean))
        return Info(tuple(clean), batch)

    def _forced(self, vd: VirtualDevice) -> str:
        return vd.strategy.pattern if vd.strategy.pattern != "auto" else self.matmul_pattern

    def matmul(self, path, frame, eqn, ins, tg, vd) -> Info | None:
        """SP1 column / SP2 row for any dot_general that reads one weight: the weight may have several
        contracting and free dimensions (DenseGeneral's (in, heads, head_dim) kernels and its
        (heads, head_dim, out) output kernel, einsum-written layers, fused (in, 3, heads, head_dim)
        qkv kernels). Column splits one free dimension of the weight, row one contracting dimension
        (the one the input is already split on, if any); the cheaper of the two in communication
        wins, among those whose dimension the split degree divides."""
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lo, ro = self.param_of(frame, eqn.invars[0]), self.param_of(frame, eqn.invars[1])
        if (lo is None) == (ro is None):
            return None
        w_pos = 0 if lo is not None else 1
        x_pos = 1 - w_pos
        leaf, dims = lo if lo is not None else ro
        param_name = self.cap.param_paths[leaf]
        w_var, x_var = eqn.invars[w_pos], eqn.invars[x_pos]
        wc, xc = (lc, rc) if w_pos == 0 else (rc, lc)
        wb = lb if w_pos == 0 else rb
        w_shape = w_var.aval.shape
        w_free = [d for d in range(len(w_shape)) if d not in wc and d not in wb]
        if wb:
            self.unmatched.setdefault(leaf, (tg, f"dot_general with the weight's dimensions {tuple(wb)} as batch "
                                                f"dimensions (dimension_numbers {eqn.params['dimension_numbers']})"))
            return None
        ma = vd.model_axes
        n = self.shards(ma)
        x, x_aval, y_aval = ins[x_pos], x_var.aval, eqn.outvars[0].aval
        # column: a free weight dim; row: a contracting one (position k in wc / xc)
        col_dims = [d for d in w_free if dims[d] is not None]
        row_ks = [k for k, d in enumerate(wc) if dims[d] is not None]
        if not col_dims and not row_ks:
            return None
        x_split_k = next((k for k, d in enumerate(xc) if x.spec[d] == ma), None)
        col = _choose(col_dims, w_shape, n, len(w_free) > 1)
        if x_split_k is not None and x_split_k in row_ks:
            row_k = x_split_k
        else:
            k_dims = _choose([wc[k] for k in row_ks], w_shape, n, len(wc) > 1)
            row_k = None if k_dims is None else list(wc).index(k_dims)
        pads = {"column": col is not None and w_shape[col] % n != 0,
                "row": row_k is not None and w_shape[wc[row_k]] % n != 0}
        x_split_c = x_split_k is not None
        x_bytes = self.group_bytes(x_aval, x, vd)
        y_info = Info(self.batch_spec(vd, y_aval) if x.batch else _unsplit(len(y_aval.shape)), x.batch)
        y_bytes = self.group_bytes(y_aval, y_info, vd)
        inf = float("inf")
        cost = {
            "column": inf if col is None else
            (_ring("all-gather", x_bytes, n) + _ring("reduce-scatter", x_bytes, n)) if x_split_c
            else _ring("all-reduce", x_bytes, n),
            "row": inf if row_k is None else
            _ring("all-reduce", y_bytes, n) + (0.0 if x_split_k == row_k else _ring("all-gather", x_bytes, n)),
        }
        decided = self.param_spec.get(leaf)
        if decided is not None:       # a weight used twice keeps its first layout
            on = [d for d in range(len(w_shape)) if dims[d] is not None and decided[dims[d]] == ma]
            if on and on[0] in wc:
                pattern, row_k = "row", list(wc).index(on[0])
            elif on and on[0] in w_free:
                pattern, col = "column", on[0]
            else:
                return None
        else:
            forced = self._forced(vd)
            if forced != "auto" and cost[forced] == inf or cost["column"] == cost["row"] == inf:
                sizes = ", ".join(f"{w_shape[d]}" for d in (col_dims if forced == "column" else
                                                             [wc[k] for k in row_ks] if forced == "row" else
                                                             col_dims + [wc[k] for k in row_ks]))
                which = {"column": "output (free)", "row": "contracted"}.get(forced, "output and contracted")
                raise PlanError(
                    f"split({n}) cannot shard {param_name} (shape {tuple(w_shape)}): its {which} dimensions "
                    f"({sizes}) are all smaller than the {n} devices of {self.cap.taskgraphs[tg].name}, so no "
                    f"split gives every device a part. Use a split degree of at most the largest of them, or move "
                    f"this layer out of the split scope.")
            natural = "row" if x_split_c else "column"      # on a tie: the one that takes x as it is laid out
            pattern = forced if forced != "auto" else \
                min(("column", "row"), key=lambda k: (cost[k], pads[k], k != natural))
            self.decide_param(leaf, dims[col] if pattern == "column" else dims[wc[row_k]], ma)
        label = "SP1 column" if pattern == "column" else "SP2 row"
        size = w_shape[col] if pattern == "column" else w_shape[wc[row_k]]
        if size % n:
            label += f", padded {size} -> {-(-size // n) * n}"
        self.choices.append(PatternChoice(tg, "matmul", param_name, label, tuple(sorted(cost.items()))))
        # the input: contracting dims whole (column) or split on the row dim; ma leaves its other dims
        x_want = [None if a == ma else a for a in x.spec]
        for k, d in enumerate(xc):
            x_want[d] = ma if pattern == "row" and k == row_k else None
        if pattern == "column":
            if x_split_c:
                self.comm(tg, "all-gather", ma, x_bytes, f"SP1 {param_name}: gather input")
                self.comm(tg, "reduce-scatter", ma, x_bytes, f"SP1 {param_name}: input grad (bwd)")
            else:
                self.comm(tg, "all-reduce", ma, x_bytes, f"SP1 {param_name}: input grad (bwd)")
        else:
            self.comm(tg, "all-reduce", ma, y_bytes, f"SP2 {param_name}: partial sums")
            if x_split_k != row_k:
                self.comm(tg, "all-gather", ma, x_bytes, f"SP2 {param_name}: input grad (bwd)")
        w_spec = [ma if pattern == "column" and d == col else None for d in range(len(w_shape))]
        lhs, rhs = (w_spec, x_want) if w_pos == 0 else (x_want, w_spec)
        out = [lhs[d] for d in lb]
        out += [lhs[d] for d in range(len(lhs)) if d not in lc and d not in lb]
        out += [rhs[d] for d in range(len(rhs)) if d not in rc and d not in rb]
        self.constraints[(path, "in", x_pos)] = to_spec(tuple(x_want))     # pinned: XLA must not re-split it
        self.constraints[(path, "out", 0)] = to_spec(tuple(out))
        return Info(tuple(out), x.batch)

    def embedding(self, path, frame, eqn, ins, tg, vd) -> Info | None:
        o = self.param_of(frame, eqn.invars[0])
        if o is None or len(eqn.invars[0].aval.shape) != 2:
            return None
        leaf, dims = o
        dn = eqn.params["dimension_numbers"]
        table = eqn.invars[0].aval.shape
        if tuple(dn.collapsed_slice_dims) != (0,) or tuple(dn.start_index_map) != (0,) or \
                tuple(eqn.params["slice_sizes"]) != (1, table[1]) or None in dims:
            return None
        ma = vd.model_axes
        n = self.shards(ma)
        idx = ins[1]
        y_aval = eqn.outvars[0].aval
        y_info = Info(self.batch_spec(vd, y_aval) if idx.batch else _unsplit(len(y_aval.shape)), idx.batch)
        y_bytes = self.group_bytes(y_aval, y_info, vd)
        inf = float("inf")
        cost = {"column": 0.0 if table[1] >= n else inf,
                "row": _ring("all-reduce", y_bytes, n) if table[0] >= n else inf}
        decided = self.param_spec.get(leaf)
        if decided is not None:
            pattern = "row" if decided[dims[0]] == ma else "column"
        else:
            forced = self._forced(vd)
            if forced != "auto" and cost[forced] == inf or cost["column"] == cost["row"] == inf:
                raise PlanError(
                    f"split({n}) cannot shard the embedding {self.cap.param_paths[leaf]} (shape {tuple(table)}): "
                    f"{'its hidden size is' if forced == 'column' else 'its vocabulary is' if forced == 'row' else 'its vocabulary and hidden size are both'} "
                    f"smaller than the {n} devices of {self.cap.taskgraphs[tg].name}. Use a smaller split degree, "
                    f"or move the embedding out of the split scope.")
            pattern = forced if forced != "auto" else min(("column", "row"), key=lambda k: (cost[k], k != "column"))
            self.decide_param(leaf, dims[1] if pattern == "column" else dims[0], ma)
        name = self.cap.param_paths[leaf]
        self.choices.append(PatternChoice(tg, "embedding", name,
                                          "hidden split" if pattern == "column" else "vocab split",
                                          tuple(sorted(cost.items()))))
        out = list(y_info.spec)
        if pattern == "column":
            out[-1] = ma
        else:
            self.comm(tg, "all-reduce", ma, y_bytes, f"vocab-split embedding {name}")
        self.constraints[(path, "out", 0)] = to_spec(tuple(out))
        return Info(tuple(out), idx.batch)

    def _gradient_sync(self):
        """Data-parallel gradient all-reduce per parameter, over the batch axes of its TaskGraph."""
        for tg in self.cap.taskgraphs:
            vd = self.vds[tg.index]
            for leaf in tg.params:
                var = self.cap.jaxpr.jaxpr.invars[leaf]
                spec = self.param_spec.get(leaf) or [None] * len(var.aval.shape)
                split = self.shards(next((a for a in spec if a), ()))
                axes = vd.batch_axes if self.shards(vd.batch_axes) > 1 else ()
                self.comm(tg.index, "all-reduce", axes, _nbytes(var.aval) / split,
                          f"gradient sync {self.cap.param_paths[leaf]}")


def plan_shardings(cap: Captured, vds: Sequence[VirtualDevice], layout: MeshLayout,
                   matmul_pattern: str = "auto") -> ShardingPlan:
    """Match sharding patterns and place bridges for every TaskGraph."""
    return _Planner(cap, vds, layout, matmul_pattern).run()
