"""Evaluating a loss in parts with its whole-batch meaning (docs/architecture.md#the-loss-contract).

`whalex.loss.analysis.analyse` says what the batch reductions of a loss are; this module carries it
out for the programs that run the loss on parts of the batch: `PartLoss` (the part jaxpr with
global constants, the part outputs, the head evaluated once), the random draws of a part (its rows
of the whole-batch draw), and the driver the uneven, micro-batched and pipelined programs call
(`value_and_grad`, or `prepass` / `cotangents` / `finish` for a program with its own schedule).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from whalex import _compat as C
from whalex.errors import PlanError
from whalex.jaxpr.capture import Captured
from whalex.loss import random_rows
from whalex.loss.analysis import Reduction, Semantics, cone, is_floating, random_draws, shape_of


def random_overrides(draws, where) -> dict:
    """{path: fn} drawing the random bits of the part holding the global rows `where`
    ((offset, rows) segments)."""
    out = {}
    for path, eqn, gs, exact in draws:
        bw = int(eqn.params["bit_width"])
        if exact:
            def fn(key, *_, bw=bw, gs=gs):
                parts = [random_rows.bits_rows(key, bw, gs, off, n) for off, n in where]
                return [parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)]
        else:
            def fn(key, *_, eqn=eqn):
                folded = jax.random.fold_in(key, where[0][0]) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) \
                    else key
                return C.bind(eqn, [folded])
        out[path] = fn
    return out


@dataclasses.dataclass(frozen=True)
class PartLoss:
    """The loss evaluated in parts with whole-batch semantics: pure functions for a program's loop.

    Inputs of every function: `params` (leaves), `part` (the part's batch leaves), `extra` (the
    other inputs of the loss: model state and rng leaves), `given` (global values of reductions
    already known: {reduction index: [outputs]}).
    """

    sem: Semantics
    part: Captured
    whole: Captured
    variants: tuple = ()         # the same loss at other part sizes (a program with parts of several sizes)
    total_parts: int | None = None   # parts per step when they are not global_rows / part_rows

    def with_variants(self, variants, total_parts: int) -> PartLoss:
        """This loss evaluated in `total_parts` parts of several sizes: `variants` are `loss_parts` at the
        other sizes. Their analyses must agree with this one (same reductions, terms and outputs), so a
        part of any size returns the same part outputs; else PlanError (the loss depends on the size)."""
        key = _structure(self.sem)
        for v in variants:
            if _structure(v.sem) != key:
                raise PlanError(f"the loss's batch reductions differ between parts of {self.sem.part_rows} and "
                                f"{v.sem.part_rows} samples; whalex cannot evaluate it in parts of several sizes.")
        return dataclasses.replace(self, total_parts=total_parts, variants=tuple(
            dataclasses.replace(v, total_parts=total_parts) for v in variants))

    def at(self, rows: int) -> PartLoss:
        """The loss for a part of `rows` samples (this one, or the variant of that size)."""
        if rows == self.sem.part_rows:
            return self
        for v in self.variants:
            if v.sem.part_rows == rows:
                return v
        raise ValueError(f"no part loss for parts of {rows} samples (sizes: "
                         f"{[self.sem.part_rows] + [v.sem.part_rows for v in self.variants]})")

    @functools.cached_property
    def draws(self):
        return random_draws(self.part, self.whole)

    def random(self, where) -> dict:
        return random_overrides(self.draws, where)

    @property
    def num_parts(self) -> int:
        return self.total_parts or self.sem.global_rows // self.sem.part_rows

    def _reds(self, pred) -> list[Reduction]:
        return [r for r in self.sem.reductions if pred(r)]

    def data_reductions(self, level: int) -> list[Reduction]:
        return self._reds(lambda r: not r.params and r.level == level)

    @property
    def sums(self) -> list[Reduction]:
        """Parameter-dependent reductions accumulated across parts."""
        return self._reds(lambda r: r.params and not r.local)

    # -- the body: the loss at part size with global values substituted ---------------------------
    @property
    def body_jaxpr(self):
        """The part jaxpr with batch-size constants of per-sample equations at their global values."""
        jp, jg = self.part.jaxpr.jaxpr, self.whole.jaxpr.jaxpr
        local = {r.index for r in self.sem.reductions if r.local}
        keep = cone(jp, [o for i in local for o in jp.eqns[i].outvars])
        tainted: set = set()
        for i, eqn in enumerate(jp.eqns):
            if i in local or any(not isinstance(v, C.Literal) and v in tainted for v in eqn.invars):
                tainted.update(eqn.outvars)
                if i in local or all(shape_of(o) == shape_of(g) for o, g in zip(eqn.outvars, jg.eqns[i].outvars)):
                    keep.add(i)
        eqns = []
        for i, (ep, eg) in enumerate(zip(jp.eqns, jg.eqns)):
            if i not in keep and any(isinstance(v, C.Literal) and isinstance(w, C.Literal) and
                                           not _same(v.val, w.val) for v, w in zip(ep.invars, eg.invars)):
                ep = ep.replace(invars=[w if isinstance(v, C.Literal) else v for v, w in zip(ep.invars, eg.invars)])
            eqns.append(ep)
        return jp.replace(eqns=eqns)

    def body(self, outvars) -> Captured:
        """A Captured whose jaxpr is the body returning `outvars` (paths unchanged)."""
        closed = C.ClosedJaxpr(self.body_jaxpr.replace(outvars=list(outvars)), self.part.jaxpr.consts)
        return dataclasses.replace(self.part, jaxpr=closed)

    def given_overrides(self, given: dict) -> dict:
        """Overrides {path: fn} replacing reductions whose global values are known."""
        return {(i,): (lambda *_, vals=vals: list(vals)) for i, vals in given.items()}

    # -- the outputs of a part and the head ---------------------------------------------------------
    def part_outputs(self) -> tuple[list, list, list, list]:
        """(vars, combine kinds, which of them carry a gradient, scale of their cotangent): the
        parameter-dependent sums, the head's parameter terms (averaged) and the per-part
        model-state outputs (averaged) that each part returns."""
        jp = self.part.jaxpr.jaxpr
        sums = [o for r in self.sums for o in jp.eqns[r.index].outvars]
        kinds = [r.combine for r in self.sums for _ in jp.eqns[r.index].outvars]
        terms = [v for v, _ in self.sem.terms]
        locs = [jp.outvars[k] for k in self.sem.local_outputs]
        rows = [jp.outvars[k] for k in self.sem.row_outputs]
        outvars = sums + terms + locs + rows
        grad = [is_floating(v) for v in sums + terms] + [False] * (len(locs) + len(rows))
        weight = [1.0] * len(sums) + [1.0 / self.num_parts] * len(terms) + [0.0] * (len(locs) + len(rows))
        return outvars, kinds + ["sum"] * (len(terms) + len(locs)) + ["rows"] * len(rows), grad, weight

    @property
    def n_sums(self) -> int:
        return len(self.sums_vars)

    @property
    def sums_vars(self) -> list:
        jp = self.part.jaxpr.jaxpr
        return [o for r in self.sums for o in jp.eqns[r.index].outvars]

    def accumulator(self, outvars, kinds) -> list:
        """Zero accumulators of the part outputs (a per-example output: its global shape)."""
        jg = self.whole.jaxpr.jaxpr
        rows = iter(self.sem.row_outputs)
        out = []
        for v, k in zip(outvars, kinds):
            out.append(jnp.zeros(jg.outvars[next(rows)].aval.shape, v.aval.dtype) if k == "rows"
                       else identity(k, v.aval))
        return out

    def head(self, inputs: Sequence[Any], given: dict, values: Sequence[Any]) -> list:
        """All outputs of the loss, evaluated once with the global-size jaxpr from the global values
        of every reduction (`given`: {index: outputs}) and of the part outputs (`values`, in the
        order of `part_outputs`: the sums' entries are ignored, `given` has them). `inputs` are the
        loss's inputs; parameters and batch leaves may be None (the head never reads them)."""
        jg = self.whole.jaxpr.jaxpr
        known: dict = dict(zip(jg.constvars, self.whole.jaxpr.consts))
        known.update({v: x for v, x in zip(jg.invars, inputs) if x is not None})
        for i, vals in given.items():
            known.update(zip(jg.eqns[i].outvars, vals))
        later = list(values[self.n_sums:])
        for (_, g), x in zip(self.sem.terms, later):
            known[g] = x
        later = later[len(self.sem.terms):]
        for k, x in zip(self.sem.local_outputs + self.sem.row_outputs, later):
            known[jg.outvars[k]] = x
        want = {v for v in jg.outvars if not isinstance(v, C.Literal) and v not in known}
        needed = []
        for i in range(len(jg.eqns) - 1, -1, -1):        # the equations the outputs still need
            eqn = jg.eqns[i]
            if any(o in want for o in eqn.outvars):
                needed.append(i)
                want.update(v for v in eqn.invars if not isinstance(v, C.Literal) and v not in known)
        env = dict(known)
        for i in reversed(needed):
            eqn = jg.eqns[i]
            env.update(zip(eqn.outvars, C.bind(eqn, [C.read(env, v) for v in eqn.invars])))
        return [C.read(env, v) for v in jg.outvars]


def _structure(sem: Semantics) -> tuple:
    """What must agree between analyses of one loss at two part sizes."""
    return (tuple((r.index, r.op, r.combine, r.params, r.feedback, r.level, r.local) for r in sem.reductions),
            sem.affine, sem.local_outputs, sem.row_outputs, len(sem.terms))


def _rows(part) -> int:
    """Samples in a part (its batch leaves' leading dimension)."""
    return int(np.shape(part[0])[0])


def _same(a, b) -> bool:
    try:
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    except Exception:   # noqa: BLE001 (typed keys and other opaque literals: compare identity)
        return a is b


def combine(kind: str | None, a, b, where=None):
    """`a` (accumulated) combined with a part's `b`; "rows": b's rows written at `where`."""
    if kind == "rows":
        start = 0
        for off, n in where:
            a = jax.lax.dynamic_update_slice_in_dim(a, b[start:start + n].astype(a.dtype), off, 0)
            start += n
        return a
    if kind == "max":
        return jnp.maximum(a, b)
    if kind == "min":
        return jnp.minimum(a, b)
    return a + b


def identity(kind: str | None, like):
    dtype = like.dtype
    if kind == "max":
        return jnp.full(like.shape, jnp.finfo(dtype).min if jnp.issubdtype(dtype, jnp.floating)
                        else (False if dtype == jnp.bool_ else jnp.iinfo(dtype).min), dtype)
    if kind == "min":
        return jnp.full(like.shape, jnp.finfo(dtype).max if jnp.issubdtype(dtype, jnp.floating)
                        else (True if dtype == jnp.bool_ else jnp.iinfo(dtype).max), dtype)
    return jnp.zeros(like.shape, dtype)


# ----------------------------------------------------------------------------------- the driver
def part_overrides(pl: PartLoss, known: dict, where) -> dict:
    """Overrides for evaluating one part: reductions with known global values, and the part's rows
    of every whole-batch random draw."""
    out = pl.given_overrides(known)
    out.update(pl.random(where))
    return out


def across_devices(values, kinds, axis):
    """Part outputs combined over the devices of `axis` (inside shard_map), by their kinds."""
    ops = {"sum": jax.lax.psum, "rows": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}
    return [ops[k or "sum"](v, axis) for v, k in zip(values, kinds)]


def value_and_grad(pl: PartLoss, evaluator_for: Callable, loop: Callable, across: Callable, params: list,
                   extra: list, scale=None, map_parts: Callable | None = None):
    """Outputs of the loss on the whole batch and this device's gradient sum, from a loop over parts.

    evaluator_for(captured, overrides) -> evaluate(*inputs) -> outputs: how the program evaluates a
      captured jaxpr (constraints, remat);
    loop(fn, init) -> acc: runs acc = fn(part_leaves, where, acc) over this device's parts (`where`:
      the global rows the part holds, as (offset, rows) segments, for random draws);
    across(values, kinds) -> values combined over devices ("sum"/"max"/"min" per value);
    map_parts(g, kinds) -> g evaluated on every part at once, stacked (for the pre-pass; optional).
    Returns (outputs, gradient): the program sums the gradients over devices (all-reduce or
    reduce-scatter); with `scale` (fp16 loss scaling) they are scaled.
    """
    jp = pl.part.jaxpr.jaxpr
    nb = len(jp.invars) - len(params) - len(extra)
    given = prepass(pl, evaluator_for, loop, across, params, extra, map_parts)
    outvars, kinds, grad, weight = pl.part_outputs()
    n_sums = pl.n_sums
    inputs = [None] * (len(params) + nb) + list(extra)

    def evaluate_part(part, where):                    # the body of this part's size, its overrides
        q = pl.at(_rows(part))
        return evaluator_for(q.body(q.part_outputs()[0]), part_overrides(q, given, where))

    if pl.sem.affine:
        at = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in outvars]
    else:                                              # exact second pass: the part outputs first
        def forward(part, where, acc):
            vals = evaluate_part(part, where)(*params, *part, *extra)
            return [combine(k, a, v, where) for k, a, v in zip(kinds, acc, vals)]
        at = _finish(pl, across(loop(forward, pl.accumulator(outvars, kinds)), kinds), n_sums)
    idx, cot = _cotangent(pl, given, inputs, at, scale)

    def fn(part, where, acc):
        evaluate = evaluate_part(part, where)

        def f(ps):
            vals = evaluate(*ps, *part, *extra)
            return [vals[k] for k in idx], vals

        _, vjp, vals = jax.vjp(f, list(params), has_aux=True)
        (grads,) = vjp(cot) if idx else ([jnp.zeros_like(p) for p in params],)
        out_acc, g_acc = acc
        out_acc = [combine(k, a, v, where) for k, a, v in zip(kinds, out_acc, vals)]
        return out_acc, [a + g for a, g in zip(g_acc, grads)]

    init = (pl.accumulator(outvars, kinds), [jnp.zeros_like(p) for p in params])
    out_acc, grads = loop(fn, init)
    values = _finish(pl, across(list(out_acc), kinds), n_sums)
    return pl.head(inputs, known(pl, given, values, n_sums), values), grads


def cotangents(pl: PartLoss, given: dict, extra: list, num_params: int, scale=None) -> tuple[list, list]:
    """(positions among the part outputs, cotangents) that start each part's backward pass, for a
    head affine in the part outputs: dH/d(part output) times its weight (and the loss scale)."""
    if not pl.sem.affine:
        raise PlanError("the loss is not affine in its batch sums (e.g. log of a mean); this plan needs it to be "
                        "(an exact second pass is not built for it): write the loss as a sum or mean of terms.")
    jp = pl.part.jaxpr.jaxpr
    nb = len(jp.invars) - num_params - len(extra)
    outvars = pl.part_outputs()[0]
    at = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in outvars]
    return _cotangent(pl, given, [None] * (num_params + nb) + list(extra), at, scale)


def _cotangent(pl: PartLoss, given: dict, inputs: list, at: list, scale=None) -> tuple[list, list]:
    """dH/d(part outputs) at the part outputs' values `at` (any value when H is affine in them)."""
    _, _, grad, weight = pl.part_outputs()
    idx = [k for k, g in enumerate(grad) if g]

    def head_loss(fvals):
        vals = list(at)
        for k, x in zip(idx, fvals):
            vals[k] = x
        return pl.head(inputs, known(pl, given, vals, pl.n_sums), vals)[0]

    cot = jax.grad(head_loss)([at[k] for k in idx]) if idx else []
    cot = [c * weight[k] for c, k in zip(cot, idx)]
    if scale is not None:
        cot = [c * scale.astype(c.dtype) for c in cot]
    return idx, cot


def known(pl: PartLoss, given: dict, values, n_sums: int) -> dict:
    """`given` with the global values of the parameter-dependent sums added: {index: outputs}."""
    jp = pl.part.jaxpr.jaxpr
    out = dict(given)
    it = iter(values[:n_sums])
    for r in pl.sums:
        out[r.index] = [next(it) for _ in jp.eqns[r.index].outvars]
    return out


def finish(pl: PartLoss, given: dict, extra: list, num_params: int, values) -> list:
    """The loss's outputs from the part outputs combined over every part (sums, term sums, ...)."""
    jp = pl.part.jaxpr.jaxpr
    nb = len(jp.invars) - num_params - len(extra)
    n_sums = pl.n_sums
    values = _finish(pl, values, n_sums)
    return pl.head([None] * (num_params + nb) + list(extra), known(pl, given, values, n_sums), values)


def _finish(pl, values, n_sums):
    """Part outputs combined over every part: parameter terms and per-part outputs averaged."""
    n_avg = len(pl.sem.terms) + len(pl.sem.local_outputs)
    avg = [x / pl.num_parts if jnp.issubdtype(x.dtype, jnp.inexact) else x for x in values[n_sums:n_sums + n_avg]]
    return list(values[:n_sums]) + avg + list(values[n_sums + n_avg:])


def prepass(pl: PartLoss, evaluator_for, loop, across, params, extra, map_parts=None) -> dict:
    """Global values of the data-only reductions (normalisers), level by level: {index: outputs}.

    `map_parts(g, kinds)`, when given, evaluates g(part, where) -> values on every part at once
    (vmap) and returns them stacked, with the identity of each kind where a stacked slot is not a
    real part: one reduction over the stack instead of a loop (in a GSPMD program one collective
    per normaliser, not one per micro-batch)."""
    jp = pl.part.jaxpr.jaxpr
    given: dict = {}
    for level in range(pl.sem.levels):
        reds = pl.data_reductions(level)
        outs = [o for r in reds for o in jp.eqns[r.index].outvars]
        kinds = [r.combine for r in reds for _ in jp.eqns[r.index].outvars]
        known = dict(given)

        def g(part, where, level=level, known=known):
            q = pl.at(_rows(part))                     # the body of this part's size
            body = q.body([o for r in q.data_reductions(level) for o in q.part.jaxpr.jaxpr.eqns[r.index].outvars])
            return evaluator_for(body, part_overrides(q, known, where))(*params, *part, *extra)

        def fn(part, where, acc, g=g, kinds=kinds):
            return [combine(k, a, v) for k, a, v in zip(kinds, acc, g(part, where))]

        if map_parts is not None:
            stacked = map_parts(g, kinds)
            red = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}
            combined = [red[k or "sum"](x, axis=0).astype(x.dtype) if k != "sum" or x.dtype != jnp.bool_
                        else jnp.sum(x, axis=0) for k, x in zip(kinds, stacked)]
            vals = iter(across(combined, kinds))
        else:
            vals = iter(across(loop(fn, [identity(k, o.aval) for k, o in zip(kinds, outs)]), kinds))
        for r in reds:
            given[r.index] = [next(vals) for _ in jp.eqns[r.index].outvars]
    return given
