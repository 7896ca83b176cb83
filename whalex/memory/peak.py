"""Predicted per-device memory of a training step: its buffers' liveness replayed over its jaxpr.

XLA's figure for a compiled step (`memory_analysis`: arguments + outputs + temp - aliased) is the
most bytes its buffers hold at once. `traced_peak` replays the step's jaxpr (a `TracedStep`: plain
data the planner makes from the program), per device and without compiling, in the terms XLA
allocates buffers in:

- sizes: `shard_map` bodies carry per-device shapes; outside them a value's size is divided by its
  sharding as GSPMD propagates it (shard_specs.py). An all-reduced value (a contraction over a
  sharded dimension) keeps its partial sums in a second buffer until it is first read.
- fusion: XLA fuses chains of element-wise and layout ops into their users, so such a value read
  only by fusible ops gets no buffer: its inputs stay live until its users run instead. This is why
  the backward pass holds fewer bytes than the residuals JAX saves for it. Reshapes and transposed
  dot results are views; dead values are dropped; calls are inlined.
- reuse: an element-wise op, a scatter, a loop or (where XLA updates a conditional's operands in
  place) a conditional writes its result into an operand that dies there, the caller's buffer
  included (a loop body's chain of conditionals each updating the carried W stash holds one stash);
  the new state goes into the donated state's buffers; values on a host memory kind take no device
  memory; loops and conditionals add their body's own peak on top of what is live around them.
- schedule: XLA orders the program to keep memory low; the replay takes the lower peak of program
  order and of a memory-greedy list schedule (the kind of scheduler XLA tries among others).

What differs between XLA's backends and versions lives in the rules' conditions (op_kinds.py, the
`platform` argument, `_compat.CONDITIONAL_UPDATES_IN_PLACE`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from whalex import _compat as C
from whalex.memory.buffer_schedule import BufferGraph, list_schedule, sweep
from whalex.memory.flat import Op, aval_bytes, bodies, flatten
from whalex.memory.gpu_fusion import shared_outputs
from whalex.memory.op_kinds import CHEAP, EXPENSIVE, FUSIBLE, GPU_PLATFORMS, REDUCE, UPDATES, VIEW
from whalex.memory.shard_specs import Spec, adopt, on_host, propagate, sharding_spec, shards, spec_of, valid, wanted
from whalex.records.program import TracedStep


@dataclasses.dataclass(frozen=True)
class Peak:
    """Predicted per-device bytes of a step, in XLA's terms: arguments, outputs that are not written
    into donated arguments, and temporaries at the step's peak."""

    arguments: float
    outputs: float
    temp: float

    @property
    def total(self) -> float:
        return self.arguments + self.outputs + self.temp


@dataclasses.dataclass(frozen=True)
class _Value:
    """What the replay knows of one value."""

    nbytes: float            # per device, 0 on a host memory kind
    spec: Spec | None        # None: per-device shapes (inside shard_map)
    partial: float = 0.0     # bytes of the partial sums an implicit all-reduce keeps until first read
    host: bool = False
    reduced: Spec | None = None    # an all-reduced value: the sharding of its partial sums


# ----------------------------------------------------------------------------------- sizes
# ----------------------------------------------------------------------------------- the program
@dataclasses.dataclass(frozen=True)
class _Env:
    axis_sizes: dict
    local: bool              # inside shard_map: avals are per device
    platform: str = "cpu"


def _replicated(aval, env: _Env) -> _Value:
    return _Value(0.0, None if env.local else ((),) * len(getattr(aval, "shape", ())))


def _sized(aval, x: _Value, env: _Env) -> _Value:
    """`x` with its per-device bytes, and those of its partial sums when it is all-reduced: sharded
    as the product was (a reduce-scatter sums the whole local product). XLA's CPU compiler writes a
    reduce-scatter as an all-reduce and a slice: the whole sum is one more buffer there."""
    if x.host:
        return dataclasses.replace(x, nbytes=0.0, partial=0.0)
    full = aval_bytes(aval)
    if env.local or x.spec is None:
        return dataclasses.replace(x, nbytes=full)
    n = full / shards(valid(x.spec, aval.shape, env.axis_sizes), env.axis_sizes)
    partial = 0.0
    if x.reduced is not None:
        partial = full / shards(valid(x.reduced, aval.shape, env.axis_sizes), env.axis_sizes)
        if env.platform == "cpu" and partial > n:
            partial *= 2
    return dataclasses.replace(x, nbytes=n, partial=partial)


def _body_operands(eqn, body, ins: Sequence[_Value]) -> list[_Value]:
    """The operands a body's invars receive: the equation's last ones (a cond's index and a while
    loop's condition constants come first); a scanned operand loses its leading dimension."""
    bj, _ = C.open_jaxpr(body)
    out = []
    for v, x in zip(bj.invars, ins[len(ins) - len(bj.invars):]):
        nd = len(getattr(v.aval, "shape", ()))
        out.append(dataclasses.replace(x, spec=x.spec[len(x.spec) - nd:]) if x.spec is not None else x)
    return out


def _carries(e) -> int:
    """How many of a loop body's outputs are carries: XLA keeps a carry in one buffer across
    iterations, so the body writes the new value into the old one's buffer."""
    if e.primitive.name == "while":
        return len(e.outvars)
    if e.primitive.name == "scan":
        return C.scan_counts(e)[1]
    return 0


# ----------------------------------------------------------------------------------- shardings
def _forward(ops: Sequence[Op], vals: dict, env: _Env) -> None:
    """Sharding, all-reduce and memory kind of every result, propagated from the operands (in place)."""
    def read(x, aval):
        return _replicated(aval, env) if isinstance(x, C.Literal) else vals[x]

    for op in ops:
        e, name = op.eqn, op.eqn.primitive.name
        args = [read(x, v.aval) for x, v in zip(op.ins, e.invars)]
        if env.local:
            host = any(a.host for a in args)
            outs = [_Value(0.0, None, host=host) for _ in op.outs]
        elif name == "shard_map":
            outs = [_Value(0.0, spec_of(s, len(getattr(v.aval, "shape", ()))))
                    for s, v in zip(C.shard_map_out_specs(e), e.outvars)]
        elif bodies(e):                           # loops and conditionals: the (first) body's view
            body = bodies(e)[0]
            bj, _ = C.open_jaxpr(body)
            inner, out_keys = flatten(bj, [("in", k) for k in range(len(bj.invars))])
            ivals = dict(zip([("in", k) for k in range(len(bj.invars))], _body_operands(e, body, args)))
            _forward(inner, ivals, env)
            outs = []
            for v, u in zip(e.outvars, out_keys):
                o = _replicated(v.aval, env) if isinstance(u, C.Literal) else ivals[u]
                nd = len(getattr(v.aval, "shape", ()))
                outs.append(_Value(0.0, ((),) * (nd - len(o.spec)) + tuple(o.spec), host=o.host))  # scan: stacked
        else:
            host = name == "device_put" and any(on_host(d) for d in (e.params.get("devices") or ()))
            outs = [_Value(0.0, s, host=host, reduced=s if red else None)
                    for s, red in propagate(e, [a.spec for a in args])]
        vals.update(zip(op.outs, outs))


def _backward(ops: Sequence[Op], vals: dict, fixed: set, env: _Env) -> None:
    """GSPMD also propagates shardings from users to operands: a broadcast mask or a zero tangent
    used beside a batch-sharded value is sharded like it (in place; `fixed` keys keep theirs)."""
    for op in reversed(ops):
        for k, c in _loop_carries(op.eqn):       # a loop's carry is sharded as the body leaves it
            x, want = op.ins[k], vals[op.outs[c]].spec
            if not isinstance(x, C.Literal) and x not in fixed and vals[x].spec is not None and want is not None \
                    and len(want) == len(vals[x].spec):
                shape = getattr(op.eqn.invars[k].aval, "shape", ())
                vals[x] = dataclasses.replace(vals[x], spec=adopt(vals[x].spec, want, shape, env.axis_sizes))
        if not op.outs or vals[op.outs[0]].spec is None:
            continue
        out = vals[op.outs[0]].spec
        for k, x in enumerate(op.ins):
            if isinstance(x, C.Literal) or x in fixed or vals[x].spec is None:
                continue
            want = wanted(op.eqn, k, out)
            shape = getattr(op.eqn.invars[k].aval, "shape", ())
            if want is not None and len(want) == len(shape):
                vals[x] = dataclasses.replace(vals[x], spec=adopt(vals[x].spec, want, shape, env.axis_sizes))


# ----------------------------------------------------------------------------------- the replay
@dataclasses.dataclass(frozen=True)
class _Level:
    """One jaxpr level, flattened: its equations, the keys of its invars and outputs, every value
    sized, and who reads what."""

    ops: list
    in_keys: list
    out_keys: list
    vals: dict               # key -> sized _Value
    reads: list              # per op: the keys it reads
    consumers: dict          # key -> the ops reading it, in order
    shared: dict             # key -> the key whose buffer holds it (`gpu_fusion.shared_outputs`)

    @property
    def outs(self) -> set:
        return {u for u in self.out_keys if not isinstance(u, C.Literal)}

    def read(self, x, aval, env: _Env) -> _Value:
        return _sized(aval, _replicated(aval, env), env) if isinstance(x, C.Literal) else self.vals[x]


def _level(jaxpr, ins: Sequence[_Value], env: _Env, hints=None) -> _Level:
    """`jaxpr` flattened, with every value's sharding propagated (forward, then back from its users
    and from `hints`, the outputs' shardings as the caller sees them) and its per-device size."""
    in_keys = [("in", k) for k in range(len(jaxpr.invars))]
    ops, out_keys = flatten(jaxpr, in_keys)
    avals = {("in", k): v.aval for k, v in enumerate(jaxpr.invars)}
    for op in ops:
        avals.update(zip(op.outs, [v.aval for v in op.eqn.outvars]))
    vals = dict(zip(in_keys, ins))
    consts = {x for op in ops for x in op.ins if not isinstance(x, C.Literal) and x not in vals and x[1] == "const"}
    vals.update({x: _replicated(x[2].aval, env) for x in consts})
    avals.update({x: x[2].aval for x in consts})
    _forward(ops, vals, env)
    if not env.local:
        for u, h in zip(out_keys, hints or ()):
            if not isinstance(u, C.Literal) and u not in in_keys and h.spec is not None and vals[u].spec is not None \
                    and len(h.spec) == len(vals[u].spec):
                vals[u] = dataclasses.replace(vals[u], spec=adopt(vals[u].spec, h.spec, avals[u].shape, env.axis_sizes))
        _backward(ops, vals, set(in_keys), env)
    reads = [[x for x in op.ins if not isinstance(x, C.Literal)] for op in ops]
    consumers: dict = {}
    for i, rs in enumerate(reads):
        for x in rs:
            consumers.setdefault(x, []).append(i)
    shared = {}
    if env.platform in GPU_PLATFORMS and not env.local:
        for op in ops:
            if op.eqn.primitive.name == "shard_map":
                shared.update({x: lead for x, lead in shared_outputs(op, ops, consumers).items()
                               if x in consumers and x not in out_keys})
    return _Level(ops, in_keys, out_keys, {x: _sized(avals[x], v, env) for x, v in vals.items()}, reads, consumers,
                  shared)


def _replay(jaxpr, ins: Sequence[_Value], env: _Env, aliased: Sequence[int] = (), hints=None,
            owned: Sequence[int] = ()):
    """(peak bytes of the values this jaxpr defines, its outputs as sized _Values). Outputs at
    positions in `aliased` are written into donated arguments or loop carries (no new buffer);
    `hints`: the outputs' shardings as the caller sees them; invars at positions in `owned` are
    buffers this body may overwrite once it last reads them (a loop's carries, a conditional's
    operands that die there)."""
    jaxpr, _ = C.open_jaxpr(jaxpr)
    lv = _level(jaxpr, ins, env, hints)
    own = {lv.in_keys[k] for k in owned}
    inner = [_inner_peak(op, lv, env, _dying(lv, i, own) if op.eqn.primitive.name != "cond" or
                         C.CONDITIONAL_UPDATES_IN_PLACE else ()) for i, op in enumerate(lv.ops)]
    sliced = [_sliced(op, lv.vals, env) for op in lv.ops]
    inner = [p + sum(sliced[i].values()) for i, p in enumerate(inner)]
    kept = {lv.out_keys[k] for k in aliased
            if not isinstance(lv.out_keys[k], C.Literal) and lv.out_keys[k] not in lv.in_keys}
    graph = _graph(lv, _virtual(lv, env), kept, inner, [set(d) for d in sliced], own)
    peak = min(sweep(graph, list(range(len(lv.ops)))), sweep(graph, list_schedule(graph)))
    return peak, [lv.read(u, v.aval, env) for u, v in zip(lv.out_keys, jaxpr.outvars)]


def _dying(lv: _Level, i: int, own: set) -> list:
    """Positions of op `i`'s operands that it reads last and whose buffers this level may reuse."""
    outs = lv.outs
    return [k for k, x in enumerate(lv.ops[i].ins) if not isinstance(x, C.Literal) and x not in outs
            and (x[0] != "in" or x in own) and lv.consumers[x][-1] == i]


def _virtual(lv: _Level, env: _Env) -> set:
    """The values XLA gives no buffer of their own: views (reshapes, a transposed dot result, an
    unchanged sharding), dead values, and element-wise or layout values fused into their users.
    On CPU a transcendental result read twice keeps a buffer, and so do the cheap values computed
    from it (XLA emits them from the same fusion); on a GPU both are recomputed in each user."""
    ops, vals, consumers, outs = lv.ops, lv.vals, lv.consumers, lv.outs
    producer = {x: i for i, op in enumerate(ops) for x in op.outs}

    def kept_expensive(u) -> bool:
        p = producer.get(u)
        return p is not None and ops[p].eqn.primitive.name in EXPENSIVE and len(consumers.get(u, ())) > 1

    def fused(x, op) -> bool:
        name, src = op.eqn.primitive.name, op.ins[0] if op.ins else None
        if src is not None and not isinstance(src, C.Literal) and (
                name in VIEW or (name == "transpose" and len(consumers.get(src, ())) == 1) or
                (name in ("sharding_constraint", "reshard") and vals[x].spec == vals[src].spec)):
            return True
        cs = consumers.get(x, [])
        if not cs:
            return x not in outs
        if x in outs or name not in FUSIBLE or not all(ops[c].eqn.primitive.name in FUSIBLE | REDUCE for c in cs):
            return False
        if env.platform in GPU_PLATFORMS:
            return True
        if name in EXPENSIVE:
            return len(cs) == 1
        return not any(kept_expensive(u) for u in op.ins if not isinstance(u, C.Literal))

    return {x for op in ops for x in op.outs if fused(x, op)} | set(lv.shared)


def _sliced(op: Op, vals: dict, env: _Env) -> dict:
    """key -> per-device bytes of the operands a shard_map takes more finely split than they are:
    GSPMD slices each at the entry (the whole operand can die there, the slice lives inside)."""
    if env.local or op.eqn.primitive.name != "shard_map":
        return {}
    out = {}
    for x, v, spec in zip(op.ins, op.eqn.invars, C.shard_map_in_specs(op.eqn)):
        if isinstance(x, C.Literal) or vals[x].host:
            continue
        local = aval_bytes(v.aval) / shards(valid(spec_of(spec, len(v.aval.shape)), v.aval.shape, env.axis_sizes),
                                          env.axis_sizes)
        if local < vals[x].nbytes:
            out[x] = local
    return out


def _inner_peak(op: Op, lv: _Level, env: _Env, dying: Sequence[int] = ()) -> float:
    """The peak of the values a loop, conditional or shard_map defines inside its body; a loop's
    carries and the operands at positions `dying` (read last here) are the body's to overwrite."""
    e = op.eqn
    if e.primitive.name == "shard_map":
        return _shard_map_peak(op, lv, env)
    if not bodies(e):
        return 0.0
    args = [lv.read(x, v.aval, env) for x, v in zip(op.ins, e.invars)]
    outs = [lv.read(x, v.aval, env) for x, v in zip(op.outs, e.outvars)]
    peaks = []
    for b in bodies(e):
        bj, _ = C.open_jaxpr(b)
        lead = len(e.invars) - len(bj.invars)
        owned = {k - lead for k in dying if k >= lead} | set(_carry_invars(e, len(bj.invars)))
        peaks.append(_replay(b, _body_operands(e, b, args), env, range(_carries(e)), hints=outs,
                             owned=sorted(owned))[0])
    return max(peaks)


def _shard_map_peak(op: Op, lv: _Level, env: _Env) -> float:
    """The peak inside a shard_map's body: per-device shapes, and where it leaves mesh axes to GSPMD
    (`axis_names=`), those axes' shardings as GSPMD propagates them from the operands' outside."""
    e = op.eqn
    body = C.sub_jaxprs(e)[0]
    bj, _ = C.open_jaxpr(body)
    auto = {a: n for a, n in env.axis_sizes.items() if a in C.shard_map_auto_axes(e) and n > 1}
    if not auto or env.local:
        return _replay(body, [_Value(0.0, None) for _ in bj.invars], _Env(env.axis_sizes, True, env.platform))[0]
    inner = _Env(auto, False, env.platform)
    ins = []
    for x, v in zip(op.ins, bj.invars):
        outer = lv.read(x, v.aval, env).spec or ()
        spec = tuple(tuple(a for a in entry if a in auto) for entry in outer)
        ins.append(_sized(v.aval, _Value(0.0, spec if len(spec) == len(v.aval.shape) else ((),) * len(v.aval.shape)),
                          inner))
    return _replay(body, ins, inner)[0]


def _loop_carries(e) -> list[tuple[int, int]]:
    """(operand, result) positions of each value a scan or while loop carries."""
    if e.primitive.name == "scan":
        consts, carry = C.scan_counts(e)
        return [(consts + c, c) for c in range(carry)]
    if e.primitive.name == "while":
        n = len(e.outvars)
        return [(len(e.invars) - n + c, c) for c in range(n)]
    return []


def _carry_invars(e, n: int) -> range:
    """Positions of a loop body's carried invars (among its `n` invars)."""
    if e.primitive.name == "while":
        return range(n - len(e.outvars), n)
    if e.primitive.name == "scan":
        consts, carry = C.scan_counts(e)
        return range(consts, consts + carry)
    return range(0)


def _readers(lv: _Level, virtual: set) -> tuple[dict, set]:
    """key -> the ops that read it, directly or through fused values and views; and the keys whose
    buffers hold an output of the level (through views)."""
    readers: dict = {}
    backing = set(lv.outs)
    for i in range(len(lv.ops) - 1, -1, -1):
        outs = lv.ops[i].outs
        for x in outs:                        # read through the buffer that holds it
            if x in lv.shared:
                readers.setdefault(lv.shared[x], set()).update(readers.pop(x, set()))
        through = [x for x in outs if x in virtual and x not in lv.shared]
        rs = ({i} if len(through) < len(outs) or not outs else set()).union(*[readers.get(x, set()) for x in through])
        held = any(x in backing for x in through)
        for u in lv.reads[i]:
            readers.setdefault(u, set()).update(rs)
            if held:
                backing.add(u)
    return readers, backing


def _graph(lv: _Level, virtual: set, kept: set, inner: list, early: list, own: set) -> BufferGraph:
    """The buffer graph of a level: each value that is not `virtual` gets a buffer (0 bytes when
    `kept`: written into one the caller owns), an all-reduced value a second one for its partial
    sums; `own` keys are the caller's buffers, reusable once read; `early[i]`: keys op i reads
    only at its start."""
    ops = lv.ops
    readers_of, backing = _readers(lv, virtual)
    producer = {x: i for i, op in enumerate(ops) for x in op.outs}
    alloc, made, reads = [0.0] * len(ops), [[] for _ in ops], [[] for _ in ops]
    size, readers, first_only, pinned, external, buffer_of = [], [], [], [], [], {}

    def add(x, nbytes, maker, first=False, pin=False, outside=False):
        b = len(size)
        rs = sorted(readers_of.get(x, ()))
        size.append(nbytes)
        readers.append(rs)
        first_only.append(first)
        pinned.append(pin)
        external.append(outside)
        for r in rs:
            reads[r].append(b)
        if maker is not None:
            alloc[maker] += nbytes
            made[maker].append(b)
        return b

    for x in sorted(own):
        add(x, lv.vals[x].nbytes, None, outside=True)
    for i, op in enumerate(ops):
        for x in op.outs:
            if x not in virtual:
                v = lv.vals[x]
                buffer_of[x] = add(x, 0.0 if x in kept else v.nbytes, i, pin=x in backing)
                if v.partial:
                    add(x, v.partial, i, first=True)
    deps = [sorted({producer[u] for u in rs if u in producer}) for rs in lv.reads]
    conds = [C.CONDITIONAL_UPDATES_IN_PLACE and op.eqn.primitive.name == "cond" for op in ops]
    inplace = [op.eqn.primitive.name in CHEAP | EXPENSIVE | UPDATES | {"scan", "while"} or c
               for op, c in zip(ops, conds)]
    into_caller = [c or op.eqn.primitive.name in UPDATES for op, c in zip(ops, conds)]
    entry = [{buffer_of[x] for x in e if x in buffer_of} for e in early]
    return BufferGraph(alloc, inner, reads, made, inplace, deps, size, readers, first_only, pinned, entry, external,
                       into_caller)


def traced_peak(step: TracedStep) -> Peak:
    """Predicted per-device memory of a traced step run by `jax.jit` on `step.platform` (its
    arguments: ShapeDtypeStructs with shardings), whose first `step.donated` argument leaves are
    donated and written back as its first outputs."""
    closed = step.jaxpr
    jaxpr, _ = C.open_jaxpr(closed)
    env = _Env(dict(step.axis_sizes), False, step.platform)
    ins = []
    for v, a in zip(jaxpr.invars, jax.tree.leaves(step.args)):
        s = getattr(a, "sharding", None)
        ins.append(_sized(v.aval, _Value(0.0, sharding_spec(s, len(v.aval.shape)), host=on_host(s)), env))
    temp, outs = _replay(closed, ins, env, range(len(jaxpr.outvars)))   # outputs: buffers of their own
    return Peak(sum(x.nbytes for x in ins), sum(o.nbytes for o in outs[step.donated:]), temp)


def step_peak(fn, args, axis_sizes: dict, platform: str = "cpu", donated: int = 0) -> Peak:
    """Predicted per-device memory of `jax.jit(fn)(*args)` on `platform` (args: ShapeDtypeStructs
    with shardings) whose first `donated` argument leaves are donated and written back as its
    first outputs."""
    return traced_peak(TracedStep(jax.make_jaxpr(fn)(*args), tuple(args), donated, dict(axis_sizes), platform))


def compiled_peak(memory_analysis) -> Peak:
    """XLA's memory analysis of a compiled step in the same terms: arguments, outputs less those
    aliased to donated arguments, temp."""
    m = memory_analysis
    return Peak(float(m.argument_size_in_bytes), float(m.output_size_in_bytes - m.alias_size_in_bytes),
                float(m.temp_size_in_bytes))
