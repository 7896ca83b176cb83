"""`replicate` and `split`: record user intent as named scopes, nothing more.

Each entry into a primitive opens `jax.named_scope("whalex.<kind>.<n>.<uid>[.<pattern>]")`.
JAX keeps that name on every equation traced inside it (forward and backward), which is how
capture groups equations into TaskGraphs. Outside a whalex transformation the scope is inert,
so an annotated model runs unchanged under plain `jax.jit` or `model.apply`.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import itertools
from typing import Any

import jax

from whalex import _compat as C
from whalex.errors import ScopeError
from whalex.primitives.config import DEFAULTS, MATMUL_PATTERNS

PREFIX = "whalex"
KINDS = ("replicate", "split")

_active: contextvars.ContextVar[tuple[Strategy, ...]] = contextvars.ContextVar("whalex_active", default=())
_uids = itertools.count()


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A parallel strategy: `kind` is "replicate" or "split"; `device_count` None means all devices."""

    kind: str
    device_count: int | None = None
    pattern: str = "auto"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ScopeError(f"unknown strategy kind {self.kind!r}; use wh.replicate or wh.split.")
        n = self.device_count
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ScopeError(
                f"wh.{self.kind}(device_count={n!r}): device_count must be a positive integer or None "
                "(None uses every device).")
        if self.pattern not in MATMUL_PATTERNS:
            raise ScopeError(f"wh.{self.kind}(pattern={self.pattern!r}): use one of {MATMUL_PATTERNS}.")
        if self.kind == "replicate" and self.pattern != "auto":
            raise ScopeError("pattern= only applies to wh.split; wh.replicate has no sharding pattern.")

    def label(self) -> str:
        n = "all" if self.device_count is None else str(self.device_count)
        return f"{self.kind}({n})" if self.pattern == "auto" else f"{self.kind}({n}, {self.pattern})"

    def scope_name(self, uid: int) -> str:
        n = "all" if self.device_count is None else str(self.device_count)
        return f"{PREFIX}.{self.kind}.{n}.{uid}.{self.pattern}"


def parse_scope(component: str) -> tuple[Strategy, int] | None:
    """The (Strategy, uid) encoded in one name-stack component, or None if it is not ours."""
    parts = component.split(".")
    if len(parts) != 5 or parts[0] != PREFIX or parts[1] not in KINDS:
        return None
    n = None if parts[2] == "all" else int(parts[2])
    return Strategy(parts[1], n, parts[4]), int(parts[3])


class Primitive:
    """A strategy usable as a context manager, a function decorator or a Flax module-class decorator."""

    def __init__(self, strategy: Strategy):
        self.strategy = strategy
        self._stack: list[contextlib.ExitStack] = []

    def __repr__(self) -> str:
        return f"wh.{self.strategy.label()}"

    def __enter__(self):
        outer = _active.get()
        if outer:
            raise ScopeError(
                f"wh.{self.strategy.label()} is nested inside wh.{outer[-1].label()}: whalex scopes may not "
                "nest or overlap. Close the outer scope first, or annotate the inner part only.")
        stack = contextlib.ExitStack()
        token = _active.set(outer + (self.strategy,))
        stack.callback(_active.reset, token)
        stack.enter_context(jax.named_scope(self.strategy.scope_name(next(_uids))))
        self._stack.append(stack)
        return self

    def __exit__(self, *exc):
        self._stack.pop().close()
        return False

    def __call__(self, target: Any) -> Any:
        if inspect.isclass(target):
            return _decorate_class(self, target)
        if callable(target):
            @functools.wraps(target)
            def wrapped(*args, **kwargs):
                with self:
                    return target(*args, **kwargs)
            return wrapped
        raise ScopeError(
            f"wh.{self.strategy.label()} decorates a function or a module class, got {type(target).__name__}.")


def _decorate_class(primitive: Primitive, cls: type) -> type:
    # Look in the class's own MRO: `getattr(cls, "__call__")` on a class without one finds the
    # metaclass's `__call__` (the constructor; for flax.nnx, PytreeMeta's) and would wrap that.
    call = next((k.__dict__["__call__"] for k in cls.__mro__ if "__call__" in k.__dict__), None)
    if call is None:
        raise ScopeError(f"wh.{primitive.strategy.label()} decorates classes with a __call__ method; "
                         f"{cls.__name__} has none.")

    @functools.wraps(call)
    def __call__(self, *args, **kwargs):
        with primitive:
            return call(self, *args, **kwargs)

    cls.__call__ = __call__
    return cls


def replicate(device_count: int | None = None) -> Primitive:
    """Data parallelism: `device_count` replicas, each taking 1/n of the (micro-)batch."""
    return Primitive(Strategy("replicate", device_count))


def split(device_count: int | None = None, *, pattern: str = "auto") -> Primitive:
    """Tensor parallelism: shard the scope's operations over `device_count` devices.

    `pattern` forces the matmul sharding pattern ("column" = SP1, "row" = SP2); "auto" picks the one
    with the least communication.
    """
    return Primitive(Strategy("split", device_count, pattern))


_default_in_trace: contextvars.ContextVar[list | None] = contextvars.ContextVar("whalex_default", default=None)


def set_default_strategy(primitive: Primitive) -> None:
    """The strategy for operations outside every scope (Whale's `wh.set_default_strategy`).

    Called while whalex captures a model, it applies to that capture; called inside model code run
    by anything else (a JAX transformation such as `jax.jit`, or a Flax module's `init`/`apply`) it
    only marks, like the scopes, and leaves the process default alone; called at top level it sets
    the process default.
    """
    if not isinstance(primitive, Primitive):
        raise ScopeError(
            f"set_default_strategy takes wh.replicate(n) or wh.split(n), got {primitive!r}.")
    record = _default_in_trace.get()
    if record is not None:
        record.append(primitive.strategy)
    elif not (C.in_jax_trace() or C.in_flax_module()):
        DEFAULTS.strategy = primitive.strategy


@contextlib.contextmanager
def recording_default():
    """Collect `set_default_strategy` calls made while a model is being captured."""
    record: list[Strategy] = []
    token = _default_in_trace.set(record)
    try:
        yield record
    finally:
        _default_in_trace.reset(token)
