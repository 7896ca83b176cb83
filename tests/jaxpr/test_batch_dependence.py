"""whalex/jaxpr/batch_dependence.py: the one batch-dependence analysis that the
loss contract, the uneven hybrid and comm_dtype read. It looks into calls: a coupling inside a
jitted function is found like one at the top level."""
import jax
import jax.numpy as jnp
import optax
import pytest

import whalex as wh
from whalex.jaxpr.batch_dependence import analyse, traces_alike


def _jaxprs(f, *shapes_at):
    """f traced at two batch sizes: the open jaxprs."""
    return [jax.make_jaxpr(f)(*[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]).jaxpr
            for shapes in shapes_at]


def _couplings(f, b=4, B=8, d=3):
    part, whole = _jaxprs(f, [(d, d), (b, d)], [(d, d), (B, d)])
    assert traces_alike(part, whole)
    found = analyse(part, [1], whole, (b, B))
    return found, [(c.kind, c.eqn.primitive.name, len(c.path)) for c in found.couplings]


def test_per_sample_work_couples_nothing_and_carries_the_batch():
    found, couplings = _couplings(lambda w, x: jnp.tanh(x @ w) * 2.0)
    assert couplings == []
    part = found.whole                          # every value paired with its whole-batch twin
    out = [v for v in part if found.carries(v) and found.batch_dims(v) == {0}]
    assert out and all(v in found.depends for v in out)


def test_couplings_at_the_top_level_and_inside_calls():
    _, top = _couplings(lambda w, x: jax.lax.cumsum(x @ w, axis=0))
    assert top == [("along", "cumsum", 1)]
    _, inner = _couplings(lambda w, x: jnp.cumsum(x @ w, axis=0))          # jnp.cumsum is a jitted call
    assert inner == [("along", "cumsum", 2)]
    _, mixed = _couplings(lambda w, x: (x @ w) @ (x @ w).T)
    assert mixed == [("mixes", "dot_general", 1)]
    _, reduced = _couplings(lambda w, x: jax.jit(lambda h: (h.sum(0), h * 2))(x @ w))
    assert ("reduces", "reduce_sum", 2) in reduced


def test_a_loop_is_not_looked_into():
    found, couplings = _couplings(lambda w, x: jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None,
                                                            length=2)[0])
    assert couplings == [("opaque", "scan", 1)] and not found.couplings[0].refused


def test_data_dependence_looks_into_calls():
    """A jitted call's result computed from parameters alone does not depend on the batch."""
    (jaxpr,) = _jaxprs(lambda w, x: jax.jit(lambda w, x: (jnp.tanh(x @ w), jnp.sum(w)))(w, x), [(3, 3), (4, 3)])
    found = analyse(jaxpr, [1])
    call = jaxpr.eqns[-1]
    assert call.outvars[0] in found.depends and call.outvars[1] not in found.depends
    assert found.batch_major(call.outvars[0], 4) and not found.batch_major(call.outvars[1], 4)


def test_a_coupling_inside_a_jitted_function_is_refused_in_parts():
    """jnp.cumsum over the batch under micro-batches: before the one analysis the loss contract did
    not look into the call and planned it (each micro-batch summing its own rows)."""
    params = {"w": jnp.ones((3, 4)), "v": jnp.ones((4,))}
    batch = {"x": jnp.ones((16, 3))}

    def loss_fn(p, b):
        h = jnp.cumsum(jnp.tanh(b["x"] @ p["w"]), axis=0)
        return (h @ p["v"]).mean()

    with pytest.raises(wh.PlanError, match=r"cumsum runs along the batch dimension inside the call 'cumsum'"):
        wh.plan(loss_fn, params, batch, optax.sgd(0.1), config=wh.Config(num_micro_batch=2))
    wh.plan(loss_fn, params, batch, optax.sgd(0.1))            # the whole batch at once: fine
