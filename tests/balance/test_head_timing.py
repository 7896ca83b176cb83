"""A split head's class split from its own program: calibrate times the head (every device at once,
its collectives included) at class splits around the rows' speeds and keeps the fastest as a scale
on the slowest devices' speed (`Cluster.head_scale`), which the plan's class split applies; training
stays exactly one device's."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import whalex as wh
from balance.test_calibrate import _synthetic_rounds
from balance.test_heterogeneous_balance import _head_model
from conftest import HETERO, adam, assert_matches
from whalex.balance import head_timing
from whalex.balance.calibrate import calibrate
from whalex.mesh.cluster import scaled_speeds


def _per_device_speeds(cluster):
    return list(cluster.speeds)        # the head splits over all 8 devices: one model position each


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_head_scale_moves_only_the_classes_and_trains_exactly(optimizer):
    """The T4s at x0.5 their speed on the classes: each gets the split of the halved speeds (fewer
    than the rows' 55 of 640), the rows keep 5:3, and training equals one device."""
    loss_fn, params, batch = _head_model()
    cluster = wh.Cluster(kinds=HETERO).with_head_scale(0.5)
    opt = optax.sgd(0.1) if optimizer == "sgd" else adam()
    step, _ = assert_matches(loss_fn, params, batch, steps=3, optimizer=opt, cluster=cluster)
    plan = step.plan
    counts = [d.rows for d in plan.head_balance.devices]
    expected = head_timing.class_counts(640, scaled_speeds(_per_device_speeds(cluster), 0.5)[0])
    assert tuple(counts) == expected and counts[4] < 55 and sum(counts) == 640
    assert "the slowest at x0.50 their rows' speed" in plan.head_balance.kind
    assert plan.batch_sizes == (5,) * 4 + (3,) * 4


def test_head_scale_is_validated_and_kept_by_a_speed_change():
    cluster = wh.Cluster(kinds=HETERO).with_head_scale(0.7)
    assert cluster.with_speeds(cluster.speeds).head_scale == 0.7
    for bad in (0, -1.0, float("nan"), True, "0.7"):
        with pytest.raises(wh.ClusterError, match="with_head_scale needs a positive number"):
            cluster.with_head_scale(bad)
    for bad in ((), (8,), (-1,), (True,), (1.5,)):
        with pytest.raises(wh.ClusterError, match=r"with_head_scale\(devices=...\) is a non-empty list"):
            cluster.with_head_scale(0.7, bad)


def test_a_head_scale_stays_on_its_devices_when_their_rows_speed_passes_the_others():
    """Named devices keep the head's scale where a speed change makes them no longer the slowest (a
    refinement's rows' sweep); unnamed, it is on the slowest."""
    cluster = wh.Cluster(kinds=HETERO)
    v100, t4 = cluster.speeds[0], cluster.speeds[4]
    assert cluster.with_head_scale(0.5).head_speeds == (v100,) * 4 + (t4 * 0.5,) * 4
    faster = cluster.with_speeds((v100,) * 4 + (v100 * 2,) * 4)
    assert faster.with_head_scale(0.5).head_speeds == (v100 * 0.5,) * 4 + (v100 * 2,) * 4
    assert faster.with_head_scale(0.25, [7, 4, 5, 6]).head_speeds == (v100,) * 4 + (v100 * 0.5,) * 4
    assert faster.with_head_scale(0.25, [7, 4, 5, 6]).head_devices == (4, 5, 6, 7)
    loss_fn, params, batch = _head_model()
    named = wh.plan(loss_fn, params, batch, optax.sgd(0.1), cluster=faster.with_head_scale(0.25, [4, 5, 6, 7]))
    assert "devices 4, 5, 6, 7 at x0.25 their rows' speed" in named.head_balance.kind
    assert [d.rows for d in named.head_balance.devices] == list(
        head_timing.class_counts(640, faster.with_head_scale(0.25, [4, 5, 6, 7]).head_speeds))


def test_the_timed_program_is_the_heads_forward_and_gradients():
    """What calibrate times computes the head: its loss and gradients equal the dense head's at an
    uneven split of the classes over two devices."""
    loss_fn, params, batch = _head_model()
    head, = head_timing.split_heads(loss_fn, params, batch)
    assert (head.rows, head.features, head.classes) == (32, 24, 640)
    counts = (448, 192)
    mesh, fn = head_timing._program(tuple(jax.devices()[:2]), counts, head.rows)
    x, w, b, y = head_timing._arguments(mesh, head, max(counts), 2)
    loss, (dx, dw, db) = fn(x, w, b, y)
    index = np.concatenate([np.arange(448), 448 + np.arange(192)])           # real columns of the padded kernel
    wd, bd = np.asarray(w)[:, index], np.asarray(b)[index]

    def dense(x, w, b):
        z = x @ w + b
        return jnp.sum(jax.nn.logsumexp(z, axis=1) - jnp.take_along_axis(z, y[:, None], axis=1)[:, 0])
    ref, (rdx, rdw, rdb) = jax.value_and_grad(dense, argnums=(0, 1, 2))(np.asarray(x), wd, bd)
    np.testing.assert_allclose(loss * 32, ref, rtol=1e-5)                     # the mean over the rows
    np.testing.assert_allclose(dx * 32, rdx, rtol=1e-4, atol=1e-6)             # gradients of the mean
    np.testing.assert_allclose(np.asarray(dw)[:, index] * 32, rdw, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(db)[index] * 32, rdb, rtol=1e-4, atol=1e-6)


def test_the_head_is_timed_for_all_its_rounds_where_they_fit_in_the_time():
    assert head_timing.rounds_for(0.5, 9, seconds=60.0) == head_timing.MAX_ROUNDS     # they fit: all of them
    assert head_timing.rounds_for(2.0, 9, seconds=60.0) == head_timing.MAX_ROUNDS     # a long program's too
    assert head_timing.rounds_for(4.0, 9, seconds=60.0) == 15             # a longer one: what fits in the time
    assert head_timing.rounds_for(20.0, 9, seconds=60.0) == 9             # ... at least the repeats
    assert head_timing.rounds_for(0.0, 40) == 40                          # the repeats asked for, if more


def test_distinct_splits_keeps_the_first_scale_of_each_class_split():
    grid = [0.5, 0.5001, 0.75, 1.0, 1.0001, 1.25]
    splits = head_timing.distinct_splits(640, [2.0, 1.0], grid)
    assert list(splits) == [0.5, 0.75, 1.0, 1.25]                           # near-equal scales: one program
    assert len(set(splits.values())) == len(splits)
    for s, counts in splits.items():
        assert counts == head_timing.class_counts(640, scaled_speeds([2.0, 1.0], s)[0]) and sum(counts) == 640
    assert splits[0.5][1] < splits[1.25][1]                                 # a faster slow device: more classes


def test_time_head_times_distinct_splits_and_keeps_one_of_its_scales():
    loss_fn, params, batch = _head_model()
    head, = head_timing.split_heads(loss_fn, params, batch)
    scales, times = head_timing.head_rounds(jax.devices()[:2], head, [2.0, 1.0], repeats=2, seconds=0.0)
    assert times.shape == (2, len(scales)) and (times > 0).all()             # no time asked: the repeats
    scale, timed = head_timing.time_head(jax.devices()[:2], head, [2.0, 1.0], repeats=2)
    splits = [head_timing.class_counts(640, scaled_speeds([2.0, 1.0], s)[0]) for s, _ in timed]
    assert len(set(splits)) == len(splits) >= 4 and all(t > 0 for _, t in timed)
    assert min(s for s, _ in timed) <= scale <= max(s for s, _ in timed)


def test_calibrate_times_the_head_where_devices_differ(monkeypatch):
    loss_fn, params, batch = _head_model()
    cal = importlib.import_module("whalex.balance.calibrate")
    seen = []

    def timed(devices, head, speeds, repeats):
        seen.append((len(devices), head.classes))
        return 0.6, []
    monkeypatch.setattr(cal, "time_head", timed)
    monkeypatch.setattr(cal, "time_rounds", _synthetic_rounds([2e-4] * 8, [2e-5] * 4 + [4e-5] * 4, 0.02))
    cluster = calibrate(wh.Cluster.detect(), loss_fn, params, batch, optimizer=optax.sgd(0.1), extras=False)
    assert seen == [(8, 640)] and cluster.head_scale == 0.6
    seen.clear()
    off = calibrate(wh.Cluster.detect(), loss_fn, params, batch, optimizer=optax.sgd(0.1), extras=False, head=False)
    assert not seen and off.head_scale == 1.0
    monkeypatch.setattr(cal, "time_rounds", _synthetic_rounds([2e-4] * 8, [2e-5] * 8, 0.02))
    assert calibrate(wh.Cluster.detect(), loss_fn, params, batch, extras=False).head_scale == 1.0 and not seen


def test_drift_between_rounds_does_not_reorder_the_splits():
    """A round that runs slower throughout (drift) scales its row; the medians keep the splits' order
    and ratios, where plain medians of these rounds would put the fastest split last."""
    base = np.array([1.0, 0.9, 1.2])
    times = np.stack([base * f for f in (1.0, 1.0, 1.5, 1.6, 1.7)])
    times[0, 1] = times[1, 1] = 0.9 * 1.8                    # the fastest split's two fast rounds hit by noise
    plain = np.median(times, axis=0)
    assert np.argmin(plain) != 1
    medians = head_timing.drift_free_medians(times)
    assert np.argmin(medians) == 1
    np.testing.assert_allclose(medians[[0, 2]] / medians[0], base[[0, 2]] / base[0], rtol=1e-9)
