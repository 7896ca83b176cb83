"""Which values of a traced loss depend on the batch, and which equations couple its samples: the
one analysis that the loss contract (`loss/analysis.py`), the uneven rows of a hybrid
(`planner/hybrid.py`) and the data-parallel segments of `comm_dtype` (`precision/comm.py`) read.

One walk over the equations, descending into calls (plain calls, and the calls with a rule of their
own whose sub-jaxpr takes the equation's operands one to one: custom derivatives, checkpoints),
finds for every value

- whether it *depends* on the batch: it is computed from a batch input (data flow; an equation
  whalex does not look into passes a dependence of any operand to all its results);
- whether it *carries* the batch, given the loss traced at a second batch size (`whole`): its shape
  changes with the batch size, along the dimensions `batch_dims` names;

and, for each equation that reads or makes values carrying the batch, whether it couples samples
(a `Coupling`): it reduces over the batch (some of its results lose it), mixes samples (results whose
size does not scale with the batch, like `z @ z.T`), runs along the batch (a cumulative op or a sort
over it), or has sub-jaxprs whalex does not look into (`opaque`: not known to be per-sample).
"""
from __future__ import annotations

import dataclasses
import linecache
import re
from collections.abc import Iterable
from typing import Any

import numpy as np

from whalex import _compat as C
from whalex.jaxpr import primitive_table as P


@dataclasses.dataclass(frozen=True)
class Coupling:
    """An equation that couples the samples of the batch (or may: `opaque`)."""

    path: tuple[int, ...]    # its index, through the calls around it (top level first)
    eqn: Any
    top: Any                 # the top-level equation it is in (itself at the top level)
    kind: str                # "reduces" | "mixes" | "along" | "opaque"
    why: str                 # e.g. "cumsum runs along the batch dimension"

    @property
    def refused(self) -> bool:
        """Known to couple samples ("opaque" ones are only not known to be per-sample)."""
        return self.kind != "opaque"

    @property
    def where(self) -> str:
        """`source` of the equation, or of the top-level equation when its own names no line."""
        return source(self.eqn) or source(self.top)


@dataclasses.dataclass(frozen=True)
class BatchDependence:
    """What `analyse` found; vars of every jaxpr it descended into."""

    depends: frozenset                 # values computed from a batch input
    whole: dict                        # value -> the same value in the trace at the other batch size
    couplings: tuple[Coupling, ...]    # in program order

    def carries(self, v) -> bool:
        """Whether `v`'s shape changes with the batch size (False without a second trace)."""
        return _carries(v, self.whole)

    def batch_dims(self, v) -> set[int]:
        """The dimensions of `v` whose size changes with the batch size."""
        return _batch_dims(v, self.whole)

    def batch_major(self, v, rows: int) -> bool:
        """`v` depends on the batch and leads with `rows` (the batch) as its first dimension."""
        return v in self.depends and bool(shape_of(v)) and shape_of(v)[0] == rows

    def at(self, index: int) -> list[Coupling]:
        """The couplings in top-level equation `index` (itself or inside the calls it makes)."""
        return [c for c in self.couplings if c.path[0] == index]


def analyse(jaxpr, batch: Iterable[int], whole=None, rows: tuple[int, int] | None = None,
            eqns: int | None = None) -> BatchDependence:
    """The batch dependence of `jaxpr` (open) whose inputs at positions `batch` are the batch.

    `whole`: the same loss traced at another batch size (its equations one to one with `jaxpr`'s:
    `traces_alike`), with `rows` = (the batch size of `jaxpr`, that of `whole`); without it no value
    carries the batch and nothing couples. `eqns`: read only the first `eqns` top-level equations."""
    invars = list(jaxpr.invars)
    dep = {invars[k] for k in batch}
    pairs: dict = {}
    if whole is not None:
        pairs.update(zip(invars + list(jaxpr.constvars), list(whole.invars) + list(whole.constvars)))
    walk = _Walk(dep, pairs, [], tuple(rows) if whole is not None else (1, 1))
    walk.run(jaxpr, whole, (), None, eqns)
    return BatchDependence(frozenset(dep), pairs, tuple(walk.found))


def traces_alike(part, whole) -> bool:
    """Whether two traces of one loss (open jaxprs) have the same equations in the same order."""
    return len(part.eqns) == len(whole.eqns) and all(e.primitive == f.primitive for e, f in zip(part.eqns, whole.eqns))


@dataclasses.dataclass
class _Walk:
    """One walk of `analyse`: what it has found so far."""

    dep: set
    pairs: dict
    found: list
    rows: tuple                  # the batch sizes of the two traces

    def run(self, jp, jg, frame: tuple, top, count: int | None = None) -> None:
        eqns = jp.eqns if count is None else jp.eqns[:count]
        for i, ep in enumerate(eqns):
            eg = jg.eqns[i] if jg is not None else None
            if eg is not None:
                self.pairs.update(zip(ep.outvars, eg.outvars))
            path, here = frame + (i,), top if top is not None else ep
            sub = _sub_jaxpr(ep)
            gsub = _sub_jaxpr(eg) if eg is not None else None
            if sub is not None and (eg is None or (gsub is not None and traces_alike(sub, gsub))):
                self.dep.update(s for s, v in zip(sub.invars, ep.invars)
                                if not isinstance(v, C.Literal) and v in self.dep)
                if gsub is not None:
                    self.pairs.update(zip(list(sub.invars) + list(sub.constvars),
                                          list(gsub.invars) + list(gsub.constvars)))
                self.run(sub, gsub, path, here)
                self.dep.update(o for o, s in zip(ep.outvars, sub.outvars)
                                if not isinstance(s, C.Literal) and s in self.dep)
                continue
            if any(not isinstance(v, C.Literal) and v in self.dep for v in ep.invars):
                self.dep.update(ep.outvars)
            if eg is not None:
                self.check(ep, path, here, opaque=sub is not None or bool(C.sub_jaxprs(ep)))

    def check(self, eqn, path, top, opaque: bool) -> None:
        """Record whether `eqn` (not looked into) couples samples."""
        b_in = [v for v in eqn.invars if _carries(v, self.pairs)]
        b_out = [o for o in eqn.outvars if _carries(o, self.pairs)]
        if not b_in and not b_out:
            return
        name = eqn.primitive.name
        b, B = self.rows
        mixed = next((o for o in b_out if not np.isclose(
            np.prod(shape_of(self.pairs[o])) / max(np.prod(shape_of(o)), 1), B / b)), None)
        kind = why = None
        if mixed is not None:
            kind, why = "mixes", (f"{name} mixes samples of the batch ({list(shape_of(mixed))} at {b} samples, "
                                  f"{list(shape_of(self.pairs[mixed]))} at {B})")
        elif not b_in:
            return
        elif opaque:
            kind, why = "opaque", f"{name} (whalex does not look inside it)"
        elif len(b_out) < len(eqn.outvars):
            kind, why = "reduces", f"{name} reduces over the batch"
        elif name in P.ALONG_AXIS:
            axes = set(np.atleast_1d(eqn.params[P.ALONG_AXIS[name]]).tolist())
            if axes & _batch_dims(b_in[0], self.pairs):
                kind, why = "along", f"{name} runs along the batch dimension"
        if kind is not None:
            self.found.append(Coupling(path, eqn, top, kind, why))


def _carries(v, pairs: dict) -> bool:
    return not isinstance(v, C.Literal) and shape_of(v) != shape_of(pairs.get(v, v))


def _batch_dims(v, pairs: dict) -> set[int]:
    return {k for k, (x, y) in enumerate(zip(shape_of(v), shape_of(pairs.get(v, v)))) if x != y}


def _sub_jaxpr(eqn):
    """The sub-jaxpr of a call whose inputs are the equation's operands one to one, else None."""
    if eqn is None:
        return None
    if C.is_call(eqn):
        return C.call_jaxpr(eqn)[0]
    if eqn.primitive.name in P.OPAQUE_CALLS:
        sub = eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr", eqn.params.get("jaxpr")))
        if sub is not None:
            sub = C.open_jaxpr(sub)[0]
            if len(sub.invars) == len(eqn.invars):
                return sub
    return None


def shape_of(v) -> tuple:
    return tuple(v.aval.shape) if hasattr(v, "aval") and hasattr(v.aval, "shape") else ()


def source(eqn) -> str:
    """'Module/path (file:line (function): `code`)' of an equation, for errors and the summary."""
    stack = "/".join(c for c in C.name_stack(eqn).split("/") if c and not c.startswith("whalex."))
    line = C.source_line(eqn)
    found = re.match(r"(.+?):(\d+)(?::\d+)? \(", line)
    if found:
        code = linecache.getline(found.group(1), int(found.group(2))).strip()
        if code:
            line = f"{line}: `{code}`"
    return f"{stack} ({line})" if stack else line
