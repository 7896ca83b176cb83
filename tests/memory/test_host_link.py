"""The plan predicts what offload moves over the host link a step and the least
time that takes at the device kind's host bandwidth."""
import optax
import pytest

import whalex as wh
from architectures.test_stock_gpt import loss_fn, problem
from whalex.memory.remat import saved_bytes
from whalex.mesh.specs import PCIE5, lookup
from whalex.records.memory_options import RematPlan


def _plan(offload, cluster=None):
    params, batch = problem()
    return wh.plan(loss_fn, params, batch, optax.adam(0.1), cluster=cluster, config=wh.Config(offload=offload))


def test_offloaded_state_crosses_the_link_both_ways_at_the_kinds_bandwidth():
    plain = _plan(None, wh.Cluster.abstract(["H100"] * 8))
    assert all(t is None for t in plain.host_traffic())
    plan = _plan(("opt_state", "params"), wh.Cluster.abstract(["H100"] * 8))
    t = plan.host_traffic()[0]
    opt, params = plain.memory[0].opt_state, plain.memory[0].params
    assert plan.params_fetched_per_layer          # parameters come for each layer's forward and backward and the update
    assert {x.what: x.to_device for x in t.transfers} == {"optimizer state": opt, "params": 3 * params}
    assert {x.what: x.to_host for x in t.transfers} == {"optimizer state": opt, "params": params}
    assert t.to_device == opt + 3 * params and t.to_host == opt + params
    assert lookup("H100").host_bandwidth == PCIE5
    assert t.seconds == pytest.approx((opt + 3 * params) / PCIE5)
    assert "host link per step and device" in plan.summary() and "63.0 GB/s" in plan.summary()


def test_offloaded_activations_are_what_full_remat_keeps():
    plan = _plan(("activations",))
    t = plan.host_traffic()[0]
    assert [x.what for x in t.transfers] == ["activations"]
    cap = plan.report.captured
    kept = saved_bytes(cap, RematPlan(("full",) * len(cap.taskgraphs), "full", plan.report.remat.layers))
    assert t.to_device == t.to_host == pytest.approx(kept / 8) and kept > 0
    assert kept < saved_bytes(cap, None)          # less than what the step keeps without remat


def test_unknown_host_bandwidth_says_so():
    spec = lookup("H100")
    custom = type(spec)(**{**spec.__dict__, "name": "X-80GB", "host_bandwidth": 0.0})
    plan = _plan(("opt_state",), wh.Cluster.abstract([custom] * 8))
    assert plan.host_traffic()[0].seconds is None
    assert "declares no host bandwidth" in plan.summary()
