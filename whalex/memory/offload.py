"""Host offload of training state: arrays stored in `pinned_host` memory between steps.

The state shardings of an offloaded subtree carry `memory_kind="pinned_host"`; inside the step
the arrays are moved to device memory for the computation (`fetch`), and the jit's output
shardings move the new values back to the host. On CPU both kinds are host memory, so the moves
cost nothing there: tests check placement, not speed.
"""
from __future__ import annotations

import jax
from jax.sharding import NamedSharding

HOST = "pinned_host"
DEVICE = "device"

TARGETS = ("opt_state", "params")        # what this module offloads ("activations": remat's business)


def _map(shardings, kind: str):
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings,
                        is_leaf=lambda x: isinstance(x, NamedSharding))


def on_host(shardings):
    """The same shardings in pinned host memory."""
    return _map(shardings, HOST)


def on_device(shardings):
    """The same shardings in device memory."""
    return _map(shardings, DEVICE)


def fetch(tree, shardings):
    """Inside a jitted step: `tree` (stored on the host) moved to device memory, same layout."""
    return jax.device_put(tree, on_device(shardings))
