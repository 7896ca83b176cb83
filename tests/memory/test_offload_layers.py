"""`offload="params"` per layer (ZeRO-Offload style). Parameters stay in pinned host
memory; each layer fetches its own for its forward pass and again for its backward pass, so no
device copy of a parameter is kept from one to the other, and training equals one device."""
import collections

import jax
import optax
import pytest

import whalex as wh
from architectures.test_stock_gpt import LAYERS, loss_fn, problem
from conftest import adam, assert_matches
from whalex import _compat as C


def _host_moves(jaxpr, where="step") -> collections.Counter:
    """Host-to-device moves of the traced step, by the primitive they sit in ('step': the top level,
    which after differentiation holds the forward pass and the update; 'remat2': a checkpoint's
    recomputation in the backward pass)."""
    out = collections.Counter()
    for e in jaxpr.eqns:
        if e.primitive.name == "device_put":
            out[where] += sum("host" in str(v.aval) for v in e.invars)
        for sub in C.sub_jaxprs(e):
            out += _host_moves(C.open_jaxpr(sub)[0], e.primitive.name)
    return out


@pytest.mark.parametrize("optimizer", [optax.sgd(0.5), adam()], ids=["sgd", "adam"])
def test_params_offloaded_per_layer_train_as_one_device(optimizer):
    params, batch = problem()
    step, state = assert_matches(loss_fn, params, batch, steps=3, optimizer=optimizer, tol=1e-4,
                                 config=wh.Config(offload="params"))
    assert step.plan.params_fetched_per_layer
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.stored_params)} == {"pinned_host"}
    assert "fetched per layer" in step.plan.summary()


@pytest.mark.parametrize("amp", [None, "bf16"])
def test_no_device_copy_of_a_parameter_is_kept_for_the_backward_pass(amp):
    """What JAX keeps for the backward pass: the host arrays (arguments), never a fetched copy nor a
    value computed from the fetched parameters alone (a bf16 cast of a kernel, a LayerNorm scale
    broadcast): the backward pass fetches each layer's weights again, inside its checkpoint's
    recomputation. Without offload those values are kept (the check below can fail)."""
    params, batch = problem()
    leaves = jax.tree.leaves(params)
    shapes = {tuple(x.shape) for x in leaves} | {(1, 1, d) for d in {x.shape[-1] for x in leaves}}

    def kept(offload):
        plan = wh.plan(loss_fn, params, batch, optax.sgd(0.1), config=wh.Config(offload=offload, amp=amp))
        loss = plan.program.loss()
        if offload is None:
            return plan, C.saved_residuals(lambda p, b: loss(p, (b, [], None))[0], params, batch)
        zeros = jax.tree.map(jax.numpy.zeros_like, params)
        return plan, C.saved_residuals(lambda d, h, b: loss(d, (b, [], h))[0], zeros, params, batch)

    def weights(saved):
        return [src for aval, src in saved if "argument" not in src and tuple(aval.shape) in shapes]

    assert weights(kept(None)[1])                            # without offload, weight-derived values are kept
    plan, saved = kept("params")
    fetched = [src for _, src in saved if any(f"output of {p}" in src for p in C.FETCH_PRIMITIVES)]
    assert not fetched, fetched
    assert not weights(saved), weights(saved)
    assert any("from the argument h" in src for _, src in saved)       # the host arrays are what is kept
    moves = _host_moves(C.open_jaxpr(plan.functions.traced_step().jaxpr)[0])
    leaves = len(jax.tree.leaves(params))
    read_back = sum(any(k in jax.tree_util.keystr(path) for k in ("kernel", "scale"))
                    for path, _ in jax.tree_util.tree_leaves_with_path(params))
    assert moves["step"] == 2 * leaves                   # each leaf: its layer's forward, the update
    assert moves["remat2"] == read_back                  # kernels and LayerNorm scales again for their layer's
    assert read_back >= 8 * LAYERS                       # backward (dx = dy W^T, dy * scale); a bias's or a table's
    assert plan.host_traffic()[0].to_device == pytest.approx(3 * plan.host_traffic()[0].to_host)   # does not read it


def test_layers_fetch_without_a_cse_barrier_on_what_they_keep():
    """Saving everything but the parameters, a layer's checkpoint adds no optimization barrier: on a
    GPU one would make XLA materialise each kept value it otherwise fuses into the backward pass
    (causal-mask broadcasts, zero tangents). The backward's fetches still stay apart from the
    forward's: lowered for a GPU, every move is a side-effecting placement XLA never merges."""
    params, batch = problem()
    plan = wh.plan(loss_fn, params, batch, optax.sgd(0.1), config=wh.Config(offload="params", amp="bf16"))
    p = plan.program
    text = p.jitted(donate=True).trace(*p.abstract_args()).lower(lowering_platforms=("cuda",)).as_text()
    moves = [line for line in text.splitlines() if "annotate_device_placement" in line]
    to_device = [line for line in moves if '_xla_buffer_placement = "device"' in line]
    assert all("has_side_effect = true" in line for line in moves)
    leaves = len(jax.tree.leaves(params))
    assert len(to_device) >= 2 * leaves + 8 * LAYERS            # forward, update, and again in the backward
    barriers = sum("optimization_barrier" in line for line in text.splitlines())
    assert barriers == leaves                                   # the update's gates (fetch_when_ready) alone


def test_params_offloaded_per_layer_under_remat_full():
    params, batch = problem()
    step, _ = assert_matches(loss_fn, params, batch, steps=2, optimizer=adam(), tol=1e-4,
                             config=wh.Config(offload="params", remat="full"))
    assert step.plan.params_fetched_per_layer


def test_micro_batches_fetch_the_whole_tree_and_say_so():
    params, batch = problem()
    plan = wh.plan(loss_fn, params, batch, optax.sgd(0.1), config=wh.Config(offload="params", num_micro_batch=2))
    assert not plan.params_fetched_per_layer and "fetched whole at the start of the step" in plan.summary()


def test_params_per_layer_with_zero_1_and_offloaded_optimizer_state():
    params, batch = problem()
    step, state = assert_matches(loss_fn, params, batch, steps=2, optimizer=adam(), tol=1e-4,
                                 config=wh.Config(zero_level=1, offload=("opt_state", "params")))
    assert step.plan.params_fetched_per_layer
    assert {x.sharding.memory_kind for x in jax.tree.leaves((state.stored_params, state.opt_state))
            if hasattr(x, "sharding") and x.ndim} == {"pinned_host"}
