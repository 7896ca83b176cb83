"""whalex: Whale's replicate/split annotations and planner for JAX."""
from whalex.distributed import maybe_initialize as _join

_join(strict=False)     # under `python -m whalex.launch`: join the process group before devices are touched
from whalex import moe as moe, ops as ops  # public submodules: wh.moe, wh.ops
from whalex.api import Step, parallelize, plan
from whalex.checkpoint import CheckpointManager
from whalex.errors import ClusterError, ConfigError, PlanError, ScopeError, WhalexError
from whalex.mesh.cluster import Cluster
from whalex.mesh.specs import SPECS, DeviceSpec
from whalex.mesh.virtual import VirtualDevice
from whalex.plan import Plan, TaskGraphInfo
from whalex.primitives import Config, Strategy, init, replicate, set_default_strategy, split
from whalex.state import TrainState

__version__ = "0.1.0"

__all__ = [
    "CheckpointManager", "Cluster", "ClusterError", "Config", "ConfigError", "DeviceSpec", "Plan", "PlanError", "SPECS",
    "ScopeError", "Step", "Strategy", "TaskGraphInfo", "TrainState", "VirtualDevice", "WhalexError",
    "init", "parallelize", "plan", "replicate", "set_default_strategy", "split",
]
