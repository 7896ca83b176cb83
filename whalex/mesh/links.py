"""The links between devices, as a pipeline's messages cross them: a message of `n` bytes between two
devices costs `latency + n / bandwidth` seconds.

A link's figures come from the spec table (`whalex.mesh.specs`: a device's peer link inside its node,
its share of the node's network between nodes, the slower end's figure where the two kinds differ,
and for a kind without one the next figure it has: its host link, its memory), or, where `calibrate`
timed them on the cluster's devices (`Cluster.with_links`), from that measurement, which stands for
every pair.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from whalex.mesh.specs import NETWORK_LATENCY, NODE_LATENCY


@dataclasses.dataclass(frozen=True)
class Link:
    """One link, each way: the seconds a message costs whatever its size, and bytes per second."""

    latency: float
    bandwidth: float
    source: str = "spec table"          # or "calibrated"

    def seconds(self, nbytes: float) -> float:
        """The time of one message of `nbytes` over this link."""
        return self.latency + float(nbytes) / self.bandwidth


def link(cluster, a: int, b: int) -> Link:
    """The link between devices `a` and `b` of `cluster`: the calibrated one where measured, else the
    spec table's, inside a node or between nodes."""
    if cluster.links is not None:
        return cluster.links
    same = any(a in node and b in node for node in cluster.nodes)
    ends = (cluster.specs[a], cluster.specs[b])
    if same:
        return Link(NODE_LATENCY, min(s.peer_bandwidth or s.host_bandwidth or s.bandwidth for s in ends))
    return Link(NETWORK_LATENCY, min(s.network_bandwidth or s.host_bandwidth or s.bandwidth for s in ends))


def exchange_seconds(cluster, pairs: Iterable[tuple[int, int]], nbytes: float, collectives: int = 1) -> float:
    """The seconds of one exchange of a pipeline tick: over every link of `pairs` at once, `collectives`
    messages (each way its own, so one message's bytes per link direction) and their fixed costs; the
    slowest link's (0 for no pairs)."""
    return max((collectives * (k := link(cluster, a, b)).latency + float(nbytes) / k.bandwidth for a, b in pairs),
               default=0.0)


def stage_pairs(stage_devices: Sequence[Sequence[int]], ring: bool = False) -> list[tuple[int, int]]:
    """The device pairs a pipeline's messages cross: each device of stage s with the device in the same
    place of stage s + 1 (and, for a `ring`, the last stage's with the first's)."""
    S = len(stage_devices)
    nexts = [(s, s + 1) for s in range(S - 1)] + ([(S - 1, 0)] if ring and S > 1 else [])
    return [(a, b) for s, t in nexts for a, b in zip(stage_devices[s], stage_devices[t])]
