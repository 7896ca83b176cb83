"""Device specs, clusters, VirtualDevice generation (section 3.2.1) and nested data parallelism."""
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import whalex as wh
from conftest import adam, assert_matches, cuda_plugin_installed
from support.models import data, plain_params
from whalex.mesh.virtual import mesh_layout, virtual_devices
from whalex.primitives import Strategy


def test_spec_table_covers_the_required_kinds():
    for kind in ["P100", "V100-16GB", "V100-32GB", "T4", "A10", "A100-40GB", "A100-80GB", "H100", "H200", "L4", "CPU"]:
        spec = wh.Cluster.abstract([kind]).specs[0]
        assert spec.fp32_flops > 0 and spec.memory_bytes > 0
    assert wh.Cluster.abstract(["NVIDIA H100 80GB HBM3"]).kinds == ("H100-80GB",)
    v100, p100 = wh.SPECS["V100-32GB"], wh.SPECS["P100-16GB"]
    assert v100.fp32_flops > p100.fp32_flops and v100.memory_bytes == 2 * p100.memory_bytes


def test_detect_and_declared_kinds():
    c = wh.Cluster.detect()
    assert c.size == 8 and c.kinds == ("CPU",) * 8 and not c.is_abstract
    h = wh.Cluster(kinds=["V100-32GB"] * 4 + ["T4-16GB"] * 4)
    assert h.is_heterogeneous and h.devices == tuple(jax.devices()) and h.platform == "cpu"
    a = wh.Cluster.abstract(["V100-32GB"] * 512)
    assert a.size == 512 and a.is_abstract and a.platform == "cuda"


def test_virtual_devices_for_example_2_are_collocated():
    strategies = [Strategy("replicate", 8), Strategy("split", 8)]
    layout = mesh_layout(strategies, 8)
    assert layout.axis_names == ("data", "model") and layout.axis_sizes == (1, 8)
    rep, spl = virtual_devices(strategies, layout)
    assert rep.devices == spl.devices == tuple(range(8))
    assert rep.batch_axes == ("model",) and spl.model_axes == ("model",)


def test_nested_data_parallelism():
    strategies = [Strategy("replicate", 2), Strategy("split", 4)]
    layout = mesh_layout(strategies, 8)
    assert layout.axis_sizes == (2, 4)
    rep, spl = virtual_devices(strategies, layout)
    assert spl.groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and spl.nested_dp == 2
    assert rep.nested_dp == 4 and rep.data_parallel == 8
    assert spl.batch_axes == ("data",) and rep.batch_axes == ("data", "model")


def test_chain_of_split_degrees():
    layout = mesh_layout([Strategy("split", 2), Strategy("split", 4)], 8)
    assert layout.axis_names == ("data", "model1", "model0") and layout.axis_sizes == (2, 2, 2)
    s2, s4 = virtual_devices([Strategy("split", 2), Strategy("split", 4)], layout)
    assert s2.model_axes == ("model0",) and s4.model_axes == ("model1", "model0")
    assert s2.groups[1] == (2, 3) and s4.groups[1] == (4, 5, 6, 7)


def _two_level(p, b, bb, hd):
    with bb:
        h = jnp.tanh(jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"])
    with hd:
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["wh"] + p["bh"], b["y"]).mean()


def test_nested_dp_hybrid_matches_single_device():
    """replicate(2) backbone, split(4) head on 8 devices: 2 model replicas of 4 devices each."""
    step, state = assert_matches(lambda p, b: _two_level(p, b, wh.replicate(2), wh.split(4)),
                                 plain_params(), data(), steps=5)
    assert step.plan.layout.axis_sizes == (2, 4)
    assert step.plan.param_specs["['wh']"] == P(None, "model")
    assert {s.data.shape for s in state.params["wh"].addressable_shards} == {(24, 320 // 4)}


def test_two_split_degrees_match_single_device():
    step, _ = assert_matches(lambda p, b: _two_level(p, b, wh.split(2), wh.split(8)),
                             plain_params(), data(), steps=5)
    assert step.plan.layout.axis_sizes == (1, 4, 2)


def test_declared_heterogeneous_kinds_execute_exactly():
    cluster = wh.Cluster(kinds=["V100-32GB"] * 4 + ["T4-16GB"] * 4)
    step, _ = assert_matches(lambda p, b: _two_level(p, b, wh.replicate(8), wh.split(8)),
                             plain_params(), data(), steps=3, cluster=cluster)
    assert [m.kind for m in step.plan.memory] == ["V100-32GB"] * 4 + ["T4-16GB"] * 4


def test_init_sets_defaults():
    try:
        wh.init(wh.Config({"split.matmul_pattern": "row"}))
        plan = wh.plan(lambda p, b: _two_level(p, b, wh.replicate(8), wh.split(8)), plain_params(), data(), adam())
        assert plan.param_specs["['wh']"] == P("model")
    finally:
        wh.init()


def test_gpu_topology_needs_the_cuda_plugin_and_says_how_to_get_it():
    """Without JAX's CUDA plugin (the CPU suites' environment), a GPU topology is refused with the
    install line; with it (tests/gpu_compile's), it is 8 devices of XLA:GPU's compiler."""
    if cuda_plugin_installed():
        assert len(wh.Cluster.gpu_topology(kinds=["H100-80GB"] * 8).devices) == 8
    else:
        with pytest.raises(wh.ClusterError, match=r"pip install 'whalex\[cuda\]'.*JAX_PLATFORMS=cpu"):
            wh.Cluster.gpu_topology(kinds=["H100-80GB"] * 8)
