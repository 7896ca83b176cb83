"""A program's training step compiled by XLA as `wh.parallelize` runs it (the state donated): on the
devices it was built for, or, for a step built over an `AbstractMesh`, for a deviceless topology's
devices in that mesh's order (`Cluster.compile_devices`), through their compile-only client."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from whalex import _compat as C

if TYPE_CHECKING:
    from whalex.records.program import ProgramStep


def lower_step(step: ProgramStep, platform: str):
    """The `jax.stages.Lowered` step as `wh.parallelize` runs it, the state donated."""
    return step.jitted(donate=True).trace(*step.abstract_args()).lower(lowering_platforms=(platform,))


def compile_step(step: ProgramStep, platform: str, devices: Sequence[Any] | None = None) -> tuple[Any, str]:
    """(XLA's memory analysis, the scheduled HLO text) of the donated step; `devices`: the topology
    devices an abstract step compiles for."""
    lowered = lower_step(step, platform)
    if devices is None:
        compiled = lowered.compile()
        return compiled.memory_analysis(), compiled.as_text()
    return C.compile_for_topology(lowered, devices)
