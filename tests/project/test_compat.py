"""whalex/_compat.py on this interpreter's jax (CI runs the oldest and the newest supported): the
jaxpr classes, the primitive names whalex reads, and the user frame of an equation."""
import os
import sysconfig

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from whalex import _compat as C


def _eqns(fn, *args):
    return C.make_jaxpr(fn, *args).jaxpr.eqns


def test_open_jaxpr_unwraps_closed_and_open_jaxprs_once():
    closed = C.make_jaxpr(lambda x: jax.lax.scan(lambda c, y: (c + y * 2.0, c), x, x)[0], jnp.ones(3))
    jaxpr, consts = C.open_jaxpr(closed)
    assert isinstance(jaxpr.eqns, list) and len(consts) == len(jaxpr.constvars)
    body = next(e for e in jaxpr.eqns if e.primitive.name == "scan").params["jaxpr"]
    inner, inner_consts = C.open_jaxpr(body)
    assert [e.primitive.name for e in inner.eqns] == ["mul", "add"]
    assert C.open_jaxpr(inner)[0] is inner                     # idempotent: no loop on `.jaxpr`


def test_call_jaxpr_of_a_nested_jit():
    eqn = _eqns(lambda x: jax.jit(lambda y: jnp.sin(y) + 1.0)(x), 1.0)[0]
    assert C.is_call(eqn)
    sub, consts = C.call_jaxpr(eqn)
    assert [e.primitive.name for e in sub.eqns] == ["sin", "add"]


@pytest.mark.parametrize("make, names", [
    (lambda: jax.jit(jnp.sin), C.CALL_PRIMITIVES),
    (lambda: jax.checkpoint(jnp.sin), C.CHECKPOINT_PRIMITIVES),
    (lambda: jax.nn.relu, C.OPAQUE_CALL_PRIMITIVES),
    (lambda: (lambda x: jax.lax.fori_loop(0, 3, lambda i, c: c * 2.0, x)), ("scan", "while")),
    (lambda: (lambda x: jax.lax.cond(x > 0, jnp.sin, jnp.cos, x)), ("cond",)),
], ids=["jit", "checkpoint", "custom_jvp", "loop", "cond"])
def test_primitive_names_whalex_reads(make, names):
    """A JAX release that renames one of these primitives fails here, not deep inside a plan."""
    prims = {e.primitive.name for e in _eqns(make(), 1.0)}
    assert prims & set(names), (prims, names)


def test_shard_map_and_varying_axes():
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    seen = {}

    def body(x):
        seen["vma"] = C.varying_axes(x)
        return jax.lax.psum(x, "d")

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P(), check_vma=True)
    assert {e.primitive.name for e in _eqns(fn, jnp.ones(4))} == {"shard_map"}
    assert seen["vma"] == frozenset({"d"})
    np.testing.assert_allclose(fn(jnp.arange(4.0)), [2.0, 4.0])


def test_library_files_are_found_by_module_location():
    assert C.is_library_file(flax.__file__) and C.is_library_file(jax.__file__) and C.is_library_file(optax.__file__)
    assert C.is_library_file(os.__file__)                                      # the standard library
    assert not C.is_library_file(__file__)                                      # this test
    site = sysconfig.get_paths()["purelib"]
    assert not C.is_library_file(os.path.join(site, "users_package", "model.py"))   # installed user code


class _Norm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.BatchNorm(use_running_average=False)(x)     # flax's frames lie between this and jnp


def test_source_line_names_the_users_line_not_flax():
    x = jnp.ones((4, 3))
    variables = _Norm().init(jax.random.key(0), x)
    jaxpr = C.make_jaxpr(lambda v, x: _Norm().apply(v, x, mutable=["batch_stats"]), variables, x)

    def leaves(jp):
        for e in jp.eqns:
            yield e
            for sub in C.sub_jaxprs(e):
                yield from leaves(C.open_jaxpr(sub)[0])

    lines = {C.source_line(e) for e in leaves(jaxpr.jaxpr) if e.primitive.name == "reduce_sum"}
    assert lines and all("test_compat.py" in line and "flax" not in line for line in lines), lines


def test_add_any_is_a_differentiable_sum_a_policy_can_name_and_saved_residuals_lists_it():
    """`add_any` adds like `+` (and differentiates like it), appears under one of FETCH_PRIMITIVES'
    names, and `saved_residuals` says where each value kept for the backward pass comes from."""
    x, y = jnp.arange(3.0), jnp.ones(3)
    np.testing.assert_array_equal(C.add_any(x, y), x + y)
    assert jax.grad(lambda a: jnp.sum(C.add_any(a, y) ** 2))(x).tolist() == (2 * (x + y)).tolist()
    assert {e.primitive.name for e in jax.make_jaxpr(C.add_any)(x, y).eqns} <= set(C.FETCH_PRIMITIVES)
    saved = C.saved_residuals(lambda a: jnp.sum(jnp.sin(C.add_any(a, y))), x)
    assert any("add_any" in src or "cos" in src for _, src in saved), saved
