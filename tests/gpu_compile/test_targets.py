"""GPU topologies without GPUs: `wh.Cluster.gpu_topology` gives devices of XLA:GPU's deviceless
topology for a kind's target description, a plan on them compiles with XLA's GPU compiler, and
nothing runs."""
import jax
import jax.numpy as jnp
import optax
import pytest

import whalex as wh
from whalex.balance.calibrate import calibrate
from whalex.mesh.gpu_targets import TARGETS, gpu_target
from whalex.mesh.specs import lookup

# The H100 SXM's description as the GPU compiler reads it (the values a real H100 80GB HBM3 reports).
H100_FIELDS = ["threads_per_block_limit: 1024", "threads_per_warp: 32", "shared_memory_per_block: 49152",
               "shared_memory_per_core: 233472", "threads_per_core_limit: 2048", "core_count: 132",
               "fpus_per_core: 128", "memory_bandwidth: 3352320000000", "l2_cache_size: 52428800",
               "clock_rate_ghz: 1.98", "device_memory_size: 84929347584", "shared_memory_per_block_optin: 232448",
               "cuda_compute_capability { major: 9 }", 'device_description_str: "NVIDIA H100 80GB HBM3"']


def mlp():
    params = {"w1": jax.ShapeDtypeStruct((64, 256), jnp.float32), "w2": jax.ShapeDtypeStruct((256, 8), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((64, 64), jnp.float32), "y": jax.ShapeDtypeStruct((64, 8), jnp.float32)}

    def loss_fn(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    return loss_fn, params, batch


def test_h100_description_is_the_real_parts():
    text = gpu_target("H100").text()
    for field in H100_FIELDS:
        assert field in text, field


@pytest.mark.parametrize("kind", ["H100-80GB", "H200-141GB", "A100-80GB"])
def test_each_kind_compiles_and_its_devices_read_back_as_that_kind(kind):
    cluster = wh.Cluster.gpu_topology(kinds=[kind] * 8)
    assert cluster.target == kind and cluster.compile_only and not cluster.is_abstract
    assert {lookup(d.device_kind).name for d in cluster.devices} == {kind}
    assert cluster.platform == "cuda"
    loss_fn, params, batch = mlp()
    plan = wh.plan(loss_fn, params, batch, optax.sgd(0.1), cluster=cluster)
    mem = plan.step_memory()
    assert mem.arguments == plan.predicted_memory().arguments > 0
    assert "gemm" in plan.lowered(donate=True).compile().as_text()      # cuBLAS: the GPU compiler ran
    assert plan.compiled_collectives().count >= 1                        # the gradient all-reduce


def test_64_gpus_on_8_hosts():
    cluster = wh.Cluster.gpu_topology(kinds=["H100-80GB"] * 64)
    assert cluster.nodes == tuple(tuple(range(8 * h, 8 * h + 8)) for h in range(8))
    assert sorted({d.process_index for d in cluster.devices}) == list(range(8))
    four = wh.Cluster.gpu_topology(kinds=["H100-80GB"] * 64, devices_per_node=4)
    assert len(four.nodes) == 16


def test_a_compile_only_cluster_plans_but_does_not_run():
    cluster = wh.Cluster.gpu_topology(kinds=["H100-80GB"] * 8)
    loss_fn, params, batch = mlp()
    real = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (params, batch))
    step = wh.parallelize(loss_fn, optax.sgd(0.1), cluster=cluster)
    with pytest.raises(wh.PlanError, match="gpu_topology cluster can plan, lower and compile but not run"):
        step.init(*real)
    with pytest.raises(ValueError, match="gpu_topology"):
        calibrate(cluster, loss_fn, *real)
    assert "XLA:GPU topology for H100-80GB" in repr(cluster)


def test_bad_topologies_are_named():
    with pytest.raises(wh.ClusterError, match="devices_per_node as a divisor"):
        wh.Cluster.gpu_topology(kinds=["H100-80GB"] * 12, devices_per_node=8)
    with pytest.raises(wh.ClusterError, match="no XLA:GPU target description for P100-16GB"):
        wh.Cluster.gpu_topology(kinds=["P100-16GB"] * 8)
    with pytest.raises(wh.ClusterError, match="the target is one of the cluster's kinds"):
        wh.Cluster.gpu_topology(kinds=["H100-80GB"] * 8, target="A100-80GB")


def test_a_heterogeneous_plan_compiles_once_per_kind():
    """One SPMD program for V100 x 4 + T4 x 4, compiled for each kind's target: the same plan (rows,
    state), each kind's compiler."""
    kinds = ["V100-32GB"] * 4 + ["T4-16GB"] * 4
    loss_fn, params, batch = mlp()
    plans = {}
    for kind in ("V100-32GB", "T4-16GB"):
        cluster = wh.Cluster.gpu_topology(kinds=kinds, devices_per_node=4, target=kind)
        plans[kind] = wh.plan(loss_fn, params, batch, optax.sgd(0.1), cluster=cluster)
    v100, t4 = plans["V100-32GB"], plans["T4-16GB"]
    assert v100.batch_sizes == t4.batch_sizes and v100.batch_sizes[0] > v100.batch_sizes[-1]   # balanced
    assert v100.step_memory().arguments == t4.step_memory().arguments
    other = wh.Cluster.gpu_topology(kinds=kinds, devices_per_node=4).for_target("T4-16GB")
    assert other.target == "T4-16GB" and other.kinds == tuple(lookup(k).name for k in kinds)


def test_every_kind_has_a_description_the_compiler_accepts():
    for kind in TARGETS:
        devices = wh.Cluster.gpu_topology(kinds=[kind] * 2).devices
        assert len(devices) == 2
