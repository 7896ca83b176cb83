"""The few JAX internals whalex relies on, kept in one place.

Everything here is reachable through public-ish modules (`jax.extend.core`); if a JAX upgrade moves
one of them, this is the only file to change.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sysconfig
from collections.abc import Sequence
from typing import Any

import jax
from flax.linen import module as linen_module
from jax._src import compiler as src_compiler, core as src_core, source_info_util, xla_bridge
from jax._src.ad_checkpoint import saved_residuals as _saved_residuals
from jax._src.ad_util import add_jaxvals as add_any  # noqa: F401  (re-exported: the sum autodiff adds cotangents with)
from jax._src.lib import xla_client
from jax.experimental import topologies
from jax.extend import core as jex

Literal = jex.Literal
Var = jex.Var
Jaxpr = jex.Jaxpr
ClosedJaxpr = jex.ClosedJaxpr
JaxprEqn = jex.JaxprEqn
DropVar = jex.DropVar

# Primitives whose sub-jaxpr is a plain call (no semantic of its own): whalex looks inside them.
CALL_PRIMITIVES = ("jit", "pjit", "closed_call", "core_call")
# `jax.checkpoint` / `nn.remat` (named "remat2" from jax 0.10 through 0.12; older names kept).
CHECKPOINT_PRIMITIVES = ("remat2", "checkpoint", "remat")
# Calls with a rule of their own (custom derivatives, rematerialization) around a sub-jaxpr.
OPAQUE_CALL_PRIMITIVES = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr") + CHECKPOINT_PRIMITIVES


def is_call(eqn: JaxprEqn) -> bool:
    return eqn.primitive.name in CALL_PRIMITIVES and isinstance(
        eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")), (ClosedJaxpr, Jaxpr))


# Since jax 0.11 `ClosedJaxpr` and `Jaxpr` are one class (a jaxpr carries its consts, and its
# `.jaxpr` is itself): unwrap through `open_jaxpr`, never by looping on `.jaxpr`.
UNIFIED_JAXPR = ClosedJaxpr is Jaxpr


def open_jaxpr(value: Any) -> tuple[Jaxpr, Sequence[Any]]:
    """(jaxpr, consts) of a closed or open jaxpr, on every supported JAX."""
    if UNIFIED_JAXPR:
        return value, tuple(getattr(value, "consts", ()) or ())
    if isinstance(value, ClosedJaxpr):
        return value.jaxpr, value.consts
    return value, ()


def call_jaxpr(eqn: JaxprEqn) -> tuple[Jaxpr, Sequence[Any]]:
    return open_jaxpr(eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")))


def name_stack(eqn: JaxprEqn) -> str:
    return str(eqn.source_info.name_stack)


def rename_scopes(source_info, rename) -> Any:
    """`source_info` with every name-stack entry's name passed through `rename(name) -> name`."""
    stack = source_info.name_stack
    entries = tuple(type(e)(rename(e.name)) for e in stack.stack)    # Scope and Transform: one field, `name`
    return source_info.replace(name_stack=type(stack)(entries))


def with_jaxpr(value: Any, jaxpr: Jaxpr, consts: Sequence[Any]) -> Any:
    """`jaxpr` stored as `value` was (closed with `consts`, or open)."""
    return ClosedJaxpr(jaxpr, consts) if isinstance(value, ClosedJaxpr) else jaxpr


# The parameters that make a shape operation an identity on its operand's shape.
_IDENTITY_PARAMS = {
    "broadcast_in_dim": lambda shape: {"shape": shape, "broadcast_dimensions": tuple(range(len(shape)))},
    "reshape": lambda shape: {"new_sizes": shape, "dimensions": None},
    "squeeze": lambda shape: {"dimensions": ()},
}


def identity_eqn(like: JaxprEqn, operand: Var) -> JaxprEqn:
    """An equation of `like`'s primitive (broadcast_in_dim, reshape or squeeze) that returns
    `operand` unchanged, with `like`'s source info. Built directly: tracing such an identity
    records no equation."""
    shape = tuple(operand.aval.shape)
    params = {**like.params, **_IDENTITY_PARAMS[like.primitive.name](shape)}
    return like.replace(invars=[operand], outvars=[Var(operand.aval)], params=params)


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


# Libraries whose frames are never the user's line; whalex is in the list because an error about a
# user's model must name the model, not the whalex scope that recorded it.
LIBRARY_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax", "whalex", "chex", "numpy", "ml_dtypes")


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """Directories of the library packages and of the standard library, found by module location
    (JAX's own filter tests one path prefix, which misses flax in a virtual environment)."""
    dirs = []
    for name in LIBRARY_PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for loc in (getattr(spec, "submodule_search_locations", None) or []):
            dirs.append(os.path.realpath(loc))
    paths = sysconfig.get_paths()
    purelib = {os.path.realpath(paths[k]) for k in ("purelib", "platlib") if k in paths}
    for key in ("stdlib", "platstdlib"):
        if key in paths:
            d = os.path.realpath(paths[key])
            if d not in purelib:
                dirs.append(d)
    return tuple(sorted({d.rstrip(os.sep) + os.sep for d in dirs}))


def is_library_file(file_name: str) -> bool:
    """Whether a frame's file belongs to jax, flax, optax, orbax, whalex or the standard library.
    The standard library's site-packages (an interpreter without a venv) is not standard library."""
    if not file_name or file_name.startswith("<"):
        return True
    path = os.path.realpath(file_name)
    for d in _library_dirs():
        if path.startswith(d):
            rest = path[len(d):]
            if rest.startswith(("site-packages" + os.sep, "dist-packages" + os.sep)) and not any(
                    path.startswith(p) for p in _library_dirs() if p != d):
                return False        # a user package installed into the interpreter's own site-packages
            return True
    return False


def user_frame(eqn: JaxprEqn):
    """The innermost recorded frame outside the libraries (None when none was recorded)."""
    tb = getattr(eqn.source_info, "traceback", None)
    for frame in (getattr(tb, "frames", None) or ()):
        if not is_library_file(frame.file_name):
            return frame
    return None


def source_line(eqn: JaxprEqn) -> str:
    """'file:line (function)' of the user code that traced an equation."""
    frame = user_frame(eqn)
    if frame is not None:
        return f"{frame.file_name}:{frame.line_num} ({frame.function_name})"
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


def sub_jaxprs(eqn: JaxprEqn) -> list[Any]:
    """The jaxprs an equation's parameters hold (a call's body, cond's branches, a loop's body...),
    closed or open as JAX stores them (`open_jaxpr` unwraps either)."""
    out = []
    for value in eqn.params.values():
        for item in (value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(item, (ClosedJaxpr, Jaxpr)):
                out.append(item)
    return out


def shard_map_out_specs(eqn: JaxprEqn) -> tuple:
    """The PartitionSpec of each output of a `shard_map` equation."""
    return tuple(eqn.params["out_specs"])


def shard_map_in_specs(eqn: JaxprEqn) -> tuple:
    """The PartitionSpec each operand of a `shard_map` equation is split by."""
    return tuple(eqn.params["in_specs"])


def shard_map_auto_axes(eqn: JaxprEqn) -> frozenset:
    """The mesh axes a `shard_map` equation leaves to GSPMD (`axis_names=` a subset of the mesh's)."""
    manual = eqn.params.get("newly_manual_axes")
    names = frozenset(eqn.params["mesh"].axis_names)
    return names - frozenset(manual) if manual is not None else frozenset()


# Whether XLA lets a conditional's branch update an operand that dies at the conditional in place
# (a pipeline tick adding into its gradient accumulator). XLA in jaxlib 0.10.2 copies the operand
# first; 0.12.0.1 shares the buffer (both measured on CPU, whalex/memory/peak.py).
CONDITIONAL_UPDATES_IN_PLACE = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)


def scan_counts(eqn: JaxprEqn) -> tuple[int, int]:
    """(num_consts, num_carry) of a `scan` equation: its inputs are consts, carry, then xs
    (jax 0.12 describes them by a flat tree `ft_in` instead of two counts)."""
    if "num_consts" in eqn.params:
        return int(eqn.params["num_consts"]), int(eqn.params["num_carry"])
    consts, carry, _ = eqn.params["ft_in"].update(list(eqn.invars)).unpack()
    return len(list(consts)), len(list(carry))


# The sum JAX's autodiff adds cotangents with (`add_any`). A forward pass has none but where whalex
# puts one, so a checkpoint policy can tell a parameter fetch (`device_put` + delta) from the
# model's own sums (whalex.memory.offload.fetch_leaf).
FETCH_PRIMITIVES = ("device_put", "add_any")


def saved_residuals(fn, *args) -> list[tuple[Any, str]]:
    """What `jax.vjp` of `fn(*args)` keeps for the backward pass: (aval, where it comes from: 'from
    the argument ...', 'output of <primitive> ...')."""
    return list(_saved_residuals(fn, *args))


def saved_by_policy(policy: Any, eqn: JaxprEqn) -> bool:
    """Whether a `jax.checkpoint` policy keeps an equation's outputs for the backward pass (the
    policy is called as JAX calls it; newer JAX answers with Saveable/Offloadable/Recompute)."""
    if policy is None:
        return False
    try:
        answer = policy(eqn.primitive, *[v.aval for v in eqn.invars], **eqn.params)
    except Exception:   # noqa: BLE001 (a policy that cannot judge this equation saves nothing)
        return False
    return answer is True or type(answer).__name__ in ("SaveableType", "Offloadable")


def gpu_topology(target_config: str, hosts: int, devices_per_host: int) -> list[Any]:
    """The devices of an XLA:GPU topology of `hosts` x `devices_per_host` GPUs described by
    `target_config` (a `GpuTargetConfig` text proto), on a machine with no GPU: a step on a mesh of
    them lowers and compiles with XLA's GPU compiler, and cannot run. Needs JAX's CUDA plugin (the
    `[cuda]` extra) loaded without a driver: `JAX_PLATFORMS=cpu` or
    `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1` in the environment before JAX starts its backends."""
    topo = topologies.get_topology_desc(platform="cuda", target_config=target_config,
                                        topology=f"1x{hosts}x{devices_per_host}")
    return list(topo.devices)


def compile_for_topology(lowered, devices: Sequence[Any]) -> tuple[Any, str]:
    """(memory stats, scheduled HLO text) of `lowered` (a `jax.stages.Lowered` over an `AbstractMesh`)
    compiled by the compile-only client of a deviceless topology's `devices`, one partition per device
    in order. JAX drops memory kinds from shardings over a topology's devices, which address no memory;
    a step lowered over an abstract mesh keeps them (`pinned_host`), and XLA compiles its host
    transfers."""
    devices = tuple(devices)
    client = devices[0].client
    options = src_compiler.get_compile_options(1, len(devices), device_assignment=[list(devices)], backend=client)
    exe = client.compile(lowered.compiler_ir("stablehlo"), executable_devices=xla_client.DeviceList(devices),
                         compile_options=options)
    text = exe.as_text() if hasattr(exe, "as_text") else exe.hlo_modules()[0].to_string()
    return exe.get_compiled_memory_stats(), text
