"""User-facing annotations: they record intent and never change what a model computes."""
from whalex.primitives.config import Config, init
from whalex.primitives.scopes import Strategy, replicate, set_default_strategy, split

__all__ = ["Config", "init", "Strategy", "replicate", "split", "set_default_strategy"]
