"""remat="auto" on an XLA:GPU topology decides from XLA:GPU's compiled figure, not only the replay's:
bench/gpu_compile.py's medium GPT (8 x 512 tokens per device, adamw, bf16 compute) data parallel on
8 x H100 under a per-device budget. The replay counts residuals as JAX keeps them, more than XLA:GPU
holds, so it recomputes more than the budget needs; compiling shows the room and the choice relaxes."""

import optax
import pytest

import whalex as wh
from support.gpu_bench import gpu_compile

SIZE = gpu_compile.SIZES["medium"]


def _plan(cluster, budget):
    loss_fn, params, batch = gpu_compile.problem(SIZE, 8, {})
    return wh.plan(loss_fn, params, batch, optax.adamw(1e-4), cluster=cluster,
                   config=wh.Config(remat="auto", amp="bf16", memory_budget=budget))


def test_remat_auto_is_decided_from_the_compiled_step():
    """On an abstract cluster too: where JAX's CUDA plugin is installed it plans on its XLA:GPU twin."""
    budget = 1.05e9
    plan = _plan(wh.Cluster.abstract(kinds=["H100-80GB"] * 8), budget)
    assert plan.cluster.compile_only
    remat = plan.report.remat
    assert remat.compiled is not None and remat.compiled <= budget and remat.compiles >= 2
    assert plan.step_memory().total == pytest.approx(remat.compiled)     # what it was decided on
    replay_only = _plan(wh.Cluster.abstract(kinds=["H100-80GB"] * 8, compiler="replay"), budget).report.remat
    assert replay_only.compiled is None
    assert remat.flops < replay_only.flops            # it recomputes less than the replay alone chose
    assert "decided from XLA's compiled step" in plan.summary()


def test_a_budget_xla_cannot_meet_is_refused_with_its_figures():
    with pytest.raises(wh.PlanError, match="as XLA compiles it for H100-80GB"):
        _plan(wh.Cluster.gpu_topology(kinds=["H100-80GB"] * 8), 0.45e9)
