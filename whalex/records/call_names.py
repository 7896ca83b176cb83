"""Names of the calls whalex recognises in a captured jaxpr (written by `whalex.moe` and
`whalex.ops`, read by the planner): MoE experts calls are `whalex_moe_experts__<activation>`,
dense MLPs `whalex_mlp__<activation>`."""
from __future__ import annotations

EXPERTS_NAME = "whalex_moe_experts"
HEAD_NAME = "whalex_softmax_cross_entropy_head"   # wh.ops.softmax_cross_entropy_head
EXPERT_ACTIVATIONS = ("relu", "gelu", "silu", "tanh")


def _after(name: str, base: str) -> str | None:
    """What follows `<base>__` in a call's name, or None when the name does not start with it."""
    prefix = base + "__"
    return name[len(prefix):] if name.startswith(prefix) else None


def _activation(name: str, base: str) -> str | None:
    """The activation named after `<base>__`, or None."""
    rest = _after(name, base)
    return rest if rest in EXPERT_ACTIVATIONS else None


def call_name(activation: str) -> str:
    return f"{EXPERTS_NAME}__{activation}"


def parse_call_name(name: str) -> str | None:
    """The activation of an experts call, or None if `name` is not one."""
    return _activation(name, EXPERTS_NAME)


MLP_NAME = "whalex_mlp"


def mlp_call_name(activation: str) -> str:
    return f"{MLP_NAME}__{activation}"


def parse_mlp_name(name: str) -> str | None:
    """The activation of a `wh.ops.mlp` call, or None if `name` is not one."""
    return _activation(name, MLP_NAME)


ATTENTION_NAME = "whalex_attention"


def attention_call_name(causal: bool) -> str:
    return f"{ATTENTION_NAME}__{'causal' if causal else 'full'}"


def parse_attention_name(name: str) -> bool | None:
    """Whether a `wh.ops.attention` call is causal, or None if `name` is not one."""
    return {"causal": True, "full": False}.get(_after(name, ATTENTION_NAME))
