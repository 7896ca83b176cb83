"""An abstract cluster of GPU kinds, where JAX's CUDA plugin is installed, plans on its deviceless
XLA:GPU twin (`Cluster.compile_twin`): `step_memory()`, `compiled_collectives()`, `memory_fit()` and
`remat="auto"` read XLA:GPU's figure, and the plan is the one a `Cluster.gpu_topology` of its kinds
gives (offload plans: lowered over an abstract mesh, compiled for its devices). `compiler="replay"` keeps
the replay."""

import jax
import jax.numpy as jnp
import optax
import pytest

import whalex as wh
from support.gpu_bench import gpu_compile

SMALL = gpu_compile.SIZES["small"]
H100 = ["H100-80GB"] * 8


def _plan(case, cluster, size=SMALL, **config):
    annotations, base = gpu_compile.CASES[case]
    loss_fn, params, batch = gpu_compile.problem(size, cluster.size, annotations)
    return wh.plan(loss_fn, params, batch, optax.adamw(1e-4), cluster=cluster, config=wh.Config(**base, **config))


def test_the_twin_is_the_kinds_gpu_topology():
    twin = wh.Cluster.abstract(kinds=H100, host_memory=1e12).compile_twin()
    assert twin is not None and twin.compile_only and twin.target == "H100-80GB" and len(twin.devices) == 8
    assert twin.host_memory == (1e12,)
    slow = wh.Cluster.abstract(kinds=H100).with_speeds([2.0] * 4 + [1.0] * 4, overhead=[0.001] * 8)
    assert slow.compile_twin().speeds == slow.speeds and slow.compile_twin().overhead == slow.overhead
    linked = wh.Cluster.abstract(kinds=H100).with_links(1e-3, 1e8)            # calibrated links stay too
    assert linked.compile_twin().links == linked.links == linked.compile_twin().for_target("H100-80GB").links
    assert wh.Cluster.abstract(kinds=H100, compiler="replay").compile_twin() is None
    assert wh.Cluster.abstract(kinds=["cpu"] * 8).compile_twin() is None


@pytest.mark.parametrize("case", ["split", "pipeline_1f1b"])
def test_an_abstract_plan_compiles_as_on_the_gpu_topology(case):
    abstract = _plan(case, wh.Cluster.abstract(kinds=H100))
    topology = _plan(case, wh.Cluster.gpu_topology(kinds=H100))
    assert abstract.cluster.compile_only and abstract.cluster.target == "H100-80GB"
    assert abstract.lower() == topology.lower()
    assert abstract.step_memory() == topology.step_memory()
    got, want = abstract.compiled_collectives(), topology.compiled_collectives()
    assert (got.count, got.ring_bytes, got.asynchronous) == (want.count, want.ring_bytes, want.asynchronous)
    assert "XLA's compiled step" in abstract.summary()



def test_a_plan_on_the_twin_does_not_run():
    annotations, _ = gpu_compile.CASES["dp"]
    loss_fn, params, batch = gpu_compile.problem(SMALL, 8, annotations)
    real = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (params, batch))
    step = wh.parallelize(loss_fn, optax.sgd(0.1), cluster=wh.Cluster.abstract(kinds=H100))
    with pytest.raises(wh.PlanError, match="can plan, lower and compile but not run"):
        step.init(*real)


def test_memory_fit_is_judged_on_xla_gpu():
    plan = _plan("dp", wh.Cluster.abstract(kinds=["T4-16GB"] * 8))
    mf = plan.memory_fit()
    assert mf.compiled == plan.step_memory().total
    assert "judged on XLA's compiled step" in mf.verdict()
    replay = _plan("dp", wh.Cluster.abstract(kinds=["T4-16GB"] * 8, compiler="replay")).memory_fit()
    assert replay.compiled is None and "judged on XLA" not in replay.verdict()


def test_offload_plans_compile_over_an_abstract_mesh():
    plan = _plan("offload_opt_state", wh.Cluster.abstract(kinds=H100))
    assert plan.cluster.is_abstract and plan.cluster.compile_only and plan.cluster.target == "H100-80GB"
    assert plan.memory_fit().compiled == plan.step_memory().total
    assert plan.compiled_host_copies().count > 0
