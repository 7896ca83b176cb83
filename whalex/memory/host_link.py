"""What offload moves over the host link in one training step, per device, and the least time that
takes at the device kind's host bandwidth (`DeviceSpec.host_bandwidth`, each way).

Offloaded state crosses twice a step: to the device for the step (parameters) or the update
(optimizer state), back to the host once updated; parameters fetched per layer come to the device
up to three times (the layer's forward, its backward, the update). Offloaded activations go to the host in the
forward pass and come back in the backward. The link carries both directions at once, so the
least time is the larger direction over the bandwidth; how much of it the step hides behind
compute is the schedule's business (`whalex.memory.offload`), not this figure's.
"""
from __future__ import annotations

import dataclasses

from whalex.memory import OFFLOADED
from whalex.memory.accounting import DeviceMemory
from whalex.mesh.specs import DeviceSpec


@dataclasses.dataclass(frozen=True)
class HostTransfer:
    """One offloaded component's bytes per step and device, each way."""

    what: str
    to_device: float
    to_host: float


@dataclasses.dataclass(frozen=True)
class HostTraffic:
    """A device's host-link traffic per step and what its link carries each way per second."""

    transfers: tuple[HostTransfer, ...]
    device_kind: str
    bandwidth: float         # bytes/s each way; 0: unknown

    @property
    def to_device(self) -> float:
        return sum(t.to_device for t in self.transfers)

    @property
    def to_host(self) -> float:
        return sum(t.to_host for t in self.transfers)

    @property
    def seconds(self) -> float | None:
        """The least time the transfers take (both directions at once); None at an unknown bandwidth."""
        return max(self.to_device, self.to_host) / self.bandwidth if self.bandwidth else None


def host_traffic(memory: DeviceMemory, spec: DeviceSpec, offloaded_activations: float = 0.0,
                 param_fetches: int = 1) -> HostTraffic | None:
    """The host-link traffic of one device whose state is accounted in `memory` (its offloaded shares)
    and whose offloaded activations are `offloaded_activations` bytes a step; None when nothing moves.
    `param_fetches`: how many times a step moves the offloaded parameters to the device (3 per layer)."""
    transfers = [HostTransfer(s.component, s.before * (param_fetches if s.component == "params" else 1), s.before)
                 for s in memory.shares if s.by == OFFLOADED]
    if offloaded_activations > 0:
        transfers.append(HostTransfer("activations", offloaded_activations, offloaded_activations))
    if not transfers:
        return None
    return HostTraffic(tuple(transfers), spec.name, float(spec.host_bandwidth))
