"""`Config` (keyword or Whale/EPL dotted keys) and `init`, which sets process-wide defaults.

The defaults live in one small `Defaults` record; only the public entry points
(`wh.parallelize`, `wh.plan`) read it, once, when they are called.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from whalex.errors import ConfigError

SCHEDULES = ("1f1b", "gpipe")
MATMUL_PATTERNS = ("auto", "column", "row")

# Whale/EPL dotted keys -> Config field.
_DOTTED = {
    "pipeline.num_micro_batch": "num_micro_batch",
    "pipeline.strategy": "schedule",
    "pipeline.schedule": "schedule",
    "auto.auto_parallel": "auto_parallel",
    "auto_parallel": "auto_parallel",
    "num_task_graph": "num_task_graph",
    "pipeline.num_stages": "num_task_graph",
    "cluster.hardware_aware": "hardware_aware",
    "zero.level": "zero_level",
    "gradient_checkpoint.type": "remat",
    "amp.level": "amp",
    "offload.level": "offload",
    "split.matmul_pattern": "matmul_pattern",
}


@dataclasses.dataclass(frozen=True, init=False)
class Config:
    """Training-plan options. `Config(num_micro_batch=8)` or `Config({"pipeline.num_micro_batch": 8})`.

    An unknown key is an error, never ignored.
    """

    num_micro_batch: int = 1
    num_task_graph: int = 1
    auto_parallel: bool = False
    schedule: str = "1f1b"
    hardware_aware: bool = True
    zero_level: int = 0
    remat: Any = None
    amp: Any = None
    offload: Any = None
    matmul_pattern: str = "auto"

    def __init__(self, options: Mapping[str, Any] | None = None, /, **kwargs: Any):
        fields = {f.name: f.default for f in dataclasses.fields(Config)}
        merged: dict[str, Any] = {}
        if options is not None:
            if not isinstance(options, Mapping):
                raise ConfigError(
                    f"Config takes a dict of options or keyword arguments, got {type(options).__name__}; "
                    "write wh.Config({'pipeline.num_micro_batch': 8}) or wh.Config(num_micro_batch=8).")
            for key, value in options.items():
                merged[_field_for(key, fields)] = value
        for key, value in kwargs.items():
            merged[_field_for(key, fields)] = value
        for name, default in fields.items():
            object.__setattr__(self, name, merged.get(name, default))
        self._validate()

    def replace(self, **kwargs: Any) -> "Config":
        """A copy with some fields changed (validated again)."""
        current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        current.update(kwargs)
        return Config(**current)

    def _validate(self) -> None:
        _positive_int("num_micro_batch", self.num_micro_batch)
        _positive_int("num_task_graph", self.num_task_graph)
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown pipeline schedule {self.schedule!r}; use one of {SCHEDULES}.")
        if self.matmul_pattern not in MATMUL_PATTERNS:
            raise ConfigError(
                f"unknown matmul_pattern {self.matmul_pattern!r}; use one of {MATMUL_PATTERNS}.")
        if self.zero_level not in (0, 1, 2, 3):
            raise ConfigError(f"zero_level must be 0, 1, 2 or 3, got {self.zero_level!r}.")
        for name in ("auto_parallel", "hardware_aware"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        for name in ("remat", "amp", "offload"):
            if getattr(self, name) is not None:
                raise ConfigError(
                    f"Config.{name}={getattr(self, name)!r} is not supported by this version of whalex "
                    f"(memory optimizations are tracked in issue 6); leave {name}=None.")
        if self.zero_level:
            raise ConfigError(
                "Config.zero_level > 0 is not supported by this version of whalex (tracked in issue 6); "
                "use zero_level=0.")


def _field_for(key: str, fields: Mapping[str, Any]) -> str:
    if key in fields:
        return key
    if key in _DOTTED:
        return _DOTTED[key]
    known = sorted(set(fields) | set(_DOTTED))
    raise ConfigError(f"unknown config key {key!r}; known keys are: {', '.join(known)}.")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}.")


@dataclasses.dataclass
class Defaults:
    """Process-wide defaults set by `wh.init` and `wh.set_default_strategy` outside a trace."""

    config: Config | None = None
    cluster: Any = None
    strategy: Any = None


DEFAULTS = Defaults()


def init(config: Config | Mapping[str, Any] | None = None, cluster: Any = None) -> None:
    """Set the default Config and Cluster used when `parallelize`/`plan` are not given one."""
    if config is not None and not isinstance(config, Config):
        config = Config(config)
    DEFAULTS.config = config
    DEFAULTS.cluster = cluster
