"""Planning and lowering for 64 GPUs without 64 devices."""
import jax
import jax.numpy as jnp
import optax
import pytest

import whalex as wh
from support.models import plain_params


def test_lower_on_64_abstract_v100s():
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), plain_params())
    batch = {"x": jax.ShapeDtypeStruct((128, 12), jnp.float32), "y": jax.ShapeDtypeStruct((128,), jnp.int32)}
    params["wh"] = jax.ShapeDtypeStruct((24, 64 * 10), jnp.float32)
    params["bh"] = jax.ShapeDtypeStruct((64 * 10,), jnp.float32)

    def loss_fn(p, b):
        with wh.replicate(64):
            h = jnp.tanh(jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"])
        with wh.split(64):
            return optax.softmax_cross_entropy_with_integer_labels(h @ p["wh"] + p["bh"], b["y"]).mean()

    cluster = wh.Cluster.abstract(kinds=["V100-32GB"] * 64)
    plan = wh.plan(loss_fn, params, batch, optimizer=optax.adam(1e-3), cluster=cluster)
    assert plan.layout.size == 64 and plan.virtual_devices[1].model_axes == ("model",)
    text = plan.lower()
    assert "mhlo.num_partitions = 64" in text
    assert '"model"=64' in text                                  # the mesh the shardings refer to
    assert '[{}, {"model"}]' in text                             # the head kernel split over 64 devices
    assert plan.batch_sizes == (2,) * 64
    assert plan.task_graphs[1].flops > 0 and plan.memory[0].kind == "V100-32GB"
    assert "split(64)" in plan.summary() and "<table>" in plan._repr_html_()


def test_what_compiles_an_abstract_clusters_plans():
    """`compile_twin()` is the XLA:GPU topology an abstract cluster of GPU kinds plans on where JAX's CUDA
    plugin is installed; without the plugin, with `compiler="replay"`, for CPU kinds or a cluster with
    devices there is none, and the replay judges memory. A compiler whalex does not know is refused."""
    from conftest import cuda_plugin_installed

    gpus = wh.Cluster.abstract(kinds=["H100-80GB"] * 8)
    twin = gpus.compile_twin()
    assert (twin is not None) == cuda_plugin_installed()
    if twin is not None:
        assert twin.compile_only and twin.kinds == gpus.kinds and twin.nodes == gpus.nodes
    assert wh.Cluster.abstract(kinds=["H100-80GB"] * 8, compiler="replay").compile_twin() is None
    assert wh.Cluster.abstract(kinds=["cpu"] * 8).compile_twin() is None
    assert wh.Cluster.detect().compile_twin() is None
    assert gpus.with_speeds([1.0] * 8).compiler == "auto"
    with pytest.raises(wh.ClusterError, match=r"compiler='xla'.*'auto', 'replay'"):
        wh.Cluster.abstract(kinds=["H100-80GB"] * 8, compiler="xla")
