"""The model's layers, for rematerialization per layer: found in the captured program, no annotation.

A layer is a contiguous run of top-level equations under one module path (Flax's name stack,
`GPT/Block_3`). The depth is the one at which the model repeats itself most: the module paths whose
equations compute the same function (equal `subgraph_key`, e.g. the blocks of a transformer) cover
the most equations there, or the shallowest depth that covers that most less `1 - COVERAGE` of the
model's equations (a block's sub-layers repeat as much as the blocks do, and a sub-layer that also
appears outside the blocks, a final LayerNorm, adds little: the blocks are the layers); depth 2 (the top
module's children) stands when nothing repeats. A remat segment is then a layer within one
TaskGraph: `Layers.cuts` gives the equations where a new one starts, and
`whalex.jaxpr.segments.segments` cuts there too. `remat="full"` or a policy name applies to the
repeated layers (as `nn.remat` per block does); the others (embedding, head) keep their residuals.
"""
from __future__ import annotations

import collections
import dataclasses

from whalex.jaxpr.interpret import subgraph_function, subgraph_key
from whalex.jaxpr.module_paths import BASE_DEPTH, name_parts, split_layers

COVERAGE = 0.9


@dataclasses.dataclass(frozen=True)
class Layers:
    """The layers found: their module paths and first equations, and the depth that named them."""

    depth: int
    names: tuple[str, ...]
    starts: tuple[int, ...]          # the first top-level equation of each layer, ascending
    repeated: int                    # equations in layers that share their function with another
    repeats: tuple[bool, ...] = ()   # per layer: it computes the same function as another layer

    @property
    def cuts(self) -> tuple[int, ...]:
        return self.starts[1:]

    def repeated_at(self, eqn: int) -> bool:
        """Whether the layer holding top-level equation `eqn` is a repeated one (a block)."""
        k = max((i for i, start in enumerate(self.starts) if start <= eqn), default=None)
        return k is not None and k < len(self.repeats) and self.repeats[k]


def find_layers(cap) -> Layers:
    """The layering at the depth where repeated layers cover the most equations (see module doc)."""
    jaxpr = cap.jaxpr.jaxpr
    deepest = max((len(name_parts(e)) for e in jaxpr.eqns), default=0)
    memo: dict = {}
    found = []
    for depth in range(BASE_DEPTH, max(deepest, BASE_DEPTH) + 1):
        units = _named(split_layers(cap, depth))
        repeats = _repeats(cap, units, memo)
        found.append(Layers(depth, tuple("/".join(u.key) or "(unnamed)" for u in units),
                            tuple(u.eqns[0] for u in units),
                            sum(len(u.eqns) for u, r in zip(units, repeats) if r), repeats))
    most = max((layers.repeated for layers in found), default=0)
    slack = (1 - COVERAGE) * len(jaxpr.eqns)
    return next((layers for layers in found if layers.repeated >= most - slack), Layers(BASE_DEPTH, (), (), 0))


def _named(units) -> list:
    """Units with a module path; an unnamed run joins the layer before it (a model of plain functions
    has no layers to cut: remat stays per TaskGraph)."""
    out: list = []
    for u in units:
        if u.key or not out:
            out.append(u)
        else:
            out[-1] = dataclasses.replace(out[-1], eqns=out[-1].eqns + u.eqns)
    return [u for u in out if u.eqns and u.key]


def _repeats(cap, units, memo: dict) -> tuple[bool, ...]:
    """Per unit: it is contiguous and another unit computes the same function."""
    jaxpr = cap.jaxpr.jaxpr
    consts = set(jaxpr.constvars)
    keys = []
    for u in units:
        contiguous = list(u.eqns) == list(range(u.eqns[0], u.eqns[-1] + 1))
        if not contiguous or len(u.eqns) < 2:
            keys.append(None)
            continue
        inputs, outputs, _ = subgraph_function(jaxpr, u.eqns)
        keys.append(subgraph_key(jaxpr, u.eqns, inputs, outputs, consts, memo))
    counts = collections.Counter(k for k in keys if k is not None)
    return tuple(k is not None and counts[k] > 1 for k in keys)
