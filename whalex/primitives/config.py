"""`Config` (keyword or Whale/EPL dotted keys) and `init`, which sets process-wide defaults.

The defaults live in one small `Defaults` record; only the public entry points
(`wh.parallelize`, `wh.plan`) read it, once, when they are called.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax

from whalex.errors import ConfigError

SCHEDULES = ("1f1b", "gpipe", "1f1b-balanced", "interleaved", "zb-h1", "zb-h2")
MATMUL_PATTERNS = ("auto", "column", "row")
BATCH_COUPLINGS = ("exact", "per_part")

# Whale/EPL dotted keys -> Config field.
_DOTTED = {
    "pipeline.num_micro_batch": "num_micro_batch",
    "pipeline.strategy": "schedule",
    "pipeline.schedule": "schedule",
    "pipeline.virtual_stages": "virtual_stages",
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
    "gradient_checkpoint.budget": "memory_budget",
    "communication.gradients_dtype": "comm_dtype",
    "amp.loss_scale_period": "loss_scale_period",
    "batch.coupling": "batch_coupling",
    "cluster.colocate_split_and_replicate": "share_devices",
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
    hardware_aware: Any = True     # True, False, or "refine": time the real step at splits around the prediction
    zero_level: int = 0
    remat: Any = None
    amp: Any = None
    offload: Any = None
    matmul_pattern: str = "auto"
    memory_budget: Any = None      # bytes per device for remat="auto" (None: the device's memory)
    comm_dtype: Any = None         # gradient all-reduce dtype: None (param dtype), "bf16", "fp16"
    loss_scale_period: int = 2000  # amp="fp16": steps without overflow before the scale doubles
    batch_coupling: str = "exact"  # "per_part": batch statistics inside the model (BatchNorm) per part
    share_devices: bool = False    # annotated TaskGraphs share devices: micro-batches accumulate, no pipeline
    virtual_stages: int = 1        # schedule="interleaved": model chunks per pipeline stage (device)

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

    def replace(self, **kwargs: Any) -> Config:
        """A copy with some fields changed (validated again)."""
        current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        current.update(kwargs)
        return Config(**current)

    def _validate(self) -> None:
        _positive_int("num_micro_batch", self.num_micro_batch)
        _positive_int("num_task_graph", self.num_task_graph)
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown pipeline schedule {self.schedule!r}; use one of {SCHEDULES}.")
        _validate_virtual_stages(self)
        if self.matmul_pattern not in MATMUL_PATTERNS:
            raise ConfigError(
                f"unknown matmul_pattern {self.matmul_pattern!r}; use one of {MATMUL_PATTERNS}.")
        if self.zero_level not in (0, 1, 2, 3):
            raise ConfigError(f"zero_level must be 0, 1, 2 or 3, got {self.zero_level!r}.")
        if self.batch_coupling not in BATCH_COUPLINGS:
            raise ConfigError(f"unknown batch_coupling {self.batch_coupling!r}; use 'exact' (statistics over the "
                              "global batch, refused where a plan cannot) or 'per_part' (statistics per part).")
        if not (isinstance(self.hardware_aware, bool) or (isinstance(self.hardware_aware, str)
                                                           and self.hardware_aware == "refine")):
            raise ConfigError(f"hardware_aware must be True (balance by the cost model), False (the even plan) or "
                              f"'refine' (balance, then time the real step at splits around the prediction during "
                              f"the first steps and keep the fastest), got {self.hardware_aware!r}.")
        for name in ("auto_parallel", "share_devices"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if self.num_task_graph != 1 and not self.auto_parallel:
            raise ConfigError(
                f"num_task_graph={self.num_task_graph} only applies with auto_parallel=True (it is the number of "
                "TaskGraphs auto_parallel cuts an un-annotated model into) and would be ignored; pass "
                f"Config(auto_parallel=True, num_task_graph={self.num_task_graph}), or leave num_task_graph at 1 "
                "and annotate the stages with wh.replicate/wh.split scopes.")
        if self.share_devices and self.auto_parallel:
            raise ConfigError(
                "share_devices=True collocates annotated TaskGraphs (micro-batches accumulate gradients), but "
                "auto_parallel=True cuts the model into pipeline stages on disjoint devices; choose one of them.")
        _validate_memory_options(self)


REMAT_MODES = ("full", "auto")          # or the name of a policy in jax.checkpoint_policies
AMP_MODES = ("bf16", "fp16")
COMM_DTYPES = ("bf16", "fp16")
OFFLOAD_TARGETS = ("opt_state", "params", "activations")


def _validate_memory_options(cfg: Config) -> None:
    """Memory options: ZeRO level, remat, amp, gradient communication dtype, offload."""
    if cfg.remat is not None and cfg.remat not in REMAT_MODES and not (
            isinstance(cfg.remat, str) and hasattr(jax.checkpoint_policies, cfg.remat)):
        names = [n for n in dir(jax.checkpoint_policies) if not n.startswith("_")]
        raise ConfigError(f"unknown remat {cfg.remat!r}; use 'full', 'auto' or a policy name from "
                          f"jax.checkpoint_policies: {', '.join(names)}.")
    if cfg.memory_budget is not None and (isinstance(cfg.memory_budget, bool) or
                                          not isinstance(cfg.memory_budget, (int, float)) or cfg.memory_budget <= 0):
        raise ConfigError(f"memory_budget must be a positive number of bytes per device, got {cfg.memory_budget!r}.")
    if cfg.amp is not None and cfg.amp not in AMP_MODES:
        raise ConfigError(f"unknown amp {cfg.amp!r}; use one of {AMP_MODES} or None.")
    if cfg.comm_dtype is not None and cfg.comm_dtype not in COMM_DTYPES:
        raise ConfigError(f"unknown comm_dtype {cfg.comm_dtype!r}; use one of {COMM_DTYPES} or None.")
    _positive_int("loss_scale_period", cfg.loss_scale_period)
    if cfg.memory_budget is not None and cfg.remat != "auto":
        raise ConfigError(
            f"memory_budget={cfg.memory_budget!r} only applies with remat='auto' (the budget it fits the step into) "
            f"and would be ignored with remat={cfg.remat!r}; pass Config(remat='auto', memory_budget=...), or drop "
            "memory_budget.")
    if cfg.loss_scale_period != Config.loss_scale_period and cfg.amp != "fp16":
        raise ConfigError(
            f"loss_scale_period={cfg.loss_scale_period} only applies with amp='fp16' (dynamic loss scaling) and would "
            f"be ignored with amp={cfg.amp!r}; pass Config(amp='fp16', loss_scale_period=...), or drop "
            "loss_scale_period.")
    if cfg.offload is not None:
        targets = (cfg.offload,) if isinstance(cfg.offload, str) else tuple(cfg.offload)
        bad = [t for t in targets if t not in OFFLOAD_TARGETS]
        if bad or not targets:
            raise ConfigError(f"unknown offload target(s) {bad or cfg.offload!r}; use one or more of "
                              f"{OFFLOAD_TARGETS}, e.g. offload='opt_state' or offload=('opt_state', 'params').")
        object.__setattr__(cfg, "offload", targets)


def _field_for(key: str, fields: Mapping[str, Any]) -> str:
    if key in fields:
        return key
    if key in _DOTTED:
        return _DOTTED[key]
    known = sorted(set(fields) | set(_DOTTED))
    raise ConfigError(f"unknown config key {key!r}; known keys are: {', '.join(known)}.")


def _validate_virtual_stages(cfg: Config) -> None:
    """virtual_stages V > 1 is interleaved 1F1B's chunks per stage: only with schedule='interleaved',
    which needs it, on an auto_parallel pipeline (the planner cuts the model into stages x V chunks)."""
    _positive_int("virtual_stages", cfg.virtual_stages)
    V = cfg.virtual_stages
    if V > 1 and cfg.schedule != "interleaved":
        raise ConfigError(
            f"virtual_stages={V} (model chunks per pipeline stage) only applies with schedule='interleaved' and "
            f"would be ignored with schedule={cfg.schedule!r}; pass Config(schedule='interleaved', "
            f"virtual_stages={V}), or leave virtual_stages at 1.")
    if cfg.schedule == "interleaved" and V < 2:
        raise ConfigError(
            "schedule='interleaved' cuts each pipeline stage into virtual_stages >= 2 model chunks, but "
            f"virtual_stages={V}; pass Config(schedule='interleaved', virtual_stages=2), or use schedule='1f1b'.")
    if cfg.schedule == "interleaved" and not cfg.auto_parallel:
        raise ConfigError(
            "schedule='interleaved' needs auto_parallel=True: the planner cuts the model into num_task_graph x "
            f"virtual_stages={V} chunks (annotated stages are one chunk each); pass Config(auto_parallel=True, "
            "num_task_graph=..., schedule='interleaved', virtual_stages=...), or use schedule='1f1b'.")


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
