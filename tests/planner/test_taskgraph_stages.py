"""Whale's Figure 5 (section 3.2.1). Two consecutive TaskGraphs, `replicate(2)` then
`split(2)`, with 4 micro-batches on 8 devices, are two pipeline stages on disjoint devices (2 per stage
and replica: the replicate stage's 2 devices each take half of a micro-batch, the split stage's shard
the class head), with nested data parallelism 2 around the pipeline; training equals one device.
`Config(share_devices=True)` collocates the same TaskGraphs instead (gradient accumulation), and the
summary says which plan it is and why."""
import jax
import jax.numpy as jnp
import optax
import pytest

import whalex as wh
from conftest import adam, assert_matches

B, T, D, H, C = 32, 3, 12, 16, 10


def figure5_problem(seed=0):
    k = jax.random.split(jax.random.key(seed), 7)
    params = {"w1": jax.random.normal(k[0], (D, H)) / 3, "b1": jax.random.normal(k[1], (H,)) / 2,
              "w2": jax.random.normal(k[2], (H, C)) / 4, "b2": jax.random.normal(k[3], (C,)) / 2}
    weights = (jax.random.uniform(k[6], (B, T)) < 0.7).astype(jnp.float32).at[3].set(0.0)   # row 3: all padding
    batch = {"x": jax.random.normal(k[4], (B, T, D)), "y": jax.random.randint(k[5], (B, T), 0, C), "w": weights}
    return params, batch


def figure5_loss(p, b):
    """Token-weighted cross-entropy: the mean over the tokens whose weight is 1, over the whole batch."""
    with wh.replicate(2):
        h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    with wh.split(2):
        logp = jax.nn.log_softmax(h @ p["w2"] + p["b2"])
        nll = -jnp.take_along_axis(logp, b["y"][..., None], axis=-1)[..., 0]
        return jnp.sum(nll * b["w"]) / jnp.sum(b["w"])


FIGURE5 = wh.Config(num_micro_batch=4)
PIPELINE_LINE = ("plan: pipeline of 2 stages on disjoint devices (2 per stage and replica), nested DP 2: "
                 "num_micro_batch=4 with 2 consecutive annotated TaskGraphs of 2 devices each "
                 "(Config(share_devices=True) would collocate them)")


def test_figure5_plans_two_stages_on_disjoint_devices_with_nested_dp_2():
    params, batch = figure5_problem()
    plan = wh.plan(figure5_loss, params, batch, optax.sgd(0.1), config=FIGURE5)
    assert plan.program_kind == "PipelineProgram"
    assert plan.layout.axis_names == ("data", "stage", "model") and plan.layout.axis_sizes == (2, 2, 2)
    stage0, stage1 = plan.virtual_devices
    for vd, kind in ((stage0, "replicate"), (stage1, "split")):
        assert vd.strategy.kind == kind and vd.strategy.device_count == 2
        assert vd.nested_dp == 2 and all(len(g) == 2 for g in vd.groups)      # 2 devices per replica, 2 replicas
    devices0 = {d for g in stage0.groups for d in g}
    devices1 = {d for g in stage1.groups for d in g}
    assert len(devices0) == len(devices1) == 4 and not devices0 & devices1 and devices0 | devices1 == set(range(8))
    # the replicate stage splits its micro-batch over its 2 devices; the split stage shards the head's classes
    assert stage0.batch_axes == ("data", "model") and stage0.model_axes == ()
    assert stage1.batch_axes == ("data",) and stage1.model_axes == ("model",)
    assert [t.strategy for t in plan.task_graphs] == ["stage 0: replicate(2)", "stage 1: split(2)"]
    assert [(t.device_count, t.nested_dp) for t in plan.task_graphs] == [(2, 2), (2, 2)]
    assert {c.param: c.pattern for c in plan.patterns} == {"['w2']": "SP1 column"}
    assert PIPELINE_LINE in plan.summary().splitlines()


def test_figure5_replicate_stage_runs_half_a_micro_batch_per_device():
    """The compiled step: stage 0's forward matmul reads 1/2 of a micro-batch (8 / 2 rows x 3 tokens)."""
    params, batch = figure5_problem()
    plan = wh.plan(figure5_loss, params, batch, optax.sgd(0.1), config=FIGURE5)
    micro = B // (2 * 4)
    dots = [line for line in plan.lowered().compile().as_text().splitlines() if " dot(" in line]
    assert any(f"f32[{micro // 2 * T},{H}]" in line for line in dots), dots
    assert not any(f"f32[{micro * T},{H}]" in line and "lhs_contracting_dims={2}" in line for line in dots)


@pytest.mark.parametrize("opt,schedule", [("sgd", "1f1b"), ("adam", "1f1b"), ("adam", "gpipe")])
def test_figure5_trains_as_one_device(opt, schedule):
    params, batch = figure5_problem()
    optimizer = optax.sgd(0.5) if opt == "sgd" else adam()
    step, _ = assert_matches(figure5_loss, params, batch, steps=3, optimizer=optimizer, param_tol=1e-4,
                             config=FIGURE5.replace(schedule=schedule))
    assert step.plan.layout.axis_sizes == (2, 2, 2) and step.plan.schedule.name == schedule


def test_share_devices_collocates_figure5_with_gradient_accumulation():
    params, batch = figure5_problem()
    for config in (wh.Config(num_micro_batch=4, share_devices=True),
                   wh.Config({"pipeline.num_micro_batch": 4, "cluster.colocate_split_and_replicate": True})):
        plan = wh.plan(figure5_loss, params, batch, optax.sgd(0.1), config=config)
        assert plan.program_kind == "Program" and plan.schedule is None
        assert plan.layout.axis_names == ("data", "model") and plan.layout.axis_sizes == (4, 2)
        assert ("plan: collocated TaskGraphs, gradient accumulation over 4 micro-batches: "
                "Config(share_devices=True) puts the 2 annotated TaskGraphs on the same devices") in plan.summary()
    assert_matches(figure5_loss, params, batch, steps=3, optimizer=optax.sgd(0.5), config=config)


def test_taskgraphs_asking_for_more_than_the_cluster_share_devices_and_say_why():
    """Whale's Example 2 (replicate and split over every device) with micro-batches: 2 x 8 devices do not
    fit 8, so the TaskGraphs share devices and the summary names the rule."""
    params, batch = figure5_problem()

    def example2(p, b):
        with wh.replicate(8):
            h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
        with wh.split(8):
            logits = h @ p["w2"][:, :8]
            return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[..., 0])

    plan = wh.plan(example2, params, batch, optax.sgd(0.1), config=wh.Config(num_micro_batch=4))
    assert plan.program_kind == "Program" and plan.layout.axis_sizes == (1, 8)
    assert ("gradient accumulation over 4 micro-batches: 2 annotated TaskGraphs x 8 devices need 16 devices, "
            "more than the cluster's 8") in plan.summary()


def test_stage_rules_are_named_errors():
    params, batch = figure5_problem()

    def uneven(p, b):
        with wh.replicate(2):
            h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
        with wh.split(4):
            return jnp.mean(h @ p["w2"][:, :8])

    with pytest.raises(wh.PlanError, match=r"different device counts \[2, 4\].*share_devices=True"):
        wh.plan(uneven, params, batch, optax.sgd(0.1), config=FIGURE5)
    plan = wh.plan(uneven, params, batch, optax.sgd(0.1), config=FIGURE5.replace(share_devices=True))
    assert plan.layout.axis_sizes == (2, 4)
    small = {k: v[:8] for k, v in batch.items()}                # 8 samples: micro-batches of 1 on each replica
    with pytest.raises(wh.PlanError, match=r"micro-batch of 1 samples on a pipeline replica must divide over the "
                                           r"stage's devices"):
        wh.plan(figure5_loss, params, small, optax.sgd(0.1), config=FIGURE5)
    with pytest.raises(wh.ConfigError, match="share_devices=True collocates"):
        wh.Config(auto_parallel=True, num_task_graph=2, num_micro_batch=2, share_devices=True)
    with pytest.raises(wh.ConfigError, match="share_devices must be True or False"):
        wh.Config(share_devices="yes")
