"""The split head is really sharded and its gradient is never all-reduced (read from HLO)."""
import optax

import whalex as wh
from conftest import adam
from support.hlo import shapes_of
from support.models import CLASSES, D_HID, B, flax_model, plain_model


def _compiled_text(loss_fn, params, batch, **kw):
    step = wh.parallelize(loss_fn, adam(), **kw)
    state = step.init(params, batch)
    text = step.plan.lowered().compile().as_text()
    return step, state, text


def test_split_head_weight_is_sharded_and_its_gradient_not_all_reduced():
    loss_fn, params, batch = flax_model("hybrid", "class")
    step, state, text = _compiled_text(loss_fn, params, batch)
    kernel = state.params["HD_0"]["Dense_0"]["kernel"]
    assert kernel.shape == (D_HID, CLASSES)
    shard_shapes = {s.data.shape for s in kernel.addressable_shards}
    assert shard_shapes == {(D_HID, CLASSES // 8)}, shard_shapes      # 1/8 of the buffer on each device
    assert len(kernel.addressable_shards) == 8
    # the optimizer state of the head is sharded the same way
    mu = state.opt_state[0].mu["HD_0"]["Dense_0"]["kernel"]
    assert {s.data.shape for s in mu.addressable_shards} == {(D_HID, CLASSES // 8)}

    reduced = shapes_of(text, "all-reduce")
    assert reduced, "the replicated backbone's gradients must be all-reduced"
    assert tuple(sorted((D_HID, D_HID))) in reduced                                    # backbone kernel gradient synced
    for forbidden in [(D_HID, CLASSES), (D_HID, CLASSES // 8), (CLASSES,), (CLASSES // 8,)]:
        forbidden = tuple(sorted(forbidden))
        assert forbidden not in reduced, f"split head gradient {forbidden} is all-reduced"
    # softmax cross-entropy over the split class dim never gathers the logits
    gathered = shapes_of(text, "all-gather") + shapes_of(text, "all-to-all")
    assert tuple(sorted((B, CLASSES))) not in gathered and tuple(sorted((B // 8, CLASSES))) not in gathered


def test_pure_data_parallel_all_reduces_the_head_gradient():
    """The control for the test above: under replicate the same head gradient IS all-reduced."""
    loss_fn, params, batch = flax_model("dp", "class")
    _, _, text = _compiled_text(loss_fn, params, batch)
    reduced = shapes_of(text, "all-reduce")
    assert tuple(sorted((D_HID, CLASSES))) in reduced


def test_argmax_over_split_classes_does_not_gather_logits():
    import jax.numpy as jnp
    base, params, batch = plain_model("hybrid", "ctx")

    def loss_fn(p, b):
        with wh.replicate(8):
            h = jnp.tanh(jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"])
        with wh.split(8):
            logits = h @ p["wh"] + p["bh"]
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()
            acc = (jnp.argmax(logits, -1) == b["y"]).mean()
        return loss, {"accuracy": acc}

    step = wh.parallelize(loss_fn, adam(), has_aux=True)
    state = step.init(params, batch)
    state, metrics = step(state, batch)
    ref_logits = jnp.tanh(jnp.tanh(batch["x"] @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]) \
        @ params["wh"] + params["bh"]
    assert float(metrics["aux"]["accuracy"]) == float((jnp.argmax(ref_logits, -1) == batch["y"]).mean())
    text = step.plan.lowered().compile().as_text()
    gathered = shapes_of(text, "all-gather") + shapes_of(text, "all-to-all")
    assert tuple(sorted((B, CLASSES))) not in gathered and tuple(sorted((B // 8, CLASSES))) not in gathered
