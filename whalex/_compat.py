"""The few JAX internals whalex relies on, kept in one place.

Everything here is reachable through public-ish modules (`jax.extend.core`); if a JAX upgrade moves
one of them, this is the only file to change.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
from flax.linen import module as linen_module
from jax._src import core as src_core, source_info_util, xla_bridge
from jax.extend import core as jex

Literal = jex.Literal
Var = jex.Var
Jaxpr = jex.Jaxpr
ClosedJaxpr = jex.ClosedJaxpr
JaxprEqn = jex.JaxprEqn

# Primitives whose sub-jaxpr is a plain call (no semantic of its own): whalex looks inside them.
CALL_PRIMITIVES = ("jit", "pjit", "closed_call", "core_call")


def is_call(eqn: JaxprEqn) -> bool:
    return eqn.primitive.name in CALL_PRIMITIVES and isinstance(
        eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")), (ClosedJaxpr, Jaxpr))


def call_jaxpr(eqn: JaxprEqn) -> tuple[Jaxpr, Sequence[Any]]:
    sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if isinstance(sub, ClosedJaxpr):
        return sub.jaxpr, sub.consts
    return sub, ()


def name_stack(eqn: JaxprEqn) -> str:
    return str(eqn.source_info.name_stack)


def bind(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Evaluate one equation on concrete or traced values (what `jax.core.eval_jaxpr` does)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: Sequence[Any] = ()
    if isinstance(params, tuple):          # older JAX: (subfuns, params)
        subfuns, params = params
    ctx = getattr(eqn, "ctx", None)
    manager = getattr(ctx, "manager", None) if ctx is not None else None
    if manager is not None:
        with manager:
            out = eqn.primitive.bind(*subfuns, *invals, **params)
    else:
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def read(env: dict, v: Any) -> Any:
    return v.val if isinstance(v, Literal) else env[v]


def backends_initialized() -> bool:
    """Whether JAX has started its backends (after which a process group can no longer be joined)."""
    return xla_bridge.backends_are_initialized()


def make_jaxpr(fn, *args) -> ClosedJaxpr:
    return jax.make_jaxpr(fn)(*args)


def in_jax_trace() -> bool:
    """Whether a JAX transformation (jit, grad, vmap, make_jaxpr, shard_map...) is tracing the caller."""
    clean = getattr(src_core, "trace_state_clean", None)
    return not (clean() if clean is not None else src_core.trace_ctx.is_top_level())


def in_flax_module() -> bool:
    """Whether a Flax linen module method is running (e.g. an eager `model.init` or `model.apply`)."""
    stack = getattr(getattr(linen_module, "_context", None), "module_stack", None)
    return bool(stack) and stack[-1] is not None


def source_line(eqn: JaxprEqn) -> str:
    """'file:line (function)' of the user code that traced an equation."""
    try:
        return source_info_util.summarize(eqn.source_info)
    except Exception:   # noqa: BLE001 (no traceback recorded)
        return "unknown location"


def varying_axes(x: Any) -> frozenset:
    """Mesh axes over which `x` varies inside `shard_map` (its type's vma); empty outside."""
    t = jax.typeof(x)
    vma = getattr(t, "vma", None)
    if vma is None:                        # jax 0.10: ShapedArray.mat (ManualAxisType).varying
        vma = getattr(getattr(t, "mat", None), "varying", ())
    return frozenset(vma)


def match_varying(*xs: Any) -> list[Any]:
    """Cast each of `xs` to vary over every axis any of them varies over.

    A primitive bound directly (not through jax.numpy) does not insert these casts itself; jax's
    threefry2x32 lowering, for one, fails inside `shard_map` when its key is replicated and its
    counts vary (the counts of a part that depend on `axis_index`).
    """
    axes = [varying_axes(x) for x in xs]
    union = frozenset().union(*axes)
    return [x if a == union else jax.lax.pcast(x, tuple(sorted(union - a)), to="varying")
            for x, a in zip(xs, axes)]
