"""Split dimensions that the device count does not divide, stored padded (Whale section 3.2.2 on
any shape): the parameter is kept as `devices * ceil(size / devices)` along the split dimension,
zeros at the end, which is exactly how XLA lays out an unevenly sharded dimension. The step slices
the stored array back to `size` before the model reads it, so the model computes on its own
shapes and the padding is never read; slicing moves nothing between devices, and the gradient of
the slice is the padded gradient, zero on the padding, so every optax update leaves it at zero."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class EvenPadding:
    """One padded dimension: `size` real entries over `devices` blocks of `width`."""

    size: int
    devices: int

    @property
    def width(self) -> int:
        return -(-self.size // self.devices)

    @property
    def counts(self) -> tuple[int, ...]:
        """Real entries per device block (the last blocks hold the shortfall)."""
        w = self.width
        return tuple(min(w, max(0, self.size - i * w)) for i in range(self.devices))

    def pad(self, x, axis: int):
        """The caller's array -> the stored one (zeros appended along `axis`)."""
        x = jnp.asarray(x)
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, self.devices * self.width - self.size)
        return jnp.pad(x, widths)

    def unpad(self, x, axis: int):
        """The stored array -> the model's shape (a slice: no data moves between devices)."""
        return jax.lax.slice_in_dim(x, 0, self.size, axis=axis)
