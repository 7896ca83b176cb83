"""Stock Flax layers found in the captured program and rewritten as the calls whalex runs uneven
(`wh.ops.mlp`, `wh.ops.attention`): on a heterogeneous model axis their hidden units and heads then
follow Algorithm 1 without a rewrite by the user (Whale section 3.3.1).

An MLP is `dot_general(x, w1) + b1 -> element-wise activation -> dot_general(., w2) + b2` with the
hidden dimension contracted by the second (two `nn.Dense`); attention is three projections of one x
with a heads axis plus their biases, scores, softmax, the values mixed, and an output projection
contracting (heads, head_dim) plus its bias (`nn.MultiHeadDotProductAttention`, `nn.DenseGeneral`).
A region is rewritten only when it is closed (its inner values are read nowhere else), reads nothing
but x and those parameters (a mask built from constants is allowed), and computes what the op
computes: values and gradients are compared at random inputs (the activation alone for an MLP, the
whole region for attention). Anything else stays as it is and gets the even shards.
"""
from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from whalex import _compat as C
from whalex.jaxpr.capture import Captured
from whalex.ops import ACTIVATIONS, _named_attention, _named_mlp

_BIAS_OPS = ("reshape", "broadcast_in_dim", "convert_element_type", "expand_dims")
_REFUSED = ("rng_bit_generator", "random_bits", "random_seed", "random_wrap", "psum", "all_gather", "ppermute")


@dataclasses.dataclass(frozen=True)
class Match:
    """A region of top-level equations that computes one op call: `ins` in the op's order."""

    eqns: tuple[int, ...]
    ins: tuple
    out: object
    call: object          # the named jitted op whose call equation replaces the region


class _Graph:
    """Producers and readers of the top-level values, and which values are (cast) parameters."""

    def __init__(self, jaxpr, num_params: int):
        self.eqns = jaxpr.eqns
        self.prod = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
        self.uses: dict = {}
        for i, e in enumerate(jaxpr.eqns):
            for v in _vars(e.invars):
                self.uses.setdefault(v, []).append(i)
        for v in _vars(jaxpr.outvars):
            self.uses.setdefault(v, []).append(-1)
        self.inputs = set(jaxpr.invars) | set(jaxpr.constvars)
        self.params = set(jaxpr.invars[:num_params])
        self.constant = set()          # equations that read no input of the program (a mask from iota)
        made_from_constants = set()
        for i, e in enumerate(jaxpr.eqns):
            if e.primitive.name == "convert_element_type" and _vars(e.invars) and e.invars[0] in self.params:
                self.params.add(e.outvars[0])
            if all(v in made_from_constants for v in _vars(e.invars)):
                self.constant.add(i)
                made_from_constants.update(e.outvars)

    def producer(self, v):
        return self.eqns[self.prod[v]] if v in self.prod else None

    def param(self, v, ndim: int) -> bool:
        return not isinstance(v, C.Literal) and v in self.params and v.aval.ndim == ndim

    def bias(self, v, shape: tuple) -> tuple | None:
        """(parameter var, equations) when `v` is a parameter of `shape` reshaped for broadcasting."""
        eqs = []
        while not self.param(v, len(shape)):
            e = self.producer(v)
            if e is None or e.primitive.name not in _BIAS_OPS or len(_vars(e.invars)) != 1:
                return None
            eqs.append(self.prod[v])
            v = e.invars[0]
        return (v, eqs) if tuple(v.aval.shape) == tuple(shape) else None


def _vars(xs) -> list:
    return [v for v in xs if not isinstance(v, C.Literal)]


def _dims(e):
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    return tuple(lc), tuple(rc), tuple(lb), tuple(rb)


def _dense(g: _Graph, e, ndim: int, contract: int) -> bool:
    """`e` contracts the last `contract` dims of its input with the first of an `ndim`-d parameter."""
    if e is None or e.primitive.name != "dot_general" or not g.param(e.invars[1], ndim):
        return False
    lc, rc, lb, rb = _dims(e)
    nd = e.invars[0].aval.ndim
    return not lb and not rb and lc == tuple(range(nd - contract, nd)) and rc == tuple(range(contract))


def _biased(g: _Graph, i: int, shape: tuple):
    """For the equation at i, its only reader when that adds a parameter of `shape`: (add index,
    bias parameter var, the bias's reshape equations)."""
    out = g.eqns[i].outvars[0]
    readers = g.uses.get(out, [])
    if len(readers) != 1 or readers[0] < 0 or g.eqns[readers[0]].primitive.name != "add":
        return None
    add = g.eqns[readers[0]]
    other = [v for v in add.invars if v is not out]
    found = g.bias(other[0], shape) if len(other) == 1 and not isinstance(other[0], C.Literal) else None
    if found is None or add.outvars[0].aval.shape != out.aval.shape:
        return None
    return readers[0], found[0], found[1]


def _closed(g: _Graph, region: set, out) -> bool:
    """No value made inside the region is read outside it, except its output; no effects, no randomness."""
    for i in region:
        e = g.eqns[i]
        if e.effects or e.primitive.name in _REFUSED:
            return False
        for v in e.outvars:
            if v is not out and any(u not in region for u in g.uses.get(v, [])):
                return False
    return True


def _slice_back(g: _Graph, start, stops: set) -> set | None:
    """The equations `start` depends on, not looking past the equations in `stops` (included) nor
    past parameters; None when it reaches another input of the program."""
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v in g.params:
            continue
        if v not in g.prod:
            return None
        i = g.prod[v]
        if i in seen:
            continue
        seen.add(i)
        if i not in stops:
            todo.extend(_vars(g.eqns[i].invars))
    return seen


def _ext_inputs(g: _Graph, region: set) -> set:
    """Values the region reads that it does not make."""
    made = {v for i in region for v in g.eqns[i].outvars}
    return {v for i in region for v in _vars(g.eqns[i].invars) if v not in made}


def match_mlp(g: _Graph, c: int) -> Match | None:
    """Two dense layers around an element-wise activation, ending at the second's bias add."""
    second = g.eqns[c]
    if not _dense(g, second, 2, 1):
        return None
    w2, a = second.invars[1], second.invars[0]
    end = _biased(g, c, (w2.aval.shape[1],))
    starts = [g.prod[v] for v in _dense_inputs(g, a) if _dense(g, g.producer(v), 2, 1)]
    if end is None or len(starts) != 1:
        return None
    start = starts[0]
    x, w1 = g.eqns[start].invars[:2]
    pre = _biased(g, start, (w1.aval.shape[1],))
    act = None if pre is None else _slice_back(g, a, {pre[0]})
    if act is None or w2.aval.shape[0] != w1.aval.shape[1] or a is g.eqns[pre[0]].outvars[0]:
        return None
    act -= {pre[0]}
    region = act | {start, pre[0], c, end[0]} | set(pre[2]) | set(end[2])
    out = g.eqns[end[0]].outvars[0]
    ins = (x, w1, pre[1], w2, end[1])
    if not _closed(g, region, out) or _ext_inputs(g, region) != set(ins):
        return None
    name = _activation_name(g, sorted(act), g.eqns[pre[0]].outvars[0], a)
    return None if name is None else Match(tuple(sorted(region)), ins, out, _named_mlp(name))


def _dense_inputs(g: _Graph, a) -> list:
    """The dot_general outputs met walking back from `a` without passing through a dot_general."""
    found, seen, todo = [], set(), [a]
    while todo:
        v = todo.pop()
        e = g.producer(v)
        if e is None or v in seen:
            continue
        seen.add(v)
        if e.primitive.name == "dot_general":
            found.append(v)
        else:
            todo.extend(_vars(e.invars))
    return found


def match_attention(g: _Graph, o: int) -> Match | None:
    """Self-attention ending at the output projection's bias add (heads contracted)."""
    proj_out = g.eqns[o]
    if not _dense(g, proj_out, 3, 2):
        return None
    wo = proj_out.invars[1]
    heads, hd, d_out = wo.aval.shape
    end = _biased(g, o, (d_out,))
    stops = {i for i, e in enumerate(g.eqns) if _dense(g, e, 3, 1) and e.invars[1].aval.shape[1:] == (heads, hd)}
    core = _slice_back(g, proj_out.invars[0], stops)
    if end is None or core is None:
        return None
    projs = sorted(core & stops)
    biases = [_biased(g, i, (heads, hd)) for i in projs]
    if len(projs) != 3 or len({g.eqns[i].invars[0] for i in projs}) != 1 or None in biases:
        return None
    order = _qkv_order(g, core, projs)
    if order is None:
        return None
    x = g.eqns[projs[0]].invars[0]
    ins = (x, *itertools.chain.from_iterable((g.eqns[projs[r]].invars[1], biases[r][1]) for r in order),
           wo, end[1])
    region = core | {o, end[0]} | set(end[2])
    out = g.eqns[end[0]].outvars[0]
    if not _closed(g, region, out) or _ext_inputs(g, region) != set(ins):
        return None
    d = x.aval.shape[-1]
    fans = (1, d, 0, d, 0, d, 0, heads * hd, 0)
    for causal in (False, True):
        if _agrees(g, sorted(region), ins, out, _named_attention(causal), fans):
            return Match(tuple(sorted(region)), ins, out, _named_attention(causal))
    return None


def _qkv_order(g: _Graph, core: set, projs: list) -> tuple[int, int, int] | None:
    """Positions in `projs` of q, k, v: the scores contract q (left) with k; the mix reads v alone."""
    deps: dict = {}

    def dep(v):
        if v not in deps:
            i = g.prod.get(v)
            deps[v] = frozenset() if i is None or i not in core else frozenset({i}) if i in projs else \
                frozenset().union(*[dep(u) for u in _vars(g.eqns[i].invars)])
        return deps[v]

    q = k = v = None
    for i in sorted(core - set(projs)):
        e = g.eqns[i]
        if e.primitive.name != "dot_general":
            continue
        left, right = dep(e.invars[0]), dep(e.invars[1])
        if len(left) == 1 and len(right) == 1 and left != right:
            q, k = next(iter(left)), next(iter(right))
        elif len(left | right) == 3 and 1 in (len(left), len(right)):
            v = next(iter(left if len(left) == 1 else right))
    if None in (q, k, v) or len({q, k, v}) != 3:
        return None
    return projs.index(q), projs.index(k), projs.index(v)


def _evaluator(g: _Graph, eqns: list, ins, out):
    """The region as a function of its inputs."""
    def fn(*args):
        env = dict(zip(ins, args))
        for i in eqns:
            e = g.eqns[i]
            env.update(zip(e.outvars, C.bind(e, [C.read(env, v) for v in e.invars])))
        return env[out]
    return fn


def _random(avals, fans, seed: int = 0) -> list:
    """Inputs at the values' shapes: x ~ N(0, 1), weights scaled by their fan-in, biases ~ N(0, 0.1)."""
    keys = jax.random.split(jax.random.key(seed), len(avals))
    return [jax.random.normal(k, a.shape, a.dtype) * (0.1 if f == 0 else 1.0 / np.sqrt(f))
            for k, a, f in zip(keys, avals, fans)]


def _agrees(g: _Graph, eqns: list, ins, out, ref, fans, tol: float = 1e-4) -> bool:
    """The region and `ref` give the same values and input gradients at random inputs."""
    args = _random([v.aval for v in ins], fans)
    ct = _random([out.aval], (1,), seed=1)[0]

    @jax.jit
    def both(args, ct):
        pairs = [jax.vjp(f, *args) for f in (_evaluator(g, eqns, ins, out), ref)]
        return [(y, vjp(ct)) for y, vjp in pairs]

    (y1, g1), (y2, g2) = both(args, ct)
    tol = tol if jnp.dtype(out.aval.dtype).itemsize >= 4 else 2e-2
    refs = [np.asarray(b, np.float64) for b in [y2, *g2]]
    floor = 1e-3 * max(float(np.max(np.abs(b), initial=0.0)) for b in refs)   # a true zero (attention's
    return all(_rel(a, b, floor) <= tol for a, b in zip([y1, *g1], refs))      # key bias) holds float noise


def _rel(a, b, floor: float) -> float:
    a = np.asarray(a, np.float64)
    if not np.all(np.isfinite(a)):
        return np.inf
    return float(np.max(np.abs(a - b), initial=0.0) / max(float(np.max(np.abs(b), initial=0.0)), floor, 1e-30))


def _activation_name(g: _Graph, eqns: list, h, a) -> str | None:
    """Which of wh.ops' activations the equations from `h` to `a` compute (values and gradients)."""
    for name, act in ACTIVATIONS.items():
        if _agrees(g, eqns, (h,), a, act, (1 / 9,), tol=1e-6):
            return name
    return None


def _call_eqn(g: _Graph, m: Match):
    """The op's call equation over the region: the op's name, the region's own equations as its body."""
    template = jax.make_jaxpr(m.call)(*[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in m.ins])
    eqn = C.open_jaxpr(template)[0].eqns[0]
    body = _with(eqn.params["jaxpr"], invars=list(m.ins), outvars=[m.out], eqns=[g.eqns[i] for i in m.eqns])
    return eqn.replace(invars=list(m.ins), outvars=[m.out], params={**eqn.params, "jaxpr": body},
                       source_info=g.eqns[m.eqns[0]].source_info)


def _with(closed, **changes):
    """A closed jaxpr with its jaxpr's fields changed (one class from jax 0.11, two before)."""
    inner, _ = C.open_jaxpr(closed)
    new = inner.replace(**changes)
    return new if C.UNIFIED_JAXPR else closed.replace(jaxpr=new)


def rewrite(cap: Captured, g: _Graph, matches) -> Captured:
    """`cap` with each match's equations replaced by one call equation (at the place of its last
    equation), the TaskGraph assignment carried over to the new paths."""
    where = {i: (n, j) for n, m in enumerate(matches) for j, i in enumerate(m.eqns)}
    tg = {n: cap.assign[(m.eqns[-1],)] for n, m in enumerate(matches)}    # constant equations join it
    last = {m.eqns[-1]: n for n, m in enumerate(matches)}
    eqns, moved = [], {}
    for i, e in enumerate(g.eqns):
        if i in last:
            moved[("call", last[i])] = len(eqns)
            eqns.append(_call_eqn(g, matches[last[i]]))
        elif i not in where:
            moved[i] = len(eqns)
            eqns.append(e)
    assign = {}
    for path, t in cap.assign.items():
        if path[0] in where:
            n, j = where[path[0]]
            assign[(moved[("call", n)], j) + path[1:]] = tg[n]
            assign[(moved[("call", n)],)] = tg[n]
        else:
            assign[(moved[path[0]],) + path[1:]] = t
    return dataclasses.replace(cap, jaxpr=_with(cap.jaxpr, eqns=eqns), assign=assign)


def find_stock_layers(cap: Captured, taskgraphs: set) -> tuple[_Graph, list]:
    """The stock MLPs and attention blocks inside the given TaskGraphs, each region in one TaskGraph."""
    g = _Graph(C.open_jaxpr(cap.jaxpr)[0], cap.num_params)
    matches, taken = [], set()
    for i, e in enumerate(g.eqns):
        if e.primitive.name != "dot_general" or cap.assign.get((i,)) not in taskgraphs:
            continue
        m = match_mlp(g, i) or match_attention(g, i)
        if m is None or taken & set(m.eqns) or len({cap.assign[(j,)] for j in m.eqns if j not in g.constant}) != 1:
            continue
        taken |= set(m.eqns)
        matches.append(m)
    return g, matches


def uneven_taskgraphs(vds, layout, speeds) -> set:
    """The split TaskGraphs whose one model axis spans positions of different speeds (the slowest
    device of each position counts): where the uneven lowering applies."""
    found = set()
    for t, vd in enumerate(vds):
        if vd.strategy.kind != "split" or len(vd.model_axes) != 1:
            continue
        grid = np.arange(layout.size).reshape(layout.axis_sizes)
        per_model = np.moveaxis(grid, layout.axis_names.index(vd.model_axes[0]), -1).reshape(grid.size // grid.shape[
            layout.axis_names.index(vd.model_axes[0])], -1)
        if len({min(speeds[d] for d in per_model[:, j]) for j in range(per_model.shape[1])}) > 1:
            found.add(t)
    return found


def fuse_stock_layers(cap: Captured, vds, layout, cluster) -> Captured:
    """`cap` with the stock MLPs and attention blocks of its split TaskGraphs on heterogeneous model
    axes as `wh.ops` calls (which the GSPMD planner then runs uneven); `cap` itself when none."""
    taskgraphs = uneven_taskgraphs(vds, layout, cluster.speeds)
    if not taskgraphs:
        return cap
    g, matches = find_stock_layers(cap, taskgraphs)
    return rewrite(cap, g, matches) if matches else cap
