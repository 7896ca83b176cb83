"""`plan.memory_fit()` on a GPU topology judges fitting on XLA:GPU's compiled step: the plan as it is
compiled once, and each option's saving from the model applied to XLA's figure. XLA:GPU fits a step
to the device's memory with its own rematerialization where it can, which the model cannot see."""

import optax

import whalex as wh
from support.gpu_bench import gpu_compile


def _fit(rows_per_device):
    size = dict(gpu_compile.SIZES["medium"], batch=rows_per_device)
    cluster = wh.Cluster.gpu_topology(kinds=["T4-16GB"] * 8)
    loss_fn, params, batch = gpu_compile.problem(size, 8, {})
    plan = wh.plan(loss_fn, params, batch, optax.adamw(1e-4), cluster=cluster)
    mf = plan.memory_fit()
    assert mf.compiled == plan.step_memory().total
    for step in mf.ladder:           # every rung: the model's saving applied to XLA's figure
        assert step.fits == (step.footprint.device_total + mf.offset <= mf.capacity)
    assert "judged on XLA's compiled step" in mf.verdict()
    return mf


def test_a_step_xla_fits_with_its_own_remat_fits():
    mf = _fit(128)                   # 128 x 512 tokens per device on a 16 GB T4
    assert mf.plain.device_total > mf.capacity         # the model alone says it does not fit
    assert mf.fits and mf.needs == () and mf.compiled <= mf.capacity


def test_a_step_that_does_not_fit_names_what_would():
    mf = _fit(256)
    assert mf.compiled > mf.capacity and not mf.fits
    assert mf.needs, mf.verdict()                      # the options, judged on XLA's figure
    assert mf.verdict().startswith("fits with " + " + ".join(mf.needs))
