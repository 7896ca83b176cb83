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
from whalex.core import primitives as P, random_rows
from whalex.core.align import refusal
from whalex.core.batch_dependence import analyse as batch_dependence, shape_of, source, traces_alike
from whalex.core.capture import Captured
from whalex.errors import PlanError

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


def analyse(part: Captured, whole: Captured, *, per_part: bool = False, context: str = "parts",
            way_out: str = WAY_OUT) -> Semantics:
    """Find the batch reductions of the loss traced at `part.global_batch` rows and at
    `whole.global_batch` rows (aligned: `whalex.core.align`); raise PlanError for traces that differ
    (naming `way_out`) and for couplings one pass cannot compute exactly."""
    jp, jg = part.jaxpr.jaxpr, whole.jaxpr.jaxpr
    b, B = part.global_batch, whole.global_batch
    if not traces_alike(jp, jg):
        raise PlanError(refusal(part, whole, context, way_out))
    n = part.num_params
    found = batch_dependence(jp, range(n, len(jp.invars)), jg, (b, B))
    gvar, is_b = found.whole, found.carries
    for v in jp.constvars:
        if is_b(v):
            raise PlanError("the loss closes over a constant with the batch dimension; pass it in the batch.")
    pdep = {v: True for v in jp.invars[:n]}
    dep: dict = {}                               # var -> frozenset of reductions its value depends on
    reds: dict[int, dict] = {}
    feedback_vars: set = set()
    couplings = []                               # (where, message) of cross-sample per-sample ops

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
            combine = P.COMBINE.get(eqn.primitive.name)
            reds[i] = dict(op=eqn.primitive.name, combine=combine, params=p, inputs=d, where=source(eqn))
            for o in eqn.outvars:
                dep[o] = d | {i}
            feedback_vars.update(v for v in ins if not is_b(v) and dep.get(v))
            continue
        for o in eqn.outvars:
            dep[o] = d
        if b_out or b_in:                        # per-sample computation
            feedback_vars.update(v for v in ins if not is_b(v) and dep.get(v))
            couplings.extend((c.where, _coupling_message(c)) for c in found.at(i) if c.refused)
    # which reductions feed per-sample computation (through the values they produce)
    fed = set()
    for v in feedback_vars:
        fed |= dep[v]
    for i, info in reds.items():
        info["feedback"] = i in fed
    # outputs
    out_vars = list(jp.outvars)
    row_outputs = []
    for k, v in enumerate(out_vars):
        if not isinstance(v, C.Literal) and is_b(v):
            if k == 0 or shape_of(v)[1:] != shape_of(gvar[v])[1:] or k > part.aux_count:
                raise PlanError(
                    f"output {k} of the loss ({'the loss' if k == 0 else 'an aux or model-state leaf'}, shape "
                    f"{list(shape_of(v))}) has the batch dimension, but this plan evaluates the loss in {context}; "
                    "return batch-free values (reduce per-example outputs over the batch) or use a plan without "
                    "parts.")
            row_outputs.append(k)                # per-example aux: each part writes its rows
    # refusals and per-part choices
    problems = []
    local = set()
    for i, info in sorted(reds.items()):
        if info["feedback"] and info["params"]:
            if per_part:
                local.add(i)
            problems.append(
                    f"{info['op']} at {info['where']} computes a statistic of parameter-dependent values over the "
                    f"batch and uses it inside the model (e.g. BatchNorm in training mode); this plan computes it on "
                    f"{context} of {b} samples, not on the global batch of {B}")
        elif info["combine"] is None:
            if per_part:
                local.add(i)
            problems.append(f"{info['op']} at {info['where']} reduces the batch in a way that is not a sum "
                                f"over samples; this plan evaluates the loss in {context} of {b} samples")
    for where, msg in couplings:
        problems.append(f"{msg} at {where}; this plan evaluates the loss in {context} of {b} samples")
    problems = list(dict.fromkeys(problems))
    if problems and not per_part:
        raise PlanError(
            "the loss couples the samples of the batch in a way one pass over parts cannot compute exactly:\n  - "
            + "\n  - ".join(problems)
            + f"\nUse a plan that sees the whole batch at once (data or hybrid parallelism without micro-batches, "
              f"on devices of one kind, or Config(hardware_aware=False)), or accept per-part statistics with "
              f"{OPT_IN} (what PyTorch pipelines and GShard do).")
    fdep: dict = {}                              # reductions reaching a batch-free value through batch-free values
    for i, eqn in enumerate(jp.eqns):
        if i in reds:
            fdep.update((o, frozenset({i})) for o in eqn.outvars)
        elif not any(is_b(o) for o in eqn.outvars):
            d = frozenset()
            for v in eqn.invars:
                if not isinstance(v, C.Literal) and not is_b(v):
                    d |= fdep.get(v, frozenset())
            fdep.update((o, d) for o in eqn.outvars)
    local_outputs = tuple(k for k, v in enumerate(out_vars)
                          if not isinstance(v, C.Literal) and (fdep.get(v, frozenset()) & local))
    if 0 in local_outputs:
        raise PlanError(
            "the loss reads a per-part statistic directly (not through per-sample values); with "
            f"{OPT_IN} it must only shape per-sample computation and model-state outputs.")
    # levels of data-only reductions
    level: dict[int, int] = {}
    for i in sorted(reds):
        info = reds[i]
        ups = [u for u in info["inputs"] if u in reds]
        level[i] = 0 if not ups else 1 + max(level[u] for u in ups)
    # the head must be a sum of per-part values for every differentiable parameter reduction
    loss_cone = cone(jp, [jp.outvars[0]])
    for i, info in reds.items():
        if info["params"] and i not in local and info["combine"] != "sum" and i in loss_cone \
                and any(is_floating(o) for o in jp.eqns[i].outvars):
            raise PlanError(
                f"{info['op']} at {info['where']} takes a {info['combine']} over the batch of parameter-dependent "
                f"values on the loss's gradient path; its gradient cannot be split over {context}. Use a sum or "
                f"mean, a plan without parts, or {OPT_IN}.")
    grad_reds = {i for i, info in reds.items() if info["params"] and i not in local and i in loss_cone}
    # parameter-dependent batch-free values the head reads (a weight penalty, a learned temperature):
    # every part computes them; the head takes their average, so each part carries 1/K of their gradient
    terms = []
    into_body = set()                            # batch-free equations whose values feed per-sample work
    needs = set(feedback_vars)
    for i in range(len(jp.eqns) - 1, -1, -1):
        eqn = jp.eqns[i]
        if any(o in needs for o in eqn.outvars) or any(is_b(o) for o in eqn.outvars) or i in reds:
            into_body.add(i)
            needs.update(v for v in eqn.invars if not isinstance(v, C.Literal))
    for i, eqn in enumerate(jp.eqns):
        if i in into_body or not eqn.outvars or not dep.get(eqn.outvars[0]):
            continue
        terms.extend(v for v in eqn.invars if not isinstance(v, C.Literal) and not is_b(v)
                     and pdep.get(v) and not dep.get(v))
    terms.extend(v for v in out_vars if not isinstance(v, C.Literal) and not is_b(v) and pdep.get(v)
                 and not dep.get(v))
    terms = list(dict.fromkeys(terms))
    affine = _affine(jp, grad_reds, {v for v in terms if is_floating(v)})
    reductions = tuple(
        Reduction(i, info["op"], info["combine"], info["params"], info["feedback"],
                  level[i] if not info["params"] else 0, info["where"], i in local)
        for i, info in sorted(reds.items()))
    return Semantics(b, B, reductions, affine, local_outputs, tuple(_random_lines(part, whole)), tuple(problems),
                     tuple((v, gvar[v]) for v in terms), tuple(row_outputs))


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
