"""Layer candidates for automatic pipeline partitioning, coarse to fine, and the names of stages.

A stage boundary falls between two *units*: contiguous runs of top-level equations. Units come
from the module paths in the equations' name stacks (Flax's `Model/decoder/block_0/mlp/...`) at
increasing depths: depth 2 gives the top module's children (`Model/decoder`), depth 3 theirs
(`Model/decoder/block_0`), and so on, so repeated blocks are found at whatever depth they sit.
The finest candidate, one unit per top-level equation, needs no names at all. Units never split
the readers of one parameter inside one top-level layer (a pipeline stage owns its parameters).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from whalex import _compat as C
from whalex.jaxpr.module_paths import BASE_DEPTH, Unit, name_parts, split_layers


@dataclasses.dataclass(frozen=True)
class Granularity:
    """One way of cutting the model into units: `name` says how ("depth 3", "equations")."""

    name: str
    units: tuple[Unit, ...]

    @property
    def fine(self) -> bool:
        """Finer than Whale's layers (cuts may fall inside a top-level layer)."""
        return self.name != f"depth {BASE_DEPTH}"


def per_equation(cap) -> tuple[Unit, ...]:
    """One unit per top-level equation, keyed by its module path (the name-free candidate)."""
    eqns = cap.jaxpr.jaxpr.eqns
    return tuple(Unit(name_parts(e) if len(name_parts(e)) >= BASE_DEPTH else (), (i,)) for i, e in enumerate(eqns))


def granularities(cap) -> Iterator[Granularity]:
    """The candidates, coarse to fine: module paths at depth 2, 3, ..., then single equations.
    Candidates that cut exactly like a coarser one are skipped."""
    jaxpr = cap.jaxpr.jaxpr
    base = split_layers(cap, BASE_DEPTH)
    layer_of = {i: u for u, unit in enumerate(base) for i in unit.eqns}
    yield Granularity(f"depth {BASE_DEPTH}", base)
    seen = {_cuts(base)}
    deepest = max((len(name_parts(e)) for e in jaxpr.eqns), default=0)
    candidates = [(f"depth {d}", lambda d=d: split_layers(cap, d)) for d in range(BASE_DEPTH + 1, deepest + 1)]
    for name, make in candidates + [("equations", lambda: per_equation(cap))]:
        units = keep_parameters_together(cap, make(), layer_of)
        if _cuts(units) not in seen:
            seen.add(_cuts(units))
            yield Granularity(name, units)


def _cuts(units: Sequence[Unit]) -> tuple:
    return tuple(u.eqns[0] for u in units)


def keep_parameters_together(cap, units: Sequence[Unit], layer_of: dict) -> tuple[Unit, ...]:
    """Merge neighbouring units that read one parameter, where its readers sit in one top-level
    layer (`layer_of`: equation -> layer); the merged key is the keys' common module path."""
    jaxpr = cap.jaxpr.jaxpr
    params = set(jaxpr.invars[: cap.num_params])
    unit_of = {i: u for u, unit in enumerate(units) for i in unit.eqns}
    readers: dict = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, C.Literal) and v in params:
                readers.setdefault(v, []).append(i)
    joined = np.zeros(len(units) + 1, dtype=int)          # +1 where units u-1 and u must stay together
    for eqns in readers.values():
        if len({layer_of[i] for i in eqns}) == 1:
            first, last = min(unit_of[i] for i in eqns), max(unit_of[i] for i in eqns)
            joined[first + 1] += 1
            joined[last + 1] -= 1
    together = np.cumsum(joined) > 0
    out: list[Unit] = []
    for u, unit in enumerate(units):
        if out and together[u]:
            prev = out[-1]
            out[-1] = Unit(common_path(prev.key, unit.key), prev.eqns + unit.eqns)
        else:
            out.append(unit)
    return tuple(out)


def common_path(a: tuple, b: tuple) -> tuple:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def cut_penalties(cap, units: Sequence[Unit]) -> np.ndarray:
    """Cost of a stage boundary before each unit (0 for the first): the depth of the module path
    shared across it (cuts between blocks beat cuts inside one), then the bytes it must carry
    (as a fraction below 1)."""
    jaxpr = cap.jaxpr.jaxpr
    n = len(units)
    produced: dict = {}
    last: dict = {}
    for u, unit in enumerate(units):
        for i in unit.eqns:
            for v in jaxpr.eqns[i].invars:
                if not isinstance(v, C.Literal) and v in produced:
                    last[v] = max(last.get(v, 0), u)
            produced.update((v, u) for v in jaxpr.eqns[i].outvars)
    for v in jaxpr.outvars:
        if not isinstance(v, C.Literal) and v in produced:
            last[v] = n
    live = np.zeros(n + 1)
    for v, u in produced.items():
        if last.get(v, u) > u:
            nbytes = float(np.prod(v.aval.shape, dtype=np.float64)) * np.dtype(v.aval.dtype).itemsize
            live[u + 1] += nbytes
            live[min(last[v], n - 1) + 1] -= nbytes
    live = np.cumsum(live)[:n]
    shared = np.array([0] + [len(common_path(units[u - 1].key, units[u].key)) for u in range(1, n)], float)
    return shared + live / (live.max() + 1.0) * (np.arange(n) > 0)


def stage_names(units: Sequence[Unit], stage_of_unit: Sequence[int]) -> tuple[tuple[str, ...], ...]:
    """The modules each stage holds, named by the shortest module path (below the common root)
    whose units all sit in that stage: `decoder/block_1` for a whole block, `decoder/block_2/mlp`
    for part of one. Paths that only glue their children together (masks, residual adds) and
    paths split between stages are named only where a stage has nothing else."""
    num_stages = max(stage_of_unit) + 1 if len(stage_of_unit) else 0
    named = [u.key for u in units if u.key]
    strip = 1 if named and len({k[0] for k in named}) == 1 and any(len(k) > 1 for k in named) else 0
    stages_under: dict = {}
    for unit, s in zip(units, stage_of_unit):
        for n in range(1, len(unit.key) + 1):
            stages_under.setdefault(unit.key[:n], set()).add(s)
    out = []
    for s in range(num_stages):
        names, extra = [], []
        for unit, st in zip(units, stage_of_unit):
            if st != s or len(unit.key) <= strip:
                continue
            path = next((unit.key[:n] for n in range(strip + 1, len(unit.key) + 1)
                         if stages_under[unit.key[:n]] == {s}), None)
            label = "/".join((path or unit.key)[strip:])
            glue = path is None and any(len(k) > len(unit.key) and k[:len(unit.key)] == unit.key for k in named)
            target = extra if glue else names
            if path is None and not glue:
                label += " (part)"
            if label not in target:
                target.append(label)
        out.append(tuple(names or extra))
    return tuple(out)
