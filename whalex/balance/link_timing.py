"""Measured links: the seconds a message between devices costs, timed on the cluster's own devices.

A pipeline's ticks exchange messages between neighbouring stages; what one exchange costs depends on
the link (NVLink, PCIe, a network, or, on CPU processes, the collectives' transport), which a spec
table only estimates. `time_links` times a swap between every device and its neighbour on a ring, at
two message sizes, inside one jitted program (`SWAPS` swaps per run, so launches do not count), and
fits `latency + bytes / bandwidth` through the median of each; with several processes every
process times its own view of the same swaps and the slowest counts.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

SWAPS = 16                              # swaps per timed run
SIZES = (1 << 12, 1 << 20)              # bytes per device of the two messages timed
UNBOUNDED = 1e15                        # bytes/s where the two sizes timed alike (noise flattened the line)


def swap_program(devices: Sequence, elements: int, swaps: int = SWAPS):
    """`swaps` swaps around the ring of `devices` of a float32 buffer of `elements` per device, jitted,
    and its placed argument (nothing cached: the buffers go with the caller's last reference)."""
    devices = list(devices)
    mesh = Mesh(np.array(devices), ("link",))
    n = len(devices)
    ring = [(i, (i + 1) % n) for i in range(n)]

    def body(x):
        return jax.lax.fori_loop(0, swaps, lambda _, y: jax.lax.ppermute(y, "link", ring) + 1.0, x)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("link"), out_specs=P("link")))
    sharding = NamedSharding(mesh, P("link"))
    x = jax.make_array_from_callback((n * elements,), sharding, lambda idx: np.zeros(elements, np.float32))
    return fn, x


def _seconds_per_swap(devices: tuple, nbytes: int, repeats: int) -> float:
    """The median seconds of one swap of `nbytes` per device, over `repeats` timed runs (one warm-up)."""
    fn, x = swap_program(devices, max(nbytes // 4, 1))
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append((time.perf_counter() - t0) / SWAPS)
    return float(np.median(times))


def time_links(devices: Sequence, repeats: int = 7, sizes: Sequence[int] = SIZES) -> tuple[float, float]:
    """(latency seconds, bandwidth bytes/s) of a swap between neighbouring `devices` (at least two, of
    every process), the line through its time at the two message `sizes`."""
    devices = tuple(devices)
    if len(devices) < 2:
        raise ValueError(f"timing links needs at least two devices, got {len(devices)}.")
    lo, hi = sorted(int(s) for s in sizes)
    if not 0 < lo < hi:
        raise ValueError(f"timing links needs two distinct positive message sizes, got {tuple(sizes)}.")
    t = np.asarray([_seconds_per_swap(devices, s, repeats) for s in (lo, hi)], np.float64)
    if jax.process_count() > 1:
        t = np.asarray(multihost_utils.process_allgather(t)).reshape(-1, 2).max(axis=0)
    per_byte = (t[1] - t[0]) / (hi - lo)
    bandwidth = 1.0 / per_byte if per_byte > 1.0 / UNBOUNDED else UNBOUNDED
    return float(max(t[0] - lo / bandwidth, 0.0)), float(bandwidth)
