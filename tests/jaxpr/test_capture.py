"""Capture: equations group into TaskGraphs by scope, forward and backward."""
import jax
import jax.numpy as jnp
import optax

import whalex as wh
from support.models import flax_model, plain_model
from whalex.jaxpr.capture import capture, scope_of


def test_taskgraphs_from_scopes_and_default_runs():
    loss_fn, params, batch = plain_model("hybrid", "ctx")
    cap = capture(loss_fn, params, batch)
    assert [t.strategy.label() for t in cap.taskgraphs] == ["replicate(8)", "split(8)"]
    assert all(t.annotated for t in cap.taskgraphs)
    names = [cap.param_paths[i] for i in cap.taskgraphs[1].params]
    assert names == ["['bh']", "['wh']"]


def test_unannotated_runs_take_the_default_strategy():
    loss_fn, params, batch = plain_model("default", "ctx")
    cap = capture(loss_fn, params, batch)
    assert cap.default == wh.Strategy("replicate", 8)
    default = [t for t in cap.taskgraphs if not t.annotated]
    assert default and all(t.strategy == wh.Strategy("replicate", 8) for t in default)


def test_backward_equations_keep_their_taskgraph():
    """Scope names survive autodiff (docs/architecture.md#jax-and-xla-facts-the-code-relies-on):
    backward matmuls map to the same scopes."""
    loss_fn, params, batch = flax_model("hybrid", "class")
    grad_jaxpr = jax.make_jaxpr(jax.grad(loss_fn))(params, batch).jaxpr
    dots = [e for e in grad_jaxpr.eqns if e.primitive.name == "dot_general"]
    kinds = [(scope_of(e)[0].kind if scope_of(e) else None, "transpose" in str(e.source_info.name_stack))
             for e in dots]
    # 3 forward matmuls (2 backbone, 1 head) and their backward matmuls, each in its scope
    assert kinds.count(("split", False)) == 1 and kinds.count(("split", True)) == 2
    assert kinds.count(("replicate", False)) == 2 and kinds.count(("replicate", True)) >= 3
    assert None not in [k for k, _ in kinds]


def test_plan_reports_flops_and_xla_memory():
    loss_fn, params, batch = plain_model("hybrid", "ctx")
    plan = wh.plan(loss_fn, params, batch, optax.adam(1e-3))
    backbone, head = plan.task_graphs
    # forward+backward FLOPs from XLA: the head matmul (32x24 @ 24x320) costs 3 matmuls' worth at least
    assert head.flops >= 3 * 2 * 32 * 24 * 320
    mem = plan.compiled_memory()
    assert mem["argument_size_in_bytes"] > 0
    text = plan.summary()
    assert "XLA memory analysis per device" in text and "SP1 column" in text
    # the planned state per device: the head's params and Adam moments are 1/8 on each device
    full = sum(x.size * 4 for x in jax.tree.leaves(params))
    head_bytes = (24 * 320 + 320) * 4
    assert abs(plan.memory[0].params - (full - head_bytes + head_bytes / 8)) < 1
    assert abs(plan.memory[0].opt_state - 2 * plan.memory[0].params) < 64


def test_scan_flops_are_counted_per_iteration():
    """XLA's cost analysis counts a loop body once; the plan counts it `length` times."""
    from whalex.balance.profile import taskgraph_flops

    def unrolled_or_scanned(scan):
        def loss_fn(p, b):
            def body(c, _):
                return jnp.tanh(c @ p["w"]), None
            if scan:
                h, _ = jax.lax.scan(body, b["x"], None, length=10)
            else:
                h = b["x"]
                for _ in range(10):
                    h, _ = body(h, None)
            return jnp.mean(h ** 2)
        return loss_fn

    params = {"w": jnp.ones((64, 64)) / 64}
    batch = {"x": jnp.ones((32, 64))}
    flops = {}
    for scan in (True, False):
        cap = capture(unrolled_or_scanned(scan), params, batch)
        flops[scan] = sum(taskgraph_flops(cap.jaxpr, cap.assign, len(cap.taskgraphs)))
    assert abs(flops[True] / flops[False] - 1) < 0.15, flops
