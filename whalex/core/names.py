"""Names of the calls whalex recognises in a captured jaxpr (written by `whalex.moe` and
`whalex.ops`, read by the planner): MoE experts calls are `whalex_moe_experts__<activation>`,
dense MLPs `whalex_mlp__<activation>`."""
from __future__ import annotations

EXPERTS_NAME = "whalex_moe_experts"
EXPERT_ACTIVATIONS = ("relu", "gelu", "silu", "tanh")


def call_name(activation: str) -> str:
    return f"{EXPERTS_NAME}__{activation}"


def parse_call_name(name: str) -> str | None:
    """The activation of an experts call, or None if `name` is not one."""
    prefix = EXPERTS_NAME + "__"
    return name[len(prefix):] if name.startswith(prefix) and name[len(prefix):] in EXPERT_ACTIVATIONS else None


MLP_NAME = "whalex_mlp"


def mlp_call_name(activation: str) -> str:
    return f"{MLP_NAME}__{activation}"


def parse_mlp_name(name: str) -> str | None:
    """The activation of a `wh.ops.mlp` call, or None if `name` is not one."""
    prefix = MLP_NAME + "__"
    return name[len(prefix):] if name.startswith(prefix) and name[len(prefix):] in EXPERT_ACTIVATIONS else None


ATTENTION_NAME = "whalex_attention"


def attention_call_name(causal: bool) -> str:
    return f"{ATTENTION_NAME}__{'causal' if causal else 'full'}"


def parse_attention_name(name: str) -> bool | None:
    """Whether a `wh.ops.attention` call is causal, or None if `name` is not one."""
    prefix = ATTENTION_NAME + "__"
    rest = name[len(prefix):] if name.startswith(prefix) else None
    return {"causal": True, "full": False}.get(rest) if rest is not None else None
