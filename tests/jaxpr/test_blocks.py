"""Repeated blocks (whalex.jaxpr.blocks): identical segments share one jitted function, evaluated exactly."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import whalex as wh
from whalex.jaxpr.blocks import block_evaluator, shared_blocks
from whalex.jaxpr.capture import capture
from whalex.jaxpr.interpret import make_evaluator
from whalex.jaxpr.segments import run_edges, segments


def _loss(params, batch):
    x = batch["x"]
    for i in range(3):                      # three identical replicate / split blocks
        with wh.replicate(8):
            x = jnp.tanh(x @ params[f"w{i}"])
        with wh.split(8):
            x = x + jax.nn.relu(x @ params[f"v{i}"])
    return jnp.mean(x ** 2)


def _example():
    rng = np.random.default_rng(0)
    params = {f"{k}{i}": rng.normal(size=(16, 16)).astype(np.float32) / 4 for k in "wv" for i in range(3)}
    return params, {"x": rng.normal(size=(8, 16)).astype(np.float32)}


def _calls(fn, args):
    return [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name in ("jit", "pjit")]


def test_identical_segments_share_one_function_and_evaluate_exactly():
    params, batch = _example()
    cap = capture(_loss, params, batch)
    assert shared_blocks(cap, segments(cap), {}, {}) == [0, 1, 0, 1, 0, 1, 6]       # the mean: its own segment
    args = [*jax.tree.leaves(params), *jax.tree.leaves(batch)]
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    shared, plain = block_evaluator(cap, {}, mesh), make_evaluator(cap.jaxpr, {}, mesh)
    calls = _calls(shared, args)
    assert len(calls) == 6 and len({id(e.params["jaxpr"]) for e in calls}) == 2    # traced once per kind
    np.testing.assert_array_equal(np.asarray(shared(*args)[0]), np.asarray(plain(*args)[0]))
    g = jax.grad(lambda *a: shared(*a)[0], argnums=tuple(range(6)))(*args)
    r = jax.grad(lambda *a: plain(*a)[0], argnums=tuple(range(6)))(*args)
    for a, b in zip(g, r):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_segments_with_other_constraints_or_overrides_are_not_shared():
    params, batch = _example()
    cap = capture(_loss, params, batch)
    segs = segments(cap)
    eqns = cap.jaxpr.jaxpr.eqns
    first_dot = next(i for i in range(segs[2].start, segs[2].stop) if eqns[i].primitive.name == "dot_general")
    assert shared_blocks(cap, segs, {((first_dot,), "out", 0): P("data")}, {}) == [0, 1, 2, 1, 0, 1, 6]
    assert shared_blocks(cap, segs, {}, {(first_dot,): lambda *a: a}) == [0, 1, 2, 1, 0, 1, 6]


def test_run_edges_give_each_run_what_it_reads_and_what_later_runs_read():
    """The edges both a plan's segments and a pipeline stage's layer runs are cut along: a run reads
    what it does not define (first read first) and writes only what a later run or the output reads."""
    def f(x, y):
        a = x * 2.0
        _ = a - 1.0                 # read by nothing
        b = a + y
        return b * a

    jaxpr = jax.make_jaxpr(f)(1.0, 2.0).jaxpr
    eqns = jaxpr.eqns
    x, y = jaxpr.invars
    a = eqns[0].outvars[0]
    (first_reads, first_writes), (rest_reads, rest_writes) = run_edges([eqns[:2], eqns[2:]], jaxpr.outvars)
    assert first_reads == [x] and first_writes == [a]
    assert rest_reads == [a, y] and rest_writes == list(jaxpr.outvars)
    (reads, writes), = run_edges([eqns], jaxpr.outvars)      # one run: the loss's inputs and output
    assert reads == [x, y] and writes == list(jaxpr.outvars)
