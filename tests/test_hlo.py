"""The split head is really sharded and its gradient is never all-reduced (read from HLO)."""
import optax
import pytest

import whalex as wh
from conftest import adam
from hlo import collectives, shapes_of
from models import CLASSES, D_HID, B, flax_model, plain_model


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


_TEXT = """HloModule jit_step, entry_computation_layout={(f32[8,16]{1,0})->f32[64,16]{1,0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%body (c: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %c = (s32[], f32[8,16]{1,0}) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element((s32[], f32[8,16]{1,0}) %c), index=1
  %ar.1 = f32[8,16]{1,0} all-reduce(f32[8,16]{1,0} %x), replica_groups=mesh['data'=2,'model'=4] {'model'}, to_apply=%add
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(s32[] %i, f32[8,16]{1,0} %ar.1)
}

ENTRY %main.9 (p: f32[8,16]) -> f32[64,16] {
  %p = f32[8,16]{1,0} parameter(0)
  %ar = f32[8,16]{1,0} all-reduce(f32[8,16]{1,0} %p), replica_groups=[2,4]<=[8], to_apply=%add, metadata={op_name="jit(step)/psum"}
  %w = (s32[], f32[8,16]{1,0}) while((s32[], f32[8,16]{1,0}) %init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %cp = bf16[8,16]{1,0} collective-permute(bf16[8,16]{1,0} %h), source_target_pairs={{0,1},{1,0}}
  %ags = (f32[8,16]{1,0}, f32[64,16]{1,0}) all-gather-start(f32[8,16]{1,0} %ar), replica_groups={}, dimensions={0}
  ROOT %agd = f32[64,16]{1,0} all-gather-done((f32[8,16]{1,0}, f32[64,16]{1,0}) %ags), metadata={op_name="jit(step)/all_gather"}
}
"""


def test_the_parser_reads_groups_async_pairs_and_loops():
    """whalex.jaxpr.hlo on text in the forms XLA prints (CPU compiles no async collectives: this covers them)."""
    from whalex.jaxpr import hlo

    found = hlo.collectives(_TEXT)
    assert [(c.kind, c.is_async, c.group) for c in found] == [
        ("all-reduce", False, 4), ("all-reduce", False, 4), ("collective-permute", False, 2),
        ("all-gather", True, None)]
    assert found[-1].arrays == (("f32", (64, 16)),) and found[-1].bytes == 64 * 16 * 4      # the -done's result
    assert found[1].op_name == "jit(step)/psum" and found[2].bytes == 8 * 16 * 2
    assert shapes_of(_TEXT, "all-gather") == [(16, 64)]
    assert collectives(_TEXT)[0] == ("all-reduce", [("f32", (8, 16))])                     # tests/hlo.py's form
    comps, entry = hlo.computations(_TEXT)
    assert entry == "main.9" and set(comps) == {"add", "body", "main.9"} and len(comps["body"]) == 4
    assert [hlo.trip_count(line) for line in comps["main.9"] if " while(" in line] == [4]
    assert hlo.count(_TEXT, "all-reduce") == 2 and hlo.count(_TEXT, "all-gather-start") == 1


_BRANCHED = """HloModule jit_tick

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%small (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %ar.s = f32[8]{0} all-reduce(f32[8]{0} %x), replica_groups={{0,1}}, to_apply=%add
}

%big (y: f32[64]) -> f32[64] {
  %y = f32[64]{0} parameter(0)
  ROOT %ar.b = f32[64]{0} all-reduce(f32[64]{0} %y), replica_groups={{0,1}}, to_apply=%add
}

%body (c: (s32[], f32[64])) -> (s32[], f32[64]) {
  %c = (s32[], f32[64]{0}) parameter(0)
  %k = s32[] get-tuple-element((s32[], f32[64]{0}) %c), index=0
  %sw = f32[64]{0} conditional(s32[] %k, f32[8]{0} %u, f32[64]{0} %v), branch_computations={%small, %big}
  ROOT %t = (s32[], f32[64]{0}) tuple(s32[] %k, f32[64]{0} %sw)
}

ENTRY %main (p: f32[64]) -> f32[64] {
  %p = f32[64]{0} parameter(0)
  %once = f32[64]{0} all-reduce(f32[64]{0} %p), replica_groups={{0,1}}, to_apply=%add
  ROOT %w = (s32[], f32[64]{0}) while((s32[], f32[64]{0}) %init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_looped_collectives_count_trips_and_every_branch_or_the_largest():
    """A pipeline tick's switch: every branch counts, or (the most one step runs) only the heaviest."""
    from whalex.jaxpr import hlo

    every = [(c.bytes, trips) for c, trips in hlo.looped_collectives(_BRANCHED)]
    assert sorted(every) == [(32, 3), (256, 1), (256, 3)]
    largest = [(c.bytes, trips) for c, trips in hlo.looped_collectives(_BRANCHED, largest_branch=lambda c: c.bytes)]
    assert sorted(largest) == [(256, 1), (256, 3)]
    smallest = hlo.looped_collectives(_BRANCHED, largest_branch=lambda c: -c.bytes)
    assert sorted((c.bytes, t) for c, t in smallest) == [(32, 3), (256, 1)]


_PREDICATED = _BRANCHED.replace(
    "%sw = f32[64]{0} conditional(s32[] %k, f32[8]{0} %u, f32[64]{0} %v), branch_computations={%small, %big}",
    "%sw = f32[64]{0} conditional(pred[] %k, f32[64]{0} %v, f32[8]{0} %u), true_computation=%big, "
    "false_computation=%small")


def test_a_predicated_conditional_is_two_branches_and_a_tick_weighs_them_by_the_schedule():
    """XLA:GPU prints a two-way cond as true/false computations: branches, not two calls. A pipeline's
    tick runs its forward arm (false) on some trips and its backward arm (true) on others."""
    from whalex.jaxpr import hlo

    largest = hlo.looped_collectives(_PREDICATED, largest_branch=lambda c: c.bytes)
    assert sorted((c.bytes, t) for c, t in largest) == [(256, 1), (256, 3)]
    ticks = hlo.looped_collectives(_PREDICATED, largest_branch=lambda c: c.bytes, tick_arms=(2 / 3, 1 / 3))
    assert sorted((c.bytes, round(t, 6)) for c, t in ticks) == [(32, 2.0), (256, 1), (256, 1.0)]
    step = hlo.step_collectives(_PREDICATED, 2, tick_arms=(2 / 3, 1 / 3))
    ring = 2 * (1 / 2)                       # an all-reduce over 2 devices sends its buffer once
    assert step.ring_bytes == pytest.approx(ring * (256 + 2 * 32 + 256))
    assert step.count == 3 and step.asynchronous == 0


_SCHEDULED = """HloModule jit_step, is_scheduled=true

ENTRY %main (p: f32[64]) -> f32[64] {
  %p = f32[64]{0} parameter(0)
  %ar-start = (f32[64]{0}, f32[64]{0}) all-reduce-start(f32[64]{0} %p), replica_groups={{0,1}}, to_apply=%add
  %gemm_fusion_dot.1 = f32[64]{0} fusion(f32[64]{0} %p), kind=kCustom, calls=%g
  %loop_add_fusion = f32[64]{0} fusion(f32[64]{0} %gemm_fusion_dot.1), kind=kLoop, calls=%a
  %ar-done = f32[64]{0} all-reduce-done((f32[64]{0}, f32[64]{0}) %ar-start)
  %ag-start = (f32[8]{0}, f32[64]{0}) all-gather-start(f32[8]{0} %x), replica_groups={}, dimensions={0}
  %ag-done = f32[64]{0} all-gather-done((f32[8]{0}, f32[64]{0}) %ag-start)
  ROOT %r = f32[64]{0} add(f32[64]{0} %ar-done, f32[64]{0} %ag-done)
}
"""


def test_async_overlaps_count_the_compute_between_start_and_done():
    from whalex.jaxpr import hlo

    found = hlo.async_overlaps(_SCHEDULED)
    assert [(o.kind, o.overlapped_ops, o.overlapped_matmuls) for o in found] == [("all-reduce", 2, 1),
                                                                                ("all-gather", 0, 0)]
    step = hlo.step_collectives(_SCHEDULED, 2)
    assert (step.count, step.asynchronous, step.overlapped, step.overlapping_matmuls) == (2, 2, 1, 1)
