"""The links between devices a pipeline's messages cross: the spec table's inside a node and between
nodes, or calibrated ones, and the swap timing that measures them."""
import jax
import pytest

import whalex as wh
from whalex.balance.calibrate import calibrate
from whalex.balance.link_timing import time_links
from whalex.mesh.links import Link, exchange_seconds, link, stage_pairs
from whalex.mesh.specs import NETWORK_LATENCY, NODE_LATENCY, SPECS


def test_spec_links_inside_a_node_and_between_nodes():
    c = wh.Cluster.abstract(["H100-80GB"] * 16)                     # two DGX H100 nodes of 8
    assert c.nodes == (tuple(range(8)), tuple(range(8, 16)))
    assert link(c, 0, 7) == Link(NODE_LATENCY, 18 * 25e9)          # NVLink, each way
    assert link(c, 7, 8) == Link(NETWORK_LATENCY, 8 * 400e9 / 8 / 8)    # its share of 8 x 400 Gb/s
    assert link(c, 0, 7).seconds(45e6) == pytest.approx(10e-6 + 1e-4)
    mixed = wh.Cluster.abstract(["V100-32GB"] * 8 + ["T4-16GB"] * 8)
    assert link(mixed, 0, 8).bandwidth == SPECS["T4-16GB"].network_bandwidth     # the slower end
    pairs = stage_pairs([(0, 1), (8, 9)])
    assert pairs == [(0, 8), (1, 9)] and stage_pairs([(0,), (1,), (2,)], ring=True) == [(0, 1), (1, 2), (2, 0)]
    assert exchange_seconds(c, [(0, 1), (7, 8)], 1e6, collectives=2) == pytest.approx(2 * 25e-6 + 1e6 / 50e9)
    assert exchange_seconds(c, [], 1e6) == 0.0


def test_calibrated_links_stand_for_every_pair_and_bad_figures_are_clear_errors():
    c = wh.Cluster.abstract(["H100-80GB"] * 16).with_links(1e-3, 1e8)
    assert link(c, 0, 1) == link(c, 0, 15) == Link(1e-3, 1e8, "calibrated")
    assert c.with_speeds([1e12] * 16).links == c.links                # kept through other calibrated figures
    with pytest.raises(wh.ClusterError, match="non-negative latency.*positive bandwidth"):
        c.with_links(-1.0, 1e9)
    with pytest.raises(wh.ClusterError, match="positive bandwidth"):
        c.with_links(0.0, 0.0)


def test_time_links_fits_a_line_through_two_message_sizes_on_real_devices():
    latency, bandwidth = time_links(jax.devices(), repeats=3)
    assert 0 <= latency < 0.1 and bandwidth > 0
    with pytest.raises(ValueError, match="at least two devices"):
        time_links(jax.devices()[:1])
    with pytest.raises(ValueError, match="two distinct positive message sizes"):
        time_links(jax.devices(), sizes=(64, 64))


def test_calibrate_times_the_links_when_asked_and_otherwise_in_one_process_keeps_the_spec_table():
    timed = calibrate(wh.Cluster.detect(), size=64, chain=1, repeats=3, links=True)
    assert timed.links is not None and timed.links.source == "calibrated" and timed.links.bandwidth > 0
    assert calibrate(wh.Cluster.detect(), size=64, chain=1, repeats=3).links is None     # one process: spec table
