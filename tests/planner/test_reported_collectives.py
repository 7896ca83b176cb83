"""The Plan by reader: `plan.storage`, `plan.functions` and `plan.report` are the program's parts, and
the collectives a plan predicts are those its program reports (the GSPMD program's patterns over its
micro-batch loop and ZeRO, a pipeline's stage rows, replica sync and messages), not derived again
by the planner."""
import jax
import jax.numpy as jnp
import optax

import whalex as wh
from support.models import flax_model


def _two_stage(p, b):
    with wh.replicate(1):
        h = jnp.tanh(b["x"] @ p["w1"])
    with wh.replicate(1):
        return jnp.mean((h @ p["w2"] - b["y"]) ** 2)


def _plain():
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k[0], (16, 32)) / 4, "w2": jax.random.normal(k[1], (32, 8)) / 6}
    batch = {"x": jax.random.normal(k[2], (64, 16)), "y": jax.random.normal(k[3], (64, 8))}
    return params, batch


def test_the_plan_hands_out_its_program_by_reader():
    loss_fn, params, batch = flax_model("hybrid", "ctx")
    plan = wh.plan(loss_fn, params, batch, optax.sgd(0.1), config=wh.Config(num_micro_batch=2, zero_level=1))
    assert plan.storage is plan.functions is plan.report is plan.program
    assert plan.report.collectives() and tuple(plan.comms) == plan.report.collectives()
    assert plan.couplings == plan.batch_couplings.value          # the loss contract's lines, found once


def test_a_pipeline_predicts_the_collectives_its_program_reports():
    params, batch = _plain()
    plan = wh.plan(_two_stage, params, batch, optax.adam(1e-3), config=wh.Config(num_micro_batch=4))
    assert plan.program_kind == "PipelineProgram"
    reported = plan.report.collectives()
    assert {c.kind for c in reported} >= {"all-gather", "all-to-all", "all-reduce", "collective-permute"}
    assert tuple(plan.comms) == reported
