"""Issue 27: remat per layer without annotations. The layers of an un-annotated model are found in
the captured program (module paths that repeat), remat applies per layer, and training is exact."""
import optax
import pytest

import whalex as wh
from conftest import adam, assert_matches
from test_gpt import LAYERS, loss_fn, problem
from whalex.core.capture import capture
from whalex.memory.layers import find_layers


def test_layers_are_the_repeated_blocks_not_their_sublayers():
    params, batch = problem()
    layers = find_layers(capture(loss_fn, params, batch))
    blocks = [n for n in layers.names if n.startswith("GPT/Block_")]
    assert blocks == [f"GPT/Block_{i}" for i in range(LAYERS)]       # whole blocks, once each
    assert layers.depth == 2 and list(layers.starts) == sorted(set(layers.starts))
    assert layers.names[0] == "GPT/Embed_0" and layers.names[-1] == "GPT/Dense_0"


@pytest.mark.parametrize("optimizer", [optax.sgd(0.5), adam()], ids=["sgd", "adam"])
def test_remat_full_per_layer_trains_as_one_device(optimizer):
    params, batch = problem()
    step, _ = assert_matches(loss_fn, params, batch, steps=3, optimizer=optimizer, tol=1e-4,
                             config=wh.Config(remat="full"))
    text = step.plan.summary()
    assert "per layer" in text and "GPT/Block_0" in text
