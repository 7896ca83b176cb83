"""Host RAM per node bounds offload; repeated blocks are measured once."""
import time

import jax
import jax.numpy as jnp
import optax
import pytest

import whalex as wh
from whalex.balance.profile import taskgraph_flops
from whalex.errors import ClusterError
from whalex.jaxpr.capture import taskgraph_eqns
from whalex.jaxpr.interpret import subgraph_functions, subgraph_key

GiB = 2**30
N = 8
WIDTH = 64


def _params(layers=3):
    return {f"w{i}": jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32) for i in range(layers)} | {
        "out": jax.ShapeDtypeStruct((WIDTH, 10), jnp.float32)}


BATCH = {"x": jax.ShapeDtypeStruct((4 * N, WIDTH), jnp.float32), "y": jax.ShapeDtypeStruct((4 * N,), jnp.int32)}


def _loss(p, b, layers=3):
    h = b["x"]
    for i in range(layers):
        with wh.replicate(N):                 # one TaskGraph per block: the blocks repeat
            h = jnp.tanh(h @ p[f"w{i}"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["out"], b["y"]).mean()


def _plan(cluster, config=None):
    return wh.plan(_loss, _params(), BATCH, optimizer=optax.adam(1e-3), cluster=cluster, config=config)


def test_nodes_and_host_memory_of_clusters():
    a = wh.Cluster.abstract(["V100-32GB"] * 512)           # the spec table's V100 node: a DGX-1
    assert len(a.nodes) == 64 and all(len(n) == 8 for n in a.nodes) and a.host_source == "spec table"
    assert a.host_memory[0] == 512 * GiB and a.host_bytes == (64 * GiB,) * 512
    d = wh.Cluster.abstract(["V100-32GB"] * 32, host_memory="1.5TB", devices_per_node=16)   # DGX-2s
    assert d.nodes == (tuple(range(16)), tuple(range(16, 32))) and d.host_bytes[0] == 96 * GiB
    assert d.host_source == "declared"
    mixed = wh.Cluster.abstract(["V100-32GB"] * 4 + ["T4-16GB"] * 4)
    assert mixed.nodes == ((0, 1, 2, 3), (4, 5, 6, 7))             # a new kind starts a new node
    real = wh.Cluster(kinds=["V100-32GB"] * 4 + ["T4-16GB"] * 4)  # one process: one node, this machine's RAM
    assert real.nodes == (tuple(range(8)),) and real.host_source in ("detected", "spec table")
    assert real.host_bytes[0] > 0 and real.with_speeds([1.0] * 8).host_bytes == real.host_bytes
    assert wh.Cluster(kinds=["CPU"] * 8, host_memory=64 * GiB, devices_per_node=4).host_bytes == (16 * GiB,) * 8
    for bad in ("lots", "-3GB", 0):
        with pytest.raises(ClusterError, match="memory"):
            wh.Cluster.abstract(["V100-32GB"] * 8, host_memory=bad)
    with pytest.raises(ClusterError, match="devices_per_node"):
        wh.Cluster.abstract(["V100-32GB"] * 8, devices_per_node=0)


@pytest.fixture(scope="module")
def ladder():
    """The footprints of the ladder on a device that holds everything (the numbers the tests size against)."""
    return _plan(wh.Cluster.abstract(["V100-32GB"] * N)).memory_fit()


def _tight(ladder, host_per_device):
    """A device that fits only once the optimizer state is offloaded, in nodes of N devices."""
    steps = {s.option: s.footprint for s in ladder.ladder}
    before, after = steps["amp bf16 activations"].device_total, steps["offload opt_state"].device_total
    spec = wh.DeviceSpec("tight", 1e12, 1e12, int((before + after) / 2), 1e11)
    return wh.Cluster.abstract([spec] * N, host_memory=host_per_device * N, devices_per_node=N), \
        steps["offload opt_state"].host


def test_memory_fit_names_host_memory_as_the_limit(ladder):
    cluster, needed = _tight(ladder, host_per_device=1.0)         # 1 byte of RAM per device
    fit = _plan(cluster).memory_fit()
    assert fit.host_capacity == 1.0 and needed > 1.0
    assert not fit.fits and fit.needs is None and fit.limit == "host memory"
    step = next(s for s in fit.ladder if s.option == "offload opt_state")
    assert step.footprint.device_total <= fit.capacity and not step.fits and step.limit == "host memory"
    assert "host memory is the limit" in fit.verdict()


def test_memory_fit_with_enough_host_memory(ladder):
    cluster, needed = _tight(ladder, host_per_device=float(GiB))
    fit = _plan(cluster).memory_fit()
    assert fit.needs is not None and fit.needs[-1] == "offload opt_state" and fit.limit is None
    assert fit.verdict().startswith("fits with ") and needed <= fit.host_capacity
    # device memory short even with everything offloaded: device memory is named
    tiny = wh.DeviceSpec("tiny", 1e12, 1e12, 1, 1e11)
    fit = _plan(wh.Cluster.abstract([tiny] * N, host_memory="1TB")).memory_fit()
    assert fit.needs is None and fit.limit == "device memory" and "device memory is the limit" in fit.verdict()


def test_plan_summary_checks_offload_against_host_memory_and_still_lowers():
    offload = wh.Config(offload="opt_state")
    small = _plan(wh.Cluster.abstract(["V100-32GB"] * N, host_memory=N, devices_per_node=N), offload)
    text = small.summary()
    assert "host memory (declared): 8 B per node of 8 devices" in text
    assert "does not fit: host memory is the limit" in text
    assert "mhlo.num_partitions = 8" in small.lower()               # a plan on an abstract cluster still lowers
    roomy = _plan(wh.Cluster.abstract(["V100-32GB"] * N), offload)
    assert "512.0 GiB per node of 8 devices" in roomy.summary() and "per device on the host: fits" in roomy.summary()


def test_repeated_blocks_are_measured_once_with_the_same_result():
    cap = _plan(wh.Cluster.abstract(["V100-32GB"] * N)).report.captured
    jaxpr = cap.jaxpr.jaxpr
    groups = taskgraph_eqns(jaxpr, cap.assign, len(cap.taskgraphs))
    keys = [subgraph_key(jaxpr, g, i, o) for g, (i, o, _) in zip(groups, subgraph_functions(jaxpr, groups))]
    assert keys[0] == keys[1] == keys[2] != keys[3]                # three tanh blocks, then the head
    flops = taskgraph_flops(cap.jaxpr, cap.assign, len(cap.taskgraphs))
    for t in range(len(groups)):                                   # each measured alone gives the same FLOPs
        alone = {p: 0 if tg == t else 1 for p, tg in cap.assign.items()}
        assert taskgraph_flops(cap.jaxpr, alone, 1)[0] == flops[t]


def test_planning_a_deep_model_on_many_abstract_devices_stays_fast():
    layers = 24
    params = _params(layers)
    cluster = wh.Cluster.abstract(["V100-32GB"] * 512)
    batch = {k: jax.ShapeDtypeStruct((512,) + v.shape[1:], v.dtype) for k, v in BATCH.items()}

    def loss(p, b):
        h = b["x"]
        for i in range(layers):
            with wh.replicate():
                h = jnp.tanh(h @ p[f"w{i}"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["out"], b["y"]).mean()

    t0 = time.perf_counter()
    plan = wh.plan(loss, params, batch, optimizer=optax.adam(1e-3), cluster=cluster)
    plan.memory_fit()
    assert "mhlo.num_partitions = 512" in plan.lower()
    assert time.perf_counter() - t0 < 60          # far above its time: a repeated block is measured once
