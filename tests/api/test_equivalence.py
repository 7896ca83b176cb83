"""Every strategy trains to the same loss and parameters as single-device training."""
import jax
import numpy as np
import pytest

from conftest import assert_matches
from support.models import flax_model, plain_model

STRATEGIES = ["dp", "split", "hybrid", "default"]


@pytest.mark.parametrize("style", ["ctx", "fn", "class"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_flax_model_matches_single_device(strategy, style):
    loss_fn, params, batch = flax_model(strategy, style)
    step, _ = assert_matches(loss_fn, params, batch, steps=5)
    kinds = {t.strategy.split("(")[0] for t in step.plan.task_graphs if t.num_params}
    expected = {"dp": {"replicate"}, "split": {"split"}}.get(strategy, {"replicate", "split"})
    assert kinds == expected


@pytest.mark.parametrize("style", ["ctx", "fn"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_plain_model_matches_single_device(strategy, style):
    loss_fn, params, batch = plain_model(strategy, style)
    assert_matches(loss_fn, params, batch, steps=5)


@pytest.mark.parametrize("builder,style", [(flax_model, "ctx"), (flax_model, "fn"), (flax_model, "class"),
                                           (plain_model, "ctx"), (plain_model, "fn")])
def test_annotated_model_runs_without_whalex(builder, style):
    """Outside whalex the primitives only mark scopes: plain jax.jit gives the un-annotated result."""
    loss_fn, params, batch = builder("hybrid", style)
    plain_fn, _, _ = builder("dp", style)       # same maths, other annotations
    a = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    b = jax.jit(jax.value_and_grad(plain_fn))(params, batch)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-6)
    # and the scope names really are in the trace
    text = str(jax.make_jaxpr(loss_fn)(params, batch).jaxpr.eqns[-1].source_info.name_stack)
    assert "whalex.split.8" in text
