"""What a step costs each device beyond its own work (placing its block, the launch, the all-reduce's
local work when it comes last), timed on real devices and added to the slower devices' fixed time."""
import importlib

import jax
import numpy as np
import optax
import pytest

import whalex as wh
from balance.test_calibrate import _synthetic_rounds
from support.models import plain_model
from whalex.balance import step_timing
from whalex.balance.calibrate import calibrate


def test_time_extras_times_every_device_on_real_devices():
    params = {"w": np.zeros((256, 256), np.float32)}
    batch = {"x": np.ones((64, 16), np.float32)}
    extras = step_timing.time_extras(jax.devices()[:4], params, batch, block=32, repeats=3)
    assert extras.shape == (4, 2) and np.all(np.isfinite(extras))       # [placement, all-reduce] per device
    assert step_timing.gradient_elements(params) == 256 * 256
    assert step_timing.gradient_elements({"h": np.zeros(3, np.float16)}) == 1        # 6 bytes: one element


def test_beyond_least_is_per_group_and_never_negative():
    out = step_timing.beyond_least([3e-3, 5e-3, 1.2e-2, 1.0e-2], [[0, 1], [2, 3]])
    np.testing.assert_allclose(out, [0.0, 0.0, 7e-3, 7e-3])           # medians 4 ms and 11 ms
    assert np.all(step_timing.beyond_least([2e-3, 1e-3], [[0], [1]]) >= 0)


def test_step_extra_counts_the_placement_and_the_all_reduce_lead():
    extras = np.asarray([[1e-3, 0.0], [1e-3, 6e-3], [0.0, 4e-3]])
    np.testing.assert_allclose(step_timing.step_extra(extras), [1e-3, 1e-3 + 6e-3 * step_timing.REDUCE_LEAD,
                                                                4e-3 * step_timing.REDUCE_LEAD])
    assert 0 < step_timing.REDUCE_LEAD < 1          # the all-reduce's tail follows the last arrival: never all of it


def test_calibrate_adds_the_slow_devices_extras_to_their_fixed_time(monkeypatch):
    loss_fn, params, batch = plain_model("dp", "ctx")
    cal = importlib.import_module("whalex.balance.calibrate")
    monkeypatch.setattr(cal, "time_rounds", _synthetic_rounds([2e-4] * 8, [2e-5] * 4 + [4e-5] * 4, 0.02))
    seen = []

    def extras(devices, params, batch, block, repeats):
        seen.append((len(devices), block, repeats))
        lead = 2e-3 / step_timing.REDUCE_LEAD                         # an all-reduce extra whose lead is 2 ms
        return np.asarray([[1e-3, 0.0]] * 4 + [[2e-3, lead]] * 4)
    monkeypatch.setattr(step_timing, "time_extras", extras)
    base = calibrate(wh.Cluster.detect(), loss_fn, params, batch, optimizer=optax.adam(1e-3), extras=False)
    assert not seen                                                    # off: the fixed times as measured
    cluster = calibrate(wh.Cluster.detect(), loss_fn, params, batch, optimizer=optax.adam(1e-3), extras=True)
    n = jax.tree.leaves(batch)[0].shape[0]
    assert seen and seen[0][0] == 8 and n // 8 < seen[0][1] <= n       # a fast device's share: its block
    added = np.asarray(cluster.overhead) - np.asarray(base.overhead)
    np.testing.assert_allclose(added, [0.0] * 4 + [3e-3] * 4, atol=2e-4)   # 2 + 2 ms beyond the fast devices' 1 ms
    slow = wh.plan(loss_fn, params, batch, cluster=cluster).batch_sizes
    assert sum(slow[4:]) < sum(wh.plan(loss_fn, params, batch, cluster=base).batch_sizes[4:])
    # identical devices: nothing to balance, nothing timed
    monkeypatch.setattr(cal, "time_rounds", _synthetic_rounds([2e-4] * 8, [2e-5] * 8, 0.02))
    seen.clear()
    calibrate(wh.Cluster.detect(), loss_fn, params, batch, optimizer=optax.adam(1e-3), extras=True)
    assert not seen


def test_extras_default_to_clusters_that_span_processes(monkeypatch):
    loss_fn, params, batch = plain_model("dp", "ctx")
    cal = importlib.import_module("whalex.balance.calibrate")
    monkeypatch.setattr(cal, "time_rounds", _synthetic_rounds([2e-4] * 8, [2e-5] * 4 + [4e-5] * 4, 0.02))
    monkeypatch.setattr(step_timing, "time_extras", lambda *a: pytest.fail("timed in one process"))
    calibrate(wh.Cluster.detect(), loss_fn, params, batch, optimizer=optax.adam(1e-3))
