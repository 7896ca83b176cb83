"""Reading compiled HLO text (whalex.jaxpr.hlo, as XLA prints it): each collective with its group, an
async start/done pair as one collective, collectives in a loop counted once per trip, a conditional's
branches, and the compute between an async start and its done."""
import pytest

from support.hlo import collectives, shapes_of

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
    assert collectives(_TEXT)[0] == ("all-reduce", [("f32", (8, 16))])                     # tests/support/hlo.py's form
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


_HOST_COPIES = """\
HloModule step, is_scheduled=true

ENTRY %main (p: f32[4096,1024], g: f32[8]) -> f32[8] {
  %copy-start.2 = (f32[4096,1024]{1,0}, f32[4096,1024]{1,0:S(5)}, u32[]) copy-start(f32[4096,1024]{1,0:S(5)} %p)
  %fusion.1 = f32[8]{0} fusion(f32[8]{0} %g), kind=kLoop, calls=%f
  %copy-done.2 = f32[4096,1024]{1,0} copy-done((f32[4096,1024]{1,0}, f32[4096,1024]{1,0:S(5)}, u32[]) %copy-start.2)
  %copy-start.3 = (f32[8]{0:S(5)}, f32[8]{0}, u32[]) copy-start(f32[8]{0} %fusion.1)
  %copy-done.3 = f32[8]{0:S(5)} copy-done((f32[8]{0:S(5)}, f32[8]{0}, u32[]) %copy-start.3)
  %copy-start.5 = (s32[], s32[]{:S(5)}, u32[]) copy-start(s32[]{:S(5)} %p)
  %copy-done.5 = s32[] copy-done((s32[], s32[]{:S(5)}, u32[]) %copy-start.5)
  %copy-start.4 = (f32[8]{0}, f32[8]{0}, u32[]) copy-start(f32[8]{0} %fusion.1)
  %copy-done.4 = f32[8]{0} copy-done((f32[8]{0}, f32[8]{0}, u32[]) %copy-start.4)
  ROOT %r = f32[8]{0} add(f32[8]{0} %copy-done.3, f32[8]{0} %copy-done.4)
}
"""


def test_host_copies_are_the_copies_into_or_out_of_memory_space_5():
    """A copy's result tuple is (destination, source, context): one copy to the device with a fusion
    between its start and done, one to the host with nothing between, a scalar to the device, and a device-to-device copy,
    which is not a host transfer; a scalar's type carries no layout but its memory space."""
    from whalex.jaxpr import hlo

    found = hlo.host_copies(_HOST_COPIES)
    assert (found.count, found.to_host, found.overlapped, found.overlapping_matmuls) == (3, 1, 1, 0)
    assert found.bytes == 4096 * 1024 * 4 + 8 * 4 + 4
