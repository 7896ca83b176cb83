"""Names of the calls whalex recognises in a captured jaxpr (written by `whalex.moe`, read by the
sharding patterns): MoE experts calls are `whalex_moe_experts__<activation>`."""
from __future__ import annotations

EXPERTS_NAME = "whalex_moe_experts"
EXPERT_ACTIVATIONS = ("relu", "gelu", "silu", "tanh")


def call_name(activation: str) -> str:
    return f"{EXPERTS_NAME}__{activation}"


def parse_call_name(name: str) -> str | None:
    """The activation of an experts call, or None if `name` is not one."""
    prefix = EXPERTS_NAME + "__"
    return name[len(prefix):] if name.startswith(prefix) and name[len(prefix):] in EXPERT_ACTIVATIONS else None
