"""Exception types. Every one is a ValueError, so `except ValueError` catches bad input."""


class WhalexError(ValueError):
    """Base class for whalex input errors: the message names the problem and the fix."""


class ConfigError(WhalexError):
    """An unknown or invalid configuration key or value."""


class ScopeError(WhalexError):
    """A replicate/split annotation that is nested, overlapping or malformed."""


class ClusterError(WhalexError):
    """A device kind that is not in the table, or a cluster that does not match the devices."""


class PlanError(WhalexError):
    """Annotations that the cluster cannot hold, or a batch that the plan cannot divide."""
