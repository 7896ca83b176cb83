"""The loss contract for plans that evaluate the loss in parts (docs/architecture.md#the-loss-contract).

A loss means its value on the whole global batch. Uneven data parallelism (per-device chunks),
gradient accumulation (micro-batches) and pipelines (micro-batches per replica) evaluate it on
parts of `part_rows` samples. Comparing the loss traced at the part size with the loss traced at
the global size shows where the batch is reduced: values whose shape changes carry the batch,
and an equation that takes such values to a batch-free value is a *batch reduction*
(`jnp.sum/mean` over the batch, `sum(mask)`, a dot product that contracts the batch).

The loss is then `H(theta, R)`, a batch-free *head* of the reductions `R`, and every reduction is
a sum (or max/min) of per-part values. `analyse` sorts the reductions:

- data-only (no parameter dependence, e.g. the real-token count `sum(mask)`): computed over the
  global batch in a pre-pass, before the parts run, and fed to every part;
- parameter-dependent and read only by the head (the loss sum, an aux term): accumulated across
  parts; the gradient of each part is the vector-Jacobian product of its partial sums with
  `dH/dR`, which is known before the parts run when the head is affine in them (means, sums,
  masked and token-weighted means, weighted sums of several terms). A head that is not affine in
  them (e.g. `log(mean(...))`) takes an exact second pass: one forward over the parts first;
- parameter-dependent and used inside the model (BatchNorm statistics in training mode): one pass
  cannot compute them exactly; refused with an error naming the operation, unless the Config
  accepts per-part statistics (`batch_coupling="per_part"`), when each part computes its own and
  the outputs that depend on them (running averages) are averaged over parts.

Constants that depend on the batch size (the `1/B` of a mean) take their global value.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from whalex import _compat as C
from whalex.errors import PlanError
from whalex.jaxpr import primitive_table as P
from whalex.jaxpr.batch_dependence import analyse as batch_dependence, shape_of, source, traces_alike
from whalex.jaxpr.capture import Captured
from whalex.loss import random_rows
from whalex.loss.align import refusal

OPT_IN = "wh.Config(batch_coupling='per_part')"
WAY_OUT = "a larger global batch (larger parts), or a plan that does not evaluate the loss in parts"


@dataclasses.dataclass(frozen=True)
class Reduction:
    """One batch reduction of the loss (an equation at the top level of the captured jaxpr)."""

    index: int
    op: str
    combine: str | None          # "sum", "max", "min"; None: not a sum of per-part values
    params: bool                 # depends on the parameters
    feedback: bool               # used (directly or through the head) inside per-sample computation
    level: int                   # data-only reductions: pre-pass level (0 first)
    where: str                   # module path and source line
    local: bool = False          # computed per part (batch_coupling="per_part")

    @property
    def kind(self) -> str:
        if self.local:
            return "statistic (per part, opt-in)"
        if not self.params:
            return "normaliser (global pre-pass)"
        return "global sum (accumulated over parts)"


@dataclasses.dataclass(frozen=True)
class Semantics:
    """What `analyse` found: the batch reductions and how a plan in parts computes them."""

    part_rows: int
    global_rows: int
    reductions: tuple[Reduction, ...]
    affine: bool                 # the loss is affine in its parameter-dependent sums: one pass
    local_outputs: tuple[int, ...]   # outputs (positions) that depend on per-part statistics: averaged
    random: tuple[str, ...]      # how random draws of the batch are made per part
    accepted: tuple[str, ...] = ()   # couplings computed per part because the Config accepts it
    terms: tuple = ()            # (part var, global var): parameter-dependent values the head reads
    row_outputs: tuple = ()      # aux outputs (positions) with the batch dimension: gathered by rows

    @property
    def levels(self) -> int:
        return 1 + max([r.level for r in self.reductions if not r.params] + [-1])

    def lines(self, whole: bool = False) -> list[str]:
        """One line per batch reduction: where it is and how the plan computes it (`whole`: a plan
        that sees the whole batch at once, where every reduction is exact as on one device)."""
        out = []
        for r in self.reductions:
            if whole:
                what = "statistic used inside the model" if r.feedback and r.params else \
                    "normaliser" if not r.params else "sum"
                out.append(f"{r.op} over the batch at {r.where}: {what}, over the whole batch in one program (exact)")
            else:
                out.append(f"{r.op} over the batch at {r.where}: {r.kind}")
        if whole:
            return out
        if not self.affine:
            out.append("the loss is not affine in its batch sums: exact in two passes (one extra forward)")
        out.extend(self.random)
        return out


def is_floating(v) -> bool:
    return hasattr(v.aval, "dtype") and jnp.issubdtype(v.aval.dtype, jnp.floating)


@dataclasses.dataclass(frozen=True)
class _Found:
    """One batch reduction as the walk over the equations finds it (before it becomes a Reduction)."""

    op: str
    combine: str | None
    params: bool
    inputs: frozenset            # reductions its operands depend on
    where: str
    feedback: bool = False


@dataclasses.dataclass(frozen=True)
class _Flow:
    """How values flow through the loss traced at the part size: what depends on the parameters,
    which reductions each value depends on, the reductions, and what feeds per-sample work."""

    pdep: dict                   # var -> depends on the parameters
    dep: dict                    # var -> frozenset of reductions its value depends on
    reds: dict                   # equation index -> _Found
    feedback_vars: frozenset     # batch-free values read by per-sample computation or a reduction
    couplings: tuple             # (where, message) of cross-sample per-sample ops


def analyse(part: Captured, whole: Captured, *, per_part: bool = False, context: str = "parts",
            way_out: str = WAY_OUT) -> Semantics:
    """Find the batch reductions of the loss traced at `part.global_batch` rows and at
    `whole.global_batch` rows (aligned: `whalex.loss.align`); raise PlanError for traces that differ
    (naming `way_out`) and for couplings one pass cannot compute exactly."""
    jp, jg = part.jaxpr.jaxpr, whole.jaxpr.jaxpr
    b, B = part.global_batch, whole.global_batch
    if not traces_alike(jp, jg):
        raise PlanError(refusal(part, whole, context, way_out))
    found = batch_dependence(jp, range(part.num_params, len(jp.invars)), jg, (b, B))
    is_b = found.carries
    if any(is_b(v) for v in jp.constvars):
        raise PlanError("the loss closes over a constant with the batch dimension; pass it in the batch.")
    flow = _flow(jp, part.num_params, found)
    row_outputs = _row_outputs(jp, part.aux_count, found, context)
    problems, local = _refusals(flow, per_part, context, b, B)
    local_outputs = _local_outputs(jp, flow.reds, local, is_b)
    level = _levels(flow.reds)
    grad_reds = _gradient_reductions(jp, flow.reds, local, context)
    terms = _head_terms(jp, flow, is_b)
    affine = _affine(jp, grad_reds, {v for v in terms if is_floating(v)})
    reductions = tuple(
        Reduction(i, r.op, r.combine, r.params, r.feedback, level[i] if not r.params else 0, r.where, i in local)
        for i, r in sorted(flow.reds.items()))
    return Semantics(b, B, reductions, affine, local_outputs, tuple(_random_lines(part, whole)), tuple(problems),
                     tuple((v, found.whole[v]) for v in terms), tuple(row_outputs))


def _flow(jp, n: int, found) -> _Flow:
    """Walk the equations once: parameter dependence, the batch reductions (equations taking batch
    values to batch-free ones), the reductions each value depends on, and which of them feed
    per-sample computation (through the values they produce)."""
    is_b = found.carries
    pdep = {v: True for v in jp.invars[:n]}
    dep: dict = {}
    reds: dict[int, _Found] = {}
    feedback_vars: set = set()
    couplings = []

    def deps(vs):
        out = frozenset()
        for v in vs:
            out |= dep.get(v, frozenset())
        return out

    for i, eqn in enumerate(jp.eqns):
        ins = [v for v in eqn.invars if not isinstance(v, C.Literal)]
        b_in = [v for v in ins if is_b(v)]
        b_out = [o for o in eqn.outvars if is_b(o)]
        d = deps(ins)
        p = any(pdep.get(v, False) for v in ins)
        for o in eqn.outvars:
            pdep[o] = p
        if b_in and not b_out:                   # a batch reduction
            reds[i] = _Found(eqn.primitive.name, P.COMBINE.get(eqn.primitive.name), p, d, source(eqn))
            for o in eqn.outvars:
                dep[o] = d | {i}
            feedback_vars.update(v for v in ins if not is_b(v) and dep.get(v))
            continue
        for o in eqn.outvars:
            dep[o] = d
        if b_out or b_in:                        # per-sample computation
            feedback_vars.update(v for v in ins if not is_b(v) and dep.get(v))
            couplings.extend((c.where, _coupling_message(c)) for c in found.at(i) if c.refused)
    fed = set()
    for v in feedback_vars:
        fed |= dep[v]
    reds = {i: dataclasses.replace(r, feedback=i in fed) for i, r in reds.items()}
    return _Flow(pdep, dep, reds, frozenset(feedback_vars), tuple(couplings))


def _row_outputs(jp, aux_count: int, found, context: str) -> list[int]:
    """Positions of the aux outputs with the batch dimension (each part writes its rows); PlanError
    for the loss itself or a model-state leaf with the batch dimension."""
    is_b, gvar = found.carries, found.whole
    row_outputs = []
    for k, v in enumerate(jp.outvars):
        if not isinstance(v, C.Literal) and is_b(v):
            if k == 0 or shape_of(v)[1:] != shape_of(gvar[v])[1:] or k > aux_count:
                raise PlanError(
                    f"output {k} of the loss ({'the loss' if k == 0 else 'an aux or model-state leaf'}, shape "
                    f"{list(shape_of(v))}) has the batch dimension, but this plan evaluates the loss in {context}; "
                    "return batch-free values (reduce per-example outputs over the batch) or use a plan without "
                    "parts.")
            row_outputs.append(k)
    return row_outputs


def _refusals(flow: _Flow, per_part: bool, context: str, b: int, B: int) -> tuple[list[str], set]:
    """The couplings one pass over parts cannot compute exactly, and the reductions computed per part
    instead (`per_part`); PlanError naming them all without `per_part`."""
    problems = []
    local = set()
    for i, r in sorted(flow.reds.items()):
        if r.feedback and r.params:
            if per_part:
                local.add(i)
            problems.append(
                    f"{r.op} at {r.where} computes a statistic of parameter-dependent values over the "
                    f"batch and uses it inside the model (e.g. BatchNorm in training mode); this plan computes it on "
                    f"{context} of {b} samples, not on the global batch of {B}")
        elif r.combine is None:
            if per_part:
                local.add(i)
            problems.append(f"{r.op} at {r.where} reduces the batch in a way that is not a sum "
                            f"over samples; this plan evaluates the loss in {context} of {b} samples")
    for where, msg in flow.couplings:
        problems.append(f"{msg} at {where}; this plan evaluates the loss in {context} of {b} samples")
    problems = list(dict.fromkeys(problems))
    if problems and not per_part:
        raise PlanError(
            "the loss couples the samples of the batch in a way one pass over parts cannot compute exactly:\n  - "
            + "\n  - ".join(problems)
            + f"\nUse a plan that sees the whole batch at once (data or hybrid parallelism without micro-batches, "
              f"on devices of one kind, or Config(hardware_aware=False)), or accept per-part statistics with "
              f"{OPT_IN} (what PyTorch pipelines and GShard do).")
    return problems, local


def _local_outputs(jp, reds: dict, local: set, is_b) -> tuple[int, ...]:
    """Outputs that depend on per-part statistics through batch-free values (averaged over parts);
    PlanError when the loss itself does."""
    fdep: dict = {}
    for i, eqn in enumerate(jp.eqns):
        if i in reds:
            fdep.update((o, frozenset({i})) for o in eqn.outvars)
        elif not any(is_b(o) for o in eqn.outvars):
            d = frozenset()
            for v in eqn.invars:
                if not isinstance(v, C.Literal) and not is_b(v):
                    d |= fdep.get(v, frozenset())
            fdep.update((o, d) for o in eqn.outvars)
    local_outputs = tuple(k for k, v in enumerate(jp.outvars)
                          if not isinstance(v, C.Literal) and (fdep.get(v, frozenset()) & local))
    if 0 in local_outputs:
        raise PlanError(
            "the loss reads a per-part statistic directly (not through per-sample values); with "
            f"{OPT_IN} it must only shape per-sample computation and model-state outputs.")
    return local_outputs


def _levels(reds: dict) -> dict[int, int]:
    """Pre-pass level of each reduction: 0 when it reads no other reduction, else one past theirs."""
    level: dict[int, int] = {}
    for i in sorted(reds):
        ups = [u for u in reds[i].inputs if u in reds]
        level[i] = 0 if not ups else 1 + max(level[u] for u in ups)
    return level


def _gradient_reductions(jp, reds: dict, local: set, context: str) -> set:
    """The parameter reductions on the loss's gradient path (not per part); PlanError for one that is
    not a sum of per-part values, since its gradient cannot be split."""
    loss_cone = cone(jp, [jp.outvars[0]])
    for i, r in reds.items():
        if r.params and i not in local and r.combine != "sum" and i in loss_cone \
                and any(is_floating(o) for o in jp.eqns[i].outvars):
            raise PlanError(
                f"{r.op} at {r.where} takes a {r.combine} over the batch of parameter-dependent "
                f"values on the loss's gradient path; its gradient cannot be split over {context}. Use a sum or "
                f"mean, a plan without parts, or {OPT_IN}.")
    return {i for i, r in reds.items() if r.params and i not in local and i in loss_cone}


def _head_terms(jp, flow: _Flow, is_b) -> list:
    """Parameter-dependent batch-free values the head reads (a weight penalty, a learned temperature):
    every part computes them; the head takes their average, so each part carries 1/K of their gradient."""
    dep, pdep = flow.dep, flow.pdep
    into_body = set()                            # batch-free equations whose values feed per-sample work
    needs = set(flow.feedback_vars)
    for i in range(len(jp.eqns) - 1, -1, -1):
        eqn = jp.eqns[i]
        if any(o in needs for o in eqn.outvars) or any(is_b(o) for o in eqn.outvars) or i in flow.reds:
            into_body.add(i)
            needs.update(v for v in eqn.invars if not isinstance(v, C.Literal))
    terms = []
    for i, eqn in enumerate(jp.eqns):
        if i in into_body or not eqn.outvars or not dep.get(eqn.outvars[0]):
            continue
        terms.extend(v for v in eqn.invars if not isinstance(v, C.Literal) and not is_b(v)
                     and pdep.get(v) and not dep.get(v))
    terms.extend(v for v in jp.outvars if not isinstance(v, C.Literal) and not is_b(v) and pdep.get(v)
                 and not dep.get(v))
    return list(dict.fromkeys(terms))


def random_draws(part: Captured, whole: Captured) -> list[tuple[tuple, Any, tuple, bool]]:
    """(path, equation, global shape, exact) of every draw of random bits whose shape has the batch:
    `exact` when the part's rows of the whole-batch draw can be computed directly (partitionable
    threefry, batch leading), else the part draws with its own key (never repeated across parts)."""
    out = []
    for (path, ep, _), (_, eg, _) in zip(part.walk(), whole.walk()):
        if ep.primitive.name != "random_bits":
            continue
        ps, gs = tuple(ep.params["shape"]), tuple(eg.params["shape"])
        if ps == gs:
            continue
        exact = ps[1:] == gs[1:] and ps[0] * (whole.global_batch // part.global_batch) == gs[0] and \
            random_rows.row_bits_override(ep, 0, gs[0]) is not None
        out.append((path, ep, gs, exact))
    return out


def _random_lines(part, whole) -> list[str]:
    lines = []
    for _path, eqn, gs, exact in random_draws(part, whole):
        how = "each part draws its rows of the whole-batch draw (equal to one device)" if exact else \
            "each part folds its first row into the key (distinct per part, not equal to one device)"
        lines.append(f"random bits {list(gs)} at {source(eqn)}: {how}")
    return lines


def _coupling_message(c) -> str:
    """What a per-sample equation that couples samples does; inside a call, which call (a reduction
    there is one the loss contract cannot compute in parts: it needs them at the top level)."""
    if len(c.path) == 1:
        return c.why
    name = c.top.params.get("name", c.top.primitive.name)
    hint = " (call it without jax.jit so whalex can see the reduction)" if c.kind == "reduces" else ""
    return f"{c.why} inside the call {name!r}{hint}"


def cone(jaxpr, outs, stop=()) -> set:
    """Indices of the top-level equations the values `outs` depend on (not looking past `stop`)."""
    producer = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for o in eqn.outvars:
            producer[o] = i
    seen, stack = set(), [v for v in outs if not isinstance(v, C.Literal)]
    while stack:
        v = stack.pop()
        i = producer.get(v)
        if i is None or i in seen:
            continue
        seen.add(i)
        if i not in stop:
            stack.extend(u for u in jaxpr.eqns[i].invars if not isinstance(u, C.Literal))
    return seen


def _affine(jaxpr, grad_reds: set, seeds: set = frozenset()) -> bool:
    """Whether the loss (output 0) is affine in the outputs of the reductions `grad_reds` and in
    the values `seeds`, jointly."""
    lin = set(seeds)
    for i, eqn in enumerate(jaxpr.eqns):
        if i in grad_reds:
            lin.update(eqn.outvars)
            continue
        ins = [v for v in eqn.invars if not isinstance(v, C.Literal)]
        which = [k for k, v in enumerate(eqn.invars) if not isinstance(v, C.Literal) and v in lin]
        if not which:
            continue
        name = eqn.primitive.name
        ok = False
        if name in P.LINEAR:
            ok = not (name == "select_n" and 0 in which)
        elif name in ("mul", "dot_general"):
            ok = len(which) == 1
        elif name == "div":
            ok = which == [0]
        elif name == "stop_gradient":
            continue
        if not ok:
            return False
        lin.update(o for o in eqn.outvars if is_floating(o))
        del ins
    return True
