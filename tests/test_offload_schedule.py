"""`offload="opt_state"` keeps the optimizer state off the device through the backward pass.

The step reads each offloaded leaf only through an `optimization_barrier` shared with the gradient it
updates (or with every gradient), so XLA cannot move it to the device before the backward pass has
made that gradient. What the step does is read from its StableHLO; that it trains exactly as one
device is tests/test_offload.py's."""
import re

import optax
import pytest

import whalex as wh
from test_gpt import loss_fn, problem


def _uses(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if re.search(rf"{re.escape(name)}\b", line) and "func.func" not in line]


@pytest.mark.parametrize("optimizer", [optax.adam(1e-3), optax.sgd(0.1, momentum=0.9)], ids=["adam", "momentum"])
def test_offloaded_state_moves_to_the_device_only_after_its_gradient(optimizer):
    params, batch = problem()
    text = wh.plan(loss_fn, params, batch, optimizer, config=wh.Config(offload="opt_state")).lower()
    header = text[text.index("func.func public @main"):].split("{\n", 1)[0]
    host_args = re.findall(r"(%arg\d+): tensor<[^>]*>\s*\{[^}]*memory_kind = \"pinned_host\"", header)
    assert host_args, "the optimizer state should be stored in pinned_host memory"
    for arg in host_args:
        first = _uses(text, arg)[0]
        assert "optimization_barrier" in first, (arg, first)
        operands = first.split("optimization_barrier", 1)[1].split(":")[0]
        assert operands.count("%") >= 2, (arg, first)          # the state leaf and the gradient(s) it waits for
    # the gradients' barrier comes after the loss: every barrier reads values the backward pass made
    first_barrier = text.index("optimization_barrier")
    assert text.index("dot_general") < first_barrier


def test_without_offload_there_is_no_barrier():
    params, batch = problem()
    text = wh.plan(loss_fn, params, batch, optax.adam(1e-3)).lower()
    assert "optimization_barrier" not in text and "pinned_host" not in text
