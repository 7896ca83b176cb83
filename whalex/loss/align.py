"""Two traces of one loss, equation by equation (docs/architecture.md#the-loss-contract).

A plan in parts compares the loss traced at a part's size with the loss traced at the whole batch's
size equation by equation, and cuts pipeline stages by equation index. JAX leaves out an operation
that is an identity at the traced shapes: `jnp.broadcast_to(mask, (b,) + mask.shape[1:])` binds no
`broadcast_in_dim` when b is 1, so the part's trace has one equation fewer. `align` puts each such
operation back into the part's trace as an explicit identity (the same primitive, returning its
operand unchanged), so both traces have the same equations in the same order and the part computes
exactly what it computed before. Where the traces really differ, `difference` names the first
equation of each that does not correspond.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from whalex import _compat as C
from whalex.jaxpr import capture as capture_mod
from whalex.jaxpr.batch_dependence import shape_of, source, traces_alike
from whalex.jaxpr.capture import Captured

# primitives JAX drops when they are identities at the traced shapes (a broadcast, reshape or
# squeeze of a size-1 batch dimension)
IDENTITIES = ("broadcast_in_dim", "reshape", "squeeze")

_SCOPE = capture_mod._SCOPE    # a whalex scope's name (its uid differs per trace)
_NO = object()                # no corresponding operand


@dataclasses.dataclass(frozen=True)
class TraceDifference:
    """The first equations at which the traces at `part_rows` and `whole_rows` samples differ (None:
    that trace has no equation left)."""

    part_rows: int
    whole_rows: int
    part_eqn: Any
    whole_eqn: Any

    def describe(self) -> str:
        b, B = self.part_rows, self.whole_rows
        if self.part_eqn is None and self.whole_eqn is None:
            return f"the loss traces differently at {b} and {B} samples: its inputs or outputs differ"
        return (f"the loss traces differently at {b} and {B} samples: its first differing equation is "
                f"{_eqn_text(self.whole_eqn)} in the trace at {B} samples, where the trace at {b} has "
                f"{_eqn_text(self.part_eqn)}")


def _eqn_text(eqn) -> str:
    if eqn is None:
        return "no equation left"
    where = source(eqn)
    return f"`{eqn.primitive.name}` at {where}" if where else f"`{eqn.primitive.name}`"


def _samples(n: int) -> str:
    return f"{n} sample" if n == 1 else f"{n} samples"


class _Differ(Exception):
    def __init__(self, part_eqn, whole_eqn):
        super().__init__()
        self.part_eqn, self.whole_eqn = part_eqn, whole_eqn


def align(part: Captured, whole: Captured) -> Captured:
    """`part` with the equations that are identities at its size put back where `whole` has them;
    `part` itself when the traces already correspond or cannot be aligned (see `difference`)."""
    jp, jg = part.jaxpr.jaxpr, whole.jaxpr.jaxpr
    if part.global_batch == whole.global_batch or _alike_deep(jp, jg):
        return part
    try:
        new = _Aligner((part.global_batch, whole.global_batch)).jaxpr(jp, jg)
    except _Differ:
        return part
    taskgraphs, assign = capture_mod.group_taskgraphs(new, part.num_params, part.default)
    return dataclasses.replace(part, jaxpr=C.ClosedJaxpr(new, part.jaxpr.consts), taskgraphs=taskgraphs,
                               assign=assign)


def difference(part: Captured, whole: Captured) -> TraceDifference | None:
    """The first equations at which the two traces differ once aligned (None: they correspond)."""
    jp, jg = part.jaxpr.jaxpr, whole.jaxpr.jaxpr
    if traces_alike(jp, jg):
        return None
    try:
        _Aligner((part.global_batch, whole.global_batch)).jaxpr(jp, jg)
    except _Differ as d:
        return TraceDifference(part.global_batch, whole.global_batch, d.part_eqn, d.whole_eqn)
    return None


def _alike_deep(jp, jg) -> bool:
    """`traces_alike`, and so are the sub-jaxprs of every pair of equations."""
    if not traces_alike(jp, jg):
        return False
    for ep, eg in zip(jp.eqns, jg.eqns):
        sp, sg = C.sub_jaxprs(ep), C.sub_jaxprs(eg)
        if len(sp) != len(sg) or not all(_alike_deep(C.open_jaxpr(a)[0], C.open_jaxpr(b)[0]) for a, b in zip(sp, sg)):
            return False
    return True


def _consistent(part_shape, whole_shape, rows) -> bool:
    """Shapes of one value at the two sizes: the same rank, each dimension equal or scaled by the batch."""
    b, B = rows
    return len(part_shape) == len(whole_shape) and all(
        p == g or p * B == g * b for p, g in zip(part_shape, whole_shape))


@dataclasses.dataclass
class _Aligner:
    rows: tuple[int, int]
    scopes: dict = dataclasses.field(default_factory=dict)   # whole scope name -> part scope name
    inserted: set = dataclasses.field(default_factory=set)   # ids of the identities put in

    def jaxpr(self, jp, jg):
        """`jp` aligned to `jg` (raises _Differ at the first equations that do not correspond)."""
        if len(jg.invars) != len(jp.invars) or len(jg.outvars) != len(jp.outvars):
            raise _Differ(None, None)
        env: dict = dict(zip(jg.invars, jp.invars))       # whole var -> part var
        if len(jg.constvars) == len(jp.constvars):
            env.update(zip(jg.constvars, jp.constvars))
        same = {}                 # an inserted identity's result -> the part var it equals
        out, i = [], 0
        for eg in jg.eqns:
            ep = jp.eqns[i] if i < len(jp.eqns) else None
            paired = self._pair(ep, eg, env, same, strict=True) if ep is not None else None
            if paired is None:
                ident = self._identity(eg, env)
                if ident is not None:
                    out.append(ident)
                    env[eg.outvars[0]] = ident.outvars[0]
                    same[ident.outvars[0]] = ident.invars[0]
                    continue
                paired = self._pair(ep, eg, env, same, strict=False) if ep is not None else None
            if paired is None:
                raise _Differ(ep, eg)
            out.append(paired)
            env.update(zip(eg.outvars, paired.outvars))
            i += 1
        if i < len(jp.eqns):
            raise _Differ(jp.eqns[i], None)
        outvars = []
        for p, w in zip(jp.outvars, jg.outvars):
            t = self._operand(p, w, env, same)
            if t is _NO:
                raise _Differ(None, None)
            outvars.append(t)
        # identities inserted into a part's equations keep its scopes' names (the scopes' uids differ per trace)
        out = [e.replace(source_info=C.rename_scopes(e.source_info, self._rename)) if id(e) in self.inserted
               else e for e in out]
        return jp.replace(eqns=out, outvars=outvars)

    def _rename(self, name: str) -> str:
        return _SCOPE.sub(lambda m: self.scopes.get(m.group(0), m.group(0)), name)

    def _operand(self, p, w, env, same):
        """The part operand to read where the whole reads `w` (`p` or the identity equal to it), or _NO."""
        if isinstance(w, C.Literal):
            return p if isinstance(p, C.Literal) else _NO
        if isinstance(p, C.Literal):
            return _NO
        t = env.get(w)
        if t is None:
            return _NO
        v = t
        while True:
            if v is p:
                return t
            if v not in same:
                return _NO
            v = same[v]

    def _pair(self, ep, eg, env, same, strict: bool):
        """`ep` reading the aligned operands when it corresponds to `eg` (same primitive, operands that
        correspond; `strict`: results of consistent shapes too), else None."""
        if ep.primitive != eg.primitive or len(ep.invars) != len(eg.invars) or len(ep.outvars) != len(eg.outvars):
            return None
        invars = [self._operand(p, w, env, same) for p, w in zip(ep.invars, eg.invars)]
        if any(t is _NO for t in invars):
            return None
        if strict and not all(_consistent(shape_of(o), shape_of(g), self.rows) for o, g in zip(ep.outvars, eg.outvars)):
            return None
        self._learn_scopes(ep, eg)
        new = ep if all(a is b for a, b in zip(invars, ep.invars)) else ep.replace(invars=invars)
        return self._subs(new, eg)

    def _subs(self, ep, eg):
        """`ep` with each sub-jaxpr aligned to `eg`'s where they differ and can be aligned."""
        changed = {}
        for key, value in ep.params.items():
            other = eg.params.get(key)
            if not isinstance(value, (C.ClosedJaxpr, C.Jaxpr)) or not isinstance(other, (C.ClosedJaxpr, C.Jaxpr)):
                continue
            (sp, consts), (sg, _) = C.open_jaxpr(value), C.open_jaxpr(other)
            if _alike_deep(sp, sg):
                continue
            try:
                new = self.jaxpr(sp, sg)
            except _Differ:
                continue
            changed[key] = C.with_jaxpr(value, new, consts)
        return ep.replace(params={**ep.params, **changed}) if changed else ep

    def _learn_scopes(self, ep, eg) -> None:
        sp, sg = _SCOPE.findall(C.name_stack(ep)), _SCOPE.findall(C.name_stack(eg))
        if len(sp) == len(sg):
            for a, b in zip(sg, sp):
                self.scopes.setdefault(a, b)

    def _identity(self, eg, env):
        """An explicit identity at the part's size where `eg` (a broadcast, reshape or squeeze at the
        whole size) is one JAX left out of the part's trace, else None."""
        if eg.primitive.name not in IDENTITIES or len(eg.outvars) != 1 or not eg.invars:
            return None
        w = eg.invars[0]
        if isinstance(w, C.Literal) or any(not isinstance(v, C.Literal) for v in eg.invars[1:]):
            return None
        t = env.get(w)
        if t is None or isinstance(t, C.Literal) or not hasattr(t.aval, "shape"):
            return None
        g = eg.outvars[0]
        if getattr(t.aval, "dtype", None) != getattr(g.aval, "dtype", None):
            return None
        if not _consistent(shape_of(t), shape_of(g), self.rows):
            return None
        eqn = C.identity_eqn(eg, t)
        self.inserted.add(id(eqn))
        return eqn


def refusal(part: Captured, whole: Captured, context: str, way_out: str) -> str:
    """The text of the PlanError for a loss whose traces at the part's and the whole batch's sizes
    differ: the first differing equation of each, both sizes, and `way_out`."""
    b, B = part.global_batch, whole.global_batch
    found = difference(part, whole)
    what = found.describe() if found is not None else f"the loss traces differently at {b} and {B} samples"
    return (f"{what}. This plan evaluates the loss in {context} of {_samples(b)}, which needs the two traces to have "
            "the same operations (an operation that is an identity at one size, such as a broadcast of a size-1 "
            f"batch dimension, is matched). Use {way_out}.")
