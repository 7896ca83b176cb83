"""Capture: trace `loss_fn` once and group its equations into TaskGraphs by their whalex scope.

A scope's name survives on every equation traced inside it
(docs/architecture.md#jax-and-xla-facts-the-code-relies-on). Equations outside every scope take
the default strategy; each contiguous run of them is one TaskGraph.
Calls (`jit` equations) are looked into: their equations carry name stacks relative to the call,
and inherit the call's TaskGraph unless they open a scope of their own.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from whalex import _compat as C, validate
from whalex.errors import PlanError
from whalex.primitives.config import DEFAULTS
from whalex.primitives.scopes import Strategy, parse_scope, recording_default

Path = tuple[int, ...]   # position of an equation: indices through enclosing calls

# Equations that only pass a parameter through keep it a parameter (e.g. Flax's dtype promotion).
_PASS_THROUGH = ("convert_element_type", "copy", "copy_p", "reshape")  # and broadcast_in_dim


@dataclasses.dataclass(frozen=True)
class TaskGraph:
    """A set of equations that share one parallel strategy (one primitive scope)."""

    index: int
    strategy: Strategy
    annotated: bool                  # False: a run of un-annotated equations (default strategy)
    num_eqns: int
    params: tuple[int, ...]          # flat indices of the parameter leaves it reads

    @property
    def name(self) -> str:
        return f"TG{self.index}"


@dataclasses.dataclass(frozen=True)
class Captured:
    """The traced loss and its TaskGraphs; `assign[path]` is the TaskGraph of each equation."""

    jaxpr: C.ClosedJaxpr
    taskgraphs: tuple[TaskGraph, ...]
    assign: dict                     # Path -> TaskGraph index
    num_params: int
    params_tree: Any
    batch_tree: Any
    param_paths: tuple[str, ...]     # readable path of each parameter leaf
    global_batch: int
    has_aux: bool
    aux_tree: Any
    default: Strategy
    num_batch: int = -1              # batch leaves after the parameters (-1: every other input)
    state_tree: Any = None           # model_state: its tree (inputs after the batch, outputs after aux)
    num_state: int = 0
    rng: Any = None                  # ShapeDtypeStruct of the key passed as rng=, or None (last input)
    num_aux: int = -1                # aux leaves after the loss (-1: every other output)

    @property
    def num_inputs(self) -> int:
        return len(self.jaxpr.jaxpr.invars)

    @property
    def batch_vars(self) -> list:
        invars = self.jaxpr.jaxpr.invars
        n = self.num_params
        return list(invars[n:n + self.num_batch] if self.num_batch >= 0 else invars[n:])

    @property
    def num_extra(self) -> int:
        """Inputs after the batch: model-state leaves, then the rng key."""
        return self.num_state + (self.rng is not None)

    @property
    def aux_count(self) -> int:
        return self.num_aux if self.num_aux >= 0 else len(self.jaxpr.jaxpr.outvars) - 1

    def split_outputs(self, outs) -> tuple[Any, Any, list]:
        """(loss, aux pytree or None, new model-state leaves) from the flat outputs."""
        k = self.aux_count
        aux = jax.tree.unflatten(self.aux_tree, list(outs[1:1 + k])) if self.has_aux else None
        return outs[0], aux, list(outs[1 + k:1 + k + self.num_state])

    def walk(self):
        """Yield (path, eqn, frame) for every equation, descending into calls; frame = enclosing path."""
        yield from _walk(self.jaxpr.jaxpr, ())


def _walk(jaxpr, frame):
    for i, eqn in enumerate(jaxpr.eqns):
        path = frame + (i,)
        yield path, eqn, frame
        if C.is_call(eqn):
            sub, _ = C.call_jaxpr(eqn)
            yield from _walk(sub, path)


def global_batch_size(batch) -> int:
    """The leading dimension every batch leaf shares (each leaf checked: an array, not a scalar)."""
    return validate.batch_size(batch)


def capture(loss_fn: Callable, params, batch, *, has_aux: bool = False,
            default: Strategy | None = None, model_state=None, rng=None) -> Captured:
    """Trace `loss_fn(params, batch[, model_state=][, rng=])` and group equations into TaskGraphs.

    Inputs: parameter leaves, batch leaves, model-state leaves, the rng key. Outputs: the loss, aux
    leaves, new model-state leaves."""
    b = global_batch_size(batch)
    flat_params, params_tree = jax.tree.flatten(params)
    flat_batch, batch_tree = jax.tree.flatten(batch)
    flat_state, state_tree = jax.tree.flatten(model_state) if model_state is not None else ([], None)
    n, nb, ns = len(flat_params), len(flat_batch), len(flat_state)
    aux_box: list = []
    _check_state(params, model_state)
    validate.check_params(params)

    def flat_loss(*leaves):
        p = jax.tree.unflatten(params_tree, leaves[:n])
        x = jax.tree.unflatten(batch_tree, leaves[n:n + nb])
        kwargs = {}
        if model_state is not None:
            kwargs["model_state"] = jax.tree.unflatten(state_tree, leaves[n + nb:n + nb + ns])
        if rng is not None:
            kwargs["rng"] = leaves[-1]
        flat, aux = _flat_outputs(loss_fn(p, x, **kwargs), has_aux, model_state is not None, state_tree)
        aux_box.append(aux)
        return flat

    leaves = flat_params + flat_batch + flat_state + ([rng] if rng is not None else [])
    jaxpr, defaults = _trace(flat_loss, leaves)
    _check_loss(jaxpr, has_aux)
    if default is None:
        default = defaults[-1] if defaults else (DEFAULTS.strategy or Strategy("replicate", None))
    taskgraphs, assign = group_taskgraphs(jaxpr.jaxpr, n, default)
    param_paths = tuple(jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0])
    aux_tree, num_aux = aux_box[0] if aux_box else (None, 0)
    return Captured(jaxpr, taskgraphs, assign, n, params_tree, batch_tree, param_paths, b, has_aux,
                    aux_tree, default, nb, state_tree, ns,
                    jax.ShapeDtypeStruct(np.shape(rng), dtype_of(rng)) if rng is not None else None, num_aux)


def _flat_outputs(out, has_aux: bool, with_state: bool, state_tree):
    """The flat outputs of one call of the loss, (loss, *aux leaves, *new model-state leaves), and
    (aux tree, aux leaf count); PlanError for a return that does not match has_aux and model_state."""
    new_state = []
    if with_state:
        out, new_state = _new_state(out, has_aux, state_tree)
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise PlanError("has_aux=True but loss_fn did not return a (loss, aux) pair.")
        loss, aux = out
        validate.check_outputs("aux", aux)
        aux_leaves, aux_tree = jax.tree.flatten(aux)
        return (loss, *aux_leaves, *new_state), (aux_tree, len(aux_leaves))
    if len(jax.tree.leaves(out)) != 1:
        raise PlanError(
            f"loss_fn must return a scalar floating-point loss, got a {type(out).__name__} of "
            f"{len(jax.tree.leaves(out))} arrays; if it returns (loss, aux), pass has_aux=True.")
    return (jax.tree.leaves(out)[0], *new_state), (None, 0)


def _new_state(out, has_aux: bool, state_tree):
    """Split a loss's return with model_state into (the loss or (loss, aux), the new model-state
    leaves), checking the new state has the structure of the old."""
    if not (isinstance(out, tuple) and len(out) == 2):
        raise PlanError("with model_state, loss_fn must return (loss, new_model_state), or "
                        "(loss, (new_model_state, aux)) with has_aux=True.")
    out, rest = out
    if has_aux:
        if not (isinstance(rest, tuple) and len(rest) == 2):
            raise PlanError("with model_state and has_aux=True, loss_fn must return "
                            "(loss, (new_model_state, aux)).")
        rest, aux = rest
        out = (out, aux)
    validate.check_outputs("new_model_state", rest)
    new_leaves, new_tree = jax.tree.flatten(rest)
    if new_tree != state_tree:
        raise PlanError(f"loss_fn returned a new model state whose structure differs from model_state:\n"
                        f"  given    {state_tree}\n  returned {new_tree}\nreturn every collection "
                        "of model_state, updated or not (flax: mutable=list(model_state)).")
    return out, list(new_leaves)


def _trace(flat_loss, leaves):
    """(the jaxpr of `flat_loss` on abstract `leaves`, the default strategies set while tracing)."""
    abstract = [jax.ShapeDtypeStruct(np.shape(x), dtype_of(x)) for x in leaves]
    with recording_default() as defaults:
        try:
            jaxpr = C.make_jaxpr(flat_loss, *abstract)
        except NameError as e:
            _unbound_axis(e)
            raise
    return jaxpr, defaults


def _check_loss(jaxpr, has_aux: bool) -> None:
    """PlanError unless the loss (output 0) is a floating-point scalar."""
    loss_aval = jaxpr.out_avals[0]
    if loss_aval.shape != () or not jax.numpy.issubdtype(loss_aval.dtype, jax.numpy.floating):
        hint = " (it returned a tuple: pass has_aux=True)" if not has_aux and len(jaxpr.out_avals) > 1 else ""
        raise PlanError(
            f"loss_fn must return a scalar floating-point loss (the mean over the batch), got "
            f"{loss_aval.dtype}{list(loss_aval.shape)}{hint}.")


_STATE_COLLECTIONS = ("batch_stats", "cache", "intermediates", "moe_losses")


def _check_state(params, model_state) -> None:
    """A mutable collection passed inside params would be trained by the optimizer: refuse it."""
    if not isinstance(params, dict):
        return
    for name in _STATE_COLLECTIONS:
        if name in params:
            raise PlanError(
                f"params has a {name!r} collection: it is model state, not a parameter (the optimizer would train "
                f"it and the step would never update it). Pass params=variables['params'] and "
                f"model_state={{'{name}': variables['{name}']}} to step.init, and have loss_fn take model_state= and "
                "return (loss, new_model_state).")



def _unbound_axis(e: NameError) -> None:
    """A loss written for pmap/shard_map (a collective over a named axis): refuse it with the fix."""
    msg = str(e)
    if "unbound axis name: " not in msg:
        return
    name = msg.split("unbound axis name: ", 1)[1].split(". To fix", 1)[0].strip().rstrip(".")
    raise PlanError(
        f"loss_fn uses a collective over the axis name {name!r} (e.g. nn.BatchNorm(axis_name={name!r}) or "
        f"jax.lax.pmean(x, {name!r})), written for jax.pmap/shard_map; under whalex that axis does not exist. "
        "whalex computes the loss over the global batch itself, as on one device: BatchNorm statistics are "
        "taken over the whole batch and gradients are synchronised for you. Drop axis_name="
        f"{name!r} / the explicit collective over {name!r}.") from None


def dtype_of(x):
    """The dtype of an array, a ShapeDtypeStruct or a Python / numpy scalar."""
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


_SCOPE = re.compile(r"whalex\.(?:replicate|split)\.\w+\.\d+\.\w+")


def scope_of(eqn) -> tuple[Strategy, int] | None:
    """The innermost whalex scope an equation was traced in, forward or backward.

    Backward equations carry the scope wrapped in transform names, e.g.
    `transpose(jvp(whalex.split.8.3.auto))`, so the name is searched for, not split out.
    """
    found = None
    for match in _SCOPE.finditer(C.name_stack(eqn)):
        found = parse_scope(match.group(0))
    return found


def group_taskgraphs(jaxpr, num_params: int, default: Strategy):
    """The TaskGraphs of a captured jaxpr (one per primitive scope, un-annotated runs taking `default`)
    and each equation's TaskGraph: what capture groups, and what a transform of the jaxpr regroups."""
    keys: dict[Any, int] = {}        # scope uid or ("default", run) -> TaskGraph index
    strategies: list[Strategy] = []
    annotated: list[bool] = []
    counts: list[int] = []
    params: list[set] = []
    assign: dict[Path, int] = {}
    state = {"run": 0, "last_annotated": True}

    def tg_for(key, strategy, is_annotated):
        if key not in keys:
            keys[key] = len(strategies)
            strategies.append(strategy)
            annotated.append(is_annotated)
            counts.append(0)
            params.append(set())
        return keys[key]

    def visit(jaxpr, frame, inherited, origin):
        for i, eqn in enumerate(jaxpr.eqns):
            path = frame + (i,)
            scope = scope_of(eqn)
            if scope is not None:
                tg = tg_for(("scope", scope[1]), scope[0], True)
                state["last_annotated"] = True
            elif inherited is not None:
                tg = inherited
            else:
                if state["last_annotated"]:
                    state["run"] += 1
                    state["last_annotated"] = False
                tg = tg_for(("default", state["run"]), default, False)
            assign[path] = tg
            for v in eqn.invars:
                if not isinstance(v, C.Literal) and v in origin:
                    params[tg].add(origin[v][0])
            if C.is_call(eqn):
                sub, _ = C.call_jaxpr(eqn)
                sub_origin = {iv: origin[v] for iv, v in zip(sub.invars, eqn.invars)
                              if not isinstance(v, C.Literal) and v in origin}
                visit(sub, path, tg, sub_origin)
            else:
                counts[tg] += 1
                passed = passed_origin(eqn, origin)
                if passed is not None:
                    origin[eqn.outvars[0]] = passed

    origin = {v: (i, tuple(range(v.aval.ndim))) for i, v in enumerate(jaxpr.invars[:num_params])}
    visit(jaxpr, (), None, origin)
    if not strategies:   # a loss with no equations at all
        tg_for(("default", 0), default, False)
    tgs = tuple(TaskGraph(i, strategies[i], annotated[i], counts[i], tuple(sorted(params[i])))
                for i in range(len(strategies)))
    return tgs, assign


def passed_origin(eqn, origin: dict):
    """If `eqn` passes a parameter through unchanged in content, (leaf, dims) for its output.

    `dims[j]` is the parameter dimension that output dimension j holds, or None for a new
    size-1 or broadcast dimension.
    """
    name = eqn.primitive.name
    if name not in _PASS_THROUGH + ("broadcast_in_dim",) or not eqn.invars:
        return None
    src = eqn.invars[0]
    if isinstance(src, C.Literal) or src not in origin:
        return None
    leaf, dims = origin[src]
    out_shape = eqn.outvars[0].aval.shape
    if name == "broadcast_in_dim":
        new = [None] * len(out_shape)
        for d_in, d_out in enumerate(eqn.params["broadcast_dimensions"]):
            new[d_out] = dims[d_in]
        return leaf, tuple(new)
    if name == "reshape":
        in_shape = src.aval.shape
        kept_in = [dims[i] for i, s in enumerate(in_shape) if s != 1]
        kept_out = [j for j, s in enumerate(out_shape) if s != 1]
        if [in_shape[i] for i in range(len(in_shape)) if in_shape[i] != 1] != [out_shape[j] for j in kept_out]:
            return None
        new = [None] * len(out_shape)
        for j, d in zip(kept_out, kept_in):
            new[j] = d
        return leaf, tuple(new)
    return leaf, dims


def taskgraph_eqns(jaxpr, assign: dict, num_taskgraphs: int) -> list[list[int]]:
    """The top-level equation indices of each TaskGraph `0 .. num_taskgraphs - 1`, in order."""
    groups: list[list[int]] = [[] for _ in range(num_taskgraphs)]
    for i in range(len(jaxpr.eqns)):
        tg = assign[(i,)]
        if tg < num_taskgraphs:
            groups[tg].append(i)
    return groups
