"""Equations' module paths (Flax's name stack, whalex's scope markers left out) and the layers they
name: contiguous runs of top-level equations under one module path cut at a depth."""
from __future__ import annotations

import dataclasses

from whalex import _compat as C
from whalex.primitives.scopes import PREFIX

BASE_DEPTH = 2          # the top module's children: Whale's layers, and the first candidate


@dataclasses.dataclass(frozen=True)
class Unit:
    """Top-level equations kept together; `key` is their module path (root first), () unnamed."""

    key: tuple[str, ...]
    eqns: tuple[int, ...]


def name_parts(eqn) -> tuple[str, ...]:
    """The module path of an equation (whalex's own scope markers left out)."""
    return tuple(p for p in str(eqn.source_info.name_stack).split("/") if p and not p.startswith(PREFIX))


def layer_key(eqn, depth: int = BASE_DEPTH) -> str | None:
    """The layer of an equation at `depth` ("Model/Dense_0" at depth 2), None if it has no module path."""
    parts = name_parts(eqn)
    return "/".join(parts[:depth]) if len(parts) >= BASE_DEPTH else None


def split_layers(cap, depth: int = BASE_DEPTH) -> tuple[Unit, ...]:
    """Contiguous runs of top-level equations under one module path cut at `depth`.

    A path seen before (a module called again, e.g. a tied embedding) joins the current unit;
    unnamed equations join the current unit, or start one at each new parameter read when the
    model has no names (plain functions).
    """
    jaxpr = cap.jaxpr.jaxpr
    params = set(jaxpr.invars[: cap.num_params])
    units: list[tuple[tuple, list[int], bool]] = []        # key, equations, reads a parameter
    seen: set = set()
    for i, eqn in enumerate(jaxpr.eqns):
        parts = name_parts(eqn)
        key = parts[:depth] if len(parts) >= BASE_DEPTH else None
        reads = any(not isinstance(v, C.Literal) and v in params for v in eqn.invars)
        if key is not None:
            new = not units or (key != units[-1][0] and key not in seen)
        else:
            new = not units or (reads and units[-1][0] == () and units[-1][2])
        if new:
            units.append((key or (), [i], reads))
            seen.add(key)
        else:
            units[-1][1].append(i)
            units[-1] = (units[-1][0], units[-1][1], units[-1][2] or reads)
    return tuple(Unit(k, tuple(e)) for k, e, _ in units)
