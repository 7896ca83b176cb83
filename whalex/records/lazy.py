"""`Lazy`: a value a record carries without paying for it until it is read.

A Plan's predicted peak is one trace of the step and the couplings of a whole-batch loss one more
capture: planning should not pay for either unless a view or a caller asks. `Lazy` holds the
function of none that finds the value and runs it once, on the first read of `value`.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, eq=False)
class Lazy(Generic[T]):
    """A value found by `find` (a function of none) on the first read of `value`, then kept."""

    find: Callable[[], T] = dataclasses.field(repr=False)

    @functools.cached_property
    def value(self) -> T:
        return self.find()

    def get(self) -> T:
        """`value`, as a function of none (for records that take one)."""
        return self.value

    @classmethod
    def of(cls, value: T) -> Lazy[T]:
        """A value already known."""
        return cls(functools.partial(_same, value))


def _same(value):
    return value
